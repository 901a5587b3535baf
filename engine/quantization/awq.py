"""AWQ checkpoints (AutoAWQ, GEMM version): INT4 weights packed along the output dim in
AWQ's interleaved nibble order, one scale and zero per (group of consecutive inputs,
output). Read from config.json's `quantization_config`; kernels/int4_reference.py
describes the layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.quantization.gptq import read_bits, read_group_size
from engine.quantization.int4_linear import Int4Linear, Int4Spec

DEFAULT_GROUP_SIZE = 128


def awq_spec(hf_config: dict[str, Any]) -> Int4Spec:
    """The layer spec a config.json declares (AutoAWQ's older names w_bit / q_group_size
    too); ModelLoadError naming an unsupported setting. No quantization_config (load_format
    dummy): 4 bits, group size 128."""
    qc = hf_config.get("quantization_config") or {}
    declared = str(qc.get("quant_method", "awq")).lower()
    if declared != "awq":
        raise ModelLoadError(f"quantization_config.quant_method is {declared!r}, not 'awq'")
    read_bits("awq", qc.get("bits", qc.get("w_bit", 4)))
    group_size = read_group_size("awq", qc.get("group_size", qc.get("q_group_size", DEFAULT_GROUP_SIZE)))
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ModelLoadError(
            f"quantization_config.version {version!r} is not supported by awq: only 'gemm' "
            "(AutoAWQ's default layout) loads; re-export the model with version='gemm'"
        )
    if qc.get("zero_point", True) is not True:
        raise ModelLoadError(
            f"quantization_config.zero_point {qc.get('zero_point')!r} is not supported by awq: only "
            "zero_point true checkpoints load"
        )
    if qc.get("modules_to_not_convert"):
        raise ModelLoadError(
            f"quantization_config.modules_to_not_convert {qc['modules_to_not_convert']!r} is not "
            "supported: every decoder linear must be quantized"
        )
    return Int4Spec("awq", group_size, 0)


class AwqMethod:
    name = "awq"
    quantizes_checkpoint = True

    def __init__(self, spec: Int4Spec | None = None) -> None:
        self.spec = spec or Int4Spec("awq", DEFAULT_GROUP_SIZE, 0)

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> AwqMethod:
        return cls(awq_spec(hf_config))

    def check_hf_config(self, hf_config: dict[str, Any]) -> None:
        spec = awq_spec(hf_config)
        if spec != self.spec:
            raise ModelLoadError(f"awq was configured for {self.spec}, but the checkpoint declares {spec}")

    def create_linear(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        output_sizes: list[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> nn.Module:
        assert sum(output_sizes) == out_features, (output_sizes, out_features)
        return Int4Linear(self.spec, in_features, output_sizes, bias, dtype, device)
