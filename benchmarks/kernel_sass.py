"""The batch-1 GEMVs' inner loops in Hopper machine code, without a GPU.

    PYTHONPATH=. python benchmarks/kernel_sass.py [--dump DIR]

Triton compiles for sm_90 on any machine (its wheel carries ptxas and cuobjdump), so the
SASS of a kernel can be read where no H200 is lent. Each kernel is compiled with the
specialization the JIT gives a real launch (pointers 16-byte aligned, sizes and strides
divisible by 16; without it the loads are not vectorised and the code is not the one that
runs). For each variant: the instructions of the main loop (between the backward branch
and its target), the weights one thread handles per iteration, instructions per weight, and
the shared-memory traffic and barriers inside the loop (a reduction across warps). Counts
are static, not timings: a variant that issues fewer instructions still has to be timed on
the H200 (bench_gemv.py) before it becomes a default.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
from typing import Any

import triton
from triton.backends.compiler import GPUTarget

from vllm_cluster.kernels.int4 import mma_ptx, triton_mma_gemv, triton_rows
from vllm_cluster.kernels.linear import triton_gemv, triton_w8_gemv

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
# run-time values a launch does not specialise (1, 2, 3, ...)
NOT_DIVISIBLE = {"split_k", "M", "rms_eps"}
_OP = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)")


def sass(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], num_warps: int = 4) -> str:
    """fn's SASS for sm_90. signature: argument -> Triton type; every non-constexpr argument
    but NOT_DIVISIBLE is taken as divisible by 16, as the JIT specialises a real launch's."""
    sig = dict(signature) | {name: "constexpr" for name in constexprs}
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in signature if a not in NOT_DIVISIBLE}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    path = f"/tmp/kernel_sass_{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run(
            [f"{_BIN}/cuobjdump", "--dump-sass", path], capture_output=True, text=True, check=True
        ).stdout
    finally:
        os.remove(path)


def main_loop(code: str) -> collections.Counter[str]:
    """Opcodes of the longest loop: between a backward branch and its target."""
    lines = code.splitlines()
    index = {int(m.group(1), 16): i for i, line in enumerate(lines) if (m := _OP.match(line))}
    loop = None
    for i, line in enumerate(lines):
        branch = re.search(r"BRA (0x[0-9a-f]+)", line)
        if branch and index.get(int(branch.group(1), 16), i) < i:
            start = index[int(branch.group(1), 16)]
            if loop is None or i - start > loop[1] - loop[0]:
                loop = (start, i)
    assert loop is not None, "no loop found"
    return collections.Counter(m.group(3) for line in lines[loop[0] : loop[1] + 1] if (m := _OP.match(line)))


# The norm halves' arguments (kernels/linear/triton_add_norm.py), after each GEMV's own.
EPILOGUE_SIGNATURE = {
    "residual_ptr": "*bf16", "h_ptr": "*bf16", "norm_weight_ptr": "*bf16", "hg_ptr": "*bf16", "ss_out_ptr": "*fp64",
    "ss_in_ptr": "*fp64", "rms_eps": "fp32",
}  # fmt: skip
W8_SIGNATURE = {
    "x_ptr": "*bf16", "w_ptr": "*u8", "scale_ptr": "*fp32", "bias_ptr": "*fp32", "y_ptr": "*bf16",
    "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32",
} | EPILOGUE_SIGNATURE  # fmt: skip
INT4_SIGNATURE = {
    "x_ptr": "*bf16", "qweight_ptr": "*i32", "qzeros_ptr": "*i32", "scales_ptr": "*bf16", "bias_ptr": "*bf16",
    "ws_ptr": "*fp32", "lock_ptr": "*i32", "y_ptr": "*bf16", "N": "i32", "K": "i32", "stride_qn": "i32",
    "group_size": "i32", "split_k": "i32", "exponent": "i32",
}  # fmt: skip
MMA_SIGNATURE = {
    "x_ptr": "*bf16", "qweight_ptr": "*i32", "qzeros_ptr": "*i32", "scales_ptr": "*bf16", "ws_ptr": "*fp32",
    "lock_ptr": "*i32", "y_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_ym": "i32",
    "stride_qn": "i32", "split_k": "i32",
} | EPILOGUE_SIGNATURE  # fmt: skip
BF16_SIGNATURE = {
    "x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "y_ptr": "*bf16", "N": "i32", "K": "i32",
    "stride_wn": "i32",
} | EPILOGUE_SIGNATURE  # fmt: skip


def variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any], int, int]]:
    """(name, kernel, signature, constexprs, weights per thread per iteration, warps) at the
    shapes decode runs (4 warps unless named): the 1-byte GEMV's 4 x 2048 tile, the bf16 GEMV's 2 x 1024 (with
    SiLU fused: half the outputs, gate and up rows, the same tile)."""
    out = []
    for fmt in ("fp8", "int8"):
        for lane_sums in (False, True):
            for silu in (False, True):
                consts = dict(
                    FP8=fmt == "fp8", HAS_BIAS=False, EVEN_K=True, BLOCK_N=2 if silu else 4, BLOCK_K=2048,
                    INT8_PTX=True, PDL=True, SILU_MUL=silu, LANE_SUMS=lane_sums, LATE_TRIGGER=silu,
                )  # fmt: skip
                name = f"{fmt} GEMV, {'lane' if lane_sums else 'row'} sums{', SiLU fused' if silu else ''}"
                out.append((name, triton_w8_gemv._gemv_w8_kernel, W8_SIGNATURE, consts, 4 * 2048 // 128, 4))
    for silu in (False, True):
        consts = dict(HAS_BIAS=False, EVEN_K=True, BLOCK_N=1 if silu else 2, BLOCK_K=1024, PDL=True, TWO_FIRST=True,
                      SILU_MUL=silu, LATE_TRIGGER=silu)
        name = f"bf16 GEMV{', SiLU fused' if silu else ''}"
        out.append((name, triton_gemv._gemv_kernel, BF16_SIGNATURE, consts, 2 * 1024 // 128, 4))
    for layout in ("rows", "pairs", "pairs, x2 math"):
        for warps in (4, 2):  # pick_rows_config: 64 outputs, 2 blocks per step; 4 warps below K = 8192, else 2
            consts = dict(
                ZERO_OFFSET=1, HAS_BIAS=False, BLOCK_N=64, UNROLL=2, GROUP_J=8 if layout == "rows" else 4, NUM_STAGES=3,
                PDL=True, PAIRS=layout != "rows", PACKED=layout == "pairs, x2 math", FP16=False, SILU_MUL=False,
            )  # fmt: skip
            name = f"INT4 {layout} GEMV, 64 outputs, {warps} warps"
            out.append((name, triton_rows._rows_gemv_kernel, INT4_SIGNATURE, consts, 64 * 256 // (32 * warps), warps))
    # pick_mma_gemv_config's default: 1 tile of 16 rows a warp, 2 blocks a step, 4 warps
    for layout, multi in (("pairs", False), ("tiles", False), ("tiles", True)):
        consts = dict(
            GROUP_BLOCKS=1, ZERO_OFFSET=1, TILES=1, UNROLL=2, WARPS=4, PDL=True, FP16=False, SILU_MUL=False,
            MULTI=multi, ASM=mma_ptx.ASM[False, multi], CONSTRAINTS=mma_ptx.CONSTRAINTS[multi], TILED=layout == "tiles",
            LATE_TRIGGER=True, K_WARPS=1,
        )  # fmt: skip
        name = f"INT4 {layout} MMA GEMV, 64 outputs, 4 warps{', 2-8 rows of x' if multi else ''}"
        out.append((name, triton_mma_gemv._mma_gemv_kernel, MMA_SIGNATURE, consts, 64 * 256 // (32 * 4), 4))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dump", help="also write each variant's SASS into this folder")
    args = parser.parse_args()
    print("| kernel | loop instructions | weights per thread | per weight | per weight byte | STS/LDS | barriers |")
    print("|---|---|---|---|---|---|---|")
    for name, fn, signature, consts, weights, num_warps in variants():
        code = sass(fn, signature, consts, num_warps=num_warps)
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, re.sub(r"\W+", "_", name) + ".sass"), "w") as f:
                f.write(code)
        ops = main_loop(code)  # one weight tile per iteration
        total = sum(ops.values())
        per_weight = total / weights
        byte = 2 if "bf16" in name else 0.5 if "INT4" in name else 1
        shared = ops["STS"] + ops["LDS"]
        bars = sum(n for op, n in ops.items() if op.startswith("BAR"))
        print(
            f"| {name} | {total} | {weights} | {per_weight:.2f} | {per_weight / byte:.2f} | {shared} | {bars} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
