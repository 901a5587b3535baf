"""Where a batch-1 decode step's time goes on the GPU, per kernel role, for several methods
in the same run (dummy llama-3.1-8b, as benchmarks/bench_quant_gpu.py builds it).

    PYTHONPATH=. python benchmarks/decode_timeline.py [--methods bf16,gptq-lm-head] [--steps 12]

Decodes `--steps` tokens after a 128-token prompt under torch.profiler (CUDA graphs, PDL,
as served) and takes one steady decode step from the middle. Each kernel gets a role: the
attention's two launches, the norms, and the layer's GEMVs in launch order (qkv, o,
gate_up, down; the step's last, lm_head). Per role it prints the kernels' summed duration
and their **advance**: how far each kernel moved the end of all work so far
(max(0, end - latest end before it)). Under PDL kernels overlap (a GEMV starts while the
norm before it runs), so durations double-count; the advances add up to the step, and
they are what a change to a role can win.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import tempfile
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_gpu import ours_generate, prompts
from benchmarks.bench_quant_gpu import make_llm

GEMV_PREFIXES = ("_mma_gemv", "_gemv", "_rows_gemv", "nvjet", "gemv", "sm90_xmma", "cutlass")
ROLES = ("qkv", "o", "gate_up", "down")


def kernel_events(method: str, steps: int) -> tuple[list[dict[str, Any]], int]:
    """The CUDA kernels of a short greedy decode, in start order; the model's layer count."""
    llm = make_llm(method, max_num_seqs=8, num_blocks=1024, max_model_len=4096, batched=2048)
    batch = prompts(1, 128, llm.core.vocab_size)
    ours_generate(llm, batch, 8)  # capture and warm up outside the trace
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ours_generate(llm, batch, steps)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    layers = llm.core.model.config.num_hidden_layers
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return sorted(events, key=lambda e: e["ts"]), layers


def role(name: str, gemv_index: int, layers: int) -> str | None:
    """The kernel's role; None for a GEMV (numbered by the caller)."""
    if name.startswith("_decode_split"):
        return "attention"
    if name.startswith("combine_splits"):
        return "attention combine"
    if name.startswith("_fused_add_rms_norm"):
        return "norm"
    if "splitKreduce" in name:
        return "lm_head"  # cuBLAS's split-K reduction after the logits GEMM
    if name.startswith(GEMV_PREFIXES):
        return ROLES[gemv_index % 4] if gemv_index < 4 * layers else "lm_head"
    return "other: " + name[:40]


def one_step(events: list[dict[str, Any]], layers: int) -> dict[str, list[float]]:
    """Per role of the middle decode step: [kernels, summed duration, summed advance] (us)."""
    attention = [i for i, e in enumerate(events) if e["name"].startswith("_decode_split")]
    starts = attention[::layers]  # each step's first attention launch
    assert len(starts) >= 3, f"{len(attention)} attention launches for {layers} layers: too few steps"
    middle = len(starts) // 2
    # a step: from the norm and qkv GEMV before its first attention to the next step's
    lo, hi = starts[middle] - 2, starts[middle + 1] - 2
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    frontier = events[lo]["ts"]
    gemvs = 0
    for e in events[lo:hi]:
        r = role(e["name"], gemvs, layers)
        if r in ROLES or (r == "lm_head" and "splitKreduce" not in e["name"]):
            gemvs += 1
        end = e["ts"] + e["dur"]
        t = totals[r or "?"]
        t[0] += 1
        t[1] += e["dur"]
        t[2] += max(0.0, end - frontier)
        frontier = max(frontier, end)
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="bf16,gptq-lm-head")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    table: dict[str, dict[str, list[float]]] = {}
    for method in args.methods.split(","):
        events, layers = kernel_events(method, args.steps)
        table[method] = one_step(events, layers)
        print(json.dumps({"method": method, "step_us": round(sum(t[2] for t in table[method].values()), 1),
                          "roles": {r: {"kernels": int(n), "dur_us": round(d, 1), "advance_us": round(a, 1)}
                                    for r, (n, d, a) in table[method].items()}}), flush=True)  # fmt: skip
    roles = sorted({r for t in table.values() for r in t}, key=lambda r: -max(t.get(r, [0, 0, 0])[2] for t in table.values()))
    print("| role | " + " | ".join(f"{m} advance us (duration)" for m in table) + " |")
    print("|---|" + "---|" * len(table))
    for r in roles:
        cells = [f"{t[r][2]:.1f} ({t[r][1]:.1f})" if r in t else "-" for t in table.values()]
        print(f"| {r} | " + " | ".join(cells) + " |")
    print("| step | " + " | ".join(f"{sum(v[2] for v in t.values()):.1f}" for t in table.values()) + " |")


if __name__ == "__main__":
    main()
