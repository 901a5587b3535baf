"""A streamed Message: the chat path's SSE chunks turned into Anthropic's events.

The sequence, as Anthropic sends it: `message_start` (the Message with empty content and
the prompt's input_tokens), `ping`, then per content block `content_block_start`, its
`content_block_delta`s (text_delta, thinking_delta, input_json_delta) and
`content_block_stop`, then `message_delta` (stop_reason, stop_sequence, usage.output_tokens)
and `message_stop`. Blocks open in the order the chunks bring them (reasoning, text, each
tool call) and one is closed before the next opens; a stream without any block still has
one empty text block. A tool_use block opens with empty input, and its input follows as
partial_json pieces. An error after the first token ends the stream with an `error` event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from vllm_cluster.router.anthropic.errors import error_type
from vllm_cluster.router.anthropic.translate import stop_reason, tool_use_id


def event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class MessageEvents:
    """One streamed Message: `feed` each chat chunk, then `finish`; each answers the events to send."""

    def __init__(self, message_id: str, stop_sequences: list[str] | None) -> None:
        self._message_id = message_id
        self._stop_sequences = stop_sequences
        self._started = False
        self._num_blocks = 0
        self._open: str | None = None  # the open block: "thinking", "text", or "tool_use:<call index>"
        self._finish_reason: str | None = None
        self._matched: Any = None
        self._has_tool_use = False
        self._num_output_tokens = 0
        self.failed = False  # an error event was sent: nothing follows it

    def feed(self, chunk: dict[str, Any]) -> list[str]:
        if "error" in chunk:
            self.failed = True
            error = chunk["error"]
            return [event("error", {"error": {"type": error_type(error["code"]), "message": error["message"]}})]
        events = [] if self._started else self._start(chunk)
        if chunk.get("usage"):
            self._num_output_tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("reasoning_content"):
                events += self._delta("thinking", {"type": "thinking_delta", "thinking": delta["reasoning_content"]})
            if delta.get("content"):
                events += self._delta("text", {"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or []:
                events += self._tool_call(call)
            if choice.get("finish_reason"):
                self._finish_reason, self._matched = choice["finish_reason"], choice.get("stop_reason")
        return events

    def finish(self) -> list[str]:
        if self.failed or not self._started:
            return []
        events = [] if self._num_blocks else self._open_block("text", {"type": "text", "text": ""})
        events += self._close_block()
        reason, sequence = stop_reason(self._finish_reason, self._matched, self._stop_sequences, self._has_tool_use)
        events.append(event("message_delta", {
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"output_tokens": self._num_output_tokens},
        }))
        events.append(event("message_stop", {}))
        return events

    def _start(self, chunk: dict[str, Any]) -> list[str]:
        self._started = True
        usage = chunk.get("usage") or {}
        message = {
            "id": self._message_id, "type": "message", "role": "assistant", "model": chunk["model"], "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": 0},
        }
        return [event("message_start", {"message": message}), event("ping", {})]

    def _delta(self, kind: str, delta: dict[str, Any]) -> list[str]:
        events = []
        if self._open != kind:
            block = {"type": "text", "text": ""} if kind == "text" else {"type": kind, "thinking": "", "signature": ""}
            events = self._open_block(kind, block)
        return [*events, event("content_block_delta", {"index": self._num_blocks - 1, "delta": delta})]

    def _tool_call(self, call: dict[str, Any]) -> list[str]:
        kind = f"tool_use:{call['index']}"
        function = call.get("function") or {}
        events = []
        if self._open != kind:
            self._has_tool_use = True
            block: dict[str, Any] = {"type": "tool_use", "id": tool_use_id(call.get("id") or ""),
                                     "name": function.get("name") or "", "input": {}}
            events = self._open_block(kind, block)
        if function.get("arguments"):
            delta = {"type": "input_json_delta", "partial_json": function["arguments"]}
            events.append(event("content_block_delta", {"index": self._num_blocks - 1, "delta": delta}))
        return events

    def _open_block(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self._close_block()
        self._open = kind
        self._num_blocks += 1
        return [*events, event("content_block_start", {"index": self._num_blocks - 1, "content_block": block})]

    def _close_block(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [event("content_block_stop", {"index": self._num_blocks - 1})]


async def message_events(
    chunks: AsyncGenerator[str, None], message_id: str, stop_sequences: list[str] | None
) -> AsyncGenerator[str, None]:
    """The chat path's stream (`data: <chunk>` lines, `data: [DONE]` at the end) as events.
    Closing this closes the chat stream, and with it the Generate calls."""
    builder = MessageEvents(message_id, stop_sequences)
    async with aclosing(chunks):
        async for line in chunks:
            data = line.removeprefix("data: ").strip()
            if data == "[DONE]" or builder.failed:
                continue
            for out in builder.feed(json.loads(data)):
                yield out
    for out in builder.finish():
        yield out
