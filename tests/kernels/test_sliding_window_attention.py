"""Sliding-window attention: the reference's convention (transformers' Mistral: the query at
position p sees the keys p - W < k <= p, W tokens itself included), then the CPU path and
the Triton prefill and decode kernels against the reference, with windows smaller than the
contexts (the interpreter on tiny shapes without a GPU).

Every path runs on block tables whose entries wholly before a sequence's window point at a
block of NaN, as a released and reused block would (engine/kv_cache_manager.py): a read of
one shows up in the output. The reference reads the original tables.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from tests.kernels import test_decode_attention as decode_tests
from tests.kernels import test_prefill_attention as prefill_tests
from tests.kernels.test_rotary_decode_attention import new_tokens
from vllm_cluster.kernels.attention import reference as attention_reference
from vllm_cluster.kernels.attention import torch_ops as attention_torch_ops
from vllm_cluster.kernels.attention.metadata import AttentionMetadata, make_plan
from vllm_cluster.kernels.attention.triton_decode import decode_attention, rotary_decode_attention
from vllm_cluster.kernels.attention.triton_prefill import prefill_attention

ATOL = {torch.float32: 1e-4, torch.float16: 2e-3}
RTOL = {torch.float32: 0.0, torch.float16: 1e-3}


def released(
    cache: torch.Tensor, tables: torch.Tensor, first_keys: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache, tables) where a spare block holds NaN and row b's entries before the block of
    its first visible key first_keys[b] point at it."""
    block_size = cache.shape[2]
    used = {int(x) for b, key in enumerate(first_keys) for x in tables[b, key // block_size :]}
    spare = next(i for i in range(cache.shape[0]) if i not in used)
    cache = cache.clone()
    cache[spare] = float("nan")
    tables = tables.clone()
    for b, key in enumerate(first_keys):
        tables[b, : key // block_size] = spare
    return cache, tables
# A fresh 37-token prompt, a q_len 0 row, a 20-token chunk after a 17-token cached prefix,
# a decode row over 17 tokens and a padding row (the prefill tests' mixed batch).
Q_LENS = prefill_tests.MIXED_Q_LENS
SEQ_LENS = prefill_tests.MIXED_SEQ_LENS


def test_reference_window_counts_the_query_itself() -> None:
    """W = 1: each query sees only its own key, so the output is its own value row;
    W >= the context: plain causal attention."""
    q, cache, tables, loc, lens = prefill_tests.make_inputs([6], [6], 2, 1, 8, 4, torch.float32)
    out = attention_reference.prefill_attention(q, cache, tables, loc, lens, 0.3, sliding_window=1)
    own_v = cache[tables[0, :2].long(), 1].flatten(0, 1)[:6]  # [6, Hkv, D]
    torch.testing.assert_close(out, own_v.expand(6, 2, 8))
    causal = attention_reference.prefill_attention(q, cache, tables, loc, lens, 0.3)
    wide = attention_reference.prefill_attention(q, cache, tables, loc, lens, 0.3, sliding_window=6)
    narrow = attention_reference.prefill_attention(q, cache, tables, loc, lens, 0.3, sliding_window=5)
    torch.testing.assert_close(wide, causal)
    assert torch.equal(narrow[:5], causal[:5]) and not torch.allclose(narrow[5], causal[5])


@pytest.mark.parametrize("window", [1, 5, 16, 40])
@pytest.mark.parametrize("block_size", [1, 4])
def test_cpu_path_matches_the_reference(block_size: int, window: int) -> None:
    # Two more decode rows of different lengths: the batched decode path masks per row.
    q_lens, seq_lens = [*Q_LENS, 1, 1], [*SEQ_LENS, 30, 9]
    q, cache, tables, loc, lens = prefill_tests.make_inputs(q_lens, seq_lens, 4, 2, 16, block_size, torch.float32)
    cache = cache.nan_to_num(0.0)
    first_keys = [max(0, s - q - window + 1) for q, s in zip(q_lens, seq_lens, strict=True)]
    stale_cache, stale_tables = released(cache, tables, first_keys)
    query_start_loc = [0, *itertools.accumulate(q_lens)]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(q.shape[0], dtype=torch.long), block_tables=tables, seq_lens=lens,
        query_start_loc=loc, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        cpu_plan=make_plan(query_start_loc, seq_lens),
    )  # fmt: skip
    stale_meta = dataclasses.replace(meta, block_tables=stale_tables)
    # A fresh prompt within its window attends over key/value: give it what the cache holds.
    key, value = torch.zeros(2, q.shape[0], 2, 16)
    for b in range(len(q_lens)):
        start, end = query_start_loc[b], query_start_loc[b + 1]
        if end - start == seq_lens[b] > 0:
            key[start:end], value[start:end] = attention_reference._context(cache, tables[b], seq_lens[b], None, None)
    out = attention_torch_ops.paged_attention(q, key, value, stale_cache, stale_meta, 0.25, sliding_window=window)
    expected = attention_reference.prefill_attention(q, cache, tables, loc, lens, 0.25, sliding_window=window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("window", "block_size", "config"),
    [(1, 4, prefill_tests.TILES_16), (5, 4, prefill_tests.TILES_16), (16, 16, prefill_tests.TILES_32),
     (24, 1, prefill_tests.TILES_16), (24, 4, prefill_tests.TILES_32)],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_prefill_matches_the_reference(window: int, block_size: int, config, dtype: torch.dtype) -> None:  # noqa: ANN001
    """Windows inside one context tile (1, 5), as wide as a tile (16) and across tiles (24):
    whole tiles skipped below the window, masked tiles at its edge and on the diagonal."""
    q, cache, tables, loc, lens = prefill_tests.make_inputs(Q_LENS, SEQ_LENS, 4, 2, 32, block_size, dtype)
    first_keys = [max(0, s - q - window + 1) for q, s in zip(Q_LENS, SEQ_LENS, strict=True)]
    stale_cache, stale_tables = released(cache, tables, first_keys)
    out = prefill_attention(
        q, stale_cache, stale_tables, loc, lens, 32**-0.5, max(Q_LENS), config=config, sliding_window=window
    )
    expected = attention_reference.prefill_attention(q, cache, tables, loc, lens, 32**-0.5, sliding_window=window)
    torch.testing.assert_close(out.float(), expected.float(), atol=ATOL[dtype], rtol=RTOL[dtype])


DECODE_SEQ_LENS = [37, 0, 1, 150, 64]


@pytest.mark.parametrize(("window", "num_splits"), [(1, 1), (7, 3), (64, 1), (70, 3), (100, 8)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_triton_decode_matches_the_reference(block_size: int, window: int, num_splits: int) -> None:
    """A window starting mid-tile and mid-block, one of exactly a tile, and more splits
    than the window has tiles (empty splits)."""
    q, cache, tables, lens = decode_tests.make_inputs(DECODE_SEQ_LENS, 8, 2, 32, block_size, torch.float32)
    stale_cache, stale_tables = released(cache, tables, [max(0, s - window) for s in DECODE_SEQ_LENS])
    out = decode_attention(
        q, stale_cache, stale_tables, lens, 32**-0.5, num_splits=num_splits, sliding_window=window
    )
    expected = attention_reference.decode_attention(q, cache, tables, lens, 32**-0.5, sliding_window=window)
    torch.testing.assert_close(out, expected, atol=ATOL[torch.float32], rtol=0)


@pytest.mark.parametrize(("window", "num_splits"), [(1, 2), (2, 1), (40, 3)])
def test_triton_rotary_decode_matches_the_reference(window: int, num_splits: int) -> None:
    """The new token comes from registers; the window's cached tokens from the cache (a
    window of 1 reads no cached token at all)."""
    seq_lens = [37, 0, 1, 150, 65]
    _, cache, tables, lens = decode_tests.make_inputs(seq_lens, 8, 2, 32, 16, torch.float32)
    q, k, v, cos, sin, slots = new_tokens(seq_lens, tables, 8, 2, 32, 16, torch.float32)
    expected_cache = cache.clone()
    rotated_q, _ = attention_reference.rotary_write_kv_cache(q, k, v, cos, sin, expected_cache, slots)
    expected = attention_reference.decode_attention(
        rotated_q, expected_cache, tables, lens, 32**-0.5, sliding_window=window
    )
    cache, tables = released(cache, tables, [max(0, s - window) for s in seq_lens])
    out = rotary_decode_attention(
        q, k, v, cos, sin, cache, slots, tables, lens, 32**-0.5, num_splits=num_splits,
        max_seq_len=max(seq_lens), sliding_window=window,
    )  # fmt: skip
    torch.testing.assert_close(out, expected, atol=ATOL[torch.float32], rtol=0)
