"""The Gluon (Triton 3.6's `triton.experimental.gluon`: explicit layouts and shared memory)
INT4 MMA GEMVs that benchmarks/bench_int4_gluon_gemv.py times against the production kernel
(kernels/int4/triton_mma_gemv.py): its PTX (kernels/int4/mma_ptx.py) on fragments in an
explicit linear layout (`weight_layout`), one row of bf16 x, the tiles layout
(kernels/int4/layouts.py), K over a tile's warps with their sums meeting in shared memory; no
split of K over programs, no SiLU, no norm epilogue. Two ways to read weights before the PDL
wait without holding them in registers, both measured slower (docs/benchmarks.md, "Quantization"):
  `gemv_tma`  a ring of TMA stages, every stage issued before the wait, each refilled once
              every warp has read it (Triton's barriers: three a step);
  `gemv_cp`   the production loop (a step's weights one step ahead in registers) with steps
              1..S copied by cp.async into shared memory before the wait, each lane its own
              words, read back by itself; S = 0 is the production kernel's order.
GPU (sm_90) only.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from vllm_cluster.kernels.int4.mma_ptx import ASM, CONSTRAINTS
from vllm_cluster.kernels.int4.triton_mma_gemv import MmaGemvConfig

GROUP = 128
# Two 8-warp programs an SM at two blocks a step, as the production kernel runs o and down
# (the TMA kernel: 151 registers uncapped, one program an SM; capped, 16 bytes of spill
# outside the loop).
MAX_REGISTERS = 128


def weight_layout(tiles: int, k_warps: int, unroll: int) -> gl.DistributedLinearLayout:
    """A stage [tiles * k_warps * unroll blocks, 256 words] (block rows (tile, k warp, u)): lane
    l of warp (tile, k warp) holds words 8l..8l + 7 of each of its unroll blocks."""
    regs = [[0, 1], [0, 2], [0, 4]] + [[1 << i, 0] for i in range(unroll.bit_length() - 1)]
    lanes = [[0, 8 << i] for i in range(5)]
    warps = [[unroll << i, 0] for i in range(k_warps.bit_length() - 1)]
    warps += [[unroll * k_warps << i, 0] for i in range(tiles.bit_length() - 1)]
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [tiles * k_warps * unroll, 256])


@gluon.jit
def _gdc_wait():
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _gdc_launch_dependents():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _split4(v, L: gl.constexpr):
    even, odd = gl.split(gl.reshape(v, (v.shape[0], 2, 2)))
    c0, c2 = gl.split(even)
    c1, c3 = gl.split(odd)
    return (gl.convert_layout(c0, L, assert_trivial=True), gl.convert_layout(c1, L, assert_trivial=True),
            gl.convert_layout(c2, L, assert_trivial=True), gl.convert_layout(c3, L, assert_trivial=True))  # fmt: skip


@gluon.jit
def _offset(qzeros_ptr, group, row, N, ZERO_OFFSET: gl.constexpr):
    """-(128 + zero) of a row (bf16's OFFSET; kernels/int4/triton_mma_gemv.py)."""
    zero = ((gl.load(qzeros_ptr + group * (N // 8) + row // 8) >> ((row % 8) * 4)) & 0xF) + ZERO_OFFSET
    return -(128.0 + zero.to(gl.float32))


@gluon.jit
def _lanes(x_ptr, N, TILES: gl.constexpr, K_WARPS: gl.constexpr, UNROLL: gl.constexpr):
    """Element i of the [T] operands: lane i % 32 of warp (i // 32) % WARPS, block of the step
    i // (32 WARPS) + UNROLL k warp. -> (block, row_lo, row_hi (rows past N read row 0,
    unstored), x's pairs 16p + 4t + c as [T, 4] pointers, the lane's share of the block sum
    as [T, 2] pointers), at the step's first block."""
    WARPS: gl.constexpr = TILES * K_WARPS
    T: gl.constexpr = UNROLL * WARPS * 32
    L4: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [WARPS, 1], [1, 0])
    L2: gl.constexpr = gl.BlockedLayout([1, 2], [32, 1], [WARPS, 1], [1, 0])
    i = gl.arange(0, T, layout=gl.SliceLayout(1, L4))
    lane = i % 32
    warp = (i // 32) % WARPS
    block = warp % K_WARPS * UNROLL + i // (32 * WARPS)
    g = lane // 4
    t = lane % 4
    row_lo = gl.program_id(0) * 16 * TILES + warp // K_WARPS * 16 + g
    row_hi = gl.where(row_lo + 8 < N, row_lo + 8, 0)
    row_lo = gl.where(row_lo < N, row_lo, 0)
    x32 = x_ptr.to(gl.pointer_type(gl.uint32))
    x_pairs = (
        x32 + gl.expand_dims(block * 64 + 4 * t, 1) + gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, L4)), 0)
    )
    share = gl.convert_layout(
        block * 64 + 16 * (g // 2) + 4 * t + 2 * (g % 2), gl.SliceLayout(1, L2), assert_trivial=True
    )
    x_share = x32 + gl.expand_dims(share, 1) + gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(0, L2)), 0)
    return block, row_lo, row_hi, x_pairs, x_share


@gluon.jit
def _operands(step, block, row_lo, row_hi, x_pairs, x_share, qzeros_ptr, scales_ptr, N,
              STEP: gl.constexpr, GROUP_BLOCKS: gl.constexpr, ZERO_OFFSET: gl.constexpr):  # fmt: skip
    """A step's operands other than the weight: the rows' offsets and scales, x's pairs
    16p + 4t + c ([T, 4] each, p = 0..3) and the lane's share of the block sum ([T, 2])."""
    group = (step * STEP + block) // GROUP_BLOCKS
    xk = x_pairs + step * 64 * STEP
    return (
        _offset(qzeros_ptr, group, row_lo, N, ZERO_OFFSET), _offset(qzeros_ptr, group, row_hi, N, ZERO_OFFSET),
        gl.load(scales_ptr + group * N + row_lo).to(gl.float32),
        gl.load(scales_ptr + group * N + row_hi).to(gl.float32),
        gl.load(xk), gl.load(xk + 16), gl.load(xk + 32), gl.load(xk + 48), gl.load(x_share + step * 64 * STEP),
    )  # fmt: skip


@gluon.jit
def _step(w, ops, acc0, acc1, TILES: gl.constexpr, K_WARPS: gl.constexpr, UNROLL: gl.constexpr,
          ASM: gl.constexpr, CONSTRAINTS: gl.constexpr):  # fmt: skip
    """One step of the PTX into the accumulators; w: the stage in registers (weight_layout)."""
    WARPS: gl.constexpr = TILES * K_WARPS
    T: gl.constexpr = UNROLL * WARPS * 32
    L4: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [WARPS, 1], [1, 0])
    L1: gl.constexpr = gl.SliceLayout(1, L4)
    off_lo, off_hi, s_lo, s_hi, xa, xb, xc, xd, xs = ops
    a0, a1, a2, a3 = _split4(xa, L1)
    b0, b1, b2, b3 = _split4(xb, L1)
    c0, c1, c2, c3 = _split4(xc, L1)
    d0, d1, d2, d3 = _split4(xd, L1)
    share0, share1 = gl.split(xs)
    share0 = gl.convert_layout(share0, L1, assert_trivial=True)
    share1 = gl.convert_layout(share1, L1, assert_trivial=True)
    # (tile, k warp, u, lane, half, c) -> (u, tile, k warp, lane, c, half): registers only
    w = gl.permute(gl.reshape(w, (TILES, K_WARPS, UNROLL, 32, 2, 4)), (2, 0, 1, 3, 5, 4))
    lo4, hi4 = gl.split(gl.reshape(w, (T, 4, 2)))
    lo0, lo1, lo2, lo3 = _split4(gl.convert_layout(lo4, L4, assert_trivial=True), L1)
    hi0, hi1, hi2, hi3 = _split4(gl.convert_layout(hi4, L4, assert_trivial=True), L1)
    return gl.inline_asm_elementwise(
        ASM, CONSTRAINTS,
        [lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, off_lo, off_hi, a0, a1, a2, a3, b0, b1, b2, b3,
         c0, c1, c2, c3, d0, d1, d2, d3, share0, share1, s_lo, s_hi, acc0, acc1],
        dtype=(gl.float32, gl.float32), is_pure=True, pack=1,
    )  # fmt: skip


@gluon.jit
def _store(acc0, acc1, y_ptr, N, TILES: gl.constexpr, K_WARPS: gl.constexpr, UNROLL: gl.constexpr):
    """Sum the blocks of a step and a tile's warps; store rows g (acc0) and g + 8 (acc1) of
    each tile once (every lane t holds the same sums)."""
    WARPS: gl.constexpr = TILES * K_WARPS
    OUT: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    lo = gl.sum(gl.reshape(acc0, (UNROLL * TILES, K_WARPS, 32)), axis=1)
    hi = gl.sum(gl.reshape(acc1, (UNROLL * TILES, K_WARPS, 32)), axis=1)
    lo = gl.convert_layout(gl.sum(gl.reshape(lo, (UNROLL, TILES * 32)), axis=0), OUT)
    hi = gl.convert_layout(gl.sum(gl.reshape(hi, (UNROLL, TILES * 32)), axis=0), OUT)
    j = gl.arange(0, TILES * 32, layout=OUT)
    row = gl.program_id(0) * 16 * TILES + (j // 32) * 16 + (j % 32) // 4
    keep = (j % 4) == 0
    gl.store(y_ptr + row, lo.to(y_ptr.dtype.element_ty), mask=keep & (row < N))
    gl.store(y_ptr + row + 8, hi.to(y_ptr.dtype.element_ty), mask=keep & (row + 8 < N))


@gluon.jit
def _issue_stage(w_desc, smem, bars, slot, step, num_steps, num_blocks, TILES: gl.constexpr, STEP: gl.constexpr):
    """TMA copies of a step's weights (one a tile) into ring stage `slot`, completing on its
    mbarrier; none past the last step."""
    mbarrier.expect(bars.index(slot), TILES * w_desc.block_type.nbytes, step < num_steps)
    for r in gl.static_range(TILES):
        tile = gl.program_id(0) * TILES + r
        tma.async_copy_global_to_shared(w_desc, [tile * num_blocks + step * STEP, 0], bars.index(slot),
                                        smem.index(slot).slice(r * STEP, STEP), step < num_steps)  # fmt: skip


@gluon.jit
def _tma_gemv_kernel(
    w_desc, x_ptr, qzeros_ptr, scales_ptr, y_ptr, N, K,
    TILES: gl.constexpr, K_WARPS: gl.constexpr, UNROLL: gl.constexpr, STAGES: gl.constexpr,
    GROUP_BLOCKS: gl.constexpr, ZERO_OFFSET: gl.constexpr, W_LAYOUT: gl.constexpr, ASM: gl.constexpr,
    CONSTRAINTS: gl.constexpr, PDL: gl.constexpr,
):  # fmt: skip
    """Program: TILES 16-row tiles, K_WARPS warps each. The ring's STAGES steps are issued
    before the PDL wait; a stage is refilled (STAGES steps ahead) once every warp has read it."""
    WARPS: gl.constexpr = TILES * K_WARPS
    STEP: gl.constexpr = K_WARPS * UNROLL  # blocks of 128 inputs a tile and step
    T: gl.constexpr = UNROLL * WARPS * 32
    L4: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [WARPS, 1], [1, 0])
    L1: gl.constexpr = gl.SliceLayout(1, L4)
    num_blocks = K // 128
    num_steps = num_blocks // STEP
    smem = gl.allocate_shared_memory(gl.int32, [STAGES, TILES * STEP, 256], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(STAGES):
        _issue_stage(w_desc, smem, bars, s, s, num_steps, num_blocks, TILES, STEP)
    if PDL:
        _gdc_wait()
    block, row_lo, row_hi, x_pairs, x_share = _lanes(x_ptr, N, TILES, K_WARPS, UNROLL)
    acc0 = gl.zeros([T], gl.float32, layout=L1)
    acc1 = gl.zeros([T], gl.float32, layout=L1)
    ops = _operands(
        0, block, row_lo, row_hi, x_pairs, x_share, qzeros_ptr, scales_ptr, N, STEP, GROUP_BLOCKS, ZERO_OFFSET
    )
    for step in range(num_steps):
        slot = step % STAGES
        nxt = gl.minimum(step + 1, num_steps - 1)
        n_ops = _operands(nxt, block, row_lo, row_hi, x_pairs, x_share, qzeros_ptr, scales_ptr, N, STEP,
                          GROUP_BLOCKS, ZERO_OFFSET)  # fmt: skip
        mbarrier.wait(bars.index(slot), (step // STAGES) & 1)
        w = smem.index(slot).load(W_LAYOUT)
        _issue_stage(w_desc, smem, bars, slot, step + STAGES, num_steps, num_blocks, TILES, STEP)
        acc0, acc1 = _step(w, ops, acc0, acc1, TILES, K_WARPS, UNROLL, ASM, CONSTRAINTS)
        ops = n_ops
    if PDL:
        _gdc_launch_dependents()
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
    _store(acc0, acc1, y_ptr, N, TILES, K_WARPS, UNROLL)


@gluon.jit
def _weight_ptrs(qweight_ptr, step, num_blocks, num_tiles, W_LAYOUT: gl.constexpr, TILES: gl.constexpr,
                 STEP: gl.constexpr):  # fmt: skip
    """Pointers to a step's weight words in W_LAYOUT: [TILES * STEP block rows, 256 words] of the
    tiles layout seen as [N/16 * K/128, 256] (tiles past the last read tile 0, unstored)."""
    r = gl.arange(0, TILES * STEP, layout=gl.SliceLayout(1, W_LAYOUT))
    c = gl.arange(0, 256, layout=gl.SliceLayout(0, W_LAYOUT))
    tile = gl.program_id(0) * TILES + r // STEP
    tile = gl.where(tile < num_tiles, tile, 0)
    rows = tile * num_blocks + step * STEP + r % STEP
    return qweight_ptr + gl.expand_dims(rows * 256, 1) + gl.expand_dims(c, 0)


@gluon.jit
def _cp_gemv_kernel(
    qweight_ptr, x_ptr, qzeros_ptr, scales_ptr, y_ptr, N, K,
    TILES: gl.constexpr, K_WARPS: gl.constexpr, UNROLL: gl.constexpr, SMEM_STEPS: gl.constexpr,
    GROUP_BLOCKS: gl.constexpr, ZERO_OFFSET: gl.constexpr, W_LAYOUT: gl.constexpr, ASM: gl.constexpr,
    CONSTRAINTS: gl.constexpr, PDL: gl.constexpr,
):  # fmt: skip
    """The production kernel's loop (each step's weights one step ahead in registers) with
    SMEM_STEPS more steps read before the PDL wait: steps 1..SMEM_STEPS copied by cp.async
    into shared memory (each lane its own words, read back by itself), step 0 into registers
    as the production kernel does. SMEM_STEPS = 0: the production kernel's order exactly."""
    WARPS: gl.constexpr = TILES * K_WARPS
    STEP: gl.constexpr = K_WARPS * UNROLL
    T: gl.constexpr = UNROLL * WARPS * 32
    L4: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [WARPS, 1], [1, 0])
    L1: gl.constexpr = gl.SliceLayout(1, L4)
    num_blocks = K // 128
    num_steps = num_blocks // STEP
    num_tiles = N // 16
    w = gl.load(_weight_ptrs(qweight_ptr, 0, num_blocks, num_tiles, W_LAYOUT, TILES, STEP))
    if SMEM_STEPS > 0:
        smem = gl.allocate_shared_memory(
            gl.int32, [SMEM_STEPS, TILES * STEP, 256], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        )
        for s in gl.static_range(SMEM_STEPS):
            ptrs = _weight_ptrs(qweight_ptr, s + 1, num_blocks, num_tiles, W_LAYOUT, TILES, STEP)
            async_copy.async_copy_global_to_shared(smem.index(s), ptrs)
            async_copy.commit_group()
    if PDL:
        _gdc_wait()
    block, row_lo, row_hi, x_pairs, x_share = _lanes(x_ptr, N, TILES, K_WARPS, UNROLL)
    acc0 = gl.zeros([T], gl.float32, layout=L1)
    acc1 = gl.zeros([T], gl.float32, layout=L1)
    ops = _operands(
        0, block, row_lo, row_hi, x_pairs, x_share, qzeros_ptr, scales_ptr, N, STEP, GROUP_BLOCKS, ZERO_OFFSET
    )
    for s in gl.static_range(SMEM_STEPS):  # steps 0..SMEM_STEPS - 1, the next one from shared memory
        n_ops = _operands(s + 1, block, row_lo, row_hi, x_pairs, x_share, qzeros_ptr, scales_ptr, N, STEP,
                          GROUP_BLOCKS, ZERO_OFFSET)  # fmt: skip
        async_copy.wait_group(SMEM_STEPS - 1 - s)
        n_w = smem.index(s).load(W_LAYOUT)
        acc0, acc1 = _step(w, ops, acc0, acc1, TILES, K_WARPS, UNROLL, ASM, CONSTRAINTS)
        w = n_w
        ops = n_ops
    for step in range(SMEM_STEPS, num_steps):
        nxt = gl.minimum(step + 1, num_steps - 1)
        n_w = gl.load(_weight_ptrs(qweight_ptr, nxt, num_blocks, num_tiles, W_LAYOUT, TILES, STEP))
        n_ops = _operands(nxt, block, row_lo, row_hi, x_pairs, x_share, qzeros_ptr, scales_ptr, N, STEP,
                          GROUP_BLOCKS, ZERO_OFFSET)  # fmt: skip
        acc0, acc1 = _step(w, ops, acc0, acc1, TILES, K_WARPS, UNROLL, ASM, CONSTRAINTS)
        w = n_w
        ops = n_ops
    if PDL:
        _gdc_launch_dependents()
    _store(acc0, acc1, y_ptr, N, TILES, K_WARPS, UNROLL)


def _launch(kernel, weight: object, x: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, n: int, k: int,  # noqa: ANN001
            config: MmaGemvConfig, y: torch.Tensor, pdl: bool, **variant: int) -> torch.Tensor:  # fmt: skip
    """One row of bf16 x @ `weight` (a tiles-layout tensor or its TMA descriptor) into y [1, N]."""
    tiles = config.tiles * config.num_warps // config.k_warps
    assert config.split_k == 1 and tiles * config.k_warps == config.num_warps, config
    kernel[(triton.cdiv(n, 16 * tiles),)](
        weight, x, qzeros, scales, y, n, k,
        TILES=tiles, K_WARPS=config.k_warps, UNROLL=config.unroll, GROUP_BLOCKS=GROUP // 128,
        ZERO_OFFSET=1, W_LAYOUT=weight_layout(tiles, config.k_warps, config.unroll), ASM=ASM[False, False],
        CONSTRAINTS=CONSTRAINTS[False], PDL=pdl, num_warps=config.num_warps, launch_pdl=pdl,
        maxnreg=MAX_REGISTERS if config.num_warps == 8 and config.unroll == 2 else None, **variant,
    )  # fmt: skip
    return y


def gemv_cp(x: torch.Tensor, tiles_weight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, n: int, k: int,
            config: MmaGemvConfig, smem_steps: int, y: torch.Tensor, pdl: bool = True) -> torch.Tensor:  # fmt: skip
    """One row of bf16 x @ a tiles-layout weight into y [1, N], `smem_steps` steps (at most
    all but the first) read into shared memory before the PDL wait."""
    smem_steps = min(smem_steps, k // (128 * config.k_warps * config.unroll) - 1)
    return _launch(_cp_gemv_kernel, tiles_weight, x, qzeros, scales, n, k, config, y, pdl, SMEM_STEPS=smem_steps)


def descriptor(tiles_weight: torch.Tensor, config: MmaGemvConfig) -> TensorDescriptor:
    """TMA descriptor of a tiles-layout weight [N/16, K/128, 256] seen as [N/16 * K/128, 256]
    block rows, a copy being one tile's step: [k_warps * unroll, 256] words."""
    flat = tiles_weight.reshape(-1, 256)
    block = [config.k_warps * config.unroll, 256]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), block, layout)


def stages_for(k: int, config: MmaGemvConfig, budget_kb: int) -> int:
    """Steps the ring holds: as many as `budget_kb` of shared memory a program allows, at most all of them."""
    tiles = config.tiles * config.num_warps // config.k_warps
    stage_kb = tiles * config.k_warps * config.unroll
    return max(1, min(k // (128 * config.k_warps * config.unroll), budget_kb // stage_kb))


def gemv_tma(x: torch.Tensor, desc: TensorDescriptor, qzeros: torch.Tensor, scales: torch.Tensor, n: int, k: int,
             config: MmaGemvConfig, stages: int, y: torch.Tensor, pdl: bool = True) -> torch.Tensor:  # fmt: skip
    """One row of bf16 x @ the weight of `desc` into y [1, N], through a ring of `stages`."""
    return _launch(_tma_gemv_kernel, desc, x, qzeros, scales, n, k, config, y, pdl, STAGES=stages)
