"""The split kernel of paged decode attention (kernels/attention/triton_decode.py launches it):
one program per (sequence, KV head, split) keeps an fp32 online softmax over its split's
cached tokens, in tiles that may span KV blocks, and writes a partial (max, sum, acc) per
query head, or the normalised output when there is one split. With ROTARY it first rotates
q and the new k and attends over the new token itself (the first split caches it); with
EARLY_TILE it loads its first tile of cached K/V before the PDL wait. With SLIDING (a
layer's window of `window` tokens) the splits share out only the tiles from the one holding
the window's first token (seq_len - window), whose earlier tokens are masked. With SOFTCAP (a
layer's attn_logit_softcapping; 0 = none) every score, the new token's too, is soft-capped
before the mask and the softmax (kernels/attention/triton_softcap.py).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from vllm_cluster.kernels.attention.triton_rotary_kv import cos_sin_row, rotate_and_cache_new_kv, rotate_heads
from vllm_cluster.kernels.attention.triton_softcap import soft_cap_log2
from vllm_cluster.kernels.sync import pdl


@triton.jit
def _load_kv_tile(
    kv_head_ptr, table_ptr, tile_start, begin, end, dims, stride_kv_block, stride_kv_kv, stride_kv_token,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    SLIDING: tl.constexpr,
):  # fmt: skip
    """The K and V rows ([TILE_N, D] each, the cache's dtype) of tokens tile_start + [0,
    TILE_N) below `end` (and, if SLIDING, from `begin`), each found through the block table,
    and which tokens those are."""
    tokens = tile_start + tl.arange(0, TILE_N)
    token_ok = tokens < end
    if SLIDING:
        token_ok = token_ok & (tokens >= begin)
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
def _attend_tile(q, k, v, token_ok, max_i, sum_i, acc, qk_scale, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """One online-softmax step of the GROUP query heads over a tile holding at least one
    valid token; k and v are read in q's dtype. Returns the new (max, sum, acc)."""
    k = k.to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [G, N]
    if SOFTCAP > 0:
        scores = soft_cap_log2(scores, SOFTCAP)
    scores = tl.where(token_ok[None, :], scores, float("-inf"))
    max_new = tl.maximum(max_i, tl.max(scores, 1))  # finite: the tile has a valid token
    alpha = tl.exp2(max_i - max_new)
    p = tl.exp2(scores - max_new[:, None])
    sum_i = sum_i * alpha + tl.sum(p, 1)
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return max_new, sum_i, acc


@triton.jit
def _attend_new_token(q, k_new, v_new, max_i, sum_i, acc, qk_scale, SOFTCAP: tl.constexpr):
    """One more online-softmax step, for the new token ([1, D] k and v as the cache holds them:
    rounded to its dtype, or fp8), read in q's dtype as the tiles are."""
    k_row = k_new.to(q.dtype).to(tl.float32)
    scores = tl.sum(q.to(tl.float32) * k_row, 1) * qk_scale  # [G]
    if SOFTCAP > 0:
        scores = soft_cap_log2(scores, SOFTCAP)
    max_new = tl.maximum(max_i, scores)
    alpha = tl.exp2(max_i - max_new)
    p = tl.exp2(scores - max_new)
    v_row = v_new.to(q.dtype).to(tl.float32)
    acc = acc * alpha[:, None] + p.to(q.dtype).to(tl.float32)[:, None] * v_row
    return max_new, sum_i * alpha + p, acc


@triton.jit
def decode_split_kernel(
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
    window,  # SLIDING: the layer's window
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
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
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
    # The first visible token, and the tile-aligned start of the range the splits share.
    begin = 0
    range_start = 0
    if SLIDING:
        begin = tl.maximum(seq_len - window, 0)
        range_start = begin // TILE_N * TILE_N
    # Splits are whole tiles, so a tile never straddles two splits and, when a tile holds
    # whole KV blocks, a split is a contiguous range of KV blocks.
    split_len = tl.cdiv(tl.cdiv(seq_len - range_start, NUM_SPLITS), TILE_N) * TILE_N
    split_start = range_start + split * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)
    # ROTARY: the new token (position seq_len - 1) is not read from the cache, where the first
    # split is writing it, but taken from registers after the loop.
    cached_end = split_end
    if ROTARY:
        cached_end = tl.minimum(split_end, seq_len - 1)
    if SLIDING:  # a window of one token has no cached token to read: every tile must hold one
        cached_end = tl.where(begin < cached_end, cached_end, split_start)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    kv_head_ptr = kv_ptr + kv_head * stride_kv_head
    table_ptr = block_tables_ptr + seq * stride_table_seq
    if EARLY_TILE:
        k_first, v_first, ok_first = _load_kv_tile(
            kv_head_ptr, table_ptr, split_start, begin, cached_end, dims, stride_kv_block, stride_kv_kv,
            stride_kv_token, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, SLIDING,
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
                q, k_first, v_first, ok_first, max_i, sum_i, acc, qk_scale, DOT_PRECISION, SOFTCAP
            )
        loop_start = split_start + TILE_N
    for tile_start in range(loop_start, cached_end, TILE_N):
        k, v, token_ok = _load_kv_tile(
            kv_head_ptr, table_ptr, tile_start, begin, cached_end, dims, stride_kv_block, stride_kv_kv,
            stride_kv_token, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, SLIDING,
        )  # fmt: skip
        max_i, sum_i, acc = _attend_tile(q, k, v, token_ok, max_i, sum_i, acc, qk_scale, DOT_PRECISION, SOFTCAP)
    if ROTARY:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if (split_start <= seq_len - 1) & (seq_len - 1 < split_end):  # the split holding the new token
            max_i, sum_i, acc = _attend_new_token(q, k_new, v_new, max_i, sum_i, acc, qk_scale, SOFTCAP)
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
