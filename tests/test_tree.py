"""Tree verification (tree.py, `--tree N`): greedy output equal to plain greedy (tiny model, eagle head, several
tree shapes, batch 3 and 1, repetition penalty), one compile per shape, and the recursive rejection sampling over a
tree follows the target's distribution (chi-square, significance 0.001)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lucebox_jax import SamplingParams
from lucebox_jax.drafters import EagleDrafter, build
from lucebox_jax.drafters.eagle import EagleConfig, _cached_layer, head_logits, init_head, select_nodes
from lucebox_jax.engine import Engine, enable_compilation_cache
from lucebox_jax.errors import InvalidSamplingParamsError
from lucebox_jax.ops import KernelSet
from lucebox_jax.sampling import RowParams
from lucebox_jax.speculative import SpeculativeDecoder, format_stats
from lucebox_jax.synthetic import PRESETS, random_weights
from lucebox_jax.tree import ancestors, tree_accept
from test_speculative import run, tiny_prompts

CFG = PRESETS["tiny"]


@pytest.fixture(scope="module")
def eng():
    enable_compilation_cache()
    return Engine(CFG, random_weights(CFG, jax.random.key(3), group_size=32, asymmetric=True), KernelSet())


def test_ancestors():
    parent = jnp.asarray([[0, 0, 1, 2, 3]], jnp.int32)  # nodes 1, 2 under the root; 3 under 1; 4 under 2; 5 under 3
    anc = np.asarray(ancestors(parent, 3))[0]
    assert anc[5].tolist() == [True, True, False, True, False, True]
    assert anc[4].tolist() == [True, False, True, False, True, False]
    assert anc[0].tolist() == [True] + [False] * 5


@pytest.mark.parametrize("nodes,k,beam", [(12, 3, None), (10, 3, 5)])
def test_tree_greedy_equal(eng, nodes, k, beam):
    """(10, 3, 5): a beam of 5 drafts 5 + 2 x 25 candidates, of which the 10 best are the tree (not a multiple of
    K, nodes with up to 5 children)."""
    hc = EagleConfig.for_target(CFG)
    d = EagleDrafter(hc, init_head(hc, jax.random.key(1)), eng)
    ps = tiny_prompts([10, 17, 5], seed=3)
    spec = SpeculativeDecoder(eng, d, k, tree=nodes, tree_beam=beam)
    assert spec.describe().endswith(f"tree of {nodes} (beam {beam or nodes // k}, depth {k})")
    assert run(eng, spec, ps, 16) == run(eng, None, ps, 16)
    assert run(eng, spec, ps[:1], 16) == run(eng, None, ps[:1], 16)
    assert run(eng, spec, ps, 16, rep=1.5) == run(eng, None, ps, 16, rep=1.5)
    assert spec.last_stats["tree_nodes"] == nodes and spec.last_stats["row_steps"] > 0
    assert f"K={k}, tree of {nodes} (beam {beam or nodes // k})]" in format_stats(spec.last_stats)
    sampled = run(eng, spec, ps, 16, temp=0.8, seed=4)
    assert sampled == run(eng, spec, ps, 16, temp=0.8, seed=4) and all(len(r) == 16 for r in sampled)


def test_tree_refused_without_a_tree_drafter(eng):
    with pytest.raises(InvalidSamplingParamsError, match="tree"):
        SpeculativeDecoder(eng, build("ngram", eng), 4, tree=16)
    hc = EagleConfig.for_target(CFG)
    d = EagleDrafter(hc, init_head(hc, jax.random.key(1)), eng)
    with pytest.raises(InvalidSamplingParamsError, match="tree"):
        SpeculativeDecoder(eng, d, "auto", tree=16)
    with pytest.raises(InvalidSamplingParamsError, match="tree"):
        SpeculativeDecoder(eng, d, 4, tree=2)
    with pytest.raises(InvalidSamplingParamsError, match="--tree-beam goes with --tree"):
        SpeculativeDecoder(eng, d, 4, tree_beam=3)
    with pytest.raises(InvalidSamplingParamsError, match="drafts at least N = 16"):  # 1 + 3 x 1 = 4 candidates
        SpeculativeDecoder(eng, d, 4, tree=16, tree_beam=1)
    with pytest.raises(InvalidSamplingParamsError, match="tree-beam"):
        SpeculativeDecoder(eng, d, 4, tree=16, tree_beam=0)


def test_tree_rejection_sampling_follows_the_target():
    """Width 3, depth 2, vocabulary 8: the root's children are tokens 1, 2, 5 (token 0 is never drafted), node 1's
    children 3, 4, 6. First committed token ~ p(root); the second, after token 1 was committed, ~ p(node 1)."""
    v, width, depth, n = 8, 3, 2, 30000
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(v), size=1 + width * depth).astype(np.float32)
    tokens = np.array([1, 2, 5, 3, 4, 6], np.int32)
    parent = np.array([0, 0, 0, 1, 1, 1], np.int32)
    depths = np.array([1, 1, 1, 2, 2, 2], np.int32)
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(p)), (n, 1 + width * depth, v))
    rp = RowParams.from_params([SamplingParams(temperature=1.0, seed=s) for s in range(n)])
    bc = lambda a: jnp.broadcast_to(jnp.asarray(a), (n, a.shape[0]))  # noqa: E731
    nacc, path, nxt = jax.jit(tree_accept, static_argnames=("width", "depth"))(
        logits, bc(tokens), bc(parent), bc(depths), rp, rp.keys, jnp.full((n,), 9, jnp.int32), width=width,
        depth=depth)
    nacc, path, nxt = np.asarray(nacc), np.asarray(path), np.asarray(nxt)
    first = np.where(nacc >= 1, tokens[np.maximum(path[:, 0] - 1, 0)], nxt)
    crit = 24.322  # chi2.ppf(0.999, 7)
    obs = np.bincount(first, minlength=v)
    chi2 = float(((obs - p[0] * n) ** 2 / (p[0] * n)).sum())
    assert chi2 < crit, (chi2, obs, (p[0] * n).round())
    after1 = nacc >= 1
    after1 &= path[:, 0] == 1  # token 1 (window node 1) was committed first
    second = np.where(nacc[after1] >= 2, tokens[np.maximum(path[after1, 1] - 1, 0)], nxt[after1])
    m = len(second)
    assert m > 500
    obs = np.bincount(second, minlength=v)
    chi2 = float(((obs - p[1] * m) ** 2 / (p[1] * m)).sum())
    assert chi2 < crit, (chi2, obs, (p[1] * m).round())


def _gumbel_children(q, w, rng):
    """w draws without replacement from each row of q [R, V] (Gumbel top-w), in draw order."""
    with np.errstate(divide="ignore"):
        z = np.log(q) + rng.gumbel(size=q.shape)
    return np.argsort(-z, axis=1, kind="stable")[:, :w]


def test_sampled_tree_rejection_sampling_follows_the_target():
    """Children drawn from the draft (recursive speculative decoding): the root's 3 children are draws without
    replacement from q_root (which allows only 2 tokens, so the third child is never acceptable), node 1's from
    q_1. First committed token ~ p(root); the second, after window node 1 was committed, ~ p(node 1). And with q = p
    the root's first child is always accepted (deterministic children would accept only p's mass on them)."""
    v, width, depth, n = 8, 3, 2, 30000
    rng = np.random.default_rng(2)
    p = rng.dirichlet(np.ones(v), size=1 + width * depth).astype(np.float32)
    q = rng.dirichlet(np.ones(v), size=1 + width * depth).astype(np.float32)
    q[0] = 0.0
    q[0, [2, 6]] = [0.7, 0.3]
    parent = np.array([0, 0, 0, 1, 1, 1], np.int32)
    depths = np.array([1, 1, 1, 2, 2, 2], np.int32)
    bc = lambda a: jnp.broadcast_to(jnp.asarray(a), (n,) + a.shape)  # noqa: E731
    rp = RowParams.from_params([SamplingParams(temperature=1.0, seed=s) for s in range(n)])
    crit = 24.322  # chi2.ppf(0.999, 7)
    walk = jax.jit(tree_accept, static_argnames=("width", "depth"))

    def accept(p, q):
        tokens = np.concatenate([_gumbel_children(np.tile(q[0], (n, 1)), width, rng),
                                 _gumbel_children(np.tile(q[1], (n, 1)), width, rng)], axis=1).astype(np.int32)
        out = walk(bc(np.log(p)), jnp.asarray(tokens), bc(parent), bc(depths), rp, rp.keys,
                   jnp.full((n,), 9, jnp.int32), width=width, depth=depth, q=bc(q))
        return tokens, *(np.asarray(a) for a in out)

    tokens, nacc, path, nxt = accept(p, q)
    rows = np.arange(n)
    first = np.where(nacc >= 1, tokens[rows, np.maximum(path[:, 0] - 1, 0)], nxt)
    obs = np.bincount(first, minlength=v)
    chi2 = float(((obs - p[0] * n) ** 2 / (p[0] * n)).sum())
    assert chi2 < crit, (chi2, obs, (p[0] * n).round())
    after1 = (nacc >= 1) & (path[:, 0] == 1)
    second = np.where(nacc[after1] >= 2, tokens[after1, np.maximum(path[after1, 1] - 1, 0)], nxt[after1])
    m = len(second)
    assert m > 500
    obs = np.bincount(second, minlength=v)
    chi2 = float(((obs - p[1] * m) ** 2 / (p[1] * m)).sum())
    assert chi2 < crit, (chi2, obs, (p[1] * m).round())
    assert not np.any((nacc >= 1) & (path[:, 0] == 3))  # the third child (q = 0) is never accepted

    _, nacc, path, _ = accept(p, p.copy())
    assert np.all(nacc >= 1) and np.all(path[:, 0] == 1)


def test_sampled_tree_after_rejections_follows_the_target():
    """One level of 3 children drawn from a q with full support, so that later children meet a residual p' with
    mass on them (each rejection renormalises p' and q'): the committed token ~ p, over several p and q."""
    v, width, n = 8, 3, 30000
    rng = np.random.default_rng(5)
    parent, depths = np.zeros(width, np.int32), np.ones(width, np.int32)
    bc = lambda a: jnp.broadcast_to(jnp.asarray(a), (n,) + a.shape)  # noqa: E731
    rp = RowParams.from_params([SamplingParams(temperature=1.0, seed=s) for s in range(n)])
    walk = jax.jit(tree_accept, static_argnames=("width", "depth"))
    crit = 24.322  # chi2.ppf(0.999, 7)
    for _ in range(3):
        p = rng.dirichlet(np.ones(v), size=1 + width).astype(np.float32)
        q = rng.dirichlet(np.full(v, 0.5), size=1 + width).astype(np.float32)
        tokens = _gumbel_children(np.tile(q[0], (n, 1)), width, rng).astype(np.int32)
        nacc, path, nxt = (np.asarray(a) for a in walk(
            bc(np.log(p)), jnp.asarray(tokens), bc(parent), bc(depths), rp, rp.keys, jnp.full((n,), 3, jnp.int32),
            width=width, depth=1, q=bc(q)))
        first = np.where(nacc >= 1, tokens[np.arange(n), np.maximum(path[:, 0] - 1, 0)], nxt)
        obs = np.bincount(first, minlength=v)
        chi2 = float(((obs - p[0] * n) ** 2 / (p[0] * n)).sum())
        assert chi2 < crit, (chi2, obs, (p[0] * n).round())
        assert np.mean((nacc >= 1) & (path[:, 0] >= 2)) > 0.02  # later children were accepted at times


def test_draft_children_draws_without_replacement_from_q():
    """Sampled rows' children: the first ~ q, the second ~ q without the first (P(j) = sum_i q_i q_j / (1 - q_i));
    greedy rows keep the most likely tokens; the scores are the sorted top log probabilities (normalised from
    shifted logits) either way."""
    from lucebox_jax.tree import draft_children

    v, w, n = 6, 3, 20000
    q = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], np.float32)
    lp = jnp.broadcast_to(jnp.log(jnp.asarray(q)) + 3.0, (n, 1, v))  # logits: log q up to a constant
    temps = [1.0] * (n - 1) + [0.0]
    rp = RowParams.from_params([SamplingParams(temperature=t, seed=s) for s, t in enumerate(temps)])
    score, tok, qd = jax.jit(draft_children, static_argnames=("w", "sample"))(
        lp, rp, jnp.arange(n, dtype=jnp.int32), w=w, sample=True)
    score, tok, qd = np.asarray(score)[:, 0], np.asarray(tok)[:, 0], np.asarray(qd)[:, 0]
    np.testing.assert_allclose(score, np.tile(np.log(q[:w]), (n, 1)), rtol=1e-5)
    np.testing.assert_allclose(qd[0], q, rtol=1e-5)
    assert tok[-1].tolist() == [0, 1, 2]  # the greedy row
    tok = tok[:-1]
    assert all(len(set(r)) == w for r in tok[:200].tolist())  # without replacement
    m = len(tok)
    crit = 20.515  # chi2.ppf(0.999, 5)
    second = (q[:, None] * q[None, :] / (1 - q[:, None]))
    np.fill_diagonal(second, 0.0)
    for j, exp in ((0, q), (1, second.sum(axis=0))):
        obs = np.bincount(tok[:, j], minlength=v)
        chi2 = float(((obs - exp * m) ** 2 / (exp * m)).sum())
        assert chi2 < crit, (j, chi2, obs, (exp * m).round())


def test_propose_tree_samples_a_whole_beam(eng):
    """Sampled rows of a tree of width x depth nodes: the tree is the beam (width nodes a depth), each node's children
    distinct, q the root's and each drafting node's distribution (the deepest level none); greedy rows are the tree
    proposed without sampling parameters, and a tree of fewer nodes keeps deterministic children (q None)."""
    hc = EagleConfig.for_target(CFG)
    d = EagleDrafter(hc, init_head(hc, jax.random.key(1)), eng)
    ps = tiny_prompts([10, 17, 5, 8], seed=3)
    st = d.init_state(ps, 64, first=np.array([3, 4, 5, 6]))
    tok = jnp.asarray([3, 4, 5, 6], jnp.int32)
    start = jnp.asarray([len(p) for p in ps], jnp.int32)
    w, depth = 3, 4
    rp = RowParams.from_params([SamplingParams(temperature=t, seed=7) for t in (0.9, 0.0, 1.2, 0.7)])
    toks, parent, dep, q = (np.asarray(a) for a in d.propose_tree(d.params, st, tok, start, w, depth, rp=rp)[:4])
    # a static sampling mode draws every level's noise at once (`children_noise`): the same tree
    static = RowParams.from_params([SamplingParams(temperature=t, seed=7) for t in (0.9, 0.0, 1.2, 0.7)], static=True)
    assert static.mode and rp.mode is None
    once = [np.asarray(a) for a in d.propose_tree(d.params, st, tok, start, w, depth, rp=static)[:4]]
    for a, c in zip((toks, parent, dep), once):
        np.testing.assert_array_equal(a, c)
    np.testing.assert_allclose(q, once[3], atol=1e-6)
    plain = [np.asarray(a) for a in d.propose_tree(d.params, st, tok, start, w, depth)[:3]]
    for a, c in zip((toks, parent, dep), plain):
        np.testing.assert_array_equal(a[1], c[1])  # the greedy row
    for r in (0, 2, 3):
        assert np.bincount(dep[r], minlength=depth + 1)[1:].tolist() == [w] * depth
        for node in range(1 + w * depth):
            kids = toks[r][parent[r] == node]
            assert len(set(kids.tolist())) == len(kids)
            has_q = node == 0 or dep[r, node - 1] < depth
            np.testing.assert_allclose(q[r, node].sum(), 1.0 if has_q else 0.0, atol=1e-4)
            if len(kids):
                assert np.all(q[r, node][kids] > 0)
    assert not np.array_equal(toks[0], plain[0][0]) or not np.array_equal(toks[2], plain[0][2])
    assert d.propose_tree(d.params, st, tok, start, w, depth, nodes=10, rp=rp)[3] is None


def _naive_beam_tree(d, st, tok, start, w, depth, nodes):
    """The reference the beam is checked against: every frontier chain run through the head one cached token at a
    time from the committed state (as `propose` drafts a chain), its children the top w of that chain's own log
    probabilities; the beam and the final choice as `propose_tree` makes them (`select_nodes`)."""
    hc, p = d.hc, d.params
    dt = jnp.dtype(hc.dtype)

    def chain_logprobs(chain):  # chain [B, m] drafted tokens after `tok` -> log probabilities after its last
        h, cache = st.h_last, (st.k, st.v)
        for j in range(chain.shape[1]):
            emb = p.embed.lookup(chain[:, j:j + 1], dt)
            h2, cache = _cached_layer(hc, p.head, cache, h[:, None], emb, start + j)
            h = h2[:, 0]
        return jax.nn.log_softmax(head_logits(hc, p.head, h, p.lm_head))

    b = tok.shape[0]
    score, ftok = jax.lax.top_k(chain_logprobs(jnp.zeros((b, 0), jnp.int32)), w)
    chains = [ftok[:, i:i + 1] for i in range(w)]
    frontier = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
    cands, base = [(ftok, score, jnp.full((b, w), -1, jnp.int32), 1, jnp.ones((b, w), bool))], w
    for dd in range(1, depth):
        tops = [jax.lax.top_k(chain_logprobs(c), w) for c in chains]
        cand = (score[:, :, None] + jnp.stack([t[0] for t in tops], 1)).reshape(b, w * w)
        kids = jnp.stack([t[1] for t in tops], 1).reshape(b, w * w)
        score, best = jax.lax.top_k(cand, w)
        kept = jnp.zeros((b, w * w), bool).at[jnp.arange(b)[:, None], best].set(True)
        cands.append((kids, cand, jnp.repeat(frontier, w, axis=1), dd + 1, kept))
        stacked = jnp.stack(chains, 1)  # [B, w, dd]
        par = jnp.take_along_axis(stacked, (best // w)[:, :, None], axis=1)
        new = jnp.take_along_axis(kids, best, axis=1)
        chains = [jnp.concatenate([par[:, i], new[:, i:i + 1]], axis=1) for i in range(w)]
        frontier, base = base + best, base + w * w
    return select_nodes(cands, nodes or w * depth)[:3]


def test_tree_drafting_matches_a_naive_beam_and_reads_its_window_from_the_cache(eng):
    """The beam's window attention checked two ways. Every frontier chain run through the head one cached token at a
    time (`_naive_beam_tree`) must give the tree the beam's batched window attention gives. A tree kernel that reads
    the drafted keys from the head's cache (`in_cache`, Pallas in interpret mode) must draft the same trees, and
    write only past the committed prefix."""
    hc = EagleConfig.for_target(CFG)
    head = init_head(hc, jax.random.key(1))
    # a fresh head scales its attention output down (wo x 0.1); scaled up, which keys a chain sees moves its tokens
    head = head.replace(wqkv=head.wqkv * 4, wo=head.wo * 40)
    ps = tiny_prompts([10, 17, 5, 8], seed=3)
    tok = jnp.asarray([3, 4, 5, 6], jnp.int32)
    start = jnp.asarray([len(p) for p in ps], jnp.int32)
    d = EagleDrafter(hc, head, eng)
    st = d.init_state(ps, 64, first=np.asarray(tok))
    cached = EagleDrafter(hc, head, Engine(CFG, eng.weights, KernelSet(attention_tree="pallas")))
    st2 = cached.init_state(ps, 64, first=np.asarray(tok))
    for w, depth, nodes in ((3, 4, 0), (3, 5, 15), (2, 6, 9), (1, 5, 0)):
        want = d.propose_tree(d.params, st, tok, start, w, depth, nodes)
        for a, c in zip(want[:3], _naive_beam_tree(d, st, tok, start, w, depth, nodes)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
        got = cached.propose_tree(cached.params, st2, tok, start, w, depth, nodes)
        for a, c in zip(got[:3], want[:3]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
        assert np.array_equal(np.asarray(want[4].k), np.asarray(st.k))  # XLA's window: the cache is not written
        k0, k1 = np.asarray(st2.k), np.asarray(got[4].k)
        for r, s0 in enumerate(np.asarray(start)):
            np.testing.assert_array_equal(k1[r, :, :s0], k0[r, :, :s0])  # the committed prefix is untouched
            assert not np.array_equal(k1[r, :, s0], k0[r, :, s0])  # the window went into the cache


def test_greedy_walk_equals_the_full_walk():
    """The all-greedy fast path picks the same path and next token as the full walk run on greedy rows, on random
    trees (siblings sharing a token included: the first in window order wins in both)."""
    from lucebox_jax.tree import _walk, _walk_greedy

    width, depth, v, b = 3, 3, 5, 256
    rng = np.random.default_rng(0)
    n_nodes = width * depth
    logits = jnp.asarray(rng.standard_normal((b, 1 + n_nodes, v)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, v, (b, n_nodes)), jnp.int32)
    parent = np.zeros((b, n_nodes), np.int32)
    for d in range(2, depth + 1):  # each node's parent: a node of the depth above
        lo = (d - 1) * width
        parent[:, lo:lo + width] = 1 + (d - 2) * width + rng.integers(0, width, (b, width))
    parent = jnp.asarray(parent)
    depths = jnp.broadcast_to(jnp.repeat(jnp.arange(1, depth + 1, dtype=jnp.int32), width), (b, n_nodes))
    rp = RowParams.from_params([SamplingParams(temperature=0.0, seed=s) for s in range(b)])
    pos = jnp.full((b,), 5, jnp.int32)
    full = _walk(logits, tokens, parent, depths, rp, rp.keys, pos, width, depth)
    fast = _walk_greedy(logits, tokens, parent, depths, depth)
    for a, c in zip(full, fast):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    assert np.asarray(full[0]).max() >= 2  # some rows accept deep paths, so the comparison is not vacuous


@pytest.mark.parametrize("n", [7, 24])
def test_tree_verify_through_the_pallas_tree_kernel(eng, n):
    """The tree forward with `attention_tree=pallas` (the committed cache through the flash-decoding kernel,
    interpreted here), and with `attention_decode=pallas` as well (the nodes as decode rows that write the window),
    gives the logits and cache of the XLA einsum path: batch 2, ragged prefixes, a tree of 7 tokens and one of 24
    (past 16: decode rows up to model.tree_rows_limit)."""
    from lucebox_jax.model import forward, init_cache, tree_rows_limit

    if n == 7:
        parent = jnp.asarray([[0, 0, 1, 1, 2, 3], [0, 1, 2, 3, 4, 5]], jnp.int32)  # a bushy tree and a chain
    else:  # each node's parent one of the nodes before it
        rng = np.random.default_rng(n)
        parent = jnp.asarray([[rng.integers(0, i) for i in range(1, n)] for _ in range(2)], jnp.int32)
        assert n <= tree_rows_limit(CFG.head_dim)
    anc = ancestors(parent, n - 1)
    depth = jnp.sum(anc, axis=-1).astype(jnp.int32) - 1
    cache = init_cache(CFG, 2, 64)
    prompt = jnp.asarray(np.random.default_rng(0).integers(1, CFG.vocab_size, (2, 20)), jnp.int32)
    _, cache = forward(CFG, KernelSet(), eng.weights, cache, prompt, jnp.zeros((2,), jnp.int32))
    start = jnp.asarray([20, 13], jnp.int32)  # row 1 sees only its first 13 cached positions
    toks = jnp.asarray(np.random.default_rng(1).integers(1, CFG.vocab_size, (2, n)), jnp.int32)
    want, cw = forward(CFG, KernelSet(), eng.weights, cache, toks, start, tree=(depth, anc))
    from lucebox_jax import ops

    assert ops.accepts("attention_tree", "pallas", "in_cache")  # the model hands it the window in the cache
    # ... and with the Pallas decode kernel, a tree this short runs as decode rows that write the window themselves
    assert ops.accepts("attention_decode", "pallas", "window_anc")
    for ks in (KernelSet(attention_tree="pallas"), KernelSet(attention_tree="pallas", attention_decode="pallas")):
        got, cg = forward(CFG, ks, eng.weights, cache, toks, start, tree=(depth, anc))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-4)
        for a, b in zip(cw.k + cw.v, cg.k + cg.v):  # (layers past the first hold keys made from its attention output)
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-4, atol=2e-4)
    plain, _ = forward(CFG, KernelSet(), eng.weights, cache, toks, start)  # the mask matters: a chain is not a tree
    assert not np.allclose(np.asarray(plain[0]), np.asarray(want[0]), atol=1e-3)


def test_select_nodes_keeps_the_best_candidates_as_a_tree():
    """EAGLE-2's rerank: from a beam's candidates (root children, then width x width children of the frontier per
    depth) the n of highest cumulative log probability, which always form a tree (every parent chosen, earlier in
    window order), deeper where the draft is sure."""
    from lucebox_jax.drafters.eagle import select_nodes

    rng = np.random.default_rng(0)
    b, w, depth = 64, 3, 4
    cands, frontier, base = [], np.tile(np.arange(w), (b, 1)), w
    score = np.sort(np.log(rng.dirichlet(np.ones(8) * 0.3, size=b)), axis=1)[:, ::-1][:, :w]
    cands.append((rng.integers(0, 50, (b, w)), score, np.full((b, w), -1), 1))
    for d in range(2, depth + 1):
        lp = np.sort(np.log(rng.dirichlet(np.ones(8) * 0.3, size=(b, w))), axis=2)[:, :, ::-1][:, :, :w]
        cand = (score[:, :, None] + lp).reshape(b, w * w)
        cands.append((rng.integers(0, 50, (b, w * w)), cand, np.repeat(frontier, w, axis=1), d))
        best = np.argsort(-cand, axis=1, kind="stable")[:, :w]
        score, frontier, base = np.take_along_axis(cand, best, 1), base + best, base + w * w
    n = w * depth
    toks, parent, dep = (np.asarray(a) for a in select_nodes(
        [tuple(jnp.asarray(x) if not isinstance(x, int) else x for x in c) for c in cands], n)[:3])
    all_score = np.concatenate([c[1] for c in cands], axis=1)
    all_tok = np.concatenate([c[0] for c in cands], axis=1)
    deeper = 0
    for r in range(b):
        chosen = np.sort(np.argsort(-all_score[r], kind="stable")[:n])
        np.testing.assert_array_equal(toks[r], all_tok[r, chosen])  # the n best, in candidate order
        for i in range(n):
            p = parent[r, i]
            assert p < i + 1 and (dep[r, i] == 1) == (p == 0)
            if p:
                assert dep[r, p - 1] == dep[r, i] - 1
        assert np.bincount(parent[r], minlength=n + 1).max() <= w  # at most `width` children a node
        deeper += int(dep[r].max() == depth and np.bincount(dep[r], minlength=depth + 1)[1] < w)
    assert deeper > 0  # some trees trade root children for depth (else this is the beam)


def test_select_nodes_keeps_parents_when_sums_round_to_equal(monkeypatch):
    """A child whose log probability is 0 has its parent's sum; at a large enough magnitude a small per-depth
    tie-break rounds away too. The tree stays closed whichever way the ranking breaks the tie: here the higher index
    first, i.e. the child."""
    from lucebox_jax.drafters import eagle
    from lucebox_jax.drafters.eagle import select_nodes

    lower_first = eagle.descending_rank

    def higher_first(x):  # ties: the higher index first
        return lower_first(x[..., ::-1])[..., ::-1]

    monkeypatch.setattr(eagle, "descending_rank", higher_first)
    big = -5000.0  # float32 spacing here is 4.9e-4
    f = lambda v: jnp.asarray([v], jnp.float32)  # noqa: E731
    cands = [(jnp.asarray([[7, 8]]), f([big, big - 10]), jnp.asarray([[-1, -1]]), 1),
             (jnp.asarray([[9, 10, 11, 12]]), f([big, big - 5, big - 10, big - 15]), jnp.asarray([[0, 0, 1, 1]]), 2)]
    for n in (1, 2, 3):
        toks, parent, dep = (np.asarray(a)[0] for a in select_nodes(cands, n)[:3])
        assert toks[0] == 7 and parent[0] == 0 and dep[0] == 1, (n, toks, parent, dep)  # the root's best child
        for i in range(n):
            assert parent[i] < i + 1 and (dep[i] == 1) == (parent[i] == 0)


def test_children_lists_each_node_in_window_order():
    from lucebox_jax.tree import children

    parent = jnp.asarray([[0, 0, 1, 2, 1, 1], [0, 1, 2, 3, 4, 5]], jnp.int32)
    kids = np.asarray(children(parent, 3))
    assert kids[0, 0].tolist() == [1, 2, 0] and kids[0, 1].tolist() == [3, 5, 6] and kids[0, 2].tolist() == [4, 0, 0]
    assert kids[1, :, 0].tolist() == [1, 2, 3, 4, 5, 6, 0] and kids[1, :, 1:].max() == 0


def test_bench_spec_reads_tree_shapes():
    """benchmarks/bench_spec.py --tree items: N (depth 4), N@K, N@K/W (a beam of W)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    try:
        import bench_spec
    finally:
        sys.path.pop(0)
    assert [bench_spec.parse_tree(x) for x in ("32", "15@5", " 15@5/8")] == [(32, 4, None), (15, 5, None), (15, 5, 8)]


@pytest.mark.parametrize("sampled_children", [False, True])
def test_parallel_walk_equals_the_sequential_walk(sampled_children):
    """`_walk_parallel` (every node's tries at once, then the path) gives `_walk`'s accepted count, path and next
    token on random trees, greedy and sampled rows mixed (temperature, top-k, min-p), with deterministic children and
    with children drawn from a draft distribution q: the same uniforms decide the same tries."""
    from lucebox_jax.tree import _walk, _walk_parallel

    width, depth, v, b = 3, 4, 7, 96
    rng = np.random.default_rng(1 + sampled_children)
    n_nodes = width * depth
    # peaked logits with tokens often the likely ones, so paths go deep and rejections leave residuals
    logits = jnp.asarray(3.0 * rng.standard_normal((b, 1 + n_nodes, v)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 3, (b, n_nodes)), jnp.int32)
    parent = np.zeros((b, n_nodes), np.int32)
    for d in range(2, depth + 1):
        lo = (d - 1) * width
        parent[:, lo:lo + width] = 1 + (d - 2) * width + rng.integers(0, width, (b, width))
    parent = jnp.asarray(parent)
    depths = jnp.broadcast_to(jnp.repeat(jnp.arange(1, depth + 1, dtype=jnp.int32), width), (b, n_nodes))
    params = [SamplingParams(temperature=[0.0, 0.7, 1.0, 1.3][s % 4], top_k=[0, 0, 4, 0][s % 4],
                             min_p=[0.0, 0.0, 0.0, 0.05][s % 4], seed=s) for s in range(b)]
    rp = RowParams.from_params(params)
    pos = jnp.asarray(rng.integers(3, 40, b), jnp.int32)
    q = (jax.nn.softmax(jnp.asarray(2.0 * rng.standard_normal((b, 1 + n_nodes, v)), jnp.float32), axis=-1)
         if sampled_children else None)
    seq = jax.jit(_walk, static_argnames=("width", "depth", "sort"))(
        logits, tokens, parent, depths, rp, rp.keys, pos, width=width, depth=depth, sort=True, q=q)
    par = jax.jit(_walk_parallel, static_argnames=("width", "depth", "sort"))(
        logits, tokens, parent, depths, rp, rp.keys, pos, width=width, depth=depth, sort=True, q=q)
    for a, c in zip(seq, par):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    n = np.asarray(seq[0])
    hot = np.asarray(rp.temperature) > 0
    assert n[hot].max() >= 2 and (n[hot] == 0).any()  # deep paths and first-level rejections among sampled rows
