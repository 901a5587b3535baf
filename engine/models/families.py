"""What each family reads from an HF config.json beyond the facts every decoder here shares
(engine/models/config.py), and the config values that change the math but are not
implemented, refused by name (a ModelLoadError that says which key and what to do).

Families: llama (Llama, Mistral), qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, phi3, olmo2,
granite, gemma2, gemma3 (the text-only Gemma3ForCausalLM). No torch here: configs and errors
import without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_cluster.engine.errors import ModelLoadError
from vllm_cluster.engine.models.rope_parameters import read_rope

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
QWEN_MOE_FAMILIES = ("qwen2_moe", "qwen3_moe")
GEMMA_FAMILIES = ("gemma2", "gemma3")
# The families whose config.json turns sliding windows on with use_sliding_window; all but
# Qwen3-MoE slide only some layers (layer_windows).
QWEN_WINDOW_FAMILIES = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
QWEN_LAYER_WINDOW_FAMILIES = ("qwen2", "qwen2_moe", "qwen3")
# The MLP activations engine/layers/mlp.py implements (HF's hidden_act / hidden_activation names).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


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
    """The attention window every layer uses (None: full attention, or a family whose layers
    differ: `layer_windows`). Qwen3-MoE, as transformers, slides every layer when
    use_sliding_window is set."""
    window = d.get("sliding_window")
    if family in QWEN_WINDOW_FAMILIES and not d.get("use_sliding_window", False):
        return None
    if family in GEMMA_FAMILIES or family in QWEN_LAYER_WINDOW_FAMILIES:
        return None  # some layers only: layer_windows, GemmaFacts.layer_windows
    return int(window) if window else None


def layer_windows(family: str, d: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's window for Qwen2, Qwen3 and Qwen2-MoE (None: that layer attends globally),
    as transformers builds them: config.json's layer_types if it gives them, else, with
    use_sliding_window, Qwen2 and Qwen3 slide the layers from max_window_layers on and
    Qwen2-MoE the even-numbered layers below max_window_layers. () for other families."""
    if family not in QWEN_LAYER_WINDOW_FAMILIES:
        return ()
    num_layers = d["num_hidden_layers"]
    use = bool(d.get("use_sliding_window", False))
    window = d.get("sliding_window") if use else None
    max_window_layers = d.get("max_window_layers", 28)
    layer_types = d.get("layer_types")
    if layer_types is None:
        if family == "qwen2_moe":
            sliding = [use and i % 2 == 0 and i < max_window_layers for i in range(num_layers)]
        else:
            sliding = [window is not None and i >= max_window_layers for i in range(num_layers)]
        return tuple(int(window) if window and s else None for s in sliding)
    _check_layer_types(layer_types, num_layers)
    if "sliding_attention" in layer_types and not window:
        raise ModelLoadError(
            f"layer_types names sliding_attention layers but {family}'s window is off (use_sliding_window "
            f"{use}, sliding_window {d.get('sliding_window')}): set use_sliding_window true and a sliding_window "
            "of at least 1, or make every layer full_attention"
        )
    return tuple(int(window) if window and t == "sliding_attention" else None for t in layer_types)


def _check_layer_types(layer_types: list[str], num_layers: int) -> None:
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown or len(layer_types) != num_layers:
        raise ModelLoadError(
            f"layer_types {unknown or layer_types} is not supported: give one of sliding_attention or "
            f"full_attention for each of the {num_layers} layers"
        )


def refuse_unsupported(family: str, d: dict[str, Any]) -> None:
    """Raise for a config value of `family` that changes the math and is not implemented."""
    # partial_rotary_factor and rope types: engine/models/rope_parameters.py.
    # These families put attention_bias on o_proj too (Qwen2's qkv bias leaves o_proj without).
    if family in ("llama", "qwen3", "qwen3_moe", "olmo2", "granite", *GEMMA_FAMILIES) and d.get("attention_bias"):
        raise ModelLoadError(
            f"attention_bias true ({family}: biases on q/k/v and on o_proj) is not supported: "
            "o_proj has no bias here"
        )
    if family in ("llama", "granite") and d.get("mlp_bias", False):
        raise ModelLoadError(f"mlp_bias true ({family}: biases on the MLP's projections) is not supported")


@dataclass(frozen=True, slots=True)
class GemmaFacts:
    """What Gemma 2 and Gemma 3 add to the shared decoder (engine/models/gemma.py)."""

    query_pre_attn_scalar: float  # the softmax scale is its inverse square root
    attn_logit_softcapping: float | None  # Gemma 2: scores -> tanh(scores / cap) * cap
    final_logit_softcapping: float | None  # the same on the logits
    layer_windows: tuple[int | None, ...]  # each layer's sliding window (None: global attention)
    # Gemma 3's sliding layers rotate with their own base (rope_local_base_freq) and no
    # scaling; None: every layer uses rope_theta and rope_scaling (Gemma 2).
    local_rope_theta: float | None = None


def gemma_facts(family: str, d: dict[str, Any]) -> GemmaFacts | None:
    if family not in GEMMA_FAMILIES:
        return None
    if d.get("use_bidirectional_attention"):
        raise ModelLoadError(
            "use_bidirectional_attention true (Gemma: attention without a causal mask) is not supported"
        )
    num_layers = d["num_hidden_layers"]
    # Gemma 2 alternates sliding and global layers; Gemma 3 makes every pattern-th layer global.
    pattern = 2 if family == "gemma2" else d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6))
    layer_types = d.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
    ]
    _check_layer_types(layer_types, num_layers)
    window = d.get("sliding_window")
    windows = tuple(int(window) if window and t == "sliding_attention" else None for t in layer_types)
    local_theta = None
    if family == "gemma3":
        local_theta, local_scaling = read_rope(gemma3_rope_config(d, "sliding_attention"))
        if local_scaling is not None:
            raise ModelLoadError(
                f"rope scaling {local_scaling['rope_type']!r} on Gemma 3's sliding layers "
                "(rope_parameters.sliding_attention) is not supported: HF checkpoints scale only full_attention"
            )
    return GemmaFacts(
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
        # HF's Gemma 3 reads attn_logit_softcapping but never applies it; so neither does this.
        attn_logit_softcapping=_float_or_none(d.get("attn_logit_softcapping")) if family == "gemma2" else None,
        final_logit_softcapping=_float_or_none(d.get("final_logit_softcapping")),
        layer_windows=windows,
        local_rope_theta=local_theta,
    )


def gemma3_rope_config(d: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """The config dict `read_rope` reads for Gemma 3's `layer_type` layers. transformers 5
    nests rope_parameters by layer type; older configs give rope_theta and rope_scaling for
    the global (full_attention) layers and rope_local_base_freq for the sliding ones."""
    nested = d.get("rope_parameters") or {}
    rope = dict(nested.get(layer_type) or {})
    if layer_type == "full_attention":
        rope.update(d.get("rope_scaling") or {})
        rope.setdefault("rope_theta", d.get("rope_theta", 1_000_000.0))
    else:
        rope.setdefault("rope_theta", d.get("rope_local_base_freq", 10_000.0))
    flat = {k: v for k, v in d.items() if k not in ("rope_scaling", "rope_parameters", "rope_theta")}
    return {**flat, "rope_parameters": rope}


def hidden_act(family: str, d: dict[str, Any]) -> str:
    """The MLP's activation: Gemma's HF config calls it hidden_activation (its hidden_act is
    unused), the others hidden_act. Refused unless engine/layers/mlp.py implements it."""
    if family in GEMMA_FAMILIES:
        act = d.get("hidden_activation") or "gelu_pytorch_tanh"
    else:
        act = d.get("hidden_act") or "silu"
    supported = ("silu",) if family in MOE_FAMILIES else ACTIVATIONS  # the experts are SwiGLU
    if act not in supported:
        key = "hidden_activation" if family in GEMMA_FAMILIES else "hidden_act"
        raise ModelLoadError(f"{key} {act!r} is not supported for {family} (supported: {list(supported)})")
    return str(act)


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)
