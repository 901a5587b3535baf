"""The KV cache scales a checkpoint may carry, under the names its tools write them.

  model.layers.N.self_attn.k_scale / v_scale              llm-compressor, vLLM
  model.layers.N.self_attn.k_proj.k_scale / v_proj.v_scale    ModelOpt
  model.layers.N.self_attn.k_proj.output_scale / v_proj...    compressed-tensors
  model.layers.N.self_attn.kv_scale                       older FP8 checkpoints: K and V share it

Each goes to the layer's `self_attn.k_scale` / `v_scale` buffer (engine/layers/attention.py).
A scale of several values (one per head) is reduced to its maximum: one scale per layer can
then hold every head without saturating. Query and probability scales (fp8 attention math)
are recognised and skipped, as vLLM does without fp8 attention.
"""

from __future__ import annotations

import logging
import re

import torch

logger = logging.getLogger(__name__)
_warned_unscaled = False

_PATTERNS = (
    (re.compile(r"^(.*\.self_attn)\.([kv])_scale$"), ("{0}.{1}_scale",)),
    (re.compile(r"^(.*\.self_attn)\.([kv])_proj\.(?:[kv]_scale|output_scale)$"), ("{0}.{1}_scale",)),
    (re.compile(r"^(.*\.self_attn)\.kv_scale$"), ("{0}.k_scale", "{0}.v_scale")),
)
_SKIPPED = re.compile(r"\.self_attn\.(?:q_scale|prob_scale|prob_output_scale|q_proj\.(?:q_scale|output_scale))$")


def kv_scale_targets(name: str) -> tuple[str, ...] | None:
    """The buffers a checkpoint tensor `name` fills; () to skip it; None if it is no KV scale."""
    if _SKIPPED.search(name):
        return ()
    for pattern, targets in _PATTERNS:
        match = pattern.match(name)
        if match:
            return tuple(t.format(*match.groups()) for t in targets)
    return None


def per_layer_scale(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The [1] fp32 scale of a checkpoint tensor; raises ValueError unless positive and finite."""
    if tensor.numel() == 0:
        raise ValueError(f"{name}: an empty KV cache scale")
    scale = tensor.detach().float().reshape(-1).max().reshape(1)
    if not bool(torch.isfinite(scale).all()) or float(scale) <= 0.0:
        raise ValueError(f"{name}: KV cache scale {float(scale)} must be positive and finite")
    return scale


def warn_once_if_unscaled(scales_loaded: bool) -> None:
    """An fp8 KV cache without the checkpoint's scales divides by 1.0 (vLLM's default): say so
    once per process, since values beyond +-448 then saturate."""
    global _warned_unscaled
    if scales_loaded or _warned_unscaled:
        return
    _warned_unscaled = True
    logger.warning(
        "fp8 KV cache: the checkpoint has no k_scale/v_scale, so every layer uses scale 1.0; "
        "K/V values beyond +-448 saturate. A checkpoint calibrated with KV cache scales "
        "(llm-compressor, ModelOpt) avoids that."
    )
