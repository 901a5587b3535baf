"""PNG plots of a load test, drawn headless with matplotlib's Agg renderer.

`plot_run` draws one run: the latency CDFs (TTFT, TPOT, ITL, E2E) in one figure, the
output token rate and the requests in flight over time in another. `plot_sweep` draws a
sweep of request rates: TTFT and ITL percentiles against the output throughput each
rate achieved, the curve that shows where latency starts to climb.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from vllm_cluster.loadtest.metrics import RequestResult, in_flight_steps, output_tokens_per_s, tpot_s


def plot_run(results: list[RequestResult], outdir: str | Path, prefix: str) -> list[Path]:
    """`{prefix}_latency_cdf.png` and `{prefix}_throughput.png` in outdir (created)."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    return [
        _plot_latency_cdfs(results, outdir / f"{prefix}_latency_cdf.png"),
        _plot_timeline(results, outdir / f"{prefix}_throughput.png"),
    ]


def plot_sweep(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """TTFT and ITL p50/p99 against achieved output throughput, one point per run.

    Each row is a `summarize` result: it needs `output_throughput`, `median_*_ms` and
    `p99_*_ms` for ttft and itl (summarize with 99 among the percentiles). Points are
    labelled by `max_concurrency` or `request_rate` when the row carries them.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    needed = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")
    for i, row in enumerate(rows):
        missing = [key for key in needed if key not in row]
        if missing:
            raise ValueError(
                f"sweep row [{i}] lacks {', '.join(missing)}; "
                "summarize each run with percentiles that include 99"
            )
    throughput = [row["output_throughput"] for row in rows]
    fig = Figure(figsize=(12, 4.5))
    axes = fig.subplots(1, 2)
    for ax, metric, title in zip(axes, ("ttft", "itl"), ("TTFT", "ITL"), strict=True):
        ax.plot(throughput, [row[f"median_{metric}_ms"] for row in rows], "o-", label="p50")
        ax.plot(throughput, [row[f"p99_{metric}_ms"] for row in rows], "s--", label="p99")
        for x, row in zip(throughput, rows, strict=True):
            ax.annotate(
                _point_label(row),
                (x, row[f"p99_{metric}_ms"]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
            )
        ax.set(xlabel="output throughput (tok/s)", ylabel=f"{title} (ms)")
        ax.set_title(f"{title} vs throughput")
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(fig, path)


def _point_label(row: dict[str, Any]) -> str:
    if row.get("max_concurrency") is not None:
        return f"concurrency {row['max_concurrency']}"
    if row.get("request_rate") is not None:
        return f"{row['request_rate']} req/s"
    return ""


def _plot_latency_cdfs(results: list[RequestResult], path: Path) -> Path:
    ok = [r for r in results if r.success]
    samples_ms = {
        "TTFT": [r.ttft_s * 1000 for r in ok],
        "TPOT": [t * 1000 for t in map(tpot_s, ok) if t is not None],
        "ITL": [gap * 1000 for r in ok for gap in r.itl_s],
        "E2E": [r.e2e_s * 1000 for r in ok],
    }
    fig = Figure(figsize=(11, 8))
    axes = fig.subplots(2, 2)
    for ax, (name, values_ms) in zip(axes.flat, samples_ms.items(), strict=True):
        if values_ms:
            xs = np.sort(values_ms)
            fractions = np.arange(len(xs) + 1) / len(xs)
            ax.step(np.concatenate(([xs[0]], xs)), fractions, where="post")
        else:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        ax.set(xlabel=f"{name} (ms)", ylabel="fraction of samples", ylim=(0, 1.02))
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3)
    return _save(fig, path)


def _plot_timeline(results: list[RequestResult], path: Path) -> Path:
    rate = output_tokens_per_s(results)
    times_s, counts = in_flight_steps(results)
    fig = Figure(figsize=(11, 7))
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.bar(np.arange(len(rate)), rate, width=1.0, align="edge")
    top.set(ylabel="output tokens/s", title="Output throughput (1 s bins)")
    top.grid(alpha=0.3)
    bottom.step([0.0, *times_s], [0, *counts], where="post")
    bottom.set(xlabel="time since run start (s)", ylabel="requests")
    bottom.set_title("Successful requests in flight")
    bottom.grid(alpha=0.3)
    return _save(fig, path)


def _save(fig: Figure, path: Path) -> Path:
    # A Figure on its own Agg canvas: no pyplot, no global backend, nothing to close.
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path
