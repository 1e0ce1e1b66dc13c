"""Drafters for speculative decoding, chosen by name like kernels in ops.py:

    layers:N        self-speculative layer skip: the target's first N layers + final norm + head (same arrays, no
                    copy), drafting straight into the target's KV cache of those layers (no cache of its own)
    ngram[:N]       prompt lookup: match the last N..1 tokens (default 3..1) against prompt + generated text and
                    propose what followed the most recent match; no model (a miss proposes the last token again)
    model:PATH      a separate draft model (GGUF or checkpoint folder) sharing the target's vocabulary; a bare PATH
                    works too

A drafter is a static, hashable object (its `key` names everything that changes the compiled program) plus `params`
(arrays passed into jit as data) and three functions used on device by `speculative.spec_chunk`:
`init_state(prompts, cache_len)` (host: prefill / token history), `propose(params, state, prev, tok, start, rp, k)`
-> (drafts [B, k], q [B, k, V] or None for a deterministic drafter, state) and `commit(state, tok, drafts, n, start)`.
A drafter with `shares_target_cache = True` gets the target's KV cache as `state` and returns it updated; the verify
then runs on that cache.
Register more with `@register("name")` on a factory `fn(arg, engine, tokenizer) -> Drafter`.
"""

from __future__ import annotations

import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .engine import Engine
from .errors import LuceboxError
from .model import KVCache, Weights, forward
from .ops import KernelSet


class DraftError(LuceboxError, ValueError):
    """A drafter that cannot be used with this target (unknown name, bad argument, vocabulary mismatch)."""


_REGISTRY: dict[str, tuple[Callable, str]] = {}


def register(name: str, usage: str = ""):
    def deco(fn):
        _REGISTRY[name] = (fn, usage or name)
        return fn

    return deco


def available() -> list[str]:
    return [u for _, u in _REGISTRY.values()]


def _compute_bytes(w: Weights) -> int:
    """Bytes read per decode step (layers + head; the embedding is a row lookup)."""
    leaves = jax.tree.leaves((w.layers, w.head, w.final_norm))
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves)


class Drafter:
    name: str = "drafter"
    key: tuple = ()
    params = None
    cost_ratio: float = 0.0  # one draft token's cost relative to one target decode step (adaptive K)
    shares_target_cache: bool = False  # propose() gets and returns the target's KV cache as its state

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, Drafter) and self.key == other.key

    def init_state(self, prompts: list[list[int]], cache_len: int):
        raise NotImplementedError

    def propose(self, params, state, prev, tok, start, rp, k: int):
        raise NotImplementedError

    def commit(self, state, tok, drafts, n, start):
        return state


def _draft_steps(cfg, ks, params, cache, d, start, rp, j0: int, k: int):
    """Single-token draft steps j = j0 .. k - 1 in a `lax.scan`: feed d at start + j, draw the next at start + j + 1.
    -> (drafts [B, k - j0], q [B, k - j0, V], cache)."""
    from .speculative import draw

    b = d.shape[0]

    def step(carry, j):
        cache, d = carry
        lg, cache = forward(cfg, ks, params, cache, d[:, None], start + j, last_only=jnp.zeros((b,), jnp.int32))
        d2, q2 = draw(lg, rp, start + j + 1)
        return (cache, d2), (d2, q2)

    (cache, _), (ds, qs) = jax.lax.scan(step, (cache, d), jnp.arange(j0, k, dtype=jnp.int32))
    return ds.T, qs.transpose(1, 0, 2), cache


class ModelDrafter(Drafter):
    """A separate transformer draft model with its own KV cache.

    Its cache mirrors the target's positions: committed tokens at p < lengths. Each proposal first feeds
    [prev, tok] at positions start - 1, start (T = 2), which also writes the token the draft never saw after a full
    acceptance (the last draft d_K), then K - 1 single-token steps in a `lax.scan`."""

    def __init__(self, cfg: ModelConfig, weights: Weights, kernels: KernelSet, name: str, target_cfg: ModelConfig,
                 target_weights: Weights | None = None):
        if cfg.vocab_size != target_cfg.vocab_size:
            raise DraftError(f"draft {name} has a vocabulary of {cfg.vocab_size} tokens but the target has "
                             f"{target_cfg.vocab_size}: a draft model must share the target's tokenizer")
        self.cfg = cfg.replace(dtype=target_cfg.dtype)
        self.engine = Engine(self.cfg, weights, kernels)
        self.kernels = kernels
        self.name = name
        self.key = ("model", self.cfg, kernels)
        tb = _compute_bytes(target_weights) if target_weights is not None else 0
        self.cost_ratio = _compute_bytes(weights) / tb if tb else 0.5

    @property
    def params(self):
        return self.engine.weights

    def init_state(self, prompts, cache_len):
        cache = self.engine.new_cache(len(prompts), cache_len)
        _, _, cache = self.engine.prefill(cache, prompts)
        return cache

    def propose(self, params, state: KVCache, prev, tok, start, rp, k):
        from .speculative import draw

        cfg, ks = self.cfg, self.kernels
        b = tok.shape[0]
        logits, cache = forward(cfg, ks, params, state, jnp.stack([prev, tok], axis=1), start - 1,
                                last_only=jnp.ones((b,), jnp.int32))
        d, q = draw(logits, rp, start + 1)
        if k == 1:
            return d[:, None], q[:, None], cache
        ds, qs, cache = _draft_steps(cfg, ks, params, cache, d, start, rp, 1, k)
        return jnp.concatenate([d[:, None], ds], axis=1), jnp.concatenate([q[:, None], qs], axis=1), cache


class NgramDrafter(Drafter):
    """Prompt lookup: the most recent earlier occurrence of the last n tokens (n = nmax down to nmin) and the
    tokens that followed it; past the known text it repeats with the match's period. State: token history [B, S]."""

    def __init__(self, nmax: int = 3, nmin: int = 1):
        if not 1 <= nmin <= nmax <= 16:
            raise DraftError(f"ngram sizes must satisfy 1 <= min <= max <= 16, got {nmin}..{nmax}")
        self.nmax, self.nmin = nmax, nmin
        self.name = f"ngram:{nmin}-{nmax}" if nmin != 1 else f"ngram:{nmax}"
        self.key = ("ngram", nmax, nmin)
        self.cost_ratio = 0.0

    def init_state(self, prompts, cache_len):
        hist = np.zeros((len(prompts), cache_len), np.int32)
        for r, p in enumerate(prompts):
            hist[r, : len(p)] = p
        return jnp.asarray(hist)

    def propose(self, params, hist, prev, tok, start, rp, k):
        b, s = hist.shape
        rows = jnp.arange(b)
        hist = hist.at[rows, start].set(tok)
        pos = jnp.arange(s, dtype=jnp.int32)[None, :]
        st = start[:, None]
        best = jnp.full((b,), -1, jnp.int32)
        for n in range(self.nmax, self.nmin - 1, -1):
            match = (pos >= n - 1) & (pos < st) & (st >= n - 1)  # window hist[i-n+1 .. i], i < start
            for o in range(n):
                shifted = jnp.pad(hist, ((0, 0), (o, 0)))[:, :s] if o else hist  # shifted[i] = hist[i - o]
                want = jnp.take_along_axis(hist, jnp.maximum(st - o, 0), axis=1)
                match = match & (shifted == want)
            last = jnp.max(jnp.where(match, pos, -1), axis=1)
            best = jnp.where(best < 0, last, best)
        period = jnp.maximum(start - best, 1)[:, None]
        src = best[:, None] + 1 + (jnp.arange(k, dtype=jnp.int32)[None, :] % period)
        drafts = jnp.take_along_axis(hist, jnp.clip(src, 0, s - 1), axis=1)
        drafts = jnp.where(best[:, None] >= 0, drafts, tok[:, None])
        return drafts.astype(jnp.int32), None, hist

    def commit(self, hist, tok, drafts, n, start):
        b, s = hist.shape
        k = drafts.shape[1]
        j = jnp.arange(k, dtype=jnp.int32)[None, :]
        idx = jnp.where(j < n[:, None], start[:, None] + 1 + j, s)
        return hist.at[jnp.arange(b)[:, None], idx].set(drafts, mode="drop")


# ---------------------------------------------------------------------------------------------------- registry
class LayerSkipDrafter(ModelDrafter):
    """The target's first N layers as the draft, writing into the target's own KV cache of those layers.

    The target's cache already holds, for every committed position, exactly the K/V these N layers would compute (same
    weights, same inputs), so the draft needs no prefill and no cache of its own. Its writes (the new token at
    `start`, drafts at start + 1 .. start + K - 1) lie inside the window the verify rewrites for every layer right
    after (start .. start + K), so the target never reads a draft's K/V."""

    shares_target_cache = True

    def __init__(self, n: int, engine: Engine):
        cfg, w = engine.cfg, engine.weights
        self.n = n
        self.cfg = cfg.replace(n_layers=n)
        self._params = w.replace(layers=tuple(w.layers[:n]))  # the same arrays: no copy
        self.kernels = engine.kernels
        self.name = f"layers:{n}"
        self.key = ("layers", self.cfg, self.kernels)
        self.cost_ratio = _compute_bytes(self._params) / _compute_bytes(w)

    @property
    def params(self):
        return self._params

    def init_state(self, prompts, cache_len):
        return None

    def propose(self, params, cache: KVCache, prev, tok, start, rp, k):
        n = self.n
        sub = KVCache(k=cache.k[:n], v=cache.v[:n], lengths=cache.lengths)
        ds, qs, sub = _draft_steps(self.cfg, self.kernels, params, sub, tok, start, rp, 0, k)
        return ds, qs, KVCache(k=sub.k + cache.k[n:], v=sub.v + cache.v[n:], lengths=cache.lengths)


@register("layers", "layers:N")
def _layers(arg: str, engine: Engine, tokenizer=None) -> Drafter:
    cfg = engine.cfg
    try:
        n = int(arg)
    except ValueError:
        raise DraftError(f"layers:N needs an integer N (1..{cfg.n_layers - 1}), got {arg!r}") from None
    if not 1 <= n < cfg.n_layers:
        raise DraftError(f"layers:N needs 1 <= N < {cfg.n_layers} (the target's layer count), got {n}")
    return LayerSkipDrafter(n, engine)


@register("ngram", "ngram[:N or :MIN-MAX]")
def _ngram(arg: str, engine: Engine, tokenizer=None) -> Drafter:
    try:
        if not arg:
            return NgramDrafter()
        if "-" in arg:
            lo, hi = arg.split("-", 1)
            return NgramDrafter(int(hi), int(lo))
        return NgramDrafter(int(arg), 1)
    except ValueError:
        raise DraftError(f"ngram takes ngram, ngram:N or ngram:MIN-MAX, got ngram:{arg}") from None


@register("model", "model:PATH (or a bare PATH)")
def _model(arg: str, engine: Engine, tokenizer=None) -> Drafter:
    from .loader import load_model

    if not arg or not os.path.exists(arg):
        raise DraftError(f"draft model not found: {arg!r}; valid drafters: {', '.join(available())}")
    cfg, w, tok_meta, source = load_model(arg, engine.cfg.dtype)
    if cfg.vocab_size != engine.cfg.vocab_size:
        raise DraftError(f"draft model {arg} has a vocabulary of {cfg.vocab_size} tokens but the target has "
                         f"{engine.cfg.vocab_size}: a draft model must share the target's tokenizer")
    if tokenizer is not None:
        from .tokenizer import Tokenizer

        dt = Tokenizer.from_gguf_metadata(tok_meta)
        n = min(dt.vocab_size, tokenizer.vocab_size)
        diff = next((i for i in range(n) if dt.id_to_token(i) != tokenizer.id_to_token(i)), None)
        if diff is not None or dt.vocab_size != tokenizer.vocab_size:
            where = f"token {diff} is {dt.id_to_token(diff)!r} vs {tokenizer.id_to_token(diff)!r}" if (
                diff is not None) else f"{dt.vocab_size} vs {tokenizer.vocab_size} tokens"
            raise DraftError(f"draft model {arg} has a different tokenizer than the target ({where})")
    return ModelDrafter(cfg, w, engine.kernels, f"model:{os.path.basename(os.path.normpath(arg))}", engine.cfg,
                        engine.weights)


def build(spec, engine: Engine, tokenizer=None) -> Drafter:
    """A Drafter from a name ("layers:8", "ngram", "model:PATH", a bare PATH) or a Drafter (returned as is)."""
    if isinstance(spec, Drafter):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise DraftError(f"a drafter is a name like {', '.join(available())}; got {spec!r}")
    spec = spec.strip()
    name, _, arg = spec.partition(":")
    if name in _REGISTRY:
        return _REGISTRY[name][0](arg.strip(), engine, tokenizer)
    if os.path.exists(spec):
        return _model(spec, engine, tokenizer)
    raise DraftError(f"unknown drafter {spec!r} (and no such file); valid: {', '.join(available())}")
