"""GPTQ checkpoints (AutoGPTQ / GPTQModel): INT4 weights packed along the input dim, one
scale and zero per (group, output), g_idx mapping each input to its group (act-order,
desc_act, makes it a permutation rather than consecutive runs). Read from config.json's
`quantization_config`; kernels/int4/packing.py describes the layout. `lm_head: true`
(GPTQModel, AutoRound) means lm_head is packed the same way (lm_head.qweight, ...), as vLLM
reads it; models that tie lm_head to the embedding are refused then (quantize_model).
"""

from __future__ import annotations

from typing import Any

from vllm_cluster.engine.errors import ModelLoadError
from vllm_cluster.engine.quantization.int4_linear import Int4Method, Int4Spec

# checkpoint_format -> the offset added to a stored zero: v1 stores zero - 1.
_FORMATS = {"gptq": 1, "gptq_v2": 0}
DEFAULT_GROUP_SIZE = 128


def read_group_size(method: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise ModelLoadError(
            f"quantization_config.group_size {value!r} is not supported by {method}: use a positive "
            "integer or -1 (one group)"
        )
    return value


def read_bits(method: str, value: Any) -> None:
    if value != 4:
        raise ModelLoadError(
            f"quantization_config.bits {value!r} is not supported by {method}: only 4-bit checkpoints load"
        )


def gptq_spec(hf_config: dict[str, Any]) -> Int4Spec:
    """The layer spec a config.json declares; ModelLoadError naming an unsupported setting.
    No quantization_config (load_format dummy): 4 bits, group size 128, format v1."""
    qc = hf_config.get("quantization_config") or {}
    declared = str(qc.get("quant_method", "gptq")).lower()
    if declared != "gptq":
        raise ModelLoadError(f"quantization_config.quant_method is {declared!r}, not 'gptq'")
    read_bits("gptq", qc.get("bits", 4))
    group_size = read_group_size("gptq", qc.get("group_size", DEFAULT_GROUP_SIZE))
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in _FORMATS or qc.get("is_marlin_format"):
        raise ModelLoadError(
            f"quantization_config.checkpoint_format {fmt!r} is not supported by gptq: "
            f"supported {sorted(_FORMATS)} (the AutoGPTQ/GPTQModel layouts, not marlin repacks)"
        )
    for flag in ("desc_act", "sym", "lm_head"):
        if not isinstance(qc.get(flag, False), bool):
            raise ModelLoadError(f"quantization_config.{flag} {qc[flag]!r} must be true or false")
    return Int4Spec("gptq", group_size, _FORMATS[fmt], lm_head=qc.get("lm_head", False))


class GptqMethod(Int4Method):
    name = "gptq"
    default_spec = Int4Spec("gptq", DEFAULT_GROUP_SIZE, 1)
    read_spec = staticmethod(gptq_spec)
