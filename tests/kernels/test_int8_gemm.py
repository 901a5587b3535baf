"""The INT8 weight-only GEMM and the per-token FP8 activation quantizer (Triton) against
their torch definitions in kernels/linear/dispatch.py.

Without a GPU the kernels run under the Triton interpreter on tiny shapes in fp32 and
fp16 (the interpreter's bf16 arithmetic is wrong); shapes are not multiples of the
tiles, so the masks are exercised.
"""

from __future__ import annotations

import pytest
import torch

from vllm_cluster.engine.quantization.int8 import quantize_int8
from vllm_cluster.kernels.linear import dispatch as linear_ops
from vllm_cluster.kernels.linear import reference as linear_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: the kernel and the reference sum the same products in another order.
# fp16: the kernel multiplies fp16 x by exact int8 values, accumulating in fp32, then rounds once.
TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-3}


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 72), (5, 33, 300), (20, 64, 48)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_gemm_matches_reference(dtype: torch.dtype, m: int, n: int, k: int, with_bias: bool) -> None:
    from vllm_cluster.kernels.linear.triton_int8_gemm import int8_gemm

    qweight, scale = quantize_int8(randn(n, k, seed=1))
    x = randn(m, k, dtype=dtype, seed=2)
    bias = randn(n, dtype=dtype, seed=3) if with_bias else None
    expected = linear_reference.int8_linear_reference(x, qweight, scale, bias)
    actual = int8_gemm(x, qweight, scale, bias)
    assert actual.dtype == dtype and actual.shape == (m, n)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int8_gemm_takes_fp8_weights(dtype: torch.dtype) -> None:
    """FP8's weight-only decode path (up to 16 rows) runs the same tiles on fp8 codes."""
    from vllm_cluster.engine.quantization.fp8 import quantize_fp8
    from vllm_cluster.kernels.linear.triton_int8_gemm import int8_gemm

    qweight, scale = quantize_fp8(randn(33, 300, seed=12))
    x = randn(5, 300, dtype=dtype, seed=13)
    bias = randn(33, dtype=dtype, seed=14)
    expected = linear_reference.fp8_weight_only_reference(x, qweight, scale, bias)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(int8_gemm(x, qweight, scale[None, :].contiguous(), bias), expected, atol=tol, rtol=tol)


def test_int8_gemm_reads_strided_input() -> None:
    """A column slice of a wider activation (as qkv splits produce) needs no copy."""
    from vllm_cluster.kernels.linear.triton_int8_gemm import int8_gemm

    qweight, scale = quantize_int8(randn(24, 40, seed=4))
    wide = randn(3, 56, seed=5)
    x = wide[:, 8:48]
    expected = linear_reference.int8_linear_reference(x, qweight, scale, None)
    torch.testing.assert_close(int8_gemm(x, qweight, scale, None), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_per_token_quant_fp8_matches_reference(dtype: torch.dtype) -> None:
    from vllm_cluster.kernels.linear.triton_fp8_quant import per_token_quant_fp8

    x = randn(6, 50, dtype=dtype, seed=6) * torch.arange(1, 7, device=DEVICE, dtype=dtype)[:, None]
    x[3] = 0  # a padding row: scale floors at MIN_AMAX / 448, values stay 0
    q, scale = per_token_quant_fp8(x)
    q_ref, scale_ref = linear_reference.per_token_quant_fp8_reference(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    assert torch.equal(q[3].float().cpu(), torch.zeros(50))
    if not torch.cuda.is_available():
        # The triton 3.6 interpreter's fp32 -> fp8 cast is wrong (7.75 becomes 4.0), so
        # the codes are compared only where the kernel compiles.
        return
    # The same fp32 quotient rounds to the same code; allow one code where the GPU's
    # division differs from torch's in the last bit.
    codes, codes_ref = q.float().cpu(), q_ref.float().cpu()
    assert bool(((codes - codes_ref).abs() <= codes_ref.abs() / 8 + 2**-9).all())
    assert (codes == codes_ref).float().mean() > 0.98


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch._scaled_mm)")
@pytest.mark.parametrize("m", [1, 7, 300])
def test_fp8_linear_on_cuda_matches_its_cpu_definition(m: int) -> None:
    """torch._scaled_mm with rowwise scales computes what the CPU emulation computes."""
    from vllm_cluster.engine.quantization.fp8 import quantize_fp8

    qweight, scale = quantize_fp8(randn(256, 512, seed=7))
    x = randn(m, 512, dtype=torch.bfloat16, seed=8)
    bias = randn(256, dtype=torch.bfloat16, seed=9)
    actual = linear_ops.fp8_linear(x, qweight, scale[None, :].contiguous(), bias)
    expected = linear_reference.fp8_linear_reference(x, qweight, scale, bias)
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual, expected, atol=3e-2, rtol=1.6e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 16, 100, 300])
def test_int8_linear_on_cuda_bf16(m: int) -> None:
    qweight, scale = quantize_int8(randn(1024, 768, seed=10))
    x = randn(m, 768, dtype=torch.bfloat16, seed=11)
    actual = linear_ops.int8_linear(x, qweight, scale, None)
    expected = linear_reference.int8_linear_reference(x, qweight, scale, None)
    torch.testing.assert_close(actual, expected, atol=3e-2, rtol=1.6e-2)

