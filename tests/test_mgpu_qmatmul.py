"""The Mosaic-GPU W4A16 / W8A16 kernel (`pallas_kernels/mgpu_qmatmul.py`) on the CPU: its repack and plain-jnp
twin against the engine's own dequantization, the kernel itself in Mosaic GPU's interpret mode (work-item indexing,
split-K, group scales and mins; the dequantized tile is staged in shared memory there, since the interpreter's wgmma
reads only shared memory), and lowering for an abstract H200. The register-operand path and timing need the GPU
(`benchmarks/bench_mgpu.py`, which checks every timed configuration against the float32 reference)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from lucebox_jax.quant import dequantize, quantize_int4, quantize_int8
from pallas_kernels import mgpu_qmatmul as mg

from test_pallas_lowering import abstract_h200

# Mosaic GPU's interpreter once hung in another test (test_kernels_mgpu.py, the engine through mgpu): a test here that
# hangs fails after this long instead of holding the suite (each takes seconds; 18 loaded runs of the interpreted
# ones here, tenth session, never hung)
pytestmark = pytest.mark.timeout(600)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("g,sym,bits", [(32, False, 4), (128, True, 4), (32, True, 8), (32, False, 8)])
def test_repack_reference_equals_engine_dequant(g, sym, bits):
    rng = np.random.default_rng(g + bits)
    wd = rng.standard_normal((256, 128)).astype(np.float32)
    w = quantize_int4(wd, group_size=g, symmetric=sym) if bits == 4 else quantize_int8(wd, group_size=g)
    if bits == 8 and not sym:  # int8 with mins, as GGUF Q5_1 / Q5_K import
        w = w.replace(mins=jnp.asarray(rng.standard_normal(w.scales.shape), w.scales.dtype))
    mw = mg.repack(w)
    assert mw.shape == (256, 128) and mw.bits == bits
    ref = np.asarray(dequantize(w))
    if sym:  # exact: the codes reordered, the scales as they were
        assert mw.scales.dtype == w.scales.dtype and mw.offsets is None
        np.testing.assert_allclose(np.asarray(mg.dequantize_mgpu(mw)), ref, rtol=1e-6, atol=1e-6)
        return
    # with mins the kernel scales in bf16 before the wgmma: the scales and offsets (min + 8 * scale for int4, in the
    # scales' dtype first) are stored in bf16, each within 2^-9 of its value; |code * scale| and |offset| are both at
    # most ~max |w| here, so the weight within 2^-8 max |w|
    off = (w.mins.astype(jnp.float32) + 8.0 * w.scales.astype(jnp.float32)).astype(w.scales.dtype) if bits == 4 \
        else w.mins
    assert mw.scales.dtype == mw.offsets.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(mw.scales), np.asarray(w.scales.astype(jnp.bfloat16)))
    np.testing.assert_array_equal(np.asarray(mw.offsets), np.asarray(off.astype(jnp.bfloat16)))
    tol = 2.0 ** -8 * float(np.abs(ref).max()) * 2
    np.testing.assert_allclose(np.asarray(mg.dequantize_mgpu(mw)), ref, rtol=0, atol=tol)


@pytest.mark.parametrize("m,g,cfg", [(3, 32, mg.MgpuConfig(tile_m=64, compute_wgs=2, groups=2, split_k=2)),
                                     (20, 32, mg.MgpuConfig(tile_m=64, compute_wgs=1, groups=1, split_k=1)),
                                     (33, 128, mg.MgpuConfig(tile_m=64, tile_t=48, compute_wgs=1, groups=1, split_k=2)),
                                     (33, 32, mg.MgpuConfig(tile_m=64, tile_t=48, compute_wgs=2, groups=2, split_k=1)),
                                     (50, 32, mg.MgpuConfig(tile_m=64, tile_t=64, compute_wgs=1, groups=4, split_k=2)),
                                     (1, 128, mg.MgpuConfig(tile_m=64, tile_t=8, compute_wgs=2, groups=1, split_k=2)),
                                     (33, 64, mg.MgpuConfig(tile_m=64, tile_t=40, compute_wgs=1, groups=2, split_k=1))])
def test_kernel_interpret_matches_reference(m, g, cfg):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    rng = np.random.default_rng(m)
    w = quantize_int4(rng.standard_normal((256, 128)).astype(np.float32), group_size=g, symmetric=False)
    x = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)
    ref = jnp.dot(x.astype(jnp.float32), dequantize(w))
    y = mg.mgpu_matmul(x, mg.repack(w), cfg, interpret=plgpu.InterpretGPUParams())
    assert y.shape == (m, 128) and y.dtype == jnp.bfloat16
    assert _rel(y, ref) < 1e-2


def test_bad_config_is_refused():
    assert mg.check_config(4096, 6144, 32, 4, mg.MgpuConfig(tile_m=96))
    assert mg.check_config(4096, 100, 32, 4, mg.MgpuConfig())
    assert mg.check_config(4096, 4096, 32, 4, mg.MgpuConfig(groups=4, split_k=3))
    assert mg.check_config(4096, 4096, 32, 4, mg.MgpuConfig(tile_t=12))  # wgmma N: a multiple of 8
    assert mg.check_config(4096, 4096, 32, 4, mg.MgpuConfig()) is None


@pytest.mark.parametrize("k,n,g,bits,m", [(4096, 28672, 32, 4, 1), (14336, 4096, 128, 4, 16), (4096, 6144, 32, 4, 64),
                                          (4096, 128256, 32, 8, 1), (4096, 6144, 128, 4, 9), (4096, 4096, 32, 8, 20),
                                          (4096, 4096, 128, 4, 5), (4096, 28672, 128, 4, 33),
                                          (14336, 4096, 128, 4, 40), (4096, 6144, 128, 4, 48)])
def test_candidates_lower_for_h200(k, n, g, bits, m):
    sds = jax.ShapeDtypeStruct
    cands = mg.candidate_configs(m, k, n, g, bits)
    assert cands
    for cfg in cands[:2]:
        w = mg.MgpuWeight(codes=sds((k // g, n, g), jnp.int4 if bits == 4 else jnp.int8),
                          scales=sds((k // g, n), jnp.float16),
                          offsets=sds((k // g, n), jnp.float16) if g == 32 and bits == 4 else None,
                          group_size=g, bits=bits)
        with abstract_h200():
            txt = jax.jit(lambda x, w, cfg=cfg: mg.mgpu_matmul(x, w, cfg)).trace(
                sds((m, k), jnp.bfloat16), w).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in txt


def test_k_permuted_repack_is_the_same_weight():
    """`loads="perm"` stores each group's K in `perm_k` order; dequantization and the interpreted kernel undo it."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    assert sorted(mg.perm_k(128)) == list(range(128)) and mg.perm_k(64)[:8] == [0, 1, 8, 9, 16, 17, 24, 25]
    rng = np.random.default_rng(7)
    w = quantize_int4(rng.standard_normal((256, 128)).astype(np.float32), group_size=64, symmetric=True)
    pw, plain = mg.repack(w, k_perm=True), mg.repack(w)
    assert pw.k_perm and not np.array_equal(np.asarray(pw.codes, np.int8), np.asarray(plain.codes, np.int8))
    np.testing.assert_array_equal(np.asarray(mg.dequantize_mgpu(pw)), np.asarray(mg.dequantize_mgpu(plain)))
    x = jnp.asarray(rng.standard_normal((5, 256)), jnp.bfloat16)
    cfg = mg.MgpuConfig(tile_m=64, compute_wgs=2, groups=1, split_k=2)
    y = mg.mgpu_matmul(x, pw, cfg, interpret=plgpu.InterpretGPUParams())
    assert _rel(y, jnp.dot(x.astype(jnp.float32), dequantize(w))) < 1e-2
    with pytest.raises(ValueError, match="k_perm needs int4"):
        mg.repack(quantize_int4(rng.standard_normal((256, 128)).astype(np.float32), group_size=32), k_perm=True)


def test_split_order_puts_each_register_pair_four_nibbles_apart():
    """`perm_k(split=True)` (`split_decode`): lane q's word holds, at nibbles i and i + 4, the real
    columns 8i + 2q and 8i + 2q + 1 (the pair its WGMMA register i wants); `unperm_k` undoes it, and the repacked weight
    dequantizes to the engine's own."""
    one = mg.perm_k(32, split=True)
    assert sorted(mg.perm_k(128, split=True)) == list(range(128))
    for q in range(4):
        for i in range(4):
            assert (one[8 * q + i], one[8 * q + i + 4]) == (8 * i + 2 * q, 8 * i + 2 * q + 1)
    a = jnp.arange(2 * 64).reshape(2, 64)
    for split in (False, True):
        np.testing.assert_array_equal(np.asarray(mg.unperm_k(a[:, jnp.asarray(mg.perm_k(64, split))], split)), a)
    rng = np.random.default_rng(9)
    w = quantize_int4(rng.standard_normal((256, 128)).astype(np.float32), group_size=128, symmetric=True)
    sw = mg.repack(w, k_perm=True, k_split=True)
    assert sw.k_split and not np.array_equal(np.asarray(sw.codes, np.int8),
                                             np.asarray(mg.repack(w, k_perm=True).codes, np.int8))
    np.testing.assert_array_equal(np.asarray(mg.dequantize_mgpu(sw)), np.asarray(mg.dequantize_mgpu(mg.repack(w))))
    with pytest.raises(ValueError, match="k_split is an order of k_perm"):
        mg.repack(w, k_split=True)


def test_split_decode_interprets_like_the_reference_and_lowers():
    """`split_decode` (the split order; shift, LOP3, subtract a register). Interpreted against the float32 product at
    3 and 20 rows, also where the configuration and the weight's order disagree (the kernel follows the weight) and
    for weights with mins; lowered for an abstract H200 on the register path (`_decode_split`) at the 8B shapes."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    rng = np.random.default_rng(12)
    w = quantize_int4(rng.standard_normal((256, 128)).astype(np.float32), group_size=64, symmetric=True)
    cfg = mg.MgpuConfig(tile_m=64, compute_wgs=2, groups=2, split_k=2, scale_after=True, split_decode=True)
    sw = mg.repack(w, k_perm=True, k_split=True)
    ref = lambda x: jnp.dot(x.astype(jnp.float32), dequantize(w))  # noqa: E731
    for m in (3, 20):
        x = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)
        y = mg.mgpu_matmul(x, sw, dataclasses.replace(cfg, tile_t=16 if m <= 16 else 32),
                           interpret=plgpu.InterpretGPUParams())
        assert _rel(y, ref(x)) < 1e-2
    plain_cfg = dataclasses.replace(cfg, tile_t=32, scale_after=False, split_decode=False)
    for w_run, c in ((sw, plain_cfg), (mg.repack(w, k_perm=True), dataclasses.replace(cfg, tile_t=32))):
        assert _rel(mg.mgpu_matmul(x, w_run, c, interpret=plgpu.InterpretGPUParams()), ref(x)) < 1e-2
    assert "needs perm loads" in mg.check_config(256, 128, 64, 4, dataclasses.replace(cfg, loads="narrow"))
    # weights with mins (no scale_after): the split order decodes them too, scale and min applied after the subtract
    wa = quantize_int4(rng.standard_normal((256, 128)).astype(np.float32), group_size=64, symmetric=False)
    y = mg.mgpu_matmul(x, mg.repack(wa, k_perm=True, k_split=True), plain_cfg, interpret=plgpu.InterpretGPUParams())
    assert _rel(y, jnp.dot(x.astype(jnp.float32), dequantize(wa))) < 1e-2
    sds = jax.ShapeDtypeStruct
    for k, n in ((4096, 28672), (14336, 4096)):
        big = dataclasses.replace(mg.default_config(1, k, n, 128, 4), scale_after=True, split_decode=True)
        ws = mg.MgpuWeight(codes=sds((k // 128, n, 128), jnp.int4), scales=sds((k // 128, n), jnp.float16),
                           offsets=None, group_size=128, bits=4, k_perm=True, k_split=True)
        with abstract_h200():
            txt = jax.jit(lambda x, w: mg.mgpu_matmul(x, w, big)).trace(
                sds((1, k), jnp.bfloat16), ws).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in txt


@pytest.mark.parametrize("loads", mg.LOADS)
def test_every_load_path_lowers_for_h200(loads):
    """The three ways codes reach wgmma's registers (`mg.LOADS`) lower for an abstract H200 at 8B gate+up, g128."""
    sds = jax.ShapeDtypeStruct
    k, n, g = 4096, 28672, 128
    cfg = dataclasses.replace(mg.default_config(1, k, n, g, 4), loads=loads)
    w = mg.MgpuWeight(codes=sds((k // g, n, g), jnp.int4), scales=sds((k // g, n), jnp.float16), offsets=None,
                      group_size=g, bits=4, k_perm=loads == "perm")
    assert mg.load_mode(cfg, w) == loads
    with abstract_h200():
        txt = jax.jit(lambda x, w: mg.mgpu_matmul(x, w, cfg)).trace(
            sds((1, k), jnp.bfloat16), w).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in txt


def test_identical_kernels_lower_to_one_module():
    """Two layers' calls of one configuration must hash alike (jax names each Pallas kernel with a counter, which made
    every layer's kernel a separate compile: 150-160 s for an 8B decode step on the H200)."""
    import re

    sds = jax.ShapeDtypeStruct
    k, n, g = 4096, 4096, 128
    cfg = mg.default_config(1, k, n, g, 4)
    w = mg.MgpuWeight(codes=sds((k // g, n, g), jnp.int4), scales=sds((k // g, n), jnp.float16), offsets=None,
                      group_size=g, bits=4, k_perm=True)

    def two_layers(x, w1, w2):
        return mg.mgpu_matmul(mg.mgpu_matmul(x, w1, cfg), w2, cfg)

    with abstract_h200():
        txt = jax.jit(two_layers).trace(sds((1, k), jnp.bfloat16), w, w).lower(lowering_platforms=("cuda",)).as_text()
    hashes = re.findall(r'kernel_hash = "([^"]*)"', txt)
    assert len(hashes) == 2 and len(set(hashes)) == 1


@pytest.mark.parametrize("probe", [p for p in mg.PROBES if p])
@pytest.mark.parametrize("loads,sym", [("perm", False), ("narrow", False), ("perm", True)])
def test_timing_probes_lower_for_h200(probe, loads, sym):
    """The stage-skipping variants that place the kernel's time by differences lower under both semantics (Lane for
    `perm`, Warpgroup for the others), and on symmetric weights with the Hopper table's `scale_after` and two groups
    per step (the configuration the skeleton probes `skip_x` and `skip_mma` keep); an unknown probe is refused."""
    sds = jax.ShapeDtypeStruct
    k, n, g = 4096, 4096, 128
    cfg = dataclasses.replace(mg.default_config(1, k, n, g, 4), loads=loads, probe=probe,
                              **({"scale_after": True, "groups": 2} if sym else {}))
    w = mg.MgpuWeight(codes=sds((k // g, n, g), jnp.int4), scales=sds((k // g, n), jnp.float16),
                      offsets=None if sym else sds((k // g, n), jnp.float16), group_size=g, bits=4,
                      k_perm=loads == "perm")
    with abstract_h200():
        txt = jax.jit(lambda x, w: mg.mgpu_matmul(x, w, cfg)).trace(
            sds((1, k), jnp.bfloat16), w).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in txt
    assert "probe" in mg.check_config(k, n, g, 4, dataclasses.replace(cfg, probe="skip_all"))


def test_scale_after_interpret_matches_reference_and_lowers():
    """`scale_after` (symmetric weights): wgmma on the raw codes per group, the scale applied to the float32 partial
    sums. Interpreted on the CPU against the float32 product, and lowered for an abstract H200 (perm loads)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    rng = np.random.default_rng(11)
    w = quantize_int4(rng.standard_normal((256, 128)).astype(np.float32), group_size=64, symmetric=True)
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
    ref = jnp.dot(x.astype(jnp.float32), dequantize(w))
    cfg = mg.MgpuConfig(tile_m=64, compute_wgs=2, groups=2, split_k=2, scale_after=True)
    for k_perm in (False, True):
        y = mg.mgpu_matmul(x, mg.repack(w, k_perm=k_perm), cfg, interpret=plgpu.InterpretGPUParams())
        assert _rel(y, ref) < 1e-2
    sds = jax.ShapeDtypeStruct
    k, n, g = 4096, 28672, 128
    big = dataclasses.replace(mg.default_config(1, k, n, g, 4), scale_after=True)
    ws = mg.MgpuWeight(codes=sds((k // g, n, g), jnp.int4), scales=sds((k // g, n), jnp.float16), offsets=None,
                       group_size=g, bits=4, k_perm=True)
    with abstract_h200():
        txt = jax.jit(lambda x, w: mg.mgpu_matmul(x, w, big)).trace(
            sds((1, k), jnp.bfloat16), ws).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in txt


@pytest.mark.parametrize("k,n,g,bits,m,k_perm,sym,stream", [(14336, 4096, 128, 4, 1, True, True, False),
                                                            (4096, 4096, 32, 4, 1, False, False, False),
                                                            (4096, 128256, 32, 8, 9, False, True, False),
                                                            (4096, 28672, 128, 4, 1, True, True, True)])
def test_programmatic_dependent_launch_lowers_for_h200(k, n, g, bits, m, k_perm, sym, stream):
    """`pdl`: the kernel prefetches its first weight steps to L2 (not on stream-K, whose CTAs start mid-tile), then
    waits for the grid before it (griddepcontrol.wait) and lets the next one launch; the module is marked for a PDL
    launch. Whether the launch overlaps is for the GPU benchmark (LUCEBOX_MGPU_PDL=1)."""
    sds = jax.ShapeDtypeStruct
    cfg = dataclasses.replace(mg.default_config(m, k, n, g, bits), pdl=True)
    if stream:
        cfg = dataclasses.replace(cfg, stream_k=True, split_k=1, groups=1)
    w = mg.MgpuWeight(codes=sds((k // g, n, g), jnp.int4 if bits == 4 else jnp.int8),
                      scales=sds((k // g, n), jnp.float16), offsets=None if sym else sds((k // g, n), jnp.float16),
                      group_size=g, bits=bits, k_perm=k_perm)
    with abstract_h200():
        txt = jax.jit(lambda x, w: mg.mgpu_matmul(x, w, cfg)).trace(
            sds((m, k), jnp.bfloat16), w).lower(lowering_platforms=("cuda",)).as_text()
    assert "uses_pdl" in txt and "griddepcontrol.wait" in txt
    plain = jax.jit(lambda x, w: mg.mgpu_matmul(x, w, dataclasses.replace(cfg, pdl=False)))
    with abstract_h200():
        plain_txt = plain.trace(sds((m, k), jnp.bfloat16), w).lower(lowering_platforms=("cuda",)).as_text()
    assert "uses_pdl" not in plain_txt and "griddepcontrol" not in plain_txt
    # (the TMA descriptors are prefetched either way: the weights' L2 prefetch is the extra one)
    assert (txt.count("prefetch") > plain_txt.count("prefetch")) != stream


def test_pdl_interprets_like_the_reference():
    """The interpreter ignores `pdl` (it runs one kernel at a time): the same result as without."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    rng = np.random.default_rng(5)
    w = quantize_int4(rng.standard_normal((256, 128)).astype(np.float32), group_size=32, symmetric=False)
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
    cfg = mg.MgpuConfig(tile_m=64, compute_wgs=2, groups=2, split_k=2, pdl=True)
    y = mg.mgpu_matmul(x, mg.repack(w), cfg, interpret=plgpu.InterpretGPUParams())
    assert _rel(y, jnp.dot(x.astype(jnp.float32), dequantize(w))) < 1e-2


def test_token_tiles_by_rows(monkeypatch):
    """16 up to 16 rows, then 32, 40 (a tree of 32 and its root), 48, 64, whatever the group; LUCEBOX_MGPU_TIGHT=0 / 1
    (TOKEN_TILES): 48 for 33-40 rows as before / every count rounded up to 8."""
    monkeypatch.setattr(mg, "TOKEN_TILES", "")
    rows = (1, 9, 16, 17, 32, 33, 40, 41, 48, 49, 64, 200)
    assert [mg.token_tile(m, 32) for m in rows] == [16, 16, 16, 32, 32, 40, 40, 48, 48, 64, 64, 64]
    assert [mg.token_tile(m, 128) for m in rows] == [mg.token_tile(m, 32) for m in rows]
    monkeypatch.setattr(mg, "TOKEN_TILES", "old")
    assert [mg.token_tile(m, 128) for m in (33, 40, 41)] == [48, 48, 48]
    monkeypatch.setattr(mg, "TOKEN_TILES", "tight")
    assert [mg.token_tile(m, 128) for m in (9, 17, 33, 50, 64, 65)] == [16, 24, 40, 56, 64, 64]


@pytest.mark.parametrize("k,n,g,bits", [(4096, 28672, 128, 4), (14336, 4096, 128, 4), (4096, 6144, 128, 4),
                                        (4096, 128256, 128, 8), (4096, 128256, 32, 8), (4096, 28672, 32, 4)])
def test_default_40_token_tile_lowers_for_a_tree_of_32(k, n, g, bits):
    """33 rows (a 32-node tree and its root) take a 40-token tile: it must fit shared memory at the 8B shapes, groups
    of 32 included (the int8 head; int4 with mins as Q4_1 / Q4_K import)."""
    sds = jax.ShapeDtypeStruct
    cfg = mg.default_config(33, k, n, g, bits)
    assert cfg.tile_t == 40
    asym = g == 32 and bits == 4
    w = mg.MgpuWeight(codes=sds((k // g, n, g), jnp.int4 if bits == 4 else jnp.int8),
                      scales=sds((k // g, n), jnp.float16), offsets=sds((k // g, n), jnp.float16) if asym else None,
                      group_size=g, bits=bits)
    with abstract_h200():
        txt = jax.jit(lambda x, w: mg.mgpu_matmul(x, w, cfg)).trace(
            sds((33, k), jnp.bfloat16), w).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in txt


@pytest.mark.parametrize("k,n,variant", [(14336, 4096, dict(tile_m=128, compute_wgs=2)),
                                         (14336, 4096, dict(tile_m=128, compute_wgs=2, groups=1, steps=4)),
                                         (4096, 4096, dict(tile_m=128, compute_wgs=2, stream_k=True, split_k=1)),
                                         (4096, 4096, dict(tile_m=128, compute_wgs=2, stream_k=True, split_k=1,
                                                           groups=1))])
def test_wider_cta_tiles_lower_for_a_tree_of_32(k, n, variant):
    """At 40 tokens a 64- or 128-row CTA reads more x than weight bytes a step (4 * tokens / rows: 2.5 for o's 64):
    the 256-row CTAs the gpu_mgpu_probe sweep times for down and o must fit shared memory on the engine's
    configuration (perm loads, split decode)."""
    from lucebox_jax import kernels_mgpu as km

    sds = jax.ShapeDtypeStruct
    cfg = dataclasses.replace(km.config_for(33, k, n, 128, 4), **variant)
    assert mg.check_config(k, n, 128, 4, cfg) is None and cfg.tile_t == 40
    w = mg.MgpuWeight(codes=sds((k // 128, n, 128), jnp.int4), scales=sds((k // 128, n), jnp.float16), offsets=None,
                      group_size=128, bits=4, k_perm=True, k_split=cfg.split_decode)
    with abstract_h200():
        txt = jax.jit(lambda x, w: mg.mgpu_matmul(x, w, cfg)).trace(
            sds((33, k), jnp.bfloat16), w).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in txt


def test_ctas_past_256_rows_are_refused():
    """A 512-row CTA failed in lowering (its scales' TMA box); check_config says so before any lowering."""
    assert "256" in mg.check_config(4096, 28672, 128, 4, mg.MgpuConfig(tile_m=256, compute_wgs=2))
    assert mg.check_config(4096, 28672, 128, 4, mg.MgpuConfig(tile_m=256, compute_wgs=1)) is None


@pytest.mark.parametrize("tiles,steps,ctas", [(2, 8, 3), (4, 8, 3), (112, 16, 132), (32, 56, 132), (24, 16, 132),
                                              (501, 8, 132), (3, 5, 7), (1, 1, 132)])
def test_stream_plan_covers_every_step_once(tiles, steps, ctas):
    """Each CTA's run of `per_cta` consecutive steps; together they cover every (tile, K step) once, and the slots
    marked written are exactly the CTAs that touch each tile, in order."""
    per_cta, used, written = mg.stream_plan(tiles, steps, ctas)
    total = tiles * steps
    assert used <= ctas and (used - 1) * per_cta < total <= used * per_cta
    owner = np.arange(total) // per_cta  # the CTA that runs each global step
    for t in range(tiles):
        touching = np.unique(owner[t * steps:(t + 1) * steps])
        assert list(touching) == list(range(touching[0], touching[0] + len(touching)))
        assert list(np.flatnonzero(written[:, t])) == list(range(len(touching)))


@pytest.mark.parametrize("m,g,bits,sym,cfg,sms", [
    # 4 column tiles of 8 steps on 3 CTAs: tiles 0 and 3 have one writer, so slot 1 of theirs stays NaN (the
    # interpreter's uninitialised memory) and must not reach the sum
    (2, 32, 4, False, mg.MgpuConfig(tile_m=64, compute_wgs=1, groups=1, stream_k=True), 3),
    (20, 32, 4, False, mg.MgpuConfig(tile_m=64, compute_wgs=2, groups=2, stream_k=True), 3),  # 2 token tiles
    (5, 64, 4, True, mg.MgpuConfig(tile_m=64, compute_wgs=1, groups=1, stream_k=True, scale_after=True), 5),
    (3, 32, 8, True, mg.MgpuConfig(tile_m=64, compute_wgs=2, groups=2, stream_k=True), 5),
    (3, 32, 4, False, mg.MgpuConfig(tile_m=64, compute_wgs=1, groups=2, stream_k=True), 132),  # one tile a CTA
    # a 33-row tree padded to 40 rows on a 16-row entry's schedule widened to 40 tokens (kernels_mgpu.WIDE_FROM_16)
    (40, 128, 4, True, mg.MgpuConfig(tile_m=64, tile_t=40, compute_wgs=2, groups=1, steps=3, stream_k=True,
                                     scale_after=True), 5),
])
def test_stream_k_interpret_matches_reference(m, g, bits, sym, cfg, sms):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    from lucebox_jax.quant import quantize_int8

    rng = np.random.default_rng(m + g)
    wd = rng.standard_normal((256, 256)).astype(np.float32)
    w = quantize_int4(wd, group_size=g, symmetric=sym) if bits == 4 else quantize_int8(wd, group_size=g)
    x = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)
    y = mg.mgpu_matmul(x, mg.repack(w), cfg, num_sms=sms, interpret=plgpu.InterpretGPUParams())
    assert y.shape == (m, 256) and y.dtype == jnp.bfloat16
    assert _rel(y, jnp.dot(x.astype(jnp.float32), dequantize(w))) < 1e-2


@pytest.mark.parametrize("k,n,g,bits,m,sym", [(4096, 28672, 128, 4, 1, True), (14336, 4096, 128, 4, 1, True),
                                              (4096, 6144, 128, 4, 16, True), (4096, 4096, 32, 4, 1, False),
                                              (4096, 128256, 32, 8, 1, True), (4096, 28672, 128, 4, 33, True)])
def test_stream_k_lowers_for_h200(k, n, g, bits, m, sym):
    """The stream-K schedule at the 8B shapes and the int8 head, on the load path each would run (perm where the
    group allows, scale_after on symmetric int4), lowered for an abstract H200; and it is among the candidates."""
    sds = jax.ShapeDtypeStruct
    cfg = dataclasses.replace(mg.default_config(m, k, n, g, bits), split_k=1, stream_k=True,
                              scale_after=sym and bits == 4, loads="perm")
    assert mg.check_config(k, n, g, bits, cfg) is None
    assert any(c.stream_k for c in mg.candidate_configs(m, k, n, g, bits))
    w = mg.MgpuWeight(codes=sds((k // g, n, g), jnp.int4 if bits == 4 else jnp.int8),
                      scales=sds((k // g, n), jnp.float16), offsets=None if sym else sds((k // g, n), jnp.float16),
                      group_size=g, bits=bits, k_perm=mg.perm_ok(g, bits))
    with abstract_h200():
        txt = jax.jit(lambda x, w: mg.mgpu_matmul(x, w, cfg)).trace(
            sds((m, k), jnp.bfloat16), w).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in txt
    assert mg.check_config(k, n, g, bits, dataclasses.replace(cfg, split_k=2))  # stream-K splits K itself


@pytest.mark.parametrize("sym", [False, True])
def test_paired_g32_repack_is_the_same_weight(sym):
    """`repack(k_pair=True)` stores int4 g32 codes two groups a 64-wide row (perm order, split or not); the weight it
    describes is unchanged. Only int4 g32 with k_perm pairs."""
    rng = np.random.default_rng(11)
    w = quantize_int4(rng.standard_normal((256, 128)).astype(np.float32), group_size=32, symmetric=sym)
    plain = np.asarray(mg.dequantize_mgpu(mg.repack(w)))
    for split in (False, True):
        pw = mg.repack(w, k_perm=True, k_split=split, k_pair=True)
        assert pw.k_pair and pw.codes.shape == (4, 128, 64) and pw.scales.shape == (8, 128) and pw.shape == (256, 128)
        np.testing.assert_array_equal(np.asarray(mg.dequantize_mgpu(pw)), plain)
    with pytest.raises(ValueError):
        mg.repack(w, k_pair=True)  # no k_perm
    with pytest.raises(ValueError):
        mg.repack(quantize_int4(rng.standard_normal((256, 128)).astype(np.float32), group_size=64), k_perm=True,
                  k_pair=True)
    assert mg.check_config(4096, 4096, 128, 4, mg.MgpuConfig(pair=True))  # g128: nothing to pair
    assert mg.check_config(4096, 4096, 32, 4, mg.MgpuConfig(pair=True, scale_after=True))
    assert mg.check_config(4096, 4096, 32, 4, mg.MgpuConfig(pair=True, loads="narrow"))
    assert mg.check_config(4096, 4096, 32, 4, mg.MgpuConfig(pair=True, split_decode=True)) is None
    assert mg.check_config(4096, 4096, 32, 4, mg.MgpuConfig(split_decode=True))  # unpaired g32 cannot split


@pytest.mark.parametrize("sym,split", [(False, True), (True, False)])
def test_paired_g32_interprets_like_the_reference(sym, split):
    """Each half of a paired row takes its own group's scale (and offset): split-K, a 24-token tile and stream-K."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    rng = np.random.default_rng(12)
    w = quantize_int4(rng.standard_normal((256, 256)).astype(np.float32), group_size=32, symmetric=sym)
    pw = mg.repack(w, k_perm=True, k_split=split, k_pair=True)
    for m, cfg in [(3, mg.MgpuConfig(tile_m=64, compute_wgs=2, groups=1, split_k=2, pair=True)),
                   (20, mg.MgpuConfig(tile_m=64, compute_wgs=1, groups=2, tile_t=24, pair=True)),
                   (5, mg.MgpuConfig(tile_m=64, compute_wgs=2, groups=1, stream_k=True, pair=True))]:
        x = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)
        y = mg.mgpu_matmul(x, pw, cfg, num_sms=5, interpret=plgpu.InterpretGPUParams())
        assert y.shape == (m, 256)
        assert _rel(y, jnp.dot(x.astype(jnp.float32), dequantize(w))) < 1e-2


@pytest.mark.parametrize("k,n,m,split,stream", [(4096, 28672, 1, True, False), (4096, 6144, 16, False, False),
                                                (14336, 4096, 1, True, True)])
def test_paired_g32_lowers_for_h200(k, n, m, split, stream):
    """The register path of paired rows (perm loads, split or Mosaic's decode, each half scaled by `_halves`) lowers
    for an abstract H200 at 8B shapes with mins; among the g32 candidates are paired twins."""
    sds = jax.ShapeDtypeStruct
    cfg = mg.default_config(m, k, n, 32, 4, pair=True)
    cfg = dataclasses.replace(cfg, split_decode=split, **(dict(stream_k=True, split_k=1) if stream else {}))
    assert cfg.pair and mg.check_config(k, n, 32, 4, cfg) is None
    assert any(c.pair for c in mg.candidate_configs(m, k, n, 32, 4))
    w = mg.MgpuWeight(codes=sds((k // 64, n, 64), jnp.int4), scales=sds((k // 32, n), jnp.float16),
                      offsets=sds((k // 32, n), jnp.float16), group_size=32, bits=4, k_perm=True, k_split=split,
                      k_pair=True)
    with abstract_h200():
        txt = jax.jit(lambda x, w: mg.mgpu_matmul(x, w, cfg)).trace(
            sds((m, k), jnp.bfloat16), w).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in txt


@pytest.mark.parametrize("m", [1, 33])
@pytest.mark.parametrize("preset", ["qwen3-32b", "gemma2-27b-shape"])
def test_engine_configs_lower_for_27b_and_32b_shapes(preset, m):
    """Every decode matmul of the 27B / 32B presets (q, k, v fused; gate and up fused; the int8 head), on the
    configuration the engine runs for it (`kernels_mgpu.config_for`: a tuned entry, else `default_config`), at a
    decode row and at a tree of 32 + root, lowered for an abstract H200: a shape's bad tile fails here, not on the GPU."""
    from lucebox_jax import kernels_mgpu as km
    from lucebox_jax.synthetic import PRESETS, decode_matmuls

    sds = jax.ShapeDtypeStruct
    for label, k, n in decode_matmuls(PRESETS[preset]):
        g, bits = (32, 8) if label == "head" else (128, 4)
        cfg = km.config_for(m, k, n, g, bits)
        assert cfg is not None and mg.check_config(k, n, g, bits, cfg) is None, (k, n, g, bits)
        perm = cfg.loads == "perm" and mg.perm_ok(g, bits)
        w = mg.MgpuWeight(codes=sds((k // g, n, g), jnp.int4 if bits == 4 else jnp.int8),
                          scales=sds((k // g, n), jnp.float16), offsets=None, group_size=g, bits=bits,
                          k_perm=perm, k_split=perm and cfg.split_decode)
        with abstract_h200():
            txt = jax.jit(lambda x, w, cfg=cfg: mg.mgpu_matmul(x, w, cfg)).trace(
                sds((m, k), jnp.bfloat16), w).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in txt, (k, n, g, bits)


@pytest.mark.parametrize("cfg,n_parts", [(mg.MgpuConfig(tile_m=64, compute_wgs=2, groups=2, split_k=2), 2),
                                         (mg.MgpuConfig(tile_m=64, compute_wgs=1, groups=1, stream_k=True), 1),
                                         (mg.MgpuConfig(tile_m=64, compute_wgs=1, groups=1, split_k=1), 1)])
def test_parts_sum_to_the_product(cfg, n_parts):
    """parts=True (`quant.linear_parts`): split-K's float32 partials as written (rows past M are padding), else the
    product as one part (stream-K's partials summed first: its unwritten slots are not zeros)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    rng = np.random.default_rng(7)
    w = quantize_int4(rng.standard_normal((256, 128)).astype(np.float32), group_size=32, symmetric=False)
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
    kw = dict(num_sms=3, interpret=plgpu.InterpretGPUParams())
    (parts,) = mg.mgpu_matmul(x, mg.repack(w), cfg, parts=True, **kw)
    assert parts.shape[0] == n_parts and parts.shape[1] >= 3 and parts.shape[2] == 128
    y = mg.mgpu_matmul(x, mg.repack(w), cfg, **kw)
    total = jnp.sum(parts.astype(jnp.float32), axis=0)[:3]
    assert (np.asarray(total.astype(jnp.bfloat16)) == np.asarray(y)).all()


def test_scales_knob_keeps_a_weight_with_mins_in_its_own_dtype(monkeypatch):
    w = quantize_int4(np.random.default_rng(5).standard_normal((128, 64)).astype(np.float32), group_size=32,
                      symmetric=False)
    monkeypatch.setattr(mg, "BF16_SCALES", False)  # LUCEBOX_MGPU_SCALES=stored
    mw = mg.repack(w)
    assert mw.scales.dtype == mw.offsets.dtype == w.scales.dtype
    np.testing.assert_allclose(np.asarray(mg.dequantize_mgpu(mw)), np.asarray(dequantize(w)), rtol=1e-6,
                               atol=2.0 ** -11 * float(np.abs(np.asarray(dequantize(w))).max()) * 2)


@pytest.mark.parametrize("m", [1, 8, 33])
@pytest.mark.parametrize("preset", ["llama3-8b", "qwen3-32b", "gemma2-27b-shape"])
def test_engine_g32_configs_lower_on_the_weights_the_engine_stores(preset, m):
    """Int4 g32 with mins (a Q4_1 / Q4_K import), every decode matmul of the preset the table gives `mgpu`: the weight
    repacked as the engine stores it (`kernels_mgpu.abstract_weight` for the one-row configuration: paired rows where
    the table says `pair`, bf16 scales), each row count on the configuration the engine then runs (`config_for` with
    the weight's rows), lowered for an abstract H200."""
    from lucebox_jax import kernels_mgpu as km
    from lucebox_jax.synthetic import PRESETS, decode_matmuls

    sds = jax.ShapeDtypeStruct
    lowered = 0
    for label, k, n in decode_matmuls(PRESETS[preset]):
        entry = km.tuned_table().get(km.tuned_key(16, k, n, 32, 4))
        if label == "head" or not (entry and entry.get("default")):
            continue
        mw = km.abstract_weight(k, n, 32, 4, km.config_for(1, k, n, 32, 4))
        assert mw.scales.dtype == mw.offsets.dtype == jnp.bfloat16 and mw.k_pair == bool(entry["cfg"].get("pair"))
        cfg = km.config_for(m, k, n, 32, 4, pair=mw.k_pair)
        assert cfg is not None and cfg.pair == mw.k_pair and mg.check_config(k, n, 32, 4, cfg) is None, (label, cfg)
        with abstract_h200():
            txt = jax.jit(lambda x, w, cfg=cfg: mg.mgpu_matmul(x, w, cfg)).trace(
                sds((m, k), jnp.bfloat16), mw).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in txt, (label, k, n)
        lowered += 1
    assert lowered >= 2  # (the table gives every preset's g32 gate+up and down to mgpu)
