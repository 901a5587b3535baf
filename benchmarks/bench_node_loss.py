"""Node gone -> routed around: how long after every process of one Ray node is SIGKILLed
do the router's requests stop failing, under a steady load.

Two Ray nodes on this machine (tests/e2e/ray_nodes.py: loopback addresses of their own),
one prefill and one decode instance on each, the router and Redis on node_a. Client
threads send short greedy requests back to back; node_b is killed mid-run. Reported, from
the same run:

  - baseline: the p50 and max latency of a request before the loss;
  - marked_unhealthy_after_s: from the kill to the router's log line that takes each of
    node_b's instances out of routing;
  - in_flight_latency_max_s: the slowest of the requests in flight at the kill (they
    migrate or are retried on node_a), against the baseline's max;
  - first_success_after_s: from the kill to the end of the first request, started after the
    kill, that completed;
  - routed_around_s: from the kill to the end of the last request that failed (0 if none
    did): after it every request completed;
  - outcomes of the requests in flight at the kill and of those started after it.

    python -m benchmarks.bench_node_loss [--threads 4] [--after-s 20]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tests.e2e.ray_nodes import RayNodes
from vllm_cluster.client import Client, ClientError
from vllm_cluster.cluster.state import ClusterState

CONFIG = """\
engine:
  model: {{model: smollm2-135m-instruct, dtype: float32}}
  cache: {{num_blocks: 128}}
  scheduler: {{max_num_seqs: 4, max_num_batched_tokens: 128, max_model_len: 1024}}
  device: cpu
  num_threads: 1
cluster:
  name: bench-node-loss-{pid}
  ray_address: {address}
  host: node
  num_prefill: 2
  num_decode: 2
  prefill: {{placement: [{{node_a: 1}}, {{node_b: 1}}]}}
  decode: {{placement: [{{node_a: 1}}, {{node_b: 1}}]}}
router:
  host: {router_host}
  port: 0
  http_port: 0
  policy: round_robin         # both nodes take requests until one is lost
  min_prefill_tokens: 0
  queue_timeout_s: 30
  lease_s: 10
  transfer_timeout_s: 5
"""


@dataclass(frozen=True, slots=True)
class Sample:
    start: float
    end: float
    outcome: str  # "completed" or the gRPC status code's name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=4, help="client threads sending back to back")
    parser.add_argument("--before-s", type=float, default=15.0, help="load before the kill")
    parser.add_argument("--after-s", type=float, default=20.0, help="load after the kill")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        nodes = RayNodes(root / "ray").start()
        config = root / "cluster.yaml"
        config.write_text(CONFIG.format(pid=os.getpid(), address=nodes.address,
                                        router_host=nodes.nodes["node_a"].ip))
        where = ["-f", str(config), "--state-dir", str(root / "state")]
        try:
            up = _cli("up", *where, "--detach", env=nodes.env)
            if up.returncode != 0:
                print(up.stdout + up.stderr, file=sys.stderr)
                return 1
            state = ClusterState.load(next((root / "state").glob("*.json")))
            report, killed_at_wall = _measure(nodes, state.router_address, args)
            lost = [r.name for r in state.processes if r.node_ip == nodes.nodes["node_b"].ip]
            router_log = Path(state.record("router").log_file)
            report["marked_unhealthy_after_s"] = _unhealthy_after(router_log, lost, killed_at_wall)
        finally:
            _cli("down", *where, env=nodes.env)
            nodes.stop()
    print(json.dumps(report))
    return 0


def _measure(nodes: RayNodes, address: str, args: argparse.Namespace) -> tuple[dict[str, object], float]:
    """The report, and the wall-clock time of the kill."""
    samples: list[Sample] = []
    stop = threading.Event()

    def run(index: int) -> None:
        with Client(address, timeout_s=60) as client:
            n = 0
            while not stop.is_set():
                start = time.monotonic()
                try:
                    client.generate(f"Client {index}, request {n}: count to ten.", max_tokens=args.max_tokens,
                                    temperature=0, ignore_eos=True)
                    outcome = "completed"
                except ClientError as e:
                    outcome = e.code.name
                samples.append(Sample(start, time.monotonic(), outcome))
                n += 1

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(args.threads)]
    for thread in threads:
        thread.start()
    time.sleep(args.before_s)
    killed_at, killed_at_wall = time.monotonic(), time.time()
    nodes.kill("node_b")
    time.sleep(args.after_s)
    stop.set()
    for thread in threads:
        thread.join(timeout=120)
    before = [s for s in samples if s.end < killed_at]
    in_flight = [s for s in samples if s.start < killed_at <= s.end]
    after = [s for s in samples if s.start >= killed_at]
    failed_after_kill = [s for s in samples if s.end >= killed_at and s.outcome != "completed"]
    first_ok = min((s.end for s in after if s.outcome == "completed"), default=None)
    latencies = [s.end - s.start for s in before if s.outcome == "completed"]
    return {
        "baseline_latency_p50_s": round(statistics.median(latencies), 3) if latencies else None,
        "baseline_latency_max_s": round(max(latencies), 3) if latencies else None,
        "first_success_after_s": None if first_ok is None else round(first_ok - killed_at, 3),
        "routed_around_s": round(max((s.end for s in failed_after_kill), default=killed_at) - killed_at, 3),
        "in_flight_latency_max_s": round(max((s.end - s.start for s in in_flight), default=0.0), 3),
        "in_flight": _count(in_flight),
        "started_after": _count(after),
        "hung": sum(1 for t in threads if t.is_alive()),
    }, killed_at_wall


def _unhealthy_after(router_log: Path, names: list[str], killed_at: float) -> dict[str, float | None]:
    """Seconds from the kill to the router's first "<name> at ... is unhealthy" line after it."""
    found: dict[str, float | None] = dict.fromkeys(names)
    for line in router_log.read_text(errors="replace").splitlines():
        stamp, _, rest = line.partition(" router ")
        for name in names:
            if found[name] is None and f"{name} at " in rest and "is unhealthy" in rest:
                try:
                    at = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
                except ValueError:
                    continue
                if at >= killed_at - 0.01:
                    found[name] = round(at - killed_at, 3)
    return found


def _count(samples: list[Sample]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for s in samples:
        counts[s.outcome] = counts.get(s.outcome, 0) + 1
    return counts


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vllm_cluster.cluster.cli", *args], capture_output=True, text=True,
                          timeout=900, env=env, cwd=Path(__file__).resolve().parents[1])


if __name__ == "__main__":
    sys.exit(main())
