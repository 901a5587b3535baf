"""Attention logit soft-capping (Gemma 2's attn_logit_softcapping: each score s becomes
cap * tanh(s / cap) after the scale, before the mask and the softmax): the reference against
the torch path of kernels/attention/softcap.py, then the Triton prefill, decode and rotary
decode kernels and the CPU dispatch against the reference with the cap (the interpreter on
tiny shapes without a GPU). Without a cap the kernels are tested by their own files.

Scores here are about N(0, 1) times `q_gain`: a cap of 1 bends most of them, and a gain of 40
drives them far into tanh's saturation, where a quotient of exponentials would overflow.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.kernels import test_decode_attention as decode_tests
from tests.kernels import test_prefill_attention as prefill_tests
from tests.kernels.test_rotary_decode_attention import new_tokens
from vllm_cluster.kernels.attention import dispatch as attention_ops
from vllm_cluster.kernels.attention import reference as attention_reference
from vllm_cluster.kernels.attention.metadata import AttentionMetadata, make_plan
from vllm_cluster.kernels.attention.softcap import softcapped_paged_attention
from vllm_cluster.kernels.attention.triton_decode import decode_attention, rotary_decode_attention
from vllm_cluster.kernels.attention.triton_prefill import PrefillTileConfig, prefill_attention

ATOL = {torch.float32: 1e-4, torch.float16: 2e-3}
RTOL = {torch.float32: 0.0, torch.float16: 1e-3}
SCALE = 32**-0.5
# A fresh prompt, a q_len 0 row, a chunk after a cached prefix, a decode row, a padding row.
Q_LENS = prefill_tests.MIXED_Q_LENS
SEQ_LENS = prefill_tests.MIXED_SEQ_LENS
DECODE_SEQ_LENS = [37, 0, 1, 150, 64]


def _prefill_inputs(block_size: int, dtype: torch.dtype, q_gain: float):  # type: ignore[no-untyped-def]
    q, cache, tables, loc, lens = prefill_tests.make_inputs(Q_LENS, SEQ_LENS, 4, 2, 32, block_size, dtype)
    return q * q_gain, cache, tables, loc, lens


def _cpu_meta(tables: torch.Tensor, loc: torch.Tensor, lens: torch.Tensor) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.zeros(int(loc[-1]), dtype=torch.long), block_tables=tables, seq_lens=lens,
        query_start_loc=loc, max_query_len=max(Q_LENS), max_seq_len=max(SEQ_LENS),
        cpu_plan=make_plan([0, *itertools.accumulate(Q_LENS)], SEQ_LENS),
    )  # fmt: skip


def test_reference_caps_the_scores() -> None:
    """The reference with a cap equals the engine's torch path (softcap.py); a cap far above
    every score changes nothing; a cap of 1 changes the output."""
    q, cache, tables, loc, lens = _prefill_inputs(4, torch.float32, 1.0)
    q, cache, tables, loc, lens = q.cpu(), cache.cpu(), tables.cpu(), loc.cpu(), lens.cpu()
    capped = attention_reference.prefill_attention(q, cache, tables, loc, lens, SCALE, softcap=1.0)
    torch_path = softcapped_paged_attention(q, cache, _cpu_meta(tables, loc, lens), SCALE, 1.0)
    torch.testing.assert_close(torch_path, capped, atol=1e-5, rtol=0)
    plain = attention_reference.prefill_attention(q, cache, tables, loc, lens, SCALE)
    wide = attention_reference.prefill_attention(q, cache, tables, loc, lens, SCALE, softcap=1e4)
    torch.testing.assert_close(wide, plain, atol=1e-5, rtol=0)
    assert (capped - plain).abs().max() > 0.05


@pytest.mark.parametrize(
    ("block_size", "config", "softcap", "q_gain", "window"),
    [(4, prefill_tests.TILES_16, 1.0, 1.0, None), (1, prefill_tests.TILES_32, 2.0, 40.0, None),
     (16, prefill_tests.TILES_16, 1.0, 1.0, 5), (4, prefill_tests.TILES_32, 2.0, 40.0, 24)],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_prefill_matches_the_reference(
    block_size: int, config: PrefillTileConfig, softcap: float, q_gain: float, window: int | None,
    dtype: torch.dtype,
) -> None:  # fmt: skip
    q, cache, tables, loc, lens = _prefill_inputs(block_size, dtype, q_gain)
    out = prefill_attention(
        q, cache, tables, loc, lens, SCALE, max(Q_LENS), config=config, sliding_window=window, softcap=softcap
    )
    expected = attention_reference.prefill_attention(
        q, cache, tables, loc, lens, SCALE, sliding_window=window, softcap=softcap
    )
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected.float(), atol=ATOL[dtype], rtol=RTOL[dtype])
    uncapped = attention_reference.prefill_attention(q, cache, tables, loc, lens, SCALE, sliding_window=window)
    assert (out.float() - uncapped.float()).abs().max() > 0.05


@pytest.mark.parametrize(
    ("num_splits", "softcap", "q_gain", "window"), [(1, 1.0, 1.0, None), (3, 2.0, 40.0, None), (3, 1.0, 1.0, 70)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_decode_matches_the_reference(
    num_splits: int, softcap: float, q_gain: float, window: int | None, dtype: torch.dtype
) -> None:
    q, cache, tables, lens = decode_tests.make_inputs(DECODE_SEQ_LENS, 8, 2, 32, 16, dtype)
    q = q * q_gain
    out = decode_attention(q, cache, tables, lens, SCALE, num_splits=num_splits, sliding_window=window, softcap=softcap)
    expected = attention_reference.decode_attention(
        q, cache, tables, lens, SCALE, sliding_window=window, softcap=softcap
    )
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected.float(), atol=ATOL[dtype], rtol=RTOL[dtype])
    uncapped = attention_reference.decode_attention(q, cache, tables, lens, SCALE, sliding_window=window)
    assert (out.float() - uncapped.float()).abs().max() > 0.05


@pytest.mark.parametrize(("num_splits", "softcap", "q_gain"), [(1, 1.0, 1.0), (3, 2.0, 40.0)])
def test_triton_rotary_decode_matches_the_reference(num_splits: int, softcap: float, q_gain: float) -> None:
    """The new token's score, taken from registers, is capped as the cached tokens' are."""
    seq_lens = [37, 0, 1, 150, 65]
    _, cache, tables, lens = decode_tests.make_inputs(seq_lens, 8, 2, 32, 16, torch.float32)
    q, k, v, cos, sin, slots = new_tokens(seq_lens, tables, 8, 2, 32, 16, torch.float32)
    q = q * q_gain
    expected_cache = cache.clone()
    rotated_q, _ = attention_reference.rotary_write_kv_cache(q, k, v, cos, sin, expected_cache, slots)
    expected = attention_reference.decode_attention(rotated_q, expected_cache, tables, lens, SCALE, softcap=softcap)
    out = rotary_decode_attention(
        q, k, v, cos, sin, cache, slots, tables, lens, SCALE, num_splits=num_splits,
        max_seq_len=max(seq_lens), softcap=softcap,
    )  # fmt: skip
    torch.testing.assert_close(out, expected, atol=ATOL[torch.float32], rtol=0)


def test_cpu_dispatch_takes_the_softcap_path() -> None:
    """attention_ops.paged_attention on CPU with a cap (what a Gemma 2 layer runs there)."""
    q, cache, tables, loc, lens = _prefill_inputs(4, torch.float32, 1.0)
    q, cache, tables, loc, lens = q.cpu(), cache.cpu(), tables.cpu(), loc.cpu(), lens.cpu()
    key = value = torch.zeros(q.shape[0], 2, 32)  # already in the cache; the torch path reads it there
    out = attention_ops.paged_attention(
        q, key, value, cache, _cpu_meta(tables, loc, lens), SCALE, sliding_window=5, softcap=1.0
    )
    expected = attention_reference.prefill_attention(q, cache, tables, loc, lens, SCALE, sliding_window=5, softcap=1.0)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
