"""Async scheduling (step N+1 prepared while step N runs) on the real SmolLM2, on CPU: the
same tokens, text, finish and stop reasons as the synchronous engine, through eos, stop
strings, stop tokens, min/max tokens, seeded sampling, a logprobs request (which drains
to synchronous steps while it runs), preemption and an abort mid-stream."""

from __future__ import annotations

import pytest

from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.engine_loop import EngineLoop
from vllm_cluster.engine.outputs import RequestOutput
from vllm_cluster.engine.tokenizer import apply_chat_template

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "What is 2+2?"}]  # answered in a few tokens, then EOS


@pytest.fixture(scope="module")
def async_llm(smollm2: LLM) -> LLM:
    llm = smollm2.derive(async_scheduling=True)
    assert llm.core._async is not None and smollm2.core._async is None
    return llm


def _summary(outputs: list[RequestOutput]) -> list[tuple[list[int], str, str | None, int | str | None]]:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in outputs for c in o.outputs]


def _assert_idle(llm: LLM) -> None:
    assert not llm.core.has_unfinished()
    assert llm.core.kv.pool.num_free_blocks == llm.core.kv.pool.num_blocks


def test_async_generate_equals_sync_through_every_stop(smollm2: LLM, async_llm: LLM) -> None:
    tok = smollm2.get_tokenizer()
    chat = apply_chat_template(tok, CHAT)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    reference = smollm2.generate([PROMPT, chat], greedy, use_tqdm=False)
    text, ids = reference[0].outputs[0].text, reference[0].outputs[0].token_ids
    assert reference[1].outputs[0].finish_reason == "stop" and reference[1].outputs[0].stop_reason is None
    num_chat = len(reference[1].outputs[0].token_ids)
    prompts = [PROMPT, PROMPT, PROMPT, chat, chat, PROMPT, PROMPT]
    params = [
        greedy,  # length
        SamplingParams(temperature=0.0, max_tokens=12, stop=[text[len(text) // 2 : len(text) // 2 + 3]]),
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[ids[5]]),
        greedy,  # eos
        SamplingParams(temperature=0.0, max_tokens=num_chat + 3, min_tokens=num_chat + 1),  # eos held off
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10),
        SamplingParams(temperature=0.0, max_tokens=3, logprobs=2),  # synchronous while it runs
    ]
    expected = smollm2.generate(prompts, params, use_tqdm=False)
    got = async_llm.generate(prompts, params, use_tqdm=False)
    assert _summary(got) == _summary(expected)
    assert [o.outputs[0].finish_reason for o in got] == ["length", "stop", "stop", "stop", "length", "length", "length"]
    for e, g in zip(expected[-1].outputs[0].logprobs or [], got[-1].outputs[0].logprobs or [], strict=True):
        assert e.keys() == g.keys()
        assert all(abs(e[t].logprob - g[t].logprob) < 1e-4 for t in e)
    _assert_idle(async_llm)


def test_async_preemption_gives_the_sync_tokens(smollm2: LLM, async_llm: LLM) -> None:
    # Three requests of >= 4 prompt tokens + 16 outputs need >= 15 blocks of 4 tokens: 12 make them preempt.
    options = dict(block_size=4, num_blocks=12, max_model_len=48, max_num_batched_tokens=64)
    sync_small, async_small = smollm2.derive(**options), async_llm.derive(**options)
    prompts = [PROMPT, "The capital of France is", "Roses are red,"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = sync_small.generate(prompts, params, use_tqdm=False)
    got = async_small.generate(prompts, params, use_tqdm=False)
    assert _summary(got) == _summary(expected)
    assert async_small.core.scheduler.num_preemptions > 0
    _assert_idle(async_small)


def test_async_abort_mid_stream(smollm2: LLM, async_llm: LLM) -> None:
    tok = smollm2.get_tokenizer()
    long_params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    other_params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected_long, expected_other = smollm2.generate(
        [PROMPT, "Roses are red,"], [long_params, other_params], use_tqdm=False
    )
    engine = async_llm.derive()
    loop = EngineLoop(engine.core, tok)
    try:
        long = loop.add(engine.core.make_request("long", tok.encode(PROMPT), long_params))
        other = loop.add(engine.core.make_request("other", tok.encode("Roses are red,"), other_params))
        first = long.get(timeout_s=60)
        assert loop.abort("long")
        deltas = [first, *long]
        assert deltas[-1].finish_reason == "abort"
        streamed = [t for d in deltas for t in d.token_ids]
        assert 0 < len(streamed) < 16 and streamed == expected_long.outputs[0].token_ids[: len(streamed)]
        assert [t for d in other for t in d.token_ids] == expected_other.outputs[0].token_ids
        pool = engine.core.kv.pool
        assert loop.call(lambda core: (core.has_unfinished(), pool.num_free_blocks)) == (False, pool.num_blocks)
    finally:
        loop.stop()


def test_constrained_requests_overlap_steps_and_give_the_sync_tokens(smollm2: LLM, async_llm: LLM) -> None:
    """A grammar's mask is filled after the previous step's token is applied, while the next
    step's forward runs: steps stay overlapped (a step is in flight after each call), and the
    tokens, constrained (ending when the grammar completes) or not, are the synchronous ones."""
    from vllm_cluster.engine import StructuredOutputsParams

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    prompts = ["A person, as JSON:", "A person, as JSON:", PROMPT, "Three digits:"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema)),
        SamplingParams(temperature=0.8, seed=3, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema)),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[0-9]{3}")),
    ]
    expected = smollm2.generate(prompts, params, use_tqdm=False)
    got = async_llm.generate(prompts, params, use_tqdm=False)
    assert _summary(got) == _summary(expected)
    assert [o.outputs[0].finish_reason for o in got] == ["stop", "stop", "length", "stop"]
    _assert_idle(async_llm)

    core = async_llm.core
    tok = smollm2.get_tokenizer()
    core.add_request(core.make_request("constrained", tok.encode(prompts[0]), params[0]))
    in_flight = []
    while core.has_unfinished():
        core.step()
        in_flight.append(core._async is not None and core._async.busy)
    assert sum(in_flight) >= len(in_flight) - 2  # every step but the last overlapped the next
    _assert_idle(async_llm)
