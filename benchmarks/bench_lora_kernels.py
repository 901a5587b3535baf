"""The batched-LoRA kernels alone (kernels/triton_lora.py) on CUDA, over a few tile sizes:
microseconds per call, replayed in a CUDA graph as the engine's decode steps are.

    PYTHONPATH=. python benchmarks/bench_lora_kernels.py

Shapes are llama-3.2-1b's at rank 16 (bf16). Batches: a decode step (64 tokens, token i
under adapter i % 4), a prefill chunk (1024 tokens, 4 requests of 256 under adapters 0-3),
and each of them with no adapter (slots -1). A shrink's time includes the sum over its K
splits. `*` marks the tiles the engine picks.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import triton

from kernels import triton_lora
from kernels.triton_lora import ShrinkTiles

RANK, NUM_LORAS = 16, 16
SHRINKS = {"qkv": (2048, 48), "gate_up": (2048, 32), "down": (8192, 16)}  # name: (K, N)
EXPANDS = {"k": 512, "q": 2048, "gate": 8192}  # name: M
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


def shrink_us(slots: torch.Tensor, k: int, n: int, tiles: ShrinkTiles) -> float:
    x = torch.randn(len(slots), k, device="cuda", dtype=torch.bfloat16)  # [T, K]
    a = torch.randn(NUM_LORAS, n, k, device="cuda", dtype=torch.bfloat16)  # [L, N, K]
    return time_us(partial(triton_lora.lora_shrink, x, a, slots, tiles))


def expand_us(slots: torch.Tensor, m: int, block_t: int) -> float:
    y = torch.randn(len(slots), m, device="cuda", dtype=torch.bfloat16)  # [T, M]
    s = torch.randn(len(slots), RANK, device="cuda")  # [T, R]
    b = torch.randn(NUM_LORAS, m, RANK, device="cuda", dtype=torch.bfloat16)  # [L, M, R]
    return time_us(partial(triton_lora.lora_expand_add, y, s, b, slots, block_t))


def shrink_table(slots_by_batch: dict[str, torch.Tensor]) -> None:
    print("\nshrink, us: tiles (block_t, block_k, k_per_split) x batch/linear")
    names = [f"{b}/{s}" for b in slots_by_batch for s in SHRINKS]
    print("| tiles | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for tiles in SHRINK_TILES:
        cells = []
        for slots in slots_by_batch.values():
            for k, n in SHRINKS.values():
                mark = "*" if triton_lora.shrink_tiles(len(slots), k) == tiles else ""
                cells.append(f"{shrink_us(slots, k, n, tiles):.1f}{mark}")
        print(f"| {tiles.block_t}, {tiles.block_k}, {tiles.k_per_split} | " + " | ".join(cells) + " |")


def expand_table(slots_by_batch: dict[str, torch.Tensor]) -> None:
    print("\nexpand, us: block_t x batch/linear")
    names = [f"{b}/{e}" for b in slots_by_batch for e in EXPANDS]
    print("| block_t | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for block_t in EXPAND_BLOCK_T:
        cells = []
        for slots in slots_by_batch.values():
            for m in EXPANDS.values():
                mark = "*" if triton_lora.token_block(len(slots)) == block_t else ""
                cells.append(f"{expand_us(slots, m, block_t):.1f}{mark}")
        print(f"| {block_t} | " + " | ".join(cells) + " |")


def main() -> None:
    slots_by_batch = batches("cuda")
    print(f"{torch.cuda.get_device_name()}, rank {RANK}, bf16")
    shrink_table(slots_by_batch)
    expand_table(slots_by_batch)


if __name__ == "__main__":
    main()
