"""The model's dense linear layer: nn.Linear (same parameters, same checkpoint names, so
quantization, LoRA and tensor parallelism treat it as one), computed through
`kernels.linear`, which sends a batch-1 decode row on CUDA to the Triton GEMV.
`forward_silu_mul` is the [gate | up] layer followed by SiLU-and-mul, one GEMV launch at
batch 1 (the fp8 and int8 layers have it too; the MLP falls back to two calls without it).
`forward_add_norm` is the layer followed by the residual add and RMS norm (o_proj,
down_proj): at batch 1 its GEMV does the first half of the norm and returns a
`kernels.Normed`, which `forward` and `forward_silu_mul` of the layer after (qkv_proj,
gate_up_proj) take as x and whose GEMV finishes it (kernels/linear/triton_add_norm.py). The fp8,
int8 and INT4 layers have the same methods and `takes_normed`; engine/layers/norm.py falls
back to the norm's own launch for layers without them (LoRA, tensor-parallel)."""

from __future__ import annotations

import torch
from torch import nn

from vllm_cluster.kernels.linear.add_norm import AddNorm, Normed
from vllm_cluster.kernels.linear.dispatch import linear, linear_add_norm, linear_silu_mul


class Linear(nn.Linear):
    takes_normed = True

    def forward(self, x: torch.Tensor | Normed) -> torch.Tensor:
        # x: [T, in_features] -> [T, out_features]
        return linear(x, self.weight, self.bias)

    def forward_silu_mul(self, x: torch.Tensor | Normed) -> torch.Tensor:
        # gate_up_proj: x [T, in_features] -> silu(gate) * up [T, out_features / 2]
        return linear_silu_mul(x, self.weight, self.bias)

    def forward_add_norm(self, x: torch.Tensor, add_norm: AddNorm) -> tuple[torch.Tensor | Normed, torch.Tensor]:
        # o_proj, down_proj: x [T, in_features] -> (normed, h) of the norm after, [T, out_features] each
        return linear_add_norm(x, self.weight, self.bias, add_norm)
