"""Combining the splits of the split-K decode attention (kernels/attention/triton_decode.py).

Each split of a (sequence, KV head) leaves a partial per query head: the running max of its
scores (log2 domain), the sum of their exponentials and the unnormalised weighted V rows.
`combine_splits_kernel` (grid (B, Hq), a second launch) rescales them to a common max and
divides by the total. Empty splits (max -inf) weigh 0; a padding row, all splits empty,
gets zeros. (Combining in the attention kernel instead, its last split per KV head counted
in on a semaphore, measured neutral on the H200's batch-1 step: docs/benchmarks.md.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_cluster.kernels.sync import pdl


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
