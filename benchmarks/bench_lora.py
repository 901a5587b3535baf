"""Multi-LoRA throughput: one batch under 1, 4 and 16 different adapters against the base
model, same prompts, same run.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_lora.py                 # CPU, SmolLM2
    PYTHONPATH=. python benchmarks/bench_lora.py --device cuda --model llama-3.2-1b --load-format dummy \\
        --num-prompts 64 --input-len 256 --output-len 128

Rows: the base model on an engine without LoRA; the base model on the LoRA engine (no
request names an adapter); then request i under adapter i % k for k = 1, 4, 16 (all
resident: max_loras 16). Adapters are random (rank --rank, q/k/v/o/gate/up/down_proj).
Every request generates exactly --output-len tokens (ignore_eos). On CUDA the LoRA
engine's decode steps replay CUDA graphs that include the Triton shrink/expand kernels.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch

from benchmarks.bench_cpu import random_prompts, timed
from tests.lora_adapters import write_adapter
from vllm_cluster.engine import LLM, LoRARequest, SamplingParams


def run(llm: LLM, prompts: list[list[int]], output_len: int, loras: list[LoRARequest | None]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2, help="runs per measurement; the best counts")
    args = parser.parse_args()
    counts = [1, 4, 16]
    options = dict(load_format=args.load_format, device=args.device, num_threads=args.threads,
                   max_model_len=args.input_len + args.output_len + 16, max_num_seqs=max(args.num_prompts, 16),
                   max_num_batched_tokens=max(1024, args.input_len), enable_prefix_caching=False)
    if args.device == "cpu":
        options |= dict(dtype="float32",
                        num_blocks=args.num_prompts * (-(-(args.input_len + args.output_len) // 16) + 1))
    base = LLM(args.model, **options)
    lora = LLM(args.model, enable_lora=True, max_loras=max(counts), max_lora_rank=args.rank, **options)
    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    adapters = [
        LoRARequest(f"a{i}", i + 1, str(write_adapter(root / f"a{i}", lora.core.model.config, rank=args.rank, seed=i)))
        for i in range(max(counts))
    ]
    prompts = random_prompts(random.Random(0), args.num_prompts, args.input_len, lora.core.vocab_size)
    cases: list[tuple[str, LLM, list[LoRARequest | None]]] = [
        ("base model, engine without LoRA", base, [None] * args.num_prompts),
        ("base model, LoRA engine", lora, [None] * args.num_prompts),
    ]
    for k in counts:
        cases.append((f"{k} adapter{'s' if k > 1 else ''}", lora, [adapters[i % k] for i in range(args.num_prompts)]))
    for _, llm, loras in cases:  # warm-up: loads every adapter, compiles the kernels
        run(llm, prompts, 4, loras)
    times = timed([lambda llm=llm, loras=loras: run(llm, prompts, args.output_len, loras) for _, llm, loras in cases],
                  args.repeat)
    num_out = args.num_prompts * args.output_len
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu, {args.threads} threads"
    print(f"\n{args.model} on {device}: {args.num_prompts} prompts, {args.input_len} in / {args.output_len} out, "
          f"rank {args.rank}, best of {args.repeat}\n")
    print("| batch | seconds | output tokens/s | vs base |")
    print("|---|---|---|---|")
    for (name, _, _), seconds in zip(cases, times, strict=True):
        print(f"| {name} | {seconds:.2f} | {num_out / seconds:.1f} | {times[0] / seconds:.2f}x |")


if __name__ == "__main__":
    main()
