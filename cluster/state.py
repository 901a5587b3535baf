"""What `vllm-cluster up` started, written down for `down`, `status` and `logs`:
`<state_dir>/<name>.json` (default state dir ~/.vllm-cluster).

The file holds the cluster token (the workers' Stats RPC needs it), so it is created 0600
in a 0700 directory. It is written once everything is healthy and removed by `down` (or by
a foreground `up` when it stops).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_cluster.cluster.procs import ProcessRef

DEFAULT_STATE_DIR = Path.home() / ".vllm-cluster"


@dataclass(slots=True)
class ProcessRecord:
    name: str  # "prefill-0", "decode-1", "router", "redis"
    role: str  # prefill | decode | router | redis
    address: str  # gRPC "host:port"; redis: its URL
    process: ProcessRef  # the server process (the actor's child)
    log_file: str  # on the node `node_ip`
    node_ip: str = ""
    actor_names: list[str] = field(default_factory=list)  # rank 0 first
    actor_processes: list[ProcessRef] = field(default_factory=list)
    metrics_address: str = ""  # "http://host:port"; the router's is its HTTP front
    http_address: str = ""  # the router's OpenAI front


@dataclass(slots=True)
class ClusterState:
    name: str
    config_file: str
    token: str  # the cluster token: internal RPCs (Stats) need it
    api_key: str  # the router's client API key ("": none)
    router_address: str
    http_address: str
    redis_url: str
    log_dir: str
    ray_address: str
    ray_namespace: str
    ray_head: ProcessRef | None  # the `ray start --head` that `up --detach` started, if any
    owner: ProcessRef | None  # a foreground `up` that holds the cluster (Ctrl-C stops it)
    processes: list[ProcessRecord] = field(default_factory=list)
    placement_groups: list[str] = field(default_factory=list)

    def record(self, name: str) -> ProcessRecord:
        for record in self.processes:
            if record.name == name:
                return record
        names = ", ".join(r.name for r in self.processes)
        raise KeyError(f"no instance {name!r} in cluster {self.name!r}; its instances: {names}")

    def save(self, path: Path) -> None:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(dataclasses.asdict(self), out, indent=2)
        os.chmod(tmp, 0o600)  # O_CREAT's mode only applies to a new file
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> ClusterState:
        data: dict[str, Any] = json.loads(path.read_text())
        data["processes"] = [_record(p) for p in data.get("processes", [])]
        for key in ("ray_head", "owner"):
            data[key] = ProcessRef(**data[key]) if data.get(key) else None
        return cls(**data)


def _record(data: dict[str, Any]) -> ProcessRecord:
    data["process"] = ProcessRef(**data["process"])
    data["actor_processes"] = [ProcessRef(**p) for p in data.get("actor_processes", [])]
    return ProcessRecord(**data)


def state_path(state_dir: Path | None, name: str) -> Path:
    return (state_dir or DEFAULT_STATE_DIR) / f"{name}.json"
