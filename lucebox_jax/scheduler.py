"""Continuous batching over a fixed number of slots (static shapes), array level: no tokenizer, no file I/O.

The device holds one `SlotState`: a KV cache [slots, Hkv, S, D] per layer, each slot's newest token, seen-token mask,
sampling parameters (`RowParams` rows), generated-token count, token budget, stop ids and a done flag. The host loop
(`Scheduler.run`) repeats:

1. admit: waiting requests go into free slots, up to `max_prefill_batch` at a time. They are prefilled together into
   a small cache [P, Hkv, S_p, D] (P a power of two, padded with copies of the last request; S_p a power of two of
   the padded prompt length), their first tokens sampled, and `insert_rows` (big state donated) writes each row into
   its slot with `dynamic_update_slice` along the batch axis. None of it waits for the device: the first tokens are
   read after the next decode call is dispatched, so the device runs prefill, insert and decode back to back.
2. decode: `decode_chunk` runs up to `steps_per_call` decode steps of every slot in one on-device `while_loop`,
   leaving early when every slot is done or when enough slots finished to be worth a refill. Done and empty slots
   still compute (static shapes) but neither advance their cache length nor change anything the host reads.
3. the host reads the chunk's tokens [slots, steps], appends them to each request, retires finished requests (stop
   token or token budget) and frees their slots for step 1. The next call is dispatched before the slower host work
   of a round (the caller's `stop_check`: streaming, stop strings; the finished requests handed back), which then
   runs while the device decodes (the call runs on a decode thread: on the GPU it holds the thread that runs it).
   With `lookahead=True` the next call is dispatched even before the last one's tokens are read (the device never
   waits for the host between calls; a request admitted in a round joins the call after the one already in flight,
   so its first token reaches the host one call later).

Sampling is per row and seeded per (seed, position) as in `sampling.py`, so a request's output does not depend on
which slot it ran in or what else was in the batch.

With `spec=` (a `spec_batch.BatchSpec`) step 2 drafts and verifies K tokens per slot (`spec_batch.spec_decode_chunk`)
while any live slot still speculates, and step 1 also prefills each new request's drafter state into its slot.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import os
import time
from typing import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from . import quant
from .engine import MIN_CACHE, PREFILL_CHUNK, Engine, bucket, join_chunks, pow2_at_least, prefill_step
from .model import KVCache, forward
from .errors import InvalidRequestError
from .sampling import RowParams, SamplingParams, is_int, sample


# LUCEBOX_DECODE_THREAD=0: decode calls run on the scheduler's own thread (before 2026-12-07; the A/B of bench_serve)
DECODE_THREAD = os.environ.get("LUCEBOX_DECODE_THREAD", "1") != "0"


@struct.dataclass
class SlotState:
    cache: KVCache
    tokens: jax.Array  # [B] newest token of each slot: the input of its next decode step
    seen: jax.Array  # [B, V] bool, tokens seen so far (repetition penalty)
    rp: RowParams
    done: jax.Array  # [B] bool: finished or empty
    count: jax.Array  # [B] int32 tokens generated so far
    row_max: jax.Array  # [B] int32 token budget
    stop_ids: jax.Array  # [B, K] int32, padded with -1
    spec: object = None  # spec_batch.SpecRows when the scheduler speculates


def init_state(engine: Engine, slots: int, max_len: int, n_stop: int = 8,
               sampling: tuple[int, bool] | None = None) -> SlotState:
    """Empty slots. sampling: (mode, penalized) fixed for every request to come (`Scheduler(sampling=...)`)."""
    def z():  # a fresh buffer each time: one buffer must not be donated twice
        return jnp.zeros((slots,), jnp.int32)

    mode, penalized = sampling or (None, None)
    rp = RowParams(temperature=jnp.zeros((slots,), jnp.float32), top_k=z(), top_p=jnp.ones((slots,), jnp.float32),
                   min_p=jnp.zeros((slots,), jnp.float32), rep_penalty=jnp.ones((slots,), jnp.float32),
                   keys=jnp.zeros((slots, 2), jnp.uint32), mode=mode, penalized=penalized)
    return SlotState(cache=engine.new_cache(slots, max_len), tokens=z(),
                     seen=jnp.zeros((slots, engine.cfg.vocab_size), bool), rp=rp, done=jnp.ones((slots,), bool),
                     count=z(), row_max=z(), stop_ids=jnp.full((slots, n_stop), -1, jnp.int32))


def _is_stop(tok, stop_ids):
    return jnp.any(tok[:, None] == stop_ids, axis=-1)


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "n_steps"), donate_argnames=("state",))
def decode_chunk(cfg, kernels, weights, state: SlotState, retire, exit_after, n_steps: int):
    """Up to n_steps decode steps of every slot. retire [B] bool: slots the host finished (marked done first).
    Leaves early when every slot is done or when `exit_after` slots finished in this call.
    Returns (state, tokens [B, n_steps] with -1 where a slot produced nothing)."""
    b = state.tokens.shape[0]
    state = state.replace(done=state.done | retire)
    done0 = state.done
    buf = jnp.full((b, n_steps), -1, jnp.int32)
    rows = jnp.arange(b)

    def cond(c):
        i, st, _ = c
        newly = jnp.sum((st.done & ~done0).astype(jnp.int32))
        return (i < n_steps) & ~jnp.all(st.done) & (newly < exit_after)

    def body(c):
        i, st, buf = c
        pos = st.cache.lengths
        live = ~st.done
        logits, cache = forward(cfg, kernels, weights, st.cache, st.tokens[:, None], pos,
                                last_only=jnp.zeros_like(pos))
        tok = sample(logits, st.rp, pos + 1, st.seen)
        cache = cache.replace(lengths=jnp.where(live, pos + 1, pos))  # done/empty slots stay where they are
        seen = st.seen.at[rows, tok].set(st.seen[rows, tok] | live)
        buf = jax.lax.dynamic_update_index_in_dim(buf, jnp.where(live, tok, -1), i, axis=1)
        count = st.count + live.astype(jnp.int32)
        done = st.done | (live & (_is_stop(tok, st.stop_ids) | (count >= st.row_max)))
        st = st.replace(cache=cache, tokens=jnp.where(live, tok, st.tokens), seen=seen, done=done, count=count)
        return i + 1, st, buf

    _, state, buf = jax.lax.while_loop(cond, body, (jnp.int32(0), state, buf))
    return state, buf


@functools.partial(jax.jit, donate_argnames=("state",))
def insert_rows(state: SlotState, small: KVCache, slots, first, seen, rp: RowParams, row_max, stop_ids):
    """Write prefilled rows p = 0..P-1 of `small` (cache [P, Hkv, S_p, D]) and their per-row values into slots[p] of
    the big state. Positions past min(S_p, S) are not copied (they lie past each prompt's end). A row whose first
    token is a stop id or whose budget is one token goes in done: the host need not see the first token before the
    next decode call is dispatched. One scatter an array (all P rows at once; a padded group repeats its last row and
    slot, so repeated indices write equal values): a loop over the rows was a while loop of P trips, each bringing its
    predicate to the host, and 603 kernels at the embedded shapes (32 slots, P = 8; now 73, AOT count for an H200)."""
    s_ins = min(small.max_len, state.cache.max_len)
    done = _is_stop(first, stop_ids) | (row_max <= 1)

    def put(big, rows):
        return big.at[slots].set(rows.astype(big.dtype))

    def put_kv(big, rows):
        return big.at[slots, :, :s_ins].set(rows[:, :, :s_ins].astype(big.dtype))

    cache = KVCache(k=tuple(put_kv(bk, sk) for bk, sk in zip(state.cache.k, small.k)),
                    v=tuple(put_kv(bv, sv) for bv, sv in zip(state.cache.v, small.v)),
                    lengths=put(state.cache.lengths, small.lengths))
    return state.replace(
        cache=cache, tokens=put(state.tokens, first), seen=put(state.seen, seen),
        rp=jax.tree_util.tree_map(put, state.rp, rp), done=put(state.done, done),
        count=put(state.count, jnp.ones_like(first)), row_max=put(state.row_max, row_max),
        stop_ids=put(state.stop_ids, stop_ids))


@dataclasses.dataclass
class SlotRequest:
    """One request for the scheduler: prompt ids, sampling params (seed set), stop token ids and token budget
    (max_new <= the cache length minus the prompt length). `key` is the caller's handle, returned as is."""

    key: object
    ids: list[int]
    params: SamplingParams
    stop_ids: frozenset = frozenset()
    max_new: int = 16


@dataclasses.dataclass
class Finished:
    request: SlotRequest
    token_ids: list[int]  # generated ids, up to and including a stop id
    finish_reason: str  # "stop": a stop id; "length": the token budget; "check": the caller's stop_check


@dataclasses.dataclass
class _Active:
    req: SlotRequest
    ids: list[int]
    checked: int = 0  # ids[:checked] hold no stop id (each round scans only its new tokens)
    since: int = 0  # the first decode call (by dispatch order) this request's row is part of


class Scheduler:
    """Continuous batching of `SlotRequest`s over `slots` cache rows of `max_len` positions.

        sched = Scheduler(engine, slots=8, max_len=2048)
        for finished in sched.run(requests):      # one list per host round, in completion order
            ...
    """

    def __init__(self, engine: Engine, slots: int = 8, max_len: int = 2048, steps_per_call: int = 8,
                 max_prefill_batch: int = 8, prefill_tokens: int = 8192,
                 stop_check: Callable[[SlotRequest, list[int]], bool] | None = None,
                 prefill_sizes: tuple[int, ...] | None = None, min_prefill_len: int = 0, spec=None,
                 exit_on_finish: bool = False, lookahead: bool = False, sampling: tuple[int, bool] | None = None):
        if slots < 1 or max_len < 2 or steps_per_call < 1:
            raise ValueError(f"bad scheduler shape: slots={slots}, max_len={max_len}, steps={steps_per_call}")
        self.engine = engine
        self.slots = slots
        self.max_len = max_len
        # (mode, penalized) of sampling.static_sampling over every request to come, when the caller knows them all
        # (a batch job, LLM.generate): the decode calls then compile one sampling branch, with no conditional (on
        # the GPU each copies its predicate to the host and waits); None (the server): chosen on device
        self.sampling = sampling
        self.steps_per_call = steps_per_call
        self.max_prefill_batch = max(1, min(max_prefill_batch, slots))
        self.prefill_tokens = prefill_tokens
        self.stop_check = stop_check
        # prefill group sizes compiled (a group is padded up to the next one) and the smallest prompt bucket:
        # fewer sizes, fewer compiles, more padding
        self.prefill_sizes = tuple(sorted(prefill_sizes or [1 << i for i in range(8) if 1 << i < self.max_prefill_batch]
                                          + [pow2_at_least(self.max_prefill_batch)]))
        self.min_prefill_len = min_prefill_len
        self.state: SlotState | None = None
        # (the timing keys exist from the start: the server's /health copies this while the device thread adds to it)
        self.stats = collections.Counter({"decode_calls": 0, "decode_s": 0.0, "admit_s": 0.0, "busy_slot_calls": 0,
                                          "wait_s": 0.0})
        # LUCEBOX_LOOP_TRACE=N: the host loop's last N events with perf_counter stamps, for bench_serve.py --trace:
        # ("d", t, rows, exit_after) a decode call dispatched, ("w", t0, t1) the host waiting for a call's tokens,
        # ("a", t0, t1, rows) an admission, ("f", t0, t1) a feed pull that blocked, ("h", t0, t1, n) the stop_check
        # hooks on n rows, ("y", t0, t1, n) the caller's time on a round's n finished requests; a server's EngineLoop
        # adds ("s", t) for each request it queues
        n_trace = int(os.environ.get("LUCEBOX_LOOP_TRACE", "0") or 0)
        self.trace: collections.deque | None = collections.deque(maxlen=n_trace) if n_trace > 0 else None
        # speculation (spec_batch.BatchSpec): off above its slot limit; the cache holds K positions past max_len
        self.spec = spec if spec is not None and slots <= spec.max_slots else None
        self.spec_note = (f"speculation off: {slots} slots > {spec.max_slots}" if spec is not None and self.spec is None
                          else None)
        extra = self.spec.k if self.spec else 0
        self.cache_len = max_len + (max(extra, quant.ROW_INVARIANT_CACHE_MARGIN) if quant.ROW_INVARIANT else extra)
        self._spec_on = np.zeros(slots, bool)  # host copy of state.spec.on
        self._spec_on_dev = None  # the last speculative call's state.spec.on, read once that call's tokens are in
        self._pending: concurrent.futures.Future | None = None  # the decode call running on the worker thread
        self._spec_seen: dict | None = None  # spec_stats() as last read with no call running
        # with nothing waiting, leave a decode call as soon as a row finishes (a live server: the finished request's
        # client hears at once and its next request arrives sooner) instead of running the call's remaining steps
        self.exit_on_finish = exit_on_finish
        # dispatch each decode call before reading the last one's tokens (vLLM's async scheduling): the device runs
        # calls back to back while the host reads, admits and streams; a new request joins one call later
        self.lookahead = lookahead

    # ------------------------------------------------------------------ device calls
    def _call(self, key, fn, *args, **kw):
        return self.engine._timed_first(key, fn, *args, **kw)

    def _ensure_state(self, n_stop: int):
        if self.state is None:
            self.state = init_state(self.engine, self.slots, self.cache_len, max(8, pow2_at_least(n_stop)),
                                    self.sampling)
            if self.spec is not None:
                self.state = self.state.replace(spec=self.spec.empty_rows(self.slots, self.cache_len))
        elif n_stop > self.state.stop_ids.shape[1]:
            k = pow2_at_least(n_stop)
            pad = jnp.full((self.slots, k - self.state.stop_ids.shape[1]), -1, jnp.int32)
            self.state = self.state.replace(stop_ids=jnp.concatenate([self.state.stop_ids, pad], axis=1))

    def _admit(self, group: list[SlotRequest], slots: list[int]) -> jax.Array:
        """Prefill `group` into `slots`; returns their first tokens [P >= len(group)] on the device. Nothing here waits
        for the device: the caller dispatches the next decode call before it reads them."""
        eng = self.engine
        self._spec_flags()  # before the insert donates the state that holds the last call's flags
        n = len(group)
        p = next((x for x in self.prefill_sizes if x >= n), pow2_at_least(n))
        reqs = group + [group[-1]] * (p - n)
        slot_ids = slots + [slots[-1]] * (p - n)
        self._ensure_state(max(len(r.stop_ids) for r in reqs))
        prompts = [r.ids for r in reqs]
        feats = self.spec.drafter.hidden_layers if self.spec is not None else None  # a draft head's start
        rp = RowParams.from_params([r.params for r in reqs], fixed=self.sampling)
        lens = np.array([len(x) for x in prompts], np.int32)
        first, cache, seen, hidden = eng.start(  # (the chunk as `_chunk_lens` gives it)
            prompts, _prefill_len(max(self.min_prefill_len, int(lens.max()))), rp, 0, feats, prefill=self._prefill,
            min_chunk=max(self.min_prefill_len, 1))
        k = self.state.stop_ids.shape[1]
        stop = np.full((p, k), -1, np.int32)
        for i, r in enumerate(reqs):
            stop[i, : len(r.stop_ids)] = sorted(r.stop_ids)
        row_max = np.array([r.max_new for r in reqs], np.int32)
        slot_d, row_max_d, stop_d = jax.device_put(  # one call, no eager conversions
            (np.asarray(slot_ids, np.int32), row_max, stop))
        self.state = self._call(("insert", p, cache.max_len, self.slots, self.cache_len, k), insert_rows, self.state,
                                cache, slot_d, first.tokens, seen, rp, row_max_d, stop_d)
        if self.spec is not None:
            self._admit_spec(prompts, slot_ids, first.tokens, hidden)
        self.stats["prefill_calls"] += 1
        self.stats["prefill_rows"] += n
        self.stats["prompt_tokens"] += int(lens[:n].sum())
        return first.tokens

    def _prefill(self, cache: KVCache, prompts: list[list[int]], hidden_layers: tuple | None = None):
        """Engine.prefill (right-padded rows, chunks of PREFILL_CHUNK) with chunks of at least min_prefill_len.
        -> (last logits, cache, hidden states of hidden_layers [B, T, F] or None)."""
        eng = self.engine
        b = len(prompts)
        lens = np.array([len(p) for p in prompts], np.int32)
        last, off, hidden = None, 0, []
        for t in self._chunk_lens(int(lens.max())):
            toks = np.zeros((b, t), np.int32)
            for r, p in enumerate(prompts):
                seg = p[off: off + t]
                toks[r, : len(seg)] = seg
            n_valid = np.clip(lens - off, 0, t).astype(np.int32)
            start = np.where(n_valid > 0, off, np.minimum(lens, off)).astype(np.int32)
            toks_d, start_d, n_valid_d = jax.device_put((toks, start, n_valid))  # one call, no eager conversions
            logits, cache, *h = self._call(("prefill", b, t, cache.max_len, False, hidden_layers), prefill_step,
                                           eng.cfg, eng.kernels, eng.weights, cache, toks_d, start_d, n_valid_d,
                                           hidden_layers=hidden_layers)
            hidden += h
            ends_here = jnp.asarray((n_valid > 0) & (lens <= off + t))[:, None]
            last = logits if last is None else jnp.where(ends_here, logits, last)
            off += t
        return last, cache.replace(lengths=jnp.asarray(lens)), join_chunks(hidden)

    def _admit_spec(self, prompts, slot_ids, first, hidden=None):
        """The drafter's state of newly prefilled rows into their slots (speculation on for each); hidden: the
        prefill's hidden states of the drafter's feature layers (a draft head's start)."""
        from .spec_batch import insert_spec_rows

        eng, d = self.engine, self.spec.drafter
        deng = getattr(d, "engine", None)  # a draft model's own prefill compiles count as compile time
        c0 = deng.compile_seconds if deng is not None else 0.0
        dstate = self.spec.init_dstate(prompts, self.cache_len, first, hidden)
        if deng is not None:
            eng.compile_seconds += deng.compile_seconds - c0
        p = len(prompts)
        rows = self._call(("spec-insert", p, self.slots, self.cache_len), insert_spec_rows, self.state.spec, dstate,
                          jnp.asarray(slot_ids, jnp.int32), jnp.asarray([x[-1] for x in prompts], jnp.int32),
                          jnp.ones((p,), bool))
        self.state = self.state.replace(spec=rows)
        self._spec_on[slot_ids] = True  # (brought up to date at the top of `_admit`)

    def _spec_flags(self) -> np.ndarray:
        """The host copy of which slots speculate, brought up to date with the last speculative call."""
        if self._spec_on_dev is not None:
            self._spec_on = np.array(self._spec_on_dev)
            self._spec_on_dev = None
        return self._spec_on

    def _decode(self, retire: np.ndarray, exit_after: int, active=()) -> jax.Array:
        eng = self.engine
        if self.spec is not None and any(self._spec_flags()[s] for s in active):
            return self._decode_spec(retire, exit_after)
        key = ("chunk", self.slots, self.cache_len, self.steps_per_call, self.state.stop_ids.shape[1])
        self.state, buf = self._call(key, decode_chunk, eng.cfg, eng.kernels, eng.weights, self.state,
                                     jnp.asarray(retire), jnp.int32(exit_after), n_steps=self.steps_per_call)
        return buf  # on the device: the host reads it in the next round

    def _decode_spec(self, retire: np.ndarray, exit_after: int) -> jax.Array:
        from .spec_batch import spec_decode_chunk

        eng, sp = self.engine, self.spec
        key = ("spec-chunk", sp.drafter.key, sp.k, self.slots, self.cache_len, self.steps_per_call,
               self.state.stop_ids.shape[1])
        self.state, buf = self._call(key, spec_decode_chunk, eng.cfg, eng.kernels, sp.drafter, eng.weights,
                                     sp.drafter.params, self.state, jnp.asarray(retire), jnp.int32(exit_after),
                                     jnp.float32(sp.min_accept), jnp.int32(sp.warmup), n_steps=self.steps_per_call,
                                     k=sp.k)
        self.stats["spec_calls"] += 1
        # its rows' speculation switches: read in the next round, when the call has finished (before an insert or
        # the next call donates this state), so the host's work of this round overlaps the call
        self._spec_on_dev = self.state.spec.on
        return buf

    def loop_stats(self) -> dict:
        """Where the host loop's time went so far: seconds in decode calls (dispatch until the host has their tokens;
        the round's first-token reads, hooks and hand-back run inside it, overlapping the device) and in admissions
        (dispatching prefill, first token and insert), decode calls, and occupancy = the mean share of slots holding
        a request when a decode call starts (rows that finish inside a call count as busy for all of it). wait_s: the
        part of decode_s the host spent blocked on the device (the rest was host work: a host-bound loop waits little).
        With LUCEBOX_LOOP_TRACE set, also the trace (see __init__)."""
        st = dict(self.stats)
        calls = st.get("decode_calls", 0)
        return {"slots": self.slots, "decode_calls": calls, "decode_s": round(st.get("decode_s", 0.0), 4),
                "wait_s": round(st.get("wait_s", 0.0), 4),
                "admit_s": round(st.get("admit_s", 0.0), 4), "prefill_calls": st.get("prefill_calls", 0),
                "busy_slot_calls": st.get("busy_slot_calls", 0),
                "occupancy": round(st.get("busy_slot_calls", 0) / (calls * self.slots), 4) if calls else None,
                **({"trace": list(self.trace)} if self.trace is not None else {})}

    def spec_stats(self) -> dict | None:
        """Acceptance over the run (spec_batch.BatchSpec.stats); None without a drafter, {"off": why} when the slot
        limit turned speculation off."""
        if self.spec is None:
            return {"off": self.spec_note} if self.spec_note else None
        if self._pending is not None and self._spec_seen is not None:
            return dict(self._spec_seen)  # a call is running on donated state: the last figures read
        if self._pending is not None:
            self._pending.result()  # (nothing read yet: wait for the call rather than touch its state)
        st = self.spec.stats(self.state.spec if self.state is not None else None)
        st["spec_calls"] = self.stats["spec_calls"]
        st["plain_calls"] = self.stats["decode_calls"] - self.stats["spec_calls"]
        self._spec_seen = dict(st)
        return st

    # ------------------------------------------------------------------ host loop
    def _check(self, a: _Active) -> str | None:
        """Stop id or token budget (cheap, at once); the caller's stop_check runs in `_hooks`."""
        r = a.req
        if r.stop_ids:
            for j in range(a.checked, len(a.ids)):
                if a.ids[j] in r.stop_ids:
                    del a.ids[j + 1:]
                    return "stop"
        a.checked = len(a.ids)
        if len(a.ids) >= r.max_new:
            del a.ids[r.max_new:]
            return "length"
        return None

    def _hooks(self, active: dict, free: list, retire: np.ndarray, done_now: list, slots) -> None:
        """The caller's stop_check (streaming, stop strings, a client gone) on each given slot still active; a row it
        ends is retired on the device by the next decode call dispatched after this."""
        if self.stop_check is None:
            return
        for s in slots:
            a = active.get(s)
            if a is not None and self.stop_check(a.req, a.ids):
                done_now.append(Finished(a.req, a.ids, "check"))
                del active[s]
                free.append(s)
                retire[s] = True  # the device does not know about host-side stops

    def validate(self, r: SlotRequest):
        """Typed refusal of a request the device loop cannot take (InvalidRequestError is a ValueError)."""
        vocab = self.engine.cfg.vocab_size
        if not isinstance(r.params, SamplingParams):
            raise InvalidRequestError(f"request {r.key!r}: params must be SamplingParams")
        if not isinstance(r.ids, (list, tuple)) or not r.ids or not all(is_int(t) and 0 <= t < vocab for t in r.ids):
            raise InvalidRequestError(f"request {r.key!r}: ids must be a non-empty list of token ids in 0..{vocab - 1}")
        if not all(is_int(t) and 0 <= t < vocab for t in r.stop_ids):
            raise InvalidRequestError(f"request {r.key!r}: stop ids must be token ids in 0..{vocab - 1}")
        if not is_int(r.max_new) or r.max_new < 1 or len(r.ids) + r.max_new > self.max_len:
            raise InvalidRequestError(f"request {r.key!r}: prompt {len(r.ids)} + max_new {r.max_new!r} tokens does "
                                      f"not fit the cache of {self.max_len}")
        if r.params.seed is None:
            raise InvalidRequestError(f"request {r.key!r}: params.seed must be set")

    def run(self, requests: Iterable[SlotRequest]) -> Iterator[list[Finished]]:
        """Serve `requests` (pulled lazily) until all are finished; yields the requests finished in each host round.
        A feed may yield None for "nothing new now" (it is asked again after the next decode call, or at once when
        the batch is empty, so an idle live feed should block).

        A round: the last decode call's tokens reach the host and rows that hit a stop id or their budget free their
        slots; new requests are admitted; the next decode call is dispatched; then, while it runs on the device, the
        admitted rows' first tokens are read, the caller's stop_check hooks (a server's streaming) run and the
        round's finished requests are yielded, so their host work does not leave the device idle. A row a hook ends
        is retired one call later. With `lookahead` a round starts by dispatching the next call, then reads the one
        before it: rows admitted in a round join the call after the one in flight and read their first tokens in the
        next round."""
        # A decode call is one XLA while loop, and running one holds the calling thread until it ends (the loop's
        # predicate comes back to the host each step): dispatched from this thread, the round's host work (first
        # tokens, hooks, hand-back) would wait for the call instead of running beside it. So the calls go to a
        # worker thread (the interpreter lock is free while one runs) and the round waits on its future where it
        # reads the tokens. (Lookahead dispatches while a call is in flight and admits beside it: it keeps the
        # calling thread, whose calls run in order.)
        pool = (None if (self.lookahead and self.spec is None) or not DECODE_THREAD
                else concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lucebox-decode"))
        try:
            yield from self._run(requests, pool)
        finally:
            if pool is not None:
                pool.shutdown(wait=True)
            self._pending = None

    def _run(self, requests: Iterable[SlotRequest], pool) -> Iterator[list[Finished]]:
        it = iter(requests)
        exhausted = False
        waiting: collections.deque[SlotRequest] = collections.deque()
        free = list(range(self.slots))
        active: dict[int, _Active] = {}
        retire = np.zeros(self.slots, bool)
        inflight: collections.deque = collections.deque()  # (tokens [slots, steps] on the device, dispatch time, seq)
        seq = 0  # decode calls dispatched so far: a row's tokens count from call `_Active.since` on
        ahead = self.lookahead and self.spec is None  # (a speculative call is read back at dispatch: no lookahead)
        late: list[tuple[list[int], jax.Array]] = []  # lookahead: last round's admissions, first tokens unread
        trace = self.trace

        def dispatch():
            nonlocal seq
            # with requests waiting, come back as soon as a prefill group's worth of slots is free
            exit_after = (max(1, min(self.max_prefill_batch, len(waiting))) if waiting
                          else 1 if self.exit_on_finish else self.slots + 1)
            t0 = time.perf_counter()
            if pool is None:
                out = self._decode(retire, exit_after, active)
            else:  # (the host changes retire and active while the call runs: the worker gets copies)
                out = self._pending = pool.submit(self._decode, retire.copy(), exit_after, tuple(active))
            inflight.append((out, t0, seq))
            self.stats["decode_calls"] += 1  # (dispatched; counted here, not on the worker)
            if trace is not None:
                trace.append(("d", t0, len(active), exit_after))
            seq += 1
            self.stats["busy_slot_calls"] += len(active)
            retire[:] = False

        def settle(s, new, done_now, hooked):
            """Slot s's request after `new` tokens reached it: finished (slot freed; the device has it done too) or,
            with new tokens, one for the hooks."""
            a = active[s]
            a.ids.extend(new)
            why = self._check(a)
            if why is not None:
                done_now.append(Finished(a.req, a.ids, why))
                del active[s]
                free.append(s)
                retire[s] = False
            elif new:
                hooked.append(s)

        def first_tokens(admitted, done_now, hooked):
            for slots, firsts in admitted:
                for s, t in zip(slots, np.asarray(firsts)):
                    settle(s, [int(t)], done_now, hooked)  # (no decode call's token is read for a row before it)

        while True:
            done_now: list[Finished] = []
            hooked: list[int] = []  # slots whose new tokens the stop_check hooks have not seen
            admitted: list[tuple[list[int], jax.Array]] = []  # (slots, their first tokens on the device)
            if ahead and inflight and active:
                dispatch()  # the next call goes out before the last one's tokens are read: no host gap between calls
            if late:  # (computed before the call just dispatched)
                first_tokens(late, done_now, hooked)
                late = []
            if inflight and (len(inflight) > 1 or not ahead or not active):
                buf, t_sent, n = inflight.popleft()
                t_w = time.perf_counter()
                if isinstance(buf, concurrent.futures.Future):
                    buf = buf.result()  # the call has run (its errors raise here)
                    self._pending = None
                buf = np.asarray(buf)  # waits for that call
                t_got = time.perf_counter()
                self.stats["decode_s"] += t_got - t_sent  # dispatch to tokens on the host
                self.stats["wait_s"] += t_got - t_w  # of which the host had nothing to do but wait
                if trace is not None:
                    trace.append(("w", t_w, t_got))
                for s in list(active):
                    if active[s].since > n:  # admitted after call n was dispatched: its row there is not this request
                        continue
                    settle(s, [int(t) for t in buf[s][buf[s] >= 0]], done_now, hooked)
            while not exhausted and len(waiting) < self.slots + self.max_prefill_batch:
                t_f = time.perf_counter()
                try:
                    r = next(it)
                except StopIteration:
                    exhausted = True
                    break
                finally:
                    if trace is not None and time.perf_counter() - t_f > 2e-4:
                        trace.append(("f", t_f, time.perf_counter()))
                if r is None:  # a live feed (serve/) with nothing new now: decode, then ask again
                    break
                self.validate(r)
                waiting.append(r)
            while free and waiting:
                group, longest = [], 0
                while waiting and len(group) < min(len(free), self.max_prefill_batch):
                    longest_if = max(longest, _prefill_len(len(waiting[0].ids)))
                    if group and longest_if * pow2_at_least(len(group) + 1) > self.prefill_tokens:
                        break
                    longest = longest_if
                    group.append(waiting.popleft())
                slots = [free.pop(0) for _ in group]
                t0 = time.perf_counter()
                admitted.append((slots, self._admit(group, slots)))
                self.stats["admit_s"] += time.perf_counter() - t0
                if trace is not None:
                    trace.append(("a", t0, time.perf_counter(), len(group)))
                for s, r in zip(slots, group):
                    active[s] = _Active(r, [], since=seq)  # its first token is read once a later call is dispatched
                    retire[s] = False
            if active and not inflight:
                dispatch()
                # the admitted rows' first tokens: their prefills run before the call just dispatched, so this waits
                # for them only, while the device goes on into the decode call (a row done at its first token is done
                # there); like the hooks, this time counts inside the call's decode_s
                first_tokens(admitted, done_now, hooked)
            else:  # lookahead: a call is in flight ahead of these rows' prefills; read them next round
                late = admitted
            t_h = time.perf_counter()
            self._hooks(active, free, retire, done_now, hooked)  # on the host while the device decodes
            if trace is not None and hooked:
                trace.append(("h", t_h, time.perf_counter(), len(hooked)))
            if done_now:
                self.stats["completion_tokens"] += sum(len(f.token_ids) for f in done_now)
                self.stats["requests"] += len(done_now)
                t_y = time.perf_counter()
                yield done_now
                if trace is not None:
                    trace.append(("y", t_y, time.perf_counter(), len(done_now)))
            if not inflight and not active and exhausted and not waiting:
                return

    # ------------------------------------------------------------------ compiling ahead of traffic
    def _chunk_lens(self, longest: int) -> tuple[int, ...]:
        """The prefill chunk lengths `_prefill` runs for a group whose longest prompt has `longest` tokens."""
        total, out = max(longest, self.min_prefill_len), []
        while sum(out) < total:
            out.append(bucket(max(min(self.min_prefill_len, PREFILL_CHUNK), min(PREFILL_CHUNK, total - sum(out)))))
        return tuple(out)

    def prompt_length_classes(self, max_prompt: int) -> list[int]:
        """Prompt lengths up to `max_prompt` that together meet every (chunk length, prefill cache length) pair a
        prompt of that size can compile: running each once compiles every prefill and insert shape."""
        met, out = set(), []
        for n in range(1, max_prompt + 1):
            pairs = {(t, _prefill_len(max(self.min_prefill_len, n))) for t in self._chunk_lens(n)}
            if not pairs <= met:
                met |= pairs
                out.append(n)
        return out

    def warmup(self, max_prompt: int | None = None, on_run: Callable[[], None] | None = None) -> int:
        """Compile every shape a workload of prompts up to `max_prompt` tokens needs (each prefill group size with
        each prompt length class, then decode chunks), so live traffic never waits for a compile (a server's
        latency would otherwise carry multi-second stalls). Returns how many warm-up batches ran."""
        hi = max(1, min(max_prompt or self.max_len - 2, self.max_len - 2))
        params = SamplingParams(temperature=0.0, seed=0, max_tokens=2, ignore_eos=True)
        runs = 0
        for p in [x for x in self.prefill_sizes if x <= self.slots]:
            for n in self.prompt_length_classes(hi):
                reqs = [SlotRequest(("warmup", p, n, i), [0] * n, params, frozenset(), 2) for i in range(p)]
                for _ in self.run(reqs):
                    pass
                runs += 1
                if on_run is not None:
                    on_run()
        return runs


def _prefill_len(n: int) -> int:
    """Cache length for prefilling a prompt of n tokens with Engine.prefill's chunk buckets (at least MIN_CACHE, so
    that few (P, S_p) shapes of prefill and insert get compiled)."""
    full, rem = divmod(n, PREFILL_CHUNK)
    padded = full * PREFILL_CHUNK + (bucket(rem) if rem else 0)
    return pow2_at_least(padded, MIN_CACHE)


def generate_ids(engine: Engine, requests: list[SlotRequest], slots: int = 8, max_len: int | None = None,
                 steps_per_call: int = 8, **kw) -> dict:
    """Convenience: run `requests` to completion; {key: Finished}."""
    max_len = max_len or max(len(r.ids) + r.max_new for r in requests)
    sched = Scheduler(engine, slots=slots, max_len=max_len, steps_per_call=steps_per_call, **kw)
    out = {}
    for batch in sched.run(requests):
        for f in batch:
            out[f.request.key] = f
    return out


__all__ = ["Scheduler", "SlotRequest", "Finished", "SlotState", "decode_chunk", "insert_rows", "init_state",
           "generate_ids"]
