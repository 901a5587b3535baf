"""The model's dense linear layer: nn.Linear (same parameters, same checkpoint names, so
quantization, LoRA and tensor parallelism treat it as one), computed through
`kernels.linear`, which sends a batch-1 decode row on CUDA to the Triton GEMV.
`forward_silu_mul` is the [gate | up] layer followed by SiLU-and-mul, one GEMV launch at
batch 1 (the fp8 and int8 layers have it too; the MLP falls back to two calls without it).
`forward_add_norm` is the layer followed by the residual add and RMS norm (o_proj,
down_proj), one GEMV launch at batch 1 (the fp8, int8 and INT4 layers have it too;
engine/layers/norm.py's `add_norm` falls back to two calls without it)."""

from __future__ import annotations

import torch
from torch import nn

from kernels import AddNorm, linear, linear_add_norm, linear_silu_mul


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] -> [T, out_features]
        return linear(x, self.weight, self.bias)

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        # gate_up_proj: x [T, in_features] -> silu(gate) * up [T, out_features / 2]
        return linear_silu_mul(x, self.weight, self.bias)

    def forward_add_norm(self, x: torch.Tensor, add_norm: AddNorm) -> tuple[torch.Tensor, torch.Tensor]:
        # o_proj, down_proj: x [T, in_features] -> (normed, h) of the norm after, [T, out_features] each
        return linear_add_norm(x, self.weight, self.bias, add_norm)
