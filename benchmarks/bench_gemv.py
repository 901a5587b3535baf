"""Batch-1 linear layers on the GPU: the Triton GEMV (kernels.linear) against cuBLAS
(F.linear), and the 1-byte GEMV (kernels/linear/triton_w8_gemv.py, through kernels/linear/dispatch as
decode calls it) on fp8 and int8 weights of the same shapes, all against the copy
bandwidth measured in the same run.

    PYTHONPATH=. python benchmarks/bench_gemv.py [--sweep]

Shapes: llama-3.1-8b and llama-3.2-1b's qkv, o, gate_up and down projections. Each is
timed inside a CUDA graph (as decode steps run) over enough distinct weights to exceed
the 50 MB L2, so every weight comes from HBM. `--sweep` then times the 1-byte GEMV's block
shapes (BLOCK_N x BLOCK_K, warps, lane sums) on the 8b shapes, the search behind
`pick_blocks` and `LANE_SUMS`.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable

import torch
from torch.nn import functional as F

from vllm_cluster.kernels.linear import dispatch as linear_ops
from vllm_cluster.kernels.linear.triton_w8_gemv import gemv_w8

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


# (BLOCK_N, BLOCK_K, warps, lane sums): per-thread partial sums across tiles (triton_w8_gemv.LANE_SUMS)
# take the loop's cross-warp reduction out (benchmarks/kernel_sass.py); larger tiles may pay then.
SWEEP_BLOCKS = [
    (4, 2048, 4, False), (2, 2048, 4, False), (8, 2048, 4, False), (4, 1024, 4, False), (8, 1024, 4, False),
    (4, 4096, 4, False), (4, 2048, 2, False),
    (4, 2048, 4, True), (8, 2048, 4, True), (4, 4096, 4, True), (8, 1024, 4, True), (4, 2048, 8, True),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also time the 1-byte GEMV's block shapes")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(json.dumps({"copy_GBps": round(bandwidth / 1e9)}), flush=True)
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, int(4e8 // nbytes)))]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        row: dict[str, object] = {"shape": name, "N": n, "K": k}
        for label, fn in (("cublas", F.linear), ("triton", linear_ops.linear)):
            seconds = graph_seconds([functools.partial(fn, x, w) for w in weights])
            row[f"{label}_us"] = round(seconds * 1e6, 1)
            row[f"{label}_GBps"] = round(nbytes / seconds / 1e9)
            row[f"{label}_of_copy"] = round(nbytes / seconds / bandwidth, 3)
        del weights
        for label, fn in w8_linears(n, k):
            seconds = graph_seconds(fn)
            row[f"{label}_us"] = round(seconds * 1e6, 1)
            row[f"{label}_of_copy"] = round(n * k / seconds / bandwidth, 3)
        print(json.dumps(row), flush=True)
    if args.sweep:
        sweep(bandwidth)


def sweep(bandwidth: float) -> None:
    """Each (BLOCK_N, BLOCK_K, warps) of SWEEP_BLOCKS on fp8 and int8 weights of the 8b shapes."""
    for name, (n, k) in SHAPES.items():
        if not name.startswith("8b"):
            continue
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        scale = torch.rand(n, device="cuda") * 0.01
        count = max(2, int(4e8 // (n * k)))
        for fmt in ("fp8", "int8"):
            if fmt == "fp8":
                qs = [
                    (torch.randn(n, k, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
                    for _ in range(count)
                ]
            else:
                qs = [torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8) for _ in range(count)]
            # gate_up also SiLU-fused, as decode runs it: BLOCK_N there counts outputs, half the tile's rows.
            for silu in (False, True) if name.endswith("gate_up") else (False,):
                for block_n, block_k, warps, lane_sums in SWEEP_BLOCKS:
                    calls = [
                        functools.partial(gemv_w8, x, q, scale, None, block_n // (1 + silu), block_k, warps,
                                          silu_mul=silu, lane_sums=lane_sums)
                        for q in qs
                    ]
                    seconds = graph_seconds(calls)
                    row = {"shape": name, "fmt": fmt, "silu_mul": silu, "blocks": f"{block_n}x{block_k}",
                           "warps": warps, "lane_sums": lane_sums}
                    print(json.dumps(row | {"us": round(seconds * 1e6, 2),
                                            "of_copy": round(n * k / seconds / bandwidth, 3)}))
            del qs


def w8_linears(n: int, k: int) -> list[tuple[str, list[Callable[[], object]]]]:
    """("fp8" | "int8", calls of the 1-byte linear at one row over 400 MB of weights)."""
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    scale = torch.rand(1, n, device="cuda") * 0.01
    count = max(2, int(4e8 // (n * k)))
    fp8 = [(torch.randn(n, k, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn) for _ in range(count)]
    int8 = [torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8) for _ in range(count)]
    return [
        ("fp8", [functools.partial(linear_ops.fp8_linear, x, q, scale, None) for q in fp8]),
        ("int8", [functools.partial(linear_ops.int8_linear, x, q, scale[0], None) for q in int8]),
    ]


if __name__ == "__main__":
    main()
