"""The Triton INT4 dequantize-GEMM (kernels/int4/triton_gemm.py) against its torch
reference (kernels/int4/reference.py), for GPTQ (consecutive groups, act-order g_idx, one
group, v1 and v2 zeros) and AWQ, through the decode (split-K) and prefill configs.

Without a GPU: the Triton interpreter, tiny shapes, fp32 and fp16. With one: Llama-8B
shapes in bf16 and fp16 as well.
"""

from __future__ import annotations

import functools

import pytest
import torch

from vllm_cluster.engine.quantization.int4_pack import act_order_g_idx, pack_awq, pack_gptq, quantize_rtn
from vllm_cluster.kernels.int4 import reference as int4_reference
from vllm_cluster.kernels.int4.triton_gemm import DEQUANT_MIN_ROWS, Int4GemmConfig, int4_gemm, pick_config
from vllm_cluster.kernels.int4.weight import Int4Weight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# The kernel and the reference multiply the same dequantized values (exact in fp32) in x's
# dtype with fp32 sums; what differs is the rounding of W to x's dtype and the sum order.
TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


@functools.lru_cache(maxsize=8)
def packed(
    method: str, in_features: int, out_features: int, group_size: int, act_order: bool, zero_offset: int = 1
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(in_features + out_features)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    g_idx = None
    if act_order:
        g_idx = act_order_g_idx(in_features, group_size, torch.randperm(in_features, generator=gen))
    q = quantize_rtn(weight, group_size, sym=False, g_idx=g_idx, min_zero=zero_offset)
    tensors = pack_gptq(q, zero_offset) if method == "gptq" else pack_awq(q)
    return {k: v.to(DEVICE) for k, v in tensors.items()}


def check(
    method: str,
    m: int,
    k: int,
    n: int,
    group_size: int,
    dtype: torch.dtype,
    act_order: bool = False,
    zero_offset: int = 1,
    config: Int4GemmConfig | None = None,
) -> None:
    offset = zero_offset if method == "gptq" else 0
    t = packed(method, k, n, group_size, act_order, offset)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    g_idx = t["g_idx"] if act_order else None
    args = (t["qweight"], t["qzeros"], t["scales"], g_idx, group_size, method, offset)
    actual = int4_gemm(x, Int4Weight(*args), config=config)
    expected = int4_reference.int4_gemm(x, Int4Weight(*args))
    assert actual.dtype == dtype and actual.shape == (m, n)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


# Each layout through both weight loads (one word per value, and one per 8 values), the
# GEMV and the tl.dot variant, with and without split-K.
GEMV = Int4GemmConfig(block_m=4, block_n=16, block_k=32, split_k=2, wide_load=True, gemv=True)
DECODE = Int4GemmConfig(block_m=16, block_n=16, block_k=32, split_k=2, wide_load=True)
PREFILL = Int4GemmConfig(block_m=16, block_n=32, block_k=16, split_k=1, wide_load=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", [GEMV, DECODE, PREFILL], ids=["gemv", "split_k", "prefill"])
@pytest.mark.parametrize("act_order", [False, True], ids=["groups", "act_order"])
def test_gptq(dtype: torch.dtype, config: Int4GemmConfig, act_order: bool) -> None:
    check("gptq", 3, 64, 32, 32, dtype, act_order=act_order, config=config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", [GEMV, DECODE, PREFILL], ids=["gemv", "split_k", "prefill"])
def test_awq(dtype: torch.dtype, config: Int4GemmConfig) -> None:
    check("awq", 3, 64, 32, 32, dtype, config=config)


def test_gptq_v2_one_group_ragged_m_and_n() -> None:
    # M and N not multiples of the blocks; group_size -1; zeros stored as is (v2).
    for wide in (True, False):
        config = Int4GemmConfig(16, 16, 32, 1, wide_load=wide)
        check("gptq", 17, 64, 40, -1, torch.float32, zero_offset=0, config=config)
        check("awq", 17, 64, 40, 32, torch.float32, config=config)


def test_default_config_small_group() -> None:
    # The launcher shrinks block_k to 16 so a tile stays inside one group of 16.
    check("awq", 2, 64, 16, 16, torch.float32)


def test_gemv_one_row() -> None:
    check("gptq", 1, 64, 16, 32, torch.float16, config=Int4GemmConfig(1, 16, 32, 1, gemv=True))


def test_prefill_rows_dequantize_then_matmul() -> None:
    # Above DEQUANT_MIN_ROWS rows the default path dequantizes (a Triton kernel) and matmuls.
    check("gptq", DEQUANT_MIN_ROWS + 2, 64, 16, 32, torch.float32, act_order=True)
    check("awq", DEQUANT_MIN_ROWS + 2, 64, 16, 16, torch.float32)


def test_pick_config() -> None:
    assert pick_config(1, 4096, 14336).split_k > 1
    assert pick_config(1, 4096, 14336).gemv
    assert pick_config(3, 4096, 14336).block_m == 4
    assert not pick_config(16, 4096, 14336).gemv
    assert pick_config(100, 14336, 4096).split_k == 1


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16, 512])
@pytest.mark.parametrize(
    "method, k, n, act_order",
    [("gptq", 4096, 14336, False), ("gptq", 14336, 4096, True), ("awq", 4096, 6144, False)],
)
def test_cuda_llama_8b_shapes(dtype: torch.dtype, m: int, method: str, k: int, n: int, act_order: bool) -> None:
    check(method, m, k, n, 128, dtype, act_order=act_order)
