"""The OpenAI-compatible HTTP API against a real local cluster (router + 1 prefill + 1
decode), driven by the official `openai` package where it can be, and by raw HTTP for
the headers it hides. Greedy answers equal the offline engine's. Errors, auth and abuse:
test_openai_errors.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.integration.openai_support import (
    CHAT,
    KEY,
    MODEL,
    assert_envelope,
    http,
)
from vllm_cluster.cluster.local import LocalCluster
from vllm_cluster.engine import LLM, SamplingParams

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(openai_cluster: LocalCluster) -> LocalCluster:
    return openai_cluster


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Any:
    return openai.OpenAI(base_url=cluster.http_address + "/v1", api_key=KEY, max_retries=0, timeout=120)


# ---- the openai package


def test_chat_greedy_equals_offline_engine(client: Any, smollm2: LLM) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    expected = smollm2.chat(CHAT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.object == "chat.completion" and reply.model == MODEL


def test_completion_greedy_equals_offline_engine(client: Any, smollm2: LLM) -> None:
    prompt = "The capital of France is"
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    expected = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    assert reply.choices[0].text == expected.text
    assert reply.usage.prompt_tokens == len(smollm2.get_tokenizer().encode(prompt))


def test_streaming_chat_equals_whole_and_reports_usage(client: Any) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_completion(client: Any) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=8, temperature=0, stream=True))
    whole = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=8, temperature=0)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices_and_seed_reproducibility(client: Any) -> None:
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=16,
                  temperature=1.0, seed=1234, n=3)
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert len({c.message.content for c in first.choices}) > 1, "n samples with one seed must differ from each other"
    assert 3 <= first.usage.completion_tokens <= 3 * 16


def test_n_choices_streamed(client: Any) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0.8,
                                            seed=7, n=2, stream=True))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    whole = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0.8, seed=7, n=2
    )
    assert texts == {c.index: c.text for c in whole.choices}


def test_batched_prompts(client: Any) -> None:
    prompts = ["The capital of France is", "1, 2, 3,"]
    reply = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0)
    singles = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0).choices[0].text for p in prompts
    ]
    assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == singles


def test_chat_logprobs(client: Any) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for token in content:
        assert token.logprob <= 0 and len(token.top_logprobs) == 3
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob, abs=1e-4)  # greedy: the top one
        assert token.bytes == list(token.token.encode())


def test_completion_logprobs(client: Any) -> None:
    reply = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2
    )
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == reply.choices[0].text
    assert lp.text_offset[0] == 0 and all(len(top) == 2 for top in lp.top_logprobs)


def test_stop_string_and_stop_reason(client: Any) -> None:
    reply = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 7"])
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and " 7" not in choice.text and "6" in choice.text
    assert choice.model_extra.get("stop_reason") == " 7"


def test_cached_tokens_reported(client: Any) -> None:
    messages = [{"role": "system", "content": "You are a helpful assistant who answers in French. " * 4}, *CHAT]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached % 16 == 0 and cached < again.usage.prompt_tokens


def test_responses_api(client: Any) -> None:
    reply = client.responses.create(
        model=MODEL, input="What is the capital of France?", max_output_tokens=12, temperature=0
    )
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert reply.output_text == chat.choices[0].message.content
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    with client.responses.stream(model=MODEL, input="What is the capital of France?", max_output_tokens=12,
                                 temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    assert final.output_text == reply.output_text


def test_responses_text_format_and_reasoning_items(client: Any, cluster: LocalCluster) -> None:
    """`text.format` constrains a response as chat's response_format does (same tokens); with
    a reasoning parser the reasoning is a `reasoning` output item, whole and streamed
    (`response.reasoning_text.delta`), counted in reasoning_tokens, and an earlier turn's
    items, reasoning included, go back in as input."""
    from tests.integration.openai_support import start_front
    from vllm_cluster.engine.loader import bundled_model_path
    from vllm_cluster.engine.tokenizer import load_tokenizer

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    reply = client.responses.create(
        model=MODEL, input="Name a city.", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
    )
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a city."}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    assert set(json.loads(reply.output_text)) == {"city"}
    assert reply.output_text == chat.choices[0].message.content and reply.text.format.type == "json_schema"
    with pytest.raises(openai.BadRequestError, match="text.format"):
        client.responses.create(model=MODEL, input="hi", text={"format": {"type": "xml"}})

    # deepseek_r1: everything before </think> is reasoning; SmolLM2 never closes it.
    with start_front(cluster.router_address, tokenizer=load_tokenizer(bundled_model_path()),
                     reasoning_parser="deepseek_r1") as front:
        thinking = openai.OpenAI(base_url=f"{front.http_address}/v1", api_key=KEY, max_retries=0)
        args = {"model": MODEL, "input": "What is the capital of France?", "max_output_tokens": 12,
                "temperature": 0, "reasoning": {"effort": "low"}}
        whole = thinking.responses.create(**args)
        chat = thinking.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
        with thinking.responses.stream(**args) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
        follow_up = thinking.responses.create(
            model=MODEL, max_output_tokens=4, temperature=0,
            input=[{"role": "user", "content": "What is the capital of France?"},
                   *[item.model_dump(exclude_none=True) for item in whole.output],
                   {"role": "user", "content": "And of Spain?"}],
        )
    expected = chat.choices[0].message.model_extra["reasoning_content"]
    for response in (whole, final):
        assert response.output[0].type == "reasoning" and response.output[0].content[0].text == expected
        assert 0 < response.usage.output_tokens_details.reasoning_tokens <= response.usage.output_tokens
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    assert follow_up.status in ("completed", "incomplete")


def test_models(client: Any) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 1024


def test_sdk_raises_typed_errors(client: Any) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=CHAT)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).models.list()


# ---- raw HTTP: routes, envelope, statuses, headers


def test_tokenize_detokenize(cluster: LocalCluster, smollm2: LLM) -> None:
    status, _, body = http(cluster, "POST", "/tokenize", {"prompt": "hello world"})
    assert status == 200 and body["tokens"] == list(smollm2.get_tokenizer().encode("hello world"))
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
    status, _, back = http(cluster, "POST", "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == "hello world"
    status, _, chat = http(cluster, "POST", "/tokenize", {"messages": CHAT})
    assert status == 200 and chat["count"] > body["count"]
    status, _, error = http(cluster, "POST", "/detokenize", {"tokens": [10**9]})
    assert status == 400
    assert_envelope(error, 400, "tokens")


def test_health_version_metrics(cluster: LocalCluster) -> None:
    assert http(cluster, "GET", "/health", key=None)[0] == 200
    status, _, body = http(cluster, "GET", "/version")
    assert status == 200 and body["version"]
    status, headers, text = http(cluster, "GET", "/metrics")
    assert status == 200 and "vllm:time_to_first_token_seconds" in text
