"""The batch-1 INT4 GEMV as decode runs it: many calls in one CUDA graph over weights
larger than the L2 (benchmarks/bench_gemv.py's `graph_seconds`), on llama-3.1-8b's shapes.
Per shape, in one run: the bf16 GEMV (kernels.linear), the GPTQ-layout split-K GEMV
(kernels/int4/triton_gemv.py), the rows-layout GEMV (kernels/int4/triton_rows.py) at its
default config, and the same GEMV on the pairs layout (decode's) at its default and over a
sweep of its configs; GB/s counts packed weight bytes (K * N / 2), against the copy
bandwidth of the same run. Then M = 4 and 16 (batched decode): the rows layout's tl.dot
tiles against the GPTQ kernels, and a check of each path against the torch reference.

    PYTHONPATH=. python benchmarks/bench_int4_gemv.py [--quick] [--shapes qkv,o,gate_up,down] [--silu-mul]
    PYTHONPATH=. python benchmarks/bench_int4_gemv.py --mma [--mma-rows 1,4,16,64,128] [--quick]

`--silu-mul`: gate_up's pairs GEMV (its default, and the sweep) also applies SiLU-and-mul, as
decode runs it. `--mma`: the tensor-core kernel (kernels/int4/triton_mma.py) against the GEMV and the rows
layout's tiles instead, per rows of x, and above one row against the bf16 product it replaces
(cuBLAS, `m{rows}_bf16_us`).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from collections.abc import Callable

import torch

from benchmarks.bench_gemv import copy_bandwidth, graph_seconds
from vllm_cluster.kernels.int4 import dispatch as int4_dispatch
from vllm_cluster.kernels.int4 import reference as int4_reference
from vllm_cluster.kernels.int4.layouts import gptq_to_pairs, gptq_to_rows
from vllm_cluster.kernels.int4.triton_gemm import int4_gemm
from vllm_cluster.kernels.int4.triton_gemv import gemv_int4, pick_gemv_config
from vllm_cluster.kernels.int4.triton_mma import int4_mma, pick_mma_config
from vllm_cluster.kernels.int4.triton_rows import gemv_rows, packed_math, pick_rows_config
from vllm_cluster.kernels.int4.triton_rows_dot import int4_gemm_rows
from vllm_cluster.kernels.int4.weight import Int4Weight
from vllm_cluster.kernels.linear.dispatch import linear

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
GROUP = 128


def weight(tensors: dict[str, torch.Tensor], layout: str) -> Int4Weight:
    """One set's weight in `layout` (its "qweight" for gptq, else the repacked tensor of that name)."""
    qweight = tensors["qweight" if layout == "gptq" else layout]
    return Int4Weight(qweight, tensors["qzeros"], tensors["scales"], None, GROUP, layout, 1)
# (block_n, unroll, num_warps, num_stages, programs per SM) of the GEMV on the pairs layout:
# 1, 2, 4 or 8 rows per thread (block_n / (8 num_warps)): fewer rows per thread hold fewer
# registers, so more warps fit an SM (ncu saw 7 warps per SM at 4-8 rows per thread, each
# issuing every ~5 cycles: latency-bound); 1, 2 or 4 blocks of 128 inputs per step, 3-4 tiles in
# flight; stages 1 (no pipelining) once as a control.
SWEEP = [(32, 1, 1, 1, 4)] + [
    (bn, u, w, st, pps)
    for (bn, w), u, st, pps in itertools.product(
        ((64, 2), (128, 2), (32, 2), (64, 4), (32, 4), (64, 8)), (1, 2, 4), (3, 4), (4, 8)
    )
]


def packed_set(k: int, n: int) -> dict[str, torch.Tensor]:
    """Random valid GPTQ tensors (any bits are valid nibbles) and their rows repack."""
    qweight = torch.randint(-(2**31), 2**31, (k // 8, n), device="cuda", dtype=torch.int32)
    return {
        "qweight": qweight,
        "rows": gptq_to_rows(qweight),
        "pairs": gptq_to_pairs(qweight),
        "qzeros": torch.randint(-(2**31), 2**31, (k // GROUP, n // 8), device="cuda", dtype=torch.int32),
        "scales": (torch.rand(k // GROUP, n, device="cuda") * 0.01).half(),
    }


def timed(calls: list[Callable[[], object]]) -> float:
    return graph_seconds(calls) * 1e6


def bf16_weights(k: int, n: int) -> list[torch.Tensor]:
    """Two dense [N, K] bf16 weights (together larger than the L2 for llama-3.1-8b's shapes)."""
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(2)]


def bf16_us(x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """us of x @ w.T through cuBLAS, the bf16 product an INT4 kernel replaces, over `weights` in turn."""
    return round(timed([functools.partial(torch.matmul, x, w.t()) for w in weights]), 2)


def gemv_row(
    name: str,
    k: int,
    n: int,
    sets: list[dict[str, torch.Tensor]],
    bandwidth: float,
    quick: bool,
    silu_mul: bool = False,
) -> None:
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    packed_bytes = k * n // 2
    row: dict[str, object] = {"shape": name, "K": k, "N": n}

    def record(label: str, us: float, nbytes: int = packed_bytes) -> None:
        row[f"{label}_us"] = round(us, 2)
        row[f"{label}_GBps"] = round(nbytes / us / 1e3)
        row[f"{label}_of_copy"] = round(nbytes / us / 1e3 / (bandwidth / 1e9), 3)

    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, int(4e8 // (2 * k * n))))]
    record("bf16", timed([functools.partial(linear, x, w) for w in weights]), 2 * k * n)
    del weights
    old = pick_gemv_config(1, n, k, GROUP, num_sms)
    record("gptq_old", timed([functools.partial(gemv_int4, x, weight(t, "gptq"), None, old) for t in sets]))
    default = pick_rows_config(n, k, num_sms)
    record("rows_default", timed([functools.partial(gemv_rows, x, weight(t, "rows"), None, default) for t in sets]))
    row["rows_default_config"] = repr(default)
    pairs = pick_rows_config(n, k, num_sms, packed=packed_math(x.dtype, GROUP))  # decode's config
    row["pairs_default_config"] = repr(pairs)
    record("pairs_default", timed([functools.partial(gemv_rows, x, weight(t, "pairs"), None, pairs) for t in sets]))
    silu = silu_mul and name == "gate_up"  # decode's gate_up: SiLU-and-mul in the GEMV
    if silu:
        record("pairs_silu_default",
               timed([functools.partial(gemv_rows, x, weight(t, "pairs"), None, pairs, True) for t in sets]))
    sweep = []
    for block_n, unroll, warps, stages, pps in [] if quick else SWEEP:
        cfg = pick_rows_config(n, k, num_sms, block_n, unroll, warps, pps, stages)
        calls = [functools.partial(gemv_rows, x, weight(t, "pairs"), None, cfg, silu) for t in sets]
        sweep.append((timed(calls), f"bn={block_n} u={unroll} w={warps} st={stages} pps={pps} split={cfg.split_k}"))
    if sweep:
        sweep.sort()
        print(json.dumps({"shape": name, "pairs_sweep_best": [(round(us, 2), c) for us, c in sweep[:8]]}), flush=True)
        record("pairs_best", sweep[0][0])
        row["pairs_best_config"] = sweep[0][1]
    print(json.dumps(row), flush=True)


# (block_n, num_warps, num_stages, programs per SM, early) of the tensor-core kernel
# (kernels/int4/triton_mma.py) at one row: 16 or 32 outputs per warp, with and without the
# early first block.
MMA_SWEEP = [
    (bn, w, 3, pps, early)
    for (bn, w), pps, early in itertools.product(
        ((32, 1), (64, 2), (32, 2), (64, 4), (128, 8)), (4, 8, 16), (True, False)
    )
]


# (block_n, num_warps) above one row: 64 x 16-64 on 2 warps (mma.sync), 128 x 16-64 on 4 (wgmma)
MMA_WIDE_TILES = ((64, 2), (128, 4))


def mma_row(
    name: str, k: int, n: int, sets: list[dict[str, torch.Tensor]], bandwidth: float, quick: bool, rows: tuple[int, ...]
) -> None:
    """The tensor-core kernel against the rows layout's kernels (default configs), 1-128 rows of
    x, same run: at one row a sweep of tiles, stages and splits; above, the split of K for
    two tile shapes (without --quick)."""
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    row: dict[str, object] = {"shape": name}
    t = sets[0]
    dense = bf16_weights(k, n) if any(m > 1 for m in rows) else []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = int4_reference.int4_gemm(x.float(), weight(t, "gptq"))
        cfg = pick_mma_config(m, n, k, num_sms)
        out = int4_mma(x, weight(t, "pairs"), None, cfg).float()
        row[f"m{m}_rel_err_mma"] = float((out - ref).norm() / ref.norm())
        if m == 1:
            old = [
                functools.partial(gemv_rows, x, weight(s, "rows"), None, pick_rows_config(n, k, num_sms)) for s in sets
            ]
        else:
            old = [functools.partial(int4_gemm_rows, x, weight(s, "rows")) for s in sets]
        row[f"m{m}_rows_us"] = round(timed(old), 2)
        if m == 1:  # the same GEMV reading the pairs layout
            cfg = pick_rows_config(n, k, num_sms, packed=packed_math(x.dtype, GROUP))
            calls = [functools.partial(gemv_rows, x, weight(s, "pairs"), None, cfg) for s in sets]
            row["m1_pairs_gemv_us"] = round(timed(calls), 2)
        if m > 1:  # the bf16 product it replaces (cuBLAS, as decode runs bf16 above one row)
            row[f"m{m}_bf16_us"] = bf16_us(x, dense)
        sweep = []
        default = pick_mma_config(m, n, k, num_sms)
        if quick:
            configs = [default]
        elif m == 1:
            configs = [default] + [
                pick_mma_config(m, n, k, num_sms, bn, w, pps, st, e) for bn, w, st, pps, e in MMA_SWEEP
            ]
        else:  # the split of K (its fp32 partials grow with the rows of x) on both tile shapes
            configs = [default] + [
                pick_mma_config(m, n, k, num_sms, bn, w, pps)
                for (bn, w), pps in itertools.product(MMA_WIDE_TILES, (1, 2, 4, 8))
            ]
        for cfg in configs:
            calls = [functools.partial(int4_mma, x, weight(s, "pairs"), None, cfg) for s in sets]
            sweep.append((round(timed(calls), 2), f"{'default ' if cfg is default else ''}{cfg}"))
        sweep.sort()
        row[f"m{m}_mma_best"] = sweep[:4]
        row[f"m{m}_mma_best_of_copy"] = round(k * n / 2 / sweep[0][0] / 1e3 / (bandwidth / 1e9), 3)
        print(json.dumps(row), flush=True)


def check_and_batched(name: str, k: int, n: int, sets: list[dict[str, torch.Tensor]]) -> None:
    """Relative error of each path against the reference (fp32 on the GPU), and M = 4, 16 timings."""
    t = sets[0]
    row: dict[str, object] = {"shape": name}
    for m in (1, 4, 16, 64, 200):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = int4_reference.int4_gemm(x, weight(t, "gptq")).float()
        new = int4_dispatch.int4_gemm(x, weight(t, "rows")).float()
        old = int4_gemm(x, weight(t, "gptq")).float()
        row[f"m{m}_rel_err_rows"] = float((new - ref).norm() / ref.norm())
        row[f"m{m}_rel_err_gptq"] = float((old - ref).norm() / ref.norm())
        if m in (4, 16, 64):
            row[f"m{m}_rows_us"] = round(
                timed([functools.partial(int4_gemm_rows, x, weight(s, "rows")) for s in sets]), 2
            )
            row[f"m{m}_gptq_us"] = round(timed([functools.partial(int4_gemm, x, weight(s, "gptq")) for s in sets]), 2)
    print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="the default rows config only (no sweep)")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--mma", action="store_true", help="only the tensor-core kernel against the rows GEMV")
    parser.add_argument("--mma-rows", default="1,4,16,64,128", help="rows of x for --mma")
    parser.add_argument("--silu-mul", action="store_true",
                        help="gate_up's pairs GEMV with SiLU-and-mul, as decode runs it")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(json.dumps({"device": torch.cuda.get_device_name(), "copy_GBps": round(bandwidth / 1e9)}), flush=True)
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        sets = [packed_set(k, n) for _ in range(max(2, int(4e8 // (k * n // 2))))]
        if args.mma:
            mma_row(name, k, n, sets, bandwidth, args.quick, tuple(int(r) for r in args.mma_rows.split(",")))
        else:
            gemv_row(name, k, n, sets, bandwidth, args.quick, args.silu_mul)
            check_and_batched(name, k, n, sets)
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
