"""Pallas kernels (interpret mode on the CPU) against their plain-jnp references and against the `xla` kernels.

Fresh random inputs every case (never zeros), shapes that are not multiples of the block sizes, ragged per-row
lengths / start offsets, GQA groups 1, 3 (SmolLM2: Hq=9, Hkv=3, D=64) and 4, M = 1, 3, 16, 40.
Relative-error bounds ||out - ref|| / ||ref||:
  float32: 2e-5 (observed ~3e-7: float32 arithmetic, different summation order)
  bfloat16: 2e-2 (observed 1e-3..7e-3: bf16 inputs/outputs, bf16 rounding of the dequantized weight / of P)
The `gpu`-marked checks run the compiled kernels and are skipped unless jax.default_backend() == "gpu".
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from lucebox_jax import kernels_xla, ops
from lucebox_jax.quant import Int8Array, QuantArray
from pallas_kernels.attention_decode import attention_decode, attention_decode_reference
from pallas_kernels.attention_prefill import attention_prefill, attention_prefill_reference
from pallas_kernels.attention_tree import attention_tree, attention_tree_reference
from pallas_kernels.int4_matmul import int4_matmul, int4_matmul_reference
from pallas_kernels.int8_matmul import int8_matmul, int8_matmul_reference

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")


def rel(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite output"
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def rand_quant(rng, k, n, g, sym):
    codes = rng.integers(0, 256, (k // 2, n), dtype=np.uint8)
    scales = (rng.uniform(0.5, 1.5, (k // g, n)) * 0.02).astype(np.float16)
    mins = None if sym else (rng.standard_normal((k // g, n)) * 0.1).astype(np.float16)
    return QuantArray(
        codes=jnp.asarray(codes), scales=jnp.asarray(scales), mins=None if sym else jnp.asarray(mins), group_size=g
    )


def test_registered():
    assert "pallas" in ops.available("qmatmul")
    assert "pallas" in ops.available("attention_decode")
    assert "pallas" in ops.available("attention_prefill")
    assert ops.default_name("qmatmul", "cpu") == "xla"
    assert ops.default_name("attention_decode", "cpu") == "xla"
    assert "pallas" in ops.available("qmatmul8") and ops.default_name("qmatmul8", "cpu") == "xla"


# ------------------------------------------------------------------------------------------------ int4 matmul
QCASES = [  # M, K, N, group, symmetric, dtype
    (1, 256, 96, 32, False, jnp.float32),
    (3, 256, 80, 128, True, jnp.bfloat16),
    (16, 512, 144, 32, True, jnp.float32),
    (40, 256, 48, 32, False, jnp.bfloat16),
]


@pytest.mark.parametrize("m,k,n,g,sym,dt", QCASES)
def test_qmatmul_registered(m, k, n, g, sym, dt):
    rng = np.random.default_rng(hash((m, k, n, g, sym)) % 2**32)
    w = rand_quant(rng, k, n, g, sym)
    x = jnp.asarray(rng.standard_normal((m, k)), dt)
    y = ops.get("qmatmul", "pallas")(x, w)
    assert y.shape == (m, n) and y.dtype == x.dtype
    ref = int4_matmul_reference(x, w.codes, w.scales, w.mins, group_size=g)
    assert rel(y, ref) < TOL[dt]
    assert rel(y, kernels_xla.qmatmul_xla(x, w)) < TOL[dt]


@pytest.mark.parametrize(
    "m,dt,kw",
    [
        (1, jnp.float32, dict(mode="fma", block_n=32, block_k=16, split_k=3)),  # 8 tiles over 3 splits: ragged
        (3, jnp.bfloat16, dict(decode="asm", block_n=64, split_k=2)),  # asm decode, emulated in interpret mode
    ],
)
def test_qmatmul_variants(m, dt, kw):
    rng = np.random.default_rng(7 + m)
    k, n, g = 256, 72, 32
    w = rand_quant(rng, k, n, g, False)
    x = jnp.asarray(rng.standard_normal((m, k)), dt)
    y = int4_matmul(x, w.codes, w.scales, w.mins, group_size=g, interpret=True, **kw)
    ref = int4_matmul_reference(x, w.codes, w.scales, w.mins, group_size=g)
    assert rel(y, ref) < TOL[dt]
    assert rel(y, kernels_xla.qmatmul_xla(x, w)) < TOL[dt]


# the qsweep2 knobs: block_k > g with [block_k/g, block_n] scale tiles broadcast in registers, atomic split-K,
# the transposed dot, per-step-reduced FMA; N ragged (masked) or a multiple of block_n (unmasked), ragged splits
QV2 = [  # M, K, N, g, symmetric, dtype, knobs
    (1, 512, 80, 32, False, jnp.float32, dict(mode="fma", block_k=128, block_n=32, reduce="atomic", split_k=2)),
    (1, 512, 80, 32, True, jnp.bfloat16, dict(mode="fma_r", block_k=64, block_n=64, decode="asm", split_k=3)),
    (1, 1024, 128, 128, True, jnp.float32, dict(mode="dot_t", block_k=256, block_n=64, reduce="atomic", split_k=2)),
    (5, 512, 128, 32, False, jnp.bfloat16, dict(block_k=128, block_n=64, decode="asm", reduce="atomic",
                                                num_warps=8, min_programs=16)),
    (16, 512, 48, 32, False, jnp.float32, dict(mode="dot_t", block_k=64, block_n=32, split_k=2)),
    (3, 512, 80, 32, True, jnp.float32, dict(block_k=64, block_n=32, scales_mode="gather", split_k=2)),
    (1, 1024, 80, 128, True, jnp.bfloat16, dict(mode="fma", decode="asm_fma", block_k=128, block_n=32, split_k=3)),
    (2, 512, 64, 32, False, jnp.bfloat16, dict(mode="fma", decode="asm_fma", block_k=64, block_n=32)),  # -> dot
]


@pytest.mark.parametrize("m,k,n,g,sym,dt,kw", QV2)
def test_qmatmul_variants_v2(m, k, n, g, sym, dt, kw):
    rng = np.random.default_rng(m * 1000 + k + n + g)
    w = rand_quant(rng, k, n, g, sym)
    x = jnp.asarray(rng.standard_normal((m, k)), dt)
    y = int4_matmul(x, w.codes, w.scales, w.mins, group_size=g, interpret=True, **kw)
    assert y.shape == (m, n) and y.dtype == x.dtype
    ref = int4_matmul_reference(x, w.codes, w.scales, w.mins, group_size=g)
    assert rel(y, ref) < TOL[dt]


def test_qmatmul_tuned_table(tmp_path, monkeypatch):
    import json

    from pallas_kernels import int4_matmul as mm

    path = tmp_path / "int4_tuned.json"
    ent = {mm.tuned_key(1, 4096, 6144, 32, False): dict(block_k=128, block_n=64, mode="fma", decode="asm",
                                                          reduce="atomic", us=9.9, variant="x"),
           mm.tuned_key(8, 4096, 6144, 128, True): dict(block_k=128, block_n=256, num_warps=8)}
    path.write_text(json.dumps({"version": 1, "entries": ent}))
    monkeypatch.setenv("LUCEBOX_INT4_TUNED", str(path))
    assert mm.tuned_key(16, 1, 2, 32, True) == "16:1:2:32:sym" and mm.tuned_key(65, 1, 2, 32, True) is None
    c = mm.default_config(1, 4096, 6144, 32, jnp.bfloat16, on_gpu=True, symmetric=False)
    assert (c["block_k"], c["block_n"], c["mode"], c["decode"], c["reduce"]) == (128, 64, "fma", "asm", "atomic")
    assert "us" not in c and "variant" not in c
    assert mm.default_config(1, 4096, 6144, 32, jnp.float32, on_gpu=True, symmetric=False)["decode"] == "f32"
    assert mm.default_config(3, 4096, 6144, 128, on_gpu=True, symmetric=True)["block_n"] == 256  # bucket <= 16
    heur = mm.default_config(1, 4096, 6144, 32, on_gpu=True, symmetric=True)  # not in the table: heuristics
    assert heur["mode"] == "fma" and "reduce" not in heur
    assert mm.default_config(1, 4096, 6144, 32, on_gpu=False, symmetric=False)["decode"] == "f32"  # CPU: no table
    monkeypatch.setenv("LUCEBOX_INT4_TUNED", "off")
    assert "reduce" not in mm.default_config(1, 4096, 6144, 32, on_gpu=True, symmetric=False)
    monkeypatch.setenv("LUCEBOX_INT4_TUNED", str(tmp_path / "missing.json"))
    assert "reduce" not in mm.default_config(1, 4096, 6144, 32, on_gpu=True, symmetric=False)


def test_small_weights_split_one_k_tile_a_program_by_rows_and_width():
    """Small weights (the embedded model's): one K tile a program up to 16 rows; at 17-64 rows (a speculative tree's
    verify, a batch job's) only for outputs up to SMALL_SPLIT_MAX_N wide, as measured at 33 rows on the GPU; big
    weights never take this heuristic, and the CPU never does."""
    from pallas_kernels import int4_matmul as mm

    shapes = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
    for name, (k, n) in shapes.items():
        assert mm.default_config(1, k, n, 32, on_gpu=True)["split_k"] == mm.SPLIT_ALL
        c33 = mm.default_config(33, k, n, 32, on_gpu=True)
        assert c33["block_m"] == 64 and (c33["split_k"] == mm.SPLIT_ALL) == (name != "gate_up"), name
        assert mm.default_config(33, k, n, 32, on_gpu=False)["split_k"] is None
    assert mm.default_config(33, 16384, 1024, 32, on_gpu=True)["split_k"] is None  # 8 MB: not small


# ------------------------------------------------------------------------------------------------ decode attention
DCASES = [  # B, Hq, Hkv, S, D, lengths, dtype, knobs
    (3, 9, 3, 100, 64, [1, 37, 100], jnp.float32, dict(block_k=32, min_programs=32)),  # SmolLM2 heads, 4 splits
    (2, 8, 2, 80, 32, [80, 17], jnp.bfloat16, dict(block_k=32, n_split=2)),  # G = 4
    (2, 2, 2, 48, 32, [5, 48], jnp.float32, dict(block_k=16, n_split=1)),  # G = 1, single split
]


@pytest.mark.parametrize("b,hq,hkv,s,d,lens,dt,kw", DCASES)
def test_attention_decode(b, hq, hkv, s, d, lens, dt, kw):
    rng = np.random.default_rng(s + hq)
    q = jnp.asarray(rng.standard_normal((b, hq, d)), dt)
    k = jnp.asarray(rng.standard_normal((b, hkv, s, d)), dt)
    v = jnp.asarray(rng.standard_normal((b, hkv, s, d)), dt)
    lengths = jnp.asarray(lens, jnp.int32)
    scale = d**-0.5
    y = attention_decode(q, k, v, lengths, scale=scale, interpret=True, **kw)
    assert y.shape == q.shape and y.dtype == q.dtype
    assert rel(y, attention_decode_reference(q, k, v, lengths, scale=scale)) < TOL[dt]
    assert rel(y, kernels_xla.attention_decode_xla(q, k, v, lengths, scale=scale)) < TOL[dt]


def test_attention_decode_default_config_few_rows(monkeypatch):
    """Few (row, kv head) pairs get one 32-key tile a program (as many splits as tiles), without Triton's pipeline
    at D >= 128; more pairs loop over 32-key tiles (64 at D < 128, past a 4k cache or in a verify's mapped rows);
    the row-invariant mode decides as for one row; and the one-tile-a-program configuration computes the reference."""
    from pallas_kernels import attention_decode as ad

    monkeypatch.delenv("LUCEBOX_ATTN_DECODE", raising=False)
    one = ad.default_config(1, 8, 1280, 128)
    assert (one["block_k"], one["n_split"], one["num_stages"]) == (32, 40, 1)
    assert ad.default_config(1, 3, 1280, 64)["num_stages"] == 3  # the embedded shapes kept Triton's pipeline
    assert ad.default_config(1, 8, 4096, 128)["n_split"] is None  # a long cache: the looped tiles (not measured)
    many = ad.default_config(8, 8, 1280, 128)
    assert (many["block_k"], many["n_split"], many["num_stages"]) == (32, None, 3)  # 8B batch 8: 32-key tiles ...
    assert ad.default_config(8, 8, 8192, 128)["block_k"] == 64  # ... up to a 4k cache
    assert ad.default_config(32, 3, 1280, 64)["block_k"] == 64  # ... at D >= 128 (the embedded shapes keep 64)
    assert ad.default_config(72, 8, 1280, 128, mapped_rows=True)["block_k"] == 64  # ... not in a verify's rows
    assert ad.default_config(8, 8, 1280, 128, row_invariant=True)["n_split"] == 40
    monkeypatch.setenv("LUCEBOX_ATTN_DECODE", "block_k=64,n_split=10,num_stages=3")  # the old batch-1 choice
    assert ad.default_config(1, 8, 1280, 128)["block_k"] == 64
    rng = np.random.default_rng(11)
    q = jnp.asarray(rng.standard_normal((1, 9, 64)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, 3, 100, 64)), jnp.float32) for _ in range(2))
    lengths = jnp.asarray([77], jnp.int32)
    kw = {key: one[key] for key in ("block_k", "num_stages")} | {"n_split": ad._cdiv(100, 32), "combine": "kernel"}
    y = attention_decode(q, k, v, lengths, scale=0.125, interpret=True, **kw)
    assert rel(y, attention_decode_reference(q, k, v, lengths, scale=0.125)) < TOL[jnp.float32]


@pytest.mark.parametrize("b,hq,hkv,s,d,lens,dt,kw", DCASES[:2] + [(2, 8, 2, 80, 32, [80, 0], jnp.float32,
                                                                      dict(block_k=16, n_split=5))])
def test_attention_decode_combine_kernel(b, hq, hkv, s, d, lens, dt, kw):
    """combine="kernel" (the splits merged by a second Pallas kernel) against the jnp merge of the same partials;
    a row that sees no key gives zeros either way."""
    rng = np.random.default_rng(s + hq + 1)
    q = jnp.asarray(rng.standard_normal((b, hq, d)), dt)
    k, v = (jnp.asarray(rng.standard_normal((b, hkv, s, d)), dt) for _ in range(2))
    lengths = jnp.asarray(lens, jnp.int32)
    got = attention_decode(q, k, v, lengths, scale=d**-0.5, interpret=True, combine="kernel", **kw)
    want = attention_decode(q, k, v, lengths, scale=d**-0.5, interpret=True, combine="xla", **kw)
    assert got.dtype == q.dtype and rel(got, want) < TOL[dt] / 10
    assert rel(got[lengths > 0], attention_decode_reference(q, k, v, lengths, scale=d**-0.5)[lengths > 0]) < TOL[dt]
    assert not np.asarray(got[lengths == 0]).any()


APPEND_CASES = [  # B, Hq, Hkv, S, D, lengths (the new slot is lengths - 1), knobs
    (1, 9, 3, 256, 64, [7], {}),  # SmolLM2 heads, batch 1
    (3, 8, 2, 128, 32, [1, 64, 130], {}),  # slot 0; a split boundary; past the cache (clamped as a DUS clamps)
    (2, 4, 4, 512, 64, [300, 512], dict(n_split=4, combine="kernel")),  # 4 splits merged by the kernel
    (2, 4, 2, 64, 16, [0, -3], {}),  # starts below 0 (a DUS counts them from the end)
    (1, 9, 3, 512, 64, [300], dict(n_split=1, block_k=128)),  # one split of 128-key tiles
]


def _append_case(b, hq, hkv, s, d, lens, seed):
    rng = np.random.default_rng(seed)
    q, k_new, v_new = (jnp.asarray(rng.standard_normal((b, h, d)), jnp.bfloat16) for h in (hq, hkv, hkv))
    k, v = (jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.bfloat16) for _ in range(2))
    return q, k_new, v_new, k, v, jnp.asarray(lens, jnp.int32)


def _check_append(b, hq, hkv, s, d, lens, kw, interpret):
    """append=True (the step's own K/V written by the kernel) is bitwise the cache written by XLA's
    dynamic-update-slice (kernels_xla.write_kv, the model's write) and then attended."""
    q, k_new, v_new, k, v, lengths = _append_case(b, hq, hkv, s, d, lens, s + hq)
    kc, vc = kernels_xla.write_kv(k, k_new[:, None], lengths - 1), kernels_xla.write_kv(v, v_new[:, None], lengths - 1)
    want = attention_decode(q, kc, vc, lengths, scale=d**-0.5, interpret=interpret, **kw)
    fn = jax.jit(lambda q, k, v, L: attention_decode(q, k, v, L, scale=d**-0.5, interpret=interpret, append=True,
                                                     **kw), donate_argnums=(1, 2))
    out, k2, v2 = fn(jnp.concatenate([q, k_new, v_new], axis=1), k, v, lengths)
    assert (np.asarray(k2) == np.asarray(kc)).all() and (np.asarray(v2) == np.asarray(vc)).all()
    assert (np.asarray(out) == np.asarray(want)).all()


@pytest.mark.parametrize("b,hq,hkv,s,d,lens,kw", APPEND_CASES)
def test_attention_decode_append_is_write_then_attend(b, hq, hkv, s, d, lens, kw):
    _check_append(b, hq, hkv, s, d, lens, kw, interpret=True)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,s,d,lens,kw", APPEND_CASES)
def test_attention_decode_append_gpu(b, hq, hkv, s, d, lens, kw):
    _check_append(b, hq, hkv, s, d, lens, kw, interpret=False)


WINDOW_CASES = [  # B, T, Hq, Hkv, S, D, window starts, knobs
    (1, 5, 9, 3, 256, 64, [7], {}),  # SmolLM2 heads, a chain verify of K + 1 = 5 at batch 1
    (2, 3, 8, 2, 128, 32, [0, 62], {}),  # a window from slot 0; one across a 64-key tile
    (2, 4, 4, 4, 512, 64, [300, 508], dict(n_split=4, combine="kernel")),  # 4 splits; the window ends the cache
    (3, 2, 4, 2, 64, 16, [5, 20, 63], {}),  # past the cache: placed as a dynamic-update-slice clamps T rows
    (1, 5, 9, 3, 256, 64, [100], dict(n_split=1, block_k=128)),  # one split (LUCEBOX_ATTN_DECODE's A/B knob)
]


def _check_window(b, t, hq, hkv, s, d, starts, kw, interpret, pack=False):
    """append=True with rows and window_rows=T (a verify of T positions as B * T decode rows): the caches equal XLA's
    write of the window (kernels_xla.write_kv), and each row's output equals attending to that cache up to its own
    position (not bitwise: the window is merged in another order). pack: one program a window (attention_window.py)
    instead of one a row."""
    rng = np.random.default_rng(s + t)
    q, k_new, v_new = (jnp.asarray(rng.standard_normal((b * t, h, d)), jnp.bfloat16) for h in (hq, hkv, hkv))
    k, v = (jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.bfloat16) for _ in range(2))
    start = jnp.asarray(starts, jnp.int32)
    placed = jnp.clip(start, 0, s - t)  # where a dynamic-update-slice puts T rows
    lens = (placed[:, None] + 1 + jnp.arange(t)[None, :]).reshape(-1).astype(jnp.int32)
    rows = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)
    kc, vc = (kernels_xla.write_kv(c, n.reshape(b, t, hkv, d), start) for c, n in ((k, k_new), (v, v_new)))
    want = attention_decode_reference(q, kc, vc, lens, rows, scale=d**-0.5)
    fn = jax.jit(lambda q, k, v, L, R: attention_decode(q, k, v, L, R, scale=d**-0.5, interpret=interpret, append=True,
                                                        window_rows=t, pack=pack, **kw), donate_argnums=(1, 2))
    out, k2, v2 = fn(jnp.concatenate([q, k_new, v_new], axis=1), k, v, lens, rows)
    assert (np.asarray(k2) == np.asarray(kc)).all() and (np.asarray(v2) == np.asarray(vc)).all()
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("b,t,hq,hkv,s,d,starts,kw", WINDOW_CASES)
def test_attention_decode_appends_a_verify_window(b, t, hq, hkv, s, d, starts, kw, pack):
    _check_window(b, t, hq, hkv, s, d, starts, kw, interpret=True, pack=pack)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("b,t,hq,hkv,s,d,starts,kw", WINDOW_CASES + [(1, 9, 32, 8, 1024, 128, [600], {})])
def test_attention_decode_appends_a_verify_window_gpu(b, t, hq, hkv, s, d, starts, kw, pack):
    _check_window(b, t, hq, hkv, s, d, starts, kw, interpret=False, pack=pack)


@pytest.mark.parametrize("b,t,hq,hkv", [(1, 9, 32, 8), (2, 20, 64, 8)])
def test_packed_window_is_the_per_row_kernel(b, t, hq, hkv):
    """The packed window (one program a window and kv head) gives the per-row kernel's caches bitwise and its output
    up to the dots' rounding (interpret mode; the same prefix tiles and window block in the same order, in dots of
    more rows): the 8B verify's heads, 9 rows, and 2 windows of 20 positions x 8 heads a kv head, 3 programs a window
    (`position_blocks`)."""
    from pallas_kernels.attention_window import position_blocks

    s, d = 256, 128
    assert position_blocks(t, hq // hkv) == (1 if t == 9 else 3)
    rng = np.random.default_rng(5)
    qkv = jnp.asarray(rng.standard_normal((b * t, hq + 2 * hkv, d)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.bfloat16) for _ in range(2))
    lens = (jnp.asarray([100, 31])[:b, None] + 1 + jnp.arange(t)[None, :]).reshape(-1).astype(jnp.int32)
    rows = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)
    outs = [attention_decode(qkv, k, v, lens, rows, scale=d**-0.5, interpret=True, append=True, window_rows=t,
                             pack=pack, n_split=2, combine="kernel") for pack in (False, True)]
    (o_rows, *caches_rows), (o_pack, *caches_pack) = outs
    for a, e in zip(caches_rows, caches_pack):
        assert (np.asarray(a) == np.asarray(e)).all()
    np.testing.assert_allclose(np.asarray(o_pack, np.float32), np.asarray(o_rows, np.float32), atol=4e-3, rtol=1e-2)


@pytest.mark.parametrize("combine,n_split", [("kernel", 4), ("xla", 4), ("kernel", 1)])
def test_attention_decode_out_rows_pads_with_zero_rows(combine, n_split):
    _check_out_rows(combine, n_split, interpret=True)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("combine,n_split", [("kernel", 4), ("xla", 4), ("kernel", 1)])
def test_attention_decode_out_rows_pads_with_zero_rows_gpu(combine, n_split):
    _check_out_rows(combine, n_split, interpret=False)


def _check_out_rows(combine, n_split, interpret):
    """out_rows (a matmul's padded input handed over by the kernel): the first B rows are those of the call without
    it, bitwise, and the rest zeros; by the combine kernel, by XLA's merge, and with one split (no merge)."""
    b, t, hq, hkv, s, d = 2, 5, 8, 2, 128, 32
    rng = np.random.default_rng(12)
    q = jnp.asarray(rng.standard_normal((b * t, hq + 2 * hkv, d)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.bfloat16) for _ in range(2))
    lens = (jnp.asarray([3, 60])[:, None] + 1 + jnp.arange(t)[None, :]).reshape(-1).astype(jnp.int32)
    rows = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)
    outs = [attention_decode(q, k, v, lens, rows, scale=d**-0.5, interpret=interpret, append=True, window_rows=t,
                             n_split=n_split, block_k=32, combine=combine, **({"out_rows": r} if r else {}))[0]
            for r in (0, 16)]
    want, got = (np.asarray(o, np.float32) for o in outs)
    assert got.shape == (16, hq, d) and want.shape == (b * t, hq, d)
    assert (got[: b * t] == want).all() and (got[b * t:] == 0).all()
    # the registered op's XLA fallback (head size not a power of two) pads the same way
    q24, k24, v24 = q[..., :24].astype(jnp.float32), k[..., :24].astype(jnp.float32), v[..., :24].astype(jnp.float32)
    o0, o16 = (ops.get("attention_decode", "pallas")(q24, k24, v24, lens, rows, scale=0.2, append=True,
                                                     window_rows=t, out_rows=r)[0] for r in (0, 16))
    assert o16.shape == (16, hq, 24) and (o16[: b * t] == o0).all() and (o16[b * t:] == 0).all()


def test_attention_decode_window_registered_fallback():
    """The registered op's XLA fallback (head size not a power of two) writes the window first and attends."""
    rng = np.random.default_rng(4)
    b, t, hq, hkv, s, d = 2, 3, 4, 2, 32, 24
    q = jnp.asarray(rng.standard_normal((b * t, hq + 2 * hkv, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.float32) for _ in range(2))
    start = jnp.asarray([4, 20], jnp.int32)
    lens = (start[:, None] + 1 + jnp.arange(t)[None, :]).reshape(-1)
    rows = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)
    out, k2, v2 = ops.get("attention_decode", "pallas")(q, k, v, lens, rows, scale=0.2, append=True, window_rows=t)
    kc, vc = (kernels_xla.write_kv(c, q[:, sl].reshape(b, t, hkv, d), start)
              for c, sl in ((k, slice(hq, hq + hkv)), (v, slice(hq + hkv, None))))
    assert (np.asarray(k2) == np.asarray(kc)).all() and (np.asarray(v2) == np.asarray(vc)).all()
    want = kernels_xla.attention_decode_xla(q[:, :hq], kc, vc, lens, rows, scale=0.2)
    assert (np.asarray(out) == np.asarray(want)).all()


SLIDING_CASES = [  # B, Hq, Hkv, S, D, lengths, sliding window W, knobs
    (2, 4, 1, 256, 64, [40, 200], 64, {}),  # Gemma 3's heads (one kv head); a row shorter than W and one longer
    (3, 8, 2, 512, 32, [100, 300, 512], 100, dict(n_split=8, combine="kernel")),  # W not a tile multiple; splits
    (1, 4, 1, 512, 64, [450], 37, dict(n_split=1, block_k=128)),  # one split whose window starts mid-tile
    (2, 4, 2, 128, 16, [1, 128], 16, dict(n_split=4)),  # slot 0 (W covers it); W = 16 at the cache's end
]


def _check_sliding(b, hq, hkv, s, d, lens, w, kw, interpret):
    """A sliding-window layer (Gemma's local attention) as a decode step with append: the caches are XLA's write,
    and the output is XLA's windowed attention (`kernels_xla.attention_decode_xla(window=W)`: keys p - W + 1 .. p)
    to the kernels' rounding; tiles wholly before the window are not read, so they are filled with NaN here."""
    q, k_new, v_new, k, v, lengths = _append_case(b, hq, hkv, s, d, lens, s + w)
    before = jnp.arange(s)[None, None, :, None] < (lengths - w)[:, None, None, None] // 16 * 16  # whole 16-key tiles
    k, v = jnp.where(before, jnp.nan, k), jnp.where(before, jnp.nan, v)
    kc, vc = kernels_xla.write_kv(k, k_new[:, None], lengths - 1), kernels_xla.write_kv(v, v_new[:, None], lengths - 1)
    want = kernels_xla.attention_decode_xla(q.astype(jnp.float32), jnp.nan_to_num(kc).astype(jnp.float32),
                                            jnp.nan_to_num(vc).astype(jnp.float32), lengths, scale=d**-0.5, window=w)
    fn = jax.jit(lambda q, k, v, L: attention_decode(q, k, v, L, scale=d**-0.5, interpret=interpret, append=True,
                                                     sliding=w, **kw), donate_argnums=(1, 2))
    out, k2, v2 = fn(jnp.concatenate([q, k_new, v_new], axis=1), k, v, lengths)
    np.testing.assert_array_equal(np.asarray(k2, np.float32), np.asarray(kc, np.float32))
    np.testing.assert_array_equal(np.asarray(v2, np.float32), np.asarray(vc, np.float32))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=2e-2, rtol=2e-2)
    ref = attention_decode_reference(q, jnp.nan_to_num(kc), jnp.nan_to_num(vc), lengths, scale=d**-0.5, sliding=w)
    np.testing.assert_allclose(np.asarray(ref, np.float32), np.asarray(want), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("b,hq,hkv,s,d,lens,w,kw", SLIDING_CASES)
def test_attention_decode_sliding_window(b, hq, hkv, s, d, lens, w, kw):
    _check_sliding(b, hq, hkv, s, d, lens, w, kw, interpret=True)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,s,d,lens,w,kw", SLIDING_CASES + [(1, 4, 1, 2048, 256, [1500], 512, {})])
def test_attention_decode_sliding_window_gpu(b, hq, hkv, s, d, lens, w, kw):
    _check_sliding(b, hq, hkv, s, d, lens, w, kw, interpret=False)


def test_sliding_window_chain_rows_and_the_registered_op():
    """A chain verify's window as decode rows in a sliding-window layer (each row sees its own last W positions),
    through the registered op, which now sends windowed decode rows to the kernel: equal to XLA's windowed attention
    of the cache written first."""
    rng = np.random.default_rng(2)
    b, t, hq, hkv, s, d, w = 2, 4, 4, 1, 256, 64, 50
    qkv = jnp.asarray(rng.standard_normal((b * t, hq + 2 * hkv, d)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.bfloat16) for _ in range(2))
    start = jnp.asarray([30, 170], jnp.int32)
    lens = (start[:, None] + 1 + jnp.arange(t)[None, :]).reshape(-1).astype(jnp.int32)
    rows = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)
    kc, vc = (kernels_xla.write_kv(c, qkv[:, sl].reshape(b, t, hkv, d), start)
              for c, sl in ((k, slice(hq, hq + hkv)), (v, slice(hq + hkv, None))))
    want = kernels_xla.attention_decode_xla(qkv[:, :hq], kc, vc, lens, rows, scale=0.125, window=w)
    op = functools.partial(ops.get("attention_decode", "pallas"), scale=0.125, append=True, window_rows=t, window=w)
    out, k2, v2 = op(qkv, k, v, lens, rows)
    assert (np.asarray(k2) == np.asarray(kc)).all() and (np.asarray(v2) == np.asarray(vc)).all()
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)
    assert "pallas_call" in str(jax.make_jaxpr(op)(qkv, k, v, lens, rows))
    one = functools.partial(ops.get("attention_decode", "pallas"), scale=0.125, window=w)  # a plain step: the kernel
    assert "pallas_call" in str(jax.make_jaxpr(one)(qkv[:b, :hq], kc, vc, lens[t - 1::t]))


def test_attention_decode_append_registered_fallback():
    """The registered op falls back to XLA (a head size that is not a power of two) and still appends."""
    q, k_new, v_new, k, v, lengths = _append_case(2, 4, 2, 32, 24, [5, 32], 3)
    out, k2, v2 = ops.get("attention_decode", "pallas")(jnp.concatenate([q, k_new, v_new], axis=1), k, v, lengths,
                                                        scale=0.2, append=True)
    kc, vc = kernels_xla.write_kv(k, k_new[:, None], lengths - 1), kernels_xla.write_kv(v, v_new[:, None], lengths - 1)
    assert (np.asarray(k2) == np.asarray(kc)).all() and (np.asarray(v2) == np.asarray(vc)).all()
    assert (np.asarray(out) == np.asarray(kernels_xla.attention_decode_xla(q, kc, vc, lengths, scale=0.2))).all()


def test_attention_decode_registered():
    rng = np.random.default_rng(11)
    b, hq, hkv, s, d = 2, 9, 3, 40, 64
    q = jnp.asarray(rng.standard_normal((b, hq, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.float32)
    lengths = jnp.asarray([40, 9], jnp.int32)
    y = ops.get("attention_decode", "pallas")(q, k, v, lengths, scale=0.125)
    assert rel(y, kernels_xla.attention_decode_xla(q, k, v, lengths, scale=0.125)) < TOL[jnp.float32]


# ------------------------------------------------------------------------------------------------ KV move
MOVE_CASES = [  # B, Hkv, S, D, caches, starts, paths (window indices; 0 past the accepted ones)
    (1, 3, 64, 64, 4, [9], [[1, 3, 6, 8, 0]]),  # SmolLM2 heads, one row, 4 of 5 accepted (then zeros)
    (2, 2, 32, 16, 3, [3, 20], [[2, 4, 7], [1, 2, 3]]),  # batch 2; row 1 moves its chain onto itself
    (2, 2, 32, 16, 2, [30, -40], [[1, 0, 0], [1, 2, 3]]),  # blocks past either end, placed as a DUS places them
]


def _move_case(b, hkv, s, d, n_caches, starts, paths, seed):
    rng = np.random.default_rng(seed)
    caches = tuple(jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.bfloat16) for _ in range(n_caches))
    start, path = jnp.asarray(starts, jnp.int32), jnp.asarray(paths, jnp.int32)
    return caches, jnp.clip(start[:, None] + path, 0, s - 1), start + 1


@pytest.mark.parametrize("case", MOVE_CASES)
def test_kv_move_equals_the_gather_then_write(case):
    """The one-launch KV move (interpret mode) against its jnp twin and the registered `xla` move, bit for bit; the
    caches are donated, as the speculative step does."""
    from pallas_kernels.kv_move import kv_move, kv_move_reference

    caches, src, dst = _move_case(*case, seed=len(case[5]))
    want = kv_move_reference(caches, src, dst)
    for got in (jax.jit(lambda c: kv_move(c, src, dst, interpret=True), donate_argnums=0)(
                    tuple(jnp.copy(c) for c in caches)),
                ops.get("kv_move", "xla")(caches, src, dst), ops.get("kv_move", "pallas")(caches, src, dst)):
        assert all((np.asarray(a) == np.asarray(w)).all() for a, w in zip(got, want))
    assert not all((np.asarray(a) == np.asarray(c)).all() for a, c in zip(want, caches))  # something moved


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case", MOVE_CASES)
def test_kv_move_gpu(case):
    from pallas_kernels.kv_move import kv_move, kv_move_reference

    caches, src, dst = _move_case(*case, seed=len(case[5]))
    want = kv_move_reference(caches, src, dst)
    got = jax.jit(lambda c: kv_move(c, src, dst), donate_argnums=0)(tuple(jnp.copy(c) for c in caches))
    assert all((np.asarray(a) == np.asarray(w)).all() for a, w in zip(got, want))


# ------------------------------------------------------------------------------------------------ tree attention
TCASES = [  # B, T nodes, Hq, Hkv, S, D, visible cache slots, dtype, knobs
    (1, 9, 8, 2, 96, 64, [37], jnp.float32, dict(block_k=32)),  # G = 4: 36 query rows per kv head, one tile
    (2, 33, 9, 3, 80, 64, [0, 71], jnp.bfloat16, dict(block_k=32)),  # SmolLM2 heads, 33 nodes: 2 tiles
    (2, 5, 4, 4, 64, 32, [64, 1], jnp.float32, dict(block_k=16, rows_per_tile=2)),  # an empty prefix; 3 tiles
]


def _tree_inputs(b, t, hq, hkv, s, d, dt, seed):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), dt)
    k, v = (jnp.asarray(rng.standard_normal((b, hkv, s, d)), dt) for _ in range(2))
    kw, vw = (jnp.asarray(rng.standard_normal((b, t, hkv, d)), dt) for _ in range(2))
    anc = jnp.asarray(rng.random((b, t, t)) < 0.4) | jnp.eye(t, dtype=bool)[None]  # a node always sees itself
    return q, k, v, kw, vw, anc


@pytest.mark.parametrize("b,t,hq,hkv,s,d,vis,dt,kw", TCASES)
def test_attention_tree(b, t, hq, hkv, s, d, vis, dt, kw):
    q, k, v, k_win, v_win, anc = _tree_inputs(b, t, hq, hkv, s, d, dt, t + s)
    n_visible, scale = jnp.asarray(vis, jnp.int32), d**-0.5
    y = attention_tree(q, k, v, n_visible, k_win, v_win, anc, scale=scale, interpret=True, **kw)
    assert y.shape == q.shape and y.dtype == q.dtype
    assert rel(y, attention_tree_reference(q, k, v, n_visible, k_win, v_win, anc, scale=scale)) < TOL[dt]
    xla = kernels_xla.attention_tree_xla(q, k, v, n_visible, k_win, v_win, anc, scale=scale)
    assert rel(y, xla) < TOL[dt]
    assert rel(attention_tree_reference(q, k, v, n_visible, k_win, v_win, anc, scale=scale),
               attention_tree_reference(q, k, v, n_visible, k_win, v_win, ~anc | jnp.eye(t, dtype=bool)[None],
                                        scale=scale)) > 10 * TOL[dt]  # (the mask matters at these sizes)


@pytest.mark.parametrize("b,t,hq,hkv,s,d,vis,dt,kw", [
    (1, 9, 8, 2, 96, 64, [37], jnp.float32, dict(block_k=32)),
    (2, 33, 9, 3, 128, 64, [0, 71], jnp.bfloat16, dict(block_k=32)),  # SmolLM2 heads, a tree of 32 and its root
    (2, 5, 4, 4, 64, 32, [40, 1], jnp.float32, dict(block_k=16, rows_per_tile=2)),  # several tiles, splits
    (1, 40, 9, 3, 128, 64, [50], jnp.bfloat16, dict(block_k=32)),  # a window past 32: two mask words
])
def test_attention_tree_reads_its_window_from_the_cache(b, t, hq, hkv, s, d, vis, dt, kw):
    """`in_cache=True`: the window's keys sit in the cache after the prefix (as the model's tree verify writes them),
    each node's ancestors go to the flash-decoding kernel as bits, and one kernel does it all; the same result."""
    q, k, v, k_win, v_win, anc = _tree_inputs(b, t, hq, hkv, s, d, dt, t + s + 1)
    n_visible, scale = jnp.asarray(vis, jnp.int32), d**-0.5
    kc, vc = k, v
    for r, n in enumerate(vis):  # the window at slots n .. n + t - 1 of row r
        kc = kc.at[r, :, n:n + t].set(k_win[r].swapaxes(0, 1))
        vc = vc.at[r, :, n:n + t].set(v_win[r].swapaxes(0, 1))
    want = attention_tree_reference(q, k, v, n_visible, k_win, v_win, anc, scale=scale)
    y = attention_tree(q, kc, vc, n_visible, k_win, v_win, anc, scale=scale, interpret=True, in_cache=True, **kw)
    assert y.shape == q.shape and y.dtype == q.dtype
    assert rel(y, want) < TOL[dt]
    merged = attention_tree(q, kc, vc, n_visible, k_win, v_win, anc, scale=scale, interpret=True, **kw)
    assert rel(y, merged) < TOL[dt]
    # the window keys are read from the cache: other keys there change the result
    wrong = attention_tree(q, k, v, n_visible, k_win, v_win, anc, scale=scale, interpret=True, in_cache=True, **kw)
    assert rel(wrong, want) > 10 * TOL[dt]


@pytest.mark.parametrize("b,t,hq,hkv,s,d,vis,dt,kw", [
    (1, 9, 8, 2, 96, 64, [37], jnp.float32, dict(block_k=32)),
    (2, 16, 9, 3, 128, 64, [0, 71], jnp.bfloat16, dict(block_k=32)),  # SmolLM2 heads, a tree of 15 and its root
    (2, 5, 4, 4, 64, 32, [40, 1], jnp.float32, dict(block_k=16, n_split=4)),  # splits
    (1, 40, 9, 3, 128, 64, [50], jnp.bfloat16, dict(block_k=32)),  # past 32 nodes: two mask words
])
def test_tree_nodes_as_decode_rows(b, t, hq, hkv, s, d, vis, dt, kw):
    """A tree's nodes as B * T decode rows (`append`, `window_rows`, the ancestors as `win_mask` bits): each row
    reads the cache before the window and the window's keys from q where its bits allow, and writes its own key and
    value at slot start + t: the tree attention's output, and the caches of writing the window first, exactly."""
    from pallas_kernels.attention_tree import ancestor_words

    q, k, v, k_win, v_win, anc = _tree_inputs(b, t, hq, hkv, s, d, dt, t + s + 3)
    n_visible, scale = jnp.asarray(vis, jnp.int32), d**-0.5
    qkv = jnp.concatenate([q, k_win, v_win], axis=2).reshape(b * t, hq + 2 * hkv, d)
    lens = (n_visible[:, None] + jnp.arange(1, t + 1)[None]).reshape(b * t)
    rows = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)
    words = ancestor_words(anc.reshape(b * t, t))
    assert bool(((words[:, 0] >> 3) & 1).astype(bool).reshape(b, t)[0, 3])  # (a node sees itself: bit t of row t)
    win = jnp.broadcast_to(words[:, None], (b * t, hq, words.shape[-1]))
    want = attention_tree_reference(q, k, v, n_visible, k_win, v_win, anc, scale=scale)
    kc, vc = k, v
    for r, n in enumerate(vis):
        kc = kc.at[r, :, n:n + t].set(k_win[r].swapaxes(0, 1))
        vc = vc.at[r, :, n:n + t].set(v_win[r].swapaxes(0, 1))
    for pack in (False, True):  # one program a row; one a window (attention_window.py)
        y, ko, vo = attention_decode(qkv, k, v, lens, rows, win, scale=scale, append=True, window_rows=t,
                                     interpret=True, pack=pack, **kw)
        assert rel(y.reshape(b, t, hq, d), want) < TOL[dt], pack
        assert np.array_equal(np.asarray(ko), np.asarray(kc)) and np.array_equal(np.asarray(vo), np.asarray(vc))
    # the registered op (bits made from the bool ancestors) and its XLA twin for the shapes the kernel cannot take
    op = ops.get("attention_decode", "pallas")(qkv, k, v, lens, rows, scale=scale, append=True, window_rows=t,
                                              window_anc=anc.reshape(b * t, t))
    twin = kernels_xla.tree_rows_xla(qkv, k, v, lens, anc.reshape(b * t, t), t, scale=scale)
    for got in (op, twin):
        assert rel(got[0].reshape(b, t, hq, d), want) < TOL[dt]
        assert np.array_equal(np.asarray(got[1]), np.asarray(kc)) and np.array_equal(np.asarray(got[2]),
                                                                                   np.asarray(vc))


def test_row_splits(monkeypatch):
    """Calls whose rows map onto cache rows (verify windows, tree nodes) take one split at head dim 64 in caches up to
    256 slots (no merge kernel), keep the grid's at 128 or longer; LUCEBOX_ATTN_ROW_SPLITS overrides (0: the grid's);
    decode steps never change. With one split the tree's kernel normalises its output itself: the same result."""
    import pallas_kernels.attention_decode as ad
    import pallas_kernels.attention_tree as at

    monkeypatch.setattr(ad, "ROW_SPLITS", "")
    base = ad.default_config(1, 3, 256, 64)
    assert ad.default_config(16, 3, 256, 64, mapped_rows=True)["n_split"] == 1
    assert ad.default_config(16, 8, 256, 128, mapped_rows=True)["n_split"] is None
    assert ad.default_config(16, 3, 512, 64, mapped_rows=True)["n_split"] is None  # a longer cache keeps its splits
    monkeypatch.setattr(ad, "ROW_SPLITS", "0")
    assert ad.default_config(16, 3, 256, 64, mapped_rows=True)["n_split"] is None
    assert ad.default_config(1, 3, 256, 64) == base
    monkeypatch.setattr(ad, "ROW_SPLITS", "2")
    assert ad.default_config(16, 8, 4096, 128, mapped_rows=True)["n_split"] == 2
    assert ad.default_config(1, 3, 256, 64) == base
    monkeypatch.setattr(ad, "ROW_SPLITS", "")
    b, t, hq, hkv, s, d, vis, dt = 1, 5, 9, 3, 128, 64, [50], jnp.float32
    q, k, v, k_win, v_win, anc = _tree_inputs(b, t, hq, hkv, s, d, dt, 7)
    kc = k.at[0, :, 50:50 + t].set(k_win[0].swapaxes(0, 1))
    vc = v.at[0, :, 50:50 + t].set(v_win[0].swapaxes(0, 1))
    n_visible, scale = jnp.asarray(vis, jnp.int32), d**-0.5
    want = attention_tree_reference(q, k, v, n_visible, k_win, v_win, anc, scale=scale)
    calls = []
    real = at.attention_decode
    monkeypatch.setattr(at, "attention_decode", lambda *a, **kw: calls.append(kw.get("n_split")) or real(*a, **kw))
    y = at.attention_tree(q, kc, vc, n_visible, k_win, v_win, anc, scale=scale, interpret=True, in_cache=True,
                          block_k=32)
    assert calls == [1] and rel(y, want) < TOL[dt]


def test_attention_tree_registered():
    q, k, v, k_win, v_win, anc = _tree_inputs(2, 6, 9, 3, 40, 64, jnp.float32, 13)
    vis = jnp.asarray([40, 9], jnp.int32)
    y = ops.get("attention_tree", "pallas")(q, k, v, vis, k_win, v_win, anc, scale=0.125)
    assert rel(y, kernels_xla.attention_tree_xla(q, k, v, vis, k_win, v_win, anc, scale=0.125)) < TOL[jnp.float32]
    pos = vis[:, None] + jnp.arange(6)[None]  # a sliding window shorter than the cache goes to XLA, the same call
    got = ops.get("attention_tree", "pallas")(q, k, v, vis, k_win, v_win, anc, scale=0.125, positions=pos, window=8)
    want = kernels_xla.attention_tree_xla(q, k, v, vis, k_win, v_win, anc, scale=0.125, positions=pos, window=8)
    assert (got == want).all()


# ------------------------------------------------------------------------------------------------ prefill attention
PCASES = [  # B, T, Hq, Hkv, S, D, starts, dtype, knobs
    (2, 5, 9, 3, 70, 64, [0, 40], jnp.float32, dict(block_k=32)),  # verify window, G = 3, ragged starts
    (2, 20, 8, 2, 96, 32, [3, 76], jnp.bfloat16, dict(block_t=8, block_k=32)),  # G = 4, T % block_t != 0
    (1, 33, 4, 4, 64, 32, [0], jnp.float32, dict(block_t=16, block_k=32)),  # G = 1, prefill from 0
]


@pytest.mark.parametrize("b,t,hq,hkv,s,d,starts,dt,kw", PCASES)
def test_attention_prefill(b, t, hq, hkv, s, d, starts, dt, kw):
    rng = np.random.default_rng(t + s)
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), dt)
    k = jnp.asarray(rng.standard_normal((b, hkv, s, d)), dt)
    v = jnp.asarray(rng.standard_normal((b, hkv, s, d)), dt)
    start = jnp.asarray(starts, jnp.int32)
    scale = d**-0.5
    y = attention_prefill(q, k, v, start, scale=scale, interpret=True, **kw)
    assert y.shape == q.shape and y.dtype == q.dtype
    assert rel(y, attention_prefill_reference(q, k, v, start, scale=scale)) < TOL[dt]
    assert rel(y, kernels_xla.attention_prefill_xla(q, k, v, start, scale=scale)) < TOL[dt]


SLIDING_PCASES = [  # B, T, Hq, Hkv, S, D, starts, window W, knobs
    (2, 40, 4, 1, 256, 64, [0, 150], 24, dict(block_t=16, block_k=32)),  # W < a tile's rows: every tile masked
    (1, 64, 4, 2, 512, 32, [300], 100, dict(block_t=16, block_k=32)),  # edge, unmasked middle and diagonal tiles
    (2, 5, 4, 1, 256, 64, [3, 200], 64, {}),  # a verify window (T <= 16: 128-key tiles), one row within W
]


@pytest.mark.parametrize("b,t,hq,hkv,s,d,starts,w,kw", SLIDING_PCASES)
def test_attention_prefill_sliding_window(b, t, hq, hkv, s, d, starts, w, kw):
    """Prefill with a sliding window W (Gemma 3's local layers): query p sees keys p - W < k <= p, as XLA's windowed
    attention (llama.cpp's rule, `test_gemma3_config.py`); keys below every query's window are NaN here, so a tile
    read there would show."""
    rng = np.random.default_rng(t + w)
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.float32) for _ in range(2))
    start = jnp.asarray(starts, jnp.int32)
    want = kernels_xla.attention_prefill_xla(q, k, v, start, scale=d**-0.5, window=w)
    below = jnp.arange(s)[None, None, :, None] < (start - w + 1)[:, None, None, None] // 16 * 16
    kn, vn = jnp.where(below, jnp.nan, k), jnp.where(below, jnp.nan, v)
    y = attention_prefill(q, kn, vn, start, scale=d**-0.5, interpret=True, sliding=w, **kw)
    assert rel(y, want) < TOL[jnp.float32]
    assert rel(attention_prefill_reference(q, k, v, start, scale=d**-0.5, sliding=w), want) < TOL[jnp.float32]
    got = ops.get("attention_prefill", "pallas")(q, k, v, start, scale=d**-0.5, window=w)  # the registered op: kernel
    assert rel(got, want) < TOL[jnp.float32]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("b,t,hq,hkv,s,d,starts,w,kw", SLIDING_PCASES + [(1, 512, 4, 1, 2048, 256, [700], 512, {})])
def test_attention_prefill_sliding_window_gpu(b, t, hq, hkv, s, d, starts, w, kw):
    rng = np.random.default_rng(t + w)
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.bfloat16) for _ in range(2))
    start = jnp.asarray(starts, jnp.int32)
    y = attention_prefill(q, k, v, start, scale=d**-0.5, sliding=w, **kw)
    assert rel(y, attention_prefill_reference(q, k, v, start, scale=d**-0.5, sliding=w)) < TOL[jnp.bfloat16]


def test_attention_prefill_registered():
    rng = np.random.default_rng(12)
    b, t, hq, hkv, s, d = 1, 4, 9, 3, 32, 64
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.float32)
    start = jnp.asarray([20], jnp.int32)
    y = ops.get("attention_prefill", "pallas")(q, k, v, start, scale=0.125)
    assert rel(y, kernels_xla.attention_prefill_xla(q, k, v, start, scale=0.125)) < TOL[jnp.float32]


# ------------------------------------------------------------------------------------------------ int8 matmul
def rand_int8(rng, k, n, g):
    codes = rng.integers(-127, 128, (k, n), dtype=np.int8)
    scales = (rng.uniform(0.5, 1.5, (k // g, n)) * 0.01).astype(np.float16)
    return Int8Array(codes=jnp.asarray(codes), scales=jnp.asarray(scales), group_size=g)


Q8CASES = [  # M, K, N, group, dtype, knobs: N not a multiple of block_n, K a non-power of two (SmolLM2: 576)
    (1, 576, 300, 32, jnp.float32, {}),
    (3, 256, 96, 32, jnp.bfloat16, dict(block_k=128, block_n=64)),
    (17, 128, 130, 32, jnp.float32, dict(split_k=2)),
    (2, 512, 64, 128, jnp.bfloat16, dict(block_k=128, num_warps=8)),
]


@pytest.mark.parametrize("m,k,n,g,dt,kw", Q8CASES)
def test_int8_matmul(m, k, n, g, dt, kw):
    rng = np.random.default_rng(hash((m, k, n, g)) % 2**32)
    w = rand_int8(rng, k, n, g)
    x = jnp.asarray(rng.standard_normal((m, k)), dt)
    y = int8_matmul(x, w.codes, w.scales, group_size=g, interpret=True, **kw)
    assert y.shape == (m, n) and y.dtype == dt
    assert rel(y, int8_matmul_reference(x, w.codes, w.scales, group_size=g)) < TOL[dt]
    assert rel(y, kernels_xla.qmatmul8_xla(x, w)) < TOL[dt]


def test_int8_matmul_registered_and_linear():
    from lucebox_jax.ops import KernelSet
    from lucebox_jax.quant import linear

    rng = np.random.default_rng(7)
    w = rand_int8(rng, 192, 70, 32)
    x = jnp.asarray(rng.standard_normal((2, 3, 192)), jnp.float32)  # linear() flattens leading dims
    ref = int8_matmul_reference(x.reshape(6, 192), w.codes, w.scales, group_size=32).reshape(2, 3, 70)
    y = linear(x, w, kernels=KernelSet.resolve("qmatmul8=pallas", backend="cpu"))
    assert rel(y, ref) < TOL[jnp.float32]
    assert rel(linear(x, w, kernels=KernelSet.resolve(None, backend="cpu")), ref) < TOL[jnp.float32]


# ------------------------------------------------------------------------------- weights imported from GGUF types
# group 16 (Q6_K, Q2_K, Q3_K), float32 scales (K-quants), int8 with mins (Q5_1, Q5_K: kernel + `mins_term`)
GGUF_KINDS = ["Q4_K", "Q2_K", "Q3_K", "Q6_K", "Q5_K", "Q5_1", "Q5_0"]


@pytest.mark.parametrize("kind", GGUF_KINDS)
@pytest.mark.parametrize("m,dt", [(1, jnp.float32), (5, jnp.bfloat16)])
def test_gguf_types_through_pallas(kind, m, dt):
    from gguf_factory import fake_tensor
    from lucebox_jax.gguf_quants import import_linear

    t, ref_w = fake_tensor(kind, out=72, n_in=512, seed=m)
    w = import_linear(t)
    op = "qmatmul" if isinstance(w, QuantArray) else "qmatmul8"
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, 512)), dt)
    ref = jnp.dot(x.astype(jnp.float32), jnp.asarray(ref_w.T), precision=jax.lax.Precision.HIGHEST)
    y = ops.get(op, "pallas")(x, w)
    assert y.shape == (m, 72) and y.dtype == dt
    assert rel(y, ref) < TOL[dt]
    assert rel(y, ops.get(op, "xla")(x, w)) < TOL[dt]


@pytest.mark.parametrize("sym", [True, False])
def test_int4_group16_float32_scales_variants(sym):
    """Group 16 with float32 scales under the knob variants: block_k below, equal to and above g, asm decode."""
    rng = np.random.default_rng(16 + sym)
    w = rand_quant(rng, 512, 80, 16, sym)
    w = w.replace(scales=w.scales.astype(jnp.float32), mins=None if sym else w.mins.astype(jnp.float32))
    x = jnp.asarray(rng.standard_normal((3, 512)), jnp.bfloat16)
    ref = int4_matmul_reference(x, w.codes, w.scales, w.mins, group_size=16)
    for kw in (dict(block_k=16), dict(block_k=64, decode="asm", split_k=2), dict(block_k=8, mode="dot_t")):
        y = int4_matmul(x, w.codes, w.scales, w.mins, group_size=16, interpret=True, **kw)
        assert rel(y, ref) < TOL[jnp.bfloat16], kw


# ------------------------------------------------------------------------------------------------ GPU (compiled)
# Knob sets the `gpu` tests compile; each also runs here in interpret mode (small shapes) so that a combination the
# wrapper rejects (e.g. a block_k that does not divide K) fails in CI, not on the device.
QMATMUL_GPU_KNOBS = [
    dict(decode="f32"), dict(decode="asm"),
    dict(decode="asm", block_k=128, block_n=64, reduce="atomic"),
    dict(decode="asm", mode="dot_t", block_k=128, block_n=64),
    dict(decode="asm", mode="fma_r", block_k=64, block_n=128, num_warps=8),
    dict(decode="asm", mode="fma", block_k=128, block_n=64),
    dict(mode="fma", decode="asm_fma", block_k=128, block_n=64),
    dict(mode="fma", decode="asm_fma", block_k=32, block_n=128, split_k=1 << 12),
]
Q8_GPU_KNOBS = [dict(block_k=32, block_n=256, num_warps=8), dict(block_k=64, block_n=64, split_k=3)]  # K = 576 = 9 * 64


@pytest.mark.parametrize("g,sym", [(32, False), (128, True)])
def test_gpu_knob_sets_in_interpret_mode(g, sym):
    rng = np.random.default_rng(g)
    w = rand_quant(rng, 256, 200, g, sym)
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
    ref = int4_matmul_reference(x, w.codes, w.scales, w.mins, group_size=g)
    for kw in QMATMUL_GPU_KNOBS:
        y = int4_matmul(x, w.codes, w.scales, w.mins, group_size=g, interpret=True, **kw)
        assert rel(y, ref) < TOL[jnp.bfloat16], kw
    w8 = rand_int8(rng, 576, 200, 32)
    x8 = jnp.asarray(rng.standard_normal((3, 576)), jnp.bfloat16)
    ref8 = int8_matmul_reference(x8, w8.codes, w8.scales, group_size=32)
    for kw in Q8_GPU_KNOBS:
        y = int8_matmul(x8, w8.codes, w8.scales, group_size=32, interpret=True, **kw)
        assert rel(y, ref8) < TOL[jnp.bfloat16], kw


def gpu_int4_case(m, g, sym):
    """The `gpu` tests' int4 case: K = 1024, N = 1000 (not a multiple of any block_n), bf16 x; (x, w, reference)."""
    rng = np.random.default_rng(m + g)
    w = rand_quant(rng, 1024, 1000, g, sym)
    x = jnp.asarray(rng.standard_normal((m, 1024)), jnp.bfloat16)
    return x, w, int4_matmul_reference(x, w.codes, w.scales, w.mins, group_size=g)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 3, 16, 40])
@pytest.mark.parametrize("g,sym", [(32, False), (128, True)])
def test_gpu_qmatmul(m, g, sym):
    x, w, ref = gpu_int4_case(m, g, sym)
    assert rel(ops.get("qmatmul", "pallas")(x, w), ref) < TOL[jnp.bfloat16]
    for kw in QMATMUL_GPU_KNOBS:
        y = int4_matmul(x, w.codes, w.scales, w.mins, group_size=g, **kw)
        assert rel(y, ref) < TOL[jnp.bfloat16], kw


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 3, 16])
def test_gpu_int8_matmul(m):
    rng = np.random.default_rng(m)
    w = rand_int8(rng, 576, 1000, 32)
    x = jnp.asarray(rng.standard_normal((m, 576)), jnp.bfloat16)
    ref = int8_matmul_reference(x, w.codes, w.scales, group_size=32)
    assert rel(ops.get("qmatmul8", "pallas")(x, w), ref) < TOL[jnp.bfloat16]
    for kw in Q8_GPU_KNOBS:
        assert rel(int8_matmul(x, w.codes, w.scales, group_size=32, **kw), ref) < TOL[jnp.bfloat16], kw


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (32, 8, 128), (4, 4, 128)])
def test_gpu_attention(hq, hkv, d):
    rng = np.random.default_rng(hq)
    b, s = 3, 1000
    q = jnp.asarray(rng.standard_normal((b, hq, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.bfloat16)
    lengths = jnp.asarray([1, 517, 1000], jnp.int32)
    y = ops.get("attention_decode", "pallas")(q, k, v, lengths, scale=d**-0.5)
    assert rel(y, attention_decode_reference(q, k, v, lengths, scale=d**-0.5)) < TOL[jnp.bfloat16]
    yk = attention_decode(q, k, v, lengths, scale=d**-0.5, combine="kernel")  # the splits merged by a Pallas kernel
    assert rel(yk, attention_decode_reference(q, k, v, lengths, scale=d**-0.5)) < TOL[jnp.bfloat16]
    t = 37
    qp = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.bfloat16)
    start = jnp.asarray([0, 400, 963], jnp.int32)
    y = ops.get("attention_prefill", "pallas")(qp, k, v, start, scale=d**-0.5)
    assert rel(y, attention_prefill_reference(qp, k, v, start, scale=d**-0.5)) < TOL[jnp.bfloat16]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("in_cache", [False, True])
@pytest.mark.parametrize("t,hq,hkv,d", [(33, 9, 3, 64), (33, 32, 8, 128), (9, 32, 8, 128)])
def test_gpu_attention_tree(t, hq, hkv, d, in_cache):
    """Tree attention compiled: the window merged in jnp, or read from the cache with mask bits (`in_cache`)."""
    b, s = 2, 1024
    q, k, v, k_win, v_win, anc = _tree_inputs(b, t, hq, hkv, s, d, jnp.bfloat16, t + hq)
    vis = jnp.asarray([5, 900], jnp.int32)
    kc, vc = k, v
    for r, n in enumerate([5, 900]):
        kc = kc.at[r, :, n:n + t].set(k_win[r].swapaxes(0, 1))
        vc = vc.at[r, :, n:n + t].set(v_win[r].swapaxes(0, 1))
    y = jax.jit(lambda *a: attention_tree(*a, scale=d**-0.5, in_cache=in_cache))(q, kc, vc, vis, k_win, v_win, anc)
    assert rel(y, attention_tree_reference(q, k, v, vis, k_win, v_win, anc, scale=d**-0.5)) < TOL[jnp.bfloat16]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t,hq,hkv,d", [(16, 9, 3, 64), (32, 9, 3, 64), (16, 32, 8, 128), (9, 32, 8, 128),
                                        (32, 32, 8, 128), (33, 32, 8, 128)])  # (packed in 2 and 3 programs a window)
def test_gpu_tree_nodes_as_decode_rows(t, hq, hkv, d):
    """A short tree's nodes as decode rows compiled: ancestors as bits, each row writing its own key and value."""
    b, s = 2, 1024
    q, k, v, k_win, v_win, anc = _tree_inputs(b, t, hq, hkv, s, d, jnp.bfloat16, t + hq + 1)
    vis = jnp.asarray([5, 900], jnp.int32)
    qkv = jnp.concatenate([q, k_win, v_win], axis=2).reshape(b * t, hq + 2 * hkv, d)
    lens = (vis[:, None] + jnp.arange(1, t + 1)[None]).reshape(b * t)
    rows = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)
    y, ko, _ = jax.jit(lambda *a: ops.get("attention_decode", "pallas")(
        *a, scale=d**-0.5, append=True, window_rows=t, window_anc=anc.reshape(b * t, t)))(qkv, k, v, lens, rows)
    want = attention_tree_reference(q, k, v, vis, k_win, v_win, anc, scale=d**-0.5)
    assert rel(y.reshape(b, t, hq, d), want) < TOL[jnp.bfloat16]
    assert np.array_equal(np.asarray(ko[1, :, 900:900 + t]), np.asarray(k_win[1].swapaxes(0, 1)))


# ------------------------------------------------------------------------------------------------ end to end
def test_embedded_model_same_greedy_tokens_with_pallas(smol):
    """Selecting every Pallas kernel on the CPU (interpret mode) gives the embedded model's greedy tokens."""
    from lucebox_jax import LLM, SamplingParams

    llm = LLM(kernels="qmatmul=pallas,qmatmul8=pallas,attention_decode=pallas,attention_prefill=pallas")
    assert llm.kernels.qmatmul == "pallas" and llm.kernels.qmatmul8 == "pallas"
    prompt = smol.get_tokenizer().apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = smol.generate(prompt, sp)[0].outputs[0].token_ids
    assert len(want) == 8
    assert llm.generate(prompt, sp)[0].outputs[0].token_ids == want


# (int8?, group, asymmetric) of the imported GGUF formats, every one with float32 scales: Q4_K, Q3_K, Q2_K, Q6_K, Q5_K
GPU_GGUF_FORMATS = [(False, 32, True), (False, 16, False), (False, 16, True), (True, 16, False), (True, 32, True)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("int8,g,asym", GPU_GGUF_FORMATS)
@pytest.mark.parametrize("m", [1, 16, 40])
def test_gpu_gguf_formats(int8, g, asym, m):
    """The compiled kernels on the imported GGUF formats (group 16, float32 scales, int8 mins) at Gemma 3's
    ffn_down shape (K 2048, N 640); random weights, so the device needs no `gguf` library."""
    rng = np.random.default_rng(m + g)
    k, n = 2048, 640
    mins = jnp.asarray(rng.standard_normal((k // g, n)) * 0.05, jnp.float32) if asym else None
    if int8:
        w = rand_int8(rng, k, n, g)
        w = w.replace(scales=w.scales.astype(jnp.float32), mins=mins)
        op = "qmatmul8"
    else:
        w = rand_quant(rng, k, n, g, not asym)
        w = w.replace(scales=w.scales.astype(jnp.float32), mins=mins)
        op = "qmatmul"
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    assert rel(ops.get(op, "pallas")(x, w), ops.get(op, "xla")(x.astype(jnp.float32), w)) < TOL[jnp.bfloat16]


def test_attention_decode_env_overrides(monkeypatch):
    """LUCEBOX_ATTN_DECODE sets the kernel's integer knobs for A/B runs; anything else is refused by name."""
    from pallas_kernels.attention_decode import default_config

    monkeypatch.setenv("LUCEBOX_ATTN_DECODE", "n_split=1, block_k=128")
    cfg = default_config(1, 3, 256, 64)
    assert (cfg["n_split"], cfg["block_k"], cfg["num_warps"]) == (1, 128, 4)
    for bad in ("splits=2", "block_k=0", "n_split=two"):
        monkeypatch.setenv("LUCEBOX_ATTN_DECODE", bad)
        with pytest.raises(ValueError, match="n_split, block_k"):
            default_config(1, 3, 256, 64)
