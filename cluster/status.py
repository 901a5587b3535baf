"""`vllm-cluster status` and `vllm-cluster logs INSTANCE`, from a cluster's state file.

status asks every server directly: its gRPC health (open to anyone) and, for the workers,
the Stats RPC (it needs the cluster token, which the state file keeps). It exits 0 when
every process is alive and SERVING, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from vllm_cluster.cluster.config_file import load_deployment
from vllm_cluster.cluster.restarts import current_process, read_restarts
from vllm_cluster.cluster.state import ClusterState, ProcessRecord, state_path
from vllm_cluster.engine.config import EngineRole
from vllm_cluster.engine.errors import ConfigError
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.worker.rpc import check_health, make_channel

_STUBS: dict[str, Any] = {EngineRole.PREFILL: pb_grpc.PrefillWorkerStub, EngineRole.DECODE: pb_grpc.DecodeWorkerStub}


@dataclass(frozen=True, slots=True)
class InstanceStatus:
    name: str
    role: str
    address: str
    pid: int
    alive: bool
    healthy: bool
    num_running: int | None = None
    num_waiting: int | None = None
    kv_cache_usage: float | None = None
    restarts: int = 0  # started again by its watchdog (cluster/restarts.py)
    last_exit: str = ""  # why it last exited on its own ("killed by SIGKILL"), if it did
    node: str = ""  # the address of the Ray node it runs on


def find_state(args: argparse.Namespace) -> tuple[Path, ClusterState]:
    """The state file `args` name; a ConfigError or FileNotFoundError says what to give."""
    name = args.name
    if name is None and args.config is not None:
        name = load_deployment(args.config, args.overrides).cluster.name
    path = state_path(args.state_dir, name or "local")
    if not path.exists():
        raise FileNotFoundError(f"no cluster {name or 'local'!r} is up (no state file {path}); "
                                "give --name or -f as to `up`, and --state-dir if `up` had one")
    return path, ClusterState.load(path)


def status_main(args: argparse.Namespace) -> int:
    try:
        _, state = find_state(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    statuses = [probe(record, state.token) for record in state.processes]
    if args.json:
        for status in statuses:
            print(json.dumps(asdict(status)))
    else:
        print(f"cluster {state.name!r}: router {state.router_address} ({state.http_address}), "
              f"Ray {state.ray_address}, logs {state.log_dir}")
        print(
            f"{'INSTANCE':<12}{'ROLE':<9}{'ADDRESS':<24}{'PID':>8}  "
            f"{'HEALTH':<12}{'RUNNING':>8}{'WAITING':>8}{'KV USAGE':>10}{'RESTARTS':>10}  LAST EXIT"
        )
        for s in statuses:
            health = "SERVING" if s.healthy else ("NOT_SERVING" if s.alive else "DEAD")
            load = [_num(s.num_running), _num(s.num_waiting),
                    "-" if s.kv_cache_usage is None else f"{100 * s.kv_cache_usage:.1f}%"]
            print(
                f"{s.name:<12}{s.role:<9}{s.address:<24}{s.pid:>8}  "
                f"{health:<12}{load[0]:>8}{load[1]:>8}{load[2]:>10}{s.restarts:>10}  {s.last_exit or '-'}"
            )
        for node, names in nodes_gone(statuses).items():
            print(f"node {node} is gone: {', '.join(names)} lost with it; once it is back, "
                  f"`vllm-cluster repair` places them again")
    return 0 if all(s.alive and s.healthy for s in statuses) else 1


def nodes_gone(statuses: list[InstanceStatus]) -> dict[str, list[str]]:
    """Node address -> its processes, for each node of several where no process answers
    (one process down is a crash its watchdog handles; all of them, a lost node)."""
    by_node: dict[str, list[InstanceStatus]] = {}
    for status in statuses:
        by_node.setdefault(status.node, []).append(status)
    if len(by_node) < 2:
        return {}
    return {node: [s.name for s in members] for node, members in by_node.items()
            if not any(s.alive or s.healthy for s in members)}


def probe(record: ProcessRecord, token: str) -> InstanceStatus:
    status = _probe(record, token)
    status = replace(status, node=record.node_ip)
    exits = read_restarts(Path(record.log_file).parent, record.name)
    if not exits:
        return status
    last = exits[-1]
    return replace(status, restarts=sum(1 for r in exits if r.pid), last_exit=last.reason + (
        f" ({last.error})" if last.error else ""))


def _probe(record: ProcessRecord, token: str) -> InstanceStatus:
    process = current_process(record)
    here = record.node_ip in ("", "127.0.0.1")  # else its pid means nothing on this machine
    alive = process.alive() if here else True
    if record.role == "redis":
        healthy = alive and _redis_ok(record.address)
        return InstanceStatus(record.name, record.role, record.address, process.pid, alive if here else healthy,
                              healthy)
    channel = make_channel(record.address, token)
    try:
        healthy = check_health(channel, timeout_s=2.0)
        stats = None
        if healthy and record.role in _STUBS:
            try:
                stats = _STUBS[record.role](channel).Stats(pb.StatsRequest(), timeout=5.0)
            except grpc.RpcError:
                stats = None
    finally:
        channel.close()
    alive = alive if here else healthy  # on another node: alive as far as it answers
    if stats is None:
        return InstanceStatus(record.name, record.role, record.address, process.pid, alive, healthy)
    return InstanceStatus(record.name, record.role, record.address, process.pid, alive, healthy,
                          stats.num_running, stats.num_waiting, round(stats.kv_cache_usage, 4))


def _redis_ok(url: str) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=2.0)
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError):
        return False
    finally:
        client.close()


def _num(value: int | None) -> str:
    return "-" if value is None else str(value)


def logs_main(args: argparse.Namespace) -> int:
    try:
        _, state = find_state(args)
        record = state.record(args.instance)
    except (ConfigError, FileNotFoundError, KeyError) as e:
        print(f"error: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 1
    path = Path(record.log_file)
    if path.exists():
        from vllm_cluster.cluster.process_host import tail_file

        sys.stdout.write(tail_file(path, args.tail))
        return 0
    # On another node: ask the actor that runs it.
    from vllm_cluster.cluster.ray_head import connect

    connect(state.ray_address, state.ray_namespace, local=state.ray_head is not None)
    import ray

    host = ray.get_actor(record.actor_names[0], namespace=state.ray_namespace)
    text = str(ray.get(host.tail.remote(args.tail)))
    sys.stdout.write(text)
    return 0
