"""Async scheduling: the host prepares step N+1 while the device runs step N.

One call of `step`:
  1. Schedule step N+1. A request whose token step N is still sampling gets a placeholder
     (request.num_pending_tokens), and the scheduler counts scheduled tokens as computed
     at once.
  2. Launch it: the runner builds its inputs (placeholders are filled on the device from
     step N's sampled ids), runs the model, and the sampler queues its token ids, which
     are copied to pinned host memory without waiting; an event marks them ready.
  3. Only now wait for step N's ids and apply them (stop conditions, max_tokens). The
     updates returned are step N's.
  With a constrained request (structured output) among step N+1's samplers, 2 and 3 meet
  in the middle: the forward of N+1 is queued, then step N's ids are waited for and
  applied (each grammar advances past its token), and only then are N+1's grammar masks
  filled on the host, while the device still runs N+1's forward, and its sampling queued.

Invariants:
  - At most one step is in flight, so at any schedule only the step before it is unapplied
    and a request has at most one placeholder.
  - A request that ends (eos, stop token or string, abort) while its next step runs has
    that step's token dropped, never emitted: one step of wasted compute at most. One that
    reaches max_tokens with its last token in flight is not scheduled again.
  - While any request needs its tokens on the host before its next step (logprobs,
    prompt logprobs, penalties, bad words), the step in flight is drained and steps run
    synchronously. A grammar does not: its mask is needed only when the next step samples.
  - Blocks freed while a step is in flight (finish, abort, preemption) are reused only by
    steps queued after it on the same stream. `wait_device` covers writers outside that
    stream (a decode reservation's KV transfer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from vllm_cluster.engine.device_tokens import DeviceTokens
from vllm_cluster.engine.request import Request, RequestId
from vllm_cluster.engine.sampler import Sampler
from vllm_cluster.engine.scheduler import RequestUpdate, SampledToken, Scheduler
from vllm_cluster.engine.scheduler_output import SchedulerOutput

# (the step, the previous step's sampled ids for its placeholders) -> (ids of the requests
# that sample, their logits [N, V])
RunModel = Callable[[SchedulerOutput, DeviceTokens | None], tuple[list[RequestId], torch.Tensor]]


@dataclass(slots=True)
class _LaunchedStep:
    output: SchedulerOutput
    scheduled_requests: list[Request]  # one per output.scheduled item: who it was for
    sample_ids: list[RequestId]  # rows of the sampled ids
    device_tokens: DeviceTokens | None  # overlapped: ids on the device
    host_token_ids: torch.Tensor | None  # overlapped: their pinned host copy, valid once `ready`
    ready: torch.cuda.Event | None  # None on CPU, where the copy is done when queued
    sampled: list[SampledToken] | None = None  # synchronous: the tokens, with logprobs


class AsyncStepper:
    def __init__(self, scheduler: Scheduler, sampler: Sampler, run_model: RunModel) -> None:
        assert scheduler.async_scheduling, "the scheduler must count tokens computed when scheduled"
        self.scheduler = scheduler
        self.sampler = sampler
        self.run_model = run_model
        self._in_flight: _LaunchedStep | None = None
        self._host_bound: set[RequestId] = set()  # need their tokens on the host every step

    @property
    def busy(self) -> bool:
        """A step is in flight: its tokens are still to be applied."""
        return self._in_flight is not None

    def track(self, request: Request) -> None:
        """Register a new request (added or reserved)."""
        params = request.sampling_params
        if params.logprobs is not None or params.prompt_logprobs is not None or params.has_penalties:
            self._host_bound.add(request.request_id)
        if params.bad_words_token_ids:  # which token is banned depends on the last ones generated
            self._host_bound.add(request.request_id)

    def wait_device(self) -> None:
        """Block until the step in flight has finished on the device (its tokens stay unapplied)."""
        if self._in_flight is not None and self._in_flight.ready is not None:
            self._in_flight.ready.synchronize()

    def step(self) -> list[RequestUpdate]:
        prev, self._in_flight = self._in_flight, None
        overlap = self._may_overlap()
        if prev is not None and not overlap:
            return self._apply(prev)  # drain; the next call runs synchronously
        output = self.scheduler.schedule()
        applied = None
        if not output.is_empty:
            launched, applied = self._launch(output, prev, overlap)
            if not overlap:
                return self._apply(launched)
            self._in_flight = launched
        if applied is not None:
            return applied
        return [] if prev is None else self._apply(prev)

    def _may_overlap(self) -> bool:
        if self._host_bound:
            self._host_bound = {r for r in self._host_bound if r in self.scheduler.requests}
        return not self._host_bound

    def _launch(
        self, output: SchedulerOutput, prev: _LaunchedStep | None, overlap: bool
    ) -> tuple[_LaunchedStep, list[RequestUpdate] | None]:
        """Queue the step; with a grammar among its samplers, also apply `prev` (its updates
        are returned) before the masks are filled."""
        requests = self.scheduler.requests
        scheduled_requests = [requests[item.request_id] for item in output.scheduled]
        sample_ids, logits = self.run_model(output, None if prev is None else prev.device_tokens)
        sampling = [requests[r] for r in sample_ids]
        applied = None
        if prev is not None and any(r.grammar is not None for r in sampling):
            applied = self._apply(prev)  # the host waits here while the device runs the forward
        step = _LaunchedStep(output, scheduled_requests, sample_ids, None, None, None)
        if overlap:
            token_ids = self.sampler.token_ids(logits, sampling)  # [N] long, on the device
            step.device_tokens = DeviceTokens(token_ids, {r: i for i, r in enumerate(sample_ids)})
            step.host_token_ids = token_ids.to("cpu", non_blocking=True)
            if token_ids.is_cuda:
                step.ready = torch.cuda.Event()
                step.ready.record()
        else:
            step.sampled = self.sampler(logits, sampling)
        self.scheduler.sampling_launched(output)
        return step, applied

    def _apply(self, step: _LaunchedStep) -> list[RequestUpdate]:
        sampled = step.sampled
        if sampled is None:
            assert step.host_token_ids is not None
            if step.ready is not None:
                step.ready.synchronize()
            sampled = [SampledToken(t, None) for t in step.host_token_ids.tolist()]
        # A request that finished meanwhile (or whose id now names a newer request) is skipped.
        requests = self.scheduler.requests
        live = [
            item
            for item, request in zip(step.output.scheduled, step.scheduled_requests, strict=True)
            if requests.get(item.request_id) is request
        ]
        tokens = dict(zip(step.sample_ids, sampled, strict=True))
        return self.scheduler.update_from_output(replace(step.output, scheduled=live), tokens)
