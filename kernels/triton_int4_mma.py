"""INT4 products of few rows (batch-1 and small-batch decode) on the tensor cores, on the
"pairs" layout (kernels/int4_rows.py): the weight is the tall operand of tl.dot, x^T (its
rows zero-padded to BLOCK_M) the narrow one.

Why tensor cores at M = 1: a CUDA-core GEMV spends an fma per weight on the product and
more on turning a nibble into a number, 4.4-5.1 instructions per weight, and the H200 can
issue about 3.6 per weight while streaming 4-bit weights at its bandwidth
(docs/benchmarks.md, "The INT4 GEMV on the rows layout"). Here a 32-bit register of the
weight tile holds two adjacent inputs of one output (two 16-bit halves of a word), and
one shift plus one LOP3 turn it into the two bf16 numbers 128 + q the tensor cores take
as is: (h >> 4p) & 0x000F000F | 0x43004300 read as two bf16 is 128 + q_lo, 128 + q_hi
(exact: bf16 holds integers to 256). The multiply-add is the MMA's. Per group the zero
and the 128 come out with the sum of x:  y_n = sum_g s_gn (sum_k (128 + q_kn) x_k -
(128 + z_gn) sum_k x_k).

Programs are (BLOCK_M rows of x, BLOCK_N outputs, one of split_k ranges of K blocks);
split partials meet in a workspace under a semaphore (kernels/semaphores.py), the last
program of a tile writes y, so a product is one launch. The wrappers read only shapes:
graph-capturable. Under the Triton interpreter (CPU tests) the conversion is written
with plain ops (inline PTX does not run there); both give the same bf16 numbers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from kernels import pdl
from kernels.semaphores import semaphores

PAIRS_BLOCK = 128  # inputs per block; a block is 32 int16 halves per output
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True, slots=True)
class MmaConfig:
    block_n: int  # outputs per program
    block_m: int  # rows of x per program (16: the narrowest tl.dot)
    split_k: int
    num_warps: int = 1
    num_stages: int = 3  # weight tiles in flight per program (cp.async into shared memory)


@triton.jit
def _weights(halves, zero, P: tl.constexpr, PTX: tl.constexpr):
    """q - zero of nibble P of each int16 half, exact in bf16. zero: int32 [BN, 1], the
    group's zero of each output. Two adjacent halves of a row share a 32-bit register in
    the tl.dot operand layout, so with PTX a shift, a LOP3 (the pair as bf16 128 + q) and a
    bf16x2 subtract of 128 + zero make two weights."""
    if not PTX:  # fp32 operands holding the same numbers: the interpreter multiplies bf16 wrongly
        return (((halves >> (4 * P)) & 0xF) - zero).to(tl.float32)
    zero_bits = tl.broadcast_to((0x4300 + zero).to(tl.int16), halves.shape)  # bf16 128 + zero
    if P == 0:
        asm: tl.constexpr = "{ .reg .b32 t; lop3.b32 t, $1, 0x000F000F, 0x43004300, 0xea; sub.rn.bf16x2 $0, t, $2; }"
    elif P == 1:
        asm: tl.constexpr = (
            "{ .reg .b32 t; shr.u32 t, $1, 4; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xea; sub.rn.bf16x2 $0, t, $2; }"
        )
    elif P == 2:
        asm: tl.constexpr = (
            "{ .reg .b32 t; shr.u32 t, $1, 8; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xea; sub.rn.bf16x2 $0, t, $2; }"
        )
    else:
        asm: tl.constexpr = (
            "{ .reg .b32 t; shr.u32 t, $1, 12; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xea; sub.rn.bf16x2 $0, t, $2; }"
        )
    return tl.inline_asm_elementwise(asm, "=r,r,r", [halves, zero_bits], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _pairs_mma_kernel(
    x_ptr, halves_ptr, qzeros_ptr, scales_ptr, bias_ptr, ws_ptr, lock_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym, stride_hn, group_size, split_k,
    ZERO_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP_P: tl.constexpr, NUM_STAGES: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (M block, N block, split). halves: the qweight as int16 [N, K/4]; half c of a
    block, nibble p, is input 32 p + c of the block. GROUP_P: runs of 32 inputs per group
    (at most 4). stride_hn (K / 4) is an argument so that Triton sees it divisible by 16."""
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
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if PDL:
        gdc_wait()  # launched while the kernel before ends; x is its output (kernels/pdl.py)
    for block in tl.range(first, last, num_stages=NUM_STAGES):
        halves = tl.load(halves_ptr + rows_n[:, None] * stride_hn + block * 32 + offs_c[None, :])  # [BN, 32]
        part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for p in tl.static_range(4):
            if p % GROUP_P == 0:
                group = (block * 128 + 32 * p) // group_size
                scale = tl.load(scales_ptr + group * N + rows_n).to(tl.float32)  # [BN]
                packed_zero = tl.load(qzeros_ptr + group * (N // 8) + rows_n // 8)
                zero = ((packed_zero >> zero_shift) & 0xF) + ZERO_OFFSET  # [BN]
            x_t = tl.load(x_rows + block * 128 + 32 * p, mask=mask_m[None, :], other=0.0)  # [32, BM]
            w = _weights(halves, zero[:, None], p, PTX)
            part = tl.dot(w, x_t.to(w.dtype), part, input_precision="ieee" if not PTX else None)
            if (p + 1) % GROUP_P == 0:
                acc += scale[:, None] * part
                part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    _reduce_tiles(acc, offs_m, offs_n, M, N, stride_ym, split_k, ws_ptr, lock_ptr, bias_ptr, y_ptr, HAS_BIAS)


@triton.jit
def _reduce_tiles(
    acc, offs_m, offs_n, M, N, stride_ym, split_k, ws_ptr, lock_ptr, bias_ptr, y_ptr, HAS_BIAS: tl.constexpr
):  # fmt: skip
    """acc: this program's fp32 y^T tile [BN, BM]. The last of a tile's split_k programs to
    arrive writes y = sum of partials + bias."""
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


def pick_mma_config(
    m: int, n: int, k: int, num_sms: int, block_n: int = 64, num_warps: int = 1, programs_per_sm: int = 4,
    num_stages: int = 3,
) -> MmaConfig:  # fmt: skip
    """Split K until about `programs_per_sm` programs per SM."""
    block_m = 16
    num_blocks = k // PAIRS_BLOCK
    num_programs = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split_k = max(1, min(num_blocks, (programs_per_sm * num_sms) // num_programs))
    return MmaConfig(block_n, block_m, split_k, num_warps, num_stages)


def int4_mma(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    zero_offset: int,
    config: MmaConfig,
) -> torch.Tensor:
    """x [M, K] @ a pairs-layout INT4 weight (qweight int32 [N, K/8]) (+ bias) -> [M, N] in
    x's dtype (bf16; fp16 x is multiplied in bf16). group_size: inputs per group (K: one)."""
    x = x.contiguous()
    m, k = x.shape
    n, num_words = qweight.shape
    assert num_words * 8 == k and k % PAIRS_BLOCK == 0, (x.shape, qweight.shape)
    assert group_size % 32 == 0 and (group_size % 128 == 0 or 128 % group_size == 0), group_size
    assert qweight.numel() < 2**31 and config.split_k * m * n < 2**31, "int32 offsets"
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), config.split_k)
    workspace = torch.empty(config.split_k if config.split_k > 1 else 0, m, n, dtype=torch.float32, device=x.device)
    halves = qweight.view(torch.int16)
    use_pdl = pdl.enabled(x)
    _pairs_mma_kernel[grid](
        x, halves, qzeros, scales, bias if bias is not None else scales, workspace,
        semaphores("int4_mma", x.device, grid[0] * grid[1]), y, m, n, k, x.stride(0), y.stride(0), halves.stride(0),
        group_size, config.split_k,
        ZERO_OFFSET=zero_offset, HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        GROUP_P=min(4, group_size // 32), NUM_STAGES=config.num_stages, PTX=not _INTERPRET, PDL=use_pdl,
        num_warps=config.num_warps, launch_pdl=use_pdl,
    )  # fmt: skip
    return y
