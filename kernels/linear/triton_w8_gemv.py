"""Weight-only GEMV for decode: y [M, N] = (x [M, K] @ w [N, K].T) * scale[N] + bias, for
a few rows of x (M <= GEMV_MAX_ROWS) and 1-byte weights: int8 (INT8 weight-only) or fp8 e4m3
(FP8 at decode: w8a16, the activations stay in x's dtype, not quantized).

At batch 1 a linear does two flops per weight byte, so it is bound by how fast the weight
streams in. Each program reads BLOCK_N whole rows of w in [BLOCK_N, BLOCK_K] tiles (16-byte
loads along K, marked evict-first: each byte is read once) and sums each tile into BLOCK_N
fp32 partial sums as it goes, so it holds few registers and many programs fit on an SM.
x is addressed per weight row with stride 0: it loads straight into the weight tile's
layout, from L1, with no shuffle through shared memory and no barrier per tile. No split-K
(it was slower on every llama shape): one launch writes y in x's dtype. Rows of x are
programs of their own: the second row's weight tiles come from L2, not memory.

Per weight the loop issues a conversion, a widening to fp32 and an fma: fp8 pairs go
through cvt.rn.f16x2.e4m3x2; int8 quads through PTX below (a byte permute under the fp16
exponent of 1024 and one f16x2 subtract per pair), not I2F, which Hopper issues at 1/8 of
the fp32 rate. Both formats arrive as their uint8 bits (masked fp8 loads with `other`
misbehave in the Triton interpreter, which also runs no inline PTX: there int8 converts
through the fp32 float trick). No host sync: graph-capturable. Timings and the sweep that
chose the blocks: docs/benchmarks.md ("Quantization on one H200").
Definition: `kernels/linear/dispatch.int8_linear_reference` / `fp8_weight_only_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from vllm_cluster.kernels.linear.add_norm import AddNorm, Normed
from vllm_cluster.kernels.linear.triton_add_norm import (
    launch_args,
    load_residual,
    load_sum_of_squares,
    rms_scale,
    store_add_norm,
)
from vllm_cluster.kernels.linear.triton_gemv import store_outputs, weight_rows
from vllm_cluster.kernels.sync import pdl

GEMV_MAX_ROWS = 4
# Row sums per tile (False) reduce each [BN, BK] tile across the program's warps through
# shared memory, with barriers, every iteration: 277 SASS instructions per 64 weights per
# thread in the fp8 loop. Per-thread partial sums kept across tiles (True) make it 219 with
# no barrier in the loop (benchmarks/kernel_sass.py, compiled for sm_90 without a GPU), and
# the llama-3.1-8b batch-1 step 34 us faster on fp8, 53 on int8 (docs/benchmarks.md).
LANE_SUMS = True
# Weight rows a program reads (pick_blocks; half with SiLU-and-mul, gate and up rows). In
# the fp8 batch-1 step on the H200: 2 rows 2.437 ms, 4 rows 2.389, 8 rows 2.533 (one call;
# benchmarks/bench_quant_gpu.py).
TILE_N = 4
# Measurement switches (benchmarks/bench_gemv.py's sweep): inputs a tile spans at most, and warps a program.
MAX_BLOCK_K = 2048
NUM_WARPS = 4


@triton.jit
def _int8_to_float_ptx(bits):
    """Four int8 weights (their uint8 bits) at a time -> fp32, through fp16 pairs: (b ^ 0x80)
    under the fp16 exponent byte 0x64 is 1024 + q + 128, minus 1152 in one f16x2 subtract."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t, lo, hi, c;
        .reg .b16 h0, h1, h2, h3;
        xor.b32 t, $4, 0x80808080;
        mov.b32 c, 0x64806480;
        prmt.b32 lo, t, 0x64646464, 0x7170;
        prmt.b32 hi, t, 0x64646464, 0x7372;
        sub.f16x2 lo, lo, c;
        sub.f16x2 hi, hi, c;
        mov.b32 {h0, h1}, lo;
        mov.b32 {h2, h3}, hi;
        cvt.f32.f16 $0, h0;
        cvt.f32.f16 $1, h1;
        cvt.f32.f16 $2, h2;
        cvt.f32.f16 $3, h3;
        }""",
        "=r,=r,=r,=r,r", [bits], dtype=tl.float32, is_pure=True, pack=4,
    )  # fmt: skip


@triton.jit
def w8_to_float(bits, FP8: tl.constexpr, INT8_PTX: tl.constexpr = False):
    """uint8 bits of int8 or fp8 e4m3 weights -> their fp32 values."""
    if FP8:
        return bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if INT8_PTX:
        return _int8_to_float_ptx(bits)
    # int8 q has bits b; (b ^ 0x80) = q + 128 in 0..255, and 0x4B000000 | (q + 128) is the
    # fp32 2^23 + q + 128: exact, two integer ops and one add.
    magic = (bits.to(tl.int32) ^ 0x80) | 0x4B000000
    return magic.to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _load_k(rows, k0, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr):
    """rows: [BLOCK_N, 1] pointers -> the [BLOCK_N, BLOCK_K] tile at k0 (0 past K)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)[None, :]
    if EVEN_K:
        return tl.load(rows + offs_k, eviction_policy=EVICT)
    return tl.load(rows + offs_k, mask=offs_k < K, other=0, eviction_policy=EVICT)


@triton.jit
def _tile_sum(
    bits, x_row, k0, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr, INT8_PTX: tl.constexpr,
    LANE_SUMS: tl.constexpr,
):  # fmt: skip
    """Sums of x * w over one [BN, BK] weight tile (its uint8 bits) at k0: [BN] fp32 row sums,
    or with LANE_SUMS [BN, BK / 16] sums of runs of 16 along K (each within one thread, so no
    reduction across threads until the kernel's end)."""
    x = _load_k(x_row, k0, K, EVEN_K, BLOCK_K, "")  # [BN, BK], the same x in every row
    prod = x.to(tl.float32) * w8_to_float(bits, FP8, INT8_PTX)
    if LANE_SUMS:
        sums = tl.sum(tl.reshape(prod, (prod.shape[0], BLOCK_K // 16, 16)), axis=2)
    else:
        sums = tl.sum(prod, axis=1)
    return sums


@triton.jit
def _gemv_w8_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_ym, residual_ptr, h_ptr,
    norm_weight_ptr, hg_ptr, ss_out_ptr, ss_in_ptr, rms_eps,
    FP8: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, INT8_PTX: tl.constexpr, PDL: tl.constexpr, SILU_MUL: tl.constexpr,
    LANE_SUMS: tl.constexpr, LATE_TRIGGER: tl.constexpr = False, ADD_NORM: tl.constexpr = False,
    RMS: tl.constexpr = False,
):  # fmt: skip
    """SILU_MUL: w is [gate | up] ([2N, K]); the program sums gate rows n and up rows N + n
    and writes silu(gate) * up ([M, N]). LANE_SUMS: keep per-thread partial sums across tiles
    and reduce across threads once, at the end (the module's LANE_SUMS says why). ADD_NORM and
    RMS (one row): the two halves of the norm between GEMVs (kernels/linear/triton_add_norm.py)."""
    if PDL and not SILU_MUL:  # the norm or rotary after it may launch (kernels/sync/pdl.py)
        gdc_launch_dependents()
    row = tl.program_id(0)
    w_idx, mask_w = weight_rows(tl.program_id(1), N, BLOCK_N, SILU_MUL)
    w_rows = w_ptr + w_idx.to(tl.int64)[:, None] * stride_wn  # [R, 1]; past N: row 0
    x_row = x_ptr + row * stride_xm + 0 * w_idx[:, None]  # [R, 1]: x in the weight tile's layout
    bits = _load_k(w_rows, 0, K, EVEN_K, BLOCK_K, "evict_first")  # [R, BK]
    if PDL:
        gdc_wait()  # the first tile is in flight; x is the kernel before's output (kernels/sync/pdl.py)
    residual = load_residual(residual_ptr, w_idx, mask_w, ADD_NORM)
    ss = load_sum_of_squares(ss_in_ptr, RMS)
    acc = _tile_sum(bits, x_row, 0, K, EVEN_K, BLOCK_K, FP8, INT8_PTX, LANE_SUMS)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        bits = _load_k(w_rows, k0, K, EVEN_K, BLOCK_K, "evict_first")
        acc += _tile_sum(bits, x_row, k0, K, EVEN_K, BLOCK_K, FP8, INT8_PTX, LANE_SUMS)
    if PDL and LATE_TRIGGER:  # pdl.SILU_MUL_LATE_TRIGGER
        gdc_launch_dependents()
    if LANE_SUMS:
        acc = tl.sum(acc, axis=1)
    y = rms_scale(acc * tl.load(scale_ptr + w_idx, mask=mask_w, other=0.0), ss, K, rms_eps, RMS)
    if HAS_BIAS:
        y += tl.load(bias_ptr + w_idx, mask=mask_w, other=0.0).to(tl.float32)
    if ADD_NORM:
        store_add_norm(y, residual, w_idx, mask_w, h_ptr, norm_weight_ptr, hg_ptr, ss_out_ptr)
    else:
        store_outputs(y, y_ptr + row * stride_ym, tl.program_id(1), N, BLOCK_N, SILU_MUL)


def pick_blocks(n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): the best of a sweep on llama-3.1-8b's four shapes on the H200 in
    CUDA-graph timing (docs/benchmarks.md), 4 x 2048 for each; K under 2048 takes one tile."""
    return TILE_N, min(MAX_BLOCK_K, triton.next_power_of_2(k))


def gemv_w8_add_norm(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, add_norm: AddNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gemv_w8` of one row, then the first half of the norm after it (kernels/linear/triton_add_norm.py):
    (hg, h)."""
    _, outputs = _gemv_w8(x, qweight, scale, bias, add_norm=add_norm)
    assert outputs is not None
    return outputs


def gemv_w8(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    silu_mul: bool = False,
    lane_sums: bool | None = None,
    rms: Normed | None = None,
) -> torch.Tensor:
    """x: [M, K] (fp16/bf16/fp32, M <= GEMV_MAX_ROWS); qweight: [N, K] int8 or
    float8_e4m3fn; scale: N fp32 values ([N] or [1, N]); bias: [N] | None -> [M, N] in x's dtype.
    silu_mul: the weight is [gate | up] and the result silu(gate) * up, [M, N / 2], as
    `silu_and_mul` of the plain result (the same roundings; the fp32 sums may be added in
    another order). rms: x is rms.hg (one row), whose norm this GEMV finishes
    (kernels/linear/triton_add_norm.py)."""
    return _gemv_w8(x, qweight, scale, bias, block_n, block_k, num_warps, silu_mul, lane_sums, rms=rms)[0]


def _gemv_w8(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    silu_mul: bool = False,
    lane_sums: bool | None = None,
    add_norm: AddNorm | None = None,
    rms: Normed | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """gemv_w8 -> (y, None), or with add_norm (y unwritten, (hg, h))."""
    assert x.dim() == 2 and qweight.dim() == 2 and x.shape[1] == qweight.shape[1], (x.shape, qweight.shape)
    assert qweight.dtype in (torch.int8, torch.float8_e4m3fn), qweight.dtype
    assert scale.dtype == torch.float32 and scale.numel() == qweight.shape[0] and scale.is_contiguous()
    assert qweight.stride(1) == 1, "qweight must be [N, K] with contiguous rows"
    x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[0]
    assert m <= GEMV_MAX_ROWS, f"{m} rows: the GEMV is for decode (at most {GEMV_MAX_ROWS})"
    if silu_mul:
        assert n % 2 == 0, f"{n} rows are not [gate | up]"
        n //= 2
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    default_n, default_k = pick_blocks(n, k)
    # silu_mul: a program reads gate and up rows, so half as many outputs for the same tile.
    block_n = block_n or (default_n // 2 if silu_mul else default_n)
    block_k = min(block_k or default_k, triton.next_power_of_2(k))
    grid = (m, triton.cdiv(n, block_n))
    assert not (silu_mul and add_norm), "SiLU-and-mul has no add + norm epilogue"
    epilogue, outputs = launch_args(add_norm, rms, x, y)
    use_pdl = pdl.enabled(x)
    _gemv_w8_kernel[grid](
        x, qweight.view(torch.uint8), scale, bias if bias is not None else scale, y,
        n, k, x.stride(0), qweight.stride(0), y.stride(0),
        FP8=qweight.dtype == torch.float8_e4m3fn, HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0,
        BLOCK_N=block_n, BLOCK_K=block_k, INT8_PTX=x.is_cuda, PDL=use_pdl, SILU_MUL=silu_mul,
        LANE_SUMS=(LANE_SUMS if lane_sums is None else lane_sums) and block_k >= 16,
        LATE_TRIGGER=silu_mul and pdl.SILU_MUL_LATE_TRIGGER,
        num_warps=num_warps or NUM_WARPS, launch_pdl=use_pdl, **epilogue,
    )  # fmt: skip
    return y, outputs
