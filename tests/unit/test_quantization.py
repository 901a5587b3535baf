"""INT8 and FP8 formats against references written from their descriptions, the
quantized linears against the definitions in kernels/linear/reference.py, and how a method is
chosen or refused (config, checkpoint's quantization_config, MoE checkpoints)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from vllm_cluster.engine import LLM, ConfigError, EngineConfig, ModelLoadError, SamplingParams
from vllm_cluster.engine.quantization import METHOD_NAMES, get_method, select_method
from vllm_cluster.engine.quantization.fp8 import Fp8Linear, dequantize_fp8, quantize_fp8
from vllm_cluster.engine.quantization.int8 import Int8Linear, dequantize_int8, quantize_int8
from vllm_cluster.kernels.linear import dispatch as linear_ops
from vllm_cluster.kernels.linear import reference as linear_reference
from vllm_cluster.kernels.linear import torch_ops as linear_torch_ops

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
)
ENGINE = dict(load_format="dummy", hf_overrides=TINY, device="cpu", dtype="float32", num_blocks=32, max_num_seqs=4)


def weights(n: int = 24, k: int = 40, seed: int = 0) -> torch.Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    w[0] *= 100  # rows of very different ranges: scales must be per row
    w[1] = 0  # an all-zero row
    return w


# --- INT8: symmetric, per output channel: s = max|w_row| / 127, q = round_half_even(w / s)


def int8_reference(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    q = np.zeros(w.shape, dtype=np.int8)
    scales = np.ones(w.shape[0], dtype=np.float32)
    for i, row in enumerate(w.astype(np.float32)):
        amax = max(abs(float(v)) for v in row)
        if amax == 0:
            continue
        scales[i] = np.float32(amax) / np.float32(127)
        for j, v in enumerate(row):
            q[i, j] = max(-127, min(127, round(float(np.float32(v) / scales[i]))))  # round(): half to even
    return q, scales


def test_int8_matches_reference_and_round_trips_within_half_a_step() -> None:
    w = weights()
    q, scale = quantize_int8(w)
    q_ref, scale_ref = int8_reference(w.numpy())
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    np.testing.assert_array_equal(q.numpy(), q_ref)
    np.testing.assert_array_equal(scale.numpy(), scale_ref)
    error = (dequantize_int8(q, scale) - w).abs()
    assert bool((error <= scale[:, None] / 2 * (1 + 1e-5)).all())
    assert int(q.abs().max()) == 127 and bool((q[1] == 0).all())


# --- FP8 e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
# subnormal (m/8 * 2^-6); no infinities; S.1111.111 is NaN, so the largest finite is
# 1.75 * 2^8 = 448. Casting rounds to the nearest value, ties to an even mantissa.


def e4m3fn_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def e4m3fn_encode(v: float) -> int:
    """The code of the finite value nearest v (|v| <= 448), ties to the even code."""
    best = None
    for code in range(256):
        value = e4m3fn_value(code)
        if math.isnan(value) or (value == 0 and code == 0x80 and v >= 0):
            continue
        key = (abs(value - v), code & 1)
        if best is None or key < best[0]:
            best = (key, code)
    assert best is not None
    code = best[1]
    return 0x80 if code == 0 and (v < 0 or (v == 0 and math.copysign(1, v) < 0)) else code


def test_fp8_codes_decode_as_the_format_describes() -> None:
    decoded = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    for code, value in enumerate(decoded):
        expected = e4m3fn_value(code)
        assert (math.isnan(value) and math.isnan(expected)) or value == expected, hex(code)
    assert max(v for v in decoded if not math.isnan(v)) == linear_reference.FP8_MAX


def test_fp8_matches_reference_and_round_trips_within_the_format_step() -> None:
    w = weights(n=8, k=24, seed=1)
    q, scale = quantize_fp8(w)
    amax = w.abs().amax(dim=1)
    expected_scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    torch.testing.assert_close(scale, expected_scale, rtol=0, atol=0)
    codes = q.view(torch.uint8).tolist()
    for i in range(w.shape[0]):
        quotients = (w[i] / scale[i]).tolist()  # fp32 division, as quantize_fp8 does
        assert codes[i] == [e4m3fn_encode(v) for v in quotients], f"row {i}"
    # Relative error of a normal e4m3 value is at most half a mantissa step: 2^-4.
    error = (dequantize_fp8(q, scale) - w).abs()
    assert bool((error <= w.abs() / 16 + scale[:, None] * 2.0**-9).all())


# --- The modules and their CPU paths


@pytest.mark.parametrize("with_bias", [False, True])
def test_quantized_linears_equal_their_definitions(with_bias: bool) -> None:
    w = weights(n=48, k=40, seed=2)
    bias = torch.randn(48) if with_bias else None
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(3))
    int8 = Int8Linear(40, 48, with_bias, torch.float32, torch.device("cpu"))
    int8.quantize_from(w, bias)
    q, scale = quantize_int8(w)
    torch.testing.assert_close(int8(x), linear_reference.int8_linear_reference(x, q, scale, bias), rtol=1e-5, atol=1e-4)
    fp8 = Fp8Linear(40, 48, with_bias, torch.float32, torch.device("cpu"))
    fp8.quantize_from(w, bias)
    q8, scale8 = quantize_fp8(w)
    torch.testing.assert_close(fp8(x), linear_reference.fp8_linear_reference(x, q8, scale8, bias), rtol=1e-5, atol=1e-4)
    # And both stay near the unquantized product.
    exact = torch.nn.functional.linear(x, w, bias)
    span = float(exact.abs().max())
    assert float((int8(x) - exact).abs().max()) < 0.02 * span
    assert float((fp8(x) - exact).abs().max()) < 0.1 * span


def test_cpu_paths_chunk_a_large_weight_without_changing_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_torch_ops, "CPU_CHUNK_ELEMS", 7 * 40)  # 7 rows per chunk, a ragged last one
    w, x = weights(n=30, k=40, seed=4), torch.randn(3, 40)
    q, scale = quantize_int8(w)
    torch.testing.assert_close(
        linear_ops.int8_linear(x, q, scale, None),
        linear_reference.int8_linear_reference(x, q, scale, None),
        rtol=1e-5,
        atol=1e-4,
    )
    q8, scale8 = quantize_fp8(w)
    torch.testing.assert_close(
        linear_ops.fp8_linear(x, q8, scale8[None, :], None),
        linear_reference.fp8_linear_reference(x, q8, scale8, None), rtol=1e-5, atol=1e-4,
    )


# --- Choosing and refusing a method


def test_unknown_method_is_refused_with_the_supported_ones() -> None:
    with pytest.raises(ConfigError, match=r"model.quantization: 'int3'.*'int8', 'fp8', 'gptq', 'awq'"):
        LLM("llama-3.2-1b", quantization="int3", **ENGINE)
    with pytest.raises(ConfigError, match="int3"):
        get_method("int3")


def test_yaml_names_the_method(tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("engine:\n  model:\n    model: smollm2-135m-instruct\n    quantization: fp8\n")
    assert EngineConfig.from_yaml(path).model.quantization == "fp8"
    path.write_text("engine:\n  model:\n    quantization: int4\n")
    with pytest.raises(ConfigError, match="int4"):
        EngineConfig.from_yaml(path)


def test_parallel_with_quantization_is_refused() -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineConfig.from_kwargs("smollm2-135m-instruct", quantization="int8", tensor_parallel_size=2)


def test_checkpoint_declaration_selects_or_conflicts() -> None:
    assert set(METHOD_NAMES) == {"int8", "fp8", "gptq", "awq"}
    assert select_method(None, {}) is None
    assert select_method("int8", {}) == "int8"
    with pytest.raises(ModelLoadError, match=r"'int8'.*quant_method 'awq'"):
        select_method("int8", {"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ModelLoadError, match="'bitsandbytes', which is not supported"):
        select_method(None, {"quantization_config": {"quant_method": "bitsandbytes"}})
    # A pre-quantized fp8 checkpoint is not what the online fp8 method loads.
    with pytest.raises(ModelLoadError, match="already quantized"):
        select_method(None, {"quantization_config": {"quant_method": "fp8"}})


def test_engine_refuses_a_checkpoint_of_another_format(tmp_path: Path) -> None:
    config = {"architectures": ["LlamaForCausalLM"], **TINY, "quantization_config": {"quant_method": "gptq", "bits": 4}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"quantization 'fp8' was asked for.*'gptq'"):
        LLM(str(tmp_path), quantization="fp8", **{**ENGINE, "hf_overrides": {}})


def test_checkpoint_methods_refuse_moe_models() -> None:
    """The online methods quantize MoE experts (tests/unit/test_quantized_experts.py); a gptq or
    awq checkpoint packs linear layers only."""
    with pytest.raises(ConfigError, match=r"'gptq' does not support mixture-of-experts.*'fp8' or 'int8'"):
        LLM("mixtral-tiny", quantization="gptq", load_format="dummy", device="cpu", dtype="float32", num_blocks=32)


@pytest.mark.parametrize(("method", "module_type"), [("int8", Int8Linear), ("fp8", Fp8Linear)])
def test_engine_swaps_every_projection_and_generates(method: str, module_type: type) -> None:
    llm = LLM("llama-3.2-1b", quantization=method, **ENGINE)
    layer: Any = llm.core.model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(linear, module_type)
    assert isinstance(llm.core.model.lm_head, torch.nn.Linear)  # the lm_head stays unquantized
    out = llm.generate(
        [[1, 5, 9, 17], [4, 8]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]


@pytest.mark.parametrize(("method", "module_type"), [("int8", Int8Linear), ("fp8", Fp8Linear)])
@pytest.mark.parametrize("tied", [False, True], ids=["own-lm-head", "tied-to-embedding"])
def test_quantize_lm_head_swaps_it_and_keeps_the_embedding(method: str, module_type: type, tied: bool) -> None:
    llm = LLM("llama-3.2-1b", quantization=method, quantize_lm_head=True,
              **{**ENGINE, "hf_overrides": {**TINY, "tie_word_embeddings": tied}})  # fmt: skip
    model: Any = llm.core.model
    assert isinstance(model.lm_head, module_type)
    embedding = model.model.embed_tokens.weight
    assert embedding.dtype == torch.float32  # the embedding stays as loaded, tied or not
    # lm_head holds a quantized copy of its own weight (the embedding's, where tied)
    reference = LLM("llama-3.2-1b", **{**ENGINE, "hf_overrides": {**TINY, "tie_word_embeddings": tied}}).core.model
    torch.testing.assert_close(embedding, reference.model.embed_tokens.weight)
    hidden = torch.randn(3, TINY["hidden_size"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference.lm_head(hidden)
        got = model.lm_head(hidden)
    assert not torch.equal(got, want)  # quantized: not the float product
    rel = float((got - want).norm() / want.norm())
    assert rel < (0.01 if method == "int8" else 0.1), rel  # a step of the format, not a wrong layout
    out = llm.generate([[1, 5, 9, 17]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_quantize_lm_head_needs_an_online_method(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="quantize_lm_head needs model.quantization 'fp8' or 'int8'"):
        LLM("llama-3.2-1b", quantize_lm_head=True, **ENGINE)
    config = {"architectures": ["LlamaForCausalLM"], **TINY, "quantization_config": {"quant_method": "gptq", "bits": 4}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConfigError, match=r"applies to the online methods.*'gptq' checkpoint.*quantization_config.lm_head"
    ):
        LLM(str(tmp_path), quantize_lm_head=True, **{**ENGINE, "hf_overrides": {}})
    path = tmp_path / "engine.yaml"
    path.write_text("engine:\n  model:\n    quantization: fp8\n    quantize_lm_head: true\n")
    assert EngineConfig.from_yaml(path).model.quantize_lm_head
