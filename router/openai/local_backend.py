"""The HTTP front's way into the cluster when it runs in the router's own process: the
router's servicer called directly (router/local_call.py), not its gRPC API over loopback.

Same contract as RouterBackend (backend.py): one `Generate` per choice, the first failure
ends the iteration with an ApiError, leaving early cancels every call (which frees the
blocks on every instance). What it saves is the loopback hop per streamed message: the
router's gRPC server sending it and the HTTP front's gRPC client receiving it, both in this
process under one GIL. Each call runs the servicer's blocking generator on a thread of its
own and hands its responses to the event loop. While the router drains, new calls get the
503 a client of a draining router gets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncGenerator, Callable
from typing import TypeVar

import grpc

from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.router.local_call import LocalContext
from vllm_cluster.router.openai.backend import RETRY_AFTER_S, ROUTER_DOWN, Piece, api_error, pieces
from vllm_cluster.router.openai.errors import ApiError

logger = logging.getLogger(__name__)

T = TypeVar("T")
_Item = Piece | ApiError | None  # None: that call ended


class LocalBackend:
    def __init__(self, servicer: pb_grpc.GenerationServicer, draining: threading.Event) -> None:
        self._servicer = servicer
        self._draining = draining

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def list_models(self) -> list[pb.ModelCard]:
        reply = await self._unary(lambda context: self._servicer.ListModels(pb.ListModelsRequest(), context))
        return list(reply.models)

    async def lora_adapter(self, load: bool, name: str, path: str) -> None:
        """Load (or unload) a LoRA adapter on every instance, through the router."""
        msg = pb.LoRAAdapterRequest(lora_name=name, lora_path=path)
        method = self._servicer.LoadLoRAAdapter if load else self._servicer.UnloadLoRAAdapter
        await self._unary(lambda context: method(msg, context))

    async def generate(self, requests: list[pb.GenerateRequest]) -> AsyncGenerator[Piece, None]:
        """The pieces of all `requests` (the choices of one HTTP request) as they arrive."""
        self._refuse_if_draining()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        contexts = [LocalContext() for _ in requests]
        for index, (msg, context) in enumerate(zip(requests, contexts, strict=True)):
            threading.Thread(target=self._run, args=(index, msg, context, loop, queue.put_nowait),
                             name="http-generate", daemon=True).start()
        try:
            async for piece in pieces(queue, len(requests)):
                yield piece
        finally:
            for context in contexts:
                context.cancel()  # no-op for a call that has ended

    def _run(
        self, index: int, msg: pb.GenerateRequest, context: LocalContext, loop: asyncio.AbstractEventLoop,
        put: Callable[[_Item], None],
    ) -> None:
        """One choice's Generate, on its own thread; every response goes to the event loop."""
        end: _Item = None
        responses = self._servicer.Generate(msg, context)
        try:
            for response in responses:
                if not context.is_active():
                    break  # the HTTP client went away; the callbacks abort the request
                loop.call_soon_threadsafe(put, Piece(index, response))
        except grpc.RpcError as e:
            end = api_error(e)
        except Exception:
            logger.exception("Generate failed inside the router")
            end = ApiError(500, "the router failed to serve this request; see its log")
        finally:
            responses.close()  # left early: the servicer's own cleanup runs now
            context.finish()
        with contextlib.suppress(RuntimeError):  # the event loop has closed: nobody is waiting
            loop.call_soon_threadsafe(put, end)

    async def _unary(self, call: Callable[[LocalContext], T]) -> T:
        self._refuse_if_draining()
        context = LocalContext()
        try:
            return await asyncio.to_thread(call, context)
        except grpc.RpcError as e:
            raise api_error(e) from e
        finally:
            context.finish()

    def _refuse_if_draining(self) -> None:
        if self._draining.is_set():
            raise ApiError(503, ROUTER_DOWN, retry_after_s=RETRY_AFTER_S)
