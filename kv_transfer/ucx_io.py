"""The UCX plumbing under kv_transfer/ucx.py: the process's one UCX event loop, and framed
sends and receives on a ucxx endpoint (protobuf frames under one tag, raw tensor bytes
under another). See ucx.py for why there is one loop per process."""

from __future__ import annotations

import asyncio
import atexit
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np
import torch
import ucxx

from vllm_cluster.kv_transfer.base import KVTransferError, flat_bytes, unpack_frame

T = TypeVar("T")

CONNECT_TIMEOUT_S = 10.0
MAX_FRAME_BYTES = 1 << 16  # the frame receive buffer; the sender packs frames to fit
# Headers and bytes travel under two tags so that frame receives can be posted ahead of
# the byte receives they announce; UCX matches each tag's messages in posting order.
FRAME_TAG, BYTES_TAG = 1, 2


class _Closable(Protocol):
    def close(self) -> None: ...


class UcxLoop:
    """The process's one asyncio loop for UCX, in a daemon thread, started on first use."""

    _instance: ClassVar[UcxLoop | None] = None
    _instance_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def get(cls, on_cpu: bool) -> UcxLoop:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls(on_cpu)
            return cls._instance

    def __init__(self, on_cpu: bool) -> None:
        self.loop = asyncio.new_event_loop()
        self.open_objects: weakref.WeakSet[_Closable] = weakref.WeakSet()
        thread = threading.Thread(target=self.loop.run_forever, name="kv-transfer-ucx", daemon=True)
        thread.start()
        self.run(self._init_ucx(on_cpu), CONNECT_TIMEOUT_S)
        atexit.register(self._close_open_objects)

    @staticmethod
    async def _init_ucx(on_cpu: bool) -> None:
        # Runs in the loop so that ucxx binds its request notifier to it. ucxx itself sets
        # UCX_MEMTYPE_CACHE, which this UCX build does not know and warns about on stderr.
        options = {"WARN_UNUSED_ENV_VARS": "n"}
        if on_cpu:
            # Listener endpoints between host buffers; an explicit UCX_TLS still wins.
            options["TLS"] = "tcp"
        try:
            ucxx.init(options=options, env_takes_precedence=True, enable_python_future=True)
        except RuntimeError as e:
            raise KVTransferError(
                "ucxx was initialised before kv_transfer started its UCX loop; let "
                "kv_transfer be the first user of ucxx in this process"
            ) from e

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run `coro` on the loop and wait for its result (never call from the loop itself)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def _close_open_objects(self) -> None:
        # Endpoints torn down by the interpreter's exit print tracebacks; close them first.
        for obj in list(self.open_objects):
            obj.close()


def as_buffer(tensor: torch.Tensor) -> Any:
    """What ucxx sends from or receives into: the tensor's bytes, in place."""
    data = flat_bytes(tensor)
    return data if data.is_cuda else data.numpy()  # CUDA: __cuda_array_interface__


def _top_up_futures() -> None:
    """ucxx gives every request a future from a per-process pool of 100 that only its
    notifier thread refills (when under 50), and warns on stderr each time the pool runs
    dry; top it up before each request (a no-op while 50 or more are left)."""
    ucxx.core._get_ctx().worker.populate_python_futures_pool()


async def send(ep: Any, buffer: Any, tag: int) -> None:
    _top_up_futures()
    await ep.send(buffer, tag=tag)


async def recv(ep: Any, buffer: Any, tag: int) -> None:
    _top_up_futures()
    await ep.recv(buffer, tag=tag)


async def send_frame(ep: Any, frame: bytes) -> None:
    await send(ep, np.frombuffer(frame, dtype=np.uint8), FRAME_TAG)


async def recv_frame(ep: Any) -> list[bytes]:
    """The protobufs of the next frame, received into a buffer of the largest frame size
    (UCX accepts a shorter message; the frame's zero length marks its end)."""
    buffer = np.empty(MAX_FRAME_BYTES, dtype=np.uint8)
    await recv(ep, buffer, FRAME_TAG)
    return unpack_frame(buffer.data.cast("B").tobytes())
