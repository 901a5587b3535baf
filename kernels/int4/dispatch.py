"""INT4's one dispatch point: the engine calls only the functions below. On CUDA tensors they
run the Triton kernels (`triton_*.py`), elsewhere the torch definition (`reference.py`).

By layout: "gptq" and "awq" (and any act-order weight) take the dequantize-GEMM of
triton_gemm.py; "rows" the kernels of triton_rows_dot.py; "pairs" and "tiles" those of
triton_mma.py (layouts.py has the layouts).
"""

from __future__ import annotations

import torch

from vllm_cluster.kernels.elementwise.dispatch import silu_and_mul
from vllm_cluster.kernels.int4 import reference
from vllm_cluster.kernels.int4.weight import Int4Weight
from vllm_cluster.kernels.linear.add_norm import AddNorm, Normed

_DECODE_LAYOUTS = ("rows", "pairs", "tiles")
_MMA_LAYOUTS = ("pairs", "tiles")


def int4_gemm(x: torch.Tensor, weight: Int4Weight, silu_mul: bool = False) -> torch.Tensor:
    """x [M, K] @ an INT4 weight [K, N] -> [M, N]. silu_mul: the weight is [gate | up], the
    result `silu_and_mul` of the product, [M, N / 2]; on the pairs and tiles layouts at one
    row on CUDA, one launch."""
    if silu_mul and not (weight.layout in _MMA_LAYOUTS and x.is_cuda):
        return silu_and_mul(int4_gemm(x, weight))
    if not x.is_cuda:
        assert weight.layout not in _DECODE_LAYOUTS or weight.g_idx is None, "act-order weights keep GPTQ's layout"
        return reference.int4_gemm(x, weight)
    if weight.layout in _DECODE_LAYOUTS:
        assert weight.g_idx is None, "act-order weights keep GPTQ's layout"
        from vllm_cluster.kernels.int4 import triton_gemm, triton_mma, triton_rows_dot

        num_sms = triton_gemm.num_sms(x.device)
        if weight.layout in _MMA_LAYOUTS:
            return triton_mma.int4_gemm_pairs(x, weight, num_sms, silu_mul)
        return triton_rows_dot.int4_gemm_rows(x, weight, num_sms)
    from vllm_cluster.kernels.int4 import triton_gemm

    return triton_gemm.int4_gemm(x, weight)


def int4_gemm_add_norm(
    x: torch.Tensor, weight: Int4Weight, add_norm: AddNorm
) -> tuple[torch.Tensor | Normed, torch.Tensor]:
    """`add_norm.after(int4_gemm(x, weight))`: (normed, h); on the pairs and tiles layouts at
    one row on CUDA the MMA GEMV does the first half of the norm (kernels/linear/triton_add_norm.py)."""
    if weight.layout in _MMA_LAYOUTS and weight.g_idx is None and add_norm.in_epilogue(x):
        from vllm_cluster.kernels.int4 import triton_gemm, triton_mma

        out = triton_mma.int4_gemm_pairs_add_norm(x, weight, triton_gemm.num_sms(x.device), add_norm)
        if out is not None:
            hg, h = out
            return add_norm.deferred(hg), h
    return add_norm.after(int4_gemm(x, weight))


def int4_gemm_normed(x: Normed, weight: Int4Weight, silu_mul: bool = False) -> torch.Tensor:
    """`int4_gemm(x.materialize(), weight)`; on the pairs and tiles layouts on CUDA the MMA GEMV
    finishes the norm itself where it takes the row (kernels/linear/triton_add_norm.py)."""
    if weight.layout in _MMA_LAYOUTS and weight.g_idx is None and x.hg.is_cuda:
        from vllm_cluster.kernels.int4 import triton_gemm, triton_mma

        return triton_mma.int4_gemm_pairs(x.hg, weight, triton_gemm.num_sms(x.hg.device), silu_mul, rms=x)
    return int4_gemm(x.materialize(), weight, silu_mul)
