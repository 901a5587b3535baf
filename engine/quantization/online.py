"""What the online methods (int8, fp8) share: the checkpoint holds ordinary weights, which
load into the unquantized model first; each linear is then replaced by `linear_class`
and filled through its `quantize_from(weight, bias)` (engine/quantization/base.py), and each
MoE layer's routed experts by a stack quantized alike (`quantize_experts`, in `expert_format`:
engine/quantization/experts.py)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from vllm_cluster.engine.errors import ModelLoadError
from vllm_cluster.engine.quantization.experts import W8Experts, W8Format


class OnlineMethod:
    name: ClassVar[str]
    linear_class: ClassVar[type[nn.Module]]
    expert_format: ClassVar[W8Format]
    quantizes_checkpoint = False

    def __init__(self, quantize_lm_head: bool = False) -> None:
        # lm_head too (`model.quantize_lm_head`): the logits read the quantized weight; a
        # model that ties lm_head to the embedding keeps a full-precision embedding.
        self.quantizes_lm_head = quantize_lm_head

    def check_hf_config(self, hf_config: dict[str, Any]) -> None:
        refuse_prequantized(self.name, hf_config)

    def create_linear(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        output_sizes: list[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> nn.Module:
        return self.linear_class(in_features, out_features, bias, dtype, device)

    def quantize_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> W8Experts:
        """One MoE layer's routed experts, w13 [E, 2I, D] and w2 [E, D, I], quantized: the
        `ExpertStack` to put in place of theirs (engine/models/mixtral.py)."""
        return W8Experts.quantize(self.expert_format, w13, w2)


def refuse_prequantized(method: str, hf_config: dict[str, Any]) -> None:
    """Online methods quantize ordinary weights; a checkpoint that is already quantized
    (any quantization_config) is not theirs to load."""
    qc = hf_config.get("quantization_config")
    if qc:
        declared = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise ModelLoadError(
            f"quantization {method!r} quantizes unquantized weights at load time, but the checkpoint "
            f"is already quantized (quantization_config.quant_method {declared!r}); load an "
            "unquantized (fp16/bf16/fp32) checkpoint"
        )
