"""The batch-1 INT4 GEMV on warp-level MMAs (kernels/int4/triton_mma_gemv.py) against the x2
arithmetic CUDA-core GEMV on the same pairs layout (kernels/int4/triton_rows.py) in the same
run, on llama-3.1-8b's shapes (many calls in one CUDA graph over weights larger than the L2),
each at its default config with its relative error against the fp32 reference, gate_up also
with SiLU-and-mul fused (as decode runs it); then 2, 4 and 8 rows of x (batched decode; up
to MAX_ROWS, in programs of 8 rows) against the tl.dot tensor-core kernel
(kernels/int4/triton_mma.py) and the bf16 cuBLAS product, and a sweep of the MMA
GEMV's configs at `--sweep-rows` rows of x (one by default).

    PYTHONPATH=. python benchmarks/bench_int4_mma_gemv.py [--quick] [--shapes qkv,o,gate_up,down,lm_head] [--rows 2,4,8]
        [--layout tiles|pairs] [--vary MODULE.ATTR=A,B] [--sweep-rows 1]

`--vary` runs it all once per value of a module attribute (e.g.
kernels.int4.triton_mma_gemv.WARP_SPLIT=1,8), each row naming its setting.

The MMA kernels read `--layout` (tiles, decode's, by default; kernels/int4/layouts.py), the x2
GEMV the pairs layout it reads.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch

from benchmarks import vary
from benchmarks.bench_gemv import copy_bandwidth
from benchmarks.bench_int4_gemv import GROUP, bf16_us, bf16_weights, packed_set, timed
from benchmarks.bench_int4_gemv import SHAPES as BENCH_SHAPES
from vllm_cluster.kernels.elementwise.dispatch import silu_and_mul
from vllm_cluster.kernels.int4 import reference as int4_reference
from vllm_cluster.kernels.int4.layouts import pairs_to_tiles
from vllm_cluster.kernels.int4.triton_mma import int4_mma, pick_mma_config
from vllm_cluster.kernels.int4.triton_mma_gemv import gemv_pairs_mma, pick_mma_gemv_config
from vllm_cluster.kernels.int4.triton_rows import gemv_rows, packed_math, pick_rows_config
from vllm_cluster.kernels.int4.weight import Int4Weight

# (16-row tiles per warp, blocks of 128 inputs per warp and step, warps, warps a tile's K is
# split over, warps per SM K is split over programs until)
SWEEP = [
    (tiles, unroll, warps, k_warps, wps)
    for (tiles, warps, k_warps), unroll, wps in itertools.product(
        ((1, 4, 1), (1, 4, 2), (1, 4, 4), (2, 4, 4), (1, 2, 1), (1, 2, 2), (1, 8, 1), (1, 8, 2), (1, 8, 4), (1, 8, 8)),
        (1, 2),
        (8, 16, 32),
    )
]
# llama-3.1-8b's lm_head, for checkpoints that quantize it (K, N)
SHAPES = BENCH_SHAPES | {"lm_head": (4096, 128256)}


def shape_row(
    name: str, k: int, n: int, bandwidth: float, quick: bool, rows: tuple[int, ...], layout: str, setting: str = "",
    sweep_rows: int = 1,
) -> None:  # fmt: skip
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    sets = [packed_set(k, n) for _ in range(max(2, int(4e8 // (k * n // 2))))]
    tiled = layout == "tiles"
    for s in sets:  # the x2 GEMV's weight: "pairs_weight"; the MMA kernels': "w"
        s["pairs_weight"] = Int4Weight(s["pairs"], s["qzeros"], s["scales"], None, GROUP, "pairs", 1)
        s["w"] = Int4Weight(
            pairs_to_tiles(s["pairs"]) if tiled else s["pairs"], s["qzeros"], s["scales"], None, GROUP, layout, 1
        )
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    nbytes = k * n // 2
    row: dict[str, object] = {"shape": name} | ({"setting": setting} if setting else {})
    t = sets[0]
    gptq = Int4Weight(t["qweight"], t["qzeros"], t["scales"].float(), None, GROUP, "gptq", 1)
    ref = int4_reference.int4_gemm(x.float(), gptq)
    pairs = pick_rows_config(n, k, num_sms, packed=packed_math(x.dtype, GROUP))
    mma = pick_mma_gemv_config(n, k, num_sms)
    for label, fn in (
        ("pairs", lambda s: gemv_rows(x, s["pairs_weight"], None, pairs)),
        ("mma", lambda s: gemv_pairs_mma(x, s["w"], mma)),
    ):
        y = fn(t).float()
        row[f"{label}_rel_err"] = round(float((y - ref).norm() / ref.norm()), 5)
        us = timed([functools.partial(fn, s) for s in sets])
        row[f"{label}_us"] = round(us, 2)
        row[f"{label}_of_copy"] = round(nbytes / us / 1e3 / (bandwidth / 1e9), 3)
    if name == "gate_up":  # decode's gate_up: SiLU-and-mul in the GEMV
        mma = pick_mma_gemv_config(n, k, num_sms, silu_mul=True)
        silu = silu_and_mul(gemv_rows(x, t["pairs_weight"], None, pairs))
        fused = gemv_pairs_mma(x, t["w"], mma, True)
        row["mma_silu_equal_x2_silu"] = round(float((fused.float() - silu.float()).norm() / silu.float().norm()), 5)
        for label, fn in (
            ("pairs_silu", lambda s: gemv_rows(x, s["pairs_weight"], None, pairs, True)),
            ("mma_silu", lambda s: gemv_pairs_mma(x, s["w"], mma, True)),
        ):
            row[f"{label}_us"] = round(timed([functools.partial(fn, s) for s in sets]), 2)
    dense = bf16_weights(k, n) if rows else []
    for m in rows:  # batched decode: x's rows in the MMA's columns, against the tl.dot kernel and bf16
        xm = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row[f"bf16_m{m}_us"] = bf16_us(xm, dense)
        refm = int4_reference.int4_gemm(xm.float(), gptq)
        dot = pick_mma_config(m, n, k, num_sms)
        mma = pick_mma_gemv_config(n, k, num_sms, rows=m)
        for label, fn in (
            (f"dot_m{m}", lambda s, xm=xm, dot=dot: int4_mma(xm, s["w"], None, dot)),
            (f"mma_m{m}", lambda s, xm=xm, mma=mma: gemv_pairs_mma(xm, s["w"], mma)),
        ):
            row[f"{label}_rel_err"] = round(float((fn(t).float() - refm).norm() / refm.norm()), 5)
            row[f"{label}_us"] = round(timed([functools.partial(fn, s) for s in sets]), 2)
    sweep = []
    xs = torch.randn(sweep_rows, k, device="cuda", dtype=torch.bfloat16)
    for tiles, unroll, warps, k_warps, wps in [] if quick else SWEEP:
        if (k // 128) % (k_warps * unroll):
            continue
        cfg = pick_mma_gemv_config(n, k, num_sms, tiles, unroll, warps, k_warps, wps, rows=sweep_rows)
        calls = [functools.partial(gemv_pairs_mma, xs, s["w"], cfg) for s in sets]
        sweep.append((
            round(timed(calls), 2),
            f"tiles={tiles} u={cfg.unroll} w={warps} kw={k_warps} wps={wps} split={cfg.split_k}",
        ))
    if sweep:
        sweep.sort()
        row["mma_best"] = sweep[:8]
        row["sweep_rows"] = sweep_rows
        row["mma_kw1_best"] = [r for r in sweep if "kw=1 " in r[1]][:3]
    print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="default configs only (no sweep)")
    parser.add_argument("--rows", default="2,4,8",
                        help="rows of x (batched decode) against the tl.dot kernel; '' for none")
    parser.add_argument("--shapes", default=",".join(BENCH_SHAPES), help="also: lm_head")
    parser.add_argument("--layout", default="tiles", choices=("tiles", "pairs"), help="the MMA kernels' weight layout")
    parser.add_argument("--vary", action="append", default=[], metavar="MODULE.ATTR=A,B",
                        help="run once per value of a module attribute, "
                             "e.g. kernels.int4.triton_mma_gemv.WARP_SPLIT=1,8")
    parser.add_argument("--sweep-rows", type=int, default=1, help="rows of x (1-8) the config sweep runs at")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(json.dumps({"device": torch.cuda.get_device_name(), "copy_GBps": round(bandwidth / 1e9)}), flush=True)
    axes = vary.parse(args.vary)
    for values in itertools.product(*(v for _, v in axes)):
        setting = ", ".join(f"{name} {value}" for (name, _), value in zip(axes, values, strict=True))
        for (name, _), value in zip(axes, values, strict=True):
            vary.set_attribute(name, value)
        for name in args.shapes.split(","):
            k, n = SHAPES[name]
            rows = tuple(int(r) for r in args.rows.split(",") if r)
            shape_row(name, k, n, bandwidth, args.quick, rows, args.layout, setting, args.sweep_rows)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
