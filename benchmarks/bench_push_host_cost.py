"""What a prefill's engine thread pays on the host per pushed layer: a chunk per run of
blocks consecutive on both sides (`plan_chunks(gather=False)`: a view and a header per run,
what cuda_ipc builds for a few runs), one gathered chunk (`plan_chunks`, what the ucx and
nccl senders build past a few runs: one header, and the blocks gathered into one buffer),
and the checks cuda_ipc's gather path makes (`push_segments`, remembered per transfer, and
`layer_ready`), measured in the same run on CPU tensors.

    .venv/bin/python benchmarks/bench_push_host_cost.py [--blocks 32,64]

On a GPU whose forward is bound by the host's kernel launches (a small model's prompt), or
whose per-layer host work outgrows the layer's GPU time, this cost adds to every prefill's
time to first token, once per layer. Caches are llama-3.1-8b's per layer (8 KV heads,
head_dim 128, block size 16, bf16); destination ids are consecutive, source ids either
consecutive (a fresh pool: one run) or scattered (a pool after hours of traffic: one run
per block). CUDA payloads carry no CRC, so the CPU payloads' CRC is left out here (the
benchmark stubs `chunks.chunk_crc32`). On CPU tensors the gathered column includes the
copy of the layer's blocks itself; on a GPU that copy is a kernel queued behind the layer.
Prints a markdown table: median of 5 rounds, microseconds per layer.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from vllm_cluster.kv_transfer import chunks
from vllm_cluster.kv_transfer.base import push_segments
from vllm_cluster.kv_transfer.chunks import layer_ready, plan_chunks

NUM_LAYERS, POOL_BLOCKS = 32, 4096


def per_layer_us(push: Callable[[int], object], rounds: int = 5, repeat: int = 50) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeat):
            for layer in range(NUM_LAYERS):
                push(layer)
        times.append((time.perf_counter() - start) / (repeat * NUM_LAYERS) * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="32,64", help="blocks per prompt (512 and 1,024 tokens)")
    args = parser.parse_args()
    chunks.chunk_crc32 = lambda blocks: 0  # as on CUDA: no CRC of device payloads
    caches = [torch.zeros(POOL_BLOCKS, 2, 16, 8, 128, dtype=torch.bfloat16) for _ in range(NUM_LAYERS)]
    rng = random.Random(0)
    print("| blocks | source ids | runs | a chunk per run us/layer | gathered chunk us/layer "
          "| cuda_ipc gather-path checks us/layer |")
    print("|---|---|---|---|---|---|")
    for num_blocks in map(int, args.blocks.split(",")):
        dst = list(range(1000, 1000 + num_blocks))
        for label, src in (("consecutive", list(range(num_blocks))),
                           ("scattered", sorted(rng.sample(range(POOL_BLOCKS), num_blocks)))):  # fmt: skip
            tid = f"{label}-{num_blocks}"
            runs = len(push_segments(tid, src, dst))
            runs_us = per_layer_us(
                lambda layer, t=tid, s=src, d=dst: plan_chunks(caches, t, layer, s, d, gather=False)
            )
            gathered_us = per_layer_us(lambda layer, t=tid, s=src, d=dst: plan_chunks(caches, t, layer, s, d))
            checks_us = per_layer_us(
                lambda layer, t=tid, s=src, d=dst: (push_segments(t, s, d), layer_ready(caches, layer, s))
            )
            print(f"| {num_blocks} | {label} | {runs} | {runs_us:.1f} | {gathered_us:.1f} | {checks_us:.1f} |")


if __name__ == "__main__":
    main()
