"""The PTX inline-asm snippets of the int4 kernels, run on the CPU by a tiny interpreter (tests/ptx_sim.py).

Interpret mode replaces each asm by a jnp twin, so without this a wrong operand number, shift or LUT in the asm text
would only show on the GPU.  Each test runs the asm text on random inputs and compares it with the twin that
interpret mode runs (float32: rel/abs 1e-6 for the GEMV products, 1e-4 where the twin rounds differently).  Operand
packing follows Triton's `pack=4`: four uint8 elements in one 32-bit register, element b in byte b (the order the
GEMV's GPU run confirmed: its output matched the reference to 1.6e-3).
"""

from __future__ import annotations

import numpy as np

import jax.numpy as jnp

from ptx_sim import run_asm


def _pack4(bytes4):
    """4 uint8 arrays -> one uint32 word per sample (element b in byte b: Triton's pack=4 order, as measured)."""
    w = np.zeros(bytes4[0].shape, np.uint32)
    for b, v in enumerate(bytes4):
        w |= v.astype(np.uint32) << np.uint32(8 * b)
    return w


def test_gemv_asm_text_computes_its_jnp_twin():
    """Run `_asm_dot`'s PTX on the CPU (tests/ptx_sim.py) against `_dot_jnp`, the arithmetic interpret mode uses."""
    from pallas_kernels.int4_gemv import _asm_dot, _dot_jnp

    rng = np.random.default_rng(0)
    n = 4096
    c = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(4)]
    xl = [rng.standard_normal(n).astype(np.float32) for _ in range(4)]
    xh = [rng.standard_normal(n).astype(np.float32) for _ in range(4)]
    ops_in = {4: _pack4(c)} | {5 + b: xl[b].view(np.uint32) for b in range(4)} | {9 + b: xh[b].view(np.uint32)
                                                                                  for b in range(4)}
    out = run_asm(_asm_dot(), ops_in)
    assert sorted(out) == [0, 1, 2, 3]
    for b in range(4):
        want = np.asarray(_dot_jnp(jnp.asarray(c[b]), jnp.asarray(xl[b]), jnp.asarray(xh[b])))
        np.testing.assert_allclose(out[b].view(np.float32), want, rtol=1e-6, atol=1e-6)


def test_int4_matmul_asm_fma_text_computes_the_f32_path():
    """`int4_matmul`'s decode="asm_fma" PTX against the float32 decode + FMA it replaces (interpret mode's path)."""
    from pallas_kernels.int4_matmul import _asm_fma, _decode_f32

    rng = np.random.default_rng(1)
    n = 4096
    c = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(4)]
    f = lambda: [rng.standard_normal(n).astype(np.float32) for _ in range(4)]  # noqa: E731
    xl, xh, sl, sh, ml, mh, acc = f(), f(), f(), f(), f(), f(), f()
    a_lo, a_hi = [16 * v for v in sl], [16 * v for v in sh]
    b_lo, b_hi = [m - a for m, a in zip(ml, a_lo)], [m - a for m, a in zip(mh, a_hi)]
    ops_in = {4: _pack4(c)}
    for base, vals in ((5, xl), (9, xh), (13, a_lo), (17, b_lo), (21, a_hi), (25, b_hi), (29, acc)):
        ops_in |= {base + b: np.asarray(vals[b], np.float32).view(np.uint32) for b in range(4)}
    out = run_asm(_asm_fma(), ops_in)
    assert sorted(out) == [0, 1, 2, 3]
    for b in range(4):
        w_lo, w_hi = _decode_f32(jnp.asarray(c[b]), jnp.asarray(sl[b]), jnp.asarray(sh[b]), jnp.asarray(ml[b]),
                                 jnp.asarray(mh[b]))
        want = acc[b] + xl[b] * np.asarray(w_lo) + xh[b] * np.asarray(w_hi)
        np.testing.assert_allclose(out[b].view(np.float32), want, rtol=1e-4, atol=1e-4)
