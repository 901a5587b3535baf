"""Multi-head latent attention's dispatch point: the engine calls only these. On CUDA a
decode-only step runs the Triton kernel (kernels/attention/triton_mla_decode.py) and the
new entries are written by a Triton launch, so a CUDA graph captures the step; steps with
prefill rows, and every step elsewhere, take the torch path (kernels/attention/mla_torch.py).

latent_cache: [num_blocks, 1, block_size, 1, R + P] per layer (R: kv_lora_rank, P:
qk_rope_head_dim); query: [T, H, R + P] with W_UK folded in; output [T, H, R].
"""

from __future__ import annotations

import torch

from vllm_cluster.kernels.attention import mla_torch
from vllm_cluster.kernels.attention.metadata import AttentionMetadata


def write_latent_cache(entry: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """entry: [T, R + P] into the slots of slot_mapping [T]; a negative slot writes nothing."""
    if not entry.is_cuda:
        return mla_torch.write_latent_cache(entry, latent_cache, slot_mapping)
    from vllm_cluster.kernels.attention import triton_mla_decode

    triton_mla_decode.write_latent_cache(entry, latent_cache, slot_mapping)


def mla_attention(
    query: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata, scale: float, latent_dim: int
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached entries (its own written
    already): query [T, H, R + P] -> [T, H, R]."""
    if query.is_cuda and meta.is_decode_only:
        from vllm_cluster.kernels.attention.triton_mla_decode import mla_decode_attention

        return mla_decode_attention(
            query, latent_cache, meta.block_tables, meta.seq_lens, scale, latent_dim, max_seq_len=meta.max_seq_len
        )
    return mla_torch.mla_attention(query, latent_cache, meta, scale, latent_dim)
