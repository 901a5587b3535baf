"""What DeepSeek-V2 and DeepSeek-V3 read from an HF config.json: multi-head latent attention
(MLA) and grouped top-k expert routing, and the values that change the math but are not
implemented, refused by name. No torch here: configs and errors import without it.

MLA (engine/models/deepseek.py): queries come from hidden states directly (`q_lora_rank`
None, as DeepSeek-V2-Lite) or through a low-rank projection and its RMSNorm; keys and
values share one compressed latent of `kv_lora_rank` per token plus one rotary key of
`qk_rope_head_dim` that every head shares. The paged KV cache holds exactly those
`kv_lora_rank + qk_rope_head_dim` values per token per layer.

Routing (DeepSeek's MoE layers after the first `first_k_dense_replace`): V2 scores experts
by softmax and takes the top k (`greedy`), or first the `topk_group` best of `n_group`
groups by their best expert (`group_limited_greedy`); V3 scores by sigmoid, picks with
`e_score_correction_bias` added, the groups by the sum of their two best, and optionally
renormalises (`norm_topk_prob`). Both multiply the weights by `routed_scaling_factor`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vllm_cluster.engine.errors import ModelLoadError
from vllm_cluster.engine.models.families import MoeFacts

MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")
# transformers' defaults for the keys a config.json may leave out (DeepseekV2Config, DeepseekV3Config).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": {
        "n_routed_experts": 64, "n_shared_experts": 2, "moe_intermediate_size": 1407, "first_k_dense_replace": 0,
        "routed_scaling_factor": 1.0, "n_group": None, "topk_group": None, "topk_method": "greedy",
        "num_experts_per_tok": None,
    },
    "deepseek_v3": {
        "n_routed_experts": 256, "n_shared_experts": 1, "moe_intermediate_size": 2048, "first_k_dense_replace": 3,
        "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc",
        "num_experts_per_tok": 8,
    },
}  # fmt: skip


def _get(family: str, d: dict[str, Any], key: str) -> Any:
    """d[key], or transformers' default for this family when the config leaves it out."""
    return d[key] if key in d else _DEFAULTS[family][key]


@dataclass(frozen=True, slots=True)
class MlaFacts:
    """One MLA layer's shapes, the same for every layer."""

    q_lora_rank: int | None  # None: q_proj straight from the hidden state
    kv_lora_rank: int  # the compressed latent each token caches
    qk_nope_head_dim: int  # each head's query/key part without rotary
    qk_rope_head_dim: int  # the rotary part; its key is shared by all heads and cached
    v_head_dim: int
    # V2 and V3 (rope_interleave, its default) rotate adjacent pairs (x0, x1), (x2, x3), ...
    # rather than the two halves.
    rope_interleave: bool
    softmax_scale: float  # qk_head_dim ** -0.5, times yarn's mscale(mscale_all_dim) squared

    @property
    def cache_entry_size(self) -> int:
        """Values one token caches per layer: the latent and the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class RoutingFacts:
    """How a DeepSeek MoE layer picks its experts (see the module docstring)."""

    scoring: str  # "softmax" (V2) or "sigmoid" (V3)
    topk_method: str  # "greedy", "group_limited_greedy" (V2) or "noaux_tc" (V3)
    n_group: int  # 1: no groups
    topk_group: int
    routed_scaling_factor: float
    has_score_bias: bool  # V3's e_score_correction_bias


def mla_facts(family: str, d: dict[str, Any], rope_scaling: dict[str, Any] | None) -> MlaFacts | None:
    if family not in MLA_FAMILIES:
        return None
    nope, rope = int(d.get("qk_nope_head_dim", 128)), int(d.get("qk_rope_head_dim", 64))
    if rope % 2:
        raise ModelLoadError(f"qk_rope_head_dim {rope} must be even: fix the model's config")
    scale = (nope + rope) ** -0.5
    # transformers' yarn_apply_mscale: the softmax scale grows with the context extension too.
    if rope_scaling is not None and rope_scaling.get("mscale_all_dim"):
        factor = float(rope_scaling["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * float(rope_scaling["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= mscale * mscale
    q_lora_rank = d.get("q_lora_rank", 1536)
    return MlaFacts(
        q_lora_rank=int(q_lora_rank) if q_lora_rank else None,
        kv_lora_rank=int(d.get("kv_lora_rank", 512)),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=int(d.get("v_head_dim", 128)),
        rope_interleave=family == "deepseek_v2" or bool(d.get("rope_interleave", True)),
        softmax_scale=scale,
    )


def routing_facts(family: str, d: dict[str, Any]) -> RoutingFacts | None:
    if family not in MLA_FAMILIES:
        return None
    v3 = family == "deepseek_v3"
    scoring = d.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise ModelLoadError(
            f"scoring_func {scoring!r} is not supported for {family} (DeepSeek-V2 scores experts by softmax, "
            "V3 by sigmoid, as transformers does)"
        )
    method = _get(family, d, "topk_method") or ("noaux_tc" if v3 else "greedy")
    methods = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    if method not in methods:
        raise ModelLoadError(f"topk_method {method!r} is not supported for {family} (supported: {list(methods)})")
    num_experts = int(_get(family, d, "n_routed_experts") or 0)
    grouped = v3 or method == "group_limited_greedy"
    n_group = int(_get(family, d, "n_group") or 1) if grouped else 1
    topk_group = int(_get(family, d, "topk_group") or n_group) if grouped else 1
    if num_experts % n_group or not 0 < topk_group <= n_group:
        raise ModelLoadError(
            f"n_group {n_group} must divide n_routed_experts ({num_experts}) and topk_group ({topk_group}) "
            "must be in 1..n_group: fix the model's config"
        )
    top_k = int(_get(family, d, "num_experts_per_tok") or 0)
    if top_k > topk_group * (num_experts // n_group):
        raise ModelLoadError(
            f"num_experts_per_tok {top_k} exceeds the {topk_group * (num_experts // n_group)} experts that "
            f"topk_group {topk_group} of n_group {n_group} leave: fix the model's config"
        )
    return RoutingFacts(
        scoring=scoring,
        topk_method=method,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(_get(family, d, "routed_scaling_factor")),
        has_score_bias=v3,
    )


def moe_facts(family: str, d: dict[str, Any]) -> MoeFacts:
    """A DeepSeek config's experts: the shared experts are one MLP of their summed width."""
    num_experts = int(_get(family, d, "n_routed_experts") or 0)
    if not num_experts:
        raise ModelLoadError(f"{family}: config.json has no n_routed_experts; fix the model's config")
    if int(d.get("moe_layer_freq") or 1) != 1:
        raise ModelLoadError(
            f"moe_layer_freq {d['moe_layer_freq']} is not supported (transformers makes every layer after "
            "first_k_dense_replace a MoE layer): fix the model's config"
        )
    if family == "deepseek_v2" and d.get("norm_topk_prob"):
        raise ModelLoadError(
            "norm_topk_prob true is not supported for deepseek_v2 (transformers' DeepSeek-V2 never "
            "renormalises its top-k weights): set it false"
        )
    first_dense = int(_get(family, d, "first_k_dense_replace") or 0)
    shared = int(_get(family, d, "n_shared_experts") or 0)
    moe_width = int(_get(family, d, "moe_intermediate_size"))
    return MoeFacts(
        num_experts=num_experts,
        num_experts_per_tok=int(_get(family, d, "num_experts_per_tok") or 0),
        moe_intermediate_size=moe_width,
        shared_expert_intermediate_size=moe_width * shared,
        norm_topk_prob=family == "deepseek_v3" and bool(d.get("norm_topk_prob", True)),
        dense_layer_ids=tuple(range(min(first_dense, int(d["num_hidden_layers"])))),
    )


def refuse_unsupported(family: str, d: dict[str, Any]) -> None:
    """Raise for a DeepSeek config value that changes the math and is not implemented."""
    if family == "deepseek_v2" and d.get("mlp_bias"):
        raise ModelLoadError("mlp_bias true (deepseek_v2: biases on the MLP's projections) is not supported")
    if (d.get("hidden_act") or "silu") != "silu":
        raise ModelLoadError(f"hidden_act {d['hidden_act']!r} is not supported for {family} (supported: ['silu'])")
