"""Multi-head latent attention (MLA) decode over the paged latent cache, in Triton: the
absorbed form, where every query head attends over the same cache entries (one token's
[latent (R) | rotary key (P)]), the key being the whole entry and the value its latent.
The caller folds W_UK into the query beforehand and applies W_UV to the output
(engine/models/deepseek.py); kernels/attention/mla_torch.py is the definition this is
tested against.

1. `mla_decode_kernel`, grid (cdiv(H, BLOCK_H), B, num_splits): a block of BLOCK_H heads of
   one sequence walks its share of the context (split-K) in tiles of TILE_N tokens. Each
   tile of entries is read once for all BLOCK_H heads: scores [BLOCK_H, TILE_N] are
   q_latent @ latent^T + q_rope @ rope^T, two tensor-core dots, then an online softmax and
   acc [BLOCK_H, R] += p @ latent. The head blocks of one (sequence, split) are adjacent
   programs, so they read the same entries at about the same time and all but the first
   find them in L2: DRAM sees the context about once.
2. With more than one split, `mla_combine_kernel`, grid (B, H), merges the partials. Each
   split stores its output already normalised, in the output's dtype, with its running max
   and sum: partials of R values per head are large next to the context they summarise
   (2 * 4 * H * splits / L of its bytes in fp32), so they are kept small, and so are the
   splits (`choose_mla_splits`).

`write_latent_cache` stores the new tokens' entries (slot -1, a CUDA-graph padding row,
writes nothing). No host sync anywhere: a CUDA graph captures both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_cluster.kernels.attention.triton_decode import _num_sms

_PROGRAMS_PER_SM = 4  # resident programs per SM to hide HBM latency
_MAX_NUM_SPLITS = 32
# A split reads at least this many tokens per head of its sequence, so that its partial
# output (R values per head) stays within about 1/16 of the context bytes it summarises.
_MIN_SPLIT_TOKENS_PER_HEAD = 32


@triton.jit
def mla_decode_kernel(
    q_ptr,  # [B, H, R + P]
    cache_ptr,  # [num_blocks, 1, BLOCK_SIZE, 1, R + P]
    block_tables_ptr,  # [B, max_num_blocks]
    seq_lens_ptr,  # [B]
    out_ptr,  # [B, H, R]
    part_max_ptr,  # [B, H, NUM_SPLITS]
    part_sum_ptr,  # [B, H, NUM_SPLITS]
    part_out_ptr,  # [B, H, NUM_SPLITS, R]: each split's output, normalised
    scale_log2,
    num_heads,
    stride_q_seq,
    stride_q_head,
    stride_out_seq,
    stride_out_head,
    stride_cache_block,
    stride_cache_tok,
    stride_table,
    LATENT: tl.constexpr,  # R
    LATENT_PAD: tl.constexpr,
    ROPE: tl.constexpr,  # P
    ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    head_block = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    dims = tl.arange(0, LATENT_PAD)
    dim_ok = dims < LATENT
    rope_dims = tl.arange(0, ROPE_PAD)
    rope_ok = rope_dims < ROPE

    q_rows = q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head
    q_latent = tl.load(q_rows + dims[None, :], mask=head_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_H, R]
    q_rope = tl.load(q_rows + LATENT + rope_dims[None, :], mask=head_ok[:, None] & rope_ok[None, :], other=0.0)

    seq_len = tl.load(seq_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N) * TILE_N
    start = split * per_split
    end = tl.minimum(seq_len, start + per_split)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LATENT_PAD], tl.float32)
    offs = tl.arange(0, TILE_N)
    for tile in range(start, end, TILE_N):
        toks = tile + offs
        tok_ok = toks < end
        blocks = tl.load(block_tables_ptr + seq * stride_table + toks // BLOCK_SIZE, mask=tok_ok, other=0)
        rows = cache_ptr + blocks.to(tl.int64) * stride_cache_block + (toks % BLOCK_SIZE) * stride_cache_tok
        latent = tl.load(rows[:, None] + dims[None, :], mask=tok_ok[:, None] & dim_ok[None, :], other=0.0)
        rope = tl.load(rows[:, None] + LATENT + rope_dims[None, :], mask=tok_ok[:, None] & rope_ok[None, :], other=0.0)
        scores = tl.dot(q_latent, tl.trans(latent), input_precision=DOT_PRECISION)
        scores += tl.dot(q_rope, tl.trans(rope), input_precision=DOT_PRECISION)  # [BLOCK_H, TILE_N]
        scores = tl.where(tok_ok[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))  # finite: every tile holds a token of the split
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision=DOT_PRECISION)
        m = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
        out_ptrs = out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])
    else:
        part = (seq * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_H]
        tl.store(part_max_ptr + part, m, mask=head_ok)
        tl.store(part_sum_ptr + part, total, mask=head_ok)
        out = acc / tl.where(total > 0.0, total, 1.0)[:, None]  # an empty split: zeros, weight 0
        part_out = part_out_ptr + part[:, None] * LATENT + dims[None, :]
        tl.store(part_out, out.to(part_out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])


@triton.jit
def mla_combine_kernel(
    out_ptr,  # [B, H, R]
    part_max_ptr,  # [B, H, NUM_SPLITS]
    part_sum_ptr,  # [B, H, NUM_SPLITS]
    part_out_ptr,  # [B, H, NUM_SPLITS, R]
    stride_out_seq,
    stride_out_head,
    LATENT: tl.constexpr,
    LATENT_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, LATENT_PAD)
    dim_ok = dims < LATENT
    split_ok = splits < NUM_SPLITS
    part = (seq * tl.num_programs(1) + head) * NUM_SPLITS + splits  # [S]
    part_max = tl.load(part_max_ptr + part, mask=split_ok, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + part, mask=split_ok, other=0.0)
    global_max = tl.max(part_max, 0)
    global_max = tl.where(global_max > float("-inf"), global_max, 0.0)  # a padding row: all empty
    weight = part_sum * tl.exp2(part_max - global_max)  # [S]: each split's share of the softmax mass
    total = tl.sum(weight, 0)
    part_out = part_out_ptr + part[:, None] * LATENT + dims[None, :]
    parts = tl.load(part_out, mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    out = tl.sum(parts.to(tl.float32) * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    out_ptrs = out_ptr + seq * stride_out_seq + head * stride_out_head + dims
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def choose_mla_splits(batch_size: int, num_heads: int, num_head_blocks: int, max_seq_len: int, num_sms: int) -> int:
    """Enough splits that B * head blocks * splits fills the SMs a few programs deep, but none
    shorter than _MIN_SPLIT_TOKENS_PER_HEAD tokens per head (the partials' cost)."""
    by_occupancy = round(_PROGRAMS_PER_SM * num_sms / max(1, batch_size * num_head_blocks))
    by_length = triton.cdiv(max(1, max_seq_len), _MIN_SPLIT_TOKENS_PER_HEAD * num_heads)
    return max(1, min(by_occupancy, by_length, _MAX_NUM_SPLITS))


@triton.jit
def write_latent_kernel(
    entry_ptr, cache_ptr, slot_mapping_ptr, stride_entry, stride_cache_block, stride_cache_tok,
    WIDTH: tl.constexpr, WIDTH_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        dims = tl.arange(0, WIDTH_PAD)
        values = tl.load(entry_ptr + token * stride_entry + dims, mask=dims < WIDTH)
        dest = cache_ptr + (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_tok
        tl.store(dest + dims, values.to(cache_ptr.dtype.element_ty), mask=dims < WIDTH)


def write_latent_cache(entry: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """entry: [T, R + P] into the slots of slot_mapping [T]; slot -1 writes nothing."""
    num_tokens, width = entry.shape
    assert latent_cache.shape[-1] == width and latent_cache.is_contiguous() and entry.stride(1) == 1
    write_latent_kernel[(num_tokens,)](
        entry, latent_cache, slot_mapping, entry.stride(0), latent_cache.stride(0), latent_cache.stride(2),
        WIDTH=width, WIDTH_PAD=triton.next_power_of_2(width), BLOCK_SIZE=latent_cache.shape[2],
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class TileConfig:
    block_h: int  # heads per program (>= 16: the dots' smallest M)
    tile_n: int  # tokens per step of the walk over the context
    num_warps: int
    num_stages: int


def default_tile_config(num_heads: int) -> TileConfig:
    """The tiles `mla_decode_attention` uses unless told: the fastest of the sweep in
    benchmarks/bench_mla_decode.py on an H100 (docs/benchmarks.md). Up to 16 heads the kernel
    is bandwidth-bound and 16 heads per program do best; with many heads it is bound by its
    dots, and 64 heads per program with 8 warps read each cached token once for 64 heads
    (1.9x faster than 32 per program at 128 heads)."""
    if num_heads <= 16:
        return TileConfig(block_h=16, tile_n=32, num_warps=4, num_stages=2)
    if num_heads <= 32:
        return TileConfig(block_h=32, tile_n=32, num_warps=4, num_stages=2)
    return TileConfig(block_h=64, tile_n=32, num_warps=8, num_stages=2)


def mla_decode_attention(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    latent_dim: int,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    tiles: TileConfig | None = None,
) -> torch.Tensor:
    """q: [B, H, R + P] (W_UK folded in, the rotary part rotated), one new token per sequence
    -> [B, H, R] in q's dtype. latent_cache: [num_blocks, 1, block_size, 1, R + P],
    contiguous, q's dtype; seq_lens [B] (0: a padding row, zeros out). `max_seq_len` only
    steers the automatic `num_splits`: pass the same value at CUDA-graph capture and replay."""
    batch_size, num_heads, width = q.shape
    _, planes, block_size, kv_heads, cache_width = latent_cache.shape
    assert planes == 1 and kv_heads == 1 and cache_width == width, (latent_cache.shape, q.shape)
    latent_pad = max(16, triton.next_power_of_2(latent_dim))
    assert latent_cache.is_contiguous() and q.stride(-1) == 1 and latent_cache.dtype == q.dtype
    rope_dim = width - latent_dim
    tiles = tiles or default_tile_config(num_heads)
    block_h = min(tiles.block_h, max(16, triton.next_power_of_2(num_heads)))
    num_head_blocks = triton.cdiv(num_heads, block_h)
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_mla_splits(batch_size, num_heads, num_head_blocks, max_seq_len, _num_sms(q.device))
    out = q.new_empty(batch_size, num_heads, latent_dim)
    if num_splits == 1:
        part_max = part_sum = part_out = out  # not read
    else:
        part_max = torch.empty(batch_size, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
        part_out = q.new_empty(batch_size, num_heads, num_splits, latent_dim)
    mla_decode_kernel[(num_head_blocks, batch_size, num_splits)](
        q, latent_cache, block_tables, seq_lens, out, part_max, part_sum, part_out,
        scale * math.log2(math.e), num_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        latent_cache.stride(0), latent_cache.stride(2), block_tables.stride(0),
        LATENT=latent_dim, LATENT_PAD=latent_pad, ROPE=rope_dim, ROPE_PAD=max(16, triton.next_power_of_2(rope_dim)),
        BLOCK_SIZE=block_size, BLOCK_H=block_h, TILE_N=tiles.tile_n, NUM_SPLITS=num_splits,
        # fp32 callers want fp32 results, not TF32; 16-bit inputs ignore this.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        mla_combine_kernel[(batch_size, num_heads)](
            out, part_max, part_sum, part_out, out.stride(0), out.stride(1),
            LATENT=latent_dim, LATENT_PAD=latent_pad, NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=4,
        )  # fmt: skip
    return out
