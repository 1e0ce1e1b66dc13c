"""Sampling on device with per-row parameters: greedy, temperature, top-k, top-p, min-p, repetition penalty, seeds.

Every row carries its own parameters, so one batch can mix requests. A row's random draw at a position depends only
on (its seed, the position): the same seed gives the same output whatever else is in the batch.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .errors import InvalidSamplingParamsError

_NEG = -1e30
SEED_LIMIT = 1 << 64  # seeds are 0..2**64-1, each its own random stream


@dataclasses.dataclass
class SamplingParams:
    """vLLM-style sampling parameters of one request (validated on construction)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1

    def __post_init__(self):
        def bad(msg):
            raise InvalidSamplingParamsError(msg)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _num(self.temperature) or self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            bad(f"top_k must be an integer >= 0 (0 or -1 disables it), got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if not _num(self.top_p) or not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _num(self.min_p) or not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _num(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            bad(f"seed must be an integer in 0..2**64-1, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and (not isinstance(self.stop, (list, tuple)) or not all(
                isinstance(s, str) for s in self.stop)):
            bad(f"stop must be a string or a list of strings, got {self.stop!r}")
        for s in self.stop or []:
            if not utf8_ok(s):
                bad(f"stop string {s!r} is not valid UTF-8 text")
        self.stop = [s for s in (self.stop or []) if s]
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                    is_int(t) and t >= 0 for t in self.stop_token_ids):
                bad(f"stop_token_ids must be a list of token ids (integers >= 0), got {self.stop_token_ids!r}")
            self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            bad(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 0):
                bad(f"{name} must be an integer >= 0, got {v!r}")
        if not is_int(self.n) or self.n != 1:
            bad("n > 1 is not supported; send the prompt several times with different seeds")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def static_sampling(params) -> tuple[int, bool]:
    """(mode, penalized) that serve all of `params`: mode 0 every row greedy, 1 some row sampled by temperature alone,
    2 some sampled row asks top-k or top-p (the sorting filters; `by_temperature`); penalized: some repetition
    penalty. A larger mode serves every row a smaller one does (greedy rows stay greedy in every branch)."""
    sampled = [p for p in params if p.temperature > 0]
    mode = 0 if not sampled else 2 if any(p.top_k > 0 or p.top_p < 1.0 for p in sampled) else 1
    return mode, any(p.repetition_penalty != 1.0 for p in params)


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def is_int(v) -> bool:
    """An integer proper: a boolean is not one (True == 1 in Python), nor is 2.0."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def utf8_ok(text: str) -> bool:
    """Whether `text` encodes as UTF-8 (lone surrogates from JSON escapes or undecodable CLI bytes do not)."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def seed_keys(seeds) -> np.ndarray:
    """Raw threefry keys [B, 2] uint32 of 64-bit seeds: (high word, low word), as `jax.random.PRNGKey` builds them
    with x64 on, so every seed in 0..2**64-1 is its own stream (and seeds < 2**32 keep their old keys)."""
    s = np.asarray([int(x) for x in seeds], np.uint64)
    return np.stack([(s >> np.uint64(32)).astype(np.uint32), (s & np.uint64(0xFFFFFFFF)).astype(np.uint32)], -1)


@struct.dataclass
class RowParams:
    """SamplingParams of each row as arrays [B] (a pytree, so it enters jit as data, not as a static)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    rep_penalty: jax.Array
    keys: jax.Array  # [B, 2] uint32 raw PRNG keys
    # Known on the host for rows fixed for a whole call (`from_params(static=True)`): the sampling mode (0 greedy,
    # 1 temperature only, 2 top-k/top-p; None: decided on device) and whether any row has a repetition penalty.
    # Static, so jit compiles the one branch instead of a `lax.cond`/`switch`: on the GPU each conditional copies
    # its predicate to the host and waits (a speculative chain step had 4).
    mode: int | None = struct.field(pytree_node=False, default=None)
    penalized: bool | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def from_params(cls, params: list[SamplingParams], default_seed: int = 0, *, static: bool = False,
                    fixed: tuple[int, bool] | None = None) -> "RowParams":
        """static=True: fix `mode` and `penalized` from these rows (for a call whose rows never change). fixed:
        (mode, penalized) decided beforehand for every request a scheduler will see (`static_sampling`); these rows
        must not need more. Without either they are decided on device."""
        seeds = [p.seed if p.seed is not None else default_seed + i for i, p in enumerate(params)]
        mode = penalized = None
        if static:
            mode, penalized = static_sampling(params)
        if fixed is not None:
            need_mode, need_pen = static_sampling(params)
            if need_mode > fixed[0] or (need_pen and not fixed[1]):
                raise ValueError(f"rows need sampling mode {need_mode} (penalty {need_pen}) beyond the fixed "
                                 f"{fixed}")
            mode, penalized = fixed
        # built on the host in their final dtypes and sent in one device_put: jnp.asarray of a list would add an
        # eager conversion op per field (a dispatch each; a scheduler admission makes one RowParams)
        return jax.device_put(cls(
            temperature=np.asarray([p.temperature for p in params], np.float32),
            top_k=np.asarray([p.top_k for p in params], np.int32),
            top_p=np.asarray([p.top_p for p in params], np.float32),
            min_p=np.asarray([p.min_p for p in params], np.float32),
            rep_penalty=np.asarray([p.repetition_penalty for p in params], np.float32),
            keys=seed_keys([s % SEED_LIMIT for s in seeds]),
            mode=mode, penalized=penalized,
        ))


def apply_repetition_penalty(logits, seen, penalty):
    """HF/llama.cpp rule on tokens already seen: positive logits divided by the penalty, negative multiplied."""
    p = penalty[:, None]
    pen = jnp.where(logits > 0, logits / p, logits * p)
    return jnp.where(seen, pen, logits)


def filter_logits(logits, temperature, top_k, top_p, min_p, *, sort: bool = True):
    """Temperature, then top-k, top-p and min-p masks (each row its own values) -> masked scaled logits [B, V].
    `sort=False` leaves out top-k and top-p, which need the [B, V] sort: only for rows that ask neither
    (`needs_sort`); the result is the same then."""
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    x = logits / t
    v = x.shape[-1]
    if sort:
        srt = -jnp.sort(-x, axis=-1)  # descending
        k = jnp.where((top_k > 0) & (top_k < v), top_k, v)
        kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)
        x = jnp.where(x >= kth, x, _NEG)
        # top-p over the top-k-filtered distribution: keep the smallest prefix whose mass reaches p
        srt = jnp.where(jnp.arange(v)[None, :] < k[:, None], srt, _NEG)
        probs = jax.nn.softmax(srt, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted entry
        keep_sorted = (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
        cutoff = jnp.min(jnp.where(keep_sorted, srt, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x >= cutoff, x, _NEG)
    # min-p: drop tokens whose probability is below min_p times the top probability (the row's largest logit
    # survives top-k and top-p, so no sort is needed for it)
    thresh = jnp.max(x, axis=-1, keepdims=True) + jnp.log(jnp.maximum(min_p[:, None], 1e-38))
    x = jnp.where((min_p[:, None] > 0) & (x < thresh), _NEG, x)
    return x


def needs_sort(rp, vocab: int):
    """Whether any row asks for top-k or top-p (the filters that sort the vocabulary)."""
    return jnp.any((rp.top_k > 0) & (rp.top_k < vocab)) | jnp.any(rp.top_p < 1.0)


def by_temperature(rp, vocab: int, greedy, stochastic, *operands):
    """One `lax.switch` over a batch's sampling mode: every row greedy -> greedy(*operands); some row sampled ->
    stochastic(*operands, sort=...), with sort=False when no row asks for top-k or top-p, so that temperature-only
    sampling (the OpenAI default) does not sort the [B, V] logits (a full sort per distribution: a speculative step
    filters 2K + 1 of them)."""
    branches = [greedy, functools.partial(stochastic, sort=False), functools.partial(stochastic, sort=True)]
    if rp.mode is not None:  # known on the host: no conditional
        return branches[rp.mode](*operands)
    mode = jnp.where(jnp.any(rp.temperature > 0), jnp.where(needs_sort(rp, vocab), 2, 1), 0)
    return jax.lax.switch(mode, branches, *operands)


def if_penalized(rp, penalize, x):
    """penalize(x) where some row has a repetition penalty, else x (a `lax.cond` unless `rp.penalized` is static)."""
    if rp.penalized is not None:
        return penalize(x) if rp.penalized else x
    return jax.lax.cond(jnp.any(rp.rep_penalty != 1.0), penalize, lambda y: y, x)


def row_keys(keys, positions):
    """Per-row PRNG keys for a draw at absolute `positions` [B]."""
    return jax.vmap(lambda k, p: jax.random.fold_in(jax.random.wrap_key_data(k), p))(keys, positions)


def sample(logits, rp: RowParams, positions, seen=None):
    """Next token per row [B] from logits [B, V] (float32). `positions` [B] seed the draw; `seen` [B, V] bool."""
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, rp.rep_penalty)
    greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def stochastic(*, sort):
        x = filter_logits(logits, rp.temperature, rp.top_k, rp.top_p, rp.min_p, sort=sort)
        keys = row_keys(rp.keys, positions)
        g = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(keys)
        tok = jnp.argmax(x + g, axis=-1).astype(jnp.int32)
        return jnp.where(rp.temperature > 0, tok, greedy_tok)

    # all-greedy batches skip the filters entirely, temperature-only ones the sort
    return by_temperature(rp, logits.shape[-1], lambda: greedy_tok, stochastic)


def _max_and_scaled_sum(a, b):
    """Combiner of (running max, sum of exp(x - max)) pairs: merging two rescales the smaller side's sum."""
    (m1, s1), (m2, s2) = a, b
    m = jnp.maximum(m1, m2)
    # where a side's max is the new max, its scale is 1 (also when both are -inf, where exp(m1 - m) would be nan)
    e1 = jnp.where(m1 == m, jnp.float32(1), jnp.exp(m1 - m))
    e2 = jnp.where(m2 == m, jnp.float32(1), jnp.exp(m2 - m))
    return m, s1 * e1 + s2 * e2


def _max_and_log_sum(x):
    """(max, log of sum of exp(x - max)) over the last axis of float32 x, keepdims, in ONE pass: a variadic reduction
    of (max, sum of exp(x - max)) pairs, where `jax.nn.logsumexp` reads x twice (its max, then the sum after it)."""
    m, s = jax.lax.reduce((x, jnp.ones_like(x)), (jnp.float32(-jnp.inf), jnp.float32(0)), _max_and_scaled_sum,
                          (x.ndim - 1,))
    return m[..., None], jnp.log(s)[..., None]


def logsumexp(x):
    """log(sum(exp(x))) over the last axis (float32 x), keepdims, in one pass (`_max_and_log_sum`). XLA splits a
    vocabulary-long row into two kernels either way, so the one pass is 2 kernels where the two passes are 4 (AOT
    count for an H200, [3, 49152]: 5 -> 3 with the final add). Equal to `jax.nn.logsumexp` up to rounding."""
    m, ls = _max_and_log_sum(x)
    return m + ls


def log_softmax(x):
    """(x - max) - log(sum) over the last axis (float32), with the one-pass reduction; the max is taken out first
    as `jax.nn.log_softmax` does, so large logits keep their precision."""
    m, ls = _max_and_log_sum(x)
    return (x - m) - ls


def top_logprobs(logits, k: int):
    """Log-softmax of the raw logits and its top-k (vLLM's raw logprobs). Returns (logprobs [B, V], ids, vals)."""
    lp = log_softmax(logits.astype(jnp.float32))
    if k > 0:
        vals, ids = jax.lax.top_k(lp, k)
    else:
        vals = jnp.zeros(lp.shape[:-1] + (0,), jnp.float32)
        ids = jnp.zeros(lp.shape[:-1] + (0,), jnp.int32)
    return lp, ids.astype(jnp.int32), vals


def descending_rank(x):
    """Each element's place [..., n] (int32, 0 = largest) along a short last axis in `lax.top_k`'s order (float total
    order, so +0 above -0; ties to the lower index), from an n x n comparison: elementwise work and a sum, which XLA
    fuses, where `lax.top_k` over a few elements is a copy and a sort kernel (the tree's beam: 506 -> 495 kernels a
    step, AOT count)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    key = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)  # floats' total order as ints
    i = jnp.arange(x.shape[-1])
    ki, kj = key[..., :, None], key[..., None, :]
    before = (kj > ki) | ((kj == ki) & (i[None, :] < i[:, None]))  # [..., i, j]: j comes before i
    return jnp.sum(before.astype(jnp.int32), axis=-1)


def small_top_k(x, k: int, rank=None):
    """`lax.top_k(x, k)` (the same values and indices) for a short last axis (up to a few hundred), through
    `descending_rank` (or `rank`, x's own, where the caller has it)."""
    rank = descending_rank(x) if rank is None else rank
    at = rank[..., None, :] == jnp.arange(k, dtype=jnp.int32)[:, None]  # [..., k, n]: the element of each place
    idx = jnp.sum(jnp.where(at, jnp.arange(x.shape[-1], dtype=jnp.int32), 0), axis=-1)
    return jnp.take_along_axis(x, idx, axis=-1), idx


def top_k_wide(x, k: int, chunk: int = 1024):
    """`lax.top_k` over a long last axis (a vocabulary) in two stages: the top k of each `chunk`-wide slice, then the
    top k of those. Same values and indices as `lax.top_k` (ties go to the lower index in both). On the H200, XLA's
    top-k kernel ran one block per row: 66 us for 8 rows of 49,152 (the eagle tree's frontier), 13% of a tree step;
    the slices give it 48 times the rows to spread over the SMs."""
    n = x.shape[-1]
    if n <= 2 * chunk or k > chunk:
        return jax.lax.top_k(x, k)
    c = -(-n // chunk)
    pad = c * chunk - n
    if pad:
        x = jnp.concatenate([x, jnp.full(x.shape[:-1] + (pad,), -jnp.inf, x.dtype)], axis=-1)
    vals, idx = jax.lax.top_k(x.reshape(*x.shape[:-1], c, chunk), k)  # [..., c, k]
    idx = idx + (jnp.arange(c, dtype=idx.dtype) * chunk)[:, None]
    vals, pick = jax.lax.top_k(vals.reshape(*x.shape[:-1], c * k), k)
    return vals, jnp.take_along_axis(idx.reshape(*x.shape[:-1], c * k), pick, axis=-1)


def np_filter_reference(logits, temperature, top_k, top_p, min_p):
    """Plain NumPy twin of `filter_logits` for one row (tests): the set of allowed token ids."""
    x = np.asarray(logits, np.float64) / (temperature if temperature > 0 else 1.0)
    order = np.argsort(-x, kind="stable")
    allowed = np.ones_like(x, bool)
    if 0 < top_k < len(x):
        allowed[:] = False
        allowed[order[:top_k]] = True
    p = np.exp(x - x.max()) * allowed
    p /= p.sum()
    if top_p < 1:
        ps = p[order]
        before = np.cumsum(ps) - ps
        keep = np.zeros_like(allowed)
        keep[order[before < top_p]] = True
        allowed &= keep
    if min_p > 0:
        allowed &= p >= min_p * p.max()
    return allowed
