"""Multi-turn chat on a CPU cluster, with a host-memory KV tier against without, same run.

    .venv/bin/python benchmarks/bench_kv_tiers_cpu.py [--num-conversations 8 --num-turns 4]

Many conversations are interleaved: each turn's prompt is the conversation so far (a long
first message, then every answer and user message) plus a new user message, and the
conversations take turns, so the instance's small device KV cache (`--num-blocks`) cannot
hold them all. Without tiers, a conversation's earlier turns are evicted before it comes
back and its whole prompt is recomputed; with `cache.host_kv_gib`, the evicted blocks are
loaded back from host memory. The same greedy workload runs on both clusters (one colocated
instance each, one after the other); it prints TTFT p50/p90 per configuration, their ratio,
and whether every answer is equal.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from vllm_cluster.client import Client
from vllm_cluster.cluster.local import LocalCluster


def engine_config(num_blocks: int, host_kv_gib: float) -> dict[str, Any]:
    cache: dict[str, Any] = {"block_size": 16, "num_blocks": num_blocks}
    if host_kv_gib > 0:
        cache["host_kv_gib"] = host_kv_gib
    return {
        "model": {"model": "smollm2-135m-instruct", "dtype": "float32"},
        "cache": cache,
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": num_blocks * 16},
        "device": "cpu",
        "num_threads": 2,
    }


def chat(client: Client, args: argparse.Namespace) -> tuple[list[float], list[list[int]]]:
    """Every turn of every conversation, round robin; (TTFT of each turn in ms, its answer)."""
    rng = random.Random(0)
    history = [[rng.randrange(100, 49000) for _ in range(args.first_len)] for _ in range(args.num_conversations)]
    ttfts_ms: list[float] = []
    answers: list[list[int]] = []
    for _ in range(args.num_turns):
        for convo in history:
            convo += [rng.randrange(100, 49000) for _ in range(args.message_len)]
            done = client.generate(token_ids=convo, max_tokens=args.output_len, temperature=0, ignore_eos=True)
            assert done.timings is not None
            ttfts_ms.append(done.timings.ttft_s * 1e3)
            answers.append(list(done.token_ids))
            convo += done.token_ids
    return ttfts_ms, answers


def run(args: argparse.Namespace, host_kv_gib: float) -> tuple[list[float], list[list[int]], float]:
    config = {
        "engine": engine_config(args.num_blocks, host_kv_gib),
        "cluster": {"num_prefill": 0, "num_decode": 1},
        "router": {"min_prefill_tokens": 10**6, "stats_interval_s": 0.2},
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.yaml"
        path.write_text(yaml.safe_dump(config))
        cluster = LocalCluster.from_yaml(path)
        cluster.log_dir = Path(tmp)
        with cluster:
            client = Client(cluster.router_address)
            client.generate(token_ids=[1, 2, 3], max_tokens=2)  # warm-up
            start = time.perf_counter()
            ttfts_ms, answers = chat(client, args)
            elapsed = time.perf_counter() - start
            client.close()
    return ttfts_ms, answers, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-conversations", type=int, default=8)
    parser.add_argument("--num-turns", type=int, default=4)
    parser.add_argument("--first-len", type=int, default=400, help="tokens of each conversation's first message")
    parser.add_argument("--message-len", type=int, default=32, help="tokens of each later user message")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=64, help="device KV blocks of 16 tokens")
    parser.add_argument("--host-kv-gib", type=float, default=1.0)
    args = parser.parse_args()
    rows = []
    for name, gib in (("device cache only", 0.0), (f"+ host tier {args.host_kv_gib:g} GiB", args.host_kv_gib)):
        ttfts_ms, answers, elapsed = run(args, gib)
        rows.append((name, ttfts_ms, answers, elapsed))
    num_requests = args.num_conversations * args.num_turns
    print(f"\n{args.num_conversations} conversations x {args.num_turns} turns, interleaved ({num_requests} requests, "
          f"first message {args.first_len} tokens, then {args.message_len} per message, {args.output_len} out), "
          f"device KV cache {args.num_blocks} blocks of 16 tokens, one colocated CPU instance\n")
    print("| configuration | TTFT p50 ms | TTFT p90 ms | later turns TTFT p50 ms | wall s |")
    print("|---|---|---|---|---|")
    p50s = []
    for name, ttfts_ms, _, elapsed in rows:
        ordered = sorted(ttfts_ms)
        later = sorted(ttfts_ms[args.num_conversations :])
        p50s.append(statistics.median(ordered))
        print(f"| {name} | {p50s[-1]:.0f} | {ordered[int(0.9 * len(ordered))]:.0f} | "
              f"{statistics.median(later):.0f} | {elapsed:.1f} |")
    equal = rows[0][2] == rows[1][2]
    print(f"\nhost tier vs device cache only: TTFT p50 {p50s[0] / p50s[1]:.2f}x better; "
          f"answers equal (greedy): {equal}")
    if not equal:
        raise SystemExit("the answers differ between the two configurations")


if __name__ == "__main__":
    main()
