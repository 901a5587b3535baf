"""The torch definition of `int4_gemm`, used on CPU and as the reference the Triton kernels
are tested against: dequantize the whole weight, whatever its layout (the checkpoint's,
kernels/int4/packing.py, or a decode layout, kernels/int4/layouts.py), and multiply in fp32.
Every layout dequantizes as w[k, n] = (q[k, n] - zero[g(k), n]) * scale[g(k), n].
"""

from __future__ import annotations

import torch

from vllm_cluster.kernels.int4.layouts import tiles_to_pairs, unpack_pairs_layout, unpack_rows_layout
from vllm_cluster.kernels.int4.packing import group_index, unpack_cols, unpack_rows
from vllm_cluster.kernels.int4.weight import Int4Weight


def dequantize(weight: Int4Weight) -> torch.Tensor:
    """The fp32 weight [K, N]: groups by g_idx (act-order) where it is set, else of
    `group_size` consecutive inputs (-1: one)."""
    layout, qweight = weight.layout, weight.qweight
    if layout == "rows":
        q = unpack_rows_layout(qweight)  # [K, N]
    elif layout in ("pairs", "tiles"):
        q = unpack_pairs_layout(tiles_to_pairs(qweight) if layout == "tiles" else qweight)
    else:
        q = unpack_rows(qweight) if layout == "gptq" else unpack_cols(qweight, "awq")  # [K, N]
    zeros = unpack_cols(weight.qzeros, layout) + weight.zero_offset  # [G, N]
    g_idx = weight.g_idx
    if g_idx is None:
        g_idx = group_index(q.shape[0], weight.group_size, q.device)
    groups = g_idx.long()
    return (q - zeros[groups]).float() * weight.scales[groups].float()


def int4_gemm(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """x [M, K] @ dequantize(weight) [K, N] -> [M, N] in x's dtype (fp32 accumulation)."""
    return (x.float() @ dequantize(weight)).to(x.dtype)
