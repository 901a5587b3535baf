"""Self-healing: a cluster process that exits on its own is started again by the actor that
runs it (cluster/process_host.py), on the same ports, so the router and clients find it at
the address they know.

Lifecycle, per process, once its first start succeeded:
  1. A watchdog thread in the actor waits for the child to exit.
  2. Exited while the actor was not stopping it (a crash, an OOM kill, `kill -9`): the exit
     is recorded, and after a backoff (`restart_backoff_s`, doubled after each restart, at
     most MAX_BACKOFF_S) the child starts again with the ports it had.
  3. After `max_restarts` restarts it is left down, and the record says so.
The record is a JSON file next to the process's log (`<name>.restarts.json`): `vllm-cluster
status` reads it for the restarts, their reasons and the process that now runs. A worker
that comes back re-registers by answering the router's polls again, and republishes its
prefix cache to Redis under a new epoch (kv_index/).
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_cluster.cluster.procs import ProcessRef

if TYPE_CHECKING:
    from vllm_cluster.cluster.state import ProcessRecord

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
# The flags whose value is a port: 0 at the first start (a free one is picked), then the one
# the process reported, so that a restarted process listens where the old one did.
_PORT_FLAGS = {"--port": "port", "--metrics-port": "metrics_port", "--http-port": "http_port"}


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    max_restarts: int = 5
    backoff_s: float = 1.0

    def delay_s(self, num_restarts: int) -> float:
        """The wait before restart number `num_restarts + 1`."""
        return min(MAX_BACKOFF_S, self.backoff_s * 2**num_restarts)


@dataclass(frozen=True, slots=True)
class Restart:
    time: float  # unix time of the exit
    reason: str  # "exited with code 1", "killed by SIGKILL"
    pid: int = 0  # the process started in its place (0: none, see `error`)
    start_ticks: int = 0
    error: str = ""  # why it could not be started again, or that max_restarts was reached


def exit_reason(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


def same_ports(argv: tuple[str, ...], info: dict[str, Any]) -> tuple[str, ...]:
    """`argv` with every port flag given as 0 replaced by the port the process reported."""
    out = list(argv)
    for i, flag in enumerate(out[:-1]):
        key = _PORT_FLAGS.get(flag)
        if key is not None and out[i + 1] == "0" and info.get(key):
            out[i + 1] = str(info[key])
    return tuple(out)


def restarts_file(log_dir: Path | str, name: str) -> Path:
    return Path(log_dir) / f"{name}.restarts.json"


def current_process(record: ProcessRecord) -> ProcessRef:
    """The process that now serves `record` (the last one its watchdog started, if any; read
    from the node's log directory, so on this node only)."""
    started = [r for r in read_restarts(Path(record.log_file).parent, record.name) if r.pid]
    return ProcessRef(started[-1].pid, started[-1].start_ticks) if started else record.process


def read_restarts(log_dir: Path | str, name: str) -> list[Restart]:
    """The restarts of process `name` so far (none when the file is missing or unreadable)."""
    try:
        rows = json.loads(restarts_file(log_dir, name).read_text())
        return [Restart(**row) for row in rows]
    except (OSError, ValueError, TypeError):
        return []


class Watchdog:
    """Waits for a process to exit and starts it again (see the module docstring).

    `wait()` blocks until the current child exits and returns its code; `stopping()` says
    whether the owner is stopping it on purpose; `restart()` starts it again and returns
    (pid, start_ticks) or raises with why it could not."""

    def __init__(
        self, name: str, log_dir: Path | str, policy: RestartPolicy, wait: Callable[[], int],
        stopping: Callable[[], bool], restart: Callable[[], tuple[int, int]],
    ) -> None:
        self.name = name
        self.policy = policy
        self.restarts: list[Restart] = read_restarts(log_dir, name)
        self._file = restarts_file(log_dir, name)
        self._wait, self._stopping, self._restart = wait, stopping, restart
        self._thread = threading.Thread(target=self._watch, name=f"watchdog-{name}", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while True:
            code = self._wait()
            if self._stopping():
                return
            reason = exit_reason(code)
            now = time.time()
            done = [r for r in self.restarts if r.pid]
            if len(done) >= self.policy.max_restarts:
                self._record(Restart(now, reason, error=f"not restarted: max_restarts ({self.policy.max_restarts})"))
                logger.error("%s %s; max_restarts %d reached, leaving it down", self.name, reason,
                             self.policy.max_restarts)
                return
            delay = self.policy.delay_s(len(done))
            logger.warning("%s %s; restarting it in %.1f s", self.name, reason, delay)
            time.sleep(delay)
            if self._stopping():
                return
            try:
                pid, ticks = self._restart()
            except Exception as e:  # noqa: BLE001 - recorded, and the watchdog ends
                self._record(Restart(now, reason, error=f"could not start it again: {e}"))
                logger.exception("%s could not be started again", self.name)
                return
            self._record(Restart(now, reason, pid=pid, start_ticks=ticks))

    def _record(self, restart: Restart) -> None:
        # The file first, then the list: whoever sees the restart in `restarts` finds it on
        # disk too (what `vllm-cluster status` reads).
        rows = [*self.restarts, restart]
        tmp = self._file.with_suffix(".tmp")
        tmp.write_text(json.dumps([asdict(r) for r in rows]))
        tmp.replace(self._file)
        self.restarts = rows
