"""The Anthropic Messages request bodies we accept (translate.py turns them into a chat
completion request). Unknown fields are ignored, as they are on the OpenAI routes; a
content block's fields are read according to its `type`, and a type this server cannot
serve (images, documents, server tools) is a 400 naming the block."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vllm_cluster.router.openai import field_types as ft
from vllm_cluster.router.openai.errors import ApiError, lone_surrogate


class _Model(BaseModel):
    # strict: a value of another JSON type is refused, not converted, as on the OpenAI routes.
    model_config = ConfigDict(extra="ignore", strict=True)


class _Body(_Model):
    """A whole request body: well-formed Unicode text only (a lone surrogate, which JSON's
    `\\ud800` escape decodes to, can be neither tokenized nor answered), refused naming the field."""

    @model_validator(mode="before")
    @classmethod
    def _well_formed_text(cls, data: Any) -> Any:
        found = lone_surrogate(data)
        if found is not None:
            where, text, index = found
            raise ApiError(
                400, f"{where or 'a field name'} is not valid UTF-8 text: it holds a lone surrogate "
                f"(U+{ord(text[index]):04X}) at character {index}; send well-formed Unicode", where or None,
            )
        return data


class ContentBlockParam(_Model):
    """One block of a message: `text` (text), `tool_use` (id, name, input: an assistant's
    call), `tool_result` (tool_use_id, content, is_error: the user's answer to a call),
    `thinking` / `redacted_thinking` (an earlier turn's reasoning, not shown to the model again)."""

    # The document lists the types served; another (image, document) is refused by translate.py,
    # with a message saying what to send instead.
    type: str = Field(json_schema_extra={"enum": ["text", "tool_use", "tool_result", "thinking", "redacted_thinking"]})
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[ContentBlockParam] | None = None
    is_error: bool | None = None


class MessageParam(_Model):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


def _client_tool_schema(schema: dict[str, Any]) -> None:
    """What translate.py requires of a tool, stated in the document (the server's own 400s say it
    in more words than a validation error would): a client tool, an input_schema, a name chat
    tools accept."""
    schema["required"] = ["name", "input_schema"]
    schema["properties"]["type"] = {"anyOf": [{"const": "custom", "type": "string"}, {"type": "null"}]}
    schema["properties"]["input_schema"] = {"type": "object", "additionalProperties": True}
    schema["properties"]["name"]["pattern"] = r"^[a-zA-Z0-9_.\-]{1,64}$"


class ToolParam(_Model):
    """A client tool: its `input_schema` (JSON Schema) is what the call's input must match."""

    model_config = ConfigDict(json_schema_extra=_client_tool_schema)
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # required of client tools (translate.py says so)
    type: str | None = None  # "custom" or absent; Anthropic's server tools are refused


class ToolChoiceParam(_Model):
    model_config = ConfigDict(json_schema_extra={  # type "tool" names the tool (translate.py refuses it without)
        "if": {"properties": {"type": {"const": "tool"}}, "required": ["type"]},
        "then": {"properties": {"name": {"type": "string", "minLength": 1}}, "required": ["name"]},
    })
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool": the tool to call
    disable_parallel_tool_use: bool | None = None


class ThinkingParam(_Model):
    """Any type but `disabled` turns thinking on."""

    type: Literal["enabled", "adaptive", "between_tools", "disabled"]
    budget_tokens: int | None = None  # accepted; the reasoning is bounded by max_tokens only


class OutputFormatParam(_Model):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfigParam(_Model):
    """`format`: the answer is JSON matching its schema (structured output). `effort`: no effect."""

    format: OutputFormatParam | None = None
    effort: str | None = None


class CountTokensRequest(_Body):
    """What /v1/messages/count_tokens reads: the prompt, as the chat template renders it."""

    model_config = ConfigDict(json_schema_extra={  # tool_choice any or tool needs tools to choose from
        "if": {"properties": {"tool_choice": {"type": "object", "properties": {"type": {"enum": ["any", "tool"]}},
                                              "required": ["type"]}}, "required": ["tool_choice"]},
        "then": {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]},
    })
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[ContentBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: ft.MaxTokens
    stop_sequences: list[str] | None = None
    temperature: ft.Temperature | None = None
    top_p: ft.TopP | None = None
    top_k: ft.TopK | None = None
    seed: ft.Seed | None = None  # vLLM's extra: reproducible sampling
    stream: bool = False
    output_config: OutputConfigParam | None = None
    metadata: dict[str, Any] | None = None  # Anthropic's user_id, for the caller's tracking: no effect
