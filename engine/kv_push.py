"""Prefill role: the KV pushes to the decode side, from request to confirmed send.

Lifecycle of one push:
  1. `PendingPushes.add`: the request enters with its KVPush (the decode's reserved blocks).
  2. `PendingPushes.take`, each step: a request whose prompt completes in this step (it
     samples) leaves the pending set for the step's `StepPushes`, with its source blocks:
     the prompt's blocks from `num_skip_blocks` (those the decode side lacks) on.
  3. `StepPushes.push_layer(layer)`: each layer of those blocks is queued as soon as the
     executor has written it (or, with tp > 1, after the whole step and the gather).
  4. `StepPushes.finish`, after the scheduler has applied the step: every queued send is
     confirmed (or failed; the KVPush records which).
  `PendingPushes.discard` drops an aborted request's push before it starts.

Invariants:
  - A push is taken at most once; a request's blocks are pushed only in the step that
    completes its prompt.
  - `finish` returns before any later step runs, so no block is reused under a send in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from vllm_cluster.engine.kv_cache_manager import KVCacheManager
from vllm_cluster.engine.request import Request, RequestId
from vllm_cluster.engine.scheduler_output import SchedulerOutput


class KVPush(Protocol):
    """Where a prefill request's KV goes: the decode's reserved blocks, one layer at a time."""

    num_skip_blocks: int  # leading prompt blocks the decode side already holds

    def push_layer(self, layer: int, src_block_ids: list[int]) -> None:
        """Queue layer `layer` of these blocks (prompt blocks from num_skip_blocks on)."""

    def finish(self) -> None:
        """Block until every queued layer is sent (or failed; the push records which)."""


@dataclass(slots=True)
class StepPushes:
    """The pushes of one step: each request whose prompt completes in it, with its blocks."""

    pushes: list[tuple[KVPush, list[int]]] = field(default_factory=list)

    @property
    def block_ids(self) -> list[int]:
        """Every source block of the step's pushes, sorted, once each."""
        return sorted({b for _, src_block_ids in self.pushes for b in src_block_ids})

    def push_layer(self, layer: int) -> None:
        for push, src_block_ids in self.pushes:
            push.push_layer(layer, src_block_ids)

    def finish(self) -> None:
        for push, _ in self.pushes:
            push.finish()


class PendingPushes:
    """The prefill requests whose KV is still to be pushed, by request id."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._pending: dict[RequestId, KVPush] = {}

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(self, request_id: RequestId, push: KVPush) -> None:
        assert request_id not in self._pending, f"request {request_id} already has a push"
        self._pending[request_id] = push

    def discard(self, request_id: RequestId) -> None:
        self._pending.pop(request_id, None)

    def take(self, output: SchedulerOutput, requests: dict[RequestId, Request]) -> StepPushes | None:
        """The pushes of the requests whose prompt completes in this step (None: none does)."""
        step = StepPushes()
        for item in output.scheduled:
            push = self._pending.pop(item.request_id, None) if item.samples else None
            if push is None:
                continue
            num_prompt_blocks = -(-requests[item.request_id].num_prompt_tokens // self.kv.block_size)
            table = self.kv.get_block_table(item.request_id)
            step.pushes.append((push, [int(b) for b in table[push.num_skip_blocks : num_prompt_blocks]]))
        return step if step.pushes else None
