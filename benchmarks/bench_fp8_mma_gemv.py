"""The batch-1 FP8 GEMV of a normed x (qkv, gate_up) on fp16 MMAs (kernels/triton_fp8_mma_gemv.py)
against the 1-byte GEMV finishing the same norm (kernels/triton_gemv.py, as decode ran it
before), in the same run, on llama-3.1-8b's shapes: many calls in one CUDA graph over weights
larger than the L2, each with its relative error against the fp32 reference; then a sweep
of the MMA GEMV's configs.

    PYTHONPATH=. python benchmarks/bench_fp8_mma_gemv.py [--sweep] [--vary MODULE.ATTR=A,B]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch

from benchmarks import vary
from benchmarks.bench_gemv import copy_bandwidth, graph_seconds
from kernels import Normed
from kernels.triton_fp8_mma_gemv import gemv_fp8_mma_normed, pick_config
from kernels.triton_gemv import gemv_w8
from kernels.triton_int4_mma_gemv import MmaGemvConfig

SHAPES = {"qkv": (6144, 4096, False), "gate_up": (28672, 4096, True)}  # name: (N, K, SiLU-and-mul)
# (tiles of 16 rows a warp, blocks a warp and step, warps, warps a tile's K is split over)
SWEEP = [
    (2, unroll, warps, k_warps)
    for unroll, (warps, k_warps) in itertools.product((1, 2), ((4, 1), (4, 2), (4, 4), (8, 2), (8, 4), (8, 8), (2, 1)))
]


def normed_x(k: int) -> Normed:
    h = torch.randn(1, k, device="cuda") * 3
    weight = torch.rand(k, device="cuda") + 0.5
    hg = (h * weight).to(torch.bfloat16)
    slot = (h.double() ** 2).sum().reshape(1)
    return Normed(hg, slot, 1e-5, float(weight.max()))


def fp32_reference(x: Normed, q: torch.Tensor, scale: torch.Tensor, silu_mul: bool) -> torch.Tensor:
    y = (x.hg.float() * torch.rsqrt(x.slot.float() / x.hg.shape[1] + x.eps)) @ (q.float() * scale[:, None]).t()
    if silu_mul:
        gate, up = y.chunk(2, dim=1)
        y = torch.nn.functional.silu(gate) * up
    return y


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected).norm() / expected.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also time SWEEP's configs")
    parser.add_argument("--vary", action="append", default=[], metavar="MODULE.ATTR=A,B",
                        help="run once per value of a module attribute, e.g. kernels.triton_fp8_mma_gemv.ASM_TILES=1,2")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(json.dumps({"copy_GBps": round(bandwidth / 1e9)}), flush=True)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    axes = vary.parse(args.vary)
    for values in itertools.product(*(v for _, v in axes)):
        setting = ", ".join(f"{name} {value}" for (name, _), value in zip(axes, values, strict=True))
        for (name, _), value in zip(axes, values, strict=True):
            vary.set_attribute(name, value)
        for name, (n, k, silu_mul) in SHAPES.items():
            x = normed_x(k)
            qs = [(torch.randn(n, k, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
                  for _ in range(max(2, int(4e8 // (n * k))))]  # fmt: skip
            scale = torch.rand(n, device="cuda") * 0.01
            expected = fp32_reference(x, qs[0], scale, silu_mul)
            row: dict[str, object] = {"shape": name, "N": n, "K": k, "setting": setting}
            case = (qs, expected, bandwidth)
            record(row, "gemv_w8", functools.partial(_w8, x, scale=scale, silu_mul=silu_mul), *case)
            record(row, "mma", functools.partial(_mma, x, scale=scale, silu_mul=silu_mul), *case)
            row["mma_config"] = str(pick_config(n, k, num_sms, silu_mul))
            print(json.dumps(row), flush=True)
            if args.sweep:
                for tiles, unroll, warps, k_warps in SWEEP:
                    config = MmaGemvConfig(tiles, unroll, 1, warps, k_warps)
                    if silu_mul and config.block_n % 64:
                        continue
                    sweep_row: dict[str, object] = {"shape": name, "config": str(config)}
                    try:
                        record(sweep_row, "mma", functools.partial(_mma, x, scale=scale, silu_mul=silu_mul, config=config), *case)
                    except AssertionError as e:
                        sweep_row["error"] = str(e)[:80]
                    print(json.dumps(sweep_row), flush=True)
            del qs


def record(
    row: dict[str, object], label: str, fn: functools.partial[torch.Tensor], qs: list[torch.Tensor],
    expected: torch.Tensor, bandwidth: float,
) -> None:  # fmt: skip
    """fn over every weight of qs in one CUDA graph: us a call, share of the copy bandwidth, error."""
    seconds = graph_seconds([functools.partial(fn, q) for q in qs])
    n, k = qs[0].shape
    row[f"{label}_us"] = round(seconds * 1e6, 2)
    row[f"{label}_of_copy"] = round(n * k / seconds / bandwidth, 3)
    row[f"{label}_rel_err"] = round(relative_error(fn(qs[0]), expected), 5)


def _w8(x: Normed, q: torch.Tensor, scale: torch.Tensor, silu_mul: bool) -> torch.Tensor:
    return gemv_w8(x.hg, q, scale, None, silu_mul=silu_mul, rms=x)


def _mma(x: Normed, q: torch.Tensor, scale: torch.Tensor, silu_mul: bool, config: MmaGemvConfig | None = None) -> torch.Tensor:
    return gemv_fp8_mma_normed(x, q, scale, None, silu_mul=silu_mul, config=config)


if __name__ == "__main__":
    main()
