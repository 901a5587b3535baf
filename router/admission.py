"""Admission control: a bounded queue of requests waiting for room on a decode instance.

When every healthy decode instance answers Reserve with RESOURCE_EXHAUSTED, a request
joins the queue (`enter`: False when `max_queued` are waiting already: shed at once),
waits for a request to leave a decode instance (`wait_for_room`, woken by `room_freed`)
and tries again, until its deadline; it leaves the queue (`leave`) however it ends. The
requests already admitted keep their latency: the queue never grows past its bound.

A request turned away is told when to come back (`retry_after_s`): the time the requests
ahead of it need to leave at the rate requests have been leaving decode instances lately.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

_POLL_S = 0.2  # a wait also ends this often: the caller checks its deadline and aborts
RATE_WINDOW_S = 30.0  # departures older than this no longer count towards the rate
MAX_RETRY_AFTER_S = 60


class AdmissionQueue:
    def __init__(self, max_queued: int) -> None:
        self.max_queued = max_queued
        self.num_queued = 0
        self._room = threading.Condition()
        self._departures: deque[float] = deque(maxlen=1024)  # monotonic times requests left decode

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
            self._departures.append(time.monotonic())
            self._room.notify_all()

    def retry_after_s(self) -> int:
        """Whole seconds until the queue as it stands has drained, at the rate requests left
        decode instances over the last RATE_WINDOW_S (1 to MAX_RETRY_AFTER_S; 1 when none
        left lately: no rate to go by, and a refusal costs the router little)."""
        now = time.monotonic()
        with self._room:
            while self._departures and now - self._departures[0] > RATE_WINDOW_S:
                self._departures.popleft()
            if not self._departures:
                return 1
            span = max(now - self._departures[0], 1.0)
            per_s = len(self._departures) / span
            ahead = self.num_queued + 1
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(ahead / per_s)))
