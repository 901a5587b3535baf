"""The Responses API's shapes (/v1/responses): the response object, its message item, and
the typed server-sent events a streamed response is made of, from a job's one choice."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from vllm_cluster.router.openai.backend import Piece
from vllm_cluster.router.openai.protocol import ResponsesRequest

if TYPE_CHECKING:
    from vllm_cluster.router.openai.serving import _Job as Job


def response_object(job: Job, body: ResponsesRequest, status: str) -> dict[str, Any]:
    c = job.choices[0]
    output = []
    if status != "in_progress":
        output = [response_message(job, c.text, "completed")]
        if c.finish_reason == "length":
            status = "incomplete"
    usage = None
    if c.usage is not None:
        usage = {
            "input_tokens": c.usage.prompt_tokens, "input_tokens_details": {"cached_tokens": c.usage.cached_tokens},
            "output_tokens": c.usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": c.usage.prompt_tokens + c.usage.completion_tokens,
        }
    return {
        "id": job.id, "object": "response", "created_at": job.created, "status": status, "model": job.model,
        "output": output, "usage": usage, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "parallel_tool_calls": False,
        "tool_choice": "auto", "tools": [], "metadata": {}, "text": {"format": {"type": "text"}},
    }

def response_message(job: Job, text: str, status: str) -> dict[str, Any]:
    content = (
        [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    )
    return {"id": f"msg_{job.id[5:]}", "type": "message", "role": "assistant", "status": status, "content": content}

async def response_events(
    job: Job, body: ResponsesRequest, pieces: AsyncGenerator[Piece, None]
) -> AsyncGenerator[str, None]:
    seq = 0

    def event(kind: str, **data: Any) -> str:
        nonlocal seq
        seq += 1
        payload = json.dumps({"type": kind, "sequence_number": seq - 1, **data}, ensure_ascii=False)
        return f"event: {kind}\ndata: {payload}\n\n"

    item_id = f"msg_{job.id[5:]}"
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    yield event("response.created", response=response_object(job, body, "in_progress"))
    yield event("response.in_progress", response=response_object(job, body, "in_progress"))
    yield event("response.output_item.added", output_index=0, item=response_message(job, "", "in_progress"))
    yield event("response.content_part.added", **where, part={"type": "output_text", "text": "", "annotations": []})
    async with aclosing(pieces):
        async for piece in pieces:
            if piece.response.text:
                yield event("response.output_text.delta", **where, delta=piece.response.text, logprobs=[])
    text = job.choices[0].text
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    yield event("response.output_text.done", **where, text=text, logprobs=[])
    yield event("response.content_part.done", **where, part=part)
    yield event("response.output_item.done", output_index=0, item=response_message(job, text, "completed"))
    yield event("response.completed", response=response_object(job, body, "completed"))
