"""The Triton MLA decode kernel (absorbed form, over the paged latent cache) against the torch
path, and both against attention written out per head from the same entries.

Without a GPU the kernels run in the Triton interpreter on tiny shapes (fp32: the
interpreter's bf16 arithmetic is wrong).
"""

from __future__ import annotations

import pytest
import torch

from vllm_cluster.kernels.attention import mla_torch
from vllm_cluster.kernels.attention.metadata import AttentionMetadata, make_plan
from vllm_cluster.kernels.attention.triton_mla_decode import (
    TileConfig,
    choose_mla_splits,
    default_tile_config,
    mla_decode_attention,
    write_latent_cache,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LATENT, ROPE = 32, 8


def make_inputs(
    seq_lens: list[int], num_heads: int, block_size: int, latent: int = LATENT, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [B, H, R + P], cache [NB, 1, BS, 1, R + P], block tables of shuffled block ids,
    padded with block 0; spare blocks no sequence owns)."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(1, -(-max(seq_lens) // block_size))
    num_blocks = len(seq_lens) * max_blocks + 3
    block_ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    taken = 0
    for b, seq_len in enumerate(seq_lens):
        n = -(-seq_len // block_size)
        tables[b, :n] = block_ids[taken : taken + n]
        taken += n
    cache = torch.randn(num_blocks, 1, block_size, 1, latent + ROPE, generator=gen)
    q = torch.randn(len(seq_lens), num_heads, latent + ROPE, generator=gen)
    return q, cache, tables


def per_head_attention(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
    latent = q.shape[-1] - ROPE
    """The definition: each head scores every cached entry (key: the whole entry) and sums
    their latents (value), in fp64."""
    out = torch.zeros(q.shape[0], q.shape[1], latent, dtype=torch.float64)
    for b, seq_len in enumerate(seq_lens):
        if seq_len:
            entries = cache[tables[b].long(), 0, :, 0].flatten(0, 1)[:seq_len].double()  # [L, R + P]
            probs = (q[b].double() @ entries.T * 0.3).softmax(-1)  # [H, L]
            out[b] = probs @ entries[:, :latent]
    return out


def decode_meta(tables: torch.Tensor, seq_lens: list[int]) -> AttentionMetadata:
    query_start_loc = list(range(len(seq_lens) + 1))
    return AttentionMetadata(
        slot_mapping=torch.zeros(len(seq_lens), dtype=torch.long),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        cpu_plan=make_plan(query_start_loc, seq_lens),
    )


@pytest.mark.parametrize(
    ("seq_lens", "num_heads", "block_size", "num_splits", "latent"),
    [
        ([5, 17, 1], 4, 4, 1, LATENT),  # heads padded to a block of 16; contexts not a tile multiple
        ([40, 9], 20, 8, 3, LATENT),  # two head blocks (the last partial), split-K with one split empty for 9
        ([33, 0], 16, 16, 2, LATENT),  # a padding row (seq_len 0) gives zeros
        ([7, 20], 4, 4, 2, 24),  # a latent width that is not a power of two
    ],
)
def test_triton_mla_decode_matches_torch_path_and_definition(
    seq_lens: list[int], num_heads: int, block_size: int, num_splits: int, latent: int
) -> None:
    q, cache, tables = make_inputs(seq_lens, num_heads, block_size, latent)
    expected = per_head_attention(q, cache, tables, seq_lens)
    live = [b for b, n in enumerate(seq_lens) if n]
    torch_path = mla_torch.mla_attention(q, cache, decode_meta(tables, seq_lens), 0.3, latent)
    torch.testing.assert_close(torch_path[live].double(), expected[live], atol=1e-4, rtol=1e-4)
    triton_out = mla_decode_attention(
        q.to(DEVICE), cache.to(DEVICE), tables.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        0.3, latent, num_splits=num_splits, tiles=TileConfig(block_h=16, tile_n=16, num_warps=4, num_stages=1),
    )  # fmt: skip
    assert triton_out.shape == (len(seq_lens), num_heads, latent)
    torch.testing.assert_close(triton_out.cpu().double(), expected, atol=1e-4, rtol=1e-4)


def test_write_latent_cache_skips_padding_slots_like_the_torch_path() -> None:
    gen = torch.Generator().manual_seed(1)
    entries = torch.randn(4, LATENT + ROPE, generator=gen)
    slots = torch.tensor([5, -1, 0, 11])
    expected = torch.zeros(3, 1, 4, 1, LATENT + ROPE)
    mla_torch.write_latent_cache(entries, expected, slots)
    assert expected[1, 0, 1, 0].equal(entries[0]) and expected[2, 0, 3, 0].equal(entries[3])
    assert int((expected.abs().sum(-1) > 0).sum()) == 3  # the padding token wrote nothing
    cache = torch.zeros(3, 1, 4, 1, LATENT + ROPE, device=DEVICE)
    write_latent_cache(entries.to(DEVICE), cache, slots.to(DEVICE))
    assert cache.cpu().equal(expected)


def test_splits_fill_the_gpu_but_keep_partials_small() -> None:
    # 16 heads: a split reads >= 512 tokens, so L=2048 takes at most 4 (occupancy asks 8).
    assert choose_mla_splits(64, 16, 1, 2048, num_sms=132) == 4
    # 128 heads: one split (its partials would rival the context); one sequence: up to 32.
    assert choose_mla_splits(64, 128, 4, 2048, num_sms=132) == 1
    assert choose_mla_splits(1, 16, 1, 32768, num_sms=132) == 32
    assert choose_mla_splits(256, 16, 1, 16, num_sms=132) == 1


@pytest.mark.parametrize("max_scores", [1 << 26, 4 * 13 * 2], ids=["whole", "chunks-of-2-queries"])
def test_torch_prefill_after_a_cached_prefix_matches_the_definition(
    max_scores: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last 6 of 13 tokens attend causally over the cached 7 and themselves; in query
    chunks when the scores would pass the limit."""
    monkeypatch.setattr(mla_torch, "_MAX_SCORES", max_scores)
    _, cache, tables = make_inputs([13], 4, 4)
    q = torch.randn(6, 4, LATENT + ROPE, generator=torch.Generator().manual_seed(2))
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(6, dtype=torch.long),
        block_tables=tables,
        seq_lens=torch.tensor([13], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 6], dtype=torch.int32),
        max_query_len=6,
        max_seq_len=13,
        cpu_plan=make_plan([0, 6], [13]),
    )
    out = mla_torch.mla_attention(q, cache, meta, 0.3, LATENT)
    for i in range(6):  # query i sits at position 7 + i: it sees the first 8 + i entries
        expected = per_head_attention(q[i : i + 1], cache, tables, [8 + i])
        torch.testing.assert_close(out[i : i + 1].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads", [20, 40])
def test_default_tiles_for_many_heads_match_the_definition(num_heads: int) -> None:
    """Past 16 heads the default tiles take 32 and then 64 heads per program (a partial head
    block for both counts here)."""
    assert default_tile_config(num_heads).block_h == (32 if num_heads <= 32 else 64)
    seq_lens = [21, 6]
    q, cache, tables = make_inputs(seq_lens, num_heads, 4)
    triton_out = mla_decode_attention(
        q.to(DEVICE), cache.to(DEVICE), tables.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        0.3, LATENT, num_splits=1,
    )  # fmt: skip
    torch.testing.assert_close(triton_out.cpu().double(), per_head_attention(q, cache, tables, seq_lens),
                               atol=1e-4, rtol=1e-4)  # fmt: skip
