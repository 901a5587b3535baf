"""Each supported architecture, as a tiny random HF checkpoint, generates the same greedy
tokens (and logprobs) as HF transformers.

The checkpoints are written with `save_pretrained` and loaded through our HF-directory
loader, so config parsing (qkv bias, q/k norm, explicit head_dim, llama3 rope scaling,
tied embeddings) and weight fusing (qkv_proj, gate_up_proj) are both under test. Prompts
of several lengths run in one batch; one is longer than the step's token budget, so its
prefill is chunked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.correctness.hf_reference import hf_greedy, randomise
from vllm_cluster.engine import LLM, SamplingParams

MAX_NEW_TOKENS = 8
MAX_NUM_BATCHED_TOKENS = 16
PROMPTS = [
    [7],
    [3, 141, 59, 26, 5],
    [200, 17, 88, 4, 250, 31, 9, 160, 72, 11, 2],
    [(37 * i + 11) % 256 for i in range(29)],  # > MAX_NUM_BATCHED_TOKENS: chunked prefill
]

_TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)


def _qwen2() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**_TINY, tie_word_embeddings=True, use_sliding_window=False)


def _qwen3() -> Any:
    from transformers import Qwen3Config

    # head_dim 32 != hidden_size / num_attention_heads (16).
    return Qwen3Config(**_TINY, head_dim=32, tie_word_embeddings=False, attention_bias=False)


def _llama3_rope() -> Any:
    from transformers import LlamaConfig

    # With head_dim 16 and theta 10000 the rotary wavelengths are about 6, 20, 63, ...;
    # an original context of 16 puts one in the smoothed band and the rest in the scaled one.
    rope = {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
        "rope_theta": 10000.0,
    }
    return LlamaConfig(**_TINY, rope_parameters=rope, tie_word_embeddings=False)


def _mistral() -> Any:
    from transformers import MistralConfig

    return MistralConfig(**_TINY, head_dim=16, sliding_window=None, tie_word_embeddings=False)


CONFIGS = {"qwen2": _qwen2, "qwen3": _qwen3, "llama3_rope": _llama3_rope, "mistral": _mistral}


@pytest.fixture(params=sorted(CONFIGS), scope="module")
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    from transformers import AutoModelForCausalLM

    config = CONFIGS[request.param]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomise(model)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(str(path), safe_serialization=True)
    return path, model


def test_greedy_tokens_and_logprobs_match_hf(checkpoint: tuple[Path, Any]) -> None:
    path, hf_model = checkpoint
    llm = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        num_blocks=64,
        block_size=4,
        max_model_len=256,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)

    for prompt, output in zip(PROMPTS, outputs, strict=True):
        hf_tokens, hf_logprobs = hf_greedy(hf_model, prompt, MAX_NEW_TOKENS)
        completion = output.outputs[0]
        assert completion.token_ids == hf_tokens, f"prompt of {len(prompt)} tokens"
        assert completion.logprobs is not None
        ours = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids, strict=True)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(hf_logprobs), atol=1e-4, rtol=0)


def test_hf_reference_is_not_degenerate(checkpoint: tuple[Path, Any]) -> None:
    # Guards the comparison above: random weights that made every prompt emit one repeated
    # token would let a broken model pass.
    _, hf_model = checkpoint
    generated = [tuple(hf_greedy(hf_model, p, MAX_NEW_TOKENS)[0]) for p in PROMPTS]
    assert len(set(generated)) == len(PROMPTS)
    assert all(len(set(tokens)) > 1 for tokens in generated)


@pytest.mark.parametrize("checkpoint", ["llama3_rope"], indirect=True)
def test_llama3_rope_scaling_is_read_and_changes_outputs(checkpoint: tuple[Path, Any]) -> None:
    path, hf_model = checkpoint
    llm = LLM(str(path), device="cpu", dtype="float32", num_blocks=64, block_size=4, max_model_len=256)
    scaling = llm.core.model.config.rope_scaling
    assert scaling is not None and scaling["rope_type"] == "llama3"

    # The same weights without scaling must score the long prompt differently, or the
    # greedy comparison would not notice scaling being dropped.
    from transformers import AutoModelForCausalLM, LlamaConfig

    unscaled_config = LlamaConfig(**_TINY, rope_theta=10000.0, tie_word_embeddings=False)
    unscaled = AutoModelForCausalLM.from_config(unscaled_config, dtype=torch.float32).eval()
    unscaled.load_state_dict(hf_model.state_dict())
    ids = torch.tensor([PROMPTS[-1]])
    with torch.no_grad():
        diff = (hf_model(ids).logits - unscaled(ids).logits).abs().max()
    assert diff > 1e-2
