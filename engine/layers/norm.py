"""RMSNorm, with the residual add fused in (one call per norm site), and `add_norm`: a
projection followed by the norm, in the projection's launch where its batch-1 GEMV can.

Gemma's RMSNorm (`unit_offset`) stores its scale minus one, as HF checkpoints do, and
multiplies by 1 + weight in fp32 before the one cast to the model's dtype, exactly as
transformers does (the same kernels, in their unit_offset variant). The GEMV-fused add-norm
paths (`add_norm`) do not take it.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_cluster.kernels.elementwise.dispatch import fused_add_rms_norm
from vllm_cluster.kernels.linear.add_norm import AddNorm, Normed


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.unit_offset = unit_offset  # Gemma: the scale is 1 + weight (see the module docstring)
        self.weight = nn.Parameter(torch.zeros(hidden_size) if unit_offset else torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); x: [T, D]."""
        return fused_add_rms_norm(x, residual, self.weight, self.eps, self.unit_offset)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dim of any shape (Qwen3's per-head q/k norm: [T, H, D])."""
        shape = x.shape
        out, _ = self(x.reshape(-1, shape[-1]))
        return out.view(shape)


def add_norm(
    proj: nn.Module, x: torch.Tensor | Normed, residual: torch.Tensor, norm: RMSNorm, slot: torch.Tensor | None = None
) -> tuple[torch.Tensor | Normed, torch.Tensor]:
    """`norm(proj(x), residual)`: (norm(proj(x) + residual), proj(x) + residual). Given a slot
    (a zeroed [1] fp64 tensor), a module with `forward_add_norm` (the dense, fp8, int8 and
    INT4 linears; the MLP through its down_proj) has its batch-1 GEMV do the first half of the
    norm, and the normed half is a `kernels.Normed` for the GEMV after to finish
    (kernels/linear/triton_add_norm.py)."""
    assert not norm.unit_offset, "the fused add-norm paths scale by the weight itself"
    return project_add_norm(proj, x, AddNorm(residual, norm.weight, norm.eps, slot))


def project_add_norm(
    proj: nn.Module, x: torch.Tensor | Normed, spec: AddNorm
) -> tuple[torch.Tensor | Normed, torch.Tensor]:
    """`spec.after(proj(x))`, through proj's `forward_add_norm` where it has one."""
    fused = getattr(proj, "forward_add_norm", None)
    if fused is None:
        return spec.after(proj(x))
    out: tuple[torch.Tensor | Normed, torch.Tensor] = fused(x, spec)
    return out
