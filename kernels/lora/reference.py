"""The definitions of batched LoRA's shrink and expand (a per-token gather of each token's
adapter), which the dispatch functions (kernels/lora/dispatch/dispatch.py) are tested against."""

from __future__ import annotations

import torch


def lora_shrink_reference(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    # x: [T, K], a: [L, N, K], slots: [T] -> [T, N] fp32
    gathered = a[slots.clamp(min=0).long()].float()  # [T, N, K]
    s = torch.einsum("tk,tnk->tn", x.float(), gathered)
    return s * (slots >= 0).unsqueeze(1)


def lora_expand_reference(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> None:
    # y: [T, M] (updated in place), s: [T, R], b: [L, M, R], slots: [T]
    gathered = b[slots.clamp(min=0).long()].float()  # [T, M, R]
    delta = torch.einsum("tr,tmr->tm", s.float(), gathered) * (slots >= 0).unsqueeze(1)
    y.copy_((y.float() + delta).to(y.dtype))
