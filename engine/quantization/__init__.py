"""Quantization methods, chosen by name, and the swap that puts them into a built model.

    method = get_method("fp8")             # "int8", "fp8", "gptq", "awq"
    quantize_model(model, method)          # online: after the weights have loaded
    quantize_model(model, method, convert=False)  # checkpoint: before, then load_shard

A method lives in its own module, imported only when asked for (a missing one is a
ConfigError, not a broken import). `select_method` decides which one a model runs with:
the one the config names, or, when it names none, the one an HF checkpoint declares in
its config.json (`quantization_config.quant_method`), as vLLM does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, cast

from torch import nn

from engine.errors import ConfigError, ModelLoadError
from engine.quantization.base import QuantMethod

if TYPE_CHECKING:
    from engine.models import CausalLM

# name -> "module:class"; the module is imported by get_method.
QUANT_METHODS: dict[str, str] = {
    "int8": "engine.quantization.int8:Int8Method",
    "fp8": "engine.quantization.fp8:Fp8Method",
    "gptq": "engine.quantization.gptq:GptqMethod",
    "awq": "engine.quantization.awq:AwqMethod",
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
        raise ConfigError(f"model.quantization: {name!r} is not available in this build ({module_name} is missing)") from None
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


def quantize_model(model: CausalLM, method: QuantMethod, convert: bool = True) -> None:
    """Replace each decoder layer's qkv_proj, o_proj, gate_up_proj and down_proj (and
    lm_head, where the method quantizes it) with `method`'s module, in place. convert:
    quantize the loaded weights (online methods); otherwise the modules are left empty for
    the checkpoint's tensors (`load_shard`)."""
    config = model.config
    if config.num_experts:
        raise ConfigError(
            f"model.quantization: {method.name!r} does not support mixture-of-experts models "
            f"({config.architecture}); unset quantization for this model"
        )
    if method.quantizes_lm_head:
        # An online method quantizes a copy and leaves the embedding as it is; a checkpoint's
        # packed lm_head cannot also be the embedding.
        if config.tie_word_embeddings and not convert:
            raise ModelLoadError(
                f"quantization_config.lm_head is true, but {config.architecture} ties lm_head to the "
                "embedding (tie_word_embeddings), which stays unquantized: use a checkpoint quantized "
                "without lm_head"
            )
        model.lm_head = _swap(model.lm_head, [model.lm_head.out_features], method, convert)  # type: ignore[assignment]
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    for layer in model.model.layers:
        attn, mlp = cast(Any, layer).self_attn, cast(Any, layer).mlp
        attn.qkv_proj = _swap(attn.qkv_proj, [q_size, kv_size, kv_size], method, convert)
        attn.o_proj = _swap(attn.o_proj, [attn.o_proj.out_features], method, convert)
        mlp.gate_up_proj = _swap(mlp.gate_up_proj, [inter, inter], method, convert)
        mlp.down_proj = _swap(mlp.down_proj, [mlp.down_proj.out_features], method, convert)


def _swap(linear: nn.Linear, output_sizes: list[int], method: QuantMethod, convert: bool) -> nn.Module:
    assert isinstance(linear, nn.Linear), f"expected an unquantized nn.Linear, got {type(linear).__name__}"
    assert sum(output_sizes) == linear.out_features, (output_sizes, linear.out_features)
    weight = linear.weight
    module = method.create_linear(
        linear.in_features, linear.out_features, linear.bias is not None, output_sizes, weight.dtype, weight.device
    )
    if convert:
        bias = None if linear.bias is None else linear.bias.data
        module.quantize_from(weight.data, bias)  # type: ignore[operator]
    return module


def is_quantized(module: nn.Module) -> bool:
    """A module the checkpoint loader hands tensors to (`load_shard`)."""
    return callable(getattr(module, "load_shard", None))


__all__ = [
    "METHOD_NAMES",
    "QUANT_METHODS",
    "QuantMethod",
    "declared_method",
    "get_method",
    "is_quantized",
    "quantize_model",
    "select_method",
]
