"""Batch-1 linear layers on the GPU: the Triton GEMV (kernels.linear) against cuBLAS
(F.linear), both against the copy bandwidth measured in the same run.

    PYTHONPATH=. python benchmarks/bench_gemv.py

Shapes: llama-3.1-8b and llama-3.2-1b's qkv, o, gate_up and down projections. Each is
timed inside a CUDA graph (as decode steps run) over enough distinct weights to exceed
the 50 MB L2, so every weight comes from HBM.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable

import torch
from torch.nn import functional as F

import kernels

SHAPES = {  # name: (N, K)
    "8b qkv": (6144, 4096),
    "8b o": (4096, 4096),
    "8b gate_up": (28672, 4096),
    "8b down": (4096, 14336),
    "1b qkv": (3072, 2048),
    "1b o": (2048, 2048),
    "1b gate_up": (16384, 2048),
    "1b down": (2048, 8192),
}


def graph_seconds(calls: list[Callable[[], object]], replays: int = 20) -> float:
    """Seconds per call, from replays of one CUDA graph holding all calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / replays / len(calls)


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy (as bench_gpu.py)."""
    from triton.testing import do_bench

    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (do_bench(lambda: dst.copy_(src)) * 1e-3)


def main() -> None:
    bandwidth = copy_bandwidth()
    print(json.dumps({"copy_GBps": round(bandwidth / 1e9)}), flush=True)
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, int(4e8 // nbytes)))]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        row: dict[str, object] = {"shape": name, "N": n, "K": k}
        for label, fn in (("cublas", F.linear), ("triton", kernels.linear)):
            seconds = graph_seconds([functools.partial(fn, x, w) for w in weights])
            row[f"{label}_us"] = round(seconds * 1e6, 1)
            row[f"{label}_GBps"] = round(nbytes / seconds / 1e9)
            row[f"{label}_of_copy"] = round(nbytes / seconds / bandwidth, 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
