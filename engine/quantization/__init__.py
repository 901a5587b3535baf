"""Quantization methods, chosen by name, and the swap that puts them into a built model.

    method = get_method("fp8")             # "int8", "fp8", "gptq", "awq"
    quantize_model(model, method)          # online: after the weights have loaded (swap.py)
    quantize_model(model, method, convert=False)  # checkpoint: before, then load_shard

A method lives in its own module, imported only when asked for (a missing one is a
ConfigError, not a broken import), so naming and selecting methods (the config does) does
not import torch. `select_method` decides which one a model runs with:
the one the config names, or, when it names none, the one an HF checkpoint declares in
its config.json (`quantization_config.quant_method`), as vLLM does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from vllm_cluster.engine.errors import ConfigError, ModelLoadError

if TYPE_CHECKING:
    from vllm_cluster.engine.quantization.base import QuantMethod

# name -> "module:class"; the module is imported by get_method.
QUANT_METHODS: dict[str, str] = {
    "int8": "vllm_cluster.engine.quantization.int8:Int8Method",
    "fp8": "vllm_cluster.engine.quantization.fp8:Fp8Method",
    "gptq": "vllm_cluster.engine.quantization.gptq:GptqMethod",
    "awq": "vllm_cluster.engine.quantization.awq:AwqMethod",
}
METHOD_NAMES: tuple[str, ...] = tuple(QUANT_METHODS)


def get_method(name: str, hf_config: dict[str, Any] | None = None, quantize_lm_head: bool = False) -> QuantMethod:
    """The method called `name`; `hf_config` (the checkpoint's config.json) configures the
    checkpoint methods (group size, bits); `quantize_lm_head` (`model.quantize_lm_head`):
    an online method quantizes lm_head too (a checkpoint method reads that from the
    checkpoint, so it refuses the option)."""
    if name not in QUANT_METHODS:
        raise ConfigError(f"model.quantization: {name!r} is not one of {list(METHOD_NAMES)} (or null)")
    module_name, class_name = QUANT_METHODS[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        raise ConfigError(
            f"model.quantization: {name!r} is not available in this build ({module_name} is missing)"
        ) from None
    cls = getattr(module, class_name)
    if hasattr(cls, "from_hf_config"):
        if quantize_lm_head:
            raise ConfigError(
                f"model.quantize_lm_head applies to the online methods (fp8, int8); a {name!r} checkpoint "
                "declares whether its lm_head is quantized (quantization_config.lm_head): unset quantize_lm_head"
            )
        method: QuantMethod = cls.from_hf_config(hf_config or {})
    else:
        method = cls(quantize_lm_head=quantize_lm_head)
    return method


def declared_method(hf_config: dict[str, Any]) -> str | None:
    """The quant_method an HF checkpoint's config.json declares, if any."""
    qc = hf_config.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    declared = qc.get("quant_method")
    return str(declared).lower() if declared is not None else None


def select_method(requested: str | None, hf_config: dict[str, Any]) -> str | None:
    """The method a model runs with; ModelLoadError when the checkpoint declares another."""
    declared = declared_method(hf_config)
    if requested is None and declared is None:
        return None
    if requested is None:
        if declared not in QUANT_METHODS:
            raise ModelLoadError(
                f"the checkpoint declares quantization_config.quant_method {declared!r}, which is not "
                f"supported (supported: {list(METHOD_NAMES)}); use an unquantized checkpoint"
            )
        requested = declared
    elif declared is not None and declared != requested:
        raise ModelLoadError(
            f"quantization {requested!r} was asked for, but the checkpoint declares "
            f"quantization_config.quant_method {declared!r}: set model.quantization to {declared!r} "
            "(or leave it unset), or use a checkpoint of the other format"
        )
    assert requested is not None
    get_method(requested, hf_config).check_hf_config(hf_config)
    return requested


__all__ = [
    "METHOD_NAMES",
    "QUANT_METHODS",
    "declared_method",
    "get_method",
    "select_method",
]
