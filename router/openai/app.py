"""The OpenAI-compatible HTTP API at the router (FastAPI on uvicorn, in the router process).

Routes: /v1/completions, /v1/chat/completions, /v1/responses, /v1/models, /tokenize,
/detokenize, /health, /metrics, /version. Every error is vLLM's envelope
`{"error": {"message", "type", "param", "code"}}`; 429 and 503 carry Retry-After.
With an API key configured every route but /health needs `Authorization: Bearer <key>`.
`X-Request-Id` is taken from the request (or made) and echoed on the response.
"""

from __future__ import annotations

import asyncio
import hmac
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
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vllm_cluster.router.openai.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoRAAdapterRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from vllm_cluster.router.openai.serving import OpenAIServing, error_body, new_request_id

logger = logging.getLogger(__name__)

VERSION = "0.1.0"


def build_app(
    serving: OpenAIServing,
    api_key: str = "",
    max_request_bytes: int = 16 << 20,
    is_healthy: Callable[[], bool] = lambda: True,
    metrics: Callable[[], tuple[bytes, str]] | None = None,
) -> ASGIApp:
    """`is_healthy`: can the cluster serve (a decode instance is up)? `metrics`: the
    Prometheus exposition (body, content type)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await serving.backend.start()
        yield
        await serving.backend.close()

    app = FastAPI(title="vllm-cluster", version=VERSION, lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> Response:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> Response:
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        message = (
            f"{where}: {first.get('msg', 'invalid value')}" if where else str(first.get("msg", "invalid request body"))
        )
        return error_response(ApiError(400, message, where or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> Response:
        return error_response(ApiError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> Response:
        request_id = _request_id(request)
        logger.exception("unexpected error serving %s (request %s)", request.url.path, request_id)
        return error_response(
            ApiError(500, f"internal server error; the server log has the details (request id {request_id})")
        )

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if is_healthy() else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/metrics")
    async def prometheus() -> Response:
        if metrics is None:
            raise ApiError(404, "metrics are not enabled on this server")
        body, content_type = metrics()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        cards = await serving.backend.list_models()
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": c.id, "object": "model", "created": created, "owned_by": "vllm-cluster", "root": c.id,
             "parent": c.parent or None, "max_model_len": c.max_model_len}
            for c in cards
        ]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoRAAdapterRequest) -> Response:
        await serving.backend.lora_adapter(True, body.lora_name, body.lora_path)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: LoRAAdapterRequest) -> Response:
        await serving.backend.lora_adapter(False, body.lora_name, "")
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _respond(request, serving.completions(body, _request_id(request)))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await _respond(request, serving.chat(body, _request_id(request)))

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await _respond(request, serving.responses(body, _request_id(request)))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages] if body.messages is not None else None
        return serving.tokenize(body.prompt, messages, body.add_special_tokens, body.add_generation_prompt)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return serving.detokenize(body.tokens)

    return _Guard(app, api_key, max_request_bytes)


def error_response(e: ApiError) -> Response:
    headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s is not None else None
    return JSONResponse(error_body(e), status_code=e.status, headers=headers)


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


class _Guard:
    """Pure ASGI (streams pass through untouched): request size, API key, X-Request-Id."""

    def __init__(self, app: ASGIApp, api_key: str, max_request_bytes: int) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode() if api_key else None
        self._max_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:256] or new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        if self._expected is not None and scope["path"] != "/health":
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                await _send_error(
                    ApiError(401, "missing or wrong API key: send `Authorization: Bearer <key>`"),
                    scope,
                    receive,
                    send_with_id,
                )
                return
        length = headers.get(b"content-length")
        too_large = ApiError(413, f"the request body is larger than {self._max_bytes} bytes; send a smaller one")
        if length is not None and (not length.isdigit() or int(length) > self._max_bytes):
            await _send_error(too_large, scope, receive, send_with_id)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self._max_bytes:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, limited_receive, send_with_id)
        except _TooLarge:
            await _send_error(too_large, scope, receive, send_with_id)


class _TooLarge(Exception):
    pass


async def _send_error(e: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
    await error_response(e)(scope, receive, send)


class HttpServer:
    """uvicorn on its own thread and event loop, so the gRPC router keeps the main thread."""

    def __init__(self, app: ASGIApp, host: str, port: int, tls: tuple[Path, Path] | None = None) -> None:
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = int(self._sock.getsockname()[1])
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
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
