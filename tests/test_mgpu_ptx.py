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


SASS = """
kernel_mosaic_gpu_kernel:
   -:-:-:Y:01        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_10:
   -:-:1:Y:02        /*1dc0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR8], R4 ;
   1:-:-:Y:05        /*1dd0*/              @!P1 BRA `(.L_x_8) ;
.L_x_15:
   -:-:1:Y:01        /*1f00*/                   LDSM.16.M88.4 R24, [R35+0x4000] ;
   1:-:-:Y:02        /*2020*/                   SHF.R.U32.HI R28, RZ, 0x4, R24.reuse ;
   -:-:-:Y:02        /*2040*/                   LOP3.LUT R40, R24, 0xf000f, R119, 0x6a, !PT ;
   -:-:-:Y:01        /*2070*/                   HADD2.BF16_V2 R40, R40, -136, -136 ;
   -:-:-:Y:04        /*2b40*/                   HGMMA.64x16x16.F32.BF16 R32, R40, gdesc[UR8], RZ, !UPT ;
   -:-:-:Y:04        /*2b50*/               @UP0 UIADD3 UR10, UR6, UR14, URZ ;
   -:-:-:Y:03        /*2c90*/                   HGMMA.64x16x16.F32.BF16 R24, R116, gdesc[UR16], R24, gsb0 ;
   -:-:-:-:02        /*2ca0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
   -:-:-:Y:06        /*2e50*/               @P1 BRA `(.L_x_9) ;
   -:-:-:-:04        /*2e60*/                   DEPBAR.LE SB0, 0x0 ;
.L_x_9:
   -:-:-:Y:06        /*35e0*/               @P1 BRA `(.L_x_10) ;
   2:-:-:Y:05        /*3610*/                   EXIT ;
"""


def test_sass_counts_cover_the_kernel_and_the_block_from_the_label_before_the_first_wgmma():
    total, block = mgpu_ptx.sass_counts(SASS)
    assert block == {"LDSM.16.M88.4": 1, "SHF.R.U32.HI": 1, "LOP3.LUT": 1, "HADD2.BF16_V2": 1,
                     "HGMMA.64x16x16.F32.BF16": 2, "UIADD3": 1, "WARPGROUP.DEPBAR.LE": 1, "BRA": 1}
    assert sum(total.values()) == 15 and total["BRA"] == 3 and total["EXIT"] == 1
    assert mgpu_ptx.sass_counts(SASS.replace("HGMMA", "HMMA"))[1] == {}
