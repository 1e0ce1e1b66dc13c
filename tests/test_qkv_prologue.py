"""The qkv prologue done inside the decode attention kernel (`lucebox_jax/qkv_prologue.py`, `prologue=`).

The kernel (interpret mode on the CPU; compiled in the `gpu`-marked case) is checked bitwise against the jnp prologue
(`QKVPrologue.apply`) followed by the same kernel without it; the jnp prologue bitwise against the model's own path
(`normed_linear`, `rms_norm`, `rope`); `linear_parts` against `linear`; and whole decode steps with the prologue
against steps without it (close, not bitwise: partials may be added in another order, and in float32 models the
rotation's products may be fused into FMAs differently).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from lucebox_jax import model, quant
from lucebox_jax.model import forward
from lucebox_jax.ops import KernelSet
from lucebox_jax.qkv_prologue import QKVPrologue, full_tables, rope_tables
from lucebox_jax.synthetic import PRESETS, random_weights
from pallas_kernels.attention_decode import attention_decode
from test_ops import ragged_decode_inputs

ON_GPU = jax.default_backend() == "gpu"

# B rows, R >= B matmul rows, Hq, Hkv, D, cache S, partial-sum arrays, q/k norms, deferred row norm, interleaved
# pairs, sliding window, kernel knobs
CASES = [
    (1, 1, 9, 3, 64, 64, (9,), False, True, True, 0, {}),  # SmolLM2's heads, split-K partials, one deferred row
    (3, 8, 6, 2, 64, 96, (3, 1), True, False, False, 0, {}),  # padded rows, int8 partials + mins part, q/k norms
    (2, 2, 8, 2, 128, 64, (1,), True, True, False, 0, dict(n_split=1)),  # one split: the kernel normalises
    (2, 2, 4, 1, 256, 80, (4, 1), True, False, False, 16, {}),  # Gemma 3's head dim, a sliding window
    (2, 4, 8, 8, 32, 48, (2,), False, False, True, 0, dict(block_k=16)),  # MHA, D = 32
]


def _case(b, r, hq, hkv, d, s, parts, norm, sumsq, inter, seed):
    ks = jax.random.split(jax.random.key(seed), 8)
    ps = tuple(jax.random.normal(ks[i], (p, r, hq + 2 * hkv, d), jnp.float32) for i, p in enumerate(parts))
    kc, vc = (jax.random.normal(ks[4 + i], (b, hkv, s, d), jnp.bfloat16) for i in range(2))
    lens = jnp.asarray(np.random.default_rng(seed).integers(1, s + 1, b), jnp.int32)
    ss = jax.random.uniform(ks[6], (r,), jnp.float32, 20.0, 200.0) if sumsq else None
    qn, kn = (jax.random.normal(jax.random.key(seed + i), (d,), jnp.float32) for i in (1, 2)) if norm else (None, None)
    cos, sin = rope_tables(lens - 1, d, 10000.0)
    pro = QKVPrologue(cos, sin, ss, qn, kn, hq, hkv, 1e-6, 96, inter, "bfloat16")
    return ps, kc, vc, lens, pro


def _check(case, interpret):
    b, r, hq, hkv, d, s, parts, norm, sumsq, inter, sliding, kw = case
    ps, kc, vc, lens, pro = _case(b, r, hq, hkv, d, s, parts, norm, sumsq, inter, seed=d + s + hq)
    kw = dict(kw, scale=d ** -0.5, interpret=interpret, append=True, sliding=sliding)
    want, wk, wv = attention_decode(pro.apply(ps), kc, vc, lens, **kw)
    cos, sin = full_tables(pro.cos, pro.sin, inter)
    args = dict(parts=ps[1:], row_sumsq=pro.row_sumsq, cos=cos, sin=sin, q_norm=pro.q_norm, k_norm=pro.k_norm)
    got, gk, gv = jax.jit(lambda p0, k, v, n: attention_decode(
        p0, k, v, n, prologue=args, prologue_eps=1e-6, prologue_dim=96, rope_interleaved=inter, **kw),
        donate_argnums=(1, 2))(ps[0], jnp.copy(kc), jnp.copy(vc), lens)
    assert got.shape == want.shape == (b, hq, d) and got.dtype == jnp.bfloat16
    assert (np.asarray(got) == np.asarray(want)).all()
    assert (np.asarray(gk) == np.asarray(wk)).all() and (np.asarray(gv) == np.asarray(wv)).all()
    assert not (np.asarray(gk) == np.asarray(kc)).all()  # the step's key was written


@pytest.mark.parametrize("case", CASES)
def test_kernel_prologue_is_the_jnp_prologue_then_the_kernel(case):
    _check(case, interpret=True)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("case", CASES)
def test_compiled_kernel_prologue_is_the_jnp_prologue_then_the_kernel(case):
    _check(case, interpret=False)


@pytest.mark.parametrize("rows,qk_norm,inter", [(1, False, True), (3, True, False), (1, True, False)])
def test_jnp_prologue_is_the_models_own_path(rows, qk_norm, inter):
    """QKVPrologue.apply over `linear_parts` (int4 Pallas-Triton partials, interpret mode) gives bitwise the q, k, v
    the model makes with `normed_linear` (its deferred one-row norm included), `rms_norm` and `rope`, in bfloat16."""
    cfg = dataclasses.replace(PRESETS["tiny"], dim=1024, qk_norm=qk_norm, rope_interleaved=inter, dtype="bfloat16")
    w = random_weights(cfg, jax.random.key(4), group_size=32)
    lw, ks = w.layers[0], KernelSet(qmatmul="pallas")
    hq, hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    x = jax.random.normal(jax.random.key(5), (rows, 1, cfg.dim), jnp.bfloat16)
    pos = jnp.arange(rows, dtype=jnp.int32)[:, None] * 7 + 3

    def own(x):
        qkv = model.normed_linear(x, lw.attn_norm, cfg.rms_eps, lw.wqkv, kernels=ks)
        q, k, v = (p.reshape(rows, 1, -1, hd) for p in model.split_parts(qkv, 1, (cfg.q_dim, cfg.kv_dim, cfg.kv_dim)))
        if qk_norm:
            q, k = model.rms_norm(q, lw.q_norm, cfg.rms_eps), model.rms_norm(k, lw.k_norm, cfg.rms_eps)
        q, k = (model.rope(t, pos, cfg.rope_theta, inter) for t in (q, k))
        return jnp.concatenate([q, k, v], axis=2)[:, 0]

    def via_prologue(x):
        xr, xf = x.reshape(rows, -1), x.reshape(rows, -1).astype(jnp.float32)
        deferred = model.one_deferred_row(x)
        h = ((xf * lw.attn_norm).astype(x.dtype) if deferred else model.rms_norm(xr, lw.attn_norm, cfg.rms_eps))
        parts = tuple(p.reshape(*p.shape[:2], hq + 2 * hkv, hd) for p in quant.linear_parts(h, lw.wqkv, ks))
        assert parts[0].shape[0] > 1  # split-K partials, as the kernel wrote them
        pro = QKVPrologue(*rope_tables(pos[:, 0], hd, cfg.rope_theta), jnp.sum(xf * xf, -1) if deferred else None,
                          lw.q_norm, lw.k_norm, hq, hkv, cfg.rms_eps, cfg.dim, inter, "bfloat16")
        return pro.apply(parts)

    a, b = jax.jit(own)(x), jax.jit(via_prologue)(x)
    assert a.shape == b.shape == (rows, hq + 2 * hkv, hd)
    assert (np.asarray(a) == np.asarray(b)).all()


def test_linear_parts_sum_to_linear():
    """Split-K partials (int4, and int8 with the mins term as one more part), one part for XLA; each sums to the
    product `linear` returns."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 1024)), jnp.bfloat16)
    w4 = quant.quantize_int4(rng.standard_normal((1024, 96)).astype(np.float32), group_size=32)
    w8 = quant.quantize_int8(rng.standard_normal((1024, 96)).astype(np.float32), group_size=32)
    w8 = dataclasses.replace(w8, mins=jnp.asarray(rng.standard_normal(w8.scales.shape) * 0.01, jnp.float16))
    for w, qm, n_arrays in ((w4, "pallas", 1), (w8, "pallas", 2), (w4, "xla", 1)):
        ks = KernelSet(qmatmul=qm, qmatmul8=qm)
        parts = quant.linear_parts(x, w, ks)
        assert len(parts) == n_arrays and all(p.ndim == 3 and p.shape[1:] == (3, 96) for p in parts)
        assert qm == "xla" or parts[0].shape[0] > 1
        total = sum(jnp.sum(p.astype(jnp.float32), axis=0) for p in parts)
        want = quant.linear(x, w, kernels=ks).astype(jnp.float32)
        assert float(jnp.max(jnp.abs(total - want))) <= 0.02 * float(jnp.max(jnp.abs(want)))


def _gemma3_tiny():
    return dataclasses.replace(PRESETS["gemma3_270m"], vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=1,
                               head_dim=32, ffn_dim=128, sliding_window=8, sliding_window_pattern=2, embed_scale=8.0,
                               attn_scale=32 ** -0.5)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3"])
def test_decode_step_with_the_prologue_matches_the_step_without(name, monkeypatch):
    """A jitted decode step (cache donated) with Pallas matmuls and attention, batch 1 and 3 rows at ragged starts:
    the prologue's logits and caches match the XLA prologue's (float32 tiny models: to ~1e-6 relative)."""
    cfg = {"llama": PRESETS["tiny"], "gemma3": _gemma3_tiny(),
           "qwen3": dataclasses.replace(PRESETS["tiny"], arch="qwen3", qk_norm=True, rope_interleaved=False)}[name]
    w = random_weights(cfg, jax.random.key(2), group_size=32)
    ks = KernelSet(attention_decode="pallas", qmatmul="pallas", qmatmul8="pallas")
    calls, real = [], model._prologue_attend
    monkeypatch.setattr(model, "_prologue_attend", lambda *a: calls.append(1) or real(*a))
    for start in ([5], [0, 9, 31]):
        cache, toks, s = ragged_decode_inputs(cfg, start)
        outs = []
        for on in (True, False):
            monkeypatch.setattr(model, "QKV_PROLOGUE", on)
            step = jax.jit(lambda c, t, st: forward(cfg, ks, w, c, t, st), donate_argnums=0)
            outs.append(step(jax.tree.map(jnp.copy, cache), toks, s))
        assert len(calls) == cfg.n_layers * (1 if start == [5] else 2)  # every layer took it, with it on only
        (got, got_c), (want, want_c) = outs
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5 * float(jnp.abs(want).max()))
        for a, c in zip(got_c.k + got_c.v, want_c.k + want_c.v):
            np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-6)
        assert not (np.asarray(want_c.k[0]) == np.asarray(cache.k[0])).all()
