"""The HTTP front's way into the cluster through a router's gRPC client API (an HTTP front
in a process of its own; in the router's process, local_backend.py calls the servicer
directly).

Every HTTP request becomes one `Generate` call per choice, so both fronts share one
request path (routing, hand-off, aborts, metrics) and a dropped HTTP client cancels its
calls, which frees the blocks on every instance. gRPC status codes map to HTTP statuses
here, once. When the router itself cannot be reached (gone, restarting, or draining: its
port refuses new connections), the client gets a 503 saying so, not gRPC's transport text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol

import grpc

from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.router.openai.errors import ApiError
from vllm_cluster.worker.rpc import CHANNEL_OPTIONS, retry_after_s

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
# How gRPC's own transport failures begin; the router's UNAVAILABLE messages (no decode
# instance, a failed hand-off) begin with its own words and reach the client as they are.
_LINK_DOWN = re.compile(
    r"(failed to connect to all addresses|connections to all backends failing|Socket closed|Connection reset"
    r"|recvmsg|sendmsg|Broken pipe|GOAWAY|Stream removed|keepalive watchdog|Connection timed out|Channel closed)",
    re.IGNORECASE,
)
ROUTER_DOWN = f"the router is not taking requests right now (restarting or shutting down); retry in {RETRY_AFTER_S} s"

# Fields only the instances can check (token ids against the vocabulary, the scheduling
# policy): their messages start with the field's name, which becomes the error's param.
_INSTANCE_CHECKED = re.compile(r"(?:^|: )(priority|logit_bias|allowed_token_ids|bad_words|stop_token_ids) ")

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def api_error(e: grpc.RpcError) -> ApiError:
    code = e.code()
    status = _HTTP_STATUS.get(code, 500)
    retry = (retry_after_s(e) or RETRY_AFTER_S) if status in (429, 503) else None
    details = e.details() or code.name
    if code == grpc.StatusCode.UNAVAILABLE and _LINK_DOWN.match(details):
        logger.warning("the router's gRPC API is unreachable: %s", details)
        return ApiError(503, ROUTER_DOWN, retry_after_s=RETRY_AFTER_S)
    param = None
    if code == grpc.StatusCode.NOT_FOUND and details.startswith("The model `"):
        # vLLM's message, word for word (clients match it); the router's gRPC one goes on
        # to name what is served.
        param, details = "model", details.split(" does not exist.")[0] + " does not exist."
    elif code == grpc.StatusCode.INVALID_ARGUMENT and (field := _INSTANCE_CHECKED.search(details)):
        param = field.group(1)
    return ApiError(status, details, param, retry_after_s=retry)


class Backend(Protocol):
    """What the HTTP front needs of the router (RouterBackend, LocalBackend)."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def list_models(self) -> list[pb.ModelCard]: ...

    async def lora_adapter(self, load: bool, name: str, path: str) -> None: ...

    def generate(self, requests: list[pb.GenerateRequest]) -> AsyncGenerator[Piece, None]: ...


@dataclass(slots=True)
class Piece:
    """One streamed response of choice `index`."""

    index: int
    response: pb.GenerateResponse


async def pieces(queue: asyncio.Queue[Piece | ApiError | None], num_calls: int) -> AsyncGenerator[Piece, None]:
    """The pieces `num_calls` calls put on `queue` until each has put None (its end); the first
    ApiError ends the iteration by raising it."""
    remaining = num_calls
    while remaining:
        item = await queue.get()
        if item is None:
            remaining -= 1
        elif isinstance(item, ApiError):
            raise item
        else:
            yield item


class RouterBackend:
    def __init__(self, target: str, api_key: str = "") -> None:
        self._target = target
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.GenerationStub | None = None

    async def start(self) -> None:
        """On the HTTP server's event loop: aio channels belong to the loop they start on."""
        self._channel = grpc.aio.insecure_channel(self._target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.GenerationStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def list_models(self) -> list[pb.ModelCard]:
        assert self._stub is not None
        try:
            reply = await self._stub.ListModels(pb.ListModelsRequest(), metadata=self._metadata, timeout=10.0)
        except grpc.RpcError as e:
            raise api_error(e) from e
        return list(reply.models)

    async def lora_adapter(self, load: bool, name: str, path: str) -> None:
        """Load (or unload) a LoRA adapter on every instance, through the router."""
        assert self._stub is not None
        msg = pb.LoRAAdapterRequest(lora_name=name, lora_path=path)
        method = self._stub.LoadLoRAAdapter if load else self._stub.UnloadLoRAAdapter
        try:
            await method(msg, metadata=self._metadata, timeout=120.0)
        except grpc.RpcError as e:
            raise api_error(e) from e

    async def generate(self, requests: list[pb.GenerateRequest]) -> AsyncGenerator[Piece, None]:
        """The pieces of all `requests` (the choices of one HTTP request) as they arrive.

        The first failure ends the whole iteration with an ApiError and cancels the other
        calls; leaving the iteration early (client gone) cancels every call still running.
        """
        assert self._stub is not None
        stub = self._stub
        queue: asyncio.Queue[Piece | ApiError | None] = asyncio.Queue()
        calls = [stub.Generate(r, metadata=self._metadata) for r in requests]

        async def pump(index: int, call: grpc.aio.UnaryStreamCall) -> None:
            try:
                async for response in call:
                    queue.put_nowait(Piece(index, response))
                queue.put_nowait(None)
            except grpc.RpcError as e:
                queue.put_nowait(api_error(e))
            except asyncio.CancelledError:
                call.cancel()
                raise

        tasks = [asyncio.create_task(pump(i, call)) for i, call in enumerate(calls)]
        try:
            async for piece in pieces(queue, len(tasks)):
                yield piece
        finally:
            for call in calls:
                call.cancel()
            for task in tasks:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.RpcError):
                await asyncio.gather(*tasks, return_exceptions=True)
