"""Structured output through the OpenAI HTTP API of a disaggregated cluster (router +
1 prefill + 1 decode): the prefill samples the first token under the grammar and the
decode instance continues it; and of a colocated one (the decode instance computes the
prompt). Driven by the official `openai` package; a bad spec is a 400 naming the field,
and the server keeps serving."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from tests.integration.openai_support import (
    CHAT,
    KEY,
    MODEL,
    assert_blocks_return,
    assert_envelope,
    http,
)
from vllm_cluster.cluster.local import LocalCluster
from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.structured_output_params import StructuredOutputsParams

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
        "country": {"enum": ["France", "Italy", "Spain"]},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 50},
    },
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}


@pytest.fixture(scope="module")
def cluster(openai_cluster: LocalCluster) -> LocalCluster:
    return openai_cluster


@pytest.fixture(scope="module")
def colocated(colocated_cluster: LocalCluster) -> LocalCluster:
    return colocated_cluster


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Any:
    return openai.OpenAI(base_url=cluster.http_address + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_chat_json_schema_validates_and_equals_offline(client: Any, smollm2: LLM) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=60, temperature=0, response_format=JSON_SCHEMA
    )
    text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), CITY)
    assert reply.choices[0].finish_reason == "stop"
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=CITY))
    assert text == smollm2.chat(CHAT, params, use_tqdm=False)[0].outputs[0].text


def test_sampled_and_streamed_json_schema(client: Any) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=60, temperature=1.0, seed=3, n=4, response_format=JSON_SCHEMA
    )
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content), CITY)
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=60, temperature=0, stream=True, response_format=JSON_SCHEMA
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), CITY)
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=40, temperature=0, response_format={"type": "json_object"}
    )
    text, finish_reason = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert text.startswith("{") and (finish_reason == "length" or isinstance(json.loads(text), dict))


def test_completions_with_vllm_fields(client: Any) -> None:
    prompt = "The capital of France is"
    regex = {"structured_outputs": {"regex": "[A-Z][a-z]+\\."}}
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, extra_body=regex)
    assert re.fullmatch(r"[A-Z][a-z]+\.", reply.choices[0].text) and reply.choices[0].finish_reason == "stop"
    reply = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, temperature=0, extra_body={"guided_choice": ["Paris", "Rome"]}
    )
    assert reply.choices[0].text in ("Paris", "Rome")
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    as_text = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"response_format": {"type": "text"}}
    )
    assert as_text.choices[0].text == plain.choices[0].text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
         "response_format"),
        ({"structured_outputs": {"regex": "a(("}}, "structured_outputs"),
        ({"guided_grammar": "root ::= "}, "guided_grammar"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ],
)
def test_bad_spec_is_400_naming_the_field(cluster: LocalCluster, fields: dict[str, Any], param: str) -> None:
    status, _, error = http(cluster, "POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, **fields})
    assert status == 400, error
    assert_envelope(error, 400, param)
    status, _, body = http(cluster, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] == 2


def test_sdk_bad_schema_raises_and_blocks_return(cluster: LocalCluster, client: Any) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}}
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, response_format=bad)
    assert_blocks_return(cluster)


def test_colocated_json_schema_equals_offline(colocated: LocalCluster, smollm2: LLM) -> None:
    client = openai.OpenAI(base_url=colocated.http_address + "/v1", api_key=KEY, max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=60, temperature=0, response_format=JSON_SCHEMA
    )
    text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), CITY)
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=CITY))
    assert text == smollm2.chat(CHAT, params, use_tqdm=False)[0].outputs[0].text


def test_reasoning_parser_splits_think_text_whole_and_streamed(cluster: LocalCluster) -> None:
    """A front with router.reasoning_parser deepseek_r1 over the cluster; a regex makes
    SmolLM2 write reasoning, </think>, then an answer: the reasoning goes to
    reasoning_content, the rest to content, the same whole and streamed."""
    from tests.integration.openai_support import start_front
    from vllm_cluster.engine.loader import bundled_model_path
    from vllm_cluster.engine.tokenizer import load_tokenizer

    regex = "[a-z]{3,12}</think>[A-Z][a-z]{2,10}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name a city."}], "max_tokens": 40,
            "temperature": 0, "extra_body": {"structured_outputs": {"regex": regex}}}
    with start_front(cluster.router_address, tokenizer=load_tokenizer(bundled_model_path()),
                     reasoning_parser="deepseek_r1") as front:
        client = openai.OpenAI(base_url=f"{front.http_address}/v1", api_key=KEY)
        whole = client.chat.completions.create(**body).choices[0].message
        reasoning, content = "", ""
        for chunk in client.chat.completions.create(**body, stream=True):
            if chunk.choices:
                delta = chunk.choices[0].delta
                reasoning += getattr(delta, "reasoning_content", None) or ""
                content += delta.content or ""
    whole_reasoning = getattr(whole, "reasoning_content", None) or whole.model_extra.get("reasoning_content")
    assert re.fullmatch("[a-z]{3,12}", whole_reasoning) and re.fullmatch("[A-Z][a-z]{2,10}", whole.content or "")
    assert (reasoning, content) == (whole_reasoning, whole.content)
