"""Self-healing: a process that exits on its own is started again on the same ports, with
a backoff, at most max_restarts times, and never when it is being stopped; the record of
restarts is what `status` shows. Real child processes under a ProcessHost (no Ray actor:
the host's methods run here)."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest

from vllm_cluster.cluster.process_host import ProcessHost, ProcessSpec
from vllm_cluster.cluster.procs import ProcessRef
from vllm_cluster.cluster.restarts import RestartPolicy, exit_reason, read_restarts, same_ports

pytest.importorskip("ray")  # the host asks Ray for the node's address

# A stand-in server: reports its ports in the ready file, then waits to be killed.
_SERVER = """\
import json, sys, time
json.dump({"port": 4321, "metrics_port": 4322}, open(sys.argv[1], "w"))
time.sleep(600)
"""


def _host(tmp_path: Path, policy: RestartPolicy) -> ProcessHost:
    server = tmp_path / "server.py"
    server.write_text(_SERVER)
    spec = ProcessSpec(name="decode-0", argv=("{python}", str(server), "{ready}", "--port", "0"), env={},
                       log_dir=str(tmp_path), cwd=str(tmp_path), startup_timeout_s=30, restart=policy)
    return ProcessHost(spec)


def _wait_for(condition, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_killed_process_is_started_again_and_recorded(tmp_path: Path) -> None:
    host = _host(tmp_path, RestartPolicy(max_restarts=2, backoff_s=0.1))
    first = host.start()
    assert not first.error
    try:
        assert host.popen is not None
        old = ProcessRef.of(host.popen.pid)
        host.kill()
        _wait_for(lambda: len(host.restarts()) == 1)
        restart = host.restarts()[0]
        assert restart.reason == "killed by SIGKILL" and restart.pid != old.pid and not restart.error
        assert ProcessRef(restart.pid, restart.start_ticks).alive()
        assert read_restarts(tmp_path, "decode-0") == host.restarts()  # what status reads
        # The second run was given the port the first one reported.
        assert host.popen is not None and "4321" in Path(f"/proc/{host.popen.pid}/cmdline").read_text()
    finally:
        host.stop(grace_s=2)


def test_after_max_restarts_it_stays_down_and_says_why(tmp_path: Path) -> None:
    host = _host(tmp_path, RestartPolicy(max_restarts=1, backoff_s=0.0))
    assert not host.start().error
    try:
        host.kill()
        _wait_for(lambda: len(host.restarts()) == 1)
        host.kill()
        _wait_for(lambda: len(host.restarts()) == 2)
        last = host.restarts()[-1]
        assert last.pid == 0 and "max_restarts (1)" in last.error
        assert host.returncode() is not None  # left down
        rows = json.loads((tmp_path / "decode-0.restarts.json").read_text())
        assert [r["reason"] for r in rows] == ["killed by SIGKILL", "killed by SIGKILL"]
    finally:
        host.stop(grace_s=2)


def test_a_process_being_stopped_is_not_restarted(tmp_path: Path) -> None:
    host = _host(tmp_path, RestartPolicy(max_restarts=3, backoff_s=0.0))
    assert not host.start().error
    host.stop(grace_s=2)
    time.sleep(0.5)
    assert host.restarts() == [] and host.returncode() is not None


def test_max_restarts_zero_means_no_watchdog(tmp_path: Path) -> None:
    host = _host(tmp_path, RestartPolicy(max_restarts=0))
    assert not host.start().error
    try:
        assert host.watchdog is None
    finally:
        host.stop(grace_s=2)


def test_ports_reported_at_the_first_start_are_kept_and_backoff_doubles() -> None:
    argv = ("{python}", "-m", "x", "--port", "0", "--metrics-port", "0", "--kv-port", "0", "--http-port", "7")
    assert same_ports(argv, {"port": 50051, "metrics_port": 9000, "http_port": 8000}) == (
        "{python}", "-m", "x", "--port", "50051", "--metrics-port", "9000", "--kv-port", "0", "--http-port", "7")
    policy = RestartPolicy(backoff_s=1.0)
    assert [policy.delay_s(n) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert exit_reason(-signal.SIGKILL) == "killed by SIGKILL" and exit_reason(3) == "exited with code 3"
    assert sys.executable
