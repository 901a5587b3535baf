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
    decode_seq_lens: torch.Tensor  # [Bd] long
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
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached context.

    query: [T, Hq, D] -> [T, Hq, D]. The new tokens' K/V must already be in the cache.
    """
    out = torch.empty_like(query)
    if meta.decode_seq_ids.numel():
        _decode_attention(query, kv_cache, meta, scale, out)
    for b in meta.prefill_seq_ids:
        _prefill_attention(query, kv_cache, meta, b, scale, out)
    return out


def _gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # block_ids: [..., NBseq] -> k, v: [..., NBseq * BS, Hkv, D]
    blocks = kv_cache[block_ids]  # [..., NBseq, 2, BS, Hkv, D]
    k = blocks.select(-4, 0).flatten(-4, -3)
    v = blocks.select(-4, 1).flatten(-4, -3)
    return k, v


def _decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    seq_ids = meta.decode_seq_ids
    token_ids = torch.tensor(meta.query_start_loc, dtype=torch.long)[seq_ids]
    max_len = int(meta.decode_seq_lens.max())
    block_size = kv_cache.shape[2]
    num_blocks = -(-max_len // block_size)
    k, v = _gather_kv(kv_cache, meta.block_tables[seq_ids, :num_blocks])  # [Bd, L, Hkv, D]
    q = query[token_ids].unsqueeze(2)  # [Bd, Hq, 1, D]
    positions = torch.arange(k.shape[1])
    mask = (positions[None, :] < meta.decode_seq_lens[:, None])[:, None, None, :]  # [Bd,1,1,L]
    o = F.scaled_dot_product_attention(
        q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True
    )
    out[token_ids] = o.squeeze(2)


def _prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    b: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    start, end = meta.query_start_loc[b], meta.query_start_loc[b + 1]
    seq_len = meta.seq_lens[b]
    q_len = end - start
    num_blocks = -(-seq_len // kv_cache.shape[2])
    k, v = _gather_kv(kv_cache, meta.block_tables[b, :num_blocks])  # [L, Hkv, D]
    k, v = k[:seq_len].transpose(0, 1), v[:seq_len].transpose(0, 1)  # [Hkv, L, D]
    q = query[start:end].transpose(0, 1)  # [Hq, Q, D]
    if q_len == seq_len:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # New tokens sit at the end of the context: token i sees keys up to seq_len - q_len + i.
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        mask = torch.arange(seq_len)[None, :] <= q_pos  # [Q, L]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    out[start:end] = o.transpose(0, 1)
