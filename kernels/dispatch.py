"""Attention and fused hot-path kernels, each behind one dispatch point.

The engine calls only the functions below. On CUDA tensors they run the Triton kernels
(`triton_*.py`); elsewhere the torch path (`torch_ops.py`). `reference.py` holds the
plain definitions both are tested against. A KV cache of float8_e4m3fn stores K and V
scaled by a layer's k_scale / v_scale ([1] fp32 device tensors; kernels/fp8_kv.py); other
caches ignore the scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_cluster.kernels import torch_ops
from vllm_cluster.kernels.metadata import AttentionMetadata

__all__ = [
    "AddNorm",
    "AttentionMetadata",
    "Normed",
    "fused_add_rms_norm",
    "int4_gemm",
    "int4_gemm_add_norm",
    "int4_gemm_normed",
    "linear",
    "linear_add_norm",
    "linear_silu_mul",
    "paged_attention",
    "rotary_embedding",
    "rotary_paged_attention",
    "rotary_write_kv_cache",
    "silu_and_mul",
    "write_kv_cache",
]


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's context in the paged cache.

    query: [T, Hq, D]; key, value: [T, Hkv, D], already written to kv_cache -> [T, Hq, D].
    """
    if not query.is_cuda:
        return torch_ops.paged_attention(query, key, value, kv_cache, meta, scale, k_scale, v_scale)
    if meta.is_decode_only:
        from vllm_cluster.kernels.triton_decode_attention import decode_attention

        return decode_attention(
            query, kv_cache, meta.block_tables, meta.seq_lens, scale, max_seq_len=meta.max_seq_len,
            k_scale=k_scale, v_scale=v_scale,
        )
    from vllm_cluster.kernels.triton_prefill_attention import prefill_attention

    return prefill_attention(
        query, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
        max_query_len=meta.max_query_len, k_scale=k_scale, v_scale=v_scale,
    )


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
) -> torch.Tensor:
    """`rotary_write_kv_cache` of the new tokens, then `paged_attention`: query [T, Hq, D],
    key and value [T, Hkv, D] not yet rotated, cos / sin [T, D/2] fp32 -> [T, Hq, D]. On CUDA
    a decode-only batch takes one kernel for all of it (the split-K decode attention rotates
    and caches the new token itself: kernels/triton_decode_attention.py); on CUDA query and
    key may be rotated in place (their storage overwritten)."""
    if query.is_cuda and meta.is_decode_only:
        from vllm_cluster.kernels.triton_decode_attention import rotary_decode_attention

        return rotary_decode_attention(
            query, key, value, cos, sin, kv_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens, scale,
            max_seq_len=meta.max_seq_len, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    query, key = rotary_write_kv_cache(query, key, value, cos, sin, kv_cache, meta.slot_mapping, k_scale, v_scale)
    return paged_attention(query, key, value, kv_cache, meta, scale, k_scale, v_scale)


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
    from vllm_cluster.kernels import triton_ops

    triton_ops.write_kv_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_norm(x + residual), x + residual); x: [T, D]."""
    if not x.is_cuda:
        return torch_ops.fused_add_rms_norm(x, residual, weight, eps)
    from vllm_cluster.kernels import triton_ops

    return triton_ops.fused_add_rms_norm(x, residual, weight, eps)


# Whether the residual add and RMS norm between two batch-1 GEMVs (o_proj -> gate_up, down ->
# the next layer's qkv) are done by the two GEMVs (kernels/triton_add_norm.py); False: the
# norm's own launch.
ADD_NORM_EPILOGUE = True


@dataclass(frozen=True)
class Normed:
    """weight * rms_norm(h) as the GEMV before left it (kernels/triton_add_norm.py): hg = h *
    weight [1, D] and, in `slot`, the sum of h^2. A batch-1 GEMV takes it as its x and scales
    its sums; anything else calls `materialize`."""

    hg: torch.Tensor  # [1, D]
    slot: torch.Tensor  # [1] fp64: sum of h^2
    eps: float

    def materialize(self) -> torch.Tensor:
        """The normed x itself, [1, D] in hg's dtype."""
        rstd = torch.rsqrt(self.slot.float() / self.hg.shape[-1] + self.eps)
        return (self.hg.float() * rstd).to(self.hg.dtype)


@dataclass(frozen=True)
class AddNorm:
    """`fused_add_rms_norm(y, residual, weight, eps)` of a linear's output y. A batch-1 GEMV
    with a `slot` (a zeroed [1] fp64 tensor) returns the normed half as a `Normed` for the
    GEMV after to finish (kernels/triton_add_norm.py); other paths return it computed."""

    residual: torch.Tensor  # [T, N]
    weight: torch.Tensor  # [N]
    eps: float
    slot: torch.Tensor | None = None

    def in_epilogue(self, x: torch.Tensor) -> bool:
        """Whether a GEMV of x ([T, K]) may take it: one row on CUDA, one dtype throughout."""
        return (
            ADD_NORM_EPILOGUE and self.slot is not None and x.is_cuda and x.dim() == 2 and x.shape[0] == 1
            and self.residual.dim() == 2 and self.residual.is_contiguous() and self.weight.is_contiguous()
            and self.residual.dtype == self.weight.dtype == x.dtype
        )  # fmt: skip

    def after(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, h) of the linear's output y, in launches of their own."""
        return fused_add_rms_norm(y, self.residual, self.weight, self.eps)

    def deferred(self, hg: torch.Tensor) -> Normed:
        """The normed half, as the GEMV before left it: its hg and this slot."""
        assert self.slot is not None
        return Normed(hg, self.slot, self.eps)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary; q: [T, Hq, D], k: [T, Hkv, D], cos/sin: [T, D/2] fp32."""
    if not q.is_cuda:
        return torch_ops.rotary_embedding(q, k, cos, sin)
    from vllm_cluster.kernels import triton_ops

    return triton_ops.rotary_embedding(q, k, cos, sin)


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
    from vllm_cluster.kernels import triton_rotary_kv

    return triton_rotary_kv.rotary_write_kv_cache(q, k, v, cos, sin, kv_cache, slot_mapping, k_scale, v_scale)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] = [gate | up] -> silu(gate) * up: [T, I]."""
    if not x.is_cuda:
        return torch_ops.silu_and_mul(x)
    from vllm_cluster.kernels import triton_ops

    return triton_ops.silu_and_mul(x)


def linear(x: torch.Tensor | Normed, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T (+ bias) -> [T, N]: `F.linear`, except one 16-bit row on CUDA
    (a batch-1 decode step), which runs the Triton GEMV (cuBLAS reads such small weights at
    60-85% of the bandwidth, the GEMV at 75-99%). x may be a `Normed`, which the GEMV finishes."""
    if isinstance(x, Normed):
        if _takes_gemv(x.hg, weight):
            return _gemv_normed(x, weight, bias, silu_mul=False)
        x = x.materialize()
    if _takes_gemv(x, weight):
        from vllm_cluster.kernels import triton_linear

        return triton_linear.gemv(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def linear_silu_mul(
    x: torch.Tensor | Normed, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`silu_and_mul(linear(x, weight, bias))` for a [gate | up] weight [2I, K] -> [T, I]; where
    `linear` runs the GEMV, one launch that applies SiLU-and-mul to its sums, rounded as the
    two launches round (the fp32 sums may be added in another order)."""
    if isinstance(x, Normed):
        if _takes_gemv(x.hg, weight):
            return _gemv_normed(x, weight, bias, silu_mul=True)
        x = x.materialize()
    if _takes_gemv(x, weight):
        from vllm_cluster.kernels import triton_linear

        return triton_linear.gemv(x, weight, bias, silu_mul=True)
    return silu_and_mul(linear(x, weight, bias))


def linear_add_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, add_norm: AddNorm
) -> tuple[torch.Tensor | Normed, torch.Tensor]:
    """`add_norm.after(linear(x, weight, bias))`: (normed, h); where `linear` runs the GEMV and
    add_norm has a slot, the normed half is a `Normed` for the GEMV after to finish
    (kernels/triton_add_norm.py)."""
    if _takes_gemv(x, weight) and add_norm.in_epilogue(x):
        from vllm_cluster.kernels import triton_linear

        hg, h = triton_linear.gemv_add_norm(x, weight, bias, add_norm)
        return add_norm.deferred(hg), h
    return add_norm.after(linear(x, weight, bias))


def _gemv_normed(x: Normed, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> torch.Tensor:
    """The bf16 GEMV of x.hg finishing x's norm (kernels/triton_add_norm.py)."""
    from vllm_cluster.kernels import triton_linear

    return triton_linear.gemv(x.hg, weight, bias, silu_mul=silu_mul, rms=x)


def _takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.is_cuda
        and x.dim() == 2
        and x.shape[0] == 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    layout: str,
    zero_offset: int,
    silu_mul: bool = False,
) -> torch.Tensor:
    """x [M, K] @ a GPTQ/AWQ INT4 weight [K, N] -> [M, N] (kernels/int4_reference.py has the
    layouts; layouts "rows", "pairs" and "tiles": GPTQ repacked at load, kernels/int4_rows.py); g_idx None: groups
    of `group_size` consecutive inputs. silu_mul: the weight is [gate | up], the result
    `silu_and_mul` of the product, [M, N / 2]; on the pairs and tiles layouts at one row on CUDA, one launch."""
    if silu_mul and not (layout in ("pairs", "tiles") and x.is_cuda):
        return silu_and_mul(int4_gemm(x, qweight, qzeros, scales, g_idx, group_size, layout, zero_offset))
    if layout in ("rows", "pairs", "tiles"):
        assert g_idx is None, "act-order weights keep GPTQ's layout"
        if not x.is_cuda:
            from vllm_cluster.kernels import int4_reference

            return int4_reference.int4_gemm(x, qweight, qzeros, scales, None, group_size, layout, zero_offset)
        from vllm_cluster.kernels import triton_int4_gemm, triton_int4_mma, triton_int4_rows_dot

        num_sms = triton_int4_gemm._num_sms(x.device)
        if layout in ("pairs", "tiles"):
            return triton_int4_mma.int4_gemm_pairs(
                x, qweight, qzeros, scales, group_size, zero_offset, num_sms, silu_mul, tiled=layout == "tiles"
            )
        return triton_int4_rows_dot.int4_gemm_rows(x, qweight, qzeros, scales, group_size, zero_offset, num_sms)
    if not x.is_cuda:
        from vllm_cluster.kernels import int4_reference

        return int4_reference.int4_gemm(x, qweight, qzeros, scales, g_idx, group_size, layout, zero_offset)
    from vllm_cluster.kernels import triton_int4_gemm

    return triton_int4_gemm.int4_gemm(x, qweight, qzeros, scales, g_idx, group_size, layout, zero_offset)


def int4_gemm_add_norm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    layout: str,
    zero_offset: int,
    add_norm: AddNorm,
) -> tuple[torch.Tensor | Normed, torch.Tensor]:
    """`add_norm.after(int4_gemm(...))`: (normed, h); on the pairs and tiles layouts at one row
    on CUDA the MMA GEMV does the first half of the norm (kernels/triton_add_norm.py)."""
    if layout in ("pairs", "tiles") and g_idx is None and add_norm.in_epilogue(x):
        from vllm_cluster.kernels import triton_int4_gemm, triton_int4_mma

        num_sms = triton_int4_gemm._num_sms(x.device)
        out = triton_int4_mma.int4_gemm_pairs_add_norm(
            x, qweight, qzeros, scales, group_size, zero_offset, num_sms, layout == "tiles", add_norm
        )
        if out is not None:
            hg, h = out
            return add_norm.deferred(hg), h
    return add_norm.after(int4_gemm(x, qweight, qzeros, scales, g_idx, group_size, layout, zero_offset))


def int4_gemm_normed(
    x: Normed,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    layout: str,
    zero_offset: int,
    silu_mul: bool = False,
) -> torch.Tensor:
    """`int4_gemm(x.materialize(), ...)`; on the pairs and tiles layouts on CUDA the MMA GEMV
    finishes the norm itself where it takes the row (kernels/triton_add_norm.py)."""
    if layout in ("pairs", "tiles") and g_idx is None and x.hg.is_cuda:
        from vllm_cluster.kernels import triton_int4_gemm, triton_int4_mma

        num_sms = triton_int4_gemm._num_sms(x.hg.device)
        return triton_int4_mma.int4_gemm_pairs(
            x.hg, qweight, qzeros, scales, group_size, zero_offset, num_sms, silu_mul, layout == "tiles", rms=x
        )
    return int4_gemm(x.materialize(), qweight, qzeros, scales, g_idx, group_size, layout, zero_offset, silu_mul)
