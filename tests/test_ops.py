"""The kernel registry: names resolve, unknown ones fail listing the valid ones, and a researcher's kernel registered
with the decorator is selected by name and actually runs in the model."""

import jax
import jax.numpy as jnp
import pytest

from lucebox_jax import ops
from lucebox_jax.errors import UnknownKernelError
from lucebox_jax.kernels_xla import qmatmul_xla
from lucebox_jax.model import forward, init_cache
from lucebox_jax.ops import KernelSet
from lucebox_jax.synthetic import PRESETS, random_weights


def test_defaults_and_parse():
    ks = KernelSet.resolve("qmatmul=xla", backend="cpu")
    assert ks == KernelSet("xla", "xla", "xla", "xla")
    assert ops.parse_spec(" qmatmul=a , attention_decode=b") == {"qmatmul": "a", "attention_decode": "b"}
    assert "xla" in ops.available("attention_prefill")


@pytest.mark.parametrize("spec,msg", [("qmatmul=nope", "unknown kernel 'nope' for op 'qmatmul'; valid: .*xla"),
                                      ("matmul=xla", "unknown op 'matmul'; valid ops: qmatmul"),
                                      ("qmatmul", "expected op=name")])
def test_unknown_names(spec, msg):
    with pytest.raises(UnknownKernelError, match=msg):
        KernelSet.resolve(spec)


def test_registered_kernel_is_used():
    calls = []

    @ops.register("qmatmul", "counting_test_kernel")
    def counting(x, w):
        calls.append(x.shape)
        return qmatmul_xla(x, w)

    cfg = PRESETS["tiny"]
    w = random_weights(cfg, jax.random.key(0), group_size=32)
    ks = KernelSet.resolve("qmatmul=counting_test_kernel")
    cache = init_cache(cfg, 1, 16)
    ref, _ = forward(cfg, KernelSet(), w, cache, jnp.arange(4)[None], jnp.zeros((1,), jnp.int32))
    got, _ = forward(cfg, ks, w, cache, jnp.arange(4)[None], jnp.zeros((1,), jnp.int32))
    assert len(calls) == 4 * cfg.n_layers  # qkv, o, gate|up, down per layer (the int8 head: op qmatmul8)
    assert jnp.allclose(ref, got)


def test_short_verify_attends_as_decode_rows_and_kernels_without_rows_still_serve():
    """forward(verify=True) of a few positions runs them as decode rows (the decode kernel, with `rows`); a registered
    decode kernel that has no `rows` parameter leaves the verify to attention_prefill. Both give plain prefill's
    logits and cache."""
    from lucebox_jax.kernels_xla import attention_decode_xla
    from lucebox_jax.model import VERIFY_AS_DECODE_ROWS

    seen = []

    @ops.register("attention_decode", "rows_test_kernel")
    def with_rows(q, k, v, lengths, rows=None, *, scale, window=None):
        seen.append(("rows", q.shape[0], rows is not None))
        return attention_decode_xla(q, k, v, lengths, rows, scale=scale, window=window)

    @ops.register("attention_decode", "no_rows_test_kernel")
    def without_rows(q, k, v, lengths, *, scale, window=None):
        seen.append(("plain", q.shape[0]))
        return attention_decode_xla(q, k, v, lengths, scale=scale, window=window)

    assert ops.accepts("attention_decode", "rows_test_kernel", "rows")
    assert not ops.accepts("attention_decode", "no_rows_test_kernel", "rows")
    cfg = PRESETS["tiny"]
    w = random_weights(cfg, jax.random.key(1), group_size=32)
    cache = init_cache(cfg, 2, 32).replace(lengths=jnp.array([3, 7], jnp.int32))
    toks, start = jnp.arange(10).reshape(2, 5) % cfg.vocab_size, jnp.array([3, 7], jnp.int32)
    want, want_cache = forward(cfg, KernelSet(), w, cache, toks, start)
    for name in ("rows_test_kernel", "no_rows_test_kernel"):
        seen.clear()
        got, got_cache = forward(cfg, KernelSet(attention_decode=name), w, cache, toks, start, verify=True)
        assert jnp.allclose(got, want, atol=1e-4, rtol=1e-4)
        assert all(jnp.allclose(a, b, atol=1e-4, rtol=1e-4) for a, b in zip(got_cache.k, want_cache.k))
        # 2 rows x 5 positions as 10 decode rows reading cache rows [0]*5 + [1]*5; none without `rows`
        assert seen == ([("rows", 10, True)] * cfg.n_layers if name == "rows_test_kernel" else [])
    long = jnp.zeros((1, VERIFY_AS_DECODE_ROWS + 1), jnp.int32)
    seen.clear()
    forward(cfg, KernelSet(attention_decode="rows_test_kernel"), w, init_cache(cfg, 1, 64), long,
            jnp.zeros((1,), jnp.int32), verify=True)
    assert seen == []  # a longer verify stays with attention_prefill


def ragged_decode_inputs(cfg, start: list[int], max_len: int = 32):
    """A decode step's inputs at rows starting at `start`: a cache of random keys (zero values), one token a row."""
    b, s = len(start), jnp.array(start, jnp.int32)
    cache = init_cache(cfg, b, max_len)
    cache = cache.replace(k=tuple(jax.random.normal(jax.random.key(i), c.shape, c.dtype)
                                  for i, c in enumerate(cache.k)), lengths=s)
    return cache, (jnp.arange(b)[:, None] * 7 + 3) % cfg.vocab_size, s


def test_decode_kernel_that_appends_kv_gives_the_written_then_attended_step(monkeypatch):
    """A decode step with the Pallas decode kernel (interpret mode) appending the step's own K/V (`append`, the
    default) gives bitwise the logits and cache of the step that writes the cache first (model.APPEND_KV = False):
    batch 1 and 3 rows at ragged starts, in a jitted step with the cache donated, as the engine runs it. (XLA
    makes q, k, v here: the kernel's own prologue rounds otherwise, `test_qkv_prologue_*`.)"""
    from lucebox_jax import model

    monkeypatch.setattr(model, "QKV_PROLOGUE", False)

    assert ops.accepts("attention_decode", "pallas", "append")
    cfg = PRESETS["tiny"]
    w = random_weights(cfg, jax.random.key(2), group_size=32)
    ks = KernelSet(attention_decode="pallas")
    for start in ([5], [0, 9, 31]):
        cache, toks, s = ragged_decode_inputs(cfg, start)
        outs = []
        for append in (True, False):
            model.APPEND_KV = append
            try:
                step = jax.jit(lambda c, t, st: forward(cfg, ks, w, c, t, st), donate_argnums=0)
                outs.append(step(jax.tree.map(jnp.copy, cache), toks, s))
            finally:
                model.APPEND_KV = True
        (got, got_c), (want, want_c) = outs
        assert (got == want).all()
        for a, c in zip(got_c.k + got_c.v, want_c.k + want_c.v):
            assert (a == c).all()
        assert not (want_c.k[0] == cache.k[0]).all()  # the step wrote its keys


def test_verify_whose_decode_kernel_appends_the_window_gives_the_written_then_attended_logits():
    """A short verify (decode rows) with the Pallas decode kernel (interpret mode) writing the window's K/V itself
    (`window_rows`, the default) gives the cache and logits of the verify that writes it first (model.APPEND_VERIFY =
    False), up to the softmax's order; batch 1 and 2 rows at ragged starts, jitted, cache donated."""
    from lucebox_jax import model

    assert ops.accepts("attention_decode", "pallas", "window_rows")
    cfg = PRESETS["tiny"]
    w = random_weights(cfg, jax.random.key(3), group_size=32)
    ks = KernelSet(attention_decode="pallas")
    for start in ([5], [0, 21]):
        b = len(start)
        s = jnp.array(start, jnp.int32)
        cache = init_cache(cfg, b, 32)
        cache = cache.replace(k=tuple(jax.random.normal(jax.random.key(i), c.shape, c.dtype)
                                      for i, c in enumerate(cache.k)), lengths=s)
        toks = (jnp.arange(b * 5).reshape(b, 5) * 7 + 3) % cfg.vocab_size
        outs = []
        for append in (True, False):
            model.APPEND_VERIFY = append
            try:
                step = jax.jit(lambda c, t, st: forward(cfg, ks, w, c, t, st, verify=True), donate_argnums=0)
                outs.append(step(jax.tree.map(jnp.copy, cache), toks, s))
            finally:
                model.APPEND_VERIFY = True
        (got, got_c), (want, want_c) = outs
        assert jnp.allclose(got, want, atol=2e-3, rtol=2e-3)
        # the first layer's window is written exactly; later layers' keys follow attention outputs that round apart
        assert (got_c.k[0] == want_c.k[0]).all() and (got_c.v[0] == want_c.v[0]).all()
        for a, c in zip(got_c.k + got_c.v, want_c.k + want_c.v):
            assert jnp.allclose(a, c, atol=1e-4, rtol=1e-4)
        assert not (want_c.k[0][:, :, start[0]:start[0] + 5] == cache.k[0][:, :, start[0]:start[0] + 5]).all()


def _tiny_verify_case(seed: int, lengths=(3, 7), max_len: int = 32):
    """The tiny model's random weights and a cache of len(lengths) rows at those lengths, random keys in it."""
    cfg = PRESETS["tiny"]
    start = jnp.array(lengths, jnp.int32)
    cache = init_cache(cfg, len(lengths), max_len).replace(lengths=start)
    cache = cache.replace(k=tuple(jax.random.normal(jax.random.key(i), c.shape, c.dtype)
                                  for i, c in enumerate(cache.k)))
    return cfg, random_weights(cfg, jax.random.key(seed), group_size=32), start, cache


def test_residual_stream_kept_at_the_matmul_kernels_padded_rows():
    """A qmatmul kernel that registers `rows` (mgpu: 9 rows run as 16) gets its inputs already padded: forward keeps
    the residual stream at that many rows, zero past B * T, and the Pallas decode kernel hands a verify's attention
    output over padded (`out_rows`). Logits, cache and hidden states equal those of the same kernel without `rows`:
    a verify as decode rows (2 x 5 -> 16 rows), a tree's nodes as decode rows, a prefill (3 -> 8 rows)."""
    seen = []

    def padded(x, w):
        seen.append(x.shape[0])
        return qmatmul_xla(x, w)

    ops.register("qmatmul", "unpadded_test_kernel")(padded)
    ops.register("qmatmul", "padded_test_kernel", rows=lambda m: -(-m // 8) * 8)(padded)
    assert ops.padded_rows("qmatmul", "padded_test_kernel", 10) == 16
    assert ops.padded_rows("qmatmul", "unpadded_test_kernel", 10) == 10
    # a kernel that prepares its weights (as mgpu / best) pads only those it prepared: the rest run its fallback
    ops.register("qmatmul", "preparing_test_kernel", prepare=lambda w: w, rows=lambda m: 64)(padded)

    class Prepared:
        matmul_op, prepared_by = "qmatmul", "padded_test_kernel"

    wq = random_weights(PRESETS["tiny"], jax.random.key(5), group_size=32).layers[0].wo
    assert ops.padded_rows("qmatmul", "preparing_test_kernel", 10, wq) == 10
    assert ops.padded_rows("qmatmul", "preparing_test_kernel", 10) == 64
    assert ops.padded_rows("qmatmul", "preparing_test_kernel", 10, Prepared()) == 16
    assert ops.accepts("attention_decode", "pallas", "out_rows")
    cfg, w, start, cache = _tiny_verify_case(4)
    t = 5
    depth = jnp.broadcast_to(jnp.array([0, 1, 1, 2, 2], jnp.int32), (2, t))  # root, two children, a grandchild each
    parent = jnp.array([-1, 0, 0, 1, 2])
    anc = jnp.eye(t, dtype=bool)
    for j in range(1, t):
        anc = anc.at[j].set(anc[j] | anc[parent[j]])
    cases = [("verify", jnp.arange(10).reshape(2, 5) % cfg.vocab_size, dict(verify=True), 16),
             ("tree", jnp.arange(10).reshape(2, 5) % cfg.vocab_size,
              dict(verify=True, tree=(depth, jnp.broadcast_to(anc, (2, t, t)))), 16),
             ("prefill", jnp.arange(3)[None] % cfg.vocab_size, {}, 8)]
    for label, toks, kw, rows in cases:
        b = toks.shape[0]
        c = cache if b == 2 else init_cache(cfg, 1, 32)
        s = start[:b] if b == 2 else jnp.zeros((1,), jnp.int32)
        outs = []
        for name in ("unpadded_test_kernel", "padded_test_kernel"):
            seen.clear()
            ks = KernelSet(qmatmul=name, attention_decode="pallas")
            outs.append(forward(cfg, ks, w, c, toks, s, hidden_layers=(0, 1), **kw))
            assert set(seen) == {toks.size if name.startswith("un") else rows}, (label, seen)
        (want, want_c, want_h), (got, got_c, got_h) = outs
        assert got.shape == want.shape and got_h.shape == want_h.shape, label
        assert jnp.allclose(got, want, atol=1e-5, rtol=1e-5), label
        assert jnp.allclose(got_h, want_h, atol=1e-5, rtol=1e-5), label
        for a, e in zip(got_c.k + got_c.v, want_c.k + want_c.v):
            assert jnp.allclose(a, e, atol=1e-5, rtol=1e-5), label


def test_verify_and_tree_with_packed_windows_equal_the_per_row_kernel(monkeypatch):
    """The decode kernel's packed windows (one program a window and kv head; by default at head dims >= 128 only,
    forced here at the tiny model's) give the per-row kernel's logits and caches: a chain verify of 2 x 5 positions
    and a tree of 5 nodes, interpret mode."""
    from pallas_kernels import attention_decode as ad

    cfg, w, start, cache = _tiny_verify_case(6)
    toks = jnp.arange(10).reshape(2, 5) % cfg.vocab_size
    anc = jnp.tril(jnp.ones((5, 5), bool)).at[2, 1].set(False)  # node 2 a sibling of node 1
    depth = jnp.broadcast_to(jnp.array([0, 1, 1, 2, 3], jnp.int32), (2, 5))
    ks = KernelSet(attention_decode="pallas")
    for kw in (dict(verify=True), dict(verify=True, tree=(depth, jnp.broadcast_to(anc, (2, 5, 5))))):
        outs = []
        for pack in ("0", "1"):
            monkeypatch.setattr(ad, "PACK_WINDOWS", pack)
            outs.append(forward(cfg, ks, w, cache, toks, start, **kw))
        (want, want_c), (got, got_c) = outs
        assert jnp.allclose(got, want, atol=1e-5, rtol=1e-5)
        for a, e in zip(got_c.k + got_c.v, want_c.k + want_c.v):
            assert jnp.allclose(a, e, atol=1e-5, rtol=1e-5)


def test_tree_rows_limit_follows_the_packed_window(monkeypatch):
    """Trees verify as decode rows up to 64 rows at head dims >= 128 (where windows run packed: timed on an H100),
    32 below; LUCEBOX_TREE_ROWS (TREE_AS_ROWS) sets one limit for all."""
    from lucebox_jax import model

    monkeypatch.setattr(model, "TREE_AS_ROWS", None)
    assert (model.tree_rows_limit(128), model.tree_rows_limit(256), model.tree_rows_limit(64)) == (64, 64, 32)
    monkeypatch.setattr(model, "TREE_AS_ROWS", 0)
    assert model.tree_rows_limit(128) == model.tree_rows_limit(64) == 0


def test_tree_of_33_rows_as_packed_decode_rows_equals_the_tiled_tree(monkeypatch):
    """A tree of 32 nodes and its root (33 rows, two mask words, several programs a window) run as packed decode rows
    (`LUCEBOX_TREE_ROWS` past 32: the default at head dims >= 128) gives the tiled tree kernel's logits and caches."""
    from lucebox_jax import model
    from lucebox_jax.tree import ancestors
    from pallas_kernels import attention_decode as ad

    cfg, w, start, cache = _tiny_verify_case(7, lengths=(9,), max_len=64)
    n, width, depth = 32, 8, 4
    parent = jnp.asarray([[0 if i < width else i - width + 1 for i in range(n)]], jnp.int32)  # 8 chains of 4
    dep = jnp.concatenate([jnp.zeros((1, 1), jnp.int32), jnp.asarray([[1 + i // width for i in range(n)]])], axis=1)
    anc = ancestors(parent, depth)
    toks = (jnp.arange(n + 1)[None] * 5 + 1) % cfg.vocab_size
    ks = KernelSet(attention_decode="pallas", attention_tree="pallas")
    monkeypatch.setattr(ad, "PACK_WINDOWS", "1")
    outs = []
    for rows in (0, 64):
        monkeypatch.setattr(model, "TREE_AS_ROWS", rows)
        outs.append(forward(cfg, ks, w, cache, toks, start, tree=(dep, anc)))
    (want, want_c), (got, got_c) = outs
    assert jnp.allclose(got, want, atol=1e-4, rtol=1e-4)
    for a, e in zip(got_c.k + got_c.v, want_c.k + want_c.v):
        assert jnp.allclose(a, e, atol=1e-5, rtol=1e-5)


def test_norms_deferred_over_several_rows_give_the_same_logits(monkeypatch):
    """LUCEBOX_DEFER_NORM_ROWS past 1 (an A/B knob): a verify's norms scaled after their matmuls give the logits of
    normalizing first, padded rows included (zero rows scale to zero, not NaN)."""
    from lucebox_jax import model

    cfg, w, start, cache = _tiny_verify_case(8)
    toks = jnp.arange(10).reshape(2, 5) % cfg.vocab_size
    ops.register("qmatmul", "padded_defer_test_kernel", rows=lambda m: -(-m // 8) * 8)(qmatmul_xla)
    outs = []
    for rows in (1, 16):
        monkeypatch.setattr(model, "DEFER_NORM_ROWS", rows)
        logits, _ = forward(cfg, KernelSet(qmatmul="padded_defer_test_kernel"), w, cache, toks, start, verify=True)
        outs.append(logits)
    assert bool(jnp.isfinite(outs[1]).all())
    assert jnp.allclose(outs[1], outs[0], atol=1e-4, rtol=1e-4)
