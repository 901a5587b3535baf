"""The torch paths of the quantized linears, used on CPU: int8 and fp8 values are exact in
x's dtype, so they compute the products of kernels/linear/reference.py up to the order of
the sums, a block of weight rows at a time (the dequantized block stays in cache instead of
materialising a full-precision copy of the weight)."""

from __future__ import annotations

from collections.abc import Callable

import torch

# The CPU paths dequantize the weight this many elements at a time.
CPU_CHUNK_ELEMS = 1 << 20


def weight_only(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The per-row scale factors out of the K sum: scale the [M, rows] product, not the
    weight. scale: [N] fp32."""
    return _chunked_over_n(x, qweight, bias, lambda w, rows: (x @ w.to(x.dtype).t()) * scale[rows].to(x.dtype))


def fp8_w8a8(
    x: torch.Tensor, xq: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """(xq @ wq.T) * x_scale * w_scale + bias in fp32, in x's dtype; xq, x_scale: x quantized per token."""
    xf = xq.float()
    return _chunked_over_n(
        x, qweight, bias, lambda w, rows: ((xf @ w.float().t()) * x_scale * weight_scale[:, rows]).to(x.dtype)
    )


def _chunked_over_n(
    x: torch.Tensor,
    qweight: torch.Tensor,
    bias: torch.Tensor | None,
    block: Callable[[torch.Tensor, slice], torch.Tensor],
) -> torch.Tensor:
    """y[:, rows] = block(qweight[rows], rows) for row slices of the weight, then + bias."""
    n, k = qweight.shape
    rows_per_chunk = max(1, CPU_CHUNK_ELEMS // max(1, k))
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
