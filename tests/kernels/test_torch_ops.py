"""The CPU attention path (kernels/attention/torch_ops.py) against the torch reference, on a mixed batch
whose new tokens are written through attention_torch_ops.write_kv_cache first, as the engine does: a
fresh prompt, a chunk after a cached prefix, and decode rows of different lengths.

With an fp8 cache the reference reads back what was stored (fp8 * scale, in fp32); the CPU
path must too, fresh prompts included (it then reads the cache, not the unquantized K/V), so
both differ by fp32 rounding only."""

from __future__ import annotations

import itertools

import pytest
import torch

from vllm_cluster.kernels.attention import reference as attention_reference
from vllm_cluster.kernels.attention import torch_ops as attention_torch_ops
from vllm_cluster.kernels.attention.fp8_kv import FP8_KV_DTYPE
from vllm_cluster.kernels.attention.metadata import AttentionMetadata, make_plan

Q_LENS = [9, 6, 1, 1]
SEQ_LENS = [9, 14, 7, 12]  # the second row's first 8 tokens, and the decode rows', are cached


def run(kv_dtype: torch.dtype, k_scale: torch.Tensor, v_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(torch_ops output, reference output) [T, Hq, D] over the same cache."""
    gen = torch.Generator().manual_seed(0)
    block_size, num_heads, num_kv_heads, head_dim = 4, 4, 2, 16
    tables = []
    for n in SEQ_LENS:  # shuffled block ids, one run of them per sequence
        tables.append([len(tables) * 4 + i for i in range(-(-n // block_size))])
    num_blocks = 4 * len(SEQ_LENS)
    block_tables = torch.tensor([t + [0] * (4 - len(t)) for t in tables], dtype=torch.int32)
    cache = torch.zeros(num_blocks, 2, block_size, num_kv_heads, head_dim, dtype=kv_dtype)
    cached = [torch.arange(s - q) for q, s in zip(Q_LENS, SEQ_LENS, strict=True)]
    new = [torch.arange(s - q, s) for q, s in zip(Q_LENS, SEQ_LENS, strict=True)]
    prefix_slots = _slots(block_tables, cached, block_size)
    prefix_k, prefix_v = (torch.randn(len(prefix_slots), num_kv_heads, head_dim, generator=gen) for _ in range(2))
    attention_torch_ops.write_kv_cache(prefix_k, prefix_v, cache, prefix_slots, k_scale, v_scale)  # earlier steps
    slots = _slots(block_tables, new, block_size)
    num_tokens = sum(Q_LENS)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    k, v = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) for _ in range(2))
    query_start_loc = [0, *itertools.accumulate(Q_LENS)]
    meta = AttentionMetadata(
        slot_mapping=slots, block_tables=block_tables, seq_lens=torch.tensor(SEQ_LENS, dtype=torch.int32),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32), max_query_len=max(Q_LENS),
        max_seq_len=max(SEQ_LENS), cpu_plan=make_plan(query_start_loc, SEQ_LENS),
    )
    attention_torch_ops.write_kv_cache(k, v, cache, slots, k_scale, v_scale)
    out = attention_torch_ops.paged_attention(q, k, v, cache, meta, 0.25, k_scale, v_scale)
    expected = attention_reference.prefill_attention(
        q, cache, block_tables, meta.query_start_loc, meta.seq_lens, 0.25, k_scale, v_scale
    )
    return out, expected


def _slots(block_tables: torch.Tensor, positions: list[torch.Tensor], block_size: int) -> torch.Tensor:
    seq_index = torch.repeat_interleave(torch.arange(len(positions)), torch.tensor([len(p) for p in positions]))
    flat = torch.cat(positions)
    return block_tables[seq_index, flat // block_size].long() * block_size + flat % block_size


@pytest.mark.parametrize("kv_dtype", [torch.float32, FP8_KV_DTYPE])
def test_mixed_batch_equals_the_reference(kv_dtype: torch.dtype) -> None:
    # V's scale saturates some values (448 * 0.004 = 1.8): read back as stored, clamped.
    out, expected = run(kv_dtype, torch.tensor([0.02]), torch.tensor([0.004]))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_fp8_scales_are_applied_on_read() -> None:
    """The same K/V under other scales read back nearly the same attention: the scales divide
    on write and multiply on read (a path that skips either is off by the ratio of the
    scales, 8x). What remains is fp8 rounding (2^-4 of a value at most), different under
    each scale once values reach e4m3's subnormals (below 2^-6 * scale)."""
    # |K|, |V| < 5: neither pair of scales saturates (448 * 0.05 = 22).
    out_a, _ = run(FP8_KV_DTYPE, torch.tensor([0.05]), torch.tensor([0.05]))
    out_b, _ = run(FP8_KV_DTYPE, torch.tensor([0.4]), torch.tensor([0.4]))
    assert 0 < float((out_a - out_b).abs().max()) < 0.1
