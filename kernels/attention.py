"""Paged attention over the KV cache, and the KV cache write by slot mapping.

KV cache layout, one tensor per layer: [num_blocks, 2, block_size, num_kv_heads, head_dim],
so that one block of one layer is contiguous (a KV transfer is a list of (layer, block)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """Where each token of a flattened varlen batch sits, and each sequence's context."""

    slot_mapping: torch.Tensor  # [T] long: block_id * block_size + offset of each new token
    query_start_loc: list[int]  # [B + 1]: token range of sequence b is [loc[b], loc[b+1])
    seq_lens: list[int]  # [B]: context length of each sequence after this step
    block_tables: torch.Tensor  # [B, max_num_blocks] long, padded with 0
    decode_seq_ids: torch.Tensor  # [Bd] long: sequences with exactly one new token
    decode_token_ids: torch.Tensor  # [Bd] long: where their token sits in the batch
    decode_seq_lens: torch.Tensor  # [Bd] long
    decode_max_len: int
    # [Bd, 1, 1, decode_max_len] bool, True = attend; None when all decode lengths are equal.
    decode_mask: torch.Tensor | None
    prefill_seq_ids: list[int]  # sequences with more than one new token


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    # key, value: [T, Hkv, D]; kv_cache: [NB, 2, BS, Hkv, D]
    block_size = kv_cache.shape[2]
    block_ids = slot_mapping // block_size
    offsets = slot_mapping % block_size
    kv_cache[block_ids, 0, offsets] = key
    kv_cache[block_ids, 1, offsets] = value


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's context.

    query: [T, Hq, D]; key, value: [T, Hkv, D] (the new tokens', already written to the
    cache) -> [T, Hq, D]. A sequence with no cached context attends over `key`/`value`
    directly; any other reads its context from the cache through its block table.
    """
    out = torch.empty_like(query)
    if meta.decode_seq_ids.numel():
        _decode_attention(query, kv_cache, meta, scale, out)
    for b in meta.prefill_seq_ids:
        _prefill_attention(query, key, value, kv_cache, meta, b, scale, out)
    return out


def _gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """block_ids: [B, NBseq] -> k, v: [B, Hkv, NBseq * BS, D], ready for SDPA."""
    num_seqs, num_blocks = block_ids.shape
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    blocks = kv_cache.index_select(0, block_ids.flatten())  # [B*NBseq, 2, BS, Hkv, D]
    blocks = blocks.view(num_seqs, num_blocks, 2, block_size, num_kv_heads, head_dim)
    shape = (num_seqs, num_kv_heads, num_blocks * block_size, head_dim)
    k = blocks[:, :, 0].permute(0, 3, 1, 2, 4).reshape(shape)
    v = blocks[:, :, 1].permute(0, 3, 1, 2, 4).reshape(shape)
    return k, v


def _decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    max_len = meta.decode_max_len
    num_blocks = -(-max_len // kv_cache.shape[2])
    k, v = _gather_kv(kv_cache, meta.block_tables[meta.decode_seq_ids, :num_blocks])  # [Bd, Hkv, L, D]
    k, v = k[:, :, :max_len], v[:, :, :max_len]
    num_seqs, num_kv_heads, _, head_dim = k.shape
    # One query row per head, grouped under its KV head: two batched matmuls, no K/V
    # repeat (on CPU this beats SDPA's GQA path by about 2x at decode shapes).
    q = query[meta.decode_token_ids].view(num_seqs, num_kv_heads, -1, head_dim)  # [Bd, Hkv, G, D]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [Bd, Hkv, G, L]
    if meta.decode_mask is not None:
        scores = scores.masked_fill(~meta.decode_mask, float("-inf"))
    o = torch.matmul(scores.softmax(dim=-1), v)  # [Bd, Hkv, G, D]
    out[meta.decode_token_ids] = o.view(num_seqs, -1, head_dim)


def _prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    b: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    start, end = meta.query_start_loc[b], meta.query_start_loc[b + 1]
    seq_len = meta.seq_lens[b]
    q_len = end - start
    if q_len == seq_len:
        k, v = key[start:end], value[start:end]  # [L, Hkv, D]
    else:
        num_blocks = -(-seq_len // kv_cache.shape[2])
        k, v = _gather_kv(kv_cache, meta.block_tables[b : b + 1, :num_blocks])
        k, v = k[0, :, :seq_len], v[0, :, :seq_len]  # [Hkv, L, D]
    if q_len == seq_len:
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, L, D]
    q = query[start:end].transpose(0, 1)  # [Hq, Q, D]
    if q_len == seq_len:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # New tokens sit at the end of the context: token i sees keys up to seq_len - q_len + i.
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        mask = torch.arange(seq_len)[None, :] <= q_pos  # [Q, L]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    out[start:end] = o.transpose(0, 1)
