"""The gated MLP: gate_up_proj ([gate | up] fused), act(gate) * up, down_proj. `activation`
"silu" is SwiGLU (the fused SiLU-and-mul kernels); "gelu_pytorch_tanh" is Gemma's GeGLU,
gelu's tanh approximation: its own elementwise launch after gate_up_proj (on CUDA a Triton
kernel; not folded into the batch-1 GEMV as SiLU-and-mul is).

`down_scale` multiplies down_proj's input, which scales its output the same way (no bias):
Granite's residual_multiplier, kept out of the weights so that LoRA and quantized layers see
the checkpoint's own tensors."""

from __future__ import annotations

import torch
from torch import nn

from vllm_cluster.engine.layers.linear import Linear
from vllm_cluster.engine.layers.norm import project_add_norm
from vllm_cluster.kernels.elementwise.dispatch import gelu_tanh_and_mul, silu_and_mul
from vllm_cluster.kernels.linear.add_norm import AddNorm, Normed


class MLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, down_scale: float = 1.0, activation: str = "silu"
    ) -> None:
        super().__init__()
        assert activation in ("silu", "gelu_pytorch_tanh"), f"activation {activation!r}"
        self.activation = activation
        self.intermediate_size = intermediate_size
        self.down_scale = down_scale
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor | Normed) -> torch.Tensor:
        return self.down_proj(self.act(x))

    def forward_add_norm(self, x: torch.Tensor | Normed, spec: AddNorm) -> tuple[torch.Tensor | Normed, torch.Tensor]:
        """`spec.after(self(x))`, down_proj's GEMV doing the norm's first half where it can
        (engine/layers/norm.py)."""
        return project_add_norm(self.down_proj, self.act(x), spec)

    @property
    def takes_normed(self) -> bool:
        """Whether x may be a kernels.Normed (gate_up_proj finishes it)."""
        return bool(getattr(self.gate_up_proj, "takes_normed", False))

    def act(self, x: torch.Tensor | Normed) -> torch.Tensor:
        """act(gate) * up (times down_scale). For SiLU, a gate_up layer with forward_silu_mul (dense,
        fp8, int8, INT4) applies SiLU-and-mul inside its batch-1 GEMV; LoRA layers are
        followed by the separate kernel."""
        if self.activation == "gelu_pytorch_tanh":
            out = gelu_tanh_and_mul(self.gate_up_proj(x))
        else:
            fused = getattr(self.gate_up_proj, "forward_silu_mul", None)
            out = fused(x) if fused is not None else silu_and_mul(self.gate_up_proj(x))
        return out if self.down_scale == 1.0 else out * self.down_scale
