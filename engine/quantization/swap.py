"""The swap that puts a quantization method's modules into a built model, in place of its
unquantized linear layers and (online methods) its unquantized MoE experts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from torch import nn

from vllm_cluster.engine.errors import ConfigError, ModelLoadError
from vllm_cluster.engine.layers.mlp import MLP
from vllm_cluster.engine.models.mixtral import SparseMoeBlock, StackedExperts
from vllm_cluster.engine.quantization import get_method
from vllm_cluster.engine.quantization.base import QuantMethod
from vllm_cluster.engine.quantization.online import OnlineMethod

if TYPE_CHECKING:
    from vllm_cluster.engine.models import CausalLM, ModelArchConfig

# MLA's projections the online methods quantize; kv_b_proj stays as loaded: its weight is
# absorbed into the query and the output (engine/models/deepseek.py), read as a matrix.
_MLA_PROJECTIONS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")


def check_quantizable(config: ModelArchConfig, method_name: str) -> None:
    """Raise ConfigError naming the layers that `method_name` has no path for in `config`'s
    model. The online methods (fp8, int8) have one for every family (quantize_model); a
    checkpoint method (gptq, awq) loads packed linear layers only, so it refuses DeepSeek's
    multi-head latent attention and every family's routed MoE experts."""
    if not get_method(method_name).quantizes_checkpoint:
        return
    online = "serve the unquantized checkpoint with quantization 'fp8' or 'int8' (quantized at load)"
    if config.mla is not None:
        raise ConfigError(
            f"model.quantization: {method_name!r} does not support {config.architecture}: its multi-head "
            "latent attention (q_a_proj / q_b_proj, kv_a_proj_with_mqa, kv_b_proj, absorbed at load) and its "
            f"mixture-of-experts routed experts have no {method_name} path; {online}"
        )
    if config.num_experts:
        raise ConfigError(
            f"model.quantization: {method_name!r} does not support mixture-of-experts models "
            f"({config.architecture}): its routed experts (w13_weight and w2_weight, {config.num_experts} "
            f"experts stacked per MoE layer) have no {method_name} path; {online}"
        )


def quantize_model(model: CausalLM, method: QuantMethod, convert: bool = True) -> None:
    """Replace each decoder layer's qkv_proj, o_proj, gate_up_proj and down_proj (and
    lm_head, where the method quantizes it) with `method`'s module, in place: the Llama
    decoder's families, Phi-3's fused projections, OLMo 2's and Gemma 2/3's layers alike
    (norms, embeddings and Gemma 3's q/k norms stay as they are). In MoE layers (online
    methods) the shared experts' and dense layers' MLPs are swapped alike, and each
    `SparseMoeBlock`'s routed experts replaced by a quantized stack (`quantize_experts`; the
    unquantized one is freed); the routers (`gate`, Qwen2-MoE's `shared_expert_gate`) stay as
    loaded: they are tiny, and rounding them would change which experts run. DeepSeek's MLA:
    its projections but kv_b_proj (_MLA_PROJECTIONS). convert: quantize the loaded weights
    (online methods); otherwise the modules are left empty for the checkpoint's tensors
    (`load_shard`)."""
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
    for layer in model.model.layers:
        _swap_attention(cast(Any, layer).self_attn, config, method, convert)
        _swap_mlp(cast(Any, layer).mlp, method, convert)


def _swap_attention(attn: Any, config: ModelArchConfig, method: QuantMethod, convert: bool) -> None:
    if config.mla is None:
        q_size = config.num_attention_heads * config.head_dim
        kv_size = config.num_key_value_heads * config.head_dim
        attn.qkv_proj = _swap(attn.qkv_proj, [q_size, kv_size, kv_size], method, convert)
    else:
        for name in _MLA_PROJECTIONS:
            linear = getattr(attn, name)
            if linear is not None:  # q_proj, or q_a_proj and q_b_proj (q_lora_rank)
                setattr(attn, name, _swap(linear, [linear.out_features], method, convert))
    attn.o_proj = _swap(attn.o_proj, [attn.o_proj.out_features], method, convert)


def _swap_mlp(mlp: nn.Module, method: QuantMethod, convert: bool) -> None:
    """A dense layer's MLP, or a MoE layer's routed experts and shared experts' MLP."""
    for module in list(mlp.modules()):
        if isinstance(module, MLP):
            inter = module.intermediate_size
            module.gate_up_proj = _swap(module.gate_up_proj, [inter, inter], method, convert)  # type: ignore[assignment]
            module.down_proj = _swap(module.down_proj, [module.down_proj.out_features], method, convert)  # type: ignore[assignment]
        elif isinstance(module, SparseMoeBlock):
            assert convert and isinstance(method, OnlineMethod), "check_quantizable refuses MoE checkpoints"
            stack = module.stack
            assert isinstance(stack, StackedExperts), f"experts already quantized ({type(stack).__name__})"
            module.stack = method.quantize_experts(stack.w13_weight.data, stack.w2_weight.data)


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
