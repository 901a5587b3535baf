"""One cluster process (a prefill or decode worker, the router, an embedded Redis) run by a
Ray actor, so that Ray places it and `down` finds it by name.

Lifecycle (the actor is created in the instance's rank-0 bundle):
  1. `start(devices)`: write the process's resolved config next to its log, start it as a
     child process (a plain `python -m prefill_service ...`, as LocalCluster does), wait
     for its ready file (or, for Redis, its port), and report the ready file's contents.
  2. `tail(n)`, `returncode()`, `restarts()` while it runs. A child that exits on its own
     is started again on the same ports by a watchdog thread (cluster/restarts.py).
  3. `stop(grace_s)`: SIGTERM, then SIGKILL after the grace period, no restart. `kill()`:
     SIGKILL now, as a crash would (fault tests; the watchdog restarts it). The child gets
     SIGTERM from the kernel too if the actor dies (PR_SET_PDEATHSIG), so killing the actor
     never leaves the server behind.

A child process rather than the service's main in a thread: the workers own their signal
handling, torch thread settings and log format, exactly as under LocalCluster, and a
crash in one cannot take the actor (or Ray's worker process) with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_cluster.cluster.restarts import Restart, RestartPolicy, Watchdog, same_ports

_PR_SET_PDEATHSIG = 1
_TAIL_BYTES = 3000


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    name: str
    # The command; "{python}", "{config}", "{ready}" and "{node_ip}" are replaced on the node
    # with its Python, the resolved config file, the ready file and the node's address.
    argv: tuple[str, ...]
    env: dict[str, str]  # added to the environment (the cluster token, the API key)
    log_dir: str  # on the node: <name>.log, <name>.yaml, <name>.ready.json
    cwd: str  # relative model paths resolve from here (up's working directory)
    config_text: str = ""
    ready_port: int = 0  # ready when this port accepts connections, not a ready file (Redis)
    startup_timeout_s: float = 300.0
    # Started again when it exits on its own (cluster/restarts.py); max_restarts 0: never.
    restart: RestartPolicy = field(default_factory=RestartPolicy)


@dataclass(frozen=True, slots=True)
class Started:
    pid: int
    start_ticks: int  # with pid, names the process safely (cluster/procs.py)
    node_ip: str
    log_file: str
    info: dict[str, Any] = field(default_factory=dict)  # the ready file: port, http_port, ...
    error: str = ""  # why it did not start (then nothing is left running)


class ProcessHost:
    def __init__(self, spec: ProcessSpec) -> None:
        self.spec = spec
        self.log_dir = Path(spec.log_dir)
        self.log_file = self.log_dir / f"{spec.name}.log"
        self.popen: subprocess.Popen[bytes] | None = None
        self.stopping = False
        self.watchdog: Watchdog | None = None

    def start(self, visible_devices: list[str] | None = None) -> Started:
        """Start the process; once it is up, a watchdog starts it again whenever it exits on its own."""
        started = self._launch(self.spec.argv, visible_devices)
        if not started.error and self.spec.restart.max_restarts > 0 and self.watchdog is None:
            argv = same_ports(self.spec.argv, started.info)
            self.watchdog = Watchdog(
                self.spec.name, self.log_dir, self.spec.restart, wait=self._wait_exit, stopping=lambda: self.stopping,
                restart=lambda: self._relaunch(argv, visible_devices),
            )
        return started

    def restarts(self) -> list[Restart]:
        return [] if self.watchdog is None else list(self.watchdog.restarts)

    def _wait_exit(self) -> int:
        assert self.popen is not None
        return self.popen.wait()

    def _relaunch(self, argv: tuple[str, ...], visible_devices: list[str] | None) -> tuple[int, int]:
        started = self._launch(argv, visible_devices)
        if started.error:
            raise RuntimeError(started.error)
        return started.pid, started.start_ticks

    def _launch(self, spec_argv: tuple[str, ...], visible_devices: list[str] | None) -> Started:
        from vllm_cluster.cluster.procs import ProcessRef, reap_when_done

        self.log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # resolved configs may hold the API key
        config_file = self.log_dir / f"{self.spec.name}.yaml"
        ready_file = self.log_dir / f"{self.spec.name}.ready.json"
        ready_file.unlink(missing_ok=True)
        if self.spec.config_text:
            config_file.write_text(self.spec.config_text)
        node_ip = node_ip_address()
        argv = [a.format(python=sys.executable, config=config_file, ready=ready_file, node_ip=node_ip)
                for a in spec_argv]
        env = {**os.environ, **self.spec.env}
        if visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible_devices)
        cwd = self.spec.cwd if Path(self.spec.cwd).is_dir() else None
        with open(self.log_file, "ab") as log:  # a restart appends to the log of the runs before
            self.popen = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                preexec_fn=_die_with_parent,
            )
        reap_when_done(self.popen)  # reaped as it exits, with or without a watchdog
        ref = ProcessRef.of(self.popen.pid)
        error = self._wait_ready(ready_file)
        info = json.loads(ready_file.read_text()) if not error and not self.spec.ready_port else {}
        if error:
            self._end(grace_s=5.0)
        return Started(ref.pid, ref.start_ticks, node_ip, str(self.log_file), info, error)

    def devices(self) -> list[str]:
        return gpu_ids()

    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def tail(self, num_lines: int | None = None) -> str:
        return tail_file(self.log_file, num_lines)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """Stop the process for good (no restart)."""
        self.stopping = True
        return self._end(grace_s)

    def _end(self, grace_s: float) -> int | None:
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL, as a crash would: the watchdog starts it again."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=30)

    def _wait_ready(self, ready_file: Path) -> str:
        assert self.popen is not None
        deadline = time.monotonic() + self.spec.startup_timeout_s
        while not (
            _port_open(node_ip_address(), self.spec.ready_port) if self.spec.ready_port else ready_file.exists()
        ):
            if self.popen.poll() is not None:
                return f"{self.spec.name} exited with {self.popen.returncode} while starting:\n{self.tail_bytes()}"
            if time.monotonic() > deadline:
                return f"{self.spec.name} not ready after {self.spec.startup_timeout_s:g} s:\n{self.tail_bytes()}"
            time.sleep(0.1)
        return ""

    def tail_bytes(self) -> str:
        with contextlib.suppress(OSError), open(self.log_file, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - _TAIL_BYTES))
            return f.read().decode(errors="replace")
        return ""


class RankSlot:
    """Holds one bundle of an instance's placement group for ranks 1..N-1 (the worker starts
    those ranks itself, on the devices the slots report)."""

    def devices(self) -> list[str]:
        return gpu_ids()


def gpu_ids() -> list[str]:
    import ray

    return [str(i) for i in ray.get_gpu_ids()]


def node_ip_address() -> str:
    import ray

    return str(ray.util.get_node_ip_address())


def tail_file(path: Path, num_lines: int | None) -> str:
    text = path.read_text(errors="replace")
    if num_lines is None:
        return text
    lines = text.splitlines(keepends=True)
    return "".join(lines[-num_lines:]) if num_lines > 0 else ""


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the actor's process dies, however it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _port_open(host: str, port: int) -> bool:
    """Listening there, or on a wildcard or loopback address of the same node."""
    for address in dict.fromkeys((host, "127.0.0.1")):
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((address, port)) == 0:
                return True
    return False
