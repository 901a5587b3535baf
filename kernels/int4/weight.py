"""An INT4 weight as every INT4 function takes it: the packed tensors of one linear layer of
K inputs and N outputs in G groups, and how to read them.

Every layout dequantizes as w[k, n] = (q[k, n] - zero[g(k), n]) * scale[g(k), n], with
zero = the stored nibble + zero_offset: the checkpoints' layouts are in packing.py, the
decode layouts GPTQ is repacked into at load in layouts.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# gptq, awq: as the checkpoint stores them; rows, pairs, tiles: GPTQ repacked at load (layouts.py).
LAYOUTS = ("gptq", "awq", "rows", "pairs", "tiles")


@dataclass(frozen=True, slots=True)
class Int4Weight:
    qweight: torch.Tensor  # int32: gptq [K/8, N], awq [K, N/8], rows and pairs [N, K/8], tiles [N/16, K/128, 256]
    qzeros: torch.Tensor  # int32 [G, N/8]: packed along N (awq: with its interleave)
    scales: torch.Tensor  # fp16 [G, N]
    g_idx: torch.Tensor | None  # int32 [K]: the group of each input (act-order); None: consecutive groups
    group_size: int  # inputs per group of consecutive inputs; -1: one group
    layout: str  # one of LAYOUTS
    zero_offset: int  # added to each stored zero: 1 for GPTQ v1 (which stores zero - 1), else 0

    def __post_init__(self) -> None:
        assert self.layout in LAYOUTS, f"INT4 layout {self.layout!r} is none of {LAYOUTS}"

    def group(self, in_features: int) -> int:
        """Inputs per group of consecutive inputs: group_size, or in_features for one group."""
        return in_features if self.group_size == -1 else self.group_size
