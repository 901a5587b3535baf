"""`vllm-cluster up --detach` -> a request through the router -> `status` -> `logs` ->
`down`, as a user runs them: real Ray (a head of its own), real processes, a killed
instance started again by itself, then nothing left running. On the way: the API key and
the cluster token are in no file but the private state file, and every server listens on
loopback only."""

from __future__ import annotations

import json
import os
import signal
import stat
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from tests.e2e.up import ENGINE_YAML
from tests.e2e.up import cli as _cli
from tests.listening import is_loopback, listening_addresses
from vllm_cluster.client import Client, ClientError
from vllm_cluster.cluster.procs import ProcessRef, session_members
from vllm_cluster.cluster.state import ClusterState

pytestmark = pytest.mark.slow

CONFIG = ENGINE_YAML + """\
cluster:
  name: e2e-up-{pid}
  num_prefill: 1
  num_decode: 1
router:
  port: 0
  http_port: 0
  policy: prefix_aware        # so `up` starts the embedded Redis too
  min_prefill_tokens: 0       # every request crosses prefill -> decode
  api_key: e2e-api-key-{pid}
  queue_timeout_s: 60         # a request may wait for a restarting decode instance
"""


def test_up_request_status_logs_down(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    pytest.importorskip("ucxx")
    config = tmp_path / "cluster.yaml"
    config.write_text(CONFIG.format(pid=os.getpid()))
    where = ["-f", str(config), "--state-dir", str(tmp_path / "state")]
    up = _cli("up", *where, "--detach", timeout_s=900)
    state_file = tmp_path / "state" / f"e2e-up-{os.getpid()}.json"
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = ClusterState.load(state_file)
        assert oct(state_file.stat().st_mode & 0o777) == "0o600"  # it holds the cluster token
        assert f"curl {state.http_address}/v1/chat/completions" in up.stdout
        assert [r.name for r in state.processes] == ["redis", "prefill-0", "decode-0", "router"]
        assert state.ray_head is not None and state.ray_head.alive()

        with Client(state.router_address) as client:  # the router has the key, though no file gave it
            assert _error(lambda: client.generate("Hi", max_tokens=1)) == grpc.StatusCode.UNAUTHENTICATED
        with Client(state.router_address, api_key=state.api_key) as client:
            result = client.generate("The capital of France is", max_tokens=8, temperature=0)
        assert result.text.strip() and result.usage is not None and result.usage.completion_tokens == 8
        for secret in (state.api_key, state.token):
            assert _files_holding(tmp_path / "state", secret) == {state_file: 0o600}
        for record in state.processes:  # KV (UCX included), gRPC, HTTP, metrics, Redis
            elsewhere = {a for a in listening_addresses(record.process.pid) if not is_loopback(a[0])}
            assert not elsewhere, f"{record.name} listens beyond loopback: {elsewhere}"

        status = _cli("status", *where, "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        rows = {row["name"]: row for row in map(json.loads, status.stdout.splitlines())}
        for name in ("prefill-0", "decode-0"):
            assert rows[name]["alive"] and rows[name]["healthy"], rows[name]
            assert rows[name]["num_running"] == 0 and rows[name]["kv_cache_usage"] is not None
        assert rows["router"]["healthy"] and rows["redis"]["healthy"]

        logs = _cli("logs", "decode-0", *where, "--tail", "5")
        assert logs.returncode == 0 and "decode-0" in logs.stdout and len(logs.stdout.splitlines()) <= 5
        assert _cli("logs", "nobody", *where).returncode == 1

        again = _cli("up", *where, "--detach")
        assert again.returncode == 1 and "already up" in again.stderr

        # The only decode instance crashes: its actor starts it again on the same port, the
        # router finds it there, and requests are served again with no command from anyone;
        # one sent while it is down waits in the admission queue (queue_timeout_s) and is
        # answered once it is back.
        state.record("decode-0").process.signal(signal.SIGKILL)
        with Client(state.router_address, api_key=state.api_key) as client:
            again = client.generate("The capital of France is", max_tokens=8, temperature=0)
        assert again.text == result.text
        deadline = time.monotonic() + 60
        while True:
            status = _cli("status", *where, "--json")
            rows = {row["name"]: row for row in map(json.loads, status.stdout.splitlines())}
            if status.returncode == 0:
                break
            assert time.monotonic() < deadline, rows["decode-0"]
            time.sleep(1.0)
        assert rows["decode-0"]["restarts"] == 1 and rows["decode-0"]["last_exit"] == "killed by SIGKILL"
        assert rows["decode-0"]["pid"] != state.record("decode-0").process.pid

        # The router (with its HTTP front) and Redis crash at once: both come back on their
        # ports, and the same request is answered over gRPC and HTTP.
        for name in ("router", "redis"):
            state.record(name).process.signal(signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:
            status = _cli("status", *where, "--json")
            rows = {row["name"]: row for row in map(json.loads, status.stdout.splitlines())}
            if status.returncode == 0 and all(rows[n]["restarts"] == 1 for n in ("router", "redis")):
                break
            assert time.monotonic() < deadline, rows
            time.sleep(1.0)
        with Client(state.router_address, api_key=state.api_key) as client:
            again = client.generate("The capital of France is", max_tokens=8, temperature=0)
        assert again.text == result.text
        request = urllib.request.Request(
            f"{state.http_address}/v1/completions", method="POST",
            data=json.dumps({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}).encode(),
            headers={"Authorization": f"Bearer {state.api_key}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["choices"][0]["text"] == result.text
    finally:
        down = _cli("down", *where, timeout_s=300)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "nothing left running" in down.stdout
    assert not state_file.exists()
    refs: list[ProcessRef] = [r.process for r in state.processes]
    assert state.ray_head is not None
    deadline = time.monotonic() + 10
    while any(r.alive() for r in [*refs, state.ray_head]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(r.alive() for r in [*refs, state.ray_head])
    assert session_members(state.ray_head.pid) == []  # the head's GCS, raylet, actors, their children
    assert _cli("status", *where).returncode == 1


def _error(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(ClientError) as info:
        call()
    return info.value.code


def _files_holding(root: Path, secret: str) -> dict[Path, int]:
    """Every file under `root` whose bytes contain `secret`, with its permission bits."""
    return {path: stat.S_IMODE(path.stat().st_mode) for path in root.rglob("*")
            if path.is_file() and secret.encode() in path.read_bytes()}
