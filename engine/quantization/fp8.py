"""FP8 (online): weights (each linear's, and each routed MoE expert's:
engine/quantization/experts.py) become float8_e4m3fn with one fp32 scale per output channel
(scale = amax(|w_row|) / 448). Up to kernels/linear/dispatch.FP8_WEIGHT_ONLY_MAX_ROWS rows
(decode) the product is weight-only (w8a16: a Triton GEMV / tile kernel widens the fp8
weight in registers); above, W8A8: activations are quantized per token at run time
(kernels/linear/dispatch.per_token_quant_fp8) and the product runs on fp8 tensor cores through
`torch._scaled_mm`. On CPU both are emulated in fp32 from the same fp8 values.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_cluster.engine.quantization.experts import W8Format
from vllm_cluster.engine.quantization.online import OnlineMethod
from vllm_cluster.kernels.linear.add_norm import AddNorm, Normed
from vllm_cluster.kernels.linear.dispatch import (
    fp8_linear,
    w8_linear_add_norm,
    w8_linear_normed,
    w8_linear_silu_mul,
)
from vllm_cluster.kernels.linear.reference import FP8_MAX


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q [N, K] float8_e4m3fn, scale [N] fp32), weight ~= q * scale[:, None]."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.reshape(-1)[:, None]


def check_fp8_shape(out_features: int, in_features: int, device: torch.device) -> None:
    if device.type == "cuda" and (in_features % 16 or out_features % 16):
        raise ValueError(
            f"fp8 on CUDA needs in/out features divisible by 16 (torch._scaled_mm); got "
            f"{in_features} x {out_features}: use quantization 'int8' for this model"
        )


class Fp8Linear(nn.Module):
    """x [T, in_features] -> [T, out_features] with an fp8 weight and fp8 activations."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        check_fp8_shape(out_features, in_features, device)
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer(
            "qweight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device)
        )
        # [1, N]: the layout torch._scaled_mm takes for rowwise scale_b.
        self.register_buffer("weight_scale", torch.empty(1, out_features, dtype=torch.float32, device=device))
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    qweight: torch.Tensor  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor  # [1, N] fp32

    def quantize_from(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        q, scale = quantize_fp8(weight)
        self.qweight.copy_(q)
        self.weight_scale.copy_(scale[None, :])
        if self.bias is not None:
            assert bias is not None
            self.bias.data.copy_(bias)

    takes_normed = True  # a kernels.linear.add_norm.Normed x (engine/layers/linear.py)

    def forward(self, x: torch.Tensor | Normed) -> torch.Tensor:
        # x: [T, K] -> [T, N]
        if isinstance(x, Normed):
            return w8_linear_normed(fp8_linear, x, self.qweight, self.weight_scale, self.bias)
        return fp8_linear(x, self.qweight, self.weight_scale, self.bias)

    def forward_silu_mul(self, x: torch.Tensor | Normed) -> torch.Tensor:
        # gate_up_proj: x [T, K] -> silu(gate) * up [T, out_features / 2]
        if isinstance(x, Normed):
            return w8_linear_normed(fp8_linear, x, self.qweight, self.weight_scale, self.bias, silu_mul=True)
        return w8_linear_silu_mul(fp8_linear, x, self.qweight, self.weight_scale, self.bias)

    def forward_add_norm(self, x: torch.Tensor, add_norm: AddNorm) -> tuple[torch.Tensor | Normed, torch.Tensor]:
        # o_proj, down_proj: x [T, K] -> (normed, h) of the norm after (engine/layers/norm.py)
        return w8_linear_add_norm(fp8_linear, x, self.qweight, self.weight_scale, self.bias, add_norm)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 (w8a16 decode, w8a8 prefill)"


def _fp8_product(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return fp8_linear(x, qweight, scale[None, :], None)  # scale [1, N], as Fp8Linear keeps it


FP8_EXPERTS = W8Format("fp8", torch.float8_e4m3fn, quantize_fp8, _fp8_product, check_fp8_shape)


class Fp8Method(OnlineMethod):
    name = "fp8"
    linear_class = Fp8Linear
    expert_format = FP8_EXPERTS
