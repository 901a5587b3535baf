"""Triton INT4 dequantize-GEMM for GPTQ and AWQ weights: y [M, N] = x [M, K] @ W [K, N].

Each program unpacks a [BLOCK_K, BLOCK_N] tile of 4-bit weights (the layouts of
kernels/int4/packing.py), subtracts the zeros and multiplies by the scales in fp32.
Groups of consecutive inputs (`g_idx` None) read one row of scales and zeros per tile;
act-order (`g_idx` given) gathers them per input row. Three paths by the number of rows:
- one row without act-order (batch-1 decode): kernels/int4/triton_gemv.py (one launch,
  float-trick unpack);
- otherwise up to GEMV_MAX_ROWS: CUDA-core dot products per row here, K split across
  programs (SPLIT_K) that add into an fp32 output: decode is memory-bound and has few
  output tiles;
- up to DEQUANT_MIN_ROWS: tl.dot on 16-row tiles, also split-K;
- above (prefill): dequantize the weight into a temporary and let cuBLAS multiply.
The wrapper reads only shapes and dtypes, never tensor values: no host sync, so it can be
captured in a CUDA graph."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from vllm_cluster.kernels.int4.triton_gemv import gemv_int4, pick_gemv_config
from vllm_cluster.kernels.int4.weight import Int4Weight

# Rows of x up to which the split-K GEMV of kernels/int4/triton_gemv.py runs (it repeats
# the unpack for each row: at 4 rows it was 2-3x slower than at 1 on the H200), then the
# GEMV variant here; above DEQUANT_MIN_ROWS the weight is dequantized to x's dtype and
# multiplied by cuBLAS.
SPLIT_K_GEMV_MAX_ROWS = 1
GEMV_MAX_ROWS = 4
DEQUANT_MIN_ROWS = 128


@dataclass(frozen=True, slots=True)
class Int4GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    wide_load: bool = True  # see _weight_tile
    gemv: bool = False  # see _int4_gemm_kernel
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _weight_tile(
    qweight_ptr, tile, pid_n, N, K,
    LAYOUT_AWQ: tl.constexpr, WIDE_LOAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The [BLOCK_K, BLOCK_N] tile of 4-bit values (0..15) at K-tile `tile`, N-tile `pid_n`.
    WIDE_LOAD reads each packed word once and unpacks it into 8 values by a reshape;
    otherwise every value loads its own word (8 loads of the same word, from cache)."""
    offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nibble = tl.arange(0, 8)
    if LAYOUT_AWQ:
        awq_shifts = ((nibble % 2) * 4 + nibble // 2) * 4  # output 8c + j sits in nibble AWQ_NIBBLE[j]
        if WIDE_LOAD:
            offs_c = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
            mask = (offs_k < K)[:, None] & (offs_c < N // 8)[None, :]
            packed = tl.load(qweight_ptr + offs_k[:, None] * (N // 8) + offs_c[None, :], mask=mask, other=0)
            q = (packed[:, :, None] >> awq_shifts[None, None, :]) & 0xF  # [BK, BN/8, 8]
            return tl.reshape(q, (BLOCK_K, BLOCK_N))
        sub = offs_n % 8
        mask = (offs_k < K)[:, None] & (offs_n < N)[None, :]
        packed = tl.load(qweight_ptr + offs_k[:, None] * (N // 8) + (offs_n // 8)[None, :], mask=mask, other=0)
        return (packed >> (((sub % 2) * 4 + sub // 2) * 4)[None, :]) & 0xF
    if WIDE_LOAD:
        offs_r = tile * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
        mask = (offs_r < K // 8)[:, None] & (offs_n < N)[None, :]
        packed = tl.load(qweight_ptr + offs_r[:, None] * N + offs_n[None, :], mask=mask, other=0)
        q = (packed[:, None, :] >> (nibble * 4)[None, :, None]) & 0xF  # [BK/8, 8, BN]
        return tl.reshape(q, (BLOCK_K, BLOCK_N))
    mask = (offs_k < K)[:, None] & (offs_n < N)[None, :]
    packed = tl.load(qweight_ptr + (offs_k // 8)[:, None] * N + offs_n[None, :], mask=mask, other=0)
    return (packed >> ((offs_k % 8) * 4)[:, None]) & 0xF


@triton.jit
def _dequant_tile(
    qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, tile, pid_n, N, K, group_size,
    LAYOUT_AWQ: tl.constexpr, ZERO_OFFSET: tl.constexpr, HAS_G_IDX: tl.constexpr, WIDE_LOAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The fp32 weight tile [BLOCK_K, BLOCK_N]: (q - zero) * scale."""
    offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_k = offs_k < K
    mask_n = offs_n < N
    sub = offs_n % 8
    # The bit offset of output n inside its packed zeros word (sequential for GPTQ).
    n_shift = ((sub % 2) * 4 + sub // 2) * 4 if LAYOUT_AWQ else sub * 4
    q = _weight_tile(qweight_ptr, tile, pid_n, N, K, LAYOUT_AWQ, WIDE_LOAD, BLOCK_N, BLOCK_K)
    if HAS_G_IDX:
        mask = mask_k[:, None] & mask_n[None, :]
        groups = tl.load(g_idx_ptr + offs_k, mask=mask_k, other=0)
        scale = tl.load(scales_ptr + groups[:, None] * N + offs_n[None, :], mask=mask, other=0.0)
        packed_zero = tl.load(qzeros_ptr + groups[:, None] * (N // 8) + (offs_n // 8)[None, :], mask=mask, other=0)
        zero = ((packed_zero >> n_shift[None, :]) & 0xF) + ZERO_OFFSET  # [BK, BN]
    else:
        group = (tile * BLOCK_K) // group_size  # the launcher keeps a tile inside one group
        scale = tl.load(scales_ptr + group * N + offs_n, mask=mask_n, other=0.0)[None, :]
        packed_zero = tl.load(qzeros_ptr + group * (N // 8) + offs_n // 8, mask=mask_n, other=0)
        zero = (((packed_zero >> n_shift) & 0xF) + ZERO_OFFSET)[None, :]  # [1, BN]
    return (q - zero).to(tl.float32) * scale.to(tl.float32)


@triton.jit
def _int4_gemm_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, out_ptr,
    M, N, K, stride_xm, stride_om, group_size,
    LAYOUT_AWQ: tl.constexpr, ZERO_OFFSET: tl.constexpr, HAS_G_IDX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    WIDE_LOAD: tl.constexpr, GEMV: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """GEMV: CUDA-core dot products per row of x (no tensor-core operand shuffle), for a
    few rows; otherwise tl.dot on [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tiles."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(num_k_tiles, SPLIT_K)
    k_first = pid_k * tiles_per_split
    k_last = tl.minimum(k_first + tiles_per_split, num_k_tiles)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(k_first, k_last):
        offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        w = _dequant_tile(
            qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, tile, pid_n, N, K, group_size,
            LAYOUT_AWQ, ZERO_OFFSET, HAS_G_IDX, WIDE_LOAD, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        if GEMV:
            for r in tl.static_range(BLOCK_M):
                row = pid_m * BLOCK_M + r
                xr = tl.load(x_ptr + row * stride_xm + offs_k, mask=(offs_k < K) & (row < M), other=0.0)
                part = tl.sum(xr.to(tl.float32)[:, None] * w, axis=0)  # [BN]
                acc = tl.where((tl.arange(0, BLOCK_M) == r)[:, None], acc + part[None, :], acc)
        else:
            x_mask = mask_m[:, None] & (offs_k < K)[None, :]
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask, other=0.0)
            acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)

    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    out_mask = mask_m[:, None] & (offs_n < N)[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.atomic_add(out, acc, mask=out_mask, sem="relaxed")


@triton.jit
def _dequant_kernel(
    qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, out_ptr, N, K, group_size,
    LAYOUT_AWQ: tl.constexpr, ZERO_OFFSET: tl.constexpr, HAS_G_IDX: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The whole weight [K, N] in out's dtype, for prefill's cuBLAS matmul."""
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    w = _dequant_tile(
        qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, tile, pid_n, N, K, group_size,
        LAYOUT_AWQ, ZERO_OFFSET, HAS_G_IDX, True, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_k < K)[:, None] & (offs_n < N)[None, :]
    tl.store(out_ptr + offs_k[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def pick_config(m: int, n: int, k: int, num_sms: int = 132) -> Int4GemmConfig:
    """Decode: the GEMV variant up to GEMV_MAX_ROWS rows, then tl.dot on 16-row tiles, both
    splitting K until there are several programs per SM. Prefill: tensor-core tiles."""
    if m <= GEMV_MAX_ROWS:
        # The best of a sweep on the H200 (docs/benchmarks.md): 4096x14336 BN 128, BK 128,
        # split 8; 14336x4096 BN 64, BK 256, split 8.
        block_n = 128 if n >= 8192 else 64
        block_k = 256 if k >= 8192 else 128
        num_programs = triton.cdiv(n, block_n)
        split_k = max(1, min(8, triton.cdiv(k, block_k) // 2, (8 * num_sms) // num_programs))
        return Int4GemmConfig(triton.next_power_of_2(m), block_n, block_k, split_k, gemv=True)
    if m <= 16:
        block_n, block_k = 64, 128
        num_programs = triton.cdiv(n, block_n)
        max_split = max(1, triton.cdiv(k, block_k) // 2)
        split_k = max(1, min(max_split, (4 * num_sms) // num_programs))
        return Int4GemmConfig(16, block_n, block_k, split_k, num_warps=4, num_stages=4)
    block_m = 64 if m <= 64 else 128
    return Int4GemmConfig(block_m, 128, 64, 1, num_warps=8 if block_m == 128 else 4, num_stages=3)


def _fit_block_k(block_k: int, group_size: int) -> int:
    """The largest block_k (>= 16) that divides the group size, so a tile sits in one group."""
    while block_k > 16 and group_size % block_k:
        block_k //= 2
    return block_k


def int4_gemm(x: torch.Tensor, weight: Int4Weight, config: Int4GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] (fp16/bf16/fp32) @ a gptq or awq INT4 weight [K, N] -> [M, N] in x's dtype
    (semantics of kernels/int4/reference.py's int4_gemm)."""
    assert weight.layout in ("gptq", "awq"), weight.layout
    x = x.contiguous()
    m, k = x.shape
    n = weight.scales.shape[1]
    assert n % 8 == 0, f"out_features {n} is not a multiple of 8"
    group = weight.group(k)
    g_idx = weight.g_idx
    if g_idx is None and group % 16:
        g_idx = torch.arange(k, device=x.device, dtype=torch.int32) // group
    weight = replace(weight, g_idx=g_idx, group_size=group)
    if config is None and m > DEQUANT_MIN_ROWS:
        return x @ dequantize(weight, x.dtype)
    if config is None and m <= SPLIT_K_GEMV_MAX_ROWS and g_idx is None:
        gemv = pick_gemv_config(m, n, k, group, num_sms(x.device), weight.layout)
        return gemv_int4(x, weight, None, gemv)
    cfg = config or pick_config(m, n, k, num_sms(x.device))
    block_k = cfg.block_k if g_idx is not None else _fit_block_k(cfg.block_k, group)
    if cfg.split_k == 1:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    else:
        out = torch.zeros(m, n, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), cfg.split_k)
    _int4_gemm_kernel[grid](
        x, weight.qweight, weight.qzeros, weight.scales, g_idx if g_idx is not None else weight.qzeros, out,
        m, n, k, x.stride(0), out.stride(0), group,
        LAYOUT_AWQ=weight.layout == "awq", ZERO_OFFSET=weight.zero_offset, HAS_G_IDX=g_idx is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, SPLIT_K=cfg.split_k,
        WIDE_LOAD=cfg.wide_load, GEMV=cfg.gemv, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out if cfg.split_k == 1 else out.to(x.dtype)


def dequantize(weight: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight [K, N] of a gptq or awq layout in `dtype` (a temporary: prefill is
    compute-bound, and cuBLAS multiplies faster than the fused kernel's tiles)."""
    qweight, g_idx = weight.qweight, weight.g_idx
    n = weight.scales.shape[1]
    k = qweight.shape[0] * 8 if weight.layout == "gptq" else qweight.shape[0]
    group = weight.group(k)
    block_k = 64 if g_idx is not None else _fit_block_k(64, group)
    out = torch.empty(k, n, device=weight.scales.device, dtype=dtype)
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, 64))
    _dequant_kernel[grid](
        qweight, weight.qzeros, weight.scales, g_idx if g_idx is not None else weight.qzeros, out, n, k, group,
        LAYOUT_AWQ=weight.layout == "awq", ZERO_OFFSET=weight.zero_offset, HAS_G_IDX=g_idx is not None,
        BLOCK_N=64, BLOCK_K=block_k,
    )  # fmt: skip
    return out


_SM_COUNTS: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """The SMs of a CUDA device (4 elsewhere: the interpreter's tests)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]
