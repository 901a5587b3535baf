"""Triton kernels for batched LoRA (semantics: `lora_*_reference` in kernels/lora.py).

One program per (token, block of output columns): it reads its token's slot and gathers
that adapter's A or B tile, so a batch may mix any number of adapters and the base model
(slot -1: loads masked off, the output untouched). Only shapes and strides are read on the
host: no sync, so the launches can be captured in a CUDA graph. Offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, s_ptr, slot_ptr,
    N, K,
    x_stride_t, a_stride_l, a_stride_n, s_stride_t,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    valid = slot >= 0
    a_base = a_ptr + tl.maximum(slot, 0) * a_stride_l
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = (offs_k < K) & valid
        xk = tl.load(x_ptr + t * x_stride_t + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        a = tl.load(
            a_base + offs_n[:, None] * a_stride_n + offs_k[None, :],
            mask=(offs_n[:, None] < N) & mask_k[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(a * xk[None, :], axis=1)
    tl.store(s_ptr + t * s_stride_t + offs_n, acc, mask=offs_n < N)


@triton.jit
def _expand_kernel(
    y_ptr, s_ptr, b_ptr, slot_ptr,
    M, R,
    y_stride_t, s_stride_t, s_stride_r, b_stride_l, b_stride_m,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    valid = slot >= 0
    mask_m = (offs_m < M) & valid
    mask_r = (offs_r < R) & valid
    s = tl.load(s_ptr + t * s_stride_t + offs_r * s_stride_r, mask=mask_r, other=0.0).to(tl.float32)
    b = tl.load(
        b_ptr + tl.maximum(slot, 0) * b_stride_l + offs_m[:, None] * b_stride_m + offs_r[None, :],
        mask=mask_m[:, None] & mask_r[None, :],
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(b * s[None, :], axis=1)
    y_ptrs = y_ptr + t * y_stride_t + offs_m
    y = tl.load(y_ptrs, mask=mask_m, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask_m)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    # x: [T, K], a: [L, N, K], slots: [T] -> [T, N] fp32
    num_tokens, k = x.shape
    n = a.shape[1]
    assert x.stride(1) == 1 and a.stride(2) == 1, "x and a need contiguous rows"
    s = torch.empty(num_tokens, n, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return s
    block_n = min(triton.next_power_of_2(n), 64)
    grid = (num_tokens, triton.cdiv(n, block_n))
    _shrink_kernel[grid](
        x, a, s, slots, n, k, x.stride(0), a.stride(0), a.stride(1), s.stride(0),
        BLOCK_N=block_n, BLOCK_K=64,
    )
    return s


def lora_expand_add(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> None:
    # y: [T, M] in place (column slice ok), s: [T, R], b: [L, M, R], slots: [T]
    num_tokens, m = y.shape
    r = b.shape[2]
    assert y.stride(1) == 1 and b.stride(2) == 1, "y and b need contiguous rows"
    if num_tokens == 0:
        return
    block_r = triton.next_power_of_2(r)
    block_m = max(16, min(128, 4096 // block_r))
    grid = (num_tokens, triton.cdiv(m, block_m))
    _expand_kernel[grid](
        y, s, b, slots, m, r, y.stride(0), s.stride(0), s.stride(1), b.stride(0), b.stride(1),
        BLOCK_M=block_m, BLOCK_R=block_r,
    )
