"""Device-resident int32 semaphores for kernels whose last program to arrive finishes the
work of all (the split-K INT4 GEMVs' reduction), and that reduction (`reduce_splits`).

Each set lives for the process and is all 0 between launches: the last program sets its
semaphore back to 0, so a CUDA graph replays the kernel as is, with no zeroing launch.
One set per (owner, device): kernels of different owners may run at once under PDL (a
dependent starts before the kernel before it ends) and must not share semaphores. Two
launches of one owner must not run at once on two streams of a device; the engine runs one
stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SETS: dict[tuple[str, torch.device], torch.Tensor] = {}
# Sets replaced by a larger one stay alive: CUDA graphs captured earlier still point at them.
_RETIRED: list[torch.Tensor] = []


def semaphores(owner: str, device: torch.device, count: int) -> torch.Tensor:
    """At least `count` int32 semaphores of `owner` on `device`, all 0 between launches."""
    current = SETS.get((owner, device))
    if current is None or current.numel() < count:
        if current is not None:
            _RETIRED.append(current)
        current = torch.zeros(max(count, 1 << 14), dtype=torch.int32, device=device)
        SETS[owner, device] = current
    return current


@triton.jit
def reduce_splits(
    acc, offs_m, offs_n, M, N, stride_ym, split_k, ws_ptr, lock_ptr, bias_ptr, y_ptr, HAS_BIAS: tl.constexpr
):  # fmt: skip
    """acc: this program's fp32 y^T tile [BN, BM] (rows offs_n of y^T, columns offs_m), its
    part of a product whose K is split over program_id(2) (grid: M blocks, N blocks,
    split_k). Each writes its partial into the workspace ws [split_k, M, N] and counts
    itself in on the semaphore of its tile; the last to arrive writes y = sum of partials
    + bias in y's dtype and sets the semaphore back to 0. split_k 1: y = acc + bias."""
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    tile = offs_m[None, :] * N + offs_n[:, None]
    if split_k == 1:
        total = acc
        is_last = mask
    else:
        tl.store(ws_ptr + tl.program_id(2) * M * N + tile, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the semaphore counts it
        lock = lock_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        arrived = tl.atomic_add(lock, 1, sem="acq_rel")
        is_last = arrived == split_k - 1
        total = tl.zeros_like(acc)
        for split in range(split_k):
            total += tl.load(ws_ptr + split * M * N + tile, mask=mask & is_last, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(lock, 0, mask=is_last, sem="relaxed")
        is_last = mask & is_last
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], total.to(y_ptr.dtype.element_ty), mask=is_last)
