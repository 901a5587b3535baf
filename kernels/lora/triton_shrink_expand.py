"""Triton kernels for batched LoRA (semantics: `lora_*_reference` in kernels/lora/dispatch.py).

One program per (block of BLOCK_T consecutive tokens, block of output columns[, slice of
K]). A prefill request's tokens are contiguous in the flattened batch, so a block's tokens
mostly share one slot: the program walks the distinct slots of its block, smallest first
(none for a block of base tokens, slot -1), and for each runs a `tl.dot` of that slot's
rows (the others masked to zero) against that adapter's tile, on tensor cores with an fp32
accumulator. A decode block that mixes k adapters costs k passes, each reading only its
own tokens' rows.

A layer's linear costs two launches: the shrink writes one fp32 partial of s per slice of
K, and the expand adds the slices up as it loads them (in slice order) and serves every
part of a fused linear at once: its B tile spans all parts' ranks side by side, each
column reading only its own part's ranks (the rest masked to zero, so never fetched).

Only shapes and strides are read on the host, and the tile sizes depend on shapes alone:
no sync, so the launches can be captured in a CUDA graph whose slots change at every
replay. Offsets are int64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

NO_SLOT: tl.constexpr = tl.constexpr(2**31 - 1)  # above every slot: the walk is over
MAX_NUM_PARTS = 3  # q, k, v: the part of a column is found from two boundaries


@triton.jit
def _next_slot(slots, after):
    # slots: [BLOCK_T] int32 (-1: base); the smallest slot above `after`, or NO_SLOT
    return tl.min(tl.where(slots > after, slots, NO_SLOT), axis=0)


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, s_ptr, slot_ptr,
    T, N, K, K_PER_SPLIT,
    x_stride_t, a_stride_l, a_stride_n, s_stride_split, s_stride_t,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # s[split, t, n] = sum over this split's k of x[t, k] * a[slot[t], n, k]
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = tl.program_id(2) * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    slots = tl.load(slot_ptr + offs_t, mask=offs_t < T, other=-1).to(tl.int32)
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    slot = _next_slot(slots, -1)
    while slot < NO_SLOT:
        rows = slots == slot
        a_base = a_ptr + slot.to(tl.int64) * a_stride_l
        for k0 in range(k_begin, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_end
            x = tl.load(x_ptr + offs_t[:, None] * x_stride_t + offs_k[None, :],
                        mask=rows[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_T, BLOCK_K]
            a_t = tl.load(a_base + offs_k[:, None] + offs_n[None, :] * a_stride_n,
                          mask=mask_k[:, None] & (offs_n[None, :] < N), other=0.0)  # [BLOCK_K, BLOCK_N]
            acc = tl.dot(x.to(a_t.dtype), a_t, acc, input_precision=DOT_PRECISION)
        slot = _next_slot(slots, slot)
    s_ptrs = s_ptr + tl.program_id(2) * s_stride_split + offs_t[:, None] * s_stride_t + offs_n[None, :]
    tl.store(s_ptrs, acc, mask=(offs_t[:, None] < T) & (offs_n[None, :] < N))


@triton.jit
def _expand_kernel(
    y_ptr, s_ptr, b_ptr, slot_ptr,
    T, M, part1_start, part2_start,
    y_stride_t, s_stride_split, s_stride_t, s_stride_r, b_stride_l, b_stride_m,
    NUM_SPLITS: tl.constexpr, NUM_PARTS: tl.constexpr, RANK: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # y[t, m] += sum over r of s[t, p*RANK + r] * b[slot[t], m, r] for the tokens with a
    # slot, where s = the sum of the shrink's splits and p = the part that column m is in
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_j = tl.arange(0, BLOCK_J)  # every part's ranks, side by side
    mask_m = offs_m < M
    mask_j = offs_j < NUM_PARTS * RANK
    slots = tl.load(slot_ptr + offs_t, mask=offs_t < T, other=-1).to(tl.int32)
    adapted = slots >= 0  # base tokens: neither s nor y is read
    s = tl.zeros([BLOCK_T, BLOCK_J], dtype=tl.float32)
    s_ptrs = s_ptr + offs_t[:, None] * s_stride_t + offs_j[None, :] * s_stride_r
    for split in tl.static_range(NUM_SPLITS):  # unrolled: the loads overlap, the adds keep their order
        s += tl.load(s_ptrs + split * s_stride_split, mask=adapted[:, None] & mask_j[None, :], other=0.0)
    # b_t[j, m] = b[slot, m, j % RANK] where j's part is m's part, else 0: block diagonal
    part_m = (offs_m >= part1_start).to(tl.int32) + (offs_m >= part2_start).to(tl.int32)
    b_offs = (offs_j % RANK)[:, None] + offs_m[None, :] * b_stride_m
    b_mask = ((offs_j // RANK)[:, None] == part_m[None, :]) & mask_j[:, None] & mask_m[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_M], dtype=tl.float32)
    slot = _next_slot(slots, -1)
    while slot < NO_SLOT:
        b_t = tl.load(b_ptr + slot.to(tl.int64) * b_stride_l + b_offs, mask=b_mask, other=0.0)  # [BLOCK_J, BLOCK_M]
        # s is rounded to the weights' dtype first, as PEFT's lora_B(lora_A(x)) does.
        rows_s = tl.where((slots == slot)[:, None], s, 0.0).to(b_t.dtype)
        acc = tl.dot(rows_s, b_t, acc, input_precision=DOT_PRECISION)
        slot = _next_slot(slots, slot)
    mask = adapted[:, None] & mask_m[None, :]
    y_ptrs = y_ptr + offs_t[:, None] * y_stride_t + offs_m[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


@dataclass(frozen=True, slots=True)
class ShrinkTiles:
    block_t: int
    block_k: int
    k_per_split: int  # a multiple of block_k; one program (and one partial of s) per slice of K


def token_block(num_tokens: int) -> int:
    """Tokens per program: small for a decode batch (more programs), 64 for a prefill chunk."""
    return 16 if num_tokens <= 64 else 64


def shrink_tiles(num_tokens: int, k: int) -> ShrinkTiles:
    """Tile sizes from shapes alone (graph-safe). The K split depends on K only, so a
    token's sum runs in the same order whatever the batch around it."""
    return ShrinkTiles(block_t=token_block(num_tokens), block_k=128, k_per_split=min(256, triton.cdiv(k, 128) * 128))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 keeps full precision (the fp32 GPU test compares graphs with eager); 16-bit inputs
    # ignore this and use the tensor cores.
    return "ieee" if dtype == torch.float32 else "tf32"


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, tiles: ShrinkTiles | None = None
) -> torch.Tensor:
    # x: [T, K], a: [L, N, K], slots: [T] -> [S, T, N] fp32, one partial per slice of K
    num_tokens, k = x.shape
    n = a.shape[1]
    assert x.stride(1) == 1 and a.stride(2) == 1, "x and a need contiguous rows"
    tiles = tiles or shrink_tiles(num_tokens, k)
    assert tiles.k_per_split % tiles.block_k == 0, tiles
    num_splits = triton.cdiv(k, tiles.k_per_split)
    parts = torch.empty(num_splits, num_tokens, n, dtype=torch.float32, device=x.device)  # [S, T, N]
    if num_tokens == 0:
        return parts
    block_n = max(16, min(triton.next_power_of_2(n), 64))
    grid = (triton.cdiv(num_tokens, tiles.block_t), triton.cdiv(n, block_n), num_splits)
    _shrink_kernel[grid](
        x, a, parts, slots, num_tokens, n, k, tiles.k_per_split,
        x.stride(0), a.stride(0), a.stride(1), parts.stride(0), parts.stride(1),
        BLOCK_T=tiles.block_t, BLOCK_N=block_n, BLOCK_K=tiles.block_k, DOT_PRECISION=_dot_precision(x.dtype),
    )
    return parts


def lora_expand_add(
    y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
    part_sizes: tuple[int, ...] | None = None, block_t: int | None = None,
) -> None:
    # y: [T, M] in place (column slice ok), s: [S, T, P*R] partials, b: [L, M, R], slots: [T];
    # part p (part_sizes[p] columns of y and b, in order; None: one part) reads s[..., p*R:(p+1)*R]
    num_tokens, m = y.shape
    r = b.shape[2]
    part_sizes = part_sizes or (m,)
    num_parts = len(part_sizes)
    assert 1 <= num_parts <= MAX_NUM_PARTS and sum(part_sizes) == m == b.shape[1], (part_sizes, y.shape, b.shape)
    assert s.shape[1:] == (num_tokens, num_parts * r), (s.shape, num_tokens, num_parts, r)
    assert y.stride(1) == 1 and b.stride(2) == 1, "y and b need contiguous rows"
    if num_tokens == 0:
        return
    starts = [sum(part_sizes[:p]) for p in range(1, num_parts)] + [m] * (MAX_NUM_PARTS - num_parts)
    block_t = block_t or token_block(num_tokens)
    block_j = max(16, triton.next_power_of_2(num_parts * r))
    block_m = max(16, min(128, 4096 // block_j))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(m, block_m))
    _expand_kernel[grid](
        y, s, b, slots, num_tokens, m, starts[0], starts[1],
        y.stride(0), s.stride(0), s.stride(1), s.stride(2), b.stride(0), b.stride(1),
        NUM_SPLITS=s.shape[0], NUM_PARTS=num_parts, RANK=r,
        BLOCK_T=block_t, BLOCK_M=block_m, BLOCK_J=block_j, DOT_PRECISION=_dot_precision(b.dtype),
    )
