"""Tensor and pipeline parallelism on two H200s (dummy weights, bf16), against one GPU in
the same run.

    python benchmarks/bench_parallel_gpu.py [--model llama-3.1-8b] [--num-prompts 64]

Offline throughput through the LLM API: N prompts of `--input-len` random tokens, each
generating `--output-len` tokens (ignore_eos), all submitted at once. One GPU runs with
CUDA graphs (the default) and eagerly; the parallel engines run every step eagerly (no
graphs yet).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from vllm_cluster.engine import LLM, SamplingParams


def run(llm: LLM, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"elapsed_s": round(elapsed, 2), "output_tok_s": round(generated / elapsed, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32000, (args.input_len,), generator=g).tolist() for _ in range(args.num_prompts)]
    options = dict(load_format="dummy", device="cuda", dtype="bfloat16", num_blocks=8192,
                   max_model_len=4096, max_num_seqs=args.num_prompts, max_num_batched_tokens=8192)
    single = LLM(args.model, **options)
    print(json.dumps({"config": "tp1", **run(single, prompts, args.output_len)}), flush=True)
    eager = single.derive(enforce_eager=True)
    print(json.dumps({"config": "tp1_eager", **run(eager, prompts, args.output_len)}), flush=True)
    del eager
    for tp, pp in ((2, 1), (1, 2)):
        llm = single.derive(tensor_parallel_size=tp, pipeline_parallel_size=pp)
        print(json.dumps({"config": f"tp{tp}_pp{pp}", **run(llm, prompts, args.output_len)}), flush=True)
        llm.core.shutdown()


if __name__ == "__main__":
    main()
