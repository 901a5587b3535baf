"""Gemma 2 and Gemma 3 (text): the shared decoder (engine/models/llama.py) with four norms per
layer, all of them Gemma's RMSNorm (scale 1 + weight, in fp32: engine/layers/norm.py):

    h   = x + post_attention_layernorm(attention(input_layernorm(x)))
    out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))

The MLP is GeGLU (gelu, tanh approximation); the embeddings are scaled by sqrt(hidden_size)
rounded to the model's dtype; the softmax scale is query_pre_attn_scalar ** -0.5; logits may
be soft-capped (final_logit_softcapping: CausalLM.compute_logits). Sliding layers attend within
sliding_window, the others globally (ModelArchConfig.gemma.layer_windows). Gemma 2 soft-caps
the attention scores (attn_logit_softcapping: Attention.softcap, which the attention kernels
apply on CPU and CUDA alike). Gemma 3 normalises each head of q and k and rotates its sliding
layers with a base of their own, unscaled (DualRotary). The layers keep the pipeline contract
of DecoderLayer.forward and run unfused (DecoderModel.forward_unfused). No distributed code here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from vllm_cluster.engine.layers.attention import Attention
from vllm_cluster.engine.layers.mlp import MLP
from vllm_cluster.engine.layers.norm import RMSNorm
from vllm_cluster.engine.layers.rotary import Rope, RotaryEmbedding
from vllm_cluster.engine.models.config import ModelArchConfig
from vllm_cluster.kernels.attention.metadata import AttentionMetadata


class DualRope(NamedTuple):
    """Gemma 3's two rotations of one step's positions."""

    full: Rope  # global layers: rope_theta and rope scaling
    local: Rope  # sliding layers: rope_local_base_freq


class DualRotary(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        assert config.gemma is not None and config.gemma.local_rope_theta is not None
        max_position = config.max_position_embeddings
        self.full = RotaryEmbedding(config.head_dim, max_position, config.rope_theta, config.rope_scaling)
        self.local = RotaryEmbedding(config.head_dim, max_position, config.gemma.local_rope_theta)

    def forward(self, positions: torch.Tensor) -> DualRope:
        return DualRope(self.full(positions), self.local(positions))


def make_rotary(config: ModelArchConfig) -> nn.Module:
    """The model's rotary: one table, or Gemma 3's two."""
    if config.gemma is not None and config.gemma.local_rope_theta is not None:
        return DualRotary(config)
    return RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling)


def _scale(config: ModelArchConfig) -> float:
    assert config.gemma is not None
    return float(config.gemma.query_pre_attn_scalar**-0.5)


def make_attention(config: ModelArchConfig, layer_id: int) -> Attention:
    assert config.gemma is not None
    window = config.gemma.layer_windows[layer_id]
    attention = Attention(
        config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
        qkv_bias=False, qk_norm_eps=None, scale=_scale(config), sliding_window=window,
        softcap=config.gemma.attn_logit_softcapping,
    )  # fmt: skip
    if config.qk_norm:  # Gemma 3: each head of q and k, Gemma's RMSNorm
        attention.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, unit_offset=True)
        attention.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, unit_offset=True)
    return attention


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, layer_id: int) -> None:
        super().__init__()
        assert config.gemma is not None
        self.is_sliding = config.gemma.layer_windows[layer_id] is not None
        self.self_attn = make_attention(config, layer_id)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, activation=config.hidden_act)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(size, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(size, eps, unit_offset=True)

    def forward(
        self,
        rope: Rope | DualRope,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pipeline contract of DecoderLayer.forward: the layer's input is x + residual
        (x alone where residual is None); returns (normed MLP output, h), whose sum is the
        layer's output."""
        if isinstance(rope, DualRope):
            rope = rope.local if self.is_sliding else rope.full
        normed, hidden = self.input_layernorm(x, residual)  # [T, D] each
        attn, _ = self.post_attention_layernorm(self.self_attn(rope, normed, kv_cache, meta))
        normed, hidden = self.pre_feedforward_layernorm(attn, hidden)  # hidden + attn, as HF adds
        out, _ = self.post_feedforward_layernorm(self.mlp(normed))
        return out, hidden
