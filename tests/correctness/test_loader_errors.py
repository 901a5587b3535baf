"""Bad model sources fail with a ModelLoadError that says what is wrong, and
`load_format: dummy` builds a preset with seeded random weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.errors import ModelLoadError
from vllm_cluster.engine.loader import bundled_model_path

_SMALL_ENGINE: dict[str, Any] = dict(device="cpu", dtype="float32", num_blocks=16, block_size=4, max_model_len=64)


def _load(path: Path | str, **options: Any) -> LLM:
    return LLM(str(path), **{**_SMALL_ENGINE, **options})


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid tiny Llama checkpoint (config.json + model.safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(str(path), safe_serialization=True)
    return path


@pytest.fixture
def checkpoint_copy(checkpoint_dir: Path, tmp_path: Path) -> Path:
    path = tmp_path / "model"
    shutil.copytree(checkpoint_dir, path)
    return path


def test_valid_checkpoint_loads(checkpoint_copy: Path) -> None:
    # The baseline the damaged copies below are made from.
    llm = _load(checkpoint_copy)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_missing_path_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_model"
    with pytest.raises(ModelLoadError, match="no_such_model"):
        _load(missing)


def test_directory_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        _load(tmp_path)


def test_unsupported_architecture_lists_supported(checkpoint_copy: Path) -> None:
    config_file = checkpoint_copy / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    config_file.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel") as info:
        _load(checkpoint_copy)
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert supported in str(info.value)


def test_corrupt_safetensors(checkpoint_copy: Path) -> None:
    weights = checkpoint_copy / "model.safetensors"
    noise = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    weights.write_bytes(noise.numpy().tobytes())
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        _load(checkpoint_copy)


def test_truncated_safetensors(checkpoint_copy: Path) -> None:
    weights = checkpoint_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        _load(checkpoint_copy)


def test_checkpoint_missing_a_tensor(checkpoint_copy: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = checkpoint_copy / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"lacks 1 tensors.*layers\.1\.mlp\.gate_up_proj"):
        _load(checkpoint_copy)


def test_truncated_gguf(tmp_path: Path) -> None:
    data = bundled_model_path().read_bytes()
    half = tmp_path / "half.gguf"
    half.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"half\.gguf.*(not a readable GGUF file|may be truncated)"):
        _load(half)


def _dummy_tokens(seed: int) -> list[list[int]]:
    llm = LLM(
        "qwen3-0.6b",
        load_format="dummy",
        hf_overrides={"num_hidden_layers": 1},
        seed=seed,
        **_SMALL_ENGINE,
    )
    arch = llm.core.model.config
    assert (arch.architecture, arch.num_hidden_layers, arch.head_dim) == ("Qwen3ForCausalLM", 1, 128)
    prompts = [[11, 22, 33], [151000, 5, 7, 9, 1000, 2]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def test_dummy_preset_is_deterministic_per_seed() -> None:
    first = _dummy_tokens(seed=0)
    assert [len(tokens) for tokens in first] == [6, 6]
    assert _dummy_tokens(seed=0) == first
    assert _dummy_tokens(seed=1) != first
