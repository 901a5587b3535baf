"""The residual add and RMS norm after a batch-1 GEMV, done as the GEMV stores its output
instead of in a launch of their own.

A decoder layer at batch 1 runs o_proj, then `fused_add_rms_norm`, then gate_up; down, then
the next layer's norm, then its qkv. The norm is one program over 4096 values, and it costs
what a kernel boundary costs: it waits for every GEMV program to finish, and the next GEMV
waits for it. Here the GEMV (o_proj, down_proj) does its work: each program adds the
residual to its outputs as it stores them (h = y + residual, rounded as the norm kernel
rounds) and counts itself in on a semaphore; the last to arrive reads the whole of h back
and stores weight * rms_norm(h), the norm kernel's output, then sets the semaphore back to
0 (kernels/semaphores.py). The GEMV's grid ends where the norm's would have begun.

`kernels.AddNorm` is what a GEMV wrapper takes to do so; the GEMVs that can are the bf16 one
(kernels/triton_linear.py), the 1-byte one (kernels/triton_gemv.py) and the INT4 MMA one
(kernels/triton_int4_mma_gemv.py), at one row of x. Off (`kernels.ADD_NORM_EPILOGUE`), the
norm has its launch again. Definition: `fused_add_rms_norm(
linear(x, w), residual, weight, eps)`; the sum of squares may be added in another order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import AddNorm
from kernels.semaphores import semaphores


def launch_args(
    add_norm: AddNorm | None, x: torch.Tensor, y: torch.Tensor, num_programs: int
) -> tuple[dict[str, object], tuple[torch.Tensor, torch.Tensor] | None]:
    """The epilogue's kernel arguments, by name (when `add_norm` is None, placeholders that
    are never read), and the (normed, h) outputs they fill. x: the GEMV's [1, K]; y: its
    [1, N] output; `num_programs`: the programs that store outputs, one arrival each."""
    if add_norm is None:
        unread = dict(residual_ptr=y, h_ptr=y, norm_weight_ptr=y, normed_ptr=y, norm_lock_ptr=y)
        return {**unread, "eps": 0.0, "num_programs": 1, "ADD_NORM": False, "BLOCK_D": 1}, None
    n = y.shape[1]
    assert x.shape[0] == 1, f"the add + norm epilogue takes one row of x, got {x.shape[0]}"
    assert add_norm.residual.shape == (1, n) and add_norm.residual.is_contiguous(), (
        add_norm.residual.shape,
        n,
    )
    assert add_norm.weight.shape == (n,) and add_norm.weight.is_contiguous(), (
        add_norm.weight.shape,
        n,
    )
    assert add_norm.residual.dtype == add_norm.weight.dtype == x.dtype, (
        add_norm.residual.dtype,
        add_norm.weight.dtype,
    )
    normed, h = torch.empty_like(y), torch.empty_like(y)
    args = dict(
        residual_ptr=add_norm.residual, h_ptr=h, norm_weight_ptr=add_norm.weight, normed_ptr=normed,
        norm_lock_ptr=semaphores("add_norm", y.device, 1), eps=add_norm.eps, num_programs=num_programs,
        ADD_NORM=True, BLOCK_D=triton.next_power_of_2(n),
    )  # fmt: skip
    return args, (normed, h)


@triton.jit
def store_add_norm(
    y, offs_n, mask, residual_ptr, h_ptr, weight_ptr, normed_ptr, lock_ptr, eps, num_programs, N,
    BLOCK_D: tl.constexpr, ready=True,
):  # fmt: skip
    """y: this program's outputs offs_n (fp32, before rounding; mask: which to store). Stores
    h = y + residual (y rounded to h's dtype first, as the GEMV's output would be) and, in
    the last of `num_programs` programs to arrive, weight * rms_norm(h) over all N. ready: a
    scalar; False stores nothing and does not arrive (a split-K program that is not the last)."""
    dtype: tl.constexpr = h_ptr.dtype.element_ty
    ready = tl.full((), 1, tl.int1) & ready
    residual = tl.load(residual_ptr + offs_n, mask=mask & ready, other=0.0)
    h = (y.to(dtype).to(tl.float32) + residual.to(tl.float32)).to(dtype)
    tl.store(h_ptr + offs_n, h, mask=mask & ready)
    tl.debug_barrier()  # every thread's h is written before the semaphore counts the program in
    arrived = tl.atomic_add(lock_ptr, 1, mask=ready, sem="acq_rel")
    if ready & (arrived == num_programs - 1):
        cols = tl.arange(0, BLOCK_D)
        in_row = cols < N
        hf = tl.load(h_ptr + cols, mask=in_row, other=0.0, cache_modifier=".cg").to(tl.float32)
        mean_square = tl.sum(hf * hf, axis=0) / N
        normed = (hf * tl.rsqrt(mean_square + eps)).to(dtype)  # rounded, as in the reference
        weight = tl.load(weight_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
        tl.store(normed_ptr + cols, (weight * normed.to(tl.float32)).to(dtype), mask=in_row)
        tl.atomic_xchg(lock_ptr, 0, sem="relaxed")
