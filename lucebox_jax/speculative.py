"""Speculative decoding: a drafter proposes K tokens per row, the target checks all of them in ONE forward over K + 1
positions, and the longest acceptable prefix plus one target token is committed.

- `accept_tokens`: the acceptance rule on logits. Greedy rows accept while the draft equals the target's argmax;
  sampled rows use rejection sampling (accept d with probability min(1, p(d) / q(d)), resample the first rejection
  from norm(max(p - q, 0)), a bonus token from p when all K are accepted), with temperature / top-k / top-p / min-p
  applied to p exactly as plain sampling does (`sampling.filter_logits`), so the output distribution is the target's.
  Randomness is keyed by (row seed, absolute position, purpose), so a run is reproducible and independent of batching.
- `verify_step`: jitted once per K. Fixed shapes whatever is accepted: accepted count [B], committed tokens
  [B, K + 1] padded with -1, next token [B]. Rejected positions are dropped by setting each row's cache length
  (attention masks by absolute position, so stale K/V past the length is never read).
- `spec_chunk`: `lax.while_loop` of (draft K tokens on device -> verify -> commit) steps; no host sync inside.
- `SpeculativeDecoder`: the host driver. With a fixed K a whole completion is one device call; with adaptive K it
  runs a few steps per call and picks the next K from the running acceptance rate among precompiled K values.

Cache contract: position p of a row holds the K/V of the token at p for p < lengths[b]; the newest committed token
(`tok`) sits at position lengths[b] and is not yet in the cache (as in `engine.decode_step`). A step writes positions
L .. L + K, so the cache must hold L + K + 1 positions; `SpeculativeDecoder.cache_len` sizes it and rows that would
overflow stop with finish reason "length".
"""

from __future__ import annotations

import collections
import functools
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from . import quant
from .config import ModelConfig
from .engine import MIN_CACHE, Engine, StepOut, pow2_at_least, stop_matrix
from .errors import InvalidSamplingParamsError
from .model import KVCache, Weights, forward
from .ops import KernelSet
from .sampling import RowParams, by_temperature, filter_logits, if_penalized, log_softmax

TAG_DRAFT, TAG_ACCEPT, TAG_RESAMPLE = 1, 2, 3
AUTO_K = (1, 2, 4, 8)
TRACE_COUNTS: collections.Counter = collections.Counter()  # ("verify", K) -> times traced (tests: no recompiles)


# ---------------------------------------------------------------------------------------------------- randomness
def keys_at(keys, positions, tag: int):
    """Typed PRNG keys for raw row keys [B, 2] at absolute positions [B, J] and a purpose tag -> [B, J]."""
    def one(k, p):
        return jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(k), p), tag)

    return jax.vmap(lambda k, ps: jax.vmap(lambda p: one(k, p))(ps))(keys, positions)


def draw(logits, rp: RowParams, positions):
    """Draft sampling: token [B] and its proposal distribution q [B, V] from logits [B, V] at positions [B].
    Greedy rows take the argmax (their q is never used)."""
    greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def stochastic(*, sort):
        x = filter_logits(logits, rp.temperature, rp.top_k, rp.top_p, rp.min_p, sort=sort)
        q = jax.nn.softmax(x, axis=-1)
        keys = keys_at(rp.keys, positions[:, None], TAG_DRAFT)[:, 0]
        g = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(keys)
        tok = jnp.argmax(x + g, axis=-1).astype(jnp.int32)
        return jnp.where(rp.temperature > 0, tok, greedy_tok), q

    return by_temperature(rp, logits.shape[-1], lambda: (greedy_tok, jnp.zeros(logits.shape, jnp.float32)),
                          stochastic)


# ---------------------------------------------------------------------------------------------------- acceptance
def _penalize(logits, seen, drafts, penalty):
    """Repetition penalty at each of the K + 1 verify positions: position j has also seen drafts d_1..d_j."""
    b, k1, v = logits.shape
    oh = jax.nn.one_hot(drafts, v, dtype=jnp.int32)  # [B, K, V]
    cum = jnp.cumsum(oh, axis=1) > 0
    seen_j = jnp.concatenate([jnp.zeros((b, 1, v), bool), cum], axis=1) | seen[:, None, :]
    p = penalty[:, None, None]
    return jnp.where(seen_j, jnp.where(logits > 0, logits / p, logits * p), logits)


def target_probs(logits, rp: RowParams, *, sort: bool = True):
    """Filtered target distribution p [B, J, V] (temperature, top-k, top-p, min-p per row, as plain sampling;
    `sort=False` where no row asks for top-k or top-p)."""
    b, j, v = logits.shape
    rep = lambda a: jnp.repeat(a, j)  # noqa: E731
    x = filter_logits(logits.reshape(b * j, v), rep(rp.temperature), rep(rp.top_k), rep(rp.top_p), rep(rp.min_p),
                      sort=sort)
    return jax.nn.softmax(x.reshape(b, j, v), axis=-1)


def accept_from_probs(p, drafts, q, keys, pos0):
    """Rejection sampling on given distributions: p [B, K+1, V] target, q [B, K, V] draft, drafts [B, K] drawn from q,
    raw row keys [B, 2], pos0 [B] = absolute position of the first draft token. Returns (n_accepted [B], next [B])."""
    b, k1, v = p.shape
    k = k1 - 1
    qq = jnp.concatenate([q, jnp.zeros((b, 1, v), q.dtype)], axis=1)
    pd = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    qd = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    positions = pos0[:, None] + jnp.arange(k1, dtype=jnp.int32)[None, :]
    u = jax.vmap(jax.vmap(lambda kk: jax.random.uniform(kk, (), jnp.float32)))(
        keys_at(keys, positions[:, :k], TAG_ACCEPT))
    ok = u * qd < pd  # P(accept) = min(1, p/q)
    n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
    q_n = jnp.take_along_axis(qq, n[:, None, None], axis=1)[:, 0]  # zeros when n == K: bonus token from p
    r = jnp.maximum(p_n - q_n, 0.0)
    r = jnp.where(jnp.sum(r, axis=-1, keepdims=True) > 0, r, p_n)
    kn = keys_at(keys, (pos0 + n)[:, None], TAG_RESAMPLE)[:, 0]
    g = jax.vmap(lambda kk: jax.random.gumbel(kk, (v,), jnp.float32))(kn)
    nxt = jnp.argmax(jnp.where(r > 0, jnp.log(jnp.maximum(r, 1e-38)), -jnp.inf) + g, axis=-1).astype(jnp.int32)
    return n.astype(jnp.int32), nxt


def accept_tokens(logits, drafts, q, rp: RowParams, pos0, seen=None):
    """Acceptance on raw target logits [B, K+1, V] (float32). q: draft probabilities [B, K, V], or None for a
    deterministic drafter (q = one-hot at the draft). Returns (n_accepted [B] in 0..K, next token [B])."""
    b, k1, v = logits.shape
    k = k1 - 1
    if seen is not None:
        logits = if_penalized(rp, lambda x: _penalize(x, seen, drafts, rp.rep_penalty), logits)
    arg = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, K+1]
    n_g = jnp.sum(jnp.cumprod((drafts == arg[:, :k]).astype(jnp.int32), axis=1), axis=1)
    next_g = jnp.take_along_axis(arg, n_g[:, None], axis=1)[:, 0]

    def stochastic(*, sort):
        p = target_probs(logits, rp, sort=sort)
        qd = jax.nn.one_hot(drafts, v, dtype=jnp.float32) if q is None else q
        n_s, next_s = accept_from_probs(p, drafts, qd, rp.keys, pos0)
        hot = rp.temperature > 0
        return jnp.where(hot, n_s, n_g), jnp.where(hot, next_s, next_g)

    n, nxt = by_temperature(rp, v, lambda: (n_g, next_g), stochastic)
    return n.astype(jnp.int32), nxt.astype(jnp.int32)


# ---------------------------------------------------------------------------------------------------- verify
@struct.dataclass
class VerifyOut:
    n_accepted: jax.Array  # [B] accepted drafts, 0..K (0 for inactive rows)
    tokens: jax.Array  # [B, K+1] committed tokens: d_1..d_n, then the target's next token; -1 after
    next_token: jax.Array  # [B]
    logprob: jax.Array  # [B, K+1] raw logprob of each committed token
    top_ids: jax.Array  # [B, K+1, k]
    top_vals: jax.Array  # [B, K+1, k]
    hidden: jax.Array | None = None  # [B, K+1, F] target hidden states of `hidden_layers` (draft heads)


def _verify(cfg, kernels, weights, cache: KVCache, tok, drafts, q, rp, seen, active, n_logprobs, hidden_layers=None):
    k = drafts.shape[1]
    TRACE_COUNTS[("verify", k)] += 1  # runs at trace time only
    b = tok.shape[0]
    start = cache.lengths
    tokens = jnp.concatenate([tok[:, None], drafts], axis=1)  # positions start .. start + K
    hidden = None
    if hidden_layers:
        logits, cache, hidden = forward(cfg, kernels, weights, cache, tokens, start, hidden_layers=hidden_layers,
                                        verify=True)
    else:
        logits, cache = forward(cfg, kernels, weights, cache, tokens, start, verify=True)  # [B, K+1, V]
    n, nxt = accept_tokens(logits, drafts, q, rp, start + 1, seen)
    return _verify_out(logits, drafts, n, nxt, hidden, cache, start, active, n_logprobs)


def _verify_out(logits, drafts, n, nxt, hidden, cache, start, active, n_logprobs):
    """Committed tokens (d_1..d_n, next, then -1), their logprobs from logits [B, K+1, V] along the committed chain,
    and the cache length advanced on active rows."""
    b, k = drafts.shape
    n = jnp.where(active, n, 0)
    j = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    committed = jnp.where(j < n[:, None], padded, jnp.where(j == n[:, None], nxt[:, None], -1))
    lp = log_softmax(logits.astype(jnp.float32))
    chosen = jnp.take_along_axis(lp, jnp.maximum(committed, 0)[..., None], axis=-1)[..., 0]
    if n_logprobs > 0:
        vals, ids = jax.lax.top_k(lp, n_logprobs)
    else:
        vals, ids = jnp.zeros((b, k + 1, 0), jnp.float32), jnp.zeros((b, k + 1, 0), jnp.int32)
    cache = cache.replace(lengths=jnp.where(active, start + n + 1, start))
    return VerifyOut(n, committed, nxt, chosen, ids.astype(jnp.int32), vals, hidden), cache


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "n_logprobs"), donate_argnames=("cache",))
def verify_step(cfg: ModelConfig, kernels: KernelSet, weights: Weights, cache: KVCache, tok, drafts, q,
                rp: RowParams, seen, active, n_logprobs: int = 0):
    """Run the target once over [tok, d_1..d_K] at positions lengths .. lengths + K and decide acceptance.

    tok [B]: each row's newest committed token (at position cache.lengths, not yet in the cache); drafts [B, K];
    q [B, K, V] draft probabilities or None (deterministic drafter); seen [B, V] (repetition penalty); active [B].
    Returns (VerifyOut, cache with lengths advanced by n_accepted + 1 on active rows). Shapes depend on K only."""
    return _verify(cfg, kernels, weights, cache, tok, drafts, q, rp, seen, active, n_logprobs)


# ---------------------------------------------------------------------------------------------------- the loop
@struct.dataclass
class SpecState:
    cache: KVCache
    dstate: object  # the drafter's state (its KV cache, a token history, ...)
    prev: jax.Array  # [B] token at position lengths - 1
    tok: jax.Array  # [B] newest committed token, at position lengths
    seen: jax.Array  # [B, V]
    done: jax.Array  # [B]
    count: jax.Array  # [B] tokens in `bufs`
    bufs: StepOut  # [B, M, ...]
    hist: jax.Array  # [Kmax + 1] row-steps by number of accepted drafts
    steps: jax.Array  # () target forwards (verify calls) run


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "drafter", "k", "n_logprobs", "tree_width",
                                             "tree_nodes"),
                   donate_argnames=("state",))
def spec_chunk(cfg: ModelConfig, kernels: KernelSet, drafter, weights: Weights, dparams, state: SpecState,
               rp: RowParams, stop_ids, row_max, max_steps, k: int, n_logprobs: int = 0, tree_width: int = 0,
               tree_nodes: int = 0):
    """Up to `max_steps` speculative steps with K = k drafts, until every row is done. Fixed shapes throughout.
    tree_width > 0: a tree per step instead of a chain (tree.py): the best tree_nodes (default tree_width x k) of
    what a beam of tree_width drafts to depth k."""
    tree_nodes = tree_nodes or tree_width * k
    b, m = state.bufs.tokens.shape
    s = state.cache.max_len
    kmax = state.hist.shape[0] - 1
    span = max(kmax, tree_nodes)  # cache slots a step writes past the length
    rows = jnp.arange(b)[:, None]
    j = jnp.arange(k + 1, dtype=jnp.int32)[None, :]

    def cond(c):
        i, st = c
        return (i < max_steps) & ~jnp.all(st.done)

    def body(c):
        i, st = c
        start = st.cache.lengths
        active = ~st.done
        if tree_width:
            from .tree import SAMPLE_CHILDREN, tree_verify

            tt, tp, td, tq, dstate = drafter.propose_tree(dparams, st.dstate, st.tok, start, tree_width, k,
                                                          tree_nodes, rp if SAMPLE_CHILDREN else None)
            n, drafts, nxt, plog, hidden, cache = tree_verify(cfg, kernels, weights, st.cache, st.tok, tt, tp, td, rp,
                                                              st.seen, tree_width, k, drafter.hidden_layers, tq)
            vo, cache = _verify_out(plog, drafts, n, nxt, hidden, cache, start, active, n_logprobs)
        elif drafter.shares_target_cache:  # it drafts into the target's cache; the verify rewrites that window
            drafts, q, cache = drafter.propose(dparams, st.cache, st.prev, st.tok, start, rp, k)
            dstate = st.dstate
        else:
            drafts, q, dstate = drafter.propose(dparams, st.dstate, st.prev, st.tok, start, rp, k)
            cache = st.cache
        if not tree_width:
            vo, cache = _verify(cfg, kernels, weights, cache, st.tok, drafts, q, rp, st.seen, active, n_logprobs,
                                drafter.hidden_layers)
        n = vo.n_accepted
        toks = vo.tokens
        stop = jnp.any(toks[..., None] == stop_ids[:, None, :], axis=-1) & (j <= n[:, None])
        first_stop = jnp.where(jnp.any(stop, axis=1), jnp.argmax(stop, axis=1), k + 1)
        keep = (active[:, None] & (j <= n[:, None]) & (j <= first_stop[:, None])
                & (j < (row_max - st.count)[:, None]))
        idx = jnp.where(keep, st.count[:, None] + j, m)  # m: out of bounds, dropped
        put = lambda buf, val: buf.at[rows, idx].set(val, mode="drop")  # noqa: E731
        bufs = StepOut(put(st.bufs.tokens, toks), put(st.bufs.logprob, vo.logprob),
                       put(st.bufs.top_ids, vo.top_ids), put(st.bufs.top_vals, vo.top_vals))
        count = st.count + jnp.sum(keep, axis=1).astype(jnp.int32)
        done = (st.done | jnp.any(stop & keep, axis=1) | (count >= row_max)
                | (cache.lengths + span + 1 > s))
        seen = st.seen | jnp.any(jax.nn.one_hot(jnp.where(keep, toks, -1), st.seen.shape[-1], dtype=bool), axis=1)
        prev = jnp.where(n > 0, jnp.take_along_axis(drafts, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0], st.tok)
        dstate = drafter.commit(dstate, st.tok, drafts, n, start)
        if drafter.hidden_layers:  # a draft head catches up on the target's features of this verify
            dstate = drafter.absorb(dparams, dstate, vo.hidden, vo.tokens, n, start)
        hist = st.hist + jnp.sum(jax.nn.one_hot(n, kmax + 1, dtype=jnp.int32) * active[:, None], axis=0)
        new = SpecState(cache=cache, dstate=dstate, prev=jnp.where(active, prev, st.prev),
                        tok=jnp.where(active, vo.next_token, st.tok), seen=seen, done=done, count=count, bufs=bufs,
                        hist=hist, steps=st.steps + 1)
        return i + 1, new

    _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
    return state


@functools.partial(jax.jit, static_argnames=("m", "kmax"))
def _start_bufs(first: StepOut, stop, row_max, m: int, kmax: int):
    """The loop's output buffers [B, m, ...] holding the first token in column 0, the rows done at it, the counts
    (1 a row), the empty acceptance histogram and the step count: one program where eager ops made a dozen launches
    (host time a request pays before its first step)."""
    b = first.tokens.shape[0]
    k = first.top_ids.shape[-1]
    put0 = lambda buf, val: buf.at[:, 0].set(val)  # noqa: E731
    bufs = StepOut(put0(jnp.full((b, m), -1, jnp.int32), first.tokens),
                   put0(jnp.zeros((b, m), jnp.float32), first.logprob),
                   put0(jnp.zeros((b, m, k), jnp.int32), first.top_ids),
                   put0(jnp.zeros((b, m, k), jnp.float32), first.top_vals))
    done = jnp.any(first.tokens[:, None] == stop, axis=-1) | (row_max <= 1)
    return bufs, done, jnp.ones((b,), jnp.int32), jnp.zeros((kmax + 1,), jnp.int32), jnp.int32(0)


@functools.partial(jax.jit, static_argnames=("n",))
def _first_cols(bufs: StepOut, n: int) -> StepOut:
    """The first n columns of every output buffer, in one program."""
    return jax.tree.map(lambda a: a[:, :n], bufs)


# ---------------------------------------------------------------------------------------------------- driver
def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens per step when each draft is accepted independently with probability alpha."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


class SpeculativeDecoder:
    """Drives speculative generation for an `Engine` with a drafter (see drafters.py).

    num_draft: an int K (fixed; one device call per completion) or "auto" (adaptive among `k_choices`)."""

    def __init__(self, engine: Engine, drafter, num_draft: int | str = 4, k_choices=AUTO_K,
                 adapt_every: int = 4, verify_cost: float | None = None, stream_steps: int = 2,
                 tree: int | None = None, tree_beam: int | None = None):
        if isinstance(num_draft, str):
            if num_draft.strip().lower() != "auto":
                try:
                    num_draft = int(num_draft)
                except ValueError:
                    raise InvalidSamplingParamsError(
                        f"num_draft must be an integer >= 1 or 'auto', got {num_draft!r}") from None
        if isinstance(num_draft, str):
            self.ks = tuple(sorted(set(int(x) for x in k_choices)))
            self.adaptive = True
        else:
            if isinstance(num_draft, bool) or not isinstance(num_draft, int) or not 1 <= num_draft <= 64:
                raise InvalidSamplingParamsError(f"num_draft must be an integer in 1..64 or 'auto', got {num_draft!r}")
            self.ks = (num_draft,)
            self.adaptive = False
        self.engine = engine
        self.drafter = drafter
        self.kmax = max(self.ks)
        self.tree_width = 0  # tree verification (tree.py): the beam's width; the N best nodes of what it drafts
        self.tree_nodes = 0
        if tree is None and tree_beam is not None:
            raise InvalidSamplingParamsError("--tree-beam goes with --tree N")
        if tree is not None:
            if self.adaptive:
                raise InvalidSamplingParamsError("--tree needs a fixed --num-draft K (the tree's depth), not auto")
            if not hasattr(drafter, "propose_tree"):
                raise InvalidSamplingParamsError(f"--tree needs a drafter that proposes trees (eagle), not "
                                                 f"{drafter.name}")
            if isinstance(tree, bool) or not isinstance(tree, int) or not self.kmax <= tree <= 256:
                raise InvalidSamplingParamsError(f"--tree N needs an integer N in {self.kmax}..256 (nodes), got "
                                                 f"{tree!r}")
            beam = tree // self.kmax if tree_beam is None else tree_beam
            # the beam drafts beam candidates at depth 1 and beam x beam at each deeper level
            if (isinstance(beam, bool) or not isinstance(beam, int) or not 1 <= beam <= 64
                    or tree > beam + (self.kmax - 1) * beam * beam):
                raise InvalidSamplingParamsError(
                    f"--tree-beam W needs an integer W in 1..64 whose beam drafts at least N = {tree} candidates "
                    f"(W + (K - 1) W^2 with K = {self.kmax}), got {beam!r}")
            self.tree_width, self.tree_nodes = beam, tree
        self.span = max(self.kmax, self.tree_nodes)  # cache slots one step writes past a row's length
        self.adapt_every = adapt_every
        self.stream_steps = stream_steps
        # cost of one extra verified position relative to a decode step (for adaptive K; bench_spec measures it)
        self.verify_cost = verify_cost if verify_cost is not None else (
            0.35 if jax.default_backend() == "cpu" else 0.03)
        self.last_stats: dict = {}
        self.time_phases = False  # benchmarks: wait for the drafter's start so init and loop seconds are told apart

    @classmethod
    def create(cls, engine: Engine, draft, num_draft: int | str = 4, tokenizer=None, **kw) -> "SpeculativeDecoder":
        from .drafters import build

        return cls(engine, build(draft, engine, tokenizer=tokenizer), num_draft, **kw)

    def describe(self) -> str:
        k = f"auto{list(self.ks)}" if self.adaptive else str(self.ks[0])
        tree = f", tree of {self.tree_nodes} (beam {self.tree_width}, depth {self.kmax})" if self.tree_width else ""
        return f"{self.drafter.name}, K={k}{tree}"

    def cache_len(self, needed: int) -> int:
        """Cache positions for prompt + completion of `needed` tokens plus the K + 1 (or tree) a verify writes."""
        extra = self.span + 1
        if quant.ROW_INVARIANT:  # a plain run's length (Engine.cache_len_for) wherever it holds the verify's window
            plain = self.engine.cache_len_for(needed)
            if plain >= needed + extra:
                return plain
        return pow2_at_least(needed + extra, MIN_CACHE)

    # -------------------------------------------------------------------------------------------- state
    def _init(self, cache: KVCache, prompts, first: StepOut, seen, stop_ids, row_max, n_logprobs, hidden=None):
        b = len(prompts)
        needed = max(len(p) for p in prompts) + int(np.max(row_max)) + self.span + 1
        if cache.max_len < needed:
            raise InvalidSamplingParamsError(
                f"cache holds {cache.max_len} positions but speculative decoding needs {needed} "
                f"(prompt + max_tokens + K + 1); size it with SpeculativeDecoder.cache_len")
        max_new = pow2_at_least(int(np.max(row_max)), 16)
        # [B, K] stop ids (each row its own), row budgets, each prompt's last token: one transfer
        stop, row_max, prev = jax.device_put((stop_matrix(stop_ids, b), np.asarray(row_max, np.int32),
                                              np.asarray([p[-1] for p in prompts], np.int32)))
        bufs, done, count, hist, steps = _start_bufs(first, stop, row_max, m=max_new + self.kmax + 1, kmax=self.kmax)
        deng = getattr(self.drafter, "engine", None)
        c0 = deng.compile_seconds if deng is not None else 0.0
        if self.drafter.hidden_layers:  # a draft head starts from the first generated token
            dstate = self.drafter.init_state(prompts, cache.max_len, first=first.tokens, hidden=hidden)
        else:
            dstate = self.drafter.init_state(prompts, cache.max_len)
        if deng is not None:  # the draft's prefill compiles count as compile time of the run
            self.engine.compile_seconds += deng.compile_seconds - c0
        state = SpecState(cache=cache, dstate=dstate, prev=prev, tok=first.tokens, seen=seen, done=done,
                          count=count, bufs=bufs, hist=hist, steps=steps)
        return state, stop, row_max, max_new

    def _chunk(self, state: SpecState, rp, stop, row_max, max_steps: int, k: int, n_logprobs: int):
        eng = self.engine
        key = ("spec", self.drafter.key, k, state.bufs.tokens.shape, state.cache.max_len, n_logprobs,
               stop.shape[1], self.kmax, self.tree_width, self.tree_nodes)
        return eng._timed_first(key, spec_chunk, eng.cfg, eng.kernels, self.drafter, eng.weights,
                                self.drafter.params, state, rp, stop, row_max, jnp.int32(max_steps), k=k,
                                n_logprobs=n_logprobs, tree_width=self.tree_width, tree_nodes=self.tree_nodes)

    def _pick_k(self, hist: np.ndarray, k_steps: dict) -> int:
        """Adaptive K: estimate the per-draft acceptance rate from the histogram so far and pick the K of best
        expected tokens per unit cost, cost(K) = 1 + K * (draft cost + verify cost per extra position)."""
        if not self.adaptive:
            return self.ks[0]
        drafted = sum(k * s for k, s in k_steps.items())
        accepted = float(np.dot(np.arange(len(hist)), hist))
        alpha = (accepted + 2.0) / (drafted + 4.0)  # prior 0.5 worth 4 drafts
        alpha = min(alpha, 0.98)
        per = self.drafter.cost_ratio + self.verify_cost
        return max(self.ks, key=lambda k: expected_tokens(alpha, k) / (1.0 + k * per))

    def _steps(self, state, rp, stop, row_max, n_logprobs, steps_per_call: int | None):
        """Generator over (state, k) after each device call until all rows are done."""
        k_steps: dict = collections.Counter()
        k = self.ks[len(self.ks) // 2] if self.adaptive else self.ks[0]
        steps0 = 0  # (a fresh state's; read after each call, never before one: no wait ahead of the first step)
        while True:
            per_call = steps_per_call or (self.adapt_every if self.adaptive else 1 << 30)
            state = self._chunk(state, rp, stop, row_max, per_call, k, n_logprobs)
            hist = np.asarray(state.hist)
            steps = int(state.steps)
            k_steps[k] += steps - steps0
            steps0 = steps
            self._k_steps = k_steps
            yield state
            if bool(np.all(np.asarray(state.done))):
                return
            k = self._pick_k(hist, k_steps)

    def _stats(self, state: SpecState, seconds: float | None = None) -> dict:
        hist = np.asarray(state.hist).astype(int)
        rows = int(hist.sum())
        mean_acc = float(np.dot(np.arange(len(hist)), hist) / rows) if rows else 0.0
        st = {"drafter": self.drafter.name, "num_draft": "auto" if self.adaptive else self.ks[0],
              "tree_nodes": self.tree_nodes, "tree_beam": self.tree_width,
              "target_steps": int(state.steps), "row_steps": rows, "mean_accepted": mean_acc,
              "tokens_per_step": mean_acc + 1.0 if rows else 0.0, "acceptance_histogram": hist.tolist(),
              "k_steps": {int(k): int(v) for k, v in sorted(getattr(self, "_k_steps", {}).items())}}
        if seconds is not None:
            st["seconds"] = seconds
        return st

    # -------------------------------------------------------------------------------------------- public
    def loop(self, cache: KVCache, prompts, first: StepOut, rp: RowParams, seen, stop_ids, row_max,
             n_logprobs: int = 0, hidden=None):
        """Speculative counterpart of `Engine.loop`: returns (bufs [B, max_new, ...], count [B], cache). hidden: the
        prefill's hidden states of `drafter.hidden_layers` (`Engine.prefill(hidden_layers=)`), a draft head's start
        without a forward of its own."""
        t0 = time.perf_counter()
        state, stop, row_max_d, max_new = self._init(cache, prompts, first, seen, stop_ids, row_max, n_logprobs,
                                                     hidden)
        if self.time_phases:
            jax.block_until_ready(state)
        t1 = time.perf_counter()
        for state in self._steps(state, rp, stop, row_max_d, n_logprobs, None):
            pass
        t2 = time.perf_counter()
        self.last_stats = self._stats(state, t2 - t0)
        if self.time_phases:  # (the first call's compiles land in these too)
            self.last_stats.update(init_seconds=t1 - t0, loop_seconds=t2 - t1)
        return _first_cols(state.bufs, max_new), state.count, state.cache

    def stream_chunks(self, cache: KVCache, prompts, first: StepOut, rp: RowParams, seen, stop_ids,
                      max_new: int, hidden=None) -> Iterator[list[int]]:
        """For one row: lists of new tokens after the first one, one list per device call of a few steps."""
        state, stop, row_max_d, _ = self._init(cache, prompts, first, seen, stop_ids, np.array([max_new]), 0,
                                               hidden)
        sent = 1
        for state in self._steps(state, rp, stop, row_max_d, 0, self.stream_steps):
            count = int(state.count[0])
            self.last_stats = self._stats(state)
            if count > sent:
                yield [int(t) for t in np.asarray(state.bufs.tokens[0, sent:count])]
                sent = count


def format_stats(st: dict) -> str:
    """One line for stderr: mean accepted drafts, tokens per target step and the acceptance histogram."""
    hist = st.get("acceptance_histogram", [])
    total = max(1, sum(hist))
    h = " ".join(f"{i}:{c}" for i, c in enumerate(hist))
    pct = " ".join(f"{100.0 * c / total:.0f}%" for c in hist)
    ks = st.get("k_steps") or {}
    kinfo = f" | K used {ks}" if len(ks) > 1 else ""
    tree = (f", tree of {st['tree_nodes']} (beam {st.get('tree_beam')})" if st.get("tree_nodes") else "")
    return (f"speculative [{st.get('drafter')}, K={st.get('num_draft')}{tree}]: "
            f"mean accepted {st.get('mean_accepted', 0):.2f} drafts/step, {st.get('tokens_per_step', 0):.2f} tokens/step over {st.get('row_steps', 0)} steps | "
            f"histogram (accepted: steps) {h} ({pct}){kinfo}")


__all__ = ["accept_tokens", "accept_from_probs", "target_probs", "verify_step", "VerifyOut", "spec_chunk",
           "SpeculativeDecoder", "SpecState", "expected_tokens", "format_stats", "TRACE_COUNTS", "keys_at", "draw"]
