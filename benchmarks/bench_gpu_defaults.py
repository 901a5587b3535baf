"""The CUDA defaults against other batch limits, on a mixed-length workload, in one run.

    python benchmarks/bench_gpu_defaults.py [--presets llama-3.1-8b,llama-3.2-1b] [--num-requests 512]

Each setting runs in its own process (a fresh GPU): `LLM(preset, load_format="dummy",
device="cuda")` with nothing else (the defaults), then with max_num_seqs /
max_num_batched_tokens set, every other option left to its default (so the KV cache is
sized by the default gpu_memory_utilization). The workload: --num-requests prompts of
random token ids, input lengths uniform in [128, 2048], output lengths in [32, 512]
(ignore_eos), all submitted at once through `LLM.generate`. Reports output tokens/s and
each setting's ratio to the best one.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time

SETTINGS = [None, (64, 512), (256, 8192), (512, 8192), (256, 16384), (1024, 16384)]  # None: the defaults


def run_one(preset: str, setting: tuple[int, int] | None, num_requests: int) -> dict:
    import torch

    from vllm_cluster.engine import LLM, SamplingParams

    options = {} if setting is None else {"max_num_seqs": setting[0], "max_num_batched_tokens": setting[1]}
    start = time.perf_counter()
    llm = LLM(preset, load_format="dummy", device="cuda", **options)
    startup_s = time.perf_counter() - start
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(rng.randint(128, 2048))] for _ in range(num_requests)]
    params = [SamplingParams(max_tokens=rng.randint(32, 512), temperature=0.0, ignore_eos=True) for _ in prompts]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    sched = llm.core.config.scheduler
    return {"preset": preset, "setting": "defaults" if setting is None else f"{setting[0]} / {setting[1]}",
            "max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
            "num_blocks": llm.core.kv.pool.num_blocks, "startup_s": round(startup_s, 1),
            "elapsed_s": round(elapsed, 2), "output_tok_s": round(tokens / elapsed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="llama-3.1-8b,llama-3.2-1b")
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--settings", default="", help="e.g. 'defaults,64x512,256x8192' (default: all)")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        preset, setting = json.loads(args.child)
        print("RESULT " + json.dumps(run_one(preset, tuple(setting) if setting else None, args.num_requests)))
        return
    settings = SETTINGS
    if args.settings:
        settings = [None if s == "defaults" else tuple(int(x) for x in s.split("x")) for s in args.settings.split(",")]
    for preset in args.presets.split(","):
        rows = []
        for setting in settings:
            child = json.dumps([preset, list(setting) if setting else None])
            out = subprocess.run([sys.executable, __file__, "--child", child, "--num-requests", str(args.num_requests)],
                                 capture_output=True, text=True)
            lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            if not lines:
                print(f"{preset} {setting}: failed\n{out.stderr[-2000:]}", flush=True)
                continue
            rows.append(json.loads(lines[-1][len("RESULT "):]))
            print(json.dumps(rows[-1]), flush=True)
        best = max((r["output_tok_s"] for r in rows), default=1)
        print(f"\n{preset}, {args.num_requests} mixed-length requests")
        print("| setting | max_num_seqs / batched tokens | KV blocks | start-up s | output tok/s | of best |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['setting']} | {r['max_num_seqs']} / {r['max_num_batched_tokens']} | {r['num_blocks']} | "
                  f"{r['startup_s']} | {r['output_tok_s']} | {r['output_tok_s'] / best:.2f} |")


if __name__ == "__main__":
    main()
