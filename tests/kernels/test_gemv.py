"""The decode GEMVs (kernels/linear/triton_w8_gemv.py: int8 / fp8 weights; kernels/int4/triton_gemv.py:
GPTQ / AWQ) against their torch definitions, and the dispatch that picks them.

Without a GPU the kernels run under the Triton interpreter on tiny shapes in fp32 and fp16;
N and K are not multiples of the blocks, so the masks run. With one: Llama-8B shapes in
bf16, and a CUDA graph replaying the split-K semaphores.
"""

from __future__ import annotations

import pytest
import torch

from vllm_cluster.engine.quantization.fp8 import quantize_fp8
from vllm_cluster.engine.quantization.int4_pack import pack_awq, pack_gptq, quantize_rtn
from vllm_cluster.engine.quantization.int8 import quantize_int8
from vllm_cluster.kernels.elementwise import triton_ops
from vllm_cluster.kernels.int4 import reference as int4_reference
from vllm_cluster.kernels.int4 import triton_gemm
from vllm_cluster.kernels.int4.triton_gemv import Int4GemvConfig, gemv_int4, pick_gemv_config
from vllm_cluster.kernels.int4.weight import Int4Weight
from vllm_cluster.kernels.linear import dispatch as linear_ops
from vllm_cluster.kernels.linear import reference as linear_reference
from vllm_cluster.kernels.linear.reference import FP8_WEIGHT_ONLY_MAX_ROWS
from vllm_cluster.kernels.linear.triton_w8_gemv import gemv_w8
from vllm_cluster.kernels.sync import semaphores

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# Weights are exact in fp32; sums are fp32 in another order; fp16 rounds the result once.
TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 3e-2}


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def quantize_w8(fmt: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight [N, K], scale [N] fp32) of a random weight in `fmt`."""
    w = randn(n, k, seed=n + k).cpu() * 0.05
    q, scale = quantize_int8(w) if fmt == "int8" else quantize_fp8(w)
    return q.to(DEVICE), scale.to(DEVICE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype and actual.shape == expected.shape
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


# --- int8 / fp8 weights


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 72), (3, 37, 100), (4, 16, 300)])
@pytest.mark.parametrize("lane_sums", [False, True], ids=["row-sums", "lane-sums"])
def test_gemv_w8_matches_reference(fmt: str, dtype: torch.dtype, m: int, n: int, k: int, lane_sums: bool) -> None:
    q, scale = quantize_w8(fmt, n, k)
    x = randn(m, k, dtype=dtype, seed=1)
    bias = randn(n, dtype=dtype, seed=2)
    # block_k 32: several K tiles and a ragged last one; block_n 8: a ragged last N block.
    actual = gemv_w8(x, q, scale, bias, block_n=8, block_k=32, lane_sums=lane_sums)
    assert_close(actual, linear_reference.int8_linear_reference(x, q, scale, bias), dtype)


def test_gemv_w8_lane_sums_with_silu_mul_and_a_short_k() -> None:
    """Per-thread partial sums with the SiLU epilogue, and a K under 16 (one tile of 8: the
    wrapper keeps row sums there)."""

    for n, k in [(24, 200), (12, 8)]:
        q, scale = quantize_w8("fp8", n, k)
        x = randn(1, k, seed=7)
        fused = gemv_w8(x, q, scale, None, silu_mul=True, lane_sums=True)
        expected = triton_ops.silu_and_mul(linear_reference.int8_linear_reference(x, q, scale, None))
        assert_close(fused, expected, torch.float32)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("n", "k", "blocks"), [(40, 72, (None, None)), (22, 300, (2, 128))], ids=["default", "2x128"])
def test_gemv_w8_silu_mul_equals_silu_and_mul_of_the_gemv(
    fmt: str, dtype: torch.dtype, n: int, k: int, blocks: tuple[int | None, int | None]
) -> None:
    """gate_up_proj at batch 1: one launch, the GEMV followed by the Triton silu_and_mul
    kernel (halves rounded to x's dtype, silu rounded, then the product); equal under the
    interpreter, compiled the fp32 sums may be added in another order."""

    q, scale = quantize_w8(fmt, n, k)
    x, bias = randn(1, k, dtype=dtype, seed=5), randn(n, dtype=dtype, seed=6)
    fused = gemv_w8(x, q, scale, bias, *blocks, silu_mul=True)
    assert fused.shape == (1, n // 2) and fused.dtype == dtype
    assert_close(fused, triton_ops.silu_and_mul(gemv_w8(x, q, scale, bias, *blocks)), dtype)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_w8_linear_silu_mul_dispatch_equals_two_calls(fmt: str) -> None:
    from vllm_cluster.kernels.elementwise.dispatch import silu_and_mul

    q, scale = quantize_w8(fmt, 32, 64)  # 20 rows take torch._scaled_mm on a GPU: N, K multiples of 16
    linear = linear_ops.int8_linear if fmt == "int8" else linear_ops.fp8_linear
    scale = scale if fmt == "int8" else scale[None, :]
    for rows in (1, 3, 20):
        x = randn(rows, 64, seed=rows)
        expected = silu_and_mul(linear(x, q, scale, None))
        assert_close(linear_ops.w8_linear_silu_mul(linear, x, q, scale, None), expected, torch.float32)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("blocks", [(None, None), (4, 64), (2, 128)], ids=["default", "4x64", "2x128"])
@pytest.mark.parametrize("k", [256, 200])
def test_gemv_w8_blocks(fmt: str, blocks: tuple[int | None, int | None], k: int) -> None:
    """K a multiple of the tile (unmasked loads) or not, one tile (the default) or several."""
    q, scale = quantize_w8(fmt, 21, k)
    x = randn(2, k, dtype=torch.float16, seed=4)
    bias = randn(21, dtype=torch.float16, seed=5)
    actual = gemv_w8(x, q, scale, bias, *blocks)
    assert_close(actual, linear_reference.int8_linear_reference(x, q, scale, bias), torch.float16)


def test_gemv_w8_fp8_takes_the_rowwise_scale_layout() -> None:
    """Fp8Linear keeps its scale as [1, N] (the layout torch._scaled_mm takes)."""
    q, scale = quantize_w8("fp8", 24, 64)
    x = randn(1, 64, seed=3)
    expected = linear_reference.fp8_weight_only_reference(x, q, scale, None)
    assert_close(gemv_w8(x, q, scale[None, :].contiguous(), None), expected, torch.float32)


def test_gemv_w8_fp8_decodes_every_code() -> None:
    """All 254 finite e4m3 codes, as the weight of one output each, through one-hot x."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # 0x7F and 0xFF are NaN in e4m3fn
    q = codes.view(torch.float8_e4m3fn)[:, None].repeat(1, 16).to(DEVICE)  # [254, 16]
    x = torch.zeros(1, 16, device=DEVICE)
    x[0, 5] = 1.0
    y = gemv_w8(x, q, torch.ones(len(codes), device=DEVICE), None)
    assert torch.equal(y[0].cpu(), codes.view(torch.float8_e4m3fn).float())


def test_gemv_w8_int8_decodes_every_code() -> None:
    """All 256 int8 codes (-128 too), as the weight of one output each, through one-hot x."""
    codes = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    q = codes[:, None].repeat(1, 16).to(DEVICE)  # [256, 16]
    x = torch.zeros(1, 16, device=DEVICE)
    x[0, 7] = 1.0
    y = gemv_w8(x, q, torch.ones(len(codes), device=DEVICE), None)
    assert torch.equal(y[0].cpu(), codes.float())


def test_gemv_w8_int8_extremes() -> None:
    """-127, 0 and 127 convert exactly through the float trick."""
    q = torch.tensor([[-127, 0, 127, 1], [127, -1, -127, 0]], dtype=torch.int8, device=DEVICE)
    x = torch.tensor([[1.0, 10.0, 100.0, 1000.0]], device=DEVICE)
    y = gemv_w8(x, q, torch.ones(2, device=DEVICE), None)
    assert y.tolist() == [[-127 + 12700 + 1000.0, 127 - 10 - 12700.0]]


# --- INT4


def packed_int4(method: str, k: int, n: int, group_size: int, zero_offset: int) -> dict[str, torch.Tensor]:
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(k + n)) * 0.05
    q = quantize_rtn(weight, group_size, sym=False, g_idx=None, min_zero=zero_offset)
    tensors = pack_gptq(q, zero_offset) if method == "gptq" else pack_awq(q)
    return {name: t.to(DEVICE) for name, t in tensors.items()}


def check_int4(
    method: str, m: int, k: int, n: int, group_size: int, dtype: torch.dtype, config: Int4GemvConfig,
    zero_offset: int = 0,
) -> None:  # fmt: skip
    t = packed_int4(method, k, n, group_size, zero_offset)
    x = randn(m, k, dtype=dtype, seed=m)
    bias = randn(n, dtype=dtype, seed=4)
    weight = Int4Weight(t["qweight"], t["qzeros"], t["scales"], None, group_size, method, zero_offset)
    actual = gemv_int4(x, weight, bias, config)
    expected = int4_reference.int4_gemm(x, weight)
    assert_close(actual, (expected.float() + bias.float()).to(dtype), dtype)


SPLITS = [Int4GemvConfig(16, 32, 1), Int4GemvConfig(32, 16, 3), Int4GemvConfig(64, 32, 2, num_warps=2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", SPLITS, ids=["split1", "split3", "split2"])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("zero_offset", [1, 0], ids=["v1", "v2"])
def test_gptq_gemv(dtype: torch.dtype, config: Int4GemvConfig, m: int, zero_offset: int) -> None:
    # N = 40: a ragged last N block; 3 groups of 32.
    check_int4("gptq", m, 96, 40, 32, dtype, config, zero_offset=zero_offset)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", SPLITS, ids=["split1", "split3", "split2"])
@pytest.mark.parametrize("m", [1, 3])
def test_awq_gemv(dtype: torch.dtype, config: Int4GemvConfig, m: int) -> None:
    check_int4("awq", m, 96, 40, 32, dtype, config)


def test_one_group_with_a_ragged_k_tail() -> None:
    # K = 72 and 50 are not multiples of block_k 32: the last tile is masked.
    check_int4("gptq", 2, 72, 16, -1, torch.float32, Int4GemvConfig(16, 32, 2), zero_offset=1)
    check_int4("awq", 1, 50, 24, -1, torch.float32, Int4GemvConfig(16, 32, 2))


def test_semaphores_are_zero_after_a_launch_and_a_rerun_agrees() -> None:
    t = packed_int4("gptq", 128, 32, 32, 1)
    x = randn(2, 128, seed=5)
    args = (x, Int4Weight(t["qweight"], t["qzeros"], t["scales"], None, 32, "gptq", 1), None, Int4GemvConfig(16, 32, 4))
    first = gemv_int4(*args)
    assert int(semaphores.SETS["int4_gemv", x.device].count_nonzero()) == 0
    assert torch.equal(gemv_int4(*args), first)


def test_pick_gemv_config_splits_k_to_fill_the_gpu() -> None:
    cfg = pick_gemv_config(1, 4096, 4096, 128, num_sms=132)
    assert cfg.split_k > 1 and 128 % cfg.block_k == 0
    assert pick_gemv_config(1, 4096, 4096, 32, num_sms=132).block_k == 32
    assert pick_gemv_config(1, 28672, 4096, 128, num_sms=132).split_k < cfg.split_k
    assert pick_gemv_config(1, 64, 32, 128, num_sms=132).split_k == 1  # one tile: nothing to split


# --- The dispatch


def test_int4_gemm_takes_the_split_k_gemv_up_to_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def spy(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return gemv_int4(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_gemm, "gemv_int4", spy)
    t = packed_int4("awq", 64, 16, 32, 0)
    rows = triton_gemm.SPLIT_K_GEMV_MAX_ROWS
    for m in (1, rows, rows + 1):
        x = randn(m, 64, seed=6)
        weight = Int4Weight(t["qweight"], t["qzeros"], t["scales"], None, 32, "awq", 0)
        assert_close(triton_gemm.int4_gemm(x, weight), int4_reference.int4_gemm(x, weight), torch.float32)
    assert calls == [1, rows]
    # Act-order gathers scales per input: the existing kernel keeps it.
    g = packed_int4("gptq", 64, 16, 32, 1)
    g_idx = torch.arange(64, device=DEVICE, dtype=torch.int32).flip(0) // 32
    triton_gemm.int4_gemm(randn(1, 64), Int4Weight(g["qweight"], g["qzeros"], g["scales"], g_idx, 32, "gptq", 1))
    assert calls == [1, rows]


@pytest.mark.parametrize(
    ("m", "weight_only"),
    [(1, True), (FP8_WEIGHT_ONLY_MAX_ROWS, True), (FP8_WEIGHT_ONLY_MAX_ROWS + 1, False)],
)
def test_fp8_linear_is_weight_only_up_to_its_rows(m: int, weight_only: bool) -> None:
    """Decode sizes keep x unquantized (w8a16); larger batches quantize it (W8A8). On CPU,
    which takes the same branch as CUDA."""
    q, scale = (t.cpu() for t in quantize_w8("fp8", 24, 64))
    x = randn(m, 64, seed=7).cpu()
    w8a16 = linear_reference.fp8_weight_only_reference(x, q, scale, None)
    w8a8 = linear_reference.fp8_w8a8_reference(x, q, scale, None)
    expected, other = (w8a16, w8a8) if weight_only else (w8a8, w8a16)
    actual = linear_ops.fp8_linear(x, q, scale[None, :], None)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(actual, other, atol=1e-3, rtol=1e-3)


# --- On a GPU: Llama-3.1-8B shapes in bf16


@cuda_only
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize(("k", "n"), [(4096, 6144), (14336, 4096)])
def test_cuda_w8_linear_llama_8b_shapes(fmt: str, m: int, k: int, n: int) -> None:
    """Through quant_ops: the GEMV up to 4 rows, the tiled kernel at 16."""
    q, scale = quantize_w8(fmt, n, k)
    x = randn(m, k, dtype=torch.bfloat16, seed=8)
    if fmt == "int8":
        actual = linear_ops.int8_linear(x, q, scale, None)
    else:
        actual = linear_ops.fp8_linear(x, q, scale[None, :].contiguous(), None)
    assert_close(actual, linear_reference.int8_linear_reference(x, q, scale, None), torch.bfloat16)


@cuda_only
@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize(("k", "n"), [(4096, 28672), (14336, 4096)])
def test_cuda_int4_gemv_llama_8b_shapes(method: str, m: int, k: int, n: int) -> None:
    offset = 1 if method == "gptq" else 0
    config = pick_gemv_config(m, n, k, 128, torch.cuda.get_device_properties(0).multi_processor_count)
    check_int4(method, m, k, n, 128, torch.bfloat16, config, zero_offset=offset)


@cuda_only
def test_cuda_graph_replays_the_split_k_semaphores() -> None:
    t = packed_int4("gptq", 4096, 4096, 128, 1)
    x = randn(1, 4096, dtype=torch.bfloat16, seed=9)
    weight = Int4Weight(t["qweight"], t["qzeros"], t["scales"], None, 128, "gptq", 1)
    expected = triton_gemm.int4_gemm(x, weight)  # also compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = triton_gemm.int4_gemm(x, weight)
    for seed in (10, 11):
        x.copy_(randn(1, 4096, dtype=torch.bfloat16, seed=seed))
        graph.replay()
        torch.testing.assert_close(y, triton_gemm.int4_gemm(x, weight), atol=0, rtol=0)
    assert torch.equal(triton_gemm.int4_gemm(x.copy_(randn(1, 4096, dtype=torch.bfloat16, seed=9)), weight), expected)
