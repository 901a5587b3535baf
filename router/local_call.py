"""A call into the router's own servicer from inside its process (the HTTP front), without
gRPC: the servicer sees a LocalContext, which keeps the ServicerContext contract it relies
on, and a failure comes out as a LocalRpcError, which reads like the grpc.RpcError a remote
caller would get.

Lifecycle of a local call:
  1. The caller makes a LocalContext and runs the servicer method on a thread of its own
     (a streaming method blocks between its messages, as it does under gRPC).
  2. `abort(code, details)` from the servicer raises LocalRpcError(code, details, trailing
     metadata set before it).
  3. The call ends (`finish`), or its caller goes away (`cancel`): the callbacks the servicer
     added run once, on a thread of their own (they may release blocks over the network),
     as gRPC runs them when a call terminates. `add_callback` after that says False.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import grpc

logger = logging.getLogger(__name__)

_Metadata = Sequence[tuple[str, str]]


class LocalRpcError(grpc.RpcError, grpc.Call):
    """How a local call failed, with the accessors of a failed gRPC call."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: _Metadata = ()) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details
        self._trailing_metadata = tuple(trailing_metadata)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> _Metadata:
        return self._trailing_metadata

    def initial_metadata(self) -> _Metadata:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return False


class LocalContext:
    """The part of grpc.ServicerContext the router's servicer uses, for a call made in-process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], Any]] = []
        self._ended = False
        self._code: grpc.StatusCode | None = None
        self._trailing_metadata: _Metadata = ()

    def add_callback(self, callback: Callable[[], Any]) -> bool:
        with self._lock:
            if self._ended:
                return False
            self._callbacks.append(callback)
            return True

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        self._code = code
        raise LocalRpcError(code, details, self._trailing_metadata)

    def set_trailing_metadata(self, metadata: _Metadata) -> None:
        self._trailing_metadata = tuple(metadata)

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def peer(self) -> str:
        return "local"  # not a TCP connection: no client-chosen id is abortable through it

    def is_active(self) -> bool:
        return not self._ended

    def invocation_metadata(self) -> _Metadata:
        return ()

    def finish(self) -> None:
        """The call returned or raised: run the callbacks."""
        self._end()

    def cancel(self) -> None:
        """The caller went away: run the callbacks (the servicer aborts the request)."""
        self._end()

    def _end(self) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
            callbacks, self._callbacks = self._callbacks, []
        if callbacks:
            threading.Thread(target=_run_all, args=(callbacks,), name="local-call-end", daemon=True).start()


def _run_all(callbacks: list[Callable[[], Any]]) -> None:
    for callback in callbacks:
        try:
            callback()
        except Exception:  # one failing callback must not keep the others from running
            logger.exception("a local call's end callback failed")
