"""A decode path for MoE layers that reads only the experts the batch routed to.

Two launches over static grids, so a CUDA graph captures them and nothing waits on the host:

1. gate/up: one program per (token, k) slot and block of I outputs reads its expert's rows
   of w13 ([E, 2I, D]), then writes silu(gate) * up to h [T*K, I];
2. down and combine: one program per token and block of D outputs runs each of the token's
   K slots through its expert's w2 ([E, D, I]) and sums them, weighted, in k order (no atomics:
   the same result every run).

A batch of T tokens reads at most T*K experts' weights, where the dense path
(SparseMoeBlock.forward_dense) reads all E: for Qwen3-MoE (E = 128, K = 8) at batch 1,
1/16 of them. Slots routed to another expert-parallel rank's experts read nothing and add 0.
The products are GEMV-shaped (no tensor cores), so this suits small batches only.
`moe_selected_experts` in kernels/moe/reference.py is the definition the tests hold it to.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gate_up_kernel(
    x_ptr, w13_ptr, ids_ptr, h_ptr,
    hidden, inter, expert_start, num_local,
    x_stride, w_stride_e, w_stride_n, h_stride,
    TOP_K: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    slot = tl.program_id(0)
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    token = slot // TOP_K
    expert = tl.load(ids_ptr + slot).to(tl.int64) - expert_start
    is_local = (expert >= 0) & (expert < num_local)
    expert = tl.where(is_local, expert, 0)
    rows = w13_ptr + expert * w_stride_e + offs_i[:, None].to(tl.int64) * w_stride_n
    acc_gate = tl.zeros([BLOCK_I], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_I], dtype=tl.float32)
    for d0 in range(0, hidden, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + token.to(tl.int64) * x_stride + offs_d, mask=offs_d < hidden, other=0.0).to(tl.float32)
        mask = (offs_i[:, None] < inter) & (offs_d[None, :] < hidden) & is_local
        gate = tl.load(rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(rows + inter * w_stride_n + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        acc_gate += tl.sum(gate * x[None, :], axis=1)
        acc_up += tl.sum(up * x[None, :], axis=1)
    h = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    tl.store(h_ptr + slot.to(tl.int64) * h_stride + offs_i, h.to(h_ptr.dtype.element_ty), mask=offs_i < inter)


@triton.jit
def _down_combine_kernel(
    h_ptr, w2_ptr, ids_ptr, weights_ptr, out_ptr,
    hidden, inter, expert_start, num_local,
    h_stride, w_stride_e, w_stride_n, out_stride,
    TOP_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_I: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        slot = token * TOP_K + k
        expert = tl.load(ids_ptr + slot).to(tl.int64) - expert_start
        is_local = (expert >= 0) & (expert < num_local)
        expert = tl.where(is_local, expert, 0)
        weight = tl.where(is_local, tl.load(weights_ptr + slot), 0.0)
        rows = w2_ptr + expert * w_stride_e + offs_d[:, None].to(tl.int64) * w_stride_n
        acc_k = tl.zeros([BLOCK_D], dtype=tl.float32)
        for i0 in range(0, inter, BLOCK_I):
            offs_i = i0 + tl.arange(0, BLOCK_I)
            h = tl.load(h_ptr + slot.to(tl.int64) * h_stride + offs_i, mask=offs_i < inter, other=0.0)
            mask = (offs_d[:, None] < hidden) & (offs_i[None, :] < inter) & is_local
            w = tl.load(rows + offs_i[None, :], mask=mask, other=0.0).to(tl.float32)
            acc_k += tl.sum(w * h.to(tl.float32)[None, :], axis=1)
        acc += weight * acc_k
    tl.store(out_ptr + token.to(tl.int64) * out_stride + offs_d, acc.to(out_ptr.dtype.element_ty), mask=offs_d < hidden)


def moe_selected_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_start: int = 0,
    block_i: int = 32,
    block_d: int = 64,
    down_block_d: int = 32,
) -> torch.Tensor:
    """kernels/moe/reference.moe_selected_experts, reading only the routed experts' weights:
    x [T, D], w13 [E, 2I, D], w2 [E, D, I] (contiguous in their last dimension), weights
    [T, K] fp32, expert_ids [T, K] -> [T, D] in x's dtype. Reads only shapes and strides.
    down_block_d: the second launch's outputs per program, smaller than block_d so that a
    batch of one still spreads over D / down_block_d programs."""
    num_tokens, top_k = expert_ids.shape
    num_local, two_i, hidden = w13.shape
    inter = two_i // 2
    assert x.shape == (num_tokens, hidden) and w2.shape == (num_local, hidden, inter), (x.shape, w2.shape)
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    ids = expert_ids.contiguous()
    weights = weights.float().contiguous()
    h = torch.empty(num_tokens * top_k, inter, dtype=torch.float32, device=x.device)  # [T*K, I]
    out = torch.empty_like(x)
    _gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, block_i))](
        x, w13, ids, h, hidden, inter, expert_start, num_local,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        TOP_K=top_k, BLOCK_I=block_i, BLOCK_D=block_d,
    )  # fmt: skip
    _down_combine_kernel[(num_tokens, triton.cdiv(hidden, down_block_d))](
        h, w2, ids, weights, out, hidden, inter, expert_start, num_local,
        h.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=top_k, BLOCK_D=down_block_d, BLOCK_I=block_i,
    )  # fmt: skip
    return out
