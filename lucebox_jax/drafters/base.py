"""The drafter interface, the registry of drafters by name and `build` (the drafters live beside this module):

    eagle[:PATH]    a trained EAGLE-style draft head over the target's hidden states (eagle.py); bare `eagle` loads
                    the head shipped for the loaded model, checkpoints/<model name>-eagle/
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
A drafter with `hidden_layers` (a tuple of target layer indices) also gets the target's hidden states of the verify
through `absorb(params, state, hidden, tokens, n, start)` after each step (the verify returns them at no extra forward).
A drafter with `shares_target_cache = True` gets the target's KV cache as `state` and returns it updated; the verify
then runs on that cache.
Register more with `@register("name")` on a factory `fn(arg, engine, tokenizer) -> Drafter`.
"""

from __future__ import annotations

import os
from typing import Callable

import jax
import numpy as np

from ..engine import Engine
from ..errors import LuceboxError
from ..model import Weights


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


def compute_bytes(w: Weights) -> int:
    """Bytes read per decode step (layers + head; the embedding is a row lookup)."""
    leaves = jax.tree.leaves((w.layers, w.head, w.final_norm))
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves)


class Drafter:
    name: str = "drafter"
    key: tuple = ()
    params = None
    cost_ratio: float = 0.0  # one draft token's cost relative to one target decode step (adaptive K)
    shares_target_cache: bool = False  # propose() gets and returns the target's KV cache as its state
    hidden_layers: tuple | None = None  # target layers whose hidden states the verify hands to absorb()

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

    def absorb(self, params, state, hidden, tokens, n, start):
        """After a verify: hidden [B, K + 1, F] at positions start .. start + K, committed tokens [B, K + 1]."""
        return state


# ---------------------------------------------------------------------------------------------------- registry
def build(spec, engine: Engine, tokenizer=None) -> Drafter:
    """A Drafter from a name ("eagle", "layers:8", "ngram", "model:PATH", a bare PATH) or a Drafter (returned as is)."""
    if isinstance(spec, Drafter):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise DraftError(f"a drafter is a name like {', '.join(available())}; got {spec!r}")
    spec = spec.strip()
    name, _, arg = spec.partition(":")
    if name in _REGISTRY:
        return _REGISTRY[name][0](arg.strip(), engine, tokenizer)
    if os.path.exists(spec):
        return _REGISTRY["model"][0](spec, engine, tokenizer)
    raise DraftError(f"unknown drafter {spec!r} (and no such file); valid: {', '.join(available())}")
