"""Admission control: a bounded queue of requests waiting for room on a decode instance.

When every healthy decode instance answers Reserve with RESOURCE_EXHAUSTED, a request
joins the queue (`enter`: False when `max_queued` are waiting already: shed at once),
waits for a request to leave a decode instance (`wait_for_room`, woken by `room_freed`)
and tries again, until its deadline; it leaves the queue (`leave`) however it ends. The
requests already admitted keep their latency: the queue never grows past its bound.
"""

from __future__ import annotations

import threading

_POLL_S = 0.2  # a wait also ends this often: the caller checks its deadline and aborts


class AdmissionQueue:
    def __init__(self, max_queued: int) -> None:
        self.max_queued = max_queued
        self.num_queued = 0
        self._room = threading.Condition()

    def enter(self) -> bool:
        with self._room:
            if self.num_queued >= self.max_queued:
                return False
            self.num_queued += 1
            return True

    def leave(self) -> None:
        with self._room:
            assert self.num_queued > 0
            self.num_queued -= 1

    def wait_for_room(self, timeout_s: float) -> None:
        with self._room:
            self._room.wait(timeout=min(_POLL_S, max(0.0, timeout_s)))

    def room_freed(self) -> None:
        """A request left a decode instance (its blocks are free, or about to be)."""
        with self._room:
            self._room.notify_all()
