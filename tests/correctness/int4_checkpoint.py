"""Tiny GPTQ / AWQ checkpoints for tests: seeded float Llama weights, quantized by
round-to-nearest (engine/quantization/int4_pack.py) and written as an HF directory
(config.json with quantization_config + model.safetensors in the format's layout), beside
the same model with the dequantized weights as plain floats."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_cluster.engine.quantization.int4_pack import (
    Int4Weights,
    act_order_g_idx,
    pack_awq,
    pack_gptq,
    quantize_rtn,
)

TINY_LLAMA: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, torch_dtype="float32",
)
# Linear -> which input it reads: fused parts (q/k/v, gate/up) read the same input and so
# share an act-order permutation.
STD = 0.1  # linear weights; larger makes this random 2-layer model chaotic
LINEAR_INPUTS = {
    "self_attn.q_proj": "attn", "self_attn.k_proj": "attn", "self_attn.v_proj": "attn",
    "self_attn.o_proj": "o", "mlp.gate_proj": "mlp", "mlp.up_proj": "mlp", "mlp.down_proj": "down",
}


@dataclass(frozen=True, slots=True)
class Int4Settings:
    method: str  # "gptq" or "awq"
    group_size: int = 32
    sym: bool = False
    desc_act: bool = False  # GPTQ act-order: a random permutation per input
    checkpoint_format: str = "gptq"  # GPTQ v1 ("gptq", stores zero - 1) or "gptq_v2"
    lm_head: bool = False  # GPTQ: lm_head quantized too (GPTQModel's `lm_head: true`)

    def quantization_config(self) -> dict[str, Any]:
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "zero_point": True,
                    "version": "gemm", "modules_to_not_convert": None}
        return {"quant_method": "gptq", "bits": 4, "group_size": self.group_size, "desc_act": self.desc_act,
                "sym": self.sym, "damp_percent": 0.01, "static_groups": False, "true_sequential": True,
                "checkpoint_format": self.checkpoint_format, "lm_head": self.lm_head}


def float_weights(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named fp32 weights of a Llama config; std 0.2 so logits are far from uniform."""
    d, inter, hd = (config["hidden_size"], config["intermediate_size"],
                    config["hidden_size"] // config["num_attention_heads"])
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], d),
                                          "model.norm.weight": (d,), "lm_head.weight": (config["vocab_size"], d)}
    linear: dict[str, tuple[int, ...]] = {"self_attn.q_proj": (q, d), "self_attn.k_proj": (kv, d),
                                          "self_attn.v_proj": (kv, d), "self_attn.o_proj": (d, q),
                                          "mlp.gate_proj": (inter, d), "mlp.up_proj": (inter, d),
                                          "mlp.down_proj": (d, inter)}
    for i in range(config["num_hidden_layers"]):
        shapes[f"model.layers.{i}.input_layernorm.weight"] = (d,)
        shapes[f"model.layers.{i}.post_attention_layernorm.weight"] = (d,)
        for name, shape in linear.items():
            shapes[f"model.layers.{i}.{name}.weight"] = shape
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=generator)
        weights[name] = 1.0 + 0.1 * noise if name.endswith("norm.weight") else STD * noise
    return weights


def _is_linear(name: str) -> str | None:
    for linear in LINEAR_INPUTS:
        if name.endswith(f".{linear}.weight"):
            return linear
    return None


def quantize_checkpoint(
    weights: dict[str, torch.Tensor], settings: Int4Settings, seed: int = 0
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(checkpoint tensors in the format's layout, the same model with each linear replaced
    by its dequantized float weight, computed from the integers before packing)."""
    generator = torch.Generator().manual_seed(seed)
    perms: dict[tuple[str, str], torch.Tensor] = {}
    packed: dict[str, torch.Tensor] = {}
    dequantized = dict(weights)
    for name, weight in weights.items():
        linear = "lm_head" if settings.lm_head and name == "lm_head.weight" else _is_linear(name)
        if linear is None:
            packed[name] = weight
            continue
        prefix = name.removesuffix(".weight")
        in_features = weight.shape[1]
        g_idx = None
        if settings.desc_act:
            key = (prefix.split(".self_attn")[0].split(".mlp")[0], LINEAR_INPUTS.get(linear, "lm_head"))
            perm = perms.setdefault(key, torch.randperm(in_features, generator=generator))
            g_idx = act_order_g_idx(in_features, settings.group_size, perm)
        min_zero = 1 if settings.method == "gptq" and settings.checkpoint_format == "gptq" else 0
        q = quantize_rtn(weight, settings.group_size, settings.sym, g_idx, min_zero)
        dequantized[name] = explicit_dequantize(q)
        if settings.method == "gptq":
            tensors = pack_gptq(q, zero_offset=1 if settings.checkpoint_format == "gptq" else 0)
        else:
            tensors = pack_awq(q)
        packed.update({f"{prefix}.{key}": value for key, value in tensors.items()})
    return packed, dequantized


def explicit_dequantize(q: Int4Weights) -> torch.Tensor:
    """[N, K] fp32 straight from the integers: (q - zero) * scale, per input's group."""
    rows = q.g_idx.long()
    return ((q.q - q.zeros[rows]).float() * q.scales.float()[rows]).t().contiguous()


def write_checkpoint(path: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def write_int4_pair(
    root: Path, settings: Int4Settings, seed: int = 0, model_config: dict[str, Any] | None = None
) -> tuple[Path, Path, Path]:
    """(quantized checkpoint, its dequantized float twin, the unquantized original) under
    root; model_config: TINY_LLAMA unless given."""
    base = TINY_LLAMA if model_config is None else model_config
    weights = float_weights(base, seed)
    packed, dequantized = quantize_checkpoint(weights, settings, seed)
    config = {**base, "quantization_config": settings.quantization_config()}
    quantized_dir = write_checkpoint(root / "quantized", config, packed)
    return quantized_dir, write_checkpoint(root / "dequantized", base, dequantized), write_checkpoint(
        root / "float", base, weights
    )
