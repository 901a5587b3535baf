"""A load step against the autoscaler, on and off, in the same run: how long until an
instance is added, the TTFT p99 over time, and requests lost (must be 0).

A CPU cluster of `up --detach` (SmolLM2 on one thread per instance; no prefill pool, one
decode instance to start). Open-loop arrivals at a fixed interval: `--rate` requests/s for
`--before-s`, then 4x for `--step-s`, then `--rate` again for `--after-s`. Each request is
16 greedy tokens (EOS ignored). The same schedule runs twice, on a fresh cluster each
time: the autoscaler off, then on (`vllm-cluster autoscale` beside it; targets below).
Reported per run: added_after_s (from the start of the step to the state file listing a
second decode instance, None when none came), the TTFT p99 of each 10 s window, and
requests lost (any error).

    python -m benchmarks.bench_autoscale [--rate 0.5] [--before-s 20] [--step-s 60] [--after-s 30]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tests.e2e.up import ENGINE_YAML
from vllm_cluster.client import Client, ClientError
from vllm_cluster.cluster.state import ClusterState

CONFIG = ENGINE_YAML + """\
cluster:
  name: bench-autoscale-{pid}
  num_prefill: 0
  num_decode: 1
router:
  port: 0
  http_port: 0
  queue_timeout_s: 120
autoscaler:
  ttft_p99_ms: {ttft_p99_ms}
  itl_p99_ms: 2000
  max_queue: 1
  min_decode: 1
  max_decode: 2
  interval_s: 2
  cooldown_s: 20
"""
WINDOW_S = 10.0
MAX_TOKENS = 16


@dataclass(slots=True)
class Outcome:
    sent_s: float  # since the run's first arrival
    ttft_s: float | None = None
    error: str = ""


def _cli(*args: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vllm_cluster.cluster.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=Path(__file__).resolve().parents[1])


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def run(args: argparse.Namespace, autoscale: bool, tmp: Path) -> dict[str, object]:
    config = tmp / f"cluster-{autoscale}.yaml"
    config.write_text(CONFIG.format(pid=os.getpid(), ttft_p99_ms=args.ttft_p99_ms))
    where = ["-f", str(config), "--state-dir", str(tmp / "state")]
    state_file = tmp / "state" / f"bench-autoscale-{os.getpid()}.json"
    up = _cli("up", *where, "--detach")
    assert up.returncode == 0, up.stdout + up.stderr
    scaler = None
    try:
        state = ClusterState.load(state_file)
        if autoscale:
            scaler = subprocess.Popen([sys.executable, "-m", "vllm_cluster.cluster.cli", "autoscale", *where],
                                      stdout=subprocess.DEVNULL, stderr=(tmp / "autoscale.log").open("w"),
                                      cwd=Path(__file__).resolve().parents[1])
        outcomes = _load(args, state.router_address, state_file)
    finally:
        if scaler is not None:
            scaler.terminate()
            scaler.wait(timeout=120)
        down = _cli("down", *where)
        assert down.returncode == 0, down.stdout + down.stderr
    return outcomes


def _load(args: argparse.Namespace, address: str, state_file: Path) -> dict[str, object]:
    schedule: list[float] = []
    t = 0.0
    for rate, length_s in ((args.rate, args.before_s), (4 * args.rate, args.step_s), (args.rate, args.after_s)):
        end = t + length_s
        while t < end:
            schedule.append(t)
            t += 1.0 / rate
    outcomes: list[Outcome] = []
    threads = []
    added_at: list[float] = []
    start = time.monotonic()

    def one(outcome: Outcome) -> None:
        try:
            with Client(address) as client:
                result = client.generate("Tell me a story.", max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
            assert result.timings is not None
            outcome.ttft_s = result.timings.ttft_s
        except ClientError as e:
            outcome.error = str(e)

    loaded = threading.Event()

    def watch() -> None:
        while not loaded.is_set() and not added_at:
            if sum(r.role == "decode" for r in ClusterState.load(state_file).processes) > 1:
                added_at.append(time.monotonic() - start)
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    for sent_s in schedule:
        time.sleep(max(0.0, start + sent_s - time.monotonic()))
        outcome = Outcome(sent_s)
        outcomes.append(outcome)
        thread = threading.Thread(target=one, args=(outcome,))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    loaded.set()
    watcher.join()
    windows = []
    for k in range(int(t // WINDOW_S) + 1):
        ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None and k * WINDOW_S <= o.sent_s < (k + 1) * WINDOW_S]
        p99 = _p99(ttfts)
        windows.append(None if p99 is None else round(p99 * 1000))
    return {
        "requests": len(outcomes),
        "lost": sum(bool(o.error) for o in outcomes),
        "errors": sorted({o.error for o in outcomes if o.error})[:3],
        "added_after_s": round(added_at[0] - args.before_s, 1) if added_at else None,
        "ttft_p99_ms_per_10s": windows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=0.5, help="requests/s before and after the step")
    parser.add_argument("--before-s", type=float, default=20.0)
    parser.add_argument("--step-s", type=float, default=60.0, help="how long the rate is 4x")
    parser.add_argument("--after-s", type=float, default=30.0)
    parser.add_argument("--ttft-p99-ms", type=float, default=3000.0, help="the autoscaler's TTFT target")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-autoscale-") as tmp:
        report = {"off": run(args, False, Path(tmp)), "on": run(args, True, Path(tmp))}
    print(json.dumps({"rate": args.rate, "step_rate": 4 * args.rate, "windows_s": WINDOW_S,
                      "step_from_s": args.before_s, "step_to_s": args.before_s + args.step_s, **report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
