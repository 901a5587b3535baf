"""OLMo 2's decoder layer: the Llama layer's attention and MLP with the norms moved after
them, each output normalised before its residual add, and no norm on the layer's input:

    h   = x + post_attention_layernorm(attention(x))
    out = h + post_feedforward_layernorm(mlp(h))

Attention normalises q and k over the whole projection (all heads at once, not per head).
With no input norm there is nothing for the next layer's qkv GEMV to finish, so these
layers run unfused (DecoderModel.forward_unfused). No distributed code here.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_cluster.engine.layers.attention import Attention
from vllm_cluster.engine.layers.mlp import MLP
from vllm_cluster.engine.layers.norm import RMSNorm
from vllm_cluster.engine.layers.rotary import Rope
from vllm_cluster.kernels.attention.metadata import AttentionMetadata


class PostNormDecoderLayer(nn.Module):
    def __init__(self, self_attn: Attention, mlp: MLP, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden_size, eps)

    def forward(
        self,
        rope: Rope,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pipeline contract of DecoderLayer.forward: the layer's input is x + residual
        (x alone where residual is None); returns (normed MLP output, h), whose sum is the
        layer's output."""
        hidden = x if residual is None else x + residual  # [T, D]
        attn, _ = self.post_attention_layernorm(self.self_attn(rope, hidden, kv_cache, meta))
        hidden = hidden + attn
        out, _ = self.post_feedforward_layernorm(self.mlp(hidden))
        return out, hidden
