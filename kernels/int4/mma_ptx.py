"""The inline PTX of the INT4 MMA GEMV (kernels/int4/triton_mma_gemv.py, whose docstring
gives the fragment mapping): one lane's work on a 16-row tile over a block of 128 inputs,
as assembly text (`ASM[fp16, multi]`, `CONSTRAINTS[multi]`) and as the Triton call that
feeds it its 32 registers (`mma_block`). tests/kernels/ptx_warp.py runs the same text on
a numpy warp.
"""

from __future__ import annotations

import triton
import triton.language as tl


def _block_asm(fp16: bool, multi: bool) -> str:
    """PTX for one lane of a 16-row tile over a block of 128 inputs. Operands: the new
    accumulators (O of them: rows g and g + 8 of x's row 0; multi: rows g, g for x rows 2t
    and 2t + 1, then g + 8 for both), then inputs from $O: 4 words of row g, 4 of row g + 8,
    -(OFFSET + zero) of each row (fp32), x's pairs 16p + 4t + c (p, c = 0..3), at one row
    the two pairs of the lane's share of the block sum (see below), the scales of rows g and
    g + 8, the O accumulators.

    The block sum X of each row of x: with M rows (multi) a second MMA chain with A = ones
    over the same B (8 MMAs; column n of D sums x's row n). At one row B's 8 columns are all
    x, so one MMA with A = ones takes a B whose column g holds 16 different inputs of the
    block instead, lane (g, t) bringing pairs 16 (g // 2) + 4 t + 2 (g % 2) and + 1 (its
    column's k-slots 2t.. and 2t + 8..): over the 32 lanes every pair once. Lane (g, t)'s D
    holds columns 2t and 2t + 1; two butterfly shuffles over t add the 8 columns into X."""
    magic = "0x64006400" if fp16 else "0x43004300"
    kind = "f16" if fp16 else "bf16"
    one = "0x3C003C00" if fp16 else "0x3F803F80"
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32"
    o = 4 if multi else 2
    words, offsets, xs = o, o + 8, o + 10
    x_share = o + 26  # one row only: the lane's two pairs of the block sum
    scales = o + 26 if multi else o + 28
    accs = scales + 2
    lines = [
        f"{{ .reg .b32 t, a<32>, one; .reg .f32 d<4>, e<4>, z, x, s; mov.f32 z, 0f00000000; mov.b32 one, {one};"
    ]
    for p in range(4):
        for half in range(2):  # words 2 half and 2 half + 1 of each row
            regs: list[str] = []
            for w in (2 * half, 4 + 2 * half, 2 * half + 1, 5 + 2 * half):  # a0 a1 a2 a3: lo, hi, lo, hi
                reg = f"a{len(regs) + 4 * (2 * p + half)}"
                if p:
                    lines.append(f"shr.u32 t, ${words + w}, {4 * p};")
                lines.append(f"lop3.b32 {reg}, {f'${words + w}' if p == 0 else 't'}, 0x000F000F, {magic}, 0xea;")
                regs.append(reg)
            b = f"{{${xs + 4 * p + 2 * half}, ${xs + 4 * p + 2 * half + 1}}}"
            first = p == 0 and half == 0
            lines.append(
                f"{mma} {{d0, d1, d2, d3}}, {{{', '.join(regs)}}}, {b}, "
                f"{'{z, z, z, z}' if first else '{d0, d1, d2, d3}'};"
            )
            if multi:
                lines.append(
                    f"{mma} {{e0, e1, e2, e3}}, {{one, one, one, one}}, {b}, "
                    f"{'{z, z, z, z}' if first else '{e0, e1, e2, e3}'};"
                )
    if not multi:  # X: one MMA over the lanes' shares, then the 8 columns added across t
        lines.append(
            f"{mma} {{e0, e1, e2, e3}}, {{one, one, one, one}}, {{${x_share}, ${x_share + 1}}}, {{z, z, z, z}};"
        )
        lines.append("add.f32 x, e0, e1;")
        for mask in (1, 2):
            lines.append(f"shfl.sync.bfly.b32 s, x, {mask}, 0x1f, 0xffffffff; add.f32 x, x, s;")
    # d_r - (OFFSET + zero_row) * X_col, times the row's scale, into the accumulator
    if multi:
        outs = [("d0", "e0", 0), ("d1", "e1", 0), ("d2", "e0", 1), ("d3", "e1", 1)]
    else:
        outs = [("d0", "x", 0), ("d2", "x", 1)]
    for n, (d, e, hi) in enumerate(outs):
        lines.append(f"fma.rn.f32 {d}, ${offsets + hi}, {e}, {d}; fma.rn.f32 ${n}, {d}, ${scales + hi}, ${accs + n};")
    lines.append("}")
    return " ".join(lines)


ASM = {(fp16, multi): _block_asm(fp16, multi) for fp16 in (False, True) for multi in (False, True)}
CONSTRAINTS = {
    multi: ",".join(
        ["=f"] * (4 if multi else 2)
        + ["r"] * 8
        + ["f"] * 2
        + ["r"] * (16 if multi else 18)
        + ["f"] * (6 if multi else 4)
    )
    for multi in (False, True)
}


@triton.jit
def _split4(v):
    """[T, 4] -> its four columns, [T] each."""
    even, odd = tl.split(tl.reshape(v, (v.shape[0], 2, 2)))  # columns (0, 2) and (1, 3)
    c0, c2 = tl.split(even)
    c1, c3 = tl.split(odd)
    return c0, c1, c2, c3


@triton.jit
def mma_block(
    words_lo, words_hi, offset_lo, offset_hi, xa, xb, xc, xd, x_share, scale_lo, scale_hi, acc0, acc1, acc2, acc3,
    ASM: tl.constexpr, CONSTRAINTS: tl.constexpr, MULTI: tl.constexpr,
):  # fmt: skip
    """One block of 128 inputs into the accumulators ([T] each; rows g, g + 8, and with MULTI
    (x's rows 2t, 2t + 1) x (rows g, g + 8)). words: [T, 4] int32; xa..xd [T, 4]: x's
    pairs 16p + 4t + c of the block, p = 0..3; x_share [T, 2] (one row; unread with MULTI):
    pairs 16 (g // 2) + 4t + 2 (g % 2) and + 1, the lane's share of the block sum."""
    lo0, lo1, lo2, lo3 = _split4(words_lo)
    hi0, hi1, hi2, hi3 = _split4(words_hi)
    a0, a1, a2, a3 = _split4(xa)
    b0, b1, b2, b3 = _split4(xb)
    c0, c1, c2, c3 = _split4(xc)
    d0, d1, d2, d3 = _split4(xd)
    if MULTI:
        acc0, acc1, acc2, acc3 = tl.inline_asm_elementwise(
            ASM, CONSTRAINTS,
            [lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, offset_lo, offset_hi, a0, a1, a2, a3, b0, b1, b2, b3,
             c0, c1, c2, c3, d0, d1, d2, d3, scale_lo, scale_hi, acc0, acc1, acc2, acc3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1,
        )  # fmt: skip
    else:
        share0, share1 = tl.split(x_share)
        acc0, acc1 = tl.inline_asm_elementwise(
            ASM, CONSTRAINTS,
            [lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, offset_lo, offset_hi, a0, a1, a2, a3, b0, b1, b2, b3,
             c0, c1, c2, c3, d0, d1, d2, d3, share0, share1, scale_lo, scale_hi, acc0, acc1],
            dtype=(tl.float32, tl.float32), is_pure=True, pack=1,
        )  # fmt: skip
    return acc0, acc1, acc2, acc3
