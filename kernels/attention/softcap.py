"""Paged attention with the scores soft-capped before the softmax, tanh(s / cap) * cap (Gemma 2's
attn_logit_softcapping), in torch: the engine's CPU path for such layers
(kernels/attention/dispatch.py); on CUDA the Triton kernels soft-cap themselves
(kernels/attention/triton_softcap.py).

Each sequence's context (its K and V already written to the cache) is read through its block
table and attended with the mask of kernels/attention/dispatch.py: causal, and within the
layer's sliding window W if it has one (the query at position p sees the keys at p - W < k <= p).
Numerics follow transformers' eager attention: scores in the query's dtype, the softmax in fp32.
"""

from __future__ import annotations

import torch

from vllm_cluster.kernels.attention.fp8_kv import dequantize
from vllm_cluster.kernels.attention.metadata import AttentionMetadata


def softcapped_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """query: [T, Hq, D] (the new tokens, whose K and V are in kv_cache already) -> [T, Hq, D]."""
    plan = meta.cpu_plan
    assert plan is not None, "the torch attention path needs AttentionMetadata.cpu_plan"
    block_size = kv_cache.shape[2]
    out = torch.zeros_like(query)
    for b, seq_len in enumerate(plan.seq_lens):
        start, end = plan.query_start_loc[b], plan.query_start_loc[b + 1]
        if end == start or seq_len == 0:
            continue
        blocks = kv_cache[meta.block_tables[b, : -(-seq_len // block_size)].long()]  # [nb, 2, BS, Hkv, D]
        k = dequantize(blocks[:, 0].flatten(0, 1)[:seq_len], k_scale, query.dtype)  # [L, Hkv, D]
        v = dequantize(blocks[:, 1].flatten(0, 1)[:seq_len], v_scale, query.dtype)
        out[start:end] = _attend(query[start:end], k, v, scale, softcap, sliding_window)
    return out


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float, window: int | None
) -> torch.Tensor:
    """q: [Q, Hq, D], the last Q positions of the context k, v: [L, Hkv, D] -> [Q, Hq, D]."""
    num_q, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, Hq, D]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, Q, L]
    scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(seq_len - num_q, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    mask = k_pos <= q_pos  # [Q, L]
    if window is not None:
        mask &= k_pos > q_pos - window
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v)
