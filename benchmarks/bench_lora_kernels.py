"""The batched-LoRA kernels alone (kernels/lora/triton_shrink_expand.py) on CUDA: microseconds per call,
replayed in a CUDA graph as the engine's decode steps are.

    PYTHONPATH=. python benchmarks/bench_lora_kernels.py [--sweep]

Shapes are llama-3.2-1b's at rank 16 (bf16); each of a layer's four adapted linears costs
one shrink (one fp32 partial of s per slice of K) and one expand (which adds the partials
up and serves all the linear's parts). Batches: a decode step (64 tokens, token i under
adapter i % 4), a prefill chunk (1024 tokens, 4 requests of 256 under adapters 0-3), and
each of them with no adapter (slots -1). The first table uses the engine's tiles; --sweep
adds a sweep over tile sizes, where `*` marks the tiles the engine picks.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch
import triton

from vllm_cluster.kernels.lora import triton_shrink_expand as triton_lora
from vllm_cluster.kernels.lora.triton_shrink_expand import ShrinkTiles

RANK, NUM_LORAS = 16, 16
# name: (K, the parts' output columns)
LINEARS = {
    "qkv": (2048, (2048, 512, 512)), "o": (2048, (2048,)), "gate_up": (2048, (8192, 8192)), "down": (8192, (2048,)),
}
SHRINK_TILES = [ShrinkTiles(bt, bk, kps) for bt, bk, kps in
                [(16, 128, 256), (16, 64, 128), (16, 128, 512), (64, 128, 256), (64, 128, 512), (32, 128, 256)]]
EXPAND_BLOCK_T = [16, 32, 64]


def batches(device: str) -> dict[str, torch.Tensor]:
    decode = torch.arange(64, device=device) % 4
    prefill = torch.arange(1024, device=device) // 256
    return {"decode": decode, "decode base": torch.full_like(decode, -1),
            "prefill": prefill, "prefill base": torch.full_like(prefill, -1)}


def time_us(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=10, return_mode="median") * 1000


def shrink_us(slots: torch.Tensor, linear: str, tiles: ShrinkTiles | None = None) -> float:
    k, parts = LINEARS[linear]
    x = torch.randn(len(slots), k, device="cuda", dtype=torch.bfloat16)  # [T, K]
    a = torch.randn(NUM_LORAS, len(parts) * RANK, k, device="cuda", dtype=torch.bfloat16)  # [L, P*R, K]
    return time_us(partial(triton_lora.lora_shrink, x, a, slots, tiles))


def expand_us(slots: torch.Tensor, linear: str, block_t: int | None = None) -> float:
    k, parts = LINEARS[linear]
    num_splits = triton.cdiv(k, triton_lora.shrink_tiles(len(slots), k).k_per_split)
    y = torch.randn(len(slots), sum(parts), device="cuda", dtype=torch.bfloat16)  # [T, M]
    s = torch.randn(num_splits, len(slots), len(parts) * RANK, device="cuda")  # [S, T, P*R]
    b = torch.randn(NUM_LORAS, sum(parts), RANK, device="cuda", dtype=torch.bfloat16)  # [L, M, R]
    return time_us(partial(triton_lora.lora_expand_add, y, s, b, slots, parts, block_t))


def engine_table(slots_by_batch: dict[str, torch.Tensor]) -> None:
    print("\nengine tiles, us per call: kernel x batch")
    print("| kernel | " + " | ".join(slots_by_batch) + " |\n|---|" + "---|" * len(slots_by_batch))
    layer = dict.fromkeys(slots_by_batch, 0.0)
    for linear in LINEARS:
        for kernel, time_fn in (("shrink", shrink_us), ("expand", expand_us)):
            cells = []
            for name, slots in slots_by_batch.items():
                us = time_fn(slots, linear)
                layer[name] += us
                cells.append(f"{us:.1f}")
            print(f"| {kernel} {linear} | " + " | ".join(cells) + " |")
    print("| a layer's 8 launches, summed | " + " | ".join(f"{us:.1f}" for us in layer.values()) + " |")


def sweep_tables(slots_by_batch: dict[str, torch.Tensor]) -> None:
    names = [f"{b}/{linear}" for b in slots_by_batch for linear in LINEARS]
    print("\nshrink, us: tiles (block_t, block_k, k_per_split) x batch/linear")
    print("| tiles | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for tiles in SHRINK_TILES:
        cells = [f"{shrink_us(slots, linear, tiles):.1f}"
                 + ("*" if triton_lora.shrink_tiles(len(slots), LINEARS[linear][0]) == tiles else "")
                 for slots in slots_by_batch.values() for linear in LINEARS]
        print(f"| {tiles.block_t}, {tiles.block_k}, {tiles.k_per_split} | " + " | ".join(cells) + " |")
    print("\nexpand, us: block_t x batch/linear")
    print("| block_t | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for block_t in EXPAND_BLOCK_T:
        cells = [f"{expand_us(slots, linear, block_t):.1f}"
                 + ("*" if triton_lora.token_block(len(slots)) == block_t else "")
                 for slots in slots_by_batch.values() for linear in LINEARS]
        print(f"| {block_t} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also sweep the tile sizes")
    args = parser.parse_args()
    slots_by_batch = batches("cuda")
    print(f"{torch.cuda.get_device_name()}, rank {RANK}, bf16")
    engine_table(slots_by_batch)
    if args.sweep:
        sweep_tables(slots_by_batch)


if __name__ == "__main__":
    main()
