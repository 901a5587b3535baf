"""Weight-only GEMM for 1-byte weights: y = (x @ dequant(w).T) + bias, dequantizing the
tiles in registers, so a step reads one byte per weight instead of two. The weights are
int8 (INT8 weight-only) or fp8 e4m3 (FP8 at decode sizes: w8a16, x is not quantized).

w: [N, K] with one fp32 scale per output row (symmetric, per channel); the scale factors
out of the K sum, so it is applied once to the fp32 accumulator. Both formats load as
their uint8 bits (the Triton interpreter mishandles masked fp8 loads); their values are
exact in fp16 / bf16 / fp32. For one row kernels/linear/triton_w8_gemv.py is faster (no 16-row tile).
Definition: `kernels/linear/dispatch.int8_linear_reference` / `fp8_weight_only_reference`. The
wrapper reads only shapes and dtypes (no host sync), so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_cluster.kernels.linear.triton_w8_gemv import w8_to_float


@triton.jit
def _int8_gemm_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_ym,
    stride_yn,
    HAS_BIAS: tl.constexpr,
    FP8: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        # x tile: [BLOCK_M, BLOCK_K]; w tile, read transposed: [BLOCK_K, BLOCK_N]
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
            mask=(rm[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )
        bits = tl.load(
            w_ptr + rn[None, :] * stride_wn + kk[:, None] * stride_wk,
            mask=(rn[None, :] < N) & (kk[:, None] < K),
            other=0,
        )
        # Measured per llama-8b step on the H200 with this loop at one row: int8 straight to
        # x's dtype 3.54 ms (through the GEMV's fp32 float trick 4.51); fp8 through fp32
        # 3.61 ms (straight to bf16 4.32).
        if FP8:
            w = w8_to_float(bits, True).to(x.dtype)
        else:
            w = bits.to(tl.int8, bitcast=True).to(x.dtype)
        acc += tl.dot(x, w, input_precision=INPUT_PRECISION)
    scale = tl.load(scale_ptr + rn, mask=rn < N, other=0.0)
    acc = acc * scale[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn,
        acc.to(y_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


def _config(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for m rows. Decode (m <= 16) is
    a bandwidth-bound GEMV: narrow N tiles give enough programs to keep every SM reading."""
    if m <= 16:
        return 16, 32, 256, 4, 4
    if m <= 64:
        return 64, 64, 128, 4, 4
    return 128, 128, 64, 8, 3


def int8_gemm(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x: [M, K] (fp16/bf16/fp32); qweight: [N, K] int8 or float8_e4m3fn; scale: N fp32
    values ([N] or [1, N]); bias: [N] | None -> [M, N] in x's dtype."""
    assert x.dim() == 2 and qweight.dim() == 2 and x.shape[1] == qweight.shape[1], (x.shape, qweight.shape)
    assert qweight.dtype in (torch.int8, torch.float8_e4m3fn), qweight.dtype
    assert scale.dtype == torch.float32 and scale.numel() == qweight.shape[0] and scale.is_contiguous()
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, num_warps, num_stages = _config(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int8_gemm_kernel[grid](
        x, qweight.view(torch.uint8), scale, bias if bias is not None else scale, y,
        m, n, k,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None,
        FP8=qweight.dtype == torch.float8_e4m3fn,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )
    return y
