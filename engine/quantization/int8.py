"""INT8 weight-only quantization (online): each linear's weight becomes int8 with one
fp32 scale per output channel, symmetric: scale = amax(|w_row|) / 127,
q = clamp(round(w / scale), -127, 127). Activations stay in the model's dtype; the
matmul dequantizes on the fly (kernels/quant_ops.int8_linear: Triton on CUDA).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.errors import ModelLoadError
from kernels.quant_ops import int8_linear

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

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None

    qweight: torch.Tensor  # [N, K] int8
    weight_scale: torch.Tensor  # [N] fp32

    def quantize_from(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        q, scale = quantize_int8(weight)
        self.qweight.copy_(q)
        self.weight_scale.copy_(scale)
        if self.bias is not None:
            assert bias is not None
            self.bias.data.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, K] -> [T, N]
        return int8_linear(x, self.qweight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


class Int8Method:
    name = "int8"
    quantizes_checkpoint = False

    def check_hf_config(self, hf_config: dict[str, Any]) -> None:
        refuse_prequantized(self.name, hf_config)

    def create_linear(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        output_sizes: list[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> nn.Module:
        return Int8Linear(in_features, out_features, bias, dtype, device)


def refuse_prequantized(method: str, hf_config: dict[str, Any]) -> None:
    """Online methods quantize ordinary weights; a checkpoint that is already quantized
    (any quantization_config) is not theirs to load."""
    qc = hf_config.get("quantization_config")
    if qc:
        declared = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise ModelLoadError(
            f"quantization {method!r} quantizes unquantized weights at load time, but the checkpoint "
            f"is already quantized (quantization_config.quant_method {declared!r}); load an "
            "unquantized (fp16/bf16/fp32) checkpoint"
        )
