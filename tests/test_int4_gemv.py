"""The K-major int4 GEMV (`pallas_kernels/int4_gemv.py`): its repack and its kernel against the references.

Interpret mode on the CPU (the inline asm is replaced by the same arithmetic in jnp), fresh random codes, scales and
mins, N not a multiple of block_n, M = 1..3, groups 32/64/128, every knob that changes the kernel's code path
(prefetch, where X is computed, scales K-major, split-K, several groups per step).  Bounds as in
test_pallas_kernels.py: bf16 2e-2 (observed ~1.6e-3), float32 2e-5.  The `gpu`-marked test runs the compiled
kernel (asm decode) and skips without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from lucebox_jax.quant import unpack_int4
from pallas_kernels.int4_gemv import int4_gemv, int4_gemv_reference, repack_kmajor, unpack_kmajor
from pallas_kernels.int4_matmul import int4_matmul_reference

from test_pallas_kernels import TOL, gpu, gpu_int4_case, rand_quant, rel


@pytest.mark.parametrize("k,n,g", [(64, 5, 32), (256, 40, 64), (512, 3, 128)])
def test_repack_roundtrip_and_group_locality(k, n, g):
    rng = np.random.default_rng(k + n)
    w = rand_quant(rng, k, n, g, sym=True)
    kc = repack_kmajor(w.codes, g)
    assert kc.shape == (n, k // 2) and kc.dtype == jnp.uint8
    q = np.asarray(unpack_int4(w.codes))  # [K, N]
    np.testing.assert_array_equal(np.asarray(unpack_kmajor(kc, g)), q)
    # byte (n, G g/2 + j): low nibble row G g + j, high nibble row G g + g/2 + j (both in group G)
    kc_np = np.asarray(kc)
    for grp in range(k // g):
        j = g // 2 - 1
        b = kc_np[:, grp * g // 2 + j]
        np.testing.assert_array_equal(b & 0xF, q[grp * g + j])
        np.testing.assert_array_equal(b >> 4, q[grp * g + g // 2 + j])


CASES = [  # m, k, n, g, sym, knobs
    (1, 256, 96, 32, False, dict(block_n=32, groups_per_step=2)),
    (1, 256, 100, 32, True, dict(block_n=64, prefetch=False, xsum="inside")),
    (3, 512, 200, 32, True, dict(block_n=64, split_k=2, scales_nk=True)),
    (2, 512, 64, 64, False, dict(block_n=32, split_k=1, groups_per_step=4, xsum="inside")),
    (1, 1024, 130, 128, True, dict(block_n=32, scales_nk=True, prefetch=False)),
    (1, 576, 72, 32, False, dict(block_n=64, groups_per_step=4)),  # SmolLM2 K: 18 groups, 4 does not divide
]


@pytest.mark.parametrize("m,k,n,g,sym,knobs", CASES)
@pytest.mark.parametrize("dt", [jnp.float32, jnp.bfloat16])
def test_gemv_interpret_matches_reference(m, k, n, g, sym, knobs, dt):
    rng = np.random.default_rng(m * 7 + k + n + g)
    w = rand_quant(rng, k, n, g, sym)
    x = jnp.asarray(rng.standard_normal((m, k)), dt)
    kc = repack_kmajor(w.codes, g)
    s, mn = w.scales, w.mins
    if knobs.get("scales_nk"):
        s, mn = s.T, (None if mn is None else mn.T)
    y = int4_gemv(x, kc, s, mn, group_size=g, interpret=True, min_programs=8, **knobs)
    assert y.shape == (m, n) and y.dtype == dt
    ref = int4_matmul_reference(x.astype(jnp.float32), w.codes, w.scales, w.mins, group_size=g)
    assert rel(y, ref) < TOL[dt]
    # the K-major reference is the same function of the same weight
    np.testing.assert_allclose(
        np.asarray(int4_gemv_reference(x.astype(jnp.float32), kc, w.scales, w.mins, group_size=g)),
        np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_gemv_sees_a_single_changed_code():
    """A one-nibble change in the repacked codes must show in the output column it belongs to."""
    rng = np.random.default_rng(5)
    k, n, g = 256, 64, 32
    w = rand_quant(rng, k, n, g, sym=False)
    x = jnp.asarray(rng.standard_normal((1, k)), jnp.float32)
    kc = repack_kmajor(w.codes, g)
    y0 = np.asarray(int4_gemv(x, kc, w.scales, w.mins, group_size=g, interpret=True, block_n=32))
    kc2 = kc.at[17, 40].set(kc[17, 40] ^ 0x10)  # column 17, high nibble of one byte
    y1 = np.asarray(int4_gemv(x, kc2, w.scales, w.mins, group_size=g, interpret=True, block_n=32))
    changed = np.nonzero(np.abs(y1 - y0)[0] > 1e-6)[0]
    assert changed.tolist() == [17]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("g,sym", [(32, False), (128, True)])
def test_gpu_gemv(m, g, sym):
    x, w, ref = gpu_int4_case(m, g, sym)
    kc = repack_kmajor(w.codes, g)
    for kw in ({}, dict(prefetch=False), dict(xsum="inside"), dict(block_n=64, num_warps=4)):
        y = jax.block_until_ready(int4_gemv(x, kc, w.scales, w.mins, group_size=g, **kw))
        assert rel(y, ref) < TOL[jnp.bfloat16], kw
