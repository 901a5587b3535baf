"""RoPE settings from an HF config.json: the base, the scaling parameters as transformers
reads them, and the context length a scaled rope serves. Pure: no torch.

transformers 5 writes `rope_parameters` (the type, its keys and `rope_theta`); older
configs write `rope_scaling` (with `type` or `rope_type`) and a top-level `rope_theta`.
As in transformers, `rope_scaling` wins over `rope_parameters`, a `rope_theta` inside the
dict over the top-level one, and a top-level `original_max_position_embeddings` (Phi-3)
over the one inside the dict.

Normalised parameters (what `ModelArchConfig.rope_scaling` holds) always carry
`rope_type`, `rope_theta` and, for every scaled type, `original_max_position_embeddings`:
the context the model was trained at, which the scaling extends. For `dynamic` that is
HF's `max_position_embeddings` (the length past which transformers grows the base); yarn
and longrope without a `factor` get HF's `max_position_embeddings / original`.
"""

from __future__ import annotations

from typing import Any

from vllm_cluster.engine.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
_REQUIRED_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": (),  # factor may be left out: transformers infers it from the two lengths
    "longrope": ("short_factor", "long_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}
_DEFAULT_MAX_POSITION = 4096


def read_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalised scaling parameters or None for plain RoPE) of an HF config
    dict; a ModelLoadError naming the problem for a type or key the engine cannot honour."""
    rope = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
    theta = float(rope.get("rope_theta") or d.get("rope_theta") or 10000.0)
    rope_type = rope.pop("type", None)
    rope_type = rope.get("rope_type") or rope_type or "default"
    if rope_type == "su" or (rope_type == "yarn" and "Phi3ForCausalLM" in (d.get("architectures") or [])):
        rope_type = "longrope"  # transformers' reading of older configs (Phi-3's among them)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"rope type {rope_type!r} (config.json rope_parameters / rope_scaling) is not supported; "
            f"supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor")) or 1.0
    if partial != 1.0:
        raise ModelLoadError(f"partial_rotary_factor {partial} is not supported: the engine rotates whole heads")
    if rope_type == "default":
        return theta, None
    missing = [key for key in _REQUIRED_KEYS[rope_type] if rope.get(key) is None]
    if missing:
        raise ModelLoadError(f"rope type {rope_type!r} needs {missing} in config.json rope_parameters")
    max_position = d.get("max_position_embeddings") or _DEFAULT_MAX_POSITION
    scaling = {**rope, "rope_type": rope_type, "rope_theta": theta}
    if rope_type == "dynamic":
        scaling["original_max_position_embeddings"] = max_position
    else:
        original = d.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = int(original or max_position)
    if rope_type in ("yarn", "longrope") and scaling.get("factor") is None:
        scaling["factor"] = max_position / scaling["original_max_position_embeddings"]
    return theta, scaling


def rope_context_length(max_position_embeddings: int, scaling: dict[str, Any] | None) -> int:
    """The positions a model serves, as vLLM derives them: linear and dynamic scale HF's
    `max_position_embeddings` by `factor`, yarn scales the original context; llama3 and
    longrope configs already state the extended length. Never less than the config's."""
    if scaling is None or scaling["rope_type"] in ("llama3", "longrope"):
        return max_position_embeddings
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "yarn":
        return max(max_position_embeddings, int(scaling["original_max_position_embeddings"] * factor))
    return max(max_position_embeddings, int(max_position_embeddings * factor))
