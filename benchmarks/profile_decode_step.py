"""Where a decode step's host time goes, with async scheduling on and off (one GPU).

    PYTHONPATH=. python benchmarks/profile_decode_step.py [--preset llama-3.2-1b] [--batch 1,64]
        [--kernels | --kernels-only] [--quantization fp8]

For each batch size: the GPU time of one decode step alone (its CUDA graph replayed back to
back: the floor for the inter-token latency), then per mode the inter-token latency of
`LLM.generate` and the host time per step in each engine section (wrapped with
perf_counter from here; the engine is not changed). "wait" is the host blocked on the
device: in async mode, waiting for the previous step's token ids; in sync mode, the sampler's
`.tolist()`. Also checks that both modes give the same greedy tokens. --kernels lists the
kernels of one batch-1 graph replay by device time (torch.profiler), to see where the GPU
step's time over its roofline goes.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from vllm_cluster.engine import LLM, SamplingParams, async_stepper, model_runner, sampler, scheduler

SECTIONS: dict[str, float] = collections.defaultdict(float)


def wrap(cls: Any, name: str, label: str) -> Callable[[], None]:
    original = getattr(cls, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            SECTIONS[label] += time.perf_counter() - start

    setattr(cls, name, timed)
    return lambda: setattr(cls, name, original)


def replay_ms(llm: LLM, batch: int) -> float:
    graphs = llm.core.runner.graphs
    assert graphs is not None
    size = min(s for s in graphs.sizes if s >= batch)
    graph = graphs.graphs[size]
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / 200 * 1e3


def kernel_table(llm: LLM, num_steps: int = 64, top: int = 16) -> None:
    """Device time per batch-1 decode step by kernel, and how much of the wall step it
    fills (torch.profiler; CUPTI sees the kernels inside graph replays). The one prefill
    step is in the totals, spread over num_steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    prompt = [list(range(1000, 1128))]
    params = SamplingParams(temperature=0.0, max_tokens=num_steps, ignore_eos=True)
    llm.generate(prompt, params, use_tqdm=False)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) / num_steps * 1e6
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    busy_us = sum(e.device_time_total for e in events) / num_steps
    print(f"batch-1 step: {wall_us:.0f} us wall (profiled), {busy_us:.0f} us of kernels and copies", flush=True)
    for e in sorted(events, key=lambda e: -e.device_time_total)[:top]:
        print(f"  {e.device_time_total / num_steps:8.1f} us  {e.count / num_steps:6.1f}/step  {e.key[:90]}", flush=True)
    step_shares(prof, num_steps)


PROJECTIONS = ("qkv", "o", "gate_up", "down")  # the order of a decoder layer's batch-1 GEMVs


def step_shares(prof: Any, num_steps: int) -> None:
    """Each kernel's share of the GPU's step: its end minus the end of the kernel before it.
    Under programmatic dependent launch kernels start early and their durations overlap;
    the shares add up to the time the GPU spent. GEMVs are told apart by projection (4 per
    layer, in order: decode steps run every GEMV, prefill none)."""
    from torch.autograd import DeviceType

    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    share: dict[str, float] = collections.defaultdict(float)
    duration: dict[str, float] = collections.defaultdict(float)
    gemvs, prev_end = 0, None
    for e in kernels:
        label = e.name[:40]
        if "gemv" in e.name:
            label = f"{label} {PROJECTIONS[gemvs % 4]}"
            gemvs += 1
        end = e.time_range.end
        share[label] += end - (prev_end if prev_end is not None else e.time_range.start)
        duration[label] += e.time_range.elapsed_us()
        prev_end = max(end, prev_end or end)
    print(f"step shares (end - previous end), us per step; sum {sum(share.values()) / num_steps:.0f}", flush=True)
    for label, total in sorted(share.items(), key=lambda kv: -kv[1])[:16]:
        print(f"  {total / num_steps:8.1f} us share  {duration[label] / num_steps:8.1f} us duration  {label}",
              flush=True)


def profile(llm: LLM, prompts: list[list[int]], num_steps: int) -> tuple[float, dict[str, float], list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=num_steps, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    SECTIONS.clear()
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    itl_ms = (time.perf_counter() - start) / num_steps * 1e3
    per_step = {k: round(v / num_steps * 1e6, 1) for k, v in sorted(SECTIONS.items(), key=lambda kv: -kv[1])}
    return itl_ms, per_step, [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-3.2-1b")
    parser.add_argument("--batch", default="1,64", help="comma list of batch sizes")
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--kernels", action="store_true", help="also list the batch-1 graph's kernels")
    parser.add_argument("--kernels-only", action="store_true", help="only list the batch-1 graph's kernels")
    parser.add_argument("--quantization", default=None, help="fp8, int8, gptq, awq (dummy weights)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    llm_async = LLM(args.preset, load_format="dummy", device="cuda", dtype="bfloat16", num_blocks=4096,
                    block_size=16, max_model_len=4096, max_num_batched_tokens=8192, max_num_seqs=max(batches),
                    enable_prefix_caching=False, async_scheduling=True, quantization=args.quantization)
    if args.kernels or args.kernels_only:
        kernel_table(llm_async, top=24)
    if args.kernels_only:
        return
    llm_sync = llm_async.derive(async_scheduling=False)
    for cls, name, label in [
        (scheduler.Scheduler, "schedule", "schedule"),
        (scheduler.Scheduler, "update_from_output", "update_from_output"),
        (model_runner.ModelRunner, "execute", "runner.execute"),
        (sampler.Sampler, "__call__", "sampler (sync: incl. wait)"),
        (sampler.Sampler, "token_ids", "sampler.token_ids"),
        (async_stepper.AsyncStepper, "_apply", "async apply (incl. wait)"),
        (torch.cuda.Event, "synchronize", "wait"),
        (LLM, "generate", "total"),
    ]:
        wrap(cls, name, label)
    vocab = llm_async.core.vocab_size
    for batch in batches:
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(1000, vocab - 1000, (batch, 128), generator=g).tolist()
        row: dict[str, Any] = dict(preset=args.preset, batch=batch,
                                   graph_replay_ms=round(replay_ms(llm_async, batch), 3))
        tokens = {}
        for mode, llm in (("async", llm_async), ("sync", llm_sync)):
            itl, per_step, tokens[mode] = profile(llm, prompts, args.steps)
            row[f"{mode}_itl_ms"] = round(itl, 3)
            row[f"{mode}_host_us_per_step"] = per_step
        row["same_tokens"] = tokens["async"] == tokens["sync"]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
