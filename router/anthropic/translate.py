"""Anthropic Messages <-> OpenAI chat completions: a Messages request becomes a
ChatCompletionRequest (so sampling, queueing and errors are the chat path's), and a chat
completion becomes a Message.

Requests: `system` is the first (system) message; a message's text blocks are its content;
an assistant's tool_use blocks are its tool_calls, a user's tool_result blocks are tool
messages; earlier thinking blocks are dropped (chat templates drop earlier reasoning too);
tools are function tools (input_schema -> parameters), tool_choice any -> required and
tool -> the named function; `stop_sequences` is `stop`; `thinking` sets the chat template's
`enable_thinking`; `output_config.format` (a JSON schema) is a json_schema response_format.
Results: reasoning_content is a thinking block, content a text block, each tool call a
tool_use block; the finish reason becomes `stop_reason`: length -> max_tokens, tool calls
-> tool_use, a matched stop sequence -> stop_sequence (named in `stop_sequence`), anything
else -> end_turn.
"""

from __future__ import annotations

import json
from typing import Any

from vllm_cluster.router.anthropic.protocol import ContentBlockParam, CountTokensRequest, MessagesRequest
from vllm_cluster.router.openai.errors import bad_request
from vllm_cluster.router.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    FunctionCall,
    StreamOptions,
    ToolCall,
)

_DROPPED_BLOCKS = ("thinking", "redacted_thinking")


def chat_request(body: MessagesRequest, reasoning: bool) -> ChatCompletionRequest:
    """`reasoning`: the server splits reasoning out (router.reasoning_parser is set)."""
    tools, tool_choice, parallel_tool_calls = chat_tools(body)
    return ChatCompletionRequest(
        model=body.model, messages=chat_messages(body), max_tokens=body.max_tokens,
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed, stop=body.stop_sequences,
        stream=body.stream,
        # Every chunk carries usage: message_start reports input_tokens before the end.
        stream_options=StreamOptions(include_usage=True, continuous_usage_stats=True) if body.stream else None,
        tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
        chat_template_kwargs=template_kwargs(body, reasoning), response_format=_response_format(body),
    )


def prompt_request(body: CountTokensRequest, reasoning: bool) -> ChatCompletionRequest:
    """What count_tokens renders: the messages, tools and template variables, no sampling."""
    tools, tool_choice, parallel_tool_calls = chat_tools(body)
    return ChatCompletionRequest(
        model=body.model, messages=chat_messages(body), tools=tools, tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls, chat_template_kwargs=template_kwargs(body, reasoning),
    )


def chat_messages(body: CountTokensRequest) -> list[ChatMessage]:
    messages = []
    if body.system is not None:
        system = body.system if isinstance(body.system, str) else _text(body.system, "system")
        messages.append(ChatMessage(role="system", content=system))
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            messages.append(ChatMessage(role=message.role, content=message.content))
        elif message.role == "assistant":
            messages.append(_assistant_message(message.content, f"messages.{i}.content"))
        else:
            messages += _user_messages(message.content, f"messages.{i}.content")
    return messages


def chat_tools(body: CountTokensRequest) -> tuple[list[dict[str, Any]] | None, Any, bool | None]:
    """(tools, tool_choice, parallel_tool_calls) as a chat request has them: each tool a
    function whose parameters are its input_schema; tool_choice any -> required, tool -> the
    named function."""
    tools = None
    if body.tools is not None:
        tools = []
        for i, tool in enumerate(body.tools):
            if tool.type not in (None, "custom"):
                raise bad_request(f"tools.{i}: tools of type {tool.type!r} (Anthropic's server tools) are not "
                                  "supported: send client tools, {name, description, input_schema}", f"tools.{i}.type")
            if tool.input_schema is None:
                raise bad_request(f"tools.{i}.input_schema: Field required", f"tools.{i}.input_schema")
            function = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
            tools.append({"type": "function", "function": function})
    choice = body.tool_choice
    if choice is None:
        return tools, None, None
    parallel = None if choice.disable_parallel_tool_use is None else not choice.disable_parallel_tool_use
    if choice.type == "any":
        return tools, "required", parallel
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice of type tool needs the name of the tool to call", "tool_choice.name")
        return tools, {"type": "function", "function": {"name": choice.name}}, parallel
    return tools, choice.type, parallel


def template_kwargs(body: CountTokensRequest, reasoning: bool) -> dict[str, Any] | None:
    if body.thinking is None:
        return None
    thinking = body.thinking.type != "disabled"
    if thinking and not reasoning:
        raise bad_request("thinking needs a reasoning model: this server splits out no reasoning "
                          "(router.reasoning_parser is not set); drop thinking", "thinking")
    return {"enable_thinking": thinking}


def _response_format(body: MessagesRequest) -> dict[str, Any] | None:
    output_format = body.output_config.format if body.output_config is not None else None
    if output_format is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": output_format.json_schema}}


def _assistant_message(blocks: list[ContentBlockParam], where: str) -> ChatMessage:
    """Text blocks are the content, tool_use blocks the tool calls."""
    parts, calls = [], []
    for j, block in enumerate(blocks):
        if block.type == "tool_use":
            if block.id is None or block.name is None:
                raise bad_request(f"{where}.{j}: a tool_use block needs `id`, `name` and `input`", f"{where}.{j}")
            arguments = json.dumps(block.input or {}, ensure_ascii=False)
            calls.append(ToolCall(id=block.id, function=FunctionCall(name=block.name, arguments=arguments)))
        elif block.type not in _DROPPED_BLOCKS:
            parts.append(ContentPart(type="text", text=_block_text(block, f"{where}.{j}")))
    return ChatMessage(role="assistant", content=parts, tool_calls=calls or None)


def _user_messages(blocks: list[ContentBlockParam], where: str) -> list[ChatMessage]:
    """Each tool_result block is a tool message (ahead of the user's text, as chat has them
    follow the assistant's calls), the text blocks one user message."""
    results, parts = [], []
    for j, block in enumerate(blocks):
        if block.type == "tool_result":
            if block.tool_use_id is None:
                raise bad_request(f"{where}.{j}: a tool_result block needs `tool_use_id`", f"{where}.{j}")
            content = block.content if isinstance(block.content, str) else _text(block.content or [], f"{where}.{j}")
            if block.is_error:
                content = f"Error: {content}"
            results.append(ChatMessage(role="tool", content=content, tool_call_id=block.tool_use_id))
        else:
            parts.append(ContentPart(type="text", text=_block_text(block, f"{where}.{j}")))
    return [*results, ChatMessage(role="user", content=parts)] if parts or not results else results


def _text(blocks: list[ContentBlockParam], where: str) -> str:
    return "".join(_block_text(block, f"{where}.{j}") for j, block in enumerate(blocks))


def _block_text(block: ContentBlockParam, where: str) -> str:
    if block.type != "text":
        what = "this model reads text only" if block.type in ("image", "document") else "send text blocks"
        raise bad_request(f"{where}: content blocks of type {block.type!r} are not supported here: {what}", where)
    if block.text is None:
        raise bad_request(f"{where}: a text block needs `text`", f"{where}.text")
    return block.text


# ---- results


def message_object(chat: dict[str, Any], message_id: str, stop_sequences: list[str] | None) -> dict[str, Any]:
    """A whole chat completion (one choice) as a Message."""
    choice = chat["choices"][0]
    reply = choice["message"]
    content: list[dict[str, Any]] = []
    if reply.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": reply["reasoning_content"], "signature": ""})
    if reply.get("content"):
        content.append({"type": "text", "text": reply["content"]})
    for call in reply.get("tool_calls") or []:
        function = call["function"]
        content.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": function["name"],
                        "input": tool_input(function["arguments"])})
    if not content:
        content.append({"type": "text", "text": ""})
    has_tool_use = any(block["type"] == "tool_use" for block in content)
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"), stop_sequences, has_tool_use)
    usage = chat["usage"]
    return {
        "id": message_id, "type": "message", "role": "assistant", "model": chat["model"], "content": content,
        "stop_reason": reason, "stop_sequence": sequence,
        "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]},
    }


def stop_reason(
    finish_reason: str | None, matched: Any, stop_sequences: list[str] | None, has_tool_use: bool
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a chat choice's finish_reason and vLLM's stop_reason
    (the stop string or token id it matched)."""
    if finish_reason == "length":
        return "max_tokens", None
    if has_tool_use or finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(matched, str) and matched in (stop_sequences or []):
        return "stop_sequence", matched
    return "end_turn", None


def tool_use_id(call_id: str) -> str:
    """Anthropic's `toolu_` id for a chat tool call's id."""
    return call_id if call_id.startswith("toolu_") else "toolu_" + call_id.rsplit("-", 1)[-1]


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments (JSON text) as the tool_use input object; {} when they are not one
    (a call cut off by max_tokens)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
