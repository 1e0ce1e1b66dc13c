"""The compiled phases of generation, one small function each (gpt-fast style), and the `Engine` that runs them.

- `prefill_step`: a chunk of prompt tokens [B, T] (T padded to a bucket) into the cache; logits of each row's last
  valid token (or of every position, for prompt logprobs).
- `decode_step`: one token per row, cache donated, sampling on device.
- `generate_loop`: `lax.while_loop` of decode steps over a fixed-shape state (done mask, token buffer, rng): a whole
  completion in one device program, no host round trip per token.

Static shapes keep recompiles bounded: prompt chunks are padded to `PREFILL_BUCKETS`, the cache length and the
token buffer to powers of two. Compiled programs are memoised per shape and JAX's persistent compilation cache keeps
them across runs (`enable_compilation_cache`).
"""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .config import ModelConfig
from .model import KVCache, Weights, forward, init_cache
from . import ops, quant
from .ops import KernelSet
from .sampling import RowParams, sample, top_logprobs

PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)
PREFILL_CHUNK = PREFILL_BUCKETS[-1]
MIN_CACHE = 256


def bucket(n: int, buckets=PREFILL_BUCKETS) -> int:
    for b in buckets:
        if n <= b:
            return b
    return buckets[-1]


def pow2_at_least(n: int, lo: int = 1) -> int:
    return max(lo, 1 << max(0, int(n) - 1).bit_length())


def stop_matrix(stop_ids, batch: int) -> np.ndarray:
    """Stop ids per row as int32 [batch, K] padded with -2 (K a power of two: few compiled shapes). `stop_ids` is one
    list of sets (one per row; a row's stops never end another row) or one set shared by every row."""
    rows = list(stop_ids) if stop_ids and not isinstance(next(iter(stop_ids)), (int, np.integer)) else None
    rows = [sorted(int(t) for t in r) for r in rows] if rows is not None else [sorted(int(t) for t in stop_ids)] * batch
    if len(rows) != batch:
        raise ValueError(f"{len(rows)} stop-id sets for {batch} rows")
    out = np.full((batch, pow2_at_least(max([len(r) for r in rows] + [1]))), -2, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def enable_compilation_cache(path: str | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache so a second run does not compile again. A cache folder that cannot
    be written (read-only HOME) falls back to one in the temp folder, with one warning; failing that, runs uncached."""
    import logging
    import tempfile

    path = path or os.environ.get("LUCEBOX_JAX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "lucebox_jax", "jax_cache")
    fallback = os.path.join(tempfile.gettempdir(), f"lucebox_jax_cache-{os.getuid()}")
    for i, p in enumerate(dict.fromkeys([path, fallback])):
        try:
            os.makedirs(p, exist_ok=True)
            if not os.access(p, os.W_OK):
                raise PermissionError(f"{p} is not writable")
        except OSError as e:
            logging.getLogger(__name__).warning("compilation cache %s unusable (%s)%s", p, e,
                                                "; trying the temp folder" if i == 0 else "; running without it")
            continue
        jax.config.update("jax_compilation_cache_dir", p)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        return p
    return None


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int) -> int:
    """Device bytes of a KV cache of `batch` rows x `max_len` positions, plus each row's seen-token mask."""
    item = jnp.dtype(cfg.dtype).itemsize
    return batch * (cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * item * max_len + cfg.vocab_size)


def free_memory() -> int | None:
    """Bytes free on the default device (a GPU's allocator limit, or the host's MemAvailable), None if unknown."""
    try:
        if jax.default_backend() != "cpu":
            st = jax.devices()[0].memory_stats() or {}
            return int(st["bytes_limit"] - st.get("bytes_in_use", 0)) if "bytes_limit" in st else None
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, KeyError, ValueError, RuntimeError):
        pass
    return None


# one compiled call makes a cache's 2 x n_layers zero buffers: built eagerly, each was an op dispatch of its own plus a
# host-to-device copy of its fill value, 18-25 ms of host time per scheduler admission on the H200 (bench_admit.py)
_new_cache_jit = jax.jit(init_cache, static_argnums=(0, 1, 2))


def check_fits(cfg: ModelConfig, batch: int, max_len: int):
    """Refuse a cache that cannot fit (ResourceLimitError naming the limit) instead of an allocator crash."""
    from .errors import ResourceLimitError

    need = cache_bytes(cfg, batch, max_len)
    if need < 256 << 20:  # small caches always go ahead: no device query
        return
    free = free_memory()
    if free is not None and need > free:
        fit = free // max(cache_bytes(cfg, 1, max_len), 1)
        raise ResourceLimitError(
            f"a batch of {batch} x {max_len} positions needs {need / 2**30:.2f} GiB of KV cache, but the "
            f"{jax.default_backend()} has {free / 2**30:.2f} GiB free: at most {fit} rows of {max_len} positions fit "
            "(lower --batch-size / max_batch or --max-context)")


@struct.dataclass
class StepOut:
    tokens: jax.Array  # [B] sampled next tokens
    logprob: jax.Array  # [B] raw logprob of the sampled token
    top_ids: jax.Array  # [B, k]
    top_vals: jax.Array  # [B, k]

    @classmethod
    def of_tokens(cls, tokens) -> "StepOut":
        """Tokens without logprobs (to continue a loop from a known token)."""
        b = tokens.shape[0]
        return cls(tokens, jnp.zeros((b,), jnp.float32), jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0), jnp.float32))


def _sample_out(logits, rp, positions, seen, n_logprobs):
    tok = sample(logits, rp, positions, seen)
    lp, ids, vals = top_logprobs(logits, n_logprobs)
    chosen = jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]
    return StepOut(tok, chosen, ids, vals)


def _mark_seen(seen, tok):
    return seen.at[jnp.arange(tok.shape[0]), tok].set(True)


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "all_logits", "hidden_layers"),
                   donate_argnames=("cache",))
def prefill_step(cfg: ModelConfig, kernels: KernelSet, weights: Weights, cache: KVCache, tokens, start, n_valid,
                 all_logits: bool = False, hidden_layers: tuple | None = None):
    """Write tokens [B, T] at positions start[b]..; rows advance by n_valid[b]. Returns (logits, cache):
    [B, V] at each row's last valid token (all_logits=False) or [B, T, V]. With hidden_layers (a draft head's
    feature layers): (logits, cache, hidden [B, T, F]), so the head starts without a forward of its own."""
    last = jnp.clip(n_valid - 1, 0, tokens.shape[1] - 1)
    out = forward(cfg, kernels, weights, cache, tokens, start, last_only=None if all_logits else last,
                  hidden_layers=hidden_layers)
    return (out[0], out[1].replace(lengths=start + n_valid)) + tuple(out[2:])


def join_chunks(parts: list):
    """A prefill's per-chunk arrays [B, T_i, ...] as one [B, sum T_i, ...] (None when there are none)."""
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


@functools.partial(jax.jit, static_argnames=("n_logprobs",))
def sample_first(logits, rp: RowParams, positions, seen, n_logprobs: int = 0):
    """Sample the first completion token from prefill logits [B, V]."""
    out = _sample_out(logits, rp, positions, seen, n_logprobs)
    return out, _mark_seen(seen, out.tokens)


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "max_len", "n_logprobs", "hidden_layers"))
def start_step(cfg: ModelConfig, kernels: KernelSet, weights: Weights, packed, rp: RowParams, max_len: int,
               n_logprobs: int = 0, hidden_layers: tuple | None = None):
    """A generation's whole start as one program, for prompts of one prefill chunk: a new cache, the prefill, the
    prompts' seen-token mask and the first token. packed [B, T + 1] int32: each row's right-padded tokens, then its
    length (one host-to-device copy). Returns (first StepOut, cache, seen[, hidden [B, T, F]])."""
    tokens, lens = packed[:, :-1], packed[:, -1]
    b, t = tokens.shape
    out = prefill_step(cfg, kernels, weights, init_cache(cfg, b, max_len), tokens, jnp.zeros_like(lens), lens,
                       hidden_layers=hidden_layers)
    valid = jnp.arange(t)[None, :] < lens[:, None]
    seen = jnp.zeros((b, cfg.vocab_size), bool).at[jnp.arange(b)[:, None], tokens].max(valid)
    first, seen = sample_first(out[0], rp, lens, seen, n_logprobs=n_logprobs)
    return (first, out[1], seen) + tuple(out[2:])


def _decode(cfg, kernels, weights, cache, tokens, rp, seen, n_logprobs):
    pos = cache.lengths
    logits, cache = forward(cfg, kernels, weights, cache, tokens[:, None], pos, last_only=jnp.zeros_like(pos))
    cache = cache.replace(lengths=pos + 1)
    out = _sample_out(logits, rp, pos + 1, seen, n_logprobs)
    return cache, out, _mark_seen(seen, out.tokens)


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "n_logprobs"), donate_argnames=("cache", "seen"))
def decode_step(cfg: ModelConfig, kernels: KernelSet, weights: Weights, cache: KVCache, tokens, rp: RowParams,
                seen, n_logprobs: int = 0):
    """Feed tokens [B] (each row's newest token, at position cache.lengths) and sample the next one."""
    return _decode(cfg, kernels, weights, cache, tokens, rp, seen, n_logprobs)


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "max_new", "n_logprobs", "steps_per_check"),
                   donate_argnames=("cache", "seen"))
def generate_loop(cfg: ModelConfig, kernels: KernelSet, weights: Weights, cache: KVCache, first: StepOut,
                  rp: RowParams, seen, stop_ids, row_max, max_new: int, n_logprobs: int = 0,
                  steps_per_check: int = 1):
    """Decode until every row hit a stop id or its own max token count (row_max [B] <= max_new), on device.

    first: the newest token of each row, not yet in the cache (e.g. sampled from the prefill); it is slot 0 of the
    output. Returns (StepOut of buffers [B, max_new, ...] with tokens padded by -1, n_generated [B], cache, seen).
    steps_per_check > 1: the loop's condition is read every that many steps (an inner `fori_loop` of known trip
    count, which the GPU runs without copying a predicate to the host); up to steps_per_check - 1 steps past the end
    then run on finished rows and write nothing. The same tokens either way (`bench_decode.py --variants check4`
    times it)."""
    b = first.tokens.shape[0]
    k = n_logprobs

    def put(buf, i, val):
        return jax.lax.dynamic_update_index_in_dim(buf, val, i, axis=1)

    def is_stop(tok):  # stop_ids [B, K]: each row its own
        return jnp.any(tok[:, None] == stop_ids, axis=-1)

    bufs = StepOut(
        tokens=put(jnp.full((b, max_new), -1, jnp.int32), 0, first.tokens),
        logprob=put(jnp.zeros((b, max_new), jnp.float32), 0, first.logprob),
        top_ids=put(jnp.zeros((b, max_new, k), jnp.int32), 0, first.top_ids),
        top_vals=put(jnp.zeros((b, max_new, k), jnp.float32), 0, first.top_vals),
    )
    done = is_stop(first.tokens) | (row_max <= 1)
    count = jnp.ones((b,), jnp.int32)

    def cond(state):
        i, _, _, _, done, _, _ = state
        return (i < max_new) & ~jnp.all(done)

    def step(state):
        i, cache, tok, seen, done, count, bufs = state
        cache, out, seen = _decode(cfg, kernels, weights, cache, tok, rp, seen, k)
        new = out.replace(tokens=jnp.where(done, -1, out.tokens))
        if steps_per_check == 1:
            bufs = jax.tree.map(lambda buf, v: put(buf, i, v), bufs, new)
        else:  # steps past max_new (every row done by then) must not overwrite the last slot
            j = jnp.minimum(i, max_new - 1)
            bufs = jax.tree.map(lambda buf, v: jnp.where(i < max_new, put(buf, j, v), buf), bufs, new)
        count = count + (~done).astype(jnp.int32)
        done = done | is_stop(out.tokens) | (count >= row_max)
        return i + 1, cache, out.tokens, seen, done, count, bufs

    body = step if steps_per_check == 1 else (
        lambda state: jax.lax.fori_loop(0, steps_per_check, lambda _, s: step(s), state))
    state = (jnp.int32(1), cache, first.tokens, seen, done, count, bufs)
    _, cache, _, seen, _, count, bufs = jax.lax.while_loop(cond, body, state)
    return bufs, count, cache, seen


class Engine:
    """Weights + config + kernel choice, and the array-level operations the API builds on."""

    def __init__(self, cfg: ModelConfig, weights: Weights, kernels: KernelSet, tensor_parallel: int = 1):
        self.cfg = cfg
        self.parallel = None  # parallel.TensorParallel when the model is split over several devices
        if tensor_parallel != 1:
            from .parallel import TensorParallel

            # weights stay in the engine's format: a kernel's load-time repack (ops.prepare_weights) is not done per
            # shard, so such kernels (mgpu, best) take their own fallback under tensor parallelism
            self.parallel = TensorParallel.create(cfg, tensor_parallel)
            weights, kernels = self.parallel.shard_weights(cfg, weights), self.parallel.wrap_kernels(kernels)
        else:
            weights = ops.prepare_weights(weights, kernels)  # kernels that repack weights do it once, here
        self.weights = weights
        self.kernels = kernels
        self.compile_seconds = 0.0
        self.model_name: str | None = None  # set by whoever loaded it (names the model's shipped draft head)
        self._seen_shapes: set = set()

    def _timed_first(self, key, fn, *args, **kw):
        """Call fn; the first call for a shape `key` (which compiles) counts as compile time, not run time."""
        if key in self._seen_shapes:
            return fn(*args, **kw)
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        jax.block_until_ready(out)
        self.compile_seconds += time.perf_counter() - t0
        self._seen_shapes.add(key)
        return out

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        check_fits(self.cfg, batch, max_len)
        if self.parallel is not None:
            return self.parallel.new_cache(self.cfg, batch, max_len)
        return _new_cache_jit(self.cfg, batch, max_len)

    def cache_len_for(self, needed: int) -> int:
        if quant.ROW_INVARIANT:  # the length a speculative run would take (speculative.SpeculativeDecoder.cache_len)
            needed += quant.ROW_INVARIANT_CACHE_MARGIN
        return min(pow2_at_least(needed, MIN_CACHE), pow2_at_least(self.cfg.max_context, MIN_CACHE))

    def start(self, prompts: list[list[int]], max_len: int, rp: RowParams, n_logprobs: int = 0,
              hidden_layers: tuple | None = None, prefill=None, min_chunk: int = 1):
        """A generation's start: a new cache of `max_len` positions, the prompts' prefill, their seen-token mask and
        the first token -> (first StepOut, cache, seen, hidden or None). Prompts of one prefill chunk (padded to at
        least `min_chunk` tokens) run as one program (`start_step`: one copy to the device, one dispatch); longer
        ones, or a tensor-parallel engine, as the steps one by one, the prefill by `prefill(cache, prompts,
        hidden_layers) -> (last logits, cache, hidden or None)` (default: `Engine.prefill`'s chunks)."""
        lens = [len(p) for p in prompts]
        if max(max(lens), min_chunk) > PREFILL_CHUNK or self.parallel is not None:
            cache = self.new_cache(len(prompts), max_len)
            if prefill is None:
                last, _, cache, *hidden = self.prefill(cache, prompts, hidden_layers=hidden_layers)
                hidden = hidden[0] if hidden else None
            else:
                last, cache, hidden = prefill(cache, prompts, hidden_layers)
            first, seen = self.first_token(last, rp, lens, self.new_seen(prompts), n_logprobs)
            return first, cache, seen, hidden
        check_fits(self.cfg, len(prompts), max_len)
        t = bucket(max(max(lens), min_chunk))
        packed = np.zeros((len(prompts), t + 1), np.int32)
        for r, p in enumerate(prompts):
            packed[r, : len(p)] = p
            packed[r, t] = len(p)
        key = ("start", len(prompts), t, max_len, n_logprobs, hidden_layers)
        first, cache, seen, *hidden = self._timed_first(key, start_step, self.cfg, self.kernels, self.weights, packed,
                                                        rp, max_len, n_logprobs=n_logprobs,
                                                        hidden_layers=hidden_layers)
        return first, cache, seen, (hidden[0] if hidden else None)

    def prefill(self, cache: KVCache, prompts: list[list[int]], all_logits: bool = False,
                hidden_layers: tuple | None = None):
        """Prefill right-padded prompts (one per cache row) in chunks of at most PREFILL_CHUNK tokens.

        Returns (last_logits [B, V] device array, all_logits list of [len_b, V] numpy arrays or None, cache), and
        with hidden_layers a fourth value: those layers' hidden states at every prompt position [B, T >= len, F]
        (a draft head's start, `Drafter.init_state(hidden=)`)."""
        b = len(prompts)
        lens = np.array([len(p) for p in prompts], np.int32)
        total = int(lens.max())
        last = None
        per_pos = [[] for _ in range(b)] if all_logits else None
        hidden = []
        off = 0
        while off < total:
            t = bucket(min(PREFILL_CHUNK, total - off))
            toks = np.zeros((b, t), np.int32)
            for r, p in enumerate(prompts):
                seg = p[off: off + t]
                toks[r, : len(seg)] = seg
            n_valid = np.clip(lens - off, 0, t).astype(np.int32)
            start = np.minimum(lens, off).astype(np.int32)  # finished rows re-write their (masked) tail
            start = np.where(n_valid > 0, off, start).astype(np.int32)
            key = ("prefill", b, t, cache.max_len, all_logits, hidden_layers)
            logits, cache, *h = self._timed_first(key, prefill_step, self.cfg, self.kernels, self.weights, cache,
                                                  jnp.asarray(toks), jnp.asarray(start), jnp.asarray(n_valid),
                                                  all_logits=all_logits, hidden_layers=hidden_layers)
            hidden += h
            if all_logits:
                lg = np.asarray(logits)
                for r in range(b):
                    per_pos[r].append(lg[r, : n_valid[r]])
                rows_last = jnp.asarray(lg[np.arange(b), np.clip(n_valid - 1, 0, t - 1)])
            else:
                rows_last = logits
            ends_here = jnp.asarray((n_valid > 0) & (lens <= off + t))[:, None]
            last = rows_last if last is None else jnp.where(ends_here, rows_last, last)
            off += t
        cache = cache.replace(lengths=jnp.asarray(lens))
        if all_logits:
            per_pos = [np.concatenate(x, axis=0) for x in per_pos]
        if hidden_layers:
            return last, per_pos, cache, join_chunks(hidden)
        return last, per_pos, cache

    def new_seen(self, prompts: list[list[int]]):
        seen = np.zeros((len(prompts), self.cfg.vocab_size), bool)
        for r, p in enumerate(prompts):
            seen[r, np.asarray(p, np.int64)] = True
        return jnp.asarray(seen)

    def first_token(self, logits, rp: RowParams, lengths, seen, n_logprobs: int = 0):
        key = ("first", logits.shape[0], n_logprobs)
        return self._timed_first(key, sample_first, logits, rp, jnp.asarray(lengths), seen, n_logprobs=n_logprobs)

    def decode(self, cache, tokens, rp, seen, n_logprobs: int = 0):
        key = ("decode", cache.batch, cache.max_len, n_logprobs)
        return self._timed_first(key, decode_step, self.cfg, self.kernels, self.weights, cache, tokens, rp, seen,
                                 n_logprobs=n_logprobs)

    def loop(self, cache, first: StepOut, rp, seen, stop_ids, row_max, n_logprobs: int = 0):
        """Run generate_loop; returns (bufs, count, cache, seen). stop_ids: one set per row (or one for all)."""
        max_new = pow2_at_least(int(np.max(row_max)), 16)
        stop = jnp.asarray(stop_matrix(stop_ids, cache.batch))
        key = ("loop", cache.batch, cache.max_len, max_new, n_logprobs, stop.shape[1])
        return self._timed_first(key, generate_loop, self.cfg, self.kernels, self.weights, cache, first, rp, seen,
                                 stop, jnp.asarray(row_max, jnp.int32), max_new=max_new, n_logprobs=n_logprobs)
