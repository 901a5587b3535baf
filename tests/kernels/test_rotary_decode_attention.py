"""Decode attention that rotates and caches the new token itself
(`triton_decode.rotary_decode_attention`, what `attention_ops.rotary_paged_attention`
runs for a decode-only batch on CUDA) against its definition: `attention_reference.rotary_write_kv_cache`
of the new tokens, then `attention_reference.decode_attention`.

The output matches with the tolerances of the plain decode attention tests; the cache ends
up holding what the reference writes (the old contents of each new token's slot are random,
so a kernel that read the slot before writing it, or attended over the stale value, fails).
q, k and v are left as they were. Interpreter runs use fp32 / fp16 on tiny shapes; the fp8
cache runs on CUDA only (the interpreter rounds fp32 -> fp8 wrongly, see test_triton_ops.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_decode_attention import (
    ATOL,
    DEVICE,
    fp8_scales,
    make_inputs,
    requires_cuda,
    to_fp8,
)
from tests.kernels.test_triton_ops import fused_qkv, llama3_tables
from vllm_cluster.kernels.attention import dispatch as attention_ops
from vllm_cluster.kernels.attention import reference as attention_reference
from vllm_cluster.kernels.attention import triton_decode
from vllm_cluster.kernels.attention.fp8_kv import FP8_KV_DTYPE
from vllm_cluster.kernels.attention.metadata import AttentionMetadata, make_plan
from vllm_cluster.kernels.attention.triton_decode import rotary_decode_attention


def new_tokens(
    seq_lens: list[int], block_tables: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
    block_size: int, dtype: torch.dtype,
):  # fmt: skip
    """(q, k, v) views of one qkv projection, cos / sin at each new token's position
    seq_len - 1, and the slot of that position (-1 for a padding row)."""
    q, k, v = fused_qkv(len(seq_lens), num_heads, num_kv_heads, head_dim, dtype)
    positions = torch.tensor([max(n - 1, 0) for n in seq_lens], device=DEVICE)
    cos, sin = llama3_tables(positions, head_dim, 4096)
    blocks = block_tables[torch.arange(len(seq_lens), device=DEVICE), positions // block_size]
    slots = blocks.long() * block_size + positions % block_size
    slots[torch.tensor(seq_lens, device=DEVICE) == 0] = -1
    return q, k, v, cos, sin, slots


def check(
    seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
    num_splits: int | None, kv_dtype: torch.dtype | None = None,
) -> None:  # fmt: skip
    _, cache, block_tables, seq_lens_t = make_inputs(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    q, k, v, cos, sin, slots = new_tokens(seq_lens, block_tables, num_heads, num_kv_heads, head_dim, block_size, dtype)
    scales = (None, None)
    if kv_dtype == FP8_KV_DTYPE:
        scales = fp8_scales()
        cache = to_fp8(cache, *scales)
    expected_cache = cache.clone()
    rotated_q, _ = attention_reference.rotary_write_kv_cache(q, k, v, cos, sin, expected_cache, slots, *scales)
    scale = head_dim**-0.5
    expected = attention_reference.decode_attention(rotated_q, expected_cache, block_tables, seq_lens_t, scale, *scales)
    inputs = [t.clone() for t in (q, k, v)]

    out = rotary_decode_attention(
        q, k, v, cos, sin, cache, slots, block_tables, seq_lens_t, scale, num_splits=num_splits,
        max_seq_len=max(seq_lens), k_scale=scales[0], v_scale=scales[1],
    )  # fmt: skip

    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=ATOL[dtype], rtol=0)
    if kv_dtype == FP8_KV_DTYPE:  # one fp8 step apart at most where the rotation rounded differently
        torch.testing.assert_close(cache.float(), expected_cache.float(), atol=0.0, rtol=0.07)
    else:
        torch.testing.assert_close(cache.float(), expected_cache.float(), atol=ATOL[dtype], rtol=0)
    for before, after in zip(inputs, (q, k, v), strict=True):
        assert torch.equal(before, after)


# A padding row (0), a context of only the new token (1), the new token at the start of a
# block (65 with block 16 / 4) and at a split's or tile's edge, contexts over several tiles.
SEQ_LENS = [37, 0, 1, 150, 65]


@pytest.mark.parametrize("early_tile", [True, False], ids=["first-tile-early", "all-tiles-in-loop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_matches_rotary_write_then_decode_attention(
    num_splits: int, dtype: torch.dtype, early_tile: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ways of reading the first cached tile (before the PDL wait, peeled off the loop,
    or in the loop) give the definition's result."""
    monkeypatch.setattr(triton_decode, "EARLY_FIRST_TILE", early_tile)
    check(SEQ_LENS, 8, 2, 32, 16, dtype, num_splits)


@pytest.mark.parametrize("num_kv_heads", [8, 1])
@pytest.mark.parametrize("block_size", [1, 4])
def test_gqa_groups_and_block_sizes(block_size: int, num_kv_heads: int) -> None:
    check([5, 64, 1, 0], 8, num_kv_heads, 16, block_size, torch.float32, num_splits=2)


def test_head_dim_not_power_of_two() -> None:
    check([9, 33], 4, 2, 24, 4, torch.float32, num_splits=2)


def test_dispatch_runs_it_for_decode_only_batches() -> None:
    """attention_ops.rotary_paged_attention: the fused kernel for a decode-only batch on CUDA, the
    rotary write + paged attention elsewhere; the same result either way."""
    seq_lens = [20, 3, 7]  # no padding row: only CUDA graphs pad, and the CPU path has none
    _, cache, block_tables, seq_lens_t = make_inputs(seq_lens, 4, 2, 16, 4, torch.float32)
    q, k, v, cos, sin, slots = new_tokens(seq_lens, block_tables, 4, 2, 16, 4, torch.float32)
    meta = AttentionMetadata(
        slot_mapping=slots, block_tables=block_tables, seq_lens=seq_lens_t,
        query_start_loc=torch.arange(4, dtype=torch.int32, device=DEVICE), max_query_len=1, max_seq_len=20,
        cpu_plan=None if q.is_cuda else make_plan([0, 1, 2, 3], seq_lens),
    )  # fmt: skip
    expected_cache = cache.clone()
    rotated_q, _ = attention_reference.rotary_write_kv_cache(q, k, v, cos, sin, expected_cache, slots)
    expected = attention_reference.decode_attention(rotated_q, expected_cache, block_tables, seq_lens_t, 0.25)
    out = attention_ops.rotary_paged_attention(q.clone(), k.clone(), v, cos, sin, cache, meta, 0.25)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(cache, expected_cache, atol=1e-5, rtol=0)


@requires_cuda
@pytest.mark.parametrize("kv_dtype", [None, FP8_KV_DTYPE], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("num_splits", [1, 4, None])
def test_realistic_bf16(num_splits: int | None, kv_dtype: torch.dtype | None) -> None:
    gen = torch.Generator().manual_seed(1)
    seq_lens = torch.randint(1, 2304, (64,), generator=gen)
    seq_lens[::17] = 0
    check(seq_lens.tolist(), 32, 8, 128, 16, torch.bfloat16, num_splits, kv_dtype)


@requires_cuda
def test_cuda_graph_replay_with_new_lengths_and_slots() -> None:
    """Captured once, replayed with other lengths, positions and slots: every input is read
    from device memory."""
    lens, new_lens = [300, 5, 0, 512], [512, 0, 77, 1]
    _, cache, block_tables, seq_lens = make_inputs([512] * 4, 32, 8, 128, 16, torch.bfloat16)
    q, k, v, cos, sin, slots = new_tokens(lens, block_tables, 32, 8, 128, 16, torch.bfloat16)
    seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))

    def run() -> torch.Tensor:
        return rotary_decode_attention(q, k, v, cos, sin, cache, slots, block_tables, seq_lens, 128**-0.5,
                                       max_seq_len=512)  # fmt: skip

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    q2, k2, v2, cos2, sin2, slots2 = new_tokens(new_lens, block_tables, 32, 8, 128, 16, torch.bfloat16)
    for dst, src in ((q, q2), (k, k2), (v, v2), (cos, cos2), (sin, sin2), (slots, slots2)):
        dst.copy_(src)
    seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
    expected_cache = cache.clone()
    rotated_q, _ = attention_reference.rotary_write_kv_cache(q, k, v, cos, sin, expected_cache, slots)
    expected = attention_reference.decode_attention(rotated_q, expected_cache, block_tables, seq_lens, 128**-0.5)
    graph.replay()
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(cache.float(), expected_cache.float(), atol=2e-2, rtol=0)
