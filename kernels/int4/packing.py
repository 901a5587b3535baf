"""How GPTQ and AWQ checkpoints pack INT4 weights, and unpacking them to values 0..15.

The two layouts, for a linear layer of K input and N output features (G groups):

  GPTQ (AutoGPTQ / GPTQModel):
    qweight int32 [K/8, N]   nibble j (bits 4j..4j+3) of row r holds input k = 8r + j
    qzeros  int32 [G, N/8]   nibble j of column c holds output n = 8c + j
    scales  fp16  [G, N]
    g_idx   int32 [K]        the group of each input (not monotonic under act-order)
    format v1 ("gptq") stores zero - 1; v2 ("gptq_v2") stores the zero itself.

  AWQ (AutoAWQ GEMM):
    qweight int32 [K, N/8]   nibble i of column c holds output n = 8c + AWQ_ORDER[i]
    qzeros  int32 [G, N/8]   the same interleave
    scales  fp16  [G, N]     group of input k is k // group_size

Both dequantize as w[k, n] = (q[k, n] - zero[g(k), n]) * scale[g(k), n].
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# AWQ_NIBBLE[j]: the nibble that holds output 8c + j (the inverse of AWQ_ORDER).
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., C] -> int32 [..., C, 8]: nibble i of each word at index i, as 0..15."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return (packed.unsqueeze(-1) >> shifts) & 0xF


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight: [K/8, N] packed along the input dim -> [K, N] values 0..15."""
    rows, cols = packed.shape
    return _nibbles(packed).permute(0, 2, 1).reshape(rows * 8, cols)


def unpack_cols(packed: torch.Tensor, layout: str) -> torch.Tensor:
    """[R, N/8] packed along the output dim -> [R, N] values 0..15, in output order:
    sequential nibbles for GPTQ qzeros, the AWQ interleave for AWQ qweight and qzeros."""
    rows, cols = packed.shape
    nibbles = _nibbles(packed)  # [R, N/8, 8] in nibble order
    if layout == "awq":
        nibbles = nibbles[..., list(AWQ_NIBBLE)]
    return nibbles.reshape(rows, cols * 8)


def group_index(in_features: int, group_size: int, device: torch.device) -> torch.Tensor:
    """The group of each input, int32 [K], for groups of consecutive inputs (-1: one group)."""
    size = in_features if group_size == -1 else group_size
    return torch.arange(in_features, dtype=torch.int32, device=device) // size
