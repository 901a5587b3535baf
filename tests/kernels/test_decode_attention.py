"""Triton decode attention against the torch reference.

Without a GPU the kernels run in the Triton interpreter, on tiny shapes (the interpreter is
slow, and its bf16 arithmetic is wrong, so bf16 runs only on CUDA).
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.triton_decode_attention import choose_num_splits, decode_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")



def make_inputs(
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block tables of shuffled, non-contiguous block ids, padded with block 0; the cache has
    spare blocks that no sequence owns."""
    gen = torch.Generator().manual_seed(seed)
    max_num_blocks = max(1, -(-max(seq_lens) // block_size))
    num_blocks = len(seq_lens) * max_num_blocks + 3
    block_ids = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seq_lens), max_num_blocks, dtype=torch.int32)
    taken = 0
    for b, seq_len in enumerate(seq_lens):
        num_seq_blocks = -(-seq_len // block_size)
        block_tables[b, :num_seq_blocks] = block_ids[taken : taken + num_seq_blocks]
        taken += num_seq_blocks
    kv_shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(kv_shape, generator=gen).to(dtype)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return q.to(DEVICE), kv_cache.to(DEVICE), block_tables.to(DEVICE), seq_lens_t.to(DEVICE)


def check(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits) -> None:
    q, kv_cache, block_tables, seq_lens_t = make_inputs(
        seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    out = decode_attention(q, kv_cache, block_tables, seq_lens_t, scale, num_splits=num_splits)
    expected = reference.decode_attention(q, kv_cache, block_tables, seq_lens_t, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=ATOL[dtype], rtol=0)


# Lengths cover: a padding row (0), one token, partial last blocks, and contexts long enough
# for several 64-token tiles in one split.
SEQ_LENS = [37, 0, 1, 150, 64]
SHORT_SEQ_LENS = [37, 0, 1, 70]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_kv_heads", [8, 4, 2, 1])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_gqa_groups_and_block_sizes(block_size: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    head_dim = 32 if block_size == 4 else 64
    check(SHORT_SEQ_LENS, 8, num_kv_heads, head_dim, block_size, dtype, num_splits=3)


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_num_splits(head_dim: int, num_splits: int | None) -> None:
    check(SEQ_LENS, 8, 2, head_dim, 16, torch.float32, num_splits)


def test_more_splits_than_tiles() -> None:
    # Most splits of most rows are empty; an empty split must not disturb the result.
    check([5, 0, 70], 4, 2, 32, 4, torch.float32, num_splits=8)


def test_head_dim_not_power_of_two() -> None:
    check([23, 0, 90], 4, 2, 40, 16, torch.float16, num_splits=2)


def test_block_larger_than_tile() -> None:
    check([200, 7, 0], 4, 4, 32, 128, torch.float32, num_splits=None)


def test_group_larger_than_sixteen() -> None:
    check([45, 0], 32, 1, 32, 16, torch.float32, num_splits=2)


def test_all_rows_padding() -> None:
    q, kv_cache, block_tables, seq_lens = make_inputs([0, 0], 4, 2, 32, 4, torch.float32)
    out = decode_attention(q, kv_cache, block_tables, seq_lens, 0.1, num_splits=3)
    assert torch.equal(out, torch.zeros_like(q))


def test_choose_num_splits() -> None:
    # Large batch already fills the SMs; a single long sequence is split, but never into
    # splits shorter than 128 tokens; never more than 64 splits.
    assert choose_num_splits(64, 8, 2048, 132) == 1
    assert choose_num_splits(1, 8, 2048, 132) == 16
    assert choose_num_splits(1, 8, 100, 132) == 1
    assert choose_num_splits(1, 1, 1 << 20, 132) == 64
    assert choose_num_splits(0, 8, 0, 132) == 1


@requires_cuda
@pytest.mark.parametrize("num_splits", [1, 4, None])
def test_realistic_bf16(num_splits: int | None) -> None:
    gen = torch.Generator().manual_seed(1)
    seq_lens = torch.randint(1792, 2304, (64,), generator=gen)
    seq_lens[::17] = 0
    check(seq_lens.tolist(), 32, 8, 128, 16, torch.bfloat16, num_splits)


@requires_cuda
def test_cuda_graph_replay_with_new_lengths() -> None:
    q, kv_cache, block_tables, seq_lens = make_inputs(
        [300, 5, 0, 512], 32, 8, 128, 16, torch.bfloat16
    )
    scale = 128**-0.5

    def run() -> torch.Tensor:
        return decode_attention(q, kv_cache, block_tables, seq_lens, scale, max_seq_len=512)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    seq_lens.copy_(torch.tensor([512, 0, 77, 1], dtype=torch.int32))
    graph.replay()
    expected = reference.decode_attention(q, kv_cache, block_tables, seq_lens, scale)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=0)
