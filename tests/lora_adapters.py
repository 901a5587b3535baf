"""PEFT-format LoRA adapters with random weights, written without peft (tests, benchmarks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from vllm_cluster.engine.lora.adapter import TARGET_MODULES, module_shape
from vllm_cluster.engine.models import ModelArchConfig

_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(
    directory: Path,
    arch: ModelArchConfig,
    rank: int = 4,
    seed: int = 0,
    modules: tuple[str, ...] = TARGET_MODULES,
    std: float = 0.05,
    **config: Any,
) -> Path:
    """adapter_config.json + adapter_model.safetensors in `directory`; `config` overrides
    adapter_config.json keys (e.g. use_dora=True) to build broken adapters."""
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for module in modules:
            out_features, in_features = module_shape(arch, module)
            prefix = f"base_model.model.model.layers.{layer}.{_PARENT[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) / in_features**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * std
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    meta = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules),
            "bias": "none", "use_rslora": False, "use_dora": False, **config}
    (directory / "adapter_config.json").write_text(json.dumps(meta))
    return directory
