"""The torch definition of kernels/moe/triton_grouped.py: each token's top-k experts, one
(token, k) slot at a time, weighted and summed in k order. Shapes as in
engine/models/mixtral.py: w13 [E, 2I, D] = [gate | up] per expert, w2 [E, D, I]."""

from __future__ import annotations

import torch
from torch.nn import functional as F


def moe_selected_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_start: int = 0,
) -> torch.Tensor:
    """x [T, D], weights [T, K] fp32, expert_ids [T, K] global ids -> [T, D]: sum over k of
    weights[t, k] * expert(x[t]), where expert e is silu(x W1_e^T) * (x W3_e^T) W2_e^T and only
    the experts expert_start .. expert_start + E - 1 are this rank's (the rest add nothing)."""
    num_local, two_i, _ = w13.shape
    inter = two_i // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for k in range(expert_ids.shape[1]):
            e = int(expert_ids[t, k]) - expert_start
            if not 0 <= e < num_local:
                continue
            gate_up = F.linear(x[t].float(), w13[e].float())  # [2I]
            h = F.silu(gate_up[:inter]) * gate_up[inter:]  # [I]
            out[t] += float(weights[t, k]) * F.linear(h, w2[e].float())
    return out.to(x.dtype)
