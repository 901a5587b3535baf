"""Prefix-aware routing against round robin on a CPU cluster of 1 prefill and 2 decode
instances, same workload, same run: a few long system prompts shared by many requests.

    .venv/bin/python benchmarks/bench_prefix_routing.py [--num-system 8 --system-len 500 --num-requests 64]

Each decode instance's KV cache holds only about half of the system prompts, so where a
request lands decides whether its prefix is there. Decode computes a request itself when
it holds all but `min_prefill_tokens` of it; otherwise the prompt goes through the prefill
instance. Reports TTFT p50/p90 and throughput per policy, and their ratios.
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


def run_workload(
    client: Client, requests: list[list[int]], output_len: int, concurrency: int
) -> tuple[list[Completion], float]:
    def ask(prompt: list[int]) -> Completion:
        return client.generate(token_ids=prompt, max_tokens=output_len, temperature=0, ignore_eos=True)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(ask, requests))
    return results, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-system", type=int, default=8)
    parser.add_argument("--system-len", type=int, default=500)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--num-blocks", type=int, default=160, help="per instance: about half the system prompts")
    args = parser.parse_args()
    rng = random.Random(0)
    systems = [[rng.randrange(100, 49000) for _ in range(args.system_len)] for _ in range(args.num_system)]
    requests = [systems[i % args.num_system] + [rng.randrange(100, 49000) for _ in range(16)]
                for i in range(args.num_requests)]
    rng.shuffle(requests)
    engine = {
        "model": {"model": "smollm2-135m-instruct", "dtype": "float32"},
        "cache": {"block_size": 16, "num_blocks": args.num_blocks},
        "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 512, "max_model_len": 1024},
        "device": "cpu", "num_threads": 1,
    }
    rows = []
    for policy in ("round_robin", "prefix_aware"):
        config = {"engine": engine, "cluster": {"num_prefill": 1, "num_decode": 2, "transport": "ucx"},
                  "router": {"policy": policy, "min_prefill_tokens": 64, "stats_interval_s": 0.2}}
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "bench.yaml"
            path.write_text(yaml.safe_dump(config))
            cluster = LocalCluster.from_yaml(path)
            cluster.log_dir = Path(tmp)
            with cluster:
                client = Client(cluster.router_address)
                client.generate(token_ids=[1, 2, 3], max_tokens=2)  # warm-up
                results, elapsed = run_workload(client, requests, args.output_len, args.concurrency)
                client.close()
        ttfts = sorted(r.timings.ttft_s * 1e3 for r in results)  # type: ignore[union-attr]
        cached = sum(r.usage.cached_tokens for r in results) / sum(r.usage.prompt_tokens for r in results)  # type: ignore[union-attr]
        skipped = sum(r.timings.prefill_skipped for r in results) / len(results)  # type: ignore[union-attr]
        rows.append((policy, statistics.median(ttfts), ttfts[int(0.9 * len(ttfts))], len(results) / elapsed,
                     len(results) * args.output_len / elapsed, cached, skipped))
    print(f"\n{args.num_requests} requests over {args.num_system} system prompts of {args.system_len} tokens "
          f"(+16 own tokens, {args.output_len} out), concurrency {args.concurrency}, "
          f"{args.num_blocks} KV blocks per instance\n")
    print("| policy | TTFT p50 ms | TTFT p90 ms | requests/s | output tok/s | decode-cached prompt share "
          "| prefill skipped |")
    print("|---|---|---|---|---|---|---|")
    for policy, p50, p90, rps, tps, cached, skipped in rows:
        print(f"| {policy} | {p50:.0f} | {p90:.0f} | {rps:.2f} | {tps:.1f} | {cached:.0%} | {skipped:.0%} |")
    rr, pa = rows
    print(f"\nprefix_aware vs round_robin: TTFT p50 {rr[1] / pa[1]:.2f}x better, throughput {pa[3] / rr[3]:.2f}x")


if __name__ == "__main__":
    main()
