"""The architecture facts a model needs, read from an HF config.json (or GGUF metadata)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_cluster.engine.errors import ModelLoadError
from vllm_cluster.engine.models import families, mla_config
from vllm_cluster.engine.models.families import GEMMA_FAMILIES, GemmaFacts, GraniteScales
from vllm_cluster.engine.models.mla_config import MLA_FAMILIES, MlaFacts, RoutingFacts
from vllm_cluster.engine.models.rope_parameters import read_rope, rope_context_length

# The architectures one shared decoder implements, and what each adds.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Phi3ForCausalLM": "phi3",
    "Olmo2ForCausalLM": "olmo2",
    "GraniteForCausalLM": "granite",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
# Architectures refused with a reason (the generic message lists the supported ones).
_REFUSED_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": "the multimodal Gemma 3 (text and images) is not supported; for "
    "text only, serve a Gemma3ForCausalLM checkpoint (such as gemma-3-1b) or one converted to it",
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
    # Normalised (engine/models/rope_parameters.py); None: plain RoPE.
    rope_scaling: dict[str, Any] | None
    # The positions the model serves: HF's max_position_embeddings, extended by linear,
    # dynamic and yarn scaling (rope_context_length), as vLLM derives its max_model_len.
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_id: int | None
    # Mixtral-style MoE (0: a dense MLP): experts per layer, experts each token uses.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    # Qwen MoE (engine/models/qwen_moe.py): each expert's width (Mixtral: intermediate_size),
    # the shared expert's (0: none), whether the top-k weights are renormalised, and the
    # layers that keep a dense MLP of intermediate_size.
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layer_ids: tuple[int, ...] = ()
    # The attention window every layer's Attention uses (None: none, or per layer below).
    sliding_window: int | None = None
    # Qwen2, Qwen3, Qwen2-MoE: each layer's window (None: global), from use_sliding_window,
    # max_window_layers and layer_types (families.layer_windows); (): sliding_window for all.
    layer_windows: tuple[int | None, ...] = ()
    # OLMo 2: RMSNorm after attention and after the MLP (before each residual add) instead
    # of before them, and q/k each normalised over the whole projection, not per head.
    post_norms: bool = False
    scales: GraniteScales = GraniteScales()
    hidden_act: str = "silu"  # the MLP's activation (families.ACTIVATIONS)
    gemma: GemmaFacts | None = None  # Gemma 2 / 3 (engine/models/gemma.py); None elsewhere
    # DeepSeek-V2 / V3 (engine/models/deepseek.py): multi-head latent attention, whose KV
    # cache holds one latent per token (num_key_value_heads 1; head_dim is the rotary
    # part's, qk_rope_head_dim), and grouped top-k routing. None elsewhere.
    mla: MlaFacts | None = None
    routing: RoutingFacts | None = None

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int | None = None) -> tuple[int, ...]:
        """One layer's KV cache: [num_blocks, 2, block_size, num_kv_heads, head_dim] (K and V;
        `num_kv_heads`: a tensor-parallel rank's share), or for MLA [num_blocks, 1,
        block_size, 1, kv_lora_rank + qk_rope_head_dim] (the latent and the rotary key).
        Either way one block of one layer is contiguous."""
        if self.mla is not None:
            return (num_blocks, 1, block_size, 1, self.mla.cache_entry_size)
        heads = self.num_key_value_heads if num_kv_heads is None else num_kv_heads
        return (num_blocks, 2, block_size, heads, self.head_dim)

    def kv_bytes_per_token(
        self, element_size: int, num_layers: int | None = None, num_kv_heads: int | None = None
    ) -> int:
        """The KV cache bytes one token takes over `num_layers` layers (the model's by default)."""
        layers = self.num_hidden_layers if num_layers is None else num_layers
        _, planes, _, heads, width = self.kv_cache_shape(1, 1, num_kv_heads)
        return layers * planes * heads * width * element_size

    def layer_window(self, layer_id: int) -> int | None:
        """The window layer `layer_id` attends within (None: globally); Gemma's are GemmaFacts'."""
        return self.layer_windows[layer_id] if self.layer_windows else self.sliding_window

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.num_experts > 0 and layer_id not in self.dense_layer_ids

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
        if arch in _REFUSED_ARCHITECTURES:
            raise ModelLoadError(f"architecture {arch}: {_REFUSED_ARCHITECTURES[arch]}")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"architecture {arch} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        if family in MLA_FAMILIES:
            return _mla_config(arch, family, d)
        families.refuse_unsupported(family, d)
        moe = families.moe_facts(family, d)
        num_heads = d["num_attention_heads"]
        gemma = families.gemma_facts(family, d)
        # Refuses rope types the engine cannot honour. Gemma 3: its global layers' rope.
        rope_source = families.gemma3_rope_config(d, "full_attention") if family == "gemma3" else d
        rope_theta, rope_scaling = read_rope(rope_source)
        eos = d.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or (256 if gemma else d["hidden_size"] // num_heads),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=rope_context_length(d.get("max_position_embeddings", 4096), rope_scaling),
            tie_word_embeddings=d.get("tie_word_embeddings", family in GEMMA_FAMILIES),
            attention_bias=families.qkv_bias(family, d),
            qk_norm=family in ("qwen3", "qwen3_moe", "olmo2", "gemma3"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            num_experts=moe.num_experts,
            num_experts_per_tok=moe.num_experts_per_tok,
            moe_intermediate_size=moe.moe_intermediate_size,
            shared_expert_intermediate_size=moe.shared_expert_intermediate_size,
            norm_topk_prob=moe.norm_topk_prob,
            dense_layer_ids=moe.dense_layer_ids,
            sliding_window=families.sliding_window(family, d),
            layer_windows=families.layer_windows(family, d),
            post_norms=family == "olmo2",
            scales=families.granite_scales(family, d),
            hidden_act=families.hidden_act(family, d),
            gemma=gemma,
        )


def _mla_config(arch: str, family: str, d: dict[str, Any]) -> ModelArchConfig:
    """A DeepSeek-V2 / V3 config (engine/models/mla_config.py)."""
    mla_config.refuse_unsupported(family, d)
    rope_theta, rope_scaling = read_rope(d)
    mla = mla_config.mla_facts(family, d, rope_scaling)
    assert mla is not None
    moe = mla_config.moe_facts(family, d)
    eos = d.get("eos_token_id")
    return ModelArchConfig(
        architecture=arch,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=1,
        head_dim=mla.qk_rope_head_dim,
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=rope_context_length(d.get("max_position_embeddings", 4096), rope_scaling),
        tie_word_embeddings=d.get("tie_word_embeddings", False),
        attention_bias=bool(d.get("attention_bias", False)),
        qk_norm=False,
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.num_experts_per_tok,
        moe_intermediate_size=moe.moe_intermediate_size,
        shared_expert_intermediate_size=moe.shared_expert_intermediate_size,
        norm_topk_prob=moe.norm_topk_prob,
        dense_layer_ids=moe.dense_layer_ids,
        mla=mla,
        routing=mla_config.routing_facts(family, d),
    )
