"""RMSNorm, with the residual add fused in (one call per norm site)."""

from __future__ import annotations

import torch
from torch import nn

from kernels import fused_add_rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); x: [T, D]."""
        return fused_add_rms_norm(x, residual, self.weight, self.eps)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dim of any shape (Qwen3's per-head q/k norm: [T, H, D])."""
        shape = x.shape
        out, _ = fused_add_rms_norm(x.reshape(-1, shape[-1]), None, self.weight, self.eps)
        return out.view(shape)
