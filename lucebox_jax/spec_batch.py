"""Speculative decoding inside continuous batching: the drafter runs per slot, acceptance is per slot, and each slot
stops speculating on its own when its drafts do not pay.

The scheduler's `SlotState` carries a `SpecRows` (the drafter's per-slot state, each slot's previous token, its
speculation flag, its drafted / accepted counts and a histogram). `spec_decode_chunk` is `scheduler.decode_chunk`
with draft + verify steps: every slot drafts K tokens, the target checks all of them in one forward of K + 1
positions, and each slot commits its own accepted prefix plus one target token (fixed shapes: the per-call token
buffer is [B, steps * (K + 1)], -1 where a slot produced nothing).

Policy (`BatchSpec`), so that speculation never makes a job slower by much:
- above `max_slots` slots (default 32) the job does not speculate at all: the verify's K extra positions per row
  stop being nearly free once a batch is compute-bound;
- a slot whose acceptance rate (accepted / drafted, after `warmup` drafts) is below `min_accept` stops speculating
  until its request finishes (a new request in that slot starts afresh). `min_accept` defaults to the break-even
  of the slot's realised acceptance: a step costs 1 + K (draft cost + verify cost per extra position) plain steps
  and yields 1 + accepted tokens, so it pays while accepted / drafted >= that per-draft cost;
- when no live slot speculates, the scheduler runs the plain `decode_chunk` (no draft, one position per step);
  until then a greedy slot that stopped still takes its accepted drafts (the call's verify covers every row, and its
  greedy tokens are the same either way), so a slot's switch-off costs it nothing while others speculate.
A sampled slot that does not speculate takes its token with `sampling.sample` at the same position and key as the plain
decode step, so its output is the plain output. Greedy output equals the plain scheduler's token for token, whether a
slot speculates or not (on float32; see README for bfloat16); sampled slots follow the target's distribution (rejection sampling), keyed by
(seed, position) and decided only by the slot's own history, so a seeded request does not depend on its neighbours.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .model import forward
from .sampling import sample
from .speculative import _verify_out, accept_tokens

DEFAULT_MAX_SLOTS = 32


def cli_chain_error(args) -> str | None:
    """Why the command line's speculation cannot run inside continuous batching (batch jobs, --serve), checked before
    the model loads: it needs a fixed --num-draft K and no --tree (`BatchSpec.from_decoder` refuses the same)."""
    if getattr(args, "draft", None) is not None and (
            getattr(args, "tree", None) is not None or str(getattr(args, "num_draft", 4)).strip().lower() == "auto"):
        return "continuous batching (batch jobs, --serve) speculates with a fixed --num-draft K and no --tree"
    return None


@struct.dataclass
class SpecRows:
    dstate: object  # the drafter's state, batch-major leaves [B, ...] (None for a drafter without state)
    prev: jax.Array  # [B] token at position lengths - 1
    on: jax.Array  # [B] bool: this slot speculates
    drafted: jax.Array  # [B] int32 drafts proposed to this slot's request
    accepted: jax.Array  # [B] int32 drafts accepted
    hist: jax.Array  # [K + 1] int32 speculating slot-steps by accepted drafts (the whole run)


def break_even_acceptance(per_draft_cost: float) -> float:
    """The acceptance rate (accepted / drafted, as a slot has realised it) at which its speculative steps pay: a step
    costs 1 + K * per_draft_cost plain steps and yields 1 + accepted tokens, so it pays when accepted / K >= the cost,
    whatever K. (The geometric model of adaptive K, expected_tokens(a, K), predicts from an assumed per-position rate
    and undercounts a trained head's bursty acceptance: on the GPU (2026-12-05) it stopped an 8-slot eagle job that
    ran x1.23 when always on, at 0.30 accepted per draft, and made it x0.79.) >= 1: never pays."""
    return per_draft_cost if per_draft_cost < 1.0 else 1.01


class BatchSpec:
    """Speculation settings for `Scheduler(spec=...)`: a drafter, K, and the policy above."""

    def __init__(self, drafter, k: int, max_slots: int | None = None, min_accept: float | None = None,
                 warmup: int | None = None, verify_cost: float | None = None):
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 64:
            raise ValueError(f"speculation in batch jobs needs a fixed K in 1..64, got {k!r}")
        self.drafter, self.k = drafter, k
        self.max_slots = DEFAULT_MAX_SLOTS if max_slots is None else max_slots
        if verify_cost is None:
            verify_cost = 0.35 if jax.default_backend() == "cpu" else 0.03
        self.min_accept = (break_even_acceptance(drafter.cost_ratio + verify_cost) if min_accept is None
                           else float(min_accept))
        self.warmup = 4 * k if warmup is None else int(warmup)

    @classmethod
    def from_decoder(cls, dec, **kw) -> "BatchSpec":
        """From an `LLM.spec` (`SpeculativeDecoder`): its drafter and fixed K (trees and adaptive K: not here)."""
        from .errors import InvalidSamplingParamsError

        if dec.adaptive or dec.tree_width:
            raise InvalidSamplingParamsError("speculation in continuous batching needs a fixed --num-draft K and "
                                             "no --tree")
        return cls(dec.drafter, dec.ks[0], verify_cost=dec.verify_cost, **kw)

    def describe(self) -> str:
        return (f"{self.drafter.name}, K={self.k}, up to {self.max_slots} slots, a slot stops below "
                f"{self.min_accept:.2f} accepted per draft after {self.warmup} drafts")

    # ------------------------------------------------------------------------------------------ per-slot state
    def init_dstate(self, prompts, cache_len: int, first, hidden=None):
        d = self.drafter
        if d.hidden_layers:  # a draft head starts from the first generated token (and the prefill's features)
            return d.init_state(prompts, cache_len, first=first, hidden=hidden)
        return d.init_state(prompts, cache_len)

    def empty_rows(self, slots: int, cache_len: int) -> SpecRows:
        """State for `slots` empty slots: the drafter's state of a one-token prompt, widened to every slot."""
        one = self.init_dstate([[0]], cache_len, jnp.zeros((1,), jnp.int32))
        dstate = jax.tree.map(lambda a: jnp.zeros((slots,) + a.shape[1:], a.dtype), one)
        z = jnp.zeros((slots,), jnp.int32)
        return SpecRows(dstate=dstate, prev=z, on=jnp.zeros((slots,), bool), drafted=jnp.zeros_like(z),
                        accepted=jnp.zeros_like(z), hist=jnp.zeros((self.k + 1,), jnp.int32))

    def stats(self, rows: SpecRows | None) -> dict:
        hist = np.asarray(rows.hist).astype(int) if rows is not None else np.zeros(self.k + 1, int)
        n = int(hist.sum())
        mean = float(np.dot(np.arange(len(hist)), hist) / n) if n else 0.0
        return {"drafter": self.drafter.name, "num_draft": self.k, "row_steps": n, "mean_accepted": mean,
                "tokens_per_step": mean + 1.0 if n else 0.0, "acceptance_histogram": hist.tolist(),
                "max_slots": self.max_slots, "min_accept": self.min_accept}


@functools.partial(jax.jit, donate_argnames=("rows",))
def insert_spec_rows(rows: SpecRows, dstate, slots, prev, on):
    """Write rows p = 0..P-1 of a prefilled drafter state (leaves [P, ...]) into slots[p]; counts start at 0. One
    scatter a leaf, no loop over the rows (as scheduler.insert_rows; a padded group's repeated rows are equal)."""
    def put(big, small):
        return big.at[slots].set(small.astype(big.dtype))

    return rows.replace(dstate=jax.tree.map(put, rows.dstate, dstate), prev=put(rows.prev, prev),
                        on=put(rows.on, on), drafted=rows.drafted.at[slots].set(0),
                        accepted=rows.accepted.at[slots].set(0))


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "drafter", "n_steps", "k"),
                   donate_argnames=("state",))
def spec_decode_chunk(cfg, kernels, drafter, weights, dparams, state, retire, exit_after, min_accept, warmup,
                      n_steps: int, k: int):
    """Up to n_steps draft + verify steps of every slot (`scheduler.decode_chunk`'s contract: `retire` marks slots
    done first; leaves early when all are done, when `exit_after` finished, or when no live slot speculates any more).
    -> (state, tokens [B, n_steps * (K + 1)])."""
    b = state.tokens.shape[0]
    state = state.replace(done=state.done | retire)
    done0, count0 = state.done, state.count
    width = n_steps * (k + 1)
    buf = jnp.full((b, width), -1, jnp.int32)
    rows = jnp.arange(b)[:, None]
    j = jnp.arange(k + 1, dtype=jnp.int32)[None, :]

    def cond(c):
        i, st, _ = c
        newly = jnp.sum((st.done & ~done0).astype(jnp.int32))
        speculating = (i == 0) | jnp.any(st.spec.on & ~st.done)  # else back to the host, which decodes plainly
        return (i < n_steps) & ~jnp.all(st.done) & (newly < exit_after) & speculating

    def body(c):
        i, st, buf = c
        sp = st.spec
        start = st.cache.lengths
        live = ~st.done
        if drafter.shares_target_cache:  # drafts into the target's cache; the verify rewrites that window
            drafts, q, cache = drafter.propose(dparams, st.cache, sp.prev, st.tokens, start, st.rp, k)
            dstate = sp.dstate
        else:
            drafts, q, dstate = drafter.propose(dparams, sp.dstate, sp.prev, st.tokens, start, st.rp, k)
            cache = st.cache
        window = jnp.concatenate([st.tokens[:, None], drafts], axis=1)
        hidden = None
        if drafter.hidden_layers:
            logits, cache, hidden = forward(cfg, kernels, weights, cache, window, start,
                                            hidden_layers=drafter.hidden_layers, verify=True)
        else:
            logits, cache = forward(cfg, kernels, weights, cache, window, start, verify=True)
        # a greedy slot that stopped speculating still takes its accepted drafts while another slot keeps the call
        # speculative: the verify is paid for every row anyway, and greedy tokens are the same either way (a sampled
        # slot's draws would depend on whether its neighbours speculate: it keeps to its own flag)
        on = live & (sp.on | ((st.rp.temperature <= 0) & jnp.any(sp.on & live)))
        n, nxt = accept_tokens(logits, drafts, q, st.rp, start + 1, st.seen)
        plain = sample(logits[:, 0], st.rp, start + 1, st.seen)  # exactly the plain decode step's draw
        n, nxt = jnp.where(on, n, 0), jnp.where(on, nxt, plain)
        vo, cache = _verify_out(logits, drafts, n, nxt, hidden, cache, start, live, 0)
        toks = vo.tokens
        stop = jnp.any(toks[..., None] == st.stop_ids[:, None, :], axis=-1) & (j <= n[:, None])
        first_stop = jnp.where(jnp.any(stop, axis=1), jnp.argmax(stop, axis=1), k + 1)
        keep = (live[:, None] & (j <= n[:, None]) & (j <= first_stop[:, None])
                & (j < (st.row_max - st.count)[:, None]))
        buf = buf.at[rows, jnp.where(keep, st.count[:, None] - count0[:, None] + j, width)].set(toks, mode="drop")
        count = st.count + jnp.sum(keep, axis=1).astype(jnp.int32)
        done = st.done | jnp.any(stop & keep, axis=1) | (count >= st.row_max)
        seen = st.seen.at[rows, jnp.where(keep, toks, st.seen.shape[1])].set(True, mode="drop")
        prev = jnp.where(n > 0, jnp.take_along_axis(drafts, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0],
                         st.tokens)
        dstate = drafter.commit(dstate, st.tokens, drafts, n, start)
        if drafter.hidden_layers:  # a draft head catches up on the target's features of this verify
            dstate = drafter.absorb(dparams, dstate, vo.hidden, vo.tokens, n, start)
        # (a slot's own rate counts its own speculation: one switched off stays off until its request ends)
        drafted = sp.drafted + jnp.where(sp.on & live, k, 0)
        accepted = sp.accepted + jnp.where(sp.on & live, n, 0)
        still = sp.on & ~((drafted >= warmup) & (accepted.astype(jnp.float32) < min_accept * drafted))
        hist = sp.hist + jnp.sum(jax.nn.one_hot(n, k + 1, dtype=jnp.int32) * on[:, None], axis=0)
        spec = SpecRows(dstate=dstate, prev=jnp.where(live, prev, sp.prev), on=still, drafted=drafted,
                        accepted=accepted, hist=hist)
        st = st.replace(cache=cache, tokens=jnp.where(live, vo.next_token, st.tokens), seen=seen, done=done,
                        count=count, spec=spec)
        return i + 1, st, buf

    _, state, buf = jax.lax.while_loop(cond, body, (jnp.int32(0), state, buf))
    return state, buf


__all__ = ["BatchSpec", "SpecRows", "spec_decode_chunk", "insert_spec_rows", "break_even_acceptance",
           "DEFAULT_MAX_SLOTS"]
