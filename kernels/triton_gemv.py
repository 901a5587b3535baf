"""Weight-only GEMV for decode: y [M, N] = (x [M, K] @ w [N, K].T) * scale[N] + bias, for a
few rows of x (M <= GEMV_MAX_ROWS) and 1-byte weights: int8 (INT8 weight-only) or fp8 e4m3
(FP8 at decode: w8a16, the activations stay in x's dtype, not quantized).

At batch 1 a linear does two flops per weight byte, so it is bound by how fast the weight
streams in. Each program reads BLOCK_N whole rows of w (K contiguous: 16-byte loads) for
one row of x and keeps a [BLOCK_N, BLOCK_K] fp32 accumulator that is summed over K once at
the end, so the loop has no cross-thread reductions. No split-K: the N of a llama linear
(4096..28672) gives hundreds of programs at BLOCK_N 8, and one launch writes y in x's dtype
(no zeroed fp32 buffer, no cast afterwards). Rows of x are programs of their own: the
second row's weight tiles come from L2, not memory.

Both formats arrive as their uint8 bits: masked loads of fp8 with `other` misbehave in the
Triton interpreter, and int8 converts through the float trick below, not I2F, which Hopper
issues at 1/8 of the fp32 rate. No host sync: graph-capturable.
Definition: `kernels/quant_ops.int8_linear_reference` / `fp8_weight_only_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GEMV_MAX_ROWS = 4


@triton.jit
def w8_to_float(bits, FP8: tl.constexpr):
    """uint8 bits of int8 or fp8 e4m3 weights -> their fp32 values."""
    if FP8:
        return bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    # int8 q has bits b; (b ^ 0x80) = q + 128 in 0..255, and 0x4B000000 | (q + 128) is the
    # fp32 2^23 + q + 128: exact, two integer ops and one add.
    magic = (bits.to(tl.int32) ^ 0x80) | 0x4B000000
    return magic.to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _gemv_w8_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_ym,
    FP8: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w_mask = mask_n[:, None] & mask_k[None, :]
        bits = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=w_mask, other=0)  # [BN, BK]
        x = tl.load(x_ptr + row * stride_xm + offs_k, mask=mask_k, other=0.0)  # [BK]
        acc += x.to(tl.float32)[None, :] * w8_to_float(bits, FP8)
    y = tl.sum(acc, axis=1) * tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)


def pick_blocks(n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): the best of benchmarks/bench_int4_gemm.py --sweep on the H200
    (8 x 512 for K 4096, 8 x 1024 for K 14336); BLOCK_N 8 gives 512 programs for N = 4096,
    and small N gets narrower blocks."""
    return (8 if n >= 1024 else 4), (1024 if k >= 8192 else 512)


def gemv_w8(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """x: [M, K] (fp16/bf16/fp32, M <= GEMV_MAX_ROWS); qweight: [N, K] int8 or
    float8_e4m3fn; scale: N fp32 values ([N] or [1, N]); bias: [N] | None -> [M, N] in x's dtype."""
    assert x.dim() == 2 and qweight.dim() == 2 and x.shape[1] == qweight.shape[1], (x.shape, qweight.shape)
    assert qweight.dtype in (torch.int8, torch.float8_e4m3fn), qweight.dtype
    assert scale.dtype == torch.float32 and scale.numel() == qweight.shape[0] and scale.is_contiguous()
    assert qweight.stride(1) == 1 and qweight.numel() < 2**31, "qweight must be [N, K] with contiguous rows"
    x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[0]
    assert m <= GEMV_MAX_ROWS, f"{m} rows: the GEMV is for decode (at most {GEMV_MAX_ROWS})"
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    default_n, default_k = pick_blocks(n, k)
    block_n, block_k = block_n or default_n, block_k or default_k
    grid = (m, triton.cdiv(n, block_n))
    _gemv_w8_kernel[grid](
        x, qweight.view(torch.uint8), scale, bias if bias is not None else scale, y,
        n, k, x.stride(0), qweight.stride(0), y.stride(0),
        FP8=qweight.dtype == torch.float8_e4m3fn, HAS_BIAS=bias is not None,
        BLOCK_N=block_n, BLOCK_K=min(block_k, triton.next_power_of_2(k)), num_warps=num_warps,
    )  # fmt: skip
    return y
