"""`vllm-cluster repair`: place again the instances a cluster lost with a Ray node.

A process that crashes is started again by its actor's watchdog (cluster/restarts.py); an
actor lost with its node is not (its actors have max_restarts 0). Once the node, or another
one the pool's placement rules allow, is back in the Ray cluster:

1. Read the state file and the cluster YAML it names (the same `--set` overrides as `up`),
   join the cluster's Ray. Only a cluster of `up --detach` is repaired: a foreground `up`
   owns its actors and would not stop the new ones.
2. A prefill or decode instance is lost when its rank-0 actor is gone or does not answer,
   or its process exited for good. Nothing lost: say so, change nothing.
3. For each lost instance: kill what is left of its actors, remove its placement group,
   and place it again (cluster/ray_cluster.py) on its old gRPC and metrics ports, with the
   cluster's token and Redis. The router knows instances by address and polls them, so an
   instance back at its old address is routed to again once it answers.
4. Rewrite the state file with the new processes.

Only workers are placed again: the router and the embedded Redis run on the node `up` ran
on, and a cluster that lost that node is brought up again with `up`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path
from typing import Any

from vllm_cluster.cluster.config import Deployment
from vllm_cluster.cluster.config_file import load_deployment
from vllm_cluster.cluster.layout import InstancePlan, plan_instances
from vllm_cluster.cluster.state import ClusterState, ProcessRecord
from vllm_cluster.cluster.status import find_state
from vllm_cluster.engine.config import EngineRole
from vllm_cluster.engine.errors import ConfigError

_ANSWER_TIMEOUT_S = 15.0


def repair_main(args: argparse.Namespace) -> int:
    try:
        path, state = find_state(args)
        deployment = load_deployment(state.config_file, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if state.owner is not None:  # its actors live as long as that process; ours would outlive it
        print(f"error: cluster {state.name!r} belongs to a foreground `vllm-cluster up` (pid {state.owner.pid}), "
              "which stops every actor it started when it ends: stop it and bring the cluster up again "
              "(`up --detach` clusters can be repaired)", file=sys.stderr)
        return 1
    from vllm_cluster.cluster.ray_head import connect

    connect(state.ray_address, state.ray_namespace, local=state.ray_head is not None)
    lost = [r for r in state.processes if r.role in (EngineRole.PREFILL, EngineRole.DECODE) and is_lost(r, state)]
    if not lost:
        print(f"cluster {state.name!r}: every instance is in place; nothing to repair")
        return 0
    print(f"cluster {state.name!r}: placing again {', '.join(r.name for r in lost)} ...", flush=True)
    try:
        replaced = place_again(deployment, state, lost)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    state.processes = [replaced.get(r.name, r) for r in state.processes]
    state.save(path)
    for record in replaced.values():
        moved = "" if record.address == _old(lost, record.name).address else (
            f" (it was at {_old(lost, record.name).address}: the router does not know the new address; "
            "bring the cluster up again to route to it)")
        print(f"  {record.name} at {record.address} on node {record.node_ip}{moved}")
    return 0


def is_lost(record: ProcessRecord, state: ClusterState) -> bool:
    """Whether an instance's actor is gone (with its node) or its process exited for good."""
    import ray

    try:
        host = ray.get_actor(record.actor_names[0], namespace=state.ray_namespace)
        return ray.get(host.returncode.remote(), timeout=_ANSWER_TIMEOUT_S) is not None
    except (ValueError, ray.exceptions.RayError):  # no such actor, a dead one, no answer
        return True


def place_again(deployment: Deployment, state: ClusterState, lost: list[ProcessRecord]) -> dict[str, ProcessRecord]:
    """Place the lost instances again on their old ports; returns their new records by name."""
    import ray
    from ray.util.placement_group import remove_placement_group

    from vllm_cluster.cluster.ray_cluster import ClusterStartError, RayCluster

    plans = {p.name: p for p in plan_instances(deployment, use_gpus=deployment.engine.device != "cpu")}
    for record in lost:
        for name in record.actor_names:
            _quietly(lambda name=name: ray.kill(ray.get_actor(name, namespace=state.ray_namespace)))
        _quietly(lambda record=record: remove_placement_group(
            ray.util.get_placement_group(f"{state.ray_namespace}.{record.name}")))
    cluster = RayCluster(deployment, [_same_ports(plans[r.name], r) for r in lost], Path(state.log_dir),
                         state.ray_namespace, detached=True, api_key=state.api_key)
    cluster.token = state.token  # the router and the other instances know this one
    cluster.redis_url = state.redis_url
    try:
        cluster.place_instances()
    except (ClusterStartError, ray.exceptions.RayError) as e:
        cluster.stop()
        raise RuntimeError(f"could not place {[r.name for r in lost]} again: {e}") from e
    return {r.name: r for r in cluster.records}


def _same_ports(plan: InstancePlan, record: ProcessRecord) -> InstancePlan:
    metrics_port = int(record.metrics_address.rsplit(":", 1)[1]) if record.metrics_address else plan.metrics_port
    return dataclasses.replace(plan, port=int(record.address.rsplit(":", 1)[1]), metrics_port=metrics_port)


def _old(records: list[ProcessRecord], name: str) -> ProcessRecord:
    return next(r for r in records if r.name == name)


def _quietly(action: Any) -> None:
    with contextlib.suppress(Exception):  # already gone: nothing to clean up
        action()
