"""scheduling_policy priority: admission in (priority, arrival) order, preemption of the
least urgent running request, and the FCFS invariants it keeps (a landed request first)."""

from __future__ import annotations

from vllm_cluster.engine.config import SchedulerConfig
from vllm_cluster.engine.kv_cache_manager import KVCacheManager
from vllm_cluster.engine.request import Request, RequestId, RequestStatus
from vllm_cluster.engine.sampling_params import SamplingParams
from vllm_cluster.engine.scheduler import SampledToken, Scheduler

BLOCK_SIZE = 4
TOKEN = 7


def _scheduler(policy: str = "priority", num_blocks: int = 64, max_num_seqs: int = 8) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, scheduling_policy=policy)
    return Scheduler(config, max_model_len=1024, kv=KVCacheManager(num_blocks, BLOCK_SIZE))


def _request(request_id: str, priority: int, arrival_time: float, prompt_len: int = 8, max_tokens: int = 16) -> Request:
    prompt = [100 + ord(request_id[0]) * 10 + i for i in range(prompt_len)]
    return Request(RequestId(request_id), prompt, SamplingParams(max_tokens=max_tokens), None, max_tokens,
                   priority=priority, arrival_time=arrival_time)


def _step(scheduler: Scheduler) -> list[str]:
    output = scheduler.schedule()
    sampled = {s.request_id: SampledToken(TOKEN, None) for s in output.scheduled if s.samples}
    scheduler.update_from_output(output, sampled)
    return [s.request_id for s in output.scheduled]


def test_waiting_requests_are_admitted_lowest_priority_value_first_then_by_arrival() -> None:
    scheduler = _scheduler(max_num_seqs=1)
    for r in (_request("a", 5, 1.0), _request("b", 0, 2.0), _request("c", 5, 0.5), _request("d", 0, 3.0)):
        scheduler.add_request(r)
    order = []
    while scheduler.has_unfinished():
        ids = _step(scheduler)
        if ids and ids[0] not in order:
            order.append(ids[0])
    assert order == ["b", "d", "c", "a"]


def test_fcfs_ignores_priority_values_and_keeps_arrival_order() -> None:
    scheduler = _scheduler(policy="fcfs", max_num_seqs=1)
    for r in (_request("a", 5, 1.0), _request("b", 0, 2.0)):
        scheduler.add_request(r)
    assert _step(scheduler) == ["a"]


def test_the_least_urgent_running_request_is_preempted_not_the_newest() -> None:
    # 7 blocks of 4. "l" runs alone, then "u" and "n" join (2 blocks each: all 7 in use). The
    # next step needs a 3rd block for "u": the least urgent ("l", the oldest) is preempted,
    # where fcfs would preempt the newest ("n").
    scheduler = _scheduler(num_blocks=7)
    lazy, urgent, newest = _request("l", 9, 1.0), _request("u", 0, 2.0), _request("n", 1, 3.0)
    scheduler.add_request(lazy)
    assert _step(scheduler) == ["l"]
    scheduler.add_request(urgent)
    scheduler.add_request(newest)
    assert _step(scheduler) == ["l", "u", "n"]
    assert scheduler.kv.pool.num_free_blocks == 0
    assert _step(scheduler) == ["u", "n"]
    assert lazy.status == RequestStatus.PREEMPTED and lazy.num_preemptions == 1
    assert urgent.status == newest.status == RequestStatus.RUNNING
    assert list(scheduler.waiting) == [lazy]


def test_a_landed_request_stays_ahead_of_more_urgent_waiting_ones() -> None:
    scheduler = _scheduler(max_num_seqs=1)
    landed = _request("x", 9, 1.0)
    assert scheduler.reserve(landed)
    scheduler.add_request(_request("y", 0, 2.0))
    scheduler.land(landed.request_id, SampledToken(TOKEN, None))
    assert _step(scheduler) == ["x"]  # it holds its blocks: it runs first
