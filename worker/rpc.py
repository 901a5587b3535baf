"""gRPC plumbing every server and client of the cluster shares: servers with the standard
health and reflection services, and the cluster token on internal RPCs.

Internal listeners bind 127.0.0.1 unless configured otherwise. With a token configured, a
worker refuses any call that does not carry it (health checks excepted), so a stray
process on the host cannot reserve blocks or push prompts.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import re
import secrets
import signal
import threading
from collections.abc import Callable, Iterable
from concurrent import futures
from pathlib import Path
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

logger = logging.getLogger(__name__)

TOKEN_METADATA_KEY = "x-cluster-token"
RETRY_AFTER_KEY = "retry-after-s"  # trailing metadata of a RESOURCE_EXHAUSTED: when to retry, whole seconds
TOKEN_ENV = "VLLM_CLUSTER_TOKEN"  # a secret: kept off the command line, where `ps` shows it
API_KEY_ENV = "VLLM_API_KEY"  # the client API key when router.api_key is empty (vLLM's name)
REDIS_URL_ENV = "VLLM_CLUSTER_REDIS_URL"  # may carry a password: kept off the command line too
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

# A synchronous gRPC server runs each call on a thread of its pool, and a streaming call
# holds its thread until the stream ends. The pool is sized far above any batch (threads
# start only when needed), and servers refuse streams beyond MAX_STREAMS (StreamSlots), so
# unary calls (the router's Stats polls, health checks, aborts) always find a thread: load
# is never mistaken for failure.
MAX_WORKERS = 1024
MAX_STREAMS = MAX_WORKERS - 64

# Prompts and streamed responses can exceed gRPC's 4 MiB default.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
]


class _SecretCheck(grpc.ServerInterceptor):
    """Refuse calls whose metadata `key` is not `expected` (compared in constant time)."""

    def __init__(
        self, key: str, expected: str, message: str, applies: Callable[[str], bool] = lambda _: True
    ) -> None:
        self._key = key
        self._expected = expected.encode()
        self._message = message
        self._applies = applies  # method path -> whether this check guards it

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or details.method.startswith(_OPEN_PREFIXES) or not self._applies(details.method):
            return handler
        given = dict(details.invocation_metadata).get(self._key, "")
        if hmac.compare_digest(str(given).encode(), self._expected):
            return handler
        return _refusal(handler, self._message)


def _refusal(handler: Any, message: str) -> Any:
    def deny(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            deny, handler.request_deserializer, handler.response_serializer
        )
    return grpc.unary_unary_rpc_method_handler(
        deny, handler.request_deserializer, handler.response_serializer
    )


def make_server(
    address: str,
    service_names: Iterable[str],
    token: str | None = None,
    max_workers: int = MAX_WORKERS,
    api_key: str | None = None,
    tls: tuple[Path, Path] | None = None,
    token_services: Iterable[str] = (),
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """A server bound to `address` ("127.0.0.1:0" picks a port) with health and reflection.

    `token`: the cluster token internal calls must carry. `api_key`: the key client calls
    must carry as `authorization: Bearer <key>` metadata (the router's public side).
    `tls`: (certificate chain PEM, private key PEM): the port speaks TLS only.
    `token_services`: services (full names) whose calls need the cluster token instead of
    the API key, on a server that also serves clients (the router's admin service); with
    them, `token` guards only those and `api_key` only the rest.
    Returns (server, bound port, health servicer). Add the services, then `server.start()`.
    """
    internal = tuple(f"/{name}/" for name in token_services)

    def is_internal(method: str) -> bool:
        return not internal or method.startswith(internal)

    interceptors: list[grpc.ServerInterceptor] = []
    if token or internal:  # a token service with no token configured refuses every call
        interceptors.append(_SecretCheck(
            TOKEN_METADATA_KEY, token or secrets.token_hex(16),
            "missing or wrong cluster token: start every process of the cluster with the same token",
            is_internal,
        ))
    if api_key:
        interceptors.append(_SecretCheck(
            "authorization", f"Bearer {api_key}",
            "missing or wrong API key: send metadata `authorization: Bearer <key>`",
            lambda method: not internal or not method.startswith(internal),
        ))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=interceptors,
        options=CHANNEL_OPTIONS,
    )
    if tls is not None:
        cert, key = (path.read_bytes() for path in tls)
        port = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}: is the port taken?")
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    for name in names:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return server, port, health_servicer


class StreamSlots:
    """A server's open streams, at most `limit`: `acquire` is False once they are all taken
    (the caller refuses the call with RESOURCE_EXHAUSTED, which says to retry or go elsewhere)."""

    def __init__(self, limit: int = MAX_STREAMS) -> None:
        self.limit = limit
        self.open = 0
        self._lock = threading.Lock()

    def acquire(self) -> bool:
        with self._lock:
            if self.open >= self.limit:
                return False
            self.open += 1
            return True

    def release(self) -> None:
        with self._lock:
            assert self.open > 0, "released a stream slot never acquired"
            self.open -= 1


class _TokenAttach(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    def _with_token(self, details: Any) -> Any:
        metadata = list(details.metadata or []) + [(TOKEN_METADATA_KEY, self._token)]
        return details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)


def make_channel(address: str, token: str | None = None) -> grpc.Channel:
    """An insecure channel to `address` that attaches the cluster token to every call."""
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    if token:
        channel = grpc.intercept_channel(channel, _TokenAttach(token))
    return channel


def check_health(channel: grpc.Channel, service: str = "", timeout_s: float = 1.0) -> bool:
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


_ENDPOINT = re.compile(r"\b(?:[a-z]+://)?(?:\d{1,3}(?:\.\d{1,3}){3}|\[[0-9a-f:]+\]|localhost)(?::\d+)?", re.IGNORECASE)
_ADDRESS = re.compile(r"\b0x[0-9a-f]{6,}\b", re.IGNORECASE)


def retry_after_s(e: grpc.RpcError) -> int | None:
    """The router's estimate of when to retry a RESOURCE_EXHAUSTED call (RETRY_AFTER_KEY in
    its trailing metadata), or None."""
    if not isinstance(e, grpc.Call):
        return None
    for key, value in e.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY and str(value).isdigit():
            return int(value)
    return None


def scrub(message: str) -> str:
    """A message fit for clients: no tracebacks, memory addresses or internal endpoints
    (the full text stays in the server's log)."""
    message = message.split("Traceback (most recent call last)")[0].rstrip()
    return _ADDRESS.sub("0x…", _ENDPOINT.sub("<internal>", message))


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """End the call with `code` and a message that says what to change."""
    context.abort(code, message)
    raise AssertionError("grpc's context.abort returned")  # it raises; this tells type checkers


class HealthReporter:
    """Keeps the standard health service truthful: NOT_SERVING while `problem()` names one
    (checked every `interval_s` on its own thread) and from the moment a drain starts."""

    def __init__(
        self, health_servicer: health.HealthServicer, services: Iterable[str],
        problem: Callable[[], str | None], interval_s: float = 0.5,
    ) -> None:
        self._health = health_servicer
        self._services = ["", *services]
        self._problem = problem
        self._interval_s = interval_s
        self._serving = True
        self._draining = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="health", daemon=True)
        self._thread.start()

    def drain(self) -> None:
        self._draining.set()
        self._set(False, "draining: finishing the requests in flight, refusing new ones")

    def close(self) -> None:
        self._draining.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._draining.wait(self._interval_s):
            problem = self._problem()
            self._set(problem is None, problem or "serving again")

    def _set(self, serving: bool, why: str) -> None:
        if serving == self._serving:
            return
        self._serving = serving
        logger.warning("health: %s (%s)", "SERVING" if serving else "NOT_SERVING", why)
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self._services:
            self._health.set(name, status)


def announce_and_wait(
    server: grpc.Server, port: int, ready_file: Path | None, grace_s: float = 5.0,
    on_signal: Callable[[], None] | None = None, **info: Any,
) -> None:
    """Write `ready_file` (JSON: port, pid, info) for whoever started this process, then
    block until SIGTERM/SIGINT and drain: `on_signal()` (flip health, refuse new work), then
    stop the server, which refuses new calls and gives those in flight `grace_s`."""
    if ready_file is not None:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"port": port, "pid": os.getpid(), **info}))
        tmp.replace(ready_file)  # readers never see a half-written file
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    if on_signal is not None:
        on_signal()
    server.stop(grace=grace_s).wait()
