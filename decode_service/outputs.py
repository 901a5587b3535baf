"""A caller's Outputs stream: the tokens of every request it decodes here, one message per
engine step.

Lifecycle of a subscriber (one per router):
  1. `Outputs` opens it under the caller's subscriber id and sends an empty message: the
     stream is open, `Decode` calls may name it. A second `Outputs` with the same id ends the
     first (a router that reconnects after a broken stream).
  2. `Decode` attaches a request's engine stream to it; from then on the engine thread hands it
     each step's deltas of all its requests in one call (`put_deltas`, never blocking).
  3. The stream's thread takes whatever has piled up since its last message (a request's
     deltas joined into one) and sends it as one DecodeOutputs: one message per step while
     the caller keeps up, fewer and larger ones when it does not.
  4. A request's last delta releases its stream slot. The stream ending (the caller went
     away, its connection broke) aborts every request still attached: their blocks are freed.
  5. Draining (SIGTERM), a stream ends once its requests have all finished, so the server's
     graceful stop is not held up by streams that would otherwise stay open for good.
Invariant: every attached request's slot is released exactly once, by its last delta or by
its subscriber's end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from vllm_cluster.engine.engine_loop import StreamDelta
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.worker.convert import delta_to_proto

_WAKE_S = 1.0  # how often an idle stream checks that it is still wanted


class Subscriber:
    """One caller's pending deltas and the requests attached to it."""

    def __init__(self, subscriber_id: str, release_slot: Callable[[], None]) -> None:
        self.subscriber_id = subscriber_id
        self._release_slot = release_slot
        self._cond = threading.Condition()
        self._pending: dict[str, StreamDelta] = {}  # request id -> deltas joined, in arrival order
        # Attached, nothing sent yet: the timings its first message carries, and when it landed.
        self._first: dict[str, tuple[pb.Timings, float]] = {}
        self._attached: set[str] = set()
        self._errors: dict[str, str] = {}
        self.closed = False

    def attach(self, request_id: str, timings: pb.Timings) -> bool:
        """Before the engine stream is attached: its slot is ours until its last delta. False
        when the stream has ended (the caller aborts the request and releases its slot)."""
        with self._cond:
            if self.closed:
                return False
            self._attached.add(request_id)
            self._first[request_id] = (timings, time.monotonic())
            return True

    def put_deltas(self, deltas: list[tuple[str, StreamDelta]]) -> None:
        with self._cond:
            if self.closed:
                return
            for request_id, delta in deltas:
                held = self._pending.get(request_id)
                self._pending[request_id] = delta if held is None else held.then(delta)
                if delta.finish_reason == "abort" and delta.error:
                    self._errors[request_id] = delta.error
            self._cond.notify()

    def next_message(self, timeout_s: float) -> pb.DecodeOutputs | None:
        """Everything pending as one message; None when nothing came within `timeout_s` or the
        subscriber is closed."""
        with self._cond:
            if not self._pending and not self.closed:
                self._cond.wait(timeout_s)
            if self.closed or not self._pending:
                return None
            pending, self._pending = self._pending, {}
            errors, self._errors = self._errors, {}
            message = pb.DecodeOutputs()
            now = time.monotonic()
            for request_id, delta in pending.items():
                output = message.outputs.add(error=errors.get(request_id, ""))
                output.response.CopyFrom(delta_to_proto(request_id, delta))
                first = self._first.pop(request_id, None)
                if first is not None:
                    timings, landed = first
                    timings.decode_queue_s = now - landed
                    output.response.timings.CopyFrom(timings)
                if delta.finish_reason is not None and request_id in self._attached:
                    self._attached.discard(request_id)
                    self._release_slot()
            return message

    def idle(self) -> bool:
        with self._cond:
            return not self._attached and not self._pending

    def close(self) -> list[str]:
        """Ends the stream; returns the requests still attached (the caller aborts them)."""
        with self._cond:
            self.closed = True
            unfinished = sorted(self._attached)
            for _ in unfinished:
                self._release_slot()
            self._attached.clear()
            self._first.clear()
            self._pending.clear()
            self._cond.notify_all()
            return unfinished


class Subscribers:
    """The open Outputs streams by subscriber id."""

    def __init__(self, release_slot: Callable[[], None], abort: Callable[[str], object]) -> None:
        self._release_slot = release_slot
        self._abort = abort
        self._lock = threading.Lock()
        self._open: dict[str, Subscriber] = {}
        self._draining = False

    def drain(self) -> None:
        """Each stream ends once nothing is attached to it (checked at least every second)."""
        self._draining = True

    def get(self, subscriber_id: str) -> Subscriber | None:
        with self._lock:
            return self._open.get(subscriber_id)

    def serve(self, subscriber_id: str, is_active: Callable[[], bool]) -> Iterator[pb.DecodeOutputs]:
        """The Outputs stream of `subscriber_id` while `is_active()`; aborts what it leaves."""
        subscriber = Subscriber(subscriber_id, self._release_slot)
        with self._lock:
            previous = self._open.get(subscriber_id)
            self._open[subscriber_id] = subscriber
        if previous is not None:
            self._end(previous)
        try:
            yield pb.DecodeOutputs()  # open: Decode calls may name it now
            while is_active() and not subscriber.closed and not (self._draining and subscriber.idle()):
                message = subscriber.next_message(_WAKE_S)
                if message is not None:
                    yield message
        finally:
            with self._lock:
                if self._open.get(subscriber_id) is subscriber:
                    del self._open[subscriber_id]
            self._end(subscriber)

    def _end(self, subscriber: Subscriber) -> None:
        for request_id in subscriber.close():
            self._abort(request_id)
