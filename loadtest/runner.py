"""Send a dataset's requests to a target on an arrival schedule, and collect the results.

Arrivals: a request rate (Poisson, or gamma with a burstiness factor), optionally capped
at a number of requests in flight, or the trace's own timestamps. Warm-up requests go
first and are not measured. Ctrl-C stops sending, cancels what is in flight and returns
what was measured so far (`interrupted=True`), so the caller can still print it.
`measure` is the measured part alone, for client processes that share one start time
(`loadtest/shards.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from vllm_cluster.loadtest.arrivals import arrival_offsets, trace_offsets
from vllm_cluster.loadtest.datasets import SampleRequest
from vllm_cluster.loadtest.metrics import RequestResult
from vllm_cluster.loadtest.targets import Target


@dataclass(slots=True)
class Schedule:
    request_rate: float = math.inf  # requests/s; inf: all at once (bounded by max_concurrency)
    burstiness: float = 1.0  # gamma shape: 1 is Poisson, < 1 burstier, > 1 more regular
    max_concurrency: int | None = None
    use_trace_timestamps: bool = False
    num_warmups: int = 0
    seed: int = 0


@dataclass(slots=True)
class RunOutcome:
    results: list[RequestResult] = field(default_factory=list)
    duration_s: float = 0.0
    interrupted: bool = False
    client_cpu_s: float = 0.0  # CPU time the client process(es) spent while measuring

    def to_json(self) -> dict[str, Any]:
        return {"results": [r.to_json() for r in self.results], "duration_s": self.duration_s,
                "interrupted": self.interrupted, "client_cpu_s": self.client_cpu_s}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunOutcome:
        results = [RequestResult.from_json(r) for r in data["results"]]
        return cls(results, data["duration_s"], data["interrupted"], data["client_cpu_s"])


async def run(target: Target, requests: list[SampleRequest], schedule: Schedule, progress: bool = True) -> RunOutcome:
    offsets = schedule_offsets(requests, schedule)
    await target.start()
    try:
        for request in requests[: schedule.num_warmups]:
            await target.send(request, 0.0)
        return await measure(target, requests, offsets, schedule.max_concurrency, progress)
    finally:
        await target.close()


def schedule_offsets(requests: list[SampleRequest], schedule: Schedule) -> list[float]:
    """When each request starts, in seconds from the start of the run."""
    if schedule.max_concurrency is not None and schedule.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {schedule.max_concurrency}")
    if schedule.use_trace_timestamps:
        return trace_offsets(requests)
    return arrival_offsets(len(requests), schedule.request_rate, schedule.burstiness, schedule.seed)


async def measure(
    target: Target, requests: list[SampleRequest], offsets: list[float], max_concurrency: int | None,
    progress: bool, start: float | None = None,
) -> RunOutcome:
    """Send `requests` at `offsets` from `start` (a `time.perf_counter()` value; default now)
    through a started target."""
    outcome = RunOutcome()
    cpu_start_s = time.process_time()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread: no Ctrl-C handling
        loop.add_signal_handler(signal.SIGINT, stop.set)
    limit = asyncio.Semaphore(max_concurrency or len(requests) or 1)
    bar = tqdm(total=len(requests), disable=not progress, unit="req")
    start = time.perf_counter() if start is None else start

    async def one(request: SampleRequest) -> None:
        sent = time.perf_counter() - start
        try:
            result = await target.send(request, sent)
        except Exception as e:  # a target bug or a bad sample: a failed request, not a dead run
            result = RequestResult(success=False, prompt_len=request.prompt_len, start_s=sent,
                                   error=f"{type(e).__name__}: {e}")
        finally:
            limit.release()
        outcome.results.append(result)
        bar.update(1)

    tasks: list[asyncio.Task[None]] = []
    stop_wait: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
    try:
        for request, offset in zip(requests, offsets, strict=True):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.wait({stop_wait}, timeout=delay)
            if stop.is_set():
                break
            acquire: asyncio.Future[Any] = asyncio.ensure_future(limit.acquire())
            await asyncio.wait({acquire, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                acquire.cancel()
                break
            tasks.append(asyncio.create_task(one(request)))
        if tasks:
            everything: asyncio.Future[Any] = asyncio.gather(*tasks)
            await asyncio.wait({stop_wait, everything}, return_when=asyncio.FIRST_COMPLETED)
            everything.cancel()
    finally:
        outcome.interrupted = stop.is_set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        stop_wait.cancel()
        bar.close()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signal.SIGINT)
    outcome.duration_s = time.perf_counter() - start
    outcome.client_cpu_s = time.process_time() - cpu_start_s
    outcome.results.sort(key=lambda r: r.start_s)
    return outcome
