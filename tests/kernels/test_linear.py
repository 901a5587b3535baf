"""The one-row Triton GEMV (kernels/linear/triton_gemv.py) against F.linear, and the dispatch.

Under the interpreter on CPU with tiny shapes; on a GPU the same tests run compiled, plus
llama-3.1-8b's batch-1 shapes in bf16. Tolerance: fp32 accumulation in a different order
than the reference, so fp32 agrees to 1e-5 relative and fp16 to the output's rounding.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from vllm_cluster.kernels.elementwise import dispatch as elementwise_ops
from vllm_cluster.kernels.elementwise import triton_ops
from vllm_cluster.kernels.linear import dispatch as linear_ops
from vllm_cluster.kernels.linear import triton_gemv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype) / k**0.5
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("n", "k", "bias"),
    [(8, 64, False), (7, 64, True), (5, 100, False), (6, 1500, True), (3, 2048, False)],
    ids=["even", "odd-n-bias", "odd-k", "k-over-block-bias", "two-k-blocks"],
)
def test_gemv_matches_linear(n: int, k: int, bias: bool, dtype: torch.dtype) -> None:
    x, w, b = _case(n, k, dtype, bias)
    y = triton_gemv.gemv(x, w, b)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert y.shape == (1, n) and y.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(y.float(), ref, **tol)


def test_gemv_reads_a_strided_weight_view() -> None:
    """A weight that is a row slice of a larger one (stride(0) > K) still reads its own rows."""
    x, w, _ = _case(12, 64, torch.float32, False)
    wide = torch.cat([w, torch.full_like(w, 100.0)], dim=1)[:, :64]
    torch.testing.assert_close(triton_gemv.gemv(x, wide, None), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_gemv_refuses_more_than_one_row() -> None:
    x, w, _ = _case(4, 64, torch.float32, False)
    with pytest.raises(AssertionError, match="one contiguous row"):
        triton_gemv.gemv(x.expand(2, 64), w, None)


def test_dispatch_equals_linear_for_every_shape() -> None:
    x, w, b = _case(6, 32, torch.float32, True)
    for rows in (1, 3):
        xs = x.expand(rows, 32).contiguous()
        torch.testing.assert_close(linear_ops.linear(xs, w, b), F.linear(xs, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="realistic shapes in bf16 need a GPU")
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (3072, 2048)])
def test_gemv_llama_shapes_bf16(n: int, k: int) -> None:
    x, w, _ = _case(n, k, torch.bfloat16, False)
    y = linear_ops.linear(x, w)
    ref = F.linear(x.float(), w.float())
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2)


# --- SiLU-and-mul fused into the GEMV (gate_up_proj at batch 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("n", "k", "bias"), [(16, 64, False), (14, 100, True), (6, 2048, False)], ids=["even", "odd", "two-k"]
)
def test_gemv_silu_mul_equals_silu_and_mul_of_the_gemv(n: int, k: int, bias: bool, dtype: torch.dtype) -> None:
    """What the two launches give: the halves rounded to x's dtype, silu rounded, then the
    product (the Triton silu_and_mul kernel's sequence). Equal under the interpreter; compiled,
    the fp32 row sums may be added in another order (another tile layout), hence a tolerance."""

    x, w, b = _case(n, k, dtype, bias, seed=3)
    fused = triton_gemv.gemv(x, w, b, silu_mul=True)
    assert fused.shape == (1, n // 2) and fused.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(fused, triton_ops.silu_and_mul(triton_gemv.gemv(x, w, b)), **tol)


def test_linear_silu_mul_dispatch_equals_two_calls() -> None:
    x, w, b = _case(8, 32, torch.float32, True)
    for rows in (1, 3):
        xs = x.expand(rows, 32).contiguous()
        expected = elementwise_ops.silu_and_mul(linear_ops.linear(xs, w, b))
        torch.testing.assert_close(linear_ops.linear_silu_mul(xs, w, b), expected, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="realistic shapes in bf16 need a GPU")
def test_linear_silu_mul_llama_gate_up_bf16() -> None:
    x, w, _ = _case(28672, 4096, torch.bfloat16, False)
    expected = elementwise_ops.silu_and_mul(linear_ops.linear(x, w))
    torch.testing.assert_close(linear_ops.linear_silu_mul(x, w), expected, rtol=1e-2, atol=1e-2)
