"""Load-test summaries on hand-built results: vLLM's keys, known means and percentiles,
goodput, peak concurrency and throughput, the TTFT breakdown, the printed table, and
the plots written as PNG files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_cluster.loadtest.metrics import (
    RequestResult,
    format_table,
    in_flight_steps,
    parse_goodput,
    summarize,
    token_times_s,
    tpot_s,
)
from vllm_cluster.loadtest.plots import plot_run, plot_sweep
from vllm_cluster.loadtest.targets import prompt_path
from vllm_cluster.proto import cluster_pb2 as pb

VLLM_KEYS = [
    "duration", "completed", "failed", "num_prompts", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
    "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests",
]  # fmt: skip
METRICS = ("ttft", "tpot", "itl", "e2el")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def hand_built() -> list[RequestResult]:
    """Four successes, three failures; the numbers below are worked out by hand.

    In flight: [0, 0.18), [0.1, 0.4), [0.4, 0.7), [1.2, 1.7): at most 2 at once (the third
    starts exactly when the second ends). Output tokens: 9 in second 0, 11 in second 1.
    """
    return [
        RequestResult(True, 10, 5, start_s=0.0, ttft_s=0.1, itl_s=[0.02] * 4, e2e_s=0.18,
                      server_timings={"prefill_queue_s": 0.01, "prefill_compute_s": 0.05}),
        RequestResult(True, 20, 3, start_s=0.1, ttft_s=0.2, itl_s=[0.05] * 2, e2e_s=0.3,
                      server_timings={"prefill_queue_s": 0.03, "prefill_compute_s": 0.07}),
        RequestResult(True, 30, 1, start_s=0.4, ttft_s=0.3, e2e_s=0.3),
        RequestResult(True, 40, 11, start_s=1.2, ttft_s=0.4, itl_s=[0.01] * 10, e2e_s=0.5),
        RequestResult(False, 50, start_s=0.2, error="RESOURCE_EXHAUSTED"),
        RequestResult(False, 60, start_s=0.3, error="HTTP 429"),
        RequestResult(False, 70, start_s=0.5, error="RESOURCE_EXHAUSTED"),
    ]  # fmt: skip


def test_summary_totals_and_throughputs() -> None:
    s = summarize(hand_built(), duration_s=2.0)
    assert all(key in s for key in VLLM_KEYS)
    assert (s["duration"], s["completed"], s["failed"], s["num_prompts"]) == (2.0, 4, 3, 7)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (100, 20)
    assert s["request_throughput"] == 2.0
    assert s["output_throughput"] == 10.0
    assert s["total_token_throughput"] == 60.0
    assert s["request_goodput"] is None
    assert s["max_concurrent_requests"] == 2
    assert s["max_output_tokens_per_s"] == 11.0
    assert s["errors"] == {"RESOURCE_EXHAUSTED": 2, "HTTP 429": 1}


def test_summary_latency_statistics() -> None:
    s = summarize(hand_built(), duration_s=2.0, percentiles=(50, 90, 99, 99.9))
    for metric in METRICS:
        for stat in ("mean", "median", "std", "p50", "p90", "p99", "p99.9"):
            assert f"{stat}_{metric}_ms" in s
    # TTFT 100, 200, 300, 400 ms; numpy's linear percentiles.
    assert s["mean_ttft_ms"] == pytest.approx(250.0)
    assert s["median_ttft_ms"] == pytest.approx(250.0)
    assert s["std_ttft_ms"] == pytest.approx(12500**0.5)
    assert s["p90_ttft_ms"] == pytest.approx(370.0)
    assert s["p99_ttft_ms"] == pytest.approx(397.0)
    assert s["p99.9_ttft_ms"] == pytest.approx(399.7)
    # TPOT 20, 50, 10 ms (the one-token request has none).
    assert s["mean_tpot_ms"] == pytest.approx(80 / 3)
    assert s["median_tpot_ms"] == pytest.approx(20.0)
    # ITL: 4 x 20, 2 x 50, 10 x 10 ms pooled.
    assert s["mean_itl_ms"] == pytest.approx(17.5)
    assert s["median_itl_ms"] == pytest.approx(10.0)
    # E2E 180, 300, 300, 500 ms.
    assert s["mean_e2el_ms"] == pytest.approx(320.0)
    assert s["median_e2el_ms"] == pytest.approx(300.0)
    for metric in METRICS:
        ordered = [s[f"p{p}_{metric}_ms"] for p in ("50", "90", "99", "99.9")]
        assert ordered == sorted(ordered)
        assert s[f"p50_{metric}_ms"] == s[f"median_{metric}_ms"]


@pytest.mark.parametrize(
    ("specs", "num_good"),
    [
        (["ttft:250 tpot:30"], 1),  # only the first request meets both
        (["e2el:300"], 3),  # 300 ms meets a 300 ms SLO
        (["tpot:15"], 2),  # the one-token request counts its TPOT as 0
        (["ttft:1000", "tpot:1000", "e2el:1000"], 4),
        (["ttft:50"], 0),
    ],
)
def test_goodput_counts_requests_meeting_every_slo(specs: list[str], num_good: int) -> None:
    s = summarize(hand_built(), duration_s=2.0, goodput=parse_goodput(specs))
    assert s["request_goodput"] == pytest.approx(num_good / 2.0)


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "tpot:50 e2el:2000"]) == {"ttft": 0.5, "tpot": 0.05, "e2el": 2.0}
    assert parse_goodput([]) == {}


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [("itl:5", "'itl:5'"), ("ttft", "METRIC:MILLISECONDS"), ("ttft:fast", "'fast' is not a number"),
     ("tpot:-1", "finite number of ms >= 0"), ("e2el:nan", "finite number")],
)  # fmt: skip
def test_parse_goodput_rejects_bad_items(spec: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_goodput([spec])


def test_ttft_breakdown_from_server_timings() -> None:
    s = summarize(hand_built(), duration_s=2.0)
    breakdown = s["ttft_breakdown"]
    assert list(breakdown) == ["prefill_queue_s", "prefill_compute_s"]
    assert breakdown["prefill_queue_s"]["mean_ms"] == pytest.approx(20.0)
    assert breakdown["prefill_compute_s"]["median_ms"] == pytest.approx(60.0)
    assert breakdown["prefill_compute_s"]["p99_ms"] == pytest.approx(69.8)
    without = [RequestResult(True, 1, 2, ttft_s=0.1, itl_s=[0.1], e2e_s=0.2)]
    assert "ttft_breakdown" not in summarize(without, duration_s=1.0)


def test_all_failed_summarizes_to_zeros() -> None:
    s = summarize([RequestResult(False, 5, error="UNAVAILABLE")], duration_s=1.0)
    assert (s["completed"], s["failed"], s["max_concurrent_requests"]) == (0, 1, 0)
    assert s["mean_ttft_ms"] == 0.0 and s["p99_itl_ms"] == 0.0
    assert s["errors"] == {"UNAVAILABLE": 1}


def test_summarize_rejects_a_zero_duration() -> None:
    with pytest.raises(ValueError, match="duration_s must be > 0"):
        summarize(hand_built(), duration_s=0.0)


def test_per_request_helpers() -> None:
    first, _, one_token, *_ = hand_built()
    assert tpot_s(first) == pytest.approx(0.02)
    assert tpot_s(one_token) is None
    assert token_times_s(first) == pytest.approx([0.1, 0.12, 0.14, 0.16, 0.18])
    # Without per-token gaps the tokens are spread evenly up to the end.
    unstreamed = RequestResult(True, 4, 3, start_s=1.0, ttft_s=0.5, e2e_s=1.5)
    assert token_times_s(unstreamed) == pytest.approx([1.5, 2.0, 2.5])
    # Half-open intervals: the second request's end (0.1 + 0.3) sorts before the third's start.
    times_s, counts = in_flight_steps(hand_built()[:3])
    assert times_s == pytest.approx([0.0, 0.1, 0.18, 0.4, 0.4, 0.7])
    assert counts == [1, 2, 1, 0, 1, 0]


def test_format_table() -> None:
    s = summarize(hand_built(), duration_s=2.0, percentiles=(50, 99.9), goodput={"ttft": 0.25})
    table = format_table(s)
    lines = table.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    assert "Successful requests:                     4" in lines
    assert "Failed requests:                         3" in lines
    assert "Request goodput (req/s):                 1.00" in lines
    assert "Mean TTFT (ms):                          250.00" in lines
    assert "P99.9 TTFT (ms):                         399.70" in lines
    assert "---------------Time to First Token----------------" in lines
    assert "Prefill queue (ms):                      20.00 / 20.00 / 29.80" in lines
    assert "RESOURCE_EXHAUSTED:                      2" in lines
    # Metrics left out of the summary (vLLM's --percentile-metrics) leave out their block.
    no_itl = {k: v for k, v in s.items() if not k.endswith("_itl_ms")}
    assert "Inter-token Latency" not in format_table(no_itl)
    assert "Inter-token Latency" in table


def test_request_result_json_round_trip() -> None:
    thirds = RequestResult(True, 4, 7, start_s=1 / 3, ttft_s=2e-5, itl_s=[1 / 7, 0.1 + 0.2], e2e_s=0.5)
    results = [*hand_built(), thirds]
    for result in results:
        text = json.dumps(result.to_json())
        assert RequestResult.from_json(json.loads(text)) == result
    assert summarize([RequestResult.from_json(json.loads(json.dumps(r.to_json()))) for r in results], 2.0) == (
        summarize(results, 2.0)
    )
    with pytest.raises(ValueError, match=r"unknown fields \['tokens'\]"):
        RequestResult.from_json({**results[0].to_json(), "tokens": [1, 2]})


def assert_png(path: Path) -> None:
    assert path.is_file()
    assert path.stat().st_size > 1000
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_plot_run_writes_pngs(tmp_path: Path) -> None:
    paths = plot_run(hand_built(), tmp_path / "plots", "run1")
    assert [p.name for p in paths] == ["run1_latency_cdf.png", "run1_throughput.png"]
    for path in paths:
        assert_png(path)
    for path in plot_run([RequestResult(False, 3, error="UNAVAILABLE")], tmp_path, "empty"):
        assert_png(path)


def test_plot_sweep_writes_one_png(tmp_path: Path) -> None:
    rows = []
    for rate in (1.0, 2.0, 4.0):
        s = summarize(hand_built(), duration_s=2.0 / rate)
        s["request_rate"] = rate
        rows.append(s)
    path = plot_sweep(rows, tmp_path / "sweep.png")
    assert path == tmp_path / "sweep.png"
    assert_png(path)
    with pytest.raises(ValueError, match=r"sweep row \[0\] lacks p99_itl_ms"):
        plot_sweep([{k: v for k, v in rows[0].items() if k != "p99_itl_ms"}], tmp_path / "x.png")


def test_prompt_paths_count_who_computed_each_prompt() -> None:
    timings = [pb.Timings(), pb.Timings(prefill_skipped=True), pb.Timings(recomputed=True),
               pb.Timings(num_kv_blocks_pulled=3), pb.Timings()]
    assert [prompt_path(t) for t in timings] == ["prefill", "decode", "recomputed", "pulled", "prefill"]
    results = [RequestResult(True, 4, 2, ttft_s=0.1, e2e_s=0.2, prompt_path=prompt_path(t)) for t in timings]
    results.append(RequestResult(False, 4, error="UNAVAILABLE"))  # failed requests are not counted
    summary = summarize(results, duration_s=1.0)
    assert summary["prompt_paths"] == {"prefill": 2, "decode": 1, "pulled": 1, "recomputed": 1}
    table = format_table(summary)
    assert "Prompts computed by (requests)" in table and "Recomputed:" in table
    untold = summarize([RequestResult(True, 4, 2, ttft_s=0.1, e2e_s=0.2)], duration_s=1.0)  # the HTTP front
    assert "prompt_paths" not in untold and "Prompts computed by" not in format_table(untold)
