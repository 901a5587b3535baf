"""One decoder for the Llama family (Llama 2/3, SmolLM2, Mistral), Qwen2 (qkv bias),
Qwen3 (q/k norm), Phi-3/Phi-4 (fused checkpoint tensors: engine/loader/hf_names.py),
Granite (four multipliers: ModelArchConfig.scales), OLMo 2 (norms after attention and MLP:
models/olmo2.py) and the MoE families: Mixtral (a sparse MoE block in place of the MLP:
models/mixtral.py), Qwen2-MoE and Qwen3-MoE (models/qwen_moe.py), Gemma 2 and Gemma 3
(four norms per layer, GeGLU, soft-capping: models/gemma.py), DeepSeek-V2 and V3
(multi-head latent attention and grouped top-k MoE: models/deepseek.py). Every difference is a
fact of ModelArchConfig. Tokens arrive flattened ([T]) from a varlen batch; attention goes
through the paged KV cache. No distributed code here: parallelism is applied from outside.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

import torch
from torch import nn

from vllm_cluster.engine.errors import ModelLoadError
from vllm_cluster.engine.layers.attention import Attention
from vllm_cluster.engine.layers.mlp import MLP
from vllm_cluster.engine.layers.norm import RMSNorm, add_norm
from vllm_cluster.engine.layers.rotary import Rope
from vllm_cluster.engine.models import deepseek, gemma, mixtral, olmo2, qwen_moe
from vllm_cluster.engine.models.config import ModelArchConfig
from vllm_cluster.engine.models.families import QWEN_MOE_FAMILIES
from vllm_cluster.engine.models.kv_scales import kv_scale_targets, per_layer_scale
from vllm_cluster.engine.quantization.base import is_quantized
from vllm_cluster.kernels.attention.metadata import AttentionMetadata
from vllm_cluster.kernels.linear.add_norm import Normed

__all__ = ["MLP", "CausalLM", "DecoderLayer", "DecoderModel"]


def make_mlp(config: ModelArchConfig, layer_id: int) -> nn.Module:
    """Layer `layer_id`'s MLP: dense, or the family's MoE block."""
    if not config.is_moe_layer(layer_id):
        return MLP(config.hidden_size, config.intermediate_size, config.scales.residual_multiplier, config.hidden_act)
    if config.family in QWEN_MOE_FAMILIES:
        return qwen_moe.QwenMoeBlock(config)
    if config.routing is not None:
        return deepseek.DeepseekMoeBlock(config)
    return mixtral.SparseMoeBlock(
        config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok
    )


def make_attention(config: ModelArchConfig, layer_id: int) -> Attention:
    return Attention(
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        qkv_bias=config.attention_bias,
        qk_norm_eps=config.rms_norm_eps if config.qk_norm else None,
        scale=config.scales.attention_multiplier,
        qk_norm_per_head=not config.post_norms,
        sliding_window=config.layer_window(layer_id),
    )


def make_layer(config: ModelArchConfig, layer_id: int) -> nn.Module:
    if config.gemma is not None:
        return gemma.GemmaDecoderLayer(config, layer_id)
    if config.post_norms:
        mlp = make_mlp(config, layer_id)
        assert isinstance(mlp, MLP), "OLMo 2 is dense"
        attention = make_attention(config, layer_id)
        return olmo2.PostNormDecoderLayer(attention, mlp, config.hidden_size, config.rms_norm_eps)
    return DecoderLayer(config, layer_id)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = deepseek.MlaAttention(config) if config.mla is not None else make_attention(config, layer_id)
        self.mlp = make_mlp(config, layer_id)
        # Granite scales attention's output before the residual add (the MLP's: MLP.down_scale).
        self.residual_multiplier = config.scales.residual_multiplier
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        rope: Rope,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) as the layer before left them (x its MLP's output; residual None: x is
        the embedding) -> this layer's, likewise (pipeline stages pass these on)."""
        x, residual = self.input_layernorm(x, residual)
        normed, residual = self.attention(rope, x, residual, kv_cache, meta)
        return self.mlp(normed), residual

    def forward_normed(
        self,
        rope: Rope,
        x: torch.Tensor | Normed,
        residual: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        next_norm: RMSNorm,
        post_slot: torch.Tensor | None = None,
        next_slot: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | Normed, torch.Tensor]:
        """x: this layer's input, normed already (input_layernorm of residual) -> (next_norm(out
        + residual), out + residual). post_slot, next_slot (zeroed [1] fp64 tensors, or None):
        where o_proj and down_proj may leave the norm after them half done, as a
        kernels.Normed for the GEMV after to finish (engine/layers/norm.py); next_slot only if
        the layer after takes_normed."""
        if not getattr(self.mlp, "takes_normed", False):
            post_slot = None
        x, residual = self.attention(rope, x, residual, kv_cache, meta, post_slot)
        return add_norm(self.mlp, x, residual, next_norm, next_slot)

    @property
    def takes_normed(self) -> bool:
        """Whether forward_normed's x may be a kernels.Normed (qkv_proj finishes it)."""
        return bool(getattr(getattr(self.self_attn, "qkv_proj", None), "takes_normed", False))

    def attention(
        self,
        rope: Rope,
        x: torch.Tensor | Normed,
        residual: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        slot: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | Normed, torch.Tensor]:
        """Attention of the normed x, o_proj, then post_attention_layernorm: (normed, residual)."""
        o = self.self_attn.attend(rope, x, kv_cache, meta)
        if self.residual_multiplier != 1.0:
            o = o * self.residual_multiplier  # o_proj has no bias: its output scales alike
        return add_norm(self.self_attn.o_proj, o, residual, self.post_attention_layernorm, slot)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = gemma.make_rotary(config)  # returns a Rope (Gemma 3: a DualRope)
        self.layers = nn.ModuleList(make_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=config.gemma is not None)
        self.embedding_multiplier = config.scales.embedding_multiplier
        # Gemma scales by sqrt(hidden_size) rounded to the model's dtype first, as HF does.
        self.rounds_multiplier = config.gemma is not None
        if config.gemma is not None:
            self.embedding_multiplier = config.hidden_size**0.5
        # OLMo 2's layers have no input norm to fuse; Gemma's norms scale by 1 + weight; MLA
        # has no qkv_proj to finish a norm.
        self.fuses_norms = not config.post_norms and config.gemma is None and config.mla is None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, D] (times Granite's embedding_multiplier or Gemma's sqrt(hidden_size))."""
        x = self.embed_tokens(input_ids)
        if self.embedding_multiplier == 1.0:
            return x
        if self.rounds_multiplier:
            return x * float(torch.tensor(self.embedding_multiplier, dtype=x.dtype))
        return x * self.embedding_multiplier

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """`after_layer(i)` runs once layer i has written its KV (the prefill role pushes it)."""
        if not self.fuses_norms:
            return self.forward_unfused(input_ids, positions, kv_caches, meta, after_layer)
        layers = cast(list[DecoderLayer], list(self.layers))
        # Each layer ends with the next one's input norm (the last with the final norm), so
        # that down_proj's GEMV can do half of it and qkv_proj's the rest (a batch-1 step on
        # CUDA: DecoderLayer.forward_normed). One zeroed fp64 slot per such norm.
        first, residual = layers[0].input_layernorm(self.embed(input_ids), None)  # [T, D] each
        x: torch.Tensor | Normed = first
        slots = None
        if first.is_cuda and first.shape[0] == 1:
            slots = torch.zeros(len(layers), 2, dtype=torch.float64, device=first.device)
        rope = self.rotary(positions)
        next_norms = [layer.input_layernorm for layer in layers[1:]] + [self.norm]
        for i, (layer, kv_cache, next_norm) in enumerate(zip(layers, kv_caches, next_norms, strict=True)):
            post_slot = next_slot = None
            if slots is not None:
                post_slot = slots[i, 0:1]
                if i + 1 < len(layers) and layers[i + 1].takes_normed:  # not the final norm (lm_head after)
                    next_slot = slots[i, 1:2]
            x, residual = layer.forward_normed(rope, x, residual, kv_cache, meta, next_norm, post_slot, next_slot)
            if after_layer is not None:
                after_layer(i)
        assert isinstance(x, torch.Tensor)  # the final norm (no slot) is never deferred
        return x

    def forward_unfused(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Each layer's own forward on (x, residual), as a pipeline stage runs them, then the
        final norm."""
        x, residual = self.embed(input_ids), None  # [T, D]
        rope = self.rotary(positions)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer(rope, x, residual, kv_cache, meta)
            if after_layer is not None:
                after_layer(i)
        out, _ = self.norm(x, residual)
        return out


# The part of a fused layer a shard fills, as quantized layers number them.
_SHARD_INDEX: dict[str | int, int] = {"q": 0, "k": 1, "v": 2, 0: 0, 1: 1}

# HF checkpoint name -> (our parameter, shard): q/k/v and gate/up are fused here (and
# the MoE experts stacked: mixtral.hf_target, qwen_moe.hf_target).
_STACKED: dict[str, tuple[str, str | int]] = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class CausalLM(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        # Whether the checkpoint carried KV cache scales (engine/models/kv_scales.py).
        self.kv_scales_loaded = False

    def tie_weights(self) -> None:
        """Share lm_head with the embedding where the config says so (again after `to_empty`)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta, after_layer)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(hidden)
        scaling = self.config.scales.logits_scaling  # Granite divides its logits
        if scaling != 1.0:
            logits = logits / scaling
        cap = self.config.gemma.final_logit_softcapping if self.config.gemma is not None else None
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; raises if one is missing, unknown or misshapen. Tensors of
        a quantized layer go to its `load_shard` (engine/quantization/base.py)."""
        quantized = {name: module for name, module in self.named_modules() if is_quantized(module)}
        params = {n: p for n, p in self.named_parameters() if n.rpartition(".")[0] not in quantized}
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self._load_kv_scale(name, tensor):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, shard = self._target(name)
            if not target:
                continue  # a tensor the model does not use (deepseek.hf_target)
            owner, _, leaf = target.rpartition(".")
            if owner in quantized:
                assert not isinstance(shard, tuple), "MoE checkpoints of gptq / awq are refused by check_quantizable"
                try:
                    quantized[owner].load_shard(leaf, tensor, _SHARD_INDEX.get(shard, 0) if shard is not None else 0)
                except ModelLoadError as e:
                    why = str(e)
                    if owner == "lm_head" and leaf == "weight":
                        why = "quantization_config.lm_head is true, but lm_head is not quantized here: set it false"
                    raise ModelLoadError(f"{name}: {why}") from None
                continue
            if target not in params:
                head = owner == "lm_head" and leaf != "weight"
                hint = " (a quantized lm_head: its quantization_config must say lm_head: true)" if head else ""
                raise KeyError(f"checkpoint tensor {name} has no place in {self.config.architecture}{hint}")
            param = params[target]
            dest = param.data if shard is None else self._shard(target, param.data, shard)
            if dest.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(target if shard is None else f"{target}:{shard}")
        for module in quantized.values():
            module.finish_loading()
        missing = self._expected_loads(params) - loaded
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def _load_kv_scale(self, name: str, tensor: torch.Tensor) -> bool:
        """Load `name` if it is a KV cache scale (or a skipped attention scale); False if not."""
        targets = kv_scale_targets(name)
        if targets is None:
            return False
        buffers = dict(self.named_buffers())
        for target in targets:
            if target not in buffers:
                raise KeyError(f"checkpoint tensor {name} has no place in {self.config.architecture}")
            buffers[target].copy_(per_layer_scale(name, tensor))
            self.kv_scales_loaded = True
        return True

    def _target(self, name: str) -> tuple[str, str | int | mixtral.ExpertShard | None]:
        if self.config.mla is not None:
            special = deepseek.hf_target(name, self.config.num_hidden_layers)
            if special is not None:
                return special
        moe = mixtral.hf_target(name) or qwen_moe.hf_target(name)
        if moe is not None:
            return moe
        for old, (new, shard) in _STACKED.items():
            if old in name:
                return name.replace(old, new), shard
        return name, None

    def _shard(self, target: str, data: torch.Tensor, shard: str | int | mixtral.ExpertShard) -> torch.Tensor:
        c = self.config
        if isinstance(shard, tuple):
            return mixtral.expert_slice(target, data, shard)
        if isinstance(shard, int):  # gate or up: half of gate_up_proj (dense or shared-expert width)
            half = data.shape[0] // 2
            return data.narrow(0, shard * half, half)
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard]
        return data.narrow(0, offset, size)

    @staticmethod
    def _expected_loads(params: dict[str, nn.Parameter]) -> set[str]:
        expected = set()
        for name, param in params.items():
            experts = mixtral.expected_expert_shards(name, param)
            if experts is not None:
                expected |= experts
            elif ".qkv_proj." in name:
                expected |= {f"{name}:q", f"{name}:k", f"{name}:v"}
            elif ".gate_up_proj." in name:
                expected |= {f"{name}:0", f"{name}:1"}
            else:
                expected.add(name)
        return expected
