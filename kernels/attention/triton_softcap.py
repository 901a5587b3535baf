"""Attention logit soft-capping (Gemma 2's attn_logit_softcapping) inside the Triton attention
kernels: a score s becomes cap * tanh(s / cap), after the softmax scale and before the mask
and the softmax, as kernels/attention/softcap.py (the torch path) and transformers do.

The kernels keep their scores in log2 units (the softmax scale times log2(e)), so the cap is
applied there as cap * log2(e): the same function of s, scaled by log2(e). SOFTCAP is a
constexpr, the cap itself; 0 compiles the step out, so other models run unchanged.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def soft_cap_log2(scores, SOFTCAP: tl.constexpr):
    """scores: fp32 in log2 units -> capped to (-cap, cap) * log2(e). tanh(|x|) is written as
    (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1], which saturates to 1 where a quotient of
    growing exponentials would overflow to inf / inf (NaN)."""
    cap_log2: tl.constexpr = SOFTCAP * 1.4426950408889634
    # exp(-2|x|) with x = scores / cap_log2, as exp2(-2 * log2(e) * |x|).
    e = tl.exp2(tl.abs(scores) * (-2.0 * 1.4426950408889634 / cap_log2))
    capped = cap_log2 * (1.0 - e) / (1.0 + e)
    return tl.where(scores < 0.0, -capped, capped)
