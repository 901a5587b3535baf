"""CPU throughput: our engine against HF transformers `generate`, same prompts, same run;
and a shared-prefix workload with prefix caching on and off.

    .venv/bin/python benchmarks/bench_cpu.py [--num-prompts 16 --input-len 128 --output-len 64]

Prompts are random token ids (fixed seed); every request generates exactly --output-len
tokens (ignore_eos), so both sides do the same work. Results print as a markdown table.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from vllm_cluster.engine import LLM, SamplingParams


def random_prompts(rng: random.Random, num: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(num)]


def timed(fns: list[Callable[[], Any]], repeat: int) -> list[float]:
    """Best of `repeat` runs of each, interleaved (a, b, a, b, ...): the machines are shared
    VMs whose speed drifts, and noise only ever adds time."""
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def run_ours(llm: LLM, prompts: list[list[int]], output_len: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)


def run_hf(hf: Any, prompts: list[list[int]], output_len: int, pad_id: int) -> None:
    # Equal-length prompts: no padding needed, one batch, as HF users batch.
    input_ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = hf.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=pad_id,
        )
    assert out.shape[1] == input_ids.shape[1] + output_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--prefix-output-len", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement; the best counts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)

    llm = LLM("smollm2-135m-instruct", device="cpu", dtype="float32", num_threads=args.threads,
              num_blocks=2048, max_model_len=4096, max_num_batched_tokens=1024, max_num_seqs=64,
              enable_prefix_caching=False)
    from transformers import AutoModelForCausalLM

    path = llm.core.source.path
    assert path is not None
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    vocab = llm.core.vocab_size

    rows = []
    prompts = random_prompts(rng, args.num_prompts, args.input_len, vocab)
    run_ours(llm, prompts[:2], 4)  # warm-up both
    run_hf(hf, prompts[:2], 4, llm.core.eos_token_id or 0)
    num_out = args.num_prompts * args.output_len
    t_hf, t_ours = timed(
        [lambda: run_hf(hf, prompts, args.output_len, llm.core.eos_token_id or 0),
         lambda: run_ours(llm, prompts, args.output_len)],
        args.repeat,
    )
    rows.append(("throughput", "HF transformers generate", t_hf, num_out / t_hf))
    rows.append(("throughput", "vllm-cluster engine", t_ours, num_out / t_ours))

    prefix = random_prompts(rng, 1, args.prefix_len, vocab)[0]
    shared = [prefix + s for s in random_prompts(rng, args.num_prompts, args.suffix_len, vocab)]
    num_out = args.num_prompts * args.prefix_output_len
    cached = llm.derive(enable_prefix_caching=True)

    def run_cached_from_cold() -> None:
        # Every run starts from an empty prefix cache and pays for the shared prefix once.
        assert cached.reset_prefix_cache()
        run_ours(cached, shared, args.prefix_output_len)

    t_off, t_on = timed(
        [lambda: run_ours(llm, shared, args.prefix_output_len), run_cached_from_cold], args.repeat
    )
    rows.append(("shared prefix", "prefix caching off", t_off, num_out / t_off))
    rows.append(("shared prefix", "prefix caching on", t_on, num_out / t_on))

    print(f"\n{args.num_prompts} prompts, {args.input_len} in / {args.output_len} out; shared prefix "
          f"{args.prefix_len} + {args.suffix_len} in / {args.prefix_output_len} out; {args.threads} threads, "
          f"best of {args.repeat}\n")
    print("| workload | system | seconds | output tokens/s |")
    print("|---|---|---|---|")
    for workload, system, seconds, tps in rows:
        print(f"| {workload} | {system} | {seconds:.2f} | {tps:.1f} |")
    print(f"\nengine / HF throughput: {t_hf / t_ours:.2f}x")
    print(f"prefix caching speed-up: {t_off / t_on:.2f}x")


if __name__ == "__main__":
    main()
