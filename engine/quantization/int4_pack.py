"""Round-to-nearest INT4 quantization and packing into the GPTQ and AWQ checkpoint layouts
(kernels/int4/packing.py describes both). Tests build small checkpoints with these, and
`load_format: dummy` fills quantized layers with random valid values; GPTQ's Hessian-based
rounding is not needed for either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_cluster.kernels.int4.packing import AWQ_ORDER, group_index

PACK = 8  # 4-bit values per int32
MAX_Q = 15


@dataclass(frozen=True, slots=True)
class Int4Weights:
    """A quantized weight before packing: w[k, n] = (q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n]."""

    q: torch.Tensor  # int32 [K, N], 0..15
    zeros: torch.Tensor  # int32 [G, N], 0..15
    scales: torch.Tensor  # fp16 [G, N]
    g_idx: torch.Tensor  # int32 [K]


def act_order_g_idx(in_features: int, group_size: int, perm: torch.Tensor) -> torch.Tensor:
    """GPTQ's desc_act groups: inputs are quantized in the order `perm` (a permutation of
    range(K)), and input perm[i] falls in group i // group_size."""
    size = in_features if group_size == -1 else group_size
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[perm] = torch.arange(in_features, dtype=torch.int32) // size
    return g_idx


def quantize_rtn(
    weight: torch.Tensor, group_size: int, sym: bool, g_idx: torch.Tensor | None = None, min_zero: int = 0
) -> Int4Weights:
    """weight [N, K] (nn.Linear layout) -> INT4 by round-to-nearest, one scale and zero per
    (group, output). sym: zero 8 and scale absmax / 7.5 (AutoGPTQ's convention). min_zero:
    the smallest zero allowed (1 for GPTQ v1, which stores zero - 1 in 4 bits)."""
    w = weight.detach().float().t().cpu()  # [K, N]
    in_features, out_features = w.shape
    if g_idx is None:
        g_idx = group_index(in_features, group_size, w.device)
    num_groups = int(g_idx.max()) + 1
    index = g_idx.long()[:, None].expand(in_features, out_features)
    empty = torch.zeros(num_groups, out_features)
    w_max = empty.scatter_reduce(0, index, w, "amax", include_self=False).clamp(min=0)
    w_min = empty.scatter_reduce(0, index, w, "amin", include_self=False).clamp(max=0)
    if sym:
        scales = torch.maximum(-w_min, w_max) * 2 / MAX_Q
        zeros = torch.full_like(scales, (MAX_Q + 1) // 2)
    else:
        scales = (w_max - w_min) / MAX_Q
    scales = torch.where(scales > 0, scales, torch.ones_like(scales)).half()
    if not sym:
        zeros = torch.round(-w_min / scales.float()).clamp(min_zero, MAX_Q)
    rows = g_idx.long()
    q = torch.round(w / scales.float()[rows]) + zeros[rows]
    return Int4Weights(q.clamp(0, MAX_Q).int(), zeros.int(), scales, g_idx.int())


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2**32) -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """[K, N] values 0..15 -> int32 [K/8, N]: nibble j of row r holds row 8r + j."""
    in_features, out_features = q.shape
    assert in_features % PACK == 0, f"{in_features} rows are not a multiple of {PACK}"
    values = q.long().reshape(in_features // PACK, PACK, out_features)
    shifts = torch.arange(0, 32, 4, dtype=torch.long, device=q.device)[None, :, None]
    return _to_int32((values << shifts).sum(dim=1))


def pack_cols(q: torch.Tensor, layout: str) -> torch.Tensor:
    """[R, N] values 0..15 -> int32 [R, N/8]: nibble i of column c holds column 8c + i
    (GPTQ) or 8c + AWQ_ORDER[i] (AWQ)."""
    rows, cols = q.shape
    assert cols % PACK == 0, f"{cols} columns are not a multiple of {PACK}"
    values = q.long().reshape(rows, cols // PACK, PACK)
    if layout == "awq":
        values = values[..., list(AWQ_ORDER)]
    shifts = torch.arange(0, 32, 4, dtype=torch.long, device=q.device)
    return _to_int32((values << shifts).sum(dim=-1))


def pack_gptq(weights: Int4Weights, zero_offset: int = 1) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one GPTQ linear (v1: zero_offset 1, v2: 0)."""
    stored_zeros = weights.zeros - zero_offset
    assert int(stored_zeros.min()) >= 0, "GPTQ v1 cannot store a zero of 0: quantize with min_zero=1"
    return {
        "qweight": pack_rows(weights.q),
        "qzeros": pack_cols(stored_zeros, "gptq"),
        "scales": weights.scales,
        "g_idx": weights.g_idx,
    }


def pack_awq(weights: Int4Weights) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one AWQ GEMM linear (groups of consecutive inputs only)."""
    return {
        "qweight": pack_cols(weights.q, "awq"),
        "qzeros": pack_cols(weights.zeros, "awq"),
        "scales": weights.scales,
    }
