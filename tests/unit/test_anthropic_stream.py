"""The Messages translation, on chat shapes written out by hand: a streamed chat answer with
reasoning, text and two tool calls becomes Anthropic's exact event sequence, and a whole
one the same content blocks; stop reasons and errors map as Anthropic names them."""

from __future__ import annotations

import json
from typing import Any

from vllm_cluster.router.anthropic.stream import MessageEvents
from vllm_cluster.router.anthropic.translate import message_object, stop_reason

MODEL = "m"


def _chunk(delta: dict[str, Any], finish_reason: str | None = None, completion_tokens: int = 1) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
    if finish_reason:
        choice["stop_reason"] = None
    return {"model": MODEL, "choices": [choice], "usage": {"prompt_tokens": 7, "completion_tokens": completion_tokens}}


def _events(texts: list[str]) -> list[tuple[str, dict[str, Any]]]:
    parsed = []
    for text in texts:
        name_line, data_line = text.rstrip("\n").split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {data['type']}"
        parsed.append((data.pop("type"), data))
    return parsed


def test_blocks_open_and_close_in_the_order_the_chunks_bring_them() -> None:
    call = {"index": 0, "id": "chatcmpl-tool-abc", "type": "function", "function": {"name": "f", "arguments": ""}}
    chunks = [
        _chunk({"role": "assistant", "reasoning_content": "think"}),
        _chunk({"reasoning_content": " more"}, completion_tokens=2),
        _chunk({"content": "Hi"}, completion_tokens=3),
        _chunk({"tool_calls": [call]}, completion_tokens=4),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}, completion_tokens=5),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}, {
            "index": 1, "id": "chatcmpl-tool-def", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
            "tool_calls", completion_tokens=6),
        {"model": MODEL, "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 6}},
    ]
    builder = MessageEvents("msg_1", None)
    events = _events([e for c in chunks for e in builder.feed(c)] + builder.finish())
    assert [kind for kind, _ in events] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["id"] == "msg_1" and start["content"] == [] and start["usage"]["input_tokens"] == 7
    blocks = [data["content_block"] for kind, data in events if kind == "content_block_start"]
    assert blocks == [
        {"type": "thinking", "thinking": "", "signature": ""}, {"type": "text", "text": ""},
        {"type": "tool_use", "id": "toolu_abc", "name": "f", "input": {}},
        {"type": "tool_use", "id": "toolu_def", "name": "g", "input": {}},
    ]
    deltas = [(data["index"], data["delta"]) for kind, data in events if kind == "content_block_delta"]
    assert deltas == [
        (0, {"type": "thinking_delta", "thinking": "think"}), (0, {"type": "thinking_delta", "thinking": " more"}),
        (1, {"type": "text_delta", "text": "Hi"}),
        (2, {"type": "input_json_delta", "partial_json": '{"a": '}),
        (2, {"type": "input_json_delta", "partial_json": "1}"}),
        (3, {"type": "input_json_delta", "partial_json": "{}"}),
    ]
    assert events[-2][1] == {"delta": {"stop_reason": "tool_use", "stop_sequence": None}, "usage": {"output_tokens": 6}}


def test_an_answer_with_no_text_still_has_one_text_block() -> None:
    builder = MessageEvents("msg_2", ["END"])
    fed = builder.feed(_chunk({"role": "assistant", "content": ""}, "stop"))
    events = _events(fed + builder.feed({"model": MODEL, "choices": [], "usage": None}) + builder.finish())
    assert [kind for kind, _ in events] == [
        "message_start", "ping", "content_block_start", "content_block_stop", "message_delta", "message_stop",
    ]


def test_an_error_after_the_first_token_ends_the_stream() -> None:
    builder = MessageEvents("msg_3", None)
    first = builder.feed(_chunk({"role": "assistant", "content": "a"}))
    error = builder.feed({"error": {"message": "gone", "type": "ServiceUnavailableError", "param": None, "code": 503}})
    assert _events(error) == [("error", {"error": {"type": "overloaded_error", "message": "gone"}})]
    assert len(first) == 4 and builder.finish() == []


def test_a_whole_answer_has_the_same_blocks() -> None:
    chat = {"model": MODEL, "usage": {"prompt_tokens": 7, "completion_tokens": 5}, "choices": [{
        "message": {"role": "assistant", "content": "Hi", "reasoning_content": "think", "tool_calls": [
            {"id": "chatcmpl-tool-abc", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        "finish_reason": "tool_calls", "stop_reason": None}]}
    message = message_object(chat, "msg_4", None)
    assert message["content"] == [
        {"type": "thinking", "thinking": "think", "signature": ""}, {"type": "text", "text": "Hi"},
        {"type": "tool_use", "id": "toolu_abc", "name": "f", "input": {"a": 1}},
    ]
    assert message["stop_reason"] == "tool_use" and message["usage"] == {"input_tokens": 7, "output_tokens": 5}


def test_stop_reasons() -> None:
    assert stop_reason("length", None, ["x"], True) == ("max_tokens", None)
    assert stop_reason("stop", "x", ["x"], False) == ("stop_sequence", "x")
    assert stop_reason("stop", "2", ["x"], False) == ("end_turn", None)  # a stop token id, not a sequence
    assert stop_reason("stop", None, None, False) == ("end_turn", None)
    assert stop_reason("tool_calls", None, None, True) == ("tool_use", None)
