"""Prefetching a weight into the L2 from a kernel that leaves HBM idle.

A batch-1 decode layer streams its weights back to back (qkv, o, gate_up, down), with one
gap: the decode attention, which reads under a megabyte of KV and is bound by latency, not
bandwidth. `prefetch_share` lets such a kernel issue, after its PDL wait (the GEMV before
has finished streaming), Hopper's bulk L2 prefetch (`cp.async.bulk.prefetch.L2.global`,
fire and forget: nothing waits for it and no register holds the data) for its share of the
weight of the GEMV that comes next, so that GEMV finds it in the 50 MB L2 instead of HBM.
A prefetch changes no value, only where the bytes come from.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Threads of the program that run the prefetch (a constexpr, for kernels): 4 warps, each of
# whose first lane issues one bulk prefetch (the instruction takes warp-uniform operands).
THREADS = tl.constexpr(128)


@triton.jit
def prefetch_share(ptr, nbytes, part, parts, THREADS: tl.constexpr):
    """Program `part` of `parts` prefetches its share of the nbytes at ptr (16-byte aligned,
    nbytes a multiple of 16) into the L2: one bulk prefetch per warp, of up to
    cdiv(cdiv(nbytes / 16, parts), THREADS / 32) 16-byte units."""
    WARPS: tl.constexpr = THREADS // 32
    units = nbytes // 16
    per_part = tl.cdiv(units, parts)
    per_warp = tl.cdiv(per_part, WARPS)
    lane = tl.arange(0, THREADS)
    first = part.to(tl.int64) * per_part + (lane // 32).to(tl.int64) * per_warp
    last = tl.minimum(tl.minimum(first + per_warp, (part.to(tl.int64) + 1) * per_part), units)
    size = tl.where(lane % 32 == 0, tl.maximum(last - first, 0) * 16, 0).to(tl.int32)
    address = ptr.to(tl.pointer_type(tl.uint8)) + first * 16
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [address, size], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


def prefetchable(weight: torch.Tensor | None) -> bool:
    """Whether `weight` can be prefetched: a contiguous CUDA tensor, 16-byte aligned and sized."""
    return (
        weight is not None and weight.is_cuda and weight.is_contiguous() and weight.data_ptr() % 16 == 0
        and weight.numel() * weight.element_size() % 16 == 0 and triton.cdiv(weight.numel() * weight.element_size(), 16) < 2**31
    )  # fmt: skip
