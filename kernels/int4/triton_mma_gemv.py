"""The INT4 GEMV of decode (1 to 32 rows of x, 8 a program) on the tensor cores, through warp-level MMAs
(mma.sync m16n8k16) written in PTX, on the pairs layout or its tiles ordering
(kernels/int4/layouts.py; `tiled`: the same words, so the same results bit for bit, but a
warp's 16 rows x 128 inputs are 1 KB in one piece instead of 16 runs of 64 bytes K / 2 bytes
apart). Each lane loads from global memory exactly the words its MMA operand needs: no
shared memory, no barrier in the loop.

The weight is the MMA's A operand (m16 x k16): lane (g, t) = (lane // 4, lane % 4) holds
rows g and g + 8 of a 16-row tile at k-slots 2t, 2t + 1 (registers a0, a1) and 2t + 8,
2t + 9 (a2, a3). On the pairs layout nibbles p and p + 4 of word w (bits 4p, 16 + 4p) are
inputs 32p + 2w and 32p + 2w + 1, so a shift and one LOP3 make them a bf16x2 OFFSET + q
(bf16 128 + q, fp16 1024 + q; exact): an A register as the MMA takes it. Lane t reads words
4t..4t + 3 of each of its two rows' 128-input block (16 bytes each); MMA (p, h) takes pair
p of words 4t + 2h (a0, a1) and 4t + 2h + 1 (a2, a3), so its k-slot 2t + e is input
32p + 8t + 4h + e and slot 8 + 2t + e input 32p + 8t + 4h + 2 + e: a permutation of the
block that B (x in all 8 columns) follows, b0 and b1 being x's 32-bit pairs 16p + 4t + 2h
and + 1 (adjacent: one 16-byte load of x gives both MMAs of a p their B).

The offset is not subtracted per weight: an MMA with A = ones sums x over the block (X),
and per block and row the fp32 sum becomes sum_k (q_k - zero) x_k = D -
(OFFSET + zero) X, times the group's scale, into the accumulator. At one row that is one MMA
a block: its B's column g holds 16 other inputs of the block (the lane's `x_share`, two
pairs it loads besides its operand pairs), and two butterfly shuffles add D's 8 columns
(kernels/int4/mma_ptx.py; 8 MMAs a block fewer than a chain over the operands' B, gate_up
22.83 -> 21.91 us, benchmarks/bench_int4_mma_gemv.py); with M rows a chain of 8 over the same B
as the weights, each column summing its row of x. Products are exact and
sums fp32 in the MMA; the subtraction cancels about OFFSET X, so a block's fp32 roundings
are relative to (OFFSET + 15) sum |x| (2^-24 each): for bf16 (128) far below the output's
rounding, for fp16 (1024) about as large as fp16's (tests bound both). In bf16, half the
error of the x2 arithmetic GEMV (kernels/int4/triton_rows.py), whose four-term sums round
to bf16. Per lane and block: 8 words, 32 LOP3, 24 shifts, 8 weight MMAs, 1 sum MMA with 2
shuffles and 3 adds (M rows: 8 sum MMAs), 4 FMAs (8 with M rows).

At one row every column of B is x, so every column of D is x . w: lane (g, t) reads outputs g
and g + 8 from d0 and d2. With M rows (MULTI, up to 8) B's column n is x's row n (lane (g, t)
loads row g's pairs; rows past M repeat the last) and d0, d1, d2, d3 are outputs g, g, g + 8,
g + 8 for x's rows 2t, 2t + 1, 2t, 2t + 1, the ones-MMA giving each row's sum of x in its column:
the same loads and MMAs for up to 8 rows. More rows (up to MAX_ROWS) are chunks of 8, one
program each on grid axis 0: the programs of a weight tile are launched side by side, so the
chunks after the first mostly read it from the L2 (9 rows cost about 1.5x of 8, not 2x;
benchmarks/bench_int4_mma_gemv.py). The PTX is right only if element i of the [T] tensors it
reads sits in lane i % 32 of warp (i // 32) % WARPS, the blocked layout Triton gives them;
tests/kernels/test_int4_mma_gemv.py checks the compiled kernel's layout (on any machine) and
its values (on a GPU). K may be split over a tile's warps (K_WARPS), whose sums meet in shared
memory after the loop, and then over programs, whose partials meet under a semaphore
(kernels/sync/semaphores.py): llama-3.1-8b's qkv, o and down take 8 warps a tile and no split
over programs (o 5.9 -> 4.8 us, down 12.0 -> 10.7; benchmarks/bench_int4_mma_gemv.py).
SILU_MUL reads gate and up rows and stores silu(gate) * up, as the x2 GEMV does. Under PDL
(kernels/sync/pdl.py) a program reads its first step's weights before it waits for x, and lets the kernel
after launch once its weight loop is done (LATE_TRIGGER). GPU only (PTX); the wrapper reads shapes only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from vllm_cluster.kernels.int4.layouts import ROW_BLOCK, pairs_shape
from vllm_cluster.kernels.int4.mma_ptx import ASM, CONSTRAINTS, mma_block
from vllm_cluster.kernels.int4.triton_rows import split_steps
from vllm_cluster.kernels.int4.weight import Int4Weight
from vllm_cluster.kernels.linear.add_norm import AddNorm, Normed
from vllm_cluster.kernels.linear.triton_add_norm import (
    launch_args,
    load_residual,
    load_sum_of_squares,
    rms_scale,
    store_add_norm,
)
from vllm_cluster.kernels.linear.triton_gemv import store_outputs
from vllm_cluster.kernels.sync import pdl
from vllm_cluster.kernels.sync.semaphores import semaphores, sum_splits

# Rows of x a program takes: the MMA's 8 columns (m16n8k16; fixed, not a tuning value; the
# kernel's literal 8s). x's rows are split into chunks of 8, one program each (grid axis 0,
# the fastest, so a weight tile's programs run together and all but the first find it in the L2).
CHUNK_ROWS = 8
# Rows of x the GEMV takes.
MAX_ROWS = 32
# Fewest ranges K is split into. One: gate_up's 448 programs of 64 rows fill the H200's SMs
# without a split, and splitting it in two costs the partials' round trip (26.2 -> 23.9 us;
# benchmarks/bench_int4_mma_gemv.py). The x2 GEMV keeps split_steps' default of two.
MIN_SPLIT = 1
# Under PDL a program lets the kernel after launch once its weight loop is done (True), so
# that the norm, attention or down GEMV after is resident and waiting while the last
# programs sum their splits and store; or not at all (False: it launches as the last
# program exits). True: gptq-lm-head batch-1 1.997 -> 1.867 ms on the H200
# (benchmarks/bench_quant_gpu.py). Earlier is worse: at the loop's last step 1.967 against
# 1.865 in one call; at the start +490 us (the x2 GEMV), and with this kernel, for qkv, o and
# down, 1.722 -> 1.746 ms (a trigger at the kernel's start; both benchmarks/bench_quant_gpu.py).
LATE_TRIGGER = True
# pick_mma_gemv_config: the most warps that split a tile's K, their sums meeting in shared
# memory (1: none; K split over programs only, their partials meeting in global memory).
WARP_SPLIT = 8
# pick_mma_gemv_config: K is split until about this many warps an SM, ...
WARPS_PER_SM = 16
# ... and from this many warps an SM a warp loads one block a step, not two (lm_head: 60).
UNROLL_ONE_WARPS = 20
# pick_mma_gemv_config at 2-8 rows of x (four accumulators a lane): at most this many warps a
# tile (down at 2 rows: 8 warps 14.5 us, 4 warps 12.8; benchmarks/bench_int4_mma_gemv.py).
ROWS_WARP_SPLIT = 4


@dataclass(frozen=True, slots=True)
class MmaGemvConfig:
    tiles: int  # 16-row tiles per warp (a program has 16 * tiles * num_warps / k_warps outputs)
    unroll: int  # blocks of 128 inputs per warp and loop step; unroll * k_warps divides K / 128
    split_k: int  # ranges of K over programs (their partials meet under a semaphore)
    num_warps: int = 4
    k_warps: int = 1  # warps of a program that share its tiles, each over its blocks of each step

    @property
    def block_n(self) -> int:
        return 16 * self.tiles * self.num_warps // self.k_warps


@triton.jit
def _offset(words, shift, ZERO_OFFSET: tl.constexpr, FP16: tl.constexpr):
    """-(OFFSET + zero) in fp32 of the zero nibble at `shift` of qzeros `words`: sum_k (OFFSET +
    q_k) x_k plus this times sum_k x_k is sum_k (q_k - zero) x_k. The nibble goes into the
    mantissa of 2^23 (an fp32 2^23 + zero: no integer conversion)."""
    bits = ((words >> shift) & 0xF) | 0x4B000000
    return (8388608.0 - (1024.0 if FP16 else 128.0) - ZERO_OFFSET) - bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_weights(step, words_lo, words_hi, qzeros_ptr, scales_ptr, row_lo, row_hi, block, N,
                  GROUP_BLOCKS: tl.constexpr, STEP: tl.constexpr, ZERO_OFFSET: tl.constexpr, FP16: tl.constexpr,
                  TILED: tl.constexpr):  # fmt: skip
    """A step's weights (STEP blocks of the tile): both rows' words, their -(OFFSET + zero) and scales."""
    group = (step * STEP + block) // GROUP_BLOCKS
    zero_row = group * (N // 8)
    BLOCK_WORDS: tl.constexpr = 256 if TILED else 16  # a block's words for one lane
    if TILED:  # tiles: rows g and g + 8 of a tile are zero words 2r and 2r + 1, one 8-byte load
        pair = tl.multiple_of(zero_row + row_lo // 8, 2)  # N and a tile's first row: multiples of 16
        words = tl.load(qzeros_ptr + pair[:, None] + tl.arange(0, 2)[None, :])
        off_lo, off_hi = tl.split(_offset(words, ((row_lo % 8) * 4)[:, None], ZERO_OFFSET, FP16))
    else:
        off_lo = _offset(tl.load(qzeros_ptr + zero_row + row_lo // 8), (row_lo % 8) * 4, ZERO_OFFSET, FP16)
        off_hi = _offset(tl.load(qzeros_ptr + zero_row + row_hi // 8), (row_hi % 8) * 4, ZERO_OFFSET, FP16)
    return (
        tl.load(words_lo + step * BLOCK_WORDS * STEP), tl.load(words_hi + step * BLOCK_WORDS * STEP), off_lo, off_hi,
        tl.load(scales_ptr + group * N + row_lo).to(tl.float32),
        tl.load(scales_ptr + group * N + row_hi).to(tl.float32),
    )  # fmt: skip


@triton.jit
def _load_x(step, x_pairs, x_share, STEP: tl.constexpr, MULTI: tl.constexpr):
    """A step's x: pairs 16p + 4t + c of each block, p = 0..3 ([T, 4] each), and at one row
    the lane's share of the block sum ([T, 2]; with MULTI a placeholder, unread)."""
    xk = x_pairs + step * 64 * STEP
    xa = tl.load(xk)
    share = xa if MULTI else tl.load(x_share + step * 64 * STEP)
    return xa, tl.load(xk + 16), tl.load(xk + 32), tl.load(xk + 48), share


@triton.jit
def _weight_row(pid, j, N, HALF: tl.constexpr, SILU_MUL: tl.constexpr):
    """Weight row of a program's output j (outputs pid * HALF + j; with SILU_MUL gate rows for
    j < HALF, up rows N + .. above). -> (row, valid); rows past N read row 0, unstored."""
    n = pid * HALF + j % HALF
    row = tl.where(n < N, n, 0)
    if SILU_MUL:
        row += (j // HALF) * N
    return row, n < N


@triton.jit
def _mma_gemv_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, ws_ptr, lock_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym, stride_qn, split_k, residual_ptr, h_ptr, norm_weight_ptr, hg_ptr, ss_out_ptr,
    ss_in_ptr, rms_eps, GROUP_BLOCKS: tl.constexpr,
    ZERO_OFFSET: tl.constexpr, TILES: tl.constexpr, UNROLL: tl.constexpr, WARPS: tl.constexpr,
    PDL: tl.constexpr, FP16: tl.constexpr, SILU_MUL: tl.constexpr, MULTI: tl.constexpr, ASM: tl.constexpr,
    CONSTRAINTS: tl.constexpr, TILED: tl.constexpr = False, LATE_TRIGGER: tl.constexpr = False,
    K_WARPS: tl.constexpr = 1, ADD_NORM: tl.constexpr = False, RMS: tl.constexpr = False,
):  # fmt: skip
    """Program (0, N block, split): 16 * TILES * WARPS / K_WARPS weight rows. Element i of the [T]
    tensors is lane i % 32 of warp (i // 32) % WARPS; i // 32 numbers (block of the step,
    16-row tile); the [T, 4] loads hold the lane's 4 words (16 bytes) of a row in their
    columns. SILU_MUL: the weight is [gate | up] (N = 2I rows); the program's first half of
    tiles reads gate rows n, the second up rows I + n, and it stores silu(gate) * up [1, I].
    MULTI: x has M rows (up to 8), row n in the MMA's column n: lane (g, t) reads row g's
    pairs and sums rows 2t and 2t + 1 (one row: every lane reads row 0 and keeps column 0).
    K_WARPS: warps w and w + 1 .. share tiles (numbered w // K_WARPS), each step's K_WARPS *
    UNROLL blocks shared out UNROLL to a warp (w % K_WARPS); their sums meet in shared memory
    at the end, not through a split's round trip to global memory. ADD_NORM and RMS (one row):
    the two halves of the norm between GEMVs (kernels/linear/triton_add_norm.py)."""
    T: tl.constexpr = UNROLL * TILES * WARPS * 32
    NT: tl.constexpr = TILES * WARPS // K_WARPS  # the program's tiles
    BLOCK_N: tl.constexpr = 16 * NT
    STEP: tl.constexpr = UNROLL * K_WARPS  # blocks of a step, over a tile's warps
    HALF: tl.constexpr = BLOCK_N // 2 if SILU_MUL else BLOCK_N
    N_OUT = N // 2 if SILU_MUL else N
    pid = tl.program_id(1)
    chunk = tl.program_id(0)  # MULTI: x's rows chunk * 8 .. + 7
    x_ptr += chunk * 8 * stride_xm
    i = tl.arange(0, T)
    lane = i % 32
    slot = (i // 32) % (TILES * WARPS)  # (tile register, warp)
    block = slot % K_WARPS * UNROLL + i // (32 * TILES * WARPS)  # block of the step
    g = lane // 4
    t = lane % 4
    j = slot // K_WARPS * 16 + g  # this lane's outputs: j (A's row g) and j + 8
    row_lo, _ = _weight_row(pid, j, N_OUT, HALF, SILU_MUL)
    row_hi, _ = _weight_row(pid, j + 8, N_OUT, HALF, SILU_MUL)
    if TILED:  # [N / 16, K / 128, 32 lanes, 8 words]: a warp's block is 1 KB in one piece
        lane_words = (row_lo // 16) * (2 * K) + block * 256 + ((row_lo % 16) * 4 + t) * 8
        words_lo = qweight_ptr + lane_words[:, None] + tl.arange(0, 4)[None, :]
        words_hi = words_lo + 4
    else:
        k_words = (block * 16 + 4 * t)[:, None] + tl.arange(0, 4)[None, :]
        words_lo = qweight_ptr + row_lo[:, None] * stride_qn + k_words
        words_hi = qweight_ptr + row_hi[:, None] * stride_qn + k_words
    x_pairs = x_ptr.to(tl.pointer_type(tl.uint32)) + (block * 64 + 4 * t)[:, None] + tl.arange(0, 4)[None, :]
    if MULTI:  # B's column g is x's row g (rows past M repeat the last; their sums are not stored)
        x_pairs += (tl.minimum(g, tl.minimum(M - chunk * 8, 8) - 1) * (stride_xm // 2))[:, None]
    # one row: pairs 16 (g // 2) + 4t + 2 (g % 2) and + 1, the lane's share of the block sum
    share_pairs = block * 64 + 16 * (g // 2) + 4 * t + 2 * (g % 2)
    x_share = x_ptr.to(tl.pointer_type(tl.uint32)) + share_pairs[:, None] + tl.arange(0, 2)[None, :]
    num_steps = K // (128 * STEP)
    per_split = tl.cdiv(num_steps, split_k)
    first = tl.program_id(2) * per_split
    last = tl.minimum(first + per_split, num_steps)
    acc0 = tl.zeros((T,), dtype=tl.float32)
    acc1 = tl.zeros((T,), dtype=tl.float32)
    acc2 = tl.zeros((T,), dtype=tl.float32)  # MULTI only (rows g + 8 for x's rows 2t, 2t + 1)
    acc3 = tl.zeros((T,), dtype=tl.float32)
    # Each step's loads are issued a step ahead into registers (no shared memory: Triton's
    # cp.async pipeline made this loop 4x slower, a wait and a barrier a step). Under PDL the
    # first step's weights are read before waiting for x (kernels/sync/pdl.py).
    lo, hi, off_lo, off_hi, s_lo, s_hi = _load_weights(
        tl.minimum(first, last - 1), words_lo, words_hi, qzeros_ptr, scales_ptr, row_lo, row_hi, block, N, GROUP_BLOCKS,
        STEP, ZERO_OFFSET, FP16, TILED,
    )  # fmt: skip
    if PDL:
        gdc_wait()
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    residual = load_residual(residual_ptr, offs_n, offs_n < N, ADD_NORM)
    ss = load_sum_of_squares(ss_in_ptr, RMS)
    xa, xb, xc, xd, xs = _load_x(tl.minimum(first, last - 1), x_pairs, x_share, STEP, MULTI)
    for step in tl.range(first, last, num_stages=1):
        ahead = tl.minimum(step + 1, last - 1)
        n_lo, n_hi, n_off_lo, n_off_hi, n_s_lo, n_s_hi = _load_weights(
            ahead, words_lo, words_hi, qzeros_ptr, scales_ptr, row_lo, row_hi, block, N, GROUP_BLOCKS,
            STEP, ZERO_OFFSET, FP16, TILED,
        )  # fmt: skip
        n_xa, n_xb, n_xc, n_xd, n_xs = _load_x(ahead, x_pairs, x_share, STEP, MULTI)
        acc0, acc1, acc2, acc3 = mma_block(
            lo, hi, off_lo, off_hi, xa, xb, xc, xd, xs, s_lo, s_hi, acc0, acc1, acc2, acc3, ASM, CONSTRAINTS, MULTI
        )
        lo, hi, off_lo, off_hi, s_lo, s_hi = n_lo, n_hi, n_off_lo, n_off_hi, n_s_lo, n_s_hi
        xa, xb, xc, xd, xs = n_xa, n_xb, n_xc, n_xd, n_xs
    if PDL and LATE_TRIGGER:  # its weights read: the kernel after may launch (kernels/sync/pdl.py)
        gdc_launch_dependents()
    rows, valid = _weight_row(pid, tl.arange(0, BLOCK_N), N_OUT, HALF, SILU_MUL)
    out_rows = tl.where(valid, rows, N)
    if MULTI:
        # acc (block, tile, g, t): y[2t + e, tile * 16 + g + 8h] in acc{2h + e}
        lo = tl.reshape(tl.join(_tile_sums(acc0, UNROLL, NT, K_WARPS), _tile_sums(acc1, UNROLL, NT, K_WARPS)),
                        (NT, 8, 8))  # (tile, g, x row)
        hi = tl.reshape(tl.join(_tile_sums(acc2, UNROLL, NT, K_WARPS), _tile_sums(acc3, UNROLL, NT, K_WARPS)),
                        (NT, 8, 8))
        partial = tl.reshape(tl.permute(tl.join(lo, hi), (0, 3, 1, 2)), (BLOCK_N, 8))  # y^T: output tile * 16 + 8h + g
        offs_m = chunk * 8 + tl.arange(0, 8)
        total, is_last = sum_splits(partial, offs_m, out_rows, M, N, split_k, ws_ptr, lock_ptr)
        mask = valid[:, None] & (offs_m < M)[None, :] & is_last
        tl.store(y_ptr + offs_m[None, :] * stride_ym + out_rows[:, None], total.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        # acc (block, tile, g, t): outputs tile * 16 + g (acc0) and + 8 (acc1), the same for every t.
        first_t = tl.arange(0, 4)[None, None, :] == 0
        lo_sums = tl.sum(tl.where(first_t, _tile_sums(acc0, UNROLL, NT, K_WARPS), 0.0), axis=2)
        hi_sums = tl.sum(tl.where(first_t, _tile_sums(acc1, UNROLL, NT, K_WARPS), 0.0), axis=2)
        partial = tl.reshape(tl.permute(tl.join(lo_sums, hi_sums), (0, 2, 1)), (BLOCK_N,))  # output tile * 16 + 8h + g
        total, is_last = sum_splits(partial[:, None], tl.arange(0, 1), out_rows, 1, N, split_k, ws_ptr, lock_ptr)
        total = rms_scale(tl.reshape(total, (BLOCK_N,)), ss, K, rms_eps, RMS)
        if ADD_NORM:
            store_add_norm(total, residual, offs_n, offs_n < N, h_ptr, norm_weight_ptr, hg_ptr, ss_out_ptr, is_last)
        else:
            store_outputs(total, y_ptr, pid, N_OUT, HALF, SILU_MUL, is_last)


@triton.jit
def _tile_sums(acc, UNROLL: tl.constexpr, TILES: tl.constexpr, K_WARPS: tl.constexpr):
    """[T] accumulators (block, tile, k warp, g, t) -> summed over the warp's blocks of the
    step and the tile's warps (across warps: Triton's sum, through shared memory), [TILES, 8, 4]."""
    sums = tl.sum(tl.reshape(acc, (UNROLL, TILES, K_WARPS, 8, 4)), axis=0)
    return tl.sum(sums, axis=1)


def pick_mma_gemv_config(
    n: int, k: int, num_sms: int, tiles: int = 1, unroll: int | None = None, num_warps: int | None = None,
    k_warps: int | None = None, warps_per_sm: int = WARPS_PER_SM, silu_mul: bool = False, rows: int = 1,
) -> MmaGemvConfig:  # fmt: skip
    """A config for N weight rows (with `silu_mul`, [gate | up]'s) and K inputs on `num_sms`
    SMs and `rows` of x, from benchmarks/bench_int4_mma_gemv.py's sweeps over llama-3.1-8b's
    shapes on the H200 (docs/benchmarks.md). Its 16-row tiles get `k_warps` warps each (None:
    doubled up to WARP_SPLIT, ROWS_WARP_SPLIT at 2-8 rows, while the tiles' warps are fewer
    than `warps_per_sm` an SM), then K is split over programs until about that many warps an
    SM (at least MIN_SPLIT ranges). `unroll` None: two blocks a warp and step, or one from
    UNROLL_ONE_WARPS warps an SM (the warps then hide the loads). `num_warps` None: k_warps,
    at least 4; with silu_mul at least two tiles a program (its gate and up halves)."""
    num_tiles = triton.cdiv(n, 16)
    if k_warps is None:
        k_warps, most = 1, (WARP_SPLIT if rows == 1 else min(WARP_SPLIT, ROWS_WARP_SPLIT)) // (2 if silu_mul else 1)
        while (
            2 * k_warps <= most
            and num_tiles * k_warps < warps_per_sm * num_sms
            and (k // ROW_BLOCK) % (2 * k_warps) == 0
        ):
            k_warps *= 2
    if num_warps is None:
        num_warps = max(4, k_warps * (2 if silu_mul else 1))
    warps = (
        triton.cdiv(n, MmaGemvConfig(tiles, 1, 1, num_warps, k_warps).block_n)
        * num_warps
        * triton.cdiv(rows, CHUNK_ROWS)
    )
    if unroll is None:
        unroll = 1 if warps >= UNROLL_ONE_WARPS * num_sms else 2
    unroll, split_k = split_steps(k // k_warps, unroll, warps, num_sms, warps_per_sm, MIN_SPLIT)
    return MmaGemvConfig(tiles, unroll, split_k, num_warps, k_warps)


def supported(x: torch.Tensor, group_size: int) -> bool:
    """Whether the MMA GEMV takes this x (1 to MAX_ROWS rows of bf16 or fp16 on a GPU) and group."""
    return (
        x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
        and group_size % 128 == 0
    )  # fmt: skip


def gemv_pairs_mma_add_norm(
    x: torch.Tensor, weight: Int4Weight, config: MmaGemvConfig, add_norm: AddNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gemv_pairs_mma` of one row, then the first half of the norm after it
    (kernels/linear/triton_add_norm.py): (hg, h)."""
    _, outputs = _gemv_pairs_mma(x, weight, config, False, add_norm, None)
    assert outputs is not None
    return outputs


def gemv_pairs_mma(
    x: torch.Tensor, weight: Int4Weight, config: MmaGemvConfig, silu_mul: bool = False, rms: Normed | None = None
) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, bf16 or fp16) @ a pairs- or tiles-layout INT4 weight (qweight
    [N, K/8], tiles [N/16, K/128, 256], kernels/int4/layouts.py) -> [M, N] in x's dtype; its
    inputs per group a multiple of 128. silu_mul (one row): the weight is [gate | up] and the
    result silu(gate) * up, [1, N / 2], rounded as `silu_and_mul` of the plain result. rms (one
    row): x is rms.hg, whose norm this GEMV finishes (kernels/linear/triton_add_norm.py)."""
    return _gemv_pairs_mma(x, weight, config, silu_mul, None, rms)[0]


def _gemv_pairs_mma(
    x: torch.Tensor, weight: Int4Weight, config: MmaGemvConfig, silu_mul: bool, add_norm: AddNorm | None,
    rms: Normed | None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:  # fmt: skip
    """gemv_pairs_mma -> (y, None), or with add_norm (y unwritten, (hg, h))."""
    assert weight.layout in ("pairs", "tiles") and weight.g_idx is None, (weight.layout, "act-order")
    qweight, qzeros, scales, zero_offset = weight.qweight, weight.qzeros, weight.scales, weight.zero_offset
    tiled = weight.layout == "tiles"
    x = x.contiguous()
    m = x.shape[0]
    n, k = pairs_shape(qweight)
    group_size = weight.group(k)
    assert supported(x, group_size) and x.shape[1] == k, (x.shape, x.dtype, qweight.shape, group_size)
    assert tiled == (qweight.dim() == 3), f"qweight {tuple(qweight.shape)} is not in the {weight.layout} layout"
    assert k % (ROW_BLOCK * config.unroll * config.k_warps) == 0 and qweight.numel() < 2**31, (qweight.shape, config)
    assert config.num_warps % config.k_warps == 0 and config.block_n > 0, config
    assert (
        not (silu_mul and tiled) or config.block_n % 32 == 0
    ), f"{config}: SiLU-and-mul on tiles needs 2 tiles a program"
    assert not silu_mul or (n % 2 == 0 and m == 1), f"{m} x {n}: SiLU-and-mul takes one row of [gate | up]"
    n_out = n // 2 if silu_mul else n
    assert not tiled or n_out % 16 == 0, f"tiles of 16 outputs: {n_out} outputs (gate's, with SiLU-and-mul)"
    y = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    num_blocks_n = triton.cdiv(n_out, config.block_n // 2 if silu_mul else config.block_n)
    chunks = triton.cdiv(m, CHUNK_ROWS)
    workspace = torch.empty(config.split_k, m, n, dtype=torch.float32, device=x.device)
    assert not (silu_mul and add_norm), "SiLU-and-mul has no add + norm epilogue"
    assert rms is None or m == 1, "the norm's second half takes one row"
    epilogue, outputs = launch_args(add_norm, rms, x, y)
    use_pdl = pdl.enabled(x)
    fp16, multi = x.dtype == torch.float16, m > 1
    _mma_gemv_kernel[(chunks, num_blocks_n, config.split_k)](
        x, qweight, qzeros, scales, workspace, semaphores("int4_mma_gemv", x.device, chunks * num_blocks_n), y,
        m, n, k, x.stride(0), y.stride(0), qweight.stride(0), config.split_k,
        # a constant: a step's group is then a shift, not a division (307 -> 259 loop instructions)
        GROUP_BLOCKS=group_size // ROW_BLOCK, ZERO_OFFSET=zero_offset, TILES=config.tiles, UNROLL=config.unroll,
        WARPS=config.num_warps, PDL=use_pdl,
        FP16=fp16, SILU_MUL=silu_mul, MULTI=multi, ASM=ASM[fp16, multi], CONSTRAINTS=CONSTRAINTS[multi],
        TILED=tiled, LATE_TRIGGER=LATE_TRIGGER, K_WARPS=config.k_warps, num_warps=config.num_warps, launch_pdl=use_pdl,
        **epilogue,
    )  # fmt: skip
    return y, outputs
