"""What every HTTP request passes before the app sees it (pure ASGI, so streams pass through
untouched).

1. X-Request-Id: taken from the request (or made) and echoed on the response.
2. The API key, on every route but the unguarded ones (/health): `Authorization: Bearer <key>`, the scheme in
   any case (RFC 7235), the key exact and compared in constant time. Routes of another API's
   dialect (`Dialect`: the Anthropic routes) also take it in their own header and answer
   every refusal in their own error shape.
3. The body: more than `max_request_bytes` (declared or received) is a 413; a body not
   whole `body_timeout_s` after the request began is a 408. Either is answered at once with
   `Connection: close`, and the app is told the client has gone, so a slow or endless body
   holds neither a connection nor a handler. Once the body is whole (or the app has started
   its answer) nothing is timed: the app's wait for a hang-up is unbounded.

Before all that, the headers (`HeadersInTime`, the server's HTTP/1.1 protocol): a request
line and headers not whole `header_timeout_s` after the connection opened, or after the
first byte of a next request on a kept-alive connection, get a 408 and the connection is
closed, so a client that trickles its headers (slowloris) holds no connection. uvicorn
times only idle kept-alive connections.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from vllm_cluster.router.openai.errors import ApiError, error_response


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class Dialect:
    """The routes under `path_prefix` speak another API: the key may also come as the whole
    value of `key_header` (`how_to_send_key` says so in a 401), and `respond` shapes their errors."""

    path_prefix: str
    key_header: bytes
    how_to_send_key: str
    respond: Callable[[ApiError], Response]


_OPENAI = Dialect("/", b"authorization", "`Authorization: Bearer <key>`", error_response)


class Guard:
    def __init__(
        self, app: ASGIApp, api_key: str, max_request_bytes: int, body_timeout_s: float,
        unguarded_paths: tuple[str, ...], dialects: tuple[Dialect, ...] = (),
    ) -> None:
        self.app = app
        self._unguarded_paths = unguarded_paths
        self._dialects = dialects
        self._key_digest = hashlib.sha256(api_key.encode()).digest() if api_key else None
        self._max_bytes = max_request_bytes
        self._body_timeout_s = body_timeout_s

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

        dialect = next((d for d in self._dialects if scope["path"].startswith(d.path_prefix)), _OPENAI)
        if scope["path"] not in self._unguarded_paths and not self._authorized(headers, dialect):
            refusal = ApiError(401, f"missing or wrong API key: send {dialect.how_to_send_key}")
            await dialect.respond(refusal)(scope, receive, send_with_id)
            return
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self._max_bytes):
            await _answer_and_close(dialect.respond(self._too_large()), scope, send_with_id)
            return
        gate = _BodyGate(
            scope, receive, send_with_id, self._max_bytes, self._body_timeout_s, self._too_large(), dialect.respond
        )
        await self.app(scope, gate.receive, gate.send)

    def _authorized(self, headers: dict[bytes, bytes], dialect: Dialect) -> bool:
        if self._key_digest is None:
            return True
        scheme, _, credentials = headers.get(b"authorization", b"").partition(b" ")
        if self._key_matches(credentials.lstrip(b" ")) and scheme.lower() == b"bearer":
            return True
        return dialect is not _OPENAI and self._key_matches(headers.get(dialect.key_header, b""))

    def _key_matches(self, key: bytes) -> bool:
        assert self._key_digest is not None
        digest = hashlib.sha256(key).digest()  # equal lengths: constant time
        return hmac.compare_digest(digest, self._key_digest)

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body is larger than {self._max_bytes} bytes; send a smaller one")


class _BodyGate:
    """One request's receive and send as the app sees them: the body bounded in size and
    time; once the gate has answered in the app's place, the app hears a hang-up and its own
    answer is dropped."""

    def __init__(
        self, scope: Scope, receive: Receive, send: Send, max_bytes: int, timeout_s: float, too_large: ApiError,
        respond: Callable[[ApiError], Response],
    ) -> None:
        self._scope = scope
        self._respond = respond
        self._receive = receive
        self._send = send
        self._max_bytes = max_bytes
        self._timeout_s = timeout_s
        self._too_large = too_large
        self._deadline = asyncio.get_running_loop().time() + timeout_s
        self._num_received_bytes = 0
        self._whole = False  # the body has all arrived
        self._started = False  # the app has begun its answer
        self._answered = False  # the gate answered instead of the app

    async def receive(self) -> Message:
        if self._answered:
            return {"type": "http.disconnect"}
        if self._whole or self._started:
            return await self._receive()
        remaining_s = self._deadline - asyncio.get_running_loop().time()
        try:
            message = await asyncio.wait_for(self._receive(), timeout=max(remaining_s, 0.0))
        except TimeoutError:
            return await self._answer(ApiError(
                408, f"the request body did not arrive within {self._timeout_s:g} s; send the whole body at once, "
                "with a Content-Length that matches it",
            ))
        if message["type"] == "http.request":
            self._num_received_bytes += len(message.get("body", b""))
            if self._num_received_bytes > self._max_bytes:
                return await self._answer(self._too_large)
            self._whole = not message.get("more_body", False)
        return message

    async def send(self, message: Message) -> None:
        if self._answered:
            return
        self._started = True
        await self._send(message)

    async def _answer(self, e: ApiError) -> Message:
        self._answered = True
        await _answer_and_close(self._respond(e), self._scope, self._send)
        return {"type": "http.disconnect"}


async def _answer_and_close(response: Response, scope: Scope, send: Send) -> None:
    """Answer without reading the rest of the body, and close the connection after it."""
    response.headers["Connection"] = "close"

    async def nothing_more() -> Message:
        return {"type": "http.disconnect"}

    await response(scope, nothing_more, send)


class HeadersInTime(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's line and headers."""

    header_timeout_s = 10.0  # set per server: `with_header_timeout`

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._headers_due: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_LingeringClose(transport, self))  # type: ignore[arg-type]
        # uvicorn writes a response's head and body apart; without TCP_NODELAY the body waits
        # for the client's delayed ACK (about 40 ms) on every request of a kept-alive connection.
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return  # the rest of a body we answered early: dropped while the close lingers
        super().data_received(data)
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_watching()
        super().connection_lost(exc)

    def _watch_headers(self) -> None:
        # h11 leaves IDLE once a request's line and headers are whole.
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            self._stop_watching()
        elif self._headers_due is None:
            self._headers_due = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _stop_watching(self) -> None:
        if self._headers_due is not None:
            self._headers_due.cancel()
            self._headers_due = None

    def _headers_late(self) -> None:
        self._headers_due = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            body = b"request headers did not arrive in time"
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
            self.transport.close()


class _LingeringClose:
    """The connection's transport, but closing it while the client is still sending a body
    (the guard's 413 or 408 answers mid-body) shuts only our side: a plain close would answer
    the unread bytes with a reset, which can reach the client before it reads the answer.
    What still arrives is dropped; the socket closes when the client closes its side, or
    LINGER_S later."""

    LINGER_S = 2.0

    def __init__(self, transport: asyncio.Transport, protocol: HeadersInTime) -> None:
        self._transport = transport
        self._protocol = protocol
        self._lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.is_closing():
            return
        if self._protocol.conn.their_state is not h11.SEND_BODY or not self._transport.can_write_eof():
            self._transport.close()
            return
        self._lingering = True
        self._transport.write_eof()  # after what is queued: the client reads the answer, then EOF
        self._transport.resume_reading()
        self._protocol.loop.call_later(self.LINGER_S, self._transport.close)


def with_header_timeout(header_timeout_s: float) -> type[HeadersInTime]:
    """The protocol class for one server (uvicorn takes a class)."""
    return type("HeadersInTime", (HeadersInTime,), {"header_timeout_s": header_timeout_s})
