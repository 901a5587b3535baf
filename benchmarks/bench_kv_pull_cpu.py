"""Cross-instance KV reuse on a CPU cluster: TTFT of a request whose 2k-token prefix another
instance holds, pulled from there against computed, on the same instance in the same run.

    .venv/bin/python benchmarks/bench_kv_pull_cpu.py [--prefix-len 2048 --num-trials 3]

One cluster: router, embedded Redis, two decode instances (A and B) that compute their own
prompts, requests sent in turn (round robin, so A, B, A, B, ...), `router.kv_pull` on, UCX.
Each trial:
  1. prefix P + question 1 -> A, computed there (A now holds P);
  2. P + question 2 -> B, which lacks P: B pulls P's blocks from A and computes the rest
     (TTFT "pull");
  3. P + question 2 -> A, which holds P itself: its answer must equal B's;
  4. a fresh prefix Q of the same length + question 2 -> B, which nobody holds: B computes
     the whole prompt (TTFT "recompute", what B would do without the pull).
It prints both TTFTs per trial, their medians and ratio, and whether the answers were equal.
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


def config(args: argparse.Namespace) -> dict[str, Any]:
    max_model_len = args.prefix_len + 256
    return {
        "engine": {
            "model": {"model": "smollm2-135m-instruct", "dtype": "float32"},
            "cache": {"block_size": 16, "num_blocks": 4 * max_model_len // 16},
            "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": max_model_len},
            "device": "cpu",
            "num_threads": 2,
        },
        "cluster": {"num_prefill": 0, "num_decode": 2, "transport": args.transport},
        "router": {"policy": "round_robin", "min_prefill_tokens": 10**6, "kv_pull": True, "stats_interval_s": 0.2},
    }


def ask(client: Client, prompt: list[int], output_len: int) -> tuple[float, list[int], int]:
    """(TTFT in ms, answer, blocks pulled)."""
    done = client.generate(token_ids=prompt, max_tokens=output_len, temperature=0, ignore_eos=True)
    assert done.timings is not None
    return done.timings.ttft_s * 1e3, list(done.token_ids), done.timings.num_kv_blocks_pulled


def trial(client: Client, rng: random.Random, args: argparse.Namespace) -> tuple[float, float, bool, int]:
    """(TTFT pull ms, TTFT recompute ms, answers equal, blocks pulled) of one trial."""
    prefix = [rng.randrange(100, 49000) for _ in range(args.prefix_len)]
    fresh = [rng.randrange(100, 49000) for _ in range(args.prefix_len)]
    question_1, question_2 = ([rng.randrange(100, 49000) for _ in range(32)] for _ in range(2))
    ask(client, prefix + question_1, args.output_len)  # A computes P
    time.sleep(0.5)  # A's block events reach Redis (tens of ms)
    pull_ms, pulled_answer, num_pulled = ask(client, prefix + question_2, args.output_len)  # B pulls P
    _, own_answer, _ = ask(client, prefix + question_2, args.output_len)  # A, from its own cache
    recompute_ms, _, num_pulled_cold = ask(client, fresh + question_2, args.output_len)  # B computes it all
    if num_pulled == 0 or num_pulled_cold != 0:
        raise SystemExit(f"the requests did not go where planned (pulled {num_pulled}, then {num_pulled_cold})")
    return pull_ms, recompute_ms, pulled_answer == own_answer, num_pulled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--num-trials", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--transport", default="ucx", choices=["ucx", "nccl"])
    args = parser.parse_args()
    rng = random.Random(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.yaml"
        path.write_text(yaml.safe_dump(config(args)))
        cluster = LocalCluster.from_yaml(path)
        cluster.log_dir = Path(tmp)
        with cluster:
            client = Client(cluster.router_address)
            for _ in range(2):  # warm-up, one request on each instance
                client.generate(token_ids=[1, 2, 3], max_tokens=2)
            rows = [trial(client, rng, args) for _ in range(args.num_trials)]
            client.close()
    print(f"\n{args.prefix_len}-token prefix held by instance A, request ({args.prefix_len} + 32 tokens, "
          f"{args.output_len} out) sent to B; two decode instances (SmolLM2 float32, 2 torch threads each), "
          f"{args.transport} transport, one CPU machine\n")
    print("| trial | blocks pulled | TTFT pull ms | TTFT recompute ms | answers equal |")
    print("|---|---|---|---|---|")
    for i, (pull_ms, recompute_ms, equal, num_pulled) in enumerate(rows):
        print(f"| {i} | {num_pulled} | {pull_ms:.0f} | {recompute_ms:.0f} | {equal} |")
    pull_p50 = statistics.median(r[0] for r in rows)
    recompute_p50 = statistics.median(r[1] for r in rows)
    print(f"\nmedian TTFT: pull {pull_p50:.0f} ms, recompute {recompute_p50:.0f} ms: "
          f"{recompute_p50 / pull_p50:.2f}x faster with the pull")
    if not all(r[2] for r in rows):
        raise SystemExit("an answer after a pull differs from the holder's own answer")


if __name__ == "__main__":
    main()
