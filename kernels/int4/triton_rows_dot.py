"""INT4 matmuls of 2 rows of x and more on the rows layout (kernels/int4/layouts.py), which
the loader keeps where the pairs layout does not fit (groups of 16) or int4_rows.DECODE_LAYOUT
asks for it; one row goes to kernels/int4/triton_rows.py's GEMV.

- 2..DEQUANT_MIN_ROWS rows: `int4_gemm_rows` multiplies, per nibble j of a block, the
  dequantized [BLOCK_N, 16] weight (rounded to x's dtype, as kernels/int4/triton_gemm.py's
  tiles do) by x^T [16, BLOCK_M] with tl.dot (wgmma: the weight is the tall operand);
- above: `dequantize_rows` writes the whole weight in x's dtype for cuBLAS (prefill).
The wrappers read only shapes, never values: graph-capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_cluster.kernels.int4.layouts import ROW_BLOCK
from vllm_cluster.kernels.int4.triton_rows import gemv_rows, pick_rows_config
from vllm_cluster.kernels.int4.weight import Int4Weight

# Rows of x above which the weight is dequantized for cuBLAS instead of tl.dot tiles.
DEQUANT_MIN_ROWS = 128


@triton.jit
def _rows_weight_tile(
    qweight_ptr, qzeros_ptr, scales_ptr, block, offs_n, N, stride_qn, group_size,
    ZERO_OFFSET: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The fp32 weight tile [BN, 128] of input block `block`, read as the rows lie in memory
    (16 contiguous words per output); column c = 8 w + j holds input 128 block + 16 j + w."""
    rows_n = tl.where(offs_n < N, offs_n, 0)
    offs_w = tl.arange(0, 16)
    j = tl.arange(0, 8)
    packed = tl.load(qweight_ptr + rows_n[:, None] * stride_qn + block * 16 + offs_w[None, :])  # [BN, 16]
    q = (packed[:, :, None] >> (4 * j)[None, None, :]) & 0xF  # [BN, 16, 8]
    group = (block * 128 + 16 * j) // group_size  # [8]
    scale = tl.load(scales_ptr + group[None, :] * N + rows_n[:, None]).to(tl.float32)  # [BN, 8]
    packed_zero = tl.load(qzeros_ptr + group[None, :] * (N // 8) + rows_n[:, None] // 8)
    zero = ((packed_zero >> ((rows_n % 8) * 4)[:, None]) & 0xF) + ZERO_OFFSET  # [BN, 8]
    w = (q - zero[:, None, :]).to(tl.float32) * scale[:, None, :]
    return tl.reshape(w, (BLOCK_N, 128))


@triton.jit
def _tile_inputs():
    """The input (within its block) of each column of a _rows_weight_tile: 16 (c % 8) + c // 8."""
    c = tl.arange(0, 128)
    return (c % 8) * 16 + c // 8


@triton.jit
def _rows_dot_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, out_ptr, M, N, K, stride_qn, stride_xm, stride_om, group_size,
    ZERO_OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    GROUP_J: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """out^T [BN, BM] += W [BN, 16] @ x^T [16, BM] for each nibble j of a block: the weight
    is the tall operand (the tensor cores' M side), the few rows of x the narrow one, and
    nibble j of the block's 16 words is 16 consecutive inputs (no reshape of the tile)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    rows_n = tl.where(offs_n < N, offs_n, 0)
    offs_w = tl.arange(0, 16)
    zero_shift = (rows_n % 8) * 4
    num_blocks = K // 128
    per_split = tl.cdiv(num_blocks, SPLIT_K)
    first = tl.program_id(2) * per_split
    last = tl.minimum(first + per_split, num_blocks)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for block in tl.range(first, last, num_stages=3):
        packed = tl.load(qweight_ptr + rows_n[:, None] * stride_qn + block * 16 + offs_w[None, :])  # [BN, 16]
        first_group = (block * 128) // group_size
        for j in tl.static_range(8):
            if j % GROUP_J == 0:  # GROUP_J nibble runs of 16 inputs per group
                group = first_group + j // GROUP_J
                scale = tl.load(scales_ptr + group * N + rows_n).to(tl.float32)  # [BN]
                zero = ((tl.load(qzeros_ptr + group * (N // 8) + rows_n // 8) >> zero_shift) & 0xF) + ZERO_OFFSET
            q = (packed >> (4 * j)) & 0xF
            w = (q - zero[:, None]).to(tl.float32) * scale[:, None]  # [BN, 16]
            x_t = tl.load(
                x_ptr + offs_m[None, :] * stride_xm + block * 128 + 16 * j + offs_w[:, None],
                mask=mask_m[None, :],
                other=0.0,
            )  # [16, BM]
            acc += tl.dot(w.to(x_t.dtype), x_t, input_precision=DOT_PRECISION)
    out = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    mask = mask_m[None, :] & (offs_n < N)[:, None]
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")


@triton.jit
def _rows_dequant_kernel(
    qweight_ptr, qzeros_ptr, scales_ptr, out_ptr, N, stride_qn, group_size,
    ZERO_OFFSET: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """out [K, N] = the weight, in out's dtype."""
    block = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w = _rows_weight_tile(
        qweight_ptr, qzeros_ptr, scales_ptr, block, offs_n, N, stride_qn, group_size, ZERO_OFFSET, BLOCK_N
    )  # fmt: skip
    rows = block * 128 + _tile_inputs()
    out = out_ptr + rows[None, :] * N + offs_n[:, None]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=(offs_n < N)[:, None])


def dequantize_rows(weight: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight [K, N] of a rows layout in `dtype` (a temporary for prefill's cuBLAS matmul)."""
    assert weight.layout == "rows", weight.layout
    qweight = weight.qweight
    n, num_words = qweight.shape
    k = num_words * 8
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    grid = (k // ROW_BLOCK, triton.cdiv(n, 64))
    _rows_dequant_kernel[grid](
        qweight, weight.qzeros, weight.scales, out, n, qweight.stride(0), weight.group(k),
        ZERO_OFFSET=weight.zero_offset, BLOCK_N=64,
    )  # fmt: skip
    return out


def int4_gemm_rows(x: torch.Tensor, weight: Int4Weight, num_sms: int = 132) -> torch.Tensor:
    """x [M, K] @ a rows-layout INT4 weight -> [M, N] in x's dtype (semantics of
    kernels/int4/reference.py's int4_gemm)."""
    assert weight.layout == "rows" and weight.g_idx is None, (weight.layout, "act-order")
    qweight, qzeros, scales, zero_offset = weight.qweight, weight.qzeros, weight.scales, weight.zero_offset
    x = x.contiguous()
    m, k = x.shape
    n, num_words = qweight.shape
    assert num_words * 8 == k and k % ROW_BLOCK == 0, (x.shape, qweight.shape)
    group = weight.group(k)
    if m == 1:
        return gemv_rows(x, weight, None, pick_rows_config(n, k, num_sms))
    if m > DEQUANT_MIN_ROWS:
        return x @ dequantize_rows(weight, x.dtype)
    block_m = 16 if m <= 16 else 64
    block_n = 64
    num_programs = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split_k = max(1, min(k // ROW_BLOCK // 2, (4 * num_sms) // num_programs))
    if split_k > 1:
        out = torch.zeros(m, n, device=x.device, dtype=torch.float32)
    else:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _rows_dot_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m), split_k)](
        x, qweight, qzeros, scales, out, m, n, k, qweight.stride(0), x.stride(0), out.stride(0), group,
        ZERO_OFFSET=zero_offset, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_K=split_k, GROUP_J=min(8, group // 16),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4, num_stages=3,
    )  # fmt: skip
    return out.to(x.dtype)
