"""PEFT adapter loading: what is served is read exactly, what is not is refused with a
message that says what to change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.lora_adapters import write_adapter
from vllm_cluster.engine.lora import LoRAAdapterError, load_adapter
from vllm_cluster.engine.models import ModelArchConfig

ARCH = ModelArchConfig.from_hf_dict({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "max_position_embeddings": 128,
})


def test_reads_weights_and_scale(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a", ARCH, rank=4, modules=("q_proj", "down_proj"))
    adapter = load_adapter("a", path, ARCH, max_rank=8)
    assert adapter.rank == 4 and adapter.scale == 2.0  # lora_alpha 8 / r 4
    assert sorted(adapter.weights) == [(0, "down_proj"), (0, "q_proj"), (1, "down_proj"), (1, "q_proj")]
    a, b = adapter.weights[(1, "down_proj")]
    saved = load_file(str(path / "adapter_model.safetensors"))
    assert torch.equal(a, saved["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"])
    assert b.shape == (32, 4)


def test_rslora_scale(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a", ARCH, rank=4, use_rslora=True)
    assert load_adapter("a", path, ARCH, max_rank=4).scale == 8 / 2  # alpha / sqrt(r)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "bias 'none'"),
        ({"target_modules": ["q_proj", "lm_head"]}, "target_modules must be among"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"peft_type": "IA3"}, "only LORA"),
    ],
)
def test_refuses_unservable_config(tmp_path: Path, overrides: dict[str, object], message: str) -> None:
    path = write_adapter(tmp_path / "a", ARCH, **overrides)
    with pytest.raises(LoRAAdapterError, match=message):
        load_adapter("a", path, ARCH, max_rank=8)


def test_refuses_rank_over_max(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a", ARCH, rank=16)
    with pytest.raises(
        LoRAAdapterError, match="rank 16 but max_lora_rank is 8: start the engine with max_lora_rank >= 16"
    ):
        load_adapter("a", path, ARCH, max_rank=8)


def test_refuses_wrong_shapes(tmp_path: Path) -> None:
    other = ModelArchConfig.from_hf_dict({**_hf(ARCH), "hidden_size": 40})
    path = write_adapter(tmp_path / "a", other)
    with pytest.raises(
        LoRAAdapterError, match=r"down_proj.lora_B.weight has shape \(40, 4\), expected \(32, 4\).*another base model"
    ):
        load_adapter("a", path, ARCH, max_rank=8)


def test_refuses_tensor_outside_target_modules(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a", ARCH)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj"]}))
    with pytest.raises(LoRAAdapterError, match="not in target_modules"):
        load_adapter("a", path, ARCH, max_rank=8)


def test_refuses_unknown_tensor_and_missing_files(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a", ARCH)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    save_file(
        {**tensors, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 32)},
        str(path / "adapter_model.safetensors"),
    )
    with pytest.raises(LoRAAdapterError, match="lm_head.lora_A.weight is not a lora_A/lora_B weight"):
        load_adapter("a", path, ARCH, max_rank=8)
    with pytest.raises(LoRAAdapterError, match="must be a PEFT adapter directory"):
        load_adapter("b", tmp_path / "nowhere", ARCH, max_rank=8)


def _hf(arch: ModelArchConfig) -> dict[str, object]:
    return {
        "architectures": [arch.architecture], "vocab_size": arch.vocab_size, "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size, "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads, "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim, "max_position_embeddings": arch.max_position_embeddings,
    }
