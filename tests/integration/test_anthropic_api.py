"""Anthropic's Messages API (/v1/messages) against a real local cluster (router + 1 decode
instance, colocated: the translation is under test here, the disaggregated path in
test_openai_api.py), driven by the official `anthropic` package: greedy answers equal the
same prompt sent through /v1/chat/completions, streams equal whole answers, stop reasons,
token counts, and errors as the SDK's typed exceptions. The SDK has no sampling arguments;
they go in `extra_body`, as the server reads them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.integration.openai_support import KEY, MODEL, http, send_and_wait
from vllm_cluster.cluster.local import LocalCluster

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.slow

PROMPT = "What is the capital of France?"
MESSAGES = [{"role": "user", "content": PROMPT}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def cluster(colocated_cluster: LocalCluster) -> LocalCluster:
    return colocated_cluster


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Any:
    return anthropic.Anthropic(base_url=cluster.http_address, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat_client(cluster: LocalCluster) -> Any:
    return openai.OpenAI(base_url=cluster.http_address + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_create_equals_chat_completions(client: Any, chat_client: Any) -> None:
    message = client.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, messages=MESSAGES)
    chat = chat_client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=MESSAGES)
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL and message.stop_sequence is None


def test_stream_equals_whole(client: Any) -> None:
    kwargs = dict(model=MODEL, max_tokens=12, extra_body=GREEDY, messages=MESSAGES)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stream_events_come_in_anthropics_order(client: Any) -> None:
    events = list(client.messages.create(model=MODEL, max_tokens=6, extra_body=GREEDY, messages=MESSAGES, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds[2:-3]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"
    ]
    assert deltas and set(deltas) == {"content_block_delta"}
    assert {e.delta.type for e in events[2:-3]} == {"text_delta"} and {e.index for e in events[1:-2]} == {0}
    assert events[0].message.usage.input_tokens > 0 and events[0].message.content == []
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 6


def test_raw_stream_names_each_event(cluster: LocalCluster) -> None:
    """`event:` lines as Anthropic sends them (the SDK skips an event without a name)."""
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0, "messages": MESSAGES, "stream": True}
    status, headers, text = http(cluster, "POST", "/v1/messages", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    frames = [f for f in text.split("\n\n") if f]
    names = [f.split("\n")[0] for f in frames]
    assert names[:3] == ["event: message_start", "event: ping", "event: content_block_start"]
    assert names[-1] == "event: message_stop" and all(n.startswith("event: ") for n in names)
    assert all(f.split("\n")[1].startswith('data: {"type": "' + n.removeprefix("event: ")) for f, n in
               zip(frames, names, strict=True))


def test_system_prompt_as_string_or_blocks(client: Any, chat_client: Any) -> None:
    system = "You are a pirate. Answer in one short sentence."
    as_string = client.messages.create(model=MODEL, max_tokens=10, extra_body=GREEDY, system=system, messages=MESSAGES)
    as_blocks = client.messages.create(model=MODEL, max_tokens=10, extra_body=GREEDY, messages=MESSAGES,
                                       system=[{"type": "text", "text": system}])
    chat = chat_client.chat.completions.create(model=MODEL, max_tokens=10, temperature=0,
                                               messages=[{"role": "system", "content": system}, *MESSAGES])
    assert as_string.content[0].text == as_blocks.content[0].text == chat.choices[0].message.content
    assert as_string.usage.input_tokens == chat.usage.prompt_tokens


def test_stop_sequences_and_max_tokens(client: Any) -> None:
    whole = client.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, messages=MESSAGES).content[0].text
    stop = whole.split()[2]
    cut = client.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, messages=MESSAGES,
                                 stop_sequences=["never seen", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == whole[: whole.index(stop)]
    short = client.messages.create(model=MODEL, max_tokens=3, extra_body=GREEDY, messages=MESSAGES)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_count_tokens_equals_the_served_prompt(client: Any) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Spain?"}]
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages)
    served = client.messages.create(model=MODEL, max_tokens=1, system="Be brief.", messages=messages)
    assert counted.input_tokens == served.usage.input_tokens > 0


def test_errors_are_the_sdks_typed_exceptions(client: Any, cluster: LocalCluster) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=5, messages=MESSAGES, extra_body={"temperature": -1})
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in bad.value.body["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [image]}])
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=5, messages=MESSAGES)
    wrong = anthropic.Anthropic(base_url=cluster.http_address, api_key="wrong-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(model=MODEL, max_tokens=5, messages=MESSAGES)
    assert refused.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.count_tokens(model=MODEL, messages=MESSAGES)
    bearer = anthropic.Anthropic(base_url=cluster.http_address, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(model=MODEL, max_tokens=1, messages=MESSAGES).usage.output_tokens == 1


def test_the_guard_refuses_in_anthropics_shape(cluster: LocalCluster) -> None:
    """The guard answers before the app: a body too large, in the route's own error shape."""
    request = (f"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: {KEY}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {1 << 30}\r\n\r\n")
    answer, closed = send_and_wait(cluster, request.encode())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and closed
    assert json.loads(body)["error"]["type"] == "request_too_large"
    status, _, refused = http(cluster, "POST", "/v1/messages/count_tokens", {"model": MODEL, "messages": MESSAGES},
                              key=None)
    assert status == 401 and refused["type"] == "error" and "x-api-key" in refused["error"]["message"]


def test_output_config_format_constrains_the_answer(client: Any) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    message = client.messages.create(model=MODEL, max_tokens=40, messages=MESSAGES, extra_body=GREEDY,
                                     output_config={"format": {"type": "json_schema", "schema": schema}})
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)


# ---- tools: `any` and a named tool are enforced by structured output (no tool-call parser needed)

WEATHER = {
    "name": "get_weather", "description": "The current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                     "required": ["city", "unit"], "additionalProperties": False},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SAMPLED = {"temperature": 1.0, "seed": 11}


def _calls(content: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(b.name, b.input) for b in content if b.type == "tool_use"]


def test_tool_choice_any_gives_tool_use_blocks(client: Any) -> None:
    kwargs = dict(model=MODEL, max_tokens=60, messages=ASK, tools=[WEATHER], extra_body=SAMPLED,
                  tool_choice={"type": "any", "disable_parallel_tool_use": True})
    whole = client.messages.create(**kwargs)
    assert whole.stop_reason == "tool_use"
    [block] = [b for b in whole.content if b.type == "tool_use"]
    assert block.id.startswith("toolu_") and block.name == "get_weather"
    jsonschema.validate(block.input, WEATHER["input_schema"])
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert _calls(final.content) == _calls(whole.content) and final.stop_reason == "tool_use"


def test_auto_tool_choice_needs_the_servers_parser(client: Any) -> None:
    """This cluster has no router.tool_call_parser: the default tool_choice, auto, says what to send instead."""
    with pytest.raises(anthropic.BadRequestError, match='"type": "any"'):
        client.messages.create(model=MODEL, max_tokens=5, messages=ASK, tools=[WEATHER])


def test_named_tool_streams_its_input_in_pieces(client: Any) -> None:
    events = list(client.messages.create(model=MODEL, max_tokens=60, messages=ASK, tools=[WEATHER], stream=True,
                                         tool_choice={"type": "tool", "name": "get_weather"}, extra_body=SAMPLED))
    [start] = [e for e in events if e.type == "content_block_start"]
    assert start.content_block.type == "tool_use" and start.content_block.input == {}
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(pieces) > 1 and {e.delta.type for e in events if e.type == "content_block_delta"} == {"input_json_delta"}
    jsonschema.validate(json.loads("".join(pieces)), WEATHER["input_schema"])
    assert events[-2].delta.stop_reason == "tool_use"


def test_tool_result_fed_back_equals_the_chat_request(client: Any, chat_client: Any) -> None:
    """A tool_use turn and its tool_result are the chat request's tool_calls and tool message."""
    call = {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris", "unit": "celsius"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_01", "content": [{"type": "text", "text": "15 degrees"}]}
    messages = [*ASK, {"role": "assistant", "content": [call]}, {"role": "user", "content": [result]}]
    message = client.messages.create(model=MODEL, max_tokens=10, messages=messages, tools=[WEATHER],
                                     tool_choice={"type": "none"}, extra_body=GREEDY)
    chat = chat_client.chat.completions.create(
        model=MODEL, max_tokens=10, temperature=0, tool_choice="none",
        tools=[{"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}],
        messages=[*ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_01", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(call["input"])}}]},
            {"role": "tool", "tool_call_id": "toolu_01", "content": "15 degrees"}],
    )
    assert message.content[0].text == chat.choices[0].message.content
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    counted = client.messages.count_tokens(model=MODEL, messages=messages, tools=[WEATHER],
                                           tool_choice={"type": "none"})
    assert counted.input_tokens == message.usage.input_tokens
