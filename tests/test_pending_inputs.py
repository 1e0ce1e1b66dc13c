"""Matmul inputs the int4 kernel finishes on its loads (`lucebox_jax/pending_inputs.py`): a decode step's attention
splits before `o`, gate+up's partial sums before `down`.

The int4 matmul given them (`x_pending`, interpret mode on the CPU; compiled in the `gpu`-marked cases) is checked
against the same matmul of their `merged()` arrays; `merged()` against the model's own arithmetic (the combine kernel
for splits, `normed_linear` + silu for the gated input); the attention kernel's `split_out` against its own output;
whole decode steps (both handed over) and a short forward (the gated input) against the same without
(`LUCEBOX_SPLIT_O`, `LUCEBOX_GATED_DOWN`), with both paths counted as taken.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from lucebox_jax import model, quant
from lucebox_jax.pending_inputs import AttentionSplits, GatedInput
from lucebox_jax.model import forward
from lucebox_jax.ops import KernelSet
from lucebox_jax.synthetic import PRESETS, random_weights
from pallas_kernels import int4_matmul as im
from pallas_kernels.attention_decode import attention_decode, merge_splits
from test_ops import ragged_decode_inputs

ON_GPU = jax.default_backend() == "gpu"


def _splits(b, hkv, ns, g, d, seed, dtype="bfloat16"):
    """Random splits, the last one of every row empty (a chunk past the row's length: m = -1e30, l = 0, o = 0)."""
    r = np.random.default_rng(seed)
    o = r.normal(size=(b, hkv, ns, g, d)).astype(np.float32)
    m = (r.normal(size=(b, hkv, ns, g)) * 4).astype(np.float32)
    l = r.uniform(0.5, 3.0, size=(b, hkv, ns, g)).astype(np.float32)  # noqa: E741
    m[:, :, -1], l[:, :, -1], o[:, :, -1] = -1e30, 0.0, 0.0
    return AttentionSplits(jnp.asarray(o), jnp.asarray(m), jnp.asarray(l), dtype=dtype)


# B rows, Hkv, splits (powers of two or not), G, D, N, group, mins, kernel knobs
CASES = [
    (1, 3, 8, 3, 64, 576, 32, True, {}),  # SmolLM2's heads at one row (the FMA path), 8 splits
    (1, 3, 5, 3, 64, 576, 32, True, dict(mode="fma", decode="f32", split_k=9)),  # 5 splits (masked to 8)
    (3, 3, 8, 3, 64, 200, 32, False, {}),  # three rows: the dot path, symmetric, ragged N
    (2, 2, 3, 4, 32, 128, 64, True, dict(block_k=64)),  # a K tile spanning two heads
    (16, 1, 16, 2, 64, 64, 32, True, {}),  # the most rows and splits `split_out` hands over
]


def _check(case, interpret):
    b, hkv, ns, g, d, n, gs, mins, kw = case
    kw = dict(dict(split_k=im.SPLIT_ALL), **kw)  # one K tile a program (the small weights' GPU configuration)
    sp = _splits(b, hkv, ns, g, d, seed=b + ns + d)
    w = quant.quantize_int4(jax.random.normal(jax.random.key(n), (hkv * g * d, n), jnp.float32), group_size=gs,
                            symmetric=not mins)
    return _against_finished(sp, w, interpret, kw)


def _against_finished(pend, w, interpret, kw):
    """The int4 matmul finishing `pend` on its loads against the same matmul of `pend.merged()`: (got, want)."""
    want = im.qmatmul_pallas(pend.merged(), w, interpret=interpret, **kw)
    got = jax.jit(lambda p: im.qmatmul_pallas(None, w, interpret=interpret, x_pending=p, **kw))(pend)
    assert got.shape == want.shape == (pend.shape[0], w.shape[1]) and got.dtype == want.dtype
    scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0, atol=1e-2 * scale)
    return got, want


@pytest.mark.parametrize("case", CASES)
def test_int4_matmul_merges_splits_on_its_loads(case, monkeypatch):
    seen, real = [], im._pending_static
    monkeypatch.setattr(im, "_pending_static", lambda p: seen.append(p.kind) or real(p))
    got, want = _check(case, interpret=True)
    assert seen == ["splits"]  # the kernel merged them, not the combine kernel first
    assert (np.asarray(got) == np.asarray(want)).mean() > 0.99  # the same merge: equal but for rare bf16 ties


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="compiled Triton kernel")
@pytest.mark.parametrize("case", CASES)
def test_compiled_int4_matmul_merges_splits_on_its_loads(case):
    _check(case, interpret=False)


def test_splits_over_a_multi_tile_program_are_merged_first(monkeypatch):
    """A configuration whose programs loop over K tiles gets the splits merged by the combine kernel first (its
    pipelined loads of them would not fit): the same product, and the matmul is traced without them."""
    sp = _splits(1, 3, 8, 3, 64, seed=7)
    w = quant.quantize_int4(jax.random.normal(jax.random.key(1), (576, 64), jnp.float32), group_size=32)
    seen = []
    monkeypatch.setattr(im, "_pending_static", lambda p, f=im._pending_static: seen.append(p.kind) or f(p))
    got = im.qmatmul_pallas(None, w, interpret=True, x_pending=sp, split_k=1)
    want = im.qmatmul_pallas(merge_splits(sp, interpret=True), w, interpret=True, split_k=1)
    assert not seen and (np.asarray(got) == np.asarray(want)).all()


@pytest.mark.parametrize("b,s,lens", [(1, 256, [200]), (3, 96, [1, 40, 96])])
def test_attention_split_out_is_its_merged_output(b, s, lens):
    """`split_out` returns the kernel's splits unmerged; merged by the combine kernel they are the call's output
    bitwise, merged in jnp within float32 rounding; one split (or a call past the limits) returns the output."""
    hq, hkv, d = 9, 3, 64
    ks = jax.random.split(jax.random.key(b), 3)
    q = jax.random.normal(ks[0], (b, hq + 2 * hkv, d), jnp.bfloat16)
    kc, vc = (jax.random.normal(k, (b, hkv, s, d), jnp.bfloat16) for k in ks[1:])
    n = jnp.asarray(lens, jnp.int32)
    kw = dict(scale=d ** -0.5, interpret=True, append=True, block_k=32, n_split=-(-s // 32), combine="kernel")
    want, wk, _ = attention_decode(q, kc, vc, n, **kw)
    sp, gk, _ = attention_decode(q, kc, vc, n, split_out=True, **kw)
    assert isinstance(sp, AttentionSplits) and sp.o.shape == (b, hkv, -(-s // 32), hq // hkv, d)
    assert (np.asarray(gk) == np.asarray(wk)).all()
    flat = np.asarray(want).reshape(b, -1)
    assert (np.asarray(merge_splits(sp, interpret=True)) == flat).all()
    np.testing.assert_allclose(np.asarray(sp.merged(), np.float32), flat.astype(np.float32), rtol=1e-2, atol=1e-2)
    one, _, _ = attention_decode(q, kc, vc, n, split_out=True, **dict(kw, n_split=1))
    assert not isinstance(one, AttentionSplits)


def _gated(rows, parts, deferred, groups, ffn, seed, dtype="bfloat16"):
    """A random GatedInput: parts of (P, R) shapes (the last in the dtype: a kernel's product as one part)."""
    ks = jax.random.split(jax.random.key(seed), len(parts) + 1)
    arrs = tuple(jax.random.normal(k, (p, r, 2 * ffn), jnp.float32) * (0.5 if i < len(parts) - 1 else 1.0)
                 for i, (k, (p, r)) in enumerate(zip(ks, parts)))
    arrs = arrs[:-1] + (arrs[-1].astype(dtype),) if len(arrs) > 1 else arrs
    ss = jax.random.uniform(ks[-1], (parts[0][1],), jnp.float32, 20.0, 200.0) if deferred else None
    return GatedInput(arrs, ss, rows=rows, ffn=ffn, groups=groups, eps=1e-5, width=96, dtype=dtype)


# rows, parts (P, R), deferred norm scale, groups, I, N, kernel knobs
GATED = [
    (1, ((9, 1),), True, 1, 128, 64, {}),  # one row, deferred scale: the FMA path
    (3, ((9, 16), (1, 16)), False, 1, 128, 96, {}),  # three rows, split-K sums + a product part
    (2, ((4, 2),), True, 2, 128, 64, dict(block_k=64)),  # gate/up in two blocks, a K tile over both halves
    (16, ((9, 16),), False, 1, 64, 64, {}),  # the most rows the model hands over
]


def _check_gated(case, interpret):
    rows, parts, deferred, groups, ffn, n, kw = case
    gin = _gated(rows, parts, deferred, groups, ffn, seed=rows + ffn)
    kw = dict(dict(split_k=im.SPLIT_ALL), **kw)
    w = quant.quantize_int4(jax.random.normal(jax.random.key(n), (ffn, n), jnp.float32), group_size=32)
    return _against_finished(gin, w, interpret, kw)


@pytest.mark.parametrize("case", GATED)
def test_int4_matmul_makes_the_gated_input_on_its_loads(case, monkeypatch):
    seen, real = [], im._pending_static
    monkeypatch.setattr(im, "_pending_static", lambda p: seen.append(p.kind) or real(p))
    got, want = _check_gated(case, interpret=True)
    assert seen == ["gated"]
    assert (np.asarray(got) == np.asarray(want)).mean() > 0.97  # the same arithmetic: rare bf16 ties apart


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="compiled Triton kernel")
@pytest.mark.parametrize("case", GATED)
def test_compiled_int4_matmul_makes_the_gated_input_on_its_loads(case):
    _check_gated(case, interpret=False)


@pytest.mark.parametrize("rows", [1, 3])
def test_gated_input_is_the_models_own_ffn_input(rows):
    """`merged()` of the model's GatedInput (`model._gated_input`) is the input `forward` gives the down matmul:
    `normed_linear` (its deferred scale at one row), gate and up split, silu(gate) * up, in bf16."""
    cfg = PRESETS["tiny"]
    w = random_weights(cfg, jax.random.key(4), group_size=32)
    lw = w.layers[0]
    ks = KernelSet(qmatmul="pallas")
    x = jax.random.normal(jax.random.key(5), (rows, cfg.dim), jnp.float32)
    gate, up = model.split_parts(model.normed_linear(x, lw.ffn_norm, cfg.rms_eps, lw.w_gate_up, kernels=ks),
                                 lw.gate_up_groups, (cfg.ffn_dim, cfg.ffn_dim))
    want = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x.dtype)
    got = model._gated_input(cfg, lw, x, ks).merged()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("start", [[70], [0, 37, 100]])  # 3-4 of the 4 splits seen
def test_decode_step_with_pending_inputs_matches_the_step_without(start, monkeypatch):
    """A jitted decode step with Pallas matmuls and attention: splits handed to every layer's `o` matmul and gate+up's
    sums to its `down` give the logits and caches of the step that finishes both first (float32 tiny model), and
    both paths are taken."""
    cfg = PRESETS["tiny"]
    w = random_weights(cfg, jax.random.key(3), group_size=32)
    ks = KernelSet(attention_decode="pallas", qmatmul="pallas", qmatmul8="pallas")
    taken, real, cfg_of, seen = [], model.linear, im.default_config, []
    monkeypatch.setattr(model, "linear", lambda x, *a, **k: taken.append(getattr(x, "kind", None)) or real(
        x, *a, **k))
    monkeypatch.setattr(im, "_pending_static", lambda p, f=im._pending_static: seen.append(p.kind) or f(p))
    # one K tile a program, as the GPU's small-weight configuration (interpret mode's default loops over K)
    monkeypatch.setattr(im, "default_config", lambda *a, **k: dict(cfg_of(*a, **k), split_k=im.SPLIT_ALL))
    cache, toks, s = ragged_decode_inputs(cfg, start, max_len=128)  # 4 splits of 32 keys
    outs = []
    for on in (True, False):
        monkeypatch.setattr(model, "SPLIT_O", on)
        monkeypatch.setattr(model, "GATED_DOWN", on)
        step = jax.jit(lambda c, t, st: forward(cfg, ks, w, c, t, st), donate_argnums=0)
        outs.append(step(jax.tree.map(jnp.copy, cache), toks, s))
    # every layer's o and down matmuls took them (with the knobs on only), and the int4 kernel was traced with them
    assert taken.count("splits") == taken.count("gated") == cfg.n_layers and len(seen) == 2
    (got, got_c), (want, want_c) = outs
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5 * float(jnp.abs(want).max()))
    for a, c in zip(got_c.k + got_c.v, want_c.k + want_c.v):  # (layer 1's from layer 0's rounded output)
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-6)


def test_short_forward_with_the_gated_input_matches_the_forward_without(monkeypatch):
    """A forward of 2 rows x 5 positions (a short prefill; verify windows take the same `down` path) with gate+up's
    sums handed to `down` gives the logits of the forward that makes silu(gate) * up first, and takes the path."""
    cfg = PRESETS["tiny"]
    w = random_weights(cfg, jax.random.key(6), group_size=32)
    ks = KernelSet(qmatmul="pallas", qmatmul8="pallas")
    cfg_of, kinds, real = im.default_config, [], model.linear
    monkeypatch.setattr(im, "default_config", lambda *a, **k: dict(cfg_of(*a, **k), split_k=im.SPLIT_ALL))
    monkeypatch.setattr(model, "linear", lambda x, *a, **k: kinds.append(getattr(x, "kind", None)) or real(
        x, *a, **k))
    cache, _, _ = ragged_decode_inputs(cfg, [0, 0], max_len=32)
    toks = (jnp.arange(10).reshape(2, 5) * 11 + 1) % cfg.vocab_size
    outs = []
    for on in (True, False):
        monkeypatch.setattr(model, "GATED_DOWN", on)
        outs.append(forward(cfg, ks, w, jax.tree.map(jnp.copy, cache), toks, jnp.zeros((2,), jnp.int32))[0])
    assert kinds.count("gated") == cfg.n_layers
    np.testing.assert_allclose(np.asarray(outs[0]), np.asarray(outs[1]), rtol=0,
                               atol=1e-5 * float(jnp.abs(outs[1]).max()))
