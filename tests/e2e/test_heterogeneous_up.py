"""Heterogeneous disaggregation through the real deployment path: `vllm-cluster up` with a
tensor-parallel prefill pool (tp=3: SmolLM2's 3 KV heads, one per rank) handing its KV
over UCX to a decode pool with tp=1. Greedy answers through the router equal the offline
single-process engine's, token for token; `down` leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.up import ENGINE_YAML
from vllm_cluster.client import Client
from vllm_cluster.cluster.state import ClusterState
from vllm_cluster.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

CONFIG = ENGINE_YAML + """\
cluster:
  name: e2e-hetero-{pid}
  num_prefill: 1
  num_decode: 1
  prefill:
    tensor_parallel_size: 3
    num_cpus_per_rank: 0.25
  decode:
    tensor_parallel_size: 1
router:
  port: 0
  http_port: 0
  min_prefill_tokens: 0       # every request crosses prefill -> decode
"""

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    " * 4, "Once upon a time, " * 10]


def _cli(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vllm_cluster.cluster.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=Path(__file__).resolve().parents[2])


def test_prefill_tp3_into_decode_tp1_equals_offline(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    pytest.importorskip("ucxx")
    llm = LLM("smollm2-135m-instruct", device="cpu", dtype="float32", num_threads=1, num_blocks=128,
              max_model_len=1024)
    prompts = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    config = tmp_path / "cluster.yaml"
    config.write_text(CONFIG.format(pid=os.getpid()))
    where = ["-f", str(config), "--state-dir", str(tmp_path / "state")]
    up = _cli("up", *where, "--detach", timeout_s=900)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = ClusterState.load(tmp_path / "state" / f"e2e-hetero-{os.getpid()}.json")
        with Client(state.router_address) as client:
            got = [client.generate(token_ids=p, max_tokens=10, temperature=0, ignore_eos=True).token_ids
                   for p in prompts]
        status = _cli("status", *where, "--json")
        rows = {row["name"]: row for row in map(json.loads, status.stdout.splitlines())}
        assert rows["prefill-0"]["healthy"] and rows["decode-0"]["healthy"], rows
    finally:
        down = _cli("down", *where, timeout_s=300)
    assert down.returncode == 0, down.stdout + down.stderr
    assert got == want
