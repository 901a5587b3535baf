"""Routed MoE experts with 1-byte weights (the online int8 and fp8 methods): the quantized
`ExpertStack` (engine/models/mixtral.py) that the swap puts into each `SparseMoeBlock` in
place of its unquantized one, which is then freed.

Each expert's w13 [2I, D] and w2 [D, I] are quantized as the method's linear layers quantize
theirs (`W8Format.quantize`: one fp32 scale per output channel, so per expert and row) and
kept stacked: w13_qweight [E, 2I, D], w13_scale [E, 2I], w2_qweight [E, D, I], w2_scale
[E, D]. Every product is the method's own linear (`W8Format.product`: int8_linear or
fp8_linear of kernels/linear/dispatch.py) on one expert's slice, so the experts compute
exactly as the quantized dense layers do, on CPU and CUDA alike:
- grouped (SparseMoeBlock.forward_grouped): each expert on the rows routed to it;
- dense (forward_dense, small CUDA batches and CUDA graphs): each expert on every row, one
  product per expert (no host sync; no full-precision copy of the stack, which dequantizing
  it for one batched matmul would make).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class W8Format:
    """How an online method stores and multiplies a weight (engine/quantization/int8.py, fp8.py)."""

    name: str
    dtype: torch.dtype  # of the quantized weight
    # weight [N, K] -> (q [N, K] of dtype, scale [N] fp32), weight ~= q * scale[:, None]
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    # (x [M, K], q [N, K], scale [N]) -> x @ (q * scale[:, None]).T [M, N], in x's dtype
    product: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    # (out_features, in_features, device): raises ValueError where the kernels take no such weight
    check_shape: Callable[[int, int, torch.device], None]


class W8Experts(nn.Module):
    """A quantized `ExpertStack`: E experts of hidden size D and intermediate size I."""

    def __init__(
        self, fmt: W8Format, num_experts: int, hidden_size: int, intermediate_size: int, device: torch.device
    ) -> None:
        super().__init__()
        fmt.check_shape(2 * intermediate_size, hidden_size, device)
        fmt.check_shape(hidden_size, intermediate_size, device)
        self.fmt = fmt
        e, d, i = num_experts, hidden_size, intermediate_size
        self.register_buffer("w13_qweight", torch.empty(e, 2 * i, d, dtype=fmt.dtype, device=device))
        self.register_buffer("w13_scale", torch.empty(e, 2 * i, dtype=torch.float32, device=device))
        self.register_buffer("w2_qweight", torch.empty(e, d, i, dtype=fmt.dtype, device=device))
        self.register_buffer("w2_scale", torch.empty(e, d, dtype=torch.float32, device=device))

    w13_qweight: torch.Tensor  # [E, 2I, D]
    w13_scale: torch.Tensor  # [E, 2I] fp32
    w2_qweight: torch.Tensor  # [E, D, I]
    w2_scale: torch.Tensor  # [E, D] fp32

    @classmethod
    def quantize(cls, fmt: W8Format, w13: torch.Tensor, w2: torch.Tensor) -> W8Experts:
        """The stack of w13 [E, 2I, D] and w2 [E, D, I] (any float dtype), quantized one expert
        at a time: no full-precision copy of the whole stack is made."""
        num_experts, two_i, hidden = w13.shape
        assert w2.shape == (num_experts, hidden, two_i // 2), (w13.shape, w2.shape)
        experts = cls(fmt, num_experts, hidden, two_i // 2, w13.device)
        for e in range(num_experts):
            experts.w13_qweight[e], experts.w13_scale[e] = fmt.quantize(w13[e])
            experts.w2_qweight[e], experts.w2_scale[e] = fmt.quantize(w2[e])
        return experts

    @property
    def num_experts(self) -> int:
        return self.w13_qweight.shape[0]

    def keep(self, start: int, count: int) -> None:
        # Copied, so that the dropped experts are freed.
        for name in ("w13_qweight", "w13_scale", "w2_qweight", "w2_scale"):
            setattr(self, name, getattr(self, name)[start : start + count].clone())

    def gate_up(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        # x: [n, D] -> [n, 2I]
        return self.fmt.product(x, self.w13_qweight[expert], self.w13_scale[expert])

    def down(self, h: torch.Tensor, expert: int) -> torch.Tensor:
        # h: [n, I] -> [n, D]
        return self.fmt.product(h, self.w2_qweight[expert], self.w2_scale[expert])

    def gate_up_all(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, D] -> [E, T, 2I]
        return torch.stack([self.gate_up(x, e) for e in range(self.num_experts)])

    def down_all(self, h: torch.Tensor) -> torch.Tensor:
        # h: [E, T, I] -> [E, T, D]
        return torch.stack([self.down(h[e], e) for e in range(self.num_experts)])

    def extra_repr(self) -> str:
        e, two_i, d = self.w13_qweight.shape
        return f"num_experts={e}, hidden_size={d}, intermediate_size={two_i // 2}, {self.fmt.name} per-channel"
