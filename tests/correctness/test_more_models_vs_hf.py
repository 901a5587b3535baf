"""Qwen2-MoE, Qwen3-MoE, Phi-3, OLMo 2 and Granite, each as a tiny random HF checkpoint
(transformers' own config class, `save_pretrained`), loaded through our HF-directory loader:
32 greedy tokens equal HF transformers' token for token, logprobs within 2e-3. Prompts of
several lengths run in one batch; one is longer than the step's token budget, so its
prefill is chunked.

Each config turns on what sets its family apart: Qwen2-MoE a shared expert with its gate,
top-k weights not renormalised and a dense layer between MoE layers (decoder_sparse_step);
Qwen3-MoE q/k norm, renormalised top-k and a dense layer from mlp_only_layers; Phi-3 fused
qkv_proj / gate_up_proj tensors (and longrope); OLMo 2 post-norms and q/k norms over the
whole projection; Granite its four multipliers, none of them 1.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.correctness.hf_reference import hf_greedy, randomise
from vllm_cluster.engine import LLM, ModelLoadError, SamplingParams
from vllm_cluster.engine.layers.mlp import MLP
from vllm_cluster.engine.models.mixtral import SparseMoeBlock
from vllm_cluster.engine.models.qwen_moe import QwenMoeBlock

MAX_NEW_TOKENS = 32
MAX_NUM_BATCHED_TOKENS = 16
PROMPTS = [
    [7],
    [3, 141, 59, 26, 5],
    [200, 17, 88, 4, 250, 31, 9, 160, 72, 11, 2],
    [(37 * i + 11) % 256 for i in range(29)],  # > MAX_NUM_BATCHED_TOKENS: chunked prefill
]
# longrope rotates a whole sequence with its long factors once it is longer than the original
# context (here 16), and the engine serves past it, so its prompts all start longer than that.
LONG_PROMPTS = [[(53 * i + 5) % 256 for i in range(n)] for n in (17, 23, 29)]

_TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False,
)


def _qwen2_moe() -> Any:
    from transformers import Qwen2MoeConfig

    # decoder_sparse_step 2: layer 0 dense, layer 1 MoE.
    return Qwen2MoeConfig(
        **_TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        norm_topk_prob=False, decoder_sparse_step=2, use_sliding_window=False,
    )


def _qwen3_moe() -> Any:
    from transformers import Qwen3MoeConfig

    # head_dim 32 != hidden_size / num_attention_heads; mlp_only_layers [1]: layer 1 dense.
    return Qwen3MoeConfig(
        **_TINY, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1],
    )


def _phi3() -> Any:
    from transformers import Phi3Config

    return Phi3Config(**_TINY, pad_token_id=0)


def _phi3_longrope() -> Any:
    from transformers import Phi3Config

    # head_dim 16: 8 factors each.
    rope = {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
        "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 3.0, 4.0, 5.0],
        "long_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0],
    }
    return Phi3Config(**_TINY, pad_token_id=0, rope_parameters=rope, original_max_position_embeddings=16)


def _olmo2() -> Any:
    from transformers import Olmo2Config

    return Olmo2Config(**_TINY, pad_token_id=0)


def _granite() -> Any:
    from transformers import GraniteConfig

    return GraniteConfig(
        **_TINY, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=0.5
    )


CONFIGS: dict[str, tuple[Callable[[], Any], list[list[int]]]] = {
    "qwen2_moe": (_qwen2_moe, PROMPTS),
    "qwen3_moe": (_qwen3_moe, PROMPTS),
    "phi3": (_phi3, PROMPTS),
    "phi3_longrope": (_phi3_longrope, LONG_PROMPTS),
    "olmo2": (_olmo2, PROMPTS),
    "granite": (_granite, PROMPTS),
}


@pytest.fixture(params=sorted(CONFIGS), scope="module")
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, str]:
    from transformers import AutoModelForCausalLM

    config = CONFIGS[request.param][0]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomise(model)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(str(path), safe_serialization=True)
    return path, model, request.param


def _llm(path: Path, **overrides: Any) -> LLM:
    return LLM(
        str(path), dtype="float32", num_blocks=64, block_size=4, max_model_len=256,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, **({"device": "cpu"} | overrides),
    )


def _assert_matches_hf(llm: LLM, hf_model: Any, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    generated = []
    for prompt, output in zip(prompts, outputs, strict=True):
        hf_tokens, hf_logprobs = hf_greedy(hf_model, prompt, MAX_NEW_TOKENS)
        generated.append(tuple(hf_tokens))
        completion = output.outputs[0]
        assert completion.token_ids == hf_tokens, f"prompt of {len(prompt)} tokens"
        assert completion.logprobs is not None
        ours = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids, strict=True)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(hf_logprobs), atol=2e-3, rtol=0)
    # Guards the comparison: one repeated token per prompt would let a broken model pass.
    assert len(set(generated)) == len(prompts)
    assert all(len(set(tokens)) > 2 for tokens in generated)


def test_greedy_tokens_and_logprobs_match_hf(checkpoint: tuple[Path, Any, str]) -> None:
    path, hf_model, name = checkpoint
    _assert_matches_hf(_llm(path), hf_model, CONFIGS[name][1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_on_gpu_greedy_tokens_and_logprobs_match_hf(checkpoint: tuple[Path, Any, str], enforce_eager: bool) -> None:
    """The same on CUDA in fp32: Triton kernels, and decode steps from CUDA graphs."""
    path, hf_model, name = checkpoint
    _assert_matches_hf(_llm(path, device="cuda", enforce_eager=enforce_eager), hf_model, CONFIGS[name][1])


@pytest.mark.parametrize("checkpoint", ["qwen2_moe", "qwen3_moe"], indirect=True)
def test_moe_layers_and_dense_layers_are_where_the_config_puts_them(checkpoint: tuple[Path, Any, str]) -> None:
    path, _, name = checkpoint
    llm = _llm(path)
    config = llm.core.model.config
    mlps = [layer.mlp for layer in llm.core.model.model.layers]
    moe_layer = 1 if name == "qwen2_moe" else 0
    assert config.dense_layer_ids == (1 - moe_layer,)
    assert isinstance(mlps[1 - moe_layer], MLP) and mlps[1 - moe_layer].intermediate_size == 128
    block = mlps[moe_layer]
    assert isinstance(block, QwenMoeBlock) and isinstance(block.experts, SparseMoeBlock)
    assert (block.experts.num_experts, block.experts.top_k, block.experts.intermediate_size) == (4, 2, 32)
    assert block.experts.renormalize == (name == "qwen3_moe")
    assert (block.shared_expert is not None) == (name == "qwen2_moe")


@pytest.mark.parametrize("checkpoint", ["phi3_longrope"], indirect=True)
def test_phi3_longrope_is_read_and_changes_outputs(checkpoint: tuple[Path, Any, str]) -> None:
    path, hf_model, _ = checkpoint
    scaling = _llm(path).core.model.config.rope_scaling
    assert scaling is not None and scaling["rope_type"] == "longrope"
    assert scaling["original_max_position_embeddings"] == 16

    # The same weights with plain RoPE must score the prompts differently, or the greedy
    # comparison would not notice longrope being dropped.
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_config(_phi3(), dtype=torch.float32).eval()
    plain.load_state_dict(hf_model.state_dict())
    ids = torch.tensor([LONG_PROMPTS[-1]])
    with torch.no_grad():
        assert (hf_model(ids).logits - plain(ids).logits).abs().max() > 1e-2


@pytest.mark.parametrize(
    ("family", "override", "message"),
    [
        ("qwen2_moe", {"layer_types": ["chunked_attention"] * 2}, "layer_types"),
        ("phi3", {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.75}}, "partial_rotary_factor 0.75"),
        ("olmo2", {"attention_bias": True}, "attention_bias true"),
        ("granite", {"mlp_bias": True}, "mlp_bias true"),
    ],
)
def test_unimplemented_config_values_are_refused_by_name(
    family: str, override: dict[str, Any], message: str, tmp_path: Path
) -> None:
    from vllm_cluster.engine import ConfigError

    config = CONFIGS[family][0]()
    config.save_pretrained(str(tmp_path))  # a config alone: config.json names no architecture
    architecture = type(config).__name__.replace("Config", "ForCausalLM")
    with pytest.raises((ModelLoadError, ConfigError), match=message):
        LLM(str(tmp_path), load_format="dummy", device="cpu", num_blocks=64, block_size=4, max_model_len=128,
            hf_overrides={"architectures": [architecture], **override})
