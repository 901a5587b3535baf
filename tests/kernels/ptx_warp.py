"""A warp of 32 lanes running the few PTX instructions of the INT4 MMA GEMV's inline
assembly (kernels/int4/mma_ptx.py), in numpy, so that the assembly text itself (its
operand numbers, register pairs and fragment positions) is checked on machines without a
GPU. The MMA follows the PTX ISA's fragment layouts for mma.sync.m16n8k16 with 16-bit A
and B and fp32 C/D, lane = 4 g + t:

    A (16 x 16, row):  a0 (g, 2t..2t+1)   a1 (g+8, 2t..2t+1)   a2 (g, 2t+8..)   a3 (g+8, 2t+8..)
    B (16 x 8, col):   b0 (2t..2t+1, g)   b1 (2t+8..2t+9, g)
    C, D (16 x 8):     c0 (g, 2t)  c1 (g, 2t+1)  c2 (g+8, 2t)  c3 (g+8, 2t+1)

a 32-bit register holding two 16-bit values, the lower index in the low half. Only what
that assembly uses is implemented (and the butterfly shuffle of all 32 lanes); anything else raises.
"""

from __future__ import annotations

import re

import numpy as np
import torch

LANES = 32
_G = np.arange(LANES) // 4
_T = np.arange(LANES) % 4


def _halves(bits: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """The two 16-bit values of 32-bit registers, as float64 (low half first)."""
    dtype = torch.bfloat16 if kind == "bf16" else torch.float16
    low = torch.from_numpy((bits & 0xFFFF).astype(np.int16)).view(dtype).double().numpy()
    high = torch.from_numpy((bits >> 16).astype(np.int16)).view(dtype).double().numpy()
    return low, high


def _f32(bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def _bits(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float32).view(np.uint32)


def _mma(kind: str, a: list[np.ndarray], b: list[np.ndarray], c: list[np.ndarray]) -> list[np.ndarray]:
    big_a = np.zeros((16, 16))
    big_b = np.zeros((16, 8))
    big_c = np.zeros((16, 8))
    for reg, (row, col) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
        low, high = _halves(a[reg], kind)
        big_a[_G + row, 2 * _T + col] = low
        big_a[_G + row, 2 * _T + col + 1] = high
    for reg, k in enumerate((0, 8)):
        low, high = _halves(b[reg], kind)
        big_b[2 * _T + k, _G] = low
        big_b[2 * _T + k + 1, _G] = high
    for reg, (row, col) in enumerate(((0, 0), (0, 1), (8, 0), (8, 1))):
        big_c[_G + row, 2 * _T + col] = _f32(c[reg])
    d = (big_a @ big_b + big_c).astype(np.float32)
    return [_bits(d[_G + row, 2 * _T + col]) for row, col in ((0, 0), (0, 1), (8, 0), (8, 1))]


def run(asm: str, inputs: list[np.ndarray], num_outputs: int) -> list[np.ndarray]:
    """Run `asm` (Triton inline-asm text: $0.. the outputs, then the inputs) on a warp.
    inputs: per operand, 32 uint32 register values (fp32 operands as their bits). -> the
    outputs' bits."""
    regs: dict[str, np.ndarray] = {f"${num_outputs + i}": v.astype(np.uint32) for i, v in enumerate(inputs)}

    def value(name: str) -> np.ndarray:
        name = name.strip()
        if name.startswith("0f"):
            return np.full(LANES, int(name[2:], 16), dtype=np.uint32)
        if name.startswith("0x"):
            return np.full(LANES, int(name, 16), dtype=np.uint32)
        if name.isdigit():
            return np.full(LANES, int(name), dtype=np.uint32)
        return regs[name]

    def vector(text: str) -> list[str]:
        return [r.strip() for r in text.strip().strip("{}").split(",")]

    for statement in asm.replace("{", " { ").replace("}", " } ").split(";"):
        statement = re.sub(r"^[\s{}]+", "", statement).strip()
        if not statement or statement.startswith(".reg") or statement == "}":
            continue
        op, _, rest = statement.partition(" ")
        if op.startswith("mma.sync.aligned.m16n8k16.row.col.f32."):
            groups = re.findall(r"\{[^}]*\}", rest)
            d, a, b, c = (vector(group) for group in groups)
            out = _mma(op.split(".")[-3], [value(r) for r in a], [value(r) for r in b], [value(r) for r in c])
            for name, bits in zip(d, out, strict=True):
                regs[name] = bits
            continue
        args = [s.strip() for s in rest.split(",")]
        if op in ("mov.f32", "mov.b32"):
            regs[args[0]] = value(args[1]).copy()
        elif op == "lop3.b32" and args[4] == "0xea":  # (a & b) | c
            regs[args[0]] = (value(args[1]) & value(args[2])) | value(args[3])
        elif op == "shr.u32":
            regs[args[0]] = value(args[1]) >> value(args[2])
        elif op == "fma.rn.f32":
            regs[args[0]] = _bits(_f32(value(args[1])) * _f32(value(args[2])) + _f32(value(args[3])))
        elif op == "add.f32":
            regs[args[0]] = _bits(_f32(value(args[1])) + _f32(value(args[2])))
        elif op == "shfl.sync.bfly.b32" and args[3:] == ["0x1f", "0xffffffff"]:  # every lane, the whole warp
            regs[args[0]] = value(args[1])[np.arange(LANES) ^ int(args[2])]
        else:
            raise NotImplementedError(statement)
    return [regs[f"${i}"] for i in range(num_outputs)]
