"""Registers the Pallas GPU kernels of `pallas_kernels/` under the name `pallas`.

On the CPU they run in Pallas interpret mode (slow; for tests); the CPU default stays `xla`.  `default_on=("gpu",)`
is set only for ops where the H200 measurement (benchmarks/RESULTS.md, "Kernels (issue 3)") shows the Pallas kernel
beating XLA.  Shapes a kernel does not handle (non-power-of-two head dim or group size) fall back to the XLA
implementation, and so do sliding-window layers whose window is shorter than the cache (the attention kernels have
no window; a window at least as long as the cache masks nothing).  A failing Pallas import logs a warning and
registers nothing.
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp

from . import kernels_xla, ops, quant
from .qkv_prologue import full_tables

log = logging.getLogger(__name__)

# which ops make `pallas` the GPU default (from the H200 measurement)
_GPU_DEFAULT = {"qmatmul": True, "qmatmul8": True, "attention_decode": True, "attention_prefill": True,
                "attention_tree": True,  # (H200, 2026-12-04: an 8B tree of 32 verifies in 1.97x a step, xla 2.24x)
                "kv_move": True}  # one launch for a tree's path in every layer, against 2 kernels a layer (not timed)
# qmatmul rows above this go to XLA's dequantize + dot on the GPU (H200: Pallas 1.1-2.3x faster at M <= 64,
# XLA 1.6-2x faster at M = 512)
_PALLAS_MAX_M = 64

try:
    from pallas_kernels.attention_decode import attention_decode_pallas
    from pallas_kernels.attention_prefill import attention_prefill_pallas
    from pallas_kernels.attention_tree import ancestor_words, attention_tree
    from pallas_kernels.int4_matmul import qmatmul_pallas
    from pallas_kernels.int8_matmul import qmatmul8_pallas
    from pallas_kernels.kv_move import kv_move
except Exception as e:  # noqa: BLE001 - any import failure must not break the package
    log.warning("Pallas kernels unavailable (%s: %s); only the xla kernels are registered", type(e).__name__, e)
else:

    def _interpret() -> bool:
        return jax.default_backend() == "cpu"

    def _pow2(v: int) -> bool:
        return v > 0 and v & (v - 1) == 0

    def _on(op: str) -> tuple[str, ...]:
        return ("gpu",) if _GPU_DEFAULT[op] else ()

    def _invariant() -> bool:
        return quant.ROW_INVARIANT  # read at trace time (tests patch it)

    def _to_xla(m: int) -> bool:
        """Many rows go to XLA's dequantize + dot, except in row-invariant mode (one kernel for every M)."""
        return m > _PALLAS_MAX_M and not _interpret() and not _invariant()

    # parts=True: the product as a tuple of partial sums (`quant.linear_parts`; split-K's as the kernel wrote them)
    # x_pending: x left unfinished (x None; `lucebox_jax.pending_inputs`: attention splits, gate+up's partial sums),
    # finished by the kernel as it loads x
    @ops.register("qmatmul", "pallas", default_on=_on("qmatmul"))
    def qmatmul_pallas_op(x, w, parts=False, x_pending=None):
        m, k = x.shape if x_pending is None else x_pending.shape
        if not _pow2(w.group_size) or (k // 2) % w.group_size or _to_xla(m):
            y = kernels_xla.qmatmul_xla(x if x_pending is None else x_pending.merged(), w)
            return (y[None],) if parts else y
        return qmatmul_pallas(x, w, interpret=_interpret(), row_invariant=_invariant(), parts=parts,
                              x_pending=x_pending)

    @ops.register("qmatmul8", "pallas", default_on=_on("qmatmul8"))
    def qmatmul8_pallas_op(x, w, parts=False):
        k = x.shape[-1]
        if w.group_size < 16 or k % w.group_size or _to_xla(x.shape[0]):
            y = kernels_xla.qmatmul8_xla(x, w)
            return (y[None],) if parts else y
        return qmatmul8_pallas(x, w, interpret=_interpret(), row_invariant=_invariant(), parts=parts)

    # LUCEBOX_ATTN_SLIDING=0 (read at import; an A/B knob): sliding-window layers attend in XLA, as before the decode
    # and prefill kernels took windows
    SLIDING = os.environ.get("LUCEBOX_ATTN_SLIDING", "1") != "0"

    def _windowed(k, window) -> bool:
        return window is not None and window < k.shape[2]

    @ops.register("attention_decode", "pallas", default_on=_on("attention_decode"))
    def attention_decode_pallas_op(q, k, v, lengths, rows=None, *, scale, window=None, append=False,
                                   window_rows=0, window_anc=None, out_rows=0, prologue=None, split_out=False):
        # split_out: a decode step's splits may come back unmerged (`AttentionSplits`), for an `o` matmul that takes
        # `x_pending`; the XLA fallbacks below return the output
        # a sliding window (Gemma's local layers) runs in the kernel for decode rows and a chain's window, not a
        # tree's nodes (their positions are their depths, not their slots: those go to XLA)
        sliding = window if SLIDING and _windowed(k, window) and window_anc is None and window_rows <= window else 0
        if prologue is not None:  # q: the qkv matmul's partial sums (a tuple), the rest done in the kernel
            d = q[0].shape[-1]
            if _pow2(d) and not (_windowed(k, window) and not sliding):
                cos, sin = full_tables(prologue.cos, prologue.sin, prologue.interleaved)
                args = dict(parts=q[1:], row_sumsq=prologue.row_sumsq, cos=cos, sin=sin, q_norm=prologue.q_norm,
                            k_norm=prologue.k_norm)
                return attention_decode_pallas(q[0], k, v, lengths, append=True, sliding=sliding, scale=scale,
                                               interpret=_interpret(), prologue=args, prologue_eps=prologue.eps,
                                               prologue_dim=prologue.width, rope_interleaved=prologue.interleaved,
                                               split_out=split_out)
            q = prologue.apply(q)  # in jnp, then as any decode step
        if not _pow2(q.shape[-1]) or (_windowed(k, window) and not sliding):
            if window_anc is not None:  # a tree's nodes as decode rows: XLA's tree attention, the window written first
                o, k, v = kernels_xla.tree_rows_xla(q, k, v, lengths, window_anc, window_rows, scale=scale)
                return kernels_xla.pad_rows(o, out_rows), k, v
            if append:  # write first, as the model does for a kernel without `append`
                hkv, t = k.shape[1], max(window_rows, 1)  # (window_rows: B windows of t rows, rows b * t + j)
                q, k_new, v_new = q[:, :-2 * hkv], q[:, -2 * hkv:-hkv], q[:, -hkv:]
                k, v = (kernels_xla.write_kv(c, n.reshape(-1, t, *n.shape[1:]), lengths[::t] - 1)
                        for c, n in ((k, k_new), (v, v_new)))
            o = kernels_xla.attention_decode_xla(q, k, v, lengths, rows, scale=scale, window=window)
            o = kernels_xla.pad_rows(o, out_rows)
            return (o, k, v) if append else o
        win_mask = None
        if window_anc is not None:  # [B * T, T] -> the kernel's bits, the same for every query head of a row
            words = ancestor_words(window_anc)
            win_mask = jnp.broadcast_to(words[:, None], (words.shape[0], q.shape[1] - 2 * k.shape[1],
                                                          words.shape[1]))
        return attention_decode_pallas(q, k, v, lengths, rows, win_mask, append=append, window_rows=window_rows,
                                       out_rows=out_rows, sliding=sliding, scale=scale, interpret=_interpret(),
                                       row_invariant=_invariant(), split_out=split_out and rows is None)

    @ops.register("attention_prefill", "pallas", default_on=_on("attention_prefill"))
    def attention_prefill_pallas_op(q, k, v, start, *, scale, window=None):
        sliding = window if SLIDING and _windowed(k, window) else 0
        if not _pow2(q.shape[-1]) or (_windowed(k, window) and not sliding):
            return kernels_xla.attention_prefill_xla(q, k, v, start, scale=scale, window=window)
        return attention_prefill_pallas(q, k, v, start, scale=scale, interpret=_interpret(),
                                        row_invariant=_invariant(), sliding=sliding)

    @ops.register("kv_move", "pallas", default_on=_on("kv_move"))
    def kv_move_pallas_op(caches, src, dst):
        return kv_move(tuple(caches), src, dst, interpret=_interpret())

    @ops.register("attention_tree", "pallas", default_on=_on("attention_tree"))
    def attention_tree_pallas_op(q, k, v, n_visible, k_win, v_win, anc, *, scale, positions=None, window=None,
                                 in_cache=False):
        if not _pow2(q.shape[-1]) or _windowed(k, window):
            return kernels_xla.attention_tree_xla(q, k, v, n_visible, k_win, v_win, anc, scale=scale,
                                                  positions=positions, window=window)
        return attention_tree(q, k, v, n_visible, k_win, v_win, anc, scale=float(scale), interpret=_interpret(),
                              in_cache=in_cache)
