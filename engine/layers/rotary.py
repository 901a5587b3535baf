"""Rotary position embedding (HF's rotate-half layout) from one precomputed cos/sin table,
with transformers' frequency scalings: linear, dynamic (NTK), yarn, longrope and llama3.

The table holds, for every position the model serves, the rotation transformers applies
there, already multiplied by the type's attention factor (yarn's mscale, longrope's
sqrt(1 + log(factor) / log(original))), exactly as transformers scales its cos and sin. So
the rotary kernels (kernels/elementwise) rotate with scaled tables and take no extra
parameter. `max_position` is the table's length: the context the model serves
(engine/models/rope_parameters.py: `rope_context_length`).

linear, yarn and llama3 rotate a position the same way whatever the sequence's length,
so the table equals transformers' for every sequence. Two types depend on the length L
of the sequence transformers is running, and one table (KV blocks are rotated once, when
written, and shared between requests) cannot follow L:

- dynamic: transformers computes the base for L once L exceeds `max_position_embeddings`
  (the unscaled base below it) and keeps the larger base until a sequence shorter than
  `max_position_embeddings` resets it. The table uses the base for L = `max_position`
  (HF's `max_position_embeddings` x factor), as vLLM does. It equals transformers'
  rotation for a sequence of that length, and for every sequence of length in
  [`max_position_embeddings`, `max_position`] once transformers has run one that long.
  A shorter sequence is rotated with the scaled base here and the unscaled one there.
- longrope: transformers rotates a whole sequence with `long_factor` when L exceeds
  `original_max_position_embeddings` and with `short_factor` otherwise, re-rotating every
  earlier position when a sequence crosses over. The table uses `long_factor` when the
  served context exceeds `original_max_position_embeddings` (`short_factor` otherwise),
  as vLLM does: equal to transformers for every sequence longer than the original
  context; a shorter one is rotated with the long factors here. A model whose context is
  its original one uses the short factors and equals transformers everywhere. (vLLM
  decides by its max_model_len; the table here is built from the model's config alone, so
  a lower scheduler.max_model_len does not switch to the short factors.)
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from vllm_cluster.kernels.elementwise.dispatch import rotary_embedding


def _exponents(head_dim: int) -> torch.Tensor:
    return torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # [D/2]


def _default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** _exponents(head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _dynamic_inv_freq(head_dim: int, base: float, scaling: dict[str, Any], seq_len: int) -> torch.Tensor:
    factor = scaling["factor"]
    trained_len = scaling["original_max_position_embeddings"]
    seq_len = max(seq_len, trained_len)
    base = base * ((factor * seq_len / trained_len) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return _default_inv_freq(head_dim, base)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(head_dim: int, base: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    factor = scaling["factor"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    trained_len = scaling["original_max_position_embeddings"]

    def dim_of(num_rotations: float) -> float:
        # The dimension whose wavelength turns num_rotations times over the trained context.
        return head_dim * math.log(trained_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: a high-frequency dimension kept as trained; 0: interpolated by factor
    return interpolated * (1 - keep) + extrapolated * keep, float(attention_factor)


def _longrope_inv_freq(
    head_dim: int, base: float, scaling: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    trained_len = scaling["original_max_position_embeddings"]
    factor = scaling["factor"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(trained_len))
    chosen = scaling["long_factor"] if max_position > trained_len else scaling["short_factor"]
    if len(chosen) != head_dim // 2:
        raise ValueError(f"longrope factors have {len(chosen)} entries; head_dim {head_dim} needs {head_dim // 2}")
    ext_factors = torch.tensor(chosen, dtype=torch.float32)
    return 1.0 / (ext_factors * base ** _exponents(head_dim)), float(attention_factor)


def rope_inv_freq(
    head_dim: int, base: float, scaling: dict[str, Any] | None, max_position: int
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [D/2] fp32, attention factor) of a table of max_position rows."""
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return _default_inv_freq(head_dim, base), 1.0
    assert scaling is not None
    if rope_type == "linear":
        return _default_inv_freq(head_dim, base) / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(_default_inv_freq(head_dim, base), scaling), 1.0
    if rope_type == "dynamic":
        return _dynamic_inv_freq(head_dim, base, scaling, max_position), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, base, scaling)
    if rope_type == "longrope":
        return _longrope_inv_freq(head_dim, base, scaling, max_position)
    raise ValueError(
        f"rope scaling {rope_type!r} is not supported (supported: default, linear, dynamic, yarn, longrope, llama3)"
    )


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        inv_freq, attention_factor = rope_inv_freq(head_dim, base, scaling, max_position)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_factor, persistent=False)

    def forward(self, positions: torch.Tensor) -> Rope:
        """The rotation for these positions ([T]), computed once per step for all layers."""
        return Rope(self.cos[positions], self.sin[positions])


class Rope(NamedTuple):
    cos: torch.Tensor  # [T, D/2] fp32, times the attention factor
    sin: torch.Tensor

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, Hq, D]; k: [T, Hkv, D]
        return rotary_embedding(q, k, self.cos, self.sin)
