"""A stop request ends a scale step that waits on Ray (the autoscaler's stop sets it): on a
real Ray, a placement that waits for resources Ray lacks, and an instance whose worker
is still starting, each give up at once with StartStopped, and `abandon()` leaves neither
a placement group nor a process behind."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vllm_cluster.cluster.config import Deployment
from vllm_cluster.cluster.config_file import load_deployment
from vllm_cluster.cluster.layout import plan_instances
from vllm_cluster.cluster.procs import ProcessRef, wait_gone

pytestmark = pytest.mark.slow
NAMESPACE = "test-scale-stop"

CONFIG = """\
engine:
  model:
    model: smollm2-135m-instruct
    dtype: float32
  cache:
    num_blocks: 64
  device: cpu
  num_threads: 1
cluster:
  num_prefill: 0
  num_decode: 1
  max_restarts: 0
  decode:
    num_cpus_per_rank: {num_cpus}
"""


@pytest.fixture(scope="module")
def ray_here() -> Iterator[None]:
    """A local Ray of 1 CPU in this process; this process's environment as it was afterwards
    (starting a local Ray writes Ray's settings there)."""
    if importlib.util.find_spec("ray") is None:  # not importorskip: Ray must not be imported yet here
        pytest.skip("ray is not installed")
    from vllm_cluster.cluster.ray_head import start_in_process

    saved = dict(os.environ)
    if "ray" in sys.modules:  # imported by an earlier test: its token authentication is off
        os.environ["RAY_AUTH_MODE"] = "disabled"
    start_in_process(num_cpus=1, namespace=NAMESPACE)
    try:
        yield
    finally:
        import ray

        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)


def _deployment(tmp_path: Path, num_cpus: float) -> Deployment:
    config = tmp_path / "cluster.yaml"
    config.write_text(CONFIG.format(num_cpus=num_cpus))
    return load_deployment(config)


def _stop_when(cluster: object, ready: Callable[[], bool]) -> threading.Thread:
    """Set the cluster's `stopping` once `ready()` holds (the step is waiting), from another thread."""

    def watch() -> None:
        deadline = time.monotonic() + 120
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.1)
        cluster.stopping.set()  # type: ignore[attr-defined]

    thread = threading.Thread(target=watch)
    thread.start()
    return thread


def _group_state(name: str) -> str:
    from ray.util import placement_group_table

    return str(next((g["state"] for g in placement_group_table().values() if g["name"] == name), "NONE"))


def test_a_stop_ends_a_placement_waiting_for_resources(ray_here: None, tmp_path: Path) -> None:
    from vllm_cluster.cluster.ray_cluster import RayCluster, StartStopped

    deployment = _deployment(tmp_path, num_cpus=8)  # the head has 1 CPU: the group stays pending
    plans = [p for p in plan_instances(deployment, use_gpus=False) if p.role == "decode"]
    cluster = RayCluster(deployment, plans, tmp_path / "logs", NAMESPACE, detached=True)
    group = f"{NAMESPACE}.decode-0"
    watcher = _stop_when(cluster, lambda: _group_state(group) == "PENDING")
    try:
        with pytest.raises(StartStopped, match="decode-0"):
            cluster.place_instances()
    finally:
        watcher.join()
    cluster.abandon()
    assert _group_state(group) == "REMOVED"
    assert cluster.records == []


def test_a_stop_ends_a_start_whose_worker_is_not_ready(ray_here: None, tmp_path: Path) -> None:
    from vllm_cluster.cluster.ray_cluster import RayCluster, StartStopped

    deployment = _deployment(tmp_path, num_cpus=0.5)
    plans = [p for p in plan_instances(deployment, use_gpus=False) if p.role == "decode"]
    cluster = RayCluster(deployment, plans, tmp_path / "logs", NAMESPACE, detached=True)
    log = tmp_path / "logs" / "decode-0.log"
    watcher = _stop_when(cluster, log.exists)  # the worker has just been started: it is far from ready
    try:
        with pytest.raises(StartStopped):
            cluster.place_instances()
    finally:
        watcher.join()
    workers = [ProcessRef.of(pid) for pid in _pids_with(str(tmp_path / "logs"))]
    assert workers
    cluster.abandon()
    assert _group_state(f"{NAMESPACE}.decode-0") == "REMOVED"
    assert wait_gone(workers, timeout_s=60), "the worker ends with its actor"


def _pids_with(text: str) -> list[int]:
    """The processes whose command line mentions `text`."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(proc.name))
            except OSError:
                continue
    return found
