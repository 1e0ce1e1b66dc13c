"""benchmarks/mgpu_ptx.py's PTX instruction counter (the compile itself needs jax's CUDA plugin: not in CI)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import mgpu_ptx  # noqa: E402

PTX = """
.visible .entry kernel(
\t.param .u64 p0
)
{
\t.reg .b32 %r<9>;
$L__BB0_1:
\t.loc\t1 392 11
\tfma.rn.bf16x2 %r1, %r2, %r3, %r4;
\t// begin inline asm
\t{ .reg .b32 t, b; shr.b32 t, %r5, 4; lop3.b32 t, t, 15, 67, 0x6a; mov.b32 b, 1; sub.bf16x2 %r6, t, b; }
\t// end inline asm
\t@%p1 bra $L__BB0_1;
\tfma.rn.bf16x2 %r7, %r2, %r3, %r4; // a comment: add.s32 is not counted
\tret;
}
"""


def test_instruction_counts_take_inline_asm_and_skip_directives():
    ops = mgpu_ptx.instruction_counts(PTX)
    assert ops == {"fma.rn.bf16x2": 2, "shr.b32": 1, "lop3.b32": 1, "mov.b32": 1, "sub.bf16x2": 1, "bra": 1}
