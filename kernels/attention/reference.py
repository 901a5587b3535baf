"""Torch references for the attention kernels: the definition each Triton kernel is tested against.

Written for clarity, not speed (loops over sequences). Shapes:
  kv_cache      [num_blocks, 2, block_size, num_kv_heads, head_dim]  (one layer)
  block_tables  [B, max_num_blocks] int32, padded with anything
  seq_lens      [B] int32: context length after this step (0 = padding, output zeros)
  k_scale, v_scale  [1] fp32 (or floats): an fp8 cache's scales (kernels/attention/fp8_kv.py); a
                cache of another dtype ignores them
  sliding_window  a layer's window W, or None: the query at position p sees the keys at
                positions p - W < k <= p (W tokens, itself included, as transformers' Mistral)
  softcap       a layer's attention logit soft-cap, or None: each score s becomes
                softcap * tanh(s / softcap) after the scale, before the mask (Gemma 2)
"""

from __future__ import annotations

import torch

from vllm_cluster.kernels.attention.fp8_kv import dequantize, quantize
from vllm_cluster.kernels.elementwise.reference import rotary_embedding

Scale = torch.Tensor | float | None


def _context(
    kv_cache: torch.Tensor, table: torch.Tensor, seq_len: int, k_scale: Scale, v_scale: Scale
) -> tuple[torch.Tensor, torch.Tensor]:
    """The context's K and V as stored, read back in fp32: [L, Hkv, D] each."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = kv_cache[table[:num_blocks].long()]  # [nb, 2, BS, Hkv, D]
    k = blocks[:, 0].flatten(0, 1)[:seq_len]  # [L, Hkv, D]
    v = blocks[:, 1].flatten(0, 1)[:seq_len]
    return dequantize(k, k_scale, torch.float32), dequantize(v, v_scale, torch.float32)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [Q, Hq, D] at the last Q positions of a context k, v: [L, Hkv, D]; causal (within
    the window, if any); fp32 math."""
    num_q, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [Hq, Q, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(seq_len - num_q, seq_len)[:, None]
    mask = torch.arange(seq_len)[None, :] <= q_pos  # [Q, L]
    if sliding_window is not None:
        mask &= torch.arange(seq_len)[None, :] > q_pos - sliding_window
    scores = scores.masked_fill(~mask.to(scores.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: Scale = None,
    v_scale: Scale = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [B, Hq, D], one new token per sequence -> [B, Hq, D]."""
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        seq_len = int(seq_lens[b])
        if seq_len > 0:
            k, v = _context(kv_cache, block_tables[b], seq_len, k_scale, v_scale)
            out[b] = _attend(q[b : b + 1], k, v, scale, sliding_window, softcap)[0]
    return out


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: Scale = None,
    v_scale: Scale = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D], a varlen batch; sequence b owns q[loc[b]:loc[b+1]], the last tokens of
    its seq_lens[b]-long context (a cached prefix may come first) -> [T, Hq, D]."""
    out = torch.zeros_like(q)
    for b in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        if end > start:
            k, v = _context(kv_cache, block_tables[b], int(seq_lens[b]), k_scale, v_scale)
            out[start:end] = _attend(q[start:end], k, v, scale, sliding_window, softcap)
    return out


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> None:
    """key, value: [T, Hkv, D] into kv_cache at slot_mapping [T] (block * block_size + offset),
    as the cache's dtype stores them; a negative slot (a padding token) writes nothing."""
    block_size = kv_cache.shape[2]
    for t in range(key.shape[0]):
        slot = int(slot_mapping[t])
        if slot >= 0:
            kv_cache[slot // block_size, 0, slot % block_size] = quantize(key[t], k_scale, kv_cache.dtype)
            kv_cache[slot // block_size, 1, slot % block_size] = quantize(value[t], v_scale, kv_cache.dtype)


def rotary_write_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_embedding` of q and k, then `write_kv_cache` of the rotated k and v; returns
    the rotated (q, k). (The CUDA kernel rotates q and k in place as well.)"""
    q, k = rotary_embedding(q, k, cos, sin)
    write_kv_cache(k, v, kv_cache, slot_mapping, k_scale, v_scale)
    return q, k
