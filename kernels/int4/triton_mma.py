"""INT4 products of a few rows of x (batched decode, 25..128 rows) on the tensor cores, on
the "pairs" layout (kernels/int4/layouts.py): the weight is the tall operand of tl.dot, x^T
(its rows zero-padded to BLOCK_M) the narrow one. Up to 24 rows go to the warp-level MMA
GEMV of kernels/int4/triton_mma_gemv.py (MMA_GEMV_MAX_ROWS; no shared memory, x's rows in
the MMA's columns, 8 a program: 0.72x this kernel's time on llama-3.1-8b's layer at 2-8
rows, 0.66-0.79x at 9-24, about even at 32, and 6%
faster at one row than the x2 CUDA-core GEMV of kernels/int4/triton_rows.py, which was
faster than this kernel there: ONE_ROW_ON_TL_DOT; docs/benchmarks.md).

The weight tile is converted in registers, two weights per 32-bit register: the two
16-bit halves of a word hold two adjacent inputs of one output, which is what the MMA's
operand layout keeps in one register, so one shift, one LOP3 and one x2 subtract make two
numbers the tensor cores take as they are:

    (word >> 4p) & 0x000F000F | 0x43004300   two bf16 128 + q (the nibble in 128's mantissa)
    minus (128 + zero, 128 + zero)            two bf16 q - zero, exact (|q - zero| <= 16)

(fp16 x: 0x6400, 1024 + q.) Products and sums are fp32 in the MMA; the group scale
multiplies the partial sums: y_n = sum_g s_gn sum_k (q_kn - z_gn) x_k, so only x is
rounded (it arrives in bf16 or fp16). That is 2.4 instructions per weight in the loop,
against 4.5-5.1 in the CUDA-core GEMV, yet at one row the GEMV stayed faster on the H200
(the MMA pads x to 16 rows and the loop is latency-bound at these sizes: ncu saw 13 warps
per SM, each issuing every 7.4 cycles, docs/benchmarks.md); at 4 and 16 rows
a llama-3.1-8b layer's four products take 0.58x the time of the rows layout's tl.dot tiles
(which dequantize every weight in fp32 and add split-K partials with atomics), at 64 rows 0.65x.

Programs are (BLOCK_M rows of x, BLOCK_N outputs, one of split_k ranges of K blocks);
split partials meet in a workspace under a semaphore (kernels/sync/semaphores.py), the last
program of a tile writes y, so a product is one launch. With PDL a program reads its first
block of weights before gdc_wait (kernels/sync/pdl.py). The wrappers read only shapes:
graph-capturable. Under the Triton interpreter (CPU tests), and for fp32 x, the weights
are made with plain ops as fp32 numbers (inline PTX does not run there): the same values.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from vllm_cluster.kernels.elementwise.dispatch import silu_and_mul
from vllm_cluster.kernels.int4 import triton_mma_gemv as mma_gemv
from vllm_cluster.kernels.int4.layouts import pairs_shape
from vllm_cluster.kernels.int4.triton_rows import gemv_rows, packed_math, pick_rows_config
from vllm_cluster.kernels.int4.weight import Int4Weight
from vllm_cluster.kernels.linear.add_norm import AddNorm, Normed
from vllm_cluster.kernels.sync import pdl
from vllm_cluster.kernels.sync.semaphores import reduce_splits, semaphores

PAIRS_BLOCK = 128  # inputs per block; a block is 32 int16 halves per output
# Rows of x above which the weight is dequantized for cuBLAS (prefill) instead.
DEQUANT_MIN_ROWS = 128
# One row of x (batch-1 decode) on this file's tl.dot kernel too (True; an experiment switch),
# or through the GEMVs (False): the MMA GEMV, or the CUDA-core GEMV of
# kernels/int4/triton_rows.py where it does not apply. One row here made batch-1 decode of
# llama-3.1-8b 3.197 ms against 3.060 with the CUDA-core GEMV (then on the rows layout; one
# H200 call, docs/benchmarks.md, where the switch is named ONE_ROW_ON_TENSOR_CORES).
ONE_ROW_ON_TL_DOT = False
# At one row, SiLU-and-mul of a [gate | up] product in the GEMV's last program (one launch).
SILU_MUL_GEMV = True
# Rows of x up to which the warp-level MMA GEMV (kernels/int4/triton_mma_gemv.py: bf16 or fp16
# x, groups of 128 inputs or more, at most its MAX_ROWS, 8 a program) takes the product: at one
# row instead of the x2 arithmetic CUDA-core GEMV, above it instead of this file's tl.dot
# kernel. 24: a llama-3.1-8b layer's four products at 9 / 16 / 24 rows 0.70 / 0.66 / 0.79x the
# tl.dot kernel's time on the H200, at 32 0.96x with gate_up and down slower
# (benchmarks/bench_int4_mma_gemv.py). 0: neither.
MMA_GEMV_MAX_ROWS = 24
# Under PDL, each program reads its first block of weights before waiting for x.
EARLY_FIRST_BLOCK = True
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True, slots=True)
class MmaConfig:
    block_n: int  # outputs per program
    block_m: int  # rows of x per program (16: the narrowest tl.dot)
    split_k: int
    num_warps: int = 2
    num_stages: int = 3  # weight tiles in flight per program (cp.async into shared memory)
    early: bool = False  # under PDL, read the first block's weights before the wait


@triton.jit
def _weights(halves, zero, P: tl.constexpr, PTX: tl.constexpr, FP16: tl.constexpr):
    """q - zero of nibble P of each int16 half (zero: int32 [BN, 1], the group's zero of each
    output), exact: as bf16 (fp16 with FP16) through PTX, else as fp32."""
    if not PTX:
        return (((halves >> (4 * P)) & 0xF) - zero).to(tl.float32)
    else:
        return _weights_ptx(halves, zero, P, FP16)


@triton.jit
def _weights_ptx(halves, zero, P: tl.constexpr, FP16: tl.constexpr):
    """Two weights per 32-bit register (the module docstring): shr by 4 P (none for P = 0),
    LOP3 of the pair's nibbles into OFFSET's mantissa, x2 subtract of OFFSET + zero."""
    shift: tl.constexpr = (
        "mov.b32 t, $1;" if P == 0
        else "shr.u32 t, $1, 4;" if P == 1
        else "shr.u32 t, $1, 8;" if P == 2
        else "shr.u32 t, $1, 12;"
    )  # fmt: skip
    if FP16:  # OFFSET 1024
        zero_bits = tl.broadcast_to((0x6400 + zero).to(tl.int16), halves.shape)
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; " + shift + " lop3.b32 t, t, 0x000F000F, 0x64006400, 0xea; sub.rn.f16x2 $0, t, $2; }",
            "=r,r,r", [halves, zero_bits], dtype=tl.float16, is_pure=True, pack=2,
        )  # fmt: skip
    else:  # bf16, OFFSET 128
        zero_bits = tl.broadcast_to((0x4300 + zero).to(tl.int16), halves.shape)
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; " + shift + " lop3.b32 t, t, 0x000F000F, 0x43004300, 0xea; sub.rn.bf16x2 $0, t, $2; }",
            "=r,r,r", [halves, zero_bits], dtype=tl.bfloat16, is_pure=True, pack=2,
        )  # fmt: skip


@triton.jit
def _block_product(
    acc, halves, block, x_rows, mask_m, rows_n, zero_shift, scales_ptr, qzeros_ptr, N, group_size,
    ZERO_OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_P: tl.constexpr, PTX: tl.constexpr, FP16: tl.constexpr,
):  # fmt: skip
    """acc [BN, BM] + the products of one block of 128 inputs (halves: its [BN, 32] int16)."""
    BLOCK_N: tl.constexpr = halves.shape[0]
    part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for p in tl.static_range(4):
        if p % GROUP_P == 0:
            group = (block * 128 + 32 * p) // group_size
            scale = tl.load(scales_ptr + group * N + rows_n).to(tl.float32)  # [BN]
            packed_zero = tl.load(qzeros_ptr + group * (N // 8) + rows_n // 8)
            zero = ((packed_zero >> zero_shift) & 0xF) + ZERO_OFFSET  # [BN]
        x_t = tl.load(x_rows + block * 128 + 32 * p, mask=mask_m[None, :], other=0.0)  # [32, BM]
        w = _weights(halves, zero[:, None], p, PTX, FP16)
        part = tl.dot(w, x_t.to(w.dtype), part, input_precision="ieee" if not PTX else None)
        if (p + 1) % GROUP_P == 0:
            acc += scale[:, None] * part
            part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    return acc


@triton.jit
def _block_halves(halves_ptr, rows_n, offs_c, stride_hn, TILED: tl.constexpr):
    """-> (pointers to block 0's halves [BN, 32] of rows_n, halves from one block to the next).
    Pairs: row n's halves are contiguous. Tiles: half c of row n's block is in the 16-byte
    lane (n % 8, c // 8) of its tile's block, in the first or second half (n % 16 // 8)."""
    if TILED:
        lane = (rows_n % 8 * 4)[:, None] + (offs_c // 8)[None, :]
        row = (rows_n // 16 * stride_hn + rows_n % 16 // 8 * 8)[:, None]
        return halves_ptr + row + lane * 16 + (offs_c % 8)[None, :], 512
    return halves_ptr + rows_n[:, None] * stride_hn + offs_c[None, :], 32


@triton.jit
def _pairs_mma_kernel(
    x_ptr, halves_ptr, qzeros_ptr, scales_ptr, bias_ptr, ws_ptr, lock_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym, stride_hn, group_size, split_k,
    ZERO_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP_P: tl.constexpr, NUM_STAGES: tl.constexpr, PTX: tl.constexpr, FP16: tl.constexpr, PDL: tl.constexpr,
    EARLY: tl.constexpr, TILED: tl.constexpr = False,
):  # fmt: skip
    """Program (M block, N block, split). halves: the qweight as int16 [N, K/4]; half c of a
    block, nibble p, is input 32 p + c of the block. GROUP_P: runs of 32 inputs per group
    (at most 4). stride_hn (K / 4) is an argument so that Triton sees it divisible by 16.
    TILED: the tiles layout (halves [N/16, K/128, 512], stride_hn a tile's K * 4 halves).
    EARLY (with PDL): the first block's weights are read before the wait."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    rows_n = tl.where(offs_n < N, offs_n, 0)  # rows past N read row 0; their sums are not stored
    offs_c = tl.arange(0, 32)
    zero_shift = (rows_n % 8) * 4
    num_blocks = K // 128
    per_split = tl.cdiv(num_blocks, split_k)
    first = tl.program_id(2) * per_split
    last = tl.minimum(first + per_split, num_blocks)
    x_rows = x_ptr + offs_m[None, :] * stride_xm + offs_c[:, None]  # x^T [32, BM] of a run of 32
    weights, block_halves = _block_halves(halves_ptr, rows_n, offs_c, stride_hn, TILED)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if PDL and EARLY:
        # weights: no kernel of the chain writes them
        early = tl.load(weights + first * block_halves, mask=first < last, other=0)
        gdc_wait()  # launched while the kernel before ends; x is its output (kernels/sync/pdl.py)
        if first < last:
            acc = _block_product(
                acc, early, first, x_rows, mask_m, rows_n, zero_shift, scales_ptr, qzeros_ptr, N, group_size,
                ZERO_OFFSET, BLOCK_M, GROUP_P, PTX, FP16,
            )  # fmt: skip
        first += 1
    elif PDL:
        gdc_wait()
    for block in tl.range(first, last, num_stages=NUM_STAGES):
        acc = _block_product(
            acc, tl.load(weights + block * block_halves), block, x_rows, mask_m, rows_n, zero_shift, scales_ptr,
            qzeros_ptr, N, group_size, ZERO_OFFSET, BLOCK_M, GROUP_P, PTX, FP16,
        )  # fmt: skip
    reduce_splits(acc, offs_m, offs_n, M, N, stride_ym, split_k, ws_ptr, lock_ptr, bias_ptr, y_ptr, HAS_BIAS)


def pick_mma_config(
    m: int, n: int, k: int, num_sms: int, block_n: int | None = None, num_warps: int | None = None,
    programs_per_sm: int | None = None, num_stages: int = 3, early: bool | None = None,
) -> MmaConfig:  # fmt: skip
    """Split K until about `programs_per_sm` programs per SM. Up to 16 rows of x: tiles of 64
    outputs x 16 rows on 2 warps, 8 programs per SM; above: 128 x 64 on 4 warps, 2 programs per
    SM (the fp32 partials of a split grow with the rows, and 64-row tiles are already enough
    programs). The defaults are the best of benchmarks/bench_int4_gemv.py --mma's sweep on the
    H200 (llama-3.1-8b shapes, 1-128 rows; within 5% of each shape's best, docs/benchmarks.md)."""
    block_m = 16 if m <= 16 else 64
    block_n = block_n or (64 if m <= 16 else 128)
    num_warps = num_warps or (2 if m <= 16 else 4)
    programs_per_sm = programs_per_sm or (8 if m <= 16 else 2)
    num_blocks = k // PAIRS_BLOCK
    num_programs = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split_k = max(1, min(num_blocks, (programs_per_sm * num_sms) // num_programs))
    return MmaConfig(block_n, block_m, split_k, num_warps, num_stages, EARLY_FIRST_BLOCK if early is None else early)


def int4_mma(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None, config: MmaConfig) -> torch.Tensor:
    """x [M, K] @ a pairs- or tiles-layout INT4 weight (qweight int32 [N, K/8], tiles
    [N/16, K/128, 256]) of consecutive groups (+ bias) -> [M, N] in x's dtype: bf16 and fp16
    x meet weights of their own dtype on the tensor cores, fp32 x fp32 weights."""
    assert weight.layout in ("pairs", "tiles") and weight.g_idx is None, (weight.layout, "act-order")
    qweight, qzeros, scales, zero_offset = weight.qweight, weight.qzeros, weight.scales, weight.zero_offset
    tiled = weight.layout == "tiles"
    x = x.contiguous()
    m, k = x.shape
    n, k_weight = pairs_shape(qweight)
    group_size = weight.group(k)
    assert k_weight == k and k % PAIRS_BLOCK == 0 and tiled == (qweight.dim() == 3), (x.shape, qweight.shape, tiled)
    assert group_size % 32 == 0 and (group_size % 128 == 0 or 128 % group_size == 0), group_size
    assert qweight.numel() < 2**31 and config.split_k * m * n < 2**31, "int32 offsets"
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), config.split_k)
    workspace = torch.empty(config.split_k if config.split_k > 1 else 0, m, n, dtype=torch.float32, device=x.device)
    halves = qweight.view(torch.int16)
    use_pdl = pdl.enabled(x)
    ptx = x.dtype in (torch.bfloat16, torch.float16) and not _INTERPRET
    _pairs_mma_kernel[grid](
        x, halves, qzeros, scales, bias if bias is not None else scales, workspace,
        semaphores("int4_mma", x.device, grid[0] * grid[1]), y, m, n, k, x.stride(0), y.stride(0),
        k // 4 * (16 if tiled else 1), group_size, config.split_k,
        ZERO_OFFSET=zero_offset, HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        GROUP_P=min(4, group_size // 32), NUM_STAGES=config.num_stages, PTX=ptx, FP16=x.dtype == torch.float16,
        PDL=use_pdl, EARLY=config.early, TILED=tiled,
        num_warps=config.num_warps, launch_pdl=use_pdl,
    )  # fmt: skip
    return y


@triton.jit
def _dequant_pairs_kernel(
    halves_ptr, qzeros_ptr, scales_ptr, out_ptr, N, stride_hn, group_size, ZERO_OFFSET: tl.constexpr,
    BLOCK_N: tl.constexpr, TILED: tl.constexpr,
):  # fmt: skip
    """out [K, N] = the weight of input block program_id(0), in out's dtype."""
    block = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = tl.where(offs_n < N, offs_n, 0)
    offs_c = tl.arange(0, 32)
    weights, block_halves = _block_halves(halves_ptr, rows_n, offs_c, stride_hn, TILED)
    halves = tl.load(weights + block * block_halves)  # [BN, 32]
    for p in tl.static_range(4):
        group = (block * 128 + 32 * p) // group_size
        scale = tl.load(scales_ptr + group * N + rows_n).to(tl.float32)
        zero = ((tl.load(qzeros_ptr + group * (N // 8) + rows_n // 8) >> ((rows_n % 8) * 4)) & 0xF) + ZERO_OFFSET
        w = (((halves >> (4 * p)) & 0xF) - zero[:, None]).to(tl.float32) * scale[:, None]
        out = out_ptr + (block * 128 + 32 * p + offs_c)[None, :] * N + offs_n[:, None]
        tl.store(out, w.to(out_ptr.dtype.element_ty), mask=(offs_n < N)[:, None])


def dequantize_pairs(weight: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight [K, N] of a pairs or tiles layout in `dtype` (a temporary for prefill's
    cuBLAS matmul)."""
    assert weight.layout in ("pairs", "tiles"), weight.layout
    qweight = weight.qweight
    n, k = pairs_shape(qweight)
    tiled = qweight.dim() == 3
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    _dequant_pairs_kernel[(k // PAIRS_BLOCK, triton.cdiv(n, 64))](
        qweight.view(torch.int16), weight.qzeros, weight.scales, out, n, k // 4 * (16 if tiled else 1),
        weight.group(k), ZERO_OFFSET=weight.zero_offset, BLOCK_N=64, TILED=tiled,
    )  # fmt: skip
    return out


def int4_gemm_pairs(
    x: torch.Tensor, weight: Int4Weight, num_sms: int = 132, silu_mul: bool = False, rms: Normed | None = None
) -> torch.Tensor:
    """x [M, K] @ a pairs- or tiles-layout INT4 weight -> [M, N] in x's dtype (semantics of
    kernels/int4/reference.py's int4_gemm). Up to DEQUANT_MIN_ROWS rows on the tensor cores
    here, above that cuBLAS on the dequantized weight. silu_mul: the weight is [gate | up], the
    result silu_and_mul of the product, [M, N / 2] (one launch at one row: the GEMV applies it
    to its sums). The tiles layout (kernels/int4/layouts.py) the CUDA-core GEMV does not read:
    one row goes to the MMA GEMV, or where that does not apply to the tl.dot kernel. rms: x is
    rms.hg, whose norm the MMA GEMV finishes (kernels/linear/triton_add_norm.py); other paths
    take rms.materialize()."""
    assert weight.layout in ("pairs", "tiles"), weight.layout
    m, k = x.shape
    group = weight.group(k)
    tiled = weight.layout == "tiles"
    if rms is not None:
        if _one_row_on_mma(x, group) and (SILU_MUL_GEMV or not silu_mul):
            mma_config = mma_gemv.pick_mma_gemv_config(pairs_shape(weight.qweight)[0], k, num_sms, silu_mul=silu_mul)
            return mma_gemv.gemv_pairs_mma(x, weight, mma_config, silu_mul, rms)
        x = rms.materialize()
    n, _ = pairs_shape(weight.qweight)
    if silu_mul and (m != 1 or ONE_ROW_ON_TL_DOT or not SILU_MUL_GEMV):
        return silu_and_mul(int4_gemm_pairs(x, weight, num_sms))
    if m > DEQUANT_MIN_ROWS:
        return x @ dequantize_pairs(weight, x.dtype)
    if m <= MMA_GEMV_MAX_ROWS and not (m == 1 and ONE_ROW_ON_TL_DOT) and mma_gemv.supported(x, group):
        mma_config = mma_gemv.pick_mma_gemv_config(n, k, num_sms, silu_mul=silu_mul, rows=m)
        return mma_gemv.gemv_pairs_mma(x, weight, mma_config, silu_mul)
    if m == 1 and not ONE_ROW_ON_TL_DOT and not tiled:
        config = pick_rows_config(n, k, num_sms, packed=packed_math(x.dtype, group))
        return gemv_rows(x.contiguous(), weight, None, config, silu_mul)
    return int4_mma(x, weight, None, pick_mma_config(m, n, k, num_sms))


def int4_gemm_pairs_add_norm(
    x: torch.Tensor, weight: Int4Weight, num_sms: int, add_norm: AddNorm
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The MMA GEMV of one row with the first half of the norm after it
    (kernels/linear/triton_add_norm.py): (hg, h); None where the row does not go to the MMA GEMV."""
    k = x.shape[1]
    if not _one_row_on_mma(x, weight.group(k)):
        return None
    config = mma_gemv.pick_mma_gemv_config(pairs_shape(weight.qweight)[0], k, num_sms)
    return mma_gemv.gemv_pairs_mma_add_norm(x, weight, config, add_norm)


def _one_row_on_mma(x: torch.Tensor, group: int) -> bool:
    """Whether x is one row that int4_gemm_pairs gives to the MMA GEMV (the one kernel here
    that does either half of the norm between GEMVs)."""
    return x.shape[0] == 1 and not ONE_ROW_ON_TL_DOT and mma_gemv.supported(x, group)
