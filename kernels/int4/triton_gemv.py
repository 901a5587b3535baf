"""INT4 GEMV for decode, GPTQ and AWQ packings (kernels/int4/reference.py) with groups of
consecutive inputs: y [M, N] = x [M, K] @ W [K, N] + bias, W = (q - zero) * scale, for
M <= GEMV_MAX_ROWS. Act-order (a g_idx gather) stays with kernels/int4/triton_gemm.py.

The unpack costs a shift, one mask-and-or and one fp32 subtract per weight:
(q | 0x4B000000) read as fp32 is 2^23 + q, so subtracting 2^23 + zero leaves q - zero
exactly, without the int-to-float conversion that Hopper issues at 1/8 of the fp32 rate.
GPTQ multiplies its group scale into a tile's partial sums, not into each weight.

Programs are (row of x, BLOCK_N outputs, one of SPLIT_K ranges of K tiles). Each writes
its fp32 partial sums into a workspace and counts itself in on the semaphore of its
(row, N block); the last to arrive adds the partials and the bias, writes y in x's dtype
and sets the semaphore back to 0. So a linear is one launch, with no zeroed buffer and no
cast kernel (semaphores: kernels/sync/semaphores.py, shared with kernels/int4/triton_rows.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_cluster.kernels.int4.weight import Int4Weight
from vllm_cluster.kernels.linear.triton_w8_gemv import GEMV_MAX_ROWS
from vllm_cluster.kernels.sync.semaphores import semaphores

# 2^23: 0x4B000000 | q read as fp32 is _MAGIC + q for q < 2^23.
_MAGIC: tl.constexpr = tl.constexpr(8388608.0)


@dataclass(frozen=True, slots=True)
class Int4GemvConfig:
    block_n: int  # outputs per program (a multiple of 8)
    block_k: int  # inputs per tile; divides the group size, so a tile sits in one group
    split_k: int
    num_warps: int = 4


@triton.jit
def _tile_range(K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """The K tiles [first, last) of this program's split."""
    num_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(num_tiles, SPLIT_K)
    first = tl.program_id(2) * per_split
    return first, tl.minimum(first + per_split, num_tiles)


@triton.jit
def _reduce_split_k(
    partial, offs_n, M, N, ws_ptr, lock_ptr, bias_ptr, y_ptr, stride_ym,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """partial: this program's fp32 [BLOCK_N] sums over its K range. The last program of a
    (row, N block) to arrive writes y = sum of the SPLIT_K partials + bias."""
    row = tl.program_id(0)
    mask_n = offs_n < N
    tl.store(ws_ptr + (tl.program_id(2) * M + row) * N + offs_n, partial, mask=mask_n)
    tl.debug_barrier()  # every thread's partial is written before the semaphore counts it
    lock = lock_ptr + row * tl.num_programs(1) + tl.program_id(1)
    is_last = tl.atomic_add(lock, 1, sem="acq_rel") == SPLIT_K - 1
    total = tl.zeros_like(partial)
    for split in tl.static_range(SPLIT_K):
        part = ws_ptr + (split * M + row) * N + offs_n
        total += tl.load(part, mask=mask_n & is_last, other=0.0, cache_modifier=".cg")
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + offs_n, total.to(y_ptr.dtype.element_ty), mask=mask_n & is_last)
    tl.atomic_xchg(lock, 0, mask=is_last, sem="relaxed")


@triton.jit
def _gptq_gemv_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, bias_ptr, ws_ptr, lock_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym, group_size,
    ZERO_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """qweight [K/8, N]: nibble j of word row r is input 8r + j, so one word row is eight
    inputs of BLOCK_N outputs, read as 16-byte loads along N."""
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    zero_shift = (offs_n % 8) * 4  # GPTQ zeros: nibble n % 8 of word n // 8
    x_row = x_ptr + row * stride_xm
    acc = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
    first, last = _tile_range(K, BLOCK_K, SPLIT_K)
    for tile in range(first, last):
        offs_r = tile * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
        mask_r = offs_r < K // 8
        packed = tl.load(
            qweight_ptr + offs_r[:, None] * N + offs_n[None, :], mask=mask_r[:, None] & mask_n[None, :], other=0
        )  # [BK/8, BN]
        group = (tile * BLOCK_K) // group_size
        packed_zero = tl.load(qzeros_ptr + group * (N // 8) + offs_n // 8, mask=mask_n, other=0)
        magic_zero = _MAGIC + (((packed_zero >> zero_shift) & 0xF) + ZERO_OFFSET).to(tl.float32)  # [BN]
        part = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(8):
            x = tl.load(x_row + offs_r * 8 + j, mask=mask_r, other=0.0).to(tl.float32)  # [BK/8]
            w = (((packed >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - magic_zero[None, :]
            part += x[:, None] * w
        scale = tl.load(scales_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc += part * scale[None, :]
    _reduce_split_k(
        tl.sum(acc, axis=0), offs_n, M, N, ws_ptr, lock_ptr, bias_ptr, y_ptr, stride_ym, HAS_BIAS, SPLIT_K
    )


@triton.jit
def _awq_gemv_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, bias_ptr, ws_ptr, lock_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym, group_size,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """qweight [K, N/8]: word c of row k holds outputs 8c..8c+7 in the AWQ nibble order;
    the zeros share it. A [BK, BN/8, 8] tile: output 8c + t reads nibble AWQ_NIBBLE[t]."""
    row = tl.program_id(0)
    offs_c = tl.program_id(1) * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    mask_c = offs_c < N // 8
    t = tl.arange(0, 8)
    shifts = (((t % 2) * 4 + t // 2) * 4)[None, None, :]  # AWQ_NIBBLE[t] * 4
    offs_n = offs_c[:, None] * 8 + t[None, :]  # [BN/8, 8]: output n, in order
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_K, BLOCK_N // 8, 8), dtype=tl.float32)
    first, last = _tile_range(K, BLOCK_K, SPLIT_K)
    for tile in range(first, last):
        offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        packed = tl.load(
            qweight_ptr + offs_k[:, None] * (N // 8) + offs_c[None, :], mask=mask_k[:, None] & mask_c[None, :], other=0
        )  # [BK, BN/8]
        group = (tile * BLOCK_K) // group_size
        packed_zero = tl.load(qzeros_ptr + group * (N // 8) + offs_c, mask=mask_c, other=0)  # [BN/8]
        magic_zero = _MAGIC + ((packed_zero[None, :, None] >> shifts) & 0xF).to(tl.float32)  # [1, BN/8, 8]
        scale = tl.load(scales_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)  # [BN/8, 8]
        w = (((packed[:, :, None] >> shifts) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - magic_zero
        x = tl.load(x_ptr + row * stride_xm + offs_k, mask=mask_k, other=0.0).to(tl.float32)  # [BK]
        acc += (w * scale[None, :, :]) * x[:, None, None]
    partial = tl.reshape(tl.sum(acc, axis=0), (BLOCK_N,))
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    _reduce_split_k(partial, offs, M, N, ws_ptr, lock_ptr, bias_ptr, y_ptr, stride_ym, HAS_BIAS, SPLIT_K)


def fit_block_k(block_k: int, group_size: int) -> int:
    """The largest block_k (>= 16) that divides the group size, so a tile sits in one group."""
    while block_k > 16 and group_size % block_k:
        block_k //= 2
    return block_k


def pick_gemv_config(
    m: int, n: int, k: int, group_size: int, num_sms: int, layout: str = "gptq",
    block_n: int | None = None, block_k: int | None = None, programs_per_sm: int | None = None,
) -> Int4GemvConfig:  # fmt: skip
    """Split K until about `programs_per_sm` programs per SM; group_size: the real one (K
    for one group). The defaults are the best of benchmarks/bench_int4_gemm.py --sweep on
    the H200 at M = 1 (docs/benchmarks.md)."""
    default = (256, 64, 4) if layout == "awq" else (128, 64, 8) if n >= 8192 else (64, 128, 8)
    block_n = block_n or default[0]
    block_k = fit_block_k(block_k or default[1], group_size)
    programs_per_sm = programs_per_sm or default[2]
    num_programs = m * triton.cdiv(n, block_n)
    split_k = max(1, min(triton.cdiv(k, block_k), (programs_per_sm * num_sms) // num_programs))
    return Int4GemvConfig(block_n, block_k, split_k)


def gemv_int4(
    x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None, config: Int4GemvConfig
) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_ROWS) @ a gptq or awq INT4 weight [K, N] of consecutive groups
    (+ bias) -> [M, N] in x's dtype; its inputs per group a multiple of config.block_k."""
    assert weight.layout in ("gptq", "awq") and weight.g_idx is None, (weight.layout, "act-order")
    x = x.contiguous()
    m, k = x.shape
    n = weight.scales.shape[1]
    group_size = weight.group(k)
    assert m <= GEMV_MAX_ROWS and n % 8 == 0 and config.block_n % 8 == 0, (m, n, config)
    assert group_size % config.block_k == 0 or group_size >= k, (group_size, config.block_k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (m, triton.cdiv(n, config.block_n), config.split_k)
    workspace = torch.empty(config.split_k, m, n, dtype=torch.float32, device=x.device)
    args = (
        x, weight.qweight, weight.qzeros, weight.scales, bias if bias is not None else weight.scales, workspace,
        semaphores("int4_gemv", x.device, m * grid[1]), y, m, n, k, x.stride(0), y.stride(0), group_size,
    )  # fmt: skip
    meta = dict(
        HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.split_k,
        num_warps=config.num_warps,
    )  # fmt: skip
    if weight.layout == "gptq":
        _gptq_gemv_kernel[grid](*args, ZERO_OFFSET=weight.zero_offset, **meta)
    else:
        assert weight.zero_offset == 0, "AWQ stores zeros as they are"
        _awq_gemv_kernel[grid](*args, **meta)
    return y
