"""`vllm-cluster scale` as a user runs it, on a real cluster of `up --detach` (Ray, the
bundled model): decode 1 -> 2, and the router routes to the new instance; then 2 -> 1
while streams keep coming, and none of them is lost; `status` and the state file show the
pools as they are, and `down` stops them all."""

from __future__ import annotations

import json
import os
import threading
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


def _stats(address: str, token: str) -> pb.WorkerStats:
    with make_channel(address, token) as channel:
        return pb_grpc.DecodeWorkerStub(channel).Stats(pb.StatsRequest(), timeout=10)


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
    finally:
        down = _cli("down", *where, timeout_s=300)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not state_file.exists()
