"""Starting the ranks other than 0, behind a small interface so that something else
(Ray actors in a placement group) can place them instead of local processes.
`parallel.distributed_executor_backend` names the launcher (`make_launcher`): "mp" is
ProcessLauncher below, "ray" is cluster/ray_launcher.py's RayLauncher, imported by name
only when asked for (the engine never imports Ray).

A launcher runs `engine.parallel.worker.run_worker(spec)` once per WorkerSpec (ranks
1..world_size-1; rank 0 is the caller's own process), says which have exited, and stops
them. A spec is plain data and travels as JSON: nothing is pickled. A launcher that
places ranks elsewhere may rewrite `device` (one GPU per actor: "cuda:0") and `host`
(the address the rank's gloo sockets bind to) with `dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from vllm_cluster.engine.config import ParallelConfig
from vllm_cluster.engine.errors import ConfigError


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    rank: int
    world_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    store_host: str  # the driver's TCPStore
    store_port: int
    host: str  # the address this rank's gloo sockets bind to
    device: str  # "cpu" or "cuda:N"
    dtype: str  # "float32", "float16" or "bfloat16"
    num_threads: int
    timeout_s: float
    hf_config: dict[str, Any]  # the model's architecture; the weights come from rank 0
    enable_expert_parallel: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        data = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            raise ValueError(f"a worker spec is a JSON object with exactly the keys {sorted(names)}")
        return cls(**data)


def hello_key(rank: int) -> str:
    """Set in the driver's store once the worker has joined it."""
    return f"hello/{rank}"


def error_key(rank: int) -> str:
    """Set in the driver's store to the error that ended the worker."""
    return f"error/{rank}"


@dataclass(frozen=True, slots=True)
class WorkerExit:
    rank: int
    detail: str  # e.g. "exited with code 1", "was killed by SIGKILL"


class WorkerLauncher(Protocol):
    def start(self, specs: Sequence[WorkerSpec]) -> None:
        """Start one worker per spec; return without waiting for them."""

    def exited(self) -> list[WorkerExit]:
        """The workers that are no longer running."""

    def stop(self, timeout_s: float) -> None:
        """Wait up to timeout_s for the workers to exit (they were told to), then kill them."""


class ProcessLauncher:
    """Each worker a child process on this machine: `python -m engine.parallel.worker SPEC`."""

    def __init__(self) -> None:
        self._processes: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, specs: Sequence[WorkerSpec]) -> None:
        for spec in specs:
            # The rank's thread count from its first import on (OpenMP reads this once).
            env = {**os.environ, "OMP_NUM_THREADS": str(spec.num_threads)}
            command = [sys.executable, "-m", "vllm_cluster.engine.parallel.worker", spec.to_json()]
            self._processes[spec.rank] = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL)

    def pid(self, rank: int) -> int:
        return self._processes[rank].pid

    def exited(self) -> list[WorkerExit]:
        return [
            WorkerExit(rank, _describe(process.returncode))
            for rank, process in sorted(self._processes.items())
            if process.poll() is not None
        ]

    def stop(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for process in self._processes.values():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


LauncherFactory = Callable[[ParallelConfig], WorkerLauncher]

_LAUNCHERS: dict[str, LauncherFactory] = {"mp": lambda _parallel: ProcessLauncher()}
# Backends implemented outside the engine, by the module that registers them when
# imported. The engine imports such a module by name, and only when its backend is asked
# for: `engine` itself never imports Ray (ARCHITECTURE.md), and a machine without Ray
# runs the "mp" backend as before.
_BACKEND_MODULES = {"ray": "vllm_cluster.cluster.ray_launcher"}


def register_launcher(name: str, factory: LauncherFactory) -> None:
    """Make `parallel.distributed_executor_backend: NAME` start ranks with `factory(parallel)`."""
    _LAUNCHERS[name] = factory


def make_launcher(parallel: ParallelConfig) -> WorkerLauncher:
    """The launcher that `parallel.distributed_executor_backend` names."""
    name = parallel.distributed_executor_backend
    if name not in _LAUNCHERS and name in _BACKEND_MODULES:
        try:
            importlib.import_module(_BACKEND_MODULES[name])
        except ImportError as e:
            raise ConfigError(
                f"distributed_executor_backend {name!r} needs {_BACKEND_MODULES[name]}, which failed to import "
                f"({e}): install its dependencies (pip install ray) or use 'mp'"
            ) from e
    if name not in _LAUNCHERS:
        raise ConfigError(
            f"distributed_executor_backend {name!r} is not one of {sorted({*_LAUNCHERS, *_BACKEND_MODULES})}"
        )
    return _LAUNCHERS[name](parallel)


def _describe(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with code {returncode}"
