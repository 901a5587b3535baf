"""The /metrics of the router (RouterMetrics fed streamed responses, as Generate relays them)
and of an instance (InstanceMetrics over a real engine), read back through Prometheus' text
format; and the Grafana dashboard queries only names we export."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.engine_loop import EngineLoop
from vllm_cluster.engine.scheduler import SampledToken
from vllm_cluster.metrics import InstanceMetrics, RouterMetrics
from vllm_cluster.proto import cluster_pb2 as pb

DASHBOARD = Path(__file__).parents[2] / "configs" / "grafana-dashboard.json"
PROMPT = list(range(1000, 1040))  # 2 full blocks of 16 and 8 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _scrape(registry: CollectorRegistry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """(sample name, labels) -> value, parsed from the text exposition."""
    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """The one sample `name` whose labels include `labels`."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


def _last(num_tokens: int, reason: str, prompt_tokens: int, **timings: float | bool | int) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        token_ids=list(range(num_tokens)),
        finish_reason=reason,
        usage=pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=3),
        timings=pb.Timings(**timings),
    )


def test_router_metrics_follow_the_streamed_responses() -> None:
    metrics = RouterMetrics("m", max_model_len=2048)
    first = metrics.start_request(arrival=10.0)
    first.on_response(pb.GenerateResponse(token_ids=[1]), now=10.5)
    first.on_response(pb.GenerateResponse(token_ids=[2, 3]), now=10.7)  # 2 tokens, 0.1 s each
    assert _value(_scrape(metrics.registry), "vllm_cluster:num_requests_in_flight") == 1
    first.on_response(_last(0, "length", 7, prefill_queue_s=0.25, decode_queue_s=0.5,
                            transfer_s=0.004, num_kv_blocks_sent=3), now=11.0)
    first.end("OK")
    skipped = metrics.start_request(arrival=20.0)
    skipped.on_response(_last(3, "stop", 5, prefill_skipped=True), now=20.2)
    skipped.end("OK")
    failed = metrics.start_request(arrival=30.0)
    failed.on_response(pb.GenerateResponse(token_ids=[1]), now=30.1)
    failed.end("UNAVAILABLE")

    s = _scrape(metrics.registry)
    labels = {"model_name": "m", "role": "router"}
    assert _value(s, "vllm:time_to_first_token_seconds_count", **labels) == 3
    assert _value(s, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.5 + 0.2 + 0.1)
    assert _value(s, "vllm:inter_token_latency_seconds_count") == 2
    assert _value(s, "vllm:inter_token_latency_seconds_bucket", le="0.1") == 2
    assert _value(s, "vllm:inter_token_latency_seconds_bucket", le="0.075") == 0
    assert _value(s, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(1.0 + 0.2)
    assert _value(s, "vllm:request_queue_time_seconds_sum") == pytest.approx(0.75)
    assert _value(s, "vllm:prompt_tokens_total", **labels) == 12
    assert _value(s, "vllm:generation_tokens_total") == 6
    assert _value(s, "vllm:request_prompt_tokens_bucket", le="5.0") == 1
    assert _value(s, "vllm:request_success_total", finished_reason="length") == 1
    assert _value(s, "vllm:request_success_total", finished_reason="stop") == 1
    assert _value(s, "vllm:request_success_total", finished_reason="abort") == 0
    assert _value(s, "vllm_cluster:request_failure_total", code="UNAVAILABLE") == 1
    assert _value(s, "vllm_cluster:request_kv_transfer_seconds_count") == 1  # not the skipped one
    assert _value(s, "vllm_cluster:kv_blocks_sent_total") == 3
    assert _value(s, "vllm_cluster:prefill_skipped_total") == 1
    assert _value(s, "vllm_cluster:requests_recomputed_total") == 0
    assert _value(s, "vllm_cluster:num_requests_in_flight") == 0


def test_reservations_waiting_counts_only_inside_its_block() -> None:
    metrics = RouterMetrics("m")
    with metrics.num_reservations_waiting.track_inprogress():
        assert _value(_scrape(metrics.registry), "vllm_cluster:num_reservations_waiting") == 1
    assert _value(_scrape(metrics.registry), "vllm_cluster:num_reservations_waiting") == 0


@pytest.fixture
def colocated(smollm2: LLM) -> Iterator[EngineLoop]:
    llm = smollm2.derive(num_blocks=128)
    loop = EngineLoop(llm.core, llm.tokenizer)
    yield loop
    loop.stop()


@pytest.fixture
def decode(smollm2: LLM) -> Iterator[EngineLoop]:
    llm = smollm2.derive(num_blocks=128, role="decode")
    loop = EngineLoop(llm.core, llm.tokenizer)
    yield loop
    loop.stop()


def test_instance_metrics_read_the_engine_at_scrape_time(colocated: EngineLoop) -> None:
    metrics = InstanceMetrics(colocated, "colocated-0")
    outputs = []
    for request_id in ("a", "b"):  # one after the other: b finds a's prompt blocks cached
        stream = colocated.add(colocated.core.make_request(request_id, PROMPT, GREEDY))
        outputs.append([t for delta in stream for t in delta.token_ids])
    s = _scrape(metrics.registry)
    labels = {"model_name": "smollm2-135m-instruct", "role": "colocated", "instance_id": "colocated-0"}
    assert _value(s, "vllm:prompt_tokens_total", **labels) == 2 * len(PROMPT)
    assert _value(s, "vllm:generation_tokens_total") == sum(map(len, outputs)) == 8
    assert _value(s, "vllm:request_success_total", finished_reason="length") == 2
    assert _value(s, "vllm:request_success_total", finished_reason="stop") == 0
    assert _value(s, "vllm:prefix_cache_queries_total") == 2 * len(PROMPT)
    assert _value(s, "vllm:prefix_cache_hits_total") == 32
    assert _value(s, "vllm:num_requests_running") == 0
    assert _value(s, "vllm:num_requests_waiting") == 0
    assert _value(s, "vllm:num_preemptions_total") == 0
    assert not any(name.startswith("vllm_cluster:") for name, _ in s)


@pytest.fixture
def tiered(smollm2: LLM) -> Iterator[EngineLoop]:
    """8 device blocks (128 tokens) over a host tier of 64 blocks."""
    llm = smollm2.derive(num_blocks=8, max_model_len=128, host_kv_gib=64 * _block_bytes(smollm2) / 2**30)
    loop = EngineLoop(llm.core, llm.tokenizer)
    yield loop
    loop.stop()


def test_offload_tier_metrics_count_loads_instead_of_recompute(tiered: EngineLoop) -> None:
    metrics = InstanceMetrics(tiered, "colocated-0")
    # a caches PROMPT's 2 full blocks; b (8 blocks) evicts them to the host tier; c loads them back.
    for request_id, prompt in (("a", PROMPT), ("b", list(range(2000, 2120))), ("c", PROMPT)):
        stream = tiered.add(tiered.core.make_request(request_id, prompt, GREEDY))
        assert len([t for delta in stream for t in delta.token_ids]) == 4
    s = _scrape(metrics.registry)
    block_bytes = sum(c[0].numel() * c.element_size() for c in tiered.core.runner.kv_caches)
    assert _value(s, "vllm:external_prefix_cache_hits_total") == 32
    assert _value(s, "vllm:prefix_cache_hits_total") == 0
    assert _value(s, "vllm_cluster:kv_offload_hits_total", tier="host") == 32
    assert _value(s, "vllm_cluster:kv_offload_loaded_blocks_total", tier="host") == 2
    assert _value(s, "vllm_cluster:kv_offload_loaded_bytes_total", tier="host") == 2 * block_bytes
    assert _value(s, "vllm_cluster:kv_offload_load_seconds_total", tier="host") > 0
    assert _value(s, "vllm_cluster:kv_offload_stored_blocks_total", tier="host") >= 2
    assert _value(s, "vllm_cluster:kv_offload_max_blocks", tier="host") == 64
    assert _value(s, "vllm_cluster:kv_offload_failed_loads_total", tier="host") == 0


def _block_bytes(llm: LLM) -> int:
    return sum(c[0].numel() * c.element_size() for c in llm.core.runner.kv_caches)


def test_decode_counts_only_what_it_computes_and_expired_leases(decode: EngineLoop) -> None:
    metrics = InstanceMetrics(decode, "decode-0")
    core = decode.core
    reserved = decode.reserve(core.make_request("landed", PROMPT, GREEDY), lease_s=30.0)
    assert reserved is not None
    s = _scrape(metrics.registry)
    assert _value(s, "vllm_cluster:num_requests_transferring", role="decode") == 1
    assert _value(s, "vllm:kv_cache_usage_perc") == pytest.approx(3 / 128)
    # The prompt's KV and first token came from prefill: decode samples the other 3 tokens.
    assert decode.land("landed", SampledToken(7, None))
    assert len([t for delta in reserved[1] for t in delta.token_ids]) == 4
    expiring = decode.reserve(core.make_request("expiring", PROMPT, GREEDY), lease_s=0.1)
    assert expiring is not None
    assert [d.finish_reason for d in expiring[1]][-1] == "abort"

    s = _scrape(metrics.registry)
    assert _value(s, "vllm:prompt_tokens_total") == 0
    assert _value(s, "vllm:generation_tokens_total") == 3
    assert _value(s, "vllm:request_success_total", finished_reason="length") == 1
    assert _value(s, "vllm:request_success_total", finished_reason="abort") == 1
    assert _value(s, "vllm_cluster:lease_expiries_total") == 1
    assert _value(s, "vllm_cluster:num_requests_transferring") == 0


def test_prefill_push_metrics_served_over_http(smollm2: LLM) -> None:
    llm = smollm2.derive(num_blocks=128, role="prefill")
    loop = EngineLoop(llm.core, None)
    metrics = InstanceMetrics(loop, "prefill-0")
    try:
        metrics.observe_push(1000, 0.003, ok=True)
        metrics.observe_push(500, 0.2, ok=False)
        port = metrics.serve("127.0.0.1", 0)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    finally:
        metrics.close()
        loop.stop()
    s = {(x.name, frozenset(x.labels.items())): x.value
         for f in text_string_to_metric_families(text) for x in f.samples}
    assert _value(s, "vllm_cluster:kv_push_bytes_total", role="prefill", instance_id="prefill-0") == 1500
    assert _value(s, "vllm_cluster:kv_push_failures_total") == 1
    assert _value(s, "vllm_cluster:kv_push_seconds_count") == 2
    assert _value(s, "vllm_cluster:kv_push_seconds_bucket", le="0.005") == 1
    assert _value(s, "vllm:num_requests_running", role="prefill") == 0


def _exported_names(registry: CollectorRegistry) -> set[str]:
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    return {f.name + suffix for f in registry.collect() for suffix in suffixes[f.type]}


def test_dashboard_queries_only_exported_metrics(smollm2: LLM, decode: EngineLoop, tiered: EngineLoop) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    prefill = EngineLoop(smollm2.derive(num_blocks=128, role="prefill").core, None)
    try:
        exported = set().union(*(_exported_names(r) for r in (
            RouterMetrics("m").registry,
            InstanceMetrics(decode, "decode-0").registry,
            InstanceMetrics(prefill, "prefill-0").registry,
            InstanceMetrics(tiered, "colocated-0").registry,
        )))
    finally:
        prefill.stop()
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    targets = [t for p in panels for t in p["targets"]]
    assert all(p["datasource"]["uid"] == "${DS_PROMETHEUS}" for p in panels)
    queried = {name for t in targets for name in re.findall(r"vllm(?:_cluster)?:[A-Za-z0-9_:]+", t["expr"])}
    assert queried - exported == set()
    for must in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_success_total",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total",
                 "vllm_cluster:request_kv_transfer_seconds_bucket", "vllm_cluster:prefill_skipped_total",
                 "vllm_cluster:kv_offload_hits_total", "vllm_cluster:kv_offload_load_seconds_total"):
        assert must in queried
