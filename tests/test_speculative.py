"""Speculative decoding (issue 4): lossless acceptance (greedy equality, a chi-square test of rejection sampling),
the fixed-shape verify (no recompiles whatever is accepted), the drafters (layer skip, n-gram lookup, a separate draft
model) and the API / CLI surface. Most logic runs on tiny models; the embedded SmolLM2 checks greedy equality."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lucebox_jax import SamplingParams
from lucebox_jax.drafters import DraftError, Drafter, ModelDrafter, NgramDrafter, build
from lucebox_jax.engine import Engine, enable_compilation_cache
from lucebox_jax.ops import KernelSet
from lucebox_jax.sampling import RowParams
from lucebox_jax.speculative import (TRACE_COUNTS, SpeculativeDecoder, accept_from_probs, accept_tokens,
                                     expected_tokens, spec_chunk, verify_step)
from lucebox_jax.synthetic import PRESETS, random_weights

CFG = PRESETS["tiny"]
KS = KernelSet()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def eng():
    enable_compilation_cache()  # reruns load the compiled loops from disk
    return Engine(CFG, random_weights(CFG, jax.random.key(3), group_size=32, asymmetric=True), KS)


def tiny_prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    ps = [[int(t) for t in rng.integers(0, CFG.vocab_size, n)] for n in lengths]
    ps[0] = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6][: lengths[0]]  # something for the n-gram drafter to find
    return ps


def run(eng, spec, ps, max_new, temp=0.0, seed=0, stop=(), rep=1.0, features=False):
    """Prefill, first token, then the plain loop (spec None) or the speculative loop; -> token lists. features: a
    draft head starts from the prefill's hidden states (as LLM does) rather than from its own forward."""
    b = len(ps)
    need = max(map(len, ps)) + max_new
    cache = eng.new_cache(b, spec.cache_len(need) if spec else eng.cache_len_for(need))
    last, _, cache, *hidden = eng.prefill(cache, ps, hidden_layers=spec.drafter.hidden_layers if features else None)
    rp = RowParams.from_params([SamplingParams(temperature=temp, seed=seed + i, repetition_penalty=rep)
                                for i in range(b)])
    seen = eng.new_seen(ps)
    first, seen = eng.first_token(last, rp, [len(p) for p in ps], seen)
    if spec is None:
        bufs, count, _, _ = eng.loop(cache, first, rp, seen, set(stop), np.full(b, max_new))
    else:
        bufs, count, _ = spec.loop(cache, ps, first, rp, seen, set(stop), np.full(b, max_new),
                                   hidden=hidden[0] if hidden else None)
    toks, count = np.asarray(bufs.tokens), np.asarray(count)
    return [[int(t) for t in toks[i, : count[i]]] for i in range(b)]


class AlwaysWrong(Drafter):
    """Proposes token -1, which is never the target's argmax: every draft is rejected."""

    name, key = "always-wrong", ("always-wrong",)

    def init_state(self, prompts, cache_len):
        return jnp.zeros((len(prompts),), jnp.int32)

    def propose(self, params, state, prev, tok, start, rp, k):
        return jnp.full((tok.shape[0], k), -1, jnp.int32), None, state


# ------------------------------------------------------------------------------------------------ acceptance rule
def test_rejection_sampling_preserves_target_distribution():
    """Chi-square goodness of fit (significance 0.001, df = 7) of the committed tokens at the first two positions
    against the target p, over 40000 rows with their own seeds; drafts drawn from q, which differs from p."""
    v, k, n = 8, 2, 40000
    rng = np.random.default_rng(0)
    p_rows = rng.dirichlet(np.ones(v), size=k + 1)
    q_rows = rng.dirichlet(np.ones(v) * 0.7, size=k)
    q_rows[0, 3] = 0.0  # q misses a token p has: only the residual can produce it
    q_rows[0] /= q_rows[0].sum()
    drafts = np.stack([rng.choice(v, size=n, p=q_rows[j]) for j in range(k)], axis=1).astype(np.int32)
    keys = RowParams.from_params([SamplingParams(seed=s) for s in range(n)]).keys
    p = jnp.broadcast_to(jnp.asarray(p_rows, jnp.float32), (n, k + 1, v))
    q = jnp.broadcast_to(jnp.asarray(q_rows, jnp.float32), (n, k, v))
    nacc, nxt = jax.jit(accept_from_probs)(p, jnp.asarray(drafts), q, keys, jnp.full((n,), 17, jnp.int32))
    nacc, nxt = np.asarray(nacc), np.asarray(nxt)
    tok0 = np.where(nacc >= 1, drafts[:, 0], nxt)
    crit = 24.322  # chi2.ppf(0.999, 7)
    for j, toks in ((0, tok0), (1, np.where(nacc >= 2, drafts[:, 1], nxt)[nacc >= 1])):
        obs = np.bincount(toks, minlength=v)
        exp = p_rows[j] * len(toks)
        chi2 = float(((obs - exp) ** 2 / exp).sum())
        assert chi2 < crit, (j, chi2, obs, exp.round())
    # the bonus token (all K accepted) is also drawn from p
    assert 0 < np.mean(nacc == k) < 1


def test_greedy_acceptance_rule():
    v = 16
    logits = jax.random.normal(jax.random.key(0), (3, 5, v))
    arg = np.asarray(jnp.argmax(logits, -1))
    drafts = np.array([arg[0, :4], arg[1, :4], arg[2, :4]], np.int32)
    drafts[1, 2] = (arg[1, 2] + 1) % v  # row 1: first two accepted
    drafts[2, 0] = (arg[2, 0] + 1) % v  # row 2: nothing accepted
    rp = RowParams.from_params([SamplingParams(temperature=0)] * 3)
    n, nxt = accept_tokens(logits, jnp.asarray(drafts), None, rp, jnp.zeros((3,), jnp.int32))
    assert list(np.asarray(n)) == [4, 2, 0]
    assert list(np.asarray(nxt)) == [arg[0, 4], arg[1, 2], arg[2, 0]]


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-9


# ------------------------------------------------------------------------------------------------ verify
def test_verify_shapes_fixed_and_no_recompile(eng):
    """Different acceptance outcomes (all, some, none) run the same compiled verify: one trace, one cache entry."""
    k, b = 4, 2
    ps = [[1, 2, 3, 4, 5], [9, 8, 7]]
    rp = RowParams.from_params([SamplingParams(temperature=0)] * b)
    ref = run(eng, None, ps, k + 2)
    before = TRACE_COUNTS[("verify", k)]
    outcomes = []
    for wrong_at in (k, 2, 0):  # drafts agree with the target's greedy output up to `wrong_at`
        cache = eng.new_cache(b, 64)
        _, _, cache = eng.prefill(cache, ps)
        drafts = np.array([r[1: k + 1] for r in ref], np.int32)
        drafts[:, wrong_at:] = (drafts[:, wrong_at:] + 1) % CFG.vocab_size
        tok = jnp.asarray([r[0] for r in ref], jnp.int32)
        out, cache = verify_step(CFG, KS, eng.weights, cache, tok, jnp.asarray(drafts), None, rp, eng.new_seen(ps),
                                 jnp.ones((b,), bool))
        assert out.tokens.shape == (b, k + 1) and out.n_accepted.shape == (b,)
        n = np.asarray(out.n_accepted)
        assert list(n) == [wrong_at] * b
        assert list(np.asarray(cache.lengths)) == [len(p) + wrong_at + 1 for p in ps]
        toks = np.asarray(out.tokens)
        for r in range(b):
            assert list(toks[r, : wrong_at + 1]) == ref[r][1: wrong_at + 2] and (toks[r, wrong_at + 1:] == -1).all()
        outcomes.append(n)
    assert TRACE_COUNTS[("verify", k)] == before + 1
    assert verify_step._cache_size() == 1


def test_spec_loop_compiles_once_per_k(eng):
    spec = SpeculativeDecoder(eng, NgramDrafter(), 2)
    run(eng, spec, tiny_prompts([6, 9], seed=1), 12)
    size = spec_chunk._cache_size()
    traces = TRACE_COUNTS[("verify", 2)]
    run(eng, spec, tiny_prompts([7, 10], seed=2), 12)  # other prompts, other acceptance: same program
    run(eng, spec, tiny_prompts([7, 10], seed=2), 12, temp=0.9)
    assert spec_chunk._cache_size() == size and TRACE_COUNTS[("verify", 2)] == traces


# ------------------------------------------------------------------------------------------------ drafters (tiny)
def test_ngram_proposal():
    d = NgramDrafter(3, 1)
    hist = d.init_state([[1, 2, 3, 4, 1, 2], [7, 7, 7, 7, 7, 7], [10, 11, 12, 13, 14, 15]], 16)
    start = jnp.asarray([6, 6, 6], jnp.int32)
    tok = jnp.asarray([3, 7, 99], jnp.int32)  # newest tokens, at position 6
    drafts, q, hist2 = d.propose(None, hist, None, tok, start, None, 5)
    assert q is None
    assert np.asarray(drafts).tolist() == [[4, 1, 2, 3, 4], [7, 7, 7, 7, 7], [99, 99, 99, 99, 99]]
    hist3 = d.commit(hist2, tok, drafts, jnp.asarray([2, 0, 5]), start)
    assert np.asarray(hist3)[0, :9].tolist() == [1, 2, 3, 4, 1, 2, 3, 4, 1]


@pytest.mark.parametrize("k", [1, 4, 8])
def test_tiny_greedy_equal_for_each_drafter(eng, k):
    """Separate draft model, layer skip and n-gram: token-for-token the plain greedy output, batch 3 and 1."""
    dcfg = CFG.replace(n_layers=1)
    other = ModelDrafter(dcfg, random_weights(dcfg, jax.random.key(9), group_size=32), KS, "model:random", CFG)
    ps = tiny_prompts([10, 17, 5], seed=3)
    ref = run(eng, None, ps, 20)
    for drafter in (other, build("layers:1", eng), build("ngram", eng)):
        assert run(eng, SpeculativeDecoder(eng, drafter, k), ps, 20) == ref, drafter.name
    if k == 4:
        assert run(eng, SpeculativeDecoder(eng, build("ngram", eng), k), ps[:1], 20) == ref[:1]


def test_layer_skip_drafts_into_the_target_cache():
    """layers:1 of a 2-layer model whose second layer adds nothing (wo, w_down = 0) is the target itself: if it drafts
    into the target's cache of layer 0 correctly, every draft is accepted, with no cache of its own."""
    w = random_weights(CFG, jax.random.key(3), group_size=32, asymmetric=True)
    zero = lambda q: q.replace(scales=q.scales * 0, mins=q.mins * 0)  # noqa: E731
    l1 = w.layers[1].replace(wo=zero(w.layers[1].wo), w_down=zero(w.layers[1].w_down))
    e = Engine(CFG, w.replace(layers=(w.layers[0], l1)), KS)
    d = build("layers:1", e)
    assert d.shares_target_cache and d.init_state([[1, 2]], 64) is None
    ps = tiny_prompts([10, 17, 5], seed=3)
    spec = SpeculativeDecoder(e, d, 4)
    assert run(e, spec, ps, 20) == run(e, None, ps, 20)
    hist = spec.last_stats["acceptance_histogram"]
    assert sum(hist[:-1]) == 0 and hist[-1] > 0, hist


def test_always_wrong_draft_still_gives_target_output(eng):
    ps = tiny_prompts([10, 17, 5], seed=3)
    spec = SpeculativeDecoder(eng, AlwaysWrong(), 4)
    assert run(eng, spec, ps, 20) == run(eng, None, ps, 20)
    st = spec.last_stats
    assert st["mean_accepted"] == 0 and st["acceptance_histogram"][0] == st["row_steps"] > 0


def test_stop_ids_and_row_max(eng):
    ps = tiny_prompts([10, 8], seed=5)
    free = run(eng, None, ps, 16)
    stop = free[1][5]
    spec = SpeculativeDecoder(eng, build("ngram", eng), 4)
    assert run(eng, spec, ps, 16, stop=[stop]) == run(eng, None, ps, 16, stop=[stop])
    # repetition penalty: each verified position sees the drafts before it
    assert run(eng, spec, ps, 16, rep=1.5) == run(eng, None, ps, 16, rep=1.5)


def test_sampling_reproducible_and_adaptive_k(eng):
    ps = tiny_prompts([10, 17], seed=6)
    spec = SpeculativeDecoder(eng, build("layers:1", eng), "auto", k_choices=(1, 2))
    a = run(eng, spec, ps, 16, temp=0.8, seed=11)
    b = run(eng, spec, ps, 16, temp=0.8, seed=11)
    assert a == b and all(len(r) == 16 for r in a)
    assert set(spec.last_stats["k_steps"]) <= {1, 2} and spec.last_stats["row_steps"] > 0


def test_bad_drafter_specs(eng):
    for spec, msg in (("layers:0", "1 <= N"), ("layers:x", "integer"), ("ngram:0", "ngram"), ("nope", "unknown"),
                      ("model:/no/such.gguf", "not found")):
        with pytest.raises(DraftError, match=msg):
            build(spec, eng)
    with pytest.raises(Exception, match="num_draft"):
        SpeculativeDecoder(eng, NgramDrafter(), 0)


# ------------------------------------------------------------------------------------------------ API, CLI
def test_identical_draft_model_accepts_everything(tiny_gguf, tmp_path, monkeypatch):
    from lucebox_jax import LLM

    monkeypatch.setenv("LUCEBOX_CHECKPOINTS", str(tmp_path))
    plain = LLM(tiny_gguf)
    llm = LLM(tiny_gguf, draft=tiny_gguf, num_draft=4)  # the same model as its own draft
    sp = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    prompts = ["hello world", "abc"]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    st = llm.last_stats["speculative"]
    assert st["mean_accepted"] == 4.0 and st["tokens_per_step"] == 5.0
    lp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    a, b = plain.generate("abc", lp)[0].outputs[0], llm.generate("abc", lp)[0].outputs[0]
    assert a.token_ids == b.token_ids and len(b.logprobs) == len(b.token_ids)
    for da, db in zip(a.logprobs, b.logprobs):
        assert da.keys() == db.keys() and all(abs(da[t].logprob - db[t].logprob) < 1e-3 for t in da)
    text = "".join(llm.stream("hello world", sp))
    assert llm.last_stats["token_ids"] == got[0] and text == llm.generate("hello world", sp)[0].outputs[0].text
    assert "speculative" in llm.last_stats


def test_vocab_mismatch_refused(smol, tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("LUCEBOX_CHECKPOINTS", str(tmp_path))
    with pytest.raises(DraftError, match="vocabulary"):
        build(tiny_gguf, smol.engine, smol.tokenizer)


def test_cli_draft_prints_histogram(tiny_gguf, tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "run.py"), "--model", tiny_gguf, "--prompt", "abcabcabc",
                        "--raw", "--max-tokens", "8", "--draft", "ngram", "--num-draft", "2"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env=dict(os.environ, LUCEBOX_CHECKPOINTS=str(tmp_path)))
    assert r.returncode == 0, r.stderr
    assert "mean accepted" in r.stderr and "histogram" in r.stderr
    r = subprocess.run([sys.executable, os.path.join(ROOT, "run.py"), "--model", tiny_gguf, "--prompt", "abcabcabc",
                        "--raw", "--max-tokens", "8", "--draft", "ngram", "--num-draft", "2", "--output-format",
                        "json"], capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env=dict(os.environ, LUCEBOX_CHECKPOINTS=str(tmp_path)))
    assert r.returncode == 0, r.stderr
    import json

    spec = json.loads(r.stdout)["speculative"]
    assert spec and "mean_accepted" in spec
    r = subprocess.run([sys.executable, os.path.join(ROOT, "run.py"), "--model", tiny_gguf, "--prompt", "hi",
                        "--draft", "layers:9"], capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env=dict(os.environ, LUCEBOX_CHECKPOINTS=str(tmp_path)))
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: layers:N")


# ------------------------------------------------------------------------------------------------ embedded model
SMOL_PROMPTS = ["The capital of France is", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"]


@pytest.fixture(scope="module")
def smol_ref(smol):
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    smol.spec = None
    return sp, [o.outputs[0].token_ids for o in smol.generate(SMOL_PROMPTS, sp)]


@pytest.mark.slow
@pytest.mark.parametrize("draft,k,batch", [("ngram", 1, 2), ("ngram", 4, 2), ("ngram", 8, 2), ("ngram", 4, 1),
                                           ("layers:6", 1, 2), ("layers:6", 4, 2), ("layers:6", 8, 2),
                                           ("layers:6", 8, 1)])
def test_embedded_greedy_equal(smol, smol_ref, draft, k, batch):
    """Speculative greedy output == plain greedy output on SmolLM2-135M (batch 1 and 2)."""
    sp, ref = smol_ref
    smol.spec = SpeculativeDecoder.create(smol.engine, draft, k)
    try:
        got = [o.outputs[0].token_ids for o in smol.generate(SMOL_PROMPTS[:batch], sp)]
    finally:
        smol.spec = None
    assert got == ref[:batch]
