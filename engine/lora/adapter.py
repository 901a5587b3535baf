"""A PEFT LoRA adapter, loaded from its directory and checked against the base model.

The directory holds adapter_config.json (r, lora_alpha, use_rslora, target_modules, ...)
and adapter_model.safetensors with, per adapted linear of layer i,
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r]. The delta is scale * B @ A, scale = lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora). Everything this engine cannot serve exactly is
refused with what to change: DoRA, biases, modules_to_save, per-module ranks, modules
other than q/k/v/o/gate/up/down_proj, ranks over max_lora_rank, misshapen tensors.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_cluster.engine.errors import InvalidRequestError
from vllm_cluster.engine.models import ModelArchConfig

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAAdapterError(InvalidRequestError):
    """An adapter directory this engine cannot serve; the message says what to change."""


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scale: float
    # (layer index, module in TARGET_MODULES) -> (A [r, in], B [out, r]), on CPU.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def module_shape(arch: ModelArchConfig, module: str) -> tuple[int, int]:
    """(out_features, in_features) of a target module in this architecture."""
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    h, i = arch.hidden_size, arch.intermediate_size
    return {
        "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
        "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
    }[module]


def load_adapter(name: str, path: str | Path, arch: ModelArchConfig, max_rank: int) -> LoRAAdapter:
    """Read and validate the PEFT directory `path`; raises LoRAAdapterError."""
    directory = Path(path)
    config = _read_config(name, directory)
    rank, modules = _check_config(name, config, max_rank)
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = _read_tensors(name, directory)
    weights = _pair_tensors(name, tensors, modules, rank, arch)
    return LoRAAdapter(name=name, path=str(path), rank=rank, scale=scale, weights=weights)


def _read_config(name: str, directory: Path) -> dict[str, Any]:
    config_path = directory / "adapter_config.json"
    if not config_path.is_file():
        raise LoRAAdapterError(
            f"LoRA adapter {name!r}: {config_path} does not exist; lora_path must be a PEFT adapter "
            "directory (adapter_config.json + adapter_model.safetensors)"
        )
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {config_path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {config_path} must hold a JSON object")
    return config


def _check_config(name: str, config: dict[str, Any], max_rank: int) -> tuple[int, set[str]]:
    """(rank, target modules) of a servable config."""
    where = f"LoRA adapter {name!r}: adapter_config.json"
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{where} has peft_type {config['peft_type']!r}; only LORA adapters are served")
    if config.get("use_dora"):
        raise LoRAAdapterError(f"{where} is a DoRA adapter (use_dora: true), which is not served: train a plain LoRA")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(
            f"{where} has bias {config['bias']!r}; only bias 'none' is served: retrain with bias='none'"
        )
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise LoRAAdapterError(
                f"{where} sets {key}, which is not served: remove it (one rank and alpha for all modules)"
            )
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"{where} has r {rank!r}; it must be a positive integer")
    if rank > max_rank:
        raise LoRAAdapterError(
            f"LoRA adapter {name!r} has rank {rank} but max_lora_rank is {max_rank}: "
            f"start the engine with max_lora_rank >= {rank}"
        )
    targets = config.get("target_modules")
    if targets == "all-linear":
        targets = list(TARGET_MODULES)
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets:
        raise LoRAAdapterError(f"{where} has target_modules {targets!r}; list modules among {list(TARGET_MODULES)}")
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise LoRAAdapterError(
            f"LoRA adapter {name!r} targets {unknown}, which cannot be adapted here: "
            f"target_modules must be among {list(TARGET_MODULES)}"
        )
    return rank, set(targets)


def _read_tensors(name: str, directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = directory / "adapter_model.safetensors"
    if not path.is_file():
        raise LoRAAdapterError(
            f"LoRA adapter {name!r}: {path} does not exist (adapter_model.bin is not read: "
            "save the adapter with safe_serialization=True)"
        )
    return load_file(str(path))


def _pair_tensors(
    name: str, tensors: dict[str, torch.Tensor], modules: set[str], rank: int, arch: ModelArchConfig
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: tensor {key} is not a lora_A/lora_B weight of a decoder "
                f"layer's {'/'.join(TARGET_MODULES)}; remove it from adapter_model.safetensors"
            )
        layer, module, half = int(match[1]), match[2], match[3]
        if module not in modules:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: tensor {key} adapts {module}, which is not in target_modules "
                f"{sorted(modules)}: add it there or drop the tensor"
            )
        if layer >= arch.num_hidden_layers:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: tensor {key} names layer {layer}; the model has {arch.num_hidden_layers}"
            )
        out_features, in_features = module_shape(arch, module)
        expected = (rank, in_features) if half == "A" else (out_features, rank)
        if tuple(tensor.shape) != expected:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: tensor {key} has shape {tuple(tensor.shape)}, expected {expected} "
                f"(rank {rank} and this model's {module}): was it trained for another base model?"
            )
        halves.setdefault((layer, module), {})[half] = tensor.float()
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: layer {layer} {module} has lora_{set(pair).pop()} without its pair"
            )
        weights[(layer, module)] = (pair["A"], pair["B"])
    if not weights:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
    return weights
