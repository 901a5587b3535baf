"""`vllm-cluster bench` against a real local cluster (router + 1 prefill + 1 decode), over
gRPC and over the OpenAI HTTP API, run as the command users run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_cluster.cluster.local import LocalCluster

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).with_name("cluster.yaml")
SMALL = ["--num-prompts", "10", "--random-input-len", "48", "--random-output-len", "6",
         "--disable-tqdm", "--seed", "1"]
VLLM_KEYS = [
    "duration", "completed", "failed", "num_prompts", "total_input_tokens", "total_output_tokens", "request_throughput",
    "request_goodput", "output_throughput", "total_token_throughput", "max_concurrent_requests",
    *[f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el")
      for stat in ("mean", "median", "std", "p50", "p90", "p99")],
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    pytest.importorskip("ucxx")
    local = LocalCluster.from_yaml(CONFIG, num_prefill=1, num_decode=1)
    local.log_dir = tmp_path_factory.mktemp("bench-cluster")
    with local:
        yield local


def _bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vllm_cluster.cluster.cli", "bench", *args],
        capture_output=True, text=True, timeout=timeout,
    )


def _check_result(result: dict[str, Any], num: int) -> None:
    missing = [k for k in VLLM_KEYS if k not in result]
    assert not missing, f"result JSON lacks {missing}"
    assert result["completed"] == num and result["failed"] == 0, result.get("errors")
    assert result["total_output_tokens"] == 6 * num  # ignore_eos: exactly the asked length
    for metric in ("ttft", "tpot", "itl", "e2el"):
        p50, p90, p99 = (result[f"p{p}_{metric}_ms"] for p in (50, 90, 99))
        assert 0 < p50 <= p90 <= p99, (metric, p50, p90, p99)
    assert result["median_ttft_ms"] < result["median_e2el_ms"]
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0


@pytest.mark.parametrize("backend", ["grpc", "openai", "openai-chat"])
def test_serve(cluster: LocalCluster, tmp_path: Path, backend: str) -> None:
    target = ["--address", cluster.router_address] if backend == "grpc" else ["--base-url", cluster.http_address]
    run = _bench("serve", "--backend", backend, *target, *SMALL, "--request-rate", "20", "--goodput", "ttft:60000",
                 "--save-result", "--plot", "--result-dir", str(tmp_path), "--result-filename", "out.json")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Serving Benchmark Result" in run.stdout
    result = json.loads((tmp_path / "out.json").read_text())
    _check_result(result, 10)
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])  # a 60 s TTFT SLO: all good
    if backend == "grpc":  # our cluster reports where the TTFT went
        assert set(result["ttft_breakdown"]) >= {"prefill_queue_s", "prefill_compute_s", "transfer_s", "decode_queue_s"}
        assert "Prefill compute" in run.stdout
        assert result["prompt_paths"] == {"prefill": 10}  # every prompt handed over, none recomputed
        assert "Prompts computed by" in run.stdout
    pngs = sorted(tmp_path.glob("*.png"))
    assert len(pngs) == 2 and all(p.stat().st_size > 10_000 for p in pngs)


def test_serve_mooncake_trace_with_timestamps(cluster: LocalCluster, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": i * 100, "input_length": 40, "output_length": 6, "hash_ids": [1, 2 + i % 2]} for i in range(6)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = _bench(
        "serve", "--address", cluster.router_address, "--dataset-name", "mooncake", "--dataset-path", str(trace),
        "--mooncake-block-size", "32", "--num-prompts", "6", "--use-trace-timestamps", "--disable-tqdm",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "m.json",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "m.json").read_text())
    assert result["completed"] == 6 and result["duration"] >= 0.5  # the trace spans 0.5 s


def test_sweep(cluster: LocalCluster, tmp_path: Path) -> None:
    run = _bench("sweep", "--address", cluster.router_address, *SMALL, "--request-rates", "5,50",
                 "--result-dir", str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["request_rate"] for r in rows] == [5.0, 50.0]
    for row in rows:
        _check_result(row, 10)
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
    assert "rate50" in run.stdout


def test_ctrl_c_prints_what_was_measured(cluster: LocalCluster, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "vllm_cluster.cluster.cli", "bench", "serve", "--address", cluster.router_address,
           "--num-prompts", "200", "--random-input-len", "32", "--random-output-len", "4", "--request-rate", "2",
           "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "partial.json"]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    first = process.stdout.readline()  # "sending 200 requests to ...": the run has started
    assert first.startswith("sending 200 requests"), first
    time.sleep(4)  # a few requests in
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 1, stderr[-3000:]
    assert "interrupted:" in stdout and "Serving Benchmark Result" in stdout
    result = json.loads((tmp_path / "partial.json").read_text())
    assert result["interrupted"] is True and 0 < result["completed"] < 200


def test_bad_dataset_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n{"timestamp": 5}\n')
    run = _bench("serve", "--dataset-name", "mooncake", "--dataset-path", str(bad), "--num-prompts", "2")
    assert run.returncode != 0
    assert f"{bad}:2" in run.stderr and "Traceback" not in run.stderr


def test_throughput_offline(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    run = _bench("throughput", "--model", "smollm2-135m-instruct", "--max-model-len", "512", "--num-prompts", "4",
                 "--random-input-len", "16", "--random-output-len", "4", "--output-json", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["num_requests"] == 4 and result["tokens_per_second"] > result["output_tokens_per_second"] > 0
    assert result["total_num_tokens"] == 4 * 16 + 4 * 4
