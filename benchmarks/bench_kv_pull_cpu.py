"""Cross-instance KV reuse on a CPU cluster: TTFT of a request whose 2k-token prefix another
instance holds, pulled from there (from its device cache, and from its host tier) against
computed, on the same instance in the same run.

    .venv/bin/python benchmarks/bench_kv_pull_cpu.py [--prefix-len 2048 --num-trials 3]

One cluster: router, embedded Redis, two decode instances (A and B) that compute their own
prompts, requests sent in turn (round robin, so A, B, A, B, ...), `router.kv_pull` on, UCX.
Each instance's device cache holds one prompt (no more), over a host tier that holds many.
Each trial, with three fresh prefixes E, Q and P:
  1. E + question 1 -> A, computed there;
  2. Q + question 2 -> B, which nobody holds: B computes the whole prompt (TTFT "recompute",
     what B would do without a pull);
  3. P + question 1 -> A, computed there; A's device cache evicts E into its host tier;
  4. P + question 2 -> B, which pulls P's blocks from A's device cache and computes the rest
     (TTFT "pull, device");
  5. P + question 2 -> A, from its own cache: its answer must equal B's;
  6. E + question 2 -> B, which pulls E's blocks from A, which loads them from its host tier
     first (TTFT "pull, host tier"; the blocks A loaded from its host tier are counted);
  7. E + question 2 -> A, from its own cache: its answer must equal B's.
It prints the three TTFTs per trial, their medians and ratios, and whether the answers were
equal.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vllm_cluster.client import Client
from vllm_cluster.cluster.local import LocalCluster


def config(args: argparse.Namespace) -> dict[str, Any]:
    max_model_len = args.prefix_len + 64
    return {
        "engine": {
            "model": {"model": "smollm2-135m-instruct", "dtype": "float32"},
            # One prompt's blocks: each new prompt evicts the last one into the host tier.
            "cache": {"block_size": 16, "num_blocks": -(-max_model_len // 16), "host_kv_gib": 0.5},
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


def host_tier_loads(cluster: LocalCluster) -> int:
    """Blocks the decode instances have loaded from their host tiers so far."""
    total = 0.0
    for name, address in cluster.metrics_addresses.items():
        if name.startswith("decode"):
            with urllib.request.urlopen(address + "/metrics", timeout=5) as response:
                text = response.read().decode()
            total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith("vllm_cluster:kv_offload_loaded_blocks_total{") and 'tier="host"' in line)
    return int(total)


@dataclass(frozen=True, slots=True)
class Trial:
    recompute_ms: float
    device_ms: float  # pulled from A's device cache
    host_ms: float  # pulled from A's host tier
    num_pulled_device: int
    num_pulled_host: int
    num_host_loads: int  # blocks A loaded from its host tier for that pull
    equal: bool  # every answer after a pull equals A's own


def trial(client: Client, cluster: LocalCluster, rng: random.Random, args: argparse.Namespace) -> Trial:
    evicted, fresh, held = ([rng.randrange(100, 49000) for _ in range(args.prefix_len)] for _ in range(3))
    question_1, question_2 = ([rng.randrange(100, 49000) for _ in range(32)] for _ in range(2))
    ask(client, evicted + question_1, args.output_len)  # A computes E
    recompute_ms, _, num_pulled_cold = ask(client, fresh + question_2, args.output_len)  # B computes it all
    ask(client, held + question_1, args.output_len)  # A computes P; E leaves its device cache
    time.sleep(0.5)  # A's block events reach Redis (tens of ms)
    device_ms, device_answer, num_pulled_device = ask(client, held + question_2, args.output_len)  # B pulls P
    _, own_device_answer, _ = ask(client, held + question_2, args.output_len)  # A, from its own cache
    loads_before = host_tier_loads(cluster)
    host_ms, host_answer, num_pulled_host = ask(client, evicted + question_2, args.output_len)  # B pulls E
    num_host_loads = host_tier_loads(cluster) - loads_before
    _, own_host_answer, _ = ask(client, evicted + question_2, args.output_len)  # A, from its own cache
    if num_pulled_device == 0 or num_pulled_host == 0 or num_pulled_cold != 0:
        raise SystemExit(f"the requests did not go where planned (pulled {num_pulled_device} from the device, "
                         f"{num_pulled_host} from the host tier, then {num_pulled_cold})")
    equal = device_answer == own_device_answer and host_answer == own_host_answer
    return Trial(recompute_ms, device_ms, host_ms, num_pulled_device, num_pulled_host, num_host_loads, equal)


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
            rows = [trial(client, cluster, rng, args) for _ in range(args.num_trials)]
            client.close()
    print(f"\n{args.prefix_len}-token prefix held by instance A (in its device cache, or evicted to its host "
          f"tier), request ({args.prefix_len} + 32 tokens, {args.output_len} out) sent to B; two decode instances "
          f"(SmolLM2 float32, 2 torch threads each), {args.transport} transport, one CPU machine\n")
    print("| trial | TTFT recompute ms | blocks pulled, device | TTFT pull, device ms | blocks pulled, host tier "
          "(of which loaded from it) | TTFT pull, host tier ms | answers equal |")
    print("|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        print(f"| {i} | {r.recompute_ms:.0f} | {r.num_pulled_device} | {r.device_ms:.0f} | {r.num_pulled_host} "
              f"({r.num_host_loads}) | {r.host_ms:.0f} | {r.equal} |")
    recompute_p50 = statistics.median(r.recompute_ms for r in rows)
    device_p50 = statistics.median(r.device_ms for r in rows)
    host_p50 = statistics.median(r.host_ms for r in rows)
    print(f"\nmedian TTFT: recompute {recompute_p50:.0f} ms; pull from the device cache {device_p50:.0f} ms "
          f"({recompute_p50 / device_p50:.2f}x faster); pull from the host tier {host_p50:.0f} ms "
          f"({recompute_p50 / host_p50:.2f}x faster)")
    if not all(r.equal for r in rows):
        raise SystemExit("an answer after a pull differs from the holder's own answer")


if __name__ == "__main__":
    main()
