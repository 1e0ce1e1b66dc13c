"""A naive reference generator kept beside the fast engine: every step re-runs the whole sequence through one full
forward in a fresh cache (no incremental KV, no on-device loop, no bucketing tricks). Tests require the engine's
greedy output to match it token for token, which checks the cache, position and loop logic."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .model import Weights, forward, init_cache
from .ops import KernelSet


@functools.partial(jax.jit, static_argnames=("cfg", "kernels"))
def full_logits(cfg: ModelConfig, kernels: KernelSet, weights: Weights, tokens):
    """Logits at every position of tokens [B, T], computed from scratch."""
    b, t = tokens.shape
    cache = init_cache(cfg, b, t)
    logits, _ = forward(cfg, kernels, weights, cache, tokens, jnp.zeros((b,), jnp.int32))
    return logits


def naive_greedy(cfg: ModelConfig, kernels: KernelSet, weights: Weights, prompt: list[int], max_new: int,
                 stop_ids=()) -> list[int]:
    ids = list(prompt)
    for _ in range(max_new):
        t = 1 << (len(ids) - 1).bit_length()  # pad to a power of two: few compiles, padding is causal-masked
        toks = np.zeros((1, max(t, 16)), np.int32)
        toks[0, : len(ids)] = ids
        nxt = int(jnp.argmax(full_logits(cfg, kernels, weights, jnp.asarray(toks))[0, len(ids) - 1]))
        ids.append(nxt)
        if nxt in stop_ids:
            break
    return ids[len(prompt):]
