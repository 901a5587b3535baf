"""`vllm-cluster scale -f FILE --prefill N --decode M`: grow or shrink a running cluster's pools.

1. Read the state file and the cluster YAML it names (the same `--set` overrides as `up`),
   join the cluster's Ray, and tell the router every instance the file has (a router
   its watchdog restarted knows only those it was started with). Only a cluster of
   `up --detach` is scaled from outside: a foreground `up` owns its actors (its
   autoscaler scales it from inside, through `PoolScaler`).
2. Which instances come and go: cluster/scale_plan.py (pure).
3. Growing: the new instances are placed through Ray as `up` places them
   (cluster/ray_cluster.py), with the cluster's token and Redis; once each serves, the
   router is told (its admin service, router/admin.py) and routes to it from its first
   healthy poll, which this waits for.
4. Shrinking: the router stops routing to the chosen instances at once; this asks it again
   until none of its requests is left on them (up to router.drain_grace_s), then stops
   each through its actor (SIGTERM: the worker's own drain), and its actors and placement
   group go.
5. The state file is rewritten after each step, so `status` and `down` see the new pools.

A stop request (`PoolScaler.stopping`, set by the autoscaler's stop) ends a step in flight
within a bounded time: a placement under way gives up (ScaleStopped) and what it placed
goes; instances placed already stay, and the router routes to them once they answer; a
shrink stops waiting for the router's drain and stops its instance at once (the worker's
own SIGTERM drain, up to router.drain_grace_s).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from vllm_cluster.cluster.config import ROLES, Deployment
from vllm_cluster.cluster.config_file import load_deployment
from vllm_cluster.cluster.procs import terminate
from vllm_cluster.cluster.restarts import current_process
from vllm_cluster.cluster.scale_plan import PoolChange, PoolSizes, plan_change
from vllm_cluster.cluster.state import ClusterState, ProcessRecord
from vllm_cluster.cluster.status import find_state
from vllm_cluster.engine.errors import ConfigError
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.worker.rpc import make_channel

_ROUTED_TIMEOUT_S = 60.0  # a new instance's first healthy poll at the router
_ADMIN_TIMEOUT_S = 10.0


class ScaleError(RuntimeError):
    """A step that could not be done; the message says which and why."""


class ScaleStopped(ScaleError):
    """A stop request ended the step in flight; the message says what was left done."""


def scale_main(args: argparse.Namespace) -> int:
    try:
        path, state = find_state(args)
        deployment = load_deployment(state.config_file, args.overrides)
        sizes = pool_sizes(state)
        wanted = PoolSizes(sizes.num_prefill if args.prefill is None else args.prefill,
                           sizes.num_decode if args.decode is None else args.decode)
        wanted.check()
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if state.owner is not None:
        print(f"error: cluster {state.name!r} belongs to a foreground `vllm-cluster up` (pid {state.owner.pid}), "
              "whose actors end with it: bring it up with `up --detach` to scale it from outside, or turn on "
              "its autoscaler (the autoscaler: section)", file=sys.stderr)
        return 1
    scaler = PoolScaler(deployment, state, path, detached=True)
    try:
        if wanted == sizes:  # the router is still told the pools; Ray is not needed
            scaler.sync_router()
            print(f"cluster {state.name!r}: already {wanted.num_prefill} prefill + {wanted.num_decode} decode; "
                  "nothing to change")
            return 0
        from vllm_cluster.cluster.ray_head import connect

        connect(state.ray_address, state.ray_namespace, local=state.ray_head is not None)
        scaler.scale(wanted)
    except ScaleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except grpc.RpcError as e:
        print(f"error: the router at {state.router_address} did not answer: {e.code().name} {e.details()}; "
              "`vllm-cluster status` shows whether it runs", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: `vllm-cluster status` shows the pools as they are now", file=sys.stderr)
        return 130
    return 0


def pool_sizes(state: ClusterState) -> PoolSizes:
    roles = [r.role for r in state.processes]
    return PoolSizes(roles.count("prefill"), roles.count("decode"))


class PoolScaler:
    """Changes the pools of the cluster `state` describes (this process joined its Ray)."""

    def __init__(
        self, deployment: Deployment, state: ClusterState, path: Path, detached: bool,
        log: Callable[[str], None] = lambda line: print(line, flush=True),
    ) -> None:
        self.deployment = deployment
        self.state = state
        self._path = path
        self._detached = detached
        self._log = log
        self._placed: list[object] = []  # the RayClusters of instances placed here (stopped with `stop`)
        self.stopping = threading.Event()  # set from another thread: the step in flight ends (module docstring)

    def scale(self, wanted: PoolSizes) -> PoolChange:
        self.sync_router()
        names = [r.name for r in self.state.processes if r.role in ROLES]
        change = plan_change(self.deployment, names, wanted, use_gpus=self.deployment.engine.device != "cpu")
        if change.add:
            self._grow(change)
        for name in change.remove:
            self._shrink(self.state.record(name))
        return change

    def sync_router(self) -> None:
        """Tell the router every instance the state file has (a router restarted by its
        watchdog knows only those it was started with); it ignores those it knows."""
        with self._admin() as admin:
            for record in self.state.processes:
                if record.role in ROLES:
                    admin.AddInstance(pb.AddInstanceRequest(role=record.role, address=record.address,
                                                            name=record.name), timeout=_ADMIN_TIMEOUT_S)

    def stop(self) -> None:
        """Stop what this scaler placed (a foreground `up` that ends)."""
        for cluster in self._placed:
            cluster.stop()  # type: ignore[attr-defined]

    def _grow(self, change: PoolChange) -> None:
        import ray

        from vllm_cluster.cluster.ray_cluster import ClusterStartError, RayCluster, StartStopped

        self._log(f"placing {', '.join(p.name for p in change.add)} ...")
        cluster = RayCluster(self.deployment, list(change.add), Path(self.state.log_dir), self.state.ray_namespace,
                             detached=self._detached, api_key=self.state.api_key)
        cluster.token = self.state.token  # the router and the other instances know this one
        cluster.redis_url = self.state.redis_url
        cluster.stopping = self.stopping
        try:
            cluster.place_instances()
        except StartStopped:
            cluster.abandon()
            raise ScaleStopped(f"stopped while placing {[p.name for p in change.add]}; they are gone again") from None
        except (ClusterStartError, ray.exceptions.RayError) as e:
            cluster.stop()
            raise ScaleError(f"could not place {[p.name for p in change.add]}: {e}") from e
        except KeyboardInterrupt:  # Ctrl-C in `vllm-cluster scale`: its detached actors must not stay
            cluster.abandon()
            raise
        self._placed.append(cluster)
        at = next((i for i, r in enumerate(self.state.processes) if r.role == "router"), len(self.state.processes))
        self.state.processes[at:at] = cluster.records
        self.state.placement_groups += cluster.placement_groups
        self.state.save(self._path)
        with self._admin() as admin:
            for record in cluster.records:
                admin.AddInstance(pb.AddInstanceRequest(role=record.role, address=record.address, name=record.name),
                                  timeout=_ADMIN_TIMEOUT_S)
            self._wait_routed(admin, [r.name for r in cluster.records])
        for record in cluster.records:
            self._log(f"  {record.name} at {record.address} serves; the router routes to it")

    def _wait_routed(self, admin: pb_grpc.RouterAdminStub, names: list[str]) -> None:
        deadline = time.monotonic() + _ROUTED_TIMEOUT_S
        while True:
            listed = admin.ListInstances(pb.ListInstancesRequest(), timeout=_ADMIN_TIMEOUT_S).instances
            waiting = set(names) - {i.name for i in listed if i.healthy and not i.draining}
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise ScaleError(f"the router found {sorted(waiting)} unhealthy for {_ROUTED_TIMEOUT_S:g} s: "
                                 "see `vllm-cluster logs NAME` and the router's log")
            if self.stopping.wait(0.2):
                raise ScaleStopped(f"stopped before the router found {sorted(waiting)} healthy; they are placed, "
                                   "and the router routes to them once they answer")

    def _shrink(self, record: ProcessRecord) -> None:
        grace_s = self.deployment.router.drain_grace_s
        with self._admin() as admin:
            deadline = time.monotonic() + grace_s
            while True:
                reply = admin.RemoveInstance(pb.RemoveInstanceRequest(address=record.address),
                                             timeout=_ADMIN_TIMEOUT_S)
                if reply.num_inflight == 0 or time.monotonic() > deadline or self.stopping.wait(0.2):
                    break
        self._log(f"  {record.name}: no new requests; stopping it ({reply.num_inflight} left in flight)")
        self._stop_instance(record, grace_s)
        self.state.processes = [r for r in self.state.processes if r.name != record.name]
        group = f"{self.state.ray_namespace}.{record.name}"
        self.state.placement_groups = [g for g in self.state.placement_groups if g != group]
        self.state.save(self._path)
        self._log(f"  {record.name} stopped")

    def _stop_instance(self, record: ProcessRecord, grace_s: float) -> None:
        """SIGTERM through its actor (the worker drains), then its actors and placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        namespace = self.state.ray_namespace
        actors = []
        for name in record.actor_names:
            with contextlib.suppress(ValueError):
                actors.append(ray.get_actor(name, namespace=namespace))
        if actors:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(actors[0].stop.remote(grace_s), timeout=grace_s + 15)
        for actor in actors:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor)
        with contextlib.suppress(Exception):
            remove_placement_group(ray.util.get_placement_group(f"{namespace}.{record.name}"))
        terminate([current_process(record)], grace_s=5.0)  # on this node: what Ray could not stop

    def _admin(self) -> _Admin:
        return _Admin(self.state.router_address, self.state.token)


class _Admin:
    """The router's admin stub over a channel with the cluster token, as a context manager."""

    def __init__(self, address: str, token: str) -> None:
        self._channel = make_channel(address, token)

    def __enter__(self) -> pb_grpc.RouterAdminStub:
        return pb_grpc.RouterAdminStub(self._channel)

    def __exit__(self, *exc: object) -> None:
        self._channel.close()
