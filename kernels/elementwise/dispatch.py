"""The elementwise kernels' one dispatch point: on CUDA tensors the Triton kernels
(`triton_ops.py`), elsewhere the torch path (`torch_ops.py`); `reference.py` holds the plain
definitions both are tested against."""

from __future__ import annotations

import torch

from vllm_cluster.kernels.elementwise import torch_ops


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_norm(x + residual), x + residual); x: [T, D]. unit_offset (Gemma): the
    scale is 1 + weight, applied in fp32 (kernels/elementwise/reference.py)."""
    if not x.is_cuda:
        return torch_ops.fused_add_rms_norm(x, residual, weight, eps, unit_offset)
    from vllm_cluster.kernels.elementwise import triton_ops

    return triton_ops.fused_add_rms_norm(x, residual, weight, eps, unit_offset)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary; q: [T, Hq, D], k: [T, Hkv, D], cos/sin: [T, D/2] fp32."""
    if not q.is_cuda:
        return torch_ops.rotary_embedding(q, k, cos, sin)
    from vllm_cluster.kernels.elementwise import triton_ops

    return triton_ops.rotary_embedding(q, k, cos, sin)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] = [gate | up] -> gelu_tanh(gate) * up: [T, I] (GeGLU)."""
    if not x.is_cuda:
        return torch_ops.gelu_tanh_and_mul(x)
    from vllm_cluster.kernels.elementwise import triton_ops

    return triton_ops.gelu_tanh_and_mul(x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] = [gate | up] -> silu(gate) * up: [T, I]."""
    if not x.is_cuda:
        return torch_ops.silu_and_mul(x)
    from vllm_cluster.kernels.elementwise import triton_ops

    return triton_ops.silu_and_mul(x)
