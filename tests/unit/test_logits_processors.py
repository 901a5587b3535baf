"""logit_bias, allowed_token_ids and bad words on synthetic logits, through the sampler:
exact values changed, the caller's tensor and the other rows of the batch untouched."""

from __future__ import annotations

import torch

from vllm_cluster.engine.logits_processors import apply_logits_processors
from vllm_cluster.engine.request import Request, RequestId
from vllm_cluster.engine.sampler import Sampler
from vllm_cluster.engine.sampling_params import SamplingParams

VOCAB = 10


def _request(output_token_ids: list[int] | None = None, **params: object) -> Request:
    request = Request(RequestId("r"), [1, 2], SamplingParams(temperature=0, **params), None, 16)  # type: ignore[arg-type]
    request.output_token_ids = list(output_token_ids or [])
    return request


def test_requests_without_processors_get_the_same_tensor_back() -> None:
    logits = torch.randn(2, VOCAB)
    assert apply_logits_processors(logits, [_request(), _request()]) is logits


def test_each_processor_changes_only_its_row_and_never_the_callers_logits() -> None:
    logits = torch.zeros(4, VOCAB)
    requests = [
        _request(),
        _request(logit_bias={3: 2.5, 4: -1.0}),
        _request(allowed_token_ids=[5, 6]),
        _request(output_token_ids=[8, 1], bad_words_token_ids=[[1, 2], [9], [8, 3]]),
    ]
    out = apply_logits_processors(logits, requests)
    assert torch.equal(logits, torch.zeros(4, VOCAB))
    assert torch.equal(out[0], torch.zeros(VOCAB))
    assert out[1].tolist() == [0, 0, 0, 2.5, -1.0, 0, 0, 0, 0, 0]
    assert torch.isfinite(out[2]).tolist() == [i in (5, 6) for i in range(VOCAB)]
    assert torch.isfinite(out[3]).tolist() == [i not in (2, 9) for i in range(VOCAB)]  # [8, 3] needs an 8 last


def test_the_sampler_applies_them_and_reports_the_models_logprobs() -> None:
    logits = torch.linspace(0.0, 1.0, VOCAB).repeat(3, 1)  # greedy: the last token
    requests = [_request(), _request(logit_bias={0: 100.0}, logprobs=0), _request(allowed_token_ids=[2, 4])]
    sampled = Sampler()(logits, requests)
    assert [s.token_id for s in sampled] == [VOCAB - 1, 0, 4]
    raw = torch.log_softmax(logits[1], dim=-1)
    assert sampled[1].logprobs is not None and abs(sampled[1].logprobs.logprob - float(raw[0])) < 1e-6
