"""Splitting a load test across client processes, on hand-built requests: round-robin
shards that keep the run's arrival offsets, warm-ups and max concurrency dealt in shares
that add up, and outcomes merged (and sent as JSON) without losing anything."""

from __future__ import annotations

import json

import pytest

from vllm_cluster.loadtest.datasets import SampleRequest
from vllm_cluster.loadtest.metrics import RequestResult
from vllm_cluster.loadtest.runner import RunOutcome
from vllm_cluster.loadtest.shards import Shard, merge, split


def requests(n: int) -> list[SampleRequest]:
    return [SampleRequest(prompt=[i, i + 1], prompt_len=2, output_len=i + 1) for i in range(n)]


def test_split_deals_round_robin_and_keeps_offsets() -> None:
    offsets = [0.0, 0.1, 0.25, 0.3, 0.8, 0.9, 1.4]
    shards = split(requests(7), offsets, 3, num_warmups=5, max_concurrency=8)
    assert [[r.output_len - 1 for r in s.requests] for s in shards] == [[0, 3, 6], [1, 4], [2, 5]]
    assert [s.offsets for s in shards] == [[0.0, 0.3, 1.4], [0.1, 0.8], [0.25, 0.9]]
    assert [s.num_warmups for s in shards] == [2, 2, 1]
    assert [s.max_concurrency for s in shards] == [3, 3, 2]


def test_split_without_limits_and_with_more_shards_than_requests() -> None:
    shards = split(requests(2), [0.0, 0.0], 3)
    assert [len(s.requests) for s in shards] == [1, 1, 0]
    assert [s.max_concurrency for s in shards] == [None, None, None]
    assert [s.num_warmups for s in shards] == [0, 0, 0]
    assert [s.num_warmups for s in split(requests(2), [0.0, 0.0], 2, num_warmups=10)] == [1, 1]


def test_split_refuses_what_cannot_be_shared() -> None:
    with pytest.raises(ValueError, match="max concurrency of 2 cannot be shared by 3"):
        split(requests(6), [0.0] * 6, 3, max_concurrency=2)
    with pytest.raises(ValueError, match=">= 1"):
        split(requests(6), [0.0] * 6, 0)
    with pytest.raises(ValueError, match="6 requests but 5 arrival offsets"):
        split(requests(6), [0.0] * 5, 2)


def test_shard_json_round_trip() -> None:
    shard = Shard([*requests(2), SampleRequest("a text prompt", 3, 4, timestamp_s=1.5)], [0.0, 0.5, 1 / 3], 1, 4)
    assert Shard.from_json(json.loads(json.dumps(shard.to_json()))) == shard


def test_merge_pools_results_and_takes_the_longest_duration() -> None:
    first = RunOutcome(
        [RequestResult(True, 2, 3, start_s=0.0), RequestResult(True, 2, 3, start_s=0.4)], 1.5, False, 1.0
    )
    second = RunOutcome([RequestResult(False, 2, start_s=0.2, error="HTTP 429")], 2.5, True, 0.5)
    merged = merge([first, second])
    assert [r.start_s for r in merged.results] == [0.0, 0.2, 0.4]
    assert (merged.duration_s, merged.interrupted, merged.client_cpu_s) == (2.5, True, 1.5)
    assert RunOutcome.from_json(json.loads(json.dumps(merged.to_json()))) == merged
    assert merge([]) == RunOutcome()
