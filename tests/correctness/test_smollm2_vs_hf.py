"""Greedy tokens of our engine equal HF transformers on the bundled SmolLM2 (same GGUF
weights, fp32), through chunked prefill, prefix caching and preemption."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from vllm_cluster.engine import LLM, SamplingParams

MAX_NEW_TOKENS = 24

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant. Answer in one word."},
        {"role": "user", "content": "What color is the sky on a clear day?"},
    ],
    [
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Name a larger one."},
    ],
]
RAW = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "1, 2, 3, 4, 5,",
    "Once upon a time, in a land far away, there lived a",
]
SHARED_PREFIX = (
    "You are reviewing a list of European capitals. Paris is the capital of France. "
    "Berlin is the capital of Germany. Madrid is the capital of Spain. Rome is the "
    "capital of Italy. Lisbon is the capital of Portugal. "
)
SHARED = [SHARED_PREFIX + q for q in ("Vienna is the capital of", "Warsaw is the capital of", "Oslo is the capital of")]


def hf_greedy(hf: Any, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """HF generate, greedy; returns new tokens and the log-softmax of each chosen token."""
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=hf.generation_config.eos_token_id,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    logprobs = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, tokens, strict=True)]
    return tokens, logprobs


def _prompt_ids(llm: LLM) -> list[list[int]]:
    tok = llm.tokenizer
    chats = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in CHATS]
    return [tok.encode(p) for p in chats + RAW + SHARED]


@pytest.fixture(scope="module")
def expected(smollm2: LLM, hf_smollm2: Any) -> list[tuple[list[int], list[int], list[float]]]:
    return [(ids, *hf_greedy(hf_smollm2, ids, MAX_NEW_TOKENS)) for ids in _prompt_ids(smollm2)]


def _check(llm: LLM, expected: list[tuple[list[int], list[int], list[float]]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=1)
    outputs = llm.generate([ids for ids, _, _ in expected], params, use_tqdm=False)
    for out, (_, hf_tokens, hf_logprobs) in zip(outputs, expected, strict=True):
        completion = out.outputs[0]
        assert completion.token_ids == hf_tokens, out.prompt_token_ids
        assert completion.logprobs is not None
        ours = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids, strict=True)]
        for a, b in zip(ours, hf_logprobs, strict=True):
            assert math.isclose(a, b, abs_tol=2e-3), (ours, hf_logprobs)


def test_batch_matches_hf(smollm2: LLM, expected: Any) -> None:
    assert len(expected) >= 8
    _check(smollm2, expected)
    assert smollm2.core.kv.pool.num_free_blocks == smollm2.core.kv.pool.num_blocks


def test_long_prompt_is_chunked_and_matches_hf(smollm2: LLM, hf_smollm2: Any) -> None:
    llm = smollm2.derive(max_num_batched_tokens=32)
    ids = llm.tokenizer.encode(SHARED_PREFIX * 3 + "The capital of Norway is")
    assert len(ids) > 3 * 32
    _check(llm, [(ids, *hf_greedy(hf_smollm2, ids, MAX_NEW_TOKENS))])


def test_shared_prefixes_hit_the_cache_and_match_hf(smollm2: LLM, expected: Any) -> None:
    llm = smollm2.derive()
    shared = expected[-len(SHARED) :]
    _check(llm, shared[:1])
    before = llm.core.stats().prefix_cache_hits
    _check(llm, shared[1:])
    assert llm.core.stats().prefix_cache_hits - before >= 2 * (len(llm.tokenizer.encode(SHARED_PREFIX)) // 16 - 1) * 16


def test_preemption_resumes_with_identical_tokens(smollm2: LLM, expected: Any) -> None:
    # 20 blocks of 16 tokens cannot hold 11 prompts of ~30-60 tokens plus 24 new tokens each.
    llm = smollm2.derive(num_blocks=20, max_model_len=320)
    _check(llm, expected)
    assert llm.core.stats().num_preemptions > 0
    assert llm.core.kv.pool.num_free_blocks == 20


def test_no_prefix_caching_matches_hf(smollm2: LLM, expected: Any) -> None:
    llm = smollm2.derive(enable_prefix_caching=False, max_num_batched_tokens=64)
    _check(llm, expected)
    assert llm.core.stats().prefix_cache_hits == 0
