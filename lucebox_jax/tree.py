"""Tree verification (`--tree N`): the drafter proposes a static-shape tree of N nodes (the best N of the draft's
candidates, any shape up to depth K with at most `width` = N // K children a node), the target checks every node in
ONE forward with a tree attention mask (model.forward(tree=...); one compile per shape), the longest accepted
root-to-leaf path is committed and its KV entries are moved into place.

Window layout: slot start + 0 holds the root (the newest committed token), slot start + i node i; node i sits at
position start + depth[i], and its parent (0 = the root) has a lower window index. After acceptance the path's nodes
at depths 1..n move to slots start + 1 .. start + n, where a chain would have put them, so the cache contract of
speculative.py holds again.

Acceptance walks the tree from the root. Greedy rows follow the child equal to the target's argmax. Sampled rows use
recursive rejection sampling over the children: child c, drawn from q', is accepted with probability
min(1, p'(c) / q'(c)); on rejection p' becomes norm(max(0, p' - q')) and q' loses c (renormalised); if every child
is rejected the next token is drawn from the last p'. The committed output follows the target's distribution exactly.
Children are tried, and a greedy tie between siblings won, in window order.

Sampled trees. Deterministic children (the draft's top tokens) are the case q' = one-hot(c): a level then accepts only
the target's mass on those tokens, less than a sampled chain's 1 - TV(p, q) when the distributions are flat. So
sampled rows of a tree that is the whole beam (N = width x depth) draw each node's children from the draft's
filtered distribution q without replacement (Gumbel top-k, in draw order; `draft_children`), as recursive speculative
decoding does, and the walk uses q. Lossless needs how many children a node gets to be independent of its own
children's draws: the beam ranks a node's children by the draft's sorted top log probabilities (not by the tokens
drawn) and the tree keeps the whole beam, so it is. Other shapes (N < width x depth, chosen by look-ahead over the
candidates' scores) keep deterministic children for sampled rows.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from . import ops
from .model import KVCache, forward
from .ops import KernelSet
from .sampling import by_temperature, filter_logits, if_penalized, log_softmax, logsumexp, top_k_wide
from .speculative import keys_at

TAG_TREE = 4  # (and 5: the resample) the walk's uniforms
TAG_TREE_DRAFT = 6  # sampled children
# LUCEBOX_TREE_SAMPLE=0: sampled rows keep deterministic children in every tree shape (the A/B of bench_spec.py)
SAMPLE_CHILDREN = os.environ.get("LUCEBOX_TREE_SAMPLE", "1") != "0"
# LUCEBOX_TREE_WALK=seq: sampled rows walk node by node (`_walk`, the reference) instead of every node at once
SEQUENTIAL_WALK = os.environ.get("LUCEBOX_TREE_WALK", "") == "seq"


def children_noise(rp, positions, s: int, v: int):
    """The Gumbel noise [B, J, s, V] with which sampled rows draw s nodes' children at each of positions [B, J]: node
    i's at position p from the row's key at (p, TAG_TREE_DRAFT) folded with i, so a level's draw does not depend on
    how many levels were drawn at once (`draft_children`'s `noise` takes one position's [B, S, V], S <= s)."""
    keys = keys_at(rp.keys, positions, TAG_TREE_DRAFT)  # [B, J]

    def node(k, i):
        return jax.random.gumbel(jax.random.fold_in(k, i), (v,), jnp.float32)

    return jax.vmap(jax.vmap(lambda k: jax.vmap(lambda i: node(k, i))(jnp.arange(s))))(keys)


def draft_children(logits, rp, positions, w: int, sample: bool, noise=None):
    """Children of S draft nodes from their logits [B, S, V] (log probabilities up to a constant a node: only the
    w chosen are normalised, by the row's logsumexp, so no [B, S, V] log-softmax is written); the children sit at
    positions [B]. -> scores [B, S, w] (the w largest log probabilities, sorted: the beam ranks children by these),
    tokens [B, S, w] and q [B, S, V] or None. Greedy rows (and every row unless `sample`) take the w most likely
    tokens; sampled rows w draws without replacement from q, the row's filtered draft distribution, in draw order.
    noise: those draws' Gumbel noise [B, S, V] made beforehand (`children_noise`; the same values), else made here."""
    logits = logits.astype(jnp.float32)
    score, top = top_k_wide(logits, w)
    score = score - logsumexp(logits)
    if not sample:
        return score, top, None
    b, s, v = logits.shape

    def stochastic(*, sort):
        rep = lambda a: jnp.repeat(a, s, axis=0)  # noqa: E731
        x = filter_logits(logits.reshape(b * s, v), rep(rp.temperature), rep(rp.top_k), rep(rp.top_p), rep(rp.min_p),
                          sort=sort)
        logq = log_softmax(x).reshape(b, s, v)

        g = children_noise(rp, positions[:, None], s, v)[:, 0] if noise is None else noise
        _, drawn = top_k_wide(logq + g, w)
        return jnp.where((rp.temperature > 0)[:, None, None], drawn, top), jnp.exp(logq)

    tok, q = by_temperature(rp, v, lambda: (top, jnp.zeros(logits.shape, jnp.float32)), stochastic)
    return score, tok, q


def ancestors(parent, depth: int):
    """parent [B, N] (window indices, 0 = root) -> anc [B, 1 + N, 1 + N]: window j is an ancestor of i, or i."""
    b, n = parent.shape
    par = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), parent], axis=1)
    idx = jnp.broadcast_to(jnp.arange(n + 1, dtype=jnp.int32)[None], (b, n + 1))
    anc = jax.nn.one_hot(idx, n + 1, dtype=bool)
    for _ in range(depth):
        idx = jnp.take_along_axis(par, idx, axis=1)
        anc = anc | jax.nn.one_hot(idx, n + 1, dtype=bool)
    return anc


def tree_accept(logits, tokens, parent, depths, rp, keys, pos0, width: int, depth: int, q=None):
    """Walk the tree. logits [B, 1 + N, V] (float32, penalties applied), tokens/parent/depths [B, N] (at most
    `width` children a node, `depth` levels), q [B, 1 + N, V] the distribution each node's children were drawn from
    for sampled rows (None: deterministic children). -> (n accepted [B], path [B, depth] window indices (0 past n), next
    token [B]). An all-greedy batch takes `_walk_greedy` (a few [B, N] ops per depth); with any sampled row the
    whole batch takes `_walk_parallel` (`_walk`, its sequential twin, under LUCEBOX_TREE_WALK=seq), which also
    serves greedy rows (by argmax) but updates distributions over the vocabulary at every child it tries."""
    walk = _walk if SEQUENTIAL_WALK else _walk_parallel
    return by_temperature(rp, logits.shape[-1], lambda: _walk_greedy(logits, tokens, parent, depths, depth),
                          lambda *, sort: walk(logits, tokens, parent, depths, rp, keys, pos0, width, depth, sort, q))


def children(parent, width: int):
    """parent [B, N] -> [B, 1 + N, width]: the window indices of each window slot's children in window order, 0
    where it has fewer than `width`."""
    b, n = parent.shape
    earlier = jnp.tril(jnp.ones((n, n), bool), -1)  # [i, j]: j before i
    rank = jnp.sum((parent[:, :, None] == parent[:, None, :]) & earlier[None], axis=-1)  # among its siblings
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, n))
    win = jnp.broadcast_to(jnp.arange(1, n + 1, dtype=jnp.int32)[None], (b, n))
    return jnp.zeros((b, n + 1, width), jnp.int32).at[rows, parent, rank].set(win, mode="drop")


def _walk_greedy(logits, tokens, parent, depths, depth: int):
    """`_walk` for greedy rows: at each depth the first child (in window order) of the current node whose token is
    the target's argmax there. Without a loop over depths (each a few dependent kernels): a node is taken when its
    token is its parent's argmax and no earlier sibling's is, and the path is the taken nodes whose ancestors are all
    taken (at most one a depth)."""
    b, n = tokens.shape
    arg = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, 1 + N]
    match = tokens == jnp.take_along_axis(arg, parent, axis=1)  # [B, N]
    earlier = jnp.tril(jnp.ones((n, n), bool), -1)  # [i, j]: j before i
    shadowed = jnp.any((parent[:, :, None] == parent[:, None, :]) & earlier[None] & match[:, None, :], axis=2)
    taken = jnp.concatenate([jnp.ones((b, 1), bool), match & ~shadowed], axis=1)  # [B, 1 + N], the root taken
    par = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), parent], axis=1)
    on = taken
    for _ in range(depth - 1):  # on the path: taken, and so is every ancestor
        on = taken & jnp.take_along_axis(on, par, axis=1)
    on = on.at[:, 0].set(False)
    dep = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), depths], axis=1)
    at = on[:, :, None] & (dep[:, :, None] == jnp.arange(1, depth + 1, dtype=jnp.int32)[None, None, :])
    path = jnp.sum(jnp.where(at, jnp.arange(1 + n, dtype=jnp.int32)[None, :, None], 0), axis=1)  # [B, depth]
    nacc = jnp.sum(on, axis=1).astype(jnp.int32)
    cur = jnp.take_along_axis(jnp.concatenate([jnp.zeros((b, 1), jnp.int32), path], axis=1), nacc[:, None], axis=1)
    return nacc, path, jnp.take_along_axis(arg, cur, axis=1)[:, 0]


def _tree_uniform(key, pos, node):
    """The uniform that decides child `node` (node index), tried at absolute position `pos` of a row with raw key
    `key`: both walks draw the same one for the same try."""
    return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(
        jax.random.wrap_key_data(key), pos), TAG_TREE), node))


def _try_child(p, zp, qc, zq, t, u, want, child, hot):
    """One child with token t tried against the unnormalised p' (sum zp) and q' (sum zq; None: deterministic
    children), over any leading shape (a row, or each of a row's nodes); `want` the target's argmax there (greedy
    rows), `child` whether there is a child to try, `hot` whether the row samples. -> (ok, p, zp, qc, zq)."""
    hit = jnp.arange(p.shape[-1], dtype=jnp.int32) == t[..., None]
    pt = jnp.take_along_axis(p, t[..., None], axis=-1)[..., 0]
    if qc is None:  # deterministic children: q' = one-hot(t)
        ok = jnp.where(hot, (pt > 0) & (u * zp < pt), t == want) & child
        rej = child & ~ok & hot
        p = jnp.where(rej[..., None] & hit, 0.0, p)
        zp = jnp.where(rej, jnp.maximum(zp - pt, 0.0), zp)  # (a sum kept by subtraction: never below 0)
        return ok, p, zp, qc, zq
    qt = jnp.take_along_axis(qc, t[..., None], axis=-1)[..., 0]  # > 0 unless the draw ran out of allowed tokens
    ok = jnp.where(hot, (qt > 0) & (u * qt * zp < pt * zq), t == want) & child
    rej = child & ~ok & hot & (qt > 0)  # a rejected sampled child leaves the residual
    p = jnp.where(rej[..., None], jnp.maximum(p * zq[..., None] - qc * zp[..., None], 0.0), p)
    zp = jnp.where(rej, jnp.sum(p, axis=-1), zp)
    qc = jnp.where(rej[..., None] & hit, 0.0, qc)
    zq = jnp.where(rej, jnp.maximum(zq - qt, 0.0), zq)
    return ok, p, zp, qc, zq


def _resample(p, keys, positions):
    """A token from each row's unnormalised distribution p [B, V] (Gumbel-max, keyed at `positions` [B])."""
    g = jax.vmap(lambda k, pos: jax.random.gumbel(jax.random.fold_in(jax.random.fold_in(
        jax.random.wrap_key_data(k), pos), TAG_TREE + 1), (p.shape[-1],), jnp.float32))(keys, positions)
    return jnp.argmax(jnp.where(p > 0, jnp.log(jnp.maximum(p, 1e-38)), -jnp.inf) + g, axis=-1).astype(jnp.int32)


def _walk(logits, tokens, parent, depths, rp, keys, pos0, width: int, depth: int, sort: bool = True, q=None):
    """The walk with sampled rows. p' and q' stay unnormalised, with their sums zp and zq carried a row ([B] each),
    and a rejected token is cleared by a mask over the vocabulary rather than a scatter: fewer [B, V] passes a try
    (the sampled 15-node tree's acceptance: 129 -> 101 kernels). The test u < p'(c) / q'(c) reads u q(c) zp < p(c)
    zq; a rejection leaves p' = max(0, p zq - q zp) (its sum one reduction) and q' without c (zq -= q(c));
    deterministic children (q' = one-hot(c)) leave p' without c (zp -= p(c))."""
    b = logits.shape[0]
    rows = jnp.arange(b)
    arg = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, 1 + N]
    hot = rp.temperature > 0
    ones = jnp.ones((b,), jnp.float32)

    def probs(cur):
        x = filter_logits(logits[rows, cur], rp.temperature, rp.top_k, rp.top_p, rp.min_p, sort=sort)
        return jax.nn.softmax(x, axis=-1)

    kids = children(parent, width)
    cur = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    n = jnp.zeros((b,), jnp.int32)
    p, zp = probs(cur), ones  # (the walk runs only where some row samples: by_temperature; no conditional on device)
    qc, zq = (None, None) if q is None else (q[:, 0], ones)
    path = []
    for d in range(1, depth + 1):
        want = arg[rows, cur]
        found, nxt_cur = jnp.zeros((b,), bool), cur
        for w in range(width):
            win = kids[rows, cur, w]  # the current node's w-th child (0: none)
            node = jnp.maximum(win - 1, 0)
            child = alive & (win > 0) & ~found
            u = jax.vmap(_tree_uniform)(keys, pos0 + d - 1, node)
            ok, p, zp, qc, zq = _try_child(p, zp, qc, zq, tokens[rows, node], u, want, child, hot)
            found = found | ok
            nxt_cur = jnp.where(ok, win, nxt_cur)
        cur = jnp.where(found, nxt_cur, cur)
        path.append(jnp.where(found, nxt_cur, 0))
        n = n + found.astype(jnp.int32)
        alive = alive & found
        p = jnp.where(found[:, None], probs(cur), p)  # a new node: its own distribution
        zp = jnp.where(found, 1.0, zp)
        if q is not None:
            qc = jnp.where(found[:, None], q[rows, cur], qc)
            zq = jnp.where(found, 1.0, zq)
    nxt = jnp.where(hot, _resample(p, keys, pos0 + n), arg[rows, cur])
    return n, jnp.stack(path, axis=1), nxt


def _walk_parallel(logits, tokens, parent, depths, rp, keys, pos0, width: int, depth: int, sort: bool = True,
                   q=None):
    """`_walk`'s result with the vocabulary work done for every node at once: each node's target distribution, and
    the tries of its children in window order (accept test, residual after a rejection), run on [B, 1 + N, V] arrays
    before the walk, which then only follows each node's accepted child ([B, 1 + N] gathers a depth). A node's tries
    depend on the node alone (its distribution, its children's tokens and uniforms keyed by its own depth), so
    trying every node, also those off the path, changes no outcome; it trades N times the [V] arithmetic (free on
    this launch-bound path) for width instead of depth x width rounds of kernels (the sampled 15@5 tree's walk:
    102 -> 23 kernels, AOT count for an H200)."""
    b, m, v = logits.shape  # m = 1 + N window slots
    rows = jnp.arange(b)
    hot = (rp.temperature > 0)[:, None]  # [B, 1]
    arg = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, M]

    def rep(a):  # a row's parameter for each of its M slots
        return jnp.repeat(a, m, axis=0)

    x = filter_logits(logits.reshape(b * m, v), rep(rp.temperature), rep(rp.top_k), rep(rp.top_p), rep(rp.min_p),
                      sort=sort)
    p = jax.nn.softmax(x, axis=-1).reshape(b, m, v)  # every slot's own target distribution
    zp = jnp.ones((b, m), jnp.float32)
    qc, zq = (None, None) if q is None else (q, jnp.ones((b, m), jnp.float32))
    kids = children(parent, width)  # [B, M, width]
    node = jnp.maximum(kids - 1, 0)  # the child's node index (0 where none)
    t = jnp.take_along_axis(tokens, node.reshape(b, m * width), axis=1).reshape(b, m, width)
    dep = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), depths], axis=1)  # each slot's depth (root 0)
    # the uniform `_walk` draws when it tries a child at depth d of the walk: keyed by (pos0 + d - 1, child node)
    pos = pos0[:, None, None] + dep[:, :, None] + jnp.zeros_like(node)
    u = jax.vmap(jax.vmap(jax.vmap(_tree_uniform, (None, 0, 0)), (None, 0, 0)))(keys, pos, node)  # [B, M, width]
    found = jnp.zeros((b, m), bool)
    acc = jnp.zeros((b, m), jnp.int32)  # each slot's accepted child (window index; 0: none)
    for w in range(width):
        win = kids[:, :, w]
        ok, p, zp, qc, zq = _try_child(p, zp, qc, zq, t[:, :, w], u[:, :, w], arg, (win > 0) & ~found, hot)
        found = found | ok
        acc = jnp.where(ok, win, acc)
    cur = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    n = jnp.zeros((b,), jnp.int32)
    path = []
    for _ in range(depth):
        nxt = acc[rows, cur]
        step = alive & (nxt > 0)
        cur = jnp.where(step, nxt, cur)
        path.append(jnp.where(step, nxt, 0))
        n = n + step.astype(jnp.int32)
        alive = step
    # the walk ends at `cur`: every child tried and rejected (its residual), or none to try (its own distribution)
    nxt = jnp.where(hot[:, 0], _resample(p[rows, cur], keys, pos0 + n), arg[rows, cur])
    return n, jnp.stack(path, axis=1), nxt


def move_path_kv(cache: KVCache, start, path, depth: int, kernels: KernelSet | None = None) -> KVCache:
    """Copy the path's window slots start + path[j] to slots start + 1 + j in every layer (the `kv_move` op: XLA
    makes a kernel of each cache, the Pallas kernel one for all of them)."""
    n = len(cache.k)
    moved = ops.get("kv_move", (kernels or KernelSet()).kv_move)(cache.k + cache.v, start[:, None] + path, start + 1)
    return KVCache(k=tuple(moved[:n]), v=tuple(moved[n:]), lengths=cache.lengths)


def tree_verify(cfg, kernels, weights, cache: KVCache, tok, tokens, parent, depths, rp, seen, width: int,
                depth: int, hidden_layers=None, q=None):
    """The target over [root, nodes] in one forward; acceptance; the path's KV moved into place.
    -> (n [B], path tokens [B, depth], next token [B], logits along the path [B, depth + 1, V], hidden along the path
    [B, depth + 1, F] or None, cache (lengths unchanged))."""
    b = tok.shape[0]
    start = cache.lengths
    win = jnp.concatenate([tok[:, None], tokens], axis=1)
    anc = ancestors(parent, depth)
    dep = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), depths], axis=1)
    out = forward(cfg, kernels, weights, cache, win, start, tree=(dep, anc), hidden_layers=hidden_layers)
    logits, cache = out[0], out[1]
    raw = logits
    if seen is not None:  # repetition penalty: node i has also seen its ancestors (and itself)
        def penalize(x):  # only built when some row has a penalty
            seen_i = seen[:, None, :] | (jnp.einsum("bij,bjv->biv", (anc & (jnp.arange(win.shape[1]) > 0)[None, None])
                                                    .astype(jnp.float32),
                                                    jax.nn.one_hot(win, x.shape[-1], dtype=jnp.float32)) > 0)
            pen = rp.rep_penalty[:, None, None]
            return jnp.where(seen_i, jnp.where(x > 0, x / pen, x * pen), x)

        logits = if_penalized(rp, penalize, logits)
    n, path, nxt = tree_accept(logits, tokens, parent, depths, rp, rp.keys, start + 1, width, depth, q)
    cache = move_path_kv(cache, start, path, depth, kernels)
    along = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), path], axis=1)  # window indices of the committed chain
    path_logits = jnp.take_along_axis(raw, along[:, :, None], axis=1)
    path_tokens = jnp.take_along_axis(tokens, jnp.maximum(path - 1, 0), axis=1)
    hidden = None if hidden_layers is None else jnp.take_along_axis(out[2], along[:, :, None], axis=1)
    return n, path_tokens, nxt, path_logits, hidden, cache
