"""`model:PATH`: a separate draft model with its own KV cache (`ModelDrafter`), and the single-token draft loop
`draft_steps` that it and the layer-skip drafter share."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from ..engine import Engine
from ..model import KVCache, Weights, forward
from ..ops import KernelSet
from .base import DraftError, Drafter, available, compute_bytes, register


def draft_steps(cfg, ks, params, cache, d, start, rp, j0: int, k: int):
    """Single-token draft steps j = j0 .. k - 1 in a `lax.scan`: feed d at start + j, draw the next at start + j + 1.
    -> (drafts [B, k - j0], q [B, k - j0, V], cache)."""
    from ..speculative import draw

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
        tb = compute_bytes(target_weights) if target_weights is not None else 0
        self.cost_ratio = compute_bytes(weights) / tb if tb else 0.5

    @property
    def params(self):
        return self.engine.weights

    def init_state(self, prompts, cache_len):
        cache = self.engine.new_cache(len(prompts), cache_len)
        _, _, cache = self.engine.prefill(cache, prompts)
        return cache

    def propose(self, params, state: KVCache, prev, tok, start, rp, k):
        from ..speculative import draw

        cfg, ks = self.cfg, self.kernels
        b = tok.shape[0]
        logits, cache = forward(cfg, ks, params, state, jnp.stack([prev, tok], axis=1), start - 1,
                                last_only=jnp.ones((b,), jnp.int32))
        d, q = draw(logits, rp, start + 1)
        if k == 1:
            return d[:, None], q[:, None], cache
        ds, qs, cache = draft_steps(cfg, ks, params, cache, d, start, rp, 1, k)
        return jnp.concatenate([d[:, None], ds], axis=1), jnp.concatenate([q[:, None], qs], axis=1), cache


@register("model", "model:PATH (or a bare PATH)")
def _model(arg: str, engine: Engine, tokenizer=None) -> Drafter:
    from ..loader import load_model

    if not arg or not os.path.exists(arg):
        raise DraftError(f"draft model not found: {arg!r}; valid drafters: {', '.join(available())}")
    cfg, w, tok_meta, source = load_model(arg, engine.cfg.dtype)
    if cfg.vocab_size != engine.cfg.vocab_size:
        raise DraftError(f"draft model {arg} has a vocabulary of {cfg.vocab_size} tokens but the target has "
                         f"{engine.cfg.vocab_size}: a draft model must share the target's tokenizer")
    if tokenizer is not None:
        from ..tokenizer import Tokenizer

        dt = Tokenizer.from_gguf_metadata(tok_meta)
        n = min(dt.vocab_size, tokenizer.vocab_size)
        diff = next((i for i in range(n) if dt.id_to_token(i) != tokenizer.id_to_token(i)), None)
        if diff is not None or dt.vocab_size != tokenizer.vocab_size:
            where = f"token {diff} is {dt.id_to_token(diff)!r} vs {tokenizer.id_to_token(diff)!r}" if (
                diff is not None) else f"{dt.vocab_size} vs {tokenizer.vocab_size} tokens"
            raise DraftError(f"draft model {arg} has a different tokenizer than the target ({where})")
    return ModelDrafter(cfg, w, engine.kernels, f"model:{os.path.basename(os.path.normpath(arg))}", engine.cfg,
                        engine.weights)
