"""The real cluster (2 prefill + 2 decode + router over UCX): each process's /metrics,
scraped over HTTP, moves with the requests sent. Prefill instances count each prompt and
its first token, decode instances the other tokens, and the router every request once."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vllm_cluster.client import Client, Completion
from vllm_cluster.cluster.local import LocalCluster

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).with_name("cluster.yaml")
PROMPTS = [
    "The capital of France is",
    "Explain what a paged KV cache is. " * 6,
    "def quicksort(arr):",
    "Here is a list of fruits: apple, banana, " * 8,
]
Samples = list[tuple[str, dict[str, str], float]]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    pytest.importorskip("ucxx")
    local = LocalCluster.from_yaml(CONFIG, transport="ucx")
    local.log_dir = tmp_path_factory.mktemp("cluster-metrics")
    with local:
        yield local


def _scrape(address: str) -> Samples:
    with urllib.request.urlopen(address + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def _sum(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for n, ls, v in samples if n == name and labels.items() <= ls.items())


def _delta(before: dict[str, Samples], after: dict[str, Samples], role: str, name: str, **labels: str) -> float:
    """`name` summed over the processes whose names start with `role`, after minus before."""
    names = [p for p in after if p.startswith(role)]
    return sum(_sum(after[p], name, **labels) - _sum(before[p], name, **labels) for p in names)


def _router_metrics(cluster: LocalCluster) -> str | None:
    """The router's HTTP front, when it serves /metrics."""
    if not cluster.http_address:
        return None
    try:
        _scrape(cluster.http_address)
    except (urllib.error.URLError, OSError):
        return None
    return cluster.http_address


def test_counters_move_with_the_requests(cluster: LocalCluster) -> None:
    addresses = dict(cluster.metrics_addresses)
    router = _router_metrics(cluster)
    if router is None:
        addresses.pop("router", None)
    assert {"prefill-0", "prefill-1", "decode-0", "decode-1"} <= set(addresses)
    before = {name: _scrape(address) for name, address in addresses.items()}
    client = Client(cluster.router_address)
    try:
        results: list[Completion] = [client.generate(text=p, max_tokens=8, temperature=0) for p in PROMPTS]
    finally:
        client.close()
    after = {name: _scrape(address) for name, address in addresses.items()}

    usages = [r.usage for r in results if r.usage is not None]
    timings = [r.timings for r in results if r.timings is not None]
    assert len(usages) == len(timings) == len(PROMPTS)
    assert not any(t.recomputed or t.prefill_skipped for t in timings)
    num_prompt = sum(u.prompt_tokens for u in usages)
    num_generated = sum(u.completion_tokens for u in usages)
    reasons = [r.finish_reason for r in results]

    assert _delta(before, after, "prefill", "vllm:prompt_tokens_total") == num_prompt
    assert _delta(before, after, "decode", "vllm:prompt_tokens_total") == 0
    assert _delta(before, after, "prefill", "vllm:generation_tokens_total") == len(PROMPTS)
    assert _delta(before, after, "decode", "vllm:generation_tokens_total") == num_generated - len(PROMPTS)
    assert _delta(before, after, "prefill", "vllm:request_success_total") == len(PROMPTS)
    for reason in set(reasons):
        assert _delta(
            before, after, "decode", "vllm:request_success_total", finished_reason=reason
        ) == reasons.count(reason)
    num_pushes = sum(1 for t in timings if t.num_kv_blocks_sent > 0)
    assert _delta(before, after, "prefill", "vllm_cluster:kv_push_seconds_count") == num_pushes
    assert _delta(before, after, "prefill", "vllm_cluster:kv_push_bytes_total") > 0
    assert _delta(before, after, "prefill", "vllm_cluster:kv_push_failures_total") == 0
    assert _delta(before, after, "decode", "vllm_cluster:lease_expiries_total") == 0
    assert _sum(after["decode-0"], "vllm_cluster:num_requests_transferring") == 0

    if router is None:
        pytest.skip("the router serves no /metrics over HTTP here: its counters are checked in tests/unit")
    assert _delta(before, after, "router", "vllm:prompt_tokens_total") == num_prompt
    assert _delta(before, after, "router", "vllm:generation_tokens_total") == num_generated
    assert _delta(before, after, "router", "vllm:request_success_total") == len(PROMPTS)
    assert _delta(before, after, "router", "vllm:time_to_first_token_seconds_count") == len(PROMPTS)
    assert _delta(before, after, "router", "vllm:e2e_request_latency_seconds_count") == len(PROMPTS)
    assert _delta(before, after, "router", "vllm_cluster:kv_blocks_sent_total") == sum(
        t.num_kv_blocks_sent for t in timings)
    assert _delta(before, after, "router", "vllm_cluster:request_failure_total") == 0
    assert _sum(after["router"], "vllm_cluster:num_requests_in_flight") == 0
