"""The torch path of the attention kernels, used on CPU: fast enough to serve there, exact
against kernels/attention/reference.py. Decode attention rows are batched (one gather per layer,
grouped-query attention by two matmuls); prefill rows run one SDPA call per sequence.
An fp8 cache (kernels/attention/fp8_kv.py) is read back in the query's dtype, k_scale folded into the
softmax scale and v_scale applied to the output; every sequence then reads its whole context
from the cache, as the Triton kernels do, so attention sees what was stored.
A layer's sliding window W (None: none) limits the query at position p to the keys at
p - W < k <= p; only the cache blocks that hold such keys are read (a block before a
row's window may have been released and reused).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_cluster.kernels.attention.fp8_kv import is_fp8, quantize, scale_value
from vllm_cluster.kernels.attention.metadata import AttentionMetadata, CpuPlan


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    # key, value: [T, Hkv, D]; kv_cache: [NB, 2, BS, Hkv, D]; the CPU path never pads.
    block_size = kv_cache.shape[2]
    block_ids = slot_mapping // block_size
    offsets = slot_mapping % block_size
    kv_cache[block_ids, 0, offsets] = quantize(key, k_scale, kv_cache.dtype)
    kv_cache[block_ids, 1, offsets] = quantize(value, v_scale, kv_cache.dtype)


@dataclass(frozen=True, slots=True)
class _Scales:
    """How attention reads the cache: the softmax scale (k_scale folded in) and the factor
    on the output (v_scale); 1.0 unless the cache is fp8."""

    softmax: float
    out: float
    fp8: bool


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """query: [T, Hq, D]; key, value: [T, Hkv, D] (the new tokens', already written to the
    cache) -> [T, Hq, D]. A sequence with no cached context attends over `key`/`value`
    directly (unless the cache is fp8); any other reads its context from the cache through
    its block table."""
    plan = meta.cpu_plan
    assert plan is not None, "the torch attention path needs AttentionMetadata.cpu_plan"
    scales = _Scales(scale, 1.0, False)
    if is_fp8(kv_cache.dtype):
        scales = _Scales(scale * scale_value(k_scale), scale_value(v_scale), True)
    out = torch.empty_like(query)
    if plan.decode_seq_ids.numel():
        _decode_attention(query, kv_cache, meta.block_tables, plan, scales, sliding_window, out)
    for b in plan.prefill_seq_ids:
        _prefill_attention(query, key, value, kv_cache, meta.block_tables, plan, b, scales, sliding_window, out)
    return out


def _gather_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """block_ids: [B, NBseq] -> k, v: [B, Hkv, NBseq * BS, D] in `dtype`, ready for attention
    (an fp8 cache's values as stored: the caller applies the scales)."""
    num_seqs, num_blocks = block_ids.shape
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    blocks = kv_cache.index_select(0, block_ids.flatten())  # [B*NBseq, 2, BS, Hkv, D]
    blocks = blocks.view(num_seqs, num_blocks, 2, block_size, num_kv_heads, head_dim)
    shape = (num_seqs, num_kv_heads, num_blocks * block_size, head_dim)
    k = blocks[:, :, 0].permute(0, 3, 1, 2, 4).reshape(shape)
    v = blocks[:, :, 1].permute(0, 3, 1, 2, 4).reshape(shape)
    return k.to(dtype), v.to(dtype)


def _decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    plan: CpuPlan,
    scales: _Scales,
    window: int | None,
    out: torch.Tensor,
) -> None:
    max_len = plan.decode_max_len
    block_size = kv_cache.shape[2]
    num_blocks = -(-max_len // block_size)
    if window is not None and max_len <= window:
        window = None  # every key is in every row's window
    # With a window, gather from the first block any row still sees.
    first_block = 0 if window is None else max(0, plan.decode_min_len - window) // block_size
    first = first_block * block_size
    table = block_tables[plan.decode_seq_ids, first_block:num_blocks]
    if window is not None:
        # A longer row's blocks before its own window may be released (engine/kv_cache_manager.py):
        # read its first block in the window there instead (masked all the same).
        own_first = (plan.decode_lens - window).clamp(min=0) // block_size - first_block  # [Bd]
        stale = torch.arange(table.shape[1])[None, :] < own_first[:, None]
        table = torch.where(stale, table.gather(1, own_first[:, None]), table)
    k, v = _gather_kv(kv_cache, table, query.dtype)  # [Bd, Hkv, L', D]: positions first..
    k, v = k[:, :, : max_len - first], v[:, :, : max_len - first]
    mask = None if plan.decode_mask is None else plan.decode_mask[..., first:]
    if window is not None:
        positions = torch.arange(first, max_len)
        in_window = (positions[None, :] >= (plan.decode_lens - window)[:, None])[:, None, None, :]
        mask = in_window if mask is None else mask & in_window  # [Bd, 1, 1, L']
    num_seqs, num_kv_heads, _, head_dim = k.shape
    # One query row per head, grouped under its KV head: two batched matmuls, no K/V
    # repeat (on CPU this beats SDPA's GQA path by about 2x at decode shapes).
    q = query[plan.decode_token_ids].view(num_seqs, num_kv_heads, -1, head_dim)  # [Bd, Hkv, G, D]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scales.softmax  # [Bd, Hkv, G, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    o = torch.matmul(scores.softmax(dim=-1), v)  # [Bd, Hkv, G, D]
    if scales.fp8:
        o = o * scales.out
    out[plan.decode_token_ids] = o.view(num_seqs, -1, head_dim)


def _prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    plan: CpuPlan,
    b: int,
    scales: _Scales,
    window: int | None,
    out: torch.Tensor,
) -> None:
    start, end = plan.query_start_loc[b], plan.query_start_loc[b + 1]
    seq_len = plan.seq_lens[b]
    q_len = end - start
    q = query[start:end].transpose(0, 1)  # [Hq, Q, D]
    if window is not None and seq_len <= window:
        window = None  # every key is in every row's window
    if q_len == seq_len and not scales.fp8 and window is None:
        k, v = key[start:end].transpose(0, 1), value[start:end].transpose(0, 1)  # [Hkv, L, D]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scales.softmax, enable_gqa=True)
    else:
        block_size = kv_cache.shape[2]
        num_blocks = -(-seq_len // block_size)
        # The first key any new token sees: its block is the first one gathered.
        first_block = 0 if window is None else max(0, seq_len - q_len - window + 1) // block_size
        first = first_block * block_size
        k, v = _gather_kv(kv_cache, block_tables[b : b + 1, first_block:num_blocks], query.dtype)
        k, v = k[0, :, : seq_len - first], v[0, :, : seq_len - first]  # [Hkv, L', D]: positions first..
        # New tokens sit at the end of the context: token i sees keys up to seq_len - q_len + i.
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(first, seq_len)[None, :]
        mask = k_pos <= q_pos  # [Q, L']
        if window is not None:
            mask &= k_pos > q_pos - window
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scales.softmax, enable_gqa=True)
        if scales.fp8:
            o = o * scales.out
    out[start:end] = o.transpose(0, 1)
