"""One chat choice's text as OpenAI's message and streamed deltas: the reasoning parser
splits off `reasoning_content`, then the tool parser takes the calls out of the content.

Tool calls take vLLM's shapes: whole, `message.tool_calls` entries `{"id", "type":
"function", "function": {"name", "arguments"}}` (arguments JSON text); streamed, a call's
first delta carries its index, id, type and name with the arguments so far, later deltas
its index and more arguments. A choice that made calls and stopped on its own finishes with
"tool_calls"; its content is null unless the model also wrote text.
"""

from __future__ import annotations

from typing import Any

from vllm_cluster.router.openai.reasoning import ReasoningSplitter
from vllm_cluster.router.openai.tool_parsers import ToolCall, ToolCallDelta, ToolCallStream, ToolParser


class ChatOutput:
    """One choice: `delta` per streamed piece, or `message` for the whole text."""

    def __init__(self, reasoning_parser: str, tools: ToolParser | None, parallel_tool_calls: bool = True) -> None:
        self._reasoning_parser = reasoning_parser
        self._tools = tools
        self._splitter = ReasoningSplitter(reasoning_parser) if reasoning_parser else None
        self._stream: ToolCallStream | None = tools.stream() if tools is not None else None
        self._max_calls = None if parallel_tool_calls else 1  # without parallel calls, the first is kept
        self.made_calls = False

    @property
    def has_tools(self) -> bool:
        return self._tools is not None

    @property
    def has_reasoning(self) -> bool:
        return self._splitter is not None

    def message(self, text: str) -> dict[str, Any]:
        reasoning, content = self._split(text, last=True)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self._splitter is not None:
            message["reasoning_content"] = reasoning or None
        if self._tools is not None:
            content, calls = self._tools.parse(content)
            calls = calls[: self._max_calls]
            self.made_calls = bool(calls)
            message["content"] = content or None if calls else content
            message["tool_calls"] = [tool_call_dict(c) for c in calls]
        return message

    def delta(self, text: str, last: bool) -> dict[str, Any]:
        reasoning, content = self._split(text, last)
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        calls: list[ToolCallDelta] = []
        if self._stream is not None:
            content, calls = self._stream.feed(content)
            if last:
                more_content, more_calls = self._stream.finish()
                content, calls = content + more_content, calls + more_calls
            calls = [c for c in calls if self._max_calls is None or c.index < self._max_calls]
            self.made_calls = self.made_calls or bool(calls)
        if content or not (reasoning or calls):
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [tool_call_delta_dict(c) for c in calls]
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.made_calls and reason == "stop" else reason

    def _split(self, text: str, last: bool) -> tuple[str, str]:
        """(reasoning, content) of a piece; the splitter's held-back tail goes with the last."""
        if self._splitter is None:
            return "", text
        reasoning, content = self._splitter.feed(text)
        if last:
            more_reasoning, more_content = self._splitter.flush()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content


def tool_call_dict(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_delta_dict(delta: ToolCallDelta) -> dict[str, Any]:
    if delta.id is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    return {"index": delta.index, "id": delta.id, "type": "function",
            "function": {"name": delta.name, "arguments": delta.arguments}}

