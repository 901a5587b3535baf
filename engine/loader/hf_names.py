"""Checkpoint tensors whose HF names or layout differ from the ones CausalLM.load_weights
maps, put into that shape first.

Phi-3 / Phi-4 checkpoints store q, k and v as one `qkv_proj` and gate and up as one
`gate_up_proj`, in the order our fused layers hold them. They are split back into the
Llama names (`q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`), so that loading,
quantized shards and LoRA see one naming for every family.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from vllm_cluster.engine.errors import ModelLoadError
from vllm_cluster.engine.models import ModelArchConfig


def hf_weights(
    arch: ModelArchConfig, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` as CausalLM.load_weights takes them."""
    if arch.family != "phi3":
        yield from weights
        return
    q_size, kv_size = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    qkv_sizes = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}
    for name, tensor in weights:
        if ".self_attn.qkv_proj." in name:
            yield from _split(name, tensor, ".self_attn.qkv_proj.", qkv_sizes)
        elif ".mlp.gate_up_proj." in name:
            half = tensor.shape[0] // 2
            yield from _split(name, tensor, ".mlp.gate_up_proj.", {"gate_proj": half, "up_proj": half})
        else:
            yield name, tensor


def _split(name: str, tensor: torch.Tensor, fused: str, sizes: dict[str, int]) -> Iterator[tuple[str, torch.Tensor]]:
    # tensor: [sum(sizes), ...] (weight [N, D] or bias [N]): row blocks, in order.
    prefix, _, leaf = name.partition(fused)
    if leaf not in ("weight", "bias"):
        raise ModelLoadError(
            f"{name}: quantized fused Phi-3 tensors ({leaf}) are not supported; load an unquantized checkpoint"
        )
    if tensor.shape[0] != sum(sizes.values()):
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects {sum(sizes.values())} rows")
    parent = fused.split(".")[1]  # self_attn or mlp
    for part, rows in zip(sizes, tensor.split(list(sizes.values())), strict=True):
        yield f"{prefix}.{parent}.{part}.{leaf}", rows
