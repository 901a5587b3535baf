"""Per-request results of a load test and the summary vLLM's `bench serve` reports.

`summarize` turns `RequestResult`s into vLLM's result keys (its JSON can be compared
with vLLM's key for key) plus `errors` and, when the cluster reported them,
`ttft_breakdown`. Latency statistics are over successful requests only; an empty list
counts as 0, as in vLLM. TPOT is (e2e - ttft)/(output_len - 1) for requests with more
than one output token; ITL pools every gap between streamed pieces of every request (a
piece carrying several tokens adds one gap, as in vLLM). `format_table` renders a summary
the way vLLM prints it. A `RequestResult` crosses between processes as JSON (`to_json` /
`from_json`), never pickled.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)
TTFT_PARTS = ("router_s", "prefill_queue_s", "prefill_compute_s", "transfer_s", "decode_queue_s")
# Who computed a request's prompt: a prefill instance (its KV handed over), the decode
# instance (the router skipped the prefill: few uncached tokens, or a colocated cluster),
# blocks pulled from another instance's cache, or the decode instance after a failed
# hand-off. A disaggregated run whose prompts were "recomputed" measured something else.
PROMPT_PATHS = ("prefill", "decode", "pulled", "recomputed")


@dataclass(slots=True)
class RequestResult:
    success: bool
    prompt_len: int
    output_len: int = 0
    start_s: float = 0.0  # when it was sent, relative to the run start
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    error: str = ""  # an error type: "RESOURCE_EXHAUSTED", "HTTP 429", ...
    server_timings: dict[str, float] | None = None  # TTFT_PARTS, from the cluster
    prompt_path: str = ""  # who computed the prompt, from the cluster (PROMPT_PATHS); "" if not told

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types; `from_json` gives an equal result back."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestResult:
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"a request result has unknown fields {sorted(unknown)}")
        return cls(**data)


def parse_goodput(specs: list[str]) -> dict[str, float]:
    """SLOs in ms ("ttft:500", "tpot:50 e2el:2000") -> {"ttft": 0.5, ...} in seconds."""
    slos_s: dict[str, float] = {}
    for item in (word for spec in specs for word in spec.split()):
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(
                f"goodput item {item!r}: expected METRIC:MILLISECONDS with METRIC one of "
                f"{', '.join(SLO_METRICS)}, e.g. ttft:500"
            )
        try:
            value_ms = float(value)
        except ValueError:
            raise ValueError(f"goodput item {item!r}: {value!r} is not a number of ms") from None
        if not value_ms >= 0 or value_ms == float("inf"):
            raise ValueError(f"goodput item {item!r}: the SLO must be a finite number of ms >= 0")
        slos_s[name] = value_ms / 1000.0
    return slos_s


def tpot_s(result: RequestResult) -> float | None:
    """Mean time per output token after the first; None with fewer than 2 tokens."""
    if result.output_len <= 1:
        return None
    return (result.e2e_s - result.ttft_s) / (result.output_len - 1)


def summarize(
    results: list[RequestResult],
    duration_s: float,
    percentiles: Sequence[float] = (50, 90, 99),
    goodput: dict[str, float] | None = None,
) -> dict[str, Any]:
    """vLLM's result keys for one run; `goodput` is parse_goodput's SLOs in seconds."""
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    summary: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "num_prompts": len(results),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": None if goodput is None else num_good(ok, goodput) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_output_tokens_per_s": float(output_tokens_per_s(ok).max(initial=0.0)),
        "max_concurrent_requests": max(in_flight_steps(ok)[1], default=0),
    }
    samples = {
        "ttft": [r.ttft_s for r in ok],
        "tpot": [t for t in map(tpot_s, ok) if t is not None],
        "itl": [gap for r in ok for gap in r.itl_s],
        "e2el": [r.e2e_s for r in ok],
    }
    for metric, values_s in samples.items():
        summary.update(_stats_ms(metric, values_s, percentiles))
    summary["errors"] = dict(Counter(r.error or "unknown" for r in results if not r.success))
    breakdown = _ttft_breakdown(ok)
    if breakdown:
        summary["ttft_breakdown"] = breakdown
    paths = Counter(r.prompt_path for r in ok if r.prompt_path)
    if paths:
        summary["prompt_paths"] = {path: paths[path] for path in PROMPT_PATHS if paths[path]}
    return summary


def num_good(results: list[RequestResult], slos_s: dict[str, float]) -> int:
    """Successful requests meeting every SLO given (a 1-token request's TPOT counts as 0)."""
    def measured(r: RequestResult) -> dict[str, float]:
        return {"ttft": r.ttft_s, "tpot": tpot_s(r) or 0.0, "e2el": r.e2e_s}

    return sum(
        r.success and all(measured(r)[name] <= slo for name, slo in slos_s.items())
        for r in results
    )


def token_times_s(result: RequestResult) -> list[float]:
    """When each output token arrived, relative to the run start.

    From the ITLs when there is one per token after the first; otherwise the tokens after
    the first are spread evenly up to the end of the request.
    """
    if result.output_len == 0:
        return []
    first_s = result.start_s + result.ttft_s
    if len(result.itl_s) == result.output_len - 1:
        return (first_s + np.concatenate(([0.0], np.cumsum(result.itl_s)))).tolist()
    end_s = result.start_s + result.e2e_s
    return np.linspace(first_s, end_s, result.output_len).tolist()


def output_tokens_per_s(results: list[RequestResult], bin_s: float = 1.0) -> np.ndarray:
    """Output token rate of successful requests in each `bin_s` bin from the run start."""
    times_s = [t for r in results if r.success for t in token_times_s(r)]
    if not times_s:
        return np.zeros(0)
    bins = np.floor(np.asarray(times_s) / bin_s).astype(np.int64).clip(min=0)
    return np.bincount(bins).astype(np.float64) / bin_s


def in_flight_steps(results: list[RequestResult]) -> tuple[list[float], list[int]]:
    """Successful requests in flight over time: (event times, count after each event).

    Requests are half-open intervals [start, start + e2e), so one ending as another
    starts does not overlap it.
    """
    events = sorted(
        [(r.start_s, 1) for r in results if r.success]
        + [(r.start_s + r.e2e_s, -1) for r in results if r.success]
    )
    times_s, counts = [], []
    current = 0
    for time_s, delta in events:
        current += delta
        times_s.append(time_s)
        counts.append(current)
    return times_s, counts


def format_table(summary: dict[str, Any]) -> str:
    """The human-readable block vLLM prints after a run."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any) -> None:
        text = f"{value:<10.2f}" if isinstance(value, float) else f"{value:<10}"
        lines.append(f"{label:<40} {text}".rstrip())

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", float(summary["duration"]))
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    if summary.get("request_goodput") is not None:
        row("Request goodput (req/s):", summary["request_goodput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Peak output token throughput (tok/s):", summary["max_output_tokens_per_s"])
    row("Peak concurrent requests:", float(summary["max_concurrent_requests"]))
    row("Total Token throughput (tok/s):", summary["total_token_throughput"])
    for metric, name, header in LATENCY_METRICS:
        if f"mean_{metric}_ms" not in summary:  # left out, as vLLM's --percentile-metrics does
            continue
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {name} (ms):", summary[f"mean_{metric}_ms"])
        row(f"Median {name} (ms):", summary[f"median_{metric}_ms"])
        for key, value in summary.items():
            if key.startswith("p") and key.endswith(f"_{metric}_ms"):
                row(f"P{key[1:-len(metric) - 4]} {name} (ms):", value)
    breakdown = summary.get("ttft_breakdown", {})
    if breakdown:
        lines.append("{s:{c}^{n}}".format(s="TTFT Breakdown (mean / median / P99)", n=50, c="-"))
    for part, stats in breakdown.items():
        label = part.removesuffix("_s").replace("_", " ").capitalize()
        row(f"{label} (ms):", "{mean_ms:.2f} / {median_ms:.2f} / {p99_ms:.2f}".format(**stats))
    paths = summary.get("prompt_paths", {})
    if paths:
        lines.append("{s:{c}^{n}}".format(s="Prompts computed by (requests)", n=50, c="-"))
    for path, count in paths.items():
        row(f"{path.capitalize()}:", count)
    if summary["errors"]:
        lines.append("{s:{c}^{n}}".format(s="Errors", n=50, c="-"))
        for error, count in sorted(summary["errors"].items()):
            row(f"{error}:", count)
    lines.append("=" * 50)
    return "\n".join(lines)


def _stats_ms(metric: str, values_s: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    values = np.asarray(values_s or [0.0]) * 1000.0
    stats = {
        f"mean_{metric}_ms": float(np.mean(values)),
        f"median_{metric}_ms": float(np.median(values)),
        f"std_{metric}_ms": float(np.std(values)),
    }
    for p in percentiles:
        p_word = str(int(p)) if int(p) == p else str(p)
        stats[f"p{p_word}_{metric}_ms"] = float(np.percentile(values, p))
    return stats


def _ttft_breakdown(results: list[RequestResult]) -> dict[str, dict[str, float]]:
    """Per TTFT part reported by the cluster: mean, median and P99 in ms."""
    timed = [r.server_timings for r in results if r.server_timings]
    parts = [p for p in TTFT_PARTS if any(p in t for t in timed)]
    parts += sorted({p for t in timed for p in t} - set(parts))
    breakdown = {}
    for part in parts:
        values_ms = np.asarray([t[part] for t in timed if part in t]) * 1000.0
        breakdown[part] = {
            "mean_ms": float(np.mean(values_ms)),
            "median_ms": float(np.median(values_ms)),
            "p99_ms": float(np.percentile(values_ms, 99)),
        }
    return breakdown
