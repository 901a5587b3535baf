"""The load generator from several client processes against the canned-token server, over
real gRPC and HTTP on loopback: every request is measured once, output tokens are counted
exactly whether a streamed message carries one token or several, `vllm-cluster bench
serve --num-client-processes` reports them in vLLM's result keys, and Ctrl-C still
reports what was measured."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_cluster.loadtest.canned import CannedAddresses, CannedConfig, canned_server, message_sizes
from vllm_cluster.loadtest.datasets import SampleRequest
from vllm_cluster.loadtest.runner import Schedule
from vllm_cluster.loadtest.shards import run_sharded
from vllm_cluster.loadtest.targets import TargetSpec

NUM_PROMPTS = 12
OUTPUT_LEN = 7  # not a multiple of 3: with 3 tokens per message, the last message carries 1


@pytest.fixture(scope="module", params=[1, 3], ids=["1-token-messages", "3-token-messages"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[CannedAddresses, int]]:
    with canned_server(CannedConfig(tokens_per_message=request.param)) as addresses:
        yield addresses, request.param


def _address(addresses: CannedAddresses, backend: str) -> str:
    return addresses.grpc_address if backend == "grpc" else addresses.base_url


def _bench_serve(*args: str) -> list[str]:
    return [sys.executable, "-m", "vllm_cluster.cluster.cli", "bench", "serve", *args]


def test_message_sizes() -> None:
    assert message_sizes(7, 1) == [1] * 7
    assert message_sizes(7, 3) == [3, 3, 1]
    assert message_sizes(6, 3) == [3, 3]
    assert message_sizes(2, 8) == [2]


@pytest.mark.parametrize("backend", ["grpc", "openai", "openai-chat"])
def test_client_processes_count_every_token(server: tuple[CannedAddresses, int], backend: str) -> None:
    addresses, tokens_per_message = server
    prompt: str | list[int] = "a b c d" if backend == "openai-chat" else [5, 6, 7, 8]
    requests = [SampleRequest(prompt, prompt_len=4, output_len=OUTPUT_LEN) for _ in range(NUM_PROMPTS)]
    spec = TargetSpec(backend, _address(addresses, backend), "canned")
    outcome = run_sharded(spec, requests, Schedule(max_concurrency=4, num_warmups=2), num_processes=3)
    assert len(outcome.results) == NUM_PROMPTS and not outcome.interrupted
    assert [r.error for r in outcome.results if not r.success] == []
    assert [r.output_len for r in outcome.results] == [OUTPUT_LEN] * NUM_PROMPTS
    assert [r.prompt_len for r in outcome.results] == [4] * NUM_PROMPTS  # the server's usage
    num_messages = math.ceil(OUTPUT_LEN / tokens_per_message)
    assert [len(r.itl_s) for r in outcome.results] == [num_messages - 1] * NUM_PROMPTS  # one gap per message
    assert all(0 < r.ttft_s <= r.e2e_s for r in outcome.results)
    assert outcome.duration_s >= max(r.start_s + r.e2e_s for r in outcome.results)
    assert outcome.client_cpu_s > 0


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_bench_serve_from_client_processes(server: tuple[CannedAddresses, int], backend: str, tmp_path: Path) -> None:
    addresses, _ = server
    target = ["--address" if backend == "grpc" else "--base-url", _address(addresses, backend)]
    run = subprocess.run(
        _bench_serve(
            *("--backend", backend, *target, "--num-prompts", str(NUM_PROMPTS), "--random-input-len", "8"),
            *("--random-output-len", str(OUTPUT_LEN), "--max-concurrency", "6", "--num-client-processes", "3"),
            *("--num-warmups", "3", "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path)),
            *("--result-filename", "out.json"),
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Serving Benchmark Result" in run.stdout
    result = json.loads((tmp_path / "out.json").read_text())
    assert (result["completed"], result["failed"], result["num_prompts"]) == (NUM_PROMPTS, 0, NUM_PROMPTS)
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert result["total_input_tokens"] == NUM_PROMPTS * 8
    assert result["model_id"] == "canned"  # asked of the server
    assert result["num_client_processes"] == 3 and result["client_cpu_s"] > 0
    assert 0 < result["median_ttft_ms"] <= result["median_e2el_ms"]
    assert result["max_concurrent_requests"] <= 6


def test_ctrl_c_reaches_every_client_process(tmp_path: Path) -> None:
    with canned_server() as addresses:
        command = _bench_serve(
            *("--address", addresses.grpc_address, "--num-prompts", "1000", "--random-input-len", "8"),
            *("--random-output-len", "4", "--request-rate", "20", "--num-client-processes", "2"),
            *("--disable-tqdm", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "partial.json"),
        )
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert process.stdout is not None
        assert process.stdout.readline().startswith("sending 1000 requests")
        started = process.stdout.readline()
        assert started == "2 client processes started\n", started
        time.sleep(1.5)  # some requests in
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 1, stderr[-3000:]
    assert "interrupted:" in stdout and "Serving Benchmark Result" in stdout
    result = json.loads((tmp_path / "partial.json").read_text())
    assert result["interrupted"] is True and 0 < result["completed"] < 1000
    assert result["failed"] == 0  # stopped requests are not sent, not failed


def test_concurrency_must_cover_the_client_processes() -> None:
    run = subprocess.run(
        _bench_serve("--max-concurrency", "2", "--num-client-processes", "3"), capture_output=True, text=True
    )
    assert run.returncode != 0
    assert "give at least one per process" in run.stderr and "Traceback" not in run.stderr
