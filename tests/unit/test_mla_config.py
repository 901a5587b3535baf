"""DeepSeek-V2 / V3 config reading (engine/models/mla_config.py): values that change the
math and are not implemented are refused by name; keys a config leaves out take
transformers' defaults. Pure: no model is built."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_cluster.engine import ModelLoadError
from vllm_cluster.engine.models import ModelArchConfig

_TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=512,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=24,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
)


@pytest.mark.parametrize(
    ("architecture", "override", "message"),
    [
        ("DeepseekV3ForCausalLM", {"scoring_func": "softmax"}, "scoring_func 'softmax'"),
        ("DeepseekV3ForCausalLM", {"topk_method": "greedy"}, "topk_method 'greedy'"),
        ("DeepseekV2ForCausalLM", {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc'"),
        ("DeepseekV2ForCausalLM", {"norm_topk_prob": True}, "norm_topk_prob true"),
        ("DeepseekV2ForCausalLM", {"mlp_bias": True}, "mlp_bias true"),
        ("DeepseekV2ForCausalLM", {"moe_layer_freq": 2}, "moe_layer_freq 2"),
        ("DeepseekV3ForCausalLM", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ("DeepseekV3ForCausalLM", {"n_group": 3}, "n_group 3 must divide n_routed_experts"),
        ("DeepseekV3ForCausalLM", {"qk_rope_head_dim": 7}, "qk_rope_head_dim 7 must be even"),
        ("DeepseekV3ForCausalLM", {"rope_scaling": {"type": "ntk"}}, "rope type 'ntk'"),
    ],
)
def test_unsupported_config_values_are_refused_by_name(
    architecture: str, override: dict[str, Any], message: str
) -> None:
    base = {
        **_TINY,
        "architectures": [architecture],
        "q_lora_rank": 48,
        "n_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
        "num_key_value_heads": 4,
    }
    with pytest.raises(ModelLoadError, match=message):
        ModelArchConfig.from_hf_dict(base | override)


def test_keys_a_config_leaves_out_take_transformers_defaults() -> None:
    minimal = {"vocab_size": 16, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 5}
    v3 = ModelArchConfig.from_hf_dict({**minimal, "architectures": ["DeepseekV3ForCausalLM"], "num_attention_heads": 4})
    assert (v3.num_experts, v3.num_experts_per_tok, v3.dense_layer_ids) == (256, 8, (0, 1, 2))
    assert v3.routing is not None and (v3.routing.n_group, v3.routing.topk_group) == (8, 4)
    assert v3.routing.routed_scaling_factor == 2.5 and v3.norm_topk_prob
    assert v3.mla is not None and (v3.mla.q_lora_rank, v3.mla.kv_lora_rank, v3.mla.qk_rope_head_dim) == (1536, 512, 64)
    assert v3.kv_bytes_per_token(2) == (512 + 64) * 2 * 5
