"""GPTQ and AWQ INT4 layouts: packing against hand-computed words, dequantize(pack(w))
against the integers it was packed from (unpacked by a bit-by-bit loop written apart from
kernels/int4/reference.py), config refusals, and Int4Linear's shard loading and checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vllm_cluster.engine.errors import ModelLoadError
from vllm_cluster.engine.quantization.awq import AwqMethod, awq_spec
from vllm_cluster.engine.quantization.gptq import GptqMethod, gptq_spec
from vllm_cluster.engine.quantization.int4_linear import Int4Linear, Int4Spec
from vllm_cluster.engine.quantization.int4_pack import (
    Int4Weights,
    act_order_g_idx,
    pack_awq,
    pack_cols,
    pack_gptq,
    pack_rows,
    quantize_rtn,
)
from vllm_cluster.kernels.int4.reference import dequantize, int4_gemm
from vllm_cluster.kernels.int4.weight import Int4Weight


def word(value: int) -> int:
    """An unsigned 32-bit word as the int32 a checkpoint stores."""
    return value - 2**32 if value >= 2**31 else value


def nibble(packed: torch.Tensor, row: int, col: int, index: int) -> int:
    return (int(packed[row, col]) >> (4 * index)) & 0xF


def test_pack_rows_is_gptq_qweight_order() -> None:
    # Inputs 0..7 of one output hold 1..8: input j sits in nibble j (LSB first).
    q = torch.arange(1, 9, dtype=torch.int32)[:, None].repeat(1, 2)
    q[:, 1] = 15 - q[:, 1]
    assert pack_rows(q).tolist() == [[word(0x87654321), word(0x789ABCDE)]]


def test_pack_cols_gptq_is_sequential_awq_is_interleaved() -> None:
    q = torch.arange(1, 9, dtype=torch.int32)[None, :]  # outputs 0..7 hold 1..8
    assert pack_cols(q, "gptq").tolist() == [[word(0x87654321)]]
    # AWQ nibble i holds output AWQ_ORDER[i] = 0, 2, 4, 6, 1, 3, 5, 7.
    assert pack_cols(q, "awq").tolist() == [[word(0x86427531)]]


def random_int4(in_features: int, out_features: int, num_groups: int, seed: int, g_idx: torch.Tensor) -> Int4Weights:
    gen = torch.Generator().manual_seed(seed)
    return Int4Weights(
        q=torch.randint(0, 16, (in_features, out_features), generator=gen, dtype=torch.int32),
        zeros=torch.randint(1, 16, (num_groups, out_features), generator=gen, dtype=torch.int32),
        scales=(torch.rand(num_groups, out_features, generator=gen) * 0.1 + 0.01).half(),
        g_idx=g_idx,
    )


def loop_dequantize(tensors: dict[str, torch.Tensor], layout: str, zero_offset: int, group_size: int) -> torch.Tensor:
    """The format's description, word by word: an independent unpacking."""
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    num_groups, out_features = scales.shape
    in_features = qweight.shape[0] * 8 if layout == "gptq" else qweight.shape[0]
    order = [0, 2, 4, 6, 1, 3, 5, 7] if layout == "awq" else list(range(8))
    out = torch.empty(in_features, out_features)
    for k in range(in_features):
        g = int(tensors["g_idx"][k]) if "g_idx" in tensors else k // group_size
        for n in range(out_features):
            index = order.index(n % 8)
            q = nibble(qweight, k // 8, n, k % 8) if layout == "gptq" else nibble(qweight, k, n // 8, index)
            zero = nibble(qzeros, g, n // 8, index) + zero_offset
            out[k, n] = (q - zero) * float(scales[g, n])
    return out


@pytest.mark.parametrize("layout, zero_offset", [("gptq", 1), ("gptq", 0), ("awq", 0)])
def test_dequantize_of_pack_matches_loop_and_integers(layout: str, zero_offset: int) -> None:
    in_features, out_features, group_size = 32, 16, 8
    g_idx = torch.arange(in_features, dtype=torch.int32) // group_size
    weights = random_int4(in_features, out_features, 4, seed=1, g_idx=g_idx)
    tensors = pack_gptq(weights, zero_offset) if layout == "gptq" else pack_awq(weights)
    expected = (weights.q - weights.zeros[g_idx.long()]).float() * weights.scales.float()[g_idx.long()]
    looped = loop_dequantize(tensors, layout, zero_offset, group_size)
    g = tensors.get("g_idx")
    fast = dequantize(
        Int4Weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], g, group_size, layout, zero_offset)
    )
    assert torch.equal(looped, expected)
    assert torch.equal(fast, expected)


def test_gptq_v1_stores_zero_minus_one() -> None:
    weights = random_int4(8, 8, 1, seed=2, g_idx=torch.zeros(8, dtype=torch.int32))
    v1, v2 = pack_gptq(weights, 1)["qzeros"], pack_gptq(weights, 0)["qzeros"]
    for n in range(8):
        assert nibble(v1, 0, 0, n) == int(weights.zeros[0, n]) - 1
        assert nibble(v2, 0, 0, n) == int(weights.zeros[0, n])


def test_act_order_g_idx_dequantizes_by_group_of_each_input() -> None:
    in_features, out_features, group_size = 32, 8, 8
    perm = torch.randperm(in_features, generator=torch.Generator().manual_seed(3))
    g_idx = act_order_g_idx(in_features, group_size, perm)
    assert not torch.equal(g_idx, g_idx.sort().values)  # really not monotonic
    assert g_idx[perm[:group_size]].tolist() == [0] * group_size
    weights = random_int4(in_features, out_features, 4, seed=3, g_idx=g_idx)
    tensors = pack_gptq(weights)
    looped = loop_dequantize(tensors, "gptq", 1, group_size)
    fast = dequantize(
        Int4Weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], group_size, "gptq", 1)
    )
    assert torch.equal(fast, looped)


@pytest.mark.parametrize("sym", [True, False])
def test_rtn_error_is_at_most_half_a_step(sym: bool) -> None:
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(4))  # [N, K]
    q = quantize_rtn(weight, group_size=16, sym=sym, min_zero=1)
    tensors = pack_gptq(q)
    w = dequantize(Int4Weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], None, 16, "gptq", 1)).t()
    step = q.scales.float().repeat_interleave(16, dim=0).t()  # [N, K]
    # Half a step of rounding, plus the scale's own fp16 rounding over up to 15 steps.
    assert bool(((w - weight).abs() <= step * (0.5 + 15 * 2**-10) + 1e-6).all())
    if sym:
        assert bool((q.zeros == 8).all())


def gptq_config(**overrides: Any) -> dict[str, Any]:
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
    return {"quantization_config": qc | overrides}


def awq_config(**overrides: Any) -> dict[str, Any]:
    qc = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    return {"quantization_config": qc | overrides}


def test_configs_read_into_specs() -> None:
    assert gptq_spec(gptq_config()) == Int4Spec("gptq", 128, 1)
    assert gptq_spec(gptq_config(group_size=-1, checkpoint_format="gptq_v2")) == Int4Spec("gptq", -1, 0)
    assert awq_spec(awq_config(version="GEMM")) == Int4Spec("awq", 128, 0)
    # AutoAWQ's older key names.
    assert awq_spec({"quantization_config": {"quant_method": "awq", "w_bit": 4, "q_group_size": 64}}) == Int4Spec(
        "awq", 64, 0
    )
    GptqMethod.from_hf_config(gptq_config(desc_act=True)).check_hf_config(gptq_config(desc_act=True))


@pytest.mark.parametrize(
    "check, config, words",
    [
        (gptq_spec, gptq_config(bits=8), ["bits", "8", "4-bit"]),
        (gptq_spec, gptq_config(group_size=0), ["group_size", "-1"]),
        (gptq_spec, gptq_config(checkpoint_format="marlin"), ["checkpoint_format", "gptq_v2"]),
        (awq_spec, awq_config(bits=3), ["bits", "3"]),
        (awq_spec, awq_config(version="gemv"), ["version", "gemv", "gemm"]),
        (awq_spec, awq_config(zero_point=False), ["zero_point"]),
        (awq_spec, gptq_config(), ["quant_method", "gptq"]),
    ],
)
def test_unsupported_settings_are_named(check: Any, config: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ModelLoadError) as info:
        check(config)
    for w in words:
        assert w in str(info.value)


def qkv_layer(spec: Int4Spec, sizes: list[int]) -> Int4Linear:
    layer = GptqMethod(spec) if spec.method == "gptq" else AwqMethod(spec)
    module = layer.create_linear(32, sum(sizes), True, sizes, torch.float32, torch.device("cpu"))
    assert isinstance(module, Int4Linear)
    return module


@pytest.mark.parametrize("spec", [Int4Spec("gptq", 16, 1), Int4Spec("awq", 16, 0)], ids=["gptq", "awq"])
def test_fused_shards_equal_separate_layers(spec: Int4Spec) -> None:
    sizes = [16, 8, 8]
    fused = qkv_layer(spec, sizes)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(5))
    expected = []
    for part, size in enumerate(sizes):
        weights = quantize_rtn(
            torch.randn(size, 32, generator=torch.Generator().manual_seed(part)), 16, sym=False, min_zero=1
        )
        tensors = pack_gptq(weights) if spec.method == "gptq" else pack_awq(weights)
        tensors["bias"] = torch.full((size,), float(part))
        for name, tensor in tensors.items():
            fused.load_shard(name, tensor, part)
        g = tensors.get("g_idx")
        y = int4_gemm(
            x,
            Int4Weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], g, 16, spec.method, spec.zero_offset),
        )
        expected.append(y + part)
    fused.finish_loading()
    torch.testing.assert_close(fused(x), torch.cat(expected, dim=1), rtol=0, atol=1e-6)


def test_awq_is_repacked_as_gptq_with_the_same_weights() -> None:
    """After loading, an AWQ layer holds GPTQ v2 tensors (packed along K, sequential zeros)
    that dequantize to exactly the checkpoint's AWQ weights."""
    layer = Int4Linear(Int4Spec("awq", 16, 0), 32, [24], bias=False, dtype=torch.float32, device=torch.device("cpu"))
    weights = quantize_rtn(torch.randn(24, 32, generator=torch.Generator().manual_seed(3)), 16, sym=False, min_zero=0)
    tensors = pack_awq(weights)
    for name, tensor in tensors.items():
        layer.load_shard(name, tensor)
    layer.finish_loading()
    assert layer.layout == "gptq" and tuple(layer.qweight.shape) == (4, 24) and tuple(layer.qzeros.shape) == (2, 3)
    awq = dequantize(Int4Weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], None, 16, "awq", 0))
    assert torch.equal(dequantize(Int4Weight(layer.qweight, layer.qzeros, layer.scales, None, 16, "gptq", 0)), awq)
    assert torch.equal(
        awq,
        (weights.q - weights.zeros.repeat_interleave(16, 0)).float() * weights.scales.float().repeat_interleave(16, 0),
    )
    with pytest.raises(AssertionError, match="repacked"):
        layer.load_shard("scales", tensors["scales"])


def test_wrong_shaped_qzeros_is_named() -> None:
    layer = qkv_layer(Int4Spec("gptq", 16, 1), [16, 8, 8])
    with pytest.raises(ModelLoadError) as info:
        layer.load_shard("qzeros", torch.zeros(2, 2, dtype=torch.int32), 1)  # k_proj: 8 outputs -> [2, 1]
    message = str(info.value)
    assert "qzeros" in message and "(2, 1)" in message and "(2, 2)" in message


def test_missing_and_mismatched_tensors_are_refused() -> None:
    layer = qkv_layer(Int4Spec("gptq", 16, 1), [16])
    with pytest.raises(ModelLoadError, match="lacks qweight of part 0"):
        layer.finish_loading()
    with pytest.raises(ModelLoadError, match="int32"):
        layer.load_shard("qweight", torch.zeros(4, 16), 0)
    with pytest.raises(ModelLoadError, match="unquantized"):
        layer.load_shard("weight", torch.zeros(16, 32), 0)


def test_fused_parts_with_different_act_order_are_refused() -> None:
    layer = qkv_layer(Int4Spec("gptq", 16, 1), [16, 8, 8])
    gen = torch.Generator().manual_seed(6)
    layer.load_shard("g_idx", act_order_g_idx(32, 16, torch.randperm(32, generator=gen)), 0)
    assert layer.act_order
    with pytest.raises(ModelLoadError, match="g_idx of part 1 differs"):
        layer.load_shard("g_idx", act_order_g_idx(32, 16, torch.randperm(32, generator=gen)), 1)


def test_features_the_format_cannot_hold_are_refused() -> None:
    with pytest.raises(ModelLoadError, match="multiples of 8"):
        Int4Linear(Int4Spec("gptq", 16, 1), 32, [12], False, torch.float32, torch.device("cpu"))
    with pytest.raises(ModelLoadError, match="group_size 24"):
        Int4Linear(Int4Spec("awq", 24, 0), 32, [16], False, torch.float32, torch.device("cpu"))
