"""The pairs and tiles INT4 layouts (kernels/int4/layouts.py) and their tensor-core kernel
(kernels/int4/triton_mma.py) against the GPTQ reference (kernels/int4/reference.py).

Without a GPU: the Triton interpreter (the plain-op weight conversion), tiny shapes.
With one: the PTX conversion at Llama-8B shapes, and a CUDA graph replay.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from tests.kernels.test_int4_gemv import (
    DEVICE,
    GEMV_CONFIGS,
    GEMV_TOLERANCES,
    cuda_only,
    gptq_tensors,
    randn,
    reference,
)
from vllm_cluster.kernels.int4 import dispatch as int4_ops
from vllm_cluster.kernels.int4 import reference as int4_reference
from vllm_cluster.kernels.int4 import triton_mma
from vllm_cluster.kernels.int4.layouts import (
    gptq_to_pairs,
    pairs_layout_fits,
    pairs_to_tiles,
    tiles_layout_fits,
    tiles_to_pairs,
    unpack_pairs_layout,
)
from vllm_cluster.kernels.int4.triton_mma import MmaConfig, dequantize_pairs, int4_mma, pick_mma_config
from vllm_cluster.kernels.int4.triton_rows import RowsGemvConfig, gemv_rows
from vllm_cluster.kernels.int4.weight import Int4Weight

# x and the weights 128 + q are bf16 (exact), products and sums fp32: the result rounds once
# to x's dtype; bf16's 8 bits give a relative error up to 2^-8 per output.
TOLERANCE = 1e-2



def gptq_weight(t: dict[str, torch.Tensor]) -> Int4Weight:
    """GPTQ's own layout of gptq_tensors' weight, groups of 128, zero offset 1 (v1)."""
    return Int4Weight(t["qweight"], t["qzeros"], t["scales"], None, 128, "gptq", 1)

def test_pairs_repack_is_exact_and_places_each_input() -> None:
    k, n = 256, 24
    qweight = torch.randint(-(2**31), 2**31, (k // 8, n), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    pairs = gptq_to_pairs(qweight)
    assert pairs.shape == (n, k // 8) and pairs.dtype == torch.int32
    q = int4_reference.unpack_rows(qweight)  # [K, N]
    assert torch.equal(unpack_pairs_layout(pairs), q)
    halves = pairs.view(torch.int16)  # little-endian: half 2w is the low half of word w
    for out, block, p, c in [(0, 0, 0, 0), (5, 0, 3, 31), (23, 1, 2, 9), (11, 1, 1, 16)]:
        half = int(halves[out, 32 * block + c]) & 0xFFFF
        assert (half >> (4 * p)) & 0xF == int(q[128 * block + 32 * p + c, out])


def test_tiles_hold_each_lanes_words_in_one_piece() -> None:
    # Tile r, block b, lane (g, t): pairs words 16 b + 4 t .. + 3 of outputs 16 r + g, then + 8.
    k, n = 256, 32
    t = {name: tensor.cpu() for name, tensor in gptq_tensors(k, n, 128, 1).items()}
    pairs = gptq_to_pairs(t["qweight"])
    tiles = pairs_to_tiles(pairs)
    assert tiles.shape == (n // 16, k // 128, 256) and torch.equal(tiles_to_pairs(tiles), pairs)
    for r, b, g, lane_t in [(0, 0, 0, 0), (1, 1, 7, 3), (1, 0, 2, 1), (0, 1, 5, 2)]:
        lane = tiles[r, b, 8 * (4 * g + lane_t) : 8 * (4 * g + lane_t) + 8]
        words = slice(16 * b + 4 * lane_t, 16 * b + 4 * lane_t + 4)
        assert torch.equal(lane, torch.cat([pairs[16 * r + g, words], pairs[16 * r + g + 8, words]]))
    dequantized = int4_reference.dequantize(Int4Weight(tiles, t["qzeros"], t["scales"], None, 128, "tiles", 1))
    gptq = gptq_weight(t)
    assert torch.equal(dequantized, int4_reference.dequantize(gptq))


def test_tiles_layout_fits() -> None:
    assert tiles_layout_fits(4096, [4096, 1024, 1024], 128) and tiles_layout_fits(512, [48], 256)
    assert tiles_layout_fits(256, [16], -1)
    assert not tiles_layout_fits(4096, [4096, 1032, 1032], 128)  # parts of whole tiles (SiLU reads up as tiles)
    assert not tiles_layout_fits(4096, [4096], 64) and not tiles_layout_fits(192, [64], -1)


CONFIGS = [
    MmaConfig(16, 16, 1),
    MmaConfig(32, 16, 3, num_warps=1, num_stages=2),
    MmaConfig(16, 16, 2, num_stages=1, early=True),
]


@pytest.mark.parametrize("config", CONFIGS, ids=["split1", "split3", "split2-early"])
@pytest.mark.parametrize(("group_size", "zero_offset"), [(32, 1), (128, 0), (256, 1)], ids=["g32", "g128", "g256"])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("tiled", [False, True], ids=["pairs", "tiles"])
def test_int4_mma(config: MmaConfig, group_size: int, zero_offset: int, m: int, tiled: bool) -> None:
    # N = 40 (pairs) or 48 (tiles of 16): a ragged last block of outputs; K = 512: 4 blocks, split 3 ways unevenly.
    k, n = 512, 48 if tiled else 40
    t = gptq_tensors(k, n, group_size, zero_offset)
    x = randn(m, k, dtype=torch.bfloat16, seed=2)
    bias = randn(n, dtype=torch.bfloat16, seed=3)
    qweight = pairs_to_tiles(gptq_to_pairs(t["qweight"])) if tiled else gptq_to_pairs(t["qweight"])
    weight = Int4Weight(qweight, t["qzeros"], t["scales"], None, group_size, "tiles" if tiled else "pairs", zero_offset)
    actual = int4_mma(x, weight, bias, config)
    expected = (reference(x, t, group_size, zero_offset).float() + bias.float()).to(torch.bfloat16)
    assert actual.dtype == torch.bfloat16 and actual.shape == (m, n)
    torch.testing.assert_close(actual, expected, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("config", GEMV_CONFIGS, ids=["split1", "split3", "unroll2"])
@pytest.mark.parametrize(("group_size", "zero_offset"), [(32, 1), (128, 0), (256, 1)], ids=["g32", "g128", "g256"])
def test_gemv_rows_on_the_pairs_layout(
    config: RowsGemvConfig, group_size: int, zero_offset: int, dtype: torch.dtype
) -> None:
    # The CUDA-core batch-1 GEMV (kernels/int4/triton_rows.py) reading the pairs layout; a
    # 16-bit x is read as 32-bit pairs, fp32 x element by element.
    k, n = 512, 40
    t = gptq_tensors(k, n, group_size, zero_offset)
    x = randn(1, k, dtype=dtype, seed=2)
    bias = randn(n, dtype=dtype, seed=3)
    pairs = gptq_to_pairs(t["qweight"])
    weight = Int4Weight(pairs, t["qzeros"], t["scales"], None, group_size, "pairs", zero_offset)
    actual = gemv_rows(x, weight, bias, config)
    expected = (reference(x, t, group_size, zero_offset).float() + bias.float()).to(dtype)
    tol = GEMV_TOLERANCES[dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def test_int4_mma_rows_of_x_past_one_tile() -> None:
    # 20 rows: two M tiles, the second ragged; fp32 sums leave one rounding to bf16.
    k, n = 256, 16
    t = gptq_tensors(k, n, 128, 1)
    x = randn(20, k, dtype=torch.bfloat16, seed=5)
    weight = Int4Weight(gptq_to_pairs(t["qweight"]), t["qzeros"], t["scales"], None, 128, "pairs", 1)
    actual = int4_mma(x, weight, None, CONFIGS[1])
    torch.testing.assert_close(actual, reference(x, t, 128, 1), atol=TOLERANCE, rtol=TOLERANCE)


def test_pairs_layout_fits() -> None:
    assert pairs_layout_fits(4096, 128) and pairs_layout_fits(14336, 128) and pairs_layout_fits(256, -1)
    assert pairs_layout_fits(256, 32) and pairs_layout_fits(512, 256)
    assert not pairs_layout_fits(256, 16)  # a run of 32 inputs would straddle two groups
    assert not pairs_layout_fits(96, 32) and not pairs_layout_fits(384, 96)


@pytest.mark.parametrize(("group_size", "tiled"), [(64, False), (256, False), (128, True), (256, True)])
def test_dequantize_pairs(group_size: int, tiled: bool) -> None:
    t = gptq_tensors(512, 48, group_size, 1)
    pairs = gptq_to_pairs(t["qweight"])
    qweight, layout = (pairs_to_tiles(pairs), "tiles") if tiled else (pairs, "pairs")
    weight = dequantize_pairs(Int4Weight(qweight, t["qzeros"], t["scales"], None, group_size, layout, 1), torch.float32)
    expected = int4_reference.dequantize(dataclasses.replace(gptq_weight(t), group_size=group_size))
    torch.testing.assert_close(weight, expected, atol=0, rtol=0)


@pytest.mark.parametrize("layout", ["pairs", "tiles"])
def test_dispatch_on_cpu_is_the_reference(layout: str) -> None:
    k, n = 256, 32
    t = {name: tensor.cpu() for name, tensor in gptq_tensors(k, n, 128, 1).items()}
    x = torch.randn(3, k)
    pairs = gptq_to_pairs(t["qweight"])
    qweight = pairs_to_tiles(pairs) if layout == "tiles" else pairs
    weight = dataclasses.replace(gptq_weight(t), qweight=qweight, layout=layout)
    actual = int4_ops.int4_gemm(x, weight)
    expected = int4_reference.int4_gemm(x, gptq_weight(t))
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("k", "n"), [(4096, 6144), (14336, 4096)])
@pytest.mark.parametrize("m", [1, 4, 16, 64, 200])
@pytest.mark.parametrize("layout", ["pairs", "tiles"])
def test_int4_mma_llama_shapes(k: int, n: int, m: int, dtype: torch.dtype, layout: str) -> None:
    # Through the dispatch: the MMA GEMV up to 8 rows, tl.dot up to 128, then cuBLAS on the dequantized weight.
    t = gptq_tensors(k, n, 128, 1)
    x = randn(m, k, dtype=dtype, seed=6)
    pairs = gptq_to_pairs(t["qweight"])
    qweight = pairs_to_tiles(pairs) if layout == "tiles" else pairs
    weight = dataclasses.replace(gptq_weight(t), qweight=qweight, layout=layout)
    actual = int4_ops.int4_gemm(x, weight).float()
    expected = int4_reference.int4_gemm(x.float(), gptq_weight(t))
    assert float((actual - expected).norm() / expected.norm()) < 4e-3


@cuda_only
@pytest.mark.parametrize(
    "config", [MmaConfig(64, 16, 5, num_warps=1), MmaConfig(128, 16, 3, num_warps=4, early=True), None]
)
@pytest.mark.parametrize("layout", ["pairs", "tiles"])
def test_int4_mma_other_configs_on_gpu(config: MmaConfig | None, layout: str) -> None:
    # None: one row on the tl.dot kernel through the dispatch (ONE_ROW_ON_TL_DOT).
    k, n = 4096, 4096
    t = gptq_tensors(k, n, 128, 1)
    x = randn(1, k, dtype=torch.bfloat16, seed=8)
    pairs = gptq_to_pairs(t["qweight"])
    qweight = pairs_to_tiles(pairs) if layout == "tiles" else pairs
    weight = dataclasses.replace(gptq_weight(t), qweight=qweight, layout=layout)
    if config is None:

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(triton_mma, "ONE_ROW_ON_TL_DOT", True)
            actual = int4_ops.int4_gemm(x, weight).float()
    else:
        actual = int4_mma(x, weight, None, config).float()
    expected = int4_reference.int4_gemm(x.float(), gptq_weight(t))
    assert float((actual - expected).norm() / expected.norm()) < 4e-3


@cuda_only
def test_int4_mma_graph_replay_resets_semaphores() -> None:
    k, n = 4096, 4096
    t = gptq_tensors(k, n, 128, 1)
    pairs = gptq_to_pairs(t["qweight"])
    x = randn(1, k, dtype=torch.bfloat16, seed=7)
    config = dataclasses.replace(pick_mma_config(1, n, k, 132), split_k=8)
    weight = Int4Weight(pairs, t["qzeros"], t["scales"], None, 128, "pairs", 1)
    eager = int4_mma(x, weight, None, config)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int4_mma(x, weight, None, config)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, eager, atol=0, rtol=0)
    assert DEVICE == "cuda"


# Compiled for sm_90 without a GPU (benchmarks/kernel_sass.py, in a process without the
# interpreter): the PTX conversion, which the interpreter does not run, builds, and the loop
# holds the two-weight instructions and the MMAs it should.
_COMPILE = """
import json, sys
from benchmarks.kernel_sass import main_loop, sass
from vllm_cluster.kernels.int4 import triton_mma
fp16 = sys.argv[1] == "1"
signature = {
    "x_ptr": "*fp16" if fp16 else "*bf16", "halves_ptr": "*i16", "qzeros_ptr": "*i32", "scales_ptr": "*bf16",
    "bias_ptr": "*bf16", "ws_ptr": "*fp32", "lock_ptr": "*i32", "y_ptr": "*fp16" if fp16 else "*bf16", "M": "i32",
    "N": "i32", "K": "i32", "stride_xm": "i32", "stride_ym": "i32", "stride_hn": "i32", "group_size": "i32",
    "split_k": "i32",
}
constexprs = dict(
    ZERO_OFFSET=1, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=64, GROUP_P=4, NUM_STAGES=3, PTX=True, FP16=fp16, PDL=True,
    EARLY=True,
)
print(json.dumps(main_loop(sass(triton_mma._pairs_mma_kernel, signature, constexprs, num_warps=2))))
"""


@pytest.mark.parametrize("fp16", [False, True], ids=["bf16", "fp16"])
def test_sm90_code_of_the_ptx_conversion(fp16: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = pathlib.Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", _COMPILE, str(int(fp16))],
        env=env, cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    ops = json.loads(out.stdout.strip().splitlines()[-1])
    # 64 x 128 weights over 64 threads: 128 each, two per 32-bit register, 4 nibbles per half
    assert ops["LOP3.LUT"] >= 64 and ops["SHF.R.U32.HI"] == 48
    assert ops["HADD2" if fp16 else "HADD2.BF16_V2"] == 64  # the x2 subtracts
    assert ops["HMMA.16816.F32" if fp16 else "HMMA.16816.F32.BF16"] == 32  # 64 x 16 x 128 in m16n8k16 steps
