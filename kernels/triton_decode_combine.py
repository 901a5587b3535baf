"""Combining the splits of the split-K decode attention (kernels/triton_decode_attention.py).

Each split of a (sequence, KV head) leaves a partial per query head: the running max of its
scores (log2 domain), the sum of their exponentials and the unnormalised weighted V rows.
The result rescales them to a common max and divides by the total: either a second launch
(`combine_splits_kernel`, grid (B, Hq)) or, with the decode attention's FUSED_COMBINE, the
last split of each KV head to finish (`combine_if_last`, a semaphore per (sequence, KV
head): kernels/semaphores.py). Empty splits (max -inf) weigh 0; a padding row, all splits
empty, gets zeros.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels import pdl


@triton.jit
def combine_if_last(
    lock_ptr, out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, first_part, stride_out_head, seq_len, split_len,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):  # fmt: skip
    """Called by every split of one KV head once its partials are stored: the last to count
    itself in on the KV head's semaphore combines them all (`_combine_group`), then sets the
    semaphore back to 0 for the next launch or graph replay."""
    tl.debug_barrier()  # every thread's partial is written before the semaphore counts it
    if tl.atomic_add(lock_ptr, 1, sem="acq_rel") == NUM_SPLITS - 1:
        _combine_group(
            out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, first_part, stride_out_head, seq_len, split_len,
            GROUP, HEAD_DIM, HEAD_DIM_PAD, NUM_SPLITS, SPLITS_PAD,
        )  # fmt: skip
        tl.atomic_xchg(lock_ptr, 0, sem="relaxed")


@triton.jit
def _combine_group(
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, first_part, stride_out_head, seq_len, split_len,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):  # fmt: skip
    """`combine_splits_kernel` for one KV head's GROUP query heads (partials from row
    first_part; out_ptr at the first head's output), run by the last of its splits to
    finish. Partials are read from L2 (.cg: other SMs wrote them); acc rows only of splits
    that saw tokens (the others weigh 0), 8 splits a step to bound the registers."""
    GROUP_P2: tl.constexpr = triton.next_power_of_2(GROUP)
    CHUNK: tl.constexpr = min(8, SPLITS_PAD)
    rows = tl.arange(0, GROUP_P2)
    row_ok = rows < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    splits = tl.arange(0, SPLITS_PAD)
    part = (first_part + rows)[:, None] * NUM_SPLITS + splits[None, :]  # [G, S]
    ok = row_ok[:, None] & (splits < NUM_SPLITS)[None, :]
    part_max = tl.load(part_max_ptr + part, mask=ok, other=float("-inf"), cache_modifier=".cg")
    part_sum = tl.load(part_sum_ptr + part, mask=ok, other=0.0, cache_modifier=".cg")
    global_max = tl.max(part_max, 1)
    global_max = tl.where(global_max > float("-inf"), global_max, 0.0)  # all splits empty
    total = tl.sum(part_sum * tl.exp2(part_max - global_max[:, None]), 1)
    acc = tl.zeros([GROUP_P2, HEAD_DIM_PAD], tl.float32)
    for first in tl.static_range(0, NUM_SPLITS, CHUNK):
        chunk = first + tl.arange(0, CHUNK)
        chunk_part = (first_part + rows)[:, None] * NUM_SPLITS + chunk[None, :]  # [G, C]
        active = row_ok[:, None] & ((chunk < NUM_SPLITS) & (chunk * split_len < seq_len))[None, :]
        chunk_max = tl.load(part_max_ptr + chunk_part, mask=active, other=float("-inf"), cache_modifier=".cg")
        weight = tl.exp2(chunk_max - global_max[:, None])  # [G, C]
        acc_ptrs = part_acc_ptr + chunk_part[:, :, None] * HEAD_DIM_PAD + dims[None, None, :]
        part_acc = tl.load(acc_ptrs, mask=active[:, :, None], other=0.0, cache_modifier=".cg")  # [G, C, D]
        acc += tl.sum(part_acc * weight[:, :, None], 1)
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    out_ptrs = out_ptr + rows[:, None] * stride_out_head + dims[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dims < HEAD_DIM)[None, :])


@triton.jit
def combine_splits_kernel(
    out_ptr,  # [B, Hq, D]
    part_max_ptr,  # [B, Hq, NUM_SPLITS]
    part_sum_ptr,  # [B, Hq, NUM_SPLITS]
    part_acc_ptr,  # [B, Hq, NUM_SPLITS, HEAD_DIM_PAD]
    stride_out_seq,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.dependent_start(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    split_ok = splits < NUM_SPLITS
    part = (seq * tl.num_programs(1) + head) * NUM_SPLITS + splits  # [S]

    part_max = tl.load(part_max_ptr + part, mask=split_ok, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + part, mask=split_ok, other=0.0)
    global_max = tl.max(part_max, 0)
    # Empty splits (max -inf) weigh exp2(-inf) = 0; every split is empty in a padding row.
    global_max = tl.where(global_max > float("-inf"), global_max, 0.0)
    weight = tl.exp2(part_max - global_max)
    total = tl.sum(part_sum * weight, 0)
    acc_ptrs = part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :]
    acc = tl.load(acc_ptrs, mask=split_ok[:, None], other=0.0)  # [S, D]
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    out_ptrs = out_ptr + seq * stride_out_seq + head * stride_out_head + dims
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)
