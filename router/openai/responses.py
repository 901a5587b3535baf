"""The Responses API's shapes (/v1/responses): the response object, its output items (a
`reasoning` item when the reasoning parser found any, a message, and a `function_call` per
tool call), and the typed server-sent events a streamed response is made of, from a job's
one choice.

Streamed, a request with neither tools nor a reasoning parser opens its message item at
once; otherwise each item opens when its first piece arrives (reasoning: its reasoning item,
whose text follows as `response.reasoning_text.delta` events; text: the message; a call: its
function_call item, whose arguments follow as `response.function_call_arguments.delta`
events), and all close at the end, in the order they opened. The final response holds the
same items. `usage.output_tokens_details.reasoning_tokens` counts the reasoning text's tokens."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from vllm_cluster.router.openai.backend import Piece
from vllm_cluster.router.openai.chat_output import ChatOutput
from vllm_cluster.router.openai.protocol import ResponsesRequest

if TYPE_CHECKING:
    from vllm_cluster.router.openai.serving import _Job as Job


def response_object(job: Job, body: ResponsesRequest, status: str, items: list[dict[str, Any]] | None = None,
                    reasoning_tokens: int = 0) -> dict[str, Any]:
    c = job.choices[0]
    if status != "in_progress" and c.finish_reason == "length":
        status = "incomplete"
    usage = None
    if c.usage is not None:
        usage = {
            "input_tokens": c.usage.prompt_tokens, "input_tokens_details": {"cached_tokens": c.usage.cached_tokens},
            "output_tokens": c.usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": c.usage.prompt_tokens + c.usage.completion_tokens,
        }
    return {
        "id": job.id, "object": "response", "created_at": job.created, "status": status, "model": job.model,
        "output": items or [], "usage": usage, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p,
        "parallel_tool_calls": bool(body.tools) and body.parallel_tool_calls is not False,
        "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "metadata": {},
        "text": body.text if body.text and body.text.get("format") else {"format": {"type": "text"}},
    }


def output_items(job: Job, message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat message (chat_output.ChatOutput.message) as output items."""
    calls = message.get("tool_calls") or []
    items = [reasoning_item(job, message["reasoning_content"], "completed")] if message.get("reasoning_content") else []
    if message["content"] or not calls:
        items.append(response_message(job, message["content"] or "", "completed"))
    items += [function_call_item(c["id"], c["function"]["name"], c["function"]["arguments"], "completed")
              for c in calls]
    return items


def response_message(job: Job, text: str, status: str) -> dict[str, Any]:
    content = (
        [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    )
    return {"id": f"msg_{job.id[5:]}", "type": "message", "role": "assistant", "status": status, "content": content}


def reasoning_item(job: Job, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"id": f"rs_{job.id[5:]}", "type": "reasoning", "summary": [], "content": content, "status": status}


def function_call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": f"fc_{call_id.removeprefix('chatcmpl-tool-')}", "type": "function_call", "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


class _Events:
    """The numbered events of one streamed response, and the items it has opened."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.message_index: int | None = None
        self.text = ""
        self.reasoning_index: int | None = None
        self.reasoning = ""
        self.call_indexes: dict[int, int] = {}  # a call's index -> its item's output index

    def event(self, kind: str, **data: Any) -> str:
        self.seq += 1
        payload = json.dumps({"type": kind, "sequence_number": self.seq - 1, **data}, ensure_ascii=False)
        return f"event: {kind}\ndata: {payload}\n\n"

    def where(self) -> dict[str, Any]:
        return {"item_id": f"msg_{self.job.id[5:]}", "output_index": self.message_index, "content_index": 0}

    def open_message(self) -> list[str]:
        self.message_index = len(self.items)
        self.items.append(response_message(self.job, "", "in_progress"))
        return [self.event("response.output_item.added", output_index=self.message_index, item=self.items[-1]),
                self.event("response.content_part.added", **self.where(),
                           part={"type": "output_text", "text": "", "annotations": []})]

    def delta(self, delta: dict[str, Any]) -> list[str]:
        events = []
        if delta.get("reasoning_content"):
            if self.reasoning_index is None:
                self.reasoning_index = len(self.items)
                self.items.append(reasoning_item(self.job, "", "in_progress"))
                events.append(self.event("response.output_item.added", output_index=self.reasoning_index,
                                         item=dict(self.items[-1])))
            self.reasoning += delta["reasoning_content"]
            events.append(self.event("response.reasoning_text.delta", item_id=self.items[self.reasoning_index]["id"],
                                     output_index=self.reasoning_index, content_index=0,
                                     delta=delta["reasoning_content"]))
        if delta.get("content"):
            if self.message_index is None:
                events += self.open_message()
            self.text += delta["content"]
            events.append(self.event("response.output_text.delta", **self.where(), delta=delta["content"], logprobs=[]))
        for call in delta.get("tool_calls", []):
            if "id" in call:
                self.call_indexes[call["index"]] = len(self.items)
                self.items.append(function_call_item(call["id"], call["function"]["name"], "", "in_progress"))
                events.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                         item=dict(self.items[-1])))
            k, arguments = self.call_indexes[call["index"]], call["function"]["arguments"]
            if arguments:
                self.items[k]["arguments"] += arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=self.items[k]["id"],
                                         output_index=k, delta=arguments))
        return events

    def close(self) -> list[str]:
        events = []
        for k, item in enumerate(self.items):
            if item["type"] == "message":
                part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
                events += [self.event("response.output_text.done", **self.where(), text=self.text, logprobs=[]),
                           self.event("response.content_part.done", **self.where(), part=part)]
                self.items[k] = response_message(self.job, self.text, "completed")
            elif item["type"] == "reasoning":
                events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=k,
                                         content_index=0, text=self.reasoning))
                self.items[k] = reasoning_item(self.job, self.reasoning, "completed")
            else:
                events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                         output_index=k, arguments=item["arguments"]))
                item["status"] = "completed"
            events.append(self.event("response.output_item.done", output_index=k, item=self.items[k]))
        return events


async def response_events(
    job: Job, body: ResponsesRequest, pieces: AsyncGenerator[Piece, None], output: ChatOutput,
    count_tokens: Callable[[str], int],
) -> AsyncGenerator[str, None]:
    events = _Events(job)
    yield events.event("response.created", response=response_object(job, body, "in_progress"))
    yield events.event("response.in_progress", response=response_object(job, body, "in_progress"))
    if not output.has_tools and not output.has_reasoning:
        for e in events.open_message():
            yield e
    async with aclosing(pieces):
        async for piece in pieces:
            for e in events.delta(output.delta(piece.response.text, bool(piece.response.finish_reason))):
                yield e
    if not events.items:
        for e in events.open_message():
            yield e
    for e in events.close():
        yield e
    yield events.event("response.completed", response=response_object(job, body, "completed", events.items,
                                                                       count_tokens(events.reasoning)))
