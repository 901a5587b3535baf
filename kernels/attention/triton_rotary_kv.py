"""Rotary embedding and the KV cache write in one Triton launch.

Semantics: `kernels.attention.reference.rotary_write_kv_cache`, i.e. `rotary_embedding` of q and k,
then `write_kv_cache` of the rotated k and of v. One program per token rotates its q and k
heads in place (their storage, usually the qkv projection's output, is overwritten) and
stores the rotated k and v into its slot of the paged cache, so the rotated k never makes
a round trip through memory before the cache write. k is rounded to its dtype before an
fp8 cache quantizes it, so the stored bytes equal the two unfused kernels'. Like the other
wrappers, this one reads only shapes, strides and dtypes: it captures in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_cluster.kernels.attention.fp8_kv import is_fp8
from vllm_cluster.kernels.attention.triton_kv_write import to_fp8
from vllm_cluster.kernels.sync import pdl


@triton.jit
def _rotate_in_place(
    x_ptr, stride_h, stride_d, num_heads, cos, sin,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """Rotates one token's heads [H, 2*HALF] (strided) in place; returns the two rotated
    halves in x's dtype, [BLOCK_H, BLOCK_HALF] each."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (d < HALF)
    ptrs = x_ptr + h * stride_h + d * stride_d
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF * stride_d, mask=mask, other=0.0).to(tl.float32)
    element_ty = x_ptr.dtype.element_ty
    out1 = (x1 * cos - x2 * sin).to(element_ty)
    out2 = (x2 * cos + x1 * sin).to(element_ty)
    tl.store(ptrs, out1, mask=mask)
    tl.store(ptrs + HALF * stride_d, out2, mask=mask)
    return out1, out2


# The decode attention's rotary of the new token (kernels/attention/triton_decode.py).


@triton.jit
def cos_sin_row(cos_ptr, sin_ptr, dims, HEAD_DIM: tl.constexpr):
    """One token's cos and sin ([D / 2] fp32 each) spread over the head: [1, D_PAD], entry d
    holding angle d mod D / 2."""
    half = HEAD_DIM // 2
    angle = tl.where(dims < half, dims, dims - half)[None, :]
    ok = (dims < HEAD_DIM)[None, :]
    return tl.load(cos_ptr + angle, mask=ok, other=0.0), tl.load(sin_ptr + angle, mask=ok, other=0.0)


@triton.jit
def rotate_heads(ptrs, dims, cos, sin, mask, HALF: tl.constexpr):
    """Rotate-half rotary of the heads at ptrs ([R, D], D contiguous), as
    `kernels.elementwise.reference.rotary_embedding` computes it (fp32, then rounded to x's dtype)."""
    first = dims < HALF
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(ptrs + tl.where(first, HALF, -HALF), mask=mask, other=0.0).to(tl.float32)
    rotated = tl.where(first, x * cos - partner * sin, x * cos + partner * sin)
    return rotated.to(ptrs.dtype.element_ty)


@triton.jit
def rotate_and_cache_new_kv(
    k_ptr, v_ptr, cos, sin, slot_ptr, cache_ptr, k_scale_ptr, v_scale_ptr,
    stride_kv_block, stride_kv_kv, stride_kv_token, dims, write,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    """One KV head of the new token (cos, sin: [1, D] from `cos_sin_row`): k rotated, then k and
    v as the cache stores them ([1, D] each, the cache's dtype; fp8 scaled by k_scale /
    v_scale). `write`: also store them in the token's slot (one program per KV head does)."""
    ok = (dims < HEAD_DIM)[None, :]
    k = rotate_heads(k_ptr + dims[None, :], dims[None, :], cos, sin, ok, HEAD_DIM // 2)
    v = tl.load(v_ptr + dims[None, :], mask=ok, other=0.0)
    element_ty = cache_ptr.dtype.element_ty
    if KV_FP8:
        k, v = to_fp8(k, k_scale_ptr, element_ty), to_fp8(v, v_scale_ptr, element_ty)
    else:
        k, v = k.to(element_ty), v.to(element_ty)
    if write:
        slot = tl.load(slot_ptr).to(tl.int64)
        if slot >= 0:
            dst = cache_ptr + (slot // BLOCK_SIZE) * stride_kv_block + (slot % BLOCK_SIZE) * stride_kv_token
            tl.store(dst + dims[None, :], k, mask=ok)
            tl.store(dst + stride_kv_kv + dims[None, :], v, mask=ok)
    return k, v


@triton.jit
def _rotary_write_kv_cache_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, cache_ptr, slot_mapping_ptr,
    k_scale_ptr, v_scale_ptr,  # [1] fp32, read when KV_FP8
    q_stride_t, q_stride_h, q_stride_d,
    k_stride_t, k_stride_h, k_stride_d,
    v_stride_t, v_stride_h, v_stride_d,
    cos_stride_t, sin_stride_t,
    cache_stride_block, cache_stride_kv, cache_stride_offset, cache_stride_h, cache_stride_d,
    num_q_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr, KV_FP8: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.dependent_start(PDL)  # kernels/sync/pdl.py
    token = tl.program_id(0).to(tl.int64)
    half = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + token * cos_stride_t + half, mask=half < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * sin_stride_t + half, mask=half < HALF, other=0.0).to(tl.float32)
    _rotate_in_place(
        q_ptr + token * q_stride_t, q_stride_h, q_stride_d, num_q_heads, cos, sin, HALF, BLOCK_HQ, BLOCK_HALF
    )
    k1, k2 = _rotate_in_place(
        k_ptr + token * k_stride_t, k_stride_h, k_stride_d, num_kv_heads, cos, sin, HALF, BLOCK_HKV, BLOCK_HALF
    )

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # a padding token is rotated but not cached
        h = tl.arange(0, BLOCK_HKV)[:, None]
        mask = (h < num_kv_heads) & (half < HALF)
        v_src = v_ptr + token * v_stride_t + h * v_stride_h + half * v_stride_d
        v1 = tl.load(v_src, mask=mask)
        v2 = tl.load(v_src + HALF * v_stride_d, mask=mask)
        dst = (
            cache_ptr
            + (slot // BLOCK_SIZE) * cache_stride_block
            + (slot % BLOCK_SIZE) * cache_stride_offset
            + h * cache_stride_h
            + half * cache_stride_d
        )
        element_ty = cache_ptr.dtype.element_ty
        if KV_FP8:
            tl.store(dst, to_fp8(k1, k_scale_ptr, element_ty), mask=mask)
            tl.store(dst + HALF * cache_stride_d, to_fp8(k2, k_scale_ptr, element_ty), mask=mask)
            tl.store(dst + cache_stride_kv, to_fp8(v1, v_scale_ptr, element_ty), mask=mask)
            tl.store(dst + cache_stride_kv + HALF * cache_stride_d, to_fp8(v2, v_scale_ptr, element_ty), mask=mask)
        else:
            tl.store(dst, k1.to(element_ty), mask=mask)
            tl.store(dst + HALF * cache_stride_d, k2.to(element_ty), mask=mask)
            tl.store(dst + cache_stride_kv, v1.to(element_ty), mask=mask)
            tl.store(dst + cache_stride_kv + HALF * cache_stride_d, v2.to(element_ty), mask=mask)


def rotary_write_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k and v [T, Hkv, D] (any strides, e.g. views of a fused qkv
    projection), cos/sin [T, D/2] fp32 (or [T, 1, D/2]); kv_cache [NB, 2, BS, Hkv, D],
    slot_mapping [T] (negative: not cached). Rotates q and k in place and writes k and v
    into the cache; returns (q, k)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim), "q and k disagree on T or D"
    assert v.shape == k.shape, f"v {tuple(v.shape)} != k {tuple(k.shape)}"
    assert head_dim % 2 == 0, f"head_dim {head_dim} must be even for rotate-half rotary"
    assert kv_cache.dim() == 5 and kv_cache.shape[1] == 2
    assert kv_cache.shape[3:] == (num_kv_heads, head_dim), "kv_cache heads/head_dim != k's"
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype in (torch.int32, torch.int64)
    kv_fp8 = is_fp8(kv_cache.dtype)
    assert not kv_fp8 or (k_scale is not None and v_scale is not None), "an fp8 cache needs k_scale and v_scale"
    half = head_dim // 2
    cos = cos.reshape(num_tokens, half)  # [T, D/2]
    sin = sin.reshape(num_tokens, half)
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1
    if num_tokens == 0:
        return q, k
    use_pdl = pdl.enabled(q)
    _rotary_write_kv_cache_kernel[(num_tokens,)](
        q, k, v, cos, sin, kv_cache, slot_mapping,
        k_scale if kv_fp8 else cos, v_scale if kv_fp8 else cos,  # any pointer: not read
        *q.stride(), *k.stride(), *v.stride(), cos.stride(0), sin.stride(0), *kv_cache.stride(),
        num_q_heads, num_kv_heads,
        HALF=half,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        KV_FP8=kv_fp8,
        PDL=use_pdl,
        num_warps=4,
        launch_pdl=use_pdl,
    )  # fmt: skip
    return q, k
