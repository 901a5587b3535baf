"""Triton kernels of kernels/elementwise/triton_ops.py against their torch references.

Without a GPU the kernels run under the Triton interpreter on tiny shapes in fp32 and fp16
(the interpreter's bf16 arithmetic is wrong); with one, the CUDA tests add realistic Llama-8B
shapes in bf16.
"""

from __future__ import annotations

import pytest
import torch

from vllm_cluster.engine.layers.rotary import RotaryEmbedding
from vllm_cluster.kernels.attention import reference as attention_reference
from vllm_cluster.kernels.attention import triton_kv_write
from vllm_cluster.kernels.attention.fp8_kv import FP8_KV_DTYPE, FP8_MAX
from vllm_cluster.kernels.elementwise import reference as elementwise_reference
from vllm_cluster.kernels.elementwise import triton_ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU_DTYPES = [torch.float32, torch.float16]
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    tol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def fused_qkv(
    num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as non-contiguous views of one [T, (Hq + 2 Hkv) * D] projection output."""
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(num_tokens, q_size + 2 * kv_size, dtype=dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    shape = (num_tokens, -1, head_dim)
    return q.view(shape), k.view(shape), v.view(shape)


# --- write_kv_cache -------------------------------------------------------------------------


def check_write_kv_cache(
    num_tokens: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    slot_dtype: torch.dtype,
) -> None:
    _, key, value = fused_qkv(num_tokens, 2 * num_kv_heads, num_kv_heads, head_dim, dtype)
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.25] = -1  # padding tokens
    slots[-1] = -1
    slot_mapping = slots.to(dtype=slot_dtype, device=DEVICE)
    cache = randn(num_blocks, 2, block_size, num_kv_heads, head_dim, dtype=dtype, seed=2)
    expected = cache.clone()
    original = cache.clone()

    attention_reference.write_kv_cache(key, value, expected, slot_mapping)
    triton_kv_write.write_kv_cache(key, value, cache, slot_mapping)

    assert torch.equal(cache, expected)
    written = slots[slots >= 0]
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[written] = False
    flat = cache.transpose(1, 2).reshape(num_blocks * block_size, 2, num_kv_heads, head_dim)
    flat_original = original.transpose(1, 2).reshape(flat.shape)
    assert torch.equal(flat[untouched.to(DEVICE)], flat_original[untouched.to(DEVICE)])
    assert not torch.equal(flat[written.to(DEVICE)], flat_original[written.to(DEVICE)])


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_write_kv_cache(block_size: int, dtype: torch.dtype, slot_dtype: torch.dtype) -> None:
    check_write_kv_cache(
        num_tokens=12,
        num_blocks=max(16 // block_size, 2) * 2,
        block_size=block_size,
        num_kv_heads=2,
        head_dim=8,
        dtype=dtype,
        slot_dtype=slot_dtype,
    )


def test_write_kv_cache_head_dim_not_power_of_two() -> None:
    check_write_kv_cache(6, 4, 4, 3, 12, torch.float16, torch.int64)


def check_write_kv_cache_fp8(
    key: torch.Tensor, value: torch.Tensor, num_blocks: int, block_size: int, k_scale: float, v_scale: float
) -> torch.Tensor:
    """The kernel's fp8 bytes equal the reference's (value / scale, saturated, rounded to
    nearest even); padding slots and other blocks keep their bytes. Returns the cache."""
    num_tokens, num_kv_heads, head_dim = key.shape
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.25] = -1
    slot_mapping = slots.to(DEVICE)
    shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
    cache = randn(*shape, dtype=torch.float32, seed=2).to(FP8_KV_DTYPE)
    expected = cache.clone()
    scales = [torch.tensor([s], device=DEVICE) for s in (k_scale, v_scale)]
    attention_reference.write_kv_cache(key, value, expected, slot_mapping, *scales)
    triton_kv_write.write_kv_cache(key, value, cache, slot_mapping, *scales)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    return cache


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_write_kv_cache_fp8(block_size: int, dtype: torch.dtype) -> None:
    """Values on the fp8 grid times power-of-two scales, and some beyond +-448 * scale.

    The Triton 3.6 interpreter rounds fp32 -> fp8e4nv wrongly (a carry into an odd exponent
    is lost, halving the value; subnormals flush to zero: runtime/interpreter.py
    _convert_float), so on CPU no value needs rounding: this checks the division by the
    scale, the saturation and the slots. Rounding itself is checked bit for bit on CUDA."""
    num_tokens, num_kv_heads, head_dim = 12, 2, 8
    k_scale, v_scale = 0.25, 2.0
    grid = randn(2, num_tokens, num_kv_heads, head_dim, dtype=torch.float32, seed=3) * 100
    grid = grid.to(FP8_KV_DTYPE).float()  # [2, T, Hkv, D], every value an fp8 value
    grid[0, 0, 0, :2] = torch.tensor([1000.0, -1000.0], device=DEVICE)  # saturate
    key, value = (grid[0] * k_scale).to(dtype), (grid[1] * v_scale).to(dtype)
    cache = check_write_kv_cache_fp8(key, value, max(16 // block_size, 2) * 2, block_size, k_scale, v_scale)
    assert {float(x) for x in cache.float().flatten()} >= {FP8_MAX, -FP8_MAX}


def test_write_kv_cache_no_tokens() -> None:
    cache = randn(2, 2, 4, 2, 8, dtype=torch.float32)
    original = cache.clone()
    empty = torch.empty(0, 2, 8, device=DEVICE)
    triton_kv_write.write_kv_cache(empty, empty, cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(cache, original)


# --- fused_add_rms_norm ---------------------------------------------------------------------


def check_rms_norm(
    num_tokens: int, hidden_size: int, dtype: torch.dtype, residual: bool, unit_offset: bool = False
) -> None:
    x = randn(num_tokens, hidden_size, dtype=dtype, seed=3)
    res = randn(num_tokens, hidden_size, dtype=dtype, seed=4) if residual else None
    weight = (float(not unit_offset) + 0.1 * randn(hidden_size, dtype=torch.float32, seed=5)).to(dtype)
    x_before = x.clone()

    out, new_res = triton_ops.fused_add_rms_norm(x, res, weight, 1e-6, unit_offset)
    expected_out, expected_res = elementwise_reference.fused_add_rms_norm(x, res, weight, 1e-6, unit_offset)

    assert_close(out, expected_out)
    assert_close(new_res, expected_res)
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("hidden_size", [64, 96, 576])
def test_fused_add_rms_norm(hidden_size: int, residual: bool, dtype: torch.dtype) -> None:
    check_rms_norm(5, hidden_size, dtype, residual)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("residual", [True, False])
def test_fused_add_rms_norm_unit_offset(residual: bool, dtype: torch.dtype) -> None:
    """Gemma's norm: the scale is 1 + weight, in fp32."""
    check_rms_norm(5, 96, dtype, residual, unit_offset=True)


def test_fused_add_rms_norm_strided_rows() -> None:
    """x and residual as column slices of wider tensors: rows are not contiguous."""
    x = randn(4, 160, dtype=torch.float16, seed=6)[:, :96]
    res = randn(4, 128, dtype=torch.float16, seed=7)[:, 32:]
    weight = randn(96, dtype=torch.float16, seed=8)
    out, new_res = triton_ops.fused_add_rms_norm(x, res, weight, 1e-5)
    expected_out, expected_res = elementwise_reference.fused_add_rms_norm(x, res, weight, 1e-5)
    assert_close(out, expected_out)
    assert_close(new_res, expected_res)


def test_fused_add_rms_norm_no_residual_returns_x() -> None:
    x = randn(3, 64, dtype=torch.float32)
    _, new_res = triton_ops.fused_add_rms_norm(x, None, torch.ones(64, device=DEVICE), 1e-6)
    assert new_res is x


# --- rotary_embedding -----------------------------------------------------------------------


def llama3_tables(
    positions: torch.Tensor, head_dim: int, max_position: int
) -> tuple[torch.Tensor, torch.Tensor]:
    rope = RotaryEmbedding(head_dim, max_position, 500000.0, scaling=LLAMA3_SCALING).to(DEVICE)
    return rope.cos[positions], rope.sin[positions]  # [T, D/2] fp32


def check_rotary(
    num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    q, k, _ = fused_qkv(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype)
    assert num_tokens == 1 or not (q.is_contiguous() or k.is_contiguous())
    gen = torch.Generator().manual_seed(9)
    positions = torch.randint(0, 1024, (num_tokens,), generator=gen).to(DEVICE)
    cos, sin = llama3_tables(positions, head_dim, 1024)
    q_before, k_before = q.clone(), k.clone()

    q_out, k_out = triton_ops.rotary_embedding(q, k, cos, sin)
    expected_q, expected_k = elementwise_reference.rotary_embedding(q, k, cos, sin)

    assert_close(q_out, expected_q)
    assert_close(k_out, expected_k)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"), [(4, 2, 16), (3, 1, 24)])
def test_rotary_embedding(
    num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    check_rotary(6, num_q_heads, num_kv_heads, head_dim, dtype)


def test_rotary_embedding_accepts_rope_tables() -> None:
    """The engine's Rope carries cos/sin as [T, 1, D/2]."""
    q, k, _ = fused_qkv(4, 4, 2, 16, torch.float32)
    rope = RotaryEmbedding(16, 64, 10000.0).to(DEVICE)(torch.arange(4, device=DEVICE))
    q_out, k_out = triton_ops.rotary_embedding(q, k, rope.cos, rope.sin)
    expected_q, expected_k = rope.apply(q, k)
    assert_close(q_out, expected_q)
    assert_close(k_out, expected_k)


# --- silu_and_mul ---------------------------------------------------------------------------


def check_silu_and_mul(num_tokens: int, intermediate_size: int, dtype: torch.dtype) -> None:
    x = 3.0 * randn(num_tokens, 2 * intermediate_size, dtype=torch.float32, seed=10)
    x = x.to(dtype)
    out = triton_ops.silu_and_mul(x)
    assert out.shape == (num_tokens, intermediate_size)
    assert_close(out, elementwise_reference.silu_and_mul(x))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("intermediate_size", [64, 96, 1536])
def test_silu_and_mul(intermediate_size: int, dtype: torch.dtype) -> None:
    check_silu_and_mul(3, intermediate_size, dtype)


def check_gelu_tanh_and_mul(num_tokens: int, intermediate_size: int, dtype: torch.dtype) -> None:
    x = (3.0 * randn(num_tokens, 2 * intermediate_size, dtype=torch.float32, seed=11)).to(dtype)
    out = triton_ops.gelu_tanh_and_mul(x)
    assert out.shape == (num_tokens, intermediate_size)
    assert_close(out, elementwise_reference.gelu_tanh_and_mul(x))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("intermediate_size", [64, 96])
def test_gelu_tanh_and_mul(intermediate_size: int, dtype: torch.dtype) -> None:
    check_gelu_tanh_and_mul(3, intermediate_size, dtype)


# --- realistic shapes on the GPU ------------------------------------------------------------

GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@cuda_only
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_write_kv_cache_cuda(dtype: torch.dtype) -> None:
    check_write_kv_cache(4096, 512, 16, 8, 128, dtype, torch.int64)


@cuda_only
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_write_kv_cache_fp8_cuda(dtype: torch.dtype) -> None:
    """Random values at Llama-8B shapes: every rounding and the saturation bit-equal to torch."""
    key = randn(4096, 8, 128, dtype=dtype, seed=4) * 3
    value = randn(4096, 8, 128, dtype=dtype, seed=5)
    check_write_kv_cache_fp8(key, value, 512, 16, 0.0071, 0.0023)


@cuda_only
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("hidden_size", [4096, 8192, 576])
def test_fused_add_rms_norm_cuda(hidden_size: int, residual: bool, dtype: torch.dtype) -> None:
    check_rms_norm(4096, hidden_size, dtype, residual)


@cuda_only
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_fused_add_rms_norm_unit_offset_cuda(dtype: torch.dtype) -> None:
    check_rms_norm(4096, 2304, dtype, residual=True, unit_offset=True)


@cuda_only
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("num_tokens", [4096, 1])
def test_rotary_embedding_cuda(num_tokens: int, dtype: torch.dtype) -> None:
    check_rotary(num_tokens, 32, 8, 128, dtype)


@cuda_only
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_silu_and_mul_cuda(dtype: torch.dtype) -> None:
    check_silu_and_mul(4096, 14336, dtype)


@cuda_only
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gelu_tanh_and_mul_cuda(dtype: torch.dtype) -> None:
    check_gelu_tanh_and_mul(4096, 9216, dtype)


@cuda_only
def test_cuda_graph_capture() -> None:
    """The wrappers read no tensor values on the host, so all four capture and replay."""
    dtype = torch.bfloat16
    key = randn(8, 8, 128, dtype=dtype)
    cache = torch.zeros(4, 2, 16, 8, 128, dtype=dtype, device=DEVICE)
    slot_mapping = torch.tensor([0, 1, 17, -1, 33, 34, -1, 63], device=DEVICE)
    x = randn(8, 4096, dtype=dtype)
    weight = randn(4096, dtype=dtype)
    q, k, _ = fused_qkv(8, 32, 8, 128, dtype)
    cos, sin = llama3_tables(torch.arange(8, device=DEVICE), 128, 64)
    gate_up = randn(8, 2 * 1024, dtype=dtype)

    def step() -> tuple[torch.Tensor, ...]:
        triton_kv_write.write_kv_cache(key, key, cache, slot_mapping)
        out, res = triton_ops.fused_add_rms_norm(x, x, weight, 1e-6)
        q_out, k_out = triton_ops.rotary_embedding(q, k, cos, sin)
        return out, res, q_out, k_out, triton_ops.silu_and_mul(gate_up)

    eager = step()  # also compiles every kernel before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    cache.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager, strict=True):
        assert torch.equal(a, b)
    expected_cache = torch.zeros_like(cache)
    attention_reference.write_kv_cache(key, key, expected_cache, slot_mapping)
    assert torch.equal(cache, expected_cache)
