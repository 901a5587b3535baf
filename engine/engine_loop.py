"""The engine core on its own thread, for servers: requests in from any thread, a stream
of deltas out per request.

Lifecycle of a request in the loop:
  1. `add` (or `reserve`, decode role) registers a RequestStream and hands the request to
     the engine thread; nothing else ever touches the EngineCore.
  2. The engine thread steps while there is work; each step's updates become StreamDeltas
     (new tokens, new text, logprobs) on the request's stream: the first token at once,
     later ones once `stream_interval` of them have piled up (EngineConfig), the last at
     once. Stop strings are found here and finish the request in the core; text that might
     be the start of a stop string is held back until it is known not to be one.
  3. The last delta of a stream has `finish_reason` set ("stop", "length", "abort"). An
     abort from any thread (`abort`) ends the stream with "abort" and frees its blocks.
     A stream `attach`ed to a DeltaSink hands its deltas to the sink instead, one call per
     step with every attached stream's deltas of that step (a server sends them as one
     message, not one message per request per token).
  4. Decode role: reservations whose lease ran out are aborted by the loop, after the
     `before_abort` hook (the KV receiver's cancel) guarantees nothing more lands in them.

Health: `problem()` says why the loop cannot serve (None when it can): its thread died (every
open stream then ends with an error and every later call raises EngineDeadError at once),
or one iteration has run longer than `stall_timeout_s` (a wedged step). Servers turn that
into NOT_SERVING, so the router stops sending here.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from vllm_cluster.engine.detokenizer import IncrementalDetokenizer
from vllm_cluster.engine.engine_core import EngineCore, EngineStats
from vllm_cluster.engine.errors import EngineDeadError
from vllm_cluster.engine.kv_push import KVPush
from vllm_cluster.engine.request import Request, TokenLogprobs
from vllm_cluster.engine.scheduler import RequestUpdate, SampledToken

logger = logging.getLogger(__name__)

T = TypeVar("T")
_IDLE_WAIT_S = 0.05  # how often an idle loop checks leases


@dataclass(frozen=True, slots=True)
class StreamDelta:
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs]
    finish_reason: str | None = None  # set on the last delta only
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    queue_s: float = 0.0  # arrival -> first scheduled (0 until then)
    error: str | None = None  # why an aborted stream ended, when not asked to by a client
    # SamplingParams.prompt_logprobs, on the first delta: prompt tokens 1, 2, ... (none when
    # the prompt was computed elsewhere: a decode instance that received its KV)
    prompt_logprobs: list[TokenLogprobs] | None = None

    def then(self, later: StreamDelta) -> StreamDelta:
        """This delta followed by `later`, as one: tokens, text and logprobs joined, the
        rest as of `later`."""
        return StreamDelta(
            self.token_ids + later.token_ids, self.text + later.text, self.logprobs + later.logprobs,
            later.finish_reason, later.stop_reason, later.num_prompt_tokens, later.num_output_tokens,
            later.num_cached_tokens, later.queue_s or self.queue_s, later.error,
            self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
        )  # fmt: skip


class DeltaSink(Protocol):
    """Where attached streams' deltas go: called on the engine thread, once per step with
    that step's (request id, delta) pairs in order; must not block."""

    def put_deltas(self, deltas: list[tuple[str, StreamDelta]]) -> None: ...


class RequestStream:
    """Deltas of one request, in order; iterate it from one consumer thread, or attach it to a
    DeltaSink (EngineLoop.attach)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: queue.Queue[StreamDelta] = queue.Queue()
        self.finished = False
        self.sink: DeltaSink | None = None  # set on the engine thread only

    def put(self, delta: StreamDelta) -> None:
        self._queue.put(delta)

    def get(self, timeout_s: float | None = None) -> StreamDelta:
        """The next delta; raises queue.Empty after `timeout_s`."""
        return self._queue.get(timeout=timeout_s)

    def get_nowait(self) -> StreamDelta:
        return self._queue.get_nowait()

    def __iter__(self) -> Iterator[StreamDelta]:
        while True:
            delta = self._queue.get()
            yield delta
            if delta.finish_reason is not None:
                return

    def coalesced(self) -> Iterator[StreamDelta]:
        """Like iterating, but every delta that has piled up while the consumer was busy
        comes as one: a consumer slower than the engine's steps (a server streaming many
        requests) sends fewer, larger messages instead of falling further behind."""
        while True:
            delta = self._queue.get()
            while delta.finish_reason is None:
                try:
                    delta = delta.then(self._queue.get_nowait())
                except queue.Empty:
                    break
            yield delta
            if delta.finish_reason is not None:
                return


@dataclass(slots=True)
class _Tracked:
    request: Request
    stream: RequestStream
    detokenizer: IncrementalDetokenizer | None
    num_sent_chars: int = 0
    num_sent_logprobs: int = 0
    hold_back_chars: int = 0  # longest stop string - 1
    unsent: list[int] = field(default_factory=list)  # tokens waiting for the stream interval
    num_sent_tokens: int = 0


class EngineLoop:
    def __init__(
        self,
        core: EngineCore,
        tokenizer: Any | None,
        before_abort: Callable[[str], None] | None = None,
        stall_timeout_s: float = 120.0,
    ) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self._before_abort = before_abort
        self._commands: queue.Queue[tuple[Callable[[], None], Future[Any]]] = queue.Queue()
        self._tracked: dict[str, _Tracked] = {}
        self._stopped = threading.Event()
        self.num_expired_leases = 0  # decode role, since start; written by the engine thread only
        # Refreshed by the engine thread after every iteration: readers never wait for a step
        # (a long prefill step must not make health checks time out).
        self._stats: EngineStats = core.stats()
        self._stream_interval = core.config.stream_interval
        self.stall_timeout_s = stall_timeout_s
        self._iteration_started = time.monotonic()
        self._error: BaseException | None = None  # why the engine thread died
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- called from any thread

    def call(self, fn: Callable[[EngineCore], T], timeout_s: float | None = 60.0) -> T:
        """Run `fn(core)` on the engine thread and return its result (or raise its error)."""
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(fn(self.core))
            except BaseException as e:  # handed to the caller, never kills the loop
                future.set_exception(e)

        if self._error is not None:
            raise EngineDeadError(f"the engine loop died: {self._error!r}")
        self._commands.put((run, future))
        if self._error is not None:  # died while we queued: nobody will run it
            self._fail_commands()
        return future.result(timeout=timeout_s)

    def problem(self) -> str | None:
        """Why this engine cannot serve now, or None when it can."""
        if self._error is not None or not self._thread.is_alive():
            return f"the engine loop died: {self._error!r}"
        stalled = time.monotonic() - self._iteration_started
        if stalled > self.stall_timeout_s:
            return f"the engine loop has been stuck in one step for {stalled:.0f}s"
        return None

    def stats(self) -> EngineStats:
        """The engine's counters as of its last loop iteration (at most one step old)."""
        return self._stats

    def add(self, request: Request, kv_push: KVPush | None = None) -> RequestStream:
        def add(core: EngineCore) -> RequestStream:
            core.add_request(request, kv_push)
            return self._track(request)

        return self.call(add)

    def reserve(self, request: Request, lease_s: float) -> tuple[list[int], RequestStream] | None:
        """Decode role: (block ids, stream) or None when the blocks do not fit."""

        def reserve(core: EngineCore) -> tuple[list[int], RequestStream] | None:
            block_ids = core.reserve(request, lease_s)
            return None if block_ids is None else (block_ids, self._track(request))

        return self.call(reserve)

    def land(self, request_id: str, first_token: SampledToken | None) -> bool:
        """Decode role: start decoding (see EngineCore.land); False if the reservation is gone."""

        def land(core: EngineCore) -> bool:
            if not core.is_transferring(request_id):
                return False
            update = core.land(request_id, first_token)
            if update is not None:
                self._dispatch([update])
            return True

        return self.call(land)

    def attach(self, stream: RequestStream, sink: DeltaSink) -> None:
        """From now on `stream`'s deltas go to `sink`, those it holds already first."""

        def attach(core: EngineCore) -> None:
            pending: list[tuple[str, StreamDelta]] = []
            while True:
                try:
                    pending.append((stream.request_id, stream.get_nowait()))
                except queue.Empty:
                    break
            stream.sink = sink
            if pending:
                sink.put_deltas(pending)

        self.call(attach)

    def abort(self, request_id: str, error: str | None = None) -> bool:
        """Abort a request wherever it is; ends its stream. False if it was already done."""
        return self.call(lambda core: self._abort(request_id, error))

    def stop(self) -> None:
        self._stopped.set()
        self._commands.put((lambda: None, Future()))
        self._thread.join(timeout=10)

    # ---- the engine thread

    def _track(self, request: Request) -> RequestStream:
        stream = RequestStream(request.request_id)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.sampling_params)
        hold_back = max((len(s) for s in request.sampling_params.stop), default=1) - 1
        self._tracked[request.request_id] = _Tracked(request, stream, detok, hold_back_chars=hold_back)
        return stream

    def _abort(self, request_id: str, error: str | None) -> bool:
        tracked = self._tracked.pop(request_id, None)
        if self._before_abort is not None:
            self._before_abort(request_id)
        request = self.core.abort(request_id)
        self._stats = self.core.stats()  # before the stream ends: its reader may check stats next
        if tracked is not None:
            _deliver([(tracked.stream, self._delta(tracked, "abort", None, error=error))])
        return request is not None

    def _run(self) -> None:
        try:
            self._serve_forever()
        except BaseException as e:
            logger.exception("the engine loop died; failing every request it holds")
            self._error = e
            error = f"the engine loop died: {e!r}"
            ended = [(tracked.stream, self._delta(tracked, "abort", None, error=error))
                     for tracked in self._tracked.values()]
            self._tracked.clear()
            _deliver(ended)
            self._fail_commands()

    def _fail_commands(self) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.done():
                future.set_exception(EngineDeadError(f"the engine loop died: {self._error!r}"))

    def _serve_forever(self) -> None:
        while not self._stopped.is_set():
            self._iteration_started = time.monotonic()
            busy = self.core.has_unfinished()
            try:
                command, _ = self._commands.get_nowait() if busy else self._commands.get(timeout=_IDLE_WAIT_S)
                self._iteration_started = time.monotonic()  # the idle wait is not a stall
                command()
                while True:
                    self._commands.get_nowait()[0]()
            except queue.Empty:
                pass
            for request_id in self.core.expired_leases():
                logger.warning("reservation %s expired before its KV arrived; freeing its blocks", request_id)
                self.num_expired_leases += 1
                self._abort(request_id, "the reservation's lease expired before decoding started")
            if self.core.has_unfinished():
                try:
                    self._dispatch(self.core.step())
                except Exception:
                    logger.exception("engine step failed; aborting the requests in it")
                    for request_id in list(self._tracked):
                        if not self.core.is_transferring(request_id):
                            self._abort(request_id, "the engine step failed")
            self._stats = self.core.stats()

    def _dispatch(self, updates: list[RequestUpdate]) -> None:
        outgoing: list[tuple[RequestStream, StreamDelta]] = []
        for update in updates:
            request_id = update.request.request_id
            tracked = self._tracked.get(request_id)
            if tracked is None:
                continue
            stop = None
            if tracked.detokenizer is not None:
                stop = tracked.detokenizer.update(update.new_token_ids)
            finish_reason = stop_reason = None
            if stop is not None and not update.finished:
                self.core.finish_stopped(request_id, stop)
            if stop is not None or update.finished:
                finish_reason = "stop" if stop is not None else update.request.status.finish_reason
                stop_reason = stop if stop is not None else update.request.stop_reason
                del self._tracked[request_id]
            tracked.unsent += update.new_token_ids
            first = tracked.num_sent_tokens == 0
            if finish_reason is None and not first and len(tracked.unsent) < self._stream_interval:
                continue  # the stream interval: these go with the next ones
            outgoing.append((tracked.stream, self._delta(tracked, finish_reason, stop_reason)))
        if any(delta.finish_reason is not None for _, delta in outgoing):
            self._stats = self.core.stats()  # before a stream ends: its reader may check stats next
        _deliver(outgoing)

    def _delta(
        self,
        tracked: _Tracked,
        finish_reason: str | None,
        stop_reason: int | str | None,
        error: str | None = None,
    ) -> StreamDelta:
        """Everything of `tracked` not sent yet: its unsent tokens, their text and logprobs."""
        request = tracked.request
        token_ids, tracked.unsent = tracked.unsent, []
        first = tracked.num_sent_tokens == 0 and bool(token_ids)
        tracked.num_sent_tokens += len(token_ids)
        text = tracked.detokenizer.text if tracked.detokenizer is not None else ""
        # Hold back what could still turn out to be the start of a stop string.
        end = (
            len(text)
            if finish_reason is not None
            else max(tracked.num_sent_chars, len(text) - tracked.hold_back_chars)
        )
        new_text = text[tracked.num_sent_chars : end]
        tracked.num_sent_chars = end
        logprobs = request.output_logprobs[tracked.num_sent_logprobs :]
        tracked.num_sent_logprobs = len(request.output_logprobs)
        started = request.first_scheduled_time
        return StreamDelta(
            token_ids=token_ids,
            text=new_text,
            logprobs=list(logprobs),
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            queue_s=0.0 if started is None else started - request.arrival_time,
            error=error,
            prompt_logprobs=list(request.prompt_logprobs) if first and request.prompt_logprobs else None,
        )


def _deliver(outgoing: list[tuple[RequestStream, StreamDelta]]) -> None:
    """Each delta to its stream, or, for attached streams, to their sinks: one call per sink."""
    batches: dict[int, tuple[DeltaSink, list[tuple[str, StreamDelta]]]] = {}
    for stream, delta in outgoing:
        if stream.sink is None:
            stream.put(delta)
        else:
            batches.setdefault(id(stream.sink), (stream.sink, []))[1].append((stream.request_id, delta))
    for sink, deltas in batches.values():
        sink.put_deltas(deltas)


__all__ = ["DeltaSink", "EngineLoop", "RequestStream", "StreamDelta"]
