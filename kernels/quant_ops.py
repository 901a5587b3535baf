"""Quantized linear layers: the plain definitions, the CPU paths and the one dispatch
point of each (Triton / cuBLAS on CUDA tensors, torch elsewhere).

- INT8 weight-only: w [N, K] int8, one fp32 scale per output row;
  y = x @ (w * scale[:, None]).T + bias.
- FP8: w [N, K] float8_e4m3fn, one fp32 scale per output row. Two products, chosen by the
  number of rows of x alone (so a CUDA graph captures one of them):
  - up to FP8_WEIGHT_ONLY_MAX_ROWS (decode), w8a16: y = x @ (wq * w_scale).T + bias, the
    weight read once in fp8 and widened in registers (one Triton launch, x not quantized);
  - above (prefill, large batches), W8A8: x is quantized per token at run time
    (`per_token_quant_fp8`); y = (xq @ wq.T) * x_scale * w_scale + bias, on fp8 tensor
    cores through `torch._scaled_mm` (rowwise scales).
  Both accumulate in fp32. The CPU path computes the same products in fp32 from the same
  fp8 values, so CPU tests see the numerics of the GPU path up to the order of the sums.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_cluster.kernels.dispatch import AddNorm, Normed

FP8_MAX = 448.0  # largest finite float8_e4m3fn
MIN_AMAX = 1e-12  # the same floor as kernels/triton_fp8_quant.py
# The CPU paths dequantize the weight this many elements at a time, so the dequantized
# block stays in cache instead of materialising a full-precision copy of the weight.
_CPU_CHUNK_ELEMS = 1 << 20
# On CUDA, above this many rows dequantize once and let cuBLAS multiply (compute-bound);
# at or below it the Triton kernel reads int8 directly (bandwidth-bound).
_INT8_TRITON_MAX_ROWS = 256
# Up to this many rows FP8 runs weight-only (a decode step reads the weight once: fp8 tensor
# cores gain nothing, and quantizing x would be a second launch); above, W8A8 on _scaled_mm.
FP8_WEIGHT_ONLY_MAX_ROWS = 16
# Rows up to which 1-byte weights take the GEMV (kernels/triton_gemv.py): it repeats the
# weight's conversion for each row; on the H200 the 16-row tiles were faster at 4 rows on
# every llama-8b shape and at 2 rows on gate_up (docs/benchmarks.md).
_W8_GEMV_MAX_ROWS = 1


def int8_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The definition: dequantize the whole weight, multiply in fp32. x: [M, K] -> [M, N]."""
    w = qweight.float() * scale.float()[:, None]
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def per_token_quant_fp8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (q [M, K] float8_e4m3fn, scale [M, 1] fp32), x ~= q * scale."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = amax.clamp(min=MIN_AMAX) / FP8_MAX
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The definition of `fp8_linear`: weight-only up to FP8_WEIGHT_ONLY_MAX_ROWS rows of x,
    W8A8 above. weight_scale: [N] or [1, N] fp32."""
    if x.shape[0] <= FP8_WEIGHT_ONLY_MAX_ROWS:
        return fp8_weight_only_reference(x, qweight, weight_scale, bias)
    return fp8_w8a8_reference(x, qweight, weight_scale, bias)


def fp8_weight_only_reference(
    x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """w8a16: x @ (wq * w_scale).T + bias in fp32, x as it is."""
    return int8_linear_reference(x, qweight, weight_scale.reshape(-1), bias)


def fp8_w8a8_reference(
    x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """W8A8: x quantized per token, (xq @ wq.T) * x_scale * w_scale + bias in fp32."""
    xq, x_scale = per_token_quant_fp8_reference(x)
    y = (xq.float() @ qweight.float().t()) * x_scale * weight_scale.reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x: [M, K]; qweight: [N, K] int8; scale: [N] fp32; bias: [N] | None -> [M, N]."""
    if not x.is_cuda:
        return _weight_only_cpu(x, qweight, scale, bias)
    if x.shape[0] > _INT8_TRITON_MAX_ROWS:
        # int8 -> x.dtype is exact; scaling the product, not the weight, rounds once.
        y = torch.nn.functional.linear(x, qweight.to(x.dtype)) * scale.to(x.dtype)
        return y if bias is None else y + bias
    return _w8_triton(x, qweight, scale, bias)


def _weight_only_cpu(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """int8 and fp8 values are exact in x's dtype. The per-row scale factors out of the K
    sum: scale the [M, rows] product, not the weight. scale: [N] fp32."""
    return _chunked_over_n(x, qweight, bias, lambda w, rows: (x @ w.to(x.dtype).t()) * scale[rows].to(x.dtype))


def _w8_triton(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The weight-only Triton kernels for 1-byte weights: the GEMV for a few rows, else tiles."""
    from vllm_cluster.kernels.triton_gemv import gemv_w8
    from vllm_cluster.kernels.triton_int8_gemm import int8_gemm

    if x.shape[0] <= _W8_GEMV_MAX_ROWS:
        return gemv_w8(x, qweight, scale, bias)
    return int8_gemm(x.contiguous(), qweight, scale, bias)


def w8_linear_silu_mul(
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """`silu_and_mul(linear(x, qweight, scale, bias))` (linear: int8_linear or fp8_linear) for a
    [gate | up] weight; where both run the 1-byte GEMV (rows of x up to _W8_GEMV_MAX_ROWS on
    CUDA), one launch that applies SiLU-and-mul to its sums, rounded as the two launches round."""
    if x.is_cuda and x.shape[0] <= _W8_GEMV_MAX_ROWS:
        from vllm_cluster.kernels.triton_gemv import gemv_w8

        return gemv_w8(x, qweight, scale, bias, silu_mul=True)
    from vllm_cluster.kernels.dispatch import silu_and_mul

    return silu_and_mul(linear(x, qweight, scale, bias))


def w8_linear_add_norm(
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    add_norm: AddNorm,
) -> tuple[torch.Tensor | Normed, torch.Tensor]:
    """`add_norm.after(linear(x, qweight, scale, bias))` (linear: int8_linear or fp8_linear):
    (normed, h); at one row on CUDA, where both run the 1-byte GEMV, the normed half is a
    `Normed` for the GEMV after to finish (kernels/triton_add_norm.py)."""
    if add_norm.in_epilogue(x):
        from vllm_cluster.kernels.triton_gemv import gemv_w8_add_norm

        hg, h = gemv_w8_add_norm(x, qweight, scale, bias, add_norm)
        return add_norm.deferred(hg), h
    return add_norm.after(linear(x, qweight, scale, bias))


def w8_linear_normed(
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
    x: Normed,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    silu_mul: bool = False,
) -> torch.Tensor:
    """`linear` (with silu_mul `w8_linear_silu_mul`) of x.materialize(); on CUDA the 1-byte
    GEMV finishes the norm itself (kernels/triton_add_norm.py)."""
    if x.hg.is_cuda:
        from vllm_cluster.kernels.triton_gemv import gemv_w8

        return gemv_w8(x.hg, qweight, scale, bias, silu_mul=silu_mul, rms=x)
    if silu_mul:
        return w8_linear_silu_mul(linear, x.materialize(), qweight, scale, bias)
    return linear(x.materialize(), qweight, scale, bias)


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (q [M, K] float8_e4m3fn, scale [M, 1] fp32)."""
    if not x.is_cuda:
        return per_token_quant_fp8_reference(x)
    from vllm_cluster.kernels.triton_fp8_quant import per_token_quant_fp8 as triton_quant

    return triton_quant(x.contiguous())


def fp8_linear(
    x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x: [M, K]; qweight: [N, K] float8_e4m3fn; weight_scale: [1, N] fp32 -> [M, N]."""
    if x.shape[0] <= FP8_WEIGHT_ONLY_MAX_ROWS:
        if not x.is_cuda:
            return _weight_only_cpu(x, qweight, weight_scale.reshape(-1), bias)
        return _w8_triton(x, qweight, weight_scale, bias)
    xq, x_scale = per_token_quant_fp8(x)
    if not x.is_cuda:
        xf = xq.float()
        return _chunked_over_n(
            x, qweight, bias, lambda w, rows: ((xf @ w.float().t()) * x_scale * weight_scale[:, rows]).to(x.dtype)
        )
    # Rowwise scaling needs a bf16 result; mat2 is qweight's column-major [K, N] view.
    y = torch._scaled_mm(xq, qweight.t(), scale_a=x_scale, scale_b=weight_scale, out_dtype=torch.bfloat16)
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)


def _chunked_over_n(
    x: torch.Tensor,
    qweight: torch.Tensor,
    bias: torch.Tensor | None,
    block: Callable[[torch.Tensor, slice], torch.Tensor],
) -> torch.Tensor:
    """y[:, rows] = block(qweight[rows], rows) for row slices of the weight, then + bias."""
    n, k = qweight.shape
    rows_per_chunk = max(1, _CPU_CHUNK_ELEMS // max(1, k))
    if rows_per_chunk >= n:
        y = block(qweight, slice(0, n))
    else:
        y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        for start in range(0, n, rows_per_chunk):
            rows = slice(start, min(n, start + rows_per_chunk))
            y[:, rows] = block(qweight[rows], rows)
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)
