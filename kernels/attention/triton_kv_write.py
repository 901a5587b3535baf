"""The Triton KV cache write: key and value [T, Hkv, D] into their slots of the paged cache,
semantics of `write_kv_cache` in kernels/attention/reference.py. The wrapper reads only
shapes, strides and dtypes, so it launches without a host sync and can be captured in a CUDA
graph. Row offsets are int64: a KV cache can hold more than 2**31 elements. An fp8 cache
(kernels/attention/fp8_kv.py) is written as value / scale, divided with IEEE rounding and
saturated (`to_fp8`), so the stored bytes equal torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_cluster.kernels.attention.fp8_kv import FP8_MAX, is_fp8

_FP8_MAX = tl.constexpr(FP8_MAX)  # a jit function reads only constexpr globals


@triton.jit
def to_fp8(x, scale_ptr, element_ty: tl.constexpr):
    """x / scale, saturated to e4m3's finite range, as element_ty (the fp8 cache's type)."""
    scaled = tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr))
    return tl.minimum(tl.maximum(scaled, -_FP8_MAX), _FP8_MAX).to(element_ty)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,  # [1] fp32, read when KV_FP8
    v_scale_ptr,
    key_stride_t,
    key_stride_h,
    key_stride_d,
    value_stride_t,
    value_stride_h,
    value_stride_d,
    cache_stride_block,
    cache_stride_kv,
    cache_stride_offset,
    cache_stride_h,
    cache_stride_d,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token
        return
    block_id = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE

    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    key = tl.load(key_ptr + token * key_stride_t + h * key_stride_h + d * key_stride_d, mask=mask)
    value = tl.load(
        value_ptr + token * value_stride_t + h * value_stride_h + d * value_stride_d, mask=mask
    )

    dst = (
        cache_ptr
        + block_id * cache_stride_block
        + block_offset * cache_stride_offset
        + h * cache_stride_h
        + d * cache_stride_d
    )
    element_ty = cache_ptr.dtype.element_ty
    if KV_FP8:
        key = to_fp8(key, k_scale_ptr, element_ty)
        value = to_fp8(value, v_scale_ptr, element_ty)
    tl.store(dst, key.to(element_ty), mask=mask)
    tl.store(dst + cache_stride_kv, value.to(element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """key, value: [T, Hkv, D] into kv_cache [NB, 2, BS, Hkv, D] at slot_mapping [T]
    (int32 or int64, block * BS + offset), in place; a negative slot writes nothing.
    k_scale, v_scale: [1] fp32, needed (and read) only when kv_cache is fp8."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert kv_cache.dim() == 5 and kv_cache.shape[1] == 2
    assert kv_cache.shape[3:] == (num_kv_heads, head_dim), "kv_cache heads/head_dim != key's"
    assert slot_mapping.shape == (num_tokens,)
    assert slot_mapping.dtype in (torch.int32, torch.int64)
    kv_fp8 = is_fp8(kv_cache.dtype)
    assert not kv_fp8 or (k_scale is not None and v_scale is not None), "an fp8 cache needs k_scale and v_scale"
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        k_scale if kv_fp8 else slot_mapping,  # any pointer: not read
        v_scale if kv_fp8 else slot_mapping,
        *key.stride(),
        *value.stride(),
        *kv_cache.stride(),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        KV_FP8=kv_fp8,
        num_warps=4,
    )
