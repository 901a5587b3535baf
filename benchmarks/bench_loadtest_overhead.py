"""What the load-testing harness itself costs: client CPU time per request at 200 req/s
against the canned-token server (loadtest/canned.py: 16 streamed tokens each, one per
message, as fast as it can), so that the harness never becomes the bottleneck it measures.

Measured in the same run, per target (our gRPC API; an OpenAI-style SSE endpoint):
  harness   `loadtest.runner.run` with the real target (timing every piece, bookkeeping)
  bare      the same calls on the same schedule with no timing or results at all
The difference is the harness's own cost; the budget is the 5 ms between requests.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_loadtest_overhead.py [--rate 200 --num 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

NUM_TOKENS = 16


async def _bare_grpc(address: str, offsets: list[float]) -> None:
    import grpc

    from vllm_cluster.proto import cluster_pb2 as pb
    from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def one() -> None:
            async for _ in stub.Generate(pb.GenerateRequest(text="hi")):
                pass

        await _on_schedule(offsets, one)


async def _bare_http(url: str, offsets: list[float]) -> None:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one() -> None:
            async with session.post(url, json={"prompt": "hi", "stream": True}) as response:
                async for _ in response.content:
                    pass

        await _on_schedule(offsets, one)


async def _on_schedule(offsets: list[float], one: Any) -> None:
    start = time.perf_counter()
    tasks = []
    for offset in offsets:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)


def _cpu(fn: Any) -> tuple[float, Any]:
    """(process CPU seconds, result) of running `fn`."""
    cpu = time.process_time()
    result = fn()
    return time.process_time() - cpu, result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--num", type=int, default=2000)
    args = parser.parse_args()
    from vllm_cluster.loadtest.arrivals import arrival_offsets
    from vllm_cluster.loadtest.canned import canned_server
    from vllm_cluster.loadtest.datasets import SampleRequest
    from vllm_cluster.loadtest.metrics import summarize
    from vllm_cluster.loadtest.runner import Schedule, run
    from vllm_cluster.loadtest.targets import GrpcTarget, OpenAITarget

    with canned_server() as server:
        grpc_address, base_url = server.grpc_address, server.base_url
        requests = [SampleRequest(prompt="hi", prompt_len=8, output_len=NUM_TOKENS)] * args.num
        offsets = arrival_offsets(args.num, args.rate, 1.0, seed=0)
        schedule = Schedule(request_rate=args.rate, seed=0)
        print(f"{args.num} requests at {args.rate:g} req/s, {NUM_TOKENS} streamed tokens each; client CPU per request")
        print(f"{'target':<8} {'bare ms':>8} {'harness ms':>11} {'overhead ms':>12} "
              f"{'achieved req/s':>15} {'p99 ttft ms':>12}")
        for name, target, bare in (
            ("grpc", GrpcTarget(grpc_address, "canned"), lambda: asyncio.run(_bare_grpc(grpc_address, offsets))),
            (
                "openai",
                OpenAITarget(base_url, "canned"),
                lambda: asyncio.run(_bare_http(base_url + "/v1/completions", offsets)),
            ),
        ):
            bare_cpu, _ = _cpu(bare)
            harness_cpu, outcome = _cpu(lambda t=target: asyncio.run(run(t, requests, schedule, progress=False)))
            summary = summarize(outcome.results, outcome.duration_s, [99])
            assert summary["completed"] == args.num, summary.get("errors")
            per_bare, per_harness = bare_cpu / args.num * 1e3, harness_cpu / args.num * 1e3
            print(f"{name:<8} {per_bare:8.3f} {per_harness:11.3f} {per_harness - per_bare:12.3f} "
                  f"{summary['request_throughput']:15.1f} {summary['p99_ttft_ms']:12.2f}")


if __name__ == "__main__":
    main()
