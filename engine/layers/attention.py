"""The attention layer: project, rotate, write K/V into the paged cache, attend.

k_scale / v_scale: what an fp8 KV cache divides K and V by (kernels/attention/fp8_kv.py), one fp32
value each per layer, from the checkpoint (engine/models/kv_scales.py) or 1.0. Buffers of
shape [1] on the model's device, so CUDA graphs read them by address; a cache of the
model's dtype ignores them.

sliding_window: this layer's window W, or None for global attention: the query at position p
attends only to the keys at p - W < k <= p (W tokens, itself included, as transformers'
Mistral and Gemma do). A model may give each layer its own (Gemma 2/3 alternate).

softcap: this layer's attention logit soft-cap, or None: each score s becomes
softcap * tanh(s / softcap) before the mask and the softmax (Gemma 2's attn_logit_softcapping)."""

from __future__ import annotations

import torch
from torch import nn

from vllm_cluster.engine.layers.linear import Linear
from vllm_cluster.engine.layers.norm import RMSNorm
from vllm_cluster.engine.layers.rotary import Rope
from vllm_cluster.kernels.attention.dispatch import rotary_paged_attention
from vllm_cluster.kernels.attention.metadata import AttentionMetadata
from vllm_cluster.kernels.linear.add_norm import Normed


class Attention(nn.Module):
    k_scale: torch.Tensor  # [1] fp32 buffers (see the module docstring)
    v_scale: torch.Tensor

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        qk_norm_eps: float | None,
        scale: float | None = None,
        qk_norm_per_head: bool = True,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        assert sliding_window is None or sliding_window >= 1, f"sliding window {sliding_window}"
        assert softcap is None or softcap > 0, f"softcap {softcap}"
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.scale = head_dim**-0.5 if scale is None else scale  # the softmax scale (Granite sets its own)
        self.qkv_proj = Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, hidden_size, bias=False)
        # Qwen3 normalises each head of q and k before the rotation; OLMo 2 the whole q and
        # the whole k projection (qk_norm_per_head False).
        self.qk_norm_per_head = qk_norm_per_head
        q_norm_size, k_norm_size = (head_dim, head_dim) if qk_norm_per_head else (self.q_size, self.kv_size)
        self.q_norm = RMSNorm(q_norm_size, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(k_norm_size, qk_norm_eps) if qk_norm_eps is not None else None
        # Not in the state dict: a checkpoint's scales load by name (CausalLM.load_weights).
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)

    def forward(
        self,
        rope: Rope,
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        return self.o_proj(self.attend(rope, x, kv_cache, meta))

    def attend(
        self, rope: Rope, x: torch.Tensor | Normed, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Everything but o_proj: x [T, hidden] (a kernels.Normed only where qkv_proj
        takes_normed) -> the heads' outputs [T, Hq * D]."""
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if not self.qk_norm_per_head and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.norm(q), self.k_norm.norm(k)  # [T, Hq * D], [T, Hkv * D]
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm_per_head and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.norm(q), self.k_norm.norm(k)
        # Rotate q and k, write k and v into the cache, attend. On CUDA a prefill rotates and
        # writes in one launch; decode attention rotates and writes the new token itself.
        o = rotary_paged_attention(
            q, k, v, rope.cos, rope.sin, kv_cache, meta, self.scale, self.k_scale, self.v_scale,
            self.sliding_window, self.softcap,
        )  # [T, Hq, D]
        return o.reshape(-1, self.q_size)


def kv_scales(model: nn.Module) -> list[torch.Tensor]:
    """Every attention layer's k_scale and v_scale, in layer order."""
    return [scale for m in model.modules() if isinstance(m, Attention) for scale in (m.k_scale, m.v_scale)]


def sliding_window_of_every_layer(model: nn.Module, num_layers: int) -> int | None:
    """The widest window when each of the model's `num_layers` attention layers has one; None
    when any attends globally (or this shard holds fewer layers): then no KV position ever
    stops being read."""
    windows = [m.sliding_window for m in model.modules() if isinstance(m, Attention)]
    if len(windows) != num_layers or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)
