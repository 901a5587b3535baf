"""The inline PTX of the FP8 MMA GEMV (kernels/triton_fp8_mma_gemv.py, whose docstring gives
the fragment mapping): one lane's work on `tiles` 16-row tiles over a block of 128 inputs,
as assembly text (`ASM[tiles]`, `CONSTRAINTS[tiles]`) and as the Triton call that feeds it
its registers (`mma_block`). tests/kernels/ptx_warp.py runs the same text on a numpy warp.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.int4_mma_ptx import split4

# 16-row tiles one asm call takes (their rows share the block's converted x)
ASM_TILES = (1, 2)


def _block_asm(tiles: int) -> str:
    """PTX for one lane of `tiles` 16-row tiles over a block of 128 inputs. Operands: the
    new accumulators (rows g and g + 8 of each tile), then inputs from $O (O = 2 tiles): per
    tile 8 words of row g and 8 of row g + 8 (the lane's 32 weights of each, inputs 32t ..
    32t + 31 of the block), x's 16 bf16 pairs at 32t .. 32t + 31, rstd (fp32), the
    accumulators.

    x is normalised (x * rstd in fp32) and rounded to fp16 once, for all the tiles. MMA m
    (0..7) takes word m of each row: its low two weights (inputs 32t + 4m, + 1) are A's
    k-slots 2t, 2t + 1 (a0 row g, a1 row g + 8), its high two (32t + 4m + 2, + 3) slots
    2t + 8, 2t + 9 (a2, a3), each pair one exact cvt.rn.f16x2.e4m3x2; B's b0 and b1 are x's
    pairs 2m and 2m + 1, the same in all 8 columns. The accumulators are the first MMA's C
    (columns 2t: d0 for row g, d2 for g + 8; the odd columns are the same sums, unread)."""
    o = 2 * tiles
    words, xs = o, o + 16 * tiles
    rstd = xs + 16
    accs = rstd + 1
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
    lines = [
        "{ .reg .b32 x<16>, a<4>, lo, hi; .reg .b16 l<2>, h<2>; .reg .f32 d<4>, z; mov.f32 z, 0f00000000;"
    ]
    for c in range(16):  # bf16 pair -> two fp32 (the high half in place), times rstd, -> an fp16 pair
        lines.append(
            f"shl.b32 lo, ${xs + c}, 16; and.b32 hi, ${xs + c}, 0xFFFF0000; mul.rn.f32 lo, lo, ${rstd}; "
            f"mul.rn.f32 hi, hi, ${rstd}; cvt.rn.f16x2.f32 x{c}, hi, lo;"
        )
    for tile in range(tiles):
        row_g, row_g8 = words + 16 * tile, words + 16 * tile + 8
        for m in range(8):
            lines.append(f"mov.b32 {{l0, h0}}, ${row_g + m}; mov.b32 {{l1, h1}}, ${row_g8 + m};")
            for reg, half in enumerate(("l0", "l1", "h0", "h1")):
                lines.append(f"cvt.rn.f16x2.e4m3x2 a{reg}, {half};")
            c = f"{{${accs + 2 * tile}, z, ${accs + 2 * tile + 1}, z}}" if m == 0 else "{d0, d1, d2, d3}"
            lines.append(f"{mma} {{d0, d1, d2, d3}}, {{a0, a1, a2, a3}}, {{x{2 * m}, x{2 * m + 1}}}, {c};")
        lines.append(f"mov.f32 ${2 * tile}, d0; mov.f32 ${2 * tile + 1}, d2;")
    lines.append("}")
    return " ".join(lines)


ASM = {tiles: _block_asm(tiles) for tiles in ASM_TILES}
CONSTRAINTS = {
    tiles: ",".join(["=f"] * (2 * tiles) + ["r"] * (16 * tiles + 16) + ["f"] * (1 + 2 * tiles)) for tiles in ASM_TILES
}


@triton.jit
def _split8(v):
    """[T, 4, 2] (column 4e + c at [c, e]: two [T, 4] loads joined) -> its 8 columns, [T] each."""
    first, second = tl.split(v)
    c0, c1, c2, c3 = split4(first)
    c4, c5, c6, c7 = split4(second)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def mma_block(w_lo, w_hi, w2_lo, w2_hi, x_lo, x_hi, rstd, acc0, acc1, acc2, acc3, ASM: tl.constexpr,
              CONSTRAINTS: tl.constexpr, ASM_TILES: tl.constexpr):  # fmt: skip
    """One block of 128 inputs into the accumulators ([T] each: rows g, g + 8 of the first
    tile, and with ASM_TILES 2 of the second). w_lo, w_hi: [T, 4, 2] int32 (_split8), the
    lane's 8 words of rows g and g + 8 (w2_*: of the second tile; unread with one); x_lo,
    x_hi: [T, 4, 2], x's pairs 0..7 and 8..15 at 32t; rstd: [T] fp32."""
    g0, g1, g2, g3, g4, g5, g6, g7 = _split8(w_lo)
    h0, h1, h2, h3, h4, h5, h6, h7 = _split8(w_hi)
    x0, x1, x2, x3, x4, x5, x6, x7 = _split8(x_lo)
    x8, x9, x10, x11, x12, x13, x14, x15 = _split8(x_hi)
    if ASM_TILES == 2:
        p0, p1, p2, p3, p4, p5, p6, p7 = _split8(w2_lo)
        q0, q1, q2, q3, q4, q5, q6, q7 = _split8(w2_hi)
        acc0, acc1, acc2, acc3 = tl.inline_asm_elementwise(
            ASM, CONSTRAINTS,
            [g0, g1, g2, g3, g4, g5, g6, g7, h0, h1, h2, h3, h4, h5, h6, h7,
             p0, p1, p2, p3, p4, p5, p6, p7, q0, q1, q2, q3, q4, q5, q6, q7,
             x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, rstd, acc0, acc1, acc2, acc3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1,
        )  # fmt: skip
    else:
        acc0, acc1 = tl.inline_asm_elementwise(
            ASM, CONSTRAINTS,
            [g0, g1, g2, g3, g4, g5, g6, g7, h0, h1, h2, h3, h4, h5, h6, h7,
             x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, rstd, acc0, acc1],
            dtype=(tl.float32, tl.float32), is_pure=True, pack=1,
        )  # fmt: skip
    return acc0, acc1, acc2, acc3
