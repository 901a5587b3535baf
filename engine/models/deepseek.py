"""DeepSeek-V2 and DeepSeek-V3: the decoder of engine/models/llama.py with multi-head latent
attention (`MlaAttention`) in place of attention and, after the first
`first_k_dense_replace` dense layers, a MoE block of routed experts (Mixtral's
`SparseMoeBlock`, routed by `GroupedTopKRouter`) plus shared experts every token runs.
Facts and refusals: engine/models/mla_config.py.

MLA, per token (H heads; R = kv_lora_rank, P = qk_rope_head_dim, N = qk_nope_head_dim):
    q            = q_proj(x), or q_b_proj(q_a_layernorm(q_a_proj(x)))     [H, N + P]
    latent, k_pe = kv_a_proj_with_mqa(x); latent = kv_a_layernorm(latent)   [R], [P]
    q_pe, k_pe rotated; the cache stores [latent | k_pe], R + P values, for all heads.
transformers expands the latent to per-head keys and values with kv_b_proj = [W_UK; W_UV]
per head. Here the expansion is folded into the query and the output instead (the
absorbed form): q_nope . (W_UK latent) = (W_UK^T q_nope) . latent, and the values' weighted
sum commutes with W_UV. So attention runs over the cached entries themselves, one shared
KV head (kernels/attention/mla.py), and the cache never holds per-head keys or values.

DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... (V2 always, V3 with
rope_interleave). Gathering the even then the odd dimensions turns that into the rotate-half
layout the rotary kernels implement; q and k are permuted alike, so their dot products are
transformers'.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from vllm_cluster.engine.layers.linear import Linear
from vllm_cluster.engine.layers.mlp import MLP
from vllm_cluster.engine.layers.norm import RMSNorm
from vllm_cluster.engine.layers.rotary import Rope
from vllm_cluster.engine.models.config import ModelArchConfig
from vllm_cluster.engine.models.mixtral import ExpertShard, SparseMoeBlock
from vllm_cluster.engine.models.mla_config import RoutingFacts
from vllm_cluster.kernels.attention.metadata import AttentionMetadata
from vllm_cluster.kernels.attention.mla import mla_attention, write_latent_cache
from vllm_cluster.kernels.linear.add_norm import Normed

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class MlaAttention(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        mla = config.mla
        assert mla is not None
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim
        self.latent_dim, self.v_head_dim = mla.kv_lora_rank, mla.v_head_dim
        self.scale = mla.softmax_scale
        self.rope_interleave = mla.rope_interleave
        hidden, bias = config.hidden_size, config.attention_bias
        q_width = self.num_heads * (self.nope_dim + self.rope_dim)
        self.q_proj: Linear | None = None
        self.q_a_proj: Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: Linear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden, q_width, bias=False)
        else:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6)  # transformers' default eps, as its modules
            self.q_b_proj = Linear(mla.q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.latent_dim + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.latent_dim, 1e-6)
        # [H * (N + V), R]: per head, W_UK's N rows then W_UV's V rows. Read as weights only.
        self.kv_b_proj = Linear(self.latent_dim, self.num_heads * (self.nope_dim + self.v_head_dim), bias=False)
        self.o_proj = Linear(self.num_heads * self.v_head_dim, hidden, bias=bias)

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        return self.o_proj(self.attend(rope, x, kv_cache, meta))

    def attend(
        self, rope: Rope, x: torch.Tensor | Normed, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Everything but o_proj: x [T, hidden] -> the heads' outputs [T, H * V]."""
        assert isinstance(x, torch.Tensor), "MLA takes a plain tensor (DecoderModel does not fuse its norms)"
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm.norm(self.q_a_proj(x)))
        q = q.view(-1, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)  # [T, H, N], [T, H, P]
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.latent_dim, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm.norm(latent.contiguous())  # [T, R]
        q_pe, k_pe = self._rotate(rope, q_pe, k_pe)  # [T, H, P], [T, 1, P]
        write_latent_cache(torch.cat([latent, k_pe[:, 0]], dim=-1), kv_cache, meta.slot_mapping)
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_head_dim, self.latent_dim)
        w_uk, w_uv = w_kv.split([self.nope_dim, self.v_head_dim], dim=1)  # [H, N, R], [H, V, R]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, R]
        query = torch.cat([q_latent, q_pe], dim=-1)  # [T, H, R + P]
        o_latent = mla_attention(query, kv_cache, meta, self.scale, self.latent_dim)  # [T, H, R]
        o = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, V]
        return o.reshape(-1, self.num_heads * self.v_head_dim)

    def _rotate(self, rope: Rope, q_pe: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q_pe [T, H, P], k_pe [T, P] -> both rotated, [T, H, P] and [T, 1, P]."""
        k_pe = k_pe.reshape(-1, 1, self.rope_dim)
        if self.rope_interleave:  # (x0, x1), (x2, x3), ... -> [x0, x2, ... | x1, x3, ...]
            q_pe = torch.cat([q_pe[..., 0::2], q_pe[..., 1::2]], dim=-1)
            k_pe = torch.cat([k_pe[..., 0::2], k_pe[..., 1::2]], dim=-1)
        return rope.apply(q_pe.contiguous(), k_pe.contiguous())


class GroupedTopKRouter(nn.Module):
    """DeepSeek's routing (engine/models/mla_config.py) of the router logits [T, E] (fp32)."""

    def __init__(self, routing: RoutingFacts, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.routing = routing
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.e_score_correction_bias: nn.Parameter | None = None
        if routing.has_score_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [T, E] fp32 -> (weights [T, K] fp32, expert_ids [T, K])."""
        r = self.routing
        scores = logits.sigmoid() if r.scoring == "sigmoid" else logits.softmax(dim=-1)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias.float()
        if r.n_group > 1:
            grouped = choice.view(-1, r.n_group, self.num_experts // r.n_group)  # [T, G, E/G]
            # V3 ranks a group by its two best experts' sum, V2 by its best.
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1) if r.scoring == "sigmoid" else grouped.amax(-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(r.topk_group, dim=-1)[1], True)
            # Experts of dropped groups: -inf for V3's choice, 0 for V2's scores (as transformers).
            dropped = float("-inf") if r.scoring == "sigmoid" else 0.0
            choice = grouped.masked_fill(~keep[..., None], dropped).flatten(1)
        expert_ids = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, expert_ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * r.routed_scaling_factor, expert_ids


class DeepseekMoeBlock(nn.Module):
    """experts(x) + shared_experts(x): the routed experts in a `SparseMoeBlock` (so expert
    parallelism shards them as Mixtral's: engine/parallel/expert.py), the shared experts one
    MLP of moe_intermediate_size * n_shared_experts."""

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        assert config.routing is not None
        top_k = config.num_experts_per_tok
        router = GroupedTopKRouter(config.routing, config.num_experts, top_k, config.norm_topk_prob)
        self.experts = SparseMoeBlock(
            config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok,
            router=router,
        )  # fmt: skip
        self.shared_experts: MLP | None = None
        if config.shared_expert_intermediate_size:
            self.shared_experts = MLP(config.hidden_size, config.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> [T, D]."""
        out = self.experts(x)
        return out if self.shared_experts is None else out + self.shared_experts(x)


def hf_target(name: str, num_layers: int) -> tuple[str, ExpertShard | None] | None:
    """A DeepSeek checkpoint name -> (our parameter, shard) where it differs from the other
    families' mapping; ("", None) for a tensor to skip: the multi-token-prediction layers
    that DeepSeek-V3 checkpoints append after the last layer, which generation does not use."""
    match = _LAYER.match(name)
    if match is not None and int(match[1]) >= num_layers:
        return "", None
    if name.endswith(".mlp.gate.e_score_correction_bias"):
        return name.replace(".mlp.gate.", ".mlp.experts.router."), None
    if ".self_attn.q_proj." in name:
        return name, None  # not fused with k and v as in the other families
    return None
