"""Tool calling in a chat request: `tools` and `tool_choice` checked, the tools as the chat
template reads them, the structured-output constraint that enforces `required` and a named
function, and the chat's tool messages as the template reads them.

tool_choice, as in vLLM:
- `none`: the tools are not offered to the model and its output is not parsed.
- `auto` (the default when tools are sent): the model decides; the server's tool-call parser
  (`router.tool_call_parser`, tool_parsers.py) takes the calls out of its text. Needs
  `router.enable_auto_tool_choice`.
- `required`: the output is constrained to a JSON array of `{"name", "parameters"}`
  objects, one of the tools each (one only with `parallel_tool_calls: false`).
- a named function: the output is constrained to that function's parameters.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from vllm_cluster.engine.errors import InvalidRequestError
from vllm_cluster.engine.structured_output_params import StructuredOutputsParams
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.router.openai.errors import bad_request
from vllm_cluster.router.openai.tool_parsers import (
    NamedToolParser,
    RequiredToolParser,
    ToolParser,
    tool_parser,
)

_NAME = re.compile(r"[a-zA-Z0-9_.\-]{1,64}")
_ANY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}
AUTO_NOT_ENABLED = (
    '"auto" tool choice requires router.enable_auto_tool_choice: true and router.tool_call_parser '
    "(hermes or llama3_json) in the cluster config; or send tool_choice \"required\", a named function, or \"none\""
)


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """A request's tools and what it asks of them. `name`: the named function's."""

    mode: Literal["none", "auto", "required", "named"]
    tools: tuple[dict[str, Any], ...] = ()  # {"type": "function", "function": {name, description, parameters}}
    name: str = ""
    parallel: bool = True  # more than one call allowed
    param: str = "tool_choice"  # the field a refusal names: "tools" when auto is only the default

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template gets as `tools` (none with tool_choice none)."""
        return None if self.mode == "none" else list(self.tools)

    def constraint(self) -> pb.StructuredOutputs | None:
        """The structured output that enforces `required` or a named function."""
        if self.mode == "required":
            schema = required_schema(list(self.tools), self.parallel)
        elif self.mode == "named":
            schema = named_schema(list(self.tools), self.name)
        else:
            return None
        try:
            StructuredOutputsParams(json=schema)
        except InvalidRequestError as e:
            raise bad_request(f"tools: a function's parameters are not a JSON schema this server can enforce: {e}",
                              "tools") from None
        return pb.StructuredOutputs(json=json.dumps(schema, ensure_ascii=False))

    def parser(self, server_parser: str, auto_enabled: bool) -> ToolParser | None:
        """What takes the calls out of the output; a 400 when `auto` is not enabled here."""
        if self.mode == "required":
            return RequiredToolParser()
        if self.mode == "named":
            return NamedToolParser(self.name)
        if self.mode == "auto":
            if not (auto_enabled and server_parser):
                raise bad_request(AUTO_NOT_ENABLED, self.param)
            return tool_parser(server_parser)
        return None


def tool_choice(tools: list[dict[str, Any]] | None, choice: Any, parallel_tool_calls: bool | None) -> ToolChoice:
    """The request's tools and tool_choice, checked: a 400 naming the field."""
    if not tools:
        if choice in (None, "none", "auto"):
            return ToolChoice("none")
        raise bad_request("tool_choice needs tools: send the functions the model may call in tools", "tool_choice")
    checked = tuple(_checked_tool(t, i) for i, t in enumerate(tools))
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise bad_request(f"tools: function names must be unique, got {names}", "tools")
    parallel = parallel_tool_calls is not False
    if choice is None or choice in ("none", "auto", "required"):
        return ToolChoice(choice or "auto", checked, parallel=parallel, param="tool_choice" if choice else "tools")
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad_request('tool_choice must be "none", "auto", "required" or '
                          '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice names {name!r}, which is not among tools ({', '.join(names)})", "tool_choice")
    return ToolChoice("named", checked, name, parallel)


def _checked_tool(tool: Any, index: int) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise bad_request(f'{where}: only function tools are supported: {{"type": "function", "function": {{...}}}}',
                          "tools")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"{where}.function must be an object with a name", "tools")
    if not _NAME.fullmatch(function["name"]):
        raise bad_request(f"{where}.function.name {function['name']!r}: use 1 to 64 letters, digits, _ . or -",
                          "tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON schema object", "tools")
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def required_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """vLLM's schema for tool_choice required: an array of calls, each one of the tools."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": t["function"].get("parameters") or _ANY_OBJECT,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The named function's arguments: its parameters schema."""
    function = next(t["function"] for t in tools if t["function"]["name"] == name)
    parameters: dict[str, Any] = function.get("parameters") or _ANY_OBJECT
    return parameters


def template_tool_calls(tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's tool_calls as chat templates read them: `function.arguments`
    as an object (Qwen's and Hermes' templates write it with `tojson`), as vLLM gives them."""
    calls = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request("messages: each tool_calls entry needs function.name and function.arguments", "messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError:
                raise bad_request(f"messages: the arguments of tool call {function['name']!r} are not JSON",
                                  "messages") from None
        calls.append({"id": call.get("id", ""), "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return calls


def from_responses_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The Responses API's function tools (`{"type": "function", "name", "parameters"}`) as
    chat tools; other kinds pass unchanged, to be refused by name."""
    if tools is None:
        return None
    converted = []
    for tool in tools:
        if isinstance(tool, dict) and tool.get("type") == "function" and "function" not in tool:
            function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
            tool = {"type": "function", "function": function}
        converted.append(tool)
    return converted


def from_responses_tool_choice(choice: Any) -> Any:
    """The Responses API's `{"type": "function", "name": ...}` as chat's tool_choice."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice
