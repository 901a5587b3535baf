"""A soak run against a live cluster: many requests with random client aborts, deadlines
and short client timeouts, while the transport may be injecting faults (see
kv_transfer/faults.py). Every request must end (completed or a clean error) and, once the
cluster is idle again, every instance must have exactly the free blocks it started with.

    report = soak(router_address, worker_stats, num_requests=2000, concurrency=16, seed=0)
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from vllm_cluster.client import Client, ClientError
from vllm_cluster.proto import cluster_pb2 as pb

WORDS = [
    "the", "a", "sea", "light", "keeper", "storm", "ship", "night",
    "wave", "rock", "north", "wind", "lamp", "harbor", "tide", "gull",
]
CLEAN_ERRORS = {"CANCELLED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}


@dataclass
class SoakReport:
    num_requests: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)  # completed, aborted, or a status code
    num_recomputed: int = 0  # completed after a failed hand-off (dropped/corrupt KV): decode recomputed
    free_blocks_before: dict[str, int] = field(default_factory=dict)
    free_blocks_after: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0

    @property
    def leaked_blocks(self) -> dict[str, int]:
        return {name: before - self.free_blocks_after.get(name, 0)
                for name, before in self.free_blocks_before.items()
                if self.free_blocks_after.get(name) != before}

    @property
    def unclean(self) -> dict[str, int]:
        return {k: v for k, v in self.outcomes.items() if k not in ("completed", "aborted", *CLEAN_ERRORS)}


def soak(
    router_address: str,
    worker_stats: Callable[[], dict[str, pb.WorkerStats]],
    num_requests: int,
    concurrency: int = 16,
    seed: int = 0,
    idle_timeout_s: float = 120.0,
) -> SoakReport:
    """`worker_stats()`: every instance's Stats, by name (to see blocks and idleness)."""
    report = SoakReport(num_requests=num_requests)
    report.free_blocks_before = {name: s.num_free_blocks for name, s in worker_stats().items()}
    lock = threading.Lock()
    start = time.monotonic()
    with Client(router_address, timeout_s=300) as client, ThreadPoolExecutor(concurrency) as pool:
        for outcome, recomputed in pool.map(
            lambda i: _one(client, random.Random(seed * 100_003 + i)), range(num_requests)
        ):
            with lock:
                report.outcomes[outcome] += 1
                report.num_recomputed += recomputed
    report.duration_s = time.monotonic() - start
    deadline = time.monotonic() + idle_timeout_s
    while True:
        stats = worker_stats()
        idle = all(not (s.num_running or s.num_waiting or s.num_transferring) for s in stats.values())
        report.free_blocks_after = {name: s.num_free_blocks for name, s in stats.items()}
        if (idle and not report.leaked_blocks) or time.monotonic() > deadline:
            return report
        time.sleep(0.25)


def _one(client: Client, rng: random.Random) -> tuple[str, bool]:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 200)))
    kind = rng.choices(["normal", "abort", "deadline", "timeout"], weights=[6, 2, 1, 1])[0]
    kwargs: dict[str, object] = {"max_tokens": rng.randint(2, 24), "temperature": rng.choice([0.0, 0.8]),
                                 "ignore_eos": True}
    if kind == "deadline":
        kwargs["deadline_s"] = rng.uniform(0.05, 1.5)
    if kind == "timeout":
        kwargs["timeout_s"] = rng.uniform(0.05, 1.5)
    try:
        with client.stream(text=prompt, **kwargs) as stream:  # type: ignore[arg-type]
            stop_after = rng.randint(0, 3) if kind == "abort" else -1
            last = None
            for i, piece in enumerate(stream):
                last = piece
                if i == stop_after:
                    stream.cancel()
            if stream.cancelled:
                return "aborted", False
            if last is None or not last.finish_reason:
                return "no finish", False
            return "completed", bool(last.timings.recomputed)
    except ClientError as e:
        return e.code.name, False
