"""INT8 weight-only quantization (online): each linear's weight, and each routed MoE
expert's (engine/quantization/experts.py), becomes int8 with one fp32 scale per output
channel, symmetric: scale = amax(|w_row|) / 127, q = clamp(round(w / scale), -127, 127).
Activations stay in the model's dtype; the matmul dequantizes on the fly
(kernels/linear/dispatch.int8_linear: Triton on CUDA).
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_cluster.engine.quantization.experts import W8Format
from vllm_cluster.engine.quantization.online import OnlineMethod
from vllm_cluster.kernels.linear.add_norm import AddNorm, Normed
from vllm_cluster.kernels.linear.dispatch import int8_linear, w8_linear_add_norm, w8_linear_normed, w8_linear_silu_mul

INT8_MAX = 127


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q [N, K] int8, scale [N] fp32), weight ~= q * scale[:, None]."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    # An all-zero row keeps scale 1 (q is 0 anyway) rather than dividing by zero.
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


class Int8Linear(nn.Module):
    """x [T, in_features] -> [T, out_features] with an int8 weight."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32, device=device))
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    qweight: torch.Tensor  # [N, K] int8
    weight_scale: torch.Tensor  # [N] fp32

    def quantize_from(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        q, scale = quantize_int8(weight)
        self.qweight.copy_(q)
        self.weight_scale.copy_(scale)
        if self.bias is not None:
            assert bias is not None
            self.bias.data.copy_(bias)

    takes_normed = True  # a kernels.Normed x (engine/layers/linear.py)

    def forward(self, x: torch.Tensor | Normed) -> torch.Tensor:
        # x: [T, K] -> [T, N]
        if isinstance(x, Normed):
            return w8_linear_normed(int8_linear, x, self.qweight, self.weight_scale, self.bias)
        return int8_linear(x, self.qweight, self.weight_scale, self.bias)

    def forward_silu_mul(self, x: torch.Tensor | Normed) -> torch.Tensor:
        # gate_up_proj: x [T, K] -> silu(gate) * up [T, out_features / 2]
        if isinstance(x, Normed):
            return w8_linear_normed(int8_linear, x, self.qweight, self.weight_scale, self.bias, silu_mul=True)
        return w8_linear_silu_mul(int8_linear, x, self.qweight, self.weight_scale, self.bias)

    def forward_add_norm(self, x: torch.Tensor, add_norm: AddNorm) -> tuple[torch.Tensor | Normed, torch.Tensor]:
        # o_proj, down_proj: x [T, K] -> (normed, h) of the norm after (engine/layers/norm.py)
        return w8_linear_add_norm(int8_linear, x, self.qweight, self.weight_scale, self.bias, add_norm)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def _int8_product(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return int8_linear(x, qweight, scale, None)


def _any_shape(out_features: int, in_features: int, device: torch.device) -> None:
    """The int8 kernels take every shape."""


INT8_EXPERTS = W8Format("int8", torch.int8, quantize_int8, _int8_product, _any_shape)


class Int8Method(OnlineMethod):
    name = "int8"
    linear_class = Int8Linear
    expert_format = INT8_EXPERTS
