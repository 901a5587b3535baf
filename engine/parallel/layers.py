"""The modules tensor parallelism swaps into a built model (engine/parallel/tensor.py).

Column-parallel linears need no module of their own: each rank keeps a slice of the
output rows of the existing nn.Linear. Row-parallel linears (o_proj, down_proj) take a
slice of the input and sum their partial outputs over the group. The vocabulary splits
into equal row blocks: each rank embeds the ids it holds (zero elsewhere, then summed),
and computes the logits of its block (gathered on the group's first rank).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from vllm_cluster.engine.parallel.groups import Group
from vllm_cluster.kernels.linear.dispatch import linear


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r @ W_r^T, where x_r, W_r are this rank's input columns."""

    def __init__(self, weight: torch.Tensor, group: Group) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in / tp]
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)  # x: [T, in / tp] -> [T, out], partial
        self.group.all_reduce_(y)
        return y


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: nn.Parameter, vocab_start: int, group: Group) -> None:
        super().__init__()
        self.weight = weight  # [V / tp (padded), D]: ids vocab_start .. vocab_start + rows - 1
        self.vocab_start = vocab_start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start  # [T]
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(torch.where(mine, local, 0), self.weight)  # [T, D]
        x.masked_fill_(~mine.unsqueeze(-1), 0.0)
        self.group.all_reduce_(x)
        return x


class ParallelLMHead(nn.Module):
    def __init__(self, weight: nn.Parameter, vocab_size: int, group: Group) -> None:
        super().__init__()
        self.weight = weight  # [V / tp (padded), D], shared with the embedding when tied
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits [N, V] on the group's first rank; elsewhere this rank's block only."""
        local = F.linear(hidden, self.weight)  # [N, V / tp]
        full = self.group.gather_cat(local, dim=-1)
        return local if full is None else full[:, : self.vocab_size]
