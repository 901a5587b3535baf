"""AWQ checkpoints (AutoAWQ, GEMM version): INT4 weights packed along the output dim in
AWQ's interleaved nibble order, one scale and zero per (group of consecutive inputs,
output). Read from config.json's `quantization_config`; kernels/int4/packing.py
describes the layout.
"""

from __future__ import annotations

from typing import Any

from vllm_cluster.engine.errors import ModelLoadError
from vllm_cluster.engine.quantization.gptq import read_bits, read_group_size
from vllm_cluster.engine.quantization.int4_linear import Int4Method, Int4Spec

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


class AwqMethod(Int4Method):
    name = "awq"
    default_spec = Int4Spec("awq", DEFAULT_GROUP_SIZE, 0)
    read_spec = staticmethod(awq_spec)
