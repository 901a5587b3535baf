"""A call into the router's servicer from its own process: the context keeps the parts of
gRPC's contract the servicer relies on, and its failures read as gRPC errors to the HTTP
front (status, message, Retry-After)."""

from __future__ import annotations

import threading

import grpc
import pytest

from vllm_cluster.router.local_call import LocalContext, LocalRpcError
from vllm_cluster.router.openai.backend import api_error
from vllm_cluster.worker.rpc import RETRY_AFTER_KEY, retry_after_s


def test_abort_raises_what_a_remote_caller_would_see() -> None:
    context = LocalContext()
    context.set_trailing_metadata(((RETRY_AFTER_KEY, "7"),))
    with pytest.raises(LocalRpcError) as info:
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the router's queue is full; retry in 7 s")
    error = info.value
    assert isinstance(error, grpc.RpcError) and isinstance(error, grpc.Call)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and context.code() == error.code()
    assert retry_after_s(error) == 7
    http = api_error(error)
    assert http.status == 429 and http.retry_after_s == 7 and "queue is full" in http.message


def test_callbacks_run_once_when_the_call_ends_and_not_after() -> None:
    context = LocalContext()
    ran: list[str] = []
    done = threading.Event()
    assert context.add_callback(lambda: ran.append("first"))
    assert context.add_callback(lambda: 1 / 0)  # a failing one does not stop the rest
    assert context.add_callback(lambda: (ran.append("second"), done.set()))
    assert context.is_active()
    context.cancel()
    assert done.wait(5) and ran == ["first", "second"]
    context.finish()  # already ended: nothing runs again
    assert not context.add_callback(lambda: ran.append("late"))
    assert not context.is_active() and ran == ["first", "second"]
    assert context.peer() == "local"  # never a TCP peer: client-chosen ids stay unabortable here
