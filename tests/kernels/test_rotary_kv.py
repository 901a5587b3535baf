"""The fused rotary + KV cache write (kernels/attention/triton_rotary_kv.py) against its definition,
`attention_reference.rotary_write_kv_cache` (rotary_embedding, then write_kv_cache).

q and k come back rotated as the reference rotates them (fp32 math, rounded to their
dtype), and rotated in place in the qkv projection's storage. The cache holds exactly what
write_kv_cache stores for the returned k and for v: bit for bit, fp8 included (fp8 only on
CUDA: the Triton interpreter rounds fp32 -> fp8 wrongly, see test_triton_ops.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_triton_ops import (
    CPU_DTYPES,
    DEVICE,
    assert_close,
    cuda_only,
    fused_qkv,
    llama3_tables,
    randn,
)
from vllm_cluster.kernels.attention import dispatch as attention_ops
from vllm_cluster.kernels.attention import reference as attention_reference
from vllm_cluster.kernels.attention import triton_kv_write
from vllm_cluster.kernels.attention.fp8_kv import FP8_KV_DTYPE
from vllm_cluster.kernels.attention.triton_rotary_kv import rotary_write_kv_cache
from vllm_cluster.kernels.elementwise import reference as elementwise_reference
from vllm_cluster.kernels.elementwise import triton_ops


def check(
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
) -> None:
    kv_dtype = kv_dtype or dtype
    num_blocks = -(-2 * num_tokens // block_size) + 1
    q, k, v = fused_qkv(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype)
    gen = torch.Generator().manual_seed(7)
    positions = torch.randint(0, 1024, (num_tokens,), generator=gen).to(DEVICE)
    cos, sin = llama3_tables(positions, head_dim, 1024)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.25] = -1  # padding tokens
    slot_mapping = slots.to(DEVICE)
    cache = randn(num_blocks, 2, block_size, num_kv_heads, head_dim, dtype=torch.float32, seed=2).to(kv_dtype)
    scales = [torch.tensor([s], device=DEVICE) for s in (0.013, 0.006)]
    expected_q, expected_k = elementwise_reference.rotary_embedding(q, k, cos, sin)
    expected_cache = cache.clone()

    q_out, k_out = rotary_write_kv_cache(q, k, v, cos, sin, cache, slot_mapping, *scales)

    assert_close(q_out, expected_q)
    assert_close(k_out, expected_k)
    assert q_out.data_ptr() == q.data_ptr() and torch.equal(q, q_out)  # rotated in place
    assert k_out.data_ptr() == k.data_ptr() and torch.equal(k, k_out)
    attention_reference.write_kv_cache(k_out, v, expected_cache, slot_mapping, *scales)
    assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"), [(4, 2, 16), (3, 1, 24)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_rotary_write_kv_cache(
    num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    check(6, num_q_heads, num_kv_heads, head_dim, block_size, dtype)


def test_no_tokens() -> None:
    q, k, v = (
        torch.empty(0, 4, 16, device=DEVICE),
        torch.empty(0, 2, 16, device=DEVICE),
        torch.empty(0, 2, 16, device=DEVICE),
    )
    cache = randn(2, 2, 4, 2, 16, dtype=torch.float32)
    original = cache.clone()
    table = torch.empty(0, 8, device=DEVICE)
    rotary_write_kv_cache(q, k, v, table, table, cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(cache, original)


def test_torch_path_is_the_definition() -> None:
    """The CPU path (what attention_ops.rotary_write_kv_cache runs off CUDA) equals the reference."""
    q, k, v = (x.cpu() for x in fused_qkv(5, 4, 2, 16, torch.float32))
    cos, sin = (x.cpu() for x in llama3_tables(torch.arange(5, device=DEVICE), 16, 64))
    slot_mapping = torch.tensor([3, 0, 9, 12, 7])
    cache, expected_cache = torch.zeros(4, 2, 4, 2, 16), torch.zeros(4, 2, 4, 2, 16)
    q_out, k_out = attention_ops.rotary_write_kv_cache(q, k, v, cos, sin, cache, slot_mapping)
    expected_q, expected_k = attention_reference.rotary_write_kv_cache(q, k, v, cos, sin, expected_cache, slot_mapping)
    assert torch.equal(q_out, expected_q) and torch.equal(k_out, expected_k)
    assert torch.equal(cache, expected_cache)


# --- realistic shapes on the GPU ------------------------------------------------------------


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens", [4096, 1])
@pytest.mark.parametrize("kv_fp8", [False, True])
def test_rotary_write_kv_cache_cuda(num_tokens: int, dtype: torch.dtype, kv_fp8: bool) -> None:
    check(num_tokens, 32, 8, 128, 16, dtype, FP8_KV_DTYPE if kv_fp8 else None)


@cuda_only
@pytest.mark.parametrize("kv_fp8", [False, True])
def test_equals_the_unfused_kernels_cuda(kv_fp8: bool) -> None:
    """Same rotation and same stored bytes as triton_ops.rotary_embedding + write_kv_cache."""
    dtype, kv_dtype = torch.bfloat16, FP8_KV_DTYPE if kv_fp8 else torch.bfloat16
    q, k, v = fused_qkv(64, 32, 8, 128, dtype)
    cos, sin = llama3_tables(torch.arange(64, device=DEVICE) * 7, 128, 1024)
    slot_mapping = torch.randperm(256, device=DEVICE)[:64]
    scales = [torch.tensor([s], device=DEVICE) for s in (0.02, 0.01)]
    cache = torch.zeros(16, 2, 16, 8, 128, device=DEVICE).to(kv_dtype)
    unfused_cache = cache.clone()
    unfused_q, unfused_k = triton_ops.rotary_embedding(q, k, cos, sin)
    triton_kv_write.write_kv_cache(unfused_k, v, unfused_cache, slot_mapping, *scales)
    q_out, k_out = attention_ops.rotary_write_kv_cache(q, k, v, cos, sin, cache, slot_mapping, *scales)
    assert torch.equal(q_out, unfused_q) and torch.equal(k_out, unfused_k)
    assert torch.equal(cache.view(torch.uint8), unfused_cache.view(torch.uint8))


@cuda_only
def test_cuda_graph_capture() -> None:
    """The wrapper reads no tensor values on the host: it captures, and a replay reads new
    positions (cos/sin) and slots from the same buffers."""
    q, k, v = fused_qkv(8, 32, 8, 128, torch.bfloat16)
    qkv_before = (q.clone(), k.clone(), v.clone())
    cos, sin = llama3_tables(torch.arange(8, device=DEVICE), 128, 64)
    slot_mapping = torch.tensor([0, 1, 17, -1, 33, 34, -1, 63], device=DEVICE)
    cache = torch.zeros(4, 2, 16, 8, 128, dtype=torch.bfloat16, device=DEVICE)

    def step() -> None:
        rotary_write_kv_cache(q, k, v, cos, sin, cache, slot_mapping)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    new_cos, new_sin = llama3_tables(torch.arange(8, device=DEVICE) + 40, 128, 64)
    for buffer, value in ((q, qkv_before[0]), (k, qkv_before[1]), (cos, new_cos), (sin, new_sin)):
        buffer.copy_(value)
    slot_mapping.copy_(slot_mapping.flip(0))
    cache.zero_()
    graph.replay()
    torch.cuda.synchronize()
    expected_q, expected_k = elementwise_reference.rotary_embedding(qkv_before[0], qkv_before[1], new_cos, new_sin)
    assert_close(q, expected_q)
    assert_close(k, expected_k)
    expected_cache = torch.zeros_like(cache)
    attention_reference.write_kv_cache(k, v, expected_cache, slot_mapping)
    assert torch.equal(cache, expected_cache)
