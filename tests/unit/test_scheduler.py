"""Scheduler driven step by step with a fake model that always samples token 7."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_cluster.engine.config import SchedulerConfig
from vllm_cluster.engine.kv_cache_manager import KVCacheManager
from vllm_cluster.engine.request import Request, RequestId, RequestStatus
from vllm_cluster.engine.sampling_params import SamplingParams
from vllm_cluster.engine.scheduler import RequestUpdate, SampledToken, Scheduler
from vllm_cluster.engine.scheduler_output import SchedulerOutput

BLOCK_SIZE = 4
TOKEN = 7
PROMPT = list(range(100, 112))  # 3 full blocks


def _scheduler(num_blocks: int = 64, max_num_batched_tokens: int = 32, max_num_seqs: int = 8,
               enable_chunked_prefill: bool = True) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             enable_chunked_prefill=enable_chunked_prefill)
    return Scheduler(config, max_model_len=1024, kv=KVCacheManager(num_blocks, BLOCK_SIZE))


def _request(request_id: str, prompt: list[int], max_tokens: int = 16, eos: int | None = None,
             **params: Any) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens, **params)
    return Request(RequestId(request_id), list(prompt), sampling, eos, max_tokens)


def _add(scheduler: Scheduler, *requests: Request) -> None:
    for request in requests:
        scheduler.add_request(request)


def _step(scheduler: Scheduler) -> tuple[SchedulerOutput, list[RequestUpdate]]:
    output = scheduler.schedule()
    sampled = {s.request_id: SampledToken(TOKEN, None) for s in output.scheduled if s.samples}
    return output, scheduler.update_from_output(output, sampled)


def _summary(output: SchedulerOutput) -> list[tuple[str, int, bool]]:
    """(request id, tokens scheduled, is_new) per scheduled request."""
    return [(s.request_id, len(s.token_ids), s.is_new) for s in output.scheduled]


def test_chunked_prefill_splits_a_long_prompt_by_the_budget() -> None:
    scheduler = _scheduler(max_num_batched_tokens=32)
    prompt = list(range(1000, 1100))
    scheduler.add_request(_request("a", prompt))
    outputs = [_step(scheduler)[0] for _ in range(5)]
    items = [o.scheduled[0] for o in outputs]
    assert [len(i.token_ids) for i in items] == [32, 32, 32, 4, 1]
    assert [i.num_computed_tokens for i in items] == [0, 32, 64, 96, 100]
    assert [i.samples for i in items] == [False, False, False, True, True]
    assert [i.is_new for i in items] == [True, False, False, False, False]
    assert items[1].token_ids == prompt[32:64]
    assert items[4].token_ids == [TOKEN]
    assert [i.new_block_ids for i in items] == [
        list(range(0, 8)), list(range(8, 16)), list(range(16, 24)), [24], [25]
    ]
    assert [o.num_scheduled_tokens for o in outputs] == [32, 32, 32, 4, 1]
    assert scheduler.requests[RequestId("a")].output_token_ids == [TOKEN, TOKEN]


def test_leftover_budget_starts_the_next_prompt() -> None:
    scheduler = _scheduler(max_num_batched_tokens=32)
    _add(scheduler, _request("a", list(range(20))), _request("b", list(range(50, 70))))
    first, _ = _step(scheduler)
    assert _summary(first) == [("a", 20, True), ("b", 12, True)]
    assert [s.samples for s in first.scheduled] == [True, False]
    second, _ = _step(scheduler)
    assert _summary(second) == [("a", 1, False), ("b", 8, False)]


def test_without_chunked_prefill_a_prompt_waits_for_room() -> None:
    scheduler = _scheduler(max_num_batched_tokens=32, enable_chunked_prefill=False)
    _add(scheduler, _request("a", list(range(20))), _request("b", list(range(50, 70))))
    first, _ = _step(scheduler)
    assert _summary(first) == [("a", 20, True)]
    second, _ = _step(scheduler)
    assert _summary(second) == [("a", 1, False), ("b", 20, True)]


def test_new_request_joins_the_running_batch() -> None:
    scheduler = _scheduler()
    scheduler.add_request(_request("a", list(range(8))))
    assert _summary(_step(scheduler)[0]) == [("a", 8, True)]
    scheduler.add_request(_request("b", list(range(50, 58))))
    assert _summary(_step(scheduler)[0]) == [("a", 1, False), ("b", 8, True)]
    scheduler.add_request(_request("c", list(range(80, 83))))
    assert _summary(_step(scheduler)[0]) == [("a", 1, False), ("b", 1, False), ("c", 3, True)]
    assert _summary(_step(scheduler)[0]) == [("a", 1, False), ("b", 1, False), ("c", 1, False)]
    assert [r.num_output_tokens for r in scheduler.running] == [4, 3, 2]


def test_max_num_seqs_caps_running() -> None:
    scheduler = _scheduler(max_num_seqs=2)
    a = _request("a", [1, 2], max_tokens=1)
    _add(scheduler, a, _request("b", [3, 4], max_tokens=3), _request("c", [5, 6], max_tokens=3))
    first, updates = _step(scheduler)
    assert _summary(first) == [("a", 2, True), ("b", 2, True)]
    assert [u.finished for u in updates] == [True, False]
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    second, _ = _step(scheduler)
    assert second.removed_request_ids == {"a"}
    assert _summary(second) == [("b", 1, False), ("c", 2, True)]
    assert len(scheduler.running) == 2


def test_newest_running_request_is_preempted_and_resumes() -> None:
    scheduler = _scheduler(num_blocks=2)
    a, b = _request("a", [1, 2, 3], max_tokens=4), _request("b", [4, 5, 6], max_tokens=4)
    _add(scheduler, a, b)
    assert _summary(_step(scheduler)[0]) == [("a", 3, True), ("b", 3, True)]
    assert _summary(_step(scheduler)[0]) == [("a", 1, False), ("b", 1, False)]
    # a's 5th token needs a 2nd block; the only one left is b's.
    third, _ = _step(scheduler)
    assert _summary(third) == [("a", 1, False)]
    assert third.scheduled[0].new_block_ids == [1]
    assert third.removed_request_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1
    assert list(scheduler.waiting) == [b]
    assert b.output_token_ids == [TOKEN, TOKEN]
    fourth, updates = _step(scheduler)
    assert _summary(fourth) == [("a", 1, False)]
    assert fourth.removed_request_ids == frozenset()
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert [u.finished for u in updates] == [True]
    # b recomputes its prompt and its two output tokens from scratch.
    fifth, _ = _step(scheduler)
    assert fifth.removed_request_ids == {"a"}
    assert _summary(fifth) == [("b", 5, True)]
    assert fifth.scheduled[0].token_ids == [4, 5, 6, TOKEN, TOKEN]
    assert fifth.scheduled[0].num_computed_tokens == 0
    assert fifth.scheduled[0].new_block_ids == [0, 1]
    assert b.status == RequestStatus.RUNNING
    _step(scheduler)
    assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert b.output_token_ids == [TOKEN] * 4
    assert not scheduler.has_unfinished()
    assert scheduler.kv.pool.num_free_blocks == 2


def test_preemption_takes_the_newest_first_and_keeps_fcfs_order() -> None:
    scheduler = _scheduler(num_blocks=3)
    requests = [_request(name, [i, i, i], max_tokens=4) for i, name in enumerate("abc")]
    _add(scheduler, *requests)
    _step(scheduler)
    _step(scheduler)
    # a takes c's block; then b cannot grow either and preempts itself.
    third, _ = _step(scheduler)
    assert _summary(third) == [("a", 1, False)]
    assert third.removed_request_ids == {"b", "c"}
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    while scheduler.has_unfinished():
        _step(scheduler)
    assert [r.status for r in requests] == [RequestStatus.FINISHED_LENGTH_CAPPED] * 3
    assert [r.output_token_ids for r in requests] == [[TOKEN] * 4] * 3
    assert [r.num_preemptions for r in requests] == [0, 1, 1]
    assert scheduler.kv.pool.num_free_blocks == 3


def test_no_admission_in_a_step_that_preempted() -> None:
    scheduler = _scheduler(num_blocks=6)
    a = _request("a", [1, 1, 1, 1], max_tokens=6)
    b = _request("b", [5, 5, 7], max_tokens=8)
    c = _request("c", [5, 5], max_tokens=8)  # its first block duplicates b's cached one
    _add(scheduler, a, b, c)
    for _ in range(5):
        _step(scheduler)
    assert scheduler.kv.block_tables == {"a": [0, 3], "b": [1, 4], "c": [2, 5]}
    # a grows into c's freed tail; c could restart at once on b's block 1 and block 2,
    # but a step that preempted admits nothing.
    sixth, _ = _step(scheduler)
    assert _summary(sixth) == [("a", 1, False), ("b", 1, False)]
    assert sixth.removed_request_ids == {"c"}
    seventh, _ = _step(scheduler)
    assert _summary(seventh) == [("b", 1, False), ("c", 3, True)]
    resumed = seventh.scheduled[1]
    assert (resumed.num_computed_tokens, resumed.new_block_ids) == (4, [1, 5])
    assert c.num_cached_tokens == 0  # the hit at first schedule, not at resumption
    while scheduler.has_unfinished():
        _step(scheduler)
    assert [r.num_output_tokens for r in (a, b, c)] == [6, 8, 8]
    assert scheduler.kv.pool.num_free_blocks == 6


def test_same_prompt_hits_the_prefix_cache() -> None:
    scheduler = _scheduler()
    a, b = _request("a", PROMPT), _request("b", PROMPT)
    scheduler.add_request(a)
    _step(scheduler)
    scheduler.add_request(b)
    output, _ = _step(scheduler)
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == 8
    item = output.scheduled[1]
    assert (item.request_id, item.num_computed_tokens, item.token_ids) == ("b", 8, PROMPT[8:])
    assert scheduler.kv.get_block_table(a.request_id) == [0, 1, 2, 3]
    assert scheduler.kv.get_block_table(b.request_id) == [0, 1, 4]
    assert item.new_block_ids == [0, 1, 4]
    assert [blk.ref_cnt for blk in scheduler.kv.pool.blocks[:5]] == [2, 2, 1, 1, 1]
    assert scheduler.kv.prefix_stats.num_hits == 8


def test_requests_admitted_together_share_their_prefix() -> None:
    scheduler = _scheduler()
    a, b = _request("a", PROMPT + [1]), _request("b", PROMPT + [2])
    _add(scheduler, a, b)
    output, _ = _step(scheduler)
    assert _summary(output) == [("a", 13, True), ("b", 1, True)]
    assert b.num_cached_tokens == 12
    assert scheduler.kv.get_block_table(b.request_id) == [0, 1, 2, 4]


def test_finish_and_abort_free_every_block_and_are_idempotent() -> None:
    scheduler = _scheduler(num_blocks=16, max_num_seqs=1)
    a, b = _request("a", list(range(10))), _request("b", list(range(50, 60)))
    _add(scheduler, a, b)
    _step(scheduler)
    assert scheduler.kv.pool.num_free_blocks == 13
    assert scheduler.finish(a.request_id, RequestStatus.FINISHED_ABORTED) is a
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert a.status.finish_reason == "abort"
    assert scheduler.kv.pool.num_free_blocks == 16
    assert scheduler.finish(a.request_id, RequestStatus.FINISHED_STOPPED) is None
    assert (a.status, scheduler.kv.pool.num_free_blocks) == (RequestStatus.FINISHED_ABORTED, 16)
    output, _ = _step(scheduler)
    assert output.removed_request_ids == {"a"}
    assert _summary(output) == [("b", 10, True)]
    scheduler.add_request(c := _request("c", [1, 2, 3]))
    assert scheduler.finish(c.request_id, RequestStatus.FINISHED_ABORTED) is c
    assert list(scheduler.waiting) == []
    scheduler.finish(b.request_id, RequestStatus.FINISHED_STOPPED)
    assert scheduler.kv.pool.num_free_blocks == 16
    assert not scheduler.has_unfinished()
    assert _step(scheduler)[0].removed_request_ids == {"b"}


@pytest.mark.parametrize(
    ("params", "num_outputs", "status", "stop_reason"),
    [
        ({"eos": TOKEN}, 1, RequestStatus.FINISHED_STOPPED, None),
        ({"eos": TOKEN, "min_tokens": 3}, 3, RequestStatus.FINISHED_STOPPED, None),
        ({"eos": TOKEN, "ignore_eos": True}, 5, RequestStatus.FINISHED_LENGTH_CAPPED, None),
        ({"stop_token_ids": [3, TOKEN], "min_tokens": 2}, 2, RequestStatus.FINISHED_STOPPED, TOKEN),
        ({"stop_token_ids": [8]}, 5, RequestStatus.FINISHED_LENGTH_CAPPED, None),
    ],
    ids=["eos", "eos-after-min-tokens", "ignore-eos", "stop-token-id", "max-tokens"],
)
def test_stop_conditions(
    params: dict[str, Any], num_outputs: int, status: RequestStatus, stop_reason: int | None
) -> None:
    scheduler = _scheduler()
    scheduler.add_request(request := _request("a", [1, 2], max_tokens=5, **params))
    updates = []
    while scheduler.has_unfinished():
        updates += _step(scheduler)[1]
    assert request.output_token_ids == [TOKEN] * num_outputs
    assert [u.finished for u in updates] == [False] * (num_outputs - 1) + [True]
    assert (request.status, request.stop_reason) == (status, stop_reason)
    assert scheduler.kv.pool.num_free_blocks == 64


def test_request_status_order_puts_finished_after_preempted() -> None:
    order = [RequestStatus.WAITING, RequestStatus.TRANSFERRING, RequestStatus.RUNNING,
             RequestStatus.PREEMPTED, RequestStatus.FINISHED_STOPPED,
             RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ABORTED]
    assert sorted(RequestStatus) == order
    assert [s.is_finished for s in order] == [False] * 4 + [True] * 3
    assert [s.finish_reason for s in order] == [None] * 4 + ["stop", "length", "abort"]
