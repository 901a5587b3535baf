"""LoRA applied to a built model from outside (as tensor parallelism is, in
engine/parallel/tensor.py): each adapted linear is replaced by a LoRALinear that calls
whatever module sat there (nn.Linear, or a quantized linear) and adds the batch's deltas.

A LoRALinear holds `max_loras` slots of stacked, zero-padded weights. A fused linear
(qkv_proj, gate_up_proj) has one A per part, concatenated along the rank, and one B per
part, stacked along the output columns: one shrink for the whole input, then one expand
for all parts (part p's columns read s's rank block p). The scale is folded into B when
an adapter is written into a slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm_cluster.engine.models import CausalLM
from vllm_cluster.kernels.lora.dispatch import SlotGroups, lora_expand_add, lora_shrink

# Our fused module -> the HF modules it holds, in output order.
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}


@dataclass(slots=True)
class LoRAContext:
    """What every LoRALinear of a model reads each step (the manager fills it)."""

    token_slots: torch.Tensor  # [max_num_tokens] int64, static (CUDA graphs read it): -1 = base
    # False: no token of this (eager) step has an adapter, skip the LoRA math. Graphs are
    # captured with it True, so a replay always runs the kernels over token_slots.
    active: bool = True
    # This step's tokens grouped by slot, known on the host (CPU: one gather and two
    # matmuls per adapter); None on CUDA (token-block Triton kernels, graph-safe).
    groups: SlotGroups | None = None


class LoRALinear(nn.Module):
    def __init__(
        self,
        base: nn.Module,
        context: LoRAContext,
        part_sizes: list[int],
        in_features: int,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.base = base
        self.context = context
        self.part_sizes = tuple(part_sizes)
        self.max_rank = max_rank
        num_parts = len(part_sizes)
        # lora_a: [L, P*R, in]; lora_b: [L, sum(out_p), R], part p in columns part_starts[p]..
        device = context.token_slots.device
        self.lora_a = torch.zeros(max_loras, num_parts * max_rank, in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, sum(part_sizes), max_rank, dtype=dtype, device=device)
        self.part_starts = [sum(part_sizes[:p]) for p in range(num_parts)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, sum(part_sizes)]
        y = self.base(x)
        if not self.context.active:
            return y
        slots = self.context.token_slots[: x.shape[0]]
        groups = self.context.groups
        s = lora_shrink(x, self.lora_a, slots, groups)  # [S, T, P*R] fp32 partials
        lora_expand_add(y, s, self.lora_b, slots, self.part_sizes, groups)
        return y

    def write_slot(self, slot: int, part: int, a: torch.Tensor | None, b: torch.Tensor | None, scale: float) -> None:
        """Put one part's A [r, in] and B [out, r] into `slot` (None: zero it)."""
        r, start = self.max_rank, self.part_starts[part]
        rows = self.lora_a[slot, part * r : (part + 1) * r]  # [R, in]
        cols = self.lora_b[slot, start : start + self.part_sizes[part]]  # [out_p, R]
        rows.zero_()
        cols.zero_()
        if a is None or b is None:
            return
        rank = a.shape[0]
        rows[:rank].copy_(a)
        cols[:, :rank].copy_(b * scale)


def apply_lora(
    model: CausalLM, context: LoRAContext, max_loras: int, max_rank: int, dtype: torch.dtype
) -> dict[tuple[int, str], tuple[LoRALinear, int]]:
    """Wrap every adaptable linear of `model` in place (again, over the same bases, if it
    was wrapped before); returns (layer, HF module name) -> (its LoRALinear, part index)."""
    targets: dict[tuple[int, str], tuple[LoRALinear, int]] = {}
    for i, layer in enumerate(model.model.layers):
        for path, parts in FUSED_PARTS.items():
            parent_name, attr = path.split(".")
            parent = getattr(layer, parent_name)
            base = getattr(parent, attr, None)
            if base is None:
                continue  # an MoE block has no gate_up_proj/down_proj to adapt
            if isinstance(base, LoRALinear):
                base = base.base
            sizes = _part_sizes(model, path, base)
            wrapped = LoRALinear(base, context, sizes, _in_features(base), max_loras, max_rank, dtype)
            setattr(parent, attr, wrapped)
            for part, module in enumerate(parts):
                targets[(i, module)] = (wrapped, part)
    return targets


def _in_features(base: nn.Module) -> int:
    in_features = getattr(base, "in_features", None)
    assert isinstance(in_features, int), f"cannot adapt {type(base).__name__}: it has no in_features"
    return in_features


def _part_sizes(model: CausalLM, path: str, base: nn.Module) -> list[int]:
    c = model.config
    out_features = getattr(base, "out_features", None)
    assert isinstance(out_features, int), f"cannot adapt {type(base).__name__}: it has no out_features"
    if path == "self_attn.qkv_proj":
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        return [q, kv, kv]
    if path == "mlp.gate_up_proj":
        return [out_features // 2, out_features // 2]
    return [out_features]
