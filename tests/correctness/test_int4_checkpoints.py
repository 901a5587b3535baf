"""GPTQ and AWQ checkpoints written by tests/correctness/int4_checkpoint.py load through the
real loader (config.json's quantization_config picks the method) and compute what their
dequantized weights compute; a checkpoint that does not match its declared format, or
declares an unsupported setting, is refused with a message naming the mismatch.

Tolerances (fp32 on CPU):
- against the same model holding the dequantized weights as floats: atol 1e-4. Both multiply
  the same fp32 weights ((q - zero) * fp16 scale is exact in fp32); only the order of the
  fp32 sums differs.
- against the unquantized weights: relative logit error < 0.35. Round-to-nearest INT4 in
  groups of 32 moves each weight by about 8-10% (relative Frobenius norm); through this
  random two-layer model that becomes 15-25% of the logits (measured), while a misread
  layout gives errors of 100% and more.
- the bundled SmolLM2-135M as a GPTQ checkpoint (act-order, groups of 64) against the
  same weights unquantized: relative logit error < 0.35 and mean KL < 1.0 nat, top-1 agreement
  >= 0.5 (measured 0.20, 0.52, 0.71). Loose because the bundled weights are already Q4_1 (4
  bits, groups of 32): round-to-nearest into other groups rounds them a second time, and a
  135M model has little slack; GPTQ's Hessian-based rounding, which the test does not
  implement, would do better. A misread layout gives noise (KL of several nats).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.correctness.int4_checkpoint import (
    TINY_LLAMA,
    Int4Settings,
    quantize_checkpoint,
    write_checkpoint,
    write_int4_pair,
)
from tests.correctness.mixtral_checkpoint import prefill_logits
from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.config import ModelConfig
from vllm_cluster.engine.errors import ModelLoadError
from vllm_cluster.engine.loader import bundled_model_path, load_model, resolve
from vllm_cluster.engine.loader.gguf_file import gguf_hf_config, gguf_weights
from vllm_cluster.engine.models import CausalLM
from vllm_cluster.engine.quantization.int4_linear import Int4Linear

PROMPTS = [[3, 141, 59, 26, 5], [(37 * i + 11) % 256 for i in range(29)]]
SETTINGS = {
    "gptq": Int4Settings("gptq"),
    "gptq_act_order_sym": Int4Settings("gptq", sym=True, desc_act=True),
    "gptq_v2_one_group": Int4Settings("gptq", group_size=-1, checkpoint_format="gptq_v2"),
    "awq": Int4Settings("awq"),
    "gptq_lm_head": Int4Settings("gptq", desc_act=True, lm_head=True),
}
_SMALL_ENGINE: dict[str, Any] = dict(device="cpu", dtype="float32", num_blocks=32, block_size=4, max_model_len=64)


def load(path: Path, quantization: str | None = None) -> CausalLM:
    source = resolve(ModelConfig(model=str(path), quantization=quantization))
    return load_model(source, torch.float32, torch.device("cpu"))


def logits(model: CausalLM) -> torch.Tensor:
    return torch.cat(prefill_logits(model, PROMPTS))  # [T, V]


@pytest.fixture(scope="module", params=list(SETTINGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path, Path]:
    name = request.param
    return (name, *write_int4_pair(tmp_path_factory.mktemp(name), SETTINGS[name]))


def test_checkpoint_computes_its_dequantized_weights(pair: tuple[str, Path, Path, Path]) -> None:
    name, quantized_dir, dequantized_dir, float_dir = pair
    model = load(quantized_dir)  # the method comes from config.json
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Int4Linear) and qkv.spec.method == SETTINGS[name].method
    assert qkv.act_order == SETTINGS[name].desc_act
    assert isinstance(model.lm_head, Int4Linear) == SETTINGS[name].lm_head
    actual = logits(model)
    torch.testing.assert_close(actual, logits(load(dequantized_dir)), rtol=0, atol=1e-4)
    unquantized = logits(load(float_dir))
    relative_error = float((actual - unquantized).norm() / unquantized.norm())
    assert relative_error < 0.35, relative_error


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["gptq", "awq", "gptq_lm_head"])
def test_gpu_kernels_compute_the_dequantized_model(method: str, tmp_path: Path) -> None:
    """On a GPU in bf16, with dims that fit the pairs layout (kernels/int4_rows.py): one
    token (the batch-1 GEMV), 2 prompts of 34 tokens (the tensor-core kernel) and one of 150
    (cuBLAS on the dequantized weight) against the dequantized twin, whose bf16 weights
    cuBLAS multiplies: relative logit error < 2e-2 (bf16 rounds the twin's weights and
    both models' activations; a misread layout gives 100%)."""
    config = {**TINY_LLAMA, "hidden_size": 256, "intermediate_size": 512, "max_position_embeddings": 256}
    settings = Int4Settings(method.removesuffix("_lm_head"), group_size=128, lm_head=method.endswith("_lm_head"))
    quantized_dir, dequantized_dir, _ = write_int4_pair(tmp_path, settings, model_config=config)

    def load_gpu(path: Path) -> CausalLM:
        return load_model(resolve(ModelConfig(model=str(path))), torch.bfloat16, torch.device("cuda"))

    quantized, dequantized = load_gpu(quantized_dir), load_gpu(dequantized_dir)
    layers = [quantized.model.layers[0].self_attn.qkv_proj, quantized.model.layers[1].mlp.down_proj]
    layers += [quantized.lm_head] if settings.lm_head else []
    assert all(isinstance(layer, Int4Linear) and layer.layout == "tiles" for layer in layers)
    for prompts in (
        [[7]],
        [list(range(3, 37)), [(11 * i) % 256 for i in range(34)]],
        [[(5 * i + 1) % 256 for i in range(150)]],
    ):
        actual = torch.cat(prefill_logits(quantized, prompts, block_size=16)).float()
        expected = torch.cat(prefill_logits(dequantized, prompts, block_size=16)).float()
        relative_error = float((actual - expected).norm() / expected.norm())
        assert relative_error < 2e-2, (len(prompts), relative_error)


@pytest.mark.parametrize("name", ["gptq_act_order_sym", "gptq_lm_head"])
def test_greedy_tokens_equal_dequantized_model(name: str, tmp_path: Path) -> None:
    quantized_dir, dequantized_dir, _ = write_int4_pair(tmp_path, SETTINGS[name])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = [
        [o.outputs[0].token_ids for o in LLM(str(path), **_SMALL_ENGINE).generate(PROMPTS, params, use_tqdm=False)]
        for path in (quantized_dir, dequantized_dir)
    ]
    assert outputs[0] == outputs[1]


def rewrite(path: Path, name: str, tensor: torch.Tensor) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    tensors[name] = tensor
    save_file(tensors, str(path / "model.safetensors"))


def test_wrong_shaped_qzeros_is_refused(tmp_path: Path) -> None:
    quantized_dir, _, _ = write_int4_pair(tmp_path, SETTINGS["awq"])
    # k_proj has 32 outputs: qzeros [2 groups, 32 / 8]; a [2, 8] one belongs to another layout.
    rewrite(quantized_dir, "model.layers.1.self_attn.k_proj.qzeros", torch.zeros(2, 8, dtype=torch.int32))
    with pytest.raises(ModelLoadError) as info:
        load(quantized_dir)
    message = str(info.value)
    assert "qzeros" in message and "(2, 4)" in message and "(2, 8)" in message


def test_unquantized_weight_in_a_gptq_checkpoint_is_refused(tmp_path: Path) -> None:
    quantized_dir, _, _ = write_int4_pair(tmp_path, SETTINGS["gptq"])
    rewrite(quantized_dir, "model.layers.0.mlp.down_proj.weight", torch.zeros(64, 128))
    with pytest.raises(ModelLoadError, match="'weight' has no place"):
        load(quantized_dir)


def test_quantized_lm_head_of_a_tied_model_is_refused(tmp_path: Path) -> None:
    settings = Int4Settings("gptq", lm_head=True)
    quantized_dir, _, _ = write_int4_pair(tmp_path, settings, model_config={**TINY_LLAMA, "tie_word_embeddings": True})
    with pytest.raises(ModelLoadError, match="lm_head is true.*tie_word_embeddings"):
        LLM(str(quantized_dir), **_SMALL_ENGINE)


@pytest.mark.parametrize("declared", [True, False])
def test_lm_head_that_does_not_match_the_declared_flag_is_refused(tmp_path: Path, declared: bool) -> None:
    # lm_head: true over an unquantized lm_head.weight, or false over a packed lm_head.
    quantized_dir, _, _ = write_int4_pair(tmp_path, Int4Settings("gptq", lm_head=not declared))
    config = json.loads((quantized_dir / "config.json").read_text())
    config["quantization_config"]["lm_head"] = declared
    (quantized_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as info:
        load(quantized_dir)
    message = str(info.value)
    assert ("lm_head.weight: " if declared else "checkpoint tensor lm_head.") in message
    assert ("lm_head is true, but lm_head is not quantized" if declared else "must say lm_head: true") in message


@pytest.mark.parametrize(
    "setting, value, words",
    [
        ("bits", 8, ["bits", "8", "4-bit"]),
        ("version", "gemv", ["version", "gemv", "gemm"]),
        ("lm_head", "yes", ["lm_head", "'yes'", "true or false"]),
    ],
)
def test_unsupported_setting_is_refused(tmp_path: Path, setting: str, value: Any, words: list[str]) -> None:
    settings = SETTINGS["awq"] if setting == "version" else SETTINGS["gptq"]
    quantized_dir, _, _ = write_int4_pair(tmp_path, settings)
    config = json.loads((quantized_dir / "config.json").read_text())
    config["quantization_config"][setting] = value
    (quantized_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as info:
        LLM(str(quantized_dir), **_SMALL_ENGINE)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_dummy_weights_for_int4_methods(method: str) -> None:
    # Every input dim a multiple of the default group size (128), as AWQ needs.
    tiny = dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=256,
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(
            "llama-3.2-1b", load_format="dummy", quantization=method, hf_overrides=tiny, seed=3, **_SMALL_ENGINE
        )
        down = llm.core.model.model.layers[1].mlp.down_proj
        assert isinstance(down, Int4Linear) and down.spec.method == method
        assert int(down.qweight.count_nonzero()) > 0
        runs.append(llm.generate(PROMPTS, params, use_tqdm=False)[1].outputs[0].token_ids)
    assert runs[0] == runs[1] and len(runs[0]) == 4


@pytest.mark.slow
def test_smollm2_as_gptq_stays_close_to_unquantized(smollm2: LLM, tmp_path: Path) -> None:
    gguf = bundled_model_path()
    hf_config = gguf_hf_config(gguf)
    settings = Int4Settings("gptq", group_size=64, sym=True, desc_act=True)
    packed, _ = quantize_checkpoint(dict(gguf_weights(gguf, hf_config)), settings)
    write_checkpoint(tmp_path, {**hf_config, "quantization_config": settings.quantization_config()}, packed)
    prompts = [[1, 4093, 314, 253, 5248, 30, 216, 2683, 28, 2683, 5005, 30], list(range(100, 140))]
    actual = torch.cat(prefill_logits(load(tmp_path), prompts))
    expected = torch.cat(prefill_logits(smollm2.core.model, prompts))
    relative_error = float((actual - expected).norm() / expected.norm())
    kl = torch.nn.functional.kl_div(
        actual.log_softmax(-1), expected.log_softmax(-1), log_target=True, reduction="batchmean"
    )
    top1 = float((actual.argmax(-1) == expected.argmax(-1)).float().mean())
    assert relative_error < 0.35 and float(kl) < 1.0 and top1 >= 0.5, (relative_error, float(kl), top1)
