"""`ngram[:N]`: prompt lookup, no model: propose what followed the most recent earlier match of the last tokens."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..engine import Engine
from .base import DraftError, Drafter, register


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
