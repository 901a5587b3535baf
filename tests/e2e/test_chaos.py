"""A bounded chaos soak on a cluster that `vllm-cluster up --detach` started (real Ray, real
processes, Redis, the gRPC and HTTP fronts): under a steady greedy load over both APIs,
each process is SIGKILLed (router, Redis, prefill, decode), Redis is stopped for a few
seconds, and bursts, slow clients and malformed clients come and go. Every request ends
with the fault-free answer or a clean error, every process is SERVING again with no
command from anyone, the same prompts give the same answers afterwards, and no instance
holds a KV block once idle. It runs `vllm-cluster chaos` as an operator would;
`loadtest/chaos.py` says what counts as clean."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.e2e.up import cli

pytestmark = pytest.mark.slow

CONFIG = """\
engine:
  model:
    model: smollm2-135m-instruct
    dtype: float32
  cache:
    num_blocks: 128
  scheduler:
    max_num_seqs: 8
    max_num_batched_tokens: 256
    max_model_len: 1024
  device: cpu
  num_threads: 1
cluster:
  name: e2e-chaos-{pid}
  num_prefill: 1
  num_decode: 1
  restart_backoff_s: 0.5
  max_restarts: 10
router:
  port: 0
  http_port: 0
  policy: prefix_aware        # Redis holds the prefix index, so it is in the cluster too
  min_prefill_tokens: 0       # every request crosses prefill -> decode
  api_key: chaos-key-{pid}
  queue_timeout_s: 60         # requests wait out a restarting decode instance
  lease_s: 10                 # a dead request's reservation is freed soon
  transfer_timeout_s: 5
  http_header_timeout_s: 2    # slow clients are cut off within seconds
  http_body_timeout_s: 2
"""


def test_every_request_ends_cleanly_and_the_cluster_heals(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    pytest.importorskip("ucxx")
    config = tmp_path / "cluster.yaml"
    config.write_text(CONFIG.format(pid=os.getpid()))
    where = ["-f", str(config), "--state-dir", str(tmp_path / "state")]
    up = cli("up", *where, "--detach", timeout_s=900)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        chaos = cli("chaos", *where, "--num-faults", "9", "--fault-interval-s", "5", "--seed", "3", timeout_s=900)
        report = json.loads(chaos.stdout.splitlines()[-1]) if chaos.stdout.strip() else {}
        assert report, chaos.stdout + chaos.stderr
        summary = f"faults {report['faults']}; outcomes {report['outcomes']}"

        assert {fault for _, fault in report["faults"]} >= {
            "kill router", "kill redis", "kill prefill-0", "kill decode-0", "stop redis",
            "burst", "slow_client", "malformed",
        }
        assert not report["unclean"], (
            f"requests that ended badly: {report['unclean']} {report['wrong_answers']}; {summary}")
        assert report["outcomes"]["completed"] >= 6, summary  # the load ran through the faults
        assert report["outcomes"]["slow client cut off"] >= 1, summary
        assert report["outcomes"]["malformed: http 400"] >= 1, summary
        assert report["recovered_after_s"] is not None, f"not every process came back; {summary}"
        assert not report["final_mismatches"], report["final_mismatches"]
        assert not report["blocks_in_use"], f"KV blocks held once idle: {report['blocks_in_use']}"
        assert report["clean"] and chaos.returncode == 0

        status = cli("status", *where, "--json")
        rows = {row["name"]: row for row in map(json.loads, status.stdout.splitlines())}
        assert status.returncode == 0, rows
        assert all(rows[name]["restarts"] >= 1 for name in ("router", "redis", "prefill-0", "decode-0")), rows
    finally:
        down = cli("down", *where, timeout_s=300)
    assert down.returncode == 0, down.stdout + down.stderr
