"""Two Ray nodes on one machine that reach each other only over TCP: each a `ray start` of
its own on a loopback address of its own (Linux routes all of 127.0.0.0/8 to lo), with a
custom resource that names it, so that placement rules can tell them apart.

    nodes = RayNodes(tmp_dir).start()      # head "node_a" on 127.0.0.2, worker "node_b" on 127.0.0.3
    nodes.kill("node_b")                   # SIGKILL every process of that node, as a lost machine
    nodes.restart("node_b")                # the same address and resources again

Each node runs in a session of its own: its raylet, its Ray workers and the cluster's
processes under them are that session's members, so a node is killed by killing its session
(`ray stop` would stop every Ray on the machine).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from vllm_cluster.cluster.procs import session_members

_START_TIMEOUT_S = 180.0


@dataclass(slots=True)
class Node:
    name: str  # its custom resource: placement rules say {name: 1}
    ip: str
    num_cpus: int
    popen: subprocess.Popen[bytes] | None = None


@dataclass(slots=True)
class RayNodes:
    log_dir: Path
    num_cpus_per_node: int = 2
    nodes: dict[str, Node] = field(default_factory=dict)
    port: int = 0
    token: str = field(default_factory=lambda: secrets.token_hex(32))

    @property
    def address(self) -> str:
        return f"{self.nodes['node_a'].ip}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What a process joining these nodes needs: Ray's token authentication, and Ray's
        multi-node switch on (a test that started a local Ray in this process earlier left it
        off in os.environ: cluster/ray_head.py keeps a local Ray on one node that way)."""
        return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token, "RAY_USAGE_STATS_ENABLED": "0",
                "RAY_agent_register_timeout_ms": "300000", "RAY_raylet_start_wait_time_s": "300",
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}

    def start(self) -> RayNodes:
        self.nodes = {name: Node(name, ip, self.num_cpus_per_node)
                      for name, ip in (("node_a", "127.0.0.2"), ("node_b", "127.0.0.3"))}
        self.port = _free_port(self.nodes["node_a"].ip)
        try:
            for name in self.nodes:
                self._start(self.nodes[name])
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, name: str) -> None:
        """SIGKILL every process of the node at once: its raylet, its workers, what they run."""
        node = self.nodes[name]
        assert node.popen is not None
        members = [node.popen.pid, *(p.pid for p in session_members(node.popen.pid))]
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        node.popen.wait(timeout=30)
        node.popen = None

    def restart(self, name: str) -> None:
        self._start(self.nodes[name])

    def stop(self) -> None:
        for name in reversed(list(self.nodes)):  # the worker node before the head
            if self.nodes[name].popen is not None:
                self.kill(name)

    def _start(self, node: Node) -> None:
        log = self.log_dir / f"ray-{node.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        ray_bin = Path(sys.executable).with_name("ray")
        cmd = [str(ray_bin) if ray_bin.exists() else "ray", "start", "--block", "--node-ip-address", node.ip,
               "--num-cpus", str(node.num_cpus), "--resources", f'{{"{node.name}": 100}}',
               "--object-store-memory", str(80 * 1024 * 1024), "--disable-usage-stats"]
        # Ray's fixed default ports (10001, 52365, ...) would collide with another Ray here.
        cmd += [f"--{flag}={_free_port(node.ip)}" for flag in (
            "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
            "runtime-env-agent-port")]
        if node.name == "node_a":
            cmd += ["--head", "--port", str(self.port), "--include-dashboard", "false",
                    "--ray-client-server-port", str(_free_port(node.ip))]
        else:
            cmd += ["--address", self.address]
        with open(log, "wb") as out:
            node.popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=self.env, start_new_session=True)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while b"block forever" not in log.read_bytes():
            if node.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Ray node {node.name} ({node.ip}) did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
