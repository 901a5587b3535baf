"""Triton prefill attention against the torch reference.

Without a GPU the kernel runs in the Triton interpreter, on tiny shapes with small tiles so
that a sequence still spans several query and context tiles (the interpreter is slow, and its
bf16 arithmetic is wrong, so bf16 runs only on CUDA).

An fp8 cache (kv_dtype float8_e4m3fn) holds the reference's quantization of the same K/V
(the NaN outside every context included) under scales that are not 1; the reference reads it
back in fp32, the kernel upcasts and folds the scales in: the same tolerances as the q dtype.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_decode_attention import fp8_scales, to_fp8
from vllm_cluster.kernels.attention import reference as attention_reference
from vllm_cluster.kernels.attention.fp8_kv import FP8_KV_DTYPE
from vllm_cluster.kernels.attention.triton_prefill import (
    PrefillTileConfig,
    default_tile_config,
    prefill_attention,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# About one unit in the last place: early rows of a prompt average few values and stay as
# large as V itself, where the 16-bit output's rounding step exceeds the atol.
RTOL = {torch.float32: 0.0, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Query tiles of 16 or 32 rows (tokens x the q heads of a KV head); context tiles of 16 tokens
# (the whole tile in one 16-token cache block) or 32 (several blocks).
TILES_16 = PrefillTileConfig(16, 16, num_warps=4, num_stages=2)
TILES_32 = PrefillTileConfig(32, 32, num_warps=4, num_stages=2)



def make_inputs(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> q [T, Hq, D], kv_cache, block_tables, query_start_loc, seq_lens.

    Block ids are shuffled and non-contiguous; the tables are padded with a spare block. Every
    cache slot outside a context (spare blocks, the tail of a last block) holds NaN, so a read
    the kernel does not mask shows up in the output."""
    gen = torch.Generator().manual_seed(seed)
    max_num_blocks = max(1, -(-max(seq_lens) // block_size))
    num_blocks = len(seq_lens) * max_num_blocks + 3
    block_ids = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(seq_lens), max_num_blocks), int(block_ids[-1]), dtype=torch.int32)
    in_context = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    taken = 0
    for b, seq_len in enumerate(seq_lens):
        num_seq_blocks = -(-seq_len // block_size)
        seq_blocks = block_ids[taken : taken + num_seq_blocks]
        block_tables[b, :num_seq_blocks] = seq_blocks
        in_context[seq_blocks] = (torch.arange(num_seq_blocks * block_size) < seq_len).view(-1, block_size)
        taken += num_seq_blocks
    kv_cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=gen)
    kv_cache = kv_cache.masked_fill(~in_context[:, None, :, None, None], float("nan"))
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return (q.to(DEVICE, dtype), kv_cache.to(DEVICE, dtype), block_tables.to(DEVICE),
            query_start_loc.to(DEVICE), seq_lens_t.to(DEVICE))


def check(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    config: PrefillTileConfig | None,
    kv_dtype: torch.dtype | None = None,
) -> None:
    q, kv_cache, block_tables, query_start_loc, seq_lens_t = make_inputs(
        q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    k_scale = v_scale = None
    if kv_dtype == FP8_KV_DTYPE:
        k_scale, v_scale = fp8_scales()
        kv_cache = to_fp8(kv_cache, k_scale, v_scale)
    out = prefill_attention(
        q, kv_cache, block_tables, query_start_loc, seq_lens_t, scale, max(q_lens), config=config,
        k_scale=k_scale, v_scale=v_scale,
    )
    expected = attention_reference.prefill_attention(
        q, kv_cache, block_tables, query_start_loc, seq_lens_t, scale, k_scale, v_scale
    )
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=ATOL[dtype], rtol=RTOL[dtype])


# (a) a fresh 37-token prompt: several query tiles, the first context tiles unmasked;
# (b) a q_len 0 row in the middle; (c) a 20-token chunk after a 17-token cached prefix (query
# tiles that end on a context tile boundary);
# (d) a decode row (q_len 1) over 17 tokens; a trailing q_len 0 padding row (seq_len 0).
MIXED_Q_LENS = [37, 0, 20, 1, 0]
MIXED_SEQ_LENS = [37, 9, 37, 17, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_batch(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    # 16-token context tiles read one cache block of 16 whole; 32-token tiles span several.
    config = TILES_16 if head_dim == 32 else TILES_32
    check(MIXED_Q_LENS, MIXED_SEQ_LENS, 4, num_kv_heads, head_dim, block_size, dtype, config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("block_size", "config"), [(4, TILES_16), (16, TILES_32), (32, TILES_16)])
def test_fp8_cache(block_size: int, config: PrefillTileConfig, dtype: torch.dtype) -> None:
    # The mixed batch has a 20-token chunk after a 17-token cached prefix and a decode row.
    check(MIXED_Q_LENS, MIXED_SEQ_LENS, 4, 2, 32, block_size, dtype, config, kv_dtype=FP8_KV_DTYPE)


@pytest.mark.parametrize("block_size", [32, 256])
def test_context_tile_inside_one_cache_block(block_size: int) -> None:
    check([30, 1, 18], [300, 40, 18], 2, 1, 32, block_size, torch.float32, TILES_16)


def test_default_tiles() -> None:
    check([70, 3, 0], [100, 64, 5], 4, 2, 32, 16, torch.float16, None)


def test_group_not_power_of_two() -> None:
    # 3 q heads per KV head: a 16-row tile holds 5 tokens and one unused row.
    check(MIXED_Q_LENS, MIXED_SEQ_LENS, 6, 2, 32, 4, torch.float32, TILES_16)


def test_group_of_thirty_two() -> None:
    # The default tiles grow to hold one token of all 32 heads.
    check([9, 1], [12, 5], 32, 1, 32, 16, torch.float32, None)


def test_head_dim_not_power_of_two() -> None:
    check([21, 1], [40, 9], 4, 2, 48, 4, torch.float32, TILES_16)


def test_strided_query_and_rows_outside_every_sequence() -> None:
    # q as the head of a fused qkv projection; two trailing rows belong to no sequence.
    q, kv_cache, block_tables, query_start_loc, seq_lens = make_inputs(
        [19, 1], [25, 6], 4, 2, 32, 4, torch.float32
    )
    qkv = torch.cat([q, torch.randn_like(q)], dim=1)
    qkv = torch.cat([qkv, torch.full_like(qkv[:2], float("nan"))])  # [T + 2, 2 * Hq, D]
    q_view = qkv[:, :4]
    out = prefill_attention(q_view, kv_cache, block_tables, query_start_loc, seq_lens, 0.2, 19,
                            config=TILES_16)
    expected = attention_reference.prefill_attention(q_view, kv_cache, block_tables, query_start_loc, seq_lens, 0.2)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=0)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))

    given = torch.full_like(q_view, 7.0)
    prefill_attention(q_view, kv_cache, block_tables, query_start_loc, seq_lens, 0.2, 19,
                      out=given, config=TILES_16)
    torch.testing.assert_close(given[:-2], expected[:-2], atol=1e-4, rtol=0)
    assert torch.equal(given[-2:], torch.full_like(given[-2:], 7.0))


def test_no_query_rows() -> None:
    q, kv_cache, block_tables, query_start_loc, seq_lens = make_inputs(
        [0, 0], [5, 0], 4, 2, 32, 4, torch.float32
    )
    out = prefill_attention(q, kv_cache, block_tables, query_start_loc, seq_lens, 0.2, 0)
    assert out.shape == (0, 4, 32)


def test_default_tile_config() -> None:
    # Query tiles no taller than a batch of short chunks needs; 128 rows for long prompts;
    # always room for one token of every head of a group.
    assert default_tile_config(128, torch.bfloat16, 1, 4).block_m == 16
    assert default_tile_config(128, torch.bfloat16, 16, 4).block_m == 64
    assert default_tile_config(128, torch.bfloat16, 2048, 4) == PrefillTileConfig(128, 32, 8, 2)
    assert default_tile_config(128, torch.bfloat16, 1, 64).block_m == 64
    assert default_tile_config(64, torch.float32, 2048, 1).block_m == 64


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_realistic_prompts_and_chunks(dtype: torch.dtype) -> None:
    # Two fresh prompts, two chunks after cached prefixes, a decode row and a padding row.
    q_lens = [2048, 512, 1024, 1, 777, 0]
    seq_lens = [2048, 1536, 1024, 900, 2000, 0]
    check(q_lens, seq_lens, 32, 8, 128, 16, dtype, None)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_realistic_prompts_and_chunks_with_fp8_cache(dtype: torch.dtype) -> None:
    q_lens = [2048, 512, 1024, 1, 777, 0]
    seq_lens = [2048, 1536, 1024, 900, 2000, 0]
    check(q_lens, seq_lens, 32, 8, 128, 16, dtype, None, kv_dtype=FP8_KV_DTYPE)


@requires_cuda
@pytest.mark.parametrize("config", [None, PrefillTileConfig(64, 64, 4, 3), PrefillTileConfig(128, 128, 8, 2)])
def test_realistic_tiles(config: PrefillTileConfig | None) -> None:
    check([600, 1500, 64], [1100, 1500, 2047], 32, 8, 128, 16, torch.bfloat16, config)


@requires_cuda
@pytest.mark.parametrize("max_query_len", [1, 16, 40])
def test_realistic_short_chunks(max_query_len: int) -> None:
    # Mixed batches of many short chunks over long contexts take the short query tiles.
    gen = torch.Generator().manual_seed(2)
    q_lens = torch.randint(1, max_query_len + 1, (24,), generator=gen).tolist()
    prefix_lens = torch.randint(0, 3000, (24,), generator=gen).tolist()
    seq_lens = [q + p for q, p in zip(q_lens, prefix_lens, strict=True)]
    check(q_lens, seq_lens, 32, 8, 128, 16, torch.bfloat16, None)


@requires_cuda
def test_realistic_block_sizes_and_head_dims() -> None:
    for block_size, head_dim in [(1, 64), (64, 128), (256, 64), (16, 96)]:
        check([700, 1, 300], [700, 513, 1800], 16, 4, head_dim, block_size, torch.bfloat16, None)
