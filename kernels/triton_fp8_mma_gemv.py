"""The FP8 GEMV of decode for a normed x (qkv and gate_up at one row: `kernels.Normed`) on the
fp16 tensor cores, through warp-level MMAs (mma.sync m16n8k16) written in PTX
(kernels/fp8_mma_ptx.py), as the INT4 MMA GEMV (kernels/triton_int4_mma_gemv.py) does for
4-bit weights.

Why fp16, and why only a normed x: an e4m3 weight pair becomes an fp16 pair, exactly, in one
cvt.rn.f16x2.e4m3x2: an MMA A register with no bit tricks (bf16 would need them: there is
no e4m3 -> bf16 conversion on sm_90). B must then be fp16 too, and x normalised is bounded:
|h_i rstd| <= sqrt(K) (rstd = 1 / rms(h)), so |x_i| <= sqrt(K) |weight_i| for the norm's
weight, within fp16's 65504 when `Normed.fp16_safe` says so (checked once at load,
engine/layers/norm.py). The kernel reads hg = h * weight and the sum of h^2 its PDL wait
made complete (kernels/triton_add_norm.py), and normalises x in registers: x * rstd in fp32,
rounded to fp16 once (11 significant bits against the reference's 8: bf16 rounds h * rstd).
Per lane and block of 128 inputs: 16 x pairs converted (5 instructions each) for all the
lane's `ASM_TILES` tiles, and per tile 16 words, 32 conversions and 8 MMAs: about 1.3
instructions a weight with two tiles, against the 1-byte GEMV's 3.4 (docs/benchmarks.md).

The weight is the MMA's A operand (m16 x k16) in its own [N, K] layout: lane (g, t) =
(lane // 4, lane % 4) loads inputs 32t .. 32t + 31 of its rows g and g + 8 (two 16-byte
loads a row; a warp's 16 rows x 128 bytes, every byte of each sector used). Word m of a row
feeds MMA m: its weights 32t + 4m, + 1 are k-slots 2t, 2t + 1 (a0, a1), 32t + 4m + 2, + 3
slots 2t + 8, 2t + 9 (a2, a3): a permutation of the block that B (x in all 8 columns)
follows, b0 and b1 being x's pairs 16t + 2m and + 1. The fp32 accumulators run through the
MMAs' C over the whole K; the per-channel scale, the bias and SiLU-and-mul are applied to
the sums. K is split over a tile's warps (K_WARPS, meeting in shared memory after the loop)
and then over programs (their partials meeting under a semaphore, kernels/semaphores.py), as
in the INT4 MMA GEMV, whose config type and output helpers this kernel shares. The PTX is
right only if element i of the [T] tensors it reads sits in lane i % 32 of warp (i // 32) %
WARPS; tests/kernels/test_fp8_mma_gemv.py checks the compiled layout (on any machine) and
the values (on a GPU). GPU only; the wrapper reads only shapes: graph-capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import Normed, pdl
from kernels.fp8_mma_ptx import ASM, CONSTRAINTS, mma_block
from kernels.int4_rows import ROW_BLOCK
from kernels.semaphores import semaphores, sum_splits
from kernels.triton_int4_mma_gemv import MmaGemvConfig, pick_mma_gemv_config, tile_sums, weight_row
from kernels.triton_linear import store_outputs

# The switch: False keeps the 1-byte GEMV (kernels/triton_gemv.py) for a normed x.
ENABLED = True
# 16-row tiles an asm call takes (1 or 2): two share the conversion of x.
ASM_TILES = 2
# pick_config: K is split over a tile's warps, then over programs, until about this many warps an SM
WARPS_PER_SM = 16


@triton.jit
def _load_row(words, step, STEP: tl.constexpr):
    """A step's 8 words of a lane's row ([T, 4] pointers): two [T, 4] 16-byte loads (one
    [T, 8] load would lay its columns over two lanes)."""
    w = words + step * STEP * 32  # a block is 128 bytes: 32 words of a row
    return tl.join(tl.load(w), tl.load(w + 4))


@triton.jit
def _load_step(step, w_lo, w_hi, w2_lo, w2_hi, x_pairs, STEP: tl.constexpr, ASM_TILES: tl.constexpr):
    """A step's words ([T, 4, 2] a row: word 4c + e at [c, e]... see mma_block) and x pairs."""
    lo = _load_row(w_lo, step, STEP)
    hi = _load_row(w_hi, step, STEP)
    if ASM_TILES == 2:
        lo2 = _load_row(w2_lo, step, STEP)
        hi2 = _load_row(w2_hi, step, STEP)
    else:
        lo2, hi2 = lo, hi
    xk = x_pairs + step * STEP * 64
    return lo, hi, lo2, hi2, tl.join(tl.load(xk), tl.load(xk + 4)), tl.join(tl.load(xk + 8), tl.load(xk + 12))


@triton.jit
def _fp8_mma_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, ws_ptr, lock_ptr, y_ptr, ss_ptr, rms_eps, N, K, stride_wn, split_k,
    TILES: tl.constexpr, UNROLL: tl.constexpr, WARPS: tl.constexpr, K_WARPS: tl.constexpr, ASM_TILES: tl.constexpr,
    PDL: tl.constexpr, SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr,
    LATE_TRIGGER: tl.constexpr = True,
):  # fmt: skip
    """Program (0, N block, split): 16 * TILES * WARPS / K_WARPS weight rows. Element i of the
    [T] tensors is lane i % 32 of warp (i // 32) % WARPS; i // 32 numbers (block of the step,
    group of ASM_TILES tiles, warp). SILU_MUL: the weight is [gate | up] (N = 2I rows); the
    program's first half of tiles reads gate rows n, the second up rows I + n, and it stores
    silu(gate) * up [1, I]. K_WARPS: warps w, w + 1 .. share tiles, each step's K_WARPS *
    UNROLL blocks shared out UNROLL to a warp."""
    GROUPS: tl.constexpr = TILES // ASM_TILES  # an element's tiles: one group
    T: tl.constexpr = UNROLL * GROUPS * WARPS * 32
    NG: tl.constexpr = GROUPS * WARPS // K_WARPS  # the program's groups
    BLOCK_N: tl.constexpr = 16 * ASM_TILES * NG
    STEP: tl.constexpr = UNROLL * K_WARPS
    HALF: tl.constexpr = BLOCK_N // 2 if SILU_MUL else BLOCK_N
    N_OUT = N // 2 if SILU_MUL else N
    pid = tl.program_id(1)
    i = tl.arange(0, T)
    lane = i % 32
    slot = (i // 32) % (GROUPS * WARPS)
    block = slot % K_WARPS * UNROLL + i // (32 * GROUPS * WARPS)  # block of the step
    g = lane // 4
    t = lane % 4
    j = slot // K_WARPS * (16 * ASM_TILES) + g  # this lane's outputs: j, j + 8 (and j + 16, j + 24)
    words = w_ptr.to(tl.pointer_type(tl.int32))
    k_words = (block * 32 + 8 * t)[:, None] + tl.arange(0, 4)[None, :]
    row, _ = weight_row(pid, j, N_OUT, HALF, SILU_MUL)
    w_lo = words + (row * (stride_wn // 4))[:, None] + k_words
    row, _ = weight_row(pid, j + 8, N_OUT, HALF, SILU_MUL)
    w_hi = words + (row * (stride_wn // 4))[:, None] + k_words
    row, _ = weight_row(pid, j + 16, N_OUT, HALF, SILU_MUL)
    w2_lo = words + (row * (stride_wn // 4))[:, None] + k_words
    row, _ = weight_row(pid, j + 24, N_OUT, HALF, SILU_MUL)
    w2_hi = words + (row * (stride_wn // 4))[:, None] + k_words
    x_pairs = x_ptr.to(tl.pointer_type(tl.int32)) + (block * 64 + 16 * t)[:, None] + tl.arange(0, 4)[None, :]
    num_steps = K // (128 * STEP)
    per_split = tl.cdiv(num_steps, split_k)
    first = tl.program_id(2) * per_split
    last = tl.minimum(first + per_split, num_steps)
    acc0 = tl.zeros((T,), dtype=tl.float32)
    acc1 = tl.zeros((T,), dtype=tl.float32)
    acc2 = tl.zeros((T,), dtype=tl.float32)  # ASM_TILES 2: the second tile's rows
    acc3 = tl.zeros((T,), dtype=tl.float32)
    # The first step's weights are read before waiting for x (kernels/pdl.py), each next
    # step's a step ahead into registers.
    lo = _load_row(w_lo, tl.minimum(first, last - 1), STEP)
    hi = _load_row(w_hi, tl.minimum(first, last - 1), STEP)
    if PDL:
        gdc_wait()
    rstd = tl.rsqrt(tl.load(ss_ptr).to(tl.float32) / K + rms_eps) + tl.zeros((T,), dtype=tl.float32)
    _, _, lo2, hi2, xa, xb = _load_step(tl.minimum(first, last - 1), w_lo, w_hi, w2_lo, w2_hi, x_pairs, STEP, ASM_TILES)
    for step in tl.range(first, last, num_stages=1):
        n_lo, n_hi, n_lo2, n_hi2, n_xa, n_xb = _load_step(
            tl.minimum(step + 1, last - 1), w_lo, w_hi, w2_lo, w2_hi, x_pairs, STEP, ASM_TILES
        )
        acc0, acc1, acc2, acc3 = mma_block(
            lo, hi, lo2, hi2, xa, xb, rstd, acc0, acc1, acc2, acc3, ASM, CONSTRAINTS, ASM_TILES
        )
        lo, hi, lo2, hi2, xa, xb = n_lo, n_hi, n_lo2, n_hi2, n_xa, n_xb
    if PDL and LATE_TRIGGER:  # its weights read: the kernel after may launch (kernels/pdl.py)
        gdc_launch_dependents()
    # acc (block, group, k warp, g, t): outputs (group * ASM_TILES + r) * 16 + 8h + g, the same for every t
    first_t = tl.arange(0, 4)[None, None, :] == 0
    lo_sums = tl.sum(tl.where(first_t, tile_sums(acc0, UNROLL, NG, K_WARPS), 0.0), axis=2)  # [NG, 8]
    hi_sums = tl.sum(tl.where(first_t, tile_sums(acc1, UNROLL, NG, K_WARPS), 0.0), axis=2)
    if ASM_TILES == 2:
        lo2_sums = tl.sum(tl.where(first_t, tile_sums(acc2, UNROLL, NG, K_WARPS), 0.0), axis=2)
        hi2_sums = tl.sum(tl.where(first_t, tile_sums(acc3, UNROLL, NG, K_WARPS), 0.0), axis=2)
        tiles = tl.join(tl.join(lo_sums, hi_sums), tl.join(lo2_sums, hi2_sums))  # (group, g, h, r)
        partial = tl.reshape(tl.permute(tiles, (0, 3, 2, 1)), (BLOCK_N,))
    else:
        partial = tl.reshape(tl.permute(tl.join(lo_sums, hi_sums), (0, 2, 1)), (BLOCK_N,))
    rows, valid = weight_row(pid, tl.arange(0, BLOCK_N), N_OUT, HALF, SILU_MUL)
    out_rows = tl.where(valid, rows, N)
    total, is_last = sum_splits(partial[:, None], tl.arange(0, 1), out_rows, 1, N, split_k, ws_ptr, lock_ptr)
    y = tl.reshape(total, (BLOCK_N,)) * tl.load(scale_ptr + rows, mask=valid, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    store_outputs(y, y_ptr, pid, N_OUT, HALF, SILU_MUL, is_last)


def pick_config(n: int, k: int, num_sms: int, silu_mul: bool = False) -> MmaGemvConfig:
    """A config for N weight rows (with `silu_mul`, [gate | up]'s) and K inputs: the INT4 MMA
    GEMV's rule (pick_mma_gemv_config) over tiles of ASM_TILES 16-row tiles."""
    return pick_mma_gemv_config(n, k, num_sms, tiles=ASM_TILES, warps_per_sm=WARPS_PER_SM, silu_mul=silu_mul)


def supported(x: Normed, qweight: torch.Tensor) -> bool:
    """Whether this kernel takes the product: on, a normed bf16 or fp16 x on a GPU whose fp16
    values cannot overflow, an fp8 e4m3 weight with whole blocks of 128 inputs."""
    return (
        ENABLED and x.hg.is_cuda and x.fp16_safe and x.hg.dtype in (torch.bfloat16, torch.float16)
        and qweight.dtype == torch.float8_e4m3fn and qweight.shape[1] % ROW_BLOCK == 0 and qweight.stride(1) == 1
        and qweight.shape[1] == x.hg.shape[1] and qweight.numel() < 2**31
    )  # fmt: skip


def gemv_fp8_mma_normed(
    x: Normed,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    silu_mul: bool = False,
    config: MmaGemvConfig | None = None,
) -> torch.Tensor:
    """x.materialize() [1, K] @ (qweight [N, K] float8_e4m3fn * scale[N]).T + bias -> [1, N] in
    x's dtype; silu_mul: the weight is [gate | up] and the result silu(gate) * up, [1, N / 2]."""
    hg = x.hg.contiguous()
    n, k = qweight.shape
    assert supported(x, qweight), (hg.shape, hg.dtype, qweight.shape, qweight.dtype, x.fp16_safe)
    assert scale.dtype == torch.float32 and scale.numel() == n and scale.is_contiguous(), (scale.shape, scale.dtype)
    assert not silu_mul or n % 2 == 0, f"{n} rows are not [gate | up]"
    if config is None:
        config = pick_config(n, k, torch.cuda.get_device_properties(hg.device).multi_processor_count, silu_mul)
    assert config.tiles % ASM_TILES == 0 and config.num_warps % config.k_warps == 0, config
    assert k % (ROW_BLOCK * config.unroll * config.k_warps) == 0, (k, config)
    n_out = n // 2 if silu_mul else n
    block_n = config.block_n
    assert not silu_mul or block_n % (32 * ASM_TILES) == 0, f"{config}: SiLU-and-mul needs gate and up tiles"
    y = torch.empty(1, n_out, dtype=hg.dtype, device=hg.device)
    num_blocks_n = triton.cdiv(n_out, block_n // 2 if silu_mul else block_n)
    workspace = torch.empty(config.split_k, 1, n, dtype=torch.float32, device=hg.device)
    use_pdl = pdl.enabled(hg)
    _fp8_mma_gemv_kernel[(1, num_blocks_n, config.split_k)](
        hg, qweight, scale, bias if bias is not None else scale, workspace,
        semaphores("fp8_mma_gemv", hg.device, num_blocks_n), y, x.slot, x.eps, n, k, qweight.stride(0), config.split_k,
        TILES=config.tiles, UNROLL=config.unroll, WARPS=config.num_warps, K_WARPS=config.k_warps, ASM_TILES=ASM_TILES,
        PDL=use_pdl, SILU_MUL=silu_mul, HAS_BIAS=bias is not None, ASM=ASM[ASM_TILES], CONSTRAINTS=CONSTRAINTS[ASM_TILES],
        num_warps=config.num_warps, launch_pdl=use_pdl,
    )  # fmt: skip
    return y
