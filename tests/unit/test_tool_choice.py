"""tools and tool_choice checked, the schemas that enforce `required` and a named function,
tool messages as chat templates read them (HTTP and gRPC alike), and the config keys."""

from __future__ import annotations

import json

import jsonschema
import pytest

from vllm_cluster.engine.errors import ConfigError, InvalidRequestError
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.router.openai.errors import ApiError
from vllm_cluster.router.openai.protocol import ChatCompletionRequest, ResponsesRequest
from vllm_cluster.router.openai.tool_parsers import NamedToolParser, RequiredToolParser
from vllm_cluster.router.openai.tools import named_schema, required_schema, tool_choice
from vllm_cluster.router.prompts import template_message
from vllm_cluster.worker.router_config import RouterConfig

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: any object
]
CALL = {"id": "chatcmpl-tool-1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}


def refusal(**fields: object) -> ApiError:
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], **fields)  # type: ignore[arg-type]
    with pytest.raises(ApiError) as e:
        body.to_sampling_params()
        body.tool_use().parser("", False)
    return e.value


def test_tool_choice_modes_and_their_defaults() -> None:
    assert tool_choice(None, None, None).mode == "none"
    assert tool_choice(TOOLS, None, None).mode == "auto"
    assert tool_choice(TOOLS, "none", None).template_tools is None
    assert tool_choice(TOOLS, "required", None).template_tools == TOOLS
    named = tool_choice(TOOLS, {"type": "function", "function": {"name": "ping"}}, False)
    assert (named.mode, named.name, named.parallel) == ("named", "ping", False)
    assert isinstance(named.parser("", False), NamedToolParser)
    assert isinstance(tool_choice(TOOLS, "required", None).parser("", False), RequiredToolParser)


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tools": TOOLS}, "tools", "router.enable_auto_tool_choice"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "router.tool_call_parser"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice", "not among"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", '"required"'),
        ({"tools": [{"type": "code_interpreter"}]}, "tools", "only function tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "letters, digits"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "unique"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "only one"),
    ],
)
def test_bad_tools_are_a_400_that_says_what_to_do(fields: dict, param: str, words: str) -> None:
    e = refusal(**fields)
    assert e.status == 400 and e.param == param and words in e.message


def test_required_and_named_schemas_admit_exactly_the_calls() -> None:
    schema = required_schema(TOOLS)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "ping", "parameters": {}}],
                        schema)
    for wrong in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    single = required_schema(TOOLS, parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "ping", "parameters": {}}] * 2, single)
    assert named_schema(TOOLS, "get_weather") == CITY
    params = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], tools=TOOLS,
                                   tool_choice="required").to_sampling_params()
    assert json.loads(params.structured_outputs.json) == required_schema(TOOLS)


def test_tool_messages_reach_the_template_with_arguments_as_objects() -> None:
    body = ChatCompletionRequest(messages=[
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "18 degrees", "tool_call_id": "chatcmpl-tool-1"},
    ])
    over_http = body.chat()
    assert over_http[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    assert over_http[1] == {"role": "tool", "content": "18 degrees", "tool_call_id": "chatcmpl-tool-1"}
    over_grpc = [
        template_message(pb.ChatMessage(role="assistant", tool_calls_json=json.dumps([CALL]))),
        template_message(pb.ChatMessage(role="tool", content="18 degrees", tool_call_id="chatcmpl-tool-1")),
    ]
    assert over_grpc == over_http
    with pytest.raises(InvalidRequestError, match="arguments is not JSON"):
        template_message(pb.ChatMessage(role="assistant", tool_calls_json=json.dumps(
            [{"function": {"name": "f", "arguments": "{"}}])))


def test_responses_tools_and_items_become_the_chat_request() -> None:
    body = ResponsesRequest(
        input=[
            {"role": "user", "content": "Weather in Rome?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "18 degrees"},
        ],
        tools=[{"type": "function", "name": "get_weather", "parameters": CITY}],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    chat = body.to_chat_request()
    assert chat.tools == [TOOLS[0]]
    assert chat.tool_use().name == "get_weather"
    messages = chat.chat()
    assert messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Rome"}}
    assert messages[2] == {"role": "tool", "content": "18 degrees", "tool_call_id": "c1"}


def test_the_config_keys_are_checked_with_what_to_set() -> None:
    config = RouterConfig.from_dict({"tool_call_parser": "llama3_json", "enable_auto_tool_choice": True})
    assert (config.tool_call_parser, config.enable_auto_tool_choice) == ("llama3_json", True)
    with pytest.raises(ConfigError, match="give hermes or llama3_json"):
        RouterConfig.from_dict({"tool_call_parser": "mistral"})
    with pytest.raises(ConfigError, match="enable_auto_tool_choice needs router.tool_call_parser"):
        RouterConfig.from_dict({"enable_auto_tool_choice": True})
