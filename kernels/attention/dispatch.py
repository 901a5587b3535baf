"""Attention's one dispatch point: the engine calls only the functions below. On CUDA tensors
they run the Triton kernels (`triton_*.py`), elsewhere the torch path (`torch_ops.py`);
`reference.py` holds the plain definitions both are tested against. A KV cache of
float8_e4m3fn stores K and V scaled by a layer's k_scale / v_scale ([1] fp32 device tensors;
kernels/attention/fp8_kv.py); other caches ignore the scales. `sliding_window` is the layer's
window W or None: a query at position p attends to the keys at p - W < k <= p. `softcap` is the
layer's attention logit soft-cap or None (Gemma 2): each score s becomes softcap * tanh(s /
softcap) before the mask and the softmax; on CPU such a layer takes kernels/attention/softcap.py.
"""

from __future__ import annotations

import torch

from vllm_cluster.kernels.attention import torch_ops
from vllm_cluster.kernels.attention.metadata import AttentionMetadata
from vllm_cluster.kernels.attention.softcap import softcapped_paged_attention
from vllm_cluster.kernels.elementwise.dispatch import rotary_embedding


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
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's context in the paged cache.

    query: [T, Hq, D]; key, value: [T, Hkv, D], already written to kv_cache -> [T, Hq, D].
    """
    if not query.is_cuda and softcap is not None:
        return softcapped_paged_attention(query, kv_cache, meta, scale, softcap, sliding_window, k_scale, v_scale)
    if not query.is_cuda:
        return torch_ops.paged_attention(query, key, value, kv_cache, meta, scale, k_scale, v_scale, sliding_window)
    if meta.is_decode_only:
        from vllm_cluster.kernels.attention.triton_decode import decode_attention

        return decode_attention(
            query, kv_cache, meta.block_tables, meta.seq_lens, scale, max_seq_len=meta.max_seq_len,
            k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window, softcap=softcap,
        )  # fmt: skip
    from vllm_cluster.kernels.attention.triton_prefill import prefill_attention

    return prefill_attention(
        query, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
        max_query_len=meta.max_query_len, k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window,
        softcap=softcap,
    )  # fmt: skip


def rotary_paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`rotary_write_kv_cache` of the new tokens, then `paged_attention`: query [T, Hq, D],
    key and value [T, Hkv, D] not yet rotated, cos / sin [T, D/2] fp32 -> [T, Hq, D]. On CUDA
    a decode-only batch takes one kernel for all of it (the split-K decode attention rotates
    and caches the new token itself: kernels/attention/triton_decode.py); on CUDA query and
    key may be rotated in place (their storage overwritten)."""
    if query.is_cuda and meta.is_decode_only:
        from vllm_cluster.kernels.attention.triton_decode import rotary_decode_attention

        return rotary_decode_attention(
            query, key, value, cos, sin, kv_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens, scale,
            max_seq_len=meta.max_seq_len, k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window,
            softcap=softcap,
        )  # fmt: skip
    query, key = rotary_write_kv_cache(query, key, value, cos, sin, kv_cache, meta.slot_mapping, k_scale, v_scale)
    return paged_attention(query, key, value, kv_cache, meta, scale, k_scale, v_scale, sliding_window, softcap)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """key, value: [T, Hkv, D] into the slots of slot_mapping [T], as the cache's dtype stores
    them; slot -1 writes nothing."""
    if not key.is_cuda:
        return torch_ops.write_kv_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    from vllm_cluster.kernels.attention import triton_kv_write

    triton_kv_write.write_kv_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)


def rotary_write_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_embedding` of q, k, then `write_kv_cache` of the rotated k and v; returns the
    rotated (q, k). On CUDA one launch, which rotates q and k in place: their storage (the
    qkv projection's output) is overwritten, so callers use only the returned tensors."""
    if not q.is_cuda:
        q, k = rotary_embedding(q, k, cos, sin)
        write_kv_cache(k, v, kv_cache, slot_mapping, k_scale, v_scale)
        return q, k
    from vllm_cluster.kernels.attention import triton_rotary_kv

    return triton_rotary_kv.rotary_write_kv_cache(q, k, v, cos, sin, kv_cache, slot_mapping, k_scale, v_scale)
