"""The scheduler: one rule, under a per-step token budget.

Each request's `num_computed_tokens` catches up to its `num_tokens` (prompt + output).
Chunked prefill (a prompt larger than the budget takes several steps), continuous
batching (requests join and leave every step), prefix caching (a new request starts with
its cached prefix already computed) and recompute-preemption (a victim drops its blocks
and starts over from 0, reusing whatever prefix stayed cached) all follow from it.

Running requests are served first, oldest first; when blocks run out the newest running
request is preempted. Waiting requests are admitted FCFS while budget, seats and blocks last.
With `scheduling_policy: priority` both lists are first put in (priority, arrival) order,
so the same rule serves and admits the most urgent first and preempts the least urgent;
a waiting request that holds blocks (landed) stays ahead of those that do not.

Decode role: `reserve` matches the prompt against the prefix cache and allocates blocks
for the rest (TRANSFERRING: the blocks are not cached, they hold nothing yet); `land`
turns it into a WAITING request whose prompt is already computed, at the head of the
queue, with the first token from prefill appended. From there the one rule applies.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from vllm_cluster.engine.block_pool import BlockId
from vllm_cluster.engine.config import SchedulerConfig
from vllm_cluster.engine.kv_cache_manager import KVCacheManager
from vllm_cluster.engine.request import Request, RequestId, RequestStatus, TokenLogprobs
from vllm_cluster.engine.scheduler_output import PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None


@dataclass(frozen=True, slots=True)
class RequestUpdate:
    """A request's progress after one step: the token it gained and whether it finished."""

    request: Request
    new_token_ids: list[int]
    finished: bool


class LoRASlots(Protocol):
    """Resident LoRA adapter slots (engine/lora/manager.py): a request holds one while it runs."""

    def acquire(self, request_id: RequestId, name: str) -> bool: ...

    def release(self, request_id: RequestId) -> None: ...

    def slot_of(self, request_id: RequestId) -> int: ...


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, max_model_len: int, kv: KVCacheManager, async_scheduling: bool = False
    ) -> None:
        self.config = config
        self.max_num_seqs, self.max_num_batched_tokens = config.batch_limits()
        # Async scheduling (engine/async_stepper.py): a step is scheduled while the previous
        # one still runs, so `schedule` counts its tokens computed at once and a token still
        # being sampled is a placeholder (request.num_pending_tokens).
        self.async_scheduling = async_scheduling
        self.max_model_len = max_model_len
        self.kv = kv
        self.requests: dict[RequestId, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._removed: set[RequestId] = set()
        self.transferring: dict[RequestId, Request] = {}  # decode role: reserved, KV in flight
        # Set with enable_lora: a request whose adapter gets no slot waits, and others pass it.
        self.lora_slots: LoRASlots | None = None
        # Since start, for stats: preemptions, prompts computed here, tokens sampled here,
        # finished requests per finish reason.
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_finished: dict[str, int] = {}

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished(self) -> bool:
        """Work to step on (TRANSFERRING requests wait for their KV, not for a step)."""
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        request.update_block_hashes(self.kv.block_size)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def reserve(self, request: Request) -> bool:
        """Decode role: hold blocks for the whole prompt; False (no change) if they don't fit.

        Afterwards `request.num_cached_tokens` tokens (whole blocks) are already here; the
        rest of `kv.get_block_table(request_id)` waits for the prefill's KV."""
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        request.update_block_hashes(self.kv.block_size)
        computed_blocks, num_cached = self._cached_prefix(request)
        num_new = request.num_prompt_tokens - num_cached
        if not self.kv.allocate_slots(request, num_new, computed_blocks, cache=False):
            return False
        if self.kv.enable_caching:
            self.kv.record_prefix_lookup(request.num_prompt_tokens, num_cached, request)
        request.status = RequestStatus.TRANSFERRING
        request.num_cached_tokens = num_cached
        self.requests[request.request_id] = request
        self.transferring[request.request_id] = request
        return True

    def land(self, request_id: RequestId, first_token: SampledToken | None) -> RequestUpdate | None:
        """Decode role: the reserved request's KV has landed (`first_token` given) or will
        not (None: drop the reservation and compute the prompt here). Returns the first
        token's update, finished if that token already ends the request."""
        request = self.transferring.pop(request_id)
        if first_token is None:
            self.kv.free(request)
            request.status = RequestStatus.WAITING
            self.waiting.append(request)
            return None
        request.num_computed_tokens = request.num_prompt_tokens
        request.append_output_token(first_token.token_id, first_token.logprobs)
        request.update_block_hashes(self.kv.block_size)
        status = self._check_stop(request)
        if status is not None:
            self.finish(request_id, status)
        else:
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)  # it holds its blocks: let it run first
        return RequestUpdate(request, [first_token.token_id], status is not None)

    def schedule(self) -> SchedulerOutput:
        if self.config.scheduling_policy == "priority":
            self._order_by_priority()
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_output_tokens + request.num_pending_tokens >= request.max_tokens:
                i += 1  # async: its last token is being sampled; it finishes when that lands
                continue
            num_new = min(request.num_tokens + request.num_pending_tokens - request.num_computed_tokens, budget)
            assert num_new > 0
            while not self.kv.allocate_slots(request, num_new):
                preempted = True
                victim = self.running.pop()
                self._preempt(victim)
                if victim is request:
                    break
            else:
                scheduled.append(self._scheduled(request, num_new, is_new=False))
                budget -= num_new
                i += 1
                continue
            break
        # Admitting new work right after a preemption would only thrash.
        no_lora_slot: list[Request] = []
        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.max_num_seqs:
                break
            request = self.waiting[0]
            if request.num_pending_tokens:  # async: preempted with a token in flight; next step
                break
            if not self._acquire_lora(request):
                no_lora_slot.append(self.waiting.popleft())
                continue
            landed = request.num_computed_tokens > 0  # decode role: its KV came from prefill
            computed_blocks: list[BlockId]
            if landed:
                computed_blocks, num_cached = [], request.num_computed_tokens
            else:
                computed_blocks, num_cached = self._cached_prefix(request)
            num_new = request.num_tokens - num_cached
            if num_new > budget and not self.config.enable_chunked_prefill:
                self._release_lora(request)
                break
            num_new = min(num_new, budget)
            if not self.kv.allocate_slots(request, num_new, computed_blocks):
                self._release_lora(request)
                break
            self.waiting.popleft()
            if self.kv.enable_caching and not landed:
                self.kv.record_prefix_lookup(request.num_tokens, num_cached, request)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_new, is_new=True))
            budget -= num_new
        self.waiting.extendleft(reversed(no_lora_slot))
        if self.async_scheduling:
            for item in scheduled:
                self.requests[item.request_id].num_computed_tokens += len(item.token_ids)
        removed, self._removed = frozenset(self._removed), set()
        return SchedulerOutput(
            scheduled=scheduled,
            num_scheduled_tokens=self.max_num_batched_tokens - budget,
            removed_request_ids=removed,
        )

    def _cached_prefix(self, request: Request) -> tuple[list[BlockId], int]:
        """The prefix-cache hit for a request about to compute its prompt; none for one that
        asked for prompt logprobs, which need the logits of every prompt position."""
        if request.sampling_params.prompt_logprobs is not None:
            return [], 0
        return self.kv.get_computed_blocks(request)

    def _order_by_priority(self) -> None:
        self.running.sort(key=_urgency)
        self.waiting = deque(sorted(self.waiting, key=lambda r: (r.num_computed_tokens == 0, *_urgency(r))))

    def _acquire_lora(self, request: Request) -> bool:
        if request.lora_name is None:
            return True
        assert self.lora_slots is not None, "a LoRA request reached an engine without enable_lora"
        return self.lora_slots.acquire(request.request_id, request.lora_name)

    def _release_lora(self, request: Request) -> None:
        if request.lora_name is not None and self.lora_slots is not None:
            self.lora_slots.release(request.request_id)

    def _scheduled(self, request: Request, num_new: int, is_new: bool) -> ScheduledRequest:
        start = request.num_computed_tokens
        table = self.kv.get_block_table(request.request_id)
        if is_new:
            new_block_ids = list(table)
        else:
            num_old_blocks = -(-start // self.kv.block_size)
            new_block_ids = table[num_old_blocks:]
        end, num_known = start + num_new, request.num_tokens
        token_ids = request.token_slice(start, min(end, num_known))
        if end > num_known:  # async: tokens still being sampled by the step in flight
            token_ids += [PLACEHOLDER_TOKEN_ID] * (end - num_known)
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=token_ids,
            num_computed_tokens=start,
            new_block_ids=new_block_ids,
            is_new=is_new,
            samples=end == num_known + request.num_pending_tokens,
            lora_slot=-1 if self.lora_slots is None else self.lora_slots.slot_of(request.request_id),
            num_prompt_logits=_num_prompt_logits(request, start, end),
        )

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        self._release_lora(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self._removed.add(request.request_id)

    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[RequestId, SampledToken]
    ) -> list[RequestUpdate]:
        updates = []
        for item in output.scheduled:
            request = self.requests.get(item.request_id)
            if request is None:  # finished (aborted) while its step ran
                continue
            if not self.async_scheduling:  # async: counted when scheduled
                request.num_computed_tokens += len(item.token_ids)
            if not item.samples:
                continue
            if self.async_scheduling:
                request.num_pending_tokens -= 1
            token = sampled[item.request_id]
            if request.num_output_tokens == 0:  # its prompt was computed here (not landed)
                self.num_prompt_tokens += request.num_prompt_tokens
            self.num_generation_tokens += 1
            request.append_output_token(token.token_id, token.logprobs)
            request.update_block_hashes(self.kv.block_size)
            status = self._check_stop(request)
            if status is not None:
                self.finish(request.request_id, status)
            updates.append(RequestUpdate(request, [token.token_id], status is not None))
        return updates

    def sampling_launched(self, output: SchedulerOutput) -> None:
        """Async: the step's sampling is queued; its tokens are pending until update_from_output."""
        for item in output.scheduled:
            request = self.requests.get(item.request_id)  # gone: finished by the step applied before this one sampled
            if item.samples and request is not None:
                request.num_pending_tokens += 1

    def _check_stop(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        token_id = request.output_token_ids[-1]
        if request.grammar is not None and request.grammar.is_terminated:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.min_tokens:
            if token_id == request.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def finish(self, request_id: RequestId, status: RequestStatus) -> Request | None:
        """Finish a request (stop string, abort, ...) and free its blocks. Idempotent."""
        assert status.is_finished
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._removed.add(request_id)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.transferring.pop(request_id, None)
        request.status = status
        self.kv.free(request)
        self._release_lora(request)
        reason = status.finish_reason
        assert reason is not None
        self.num_finished[reason] = self.num_finished.get(reason, 0) + 1
        return request


def _num_prompt_logits(request: Request, start: int, end: int) -> int:
    """Positions of [start, end) whose logits give a prompt token's logprob (position p
    predicts prompt token p + 1), for a request that asked for prompt logprobs."""
    num_wanted = request.num_prompt_tokens - 1
    if request.sampling_params.prompt_logprobs is None or len(request.prompt_logprobs) >= num_wanted:
        return 0  # a preempted request recomputing its prompt has them already
    return max(0, min(end, num_wanted) - start)


def _urgency(request: Request) -> tuple[int, float]:
    """Priority policy: the smaller, the sooner served and the later preempted."""
    return request.priority, request.arrival_time
