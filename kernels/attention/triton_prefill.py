"""Triton flash attention for prefill and chunked prefill over the paged KV cache.

Same contract as `kernels.attention.reference.prefill_attention`: sequence b owns the query rows
query_start_loc[b]:query_start_loc[b+1], the last q_len tokens of a context of seq_lens[b]
tokens whose K/V (cached prefix and new tokens alike) are already in the cache.

One program per (query tile, sequence, KV head). A tile's BLOCK_M rows are TILE_Q tokens times
the QUERIES_PER_KV q heads that share the KV head, so each K/V tile is read once for the whole
group (on an H200 this is about a third faster than one program per q head at Hq/Hkv = 4).
The program walks the context in tiles of BLOCK_N tokens, mapping each token to its cache
block through the block table, with an online softmax in fp32: first the tiles every row of
the query tile may see (no mask), then the tiles across the causal diagonal (masked), and
nothing past it. An fp8 cache (kernels/attention/fp8_kv.py) is upcast to q's dtype (exact) as each tile
is loaded; k_scale is folded into the softmax scale and v_scale into the output, both read
from device memory.

With a sliding window W (SLIDING, a layer's window; `window` holds W) the row at position p
sees the keys p - W < k <= p: the walk starts at the tile holding the tile's lowest visible
key, the tiles below the window's edge for some row are masked as the diagonal's are, and
whole tiles outside every row's window are never read.

With SOFTCAP (a layer's attn_logit_softcapping; 0 = none) each score is soft-capped before
the mask and the softmax (kernels/attention/triton_softcap.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_cluster.kernels.attention.fp8_kv import is_fp8
from vllm_cluster.kernels.attention.triton_softcap import soft_cap_log2

_LOG2_E = 1.4426950408889634


@dataclass(frozen=True, slots=True)
class PrefillTileConfig:
    block_m: int  # query rows per program: block_m // queries_per_kv tokens x the group's heads
    block_n: int  # context tokens per inner step
    num_warps: int
    num_stages: int


def default_tile_config(
    head_dim: int, dtype: torch.dtype, max_query_len: int, queries_per_kv: int
) -> PrefillTileConfig:
    """Tiles measured on an H200 (bf16, D=128, block 16); mixed batches of short chunks get
    a query tile no taller than their rows."""
    min_block_m = triton.next_power_of_2(queries_per_kv)  # at least one token per tile
    rows = triton.next_power_of_2(max(1, max_query_len) * queries_per_kv)
    block_m = max(min_block_m, min(rows, 64 if dtype == torch.float32 else 128), 16)
    if dtype == torch.float32:
        return PrefillTileConfig(block_m, 32, num_warps=4, num_stages=2)
    if block_m >= 128:
        return PrefillTileConfig(block_m, 32, num_warps=8, num_stages=2)
    return PrefillTileConfig(block_m, 64, num_warps=4, num_stages=3)


@triton.jit
def _load_tile(ptrs, row_valid, offs_d, HEAD_DIM: tl.constexpr, MASK_ROWS: tl.constexpr,
               MASK_D: tl.constexpr):
    """ptrs: [R, BLOCK_D]; rows where row_valid is False and columns past HEAD_DIM read 0."""
    if MASK_D:
        d_valid = offs_d < HEAD_DIM
        if MASK_ROWS:
            return tl.load(ptrs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)
        return tl.load(ptrs, mask=d_valid[None, :], other=0.0)
    if MASK_ROWS:
        return tl.load(ptrs, mask=row_valid[:, None], other=0.0)
    return tl.load(ptrs)


@triton.jit
def _kv_token_offsets(block_table_ptr, start, tokens, token_valid, stride_kv_block, stride_kv_tok,
                      CACHE_BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """tokens: [BLOCK_N] context positions -> [BLOCK_N] int64 offsets of their rows in the cache."""
    if CACHE_BLOCK_SIZE >= BLOCK_N:
        # start is a multiple of BLOCK_N, so the whole tile sits in one cache block.
        block_ids = tl.load(block_table_ptr + start // CACHE_BLOCK_SIZE).to(tl.int64)
    else:
        if MASKED:
            # Past seq_len the table may end: read block 0, the loads are masked anyway.
            block_ids = tl.load(block_table_ptr + tokens // CACHE_BLOCK_SIZE, mask=token_valid,
                                other=0)
        else:
            block_ids = tl.load(block_table_ptr + tokens // CACHE_BLOCK_SIZE)
        block_ids = block_ids.to(tl.int64)
    return block_ids * stride_kv_block + (tokens % CACHE_BLOCK_SIZE) * stride_kv_tok


@triton.jit
def _attend_tile(acc, l_i, m_i, q, k_base, v_base, block_table_ptr, start, q_pos, seq_len,
                 qk_scale, window, key_start, stride_kv_block, stride_kv_tok,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr,
                 CACHE_BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                 SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over context tokens start:start+BLOCK_N.

    acc: [BLOCK_M, BLOCK_D] fp32; l_i, m_i: [BLOCK_M] fp32 (m_i in log2 units); q: [BLOCK_M, BLOCK_D].
    """
    tokens = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    token_valid = tokens < seq_len
    if SLIDING and MASKED:
        # Below key_start no row looks: its block may be released (engine/kv_cache_manager.py).
        token_valid = token_valid & (tokens >= key_start)
    kv_offs = _kv_token_offsets(block_table_ptr, start, tokens, token_valid, stride_kv_block,
                                stride_kv_tok, CACHE_BLOCK_SIZE, BLOCK_N, MASKED)
    ptr_offs = kv_offs[:, None] + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
    # Masked loads read 0, never stale cache memory: a NaN there would survive p = 0.
    # An fp8 cache's tiles become q's dtype here (a no-op for a cache of q's dtype).
    k = _load_tile(k_base + ptr_offs, token_valid, offs_d, HEAD_DIM, MASKED, PAD_D).to(q.dtype)
    v = _load_tile(v_base + ptr_offs, token_valid, offs_d, HEAD_DIM, MASKED, PAD_D).to(q.dtype)

    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if SOFTCAP > 0:
        qk = soft_cap_log2(qk, SOFTCAP)
    if MASKED:
        visible = (tokens[None, :] <= q_pos[:, None]) & token_valid[None, :]
        if SLIDING:
            visible = visible & (tokens[None, :] > q_pos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
    # Without a window every row sees a key in its first tile, so m_new is finite from then
    # on; with one a row may see none of a tile below its window: exponentiate against 0
    # there (p and alpha come out 0, not NaN).
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_exp = m_new
    if SLIDING:
        m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(qk - m_exp[:, None])
    alpha = tl.exp2(m_i - m_exp)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _prefill_attention_kernel(
    q_ptr, kv_cache_ptr, out_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    qk_scale, k_scale_ptr, v_scale_ptr,  # the scales: [1] fp32, read when KV_FP8
    window,  # the sliding window, read when SLIDING
    stride_q_tok, stride_q_head, stride_out_tok, stride_out_head,
    stride_kv_block, stride_kv_kv, stride_kv_tok, stride_kv_head, stride_bt_seq,
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAD_D: tl.constexpr, CACHE_BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
):
    # Rows of the tile are (token, q head of the group) pairs: TILE_Q tokens x QUERIES_PER_KV.
    TILE_Q: tl.constexpr = BLOCK_M // QUERIES_PER_KV
    kv_head = tl.program_id(0)
    # Highest query tiles (longest causal range) first, for a shorter tail.
    m_tile = tl.num_programs(1) - 1 - tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_tile * TILE_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len + m_tile * TILE_Q
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)

    offs_r = tl.arange(0, BLOCK_M)
    tok_in_tile = offs_r // QUERIES_PER_KV
    heads = kv_head * QUERIES_PER_KV + offs_r % QUERIES_PER_KV
    offs_q = m_tile * TILE_Q + tok_in_tile
    offs_d = tl.arange(0, BLOCK_D)
    row_valid = (offs_q < q_len) & (tok_in_tile < TILE_Q)
    rows = (q_start + offs_q).to(tl.int64)
    q_ptrs = q_ptr + (rows * stride_q_tok + heads * stride_q_head)[:, None] + offs_d[None, :]
    q = _load_tile(q_ptrs, row_valid, offs_d, HEAD_DIM, True, PAD_D)  # [BLOCK_M, BLOCK_D]
    q_pos = first_pos + tok_in_tile

    k_base = kv_cache_ptr + kv_head * stride_kv_head
    v_base = k_base + stride_kv_kv
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # Keys 0..first_pos are visible to every row of the tile (and all lie below seq_len).
    unmasked_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    causal_end = tl.minimum(seq_len, first_pos + TILE_Q)
    key_start = 0  # the first key some row of the tile sees
    window_start = 0  # the first tile some row's window reaches
    full_start = 0  # the first tile inside every row's window
    if SLIDING:
        key_start = tl.maximum(first_pos - window + 1, 0)
        window_start = key_start // BLOCK_N * BLOCK_N
        full_start = tl.cdiv(tl.maximum(first_pos + TILE_Q - window, 0), BLOCK_N) * BLOCK_N
        full_start = tl.minimum(tl.maximum(full_start, window_start), unmasked_end)
        for start in range(window_start, full_start, BLOCK_N):
            start = tl.multiple_of(start, BLOCK_N)
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, k_base, v_base, block_table_ptr, start, q_pos, seq_len, qk_scale,
                window, key_start, stride_kv_block, stride_kv_tok, HEAD_DIM, BLOCK_D, PAD_D, CACHE_BLOCK_SIZE,
                BLOCK_N, True, SLIDING, SOFTCAP, DOT_PRECISION)
    for start in range(full_start, unmasked_end, BLOCK_N):
        start = tl.multiple_of(start, BLOCK_N)
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, k_base, v_base, block_table_ptr, start, q_pos, seq_len, qk_scale,
            window, key_start, stride_kv_block, stride_kv_tok, HEAD_DIM, BLOCK_D, PAD_D, CACHE_BLOCK_SIZE,
            BLOCK_N, False, SLIDING, SOFTCAP, DOT_PRECISION)
    for start in range(unmasked_end, causal_end, BLOCK_N):
        start = tl.multiple_of(start, BLOCK_N)
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, k_base, v_base, block_table_ptr, start, q_pos, seq_len, qk_scale,
            window, key_start, stride_kv_block, stride_kv_tok, HEAD_DIM, BLOCK_D, PAD_D, CACHE_BLOCK_SIZE,
            BLOCK_N, True, SLIDING, SOFTCAP, DOT_PRECISION)

    if SLIDING:  # a row past q_len may see no key at all: not stored, but keep it finite
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
    acc = acc / l_i[:, None]
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    out_ptrs = out_ptr + (rows * stride_out_tok + heads * stride_out_head)[:, None] + offs_d[None, :]
    store_mask = row_valid[:, None]
    if PAD_D:
        store_mask = store_mask & (offs_d < HEAD_DIM)[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=store_mask)


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    *,
    out: torch.Tensor | None = None,
    config: PrefillTileConfig | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D]; kv_cache: [NB, 2, BS, Hkv, D], q's dtype or fp8 (then with k_scale,
    v_scale: [1] fp32); block_tables: [B, max_num_blocks] int32; query_start_loc: [B + 1]
    int32; seq_lens: [B] int32; sliding_window: the layer's window or None; softcap: the
    layer's attention logit soft-cap or None -> [T, Hq, D] in q's dtype.

    max_query_len must be at least the longest q_len (it sizes the grid; never read back from
    the device). Rows outside every sequence's range are zero, as in the reference; pass `out`
    to skip that memset (those rows of `out` are then left as they were).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    num_seqs = seq_lens.shape[0]
    assert kv_cache.shape[1] == 2 and kv_cache.shape[4] == head_dim, "kv_cache layout mismatch"
    kv_fp8 = is_fp8(kv_cache.dtype)
    assert kv_fp8 or kv_cache.dtype == q.dtype, f"kv_cache is {kv_cache.dtype}, q is {q.dtype}"
    assert not kv_fp8 or (k_scale is not None and v_scale is not None), "an fp8 cache needs k_scale and v_scale"
    assert num_heads % num_kv_heads == 0, f"{num_heads} q heads over {num_kv_heads} KV heads"
    assert block_size & (block_size - 1) == 0, f"block size {block_size} is not a power of two"
    assert query_start_loc.shape[0] == num_seqs + 1 and block_tables.shape[0] >= num_seqs
    assert q.stride(-1) == 1 and kv_cache.stride(-1) == 1 and block_tables.stride(-1) == 1
    if out is None:
        out = torch.zeros_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    assert sliding_window is None or sliding_window >= 1, f"sliding window {sliding_window}"
    assert softcap is None or softcap > 0, f"softcap {softcap}"
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out

    queries_per_kv = num_heads // num_kv_heads
    config = config or default_tile_config(head_dim, q.dtype, max_query_len, queries_per_kv)
    assert config.block_m >= queries_per_kv, f"block_m {config.block_m} < group {queries_per_kv}"
    block_d = triton.next_power_of_2(head_dim)
    tile_q = config.block_m // queries_per_kv
    grid = (num_kv_heads, triton.cdiv(max_query_len, tile_q), num_seqs)
    _prefill_attention_kernel[grid](
        q, kv_cache, out, block_tables, query_start_loc, seq_lens,
        scale * _LOG2_E,
        k_scale if kv_fp8 else seq_lens, v_scale if kv_fp8 else seq_lens,  # any pointer: not read
        sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv, HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAD_D=block_d != head_dim, CACHE_BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        # fp32 callers want fp32 results, not TF32; 16-bit inputs ignore this.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        KV_FP8=kv_fp8,
        SLIDING=sliding_window is not None,
        SOFTCAP=float(softcap or 0.0),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
