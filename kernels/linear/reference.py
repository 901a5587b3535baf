"""Torch references for the quantized linear kernels: the plain definitions (dequantize the
whole weight, multiply in fp32) the Triton kernels and the CPU paths are tested against.

- INT8 weight-only: w [N, K] int8, one fp32 scale per output row;
  y = x @ (w * scale[:, None]).T + bias.
- FP8: w [N, K] float8_e4m3fn, one fp32 scale per output row, by the number of rows of x:
  weight-only (w8a16) up to FP8_WEIGHT_ONLY_MAX_ROWS, W8A8 above (x quantized per token).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
MIN_AMAX = 1e-12  # the same floor as kernels/linear/triton_fp8_quant.py
# Up to this many rows FP8 runs weight-only (a decode step reads the weight once: fp8 tensor
# cores gain nothing, and quantizing x would be a second launch); above, W8A8 on _scaled_mm.
FP8_WEIGHT_ONLY_MAX_ROWS = 16


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
