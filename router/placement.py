"""Where a request's legs run: the prefix overlap of its prompt, the instances of a role
ranked by the routing policy, and the reservation on a decode instance.

`reserve` tries the ranked decode instances in turn; RESOURCE_EXHAUSTED (or a Reserve too
slow to answer) moves on to the next, UNAVAILABLE marks the instance unhealthy. When every
healthy one is full (or none is up, say while one restarts) the request waits in the
bounded admission queue (router/admission.py) until a request leaves a decode instance
(`room_freed`), one comes back, or `queue_timeout_s` passes; beyond `max_queued_requests`
it is shed at once with RESOURCE_EXHAUSTED, so the requests already admitted keep their
latency. A shed request's trailing metadata carries `retry-after-s`, from the queue
(`AdmissionQueue.retry_after_s`); the HTTP front sends it as Retry-After.
"""

from __future__ import annotations

import random
import threading
import time
from functools import partial
from typing import NoReturn

import grpc

from vllm_cluster.engine.block_hash import hash_block_tokens
from vllm_cluster.engine.config import EngineRole
from vllm_cluster.kv_index import PrefixIndex, TierOverlap
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.router.admission import AdmissionQueue
from vllm_cluster.router.calls import abort, end_aborted
from vllm_cluster.router.handoff import Handoff, HandoffState
from vllm_cluster.router.policy import PrefixWeights, rank
from vllm_cluster.router.registry import Instance, Registry
from vllm_cluster.worker.router_config import RouterConfig
from vllm_cluster.worker.rpc import RETRY_AFTER_KEY

# Full (RESOURCE_EXHAUSTED), too busy to answer in time (DEADLINE_EXCEEDED: load, counted as
# full, never as down), or down (UNAVAILABLE): the next instance is tried.
_RETRYABLE = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)


Overlap = dict[str, TierOverlap]  # prefix-index id -> a prompt's leading blocks held there, by tier


class Placement:
    def __init__(
        self, config: RouterConfig, registry: Registry, block_size: int, prefix_index: PrefixIndex | None
    ) -> None:
        self._config = config
        self._weights = PrefixWeights(
            config.prefix_weight_overlap, config.prefix_weight_usage, config.prefix_weight_load
        )
        self._registry = registry
        self._block_size = block_size
        self._prefix_index = prefix_index
        self._admission = AdmissionQueue(config.max_queued_requests)
        self._rng = random.Random()
        self._lock = threading.Lock()
        self._turn = 0

    def overlap(self, request: pb.WorkerRequest) -> dict[str, TierOverlap]:
        """Prefix-index id -> leading blocks of this prompt held, by tier ({} without an index)."""
        if self._prefix_index is None or self._config.policy != "prefix_aware":
            return {}
        hashes = hash_block_tokens(list(request.prompt_token_ids), self._block_size, tuple(request.extra_keys))
        return self._prefix_index.tier_overlap([bytes(h) for h in hashes]) if hashes else {}

    def rank(self, role: EngineRole, request: pb.WorkerRequest, overlap: dict[str, TierOverlap]) -> list[str]:
        """The healthy instances of `role`, best first."""
        num_blocks = len(request.prompt_token_ids) // self._block_size
        loads = self._registry.loads(role, overlap, request.lora_name or None)
        with self._lock:
            self._turn += 1
            turn = self._turn
        return rank(self._config.policy, loads, turn, self._rng, num_blocks, self._weights)

    def room_freed(self) -> None:
        """A request left a decode instance: queued requests try again."""
        self._admission.room_freed()

    def reserve(
        self, handoff: Handoff, request: pb.WorkerRequest, overlap: Overlap, context: grpc.ServicerContext
    ) -> tuple[Instance, pb.Reservation]:
        """Reserve on the best decode instance that has room, waiting in the admission queue
        while every healthy one is full or none is up; aborts the call when none can take
        the request.
        The caller releases the instance (`Registry.release`) when the request leaves it."""
        deadline = time.monotonic() + self._config.queue_timeout_s
        queued = False
        try:
            while True:
                found, full, down = self._try_reserve(handoff, request, overlap, context)
                if found is not None:
                    return found
                # Nothing up: decode instances that are registered but down (a restart brings one
                # back at its address) are waited for like full ones, up to queue_timeout_s;
                # none registered, or the wait over: UNAVAILABLE (HTTP 503). All full: 429.
                registered = bool(self._registry.of_role(EngineRole.DECODE))
                if not full and (not registered or time.monotonic() >= deadline):
                    self._none_up(context, down)
                if not queued:
                    queued = self._admission.enter()
                    if not queued and not full:
                        self._none_up(context, down)
                    if not queued:
                        self._shed(context, f"every decode instance is full ({'; '.join(full)}) and "
                                   f"{self._admission.num_queued} requests are queued")
                if full and time.monotonic() >= deadline:
                    self._shed(context, f"no decode instance had room within {self._config.queue_timeout_s:g}s "
                                        f"({'; '.join(full)})")
                if handoff.state == HandoffState.ABORTED:
                    end_aborted(context, handoff)
                self._admission.wait_for_room(deadline - time.monotonic())
        finally:
            if queued:
                self._admission.leave()

    def _shed(self, context: grpc.ServicerContext, why: str) -> NoReturn:
        """RESOURCE_EXHAUSTED (HTTP 429), with when to retry in the trailing metadata."""
        retry_after_s = self._admission.retry_after_s()
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(retry_after_s)),))
        abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{why}; retry in {retry_after_s} s")

    def _none_up(self, context: grpc.ServicerContext, down: list[str]) -> NoReturn:
        names = [i.name for i in self._registry.of_role(EngineRole.DECODE)]
        why = "; ".join(down) or (f"{', '.join(names)}: not answering health polls" if names else "none registered")
        abort(context, grpc.StatusCode.UNAVAILABLE, f"no healthy decode instance ({why}); retry later")

    def _try_reserve(
        self, handoff: Handoff, request: pb.WorkerRequest, overlap: Overlap, context: grpc.ServicerContext
    ) -> tuple[tuple[Instance, pb.Reservation] | None, list[str], list[str]]:
        """One pass over the ranked decode instances: (instance, reservation) or None, with
        why each failed: full (RESOURCE_EXHAUSTED) or down (UNAVAILABLE)."""
        full: list[str] = []
        down: list[str] = []
        for name in self.rank(EngineRole.DECODE, request, overlap):
            instance = self._registry.acquire(name)
            try:
                reservation = instance.stub.Reserve(
                    pb.ReserveRequest(request=request, lease_s=self._config.lease_s), timeout=10.0
                )
            except grpc.RpcError as e:
                self._registry.release(instance)
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    abort(context, e.code(), e.details())
                if e.code() not in _RETRYABLE:
                    abort(context, e.code(), f"{name}: {e.details()}")
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    self._registry.mark_unhealthy(instance)
                    down.append(f"{name}: {e.details()}")
                else:
                    full.append(f"{name}: {e.details()}")
                continue
            handoff.on_abort(
                partial(instance.stub.Release, pb.ReleaseRequest(request_id=request.request_id), timeout=5.0)
            )
            if not handoff.advance(HandoffState.RESERVED):
                self._registry.release(instance)
                end_aborted(context, handoff)
            return (instance, reservation), full, down
        return None, full, down
