"""`vllm-cluster down`: stop everything `up` started, and check that nothing is left.

1. A foreground `up` still holds the cluster: SIGTERM it; it stops everything itself.
2. Otherwise, with its Ray reachable: each server gets SIGTERM through its actor (router,
   then workers, then Redis), then every actor and placement group goes.
3. The Ray head `up --detach` started: SIGTERM, then whatever is left in its session.
4. Every recorded server pid is checked (and SIGKILLed if it somehow survived); the state
   file goes only when nothing is left running.
"""

from __future__ import annotations

import argparse
import socket
import sys

from vllm_cluster.cluster.procs import ProcessRef, terminate
from vllm_cluster.cluster.restarts import current_process
from vllm_cluster.cluster.state import ClusterState
from vllm_cluster.cluster.status import find_state
from vllm_cluster.engine.errors import ConfigError

_OWNER_TIMEOUT_S = 120.0


def down_main(args: argparse.Namespace) -> int:
    try:
        path, state = find_state(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"stopping cluster {state.name!r} ...", flush=True)
    if state.owner is not None and state.owner.alive():
        terminate([state.owner], _OWNER_TIMEOUT_S)
    else:
        _stop_through_ray(state, args.grace_s)
    survivors = terminate([current_process(r) for r in state.processes if _is_local(r.node_ip)], args.grace_s)
    if state.ray_head is not None:
        from vllm_cluster.cluster.ray_head import stop_head

        survivors += stop_head(state.ray_head, state.ray_address)
    if survivors:
        print(f"error: still running after SIGKILL: pids {[r.pid for r in survivors]}", file=sys.stderr)
        return 1
    path.unlink(missing_ok=True)
    print(f"stopped {len(state.processes)} processes" + (" and the Ray head" if state.ray_head else "")
          + "; nothing left running")
    return 0


def _stop_through_ray(state: ClusterState, grace_s: float) -> None:
    if not _reachable(state.ray_address, state.ray_head):
        return  # its head is gone: the pids are all that is left to check
    from vllm_cluster.cluster.ray_head import connect

    connect(state.ray_address, state.ray_namespace, local=state.ray_head is not None)
    import ray

    from vllm_cluster.cluster.ray_cluster import teardown

    try:
        teardown(state, grace_s)
    finally:
        ray.shutdown()


def _reachable(address: str, head: ProcessRef | None) -> bool:
    """Connecting to a Ray whose GCS is gone would retry for minutes: look first."""
    if head is not None and not head.alive():
        return False
    if address == "auto":
        return True
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=2.0):
            return True
    except (OSError, ValueError):
        return False


def _is_local(node_ip: str) -> bool:
    return node_ip in ("", "127.0.0.1") or node_ip == _own_ip()


def _own_ip() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return ""

