"""Dynamic per-token FP8 quantization of activations, one program per row:
scale = max(amax(|x_row|), MIN_AMAX) / 448, q = fp8_e4m3fn(clamp(x_row / scale, ±448)).

One launch instead of the five a torch expression takes (abs, amax, divide, clamp,
cast): this runs before every quantized linear of a decode step. Definition:
`kernels/linear/dispatch.per_token_quant_fp8_reference`. No host sync: graph-capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
MIN_AMAX = 1e-12  # an all-zero row (a padding token) gets a tiny scale, not a division by 0


@triton.jit
def _per_token_quant_fp8_kernel(
    x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, MIN: tl.constexpr, FMAX: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.maximum(amax, MIN) / FMAX
    q = tl.clamp(x / scale, -FMAX, FMAX)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K)
    tl.store(scale_ptr + row, scale)


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (q [M, K] float8_e4m3fn, scale [M, 1] fp32) with x ~= q * scale."""
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [M, K] with contiguous rows"
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    num_warps = 4 if block <= 4096 else 8
    _per_token_quant_fp8_kernel[(m,)](
        x, q, scale, k, x.stride(0), q.stride(0), MIN=MIN_AMAX, FMAX=FP8_MAX, BLOCK=block, num_warps=num_warps
    )
    return q, scale
