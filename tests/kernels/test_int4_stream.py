"""The stream-K batch-1 INT4 GEMV (kernels/triton_int4_stream.py) against the GPTQ reference:
ranges that end inside an output block and blocks that end inside a range, one program per
block and many, a ragged last output block, bias, groups of 128 and one group; semaphores
back at 0 and a rerun bit-identical (the slots are added in order).

Without a GPU: the Triton interpreter (fp32 products), tiny shapes. With one: llama-3.1-8b
shapes in bf16 and fp16 (x2 products) against the fp32 reference, and a CUDA graph replay.
"""

from __future__ import annotations

import pytest
import torch

from kernels import semaphores
from kernels.int4_rows import gptq_to_pairs
from kernels.triton_int4_stream import StreamConfig, gemv_stream, max_slots, stream_fits
from tests.kernels.test_int4_gemv import GEMV_TOLERANCES, cuda_only, gptq_tensors, randn, reference


def test_max_slots_bounds_the_programs_of_every_block() -> None:
    for total, programs, per_block in [(12, 5, 4), (12, 12, 4), (64, 7, 16), (1024, 264, 16), (30, 4, 3), (9, 9, 1)]:
        owners = [((s + 1) * programs - 1) // total for s in range(total)]
        assert owners == [p for p in range(programs) for _ in range(p * total // programs, (p + 1) * total // programs)]
        counts = [len(set(owners[b : b + per_block])) for b in range(0, total, per_block)]
        assert max(counts) <= max_slots(total, programs, per_block)


# (K, N, config, SMs): 4 output blocks x 4 steps over 5 programs (ranges of 3-4 steps cross
# blocks); 2 blocks x 2 steps over 2 (one program a block: no workspace); 3 blocks (the last
# ragged) x 2 steps over 6 programs (one step each: two programs a block).
CASES = [
    (512, 128, StreamConfig(32, 1, programs_per_sm=5, num_warps=2, num_stages=2), 1),
    (512, 64, StreamConfig(32, 2, programs_per_sm=1, num_warps=1), 2),
    (512, 40, StreamConfig(16, 2, programs_per_sm=3, num_warps=1, num_stages=1), 2),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("k", "n", "config", "num_sms"), CASES, ids=["crossing", "whole", "ragged"])
@pytest.mark.parametrize("group_size", [128, -1], ids=["g128", "one"])
def test_gemv_stream(dtype: torch.dtype, k: int, n: int, config: StreamConfig, num_sms: int, group_size: int) -> None:
    t = gptq_tensors(k, n, group_size, 1)
    x = randn(1, k, dtype=dtype, seed=2)
    bias = randn(n, dtype=dtype, seed=3)
    group = k if group_size == -1 else group_size
    pairs = gptq_to_pairs(t["qweight"])
    actual = gemv_stream(x, pairs, t["qzeros"], t["scales"], bias, group, 1, config, num_sms)
    expected = (reference(x, t, group_size, 1).float() + bias.float()).to(dtype)
    assert actual.dtype == dtype and actual.shape == (1, n)
    tol = GEMV_TOLERANCES[dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)
    assert int(semaphores.SETS["int4_stream", x.device].count_nonzero()) == 0
    assert torch.equal(gemv_stream(x, pairs, t["qzeros"], t["scales"], bias, group, 1, config, num_sms), actual)


def test_stream_fits_whole_steps_and_groups_of_128() -> None:
    config = StreamConfig(unroll=2)
    assert stream_fits(4096, 128, config) and stream_fits(14336, 14336, config)
    assert not stream_fits(4096, 64, config)  # groups under a block: kernels/triton_int4_rows.py
    assert not stream_fits(384, 128, config)  # 3 blocks: not whole steps of 2


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("k", "n"), [(4096, 6144), (4096, 28672), (14336, 4096)])
def test_cuda_llama_8b_shapes(dtype: torch.dtype, k: int, n: int) -> None:
    # x2 products and four-term sums in x's dtype: the bound of
    # test_int4_gemv.py::test_cuda_pairs_gemv_x2_math_against_fp32.
    t = gptq_tensors(k, n, 128, 1)
    x = randn(1, k, dtype=dtype, seed=12)
    actual = gemv_stream(x, gptq_to_pairs(t["qweight"]), t["qzeros"], t["scales"], None, 128, 1, StreamConfig()).float()
    expected = reference(x.float(), t, 128, 1)
    bound = {torch.bfloat16: 4.5e-3, torch.float16: 1e-3}[dtype]
    assert float((actual - expected).norm() / expected.norm()) < bound


@cuda_only
def test_cuda_graph_replays_the_stream_gemv() -> None:
    t = gptq_tensors(4096, 4096, 128, 1)
    args = (gptq_to_pairs(t["qweight"]), t["qzeros"], t["scales"], None, 128, 1, StreamConfig())
    x = randn(1, 4096, dtype=torch.bfloat16, seed=9)
    gemv_stream(x, *args)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv_stream(x, *args)
    for seed in (10, 11):
        x.copy_(randn(1, 4096, dtype=torch.bfloat16, seed=seed))
        graph.replay()
        torch.testing.assert_close(y, gemv_stream(x, *args), atol=0, rtol=0)
