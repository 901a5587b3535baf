"""One-row linear (GEMV) for batch-1 decode: y[1, N] = x[1, K] @ w[N, K]^T + bias.

cuBLAS picks tiles built for many rows; with one row every weight is read once and the
step is bound by memory, so the kernel only has to stream the weight at full bandwidth.
Each program owns BLOCK_N output rows and walks K in BLOCK_K chunks, multiplying in fp32
and reducing once at the end. On the H200 (copy 4.25 TB/s) this reads llama-3.1-8b's
o_proj at 76% of the copy bandwidth against cuBLAS's 59%, qkv 84% against 74%, down 88-91%
against 86% (benchmarks/bench_gemv.py). The first weight tiles are loaded before the kernel
waits for the one before (programmatic dependent launch, kernels/sync/pdl.py). The wrapper reads
only shapes and strides, so it can be captured in a CUDA graph.
Definition: `torch.nn.functional.linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from vllm_cluster.kernels.elementwise.triton_ops import silu_times
from vllm_cluster.kernels.linear.add_norm import AddNorm, Normed
from vllm_cluster.kernels.linear.triton_add_norm import (
    launch_args,
    load_residual,
    load_sum_of_squares,
    rms_scale,
    store_add_norm,
)
from vllm_cluster.kernels.sync import pdl

BLOCK_N = 2
MAX_BLOCK_K = 1024
TWO_FIRST = True


@triton.jit
def _load_k(ptr, kk, K, EVEN_K: tl.constexpr):
    """ptr: [BLOCK_N, 1] row pointers or one pointer; kk: [BLOCK_K] offsets along K (0 past K)."""
    if EVEN_K:
        return tl.load(ptr + kk)
    return tl.load(ptr + kk, mask=kk < K, other=0.0)


@triton.jit
def weight_rows(pid, N, BLOCK_N: tl.constexpr, SILU_MUL: tl.constexpr):
    """The weight rows program pid reads: outputs pid * BLOCK_N + [0, BLOCK_N), or with SILU_MUL
    (w = [gate | up], [2N, K]) gate rows n then up rows N + n ([2 BLOCK_N]). -> (rows, valid);
    rows past N read row 0 (their results are not stored)."""
    if SILU_MUL:
        r = tl.arange(0, 2 * BLOCK_N)
        n = pid * BLOCK_N + r % BLOCK_N
        rows = tl.where(n < N, n, 0) + (r // BLOCK_N) * N
    else:
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.where(n < N, n, 0)
    return rows, n < N


@triton.jit
def store_outputs(y, y_row_ptr, pid, N, BLOCK_N: tl.constexpr, SILU_MUL: tl.constexpr, ready=True):
    """Store a program's fp32 row results (as weight_rows ordered them) in y's dtype; with
    SILU_MUL, silu(gate) * up rounded as `silu_and_mul` of the stored halves would be.
    ready: a scalar; False stores nothing (a split-K program that is not the last)."""
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    element_ty: tl.constexpr = y_row_ptr.dtype.element_ty
    if SILU_MUL:
        gate, up = tl.split(tl.permute(tl.reshape(y, (2, BLOCK_N)), (1, 0)))
        out = silu_times(gate.to(element_ty), up.to(element_ty), element_ty)
    else:
        out = y.to(element_ty)
    tl.store(y_row_ptr + offs_n, out, mask=(offs_n < N) & ready)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    N,
    K,
    stride_wn,
    residual_ptr,
    h_ptr,
    norm_weight_ptr,
    hg_ptr,
    ss_out_ptr,
    ss_in_ptr,
    rms_eps,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    TWO_FIRST: tl.constexpr,
    SILU_MUL: tl.constexpr,
    LATE_TRIGGER: tl.constexpr = False,
    ADD_NORM: tl.constexpr = False,
    RMS: tl.constexpr = False,
):
    """The two halves of the norm between GEMVs (kernels/linear/triton_add_norm.py): ADD_NORM stores
    h = y + residual and h * weight and sums h^2, not y; RMS (x is h * weight) scales the sums
    by rsqrt(mean h^2 + eps)."""
    if PDL and not SILU_MUL:  # the norm or rotary after it may launch (kernels/sync/pdl.py)
        gdc_launch_dependents()
    rn, n_mask = weight_rows(tl.program_id(0), N, BLOCK_N, SILU_MUL)
    rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    rk = tl.arange(0, BLOCK_K)
    w = _load_k(rows, rk, K, EVEN_K)
    if TWO_FIRST:  # K >= 2 BLOCK_K, EVEN_K: the second tile goes out before the wait too
        w2 = _load_k(rows, BLOCK_K + rk, K, True)
    if PDL:
        gdc_wait()  # the first weight tiles are in flight; x is the kernel before's output (kernels/sync/pdl.py)
    residual = load_residual(residual_ptr, rn, n_mask, ADD_NORM)
    ss = load_sum_of_squares(ss_in_ptr, RMS)
    acc = w.to(tl.float32) * _load_k(x_ptr, rk, K, EVEN_K).to(tl.float32)[None, :]
    if TWO_FIRST:
        acc += w2.to(tl.float32) * _load_k(x_ptr, BLOCK_K + rk, K, True).to(tl.float32)[None, :]
    for k0 in range(BLOCK_K * (2 if TWO_FIRST else 1), K, BLOCK_K):
        w = _load_k(rows, k0 + rk, K, EVEN_K)
        acc += w.to(tl.float32) * _load_k(x_ptr, k0 + rk, K, EVEN_K).to(tl.float32)[None, :]
    if PDL and LATE_TRIGGER:  # pdl.SILU_MUL_LATE_TRIGGER
        gdc_launch_dependents()
    y = rms_scale(tl.sum(acc, axis=1), ss, K, rms_eps, RMS)  # [rows]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    if ADD_NORM:
        store_add_norm(y, residual, rn, n_mask, h_ptr, norm_weight_ptr, hg_ptr, ss_out_ptr)
    else:
        store_outputs(y, y_ptr, tl.program_id(0), N, BLOCK_N, SILU_MUL)


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool = False, rms: Normed | None = None
) -> torch.Tensor:
    """x [1, K] (contiguous), weight [N, K] (unit stride along K) -> [1, N] in x's dtype.
    silu_mul: the weight is [gate | up] and the result silu(gate) * up, [1, N / 2], as
    `silu_and_mul` of the plain result (the same roundings; the fp32 sums may be added in
    another order). rms: x is rms.hg, whose norm this GEMV finishes (kernels/linear/triton_add_norm.py)."""
    return _gemv(x, weight, bias, silu_mul, None, rms)[0]


def gemv_add_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, add_norm: AddNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gemv`, then the first half of the norm after it (kernels/linear/triton_add_norm.py): (hg, h)."""
    _, outputs = _gemv(x, weight, bias, False, add_norm, None)
    assert outputs is not None
    return outputs


def _gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool, add_norm: AddNorm | None,
    rms: Normed | None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:  # fmt: skip
    """gemv -> (y, None), or with add_norm (y unwritten, (hg, h))."""
    assert x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1, f"one contiguous row, got {tuple(x.shape)}"
    n, k = weight.shape
    assert x.shape[1] == k and weight.stride(1) == 1, f"x {tuple(x.shape)} against weight {tuple(weight.shape)}"
    if silu_mul:
        assert n % 2 == 0, f"{n} rows are not [gate | up]"
        n //= 2
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    block_k = min(MAX_BLOCK_K, triton.next_power_of_2(k))
    use_pdl = pdl.enabled(x)
    block_n = BLOCK_N // 2 if silu_mul else BLOCK_N  # gate and up rows: the same tile
    assert not (silu_mul and add_norm), "SiLU-and-mul has no add + norm epilogue"
    epilogue, outputs = launch_args(add_norm, rms, x, y)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        bias if bias is not None else weight,  # never read without HAS_BIAS
        y,
        n,
        k,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=k % block_k == 0,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PDL=use_pdl,
        TWO_FIRST=TWO_FIRST and k % block_k == 0 and k >= 2 * block_k,
        SILU_MUL=silu_mul,
        LATE_TRIGGER=silu_mul and pdl.SILU_MUL_LATE_TRIGGER,
        num_warps=4,
        launch_pdl=use_pdl,
        **epilogue,
    )
    return y, outputs
