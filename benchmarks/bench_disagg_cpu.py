"""Disaggregated (1 prefill + 1 decode) against colocated (the decode instance computes the
prompt itself), same cluster processes, same run, on CPU, and disaggregated with the first
token sent by the decode instance (`early_first_token: false`) rather than by the router as
the prefill answers: time to first token broken into
router, prefill queue, prefill compute, KV transfer and decode queue; and the end-to-end
throughput of a batch of concurrent requests.

    .venv/bin/python benchmarks/bench_disagg_cpu.py [--transport ucx --input-len 512 --num-requests 8]

Colocated runs through the same router with `min_prefill_tokens` above every prompt's
length, so both paths share the router, gRPC and the decode process; the difference is
the hand-off. Prompts are random token ids (no prefix-cache hits); every request generates
exactly --output-len tokens. Results print as markdown.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from vllm_cluster.client import Client, Completion
from vllm_cluster.cluster.local import LocalCluster

ENGINE = {
    "model": {"model": "smollm2-135m-instruct", "dtype": "float32"},
    "cache": {"block_size": 16, "num_blocks": 1024},
    "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 512, "max_model_len": 4096},
    "device": "cpu",
    "num_threads": 1,
}


def run(
    cluster: LocalCluster, prompts: list[list[int]], output_len: int, concurrency: int
) -> tuple[list[Completion], float]:
    client = Client(cluster.router_address)
    client.generate(token_ids=prompts[0][:8], max_tokens=2)  # warm-up
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(
            lambda p: client.generate(token_ids=p, max_tokens=output_len, temperature=0, ignore_eos=True), prompts))
    elapsed = time.perf_counter() - start
    client.close()
    return results, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default="ucx", choices=["ucx", "nccl"])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=1, help="1 measures TTFT without queueing")
    args = parser.parse_args()
    rng = random.Random(0)
    rows = []
    modes = (("disaggregated", 0, True), ("disaggregated, first token from decode", 0, False),
             ("colocated", 1 << 30, True))
    for mode, min_prefill, early in modes:
        prompts = [[rng.randrange(100, 49000) for _ in range(args.input_len)] for _ in range(args.num_requests)]
        config = {"engine": ENGINE, "cluster": {"num_prefill": 1, "num_decode": 1, "transport": args.transport},
                  "router": {"min_prefill_tokens": min_prefill, "early_first_token": early}}
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "bench.yaml"
            path.write_text(yaml.safe_dump(config))
            with LocalCluster.from_yaml(path) as cluster:
                results, elapsed = run(cluster, prompts, args.output_len, args.concurrency)
        t = [r.timings for r in results]
        ms = lambda xs: f"{statistics.median(xs) * 1e3:.1f}"  # noqa: E731
        rows.append([mode, ms([x.ttft_s for x in t]), ms([x.router_s for x in t]), ms([x.prefill_queue_s for x in t]),
                     ms([x.prefill_compute_s for x in t]), ms([x.transfer_s for x in t]),
                     ms([x.decode_queue_s for x in t]), f"{args.num_requests * args.output_len / elapsed:.1f}"])
    print(f"\n{args.num_requests} requests, {args.input_len} prompt tokens, {args.output_len} output tokens, "
          f"concurrency {args.concurrency}, transport {args.transport}; medians in ms\n")
    print("| mode | TTFT | router | prefill queue | prefill compute | transfer | decode queue | output tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
