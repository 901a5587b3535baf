"""INT4 (GPTQ / AWQ) dequantize-GEMM against a bf16 torch matmul of the same shape, in one
run, on Llama-3.1-8B's linear shapes. Each timing is triton.testing.do_bench's median,
which flushes the L2 cache before every call (a 4096x14336 INT4 weight, 29 MB, would
otherwise sit in the H200's 50 MB L2). `--sweep` first tries decode configs on two shapes.

    PYTHONPATH=. python benchmarks/bench_int4_gemm.py [--sweep] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

from kernels.triton_int4_gemm import Int4GemmConfig, int4_gemm, pick_config

# (name, K in, N out) of Llama-3.1-8B's layers, and the 4096 x 14336 of the brief.
SHAPES = [
    ("qkv", 4096, 6144),
    ("o", 4096, 4096),
    ("up 4096x14336", 4096, 14336),
    ("gate_up", 4096, 28672),
    ("down", 14336, 4096),
]


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


def bench_int4(
    x: torch.Tensor, t: dict[str, torch.Tensor], method: str, config: Int4GemmConfig | None
) -> float:
    offset = 1 if method == "gptq" else 0

    def run() -> torch.Tensor:
        return int4_gemm(
            x, t["qweight"], t["qzeros"], t["scales"], None, 128, method, offset, config=config
        )

    return float(do_bench(run, warmup=25, rep=100, return_mode="median")) * 1e3  # us


def sweep() -> list[dict[str, object]]:
    rows = []
    for name, k, n in (SHAPES[2], SHAPES[4]):
        t = make(k, n, "gptq")
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        for block_n, block_k, split_k in itertools.product((64, 128), (128, 256), (2, 4, 8)):
            cfg = Int4GemmConfig(1, block_n, block_k, split_k, gemv=True)
            try:
                us = round(bench_int4(x, t, "gptq", cfg), 2)
            except OutOfResources:
                continue
            rows.append({"shape": name, "config": repr(cfg), "us": us})
        best = sorted((r for r in rows if r["shape"] == name), key=lambda r: float(r["us"]))[:6]  # type: ignore[arg-type]
        print(f"sweep {name}: best {best}", flush=True)
    return rows


def table(ms: list[int]) -> list[dict[str, object]]:
    rows = []
    for name, k, n in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        packed = {method: make(k, n, method) for method in ("gptq", "awq")}
        for m in ms:
            rows.append(_row(name, k, n, m, w, packed))
        del w, packed
    return rows


def _row(
    name: str, k: int, n: int, m: int, w: torch.Tensor, packed: dict[str, dict[str, torch.Tensor]]
) -> dict[str, object]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bf16_us = (
        float(do_bench(lambda: F.linear(x, w), warmup=25, rep=100, return_mode="median")) * 1e3
    )
    row: dict[str, object] = {"layer": name, "K": k, "N": n, "M": m, "bf16_us": round(bf16_us, 2)}
    for method, t in packed.items():
        us = bench_int4(x, t, method, None)
        row[f"{method}_us"] = round(us, 2)
        row[f"{method}_speedup"] = round(bf16_us / us, 2)
    row["config"] = repr(pick_config(m, n, k))
    weight_bytes = k * n // 2
    row["gptq_GBps"] = round(weight_bytes / (float(row["gptq_us"]) * 1e3), 0)  # type: ignore[arg-type]
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--ms", default="1,4,16,512")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    result = {
        "sweep": sweep() if args.sweep else [],
        "table": table([int(m) for m in args.ms.split(",")]),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
