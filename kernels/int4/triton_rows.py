"""The one-row INT4 GEMV (batch-1 decode) on the rows layout (kernels/int4/layouts.py: each
output's nibbles contiguous along K, GPTQ's zeros and scales) and the pairs layout, for
groups of consecutive inputs; 2 rows and more on the rows layout: kernels/int4/triton_rows_dot.py.

- `gemv_rows`: a program owns BLOCK_N outputs and walks K
  in UNROLL blocks of 128 inputs, reading each row's 64 * UNROLL bytes with 16-byte loads,
  NUM_STAGES steps in flight (cp.async into shared memory; the best configs streamed
  0.9-1.4 TB/s before it and the 16-byte loads, 1.0-1.8 TB/s after; the loop is
  latency-bound, so the default gives each thread only 2 rows on 4 warps to fit more warps
  per SM: 1.1-1.9 TB/s, docs/benchmarks.md).
  Nibble j of a block's 16 words is 16 consecutive inputs, so x arrives as contiguous
  vectors, shared by the rows a thread holds. Per 4-bit weight: one and-or, which makes
  the fp32 2^23 + q * 2^p of the nibble at bit p, one fma that turns it into q exactly
  ((2^23 + q 2^p) * 2^-p - 2^(23-p)), and the fma with x. Zeros and scales are applied
  per group to the partial sums: y_n = sum_g s_gn * (sum_k q_kn x_k - z_gn * sum_k x_k).
  K may be split over SPLIT_K programs; their fp32 partials meet as in
  kernels/int4/triton_gemv.py (workspace + per-block semaphore, the last one writes y).
  Under PDL it waits for x before its loop (whose pipeline issues the weight loads). The
  same loop reads the pairs layout (`pairs=True`): nibble j + 4 h of word w is then input
  32 j + 2 w + h, so per j one 32-bit load of x's pairs gives both nibbles' vectors.
The wrapper reads only shapes, never values: graph-capturable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from vllm_cluster.kernels.int4.layouts import ROW_BLOCK
from vllm_cluster.kernels.int4.weight import Int4Weight
from vllm_cluster.kernels.linear.triton_gemv import store_outputs, weight_rows
from vllm_cluster.kernels.sync import pdl
from vllm_cluster.kernels.sync.semaphores import semaphores, sum_splits

# Blocks of 128 inputs per step of the one-row GEMV (pick_rows_config's default).
GEMV_UNROLL = 2
# Outputs from which the one-row GEMV takes 128 outputs a program on 2 warps (llama-3.1-8b's
# gate_up, 28672; 64 on 4 warps below, docs/benchmarks.md).
WIDE_N = 16384
# The one-row GEMV on the pairs layout multiplies in x2 arithmetic of x's dtype where it can
# (_word_dots_ptx: groups of 128 inputs or more, bf16 or fp16 x, on a GPU), else in fp32.
PACKED_PAIRS = True
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True, slots=True)
class RowsGemvConfig:
    block_n: int  # outputs per program
    unroll: int  # blocks of 128 inputs per loop step; divides K / 128
    split_k: int
    num_warps: int = 2
    num_stages: int = 3  # weight tiles in flight per program (cp.async into shared memory)


@triton.jit
def _nibble_value(packed, high, exponent, J: tl.constexpr):
    """Nibble J of each word as exact fp32 q (0..15). exponent: 0x4B000000, a kernel argument
    so that it sits in a register and the and-or is one LOP3 (one immediate operand).
    Nibbles 0..4 are read at bit 4J of the word, 5..7 at bit 4J - 12 of `high` (word >> 12)."""
    pos: tl.constexpr = 4 * J if J < 5 else 4 * J - 12
    bits = ((packed if J < 5 else high) & (0xF << pos)) | exponent
    # bits read as fp32: 2^23 + q 2^pos, exact; scaled by 2^-pos, minus 2^(23-pos): q.
    return bits.to(tl.float32, bitcast=True) * (1.0 / (1 << pos)) - (1 << (23 - pos))


@triton.jit
def _input_pairs(x_ptr, start, pair_offs):
    """x[start + 2 i] and x[start + 2 i + 1] as fp32, i = pair_offs ([U, 16]; start even). A
    16-bit x is read as 32-bit pairs, so one vector load serves both, split by bit operations
    (a bf16's bits are the top half of its fp32); fp32 x is read twice with stride 2."""
    if x_ptr.dtype.element_ty == tl.float32:
        return tl.load(x_ptr + start + 2 * pair_offs), tl.load(x_ptr + start + 2 * pair_offs + 1)
    pairs = tl.load(x_ptr.to(tl.pointer_type(tl.uint32)) + start // 2 + pair_offs)
    if x_ptr.dtype.element_ty == tl.bfloat16:
        return (pairs << 16).to(tl.float32, bitcast=True), (pairs & 0xFFFF0000).to(tl.float32, bitcast=True)
    even = (pairs & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return even, (pairs >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _word_dots_ptx(packed, offset, x0, x1, x2, x3, FP16: tl.constexpr):
    """fp32 sum of the 8 products of each pairs-layout word (packed [BN, U, 16] int32) with
    its inputs, in x2 arithmetic: per nibble pair p (bits 4p and 4p + 16) a shift, one LOP3
    into OFFSET's mantissa (bf16 128 + q, fp16 1024 + q), one x2 subtract of `offset` (its
    OFFSET + zero in both halves: q - zero, exact) and one x2 fma with x_p (the 32-bit pair of
    inputs 32 p + 2 w, + 1, as loaded); the two halves of the sum are added in fp32. Products
    and the four-term sums round to x's dtype (bf16: relative 2^-9 a step)."""
    magic: tl.constexpr = "0x64006400" if FP16 else "0x43004300"
    kind: tl.constexpr = "f16x2" if FP16 else "bf16x2"
    unpack: tl.constexpr = (
        "mov.b32 {h0, h1}, a; cvt.f32.f16 fl, h0; cvt.f32.f16 fh, h1;" if FP16
        else "shl.b32 t, a, 16; mov.b32 fl, t; and.b32 t, a, 0xFFFF0000; mov.b32 fh, t;"
    )  # fmt: skip
    pair: tl.constexpr = " lop3.b32 q, t, 0x000F000F, " + magic + ", 0xea; sub.rn." + kind + " q, q, $2;"
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t, q, a; .reg .b16 h0, h1; .reg .f32 fl, fh;"
        " lop3.b32 q, $1, 0x000F000F, " + magic + ", 0xea; sub.rn." + kind + " q, q, $2; mul.rn." + kind + " a, q, $3;"
        " shr.u32 t, $1, 4;" + pair + " fma.rn." + kind + " a, q, $4, a;"
        " shr.u32 t, $1, 8;" + pair + " fma.rn." + kind + " a, q, $5, a;"
        " shr.u32 t, $1, 12;" + pair + " fma.rn." + kind + " a, q, $6, a; "
        + unpack + " add.f32 $0, fl, fh; }",
        "=f,r,r,r,r,r,r",
        [packed, tl.broadcast_to(offset, packed.shape), tl.broadcast_to(x0[None, :, :], packed.shape),
         tl.broadcast_to(x1[None, :, :], packed.shape), tl.broadcast_to(x2[None, :, :], packed.shape),
         tl.broadcast_to(x3[None, :, :], packed.shape)],
        dtype=tl.float32, is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _rows_gemv_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, bias_ptr, ws_ptr, lock_ptr, y_ptr,
    N, K, stride_qn, group_size, split_k, exponent,
    ZERO_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr,
    GROUP_J: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr, PAIRS: tl.constexpr, PACKED: tl.constexpr,
    FP16: tl.constexpr, SILU_MUL: tl.constexpr,
):  # fmt: skip
    """Program (0, N block, split). GROUP_J: nibble runs of 16 inputs per group, at most 8.
    stride_qn (K / 8) is its own argument so that Triton sees it divisible by 16 (16-byte loads).
    PAIRS: the weight is in the pairs layout (nibble p + 4 h of word w: input 32 p + 2 w + h),
    read in the same loop: per p one load of x's 32 inputs, split into the two nibbles' vectors;
    GROUP_J then counts runs of 32 inputs (at most 4). PACKED (pairs, groups of 128 inputs or
    more, 16-bit x, on a GPU): a word's eight products in x2 arithmetic (_word_dots_ptx), the
    group's zero subtracted from each weight, its scale times each word's sum. SILU_MUL: the
    weight is [gate | up] (N = 2I rows); a program reads gate rows n and up rows I + n
    (BLOCK_N / 2 outputs) and stores silu(gate) * up, y [1, I]."""
    pid_n = tl.program_id(1)
    # The weight rows of this program; rows past N (past I for SILU_MUL) read row 0, unstored.
    if SILU_MUL:
        rows_n, valid = weight_rows(pid_n, N // 2, BLOCK_N // 2, True)
    else:
        rows_n, valid = weight_rows(pid_n, N, BLOCK_N, False)
    offs_u = tl.arange(0, UNROLL)
    offs_w = tl.arange(0, 16)
    words = qweight_ptr + rows_n[:, None, None] * stride_qn + offs_u[None, :, None] * 16 + offs_w[None, None, :]
    x_offs = offs_u[:, None] * 128 + offs_w[None, :]  # [U, 16]: input of nibble 0 in the step
    pair_offs = offs_u[:, None] * 64 + offs_w[None, :]  # [U, 16]: the 32-bit pair of inputs 2 w, 2 w + 1
    zero_shift = ((rows_n % 8) * 4)[:, None]
    num_steps = K // (128 * UNROLL)
    per_split = tl.cdiv(num_steps, split_k)
    first = tl.program_id(2) * per_split
    last = tl.minimum(first + per_split, num_steps)
    acc = tl.zeros((BLOCK_N, UNROLL, 16), dtype=tl.float32)
    if PDL:
        gdc_wait()  # launched while the kernel before ends; x is its output (kernels/sync/pdl.py)
    for step in tl.range(first, last, num_stages=NUM_STAGES):
        k0 = step * 128 * UNROLL
        packed = tl.load(words + step * 16 * UNROLL)  # [BN, U, 16]
        if PACKED:  # one group per block of 128 inputs (group_size a multiple of 128)
            x_pairs = x_ptr.to(tl.pointer_type(tl.uint32)) + k0 // 2 + pair_offs  # [U, 16]
            group = (k0 + offs_u * 128) // group_size  # [U]
            scale = tl.load(scales_ptr + group[None, :] * N + rows_n[:, None]).to(tl.float32)  # [BN, U]
            packed_zero = tl.load(qzeros_ptr + group[None, :] * (N // 8) + rows_n[:, None] // 8)
            zero = ((packed_zero >> zero_shift) & 0xF) + ZERO_OFFSET  # [BN, U]
            offset = ((0x6400 if FP16 else 0x4300) + zero) * 0x10001  # OFFSET + zero in both halves
            sums = _word_dots_ptx(
                packed, offset[:, :, None], tl.load(x_pairs), tl.load(x_pairs + 16), tl.load(x_pairs + 32),
                tl.load(x_pairs + 48), FP16,
            )  # fmt: skip
            acc += scale[:, :, None] * sums
        else:
            high = packed >> 12  # nibbles 5..7 at bits 8..19
            part = tl.zeros((BLOCK_N, UNROLL, 16), dtype=tl.float32)
            x_sum = tl.zeros((UNROLL, 16), dtype=tl.float32)
            for j in tl.static_range(8 if not PAIRS else 4):
                if PAIRS:  # nibbles j and j + 4: inputs 32 j + 2 w and 32 j + 2 w + 1
                    x_even, x_odd = _input_pairs(x_ptr, k0 + 32 * j, pair_offs)  # [U, 16] each
                    part += _nibble_value(packed, high, exponent, j) * x_even[None, :, :]
                    part += _nibble_value(packed, high, exponent, j + 4) * x_odd[None, :, :]
                    x_sum += x_even + x_odd
                    first_input = 32 * j
                else:
                    x = tl.load(x_ptr + k0 + 16 * j + x_offs).to(tl.float32)  # [U, 16]
                    part += _nibble_value(packed, high, exponent, j) * x[None, :, :]
                    x_sum += x
                    first_input = 16 * j
                if (j + 1) % GROUP_J == 0:
                    group = (k0 + offs_u * 128 + first_input) // group_size  # [U]
                    scale = tl.load(scales_ptr + group[None, :] * N + rows_n[:, None]).to(tl.float32)  # [BN, U]
                    packed_zero = tl.load(qzeros_ptr + group[None, :] * (N // 8) + rows_n[:, None] // 8)
                    zero = (((packed_zero >> zero_shift) & 0xF) + ZERO_OFFSET).to(tl.float32)  # [BN, U]
                    acc += scale[:, :, None] * (part - zero[:, :, None] * x_sum[None, :, :])
                    part = tl.zeros((BLOCK_N, UNROLL, 16), dtype=tl.float32)
                    x_sum = tl.zeros((UNROLL, 16), dtype=tl.float32)
    partial = tl.sum(tl.sum(acc, axis=2), axis=1)[:, None]  # y^T [BN, 1]
    out_rows = tl.where(valid, rows_n, N)
    total, is_last = sum_splits(partial, tl.arange(0, 1), out_rows, 1, N, split_k, ws_ptr, lock_ptr)
    y = tl.reshape(total, (BLOCK_N,))
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows_n, mask=valid, other=0.0).to(tl.float32)
    if SILU_MUL:
        store_outputs(y, y_ptr, pid_n, N // 2, BLOCK_N // 2, True, is_last)
    else:
        tl.store(y_ptr + out_rows, y.to(y_ptr.dtype.element_ty), mask=valid & is_last)


def pick_rows_config(
    n: int, k: int, num_sms: int, block_n: int | None = None, unroll: int | None = None, num_warps: int | None = None,
    programs_per_sm: int = 4, num_stages: int = 3, packed: bool = False,
) -> RowsGemvConfig:  # fmt: skip
    """Split K until about `programs_per_sm` programs per SM, in at least two ranges (more
    warps in flight: the loop is latency-bound). The defaults are the best of
    benchmarks/bench_int4_gemv.py's sweep on the pairs layout on the H200 for llama-3.1-8b
    (docs/benchmarks.md): 64 outputs per program, two blocks of 128 inputs per step, 4 warps
    (2 rows per thread) below K = 8192, 2 warps (4 rows per thread) from there; from WIDE_N
    outputs in x2 arithmetic (`packed`: the pairs GEMV's PACKED path, fewer registers a row),
    128 outputs per program on 2 warps (8 rows per thread)."""
    wide = packed and n >= WIDE_N and k < 8192
    block_n = block_n or (128 if wide else 64)
    unroll = unroll or GEMV_UNROLL
    num_warps = num_warps or (4 if k < 8192 and not wide else 2)
    unroll, split_k = split_steps(k, unroll, triton.cdiv(n, block_n), num_sms, programs_per_sm)
    return RowsGemvConfig(block_n, unroll, split_k, num_warps, num_stages)


def split_steps(
    k: int, unroll: int, num_programs: int, num_sms: int, programs_per_sm: int, min_split: int = 2
) -> tuple[int, int]:  # fmt: skip
    """The one-row GEMVs' steps (this file's and kernels/int4/triton_mma_gemv.py's): halve
    `unroll` until it divides K's blocks of 128 inputs, then split the steps over programs
    until about `programs_per_sm` programs per SM, in at least `min_split` ranges.
    -> (unroll, split_k)."""
    num_blocks = k // ROW_BLOCK
    while num_blocks % unroll:
        unroll //= 2
    num_steps = num_blocks // unroll
    return unroll, max(min(min_split, num_steps), min(num_steps, (programs_per_sm * num_sms) // num_programs))


def packed_math(dtype: torch.dtype, group_size: int) -> bool:
    """Whether the pairs GEMV takes the x2 path (PACKED_PAIRS) for this x dtype and group."""
    return PACKED_PAIRS and not _INTERPRET and dtype in (torch.bfloat16, torch.float16) and group_size % 128 == 0


def gemv_rows(
    x: torch.Tensor,
    weight: Int4Weight,
    bias: torch.Tensor | None,
    config: RowsGemvConfig,
    silu_mul: bool = False,
) -> torch.Tensor:
    """x [1, K] @ a rows- or pairs-layout INT4 weight (qweight [N, K/8]) of consecutive groups
    (+ bias) -> [1, N] in x's dtype. silu_mul: the weight is [gate | up] and the result
    silu(gate) * up, [1, N / 2], rounded as `silu_and_mul` of the plain result (a program
    reads config.block_n / 2 outputs of each)."""
    assert weight.layout in ("rows", "pairs") and weight.g_idx is None, (weight.layout, "act-order")
    qweight, qzeros, scales, zero_offset = weight.qweight, weight.qzeros, weight.scales, weight.zero_offset
    pairs = weight.layout == "pairs"
    x = x.contiguous()
    n, num_words = qweight.shape
    k = num_words * 8
    group_size = weight.group(k)
    assert x.shape == (1, k) and k % (ROW_BLOCK * config.unroll) == 0, (x.shape, qweight.shape, config)
    assert qweight.numel() < 2**31, "int32 offsets"
    assert not silu_mul or (n % 2 == 0 and config.block_n % 2 == 0), f"{n} rows are not [gate | up] ({config})"
    y = torch.empty(1, n // 2 if silu_mul else n, dtype=x.dtype, device=x.device)
    num_blocks_n = triton.cdiv(y.shape[1], config.block_n // 2 if silu_mul else config.block_n)
    workspace = torch.empty(config.split_k, n, dtype=torch.float32, device=x.device)
    use_pdl = pdl.enabled(x)
    _rows_gemv_kernel[(1, num_blocks_n, config.split_k)](
        x, qweight, qzeros, scales, bias if bias is not None else scales, workspace,
        semaphores("int4_gemv", x.device, num_blocks_n), y, n, k, qweight.stride(0), group_size,
        config.split_k, 0x4B000000,
        ZERO_OFFSET=zero_offset, HAS_BIAS=bias is not None, BLOCK_N=config.block_n, UNROLL=config.unroll,
        GROUP_J=min(4, group_size // 32) if pairs else min(8, group_size // 16), NUM_STAGES=config.num_stages,
        PDL=use_pdl, PAIRS=pairs, PACKED=pairs and packed_math(x.dtype, group_size), FP16=x.dtype == torch.float16,
        SILU_MUL=silu_mul, num_warps=config.num_warps, launch_pdl=use_pdl,
    )  # fmt: skip
    return y
