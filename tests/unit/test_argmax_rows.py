"""The sampler's two-stage argmax gives torch.argmax's answer, ties included (the lowest
index wins), so greedy tokens do not depend on which path ran."""

from __future__ import annotations

import pytest
import torch

from vllm_cluster.engine.sampler import _argmax_chunks, argmax_rows, chunked_argmax


@pytest.mark.parametrize("chunks", [4, 16, 64])
def test_chunked_argmax_equals_argmax(chunks: int) -> None:
    g = torch.Generator().manual_seed(chunks)
    x = torch.randn(5, 1024, generator=g)
    assert torch.equal(chunked_argmax(x, chunks), x.argmax(dim=-1))


def test_ties_pick_the_lowest_index_across_and_within_chunks() -> None:
    x = torch.zeros(3, 64)
    x[0, [40, 9, 63]] = 7.0  # across chunks: 9 wins
    x[1, [17, 18]] = 3.0  # within one chunk: 17 wins
    x[2] = -1.0  # all equal: 0 wins
    assert chunked_argmax(x, 8).tolist() == [9, 17, 0] == x.argmax(dim=-1).tolist()


def test_chunk_counts_divide_the_vocabulary() -> None:
    for vocab in (128256, 49152, 151936, 32000, 32064):
        chunks = _argmax_chunks(vocab)
        assert 128 <= chunks <= 1024 and vocab % chunks == 0, (vocab, chunks)
    assert _argmax_chunks(1000) == 0  # short rows: one stage
    assert _argmax_chunks(65537) == 0  # a prime: no equal chunks, one stage


def test_argmax_rows_on_cpu_is_torch_argmax() -> None:
    x = torch.randn(2, 49152, generator=torch.Generator().manual_seed(0))
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
