"""The `mgpu` kernel in the registry, on the CPU: it is refused here with the kernels that can run, and (with the
hardware check bypassed and the kernel in Mosaic GPU's interpreter) the engine repacks its weights once at build and
decodes through it the same tokens as the XLA kernels. Speed and the compiled register path need an H200
(`benchmarks/bench_mgpu.py`, `benchmarks/bench_decode.py --kernel-sets 'qmatmul=mgpu,qmatmul8=mgpu'`)."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lucebox_jax import kernels_mgpu, ops
from lucebox_jax.engine import Engine
from lucebox_jax.errors import UnknownKernelError
from lucebox_jax.ops import KernelSet
from lucebox_jax.quant import Int8Array, QuantArray, dequantize, linear, quantize_int4
from lucebox_jax.synthetic import PRESETS, random_weights
from pallas_kernels import mgpu_qmatmul as mg

CFG = PRESETS["tiny"]
MGPU = KernelSet(qmatmul="mgpu", qmatmul8="mgpu")


def test_refused_on_cpu_with_the_usable_kernels():
    for name in ("mgpu", "best"):
        assert name in ops.available("qmatmul") and name in ops.available("qmatmul8")
        with pytest.raises(UnknownKernelError) as e:
            KernelSet.resolve(f"qmatmul8={name}")
        msg = str(e.value)
        assert "Hopper" in msg and "xla" in msg and name not in msg.split("usable here:")[1]
    assert ops.default_name("qmatmul") not in ("mgpu", "best")


def test_best_repacks_only_shapes_measured_faster(monkeypatch):
    rng = np.random.default_rng(1)
    fast = quantize_int4(rng.standard_normal((128, 256)).astype(np.float32), group_size=32)
    slow = quantize_int4(rng.standard_normal((256, 128)).astype(np.float32), group_size=32)
    table = {kernels_mgpu.tuned_key(16, 128, 256, 32, 4): {"cfg": {}, "default": True},
             kernels_mgpu.tuned_key(16, 256, 128, 32, 4): {"cfg": {}, "default": False}}
    monkeypatch.setattr(kernels_mgpu, "tuned_table", lambda: table)
    assert isinstance(kernels_mgpu.prepare_best(fast), mg.MgpuWeight)
    assert kernels_mgpu.prepare_best(slow) is slow
    assert isinstance(kernels_mgpu.prepare(slow), mg.MgpuWeight)


@pytest.fixture
def interpreted(monkeypatch):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    for op in ("qmatmul", "qmatmul8"):
        monkeypatch.setitem(ops._USABLE, (op, "mgpu"), lambda: None)
    monkeypatch.setattr(kernels_mgpu, "INTERPRET", plgpu.InterpretGPUParams())


def test_prepare_repacks_what_tiles_and_linear_dispatches_it(interpreted):
    rng = np.random.default_rng(0)
    w = quantize_int4(rng.standard_normal((128, 256)).astype(np.float32), group_size=32)
    odd = quantize_int4(rng.standard_normal((128, 96)).astype(np.float32), group_size=32)  # N = 96: no CTA tile
    pw = kernels_mgpu.prepare(w)
    assert isinstance(pw, mg.MgpuWeight) and kernels_mgpu.prepare(odd) is odd
    x = jnp.asarray(rng.standard_normal((3, 128)), jnp.bfloat16)
    ref = np.asarray(jnp.dot(x.astype(jnp.float32), dequantize(w)))
    y = np.asarray(linear(x, pw, kernels=MGPU), np.float32)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-2
    y_odd = np.asarray(linear(x, odd, kernels=MGPU), np.float32)  # left in the engine format: the fallback kernel
    ref_odd = np.asarray(jnp.dot(x.astype(jnp.float32), dequantize(odd)))
    assert np.linalg.norm(y_odd - ref_odd) / np.linalg.norm(ref_odd) < 1e-2


def test_engine_decodes_through_mgpu_like_xla():
    """Run in a process of its own, with a time limit and up to three attempts: in three full-suite runs (2026-12-04,
    ninth session) Mosaic GPU's interpreter hung here with every simulated thread waiting and the CPU idle, once in a
    fresh process while the other test worker was busy; alone it passes in seconds. A hang (a timeout) is retried;
    a wrong result or an error fails at once. Alone it takes ~15 s on 2 cores: the 75 s limit bounds a hang's cost."""
    import os
    import subprocess
    import sys

    code = ("import test_kernels_mgpu as t, jax.experimental.pallas.mosaic_gpu as plgpu\n"
            "from lucebox_jax import kernels_mgpu, ops\n"
            "for op in ('qmatmul', 'qmatmul8'):\n"
            "    ops._USABLE[(op, 'mgpu')] = lambda: None\n"
            "kernels_mgpu.INTERPRET = plgpu.InterpretGPUParams()\n"
            "t._engine_decodes_through_mgpu_like_xla()\n"
            "print('ok')\n")
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])}
    for attempt in range(3):
        try:
            r = subprocess.run([sys.executable, "-c", code], cwd=here, env=env, capture_output=True, text=True,
                               timeout=75)
            break
        except subprocess.TimeoutExpired:
            if attempt == 2:
                raise
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def _engine_decodes_through_mgpu_like_xla():
    w = random_weights(CFG, jax.random.key(3), group_size=32, asymmetric=True)
    eng = Engine(CFG, w, MGPU)
    leaves = jax.tree_util.tree_leaves(eng.weights.layers, is_leaf=lambda t: isinstance(t, mg.MgpuWeight))
    assert any(isinstance(t, mg.MgpuWeight) for t in leaves)
    assert not any(isinstance(t, (QuantArray, Int8Array)) for t in leaves)
    assert isinstance(eng.weights.head, mg.MgpuWeight)
    ref = Engine(CFG, w, KernelSet())
    prompt = [[5, 17, 99, 3, 42, 7]]
    outs = []
    for e in (eng, ref):
        cache = e.new_cache(1, 64)
        last, _, cache = e.prefill(cache, prompt)
        outs.append(np.asarray(last))
    rel = np.linalg.norm(outs[0] - outs[1]) / np.linalg.norm(outs[1])
    assert rel < 2e-2, rel  # bf16 activations in the kernel against float32 XLA
    assert outs[0].argmax() == outs[1].argmax()


GPU_CASES = [(1, 4096, 28672, 128, 4, True), (1, 4096, 6144, 32, 4, False), (16, 14336, 4096, 128, 4, True),
             (64, 4096, 4096, 32, 4, False), (9, 4096, 6144, 128, 4, True), (1, 4096, 128256, 32, 8, True),
             # a tree of 32 and its root, padded to 40 rows (the 16-row entries' schedules: WIDE_FROM_16)
             (40, 4096, 28672, 128, 4, True), (40, 14336, 4096, 128, 4, True), (40, 4096, 6144, 128, 4, True),
             (40, 4096, 4096, 128, 4, True),
             # groups of 32 past 32 rows: 40- and 48-token tiles (gate+up widened from its 16-row entry; the head's own)
             (40, 4096, 28672, 32, 4, False), (40, 4096, 128256, 32, 8, True)]


def test_wider_rows_take_the_16_row_entry(monkeypatch):
    """By default (LUCEBOX_MGPU_WIDE unset), rows past 16 with no tuned entry of their own run the 16-row entry's
    tiles and schedule with their own token tile (LUCEBOX_MGPU_WIDE=0: default_config's untuned split-K); a bucket with
    its own entry keeps it."""
    assert kernels_mgpu.WIDE_FROM_16 == (os.environ.get("LUCEBOX_MGPU_WIDE", "1") != "0")
    monkeypatch.setattr(kernels_mgpu, "WIDE_FROM_16", True)
    monkeypatch.setattr(mg, "TOKEN_TILES", "")  # (whatever LUCEBOX_MGPU_TIGHT says)
    for k, n in ((4096, 28672), (14336, 4096), (4096, 6144), (4096, 4096)):
        c16 = kernels_mgpu.config_for(16, k, n, 128, 4)
        assert kernels_mgpu.config_for(40, k, n, 128, 4) == dataclasses.replace(c16, tile_t=40)
        assert kernels_mgpu.config_for(48, k, n, 128, 4) == dataclasses.replace(c16, tile_t=48)
        assert kernels_mgpu.config_for(20, k, n, 128, 4) == dataclasses.replace(c16, tile_t=32)
    head48 = kernels_mgpu.tuned_table()["m48_k4096_n128256_g32_b8"]["cfg"]
    assert kernels_mgpu.config_for(40, 4096, 128256, 32, 8).tile_t == head48["tile_t"] == 48  # its own entry
    monkeypatch.setattr(kernels_mgpu, "WIDE_FROM_16", False)
    assert kernels_mgpu.config_for(40, 4096, 28672, 128, 4) == kernels_mgpu.with_decode(
        mg.default_config(40, 4096, 28672, 128, 4), 4096, 28672, 128, 4)


def test_an_entry_never_splits_its_rows_into_more_token_tiles(monkeypatch):
    """A bucket's entry timed at fewer rows than the bucket holds (a sweep at 40 rows writes the 48-row entry with a
    40-token tile) runs 41-48 rows in one 48-token tile, not two tiles that would stream the weight twice; a wider
    tile than needed (the head's 48 at 40 rows) stays."""
    monkeypatch.setattr(mg, "TOKEN_TILES", "")
    cfg = mg.MgpuConfig(tile_m=128, tile_t=40, groups=1, split_k=2)
    table = {kernels_mgpu.tuned_key(48, 4096, 28672, 128, 4): {"cfg": dataclasses.asdict(cfg)},
             kernels_mgpu.tuned_key(48, 4096, 6144, 128, 4): {"cfg": dataclasses.asdict(
                 dataclasses.replace(cfg, tile_t=48))}}
    monkeypatch.setattr(kernels_mgpu, "tuned_table", lambda: table)
    assert kernels_mgpu.config_for(40, 4096, 28672, 128, 4).tile_t == 40
    assert kernels_mgpu.config_for(45, 4096, 28672, 128, 4).tile_t == 48
    assert kernels_mgpu.config_for(40, 4096, 6144, 128, 4).tile_t == 48


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,g,bits,sym", GPU_CASES)
def test_compiled_mgpu_matches_reference_on_hopper(m, k, n, g, bits, sym):
    """The registered op, compiled, on Llama-3-8B shapes (the layer shapes, the int8 head) and decode / verify /
    small-batch row counts, against the float32 product of the engine's own dequantization."""
    if kernels_mgpu.hopper_reason():
        pytest.skip(kernels_mgpu.hopper_reason())
    from lucebox_jax.quant import quantize_int8

    rng = np.random.default_rng(m + n)
    wd = (rng.standard_normal((k, n)) * k ** -0.5).astype(np.float32)
    w = quantize_int4(wd, group_size=g, symmetric=sym) if bits == 4 else quantize_int8(wd, group_size=g)
    pw = kernels_mgpu.prepare(w)
    assert isinstance(pw, mg.MgpuWeight)  # `mgpu` repacks every shape it tiles
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    op = ops.get("qmatmul" if bits == 4 else "qmatmul8", "mgpu")
    y = np.asarray(jax.jit(op)(x, pw), np.float32)
    ref = np.asarray(jnp.dot(x.astype(jnp.float32), dequantize(w)))
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("loads", mg.LOADS)
@pytest.mark.parametrize("m,k,n,g,bits,sym", [(1, 4096, 28672, 128, 4, True), (16, 4096, 6144, 64, 4, False),
                                              (1, 4096, 4096, 32, 4, False), (9, 4096, 128256, 32, 8, True)])
def test_every_load_path_matches_reference_on_hopper(loads, m, k, n, g, bits, sym):
    """Each way of bringing codes into wgmma's registers (`mg.LOADS`; `perm` on a K-permuted weight where the group
    allows it, else the path it falls back to), compiled, against the float32 product."""
    if kernels_mgpu.hopper_reason():
        pytest.skip(kernels_mgpu.hopper_reason())
    import dataclasses

    from lucebox_jax.quant import quantize_int8

    rng = np.random.default_rng(m + n + g)
    wd = (rng.standard_normal((k, n)) * k ** -0.5).astype(np.float32)
    w = quantize_int4(wd, group_size=g, symmetric=sym) if bits == 4 else quantize_int8(wd, group_size=g)
    pw = mg.repack(w, k_perm=loads == "perm" and mg.perm_ok(g, bits))
    cfg = dataclasses.replace(mg.default_config(m, k, n, g, bits), loads=loads)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    y = np.asarray(jax.jit(lambda x, w: mg.mgpu_matmul(x, w, cfg))(x, pw), np.float32)
    ref = np.asarray(jnp.dot(x.astype(jnp.float32), dequantize(w)))
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,g,bits,sym", [(1, 4096, 28672, 128, 4, True), (1, 14336, 4096, 128, 4, True),
                                              (16, 4096, 6144, 128, 4, True), (1, 4096, 4096, 32, 4, False),
                                              (33, 4096, 28672, 128, 4, True), (1, 4096, 128256, 32, 8, True)])
def test_stream_k_matches_reference_on_hopper(m, k, n, g, bits, sym):
    """The stream-K schedule, compiled, on the 8B shapes and the int8 head (tiles cut between CTAs, partials summed),
    against the float32 product."""
    if kernels_mgpu.hopper_reason():
        pytest.skip(kernels_mgpu.hopper_reason())
    import dataclasses

    from lucebox_jax.quant import quantize_int8

    rng = np.random.default_rng(m + n + k)
    wd = (rng.standard_normal((k, n)) * k ** -0.5).astype(np.float32)
    w = quantize_int4(wd, group_size=g, symmetric=sym) if bits == 4 else quantize_int8(wd, group_size=g)
    perm = mg.perm_ok(g, bits)
    pw = mg.repack(w, k_perm=perm)
    cfg = dataclasses.replace(mg.default_config(m, k, n, g, bits), split_k=1, stream_k=True, loads="perm",
                              scale_after=sym and bits == 4)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    y = np.asarray(jax.jit(lambda x, w: mg.mgpu_matmul(x, w, cfg))(x, pw), np.float32)
    ref = np.asarray(jnp.dot(x.astype(jnp.float32), dequantize(w)))
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-2


def _check_compiled(w, pw, cfg, rng, m: int, stream: bool):
    """The compiled kernel on `pw` (stream-K if asked) against the float32 product of `w`, M random rows."""
    if stream:
        cfg = dataclasses.replace(cfg, split_k=1, stream_k=True)
    k = w.shape[0]
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    y = np.asarray(jax.jit(lambda x, w: mg.mgpu_matmul(x, w, cfg))(x, pw), np.float32)
    ref = np.asarray(jnp.dot(x.astype(jnp.float32), dequantize(w)))
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,stream", [(1, 4096, 28672, False), (1, 14336, 4096, True), (16, 4096, 6144, False),
                                          (1, 4096, 4096, False), (33, 4096, 28672, False)])
def test_split_decode_matches_reference_on_hopper(m, k, n, stream):
    """`split_decode` compiled (`_decode_split`'s inline PTX: the interpreter stages the codes instead), int4 g128
    symmetric on the 8B shapes, against the float32 product."""
    if kernels_mgpu.hopper_reason():
        pytest.skip(kernels_mgpu.hopper_reason())

    rng = np.random.default_rng(m + n + k + 1)
    w = quantize_int4((rng.standard_normal((k, n)) * k ** -0.5).astype(np.float32), group_size=128, symmetric=True)
    pw = mg.repack(w, k_perm=True, k_split=True)
    cfg = dataclasses.replace(mg.default_config(m, k, n, 128, 4), loads="perm", scale_after=True, split_decode=True)
    _check_compiled(w, pw, cfg, rng, m, stream)


@pytest.mark.parametrize("decode", ["split", "cast"])
def test_decode_knob_repacks_in_the_split_order(monkeypatch, interpreted, decode):
    """LUCEBOX_MGPU_DECODE (`kernels_mgpu.DECODE`; split the default): with `split` the configurations that take
    `split_decode` get it and the weight is repacked in the split order (others, e.g. g32, are left as they were);
    `cast` keeps the plain perm order, also over a table's entry. The engine's linear through it (interpreted) still
    gives the product."""
    assert kernels_mgpu.DECODE == "split" or os.environ.get("LUCEBOX_MGPU_DECODE")
    monkeypatch.setattr(kernels_mgpu, "DECODE", decode)
    rng = np.random.default_rng(3)
    w = quantize_int4(rng.standard_normal((256, 128)).astype(np.float32), group_size=64, symmetric=True)
    table = {kernels_mgpu.tuned_key(16, 256, 128, 64, 4): {"cfg": {"tile_m": 64, "compute_wgs": 2, "groups": 2,
                                                                   "scale_after": True, "split_decode": True},
                                                           "default": True}}  # (the knob overrides a table's)
    monkeypatch.setattr(kernels_mgpu, "tuned_table", lambda: table)
    cfg, g32 = kernels_mgpu.config_for(1, 256, 128, 64, 4), kernels_mgpu.config_for(1, 256, 128, 32, 4)
    assert cfg.split_decode == (decode == "split")
    assert not g32.split_decode  # g32: no perm loads, no split order
    pw = kernels_mgpu.prepare(w)
    assert pw.k_perm and pw.k_split == (decode == "split")
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
    y = np.asarray(linear(x, pw, kernels=MGPU), np.float32)
    ref = np.asarray(jnp.dot(x.astype(jnp.float32), dequantize(w)))
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-2


def test_a_paired_entry_repacks_g32_in_pairs_and_every_row_count_follows(monkeypatch, interpreted):
    """A table entry with `pair` (int4 g32) repacks the weight two groups a row; the engine's configuration for any
    row count then pairs too (the kernel follows the weight), its own entry or not; the linear (interpreted) gives
    the product. Without the entry nothing pairs."""
    rng = np.random.default_rng(5)
    w = quantize_int4(rng.standard_normal((256, 128)).astype(np.float32), group_size=32)
    assert not kernels_mgpu.prepare(w).k_pair
    table = {kernels_mgpu.tuned_key(16, 256, 128, 32, 4): {"cfg": {"tile_m": 64, "compute_wgs": 2, "groups": 1,
                                                                   "pair": True}, "default": True}}
    monkeypatch.setattr(kernels_mgpu, "tuned_table", lambda: table)
    pw = kernels_mgpu.prepare(w)
    assert pw.k_pair and pw.k_perm and pw.k_split == (kernels_mgpu.DECODE == "split")
    for m in (1, 3, 40):
        cfg = kernels_mgpu.config_for(m, 256, 128, 32, 4, pair=True)
        assert cfg.pair and mg.check_config(256, 128, 32, 4, cfg) is None
    for m in (3, 40):
        x = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)
        y = np.asarray(linear(x, pw, kernels=MGPU), np.float32)
        ref = np.asarray(jnp.dot(x.astype(jnp.float32), dequantize(w)))
        assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,split,stream", [(1, 4096, 28672, True, False), (1, 4096, 6144, True, False),
                                                (16, 4096, 4096, False, False), (1, 14336, 4096, True, True),
                                                (40, 4096, 28672, True, False), (9, 4096, 128256, True, False)])
def test_paired_g32_matches_reference_on_hopper(m, k, n, split, stream):
    """Int4 g32 with mins (Q4_1 / Q4_K imports) stored two groups a row (`pair`): the compiled register path (perm
    loads, split or Mosaic's decode, each half scaled by `_halves`, which the interpreter does in jnp) against the
    float32 product on 8B shapes."""
    if kernels_mgpu.hopper_reason():
        pytest.skip(kernels_mgpu.hopper_reason())

    rng = np.random.default_rng(m + n + k + 2)
    w = quantize_int4((rng.standard_normal((k, n)) * k ** -0.5).astype(np.float32), group_size=32)
    pw = mg.repack(w, k_perm=True, k_split=split, k_pair=True)
    cfg = dataclasses.replace(mg.default_config(m, k, n, 32, 4, pair=True), split_decode=split)
    _check_compiled(w, pw, cfg, rng, m, stream)


def test_best_is_the_hopper_default_only():
    """`best` is consulted first on sm_90 (`gpu:sm90`), while a GPU of another generation keeps Pallas-Triton."""
    assert kernels_mgpu.HOPPER_DEFAULT
    for op in ("qmatmul", "qmatmul8"):
        assert ops._DEFAULTS["gpu:sm90"][op] == "best"
        assert ops._DEFAULTS["gpu"][op] != "best"
        assert ops.default_name(op) in ("xla", "pallas")  # this CPU: unchanged


def test_configs_that_hung_or_have_no_path_are_refused():
    """4 compute warpgroups hung on the H200; the dequantized tile staged in shared memory on `perm` loads (paired g32
    rows included) failed to lower for an abstract H200 (2026-12-06, thirtieth session: a transpose); `perm` asked of a
    plain weight runs the `narrow` path."""
    cfg = mg.MgpuConfig(tile_m=64, compute_wgs=4, groups=1)
    assert "compute_wgs" in mg.check_config(4096, 28672, 128, 4, cfg)
    assert "lhs_smem" in mg.check_config(4096, 6144, 128, 4, mg.MgpuConfig(loads="perm", lhs_smem=True))
    assert "lhs_smem" in mg.check_config(4096, 6144, 32, 4, mg.MgpuConfig(loads="perm", pair=True, lhs_smem=True))
    assert mg.check_config(4096, 6144, 128, 4, mg.MgpuConfig(loads="narrow", lhs_smem=True)) is None
    sds = jax.ShapeDtypeStruct
    plain = mg.MgpuWeight(codes=sds((128, 256, 32), jnp.int8), scales=sds((128, 256), jnp.float16), offsets=None,
                          group_size=32, bits=8)
    assert mg.load_mode(mg.MgpuConfig(loads="perm"), plain) == "narrow"
    assert mg.load_mode(mg.MgpuConfig(loads="wide"), plain) == "wide"


def test_engine_calls_of_one_shape_lower_once():
    """The registered op puts the kernel behind a nested jit, so the layers' calls of one shape are traced and lowered
    once (a per-layer lowering cost seconds per call site in an 8B step's compile)."""
    import sys

    sys.path.insert(0, "tests")
    from test_pallas_lowering import abstract_h200

    sds = jax.ShapeDtypeStruct
    k, n, g = 4096, 4096, 128
    w = mg.MgpuWeight(codes=sds((k // g, n, g), jnp.int4), scales=sds((k // g, n), jnp.float16), offsets=None,
                      group_size=g, bits=4, k_perm=True)

    def kernels_in(n_layers):
        def layers(x, w):
            for _ in range(n_layers):
                x = kernels_mgpu.qmatmul_mgpu_op(x, w)
            return x

        with abstract_h200():
            txt = jax.jit(layers).trace(sds((1, k), jnp.bfloat16), w).lower(lowering_platforms=("cuda",)).as_text()
        return txt.count("stablehlo.custom_call @mosaic_gpu_v2")

    assert kernels_in(12) == kernels_in(4) <= 2  # (the first call, on the jit's own argument, may lower apart)


def test_tuned_table_knob_reads_another_table(tmp_path):
    """LUCEBOX_MGPU_TUNED (read at import) points the engine at another table (the step A/Bs of
    `gpu_mgpu_probe.sh TABLE_AB`): a changed entry is the configuration the engine picks; without it, the shipped one."""
    import json
    import subprocess
    import sys

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    table = json.load(open(kernels_mgpu.TUNED))
    key = kernels_mgpu.tuned_key(16, 4096, 28672, 128, 4)
    table[key]["cfg"].update(steps=7, stream_k=False, split_k=2)
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    code = ("from lucebox_jax import kernels_mgpu as k; c = k.config_for(1, 4096, 28672, 128, 4); "
            "print(c.steps, c.stream_k, c.split_k)")
    env = {kk: v for kk, v in os.environ.items() if kk != "LUCEBOX_MGPU_TUNED"}
    shipped = subprocess.run([sys.executable, "-c", code], cwd=here, env=env, capture_output=True, text=True,
                             timeout=120)
    other = subprocess.run([sys.executable, "-c", code], cwd=here, env={**env, "LUCEBOX_MGPU_TUNED": str(path)},
                           capture_output=True, text=True, timeout=120)
    assert other.stdout.split() == ["7", "False", "2"], other.stderr[-500:]
    assert shipped.stdout.split() and shipped.stdout.split() != ["7", "False", "2"], shipped.stderr[-500:]
