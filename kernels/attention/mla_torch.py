"""The torch path of multi-head latent attention (MLA) over the paged latent cache: used on
CPU, and on CUDA for steps with prefill rows. The Triton decode kernel
(kernels/attention/triton_mla_decode.py) is tested against it.

Absorbed form: each cache entry is one token's [latent (R) | rotary key (P)], shared by
every head, so attention is multi-query attention with one KV head whose key is the whole
entry and whose value is its first R values. The caller folds the key's up-projection into
the query (q_nope @ W_UK, then the rotary query) and applies the value's up-projection to
the output.

Shapes:
  latent_cache  [num_blocks, 1, block_size, 1, R + P]  (one layer)
  query         [T, H, R + P]
  output        [T, H, R]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_cluster.kernels.attention.metadata import AttentionMetadata

_MAX_SCORES = 1 << 26  # a prefill chunk's scores, [H, Qc, L]: 256 MiB in fp32


def write_latent_cache(entry: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """entry: [T, R + P] into the slots of slot_mapping [T]; a negative slot writes nothing."""
    block_size = latent_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    latent_cache[slots // block_size, 0, slots % block_size, 0] = entry[keep].to(latent_cache.dtype)


def _context(latent_cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's cached entries: [L, R + P]."""
    block_size = latent_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    return latent_cache[table[:num_blocks].long(), 0, :, 0].flatten(0, 1)[:seq_len]


def mla_attention(
    query: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata, scale: float, latent_dim: int
) -> torch.Tensor:
    """query [T, H, R + P] of the new tokens, whose entries are already in the cache ->
    [T, H, R]. Decode rows (one new token) attend together, prefill rows one sequence at a time."""
    if meta.cpu_plan is not None:
        query_start_loc, seq_lens = meta.cpu_plan.query_start_loc, meta.cpu_plan.seq_lens
    else:
        query_start_loc, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    out = query.new_zeros(*query.shape[:2], latent_dim)
    decode = [b for b in range(len(seq_lens)) if query_start_loc[b + 1] - query_start_loc[b] == 1 and seq_lens[b]]
    if decode:
        rows = torch.tensor([query_start_loc[b] for b in decode], device=query.device)
        out[rows] = _decode(query[rows], latent_cache, meta.block_tables[decode], [seq_lens[b] for b in decode],
                            scale, latent_dim)  # fmt: skip
    for b in range(len(seq_lens)):
        start, end = query_start_loc[b], query_start_loc[b + 1]
        if end - start > 1:
            ctx = _context(latent_cache, meta.block_tables[b], seq_lens[b]).to(query.dtype)  # [L, R + P]
            out[start:end] = _prefill(query[start:end], ctx, scale, latent_dim)
    return out


def _prefill(q: torch.Tensor, ctx: torch.Tensor, scale: float, latent_dim: int) -> torch.Tensor:
    """q [Q, H, R + P]: the last Q tokens of a context whose entries are ctx [L, R + P] ->
    [Q, H, R], causal. In chunks of queries whose scores stay within _MAX_SCORES elements:
    SDPA may take its math path here (one KV head, a value narrower than the key), which
    materialises them."""
    num_q, num_heads, _ = q.shape
    seq_len = ctx.shape[0]
    positions = torch.arange(seq_len - num_q, seq_len, device=q.device)  # [Q]
    step = max(1, _MAX_SCORES // (num_heads * seq_len))
    out = q.new_empty(num_q, num_heads, latent_dim)
    for lo in range(0, num_q, step):
        chunk = q[lo : lo + step].transpose(0, 1)  # [H, Qc, R + P]
        mask = torch.arange(seq_len, device=q.device)[None, :] <= positions[lo : lo + step, None]  # [Qc, L]
        o = F.scaled_dot_product_attention(
            chunk, ctx[None], ctx[None, :, :latent_dim], attn_mask=mask, scale=scale, enable_gqa=True
        )  # [H, Qc, R]
        out[lo : lo + step] = o.transpose(0, 1)
    return out


def _decode(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: list[int],
    scale: float,
    latent_dim: int,
) -> torch.Tensor:
    """q: [B, H, R + P], one new token per sequence -> [B, H, R]."""
    block_size = latent_cache.shape[2]
    max_len = max(seq_lens)
    num_blocks = -(-max_len // block_size)
    ctx = latent_cache[tables[:, :num_blocks].long(), 0, :, 0]  # [B, NB, BS, R + P]
    ctx = ctx.flatten(1, 2)[:, :max_len].to(q.dtype)  # [B, L, R + P]
    scores = torch.einsum("bhd,bld->bhl", q.float(), ctx.float()) * scale
    lens = torch.tensor(seq_lens, device=q.device)
    valid = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]  # [B, L]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("bhl,blr->bhr", scores.softmax(-1), ctx[..., :latent_dim].float()).to(q.dtype)
