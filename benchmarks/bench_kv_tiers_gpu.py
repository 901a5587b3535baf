"""A long prefix loaded from the host-memory KV tier against recomputing it, same run (GPU).

    python benchmarks/bench_kv_tiers_gpu.py [--model llama-3.1-8b --prefix-len 8192 --reps 3]

One engine (dummy weights, bf16) with a device KV cache that holds one prefix but not two,
and a host tier (`cache.host_kv_gib`, pinned memory). Per repetition, with a fresh random
prefix P and a short suffix S (prompt P + S, one output token):
  1. recompute: P + S, never seen before: the whole prompt is computed (TTFT_recompute);
  2. two other prompts as long as the device cache evict P's blocks from it: they are
     copied to the host tier;
  3. host: P + S again: P's blocks are loaded from the host tier, only S is computed
     (TTFT_host);
  4. device: P + S once more, P now in the device cache (TTFT_device, the floor).
A first repetition warms up every shape and is not counted. Prints the medians,
TTFT_recompute / TTFT_host, the load's own time (the host-to-device copies alone,
synchronized) and its bandwidth, and whether the greedy tokens agree.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch

from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.kv_offload import Tier

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def timed(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first (only) token, and that token."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    output = llm.generate([prompt], ONE_TOKEN, use_tqdm=False)[0].outputs[0]
    return time.perf_counter() - start, output.token_ids[0]


def load_only_s(llm: LLM, block_hashes: list[Any], num_blocks: int) -> float:
    """The host-to-device copies of `num_blocks` blocks alone, into free device blocks."""
    kv = llm.core.kv
    offload = kv.offload
    assert offload is not None
    block_ids = kv.pool.allocate(num_blocks)
    try:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        loaded = offload.load(block_hashes[:num_blocks], [int(b) for b in block_ids])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        assert len(loaded) == num_blocks, f"only {len(loaded)} of {num_blocks} blocks were in the tiers"
        return time.perf_counter() - start
    finally:
        kv.pool.free(block_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prefix-len", type=int, default=8192)
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--host-kv-gib", type=float, default=8.0)
    parser.add_argument("--profile", action="store_true",
                        help="print torch.profiler's tables for the last host pass (its time then counts the profiler)")
    args = parser.parse_args()
    block_size = 16
    prompt_len = args.prefix_len + args.suffix_len
    num_blocks = -(-prompt_len // block_size) * 3 // 2  # one prompt fits, two do not
    llm = LLM(args.model, load_format=args.load_format, device=args.device, dtype=args.dtype,
              block_size=block_size, num_blocks=num_blocks, max_model_len=num_blocks * block_size,
              max_num_seqs=4, host_kv_gib=args.host_kv_gib)
    kv = llm.core.kv
    assert kv.offload is not None
    rng = random.Random(0)
    vocab = llm.core.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    filler_len = num_blocks * block_size - block_size - 1
    rows: dict[str, list[float]] = {"recompute": [], "host": [], "device": [], "load_only": []}
    agree = []
    for rep in range(args.reps + 1):  # the first is a warm-up (kernels for each shape), not counted
        prompt = tokens(args.prefix_len) + tokens(args.suffix_len)
        recompute_s, first = timed(llm, prompt)
        for _ in range(2):  # two prompts as long as the cache: every block of `prompt` goes to the host tier
            timed(llm, tokens(filler_len))
        hits_before = kv.offload.stats[Tier.HOST].num_hit_blocks
        if args.profile and rep == args.reps:  # the last host pass, under the profiler
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                host_s, again = timed(llm, prompt)
            table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=48)
            print(f"host pass under the profiler ({host_s * 1e3:.1f} ms), by GPU time:\n{table}", flush=True)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=48),
                  flush=True)
        else:
            host_s, again = timed(llm, prompt)
        num_loaded = kv.offload.stats[Tier.HOST].num_hit_blocks - hits_before
        assert num_loaded == args.prefix_len // block_size, f"loaded {num_loaded} blocks from the host tier"
        device_s, _ = timed(llm, prompt)
        request = llm.core.make_request("probe", prompt, ONE_TOKEN)
        request.update_block_hashes(block_size)
        load_s = load_only_s(llm, request.block_hashes, num_loaded)
        if rep == 0:
            continue
        rows["load_only"].append(load_s)
        rows["recompute"].append(recompute_s)
        rows["host"].append(host_s)
        rows["device"].append(device_s)
        agree.append(first == again)
    ms = {name: statistics.median(values) * 1e3 for name, values in rows.items()}
    block_bytes = kv.offload.block_bytes
    loaded_bytes = (args.prefix_len // block_size) * block_bytes
    result = {
        "bench": "kv_tiers_host_load",
        "model": args.model,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else args.device,
        "prefix_tokens": args.prefix_len,
        "suffix_tokens": args.suffix_len,
        "ttft_recompute_ms": round(ms["recompute"], 1),
        "ttft_host_ms": round(ms["host"], 1),
        "ttft_device_ms": round(ms["device"], 1),
        "host_vs_recompute_x": round(ms["recompute"] / ms["host"], 2),
        "load_only_ms": round(ms["load_only"], 2),
        "load_GBps": round(loaded_bytes / (ms["load_only"] * 1e-3) / 1e9, 1),
        "loaded_MiB": round(loaded_bytes / 2**20),
        "first_token_equal": all(agree),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
