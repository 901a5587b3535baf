"""Linear layers' one dispatch point: the engine calls only the functions below. On CUDA
tensors they run the Triton GEMVs and GEMMs (`triton_*.py`) or cuBLAS, elsewhere torch
(`torch_ops.py` for the quantized weights); `reference.py` holds the plain definitions of the
quantized products.

- bf16 / fp16: `linear`, the Triton GEMV at one row on CUDA, else `F.linear`.
- INT8 weight-only: w [N, K] int8, one fp32 scale per output row (`int8_linear`).
- FP8: w [N, K] float8_e4m3fn, one fp32 scale per output row (`fp8_linear`). Two products,
  chosen by the number of rows of x alone (so a CUDA graph captures one of them):
  - up to FP8_WEIGHT_ONLY_MAX_ROWS (decode), w8a16: y = x @ (wq * w_scale).T + bias, the
    weight read once in fp8 and widened in registers (one Triton launch, x not quantized);
  - above (prefill, large batches), W8A8: x is quantized per token at run time
    (`per_token_quant_fp8`); y = (xq @ wq.T) * x_scale * w_scale + bias, on fp8 tensor
    cores through `torch._scaled_mm` (rowwise scales).
  Both accumulate in fp32. The CPU path computes the same products in fp32 from the same
  fp8 values, so CPU tests see the numerics of the GPU path up to the order of the sums.

Where a batch-1 GEMV runs, the `*_add_norm` and `*_normed` variants split the residual add
and RMS norm between two GEMVs (kernels/linear/add_norm.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_cluster.kernels.elementwise.dispatch import silu_and_mul
from vllm_cluster.kernels.linear import torch_ops
from vllm_cluster.kernels.linear.add_norm import AddNorm, Normed
from vllm_cluster.kernels.linear.reference import FP8_WEIGHT_ONLY_MAX_ROWS, per_token_quant_fp8_reference

# On CUDA, above this many rows dequantize once and let cuBLAS multiply (compute-bound);
# at or below it the Triton kernel reads int8 directly (bandwidth-bound).
_INT8_TRITON_MAX_ROWS = 256
# Rows up to which 1-byte weights take the GEMV (kernels/linear/triton_w8_gemv.py): it repeats
# the weight's conversion for each row; on the H200 the 16-row tiles were faster at 4 rows on
# every llama-8b shape and at 2 rows on gate_up (docs/benchmarks.md).
_W8_GEMV_MAX_ROWS = 1

W8Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def linear(x: torch.Tensor | Normed, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T (+ bias) -> [T, N]: `F.linear`, except one 16-bit row on CUDA
    (a batch-1 decode step), which runs the Triton GEMV (cuBLAS reads such small weights at
    60-85% of the bandwidth, the GEMV at 75-99%). x may be a `Normed`, which the GEMV finishes."""
    if isinstance(x, Normed):
        if _takes_gemv(x.hg, weight):
            return _gemv_normed(x, weight, bias, silu_mul=False)
        x = x.materialize()
    if _takes_gemv(x, weight):
        from vllm_cluster.kernels.linear import triton_gemv

        return triton_gemv.gemv(x, weight, bias)
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
        from vllm_cluster.kernels.linear import triton_gemv

        return triton_gemv.gemv(x, weight, bias, silu_mul=True)
    return silu_and_mul(linear(x, weight, bias))


def linear_add_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, add_norm: AddNorm
) -> tuple[torch.Tensor | Normed, torch.Tensor]:
    """`add_norm.after(linear(x, weight, bias))`: (normed, h); where `linear` runs the GEMV and
    add_norm has a slot, the normed half is a `Normed` for the GEMV after to finish
    (kernels/linear/triton_add_norm.py)."""
    if _takes_gemv(x, weight) and add_norm.in_epilogue(x):
        from vllm_cluster.kernels.linear import triton_gemv

        hg, h = triton_gemv.gemv_add_norm(x, weight, bias, add_norm)
        return add_norm.deferred(hg), h
    return add_norm.after(linear(x, weight, bias))


def _gemv_normed(x: Normed, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> torch.Tensor:
    """The bf16 GEMV of x.hg finishing x's norm (kernels/linear/triton_add_norm.py)."""
    from vllm_cluster.kernels.linear import triton_gemv

    return triton_gemv.gemv(x.hg, weight, bias, silu_mul=silu_mul, rms=x)


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


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x: [M, K]; qweight: [N, K] int8; scale: [N] fp32; bias: [N] | None -> [M, N]."""
    if not x.is_cuda:
        return torch_ops.weight_only(x, qweight, scale, bias)
    if x.shape[0] > _INT8_TRITON_MAX_ROWS:
        # int8 -> x.dtype is exact; scaling the product, not the weight, rounds once.
        y = torch.nn.functional.linear(x, qweight.to(x.dtype)) * scale.to(x.dtype)
        return y if bias is None else y + bias
    return _w8_triton(x, qweight, scale, bias)


def _w8_triton(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The weight-only Triton kernels for 1-byte weights: the GEMV for a few rows, else tiles."""
    from vllm_cluster.kernels.linear.triton_int8_gemm import int8_gemm
    from vllm_cluster.kernels.linear.triton_w8_gemv import gemv_w8

    if x.shape[0] <= _W8_GEMV_MAX_ROWS:
        return gemv_w8(x, qweight, scale, bias)
    return int8_gemm(x.contiguous(), qweight, scale, bias)


def w8_linear_silu_mul(
    linear: W8Linear,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """`silu_and_mul(linear(x, qweight, scale, bias))` (linear: int8_linear or fp8_linear) for a
    [gate | up] weight; where both run the 1-byte GEMV (rows of x up to _W8_GEMV_MAX_ROWS on
    CUDA), one launch that applies SiLU-and-mul to its sums, rounded as the two launches round."""
    if x.is_cuda and x.shape[0] <= _W8_GEMV_MAX_ROWS:
        from vllm_cluster.kernels.linear.triton_w8_gemv import gemv_w8

        return gemv_w8(x, qweight, scale, bias, silu_mul=True)
    return silu_and_mul(linear(x, qweight, scale, bias))


def w8_linear_add_norm(
    linear: W8Linear,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    add_norm: AddNorm,
) -> tuple[torch.Tensor | Normed, torch.Tensor]:
    """`add_norm.after(linear(x, qweight, scale, bias))` (linear: int8_linear or fp8_linear):
    (normed, h); at one row on CUDA, where both run the 1-byte GEMV, the normed half is a
    `Normed` for the GEMV after to finish (kernels/linear/triton_add_norm.py)."""
    if add_norm.in_epilogue(x):
        from vllm_cluster.kernels.linear.triton_w8_gemv import gemv_w8_add_norm

        hg, h = gemv_w8_add_norm(x, qweight, scale, bias, add_norm)
        return add_norm.deferred(hg), h
    return add_norm.after(linear(x, qweight, scale, bias))


def w8_linear_normed(
    linear: W8Linear,
    x: Normed,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    silu_mul: bool = False,
) -> torch.Tensor:
    """`linear` (with silu_mul `w8_linear_silu_mul`) of x.materialize(); on CUDA the 1-byte
    GEMV finishes the norm itself (kernels/linear/triton_add_norm.py)."""
    if x.hg.is_cuda:
        from vllm_cluster.kernels.linear.triton_w8_gemv import gemv_w8

        return gemv_w8(x.hg, qweight, scale, bias, silu_mul=silu_mul, rms=x)
    if silu_mul:
        return w8_linear_silu_mul(linear, x.materialize(), qweight, scale, bias)
    return linear(x.materialize(), qweight, scale, bias)


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (q [M, K] float8_e4m3fn, scale [M, 1] fp32)."""
    if not x.is_cuda:
        return per_token_quant_fp8_reference(x)
    from vllm_cluster.kernels.linear.triton_fp8_quant import per_token_quant_fp8 as triton_quant

    return triton_quant(x.contiguous())


def fp8_linear(
    x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x: [M, K]; qweight: [N, K] float8_e4m3fn; weight_scale: [1, N] fp32 -> [M, N]."""
    if x.shape[0] <= FP8_WEIGHT_ONLY_MAX_ROWS:
        if not x.is_cuda:
            return torch_ops.weight_only(x, qweight, weight_scale.reshape(-1), bias)
        return _w8_triton(x, qweight, weight_scale, bias)
    xq, x_scale = per_token_quant_fp8(x)
    if not x.is_cuda:
        return torch_ops.fp8_w8a8(x, xq, x_scale, qweight, weight_scale, bias)
    # Rowwise scaling needs a bf16 result; mat2 is qweight's column-major [K, N] view.
    y = torch._scaled_mm(xq, qweight.t(), scale_a=x_scale, scale_b=weight_scale, out_dtype=torch.bfloat16)
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)
