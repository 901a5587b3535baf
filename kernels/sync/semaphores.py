"""Device-resident int32 semaphores for kernels whose last program to arrive finishes the
work of all (the split-K INT4 GEMVs' reduction), and that reduction (`sum_splits`, and
`reduce_splits`, which also stores y).

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
def sum_splits(acc, offs_m, offs_n, M, N, split_k, ws_ptr, lock_ptr):
    """acc: this program's fp32 y^T tile [BN, BM] (rows offs_n of y^T, columns offs_m; rows
    at or past N are not stored), its part of a product whose K is split over program_id(2)
    (grid: M blocks, N blocks, split_k). Each writes its partial into the workspace ws
    [split_k, M, N] and counts itself in on the semaphore of its tile; the last to arrive
    sets the semaphore back to 0. -> (the sum of the partials, in the last program only;
    whether this program is the last, a scalar: it stores the tile). split_k 1: (acc, True)."""
    if split_k == 1:
        total = acc
        is_last = tl.full((), True, tl.int1)
    else:
        mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
        tile = offs_m[None, :] * N + offs_n[:, None]
        tl.store(ws_ptr + tl.program_id(2) * M * N + tile, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the semaphore counts it
        lock = lock_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        arrived = tl.atomic_add(lock, 1, sem="acq_rel")
        is_last = arrived == split_k - 1
        total = tl.zeros_like(acc)
        for split in range(split_k):
            total += tl.load(ws_ptr + split * M * N + tile, mask=mask & is_last, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(lock, 0, mask=is_last, sem="relaxed")
    return total, is_last


@triton.jit
def reduce_splits(
    acc, offs_m, offs_n, M, N, stride_ym, split_k, ws_ptr, lock_ptr, bias_ptr, y_ptr, HAS_BIAS: tl.constexpr
):  # fmt: skip
    """sum_splits, then the last program writes y = sum of partials + bias in y's dtype."""
    total, is_last = sum_splits(acc, offs_m, offs_n, M, N, split_k, ws_ptr, lock_ptr)
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :] & is_last
    tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], total.to(y_ptr.dtype.element_ty), mask=mask)
