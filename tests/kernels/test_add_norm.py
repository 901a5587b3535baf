"""The norm between two batch-1 GEMVs done by the GEMVs (kernels/linear/triton_add_norm.py): the GEMV
before stores h = y + residual and hg = h * weight and sums h^2 into a slot; the GEMV after
takes hg as x and scales its sums by rsqrt(mean h^2 + eps).

Without a GPU the bf16 and 1-byte GEMVs run under the Triton interpreter on tiny shapes (N
not a multiple of a program's rows, so the masks run, and several programs adding into the
slot); the INT4 MMA GEMV (PTX) and llama-3.1-8b's shapes need a GPU. Tolerances: h and hg
are rounded once, as the reference rounds them: equal bit for bit. The slot's fp64 sum is
within fp32 rounding of the reference's. The GEMV after applies rstd in fp32 where the
reference rounds h * rstd and its product with the weight to the activations' dtype: its
output is within a few of that dtype's roundings of the reference's (fp32: 1e-5).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from vllm_cluster.engine.quantization.fp8 import quantize_fp8
from vllm_cluster.engine.quantization.int8 import quantize_int8
from vllm_cluster.kernels.elementwise import dispatch as elementwise_ops
from vllm_cluster.kernels.elementwise import reference as elementwise_reference
from vllm_cluster.kernels.linear import add_norm as add_norm_values
from vllm_cluster.kernels.linear import dispatch as linear_ops
from vllm_cluster.kernels.linear import triton_gemv
from vllm_cluster.kernels.linear.add_norm import AddNorm, Normed
from vllm_cluster.kernels.linear.triton_w8_gemv import gemv_w8, gemv_w8_add_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
EPS = 1e-5
TOLERANCES = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


def add_norm_case(n: int, dtype: torch.dtype) -> AddNorm:
    residual = randn(1, n, dtype=dtype, seed=1)
    weight = 1.0 + randn(n, dtype=dtype, seed=2, scale=0.1)
    return AddNorm(residual, weight, EPS, torch.zeros(1, dtype=torch.float64, device=DEVICE))


def assert_first_half(plain: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor], add_norm: AddNorm) -> Normed:
    """out = (hg, h) of the GEMV before, against its plain output y: h = y + residual and hg =
    h * weight, each rounded once; the slot holds sum h^2. -> the Normed for the GEMV after."""
    hg, h = out
    assert add_norm.slot is not None
    expected_h = (plain.float() + add_norm.residual.float()).to(plain.dtype)
    assert h.dtype == hg.dtype == plain.dtype and h.shape == hg.shape == plain.shape
    torch.testing.assert_close(h, expected_h, rtol=0, atol=0)
    torch.testing.assert_close(hg, (h.float() * add_norm.weight.float()).to(h.dtype), rtol=0, atol=0)
    expected_ss = h.double().pow(2).sum()
    torch.testing.assert_close(add_norm.slot[0], expected_ss, rtol=1e-6, atol=0)
    return add_norm.deferred(hg)


def assert_relative(actual: torch.Tensor, expected: torch.Tensor, bound: float) -> None:
    """Norm-wise, as tests/kernels/test_int4_mma_gemv.py compares: in bf16 x is rounded after
    rstd (the reference) or before it (hg), and one output near 0 can be far off alone."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    error = float((actual.float() - expected.float()).norm() / expected.float().norm())
    assert error < bound, error


def normed_reference(normed: Normed, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The reference norm of h (what the GEMV after should see as x)."""
    return elementwise_reference.fused_add_rms_norm(h, None, weight, normed.eps)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("n", "k", "bias"), [(7, 64, True), (40, 100, False)])
def test_bf16_gemv_first_half(n: int, k: int, bias: bool, dtype: torch.dtype) -> None:
    x = randn(1, k, dtype=dtype, seed=3)
    w = randn(n, k, dtype=dtype, seed=4, scale=k**-0.5)
    b = randn(n, dtype=dtype, seed=5) if bias else None
    add_norm = add_norm_case(n, dtype)
    assert_first_half(triton_gemv.gemv(x, w, b), triton_gemv.gemv_add_norm(x, w, b, add_norm), add_norm)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize(("n", "k", "bias"), [(9, 72, False), (40, 300, True)])
def test_w8_gemv_first_half(fmt: str, n: int, k: int, bias: bool) -> None:
    dtype = torch.float16
    x = randn(1, k, dtype=dtype, seed=3)
    q, scale = quantize_w8(fmt, n, k)
    b = randn(n, dtype=dtype, seed=5) if bias else None
    add_norm = add_norm_case(n, dtype)
    assert_first_half(gemv_w8(x, q, scale, b), gemv_w8_add_norm(x, q, scale, b, add_norm), add_norm)


def quantize_w8(fmt: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = randn(n, k, dtype=torch.float32, seed=4, scale=0.05).cpu()
    q, scale = quantize_int8(w) if fmt == "int8" else quantize_fp8(w)
    return q.to(DEVICE), scale.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("second", ["bf16", "bf16-silu", "fp8", "int8-silu"])
def test_two_gemvs_equal_the_norm_between_them(second: str, dtype: torch.dtype) -> None:
    """o_proj -> gate_up as a decode step runs them: the pair against GEMV, reference norm, GEMV."""
    n, k, n2 = 48, 80, 40
    x = randn(1, k, dtype=dtype, seed=3)
    w = randn(n, k, dtype=dtype, seed=4, scale=k**-0.5)
    add_norm = add_norm_case(n, dtype)
    hg, h = triton_gemv.gemv_add_norm(x, w, None, add_norm)
    normed = assert_first_half(triton_gemv.gemv(x, w, None), (hg, h), add_norm)
    x2 = normed_reference(normed, h, add_norm.weight)
    silu = second.endswith("silu")
    if second.startswith("bf16"):
        w2 = randn(n2, n, dtype=dtype, seed=6, scale=n**-0.5)
        b2 = None if silu else randn(n2, dtype=dtype, seed=7)
        fused = triton_gemv.gemv(hg, w2, b2, silu_mul=silu, rms=normed)
        expected = triton_gemv.gemv(x2, w2, b2, silu_mul=silu)
    else:
        if dtype == torch.float32:
            pytest.skip("the 1-byte GEMV's x is 16-bit in decode")
        q, scale = quantize_w8(second[:4], n2, n)
        fused = gemv_w8(hg, q, scale, None, silu_mul=silu, rms=normed)
        expected = gemv_w8(x2, q, scale, None, silu_mul=silu)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(fused, expected, rtol=tol, atol=tol)
    # And the kernels' entry points: a Normed x goes to the GEMV that finishes it.
    materialized = normed.materialize()
    torch.testing.assert_close(materialized, x2, rtol=tol, atol=tol)


def test_the_dispatch_finishes_a_normed_x_and_materializes_it_elsewhere() -> None:

    n, k = 24, 64
    dtype = torch.float16
    hg = randn(1, k, dtype=dtype, seed=3)
    normed = Normed(hg, torch.full((1,), 50.0, dtype=torch.float64, device=DEVICE), EPS)
    w = randn(n, k, dtype=dtype, seed=4, scale=k**-0.5)
    expected = F.linear(normed.materialize().float(), w.float())
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(linear_ops.linear(normed, w).float(), expected, rtol=tol, atol=tol)


def test_add_norm_refuses_a_mismatched_residual() -> None:
    x = randn(1, 64, dtype=torch.float32, seed=3)
    w = randn(8, 64, dtype=torch.float32, seed=4)
    with pytest.raises(AssertionError):
        triton_gemv.gemv_add_norm(x, w, None, add_norm_case(16, torch.float32))


# --- On a GPU: llama-3.1-8b's shapes (o_proj, down_proj: 1024-2048 programs add into the
# slot), the INT4 MMA GEMV, a CUDA graph, and the layers taking it.


@cuda_only
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("k", [4096, 14336], ids=["o", "down"])
def test_cuda_llama_8b_shapes(fmt: str, k: int) -> None:
    n, dtype = 4096, torch.bfloat16
    x = randn(1, k, dtype=dtype, seed=3)
    add_norm = add_norm_case(n, dtype)
    if fmt == "bf16":
        w = randn(n, k, dtype=dtype, seed=4, scale=k**-0.5)
        first, first_half = triton_gemv.gemv(x, w, None), triton_gemv.gemv_add_norm(x, w, None, add_norm)
        normed = assert_first_half(first, first_half, add_norm)
    else:
        q, scale = quantize_w8(fmt, n, k)
        normed = assert_first_half(gemv_w8(x, q, scale, None), gemv_w8_add_norm(x, q, scale, None, add_norm), add_norm)
    w2 = randn(2 * 14336, n, dtype=dtype, seed=6, scale=n**-0.5)  # gate_up after it
    fused = triton_gemv.gemv(normed.hg, w2, None, silu_mul=True, rms=normed)
    expected = triton_gemv.gemv(normed.materialize(), w2, None, silu_mul=True)
    assert_relative(fused, expected, 1e-2)


@cuda_only
@pytest.mark.parametrize("tiled", [False, True], ids=["pairs", "tiles"])
@pytest.mark.parametrize(
    ("k", "config"), [(4096, None), (14336, None), (1024, (1, 1, 3, 2))], ids=["o", "down", "split3"]
)
def test_cuda_int4_mma_gemv(tiled: bool, k: int, config: tuple[int, ...] | None) -> None:
    from tests.kernels.test_int4_gemv import gptq_tensors
    from vllm_cluster.kernels.int4.layouts import gptq_to_pairs, pairs_to_tiles
    from vllm_cluster.kernels.int4.triton_mma_gemv import (
        MmaGemvConfig,
        gemv_pairs_mma,
        gemv_pairs_mma_add_norm,
        pick_mma_gemv_config,
    )
    from vllm_cluster.kernels.int4.weight import Int4Weight

    n = 4096 if config is None else 336  # 336: a ragged last program; split3: only a tile's last split stores
    t = gptq_tensors(k, n, 128, 1)
    t["scales"] = t["scales"].bfloat16()
    pairs = gptq_to_pairs(t["qweight"])
    layout = "tiles" if tiled else "pairs"
    weight = Int4Weight(pairs_to_tiles(pairs) if tiled else pairs, t["qzeros"], t["scales"], None, 128, layout, 1)
    x = randn(1, k, dtype=torch.bfloat16, seed=3)
    cfg = MmaGemvConfig(*config) if config else pick_mma_gemv_config(n, k, 132)
    add_norm = add_norm_case(n, torch.bfloat16)
    first, first_half = gemv_pairs_mma(x, weight, cfg), gemv_pairs_mma_add_norm(x, weight, cfg, add_norm)
    normed = assert_first_half(first, first_half, add_norm)
    if n % 128:
        return  # the GEMV after takes whole blocks of 128 inputs
    # The INT4 GEMV after it (qkv, gate_up) finishing the norm.
    t2 = gptq_tensors(n, 2 * 1024, 128, 1)
    t2["scales"] = t2["scales"].bfloat16()
    pairs2 = gptq_to_pairs(t2["qweight"])
    w2 = Int4Weight(pairs_to_tiles(pairs2) if tiled else pairs2, t2["qzeros"], t2["scales"], None, 128, layout, 1)
    for silu in (False, True):
        cfg2 = pick_mma_gemv_config(2 * 1024, n, 132, silu_mul=silu)
        args2 = (w2, cfg2, silu)
        fused = gemv_pairs_mma(normed.hg, *args2, rms=normed)
        expected = gemv_pairs_mma(normed.materialize(), *args2)
        assert_relative(fused, expected, 1e-2)


@cuda_only
def test_cuda_graph_replays_the_pair() -> None:
    n, k, dtype = 4096, 4096, torch.bfloat16
    x = randn(1, k, dtype=dtype, seed=3)
    w = randn(n, k, dtype=dtype, seed=4, scale=k**-0.5)
    w2 = randn(6144, n, dtype=dtype, seed=5, scale=n**-0.5)
    add_norm = add_norm_case(n, dtype)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        assert add_norm.slot is not None
        add_norm.slot.zero_()
        hg, h = triton_gemv.gemv_add_norm(x, w, None, add_norm)
        return triton_gemv.gemv(hg, w2, None, rms=add_norm.deferred(hg)), h

    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, h = step()
    for seed in (10, 11):
        x.copy_(randn(1, k, dtype=dtype, seed=seed))
        add_norm.residual.copy_(randn(1, n, dtype=dtype, seed=seed + 1))
        graph.replay()
        expected_y, expected_h = step()
        torch.testing.assert_close(h, expected_h, rtol=0, atol=0)
        torch.testing.assert_close(y, expected_y, rtol=1e-2, atol=1e-2)


@cuda_only
@pytest.mark.parametrize("method", ["bf16", "fp8", "int8"])
def test_cuda_layers_take_it_and_the_switch_turns_it_off(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """engine/layers/norm.py's add_norm through each linear class, then the class's forward on
    the Normed; with add_norm_values.ADD_NORM_EPILOGUE off, the norm kernel's launch between."""
    from vllm_cluster.engine.layers.linear import Linear
    from vllm_cluster.engine.layers.norm import RMSNorm, add_norm
    from vllm_cluster.engine.quantization.fp8 import Fp8Linear
    from vllm_cluster.engine.quantization.int8 import Int8Linear

    n, k, dtype = 512, 1024, torch.bfloat16
    dense, dense2 = Linear(k, n, bias=False).to("cuda", dtype), Linear(n, 768, bias=False).to("cuda", dtype)
    proj: torch.nn.Module = dense
    proj2: torch.nn.Module = dense2
    if method != "bf16":
        cls = Fp8Linear if method == "fp8" else Int8Linear
        proj, proj2 = cls(k, n, False, dtype, torch.device("cuda")), cls(n, 768, False, dtype, torch.device("cuda"))
        proj.quantize_from(dense.weight.data.float(), None)
        proj2.quantize_from(dense2.weight.data.float(), None)
    norm = RMSNorm(n, EPS).to("cuda", dtype)
    norm.weight.data.copy_(add_norm_case(n, dtype).weight)
    x, residual = randn(1, k, dtype=dtype, seed=3), randn(1, n, dtype=dtype, seed=5)
    launches: list[str] = []
    monkeypatch.setattr(add_norm_values, "fused_add_rms_norm", _counting(elementwise_ops.fused_add_rms_norm, launches))
    slot = torch.zeros(1, dtype=torch.float64, device="cuda")
    normed, h = add_norm(proj, x, residual, norm, slot)
    assert isinstance(normed, Normed) and launches == []
    fused = proj2(normed)
    monkeypatch.setattr(add_norm_values, "ADD_NORM_EPILOGUE", False)
    plain, h2 = add_norm(proj, x, residual, norm, torch.zeros(1, dtype=torch.float64, device="cuda"))
    assert isinstance(plain, torch.Tensor) and launches == ["norm"]
    assert torch.equal(h, h2)
    assert_relative(fused, proj2(plain), 1e-2)


def _counting(fn: Callable[..., Any], launches: list[str]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        launches.append("norm")
        return fn(*args, **kwargs)

    return counted
