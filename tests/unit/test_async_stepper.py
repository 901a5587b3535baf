"""Async scheduling (engine/async_stepper.py) with the real scheduler and sampler and a fake
model whose next token is its last input token + 1: placeholders, the tokens each step
really computed, stops, max_tokens, aborts, id reuse and preemption, against the
synchronous scheduler driven with the same model."""

from __future__ import annotations

import pytest
import torch

from vllm_cluster.engine.async_stepper import AsyncStepper
from vllm_cluster.engine.config import EngineConfig, SchedulerConfig
from vllm_cluster.engine.device_tokens import DeviceTokens
from vllm_cluster.engine.errors import ConfigError
from vllm_cluster.engine.kv_cache_manager import KVCacheManager
from vllm_cluster.engine.request import Request, RequestId
from vllm_cluster.engine.sampler import Sampler
from vllm_cluster.engine.sampling_params import SamplingParams
from vllm_cluster.engine.scheduler import RequestUpdate, Scheduler
from vllm_cluster.engine.scheduler_output import PLACEHOLDER_TOKEN_ID, SchedulerOutput

VOCAB = 64
BLOCK_SIZE = 4


class FakeModel:
    """Next token = (last input token + 1) % VOCAB. Records the tokens each step fed in."""

    def __init__(self) -> None:
        self.inputs: list[tuple[RequestId, int, list[int]]] = []  # (request, first position, tokens)

    def __call__(self, output: SchedulerOutput, prev: DeviceTokens | None) -> tuple[list[RequestId], torch.Tensor]:
        sample_ids, rows = [], []
        for item in output.scheduled:
            tokens = list(item.token_ids)
            if tokens[-1] == PLACEHOLDER_TOKEN_ID:
                assert prev is not None
                tokens[-1] = int(prev.token_ids[prev.rows[item.request_id]])
            assert PLACEHOLDER_TOKEN_ID not in tokens
            self.inputs.append((item.request_id, item.num_computed_tokens, tokens))
            if item.samples:
                sample_ids.append(item.request_id)
                rows.append((tokens[-1] + 1) % VOCAB)
        logits = torch.nn.functional.one_hot(torch.tensor(rows, dtype=torch.long), VOCAB).float()
        return sample_ids, logits.reshape(len(rows), VOCAB)


def _scheduler(async_scheduling: bool, num_blocks: int = 64, max_num_batched_tokens: int = 16) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(config, 1024, KVCacheManager(num_blocks, BLOCK_SIZE), async_scheduling=async_scheduling)


def _requests() -> list[Request]:
    specs = [  # (prompt, max_tokens, stop token ids)
        (list(range(1, 10)), 6, ()),
        (list(range(20, 23)), 20, (30,)),  # 23, 24, ... stops at 30
        ([40] * 13, 5, (41,)),  # stops on its first token
        (list(range(50, 55)), 1, ()),
    ]
    return [
        Request(
            RequestId(f"r{i}"),
            prompt,
            SamplingParams(temperature=0.0, max_tokens=m, stop_token_ids=list(stop)),
            None,
            m,
        )
        for i, (prompt, m, stop) in enumerate(specs)
    ]


def _run_sync(scheduler: Scheduler, model: FakeModel) -> list[RequestUpdate]:
    updates = []
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        sample_ids, logits = model(output, None)
        requests = [scheduler.requests[r] for r in sample_ids]
        tokens = dict(zip(sample_ids, Sampler()(logits, requests), strict=True))
        updates += scheduler.update_from_output(output, tokens)
    return updates


def _run_async(stepper: AsyncStepper) -> list[RequestUpdate]:
    updates = []
    while stepper.scheduler.has_unfinished() or stepper.busy:
        updates += stepper.step()
    return updates


def _outputs(updates: list[RequestUpdate]) -> dict[str, tuple[list[int], bool]]:
    out: dict[str, tuple[list[int], bool]] = {}
    for u in updates:
        tokens, _ = out.get(u.request.request_id, ([], False))
        out[u.request.request_id] = (tokens + u.new_token_ids, u.finished)
    return out


def _check_inputs_were_true_tokens(model: FakeModel, requests: list[Request]) -> None:
    by_id = {r.request_id: r for r in requests}
    for request_id, start, tokens in model.inputs:
        assert by_id[request_id].all_token_ids[start : start + len(tokens)] == tokens


def _sync_reference(num_blocks: int = 64) -> tuple[dict[str, tuple[list[int], bool]], Scheduler]:
    scheduler = _scheduler(False, num_blocks)
    for r in _requests():
        scheduler.add_request(r)
    return _outputs(_run_sync(scheduler, FakeModel())), scheduler


def test_async_steps_give_the_synchronous_tokens_stops_and_lengths() -> None:
    expected, _ = _sync_reference()
    assert expected["r1"] == ([23, 24, 25, 26, 27, 28, 29, 30], True)
    assert expected["r2"] == ([41], True)
    scheduler, model = _scheduler(True), FakeModel()
    requests = _requests()
    for r in requests:
        scheduler.add_request(r)
    assert _outputs(_run_async(AsyncStepper(scheduler, Sampler(), model))) == expected
    _check_inputs_were_true_tokens(model, requests)
    assert scheduler.kv.pool.num_free_blocks == 64


def test_placeholders_counts_and_a_capped_request() -> None:
    scheduler = _scheduler(True)
    stepper = AsyncStepper(scheduler, Sampler(), FakeModel())
    request = Request(RequestId("a"), [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2), None, 2)
    scheduler.add_request(request)
    assert stepper.step() == []  # the prompt's step is launched, nothing applied yet
    assert (request.num_computed_tokens, request.num_pending_tokens) == (3, 1)
    first = scheduler.schedule()  # what the next call schedules: one placeholder
    assert [(s.token_ids, s.num_computed_tokens, s.samples) for s in first.scheduled] == [
        ([PLACEHOLDER_TOKEN_ID], 3, True)
    ]
    assert request.num_computed_tokens == 4
    scheduler.sampling_launched(first)
    assert request.num_pending_tokens == 2
    # Two tokens in flight reach max_tokens: it is not scheduled again.
    assert scheduler.schedule().is_empty


def test_a_request_finished_while_its_next_step_runs_emits_nothing_more() -> None:
    scheduler, model = _scheduler(True), FakeModel()
    stepper = AsyncStepper(scheduler, Sampler(), model)
    scheduler.add_request(Request(RequestId("a"), [1, 2], SamplingParams(temperature=0.0, max_tokens=50), None, 50))
    updates = stepper.step() + stepper.step() + stepper.step()
    assert [u.new_token_ids for u in updates] == [[3], [4]]
    scheduler.finish(RequestId("a"), scheduler.requests[RequestId("a")].status.FINISHED_ABORTED)
    # The same id, reused at once, must not receive the aborted request's token in flight.
    reused = Request(RequestId("a"), [60, 61], SamplingParams(temperature=0.0, max_tokens=2), None, 2)
    scheduler.add_request(reused)
    stepper.track(reused)
    updates = _run_async(stepper)
    assert [(u.request is reused, u.new_token_ids) for u in updates] == [(True, [62]), (True, [63])]
    assert scheduler.kv.pool.num_free_blocks == 64


def test_preemption_under_async_steps_gives_the_synchronous_tokens() -> None:
    expected, sync_scheduler = _sync_reference(num_blocks=5)
    assert sync_scheduler.num_preemptions > 0
    scheduler, model = _scheduler(True, num_blocks=5), FakeModel()
    requests = _requests()
    for r in requests:
        scheduler.add_request(r)
    assert _outputs(_run_async(AsyncStepper(scheduler, Sampler(), model))) == expected
    assert scheduler.num_preemptions > 0
    _check_inputs_were_true_tokens(model, requests)
    assert scheduler.kv.pool.num_free_blocks == 5


def test_async_scheduling_is_refused_where_it_cannot_run() -> None:
    with pytest.raises(ConfigError, match="async_scheduling"):
        EngineConfig.from_kwargs("smollm2-135m-instruct", role="prefill", async_scheduling=True)
    with pytest.raises(ConfigError, match="async_scheduling"):
        EngineConfig.from_kwargs("smollm2-135m-instruct", tensor_parallel_size=2, async_scheduling=True)
    assert EngineConfig.from_kwargs("smollm2-135m-instruct", role="decode", async_scheduling=True).async_scheduling
