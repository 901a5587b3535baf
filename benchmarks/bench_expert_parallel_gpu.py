"""Expert parallelism through the LLM API on two GPUs (NCCL): the tiny Mixtral preset in
fp32 gives the same greedy tokens at tensor_parallel_size=2 with enable_expert_parallel as
on one GPU; then a 4-layer `mixtral-8x7b` dummy preset in bf16 at tp=2 with expert
parallelism off (every rank holds every expert) and on (4 of 8 each): rank 0's GPU
memory and the time for one batch.

    PYTHONPATH=. python benchmarks/bench_expert_parallel_gpu.py
"""

from __future__ import annotations

import time

import torch

from vllm_cluster.engine import LLM, SamplingParams


def check_tiny_fp32() -> None:
    prompts = [[(11 * i + 5 * j) % 1024 for j in range(3 + 9 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    one = LLM("mixtral-tiny", load_format="dummy", dtype="float32", num_blocks=256, max_model_len=512,
              enforce_eager=True)
    ep = one.derive(tensor_parallel_size=2, enable_expert_parallel=True)  # the same weights
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in ep.generate(prompts, params, use_tqdm=False)]
    same = sum(a == b for a, b in zip(want, got, strict=True))
    print(f"mixtral-tiny fp32: tp2 + expert parallel tokens equal one GPU's in {same}/{len(prompts)} requests")
    ep.core.shutdown()


def bench_mixtral(enable_expert_parallel: bool) -> None:
    llm = LLM("mixtral-8x7b", load_format="dummy", dtype="bfloat16", hf_overrides={"num_hidden_layers": 4},
              num_blocks=2048, max_model_len=4096, tensor_parallel_size=2,
              enable_expert_parallel=enable_expert_parallel)
    allocated_gib = torch.cuda.memory_allocated(0) / 2**30
    prompts = [[(7 * i + j) % 32000 for j in range(512)] for i in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    print(f"mixtral-8x7b (4 layers) bf16 tp2 enable_expert_parallel={enable_expert_parallel}: rank 0 "
          f"{allocated_gib:.2f} GiB allocated; 32 x (512 prompt + 64 out) in {time.perf_counter() - start:.2f} s")
    llm.core.shutdown()


if __name__ == "__main__":
    assert torch.cuda.device_count() >= 2, "needs two GPUs"
    check_tiny_fp32()
    for enabled in (False, True):
        bench_mixtral(enabled)
