"""The rows INT4 layout (kernels/int4/layouts.py) and its kernels (kernels/int4/triton_rows.py)
against the GPTQ reference (kernels/int4/reference.py): the repack is exact, the batch-1
GEMV, the tl.dot tiles and the prefill dequantize compute the reference's function, and
Int4Linear repacks GPTQ and AWQ checkpoints (and dummy weights) into it after loading.

Without a GPU: the Triton interpreter, tiny shapes (K of 2-4 blocks of 128), fp32 and fp16.
With one: Llama-8B shapes in bf16 through the dispatch, and a CUDA graph replay.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_cluster.engine.quantization.int4_linear import Int4Linear, Int4Spec
from vllm_cluster.engine.quantization.int4_pack import (
    act_order_g_idx,
    pack_awq,
    pack_gptq,
    pack_rows,
    quantize_rtn,
)
from vllm_cluster.kernels.elementwise import dispatch as elementwise_ops
from vllm_cluster.kernels.int4 import dispatch as int4_ops
from vllm_cluster.kernels.int4 import layouts, triton_rows
from vllm_cluster.kernels.int4 import reference as int4_reference
from vllm_cluster.kernels.int4.layouts import gptq_to_pairs, gptq_to_rows, rows_layout_fits, rows_to_gptq
from vllm_cluster.kernels.int4.triton_rows import (
    RowsGemvConfig,
    gemv_rows,
    packed_math,
    pick_rows_config,
)
from vllm_cluster.kernels.int4.triton_rows_dot import int4_gemm_rows
from vllm_cluster.kernels.int4.weight import Int4Weight
from vllm_cluster.kernels.sync import semaphores

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# The GEMV multiplies exact fp32 weights with fp32 sums (x's dtype rounds the result once);
# the tl.dot tiles round the weight to x's dtype first, as kernels/int4/triton_gemm.py does.
GEMV_TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 3e-2}
DOT_TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def gptq_tensors(k: int, n: int, group_size: int, zero_offset: int, seed: int = 0) -> dict[str, torch.Tensor]:
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed + k + n)) * 0.05
    q = quantize_rtn(weight, group_size, sym=False, min_zero=zero_offset)
    return {name: t.to(DEVICE) for name, t in pack_gptq(q, zero_offset).items()}


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def reference(x: torch.Tensor, t: dict[str, torch.Tensor], group_size: int, zero_offset: int) -> torch.Tensor:
    weight = Int4Weight(t["qweight"], t["qzeros"], t["scales"], None, group_size, "gptq", zero_offset)
    return int4_reference.int4_gemm(x, weight)


# --- The layout


def test_repack_is_exact_and_places_each_input() -> None:
    k, n = 256, 24
    qweight = torch.randint(-(2**31), 2**31, (k // 8, n), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    rows = gptq_to_rows(qweight)
    assert rows.shape == (n, k // 8) and rows.dtype == torch.int32
    assert torch.equal(rows_to_gptq(rows), qweight)
    q = int4_reference.unpack_rows(qweight)  # [K, N]
    for out, block, j, w in [(0, 0, 0, 0), (5, 0, 7, 15), (23, 1, 3, 9), (11, 1, 0, 4)]:
        word = int(rows[out, 16 * block + w])
        assert (word >> (4 * j)) & 0xF == int(q[128 * block + 16 * j + w, out])


def test_rows_layout_fits() -> None:
    assert rows_layout_fits(4096, 128) and rows_layout_fits(14336, 128) and rows_layout_fits(256, -1)
    assert rows_layout_fits(256, 16) and rows_layout_fits(512, 256)
    assert not rows_layout_fits(96, 32)  # not whole blocks of 128
    assert not rows_layout_fits(384, 48)  # a run of 16 inputs would straddle two groups
    assert not rows_layout_fits(256, 8)


# --- The kernels (Triton; the interpreter on CPU)

GEMV_CONFIGS = [
    RowsGemvConfig(16, 1, 1, num_warps=2),
    RowsGemvConfig(32, 1, 3, num_warps=1, num_stages=2),
    RowsGemvConfig(16, 2, 2, num_warps=1, num_stages=1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", GEMV_CONFIGS, ids=["split1", "split3", "unroll2"])
@pytest.mark.parametrize(("group_size", "zero_offset"), [(32, 1), (128, 0), (-1, 1)], ids=["g32", "g128", "one"])
def test_gemv_rows(dtype: torch.dtype, config: RowsGemvConfig, group_size: int, zero_offset: int) -> None:
    # N = 40: a ragged last block of outputs; K = 512: 4 blocks, split 3 ways unevenly.
    k, n = 512, 40
    t = gptq_tensors(k, n, group_size, zero_offset)
    x = randn(1, k, dtype=dtype, seed=2)
    bias = randn(n, dtype=dtype, seed=3)
    group = k if group_size == -1 else group_size
    weight = Int4Weight(gptq_to_rows(t["qweight"]), t["qzeros"], t["scales"], None, group, "rows", zero_offset)
    actual = gemv_rows(x, weight, bias, config)
    expected = (reference(x, t, group_size, zero_offset).float() + bias.float()).to(dtype)
    assert actual.dtype == dtype and actual.shape == (1, n)
    tol = GEMV_TOLERANCES[dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def test_gemv_rows_groups_of_16_and_64() -> None:
    for group_size in (16, 64):
        t = gptq_tensors(256, 16, group_size, 1)
        x = randn(1, 256, seed=4)
        weight = Int4Weight(gptq_to_rows(t["qweight"]), t["qzeros"], t["scales"], None, group_size, "rows", 1)
        actual = gemv_rows(x, weight, None, GEMV_CONFIGS[1])
        torch.testing.assert_close(actual, reference(x, t, group_size, 1), atol=1e-4, rtol=1e-4)


def test_gemv_semaphores_are_zero_after_a_launch_and_a_rerun_agrees() -> None:
    t = gptq_tensors(512, 32, 128, 1)
    rows = gptq_to_rows(t["qweight"])
    x = randn(1, 512, seed=5)
    args = (x, Int4Weight(rows, t["qzeros"], t["scales"], None, 128, "rows", 1), None, RowsGemvConfig(16, 1, 4))
    first = gemv_rows(*args)
    assert int(semaphores.SETS["int4_gemv", x.device].count_nonzero()) == 0
    assert torch.equal(gemv_rows(*args), first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", GEMV_CONFIGS, ids=["split1", "split3", "unroll2"])
def test_gemv_silu_mul_equals_the_two_launches(dtype: torch.dtype, config: RowsGemvConfig) -> None:
    # [gate | up] of 2 x 40 rows (a ragged last block in each half), pairs layout; the fused
    # launch rounds gate and up to x's dtype as the plain GEMV stores them, then silu * up.
    # fp16: the two may differ by an ulp of the output (exp in Triton vs torch).
    k, n = 512, 80
    t = gptq_tensors(k, n, 128, 1, seed=6)
    x = randn(1, k, dtype=dtype, seed=7)
    weight = Int4Weight(gptq_to_pairs(t["qweight"]), t["qzeros"], t["scales"], None, 128, "pairs", 1)
    fused = gemv_rows(x, weight, None, config, silu_mul=True)
    assert int(semaphores.SETS["int4_gemv", x.device].count_nonzero()) == 0
    expected = elementwise_ops.silu_and_mul(gemv_rows(x, weight, None, config))
    assert fused.dtype == dtype and fused.shape == (1, n // 2)
    tol = {torch.float32: 1e-6, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(fused, expected, atol=tol, rtol=tol)
    # int4_ops.int4_gemm off the fused path (CPU): silu_and_mul of the product.
    assert torch.equal(
        int4_ops.int4_gemm(x, weight, silu_mul=True), elementwise_ops.silu_and_mul(int4_ops.int4_gemm(x, weight))
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 20, 130], ids=["gemv", "dot16", "dot64", "dequant"])
def test_int4_gemm_rows_every_path(dtype: torch.dtype, m: int) -> None:
    for group_size, zero_offset in ((64, 1), (128, 0)):
        t = gptq_tensors(256, 24, group_size, zero_offset, seed=m)
        x = randn(m, 256, dtype=dtype, seed=m)
        weight = Int4Weight(gptq_to_rows(t["qweight"]), t["qzeros"], t["scales"], None, group_size, "rows", zero_offset)
        actual = int4_gemm_rows(x, weight, num_sms=4)
        tol = DOT_TOLERANCES[dtype]
        torch.testing.assert_close(actual, reference(x, t, group_size, zero_offset), atol=tol, rtol=tol)


def test_pick_rows_config_splits_k_to_fill_the_gpu() -> None:
    small = pick_rows_config(4096, 4096, num_sms=132)
    assert small.split_k > 1 and 4096 // 128 % small.unroll == 0
    assert pick_rows_config(28672, 4096, num_sms=132).split_k < small.split_k
    assert pick_rows_config(64, 128, num_sms=132).split_k == 1  # one block: nothing to split
    # gate_up in x2 arithmetic: 128 outputs a program on 2 warps; the fp32 path keeps 64 on 4.
    wide = pick_rows_config(28672, 4096, num_sms=132, packed=True)
    assert (wide.block_n, wide.num_warps) == (128, 2)
    assert (
        pick_rows_config(28672, 4096, num_sms=132).block_n,
        pick_rows_config(6144, 4096, 132, packed=True).block_n,
    ) == (64, 64)


# --- The dispatch and the layer (torch on CPU)


def test_dispatch_on_cpu_is_the_reference() -> None:
    t = {name: v.cpu() for name, v in gptq_tensors(256, 16, 128, 1).items()}
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6))
    rows = Int4Weight(gptq_to_rows(t["qweight"]), t["qzeros"], t["scales"], None, 128, "rows", 1)
    actual = int4_ops.int4_gemm(x, rows)
    gptq = dataclasses.replace(rows, qweight=t["qweight"], layout="gptq")
    assert torch.equal(actual, int4_reference.int4_gemm(x, gptq))


def loaded_layer(
    spec: Int4Spec, in_features: int, sizes: list[int], act_order: bool = False
) -> tuple[Int4Linear, torch.Tensor]:
    """A fused layer loaded part by part, and the reference output of its parts for one x."""
    layer = Int4Linear(spec, in_features, sizes, bias=True, dtype=torch.float32, device=torch.device("cpu"))
    x = torch.randn(2, in_features, generator=torch.Generator().manual_seed(7))
    expected = []
    for part, size in enumerate(sizes):
        gen = torch.Generator().manual_seed(10 + part)
        g_idx = (
            act_order_g_idx(in_features, spec.group_size, torch.randperm(in_features, generator=gen))
            if act_order
            else None
        )
        weights = quantize_rtn(
            torch.randn(size, in_features, generator=gen), spec.group_size, sym=False, g_idx=g_idx, min_zero=1
        )
        tensors = pack_gptq(weights, spec.zero_offset) if spec.method == "gptq" else pack_awq(weights)
        tensors["bias"] = torch.full((size,), float(part))
        for name, tensor in tensors.items():
            layer.load_shard(name, tensor, part)
        args = (tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors.get("g_idx"), spec.group_size)
        expected.append(int4_reference.int4_gemm(x, Int4Weight(*args, spec.method, spec.zero_offset)) + part)
    layer.finish_loading()
    torch.testing.assert_close(layer(x), torch.cat(expected, dim=1), rtol=0, atol=1e-5)
    return layer, x


@pytest.mark.parametrize("layout", ["rows", "pairs"])
@pytest.mark.parametrize("spec", [Int4Spec("gptq", 64, 1), Int4Spec("gptq", -1, 0), Int4Spec("awq", 128, 0)])
def test_loaded_layers_are_repacked_for_decode(spec: Int4Spec, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layouts, "DECODE_LAYOUT", layout)
    layer, _ = loaded_layer(spec, 256, [16, 8, 8])
    assert layer.layout == layout and tuple(layer.qweight.shape) == (32, 32)
    with pytest.raises(AssertionError, match="repacked"):
        layer.load_shard("scales", torch.zeros(4, 16, dtype=torch.float16), 0)


@pytest.mark.parametrize(
    ("spec", "output_sizes", "layout"),
    [
        (Int4Spec("gptq", 128, 1), [16, 16, 32], "tiles"),
        (Int4Spec("gptq", -1, 0), [32], "tiles"),
        (Int4Spec("awq", 128, 0), [64], "tiles"),
        (Int4Spec("gptq", 64, 1), [16, 16, 32], "pairs"),  # groups of half a block: one zero a block does not hold
        (Int4Spec("gptq", 128, 1), [16, 8, 8], "pairs"),  # parts of half a tile
    ],
)
def test_tiles_where_they_fit_else_pairs(spec: Int4Spec, output_sizes: list[int], layout: str) -> None:
    assert layouts.DECODE_LAYOUT == "tiles"
    layer, _ = loaded_layer(spec, 256, output_sizes)  # checks the layer against the reference
    assert layer.layout == layout
    n = sum(output_sizes)
    assert tuple(layer.qweight.shape) == ((n // 16, 2, 256) if layout == "tiles" else (n, 32))


def test_act_order_and_odd_shapes_keep_gptq() -> None:
    layer, _ = loaded_layer(Int4Spec("gptq", 64, 1), 256, [16], act_order=True)
    assert layer.act_order and layer.layout == "gptq"
    layer, _ = loaded_layer(Int4Spec("gptq", 32, 1), 96, [16])
    assert layer.layout == "gptq"


def test_groups_of_16_fall_back_to_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layouts, "DECODE_LAYOUT", "pairs")  # runs of 32 would straddle groups
    layer, _ = loaded_layer(Int4Spec("gptq", 16, 1), 256, [16])
    assert layer.layout == "rows"


@pytest.mark.parametrize("layout", ["rows", "pairs", "tiles"])
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_dummy_weights_are_repacked_for_decode(method: str, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layouts, "DECODE_LAYOUT", layout)
    spec = Int4Spec(method, 128, 1 if method == "gptq" else 0)
    layer = Int4Linear(spec, 256, [32], bias=False, dtype=torch.float32, device=torch.device("cpu"))
    layer.init_dummy(torch.Generator().manual_seed(8))
    assert layer.layout == layout
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(9))
    if layout == "rows":
        gptq = pack_rows(layouts.unpack_rows_layout(layer.qweight))
    else:
        pairs = layouts.tiles_to_pairs(layer.qweight) if layout == "tiles" else layer.qweight
        gptq = pack_rows(layouts.unpack_pairs_layout(pairs))
    expected = int4_reference.int4_gemm(x, dataclasses.replace(layer.int4_weight(), qweight=gptq, layout="gptq"))
    assert torch.equal(layer(x), expected)


# --- On a GPU: Llama-3.1-8B shapes in bf16


@cuda_only
@pytest.mark.parametrize("m", [1, 4, 16, 200])
@pytest.mark.parametrize(("k", "n"), [(4096, 6144), (4096, 28672), (14336, 4096)])
def test_cuda_llama_8b_shapes(m: int, k: int, n: int) -> None:
    t = gptq_tensors(k, n, 128, 1)
    x = randn(m, k, dtype=torch.bfloat16, seed=m)
    rows = Int4Weight(gptq_to_rows(t["qweight"]), t["qzeros"], t["scales"], None, 128, "rows", 1)
    actual = int4_ops.int4_gemm(x, rows)
    tol = GEMV_TOLERANCES[torch.bfloat16] if m == 1 else DOT_TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(actual, reference(x, t, 128, 1), atol=tol, rtol=tol)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [128, -1], ids=["g128", "one"])
def test_cuda_pairs_gemv_x2_math_against_fp32(
    dtype: torch.dtype, group_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pairs GEMV's x2 path (products and four-term sums rounded to x's dtype) against its
    # fp32 path and the fp32 reference. Bounds: the output's own rounding is 1.6e-3 (bf16) and
    # 2e-4 (fp16) relative; x2 products and sums add about as much again (2^-9, 2^-11 a step).
    k, n = 4096, 6144
    t = gptq_tensors(k, n, group_size, 1)
    x = randn(1, k, dtype=dtype, seed=12)
    group = k if group_size == -1 else group_size
    weight = Int4Weight(gptq_to_pairs(t["qweight"]), t["qzeros"], t["scales"], None, group, "pairs", 1)
    args = (x, weight, None, pick_rows_config(n, k, 132))
    assert packed_math(dtype, group)
    packed = gemv_rows(*args).float()
    monkeypatch.setattr(triton_rows, "PACKED_PAIRS", False)
    exact = gemv_rows(*args).float()
    expected = reference(x.float(), t, group_size, 1)

    def rel(y: torch.Tensor) -> float:
        return float((y - expected).norm() / expected.norm())

    bound = {torch.bfloat16: 4.5e-3, torch.float16: 1e-3}[dtype]
    assert rel(exact) < bound / 2 and rel(packed) < bound, (rel(exact), rel(packed))


@cuda_only
@pytest.mark.parametrize("m", [1, 3])
def test_cuda_gate_up_silu_mul_equals_the_two_launches(m: int) -> None:
    # llama-3.1-8b's gate_up (4096 -> 2 x 14336) in bf16: one row takes the fused GEMV, three
    # the tensor-core kernel and the SiLU kernel. The same sums, rounded the same way.
    k, n = 4096, 28672
    t = gptq_tensors(k, n, 128, 1)
    x = randn(m, k, dtype=torch.bfloat16, seed=13)
    weight = Int4Weight(gptq_to_pairs(t["qweight"]), t["qzeros"], t["scales"], None, 128, "pairs", 1)
    fused = int4_ops.int4_gemm(x, weight, silu_mul=True)
    expected = elementwise_ops.silu_and_mul(int4_ops.int4_gemm(x, weight))
    assert fused.shape == (m, n // 2)
    torch.testing.assert_close(fused, expected, atol=0, rtol=0)


@cuda_only
def test_cuda_graph_replays_the_rows_gemv() -> None:
    t = gptq_tensors(4096, 4096, 128, 1)
    rows = gptq_to_rows(t["qweight"])
    x = randn(1, 4096, dtype=torch.bfloat16, seed=9)
    weight = Int4Weight(rows, t["qzeros"], t["scales"], None, 128, "rows", 1)
    expected = int4_ops.int4_gemm(x, weight)  # also compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = int4_ops.int4_gemm(x, weight)
    for seed in (10, 11):
        x.copy_(randn(1, 4096, dtype=torch.bfloat16, seed=seed))
        graph.replay()
        torch.testing.assert_close(y, int4_ops.int4_gemm(x, weight), atol=0, rtol=0)
    assert torch.equal(int4_ops.int4_gemm(x.copy_(randn(1, 4096, dtype=torch.bfloat16, seed=9)), weight), expected)
