"""Disaggregated against colocated on one GPU: a prefill and a decode process sharing the
GPU, the KV handed over by CUDA IPC, against the same decode process computing prompts
itself (colocated), both through the same router, in the same run.

    python benchmarks/bench_disagg_gpu.py [--model llama-3.1-8b --input-len 2048 ...]

Reports (1) time to first token at concurrency 1, broken into its parts, and the KV
hand-off's share of it; (2) output throughput of --num-requests requests at once.
Weights are random (`load_format: dummy`): no weights can be downloaded on the GPU box;
speed does not depend on their values. Prompts are random token ids, no prefix hits.
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


def engine_section(args: argparse.Namespace) -> dict:
    return {
        "model": {"model": args.model, "load_format": "dummy", "dtype": "bfloat16"},
        "cache": {"block_size": 16, "num_blocks": args.num_blocks, "enable_prefix_caching": False},
        "scheduler": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                      "max_model_len": args.input_len + args.output_len + 16},
        "device": "cuda",
    }


def generate_all(
    client: Client, prompts: list[list[int]], output_len: int, concurrency: int
) -> tuple[list[Completion], float]:
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(
            lambda p: client.generate(token_ids=p, max_tokens=output_len, temperature=0, ignore_eos=True), prompts))
    return results, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--input-len", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-ttft", type=int, default=8, help="sequential requests for the TTFT breakdown")
    parser.add_argument("--num-requests", type=int, default=64, help="concurrent requests for throughput")
    parser.add_argument("--num-blocks", type=int, default=12000)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--transport", default="cuda_ipc")
    args = parser.parse_args()
    rng = random.Random(0)
    rows = []
    for mode, min_prefill in (("disaggregated", 0), ("colocated", 1 << 30)):
        config = {"engine": engine_section(args),
                  "cluster": {"num_prefill": 1, "num_decode": 1, "transport": args.transport},
                  "router": {"min_prefill_tokens": min_prefill, "transfer_timeout_s": 60, "prefill_timeout_s": 600}}
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "bench.yaml"
            path.write_text(yaml.safe_dump(config))
            cluster = LocalCluster.from_yaml(path)
            cluster.log_dir = Path(tmp)
            with cluster:
                client = Client(cluster.router_address)
                fresh = lambda n: [[rng.randrange(100, 30000) for _ in range(args.input_len)] for _ in range(n)]  # noqa: E731
                generate_all(client, fresh(4), 4, 4)  # warm-up: kernels, graphs, connections
                ttft_runs = [generate_all(client, [p], 1, 1)[0][0] for p in fresh(args.num_ttft)]
                results, elapsed = generate_all(client, fresh(args.num_requests), args.output_len, args.num_requests)
                client.close()
        t = [r.timings for r in ttft_runs]
        med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
        handoff = med([x.transfer_s for x in t])
        rows.append((mode, med([x.ttft_s for x in t]), med([x.router_s for x in t]),
                     med([x.prefill_queue_s for x in t]), med([x.prefill_compute_s for x in t]), handoff,
                     med([x.decode_queue_s for x in t]),
                     args.num_requests * args.output_len / elapsed,
                     statistics.median([r.timings.ttft_s for r in results]) * 1e3))
    print(f"\n{args.model} bf16, {args.input_len} prompt tokens; throughput: {args.num_requests} concurrent "
          f"requests x {args.output_len} output tokens; transport {args.transport}; medians in ms\n")
    print("| mode | TTFT | router | prefill queue | prefill compute | KV hand-off | hand-off / TTFT | decode queue "
          "| output tok/s | TTFT under load |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode, ttft, router, pq, pc, ho, dq, tput, ttft_load in rows:
        print(f"| {mode} | {ttft:.1f} | {router:.1f} | {pq:.1f} | {pc:.1f} | {ho:.2f} | {ho / ttft:.2%} | {dq:.1f} "
              f"| {tput:.0f} | {ttft_load:.0f} |")
    if len(rows) == 2:
        print(f"\ndisaggregated / colocated throughput: {rows[0][7] / rows[1][7]:.3f}")


if __name__ == "__main__":
    main()
