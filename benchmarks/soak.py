"""The long soak: a 2 prefill + 2 decode CPU cluster (tests/integration/soak_cluster.yaml)
with KV transport faults injected on the prefill senders, and many requests with random
client aborts, deadlines and timeouts. Prints what ran, what was injected and detected,
and the blocks leaked (must be 0).

    PYTHONPATH=. .venv/bin/python benchmarks/soak.py --requests 2000 --concurrency 16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.test_soak import CONFIG, worker_stats  # noqa: E402
from vllm_cluster.cluster.local import LocalCluster  # noqa: E402
from vllm_cluster.loadtest.soak import soak  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--faults", default="corrupt=0.05,drop=0.02,delay_ms=2,seed=7", help="cluster.kv_faults")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cluster = LocalCluster.from_yaml(CONFIG, kv_faults=args.faults)
    with cluster:
        report = soak(cluster.router_address, lambda: worker_stats(cluster), args.requests, args.concurrency, args.seed)
        logs = "".join(p.log_file.read_text(errors="replace") for p in cluster.processes)
    print(f"requests {report.num_requests} in {report.duration_s:.0f} s, concurrency {args.concurrency}, "
          f"faults {args.faults}")
    print(f"outcomes: {dict(sorted(report.outcomes.items()))}")
    print(f"corrupt chunks detected (decode logs): {logs.count('landed corrupted')}; "
          f"transfers that never completed (dropped chunks): {logs.count('did not arrive')}; "
          f"requests completed after decode recomputed the prompt: {report.num_recomputed}")
    print(f"unclean endings: {report.unclean or 0}; blocks leaked: {report.leaked_blocks or 0}")


if __name__ == "__main__":
    main()
