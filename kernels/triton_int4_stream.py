"""The batch-1 INT4 GEMV on the pairs layout (kernels/int4_rows.py) as one wave of
persistent programs that stream the weight (stream-K).

kernels/triton_int4_rows.py's GEMV launches a program per (BLOCK_N outputs, K range): at
llama-3.1-8b's shapes each reads 16-64 KiB, so every few microseconds a program ends with
its pipeline drained, its partial reduced, and a new one starts with an empty pipeline,
and the last wave leaves SMs idle. Here the weight is a sequence of steps (BLOCK_N outputs
x UNROLL blocks of 128 inputs, output blocks in order, K within each) cut into one equal
contiguous range per program, num_programs a multiple of the SMs: a program's loads stay in
flight across output blocks (one flattened, pipelined loop), and each SM reads the same
number of bytes. Where a range ends inside an output block, or the block ends inside the
range, the program's partial sums go to a slot of the workspace; the programs sharing a
block count themselves in on each output's semaphore and the last one adds the slots in
order and writes y (deterministic), then sets the semaphore back to 0 (kernels/semaphores.py).
One semaphore per output, not per block: each thread releases the partials it stored, so the
step loop holds no CTA barrier, which would keep Triton from pipelining it.

The arithmetic is the pairs GEMV's: per word, x2 products in x's dtype (_word_dots_ptx, on
a GPU with bf16 or fp16 x), else the eight products in fp32 (the interpreter and fp32 x);
groups are whole blocks of 128 inputs (group_size % 128 == 0; other groups stay on
kernels/triton_int4_rows.py). The wrapper reads only shapes: graph-capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from kernels import pdl
from kernels.int4_rows import ROW_BLOCK
from kernels.semaphores import semaphores
from kernels.triton_int4_rows import _input_pairs, _nibble_value, _word_dots_ptx, packed_math


@dataclass(frozen=True, slots=True)
class StreamConfig:
    block_n: int = 64  # outputs per step
    unroll: int = 2  # blocks of 128 inputs per step; divides K / 128
    programs_per_sm: int = 2
    num_warps: int = 4
    num_stages: int = 4  # steps in flight per program (cp.async into shared memory)


@triton.jit
def _owner(step, num_programs, total_steps):
    """The program whose range holds `step`: ranges are [p T // P, (p + 1) T // P)."""
    return ((step + 1) * num_programs - 1) // total_steps


@triton.jit
def _step_sums(
    packed, k0, x_ptr, pair_offs, scales_ptr, qzeros_ptr, rows_n, zero_shift, N, group_size, exponent,
    ZERO_OFFSET: tl.constexpr, PACKED: tl.constexpr, FP16: tl.constexpr,
):  # fmt: skip
    """[BN, U, 16] fp32: per word of the step (packed [BN, U, 16], inputs from k0), the group
    scale times the sum of its eight (q - zero) x."""
    UNROLL: tl.constexpr = packed.shape[1]
    group = (k0 + tl.arange(0, UNROLL) * 128) // group_size  # [U]: one group per block
    scale = tl.load(scales_ptr + group[None, :] * N + rows_n[:, None]).to(tl.float32)  # [BN, U]
    packed_zero = tl.load(qzeros_ptr + group[None, :] * (N // 8) + rows_n[:, None] // 8)
    zero = ((packed_zero >> zero_shift) & 0xF) + ZERO_OFFSET  # [BN, U]
    if PACKED:
        x_pairs = x_ptr.to(tl.pointer_type(tl.uint32)) + k0 // 2 + pair_offs  # [U, 16]
        offset = ((0x6400 if FP16 else 0x4300) + zero) * 0x10001  # OFFSET + zero in both halves
        sums = _word_dots_ptx(
            packed, offset[:, :, None], tl.load(x_pairs), tl.load(x_pairs + 16), tl.load(x_pairs + 32),
            tl.load(x_pairs + 48), FP16,
        )  # fmt: skip
        return scale[:, :, None] * sums
    else:
        high = packed >> 12  # nibbles 5..7 at bits 8..19
        part = tl.zeros(packed.shape, dtype=tl.float32)
        x_sum = tl.zeros((UNROLL, 16), dtype=tl.float32)
        for j in tl.static_range(4):  # nibbles j and j + 4: inputs 32 j + 2 w and 32 j + 2 w + 1
            x_even, x_odd = _input_pairs(x_ptr, k0 + 32 * j, pair_offs)  # [U, 16] each
            part += _nibble_value(packed, high, exponent, j) * x_even[None, :, :]
            part += _nibble_value(packed, high, exponent, j + 4) * x_odd[None, :, :]
            x_sum += x_even + x_odd
        return scale[:, :, None] * (part - zero.to(tl.float32)[:, :, None] * x_sum[None, :, :])


@triton.jit
def _finish_block(
    acc, block, offs_n, N, num_programs, total_steps, steps_per_block, ws_ptr, lock_ptr, bias_ptr, y_ptr,
    HAS_BIAS: tl.constexpr, MAX_SLOTS: tl.constexpr,
):  # fmt: skip
    """This program's part of output block `block` (acc [BN, U, 16]) into y: directly when no
    other program reads the block, else through the workspace slot of the program's rank
    among the block's programs; per output, the last to count itself in on the output's
    semaphore adds the slots in order and writes y."""
    partial = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BN]
    mask = offs_n < N
    first = _owner(block * steps_per_block, num_programs, total_steps)
    count = _owner(block * steps_per_block + steps_per_block - 1, num_programs, total_steps) - first + 1
    if count == 1:
        total = partial
        is_last = mask
    else:  # per-output semaphores: a CTA barrier in the step loop would stop its pipelining
        tl.store(ws_ptr + (tl.program_id(0) - first) * N + offs_n, partial, mask=mask)
        # The thread that stored an output's partial releases it with its own atomic.
        arrived = tl.atomic_add(lock_ptr + offs_n, 1, mask=mask, sem="acq_rel")
        is_last = mask & (arrived == count - 1)
        total = tl.zeros_like(partial)
        for slot in tl.static_range(MAX_SLOTS):  # static: a loop nested in the step loop would stop its pipelining
            total += tl.load(ws_ptr + slot * N + offs_n, mask=is_last & (slot < count), other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(lock_ptr + offs_n, 0, mask=is_last, sem="relaxed")
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, total.to(y_ptr.dtype.element_ty), mask=is_last)


@triton.jit
def _stream_gemv_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, bias_ptr, ws_ptr, lock_ptr, y_ptr,
    N, K, stride_qn, group_size, total_steps, steps_per_block, exponent,
    ZERO_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr,
    NUM_STAGES: tl.constexpr, PDL: tl.constexpr, PACKED: tl.constexpr, FP16: tl.constexpr, MAX_SLOTS: tl.constexpr,
):  # fmt: skip
    """Program p walks steps [p T // P, (p + 1) T // P) of the T = total_steps (step s: output
    block s // steps_per_block, blocks of 128 inputs from UNROLL (s % steps_per_block)),
    finishing an output block where the block or the range ends."""
    num_programs = tl.num_programs(0)
    start = tl.program_id(0) * total_steps // num_programs
    end = (tl.program_id(0) + 1) * total_steps // num_programs
    offs_u = tl.arange(0, UNROLL)
    offs_w = tl.arange(0, 16)
    offs_b = tl.arange(0, BLOCK_N)
    pair_offs = offs_u[:, None] * 64 + offs_w[None, :]  # [U, 16]: the 32-bit pair of inputs 2 w, 2 w + 1
    word_offs = offs_u[None, :, None] * 16 + offs_w[None, None, :]  # [1, U, 16]
    acc = tl.zeros((BLOCK_N, UNROLL, 16), dtype=tl.float32)
    if PDL:
        gdc_wait()  # launched while the kernel before ends; x is its output (kernels/pdl.py)
    for step in tl.range(start, end, num_stages=NUM_STAGES):
        block = step // steps_per_block
        k_step = step - block * steps_per_block
        offs_n = block * BLOCK_N + offs_b
        rows_n = tl.where(offs_n < N, offs_n, 0)  # rows past N read row 0; their sums are not stored
        packed = tl.load(qweight_ptr + rows_n[:, None, None] * stride_qn + k_step * 16 * UNROLL + word_offs)
        acc += _step_sums(
            packed, k_step * 128 * UNROLL, x_ptr, pair_offs, scales_ptr, qzeros_ptr, rows_n, ((rows_n % 8) * 4)[:, None],
            N, group_size, exponent, ZERO_OFFSET, PACKED, FP16,
        )  # fmt: skip
        if (k_step == steps_per_block - 1) | (step == end - 1):
            _finish_block(
                acc, block, offs_n, N, num_programs, total_steps, steps_per_block, ws_ptr, lock_ptr, bias_ptr, y_ptr,
                HAS_BIAS, MAX_SLOTS,
            )  # fmt: skip
            acc = tl.zeros((BLOCK_N, UNROLL, 16), dtype=tl.float32)


def pick_stream_config(n: int, k: int) -> StreamConfig:
    """The best of benchmarks/bench_int4_gemv.py --stream's sweep on the H200 for gate_up (27.8
    us against the pairs GEMV's 28.7; the other llama-3.1-8b shapes were 4-9% slower than it)."""
    return StreamConfig(block_n=128, unroll=2, programs_per_sm=3, num_warps=4, num_stages=3)


def stream_fits(k: int, group_size: int, config: StreamConfig) -> bool:
    """Whether the stream GEMV takes a weight of K inputs in groups of group_size."""
    return k % (ROW_BLOCK * config.unroll) == 0 and group_size % ROW_BLOCK == 0


def max_slots(total_steps: int, num_programs: int, steps_per_block: int) -> int:
    """An upper bound on the programs that share an output block (workspace slots), rounded
    up to a power of two (a kernel constexpr: fewer compiled variants)."""
    shortest = total_steps // num_programs
    return triton.next_power_of_2(-(-(steps_per_block - 1) // shortest) + 1)


def gemv_stream(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    zero_offset: int,
    config: StreamConfig,
    num_sms: int = 132,
) -> torch.Tensor:
    """x [1, K] @ a pairs-layout INT4 weight (qweight [N, K/8]) (+ bias) -> [1, N] in x's
    dtype; group_size: inputs per group (K for one group), a multiple of 128."""
    x = x.contiguous()
    n, num_words = qweight.shape
    k = num_words * 8
    assert x.shape == (1, k) and stream_fits(k, group_size, config), (x.shape, qweight.shape, group_size, config)
    assert qweight.numel() < 2**31, "int32 offsets"
    num_blocks = triton.cdiv(n, config.block_n)
    steps_per_block = k // (ROW_BLOCK * config.unroll)
    total_steps = num_blocks * steps_per_block
    num_programs = min(total_steps, config.programs_per_sm * num_sms)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    slots = max_slots(total_steps, num_programs, steps_per_block)
    workspace = torch.empty(slots, n, dtype=torch.float32, device=x.device)
    use_pdl = pdl.enabled(x)
    _stream_gemv_kernel[(num_programs,)](
        x, qweight, qzeros, scales, bias if bias is not None else scales, workspace,
        semaphores("int4_stream", x.device, n), y, n, k, qweight.stride(0), group_size, total_steps,
        steps_per_block, 0x4B000000,
        ZERO_OFFSET=zero_offset, HAS_BIAS=bias is not None, BLOCK_N=config.block_n, UNROLL=config.unroll,
        NUM_STAGES=config.num_stages, PDL=use_pdl, PACKED=packed_math(x.dtype, group_size), FP16=x.dtype == torch.float16,
        MAX_SLOTS=slots, num_warps=config.num_warps, launch_pdl=use_pdl,
    )  # fmt: skip
    return y
