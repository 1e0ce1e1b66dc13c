"""`layers:N`: self-speculative layer skip, the target's first N layers drafting into the target's own KV cache."""

from __future__ import annotations

from ..engine import Engine
from ..model import KVCache
from .base import DraftError, Drafter, compute_bytes, register
from .model import ModelDrafter, draft_steps


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
        self.cost_ratio = compute_bytes(self._params) / compute_bytes(w)

    @property
    def params(self):
        return self._params

    def init_state(self, prompts, cache_len):
        return None

    def propose(self, params, cache: KVCache, prev, tok, start, rp, k):
        n = self.n
        sub = KVCache(k=cache.k[:n], v=cache.v[:n], lengths=cache.lengths)
        ds, qs, sub = draft_steps(self.cfg, self.kernels, params, sub, tok, start, rp, 0, k)
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
