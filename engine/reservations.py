"""Decode role: the leases on reserved blocks whose KV is still to arrive.

Lifecycle of one lease:
  1. `grant`: the scheduler has reserved blocks for a prompt (the request is TRANSFERRING);
     the lease runs until now + lease_s.
  2. `extend`: the request's Decode call has started; its deadline moves to now + lease_s.
  3. `release`: the KV has landed (or the request was aborted): the lease ends.
  4. `expired`: a lease past its deadline. The caller aborts the request, after making sure
     nothing more can land in its blocks; the abort releases the lease.

Invariants:
  - At most one lease per request id; only a granted, unreleased lease can be extended.
  - Deadlines are time.monotonic() seconds; `expired` changes nothing.
"""

from __future__ import annotations

import time

from vllm_cluster.engine.request import RequestId


class Leases:
    def __init__(self) -> None:
        self._deadlines: dict[RequestId, float] = {}  # monotonic seconds

    def __len__(self) -> int:
        return len(self._deadlines)

    def grant(self, request_id: RequestId, lease_s: float) -> None:
        assert request_id not in self._deadlines, f"request {request_id} already holds a lease"
        self._deadlines[request_id] = time.monotonic() + lease_s

    def extend(self, request_id: RequestId, lease_s: float) -> bool:
        """Push the deadline out to now + lease_s; False if the request holds no lease."""
        if request_id not in self._deadlines:
            return False
        self._deadlines[request_id] = time.monotonic() + lease_s
        return True

    def release(self, request_id: RequestId) -> None:
        self._deadlines.pop(request_id, None)

    def expired(self, now: float | None = None) -> list[RequestId]:
        """The leases whose deadline has passed at `now` (default: now), in grant order."""
        now = time.monotonic() if now is None else now
        return [rid for rid, deadline in self._deadlines.items() if deadline <= now]
