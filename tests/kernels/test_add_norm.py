"""The batch-1 GEMVs' add + RMS norm epilogue (kernels/triton_add_norm.py) against the GEMV's
own output followed by the reference `fused_add_rms_norm`.

Without a GPU the bf16 and 1-byte GEMVs run under the Triton interpreter on tiny shapes (N
not a multiple of the programs' rows, so the masks run, and several programs, so the last
to arrive is not the first); the INT4 MMA GEMV (PTX) and llama-3.1-8b's shapes need a GPU.
h is the GEMV's output plus the residual, rounded once: equal bit for bit. The normed
output's sum of squares is added in another order than the reference's: one rounding of
the output's dtype apart at most.
"""

from __future__ import annotations

import pytest
import torch

from engine.quantization.fp8 import quantize_fp8
from engine.quantization.int8 import quantize_int8
from kernels import AddNorm, reference, semaphores, triton_linear
from kernels.triton_gemv import gemv_w8, gemv_w8_add_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
EPS = 1e-5


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


def add_norm_case(n: int, dtype: torch.dtype) -> AddNorm:
    residual = randn(1, n, dtype=dtype, seed=1)
    weight = 1.0 + randn(n, dtype=dtype, seed=2, scale=0.1)
    return AddNorm(residual, weight, EPS)


def assert_epilogue(
    plain: torch.Tensor, fused: tuple[torch.Tensor, torch.Tensor], add_norm: AddNorm
) -> None:
    """fused = (normed, h) against the reference add + norm of the plain GEMV's output."""
    normed, h = fused
    expected_normed, expected_h = reference.fused_add_rms_norm(
        plain, add_norm.residual, add_norm.weight, EPS
    )
    assert h.dtype == normed.dtype == plain.dtype and h.shape == normed.shape == plain.shape
    torch.testing.assert_close(h, expected_h, rtol=0, atol=0)
    ulp = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[plain.dtype]
    torch.testing.assert_close(normed, expected_normed, rtol=ulp, atol=ulp)
    assert int(semaphores.SETS["add_norm", plain.device].count_nonzero()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("n", "k", "bias"), [(7, 64, True), (40, 100, False)])
def test_bf16_gemv_add_norm(n: int, k: int, bias: bool, dtype: torch.dtype) -> None:
    x = randn(1, k, dtype=dtype, seed=3)
    w = randn(n, k, dtype=dtype, seed=4, scale=k**-0.5)
    b = randn(n, dtype=dtype, seed=5) if bias else None
    add_norm = add_norm_case(n, dtype)
    plain = triton_linear.gemv(x, w, b)
    assert_epilogue(plain, triton_linear.gemv_add_norm(x, w, b, add_norm), add_norm)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize(("n", "k", "bias"), [(9, 72, False), (40, 300, True)])
def test_w8_gemv_add_norm(fmt: str, n: int, k: int, bias: bool) -> None:
    dtype = torch.float16
    x = randn(1, k, dtype=dtype, seed=3)
    w = randn(n, k, dtype=torch.float32, seed=4, scale=0.05).cpu()
    q, scale = quantize_int8(w) if fmt == "int8" else quantize_fp8(w)
    q, scale = q.to(DEVICE), scale.to(DEVICE)
    b = randn(n, dtype=dtype, seed=5) if bias else None
    add_norm = add_norm_case(n, dtype)
    plain = gemv_w8(x, q, scale, b)
    assert_epilogue(plain, gemv_w8_add_norm(x, q, scale, b, add_norm), add_norm)


def test_add_norm_refuses_a_mismatched_residual() -> None:
    x = randn(1, 64, dtype=torch.float32, seed=3)
    w = randn(8, 64, dtype=torch.float32, seed=4)
    add_norm = add_norm_case(16, torch.float32)
    with pytest.raises(AssertionError):
        triton_linear.gemv_add_norm(x, w, None, add_norm)


# --- On a GPU: llama-3.1-8b's shapes (o_proj, down_proj: 1024-2048 programs arrive), the INT4
# MMA GEMV, a CUDA graph, and the layers taking the epilogue.


@cuda_only
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("k", [4096, 14336], ids=["o", "down"])
def test_cuda_llama_8b_shapes(fmt: str, k: int) -> None:
    n, dtype = 4096, torch.bfloat16
    x = randn(1, k, dtype=dtype, seed=3)
    add_norm = add_norm_case(n, dtype)
    if fmt == "bf16":
        w = randn(n, k, dtype=dtype, seed=4, scale=k**-0.5)
        assert_epilogue(triton_linear.gemv(x, w, None), triton_linear.gemv_add_norm(x, w, None, add_norm), add_norm)
        return
    w = randn(n, k, dtype=torch.float32, seed=4, scale=0.05).cpu()
    q, scale = quantize_int8(w) if fmt == "int8" else quantize_fp8(w)
    q, scale = q.cuda(), scale.cuda()
    assert_epilogue(gemv_w8(x, q, scale, None), gemv_w8_add_norm(x, q, scale, None, add_norm), add_norm)


@cuda_only
@pytest.mark.parametrize("tiled", [False, True], ids=["pairs", "tiles"])
@pytest.mark.parametrize(("k", "config"), [(4096, None), (14336, None), (1024, (1, 1, 3, 2))], ids=["o", "down", "split3"])
def test_cuda_int4_mma_gemv(tiled: bool, k: int, config: tuple[int, ...] | None) -> None:
    from kernels.int4_rows import gptq_to_pairs, pairs_to_tiles
    from kernels.triton_int4_mma_gemv import (
        MmaGemvConfig,
        gemv_pairs_mma,
        gemv_pairs_mma_add_norm,
        pick_mma_gemv_config,
    )
    from tests.kernels.test_int4_gemv import gptq_tensors

    n = 4096 if config is None else 336  # 336: a ragged last program; split3: 3 programs a tile arrive as one
    t = gptq_tensors(k, n, 128, 1)
    t["scales"] = t["scales"].bfloat16()
    weight = gptq_to_pairs(t["qweight"])
    weight = pairs_to_tiles(weight) if tiled else weight
    x = randn(1, k, dtype=torch.bfloat16, seed=3)
    cfg = MmaGemvConfig(*config) if config else pick_mma_gemv_config(n, k, 132)
    args = (x, weight, t["qzeros"], t["scales"], 128, 1, cfg)
    add_norm = add_norm_case(n, torch.bfloat16)
    assert_epilogue(gemv_pairs_mma(*args, tiled=tiled), gemv_pairs_mma_add_norm(*args, tiled, add_norm), add_norm)


@cuda_only
def test_cuda_graph_replays_the_epilogue() -> None:
    n, k, dtype = 4096, 4096, torch.bfloat16
    x = randn(1, k, dtype=dtype, seed=3)
    w = randn(n, k, dtype=dtype, seed=4, scale=k**-0.5)
    add_norm = add_norm_case(n, dtype)
    triton_linear.gemv_add_norm(x, w, None, add_norm)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, h = triton_linear.gemv_add_norm(x, w, None, add_norm)
    for seed in (10, 11):
        x.copy_(randn(1, k, dtype=dtype, seed=seed))
        add_norm.residual.copy_(randn(1, n, dtype=dtype, seed=seed + 1))
        graph.replay()
        expected_normed, expected_h = triton_linear.gemv_add_norm(x, w, None, add_norm)
        torch.testing.assert_close(h, expected_h, rtol=0, atol=0)
        torch.testing.assert_close(normed, expected_normed, rtol=0, atol=0)


@cuda_only
@pytest.mark.parametrize("method", ["bf16", "fp8", "int8"])
def test_cuda_layers_take_it_and_the_switch_turns_it_off(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """engine/layers/norm.py's add_norm through each linear class: the epilogue's launch, or
    with kernels.ADD_NORM_EPILOGUE off the GEMV then the norm kernel."""
    import kernels
    from engine.layers.linear import Linear
    from engine.layers.norm import RMSNorm, add_norm
    from engine.quantization.fp8 import Fp8Linear
    from engine.quantization.int8 import Int8Linear

    n, k, dtype = 512, 1024, torch.bfloat16
    dense = Linear(k, n, bias=False).to("cuda", dtype)
    proj: torch.nn.Module = dense
    if method != "bf16":
        proj = (Fp8Linear if method == "fp8" else Int8Linear)(k, n, False, dtype, torch.device("cuda"))
        proj.quantize_from(dense.weight.data.float(), None)
    norm = RMSNorm(n, EPS).to("cuda", dtype)
    norm.weight.data.copy_(add_norm_case(n, dtype).weight)
    x, residual = randn(1, k, dtype=dtype, seed=3), randn(1, n, dtype=dtype, seed=5)
    launches: list[str] = []
    monkeypatch.setattr(kernels, "fused_add_rms_norm", _counting(kernels.fused_add_rms_norm, launches))
    fused = add_norm(proj, x, residual, norm)
    assert launches == []
    monkeypatch.setattr(kernels, "ADD_NORM_EPILOGUE", False)
    unfused = add_norm(proj, x, residual, norm)
    assert launches == ["norm"]
    assert_epilogue(proj(x), fused, kernels.AddNorm(residual, norm.weight, EPS))
    torch.testing.assert_close(fused, unfused, rtol=8e-3, atol=8e-3)


def _counting(fn, launches: list[str]):  # type: ignore[no-untyped-def]
    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        launches.append("norm")
        return fn(*args, **kwargs)

    return counted
