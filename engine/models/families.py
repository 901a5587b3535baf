"""What each family reads from an HF config.json beyond the facts every decoder here shares
(engine/models/config.py), and the config values that change the math but are not
implemented, refused by name (a ModelLoadError that says which key and what to do).

Families: llama (Llama, Mistral), qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, phi3, olmo2,
granite. No torch here: configs and errors import without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_cluster.engine.errors import ModelLoadError

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
QWEN_MOE_FAMILIES = ("qwen2_moe", "qwen3_moe")


@dataclass(frozen=True, slots=True)
class MoeFacts:
    """A MoE model's experts (num_experts 0: a dense model)."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each routed expert's width
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    dense_layer_ids: tuple[int, ...] = ()  # layers that keep a dense MLP


@dataclass(frozen=True, slots=True)
class GraniteScales:
    """Granite's multipliers (1.0 and None elsewhere: no change)."""

    embedding_multiplier: float = 1.0  # the embeddings are scaled by it
    residual_multiplier: float = 1.0  # attention's and the MLP's outputs, before the residual add
    attention_multiplier: float | None = None  # the softmax scale (None: head_dim ** -0.5)
    logits_scaling: float = 1.0  # the logits are divided by it


def moe_facts(family: str, d: dict[str, Any]) -> MoeFacts:
    if family == "mixtral":
        return MoeFacts(
            num_experts=d.get("num_local_experts", 8),
            num_experts_per_tok=d.get("num_experts_per_tok", 2),
            moe_intermediate_size=d["intermediate_size"],
        )
    if family not in QWEN_MOE_FAMILIES:
        return MoeFacts()
    # Qwen3-MoE's config class writes num_experts as num_local_experts; the hub's configs say num_experts.
    num_experts = d.get("num_experts", d.get("num_local_experts"))
    if not num_experts:
        raise ModelLoadError(f"{family}: config.json has no num_experts; fix the model's config")
    num_layers, step = d["num_hidden_layers"], d.get("decoder_sparse_step", 1)
    if step < 1:
        raise ModelLoadError(f"decoder_sparse_step {step} must be >= 1: fix the model's config")
    mlp_only = set(d.get("mlp_only_layers") or ())
    # As HF: a layer is sparse unless listed in mlp_only_layers or off the decoder_sparse_step grid.
    dense = tuple(i for i in range(num_layers) if i in mlp_only or (i + 1) % step)
    return MoeFacts(
        num_experts=num_experts,
        num_experts_per_tok=d.get("num_experts_per_tok", 8 if family == "qwen3_moe" else 4),
        moe_intermediate_size=d["moe_intermediate_size"],
        shared_expert_intermediate_size=d.get("shared_expert_intermediate_size", 0) if family == "qwen2_moe" else 0,
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        dense_layer_ids=dense,
    )


def granite_scales(family: str, d: dict[str, Any]) -> GraniteScales:
    if family != "granite":
        return GraniteScales()
    return GraniteScales(
        embedding_multiplier=float(d.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(d.get("residual_multiplier", 1.0)),
        attention_multiplier=float(d.get("attention_multiplier", 1.0)),
        logits_scaling=float(d.get("logits_scaling", 1.0)),
    )


def qkv_bias(family: str, d: dict[str, Any]) -> bool:
    """Whether q, k and v have biases: Qwen2's always; Qwen2-MoE's key is qkv_bias."""
    if family == "qwen2_moe":
        return bool(d.get("qkv_bias", True))
    return bool(d.get("attention_bias", family == "qwen2"))


def sliding_window(family: str, d: dict[str, Any]) -> int | None:
    """The attention window the config turns on (None: full attention). Not implemented:
    startup refuses a max_model_len longer than it (engine/startup.py), within which a
    window changes nothing."""
    window = d.get("sliding_window")
    if family in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe") and not d.get("use_sliding_window", False):
        return None
    return int(window) if window else None


def refuse_unsupported(family: str, d: dict[str, Any]) -> None:
    """Raise for a config value of `family` that changes the math and is not implemented."""
    # partial_rotary_factor and rope types: engine/models/rope_parameters.py.
    # These families put attention_bias on o_proj too (Qwen2's qkv bias leaves o_proj without).
    if family in ("llama", "qwen3", "qwen3_moe", "olmo2", "granite") and d.get("attention_bias", False):
        raise ModelLoadError(
            f"attention_bias true ({family}: biases on q/k/v and on o_proj) is not supported: "
            "o_proj has no bias here"
        )
    if family in ("llama", "granite") and d.get("mlp_bias", False):
        raise ModelLoadError(f"mlp_bias true ({family}: biases on the MLP's projections) is not supported")
