"""The OpenAI-compatible HTTP API at the router (FastAPI on uvicorn, in the router process).

Routes: /v1/completions, /v1/chat/completions, /v1/responses, /v1/models, /tokenize,
/detokenize, /health, /metrics, /version, and Anthropic's /v1/messages and
/v1/messages/count_tokens (router/anthropic/, in Anthropic's error shape). Every error is vLLM's envelope
`{"error": {"message", "type", "param", "code"}}` (errors.py); 429 and 503 carry Retry-After,
405 carries Allow. Before a route runs, the guard (guard.py) checks the API key, bounds the
body in size and time and sets X-Request-Id. /openapi.json documents every status a route
answers (openapi.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp

from vllm_cluster.router.anthropic.messages import DIALECT, AnthropicServing, messages_routes
from vllm_cluster.router.openai.errors import ApiError, error_response, invalid_body
from vllm_cluster.router.openai.guard import Guard, with_header_timeout
from vllm_cluster.router.openai.openapi import document, error_responses
from vllm_cluster.router.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoRAAdapterRequest,
    ResponsesRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from vllm_cluster.router.openai.serving import OpenAIServing

logger = logging.getLogger(__name__)

VERSION = "0.1.0"
_UNGUARDED_PATHS = ("/health",)
_STREAMED: dict[int | str, dict[str, Any]] = {200: {
    "content": {"text/event-stream": {"schema": {  # one event: `data` a JSON chunk, or [DONE] at the end
        "type": "object", "properties": {"event": {"type": "string"}, "data": {"type": "string"}}, "required": ["data"],
    }}},
    "description": "The whole object, or with `stream: true` server-sent events.",
}}
_GENERATION_RESPONSES = {**_STREAMED, **error_responses(400, 404, 429, 503)}


def build_app(
    serving: OpenAIServing,
    api_key: str = "",
    max_request_bytes: int = 16 << 20,
    is_healthy: Callable[[], bool] = lambda: True,
    metrics: Callable[[], tuple[bytes, str]] | None = None,
    body_timeout_s: float = 60.0,
) -> ASGIApp:
    """`is_healthy`: can the cluster serve (a decode instance is up)? `metrics`: the
    Prometheus exposition (body, content type). `body_timeout_s`: how long a request's body
    may take to arrive (from the request's start) before the answer is 408."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await serving.backend.start()
        yield
        await serving.backend.close()

    app = FastAPI(title="vllm-cluster", version=VERSION, lifespan=lifespan, docs_url=None, redoc_url=None)
    _handle_errors(app)

    @app.get("/health", response_class=Response, responses={
        200: {"description": "The cluster can serve (an empty body)."},
        503: {"description": "The cluster cannot serve: no decode instance is up, or the router is draining "
                             "(an empty body)."},
    })
    async def health() -> Response:
        return Response(status_code=200 if is_healthy() else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/metrics", response_class=PlainTextResponse, responses=error_responses(404))
    async def prometheus() -> Response:
        if metrics is None:
            raise ApiError(404, "metrics are not enabled on this server")
        body, content_type = metrics()
        return Response(body, media_type=content_type)

    @app.get("/v1/models", responses=error_responses(503))
    async def models() -> dict[str, Any]:
        cards = await serving.backend.list_models()
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": c.id, "object": "model", "created": created, "owned_by": "vllm-cluster", "root": c.id,
             "parent": c.parent or None, "max_model_len": c.max_model_len}
            for c in cards
        ]}

    lora_errors = error_responses(400, 404, 409, 503)

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=lora_errors)
    async def load_lora_adapter(body: LoRAAdapterRequest) -> Response:
        await serving.backend.lora_adapter(True, body.lora_name, body.lora_path)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=lora_errors)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        await serving.backend.lora_adapter(False, body.lora_name, "")
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    @app.post("/v1/completions", responses=_GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _respond(request, serving.completions(body, _request_id(request)))

    @app.post("/v1/chat/completions", responses=_GENERATION_RESPONSES)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await _respond(request, serving.chat(body, _request_id(request)))

    @app.post("/v1/responses", responses=_GENERATION_RESPONSES)
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await _respond(request, serving.responses(body, _request_id(request)))

    @app.post("/tokenize", responses=error_responses(400, 404))
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        await serving.check_model(body.model)
        messages = [m.template_message() for m in body.messages] if body.messages is not None else None
        return serving.tokenize(body.prompt, messages, body.add_special_tokens, body.add_generation_prompt)

    @app.post("/detokenize", responses=error_responses(400, 404))
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        await serving.check_model(body.model)
        return serving.detokenize(body.tokens)

    app.include_router(messages_routes(AnthropicServing(serving), _respond))
    vocab_size = len(serving.tokenizer) if serving.tokenizer is not None else None
    document(app, _UNGUARDED_PATHS, api_key_required=bool(api_key), max_model_len=serving.max_model_len,
             vocab_size=vocab_size, reasoning=bool(serving.reasoning_parser))
    return Guard(app, api_key, max_request_bytes, body_timeout_s, _UNGUARDED_PATHS, dialects=(DIALECT,))


def _handle_errors(app: FastAPI) -> None:
    """Every error the app raises becomes the envelope."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> Response:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> Response:
        return error_response(invalid_body(e.errors(), request.headers.get("content-type", "")))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> Response:
        # 404 (no such route) and 405 (wrong method, with its Allow header) come from here.
        respond = DIALECT.respond if request.url.path.startswith(DIALECT.path_prefix) else error_response
        return respond(ApiError(e.status_code, str(e.detail), headers=e.headers))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> Response:
        request_id = _request_id(request)
        logger.exception("unexpected error serving %s (request %s)", request.url.path, request_id)
        return error_response(
            ApiError(500, f"internal server error; the server log has the details (request id {request_id})")
        )


def _request_id(request: Request) -> str:
    return str(request.scope["state"]["request_id"])


async def _respond(request: Request, work: Awaitable[dict[str, Any] | AsyncIterator[str]]) -> Response:
    """A whole object, or an SSE stream. A client that hangs up on a whole-object request
    cancels it (and so its Generate calls) instead of leaving it running."""
    task = asyncio.ensure_future(work)
    disconnected = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnected.cancel()
    if task not in done:
        task.cancel()
        return Response(status_code=499)
    result = task.result()
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class HttpServer:
    """uvicorn on its own thread and event loop, so the gRPC router keeps the main thread."""

    def __init__(
        self, app: ASGIApp, host: str, port: int, tls: tuple[Path, Path] | None = None, header_timeout_s: float = 10.0,
    ) -> None:
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = int(self._sock.getsockname()[1])
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
            http=with_header_timeout(header_timeout_s),
            ssl_certfile=str(tls[0]) if tls else None, ssl_keyfile=str(tls[1]) if tls else None,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="http", daemon=True)

    def _run(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._sock]))

    def start(self, timeout_s: float = 30.0) -> HttpServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start; see the log above")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
