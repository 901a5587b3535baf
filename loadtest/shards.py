"""One load test split across client processes, so that the client is not the bottleneck it
measures: one Python process drains only so many streamed messages per second
(benchmarks/bench_loadgen.py).

1. The parent draws the whole run's arrival offsets, then deals the requests round robin:
   client process i of N takes requests i, i+N, i+2N, ... with their offsets unchanged, so
   an offset keeps its meaning for the whole run. Warm-ups and the max concurrency are
   dealt the same way: the shares add up to the totals.
2. Each client process (`python -m vllm_cluster.loadtest.shards`) reads its target and its
   shard as one JSON line on stdin, starts the target, sends its warm-ups and answers
   {"ready": true}.
3. Once every process is ready the parent sends one start time (wall clock, a little
   ahead), so that all of them measure from the same instant.
4. Each runs `runner.measure` on its shard and answers with its results; the parent merges
   them into one outcome: every result, the longest duration (each counts from the shared
   start), the client CPU time of all, interrupted if any process was.

Ctrl-C in the parent is passed on to every client process, which stops sending and reports
what it measured. Everything crosses the pipes as JSON, never pickled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import IO, Any

from vllm_cluster.loadtest.datasets import SampleRequest
from vllm_cluster.loadtest.runner import RunOutcome, Schedule, measure, schedule_offsets
from vllm_cluster.loadtest.targets import TargetSpec

START_DELAY_S = 0.1  # from sending the start time to the start: every process has read it by then


class ClientProcessError(RuntimeError):
    """A client process that died or answered something other than the protocol."""


@dataclass(slots=True)
class Shard:
    requests: list[SampleRequest]
    offsets: list[float]  # from the shared start, as in the whole run
    num_warmups: int  # the first num_warmups requests are also sent once, unmeasured, before the start
    max_concurrency: int | None

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": [asdict(r) for r in self.requests],
            "offsets": self.offsets,
            "num_warmups": self.num_warmups,
            "max_concurrency": self.max_concurrency,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Shard:
        requests = [SampleRequest(**r) for r in data["requests"]]
        return cls(requests, data["offsets"], data["num_warmups"], data["max_concurrency"])


def split(
    requests: list[SampleRequest],
    offsets: list[float],
    num_shards: int,
    num_warmups: int = 0,
    max_concurrency: int | None = None,
) -> list[Shard]:
    """Deal requests round robin into `num_shards` shards; warm-ups and concurrency in shares."""
    if num_shards < 1:
        raise ValueError(f"the number of client processes must be >= 1, got {num_shards}")
    if len(offsets) != len(requests):
        raise ValueError(f"{len(requests)} requests but {len(offsets)} arrival offsets")
    if max_concurrency is not None and max_concurrency < num_shards:
        raise ValueError(
            f"a max concurrency of {max_concurrency} cannot be shared by {num_shards} client "
            f"processes; use at most {max_concurrency} processes"
        )
    warmup_shares = _shares(min(num_warmups, len(requests)), num_shards)
    concurrency_shares = _shares(max_concurrency, num_shards) if max_concurrency is not None else [None] * num_shards
    return [
        Shard(requests[i::num_shards], offsets[i::num_shards], warmup_shares[i], concurrency_shares[i])
        for i in range(num_shards)
    ]


def _shares(total: int, num_shards: int) -> list[int]:
    """`total` in `num_shards` near-equal parts, the larger ones first."""
    return [total // num_shards + (i < total % num_shards) for i in range(num_shards)]


def merge(outcomes: list[RunOutcome]) -> RunOutcome:
    return RunOutcome(
        results=sorted((r for o in outcomes for r in o.results), key=lambda r: r.start_s),
        duration_s=max((o.duration_s for o in outcomes), default=0.0),
        interrupted=any(o.interrupted for o in outcomes),
        client_cpu_s=sum(o.client_cpu_s for o in outcomes),
    )


def run_sharded(
    spec: TargetSpec,
    requests: list[SampleRequest],
    schedule: Schedule,
    num_processes: int,
    on_start: Callable[[int], None] | None = None,
) -> RunOutcome:
    """The run `runner.run` makes, from `num_processes` client processes (steps 1-4 above);
    `on_start(num_processes)` is called once they all have the start time."""
    offsets = schedule_offsets(requests, schedule)
    num_processes = max(1, min(num_processes, len(requests)))
    shards = split(requests, offsets, num_processes, schedule.num_warmups, schedule.max_concurrency)
    children = [_start_child(spec, shard) for shard in shards]
    reports: list[dict[str, Any]] = []
    try:
        for i, child in enumerate(children):
            _read(child, i, "ready")
        start_at = time.time() + START_DELAY_S
        for child in children:
            assert child.stdin is not None
            child.stdin.write(json.dumps({"start_at": start_at}) + "\n")
            child.stdin.close()
        if on_start is not None:
            on_start(len(children))
        with _forwarding_ctrl_c(children):
            reports = [_read(child, i, "results") for i, child in enumerate(children)]
    finally:
        for child in children:
            if len(reports) < len(children) and child.poll() is None:  # a failed run: stop the others now
                child.kill()
            child.wait()
    return merge([RunOutcome.from_json(report) for report in reports])


def _start_child(spec: TargetSpec, shard: Shard) -> subprocess.Popen[str]:
    # A session of its own: a Ctrl-C at the terminal reaches the parent only, which passes
    # it on once, when the run is under way.
    child = subprocess.Popen(
        [sys.executable, "-m", "vllm_cluster.loadtest.shards"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert child.stdin is not None
    child.stdin.write(json.dumps({"target": asdict(spec), "shard": shard.to_json()}) + "\n")
    child.stdin.flush()
    return child


def _read(child: subprocess.Popen[str], index: int, key: str) -> dict[str, Any]:
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line:
        raise ClientProcessError(
            f"client process {index} exited with code {child.wait()} before sending "
            f"{key!r}; its error is on stderr above"
        )
    message = json.loads(line)
    if key not in message:
        raise ClientProcessError(f"client process {index} sent {sorted(message)}, expected {key!r}")
    return dict(message)


@contextlib.contextmanager
def _forwarding_ctrl_c(children: list[subprocess.Popen[str]]) -> Iterator[None]:
    def forward(signum: int, frame: Any) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGINT)

    try:
        previous = signal.signal(signal.SIGINT, forward)
    except ValueError:  # not the main thread: Ctrl-C is not ours to handle
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


async def _run_shard(spec: TargetSpec, shard: Shard, protocol: IO[str]) -> RunOutcome:
    target = spec.build()
    await target.start()
    try:
        for request in shard.requests[: shard.num_warmups]:
            await target.send(request, 0.0)
        _send(protocol, {"ready": True})
        start_at = json.loads(sys.stdin.readline())["start_at"]
        start = time.perf_counter() + (start_at - time.time())
        return await measure(target, shard.requests, shard.offsets, shard.max_concurrency, progress=False, start=start)
    finally:
        await target.close()


def _send(protocol: IO[str], message: dict[str, Any]) -> None:
    protocol.write(json.dumps(message) + "\n")
    protocol.flush()


def child_main() -> None:
    """A client process: steps 2-4 above, the protocol on stdin and stdout."""
    # The protocol keeps stdout to itself; anything else printed there goes to stderr.
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    job = json.loads(sys.stdin.readline())
    spec, shard = TargetSpec(**job["target"]), Shard.from_json(job["shard"])
    outcome = asyncio.run(_run_shard(spec, shard, protocol))
    _send(protocol, outcome.to_json())


if __name__ == "__main__":
    child_main()
