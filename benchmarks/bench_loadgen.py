"""How many streamed tokens `vllm-cluster bench serve` drains per second: the real command,
gRPC and OpenAI HTTP backends, from 1, 2 and 4 client processes, against the canned-token
server (loadtest/canned.py, a process of its own) with 1 and 8 tokens per streamed message.

Each run sends --num-prompts requests of 128 output tokens, --concurrency at once. Per row:
output tokens/s and messages/s over the run (the result JSON's `output_throughput`), the
client processes' CPU time per message (all of them, while measuring), and the server's
CPU use over the run (a share of one core, from /proc). Baseline (`bare`), from the same
run: the client library alone (grpc.aio, aiohttp) draining the same streams at the same
concurrency from one process, no timing and no results. Each row is the fastest of
--repeats runs, the one least disturbed by anything else on the machine.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_loadgen.py [--num-prompts 4000 --concurrency 256 --processes 1,2,4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from vllm_cluster.loadtest.canned import CannedConfig, canned_server, message_sizes
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc

OUTPUT_LEN = 128


def server_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_serve(backend: str, address: str, num_prompts: int, concurrency: int, num_processes: int) -> dict[str, Any]:
    """One `vllm-cluster bench serve` run; its result JSON."""
    target = ["--address", address] if backend == "grpc" else ["--base-url", address]
    with tempfile.TemporaryDirectory() as result_dir:
        command = [
            *(sys.executable, "-m", "vllm_cluster.cluster.cli", "bench", "serve", "--backend", backend, *target),
            *("--model", "canned", "--dataset-name", "random", "--random-input-len", "8"),
            *("--random-output-len", str(OUTPUT_LEN), "--num-prompts", str(num_prompts)),
            *("--max-concurrency", str(concurrency), "--num-client-processes", str(num_processes)),
            *("--num-warmups", str(num_processes), "--disable-tqdm", "--save-result"),
            *("--result-dir", result_dir, "--result-filename", "result.json"),
        ]
        run = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if run.returncode != 0:
            raise RuntimeError(f"bench serve failed:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}")
        result: dict[str, Any] = json.loads((Path(result_dir) / "result.json").read_text())
    if result["completed"] != num_prompts:
        raise RuntimeError(f"{result['completed']} of {num_prompts} requests completed: {result['errors']}")
    return result


async def bare_grpc(address: str, num_prompts: int, concurrency: int) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(max_tokens=OUTPUT_LEN))

        async def one() -> None:
            async for _ in stub.Generate(request):
                pass

        await _at_concurrency(one, num_prompts, concurrency)


async def bare_http(base_url: str, num_prompts: int, concurrency: int) -> None:
    body = {"model": "canned", "prompt": "hi", "max_tokens": OUTPUT_LEN, "stream": True}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one() -> None:
            async with session.post(f"{base_url}/v1/completions", json=body) as response:
                async for _ in response.content:
                    pass

        await _at_concurrency(one, num_prompts, concurrency)


async def _at_concurrency(one: Callable[[], Awaitable[None]], num_prompts: int, concurrency: int) -> None:
    limit = asyncio.Semaphore(concurrency)

    async def limited() -> None:
        async with limit:
            await one()

    await asyncio.gather(*(limited() for _ in range(num_prompts)))


@dataclass(frozen=True, slots=True)
class Run:
    wall_s: float
    client_cpu_s: float  # the client processes', while measuring
    server_cpu_s: float


def bare(backend: str, address: str, num_prompts: int, concurrency: int, server_pid: int) -> Run:
    """The client library alone draining the streams from this process."""
    drain = bare_grpc if backend == "grpc" else bare_http
    asyncio.run(drain(address, concurrency, concurrency))  # warm-up: connections, server and client caches
    wall, cpu, server_cpu = time.perf_counter(), time.process_time(), server_cpu_s(server_pid)
    asyncio.run(drain(address, num_prompts, concurrency))
    return Run(time.perf_counter() - wall, time.process_time() - cpu, server_cpu_s(server_pid) - server_cpu)


def harness(backend: str, address: str, num_prompts: int, concurrency: int, server_pid: int, num_processes: int) -> Run:
    """`vllm-cluster bench serve` from `num_processes` client processes."""
    server_cpu = server_cpu_s(server_pid)
    result = bench_serve(backend, address, num_prompts, concurrency, num_processes)
    return Run(result["duration"], result["client_cpu_s"], server_cpu_s(server_pid) - server_cpu)


def best_of(repeats: int, measure: Callable[[], Run]) -> Run:
    """The fastest of `repeats` runs: the one least disturbed by anything else on the machine."""
    return min((measure() for _ in range(repeats)), key=lambda run: run.wall_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--processes", default="1,2,4", help="numbers of client processes, comma-separated")
    parser.add_argument("--tokens-per-message", default="1,8", help="comma-separated")
    parser.add_argument("--backends", default="grpc,openai", help="comma-separated")
    parser.add_argument("--repeats", type=int, default=2, help="runs per row; the fastest is shown")
    args = parser.parse_args()
    print(
        f"{os.cpu_count()} CPU cores; {args.num_prompts} requests x {OUTPUT_LEN} output tokens, "
        f"{args.concurrency} at once; best of {args.repeats}"
    )
    print(
        f"{'backend':<8} {'tok/msg':>7} {'client':>10} {'out tok/s':>10} {'msgs/s':>9} "
        f"{'client CPU us/msg':>18} {'server CPU':>10}"
    )
    for tokens_per_message in (int(k) for k in args.tokens_per_message.split(",")):
        num_messages = args.num_prompts * len(message_sizes(OUTPUT_LEN, tokens_per_message))
        num_tokens = args.num_prompts * OUTPUT_LEN
        with canned_server(CannedConfig(tokens_per_message=tokens_per_message)) as server:
            for backend in args.backends.split(","):
                address = server.grpc_address if backend == "grpc" else server.base_url
                load = (backend, address, args.num_prompts, args.concurrency, server.pid)
                rows = [("bare", best_of(args.repeats, partial(bare, *load)))]
                for n in (int(n) for n in args.processes.split(",")):
                    rows.append((f"{n} proc", best_of(args.repeats, partial(harness, *load, n))))
                for label, run in rows:
                    print(
                        f"{backend:<8} {tokens_per_message:>7} {label:>10} {num_tokens / run.wall_s:10.0f} "
                        f"{num_messages / run.wall_s:9.0f} {run.client_cpu_s / num_messages * 1e6:18.1f} "
                        f"{run.server_cpu_s / run.wall_s:10.0%}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
