"""Sampling: the top-k/top-p/min-p masks against a plain NumPy twin, seeds, per-row independence, the temperature
distribution, the repetition-penalty rule and parameter validation."""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from lucebox_jax.errors import InvalidSamplingParamsError
from lucebox_jax.sampling import (RowParams, SamplingParams, apply_repetition_penalty, filter_logits,
                                  np_filter_reference)
from lucebox_jax.sampling import sample as _sample

sample = jax.jit(_sample)


@pytest.mark.parametrize("temp,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.0, 0, 0.5, 0.0), (1.3, 0, 1.0, 0.1),
    (0.8, 20, 0.9, 0.05), (1.0, 1, 1.0, 0.0), (2.0, 50, 0.3, 0.2)])
def test_filter_matches_numpy(temp, top_k, top_p, min_p):
    rng = np.random.default_rng(top_k + int(100 * top_p))
    logits = rng.standard_normal((3, 200)).astype(np.float32) * 3
    b = logits.shape[0]
    x = filter_logits(jnp.asarray(logits), jnp.full(b, temp), jnp.full(b, top_k, jnp.int32), jnp.full(b, top_p),
                      jnp.full(b, min_p))
    got = np.asarray(x) > -1e29
    for r in range(b):
        np.testing.assert_array_equal(got[r], np_filter_reference(logits[r], temp, top_k, top_p, min_p))


def test_temperature_only_rows_skip_the_sort_with_the_same_result():
    """Rows that ask neither top-k nor top-p are filtered without sorting the vocabulary (`sort=False`): the same
    logits, min-p included; `by_temperature` picks that branch only when no row of the batch asks for either, and
    a sampled token is the same either way."""
    from lucebox_jax.sampling import by_temperature, needs_sort

    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.standard_normal((3, 200)).astype(np.float32) * 3)
    for min_p in (0.0, 0.1):
        args = (logits, jnp.full(3, 0.7), jnp.zeros(3, jnp.int32), jnp.ones(3), jnp.full(3, min_p))
        np.testing.assert_array_equal(np.asarray(filter_logits(*args, sort=False)), np.asarray(filter_logits(*args)))
    plain = [SamplingParams(temperature=0.7, seed=s) for s in range(3)]
    mixed = plain[:2] + [SamplingParams(temperature=0.7, seed=2, top_p=0.9)]
    greedy = [SamplingParams(temperature=0, seed=s) for s in range(3)]
    pick = jax.jit(lambda rp: by_temperature(rp, 200, lambda: 0, lambda *, sort: 2 if sort else 1))
    assert [int(pick(rp_of(ps))) for ps in (greedy, plain, mixed)] == [0, 1, 2]
    assert not bool(needs_sort(rp_of(plain), 200)) and bool(needs_sort(rp_of([SamplingParams(top_k=5)]), 200))
    assert not bool(needs_sort(rp_of([SamplingParams(top_k=200)]), 200))  # k = V keeps everything
    pos = jnp.arange(3, dtype=jnp.int32)
    tok = sample(logits, rp_of(plain), pos)  # temperature only: no sort
    tok_sorted = sample(logits, rp_of([SamplingParams(temperature=0.7, seed=s, top_k=200) for s in range(3)]), pos)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(tok_sorted))  # (top_k = V: the sorting branch)


def rp_of(params):
    return RowParams.from_params(params)


def _primitives(jaxpr):
    """Every primitive name in a closed jaxpr, sub-jaxprs included."""
    out = set()
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out |= _primitives(sub)
    return out


@pytest.mark.parametrize("params,mode", [
    ([SamplingParams(temperature=0, seed=1)] * 2, 0),
    ([SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=2)], 1),
    ([SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_p=0.9)], 2),
    ([SamplingParams(temperature=0.9, top_k=5), SamplingParams(temperature=0, top_p=0.5)], 2),
    ([SamplingParams(temperature=0, top_k=5)], 0),  # a greedy row's top-k is never used
])
def test_static_mode_fixes_the_branch_and_draws_the_same_tokens(params, mode):
    """`from_params(static=True)` decides the sampling branch on the host: the traced step has no conditional (each
    costs a device-to-host copy and a wait on the GPU), and draws exactly the tokens of the on-device choice."""
    from lucebox_jax.speculative import accept_tokens

    rng = np.random.default_rng(mode)
    b, v = len(params), 300
    logits = jnp.asarray(rng.standard_normal((b, v)).astype(np.float32) * 3)
    pos = jnp.arange(b, dtype=jnp.int32) + 7
    dyn, fixed = RowParams.from_params(params), RowParams.from_params(params, static=True)
    assert (dyn.mode, fixed.mode, fixed.penalized) == (None, mode, False)
    for i in range(4):
        np.testing.assert_array_equal(np.asarray(sample(logits, fixed, pos + i)), np.asarray(sample(logits, dyn, pos + i)))
    seen = jnp.zeros((b, v), bool)
    assert "cond" in _primitives(jax.make_jaxpr(lambda lg, rp: _sample(lg, rp, pos, seen))(logits, dyn).jaxpr)
    assert "cond" not in _primitives(jax.make_jaxpr(lambda lg, rp: _sample(lg, rp, pos, seen))(logits, fixed).jaxpr)
    # speculative acceptance (with the repetition-penalty switch) likewise
    vlog = jnp.asarray(rng.standard_normal((b, 3, v)).astype(np.float32) * 3)
    drafts = jnp.argmax(vlog[:, :2], axis=-1).astype(jnp.int32).at[:, 1].set(5)
    acc = jax.jit(lambda rp: accept_tokens(vlog, drafts, None, rp, pos, seen))
    for x, y in zip(acc(fixed), acc(dyn)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    jx = jax.make_jaxpr(lambda rp: accept_tokens(vlog, drafts, None, rp, pos, seen))(fixed).jaxpr
    assert "cond" not in _primitives(jx)
    pen = RowParams.from_params([dataclasses.replace(params[0], repetition_penalty=1.3)] + params[1:], static=True)
    assert pen.penalized is True


def test_top_k_wide_equals_lax_top_k():
    """The two-stage top-k (slices, then their winners) gives lax.top_k's values and indices, ties included, for
    widths that are and are not a multiple of the slice."""
    from lucebox_jax.sampling import top_k_wide

    rng = np.random.default_rng(0)
    for shape, k, chunk in [((8, 49152), 8, 1024), ((2, 3, 5000), 4, 1024), ((4, 700), 16, 64), ((3, 100), 3, 64)]:
        x = np.round(rng.standard_normal(shape) * 4) / 4  # many equal values
        want = jax.lax.top_k(jnp.asarray(x, jnp.float32), k)
        got = top_k_wide(jnp.asarray(x, jnp.float32), k, chunk=chunk)
        for a, g in zip(want, got):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(g))


def test_small_top_k_equals_lax_top_k():
    """The comparison top-k (descending_rank) gives lax.top_k's values and indices: ties to the lower index, +0 above
    -0, -inf last, over the short rows the tree's beam and node choice rank; its ranks are a permutation."""
    from lucebox_jax.sampling import descending_rank, small_top_k

    rng = np.random.default_rng(1)
    for shape, k in [((64, 9), 3), ((16, 39), 15), ((2, 3, 12), 4), ((5, 1), 1)]:
        x = np.round(rng.standard_normal(shape) * 2) / 2  # many equal values
        x[rng.random(shape) < 0.15] = -np.inf
        x[rng.random(shape) < 0.15] = -0.0
        x[rng.random(shape) < 0.15] = 0.0
        want = jax.lax.top_k(jnp.asarray(x, jnp.float32), k)
        got = small_top_k(jnp.asarray(x, jnp.float32), k)
        for a, g in zip(want, got):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(g))
        rank = np.asarray(descending_rank(jnp.asarray(x, jnp.float32)))
        np.testing.assert_array_equal(np.sort(rank, axis=-1), np.broadcast_to(np.arange(shape[-1]), shape))


def test_one_pass_logsumexp_against_numpy():
    """The one-pass logsumexp (a variadic reduction of (max, scaled sum) pairs) against NumPy's float64 value, on
    vocabulary-long rows, large magnitudes, rows with -inf (masked tokens) and an all -inf row (-inf, not nan)."""
    from lucebox_jax.sampling import log_softmax, logsumexp

    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 49152)) * 8
    x[1] += 1e4  # exp would overflow without the running max
    x[2, ::3] = -np.inf
    x[3] = -np.inf
    x[3, 7] = 2.5
    want = np.log(np.sum(np.exp(x - x.max(-1, keepdims=True)), -1, keepdims=True)) + x.max(-1, keepdims=True)
    got = np.asarray(jax.jit(logsumexp)(jnp.asarray(x, jnp.float32)), np.float64)
    assert got.shape == (4, 1)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    assert got[3, 0] == 2.5
    allneg = np.asarray(logsumexp(jnp.full((2, 300), -jnp.inf, jnp.float32)))
    assert np.all(np.isneginf(allneg))
    lp = np.asarray(jax.jit(log_softmax)(jnp.asarray(x[:2], jnp.float32)), np.float64)
    np.testing.assert_allclose(np.log(np.sum(np.exp(lp), -1)), 0, atol=1e-5)


def test_seed_reproducible_and_batch_independent():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((1, 1000)), jnp.float32)
    p = SamplingParams(temperature=1.0, seed=42)
    a = [int(sample(logits, rp_of([p]), jnp.asarray([i]))[0]) for i in range(20)]
    b = [int(sample(logits, rp_of([p]), jnp.asarray([i]))[0]) for i in range(20)]
    assert a == b
    c = [int(sample(logits, rp_of([SamplingParams(temperature=1.0, seed=43)]), jnp.asarray([i]))[0]) for i in range(20)]
    assert a != c
    # the same request inside a batch of others draws the same tokens
    batch = jnp.concatenate([logits, logits * 0.5, logits], axis=0)
    others = [SamplingParams(temperature=0.5, seed=1), p, SamplingParams(temperature=0)]
    for i in range(5):
        tok = sample(batch, rp_of(others), jnp.asarray([i, i, i]))
        assert int(tok[1]) == int(sample(logits * 0.5, rp_of([p]), jnp.asarray([i]))[0])
        assert int(tok[2]) == int(jnp.argmax(logits))


def test_temperature_distribution():
    """Empirical frequencies over 4000 draws match softmax(logits / T) (chi-square, p > 0.001)."""
    logits = np.array([1.0, 0.5, 0.0, -1.0, 2.0], np.float32)
    t = 0.7
    n = 4000
    l = jnp.tile(jnp.asarray(logits)[None], (n, 1))
    rp = rp_of([SamplingParams(temperature=t, seed=9)] * n)
    toks = np.asarray(sample(l, rp, jnp.arange(n)))
    # rows share a seed but differ in position, so draws are independent
    obs = np.bincount(toks, minlength=5)
    p = np.exp(logits / t) / np.exp(logits / t).sum()
    chi2 = float(((obs - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 18.47, (obs, n * p)  # chi-square 4 dof at p = 0.001


def test_greedy_is_argmax_and_top_k_1():
    logits = jnp.asarray(np.random.default_rng(5).standard_normal((4, 300)), jnp.float32)
    rp = rp_of([SamplingParams(temperature=0), SamplingParams(temperature=1.5, top_k=1, seed=3),
                SamplingParams(temperature=1.0, min_p=1.0, seed=4), SamplingParams(temperature=1.0, top_p=1e-6)])
    tok = np.asarray(sample(logits, rp, jnp.arange(4)))
    np.testing.assert_array_equal(tok, np.argmax(np.asarray(logits), axis=-1))


def test_repetition_penalty_rule():
    logits = jnp.asarray([[2.0, -2.0, 1.0, -1.0]])
    seen = jnp.asarray([[True, True, False, False]])
    out = np.asarray(apply_repetition_penalty(logits, seen, jnp.asarray([2.0])))
    np.testing.assert_allclose(out, [[1.0, -4.0, 1.0, -1.0]])
    rp = rp_of([SamplingParams(temperature=0, repetition_penalty=3.0)])
    assert int(sample(jnp.asarray([[2.0, 1.0]]), rp, jnp.asarray([0]), jnp.asarray([[True, False]]))[0]) == 1


@pytest.mark.parametrize("kw,msg", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-5), "top_k"), (dict(min_p=2.0), "min_p"), (dict(max_tokens=0), "max_tokens"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(temperature=float("nan")), "temperature"),
    (dict(logprobs=-1), "logprobs"), (dict(seed="x"), "seed")])
def test_invalid_params(kw, msg):
    with pytest.raises(InvalidSamplingParamsError, match=msg):
        SamplingParams(**kw)
