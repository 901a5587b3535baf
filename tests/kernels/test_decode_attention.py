"""Triton decode attention against the torch reference.

Without a GPU the kernels run in the Triton interpreter, on tiny shapes (the interpreter is
slow, and its bf16 arithmetic is wrong, so bf16 runs only on CUDA).

An fp8 cache (kv_dtype float8_e4m3fn) holds the reference's own quantization of random K/V
under scales that are not 1; the reference reads it back (fp8 * scale) in fp32, the kernel
upcasts and folds the scales in, so the two differ by rounding in the q dtype only: the same
tolerances. What fp8 itself costs (3 mantissa bits: up to 2^-4 relative per element) is
bounded separately, against the unquantized cache.
"""

from __future__ import annotations

import pytest
import torch

from vllm_cluster.kernels.attention import reference as attention_reference
from vllm_cluster.kernels.attention import triton_decode
from vllm_cluster.kernels.attention.fp8_kv import FP8_KV_DTYPE, quantize
from vllm_cluster.kernels.attention.triton_decode import choose_num_splits, decode_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# K and V scales of the fp8 tests: K's maps |K| <= ~4.5 to <= 448 (no saturation), V's is
# small enough that some V saturates at +-448 * 0.008 = 3.6 (the kernel must read what the
# cache holds, clamped values included).
K_SCALE, V_SCALE = 0.01, 0.008


def fp8_scales() -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([K_SCALE], device=DEVICE), torch.tensor([V_SCALE], device=DEVICE))



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


def to_fp8(kv_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """The cache as an fp8 cache stores it (reference quantization, per K and V)."""
    fp8 = torch.empty(kv_cache.shape, dtype=FP8_KV_DTYPE, device=kv_cache.device)
    fp8[:, 0] = quantize(kv_cache[:, 0], k_scale, FP8_KV_DTYPE)
    fp8[:, 1] = quantize(kv_cache[:, 1], v_scale, FP8_KV_DTYPE)
    return fp8


def check(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits, kv_dtype=None) -> None:
    q, kv_cache, block_tables, seq_lens_t = make_inputs(
        seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    k_scale = v_scale = None
    if kv_dtype == FP8_KV_DTYPE:
        k_scale, v_scale = fp8_scales()
        kv_cache = to_fp8(kv_cache, k_scale, v_scale)
    out = decode_attention(
        q, kv_cache, block_tables, seq_lens_t, scale, num_splits=num_splits, k_scale=k_scale, v_scale=v_scale
    )
    expected = attention_reference.decode_attention(q, kv_cache, block_tables, seq_lens_t, scale, k_scale, v_scale)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_size", [1, 16])
def test_fp8_cache(block_size: int, num_splits: int, dtype: torch.dtype) -> None:
    check(SHORT_SEQ_LENS, 8, 2, 32, block_size, dtype, num_splits, kv_dtype=FP8_KV_DTYPE)


def test_fp8_cache_stays_close_to_the_unquantized_one() -> None:
    """What fp8 itself costs. Each stored K/V element is off by at most 2^-4 of itself
    (round to nearest with 3 mantissa bits, for values above e4m3's subnormals: 2^-6 *
    scale), so the output, a convex mix of V rows, is off by up to 2^-4 * max|V| (reached
    where a row attends one token), plus what the scores move (K's error, dotted with q:
    a few hundredths here). Bound: 1.25 * 2^-4 * max|V|; a wrong scale is off by the ratio
    of the scales, of the order of |V| itself."""
    q, kv_cache, block_tables, seq_lens = make_inputs(SEQ_LENS, 8, 2, 64, 16, torch.float32)
    k_scale, v_scale = fp8_scales()
    v_scale = torch.tensor([5.0 / 448], device=DEVICE)  # no saturation here: only rounding
    out = decode_attention(
        q, to_fp8(kv_cache, k_scale, v_scale), block_tables, seq_lens, 64**-0.5, num_splits=2,
        k_scale=k_scale, v_scale=v_scale,
    )
    exact = attention_reference.decode_attention(q, kv_cache, block_tables, seq_lens, 64**-0.5)
    error = float((out - exact).abs().max())
    bound = 1.25 * 2**-4 * float(kv_cache[:, 1].abs().max())
    assert 0 < error <= bound, (error, bound)


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
@pytest.mark.parametrize("num_splits", [1, 4, None])
def test_realistic_bf16_with_fp8_cache(num_splits: int | None) -> None:
    gen = torch.Generator().manual_seed(3)
    seq_lens = torch.randint(1792, 2304, (64,), generator=gen)
    seq_lens[::17] = 0
    check(seq_lens.tolist(), 32, 8, 128, 16, torch.bfloat16, num_splits, kv_dtype=FP8_KV_DTYPE)


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
    expected = attention_reference.decode_attention(q, kv_cache, block_tables, seq_lens, scale)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=0)


@requires_cuda
def test_cuda_graph_reads_fp8_scales_from_device_memory() -> None:
    """A replay uses the scales' current values: they are tensors, not captured constants."""
    q, kv_cache, block_tables, seq_lens = make_inputs([300, 5, 0, 512], 32, 8, 128, 16, torch.bfloat16)
    k_scale, v_scale = fp8_scales()
    fp8_cache = to_fp8(kv_cache, k_scale, v_scale)

    def run() -> torch.Tensor:
        return decode_attention(q, fp8_cache, block_tables, seq_lens, 128**-0.5, max_seq_len=512,
                                k_scale=k_scale, v_scale=v_scale)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    k_scale.mul_(2.0)
    v_scale.mul_(0.5)
    graph.replay()
    expected = attention_reference.decode_attention(q, fp8_cache, block_tables, seq_lens, 128**-0.5, k_scale, v_scale)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=0)


def test_every_partial_read_is_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split partials start as NaN: every split, an empty one too, must write the partial
    the combine reads. (Skipping the empty splits instead, the combine reading only those
    holding tokens, was measured neutral to slower on the H200 by benchmarks/bench_decode_attention.py.)"""

    def poisoned(q: torch.Tensor, num_splits: int, head_dim_pad: int) -> tuple[torch.Tensor, ...]:
        return tuple(t.fill_(float("nan")) for t in new_partials(q, num_splits, head_dim_pad))

    new_partials = triton_decode._new_partials
    monkeypatch.setattr(triton_decode, "_new_partials", poisoned)
    # 8 splits of whole 64-token tiles: 70 tokens fill two, 37 and 1 one, 0 none
    check([37, 0, 1, 70], 8, 2, 32, 16, torch.float32, num_splits=8)
