"""The canned-token server answers logprobs and prompt_logprobs as a decode instance does (one
per generated token; one per prompt token after the first, on the first message), so that the
HTTP front's logprobs paths run against it as they run against a cluster."""

from __future__ import annotations

import asyncio
from typing import Any

from vllm_cluster.loadtest.canned import CANNED_TOKEN_ID, CannedConfig, CannedGeneration
from vllm_cluster.proto import cluster_pb2 as pb


def _generate(**sampling: Any) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(request_id="r", token_ids=pb.TokenIds(ids=[5, 6, 7]),
                                 sampling_params=pb.SamplingParams(max_tokens=5, **sampling))

    async def collect() -> list[pb.GenerateResponse]:
        servicer = CannedGeneration(CannedConfig(tokens_per_message=2))
        return [r async for r in servicer.Generate(request, None)]  # type: ignore[arg-type]

    return asyncio.run(collect())


def test_prompt_logprobs_cover_every_prompt_token_after_the_first_once() -> None:
    responses = _generate(prompt_logprobs=0, logprobs=1)
    assert [lp.token_id for lp in responses[0].prompt_logprobs] == [6, 7]
    assert all(not r.prompt_logprobs for r in responses[1:])
    assert [len(r.logprobs) for r in responses] == [len(r.token_ids) for r in responses] == [2, 2, 1]
    assert {lp.token_id for r in responses for lp in r.logprobs} == {CANNED_TOKEN_ID}


def test_no_logprobs_unless_asked() -> None:
    assert all(not r.logprobs and not r.prompt_logprobs for r in _generate())
