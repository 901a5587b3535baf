"""Prompt logprobs, the pure parts: which positions' logits the scheduler asks for, the
prefix cache a request with prompt logprobs does not read, the split of a step's logit
rows, the HTTP shapes, and a migrated leg that does not ask again."""

from __future__ import annotations

import math

import pytest
import torch

from tests.unit.test_scheduler import TOKEN, _request, _scheduler, _step
from vllm_cluster.engine.model_runner import logit_rows
from vllm_cluster.engine.prompt_logprobs import take_prompt_logprobs
from vllm_cluster.engine.scheduler import SampledToken
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.router.migration import Progress, continuation
from vllm_cluster.router.openai.echo import prompt_texts
from vllm_cluster.router.openai.errors import ApiError
from vllm_cluster.router.openai.logprobs import echo_logprobs, vllm_prompt_logprobs
from vllm_cluster.router.openai.protocol import CompletionRequest

PROMPT = list(range(100, 110))  # 10 tokens


def test_chunks_ask_for_every_prompt_position_but_the_last() -> None:
    scheduler = _scheduler(max_num_batched_tokens=4)
    scheduler.add_request(_request("a", PROMPT, prompt_logprobs=1))
    scheduler.add_request(_request("b", PROMPT))
    items = [_step(scheduler)[0].scheduled for _ in range(6)]
    a = [(i.num_computed_tokens, len(i.token_ids), i.num_prompt_logits, i.samples) for s in items for i in s
         if i.request_id == "a"]
    # Positions 0..8 predict prompt tokens 1..9; position 9 samples the first output token.
    assert a[:3] == [(0, 4, 4, False), (4, 4, 4, False), (8, 2, 1, True)]
    assert all(n == 0 for _, _, n, _ in a[3:])
    assert all(i.num_prompt_logits == 0 for s in items for i in s if i.request_id == "b")


def test_a_request_with_prompt_logprobs_reads_no_prefix_cache() -> None:
    scheduler = _scheduler()
    scheduler.add_request(_request("warm", PROMPT, max_tokens=1))
    _step(scheduler)
    scheduler.add_request(_request("plain", PROMPT, max_tokens=1))
    scheduler.add_request(_request("asks", PROMPT, max_tokens=1, prompt_logprobs=0))
    output, _ = _step(scheduler)
    computed = {i.request_id: (i.num_computed_tokens, i.num_prompt_logits) for i in output.scheduled}
    assert computed == {"plain": (8, 0), "asks": (0, 9)}


def test_logit_rows_are_prompt_positions_then_the_sampling_row() -> None:
    scheduler = _scheduler(max_num_batched_tokens=32)
    scheduler.add_request(_request("a", PROMPT, prompt_logprobs=2))
    scheduler.add_request(_request("b", PROMPT[:3]))
    output = scheduler.schedule()
    assert logit_rows(output.scheduled, [0, 10, 13]) == [*range(9), 9, 12]


def test_take_prompt_logprobs_records_them_and_keeps_the_sampling_rows() -> None:
    scheduler = _scheduler(max_num_batched_tokens=32)
    request = _request("a", PROMPT, prompt_logprobs=1)
    scheduler.add_request(request)
    output = scheduler.schedule()
    logits = torch.randn(10, 200)  # 9 prompt rows, 1 sampling row
    sample = take_prompt_logprobs(output, logits, scheduler.requests)
    assert torch.equal(sample, logits[9:])
    expected = torch.log_softmax(logits[:9], dim=-1)
    assert [lp.token_id for lp in request.prompt_logprobs] == PROMPT[1:]
    for p, lp in enumerate(request.prompt_logprobs):
        assert math.isclose(lp.logprob, float(expected[p, PROMPT[p + 1]]), abs_tol=1e-5)
        assert lp.rank == int((expected[p] > expected[p, PROMPT[p + 1]]).sum()) + 1
        assert list(lp.top) == [int(expected[p].argmax())]
    scheduler.update_from_output(output, {request.request_id: SampledToken(TOKEN, None)})
    take_prompt_logprobs(output, logits, scheduler.requests)  # the same positions again: nothing added
    assert len(request.prompt_logprobs) == 9


def _lp(token_id: int, logprob: float, *top: tuple[int, float]) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=token_id, logprob=logprob, rank=2,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top])


def test_echo_logprobs_put_the_prompt_first_with_a_null_head() -> None:
    prompt = [_lp(2, -1.0, (9, -0.5)), _lp(3, -2.0, (3, -2.0))]
    generated = [_lp(4, -0.25, (4, -0.25))]
    out = echo_logprobs(None, [1, 2, 3], prompt, generated)
    assert out["tokens"] == ["token_id:1", "token_id:2", "token_id:3", "token_id:4"]
    assert out["token_logprobs"] == [None, -1.0, -2.0, -0.25]
    assert out["top_logprobs"] == [None, {"token_id:9": -0.5}, {"token_id:3": -2.0}, {"token_id:4": -0.25}]
    assert out["text_offset"] == [0, 10, 20, 30]


def test_vllm_prompt_logprobs_shape() -> None:
    out = vllm_prompt_logprobs(None, [1, 2], [_lp(2, -1.0, (9, -0.5), (2, -1.0))])
    assert out == [None, {"2": {"logprob": -1.0, "rank": 2, "decoded_token": "token_id:2"},
                          "9": {"logprob": -0.5, "rank": 1, "decoded_token": "token_id:9"}}]


def test_a_migrated_leg_does_not_ask_for_prompt_logprobs_again() -> None:
    request = pb.WorkerRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                               sampling_params=pb.SamplingParams(max_tokens=8, prompt_logprobs=2))
    leg = continuation(request, Progress([1, 2, 3], token_ids=[5], migrations=1))
    assert not leg.sampling_params.HasField("prompt_logprobs")
    assert list(leg.prompt_token_ids) == [1, 2, 3, 5]


def test_echo_needs_a_tokenizer_for_token_id_prompts_only() -> None:
    assert prompt_texts(None, CompletionRequest(prompt="Hi there", echo=True)) == ["Hi there"]
    assert prompt_texts(None, CompletionRequest(prompt=[1, 2])) == []
    with pytest.raises(ApiError) as e:
        prompt_texts(None, CompletionRequest(prompt=[1, 2], echo=True))
    assert e.value.param == "echo"


def test_echo_only_asks_for_one_token_and_the_prompt_logprobs() -> None:
    params = CompletionRequest(prompt="Hi", echo=True, max_tokens=0, logprobs=1).to_sampling_params()
    assert params.max_tokens == 1 and params.prompt_logprobs == 1 and params.logprobs == 1
    assert not CompletionRequest(prompt="Hi", echo=True).to_sampling_params().HasField("prompt_logprobs")
