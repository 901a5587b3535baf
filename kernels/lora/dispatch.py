"""Batched LoRA for a mixed batch (punica's shrink/expand): every token carries the slot
of its adapter (-1: the base model), and one call serves all of them.

    shrink:  s[t] = x[t] @ A[slot[t]].T             A: [L, N, K]  -> s: [T, N] fp32
    expand:  y[t] += s[t] @ B[slot[t]].T            B: [L, M, R]  (y may be a column slice)

`reference.py` holds the definitions (a per-token gather) the tests compare against. The
dispatch functions differ from them in two ways that save launches on CUDA:

- `lora_shrink` returns s as partials [S, T, N] whose sum over S is s (one per slice of K
  on CUDA, S = 1 elsewhere); `lora_expand_add` takes them and does the sum.
- `lora_expand_add` serves every part of a fused linear at once: `part_sizes` splits y's
  and B's columns into parts (B: [L, sum(part_sizes), R]), and part p reads s's columns
  p*R .. (p+1)*R (a fused linear's A holds one rank block per part, concatenated).

They take the batch's tokens grouped by slot when the caller knows them on the host
(`groups`: an eager step): then each adapter costs a gather and two matmuls per part, on
any device. Without groups (a CUDA graph, whose slots change at every replay) they run
the Triton kernels (kernels/lora/dispatch/triton_shrink_expand.py: blocks of consecutive tokens, a tensor-core
dot per distinct slot of a block) on CUDA, and group on the spot on CPU.
"""

from __future__ import annotations

import torch

# (slot, the indices of its tokens, or None: every token), one per adapter in the batch.
SlotGroups = list[tuple[int, torch.Tensor | None]]


def _groups(slots: torch.Tensor) -> SlotGroups:
    """(slot, token indices) per adapter in the batch; None: every token."""
    values = slots.unique().tolist()
    if len(values) == 1:
        return [] if values[0] < 0 else [(values[0], None)]
    return [(v, (slots == v).nonzero().squeeze(1)) for v in values if v >= 0]


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, groups: SlotGroups | None = None
) -> torch.Tensor:
    """x: [T, K], a: [L, N, K], slots: [T] (int, -1 = none) -> s as partials [S, T, N] fp32."""
    if groups is None and x.is_cuda:
        from vllm_cluster.kernels.lora import triton_shrink_expand

        return triton_shrink_expand.lora_shrink(x, a, slots)
    s = x.new_zeros(x.shape[0], a.shape[1], dtype=torch.float32)
    for slot, idx in _groups(slots) if groups is None else groups:
        rows = x if idx is None else x[idx]
        part = rows.float() @ a[slot].float().T
        if idx is None:
            s = part
        else:
            s[idx] = part
    return s.unsqueeze(0)


def lora_expand_add(
    y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
    part_sizes: tuple[int, ...] | None = None, groups: SlotGroups | None = None,
) -> None:
    """y[t, part p] += s[t, p*R:(p+1)*R] @ b[slots[t], part p].T in place, s summed over its
    partials; y: [T, M] (a column slice is fine), s: [S, T, P*R], b: [L, M, R],
    part_sizes: the parts' column counts (None: one part)."""
    if groups is None and y.is_cuda:
        from vllm_cluster.kernels.lora import triton_shrink_expand

        triton_shrink_expand.lora_expand_add(y, s, b, slots, part_sizes)
        return
    summed = s[0] if s.shape[0] == 1 else s.sum(0)  # [T, P*R]
    groups = _groups(slots) if groups is None else groups
    r, start = b.shape[2], 0
    for p, size in enumerate(part_sizes or (y.shape[1],)):
        _expand_part(y[:, start : start + size], summed[:, p * r : (p + 1) * r], b[:, start : start + size], groups)
        start += size


def _expand_part(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, groups: SlotGroups) -> None:
    # y: [T, M], s: [T, R], b: [L, M, R]
    for slot, idx in groups:
        if idx is None:
            y += (s @ b[slot].float().T).to(y.dtype)
        else:
            y[idx] += (s[idx] @ b[slot].float().T).to(y.dtype)
