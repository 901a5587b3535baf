"""The per-request state machine the router owns: both legs of a disaggregated request.

    NEW -> RESERVED -> PREFILLING -> TRANSFERRED -> DECODING -> FINISHED
                   \\-------------------------------/
    any state -> ABORTED (client abort or disconnect, deadline, a failed leg)
    DECODING -> NEW (restart: the decode instance was lost mid-stream; migrate the rest)

`advance` is the one place the state changes. `abort` is idempotent and releases both
legs: it cancels the calls in flight, then tells decode to free its reservation and
prefill to drop the prompt. Releases are best effort (an instance that died has nothing
left to free), and never raise.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


class HandoffState(enum.IntEnum):
    NEW = enum.auto()
    RESERVED = enum.auto()
    PREFILLING = enum.auto()
    TRANSFERRED = enum.auto()
    DECODING = enum.auto()
    FINISHED = enum.auto()
    ABORTED = enum.auto()

    @property
    def is_done(self) -> bool:
        return self >= HandoffState.FINISHED


_NEXT = {
    HandoffState.NEW: {HandoffState.RESERVED},
    HandoffState.RESERVED: {HandoffState.PREFILLING, HandoffState.DECODING},
    HandoffState.PREFILLING: {HandoffState.TRANSFERRED, HandoffState.DECODING},  # DECODING: recompute
    HandoffState.TRANSFERRED: {HandoffState.DECODING},
    HandoffState.DECODING: {HandoffState.FINISHED},
}


class InvalidTransition(RuntimeError):
    pass


@dataclass
class Handoff:
    request_id: str
    state: HandoffState = HandoffState.NEW
    abort_reason: str | None = None
    deadline_passed: bool = False  # the abort was the request's deadline (the client hears so)
    # Undo actions per leg, run once on abort: cancel a call, release blocks.
    _on_abort: list[Callable[[], Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def advance(self, to: HandoffState) -> bool:
        """Move forward; False if the request was aborted meanwhile (the caller stops)."""
        with self._lock:
            if self.state == HandoffState.ABORTED:
                return False
            if to not in _NEXT.get(self.state, set()):
                raise InvalidTransition(f"{self.request_id}: {self.state.name} -> {to.name}")
            self.state = to
            if to == HandoffState.FINISHED:
                self._on_abort.clear()
            return True

    def on_abort(self, undo: Callable[[], Any]) -> bool:
        """Register an undo action; False (and it runs now) if already aborted."""
        with self._lock:
            if self.state != HandoffState.ABORTED:
                self._on_abort.append(undo)
                return True
        _run_quietly(undo, self.request_id)
        return False

    def restart(self) -> bool:
        """A decode leg was lost mid-stream: undo that leg (best effort: its instance may be
        gone) and start over from NEW for the rest of the request. False if aborted."""
        with self._lock:
            if self.state.is_done:
                return False
            self.state = HandoffState.NEW
            undo, self._on_abort = self._on_abort, []
        for action in reversed(undo):
            _run_quietly(action, self.request_id)
        return True

    def abort(self, reason: str, deadline_passed: bool = False) -> bool:
        """Abort both legs; False if already finished or aborted."""
        with self._lock:
            if self.state.is_done:
                return False
            self.state = HandoffState.ABORTED
            self.abort_reason = reason
            self.deadline_passed = deadline_passed
            undo, self._on_abort = self._on_abort, []
        logger.info("aborting %s: %s", self.request_id, reason)
        for action in reversed(undo):
            _run_quietly(action, self.request_id)
        return True


def _run_quietly(action: Callable[[], Any], request_id: str) -> None:
    try:
        action()
    except Exception as e:  # a dead instance has nothing to release; the abort goes on
        logger.debug("release step for %s failed: %s", request_id, e)
