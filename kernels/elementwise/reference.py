"""Torch references for the elementwise kernels (fused add + RMS norm, rotary embedding,
SiLU-and-mul): the definition each Triton kernel is tested against, written for clarity."""

from __future__ import annotations

import torch


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (weight * rms_norm(x + residual), x + residual); x: [T, D]. Normalises in fp32,
    scales in x's dtype, as HF transformers does. unit_offset (Gemma): scales by 1 + weight in
    fp32 and casts once, as HF's Gemma RMSNorm does."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (normed * (1.0 + weight.float())).to(x.dtype), x
    return weight * normed.to(x.dtype), x


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (NeoX/HF) rotary: q [T, Hq, D], k [T, Hkv, D], cos/sin [T, D/2] fp32
    (any scaling, llama3 included, is already in the tables)."""

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] = [gate | up] -> gelu(gate) * up: [T, I], gelu's tanh approximation (GeGLU)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] = [gate | up] -> silu(gate) * up: [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
