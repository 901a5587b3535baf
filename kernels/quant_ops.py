"""Quantized linear layers: the plain definitions, the CPU paths and the one dispatch
point of each (Triton / cuBLAS on CUDA tensors, torch elsewhere).

- INT8 weight-only: w [N, K] int8, one fp32 scale per output row;
  y = x @ (w * scale[:, None]).T + bias.
- FP8 W8A8: w [N, K] float8_e4m3fn, one fp32 scale per output row; x is quantized per
  token at run time (`per_token_quant_fp8`); y = (xq @ wq.T) * x_scale * w_scale + bias,
  accumulated in fp32. On CUDA the product is `torch._scaled_mm` (rowwise scales); the CPU
  path computes the same product in fp32 from the same fp8 values, so CPU tests see the
  numerics of the GPU path up to the order of the fp32 sums.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
MIN_AMAX = 1e-12  # the same floor as kernels/triton_fp8_quant.py
# The CPU paths dequantize the weight this many elements at a time, so the dequantized
# block stays in cache instead of materialising a full-precision copy of the weight.
_CPU_CHUNK_ELEMS = 1 << 20
# On CUDA, above this many rows dequantize once and let cuBLAS multiply (compute-bound);
# at or below it the Triton kernel reads int8 directly (bandwidth-bound).
_INT8_TRITON_MAX_ROWS = 256


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
    """The definition; weight_scale: [N] or [1, N] fp32."""
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
        # The per-row scale factors out of the K sum: scale the [M, rows] product, not the weight.
        return _chunked_over_n(x, qweight, bias, lambda w, rows: (x @ w.to(x.dtype).t()) * scale[rows].to(x.dtype))
    if x.shape[0] > _INT8_TRITON_MAX_ROWS:
        # int8 -> x.dtype is exact; scaling the product, not the weight, rounds once.
        y = torch.nn.functional.linear(x, qweight.to(x.dtype)) * scale.to(x.dtype)
        return y if bias is None else y + bias
    from kernels.triton_int8_gemm import int8_gemm

    return int8_gemm(x.contiguous(), qweight, scale, bias)


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (q [M, K] float8_e4m3fn, scale [M, 1] fp32)."""
    if not x.is_cuda:
        return per_token_quant_fp8_reference(x)
    from kernels.triton_fp8_quant import per_token_quant_fp8 as triton_quant

    return triton_quant(x.contiguous())


def fp8_linear(
    x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x: [M, K]; qweight: [N, K] float8_e4m3fn; weight_scale: [1, N] fp32 -> [M, N]."""
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
