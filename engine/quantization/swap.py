"""The swap that puts a quantization method's modules into a built model, in place of its
unquantized linear layers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from torch import nn

from vllm_cluster.engine.errors import ConfigError, ModelLoadError
from vllm_cluster.engine.quantization.base import QuantMethod

if TYPE_CHECKING:
    from vllm_cluster.engine.models import CausalLM, ModelArchConfig


def check_quantizable(config: ModelArchConfig, method_name: str) -> None:
    """Raise ConfigError naming the layers that `method_name` has no module for in `config`'s
    model: DeepSeek's multi-head latent attention, and every family's routed MoE experts (stacked
    per expert, not nn.Linear). What the swap covers: quantize_model."""
    if config.mla is not None:
        raise ConfigError(
            f"model.quantization: {method_name!r} does not support {config.architecture}: its multi-head "
            "latent attention (q_a_proj / q_b_proj, kv_a_proj_with_mqa, kv_b_proj, absorbed at load) and its "
            "mixture-of-experts routed experts have no quantized path; unset quantization for this model"
        )
    if config.num_experts:
        raise ConfigError(
            f"model.quantization: {method_name!r} does not support mixture-of-experts models "
            f"({config.architecture}): its routed experts (mlp.experts: w13_weight and w2_weight, "
            f"{config.num_experts} experts stacked per MoE layer) have no quantized path and hold most of "
            "the weights; unset quantization for this model, or serve a dense model"
        )


def quantize_model(model: CausalLM, method: QuantMethod, convert: bool = True) -> None:
    """Replace each decoder layer's qkv_proj, o_proj, gate_up_proj and down_proj (and
    lm_head, where the method quantizes it) with `method`'s module, in place: the Llama
    decoder's families, Phi-3's fused projections, OLMo 2's and Gemma 2/3's layers alike
    (norms, embeddings and Gemma 3's q/k norms stay as they are). convert:
    quantize the loaded weights (online methods); otherwise the modules are left empty for
    the checkpoint's tensors (`load_shard`)."""
    config = model.config
    check_quantizable(config, method.name)
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
