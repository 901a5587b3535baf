"""The architecture facts a model needs, read from an HF config.json (or GGUF metadata)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_cluster.engine.errors import ModelLoadError

# The architectures one shared decoder implements, and what each adds.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
}


@dataclass(frozen=True, slots=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_id: int | None
    # Mixtral-style MoE (0: a dense MLP): experts per layer, experts each token uses.
    num_experts: int = 0
    num_experts_per_tok: int = 0

    def __post_init__(self) -> None:
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelLoadError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_local_experts "
                f"({self.num_experts}): fix the model's config"
            )

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelArchConfig:
        architectures = d.get("architectures") or ["LlamaForCausalLM"]
        arch = architectures[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"architecture {arch} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        if d.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"hidden_act {d['hidden_act']!r} is not supported (only silu)")
        num_heads = d["num_attention_heads"]
        # transformers 5 moved rope settings into rope_parameters.
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = d.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=dict(rope) if rope_type != "default" else None,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", family == "qwen2"),
            qk_norm=family == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            num_experts=d.get("num_local_experts", 8) if family == "mixtral" else 0,
            num_experts_per_tok=d.get("num_experts_per_tok", 2) if family == "mixtral" else 0,
        )
