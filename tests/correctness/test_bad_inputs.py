"""Bad requests fail that call with an InvalidRequestError that says what to change; the
same LLM then serves a normal request, and no KV block is left allocated."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.errors import InvalidRequestError, ModelLoadError

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 2048  # the smollm2 fixture's
VOCAB_SIZE = 49152  # SmolLM2's

BadCall = Callable[[LLM], object]


def greedy(**options: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=2, **options)  # type: ignore[arg-type]


BAD_CALLS: list[tuple[str, BadCall, str]] = [
    ("empty string prompt", lambda llm: llm.generate("", greedy(), use_tqdm=False), "prompt is empty"),
    ("no prompts", lambda llm: llm.generate([], greedy(), use_tqdm=False), "no prompts given"),
    ("empty token list", lambda llm: llm.generate([[]], greedy(), use_tqdm=False), "prompt is empty"),
    (
        "prompt of exactly max_model_len tokens",
        lambda llm: llm.generate([[1] * MAX_MODEL_LEN], greedy(), use_tqdm=False),
        "max_model_len is 2048: shorten the prompt",
    ),
    (
        "prompt longer than max_model_len",
        lambda llm: llm.generate([[1] * 3000], greedy(), use_tqdm=False),
        "3000 tokens but max_model_len is 2048",
    ),
    (
        "text prompt longer than max_model_len",
        lambda llm: llm.generate("hello " * 2100, greedy(), use_tqdm=False),
        "max_model_len",
    ),
    (
        "max_tokens 0",
        lambda llm: llm.generate("Hi", SamplingParams(max_tokens=0), use_tqdm=False),
        "max_tokens must be >= 1",
    ),
    (
        "max_tokens -1",
        lambda llm: llm.generate("Hi", SamplingParams(max_tokens=-1), use_tqdm=False),
        "max_tokens must be >= 1",
    ),
    (
        "temperature < 0",
        lambda llm: llm.generate("Hi", SamplingParams(temperature=-0.5), use_tqdm=False),
        "temperature must be >= 0",
    ),
    (
        "top_p 0",
        lambda llm: llm.generate("Hi", SamplingParams(top_p=0.0), use_tqdm=False),
        r"top_p must be in \(0, 1\]",
    ),
    (
        "top_p 1.5",
        lambda llm: llm.generate("Hi", SamplingParams(top_p=1.5), use_tqdm=False),
        r"top_p must be in \(0, 1\]",
    ),
    ("n 0", lambda llm: llm.generate("Hi", SamplingParams(n=0), use_tqdm=False), "n must be an integer >= 1"),
    (
        "negative token id",
        lambda llm: llm.generate([[5, -1, 7]], greedy(), use_tqdm=False),
        r"token ids \[-1\] are outside the vocabulary \[0, 49152\)",
    ),
    (
        "token id == vocab size",
        lambda llm: llm.generate([[5, VOCAB_SIZE]], greedy(), use_tqdm=False),
        r"token ids \[49152\] are outside the vocabulary",
    ),
    (
        "huge token id",
        lambda llm: llm.generate([[10**9]], greedy(), use_tqdm=False),
        "outside the vocabulary",
    ),
    (
        "stop token id outside the vocabulary",
        lambda llm: llm.generate("Hi", greedy(stop_token_ids=[VOCAB_SIZE], min_tokens=1), use_tqdm=False),
        "stop_token_ids",
    ),
    (
        "one bad prompt in a batch",
        lambda llm: llm.generate(["Hello", "", "World"], greedy(), use_tqdm=False),
        "prompt is empty",
    ),
    (
        "bad n in one of several params",
        lambda llm: llm.generate(["Hello", "World"], [greedy(), SamplingParams(n=0)], use_tqdm=False),
        "n must be",
    ),
    (
        "params count does not match prompts",
        lambda llm: llm.generate(["Hello", "World"], [greedy()] * 3, use_tqdm=False),
        "got 3 SamplingParams for 2 prompts",
    ),
]


def assert_serves_normally(llm: LLM) -> None:
    outputs = llm.generate("The capital of France is", greedy(), use_tqdm=False)
    assert len(outputs) == 1
    completion = outputs[0].outputs[0]
    assert len(completion.token_ids) == 2
    assert completion.finish_reason == "length"
    assert completion.text


def assert_no_leaks(llm: LLM) -> None:
    assert not llm.core.has_unfinished()
    assert llm.core.scheduler.requests == {}
    assert llm.core.kv.pool.num_free_blocks == llm.core.kv.pool.num_blocks


@pytest.mark.parametrize(
    ("call", "message"), [(c, m) for _, c, m in BAD_CALLS], ids=[n.replace(" ", "-") for n, _, _ in BAD_CALLS]
)
def test_bad_request_raises_and_engine_keeps_serving(smollm2: LLM, call: BadCall, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        call(smollm2)
    assert_no_leaks(smollm2)
    assert_serves_normally(smollm2)
    assert_no_leaks(smollm2)


def test_longest_allowed_prompt_is_served(smollm2: LLM) -> None:
    llm = smollm2.derive(max_model_len=32, num_blocks=2)
    outputs = llm.generate([[1] * 31], greedy(), use_tqdm=False)
    completion = outputs[0].outputs[0]
    # Room for exactly one generated token.
    assert len(completion.token_ids) == 1
    assert completion.finish_reason == "length"
    assert_no_leaks(llm)


def test_many_bad_requests_in_a_row_leave_the_engine_whole(smollm2: LLM) -> None:
    for _, call, _ in BAD_CALLS:
        with pytest.raises(InvalidRequestError):
            call(smollm2)
    assert_serves_normally(smollm2)
    assert_no_leaks(smollm2)


def test_unknown_model_name_raises_model_load_error() -> None:
    with pytest.raises(ModelLoadError, match="'no-such-model'"):
        LLM("no-such-model")
