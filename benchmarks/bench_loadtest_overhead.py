"""What the load-testing harness itself costs: client CPU time per request at 200 req/s
against stub servers that answer instantly (16 streamed tokens each), so that the harness
never becomes the bottleneck it measures.

Measured in the same run, per target (our gRPC API; an OpenAI-style SSE endpoint):
  harness   `loadtest.runner.run` with the real target (timing every piece, bookkeeping)
  bare      the same calls on the same schedule with no timing or results at all
The difference is the harness's own cost; the budget is the 5 ms between requests.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_loadtest_overhead.py [--rate 200 --num 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

NUM_TOKENS = 16


def _stub_main() -> None:
    """The stub servers: gRPC Generation and HTTP /v1/completions, both answering at once."""
    import grpc
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from vllm_cluster.proto import cluster_pb2 as pb
    from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc

    class Stub(pb_grpc.GenerationServicer):
        def Generate(self, request: Any, context: Any) -> Iterator[Any]:
            for i in range(NUM_TOKENS - 1):
                yield pb.GenerateResponse(request_id=request.request_id, token_ids=[i], text="x")
            yield pb.GenerateResponse(request_id=request.request_id, token_ids=[0], text="x", finish_reason="length",
                                      usage=pb.Usage(prompt_tokens=8, completion_tokens=NUM_TOKENS))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
    pb_grpc.add_GenerationServicer_to_server(Stub(), server)
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    async def completions(request: Any) -> StreamingResponse:
        async def events() -> Any:
            for _ in range(NUM_TOKENS):
                yield 'data: {"choices": [{"index": 0, "text": "x", "finish_reason": null}]}\n\n'
            yield f'data: {{"choices": [], "usage": {{"prompt_tokens": 8, "completion_tokens": {NUM_TOKENS}}}}}\n\n'
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    import socket
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    http_port = sock.getsockname()[1]
    print(json.dumps({"grpc": grpc_port, "http": http_port}), flush=True)
    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


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
    parser.add_argument("--stub", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--num", type=int, default=2000)
    args = parser.parse_args()
    if args.stub:
        _stub_main()
        return
    from vllm_cluster.loadtest.arrivals import arrival_offsets
    from vllm_cluster.loadtest.datasets import SampleRequest
    from vllm_cluster.loadtest.metrics import summarize
    from vllm_cluster.loadtest.runner import Schedule, run
    from vllm_cluster.loadtest.targets import GrpcTarget, OpenAITarget

    stub = subprocess.Popen([sys.executable, __file__, "--stub"], stdout=subprocess.PIPE, env={**os.environ})
    try:
        assert stub.stdout is not None
        ports = json.loads(stub.stdout.readline())
        grpc_address, base_url = f"127.0.0.1:{ports['grpc']}", f"http://127.0.0.1:{ports['http']}"
        time.sleep(1.0)
        requests = [SampleRequest(prompt="hi", prompt_len=8, output_len=NUM_TOKENS)] * args.num
        offsets = arrival_offsets(args.num, args.rate, 1.0, seed=0)
        schedule = Schedule(request_rate=args.rate, seed=0)
        print(f"{args.num} requests at {args.rate:g} req/s, {NUM_TOKENS} streamed tokens each; client CPU per request")
        print(f"{'target':<8} {'bare ms':>8} {'harness ms':>11} {'overhead ms':>12} "
              f"{'achieved req/s':>15} {'p99 ttft ms':>12}")
        for name, target, bare in (
            ("grpc", GrpcTarget(grpc_address, "stub"), lambda: asyncio.run(_bare_grpc(grpc_address, offsets))),
            (
                "openai",
                OpenAITarget(base_url, "stub"),
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
    finally:
        stub.terminate()
        stub.wait(timeout=10)


if __name__ == "__main__":
    main()
