"""Prompt logprobs (SamplingParams.prompt_logprobs) against HF transformers' log_softmax over
the same prompt: whole, chunked, next to requests that do not ask, and not skipped by the
prefix cache; with preemption and async scheduling."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.outputs import RequestOutput

PROMPTS = [
    "The capital of France is Paris, and the capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a land far away, there lived a small dragon who loved to read books. " * 3,
]
NUM_TOP = 3


def hf_prompt_logprobs(hf: Any, prompt_ids: list[int]) -> torch.Tensor:
    """log_softmax at every prompt position: [P, V]; row p predicts token p + 1."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def check_prompt_logprobs(out: RequestOutput, expected: torch.Tensor, num_top: int) -> None:
    ids = out.prompt_token_ids
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None
    for p in range(1, len(ids)):
        entry = out.prompt_logprobs[p]
        assert entry is not None
        token = ids[p]
        row = expected[p - 1]
        assert math.isclose(entry[token].logprob, float(row[token]), abs_tol=2e-3), (p, entry[token], float(row[token]))
        value = float(row[token])
        assert int((row > value + 2e-3).sum()) < entry[token].rank <= int((row > value - 2e-3).sum()) + 1
        hf_top = row.topk(num_top)
        ours_top = {t: lp.logprob for t, lp in entry.items() if lp.rank <= num_top}
        assert sorted(ours_top) == sorted(hf_top.indices.tolist()), (p, ours_top, hf_top)
        for t, v in zip(hf_top.indices.tolist(), hf_top.values.tolist(), strict=True):
            assert math.isclose(ours_top[t], v, abs_tol=2e-3)

@pytest.fixture(scope="module")
def prompts_and_expected(smollm2: LLM, hf_smollm2: Any) -> list[tuple[list[int], torch.Tensor]]:
    ids = [smollm2.tokenizer.encode(p) for p in PROMPTS]
    return [(i, hf_prompt_logprobs(hf_smollm2, i)) for i in ids]


def test_prompt_logprobs_match_hf(smollm2: LLM, prompts_and_expected: Any) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=NUM_TOP)
    outputs = smollm2.generate([ids for ids, _ in prompts_and_expected], params, use_tqdm=False)
    for out, (_, expected) in zip(outputs, prompts_and_expected, strict=True):
        check_prompt_logprobs(out, expected, NUM_TOP)
        assert out.outputs[0].logprobs is None


def test_prompt_logprobs_zero_gives_the_token_alone(smollm2: LLM, prompts_and_expected: Any) -> None:
    ids, expected = prompts_and_expected[0]
    out = smollm2.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.prompt_logprobs is not None
    assert all(list(entry) == [t] for entry, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True) if entry)
    check_prompt_logprobs(out, expected, 0)


def test_chunked_prompt_next_to_plain_requests(smollm2: LLM, prompts_and_expected: Any) -> None:
    llm = smollm2.derive(max_num_batched_tokens=16)
    ids_list = [ids for ids, _ in prompts_and_expected]
    assert len(ids_list[-1]) > 3 * 16
    plain = SamplingParams(temperature=0.0, max_tokens=4)
    asking = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=NUM_TOP)
    mixed = llm.generate(ids_list + ids_list, [asking] * len(ids_list) + [plain] * len(ids_list), use_tqdm=False)
    for out, (_, expected) in zip(mixed[: len(ids_list)], prompts_and_expected, strict=True):
        check_prompt_logprobs(out, expected, NUM_TOP)
    alone = smollm2.generate(ids_list, plain, use_tqdm=False)
    for a, b in zip(mixed[len(ids_list) :], alone, strict=True):
        assert a.prompt_logprobs is None
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for a, b in zip(mixed[: len(ids_list)], alone, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_prefix_cache_does_not_skip_prompt_positions(smollm2: LLM, prompts_and_expected: Any) -> None:
    llm = smollm2.derive()
    ids, expected = prompts_and_expected[-1]
    llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)  # fills the cache
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    check_prompt_logprobs(out, expected, 1)


def test_preempted_requests_keep_one_entry_per_prompt_token(smollm2: LLM, prompts_and_expected: Any) -> None:
    # 8 blocks of 16 tokens cannot hold three prompts of ~15-60 tokens and their outputs at once.
    llm = smollm2.derive(num_blocks=8, max_model_len=128, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=24, prompt_logprobs=NUM_TOP, ignore_eos=True)
    outputs = llm.generate([ids for ids, _ in prompts_and_expected], params, use_tqdm=False)
    assert llm.core.stats().num_preemptions > 0
    for out, (_, expected) in zip(outputs, prompts_and_expected, strict=True):
        check_prompt_logprobs(out, expected, NUM_TOP)
    assert llm.core.kv.pool.num_free_blocks == 8


def test_async_scheduling_gives_the_same(smollm2: LLM, prompts_and_expected: Any) -> None:
    llm = smollm2.derive(async_scheduling=True, max_num_batched_tokens=16)
    params = [SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=NUM_TOP), SamplingParams(max_tokens=4)]
    ids_list = [ids for ids, _ in prompts_and_expected]
    outputs = llm.generate(ids_list + ids_list, params[:1] * len(ids_list) + params[1:] * len(ids_list),
                           use_tqdm=False)
    for out, (_, expected) in zip(outputs[: len(ids_list)], prompts_and_expected, strict=True):
        check_prompt_logprobs(out, expected, NUM_TOP)
