"""Paged decode attention in Triton: flash-decoding over the paged KV cache, GQA-grouped.

Semantics are those of `kernels.reference.decode_attention`. Two launches:
  1. `_decode_split_kernel`, grid (B, num_kv_heads, num_splits): one program serves all the
     query heads of one KV head (each K/V tile is read once for the group) over one split, a
     contiguous range of the sequence's tokens, in tiles of TILE_N tokens that may span KV
     blocks (each token finds its block through the block table). It keeps an fp32 online
     softmax and writes a partial (max, sum, acc) per query head, or, when there is one
     split, the normalised output directly (and launch 2 is skipped).
  2. `combine_splits_kernel` (kernels/triton_decode_combine.py), grid (B, Hq): rescales the
     partials to a common max and sums.
On Hopper both start early and wait for the kernel before (PDL, kernels/pdl.py).

`rotary_decode_attention` (what the engine runs for a decode-only batch on CUDA) folds the
rotary + KV write launch of the new token into launch 1: every split rotates q and the new
k in registers, attends over the cached tokens (the new token's slot excluded) and then
over the new token itself, and the first split of each KV head stores the new k and v in
the cache (the rotary helpers live in kernels/triton_rotary_kv.py). One launch fewer per
layer: -56 us a batch-1 step for bf16, -69 for int8 on the H200 (docs/benchmarks.md). Its
splits also load their first tile of cached K/V before the PDL wait (EARLY_FIRST_TILE).

Launch shapes depend only on tensor shapes and `max_seq_len` (never on the values in
`seq_lens`), and nothing syncs with the host, so the call can be captured in a CUDA graph.
A split whose range is empty (a short sequence, a padding row) writes (-inf, 0, 0); a
sequence of length 0 gets zeros. An fp8 cache (kernels/fp8_kv.py) is upcast to q's dtype
(exact) as it is loaded; k_scale is folded into the softmax scale and v_scale into the
partial sums, both read from device memory (a CUDA graph replays them).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from vllm_cluster.kernels import pdl
from vllm_cluster.kernels.fp8_kv import is_fp8
from vllm_cluster.kernels.triton_decode_combine import combine_splits_kernel
from vllm_cluster.kernels.triton_rotary_kv import cos_sin_row, rotate_and_cache_new_kv, rotate_heads

_MIN_TOKENS_PER_SPLIT = 128  # below this a split's fixed cost (q load, partial write) shows
_MAX_NUM_SPLITS = 64  # bounds the combine kernel's [splits, head_dim] register tile
_PROGRAMS_PER_SM = 4  # resident programs per SM to hide HBM latency
# rotary_decode_attention: each split loads its first tile of cached K/V (and the sequence's
# length and block table entries) before waiting for the qkv projection (PDL), so those
# loads overlap the projection's tail. Safe there (and only there): the cached tokens, the
# lengths and the block tables are written by ordinary launches that finish before the
# PDL chain's first kernel starts (kernels/pdl.py), and the one slot this step writes (the
# new token's) is not among the tokens read. bf16 -77 us a batch-1 step, fp8 -60 on the
# H200 (docs/benchmarks.md).
EARLY_FIRST_TILE = True


def _tile_config(head_dim_pad: int, kv_fp8: bool, q_dtype: torch.dtype) -> tuple[int, int, bool]:
    """(TILE_N, num_stages, FP16_DOT). An fp8 cache moves half the bytes per tile, so it takes
    twice the tokens and one more stage to keep as many bytes in flight, and upcasts to fp16
    (one conversion instruction per two values, exact for e4m3) rather than bf16. Measured on
    the H200, batch 64 x 2k context (docs/benchmarks.md): fp8 121 us with these, 151 us with
    bf16 dots, 189 us with the bf16 cache's tiles; the bf16 cache 137 us (93% of copy).
    fp32 queries keep fp32 dots (the tests' precision)."""
    if kv_fp8:
        return (128 if head_dim_pad <= 128 else 64), 3, q_dtype != torch.float32
    return (64 if head_dim_pad <= 128 else 32), 2, False


_DEFAULT_NUM_SMS = 132  # H100/H200; used when q is not on a CUDA device


@triton.jit
def _load_kv_tile(
    kv_head_ptr, table_ptr, tile_start, end, dims, stride_kv_block, stride_kv_kv, stride_kv_token,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
):  # fmt: skip
    """The K and V rows ([TILE_N, D] each, the cache's dtype) of tokens tile_start + [0,
    TILE_N) below `end`, each found through the block table, and which tokens those are."""
    tokens = tile_start + tl.arange(0, TILE_N)
    token_ok = tokens < end
    block_ids = tl.load(table_ptr + tokens // BLOCK_SIZE, mask=token_ok, other=0)
    token_offs = block_ids.to(tl.int64) * stride_kv_block + (tokens % BLOCK_SIZE) * stride_kv_token
    k_ptrs = kv_head_ptr + token_offs[:, None] + dims[None, :]  # [N, D]
    if HEAD_DIM == HEAD_DIM_PAD:
        kv_mask = token_ok[:, None]
    else:
        kv_mask = token_ok[:, None] & (dims < HEAD_DIM)[None, :]
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    v = tl.load(k_ptrs + stride_kv_kv, mask=kv_mask, other=0.0)
    return k, v, token_ok


@triton.jit
def _attend_tile(q, k, v, token_ok, max_i, sum_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    """One online-softmax step of the GROUP query heads over a tile holding at least one
    valid token; k and v are read in q's dtype. Returns the new (max, sum, acc)."""
    k = k.to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [G, N]
    scores = tl.where(token_ok[None, :], scores, float("-inf"))
    max_new = tl.maximum(max_i, tl.max(scores, 1))  # finite: the tile has a valid token
    alpha = tl.exp2(max_i - max_new)
    p = tl.exp2(scores - max_new[:, None])
    sum_i = sum_i * alpha + tl.sum(p, 1)
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return max_new, sum_i, acc


@triton.jit
def _attend_new_token(q, k_new, v_new, max_i, sum_i, acc, qk_scale):
    """One more online-softmax step, for the new token ([1, D] k and v as the cache holds them:
    rounded to its dtype, or fp8), read in q's dtype as the tiles are."""
    k_row = k_new.to(q.dtype).to(tl.float32)
    scores = tl.sum(q.to(tl.float32) * k_row, 1) * qk_scale  # [G]
    max_new = tl.maximum(max_i, scores)
    alpha = tl.exp2(max_i - max_new)
    p = tl.exp2(scores - max_new)
    v_row = v_new.to(q.dtype).to(tl.float32)
    acc = acc * alpha[:, None] + p.to(q.dtype).to(tl.float32)[:, None] * v_row
    return max_new, sum_i * alpha + p, acc


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [B, Hq, D]
    kv_ptr,  # [num_blocks, 2, block_size, Hkv, D]
    block_tables_ptr,  # [B, max_num_blocks]
    seq_lens_ptr,  # [B]
    out_ptr,  # [B, Hq, D], written when NUM_SPLITS == 1
    part_max_ptr,  # [B, Hq, NUM_SPLITS] fp32, log2 domain
    part_sum_ptr,  # [B, Hq, NUM_SPLITS] fp32
    part_acc_ptr,  # [B, Hq, NUM_SPLITS, HEAD_DIM_PAD] fp32, unnormalised
    qk_scale,  # softmax scale * log2(e)
    k_scale_ptr,  # [1] fp32, read when KV_FP8
    v_scale_ptr,
    k_new_ptr,  # ROTARY: [B, Hkv, D] the new tokens' k, not yet rotated
    v_new_ptr,  # ROTARY: [B, Hkv, D]
    cos_ptr,  # ROTARY: [B, D / 2] fp32
    sin_ptr,
    slot_mapping_ptr,  # ROTARY: [B], the new tokens' cache slots (-1: not cached)
    stride_q_seq,
    stride_q_head,
    stride_k_seq,
    stride_k_head,
    stride_v_seq,
    stride_v_head,
    stride_cos_seq,
    stride_sin_seq,
    stride_out_seq,
    stride_out_head,
    stride_kv_block,
    stride_kv_kv,
    stride_kv_token,
    stride_kv_head,
    stride_table_seq,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP16_DOT: tl.constexpr,
    PDL: tl.constexpr,
    ROTARY: tl.constexpr,
    EARLY_TILE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if EARLY_TILE:  # the first tile's loads go out before the wait (see the module docstring)
        if PDL:
            gdc_launch_dependents()
    else:
        pdl.dependent_start(PDL)

    seq_len = tl.load(seq_lens_ptr + seq)
    # Splits are whole tiles, so a tile never straddles two splits and, when a tile holds
    # whole KV blocks, a split is a contiguous range of KV blocks.
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N) * TILE_N
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)
    # ROTARY: the new token (position seq_len - 1) is not read from the cache, where the first
    # split is writing it, but taken from registers after the loop.
    cached_end = split_end
    if ROTARY:
        cached_end = tl.minimum(split_end, seq_len - 1)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    kv_head_ptr = kv_ptr + kv_head * stride_kv_head
    table_ptr = block_tables_ptr + seq * stride_table_seq
    if EARLY_TILE:
        k_first, v_first, ok_first = _load_kv_tile(
            kv_head_ptr, table_ptr, split_start, cached_end, dims, stride_kv_block, stride_kv_kv, stride_kv_token,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N,
        )  # fmt: skip
        if PDL:
            gdc_wait()
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)

    q_ptrs = q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :]
    if ROTARY:
        # The new token: rotate q and k (in registers), and the first split caches k and v.
        cos, sin = cos_sin_row(cos_ptr + seq * stride_cos_seq, sin_ptr + seq * stride_sin_seq, dims, HEAD_DIM)
        k_new, v_new = rotate_and_cache_new_kv(
            k_new_ptr + seq * stride_k_seq + kv_head * stride_k_head,
            v_new_ptr + seq * stride_v_seq + kv_head * stride_v_head,
            cos, sin, slot_mapping_ptr + seq, kv_head_ptr, k_scale_ptr, v_scale_ptr,
            stride_kv_block, stride_kv_kv, stride_kv_token, dims, split == 0,
            HEAD_DIM, BLOCK_SIZE, KV_FP8,
        )  # fmt: skip
        q = rotate_heads(q_ptrs, dims[None, :], cos, sin, row_ok[:, None] & dim_ok[None, :], HEAD_DIM // 2)
    else:
        q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [G, D]
    if FP16_DOT:  # saturate rather than overflow fp16's range (q is bf16 or fp32 here)
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    max_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    sum_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    loop_start = split_start
    if EARLY_TILE:
        if split_start < cached_end:
            max_i, sum_i, acc = _attend_tile(
                q, k_first, v_first, ok_first, max_i, sum_i, acc, qk_scale, DOT_PRECISION
            )
        loop_start = split_start + TILE_N
    for tile_start in range(loop_start, cached_end, TILE_N):
        k, v, token_ok = _load_kv_tile(
            kv_head_ptr, table_ptr, tile_start, cached_end, dims, stride_kv_block, stride_kv_kv, stride_kv_token,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N,
        )  # fmt: skip
        max_i, sum_i, acc = _attend_tile(q, k, v, token_ok, max_i, sum_i, acc, qk_scale, DOT_PRECISION)
    if ROTARY:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if (split_start <= seq_len - 1) & (seq_len - 1 < split_end):  # the split holding the new token
            max_i, sum_i, acc = _attend_new_token(q, k_new, v_new, max_i, sum_i, acc, qk_scale)
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)

    if NUM_SPLITS == 1:
        out = acc / tl.where(sum_i > 0.0, sum_i, 1.0)[:, None]  # empty context -> zeros
        out_ptrs = out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :]
        out_mask = row_ok[:, None] & dim_ok[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = (seq * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split  # [G]
        tl.store(part_max_ptr + part, max_i, mask=row_ok)
        tl.store(part_sum_ptr + part, sum_i, mask=row_ok)
        acc_ptrs = part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :]
        tl.store(acc_ptrs, acc, mask=row_ok[:, None])


@dataclass(frozen=True, slots=True)
class NewTokens:
    """Each sequence's new token for `rotary_decode_attention`: k and v [B, Hkv, D] not yet
    rotated, cos / sin [B, D / 2] fp32, slot_mapping [B] (-1: not cached)."""

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch_size: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Enough splits that B * Hkv * splits fills the SMs a few programs deep, but none
    shorter than _MIN_TOKENS_PER_SPLIT tokens."""
    num_programs = max(1, batch_size * num_kv_heads)
    by_occupancy = round(_PROGRAMS_PER_SM * num_sms / num_programs)
    by_length = triton.cdiv(max(1, max_seq_len), _MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, _MAX_NUM_SPLITS))


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, Hq, D], one new token per sequence -> [B, Hq, D] in q's dtype.

    kv_cache: [num_blocks, 2, block_size, Hkv, D] contiguous, q's dtype or fp8 (then with
    k_scale, v_scale: [1] fp32); block_tables: [B, max_num_blocks] int32 (int64 works too);
    seq_lens: [B] (0 = padding row, zeros out). `max_seq_len` bounds the context lengths and
    only steers the automatic `num_splits`; for CUDA graphs pass the same value at capture
    and replay.
    """
    return _decode(q, kv_cache, block_tables, seq_lens, scale, num_splits, max_seq_len, k_scale, v_scale, None)


def rotary_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`kernels.rotary_write_kv_cache` of the new tokens, then `decode_attention`, with no
    launch between them: q [B, Hq, D], k and v [B, Hkv, D] (not rotated; views of the qkv
    projection do), cos / sin [B, D / 2] fp32, slot_mapping [B]: the slot of each sequence's
    new token, which is its position seq_lens[b] - 1 (-1 with seq_lens[b] = 0: a padding
    row). Every split rotates q and the new k in registers and attends over the cached
    tokens plus the new one; the first split of each KV head writes the new k and v into
    the cache, with the roundings of `rotary_write_kv_cache`. q, k and v are not modified.
    """
    num_tokens, _, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), (k.shape, v.shape, q.shape)
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "k and v need contiguous heads"
    assert head_dim % 2 == 0, f"head_dim {head_dim} must be even for rotate-half rotary"
    assert slot_mapping.shape == (num_tokens,) and seq_lens.shape == (num_tokens,), "one new token per sequence"
    cos = cos.reshape(num_tokens, head_dim // 2)
    sin = sin.reshape(num_tokens, head_dim // 2)
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1
    new = NewTokens(k, v, cos, sin, slot_mapping)
    return _decode(q, kv_cache, block_tables, seq_lens, scale, num_splits, max_seq_len, k_scale, v_scale, new)


def _new_partials(q: torch.Tensor, num_splits: int, head_dim_pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised split partials (max, sum, acc) for q [B, Hq, D]: fp32 [B, Hq, S], [B, Hq,
    S] and [B, Hq, S, head_dim_pad]. Every split writes its own, an empty one (-inf, 0, 0)."""
    part_max = q.new_empty((*q.shape[:2], num_splits), dtype=torch.float32)
    return part_max, torch.empty_like(part_max), q.new_empty((*part_max.shape, head_dim_pad), dtype=torch.float32)


def _decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None,
    max_seq_len: int | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    new: NewTokens | None,
) -> torch.Tensor:
    """Both launches; `new`: rotate and cache the new tokens first (`rotary_decode_attention`)."""
    batch_size, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, kv_head_dim = kv_cache.shape
    assert kv_head_dim == head_dim and num_heads % num_kv_heads == 0
    assert kv_cache.is_contiguous() and q.stride(-1) == 1
    assert block_tables.shape[0] == batch_size and seq_lens.shape == (batch_size,)
    kv_fp8 = is_fp8(kv_cache.dtype)
    assert kv_fp8 or kv_cache.dtype == q.dtype, f"kv_cache is {kv_cache.dtype}, q is {q.dtype}"
    assert not kv_fp8 or (k_scale is not None and v_scale is not None), "an fp8 cache needs k_scale and v_scale"
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(batch_size, num_kv_heads, max_seq_len, _num_sms(q.device))
    assert num_splits >= 1

    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    out = torch.empty_like(q)
    if num_splits == 1:
        part_max = part_sum = part_acc = out  # unused by the kernel
    else:
        part_max, part_sum, part_acc = _new_partials(q, num_splits, head_dim_pad)
    tile_n, num_stages, fp16_dot = _tile_config(head_dim_pad, kv_fp8, q.dtype)
    use_pdl = pdl.enabled(q)
    rotary = new if new is not None else NewTokens(q, q, q, q, seq_lens)  # any tensors: not read
    _decode_split_kernel[(batch_size, num_kv_heads, num_splits)](
        q, kv_cache, block_tables, seq_lens, out, part_max, part_sum, part_acc,
        scale * math.log2(math.e),
        k_scale if kv_fp8 else seq_lens, v_scale if kv_fp8 else seq_lens,  # any pointer: not read
        rotary.k, rotary.v, rotary.cos, rotary.sin, rotary.slot_mapping,
        q.stride(0), q.stride(1), rotary.k.stride(0), rotary.k.stride(1), rotary.v.stride(0), rotary.v.stride(1),
        rotary.cos.stride(0), rotary.sin.stride(0), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        NUM_SPLITS=num_splits,
        # fp32 callers want fp32 results, not TF32; 16-bit inputs ignore this.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        KV_FP8=kv_fp8,
        FP16_DOT=fp16_dot,
        PDL=use_pdl,
        ROTARY=new is not None,
        EARLY_TILE=new is not None and EARLY_FIRST_TILE,
        num_warps=4,
        num_stages=num_stages,
        launch_pdl=use_pdl,
    )  # fmt: skip
    if num_splits > 1:
        combine_splits_kernel[(batch_size, num_heads)](
            out, part_max, part_sum, part_acc, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            PDL=use_pdl,
            num_warps=4,
            launch_pdl=use_pdl,
        )  # fmt: skip
    return out
