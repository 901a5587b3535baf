"""Anthropic's Messages API over the OpenAI chat path: POST /v1/messages (whole, or streamed
as Anthropic's events) and POST /v1/messages/count_tokens.

A request's lifecycle:
1. The guard checks the API key (`x-api-key`, as the Anthropic SDK sends it, or
   `Authorization: Bearer`) and bounds the body; its refusals come in Anthropic's shape.
2. The body is validated (protocol.py) and becomes a ChatCompletionRequest (translate.py).
3. OpenAIServing.chat serves it exactly as /v1/chat/completions: chat template, context
   check, Generate calls, 429/503 with Retry-After before the first token, cancellation
   when the client hangs up.
4. The chat completion becomes a Message (translate.py), or the chat chunks become
   Anthropic's events (stream.py). Every error is Anthropic's error body (errors.py).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel

from vllm_cluster.engine.errors import InvalidRequestError
from vllm_cluster.engine.tokenizer import apply_chat_template
from vllm_cluster.router.anthropic.errors import AnthropicRoute, error_response, error_responses
from vllm_cluster.router.anthropic.protocol import CountTokensRequest, MessagesRequest
from vllm_cluster.router.anthropic.stream import message_events
from vllm_cluster.router.anthropic.translate import chat_request, message_object, prompt_request
from vllm_cluster.router.openai.errors import bad_request
from vllm_cluster.router.openai.guard import Dialect
from vllm_cluster.router.openai.serving import OpenAIServing

PATH_PREFIX = "/v1/messages"
AUTO_NOT_ENABLED = (
    'tool_choice "auto" (the default with tools) needs router.tool_call_parser and router.enable_auto_tool_choice: '
    'true in the cluster config; or send tool_choice {"type": "any"}, {"type": "tool", "name": ...} or {"type": "none"}'
)
DIALECT = Dialect(PATH_PREFIX, b"x-api-key", "`x-api-key: <key>` (or `Authorization: Bearer <key>`)",
                  error_response)
Work = Awaitable[dict[str, Any] | AsyncIterator[str]]
_STREAMED: dict[int | str, dict[str, Any]] = {200: {
    "content": {"text/event-stream": {"schema": {  # one event: its name, and its JSON object as `data`
        "type": "object", "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
        "required": ["event", "data"],
    }}},
    "description": "The Message, or with `stream: true` Anthropic's server-sent events.",
}}


class MessageTokensCount(BaseModel):
    input_tokens: int


class AnthropicServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def messages(self, body: MessagesRequest, request_id: str) -> dict[str, Any] | AsyncIterator[str]:
        auto = body.tool_choice is None or body.tool_choice.type == "auto"
        if body.tools and auto and not (self.serving.tool_call_parser and self.serving.enable_auto_tool_choice):
            raise bad_request(AUTO_NOT_ENABLED, "tool_choice")
        chat = chat_request(body, reasoning=bool(self.serving.reasoning_parser))
        result = await self.serving.chat(chat, request_id)
        message_id = f"msg_{request_id}"
        if isinstance(result, dict):
            return message_object(result, message_id, body.stop_sequences)
        assert isinstance(result, AsyncGenerator), "the chat path streams from an async generator"
        return message_events(result, message_id, body.stop_sequences)

    async def count_tokens(self, body: CountTokensRequest) -> MessageTokensCount:
        """The prompt's length as /v1/messages would serve it: the chat template rendered with
        the messages, the tools offered and the generation prompt, then tokenized."""
        await self.serving.check_model(body.model)
        chat = prompt_request(body, reasoning=bool(self.serving.reasoning_parser))
        tokenizer = self.serving.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template, so its prompts cannot be counted", "messages")
        try:
            tools = chat.tool_use().template_tools
            prompt = apply_chat_template(tokenizer, chat.chat(), chat.chat_template_kwargs, tools)
        except InvalidRequestError as e:
            raise bad_request(str(e), "messages") from None
        return MessageTokensCount(input_tokens=len(prompt))


def messages_routes(serving: AnthropicServing, respond: Callable[[Request, Work], Awaitable[Response]]) -> APIRouter:
    """The routes, for the app to include; `respond` answers a whole object or a stream (and
    cancels the work when the client hangs up)."""
    router = APIRouter(route_class=AnthropicRoute)

    @router.post(PATH_PREFIX, responses={**_STREAMED, **error_responses(400, 404, 429, 503)})
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await respond(request, serving.messages(body, str(request.scope["state"]["request_id"])))

    @router.post(f"{PATH_PREFIX}/count_tokens", responses=error_responses(400, 404))
    async def count_tokens(body: CountTokensRequest) -> MessageTokensCount:
        return await serving.count_tokens(body)

    return router
