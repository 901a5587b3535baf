"""The model's dense linear layer: nn.Linear (same parameters, same checkpoint names, so
quantization, LoRA and tensor parallelism treat it as one), computed through
`kernels.linear`, which sends a batch-1 decode row on CUDA to the Triton GEMV."""

from __future__ import annotations

import torch
from torch import nn

from kernels import linear


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] -> [T, out_features]
        return linear(x, self.weight, self.bias)
