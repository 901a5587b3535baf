"""The tool-call parsers: whole texts, and the same texts streamed in pieces split at every
point, give the same content and the same calls."""

from __future__ import annotations

import json

import pytest

from vllm_cluster.router.openai.chat_output import ChatOutput
from vllm_cluster.router.openai.tool_parsers import (
    TOOL_CALL_PARSERS,
    NamedToolParser,
    RequiredToolParser,
    ToolCall,
    ToolParser,
    merge,
    tool_parser,
)
from vllm_cluster.worker.router_config import TOOL_CALL_PARSERS as CONFIG_PARSERS

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
HERMES = f"Let me look.\n\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n" + \
    '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'


def calls_of(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(parser: ToolParser, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    stream = parser.stream()
    results = [stream.feed(p) for p in pieces] + [stream.finish()]
    return "".join(content for content, _ in results), merge([d for _, deltas in results for d in deltas])


def assert_every_split_agrees(parser: ToolParser, text: str) -> tuple[str, list[ToolCall]]:
    content, calls = parser.parse(text)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 7):  # three pieces: every first split, a spread of second ones
            got_content, got_calls = streamed(parser, [text[:i], text[i:j], text[j:]])
            assert (got_content, calls_of(got_calls)) == (content, calls_of(calls)), (i, j)
    one_char_each = streamed(parser, list(text))
    assert (one_char_each[0], calls_of(one_char_each[1])) == (content, calls_of(calls))
    return content, calls


def test_the_config_and_the_parsers_name_the_same_formats() -> None:
    assert CONFIG_PARSERS == TOOL_CALL_PARSERS
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        tool_parser("mistral")


def test_hermes_takes_calls_out_of_the_text() -> None:
    content, calls = assert_every_split_agrees(tool_parser("hermes"), HERMES)
    assert content == "Let me look."
    assert calls_of(calls) == [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
    assert all(c.id.startswith("chatcmpl-tool-") and len(c.id) == len("chatcmpl-tool-") + 32 for c in calls)
    assert len({c.id for c in calls}) == 2
    assert calls[0].arguments == '{"city": "Paris", "unit": "celsius"}'  # JSON text, as OpenAI sends it


def test_hermes_leaves_malformed_calls_and_plain_text_as_content() -> None:
    parser = tool_parser("hermes")
    malformed = 'Before <tool_call>{"name": "f", "arguments": {"x": 1}</tool_call> after'  # one brace short
    assert assert_every_split_agrees(parser, malformed) == (malformed, [])
    not_a_call = '<tool_call>{"arguments": {}}</tool_call>'  # no name
    assert assert_every_split_agrees(parser, not_a_call) == (not_a_call, [])
    plain = "  Paris is the capital of France. <tool "
    assert assert_every_split_agrees(parser, plain) == (plain, [])
    mixed = f"<tool_call>{WEATHER}</tool_call>\n<tool_call>oops</tool_call>"
    content, calls = assert_every_split_agrees(parser, mixed)
    assert content == "<tool_call>oops</tool_call>" and calls_of(calls)[0][0] == "get_weather"


def test_hermes_text_between_calls_stays_and_an_unclosed_last_call_counts() -> None:
    parser = tool_parser("hermes")
    content, calls = assert_every_split_agrees(parser, f"A\n<tool_call>{WEATHER}</tool_call>\nB <tool_call>{WEATHER}")
    assert content == "A\n\nB" and len(calls) == 2
    arguments_as_string = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert calls_of(parser.parse(arguments_as_string)[1]) == [("f", {"x": 1})]


def test_llama3_json_takes_calls_separated_by_semicolons() -> None:
    parser = tool_parser("llama3_json")
    content, calls = assert_every_split_agrees(parser, LLAMA)
    assert content == "" and calls_of(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    bare = '  {"name": "get_weather", "arguments": {"city": "Rome"}}'
    assert calls_of(assert_every_split_agrees(parser, bare)[1]) == [("get_weather", {"city": "Rome"})]


def test_llama3_json_text_is_content_and_a_cut_call_too() -> None:
    parser = tool_parser("llama3_json")
    text = 'The answer is {"name": "x"}.'
    assert assert_every_split_agrees(parser, text) == (text, [])
    content, calls = assert_every_split_agrees(parser, '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "par')
    assert content == '{"name": "b", "par' and calls_of(calls) == [("a", {"x": 1})]
    content, calls = assert_every_split_agrees(parser, '{"name": "a", "parameters": {}}; {"city": "Paris"}')
    assert content == '{"city": "Paris"}' and calls_of(calls) == [("a", {})]


def test_required_and_named_read_what_structured_output_forces() -> None:
    array = '[{"name": "get_weather", "parameters": {"city": "Paris"}},{"name": "get_time", "parameters": {}}]'
    content, calls = assert_every_split_agrees(RequiredToolParser(), array)
    assert content == "" and calls_of(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    cut = '[{"name": "get_weather", "parameters": {"city": "Paris"}},{"name": "get_t'
    content, calls = assert_every_split_agrees(RequiredToolParser(), cut)
    assert content == '{"name": "get_t' and len(calls) == 1
    arguments = '{"city": "Paris", "unit": "celsius"}'
    content, calls = assert_every_split_agrees(NamedToolParser("get_weather"), arguments)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", arguments)]


def test_streamed_deltas_carry_id_and_name_first_then_arguments() -> None:
    stream = NamedToolParser("f").stream()
    first, later = stream.feed('{"x": '), stream.feed("1}")
    assert first[1][0].id is not None and first[1][0].name == "f" and first[1][0].arguments == '{"x": '
    assert later[1][0].id is None and later[1][0].name is None and later[1][0].arguments == "1}"
    assert stream.finish() == ("", [])
    empty = NamedToolParser("f").stream()
    (_, [only]) = empty.finish()
    assert only.name == "f" and only.arguments == ""


def test_chat_output_shapes_whole_and_streamed_alike() -> None:
    text = "<think>The user wants weather.</think>" + HERMES
    whole = ChatOutput("qwen3", tool_parser("hermes"))
    message = whole.message(text)
    assert message["reasoning_content"] == "The user wants weather." and message["content"] == "Let me look."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    assert message["tool_calls"][0]["type"] == "function" and whole.finish_reason("stop") == "tool_calls"
    assert whole.finish_reason("length") == "length"
    streamed = ChatOutput("qwen3", tool_parser("hermes"))
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    deltas = [streamed.delta(p, last=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert all(set(c) == {"index", "id", "type", "function"} for c in calls)  # parsed calls come whole
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    single = ChatOutput("", tool_parser("hermes"), parallel_tool_calls=False).message(HERMES)
    assert [c["function"]["name"] for c in single["tool_calls"]] == ["get_weather"]
    plain = ChatOutput("", tool_parser("hermes"))
    assert plain.message("Paris.") == {"role": "assistant", "content": "Paris.", "tool_calls": []}
    assert plain.finish_reason("stop") == "stop"
    assert ChatOutput("", None).message("Paris.") == {"role": "assistant", "content": "Paris."}


def test_named_arguments_stream_in_pieces_after_a_first_delta_with_the_name() -> None:
    output = ChatOutput("", NamedToolParser("get_weather"))
    first, second = output.delta('{"city": ', last=False), output.delta('"Paris"}', last=True)
    (head,) = first["tool_calls"]
    assert head["index"] == 0 and head["id"].startswith("chatcmpl-tool-") and head["type"] == "function"
    assert head["function"] == {"name": "get_weather", "arguments": '{"city": '}
    assert second["tool_calls"] == [{"index": 0, "function": {"arguments": "\"Paris\"}"}}]
    assert "content" not in first and output.finish_reason("stop") == "tool_calls"
