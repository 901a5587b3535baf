"""A probe kept for the next attempt at the INT4 GEMV's memory side: the MMA GEMV's loop
(kernels/triton_int4_mma_gemv.py, its PTX from kernels/int4_mma_ptx.py) with the weights
brought in by TMA (the Hopper bulk tensor copy) through a ring of shared-memory stages
under mbarriers, written in Gluon (Triton 3.6's `triton.experimental.gluon`, explicit
layouts and shared memory), against the production kernel in the same run. Two variants:
one partition whose warps issue the copies `STAGES - 1` steps ahead (Triton inserts the
barriers that keep a stage from being refilled while it is read), and a warp-specialised
one (one producer warp, `gl.warp_specialize`, the consumers releasing a stage on an
mbarrier). One row of x, bf16, no split of K and no SiLU: enough to time the loop, not a
replacement (session 14 measured both no faster than the register prefetch they would
replace; docs/benchmarks.md). GPU (sm_90) only.

The weight tile [16 * warps rows, 16 * unroll words] is read from shared memory in a linear
layout that gives lane (g, t) of warp w words 4t..4t + 3 (+ 16 per block) of rows 16w + g and
16w + g + 8: the A fragments the PTX takes, split into its operands by reshape / permute /
split with no data movement.

    PYTHONPATH=. python benchmarks/bench_int4_tma_gemv.py
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from benchmarks.bench_int4_gemv import GROUP, packed_set, timed
from kernels import int4_reference
from kernels.int4_mma_ptx import ASM, CONSTRAINTS
from kernels.triton_int4_mma_gemv import gemv_pairs_mma, pick_mma_gemv_config

SHAPES = {"gate_up": (4096, 28672), "down": (14336, 4096), "qkv": (4096, 6144)}  # (K, N)
# (variant, warps, blocks of 128 a step, stages, register cap of the warp-specialised kernel)
CONFIGS = [("tma", 4, 2, 4, None), ("tma", 4, 2, 8, None), ("tma", 2, 2, 8, None), ("ws", 4, 2, 4, 128), ("ws", 4, 2, 8, 96)]


def weight_layout(warps: int, unroll: int) -> gl.DistributedLinearLayout:
    """[16 * warps rows, 16 * unroll words]: lane (g, t) of warp w holds words 4t..4t+3 (+16 per
    block) of rows 16w + g and 16w + g + 8."""
    regs = [[0, 1], [0, 2]] + ([[0, 16]] if unroll == 2 else []) + [[8, 0]]
    lanes = [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]]
    warp_bases = [[16 << i, 0] for i in range(warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(regs, lanes, warp_bases, [], [16 * warps, 16 * unroll])


@gluon.jit
def _split4(v, L: gl.constexpr):
    even, odd = gl.split(gl.reshape(v, (v.shape[0], 2, 2)))
    c0, c2 = gl.split(even)
    c1, c3 = gl.split(odd)
    return (gl.convert_layout(c0, L, assert_trivial=True), gl.convert_layout(c1, L, assert_trivial=True),
            gl.convert_layout(c2, L, assert_trivial=True), gl.convert_layout(c3, L, assert_trivial=True))


@gluon.jit
def _offset(qzeros_ptr, group, row, N, ZERO_OFFSET: gl.constexpr):
    """-(128 + zero) of a row (bf16's OFFSET; kernels/triton_int4_mma_gemv.py)."""
    zero = ((gl.load(qzeros_ptr + group * (N // 8) + row // 8) >> ((row % 8) * 4)) & 0xF) + ZERO_OFFSET
    return -(128.0 + zero.to(gl.float32))


@gluon.jit
def _lanes(N, UNROLL: gl.constexpr, WARPS: gl.constexpr):
    """Element i of the [T] operands: lane i % 32 of warp (i // 32) % WARPS, block of the step
    i // (32 WARPS). -> (block, row_lo, row_hi, x's pairs 16p + 4t + c as [T, 4] pointers
    to offset from x)."""
    T: gl.constexpr = UNROLL * WARPS * 32
    L4: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [WARPS, 1], [1, 0])
    i = gl.arange(0, T, layout=gl.SliceLayout(1, L4))
    block = i // (32 * WARPS)
    g = i % 32 // 4
    t = i % 4
    row_lo = gl.program_id(0) * 16 * WARPS + (i // 32) % WARPS * 16 + g
    row_hi = row_lo + 8
    pairs = gl.expand_dims(block * 64 + 4 * t, 1) + gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, L4)), 0)
    return block, gl.where(row_lo < N, row_lo, 0), gl.where(row_hi < N, row_hi, 0), pairs


@gluon.jit
def _operands(step, block, row_lo, row_hi, x_pairs, qzeros_ptr, scales_ptr, N,
              UNROLL: gl.constexpr, WARPS: gl.constexpr, GROUP_BLOCKS: gl.constexpr, ZERO_OFFSET: gl.constexpr):  # fmt: skip
    """A step's operands other than the weight, loaded before waiting for its stage: the
    rows' offsets and scales, and x's pairs ([T, 4] each, p = 0..3)."""
    group = (step * UNROLL + block) // GROUP_BLOCKS
    xk = x_pairs + step * 64 * UNROLL
    return (
        _offset(qzeros_ptr, group, row_lo, N, ZERO_OFFSET), _offset(qzeros_ptr, group, row_hi, N, ZERO_OFFSET),
        gl.load(scales_ptr + group * N + row_lo).to(gl.float32), gl.load(scales_ptr + group * N + row_hi).to(gl.float32),
        (gl.load(xk), gl.load(xk + 16), gl.load(xk + 32), gl.load(xk + 48)),
    )  # fmt: skip


@gluon.jit
def _step(w, operands, acc0, acc1, UNROLL: gl.constexpr, WARPS: gl.constexpr, ASM: gl.constexpr, CONSTRAINTS: gl.constexpr):
    """One step (UNROLL blocks of 128 inputs) of the PTX into the accumulators; w: the
    step's weight tile [16 WARPS rows, 16 UNROLL words] in registers (weight_layout)."""
    T: gl.constexpr = UNROLL * WARPS * 32
    L4: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [WARPS, 1], [1, 0])
    L1: gl.constexpr = gl.SliceLayout(1, L4)
    off_lo, off_hi, s_lo, s_hi, xs = operands
    a0, a1, a2, a3 = _split4(xs[0], L1)
    b0, b1, b2, b3 = _split4(xs[1], L1)
    c0, c1, c2, c3 = _split4(xs[2], L1)
    d0, d1, d2, d3 = _split4(xs[3], L1)
    # (warp, half, g, block, t, c) -> (block, warp, g, t, half, c): registers only
    w = gl.permute(gl.reshape(w, (WARPS, 2, 8, UNROLL, 4, 4)), (3, 0, 2, 4, 1, 5))
    lo4, hi4 = gl.split(gl.permute(gl.reshape(w, (T, 2, 4)), (0, 2, 1)))
    lo0, lo1, lo2, lo3 = _split4(gl.convert_layout(lo4, L4, assert_trivial=True), L1)
    hi0, hi1, hi2, hi3 = _split4(gl.convert_layout(hi4, L4, assert_trivial=True), L1)
    return gl.inline_asm_elementwise(
        ASM, CONSTRAINTS,
        [lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, off_lo, off_hi, a0, a1, a2, a3, b0, b1, b2, b3,
         c0, c1, c2, c3, d0, d1, d2, d3, s_lo, s_hi, acc0, acc1],
        dtype=(gl.float32, gl.float32), is_pure=True, pack=1,
    )  # fmt: skip


@gluon.jit
def _store(acc0, acc1, y_ptr, N, UNROLL: gl.constexpr, WARPS: gl.constexpr):
    """Sum the blocks of a step and store rows g (acc0) and g + 8 (acc1) of each tile once
    (every lane t holds the same sums)."""
    T: gl.constexpr = UNROLL * WARPS * 32
    lo = gl.sum(gl.reshape(acc0, (UNROLL, T // UNROLL)), axis=0)
    hi = gl.sum(gl.reshape(acc1, (UNROLL, T // UNROLL)), axis=0)
    j = gl.arange(0, T // UNROLL, layout=lo.type.layout)
    row = gl.program_id(0) * 16 * WARPS + (j // 32) * 16 + (j % 32) // 4
    keep = (j % 4) == 0
    gl.store(y_ptr + row, lo.to(y_ptr.dtype.element_ty), mask=keep & (row < N))
    gl.store(y_ptr + row + 8, hi.to(y_ptr.dtype.element_ty), mask=keep & (row + 8 < N))


@gluon.jit
def _tma_gemv_kernel(
    w_desc, x_ptr, qzeros_ptr, scales_ptr, y_ptr, N, K,
    UNROLL: gl.constexpr, WARPS: gl.constexpr, STAGES: gl.constexpr, GROUP_BLOCKS: gl.constexpr,
    ZERO_OFFSET: gl.constexpr, W_LAYOUT: gl.constexpr, ASM: gl.constexpr, CONSTRAINTS: gl.constexpr,
):  # fmt: skip
    """One partition: every step issues the copy of step + STAGES - 1, then waits for its own."""
    BLOCK_N: gl.constexpr = 16 * WARPS
    WORDS: gl.constexpr = 16 * UNROLL
    T: gl.constexpr = UNROLL * WARPS * 32
    L1: gl.constexpr = gl.SliceLayout(1, gl.BlockedLayout([1, 4], [32, 1], [WARPS, 1], [1, 0]))
    pid = gl.program_id(0)
    block, row_lo, row_hi, pairs = _lanes(N, UNROLL, WARPS)
    x_pairs = x_ptr.to(gl.pointer_type(gl.uint32)) + pairs
    smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, WORDS], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    num_steps = K // (128 * UNROLL)
    for s in gl.static_range(STAGES - 1):
        mbarrier.expect(bars.index(s), w_desc.block_type.nbytes, s < num_steps)
        tma.async_copy_global_to_shared(w_desc, [pid * BLOCK_N, s * WORDS], bars.index(s), smem.index(s), s < num_steps)
    acc0 = gl.zeros([T], gl.float32, layout=L1)
    acc1 = gl.zeros([T], gl.float32, layout=L1)
    for step in range(num_steps):
        ahead = step + STAGES - 1
        bar = bars.index(ahead % STAGES)
        mbarrier.expect(bar, w_desc.block_type.nbytes, ahead < num_steps)
        tma.async_copy_global_to_shared(w_desc, [pid * BLOCK_N, ahead * WORDS], bar, smem.index(ahead % STAGES), ahead < num_steps)
        operands = _operands(step, block, row_lo, row_hi, x_pairs, qzeros_ptr, scales_ptr, N, UNROLL, WARPS,
                             GROUP_BLOCKS, ZERO_OFFSET)  # fmt: skip
        mbarrier.wait(bars.index(step % STAGES), (step // STAGES) & 1)
        w = smem.index(step % STAGES).load(W_LAYOUT)
        acc0, acc1 = _step(w, operands, acc0, acc1, UNROLL, WARPS, ASM, CONSTRAINTS)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
    _store(acc0, acc1, y_ptr, N, UNROLL, WARPS)


@gluon.jit
def _ws_load(w_desc, smem, ready, empty, num_steps, BLOCK_N: gl.constexpr, WORDS: gl.constexpr, STAGES: gl.constexpr):
    """The producer warp: refill a stage once its consumers released it."""
    pid = gl.program_id(0)
    for step in range(num_steps):
        slot = step % STAGES
        mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [pid * BLOCK_N, step * WORDS], ready.index(slot), smem.index(slot))


@gluon.jit
def _ws_compute(x_ptr, qzeros_ptr, scales_ptr, y_ptr, N, smem, ready, empty, num_steps,
                UNROLL: gl.constexpr, WARPS: gl.constexpr, STAGES: gl.constexpr, GROUP_BLOCKS: gl.constexpr,
                ZERO_OFFSET: gl.constexpr, W_LAYOUT: gl.constexpr, ASM: gl.constexpr, CONSTRAINTS: gl.constexpr):  # fmt: skip
    """The consumer warps: read a stage into registers, release it, compute."""
    T: gl.constexpr = UNROLL * WARPS * 32
    L1: gl.constexpr = gl.SliceLayout(1, gl.BlockedLayout([1, 4], [32, 1], [WARPS, 1], [1, 0]))
    block, row_lo, row_hi, pairs = _lanes(N, UNROLL, WARPS)
    x_pairs = x_ptr.to(gl.pointer_type(gl.uint32)) + pairs
    acc0 = gl.zeros([T], gl.float32, layout=L1)
    acc1 = gl.zeros([T], gl.float32, layout=L1)
    for step in range(num_steps):
        slot = step % STAGES
        operands = _operands(step, block, row_lo, row_hi, x_pairs, qzeros_ptr, scales_ptr, N, UNROLL, WARPS,
                             GROUP_BLOCKS, ZERO_OFFSET)  # fmt: skip
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        w = smem.index(slot).load(W_LAYOUT)
        fence_async_shared()
        mbarrier.arrive(empty.index(slot), count=1)
        acc0, acc1 = _step(w, operands, acc0, acc1, UNROLL, WARPS, ASM, CONSTRAINTS)
    _store(acc0, acc1, y_ptr, N, UNROLL, WARPS)


@gluon.jit
def _ws_gemv_kernel(
    w_desc, x_ptr, qzeros_ptr, scales_ptr, y_ptr, N, K,
    UNROLL: gl.constexpr, WARPS: gl.constexpr, STAGES: gl.constexpr, GROUP_BLOCKS: gl.constexpr,
    ZERO_OFFSET: gl.constexpr, W_LAYOUT: gl.constexpr, ASM: gl.constexpr, CONSTRAINTS: gl.constexpr,
):  # fmt: skip
    """Warp-specialised: WARPS consumer warps and one producer warp."""
    BLOCK_N: gl.constexpr = 16 * WARPS
    WORDS: gl.constexpr = 16 * UNROLL
    smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, WORDS], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    num_steps = K // (128 * UNROLL)
    gl.warp_specialize(
        [
            (_ws_compute, (x_ptr, qzeros_ptr, scales_ptr, y_ptr, N, smem, ready, empty, num_steps, UNROLL, WARPS,
                           STAGES, GROUP_BLOCKS, ZERO_OFFSET, W_LAYOUT, ASM, CONSTRAINTS)),
            (_ws_load, (w_desc, smem, ready, empty, num_steps, BLOCK_N, WORDS, STAGES)),
        ],
        [1], [24],
    )  # fmt: skip


def descriptor(qweight: torch.Tensor, warps: int, unroll: int) -> TensorDescriptor:
    """The TMA descriptor of a pairs-layout weight [N, K / 8] in tiles of [16 warps, 16 unroll] words."""
    block = [16 * warps, 16 * unroll]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.int32)
    return TensorDescriptor(qweight, list(qweight.shape), list(qweight.stride()), block, layout)


def _launch(kernel, x, desc, qzeros, scales, group_size, zero_offset, warps, unroll, stages, **options):  # type: ignore[no-untyped-def]
    n, words = desc.shape
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    kernel[(triton.cdiv(n, 16 * warps),)](
        desc, x, qzeros, scales, y, n, words * 8,
        UNROLL=unroll, WARPS=warps, STAGES=stages, GROUP_BLOCKS=group_size // 128, ZERO_OFFSET=zero_offset,
        W_LAYOUT=weight_layout(warps, unroll), ASM=ASM[False, False], CONSTRAINTS=CONSTRAINTS[False], num_warps=warps,
        **options,
    )  # fmt: skip
    return y


def gemv_tma(x, desc, qzeros, scales, group_size, zero_offset, warps=4, unroll=2, stages=4):  # type: ignore[no-untyped-def]
    """One row of bf16 x @ the weight of `desc` -> [1, N], one partition."""
    return _launch(_tma_gemv_kernel, x, desc, qzeros, scales, group_size, zero_offset, warps, unroll, stages)


def gemv_ws(x, desc, qzeros, scales, group_size, zero_offset, warps=4, unroll=2, stages=4, maxnreg=None):  # type: ignore[no-untyped-def]
    """The same, warp-specialised (maxnreg: the register cap of every warp)."""
    return _launch(_ws_gemv_kernel, x, desc, qzeros, scales, group_size, zero_offset, warps, unroll, stages, maxnreg=maxnreg)


def main() -> None:
    torch.manual_seed(0)
    for name, (k, n) in SHAPES.items():
        sets = [packed_set(k, n) for _ in range(max(2, int(4e8 // (k * n // 2))))]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        t = sets[0]
        ref = int4_reference.int4_gemm(x.float(), t["qweight"], t["qzeros"], t["scales"].float(), None, GROUP, "gptq", 1)
        cfg = pick_mma_gemv_config(n, k, torch.cuda.get_device_properties(0).multi_processor_count)
        calls: list[Callable[[], object]] = [functools.partial(gemv_pairs_mma, x, s["pairs"], s["qzeros"], s["scales"], GROUP, 1, cfg) for s in sets]
        row: dict[str, object] = {"shape": name, "mma_gemv_us": round(timed(calls), 2)}
        for kind, warps, unroll, stages, maxnreg in CONFIGS:
            descs = [descriptor(s["pairs"], warps, unroll) for s in sets]
            fn = functools.partial(gemv_tma, warps=warps, unroll=unroll, stages=stages)
            if kind == "ws":
                fn = functools.partial(gemv_ws, warps=warps, unroll=unroll, stages=stages, maxnreg=maxnreg)
            y = fn(x, descs[0], t["qzeros"], t["scales"], GROUP, 1).float()
            label = f"{kind}_w{warps}_u{unroll}_s{stages}"
            row[f"{label}_rel_err"] = round(float((y - ref).norm() / ref.norm()), 5)
            pairs = zip(descs, sets, strict=True)
            tma_calls: list[Callable[[], object]] = [
                functools.partial(fn, x, d, s["qzeros"], s["scales"], GROUP, 1) for d, s in pairs
            ]
            row[f"{label}_us"] = round(timed(tma_calls), 2)
        print(json.dumps(row), flush=True)
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
