"""Decode GEMMs of quantized weights against a bf16 torch matmul of the same shape, in one
run, on Llama-3.1-8B's linear shapes: INT4 (GPTQ / AWQ), INT8 weight-only and FP8 (through
kernels/linear/dispatch: weight-only at decode sizes). Each timing is triton.testing.do_bench's
median, which flushes the L2 cache before every call (a 4096x14336 INT4 weight, 29 MB,
would otherwise sit in the H200's 50 MB L2). GB/s is weight bytes over time, next to the
device-to-device copy bandwidth measured in the same run. `--sweep` first tries GEMV
configs on two shapes at M = 1.

    PYTHONPATH=. python benchmarks/bench_int4_gemm.py [--sweep] [--ms 1,4,16] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

from vllm_cluster.kernels.int4.triton_gemm import SPLIT_K_GEMV_MAX_ROWS, int4_gemm, pick_config
from vllm_cluster.kernels.int4.triton_gemv import gemv_int4, pick_gemv_config
from vllm_cluster.kernels.int4.weight import Int4Weight
from vllm_cluster.kernels.linear import dispatch as linear_ops
from vllm_cluster.kernels.linear.triton_w8_gemv import gemv_w8

# (name, K in, N out) of Llama-3.1-8B's layers, and the 4096 x 14336 of the brief.
SHAPES = [
    ("qkv", 4096, 6144),
    ("o", 4096, 4096),
    ("gate_up", 4096, 28672),
    ("down", 14336, 4096),
]
SWEEP_SHAPES = [("up 4096x14336", 4096, 14336), ("down", 14336, 4096)]


def make(k: int, n: int, method: str) -> dict[str, torch.Tensor]:
    """Random valid packed tensors (any bits are valid nibbles), made on the GPU."""
    groups = k // 128
    words = {
        "qweight": (k // 8, n) if method == "gptq" else (k, n // 8),
        "qzeros": (groups, n // 8),
    }
    tensors = {
        name: torch.randint(-(2**31), 2**31, shape, device="cuda", dtype=torch.int32)
        for name, shape in words.items()
    }
    tensors["scales"] = (torch.rand(groups, n, device="cuda") * 0.01).half()
    return tensors


def timed_us(fn: Callable[[], object]) -> float:
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy of 1 GiB: bytes read plus written per second."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = timed_us(lambda: dst.copy_(src))
    return 2 * (1 << 30) / (us * 1e3)


def int4_fn(x: torch.Tensor, t: dict[str, torch.Tensor], method: str) -> Callable[[], torch.Tensor]:
    offset = 1 if method == "gptq" else 0
    weight = Int4Weight(t["qweight"], t["qzeros"], t["scales"], None, 128, method, offset)
    return lambda: int4_gemm(x, weight)


def w8_weights(k: int, n: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """int8 and fp8 codes of a random weight, with [N] fp32 scales."""
    codes = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8)
    scale = torch.rand(n, device="cuda") * 1e-3
    fp8 = (codes.to(torch.bfloat16) * 3.5).to(torch.float8_e4m3fn)
    return {"int8": (codes, scale), "fp8": (fp8, scale)}


def w8_fn(x: torch.Tensor, fmt: str, weight: tuple[torch.Tensor, torch.Tensor]) -> Callable[[], torch.Tensor]:
    q, scale = weight
    if fmt == "int8":
        return lambda: linear_ops.int8_linear(x, q, scale, None)
    row_scale = scale[None, :].contiguous()
    return lambda: linear_ops.fp8_linear(x, q, row_scale, None)


def sweep() -> list[dict[str, object]]:
    """M = 1 GEMV configs: INT4 (block_n, block_k, programs per SM), 1-byte (block_n, block_k, warps)."""
    rows: list[dict[str, object]] = []
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, k, n in SWEEP_SHAPES:
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        for method in ("gptq", "awq"):
            t = make(k, n, method)
            for block_n, block_k, pps in itertools.product((64, 128, 256), (64, 128), (4, 8)):
                cfg = pick_gemv_config(1, n, k, 128, num_sms, method, block_n, block_k, pps)
                offset = 1 if method == "gptq" else 0
                args = (x, Int4Weight(t["qweight"], t["qzeros"], t["scales"], None, 128, method, offset), None, cfg)
                _sweep_row(rows, name, method, f"{cfg} pps={pps}", k * n // 2, functools.partial(gemv_int4, *args))
        for fmt, (q, scale) in w8_weights(k, n).items():
            for block_n, block_k, warps in itertools.product((2, 4, 8, 16), (512, 1024), (4, 8)):
                fn = functools.partial(gemv_w8, x, q, scale, None, block_n, block_k, warps)
                _sweep_row(rows, name, fmt, f"block_n={block_n} block_k={block_k} warps={warps}", k * n, fn)
        for method in ("gptq", "awq", "int8", "fp8"):
            best = sorted((r for r in rows if r["shape"] == name and r["fmt"] == method), key=lambda r: float(r["us"]))  # type: ignore[arg-type]
            print(f"sweep {name} {method}: best {best[:3]}", flush=True)
    return rows


def _sweep_row(
    rows: list[dict[str, object]], shape: str, fmt: str, config: str, weight_bytes: int, fn: Callable[[], object]
) -> None:
    try:
        us = timed_us(fn)
    except OutOfResources:
        return
    rows.append({"shape": shape, "fmt": fmt, "config": config, "us": round(us, 2),
                 "GBps": round(weight_bytes / (us * 1e3))})


def table(ms: list[int], copy_gbps: float) -> list[dict[str, object]]:
    rows = []
    for name, k, n in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        packed = {method: make(k, n, method) for method in ("gptq", "awq")}
        w8 = w8_weights(k, n)
        for m in ms:
            rows.append(_row(name, k, n, m, w, packed, w8, copy_gbps))
        del w, packed, w8
    return rows


def _row(
    name: str, k: int, n: int, m: int, w: torch.Tensor, packed: dict[str, dict[str, torch.Tensor]],
    w8: dict[str, tuple[torch.Tensor, torch.Tensor]], copy_gbps: float,
) -> dict[str, object]:  # fmt: skip
    """Time (us) and weight GB/s (as a fraction of the copy bandwidth) of each format."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    row: dict[str, object] = {"layer": name, "K": k, "N": n, "M": m}
    fns = {"bf16": (2 * k * n, lambda: F.linear(x, w))}
    fns.update({method: (k * n // 2, int4_fn(x, t, method)) for method, t in packed.items()})
    fns.update({fmt: (k * n, w8_fn(x, fmt, weight)) for fmt, weight in w8.items()})
    for fmt, (weight_bytes, fn) in fns.items():
        us = timed_us(fn)
        row[f"{fmt}_us"] = round(us, 2)
        row[f"{fmt}_of_copy_bw"] = round(weight_bytes / (us * 1e3) / copy_gbps, 2)
    split_k_gemv = m <= SPLIT_K_GEMV_MAX_ROWS
    row["int4_config"] = repr(pick_gemv_config(m, n, k, 128, 132) if split_k_gemv else pick_config(m, n, k))
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--ms", default="1,4,16")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    copy_gbps = copy_bandwidth_gbps()
    print(f"copy bandwidth {copy_gbps:.0f} GB/s", flush=True)
    result = {
        "copy_GBps": round(copy_gbps),
        "sweep": sweep() if args.sweep else [],
        "table": table([int(m) for m in args.ms.split(",")], copy_gbps),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
