"""A tiny PTX interpreter for the inline-asm snippets of the int4 kernels (numpy, vectorised over many inputs).

Why: CI has no GPU, and interpret mode replaces the asm by a jnp twin, so a wrong operand number or shift in the asm
text would only show on the GPU.  This runs the asm text itself on the CPU, for the instructions those snippets use:
shl/shr.b32, lop3.b32 (any LUT), mov.b32, mul.rn.f32, fma.rn.f32.  Registers hold uint32 bit patterns.
"""

from __future__ import annotations

import re

import numpy as np

_F32 = np.float32


def _f(v):
    return v.view(_F32)


def _u(v):
    return np.asarray(v, _F32).view(np.uint32)


def _lop3(a, b, c, lut):
    out = np.zeros_like(a)
    for i in range(8):
        if (lut >> i) & 1:
            out |= (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
    return out


def run_asm(text: str, operands: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Execute `text`; `operands` maps $N -> uint32 array (inputs); returns every $N written (outputs)."""
    regs: dict[str, np.ndarray] = {f"${k}": np.asarray(v, np.uint32) for k, v in operands.items()}
    written: set[str] = set()
    shape = next(iter(regs.values())).shape

    def val(tok: str) -> np.ndarray:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if re.fullmatch(r"0x[0-9a-fA-F]+|\d+", tok):
            return np.full(shape, int(tok, 0), np.uint32)
        raise KeyError(f"read of unset register {tok}")

    for raw in text.split("\n"):
        line = raw.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        args = [a.strip() for a in rest.split(",")]
        dst, src = args[0], args[1:]
        if op == "shl.b32":
            res = val(src[0]) << np.uint32(int(src[1], 0))
        elif op == "shr.b32":
            res = val(src[0]) >> np.uint32(int(src[1], 0))
        elif op == "lop3.b32":
            res = _lop3(val(src[0]), val(src[1]), val(src[2]), int(src[3], 0))
        elif op == "mov.b32":
            res = val(src[0])
        elif op == "mul.rn.f32":
            res = _u(_f(val(src[0])).astype(np.float64) * _f(val(src[1])))
        elif op == "fma.rn.f32":
            a, b, c = (_f(val(s)).astype(np.float64) for s in src)
            res = _u(a * b + c)  # float32 products are exact in float64; one rounding to float32 (up to ties)
        else:
            raise NotImplementedError(op)
        regs[dst] = np.asarray(res, np.uint32)
        written.add(dst)
    return {int(r[1:]): regs[r] for r in written if r.startswith("$")}
