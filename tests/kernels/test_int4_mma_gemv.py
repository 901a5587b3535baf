"""The one-row INT4 GEMV on warp-level MMAs (kernels/int4/triton_mma_gemv.py).

Its PTX mixes lanes (an MMA), so it is right only where Triton places element i of its
operands in lane i % 32: without a GPU, the kernel is compiled for sm_90 (Triton's wheel
carries ptxas) and its operands' layout, the MMAs per step and a loop without shared
memory or barriers are checked, and the PTX text itself runs on a numpy warp
(tests/kernels/ptx_warp.py: the ISA's fragment layouts) over operands addressed as the
kernel addresses them, against the block sums of the dequantized weight. With a GPU: its
values against the GPTQ reference over dtypes, groups, zero offsets, configs, ragged N and
1-8 rows of x, SiLU-and-mul against the two launches, and the decode dispatch taking it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.kernels import ptx_warp
from tests.kernels.test_int4_gemv import gptq_tensors, randn
from vllm_cluster.kernels.elementwise import dispatch as elementwise_ops
from vllm_cluster.kernels.int4 import dispatch as int4_ops
from vllm_cluster.kernels.int4 import reference as int4_reference
from vllm_cluster.kernels.int4 import triton_mma
from vllm_cluster.kernels.int4.layouts import gptq_to_pairs, pairs_to_tiles, unpack_pairs_layout
from vllm_cluster.kernels.int4.mma_ptx import ASM
from vllm_cluster.kernels.int4.triton_mma_gemv import (
    MmaGemvConfig,
    gemv_pairs_mma,
    pick_mma_gemv_config,
    supported,
)
from vllm_cluster.kernels.int4.triton_rows import gemv_rows, pick_rows_config
from vllm_cluster.kernels.int4.weight import Int4Weight

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

_COMPILE = """
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from benchmarks.kernel_sass import main_loop
from vllm_cluster.kernels.int4 import mma_ptx, triton_mma_gemv as m
tiles, unroll, warps, fp16, silu, multi, tiled, k_warps = (int(a) for a in sys.argv[1:9])
dtype = "*fp16" if fp16 else "*bf16"
signature = {
    "x_ptr": dtype, "qweight_ptr": "*i32", "qzeros_ptr": "*i32", "scales_ptr": dtype, "ws_ptr": "*fp32",
    "lock_ptr": "*i32", "y_ptr": dtype, "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_ym": "i32",
    "stride_qn": "i32", "split_k": "i32", "residual_ptr": dtype, "h_ptr": dtype, "norm_weight_ptr": dtype,
    "hg_ptr": dtype, "ss_out_ptr": "*fp64", "ss_in_ptr": "*fp64", "rms_eps": "fp32",
}
constexprs = dict(
    GROUP_BLOCKS=1, ZERO_OFFSET=1, TILES=tiles, UNROLL=unroll, WARPS=warps, PDL=True, FP16=bool(fp16), SILU_MUL=bool(silu),
    MULTI=bool(multi), ASM=mma_ptx.ASM[bool(fp16), bool(multi)], CONSTRAINTS=mma_ptx.CONSTRAINTS[bool(multi)],
    TILED=bool(tiled), LATE_TRIGGER=True, K_WARPS=k_warps,
)
names = list(signature) + list(constexprs)
attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in signature if a not in ("split_k", "M", "rms_eps")}
src = triton.compiler.ASTSource(
    fn=m._mma_gemv_kernel, signature=signature | {n: "constexpr" for n in constexprs}, constexprs=constexprs, attrs=attrs
)
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
ttgir = kernel.asm["ttgir"]
layouts = dict(re.findall(r"^(#\\w+) = (.*)$", ttgir, re.M))
asm = [line for line in ttgir.splitlines() if "tt.elementwise_inline_asm" in line and "mma.sync" in line]
used = sorted({layouts[name] for line in asm for name in re.findall(r"tensor<\\d+x\\w+, (#\\w+)>", line)})
path = "/tmp/mma_gemv_%d.cubin" % id(kernel)
open(path, "wb").write(kernel.asm["cubin"])
import subprocess, os
code = subprocess.run([os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"),
                       "--dump-sass", path], capture_output=True, text=True, check=True).stdout
os.remove(path)
print(json.dumps({"asm_ops": len(asm), "layouts": used, "loop": main_loop(code), "preexit": code.count("PREEXIT")}))
"""  # noqa: E501 (a script's text: wrapping it would change the string)


@pytest.mark.parametrize(
    ("tiles", "unroll", "warps", "fp16", "silu", "multi", "tiled", "k_warps"),
    [
        (1, 2, 4, 0, 0, 0, 0, 1), (2, 1, 2, 1, 0, 0, 0, 1), (1, 1, 8, 0, 1, 0, 0, 1), (1, 2, 4, 0, 0, 1, 0, 1),
        (1, 2, 4, 0, 1, 0, 1, 1), (1, 1, 8, 0, 0, 0, 1, 8), (2, 1, 8, 0, 0, 1, 1, 2), (1, 2, 4, 0, 0, 1, 1, 4),
    ],
    ids=[
        "default", "two-tiles-fp16", "eight-warps-silu", "rows", "tiles-layout-silu", "k-warps", "k-warps-rows",
        "k-warps-rows-default",
    ],
)
def test_sm90_operands_sit_in_their_lanes(
    tiles: int, unroll: int, warps: int, fp16: int, silu: int, multi: int, tiled: int, k_warps: int
) -> None:  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = pathlib.Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", _COMPILE, *(str(a) for a in (tiles, unroll, warps, fp16, silu, multi, tiled, k_warps))],
        env=env, cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["asm_ops"] == 1
    # Every operand of the PTX: element i in lane i % 32 of warp (i // 32) % warps.
    assert result["layouts"] == [
        f"#ttg.blocked<{{sizePerThread = [1], threadsPerWarp = [32], warpsPerCTA = [{warps}], order = [0]}}>"
    ]
    loop = result["loop"]
    kind = "HMMA.16816.F32" if fp16 else "HMMA.16816.F32.BF16"
    # per 16-row tile and block: 8 weight MMAs, and the sums of x: one MMA at one row, 8 for M rows
    assert loop[kind] == (16 if multi else 9) * tiles * unroll
    assert loop.get("SHFL.BFLY", 0) == (0 if multi else 2 * tiles * unroll), loop
    # (k_warps > 1: the tile's warps meet in shared memory after the loop, not in it)
    assert not any(op.startswith(("BAR", "LDS", "STS", "LDGSTS")) for op in loop), loop
    # 16-byte weight loads
    assert loop["LDG.E.128.CONSTANT" if "LDG.E.128.CONSTANT" in loop else "LDG.E.128"] >= 2 * tiles * unroll, loop
    # PDL: the kernel after may launch once, after the weight loop (griddepcontrol.launch_dependents)
    assert result["preexit"] == 1 and "PREEXIT" not in loop, (result["preexit"], loop)


def test_supported_is_up_to_32_16_bit_rows_on_a_gpu_with_groups_of_128() -> None:
    cpu = torch.zeros(1, 256, dtype=torch.bfloat16)
    assert not supported(cpu, 128)  # the CPU takes the reference
    if torch.cuda.is_available():
        x = cpu.cuda()
        assert supported(x, 128) and supported(x, 256) and supported(x.half(), 128)
        assert supported(x.expand(8, 256), 128) and supported(x.expand(32, 256), 128)  # 8 rows a program
        assert not supported(x, 64) and not supported(x.float(), 128) and not supported(x.expand(33, 256), 128)


def test_pick_splits_k_over_a_tiles_warps_then_over_programs() -> None:
    o = pick_mma_gemv_config(4096, 4096, 132)
    # 256 tiles of 16 rows, 8 warps each (2048 warps, about 16 an SM): no split over programs
    assert (o.tiles, o.unroll, o.num_warps, o.k_warps, o.block_n, o.split_k) == (1, 2, 8, 8, 16, 1)
    qkv = pick_mma_gemv_config(6144, 4096, 132)
    assert (qkv.k_warps, qkv.unroll, qkv.split_k) == (8, 1, 1)  # 3072 warps: one block a step
    gate_up = pick_mma_gemv_config(28672, 4096, 132, silu_mul=True)
    assert (gate_up.k_warps, gate_up.num_warps, gate_up.block_n) == (2, 4, 32)  # gate and up: a tile each
    assert pick_mma_gemv_config(4096, 4096, 132, k_warps=1).split_k == 8  # over programs only: 16 * 132 / 256
    assert pick_mma_gemv_config(576, 14336, 132).split_k == 7  # 36 tiles x 8 warps: 2112 / 288, over 14 blocks a warp
    assert pick_mma_gemv_config(4096, 256, 132).k_warps == 2  # 2 blocks: 2 warps a tile at most
    assert pick_mma_gemv_config(128256, 4096, 132).k_warps == 1  # 8016 tiles: K not split at all
    assert pick_mma_gemv_config(4096, 128, 132).split_k == 1  # one block: nothing to split
    assert pick_mma_gemv_config(4096, 384, 132, k_warps=1).unroll == 1  # 3 blocks: 2 does not divide them
    assert pick_mma_gemv_config(128256, 4096, 132).unroll == 1  # lm_head's 8016 warps: one block a step
    assert pick_mma_gemv_config(128256, 4096, 132, unroll=2).unroll == 2  # asked for
    rows = pick_mma_gemv_config(4096, 4096, 132, rows=2)
    assert (rows.k_warps, rows.num_warps, rows.unroll, rows.split_k) == (4, 4, 2, 2)  # 2-8 rows: 4 warps a tile


# --- On a GPU


def reference(x: torch.Tensor, t: dict[str, torch.Tensor], group_size: int, zero_offset: int) -> torch.Tensor:
    weight = Int4Weight(t["qweight"], t["qzeros"], t["scales"], None, group_size, "gptq", zero_offset)
    return int4_reference.int4_gemm(x.float(), weight)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected).norm() / expected.norm())


# Products and sums are fp32 in the MMA: the error is the output's rounding (bf16 2^-9, fp16
# 2^-12 relative, about half that as a norm) and the fp32 sums' order.
BOUNDS = {torch.bfloat16: 3e-3, torch.float16: 4e-4}


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("group_size", "zero_offset"), [(128, 1), (256, 0), (-1, 1)], ids=["g128", "g256-awq", "one"])
@pytest.mark.parametrize(
    "config",
    [
        None, MmaGemvConfig(1, 1, 3, 2), MmaGemvConfig(2, 2, 1, 4), MmaGemvConfig(1, 4, 2, 8),
        MmaGemvConfig(1, 1, 1, 4, 1), MmaGemvConfig(2, 1, 3, 8, 2),
    ],
    ids=["default", "split3", "two-tiles", "eight-warps", "k-over-programs-only", "two-k-warps-split3"],
)
def test_cuda_against_the_reference(
    dtype: torch.dtype, group_size: int, zero_offset: int, config: MmaGemvConfig | None
) -> None:  # fmt: skip
    k, n = 1024, 336  # 336 rows: a ragged last program for every config
    t = gptq_tensors(k, n, group_size, zero_offset)
    t["scales"] = t["scales"].to(dtype)
    x = randn(1, k, dtype=dtype, seed=3)
    config = config or pick_mma_gemv_config(n, k, 132)
    weight = Int4Weight(gptq_to_pairs(t["qweight"]), t["qzeros"], t["scales"], None, group_size, "pairs", zero_offset)
    y = gemv_pairs_mma(x, weight, config)
    assert y.shape == (1, n) and y.dtype == dtype
    assert relative_error(y, reference(x, t, group_size, zero_offset)) < BOUNDS[dtype]


@cuda_only
@pytest.mark.parametrize(("k", "n"), [(4096, 6144), (4096, 4096), (14336, 4096)], ids=["qkv", "o", "down"])
def test_cuda_llama_8b_shapes_halve_the_x2_error(k: int, n: int) -> None:
    t = gptq_tensors(k, n, 128, 1)
    t["scales"] = t["scales"].bfloat16()
    x = randn(1, k, dtype=torch.bfloat16, seed=5)
    pairs = gptq_to_pairs(t["qweight"])
    weight = Int4Weight(pairs, t["qzeros"], t["scales"], None, 128, "pairs", 1)
    y = gemv_pairs_mma(x, weight, pick_mma_gemv_config(n, k, 132))
    x2 = gemv_rows(x, weight, None, pick_rows_config(n, k, 132, packed=True))
    expected = reference(x, t, 128, 1)
    # Only the output rounds here; the x2 GEMV rounds products and four-term sums to bf16 too.
    assert relative_error(y, expected) < min(BOUNDS[torch.bfloat16], 0.75 * relative_error(x2, expected))


@cuda_only
@pytest.mark.parametrize(
    "config",
    [None, MmaGemvConfig(1, 1, 5, 8), MmaGemvConfig(1, 2, 1, 8, 8)],
    ids=["default", "eight-warps-split5", "eight-k-warps"],
)
def test_cuda_silu_mul_equals_the_two_launches(config: MmaGemvConfig | None) -> None:
    k, n = 2048, 2 * 1040  # 1040 outputs: not a whole number of programs
    t = gptq_tensors(k, n, 128, 1)
    x = randn(1, k, dtype=torch.bfloat16, seed=7)
    config = config or pick_mma_gemv_config(n, k, 132)
    weight = Int4Weight(gptq_to_pairs(t["qweight"]), t["qzeros"], t["scales"], None, 128, "pairs", 1)
    fused = gemv_pairs_mma(x, weight, config, silu_mul=True)
    assert fused.shape == (1, n // 2)
    torch.testing.assert_close(fused, elementwise_ops.silu_and_mul(gemv_pairs_mma(x, weight, config)), atol=0, rtol=0)


@cuda_only
def test_cuda_decode_dispatch_takes_it_and_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    k, n = 1024, 512
    t = gptq_tensors(k, n, 128, 1)
    x = randn(1, k, dtype=torch.bfloat16, seed=8)
    weight = Int4Weight(gptq_to_pairs(t["qweight"]), t["qzeros"], t["scales"], None, 128, "pairs", 1)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    direct = gemv_pairs_mma(x, weight, pick_mma_gemv_config(n, k, num_sms))
    assert torch.equal(int4_ops.int4_gemm(x, weight), direct)
    monkeypatch.setattr(triton_mma, "MMA_GEMV_MAX_ROWS", 0)
    x2 = int4_ops.int4_gemm(x, weight)  # the x2 CUDA-core GEMV: another rounding, the same product
    assert not torch.equal(x2, direct)
    assert relative_error(x2, reference(x, t, 128, 1)) < 5e-3


@cuda_only
@pytest.mark.parametrize("m", [2, 3, 8, 9, 16, 27, 32])  # past 8: programs of 8 rows, the last ragged
@pytest.mark.parametrize(
    "config",
    [None, MmaGemvConfig(1, 1, 3, 2), MmaGemvConfig(2, 1, 2, 8, 4)],
    ids=["default", "split3", "four-k-warps-split2"],
)
def test_cuda_rows_of_x_are_the_mma_columns(m: int, config: MmaGemvConfig | None) -> None:
    k, n = 1024, 336
    t = gptq_tensors(k, n, 128, 1)
    x = randn(m, k, dtype=torch.bfloat16, seed=m)
    config = config or pick_mma_gemv_config(n, k, 132, rows=m)
    weight = Int4Weight(gptq_to_pairs(t["qweight"]), t["qzeros"], t["scales"], None, 128, "pairs", 1)
    y = gemv_pairs_mma(x, weight, config)
    assert y.shape == (m, n)
    expected = reference(x, t, 128, 1)
    for row in range(m):  # each row as good as alone: its own column of the MMA
        assert relative_error(y[row : row + 1], expected[row : row + 1]) < BOUNDS[torch.bfloat16], row


@cuda_only
@pytest.mark.parametrize(("m", "silu_mul"), [(1, False), (1, True), (3, False), (8, False)])
@pytest.mark.parametrize(
    "config",
    [None, MmaGemvConfig(1, 1, 3, 2), MmaGemvConfig(2, 2, 1, 4), MmaGemvConfig(1, 1, 1, 4, 1)],
    ids=["default", "split3", "two-tiles", "k-over-programs-only"],
)
def test_cuda_tiles_layout_equals_pairs_bit_for_bit(m: int, silu_mul: bool, config: MmaGemvConfig | None) -> None:
    # The same words through the same MMAs in the same order: only the addresses differ.
    k, n = 1024, 2 * 336
    t = gptq_tensors(k, n, 128, 1)
    x = randn(m, k, dtype=torch.bfloat16, seed=12)
    config = config or pick_mma_gemv_config(n, k, 132, silu_mul=silu_mul)
    pairs = gptq_to_pairs(t["qweight"])
    weight = Int4Weight(pairs, t["qzeros"], t["scales"], None, 128, "pairs", 1)
    tiles = Int4Weight(pairs_to_tiles(pairs), t["qzeros"], t["scales"], None, 128, "tiles", 1)
    y = gemv_pairs_mma(x, weight, config, silu_mul)
    tiled = gemv_pairs_mma(x, tiles, config, silu_mul)
    assert torch.equal(tiled, y)
    via_dispatch = int4_ops.int4_gemm(x, tiles, silu_mul)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    dispatch_config = pick_mma_gemv_config(n, k, num_sms, silu_mul=silu_mul, rows=m)
    assert torch.equal(via_dispatch, gemv_pairs_mma(x, weight, dispatch_config, silu_mul))
    with pytest.raises(AssertionError, match="tiles layout"):
        gemv_pairs_mma(x, dataclasses.replace(weight, layout="tiles"), config)


@cuda_only
def test_cuda_decode_dispatch_takes_up_to_24_rows() -> None:
    k, n = 1024, 512
    t = gptq_tensors(k, n, 128, 1)
    weight = Int4Weight(gptq_to_pairs(t["qweight"]), t["qzeros"], t["scales"], None, 128, "pairs", 1)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert triton_mma.MMA_GEMV_MAX_ROWS == 24
    for m in (4, 8, 9, 24):
        x = randn(m, k, dtype=torch.bfloat16, seed=m)
        direct = gemv_pairs_mma(x, weight, pick_mma_gemv_config(n, k, num_sms, rows=m))
        assert torch.equal(int4_ops.int4_gemm(x, weight), direct)
    x = randn(25, k, dtype=torch.bfloat16, seed=9)  # 25 rows: the tl.dot kernel
    assert relative_error(int4_ops.int4_gemm(x, weight), reference(x, t, 128, 1)) < 5e-3


@cuda_only
def test_cuda_graph_replays_it() -> None:
    k, n = 2048, 1024
    t = gptq_tensors(k, n, 128, 1)
    x = randn(1, k, dtype=torch.bfloat16, seed=9)
    weight = Int4Weight(gptq_to_pairs(t["qweight"]), t["qzeros"], t["scales"], None, 128, "pairs", 1)
    args = (weight, pick_mma_gemv_config(n, k, 132))
    gemv_pairs_mma(x, *args)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv_pairs_mma(x, *args)
    for seed in (10, 11):
        x.copy_(randn(1, k, dtype=torch.bfloat16, seed=seed))
        graph.replay()
        torch.testing.assert_close(y, gemv_pairs_mma(x, *args), atol=0, rtol=0)


# --- The PTX itself, on a numpy warp (tests/kernels/ptx_warp.py): any machine


def warp_block(t: dict[str, torch.Tensor], x: torch.Tensor, tile: int, block: int, zero_offset: int, multi: bool):
    """The kernel's operands for one 16-row tile and one block of 128 inputs, lane by lane
    (as _mma_gemv_kernel addresses them), run through the PTX; -> (outputs, expected)."""
    fp16 = x.dtype == torch.float16
    lanes = np.arange(32)
    g, lane_t = lanes // 4, lanes % 4
    words = gptq_to_pairs(t["qweight"]).numpy().view(np.uint32)
    q = unpack_pairs_layout(gptq_to_pairs(t["qweight"])).double().numpy()  # [K, N]
    qzeros = t["qzeros"].numpy().view(np.uint32)
    scales = t["scales"].float().numpy()
    x_pairs = x.contiguous().view(torch.int32).numpy().view(np.uint32)  # [M, K / 2]
    group = block  # groups of 128
    inputs, expected = [], []
    rows = (tile * 16 + g, tile * 16 + g + 8)
    for row in rows:
        inputs += [words[row, block * 16 + 4 * lane_t + c] for c in range(4)]
    zeros = [((qzeros[group, row // 8] >> ((row % 8) * 4)) & 0xF) + zero_offset for row in rows]
    inputs += [(-((1024.0 if fp16 else 128.0) + z)).astype(np.float32).view(np.uint32) for z in zeros]
    x_row = np.minimum(g, x.shape[0] - 1) if multi else np.zeros_like(g)
    inputs += [x_pairs[x_row, block * 64 + 16 * p + 4 * lane_t + c] for p in range(4) for c in range(4)]
    if not multi:  # the lane's share of the block sum
        inputs += [x_pairs[0, block * 64 + 16 * (g // 2) + 4 * lane_t + 2 * (g % 2) + c] for c in range(2)]
    inputs += [scales[group, row].astype(np.float32).view(np.uint32) for row in rows]
    outs = [(row, x_col) for row in rows for x_col in ((2 * lane_t, 2 * lane_t + 1) if multi else (x_row,))]
    inputs += [np.zeros(32, dtype=np.uint32) for _ in outs]
    k = slice(block * 128, (block + 1) * 128)
    xs = x.double().numpy()
    for (row, x_col), zero in zip(outs, [z for z in zeros for _ in range(len(outs) // 2)], strict=True):
        dots = ((q[k][:, row] - zero[None, :]) * xs[np.minimum(x_col, x.shape[0] - 1)][:, k].T).sum(axis=0)
        expected.append(scales[group, row] * dots)
    result = ptx_warp.run(ASM[fp16, multi], inputs, len(outs))
    return [bits.view(np.float32).astype(np.float64) for bits in result], expected, outs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8], ids=["one-row", "rows3", "rows8"])
def test_ptx_on_a_numpy_warp_computes_the_block_sums(dtype: torch.dtype, m: int) -> None:
    t = gptq_tensors(256, 48, 128, 1, seed=4)
    t = {name: v.cpu() for name, v in t.items()}
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(dtype)
    offset = 1024 if dtype == torch.float16 else 128
    for tile, block in ((0, 0), (2, 1)):
        actual, expected, outs = warp_block(t, x, tile, block, 1, multi=m > 1)
        # fp32 sums of (OFFSET + q) x, less (OFFSET + zero) sum x: a few fp32 roundings of
        # numbers up to (OFFSET + 15) sum |x| (fp16's 1024 costs 8x bf16's 128 here).
        bound = 2.0**-20 * (offset + 15) * float(x.double().abs()[:, block * 128 : (block + 1) * 128].sum(1).max())
        bound *= float(t["scales"].abs().max())
        for (_, x_col), a, e in zip(outs, actual, expected, strict=True):
            stored = np.asarray(x_col) < m  # x's rows past M: computed, never stored
            np.testing.assert_allclose(a[stored], e[stored], rtol=0, atol=bound)
