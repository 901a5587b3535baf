"""Tool calling through the OpenAI HTTP API, driven by the official `openai` package, on a
colocated cluster whose router has a Hermes-style chat template (tools_cluster.yaml), the
hermes tool-call parser and auto tool choice on.

`required` and a named function are enforced by structured output, so even SmolLM2 sampled
at temperature 1 makes calls whose arguments validate. SmolLM2 does not write <tool_call>
blocks by itself: the `auto` test makes it write one with a guided regex, and the parser
takes the call out of the text as it would from a model that wrote it freely."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.integration.openai_support import KEY, MODEL, assert_envelope, http, refusing_address, start_front
from vllm_cluster.client import Client
from vllm_cluster.cluster.local import LocalCluster
from vllm_cluster.engine.loader import bundled_model_path
from vllm_cluster.engine.tokenizer import apply_chat_template, load_tokenizer
from vllm_cluster.worker.router_config import RouterConfig

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

CONFIG = Path(__file__).with_name("tools_cluster.yaml")
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object", "properties": {"zone": {"enum": ["CET", "UTC", "EST"]}}, "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": TIME}},
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# Sampled calls, sent as requests of n=50 at once (n is at most 64 a request); each costs the
# 2-core CI machine about a third of a second of decode time in batches of 64.
NUM_SAMPLED_CALLS = 200
CALLS_PER_REQUEST = 50


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    pytest.importorskip("ucxx")
    local = LocalCluster.from_yaml(CONFIG)
    local.api_key = KEY
    local.log_dir = tmp_path_factory.mktemp("openai-tools")
    with local:
        yield local


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Any:
    # 200 sampled calls (4 requests, n=50) on two shared cores: a generous bound, not a speed check.
    return openai.OpenAI(base_url=cluster.http_address + "/v1", api_key=KEY, max_retries=0, timeout=600)


def assert_valid_call(call: Any) -> None:
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def streamed_calls(stream: Any) -> tuple[list[dict[str, str]], str | None, list[Any]]:
    """The calls a client puts together from the deltas, the finish reason, and the deltas."""
    calls: dict[int, dict[str, str]] = {}
    deltas, finish_reason = [], None
    for chunk in stream:
        for choice in chunk.choices:
            finish_reason = choice.finish_reason or finish_reason
            for delta in choice.delta.tool_calls or []:
                deltas.append(delta)
                if delta.id is not None:
                    assert delta.type == "function" and delta.function.name and delta.index not in calls
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
                else:
                    assert delta.function.name is None
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish_reason, deltas


def test_required_calls_sampled_validate_against_the_parameters(client: Any) -> None:
    # One call first puts the prompt in the prefix cache, so the n choices below share it
    # instead of each computing it.
    greedy = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=60
    )
    assert greedy.choices[0].finish_reason == "tool_calls"
    assert_valid_call(greedy.choices[0].message.tool_calls[0])
    def sampled(seed: int) -> Any:
        return client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            temperature=1.0, seed=seed, n=CALLS_PER_REQUEST, max_tokens=60,
        )

    num_requests = NUM_SAMPLED_CALLS // CALLS_PER_REQUEST
    with ThreadPoolExecutor(num_requests) as pool:
        choices = [c for reply in pool.map(sampled, range(num_requests)) for c in reply.choices]
    assert len(choices) == NUM_SAMPLED_CALLS
    for choice in choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        assert_valid_call(choice.message.tool_calls[0])
    assert len({c.message.tool_calls[0].function.arguments for c in choices}) > 1  # sampled, not one answer
    parallel = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=7, n=2, max_tokens=80,
    )
    for choice in parallel.choices:
        if choice.finish_reason == "length":  # parallel calls are unbounded: the model may not stop
            continue
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert_valid_call(call)


def test_named_function_streamed_equals_whole(client: Any) -> None:
    whole = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=60
    )
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and whole.choices[0].finish_reason == "tool_calls"
    assert_valid_call(call)
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=60, stream=True
    )
    calls, finish_reason, deltas = streamed_calls(stream)
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]
    assert finish_reason == "tool_calls" and len(deltas) > 1  # the arguments came in pieces
    whole = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=60
    )
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=60, stream=True
    )
    calls, finish_reason, _ = streamed_calls(stream)
    expected = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert [(c["name"], c["arguments"]) for c in calls] == expected and finish_reason == "tool_calls"


def test_tool_results_go_through_the_template(client: Any, cluster: LocalCluster) -> None:
    arguments = '{"city": "Paris", "unit": "celsius"}'
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}},
        ]},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "18 degrees and sunny"},
    ]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8,
        extra_body={"prompt_logprobs": 0},
    )
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
    prompt_ids = [int(next(iter(entry))) for entry in reply.model_extra["prompt_logprobs"][1:]]
    tokenizer = load_tokenizer(bundled_model_path())
    tokenizer.chat_template = RouterConfig.from_dict({"chat_template": _template()}).chat_template
    # tool_choice none offers no tools; the call's arguments reach the template as an object.
    as_template_reads = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "chatcmpl-tool-1", "type": "function",
         "function": {"name": "get_weather", "arguments": json.loads(arguments)}}]},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "18 degrees and sunny"}]
    expected = apply_chat_template(tokenizer, as_template_reads)
    assert prompt_ids == expected[1:]
    text = tokenizer.decode(expected)
    assert f'"arguments": {arguments}' in text and "<tool_response>\n18 degrees and sunny\n</tool_response>" in text
    with_tools = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=40,
        extra_body={"prompt_logprobs": 0},
    )
    offered = [int(next(iter(entry))) for entry in with_tools.model_extra["prompt_logprobs"][1:]]
    assert offered == apply_chat_template(tokenizer, as_template_reads, None, TOOLS)[1:]
    with Client(cluster.router_address, api_key=KEY) as grpc_client:  # the router templates gRPC chats
        result = grpc_client.generate(chat=messages, tools=TOOLS, max_tokens=2, temperature=0, prompt_logprobs=0)
    assert [lp.token_id for lp in result.prompt_logprobs] == offered


def test_auto_parses_the_hermes_calls_the_model_writes(client: Any) -> None:
    written = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    forced = {"guided_regex": "Let me check\\.\\n" + _regex_literal(written)}
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60, extra_body=forced
    )
    message = reply.choices[0].message
    assert message.content == "Let me check." and reply.choices[0].finish_reason == "tool_calls"
    (call,) = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {"zone": "CET"})
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60, extra_body=forced, stream=True,
        stream_options={"include_usage": True},
    )
    content, calls, finish_reason = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish_reason = choice.finish_reason or finish_reason
            for delta in choice.delta.tool_calls or []:
                calls[delta.index] = (delta.function.name, delta.function.arguments)
    assert content == "Let me check." and finish_reason == "tool_calls"
    assert calls == {0: ("get_time", call.function.arguments)}
    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=8)
    assert plain.choices[0].message.content and plain.choices[0].message.tool_calls == []
    assert plain.choices[0].finish_reason == "length"


def test_auto_needs_the_config_and_none_offers_no_tools(cluster: LocalCluster) -> None:
    with refusing_address() as nowhere, start_front(nowhere) as front:  # no tool parser configured
        for fields, param in (({"tools": TOOLS}, "tools"), ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice")):
            status, _, body = http(front, "POST", "/v1/chat/completions", {"messages": ASK, **fields})
            assert status == 400, body
            assert_envelope(body, 400, param)
            assert "router.enable_auto_tool_choice" in body["error"]["message"]
            assert "router.tool_call_parser" in body["error"]["message"]
    bad = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
         "messages"),
    ]
    for fields, param in bad:
        status, _, body = http(cluster, "POST", "/v1/chat/completions", {"messages": ASK, **fields})
        assert status == 400, body
        assert_envelope(body, 400, param)
    plain = {"messages": ASK, "temperature": 0, "max_tokens": 8}
    _, _, without = http(cluster, "POST", "/v1/chat/completions", plain)
    _, _, none = http(cluster, "POST", "/v1/chat/completions", {**plain, "tools": TOOLS, "tool_choice": "none"})
    assert none["choices"][0]["message"]["content"] == without["choices"][0]["message"]["content"]
    assert none["usage"]["prompt_tokens"] == without["usage"]["prompt_tokens"]  # no tools in the prompt


def test_responses_function_tools(client: Any) -> None:
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
              "parameters": WEATHER, "strict": True}]
    reply = client.responses.create(
        model=MODEL, input=ASK[0]["content"], tools=tools, tool_choice={"type": "function", "name": "get_weather"},
        temperature=0, max_output_tokens=60,
    )
    (item,) = reply.output
    assert item.type == "function_call" and item.name == "get_weather" and item.call_id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(item.arguments), WEATHER)
    assert reply.tools[0].name == "get_weather"
    with client.responses.stream(
        model=MODEL, input=ASK[0]["content"], tools=tools, tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_output_tokens=60,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    assert [(o.type, o.name, o.arguments) for o in final.output] == [("function_call", "get_weather", item.arguments)]
    follow_up = [
        {"role": "user", "content": ASK[0]["content"]},
        {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments},
        {"type": "function_call_output", "call_id": item.call_id, "output": "18 degrees and sunny"},
    ]
    answer = client.responses.create(model=MODEL, input=follow_up, tools=tools, tool_choice="none",
                                     temperature=0, max_output_tokens=12)
    assert answer.output[0].type == "message" and answer.output_text
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=12, tools=TOOLS, tool_choice="none",
        messages=[*ASK, {"role": "assistant", "tool_calls": [{"id": item.call_id, "type": "function", "function": {
            "name": item.name, "arguments": item.arguments}}]},
            {"role": "tool", "tool_call_id": item.call_id, "content": "18 degrees and sunny"}],
    )
    assert answer.output_text == chat.choices[0].message.content


def _template() -> str:
    import yaml

    return str(yaml.safe_load(CONFIG.read_text())["router"]["chat_template"])


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in "\\.^$|?*+()[]{}" else c for c in text)
