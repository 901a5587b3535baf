"""The FP8 KV cache: what a cache of float8_e4m3fn stores, and how it reads back.

Each layer has one fp32 scale for K and one for V. A write stores value / scale, saturated
to +-448 (e4m3's largest finite value: it has no infinity, and an overflow would be NaN); a
read gives fp8 * scale. The kernels fold k_scale into the softmax scale and apply v_scale
to the output. Scales are device tensors of shape [1], so a CUDA graph captures them by
address. A cache of any other dtype stores values as they are and ignores the scales.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_KV_DTYPE).max)  # 448.0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def quantize(x: torch.Tensor, scale: torch.Tensor | float | None, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `dtype` stores it."""
    if not is_fp8(dtype):
        return x.to(dtype)
    assert scale is not None, "an fp8 KV cache needs its k_scale / v_scale"
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor | float | None, dtype: torch.dtype) -> torch.Tensor:
    """Values read from a cache (x in its dtype), in `dtype`."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    assert scale is not None, "an fp8 KV cache needs its k_scale / v_scale"
    return (x.float() * scale).to(dtype)


def scale_value(scale: torch.Tensor | float | None) -> float:
    """A host-side scale (the CPU path's SDPA takes a Python float); 1.0 for None."""
    return 1.0 if scale is None else float(scale)
