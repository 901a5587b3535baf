"""The instances the router knows, their gRPC stubs, and their health and load.

A poller thread asks every instance for Stats each `interval_s`, all at once. Health
measures liveness, not speed: a poll that misses its deadline makes an instance "slow"
(still routed to), and only MISSES_BEFORE_DEAD misses in a row, or an answer that says it
cannot serve or cannot be reached (UNAVAILABLE and the like), make it unhealthy, until it
answers again. The router's own in-flight count per instance is kept here too: it is fresh
where polled stats lag.

The pools change while the router runs (`vllm-cluster scale`, the autoscaler, through the
admin service): `add` routes to a new instance from its first healthy poll; `remove` takes
one out of routing at once (a request already ranked onto it may still reserve there) and
moves it to the draining set, where it stays, unpolled, until its in-flight count reaches
0 and `remove` is asked again; then it is forgotten, though a request ranked onto it a
moment before still gets it from `acquire` (and, once it has stopped, moves on to another
instance as from any instance that went away).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import grpc

from vllm_cluster.engine.config import EngineRole
from vllm_cluster.kv_index import TierOverlap
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.router.policy import InstanceLoad
from vllm_cluster.worker.rpc import make_channel

logger = logging.getLogger(__name__)

MISSES_BEFORE_DEAD = 3  # Stats polls in a row that miss their deadline


@dataclass
class Instance:
    name: str
    role: EngineRole  # PREFILL | DECODE
    address: str
    channel: grpc.Channel
    stub: Any  # PrefillWorkerStub | DecodeWorkerStub
    healthy: bool = False
    stats: pb.WorkerStats = field(default_factory=pb.WorkerStats)
    num_inflight: int = 0
    missed_polls: int = 0  # in a row; reset by an answer

    @property
    def index_id(self) -> str:
        """This instance's id in the prefix index (see worker.main.instance_id)."""
        return f"{self.role}@{self.address}"

    def load(
        self, num_cached_blocks: int = 0, lora_name: str | None = None, num_host_blocks: int = 0,
        num_disk_blocks: int = 0,
    ) -> InstanceLoad:
        return InstanceLoad(
            name=self.name,
            healthy=self.healthy,
            num_inflight=self.num_inflight,
            num_waiting=self.stats.num_waiting,
            num_running=self.stats.num_running,
            kv_cache_usage=self.stats.kv_cache_usage,
            num_cached_blocks=num_cached_blocks,
            num_host_blocks=num_host_blocks,
            num_disk_blocks=num_disk_blocks,
            lora_resident=lora_name is not None and lora_name in self.stats.lora_resident_names,
            lora_loaded=lora_name is None or lora_name in self.stats.lora_names,
        )


class Registry:
    def __init__(
        self, prefill: list[str], decode: list[str], token: str | None, interval_s: float = 0.5,
        poll_timeout_s: float | None = None,
    ) -> None:
        """`poll_timeout_s`: a Stats poll's deadline (default: 4 intervals, at least 2 s)."""
        self._lock = threading.Lock()
        self._token = token
        self.instances: dict[str, Instance] = {}  # routed to; replaced whole on a change, never mutated
        self._draining: dict[str, Instance] = {}  # removed, requests still on them
        self._gone: dict[str, Instance] = {}  # drained and forgotten: only `acquire` finds them
        self._num_added = {EngineRole.PREFILL: 0, EngineRole.DECODE: 0}
        for role, addresses in ((EngineRole.PREFILL, prefill), (EngineRole.DECODE, decode)):
            for address in addresses:
                self._add_locked(EngineRole(role), address, "")
        self._interval_s = interval_s
        self._poll_timeout_s = poll_timeout_s if poll_timeout_s is not None else max(2.0, interval_s * 4)
        self._stopped = threading.Event()
        self.poll()
        self._thread = threading.Thread(target=self._poll_forever, name="registry-poll", daemon=True)
        self._thread.start()

    def add(self, role: EngineRole, address: str, name: str = "") -> tuple[str, bool]:
        """Route to the instance at `address` once a poll finds it healthy. Returns (its name,
        whether it is new: False when an instance at that address is routed to already)."""
        with self._lock:
            for instance in self.instances.values():
                if instance.address == address:
                    return instance.name, False
            instance = self._add_locked(role, address, name)
        logger.info("%s at %s added", instance.name, address)
        return instance.name, True

    def remove(self, address: str) -> tuple[bool, int]:
        """Stop routing to the instance at `address`. Returns (whether one was there, routed
        or draining; the requests of this router still on it). At 0 it is forgotten."""
        with self._lock:
            found = next((i for i in self.instances.values() if i.address == address), None)
            if found is not None:
                self.instances = {n: i for n, i in self.instances.items() if i is not found}
                self._draining[found.name] = found
                logger.info("%s at %s removed: draining %d requests", found.name, address, found.num_inflight)
            draining = next((i for i in self._draining.values() if i.address == address), None)
            if draining is None:
                return False, 0
            if draining.num_inflight == 0:
                self._gone[draining.name] = self._draining.pop(draining.name)
            return True, draining.num_inflight

    def draining(self) -> list[Instance]:
        with self._lock:
            return list(self._draining.values())

    def _add_locked(self, role: EngineRole, address: str, name: str) -> Instance:
        """`name` ("" or taken by another instance: the next free `<role>-<n>`)."""
        if not name or name in self.instances or name in self._draining:
            name = f"{role}-{self._num_added[role]}"
            while name in self.instances or name in self._draining:
                self._num_added[role] += 1
                name = f"{role}-{self._num_added[role]}"
            self._num_added[role] += 1
        stub_type = pb_grpc.PrefillWorkerStub if role == EngineRole.PREFILL else pb_grpc.DecodeWorkerStub
        channel = make_channel(address, self._token)
        instance = Instance(name, role, address, channel, stub_type(channel))
        self.instances = {**self.instances, name: instance}
        return instance

    def of_role(self, role: EngineRole) -> list[Instance]:
        return [i for i in self.instances.values() if i.role == role]

    def loads(
        self, role: EngineRole, overlap: dict[str, TierOverlap] | None = None, lora_name: str | None = None
    ) -> list[InstanceLoad]:
        """`overlap`: prefix-index id -> leading blocks of the prompt it holds, by tier."""
        overlap = overlap or {}
        none = TierOverlap()
        with self._lock:
            return [
                i.load(o.num_device, lora_name, o.num_host, o.num_disk)
                for i in self.of_role(role)
                for o in [overlap.get(i.index_id, none)]
            ]

    def lora_names(self) -> set[str]:
        """The LoRA adapters some instance reported loaded at its last Stats."""
        with self._lock:
            return {name for i in self.instances.values() for name in i.stats.lora_names}

    def acquire(self, name: str) -> Instance:
        """`name` was ranked a moment ago: it may be draining since (it takes the request)."""
        with self._lock:
            instance = self.instances.get(name) or self._draining.get(name) or self._gone[name]
            instance.num_inflight += 1
            return instance

    def release(self, instance: Instance) -> None:
        with self._lock:
            instance.num_inflight -= 1

    def mark_unhealthy(self, instance: Instance) -> None:
        """A call found it unreachable: out of routing until a poll finds it again."""
        with self._lock:
            if instance.healthy:
                logger.warning("%s at %s is unhealthy: a call found it unreachable", instance.name, instance.address)
            instance.healthy = False

    def poll(self) -> None:
        timeout_s = self._poll_timeout_s
        calls = [(i, i.stub.Stats.future(pb.StatsRequest(), timeout=timeout_s)) for i in list(self.instances.values())]
        for instance, call in calls:
            try:
                stats = call.result()
            except grpc.RpcError as e:
                self._missed(instance, e.code())
                continue
            with self._lock:
                if not instance.healthy:
                    logger.info("%s at %s is healthy", instance.name, instance.address)
                instance.healthy = True
                instance.missed_polls = 0
                instance.stats = stats

    def _missed(self, instance: Instance, code: grpc.StatusCode) -> None:
        with self._lock:
            instance.missed_polls += 1
            slow = code == grpc.StatusCode.DEADLINE_EXCEEDED and instance.missed_polls < MISSES_BEFORE_DEAD
            if slow:
                logger.info("%s at %s is slow: %d Stats polls in a row missed their deadline",
                            instance.name, instance.address, instance.missed_polls)
                return
            if instance.healthy:
                logger.warning("%s at %s is unhealthy: %s (%d polls in a row unanswered)",
                               instance.name, instance.address, code, instance.missed_polls)
            instance.healthy = False

    def _poll_forever(self) -> None:
        while not self._stopped.wait(self._interval_s):
            self.poll()

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        for instance in [*self.instances.values(), *self._draining.values(), *self._gone.values()]:
            instance.channel.close()
