"""Qwen2-MoE and Qwen3-MoE: the Llama decoder of engine/models/llama.py (Qwen2's qkv bias or
Qwen3's q/k norm) with MoE layers whose routed experts are Mixtral's `SparseMoeBlock`
(engine/models/mixtral.py), plus, in Qwen2-MoE, a shared expert every token runs.

A `QwenMoeBlock` is
    experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)
where `experts` routes each token to top-k of num_experts experts of moe_intermediate_size
(the top-k weights renormalised only if norm_topk_prob) and `shared_expert` is a plain MLP
of shared_expert_intermediate_size (Qwen3-MoE has none). Keeping the routed experts in
their own `SparseMoeBlock` lets expert parallelism shard and all-reduce them exactly as for
Mixtral (engine/parallel/expert.py), while the shared expert, an `MLP`, is replicated or
tensor-parallel like any other MLP (engine/parallel/tensor.py). Layers listed in
`ModelArchConfig.dense_layer_ids` keep a dense MLP of intermediate_size instead.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from vllm_cluster.engine.layers.mlp import MLP
from vllm_cluster.engine.models.config import ModelArchConfig
from vllm_cluster.engine.models.mixtral import ExpertShard, SparseMoeBlock

_HF_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_PART = {"gate_proj": 0, "up_proj": 1}


class QwenMoeBlock(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.experts = SparseMoeBlock(
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            renormalize=config.norm_topk_prob,
        )
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = MLP(config.hidden_size, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> [T, D]."""
        out = self.experts(x)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def hf_target(name: str) -> tuple[str, ExpertShard | None] | None:
    """An HF Qwen MoE checkpoint name -> (our parameter, expert shard); None if not one.

    `...mlp.gate.weight` is the router (ours: `mlp.experts.gate`); `...mlp.experts.{e}.
    gate_proj/up_proj` fill the rows of `mlp.experts.stack.w13_weight[e]`, `down_proj` fills
    `w2_weight[e]`. The shared expert's and a dense layer's names are left to the dense mapping."""
    match = _HF_EXPERT.search(name)
    if match is not None:
        prefix, expert, part = name[: match.start()] + ".mlp.experts.stack.", int(match[1]), match[2]
        if part == "down_proj":
            return prefix + "w2_weight", (expert, 0)
        return prefix + "w13_weight", (expert, _PART[part])
    if name.endswith(".mlp.gate.weight"):
        return name.replace(".mlp.gate.", ".mlp.experts.gate."), None
    return None
