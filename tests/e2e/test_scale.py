"""`vllm-cluster scale` as a user runs it, on a real cluster of `up --detach` (Ray, the
bundled model): decode 1 -> 2, and the router routes to the new instance; then 2 -> 1
while streams keep coming, and none of them is lost; `status` and the state file show the
pools as they are. Then `vllm-cluster autoscale` beside it, with a TTFT target no request
meets, grows decode back to its maximum under traffic, and SIGINT stops it (also when it
was started with SIGINT ignored); `down` stops them all."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.up import ENGINE_YAML
from tests.e2e.up import cli as _cli
from vllm_cluster.client import Client, ClientError
from vllm_cluster.cluster.state import ClusterState
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.worker.rpc import make_channel

pytestmark = pytest.mark.slow

CONFIG = ENGINE_YAML + """\
cluster:
  name: e2e-scale-{pid}
  num_prefill: 0              # decode computes every prompt: the pool that scales
  num_decode: 1
  max_restarts: 0
router:
  port: 0
  http_port: 0
  queue_timeout_s: 60
"""
MAX_TOKENS = 12
GROW_TIMEOUT_S = 180  # a hang fails the test with the autoscaler's output, not the CI job's timeout
STOP_TIMEOUT_S = 60


def _stats(address: str, token: str) -> pb.WorkerStats:
    with make_channel(address, token) as channel:
        return pb_grpc.DecodeWorkerStub(channel).Stats(pb.StatsRequest(), timeout=10)


def _autoscaler_grows_decode(where: list[str], state_file: Path) -> None:
    """`vllm-cluster autoscale` with a TTFT target of 1 us and no prefill pool allowed: the
    first round that sees traffic adds a decode instance (up to max_decode 2), which the
    router then uses. It is started with SIGINT ignored, as a background job of a CI script
    starts it, and SIGINT stops it all the same."""
    targets = ["autoscaler.enabled=true", "autoscaler.ttft_p99_ms=0.001", "autoscaler.interval_s=1",
               "autoscaler.cooldown_s=0", "autoscaler.max_decode=2", "autoscaler.max_prefill=0"]
    autoscale = subprocess.Popen(
        [sys.executable, "-m", "vllm_cluster.cluster.cli", "autoscale", *where, *(f"--set={t}" for t in targets)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).resolve().parents[2],
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    state = ClusterState.load(state_file)
    stop = threading.Event()

    def traffic() -> None:  # every round sees a TTFT over the target: it never shrinks back
        with Client(state.router_address) as client:
            while not stop.is_set():
                with contextlib.suppress(ClientError):
                    client.generate("Hi", max_tokens=2)

    sender = threading.Thread(target=traffic)
    sender.start()
    try:
        grown = _wait_until(lambda: "decode-1" in _names(state_file) or autoscale.poll() is not None, GROW_TIMEOUT_S)
    finally:
        autoscale.send_signal(signal.SIGINT)
        try:
            log = autoscale.communicate(timeout=STOP_TIMEOUT_S)[0]
        except subprocess.TimeoutExpired:
            autoscale.kill()
            log = autoscale.communicate()[0]
            pytest.fail(f"autoscale did not stop within {STOP_TIMEOUT_S} s of its SIGINT; its output:\n{log}")
        finally:
            stop.set()
            sender.join(timeout=60)
    assert grown and autoscale.returncode == 0 and "stopped" in log, log
    state = ClusterState.load(state_file)
    assert [r.name for r in state.processes] == ["decode-0", "decode-1", "router"], log
    with make_channel(state.router_address, state.token) as channel:  # its first healthy poll may come later
        admin = pb_grpc.RouterAdminStub(channel)
        assert _wait_until(lambda: any(i.name == "decode-1" and i.healthy for i in admin.ListInstances(
            pb.ListInstancesRequest(), timeout=10).instances), 60), log
    queries = _stats(state.record("decode-1").address, state.token).prefix_cache_queries
    with Client(state.router_address) as client:  # two at once: least_loaded gives the new instance one
        threads = [threading.Thread(target=lambda: client.generate("Count to ten:", max_tokens=4)) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert _stats(state.record("decode-1").address, state.token).prefix_cache_queries > queries, log


def _names(state_file: Path) -> list[str]:
    return [r.name for r in ClusterState.load(state_file).processes]


def _wait_until(done: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def test_scale_decode_up_then_down_under_load(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    config = tmp_path / "cluster.yaml"
    config.write_text(CONFIG.format(pid=os.getpid()))
    where = ["-f", str(config), "--state-dir", str(tmp_path / "state")]
    state_file = tmp_path / "state" / f"e2e-scale-{os.getpid()}.json"
    up = _cli("up", *where, "--detach", timeout_s=600)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        grown = _cli("scale", *where, "--decode", "2", timeout_s=300)
        assert grown.returncode == 0, grown.stdout + grown.stderr
        state = ClusterState.load(state_file)
        assert [r.name for r in state.processes] == ["decode-0", "decode-1", "router"]
        assert len(state.placement_groups) == 2
        new = state.record("decode-1")
        queries = _stats(new.address, state.token).prefix_cache_queries
        with Client(state.router_address) as client:  # two at once: least_loaded gives each instance one
            results: list[str] = []
            threads = [threading.Thread(target=lambda: results.append(
                client.generate("Count to ten:", max_tokens=MAX_TOKENS, temperature=0).text)) for _ in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        assert len(results) == 2
        assert _stats(new.address, state.token).prefix_cache_queries > queries, "the new instance took a request"

        stop = threading.Event()
        done: list[int] = []
        failed: list[str] = []

        def load() -> None:
            with Client(state.router_address) as client:
                while not stop.is_set():
                    try:
                        result = client.generate("Tell me a story.", max_tokens=MAX_TOKENS, temperature=0,
                                                 ignore_eos=True)
                    except ClientError as e:
                        failed.append(str(e))
                        continue
                    assert result.usage is not None
                    done.append(result.usage.completion_tokens)
                    if result.finish_reason != "length":
                        failed.append(f"finished by {result.finish_reason!r}")

        streams = [threading.Thread(target=load) for _ in range(3)]
        for thread in streams:
            thread.start()
        try:
            shrunk = _cli("scale", *where, "--decode", "1", timeout_s=300)
        finally:
            stop.set()
            for thread in streams:
                thread.join(timeout=120)
        assert shrunk.returncode == 0, shrunk.stdout + shrunk.stderr
        assert not failed, failed
        assert done and all(n == MAX_TOKENS for n in done)
        state = ClusterState.load(state_file)
        assert [r.name for r in state.processes] == ["decode-0", "router"]
        assert not new.process.alive()
        status = _cli("status", *where, "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        assert [json.loads(row)["name"] for row in status.stdout.splitlines()] == ["decode-0", "router"]
        with Client(state.router_address) as client:
            assert client.generate("Hi", max_tokens=2).usage.completion_tokens == 2  # type: ignore[union-attr]
        again = _cli("scale", *where, "--decode", "1")
        assert again.returncode == 0 and "nothing to change" in again.stdout
        _autoscaler_grows_decode(where, state_file)
    finally:
        down = _cli("down", *where, timeout_s=300)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not state_file.exists()
