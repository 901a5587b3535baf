"""Triton kernels for the small elementwise steps of the hot path: fused add + RMS norm,
rotary embedding, SiLU-and-mul (and GeGLU's gelu-tanh-and-mul).

Each wrapper has the signature and semantics of the same-named function in
`kernels/elementwise/reference.py`, which is its definition in the tests. The wrappers read only shapes,
strides and dtypes, never tensor values, so they launch without a host sync and can be
captured in a CUDA graph. On Hopper the decode chain's kernels start early and wait for the
one before (PDL, kernels/sync/pdl.py). Row offsets are computed in int64: an activation can
hold more than 2**31 elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_cluster.kernels.sync import pdl


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    x_stride,
    residual_stride,
    out_stride,
    new_residual_stride,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    UNIT_OFFSET: tl.constexpr = False,
):
    pdl.dependent_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        # The sum is rounded to x's dtype before it is normalised, as in the reference.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * new_residual_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean_square = tl.sum(xf * xf, axis=0) / hidden_size
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    if UNIT_OFFSET:  # Gemma: scale by 1 + weight in fp32, the normalised x not rounded first
        out = (1.0 + weight.to(tl.float32)) * (xf * tl.rsqrt(mean_square + eps))
    else:
        normed = (xf * tl.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
        out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, D] -> (weight * rms_norm(x + residual), x + residual); unit_offset:
    (1 + weight) instead of weight, as the reference. Without a residual the second output is
    x itself, as in the reference."""
    hidden_size = x.shape[-1]
    assert weight.shape == (hidden_size,), f"weight {tuple(weight.shape)} != ({hidden_size},)"
    assert residual is None or residual.shape == x.shape
    x2d = x.reshape(-1, hidden_size)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    out = torch.empty(
        x2d.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device
    )  # [T, D]
    if residual is None:
        res2d, new_residual = x2d, x2d
    else:
        res2d = residual.reshape(-1, hidden_size)
        if res2d.stride(-1) != 1:
            res2d = res2d.contiguous()
        new_residual = torch.empty_like(x2d, memory_format=torch.contiguous_format)
    num_rows = x2d.shape[0]
    if num_rows > 0:
        block = triton.next_power_of_2(hidden_size)
        use_pdl = pdl.enabled(x)
        _fused_add_rms_norm_kernel[(num_rows,)](
            x2d,
            res2d,
            weight.contiguous(),
            out,
            new_residual,
            x2d.stride(0),
            res2d.stride(0),
            out.stride(0),
            new_residual.stride(0),
            hidden_size,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            PDL=use_pdl,
            UNIT_OFFSET=unit_offset,
            num_warps=min(max(block // 512, 1), 16),
            launch_pdl=use_pdl,
        )
    new_residual = x if residual is None else new_residual.view(x.shape)
    return out.view(x.shape), new_residual


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    stride_h,
    stride_d,
    num_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotates the heads of one token: src [H, 2*HALF] (strided) -> dst [H, 2*HALF] contiguous."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (d < HALF)
    src = src_ptr + h * stride_h + d * stride_d
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF * stride_d, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + h * (2 * HALF) + d
    element_ty = dst_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos - x2 * sin).to(element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(element_ty), mask=mask)


@triton.jit
def _rotary_embedding_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    q_stride_t,
    q_stride_h,
    q_stride_d,
    k_stride_t,
    k_stride_h,
    k_stride_d,
    cos_stride_t,
    cos_stride_d,
    sin_stride_t,
    sin_stride_d,
    num_q_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + token * cos_stride_t + d * cos_stride_d, mask=d < HALF, other=0.0)
    sin = tl.load(sin_ptr + token * sin_stride_t + d * sin_stride_d, mask=d < HALF, other=0.0)
    cos = cos.to(tl.float32)
    sin = sin.to(tl.float32)
    _rotate_heads(
        q_ptr + token * q_stride_t,
        q_out_ptr + token * (num_q_heads * 2 * HALF),
        q_stride_h,
        q_stride_d,
        num_q_heads,
        cos,
        sin,
        HALF,
        BLOCK_HQ,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_ptr + token * k_stride_t,
        k_out_ptr + token * (num_kv_heads * 2 * HALF),
        k_stride_h,
        k_stride_d,
        num_kv_heads,
        cos,
        sin,
        HALF,
        BLOCK_HKV,
        BLOCK_HALF,
    )


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary: q [T, Hq, D], k [T, Hkv, D] (any strides, e.g. views of a fused qkv
    projection), cos/sin [T, D/2] (or [T, 1, D/2]) -> new contiguous q, k in their dtypes."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim), "q and k disagree on T or D"
    assert head_dim % 2 == 0, f"head_dim {head_dim} must be even for rotate-half rotary"
    half = head_dim // 2
    cos = cos.reshape(num_tokens, half)  # [T, D/2]
    sin = sin.reshape(num_tokens, half)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    _rotary_embedding_kernel[(num_tokens,)](
        q,
        k,
        cos,
        sin,
        q_out,
        k_out,
        *q.stride(),
        *k.stride(),
        *cos.stride(),
        *sin.stride(),
        num_q_heads,
        num_kv_heads,
        HALF=half,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4,
    )
    return q_out, k_out


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    x_stride,
    out_stride,
    intermediate_size,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    GELU_TANH: tl.constexpr = False,
):
    pdl.dependent_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + intermediate_size + cols, mask=mask, other=0.0)
    if GELU_TANH:
        out = gelu_tanh_times(gate, up, out_ptr.dtype.element_ty)
    else:
        out = silu_times(gate, up, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_stride + cols, out, mask=mask)


@triton.jit
def silu_times(gate, up, element_ty: tl.constexpr):
    """silu(gate) * up in element_ty, gate and up already in element_ty (the GEMVs' fused
    epilogue rounds them first). silu(gate) is rounded to the activation dtype before the
    product, as in the reference (and HF transformers); a no-op in fp32."""
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(element_ty)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(element_ty)


@triton.jit
def gelu_tanh_times(gate, up, element_ty: tl.constexpr):
    """gelu(gate) * up with gelu's tanh approximation, rounded like silu_times."""
    g = gate.to(tl.float32)
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) * (g + 0.044715 g^3)
    tanh = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0
    gelu = (0.5 * g * (1.0 + tanh)).to(element_ty)
    return (gelu.to(tl.float32) * up.to(tl.float32)).to(element_ty)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] = [gate | up] -> silu(gate) * up: [T, I]."""
    return _act_and_mul(x, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] = [gate | up] -> gelu_tanh(gate) * up: [T, I] (GeGLU)."""
    return _act_and_mul(x, gelu_tanh=True)


def _act_and_mul(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    assert x.shape[-1] % 2 == 0, f"last dim {x.shape[-1]} must be even ([gate | up])"
    intermediate_size = x.shape[-1] // 2
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    out = torch.empty((x2d.shape[0], intermediate_size), dtype=x.dtype, device=x.device)
    if x2d.shape[0] > 0:
        block = min(triton.next_power_of_2(intermediate_size), 1024)
        grid = (x2d.shape[0], triton.cdiv(intermediate_size, block))
        use_pdl = pdl.enabled(x)
        _silu_and_mul_kernel[grid](
            x2d, out, x2d.stride(0), out.stride(0), intermediate_size, BLOCK=block,
            PDL=use_pdl, GELU_TANH=gelu_tanh, num_warps=4, launch_pdl=use_pdl,
        )  # fmt: skip
    return out.view(*x.shape[:-1], intermediate_size)
