"""The router's end of each decode instance's Outputs stream: one stream per instance carries
every engine step's tokens of all this router's requests there, and is split here into one
queue per request.

Lifecycle of a request's outputs:
  1. `open(instance, request_id)` before the request's Decode call registers its queue. The
     first request on an instance (or the first after that instance's stream broke) opens the
     stream and waits for its first, empty, message: the instance knows the stream then.
  2. The stream's reader thread puts each output on its request's queue (an output for a
     request no longer registered, aborted or finished here, is dropped).
  3. The request's relay iterates its RequestOutputs: responses until the one with a finish
     reason; outputs that piled up while the relay was busy come joined as one response. An
     output with an error, or the stream breaking, raises OutputsLost in every request still
     registered on it (the router replays them elsewhere); `cancel()` ends the iteration
     (the request was aborted here).
  4. `close()` unregisters the request, whatever happened.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from vllm_cluster.proto import cluster_pb2 as pb

logger = logging.getLogger(__name__)

_OPEN_TIMEOUT_S = 10.0  # for an instance to answer a new stream's first message


class OutputsLost(Exception):
    """The request's outputs will not come: `code` says why, as a gRPC status would."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name} {details}")
        self.code = code
        self.details = details


_Item = pb.DecodeOutput | OutputsLost | None  # None: cancelled


class RequestOutputs:
    """One request's outputs, from one decode instance's stream; iterate from one thread."""

    def __init__(self, request_id: str, unregister: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._unregister = unregister
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._held: _Item = None  # taken off the queue while joining, not yet handed out
        self._has_held = False

    def put(self, item: _Item) -> None:
        self._queue.put(item)

    def cancel(self) -> None:
        self._queue.put(None)

    def close(self) -> None:
        self._unregister(self.request_id)

    def __iter__(self) -> Iterator[pb.GenerateResponse]:
        while True:
            item = self._next()
            if item is None:
                return
            if isinstance(item, OutputsLost):
                raise item
            if item.error:
                raise OutputsLost(grpc.StatusCode.ABORTED, item.error)
            response = item.response
            while not response.finish_reason:  # join what piled up behind it
                try:
                    later = self._queue.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(later, pb.DecodeOutput) or later.error:
                    self._held, self._has_held = later, True
                    break
                _join(response, later.response)
            yield response
            if response.finish_reason:
                return

    def _next(self) -> _Item:
        if self._has_held:
            self._has_held = False
            return self._held
        return self._queue.get()


def _join(response: pb.GenerateResponse, later: pb.GenerateResponse) -> None:
    """`response` followed by `later`, as one (timings and prompt logprobs stay the first's)."""
    response.token_ids.extend(later.token_ids)
    response.text += later.text
    response.logprobs.extend(later.logprobs)
    response.finish_reason = later.finish_reason
    response.stop_reason = later.stop_reason
    if later.HasField("usage"):
        response.usage.CopyFrom(later.usage)


@dataclass
class _Stream:
    """One Outputs call to one instance and the requests registered on it."""

    call: Any
    requests: dict[str, RequestOutputs] = field(default_factory=dict)
    ready: threading.Event = field(default_factory=threading.Event)
    lost: OutputsLost | None = None


class DecodeOutputs:
    """This router's Outputs streams, one per decode instance (by name and address)."""

    def __init__(self) -> None:
        self.subscriber_id = f"router-{uuid.uuid4().hex}"
        self._lock = threading.Lock()
        self._streams: dict[tuple[str, str], _Stream] = {}

    def open(self, name: str, address: str, stub: Any, request_id: str) -> RequestOutputs:
        """Register `request_id` on the instance's stream (opened if need be); raises
        OutputsLost when the stream cannot be opened."""
        key = (name, address)
        with self._lock:
            stream = self._streams.get(key)
            if stream is None or stream.lost is not None:
                stream = self._start(key, stub)
            outputs = RequestOutputs(request_id, lambda rid: self._unregister(stream, rid))
            stream.requests[request_id] = outputs
        if not stream.ready.wait(_OPEN_TIMEOUT_S):
            outputs.close()
            raise OutputsLost(grpc.StatusCode.UNAVAILABLE, f"{name} did not open its Outputs stream in time")
        if stream.lost is not None:
            outputs.close()
            raise stream.lost
        return outputs

    def _start(self, key: tuple[str, str], stub: Any) -> _Stream:
        call = stub.Outputs(pb.OutputsRequest(subscriber_id=self.subscriber_id))
        stream = _Stream(call)
        self._streams[key] = stream
        threading.Thread(target=self._read, args=(key, stream), name=f"outputs-{key[0]}", daemon=True).start()
        return stream

    def _unregister(self, stream: _Stream, request_id: str) -> None:
        with self._lock:
            stream.requests.pop(request_id, None)

    def _read(self, key: tuple[str, str], stream: _Stream) -> None:
        try:
            for message in stream.call:
                stream.ready.set()
                with self._lock:  # once per message, not per request in it
                    targets = [(stream.requests.get(o.response.request_id), o) for o in message.outputs]
                for target, output in targets:
                    if target is not None:
                        target.put(output)
            lost = OutputsLost(grpc.StatusCode.UNAVAILABLE, f"{key[0]} ended its Outputs stream (draining)")
        except grpc.RpcError as e:
            lost = OutputsLost(e.code(), e.details() or "the Outputs stream broke")
        logger.info("Outputs stream of %s ended: %s", key[0], lost)
        with self._lock:
            stream.lost = lost
            orphans = list(stream.requests.values())
            stream.requests.clear()
            if self._streams.get(key) is stream:
                del self._streams[key]
        stream.ready.set()
        for outputs in orphans:
            outputs.put(lost)

    def close(self) -> None:
        """Ends every stream (the router is stopping)."""
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.call.cancel()
