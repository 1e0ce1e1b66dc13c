"""Engine logic on a tiny random model: incremental decoding equals one full forward, the on-device loop equals the
naive reference generator token for token, batching and chunked prefill change nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lucebox_jax.engine import Engine, bucket, pow2_at_least
from lucebox_jax.ops import KernelSet
from lucebox_jax.reference import full_logits, naive_greedy
from lucebox_jax.sampling import RowParams, SamplingParams
from lucebox_jax.synthetic import PRESETS, random_weights

CFG = PRESETS["tiny"].replace(max_context=2048)
KS = KernelSet()


@pytest.fixture(scope="module")
def eng():
    return Engine(CFG, random_weights(CFG, jax.random.key(3), group_size=32, asymmetric=True), KS)


def prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(0, CFG.vocab_size, n)) for n in lengths]


def greedy_rp(b):
    return RowParams.from_params([SamplingParams(temperature=0)] * b)


def run_greedy(eng, ps, max_new, stop=()):
    b = len(ps)
    cache = eng.new_cache(b, eng.cache_len_for(max(map(len, ps)) + max_new))
    last, _, cache = eng.prefill(cache, ps)
    rp = greedy_rp(b)
    seen = eng.new_seen(ps)
    first, seen = eng.first_token(last, rp, [len(p) for p in ps], seen)
    bufs, count, _, _ = eng.loop(cache, first, rp, seen, set(stop), np.full(b, max_new))
    toks, count = np.asarray(bufs.tokens), np.asarray(count)
    return [list(toks[i, : count[i]]) for i in range(b)]


def test_prefill_then_decode_equals_full_forward(eng):
    (p,) = prompts([11])
    seq = p + list(np.random.default_rng(1).integers(0, CFG.vocab_size, 5))
    ref = np.asarray(full_logits(CFG, KS, eng.weights, jnp.asarray([seq + [0] * (32 - len(seq))])))[0]
    cache = eng.new_cache(1, 64)
    last, _, cache = eng.prefill(cache, [p])
    np.testing.assert_allclose(np.asarray(last)[0], ref[len(p) - 1], rtol=1e-4, atol=1e-4)
    rp, seen = greedy_rp(1), eng.new_seen([p])
    for j, tok in enumerate(seq[len(p):]):
        from lucebox_jax.engine import decode_step
        from lucebox_jax.model import forward
        pos = cache.lengths
        logits, cache2 = forward(CFG, KS, eng.weights, cache, jnp.asarray([[tok]]), pos, last_only=jnp.zeros_like(pos))
        np.testing.assert_allclose(np.asarray(logits)[0], ref[len(p) + j], rtol=1e-4, atol=1e-4)
        cache, _, seen = decode_step(CFG, KS, eng.weights, cache, jnp.asarray([tok]), rp, seen)
    assert int(cache.lengths[0]) == len(seq)


def test_loop_matches_naive_reference_batched(eng):
    ps = prompts([5, 17, 9], seed=2)
    got = run_greedy(eng, ps, 12)
    for p, g in zip(ps, got):
        assert g == naive_greedy(CFG, KS, eng.weights, p, 12)


def test_batch_equals_single(eng):
    ps = prompts([3, 14, 30, 7], seed=4)
    batched = run_greedy(eng, ps, 10)
    for p, g in zip(ps, batched):
        assert run_greedy(eng, [p], 10)[0] == g


def test_chunked_prefill_of_long_prompt(eng):
    (p,) = prompts([600], seed=5)
    cache = eng.new_cache(1, 1024)
    last, per_pos, cache = eng.prefill(cache, [p], all_logits=True)
    ref = np.asarray(full_logits(CFG, KS, eng.weights, jnp.asarray([p + [0] * 424])))[0]
    np.testing.assert_allclose(per_pos[0], ref[:600], rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(last)[0], ref[599], rtol=2e-4, atol=2e-4)
    assert int(cache.lengths[0]) == 600


def test_stop_ids_and_row_max(eng):
    ps = prompts([6, 6], seed=6)
    free = run_greedy(eng, ps, 12)
    stop = free[0][3]
    got = run_greedy(eng, ps, 12, stop=[stop])
    assert got[0] == free[0][: free[0].index(stop) + 1]
    b = len(ps)
    cache = eng.new_cache(b, 64)
    last, _, cache = eng.prefill(cache, ps)
    rp = greedy_rp(b)
    seen = eng.new_seen(ps)
    first, seen = eng.first_token(last, rp, [6, 6], seen)
    bufs, count, _, _ = eng.loop(cache, first, rp, seen, set(), np.array([2, 7]))
    assert list(np.asarray(count)) == [2, 7]
    assert list(np.asarray(bufs.tokens)[0, :2]) == free[0][:2] and np.asarray(bufs.tokens)[0, 2] == -1


def test_buckets():
    assert bucket(1) == 16 and bucket(17) == 32 and bucket(512) == 512 and bucket(5000) == 512
    assert pow2_at_least(300, 256) == 512 and pow2_at_least(3, 256) == 256


def test_one_row_norm_is_applied_after_the_matmul():
    """normed_linear at one row scales the matmul's output by the norm's 1 / rms (2 kernels fewer a layer on the GPU);
    the product is rms_norm's then matmul's to bf16 rounding, and more rows (or row-invariant mode) take the plain
    path exactly."""
    from lucebox_jax import quant
    from lucebox_jax.model import normed_linear, rms_norm
    from lucebox_jax.quant import linear

    lw = eng_weights().layers[0]
    rng = np.random.default_rng(5)
    for rows in (1, 3):
        x = jnp.asarray(rng.standard_normal((rows, 1, CFG.dim)) * 40, jnp.bfloat16)
        want = linear(rms_norm(x, lw.attn_norm, CFG.rms_eps), lw.wqkv, kernels=KS).astype(jnp.float32)
        got = normed_linear(x, lw.attn_norm, CFG.rms_eps, lw.wqkv, kernels=KS).astype(jnp.float32)
        if rows == 1:
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0.03, atol=0.03 * float(jnp.abs(want).max()))
            assert not np.array_equal(np.asarray(got), np.asarray(want))  # (the deferred path really ran)
        else:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    quant.ROW_INVARIANT, old = True, quant.ROW_INVARIANT
    try:
        x1 = x[:1]
        np.testing.assert_array_equal(
            np.asarray(normed_linear(x1, lw.attn_norm, CFG.rms_eps, lw.wqkv, kernels=KS)),
            np.asarray(linear(rms_norm(x1, lw.attn_norm, CFG.rms_eps), lw.wqkv, kernels=KS)))
    finally:
        quant.ROW_INVARIANT = old


def eng_weights():
    return random_weights(CFG, jax.random.key(3), group_size=32, asymmetric=True)


def test_loop_checking_every_few_steps_gives_the_same_output(eng):
    """generate_loop(steps_per_check=4) reads its condition every 4 steps (an inner loop of known trip count): the
    same tokens, log probabilities and counts as checking every step, with rows stopping at a stop id, at their own
    budget, and at the buffer's end (the extra steps write nothing)."""
    from lucebox_jax.engine import generate_loop, stop_matrix

    ps = prompts([6, 9, 4], seed=7)
    free = run_greedy(eng, ps, 16)
    stop = jnp.asarray(stop_matrix([{free[0][5]}, set(), set()], 3))
    outs = []
    for spc in (1, 4):
        cache = eng.new_cache(3, 64)
        last, _, cache = eng.prefill(cache, ps)
        rp = greedy_rp(3)
        seen = eng.new_seen(ps)
        first, seen = eng.first_token(last, rp, [6, 9, 4], seen, 2)
        bufs, count, _, _ = generate_loop(CFG, KS, eng.weights, cache, first, rp, seen, stop,
                                          jnp.asarray([16, 7, 16], jnp.int32), max_new=16, n_logprobs=2,
                                          steps_per_check=spc)
        outs.append((bufs, count))
    (a, ca), (b, cb) = outs
    assert list(np.asarray(ca)) == list(np.asarray(cb)) == [free[0].index(free[0][5]) + 1, 7, 16]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("hidden_layers", [None, (0, 1)])
def test_start_in_one_program_equals_its_steps(eng, hidden_layers):
    """`Engine.start` (cache, prefill, seen mask and first token as one program) gives what the steps give one by
    one: the same first token and log-probability, cache contents and lengths, seen mask, hidden states. Shorter rows
    are padded with id 0, which no prompt holds: the padding must not mark it seen."""
    ps = [[max(int(t), 1) for t in p] for p in prompts([5, 13, 9], seed=4)]  # no id 0: the padding's id
    rp = RowParams.from_params([SamplingParams(temperature=0.8, seed=s, repetition_penalty=1.3) for s in (1, 2, 3)])
    max_len = 64
    first, cache, seen, hidden = eng.start(ps, max_len, rp, 2, hidden_layers)
    c2 = eng.new_cache(3, max_len)
    last, _, c2, *h2 = eng.prefill(c2, ps, hidden_layers=hidden_layers)
    f2, s2 = eng.first_token(last, rp, [len(p) for p in ps], eng.new_seen(ps), 2)
    np.testing.assert_array_equal(np.asarray(first.tokens), np.asarray(f2.tokens))
    np.testing.assert_allclose(np.asarray(first.logprob), np.asarray(f2.logprob), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(seen), np.asarray(s2))
    assert not np.asarray(seen)[:, 0].any() and np.asarray(seen).sum() > 0
    np.testing.assert_array_equal(np.asarray(cache.lengths), [len(p) for p in ps])
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(c2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert (hidden is None) == (hidden_layers is None)
    if hidden is not None:
        np.testing.assert_array_equal(np.asarray(hidden), np.asarray(h2[0]))
