"""The residual add and RMS norm between two batch-1 GEMVs, done by the two GEMVs instead of
in a launch of their own.

A decoder layer at batch 1 runs o_proj, then `fused_add_rms_norm`, then gate_up; down, then
the next layer's norm, then its qkv. The norm is one program over 4096 values, and what it
costs is a kernel boundary more: it waits for every program of the GEMV before, and the
GEMV after waits for it. Here its work is split between the two GEMVs:

- the GEMV before (o_proj, down_proj; `AddNorm`, kernels/linear/add_norm.py) adds the residual to its outputs as
  it stores them, h = y + residual (rounded as the norm kernel rounds), and stores h (the
  new residual), hg = h * weight (the norm's weight, which is per output: each program has
  its rows'), and adds its rows' sum of h^2 into one fp64 slot with an atomic that nothing
  waits for;
- the GEMV after (qkv, gate_up; `Normed`) reads hg as its x and multiplies its sums
  by rsqrt(slot / K + eps) before the bias and SiLU: sum_k w_k (h_k weight_k) rstd is
  sum_k w_k (weight * rms_norm(h))_k.

The slot holds the whole sum once the GEMV before has ended, which is what the GEMV after
waits for (kernels/sync/pdl.py) before it reads anything. Slots are zeroed at the start of each
forward (engine/models/llama.py), one per norm. Rounding: the reference rounds h * rstd to
the activations' dtype, then the product with the weight; here h * weight is rounded once
and rstd applied in fp32: the same error, in another place. The fp64 sum is added in the
order the programs arrive; its fp32 value is the same in any order unless the sum falls
within about 2^-42 (relative: a few thousand fp64 roundings) of an fp32 rounding boundary.

The GEMVs that do either part are the bf16 one (kernels/linear/triton_gemv.py), the 1-byte one
(kernels/linear/triton_w8_gemv.py) and the INT4 MMA one (kernels/int4/triton_mma_gemv.py), at one row
of x. `ADD_NORM_EPILOGUE` (kernels/linear/add_norm.py) off: the norm has its own launch again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_cluster.kernels.linear.add_norm import AddNorm, Normed


def launch_args(
    add_norm: AddNorm | None, rms: Normed | None, x: torch.Tensor, y: torch.Tensor
) -> tuple[dict[str, object], tuple[torch.Tensor, torch.Tensor] | None]:
    """The kernel arguments of both parts, by name (placeholders, never read, for a part not
    asked for), and with add_norm the (hg, h) outputs they fill. x: the GEMV's [1, K] (with
    rms: rms.hg); y: its [1, N] output."""
    args: dict[str, object] = dict(
        residual_ptr=y, h_ptr=y, norm_weight_ptr=y, hg_ptr=y, ss_out_ptr=y, ss_in_ptr=y, rms_eps=0.0,
        ADD_NORM=False, RMS=False,
    )  # fmt: skip
    outputs = None
    if add_norm is not None:
        n = y.shape[1]
        assert x.shape[0] == 1, f"the add + norm epilogue takes one row of x, got {x.shape[0]}"
        assert add_norm.residual.shape == (1, n) and add_norm.residual.is_contiguous(), (add_norm.residual.shape, n)
        assert add_norm.weight.shape == (n,) and add_norm.weight.is_contiguous(), (add_norm.weight.shape, n)
        assert add_norm.residual.dtype == add_norm.weight.dtype == x.dtype, (add_norm.residual.dtype, x.dtype)
        assert add_norm.slot is not None and add_norm.slot.dtype == torch.float64, "no fp64 slot for the sum of h^2"
        hg, h = torch.empty_like(y), torch.empty_like(y)
        args |= dict(
            residual_ptr=add_norm.residual, h_ptr=h, norm_weight_ptr=add_norm.weight, hg_ptr=hg,
            ss_out_ptr=add_norm.slot, ADD_NORM=True,
        )  # fmt: skip
        outputs = (hg, h)
    if rms is not None:
        assert rms.hg is x and rms.slot.dtype == torch.float64, "x must be the Normed's hg"
        args |= dict(ss_in_ptr=rms.slot, rms_eps=rms.eps, RMS=True)
    return args, outputs


@triton.jit
def load_residual(residual_ptr, offs_n, mask, ADD_NORM: tl.constexpr):
    """The residual at the program's outputs (0 without ADD_NORM): loaded as the weight loop
    starts (after the PDL wait: the residual is an earlier kernel's output), so that the
    store does not wait for it."""
    if ADD_NORM:
        return tl.load(residual_ptr + offs_n, mask=mask, other=0.0)
    return tl.zeros(offs_n.shape, dtype=residual_ptr.dtype.element_ty)


@triton.jit
def load_sum_of_squares(ss_in_ptr, RMS: tl.constexpr):
    """The GEMV before's sum of h^2 (fp32; 0 without RMS), read after the PDL wait."""
    if RMS:
        return tl.load(ss_in_ptr).to(tl.float32)
    return tl.zeros((), dtype=tl.float32)


@triton.jit
def rms_scale(acc, ss, K, rms_eps, RMS: tl.constexpr):
    """acc times rsqrt(ss / K + eps) with RMS (its x was h * weight), else acc."""
    if RMS:
        return acc * tl.rsqrt(ss / K + rms_eps)
    return acc


@triton.jit
def store_add_norm(y, residual, offs_n, mask, h_ptr, norm_weight_ptr, hg_ptr, ss_out_ptr, ready=True):
    """y: this program's outputs offs_n (fp32, before rounding; mask: which to store); residual:
    load_residual's. Stores h = y + residual (y rounded to h's dtype first, as the GEMV's
    output would be) and hg = h * weight, and adds the rows' sum of h^2 into the fp64 slot.
    ready: a scalar; False stores nothing (a split-K program that is not the last)."""
    dtype: tl.constexpr = h_ptr.dtype.element_ty
    ok = mask & (tl.full((), 1, tl.int1) & ready)
    h = (y.to(dtype).to(tl.float32) + residual.to(tl.float32)).to(dtype)
    tl.store(h_ptr + offs_n, h, mask=ok)
    hf = tl.where(ok, h.to(tl.float32), 0.0)
    weight = tl.load(norm_weight_ptr + offs_n, mask=ok, other=0.0).to(tl.float32)
    tl.store(hg_ptr + offs_n, (hf * weight).to(dtype), mask=ok)
    tl.atomic_add(
        ss_out_ptr, tl.sum(hf * hf, axis=0).to(tl.float64), mask=tl.full((), 1, tl.int1) & ready, sem="relaxed"
    )
