"""Flash-decoding over the static KV cache (Pallas-Triton).

    out[b, h] = softmax(scale * q[b, h] . k[b, h // G, :L_b]) @ v[b, h // G, :L_b],   L_b = lengths[b]

Grid (B, Hkv, n_split).  A program takes all G = Hq / Hkv query heads of one kv head as one [block_h, D] tile
(block_h = the next power of two >= G, at least 16 because the tensor-core dot needs 16 rows; the padding rows are
masked loads of q, never read from or written to memory), and one contiguous chunk of the sequence.  It streams its
chunk of K and V once, in [block_k, D] tiles, with an online softmax in float32 (exp2 with log2(e) folded into the
scale), and stops at the row's length: kv tiles past `lengths[b]` are never read.  With n_split > 1 each program
writes an unnormalised partial (acc, running max, running sum) and a small jnp combine merges the splits; with
n_split == 1 the kernel normalises and writes the output itself.

`rows` [B] (optional) maps query row b to cache row rows[b], so several query rows can read one cache row: a
speculative verify of T positions runs as B * T decode rows.

`append=True` (a plain decode step): q is [B, Hq + 2 Hkv, D], the step's queries, then its own keys and values, one
array as XLA's rope fusion writes it. The kernel appends that key and value to the cache itself: the program whose
chunk holds slot lengths[b] - 1 writes them there (the cache buffers are aliased in and out) and every tile that
holds the slot reads the new key in place of the stale one, so the result is bitwise that of writing the cache first
and then attending, without the writes' two kernels a layer and with one input fusion instead of three.

`append=True` with `rows` and `window_rows=T` (a short speculative verify as B * T decode rows): query row r is
position t = r % T of a window of T new positions of cache row rows[r], whose keys and values are q's rows r - t ..
r - t + T - 1 (the window's own rows). Each program reads the cache only before the window's first slot, attends to
the window's keys 0..t from q (in the row's last split, the window read as one block), and its row's key and value
are written at slot lengths[r] - 1 (the window placed as a dynamic-update-slice places T rows). No read can meet a
write (writes are at or past the window's start, reads before it), so the verify's two cache writes a layer go as for
a decode step; the softmax runs in another order than attending to a cache written first (not bitwise; the
row-invariant mode keeps the write-first path).

The same with `win_mask` (a token tree's verify, at most 64 nodes, as B * T decode rows): row r is node t of its
row's window and attends, besides the cache before the window, to the window keys whose bit is set in its mask (its
ancestors and itself) instead of keys 0..t. The tree's keys are written where a chain's would be (slot start + t for
node t; the accepted path is moved into place afterwards), so a tree verify also loses its two cache writes a layer
and, as decode rows, the transposes of the tiled tree kernel (`attention_tree.py`, for longer trees and contexts).

`prologue=` (a decode step with append): q is the qkv matmul's split-K partial sums as written, and each program
makes its rows of q, k, v itself (the sum, the deferred attention norm, the q/k head norms, RoPE; the wrapper's
docstring), so XLA's fusion between the two kernels goes (`lucebox_jax/qkv_prologue.py`).

`row_invariant=True` fixes n_split by the cache shape alone (as for one row) and merges the splits in order, so a
row's output does not depend on how many rows share the call (lucebox_jax.quant.ROW_INVARIANT).
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lucebox_jax.pending_inputs import AttentionSplits

from .attention_window import bits_visible, merge_visible, packed_tiles, position_blocks, window_kernel
from .int4_matmul import ordered_sum

__all__ = ["attention_decode", "attention_decode_reference", "attention_decode_pallas"]

_LOG2E = 1.4426950408889634
_NEG = -1e30


def _next_pow2(v: int) -> int:
    return 1 << max(0, int(v) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _prologue(q_ref, pro_refs, b, h, hq, hkv, g, bh, rmask, d, *, pro, dt):
    """`prologue` (the wrapper's docstring): this program's q heads [bh, D], its kv head's new key and value [1, D],
    from the qkv partials. RoPE as x * C + x[partner] * S with full-width tables (C = cos, S = -sin on a pair's
    first column and sin on its second): the partner columns come from a second, gathered load of the same rows."""
    n_parts, has_r, has_norm, eps, inter, width = pro
    f32 = jnp.float32
    it = iter(pro_refs)
    part_refs = [q_ref] + [next(it) for _ in n_parts[1:]]
    r_ref = next(it) if has_r else None
    cos_ref, sin_ref = next(it), next(it)
    qn_ref, kn_ref = (next(it), next(it)) if has_norm else (None, None)
    col = jnp.arange(d)
    partner = (col ^ 1) if inter else jnp.where(col < d // 2, col + d // 2, col - d // 2)

    def summed(h0, n, mask, cols):  # the product's rows as the model's linear returns them (cast, then row-scaled)
        at = (pl.ds(h0, n), slice(None)) if cols is None else (h0 + jnp.arange(n)[:, None], cols[None, :])
        acc, masked = None, {} if mask is None else dict(mask=mask, other=0)
        for ref, count in zip(part_refs, n_parts):
            for p in range(count):
                x = plgpu.load(ref.at[(jnp.int32(p), b) + at], **masked).astype(f32)
                acc = x if acc is None else acc + x
        y = acc.astype(dt)
        if has_r:  # the attention norm's scale, rsqrt(mean(x^2) + eps), from the row's sum of squares
            r = lax.rsqrt(plgpu.load(r_ref.at[pl.ds(b, 1)]) / width + eps)
            y = (y.astype(f32) * r[:, None]).astype(dt)
        return y.astype(f32)

    def roped(h0, n, mask, n_ref):
        x, xp = summed(h0, n, mask, None), summed(h0, n, mask, partner)
        if has_norm:  # (x * rsqrt(mean(x^2) + eps)) * w, float32, cast; the partner columns by the same row scale
            inv = lax.rsqrt(jnp.sum(x * x, axis=1) / d + eps)[:, None]
            x = (x * inv * plgpu.load(n_ref)[None, :]).astype(dt).astype(f32)
            xp = (xp * inv * plgpu.load(n_ref.at[partner])[None, :]).astype(dt).astype(f32)
        cs, sn = plgpu.load(cos_ref.at[pl.ds(b, 1), :]), plgpu.load(sin_ref.at[pl.ds(b, 1), :])  # [1, D]
        return (x * cs + xp * sn).astype(dt)

    q = roped(h * g, bh, rmask[:, None], qn_ref)
    k_new = roped(hq + h, 1, None, kn_ref)
    v_new = summed(hq + hkv + h, 1, None, None).astype(dt)
    return q, k_new, v_new


def _kernel(len_ref, *refs, g, bh, bk, chunk, seq, qk_scale, n_split, partials, nw, has_rows, append, win_rows,
            sliding=0, pro=None):
    row_ref, refs = (refs[0], refs[1:]) if has_rows else (None, refs)
    q_ref, k_ref, v_ref, *refs = refs
    if pro:  # the qkv partials' other arrays, the row scale, the RoPE tables and the head norms
        n_pro = len(pro[0]) - 1 + pro[1] + 2 + 2 * pro[2]
        pro_refs, refs = refs[:n_pro], refs[n_pro:]
    if append:  # q_ref [B, Hq + 2 Hkv, D]; the aliased caches are the last two outputs
        *refs, ko_ref, vo_ref = refs
    win_ref, out_refs = (refs[0], refs[1:]) if nw else (None, refs)
    cache_nw = 0 if win_rows else nw  # window bits over cache slots (a tree's window read from the cache)
    b, h, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kb = row_ref[b] if has_rows else b  # the cache row this query row reads
    length = jnp.minimum(len_ref[b], seq)
    start = sp * chunk
    lo = 0  # the first key the row sees (a sliding window: the row's position + 1 - sliding)
    if win_rows:  # this row is position t of its window: the cache is read before the window only
        t = b % win_rows
        wstart = jnp.clip(len_ref[b] - 1 - t, 0, seq - win_rows)  # (clamped as dynamic_update_slice clamps)
        lo = jnp.maximum(wstart + t + 1 - sliding, 0) if sliding else 0
        length = jnp.minimum(length, wstart)
    elif sliding:
        lo = jnp.maximum(length - sliding, 0)
    end = jnp.minimum(start + chunk, jnp.minimum(length + 32 * nw, seq) if cache_nw else length)
    if sliding:  # tiles wholly before the window are never read; a chunk with no key in it reads none
        end = jnp.where(lo < end, end, start)
        start = jnp.maximum(start, lo // bk * bk)
    n_blocks = jnp.maximum(end - start + bk - 1, 0) // bk
    rows = jnp.arange(bh)
    rmask = rows < g
    d = q_ref.shape[-1]
    if append:
        hq, hkv = k_ref.shape[1] * g, k_ref.shape[1]
    if pro:
        q, k_new, v_new = _prologue(q_ref, pro_refs, b, h, hq, hkv, g, bh, rmask, d, pro=pro, dt=k_ref.dtype)
    elif append:
        q = plgpu.load(q_ref.at[b, pl.ds(h * g, bh), :], mask=rmask[:, None], other=0)
    else:
        q = plgpu.load(q_ref.at[b, h, pl.ds(0, bh), :], mask=rmask[:, None], other=0)
    q = (q.astype(jnp.float32) * qk_scale).astype(k_ref.dtype)
    # a window of 32 * nw slots after `length`, visible per query row by its bits (a token tree's ancestors)
    words = [plgpu.load(win_ref.at[b, h, pl.ds(0, bh), pl.ds(w, 1)], mask=rmask[:, None], other=0)
             for w in range(nw)]  # [bh, 1] each
    if append:  # placed as lax.dynamic_update_slice places it: a negative start counts from the end, then clamps
        slot = len_ref[b] - 1
        slot = wstart + t if win_rows else jnp.clip(jnp.where(slot < 0, slot + seq, slot), 0, seq - 1)
        if not pro:
            k_new = plgpu.load(q_ref.at[b, pl.ds(hq + h, 1), :]).astype(k_ref.dtype)  # [1, D]
            v_new = plgpu.load(q_ref.at[b, pl.ds(hq + hkv + h, 1), :]).astype(v_ref.dtype)

    def body(i, carry):
        acc, m_i, l_i = carry
        k0 = pl.multiple_of(start + i * bk, bk)
        kpos = k0 + jnp.arange(bk)
        kmask = (kpos < end) & (kpos >= lo) if sliding else kpos < end
        k = plgpu.load(k_ref.at[kb, h, pl.ds(k0, bk), :], mask=kmask[:, None], other=0)
        if append and not win_rows:
            k = jnp.where((kpos == slot)[:, None], k_new, k)
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32)  # [bh, bk], log2 units
        if cache_nw:
            rel = jnp.clip(kpos - length, 0, 32 * nw - 1)[None, :]  # the slot's bit in the window
            word = words[0] if nw == 1 else jnp.where(rel < 32, words[0], words[1])
            seen = (kpos < length)[None, :] | (((word >> (rel % 32)) & 1) == 1)  # (rel is 0 before the window)
            vis = seen & kmask[None, :]
        else:
            vis = kmask[None, :]
        s = jnp.where(vis, s, _NEG)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(s - m_new[:, None])
        if cache_nw:  # a row may see none of a block's keys (its m still -1e30, so exp2(0) = 1 there)
            p = jnp.where(vis, p, 0.0)
        l_new = l_i * alpha + jnp.sum(p, axis=1)
        v = plgpu.load(v_ref.at[kb, h, pl.ds(k0, bk), :], mask=kmask[:, None], other=0)
        if append and not win_rows:
            v = jnp.where((kpos == slot)[:, None], v_new, v)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return acc, m_new, l_new

    init = (jnp.zeros((bh, d), jnp.float32), jnp.full((bh,), _NEG, jnp.float32), jnp.zeros((bh,), jnp.float32))
    acc, m_i, l_i = lax.fori_loop(0, n_blocks, body, init)
    if win_rows:  # the window's keys and values (q's rows b - t .. b - t + T - 1) as one block, in the last split
        tw = max(16, _next_pow2(win_rows))  # (the tensor-core dot's 16 columns at least)
        j = jnp.arange(tw)
        jmask = j < win_rows
        kw = plgpu.load(q_ref.at[pl.ds(b - t, tw), hq + h, :], mask=jmask[:, None], other=0).astype(k_ref.dtype)
        vw = plgpu.load(q_ref.at[pl.ds(b - t, tw), hq + hkv + h, :], mask=jmask[:, None], other=0)
        s = jnp.dot(q, kw.T, preferred_element_type=jnp.float32)  # [bh, tw]
        # a tree: key j where the row's bit j is set; a chain: keys 0..t
        vis = bits_visible(words, j, jmask) if nw else (j <= t)[None, :] & jmask[None, :]
        acc, m_i, l_i = merge_visible(acc, m_i, l_i, s, vis & (sp == n_split - 1), vw.astype(v_ref.dtype))
    if append:
        @pl.when(sp == (n_split - 1 if win_rows else slot // chunk))
        def _():
            plgpu.store(ko_ref.at[kb, h, pl.ds(slot, 1), :], k_new)
            plgpu.store(vo_ref.at[kb, h, pl.ds(slot, 1), :], v_new)

    if n_split == 1 and not partials:
        (o_ref,) = out_refs
        out = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
        plgpu.store(o_ref.at[b, h, pl.ds(0, bh), :], out.astype(o_ref.dtype), mask=rmask[:, None])
    else:
        o_ref, m_ref, l_ref = out_refs
        plgpu.store(o_ref.at[b, h, sp, pl.ds(0, bh), :], acc, mask=rmask[:, None])
        plgpu.store(m_ref.at[b, h, sp, pl.ds(0, bh)], m_i, mask=rmask)
        plgpu.store(l_ref.at[b, h, sp, pl.ds(0, bh)], l_i, mask=rmask)


def _combine_kernel(o_ref, m_ref, l_ref, out_ref, *, n_split, nsp, bsz):
    """One program per (row, kv head, query head of the group): its n_split partials in one [nsp, D] load (a loop
    over the splits waits on one load after another), merged by their maxima. Rows from bsz on (`out_rows`) are
    zeros."""
    row, h, gi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    b = jnp.minimum(row, bsz - 1)
    smask = jnp.arange(nsp) < n_split
    m = plgpu.load(m_ref.at[b, h, pl.ds(0, nsp), gi], mask=smask, other=_NEG)  # [nsp]
    l = plgpu.load(l_ref.at[b, h, pl.ds(0, nsp), gi], mask=smask, other=0)
    o = plgpu.load(o_ref.at[b, h, pl.ds(0, nsp), gi, :], mask=smask[:, None], other=0)  # [nsp, D]
    w = jnp.exp2(m - jnp.max(m))
    l_tot = jnp.sum(w * l)
    out = jnp.sum(w[:, None] * o, axis=0) / jnp.where(l_tot > 0, l_tot, 1.0)
    plgpu.store(out_ref.at[row, h, gi, :], jnp.where(row < bsz, out, 0.0).astype(out_ref.dtype))


FEW_ROW_HEADS = 32  # below this many (query row, kv head) pairs a call gets one 32-key tile a program ...
FEW_ROW_MAX_SEQ = 2048  # ... in caches up to this long (64 splits; longer ones were not measured so)
WIDE_HEAD_32_MAX_SEQ = 4096  # more pairs, D >= 128: 32-key tiles up to this cache length (64 beyond, and at D < 128)


# a verify's window in one program a kv head (`pack`): by default at head dims >= 128, where it was measured (the 8B
# verify of 9 rows, H100: 2.89 / 2.92 -> 2.81 / 2.81 ms); LUCEBOX_ATTN_PACK=1 at every head dim, =0 at none
PACK_WINDOWS = os.environ.get("LUCEBOX_ATTN_PACK", "")
PACK_MIN_HEAD_DIM = 128
PACKED_MIN_PROGRAMS = 64  # splits for packed windows: (windows x kv heads x splits) >= this many programs
# Calls whose rows map onto cache rows (a verify's window, a tree's nodes) at head dims up to 64 (the embedded
# model's) in caches up to 256 slots take one split: no merge kernel (30 a verify; tree step 495 -> 464 kernels,
# AOT), and on an H100 (2026-12-07; chat prompts and 96 new tokens: 256-slot caches) the chain and tree steps cost
# 2-4% fewer plain steps, 2-10% fewer ms (benchmarks/RESULTS.md). Longer caches (one program would read a long
# prefix alone) and head dim 128 (the 8B verify) were not measured so and keep the grid's splits.
# LUCEBOX_ATTN_ROW_SPLITS=N sets N for every such call, =0 restores the grid's splits (decode steps never change).
ROW_SPLITS = os.environ.get("LUCEBOX_ATTN_ROW_SPLITS", "")
ROW_SPLITS_MAX_HEAD_DIM = 64
ROW_SPLITS_MAX_SEQ = 256
# split_out hands at most this many splits (64 for one row) of at most this many rows to the `o` matmul unmerged: its
# programs load [16 rows, splits, block_k] of them (one row: [1, ...]), which compile for an H200 up to 16 splits
# (AOT; the matmul's software pipeline off, `qmatmul_pallas`)
SPLIT_OUT_MAX = 16
SPLIT_OUT_MAX_ONE_ROW = 64
SPLIT_OUT_MAX_ROWS = 16


def row_splits(d: int, s: int) -> int:
    """Splits for a call whose rows map onto cache rows, head dim d, cache length s (0: chosen by the grid)."""
    if ROW_SPLITS.strip():
        return int(ROW_SPLITS)
    return 1 if d <= ROW_SPLITS_MAX_HEAD_DIM and s <= ROW_SPLITS_MAX_SEQ else 0


def default_config(b: int, hkv: int, s: int, d: int, row_invariant: bool = False, mapped_rows: bool = False,
                   packed: bool = False) -> dict:
    """From the H200 measurement (B=8, Hkv=8, D=128): 64-key tiles / 4 warps up to 4k, 128 / 8 warps from 16k
    (32-key tiles since, below).
    Few rows (b * hkv < FEW_ROW_HEADS: a batch-1 step), cache up to 2k: one 32-key tile a program, as many programs
    as the cache has tiles, the programs' latency chains side by side instead of a loop of 2 tiles; without Triton's
    software pipeline (num_stages 1) at D >= 128. On the H100 (2026-12-06, context 1,024) the 8B shapes' attention
    went 256 -> 154 us a step (2.66 -> 2.58 ms) and the embedded shapes' (D = 64, 3 stages) 118 -> 89 us. The
    row-invariant mode decides by the cache alone (as for one row), so a row rounds the same in any batch.
    More pairs at D >= 128 (the 8B shapes' batch 8) take 32-key tiles up to a 4k cache, the splits unchanged (each
    program's chunk in 4 tiles, not 2): H100, 2026-12-06, batch 8 at 1k the step went 3.19 -> 3.00 ms, the kernel
    alone 18.7 -> 16.9 us at 1k and 52.0 -> 50.3 us at 4k (benchmarks/RESULTS.md); D = 64 was not measured so.
    Rows mapped onto cache rows (`mapped_rows`: a speculative verify's window) keep 64-key tiles: the 8B verify of 9
    rows measured 3.14 ms with 32-key tiles against 3.06 with 64 (same call).
    The splits are merged by a second Pallas kernel (`combine="kernel"`): on the H200 the 8B batch-1 step ran 400
    tok/s with it against 394 with XLA's 2-4 fusions a call (2026-12-05); LUCEBOX_ATTN_COMBINE=xla restores those."""
    combine = os.environ.get("LUCEBOX_ATTN_COMBINE", "kernel")
    if packed:  # a window's positions x query heads, 16-128 rows a tile: 64-key tiles, splits for one wave or so
        cfg = dict(block_k=64, n_split=None, min_programs=PACKED_MIN_PROGRAMS, num_warps=4, num_stages=3,
                   combine=combine)
    elif s >= 16384:
        cfg = dict(block_k=128, n_split=None, num_warps=8, num_stages=3, combine=combine)
    elif (1 if row_invariant else b) * hkv < FEW_ROW_HEADS and s <= FEW_ROW_MAX_SEQ:
        cfg = dict(block_k=32, n_split=_cdiv(s, 32), num_warps=4, num_stages=1 if d >= 128 else 3, combine=combine)
    else:
        narrow = d >= 128 and s <= WIDE_HEAD_32_MAX_SEQ and not mapped_rows
        cfg = dict(block_k=32 if narrow else 64, n_split=None, num_warps=4, num_stages=3, combine=combine)
    if mapped_rows and row_splits(d, s) > 0:
        cfg["n_split"] = row_splits(d, s)
    return {**cfg, **env_overrides()}


def env_overrides() -> dict:
    """LUCEBOX_ATTN_DECODE="n_split=1,block_k=128" (integer knobs, for A/B runs): e.g. one split, so no merge
    kernel, where a small model's short cache makes the split's second kernel cost more than it saves."""
    spec = os.environ.get("LUCEBOX_ATTN_DECODE", "").strip()
    out = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        key, _, val = item.partition("=")
        if (key not in ("n_split", "block_k", "num_warps", "num_stages", "min_programs") or not val.isdigit()
                or int(val) == 0):
            raise ValueError(f"LUCEBOX_ATTN_DECODE: {item!r} is not one of n_split, block_k, num_warps, num_stages, "
                             "min_programs = a positive integer")
        out[key] = int(val)
    return out


@functools.partial(
    jax.jit,
    static_argnames=("scale", "block_k", "n_split", "num_warps", "num_stages", "interpret", "min_programs",
                     "row_invariant", "partials", "combine", "append", "window_rows", "out_rows", "pack", "sliding",
                     "prologue_eps", "prologue_dim", "rope_interleaved", "split_out"),
)
def attention_decode(
    q, k, v, lengths, rows=None, win_mask=None, *, scale: float, block_k: int = 64, n_split: int | None = None,
    num_warps: int = 4, num_stages: int = 3, interpret: bool = False, min_programs: int = 264,
    row_invariant: bool = False, partials: bool = False, combine: str = "xla", append: bool = False,
    window_rows: int = 0, out_rows: int = 0, pack: bool = False, sliding: int = 0, prologue: dict | None = None,
    prologue_eps: float = 0.0, prologue_dim: int = 0, rope_interleaved: bool = False, split_out: bool = False,
):
    """q [B, Hq, D], k/v [Bc, Hkv, S, D], lengths [B] int32, rows [B] int32 (cache row of each query row; None:
    row b reads cache row b) -> [B, Hq, D] (q.dtype).

    partials=True returns the softmax unnormalised instead, to be merged with other keys (a tree's window,
    `attention_tree.py`): (acc [B, Hq, D], m [B, Hq], l [B, Hq]) in float32, where out = acc / l and m is the
    running maximum of the scores in log2 units (scale * log2(e) * q.k); a row that sees no key has l = 0.
    combine: how n_split > 1 partials are merged: "xla" (jnp; XLA makes 1-4 small fusions of it, by shape) or
    "kernel" (one Pallas program per row and query head). A row-invariant call always merges in jnp, in split order.
    win_mask [B, Hq, nw] int32 (nw 1 or 2): query row b, head h also sees the cache slots lengths[b] + j, j < 32 nw,
    whose bit j is set (bit j % 32 of word j // 32): a token tree's ancestors, written to the cache after the prefix;
    with append and window_rows = T, the window's keys j < T whose bit is set instead of keys 0..t (a tree's nodes
    as decode rows, module docstring).
    append=True: q [B, Hq + 2 Hkv, D] also holds the step's own keys and values (heads Hq.., Hq + Hkv..), written at
    slot lengths[b] - 1 (placed as a dynamic-update-slice places it) and attended there; returns (out, k, v), the
    caches updated in place (no partials with it, and win_mask only with window_rows). With `rows`, append needs
    `window_rows` = T: the rows
    are B windows of T consecutive positions (module docstring), each row's key and value written at lengths - 1.
    out_rows > B: the output has that many rows, zero past B (a matmul's input padded in the combine kernel, not by a
    pad kernel after it; not with partials).
    pack=True (with window_rows): one program a window and kv head instead of one a row (`attention_window.py`): the
    prefix is read once for the window's T positions; n_split is then chosen for B / T windows.
    sliding=W > 0 (a sliding-window layer, Gemma's): the row at position p sees keys p - W + 1 .. p only, p =
    lengths[b] - 1 (its window's own keys, with window_rows, all nearer than W); not with win_mask or pack.
    prologue (a decode step with append, no rows): q is the qkv matmul's partial sums [P, R, Hq + 2 Hkv, D] (R >= B
    rows, B = len(lengths)), and the dict holds `parts` (more such arrays, a tuple), `row_sumsq` [R] or None, `cos`,
    `sin` [B, D] (full-width tables: `lucebox_jax.qkv_prologue.full_tables`) and `q_norm`, `k_norm` [D] or None:
    the kernel sums the partials, scales each row by its attention norm (rsqrt(row_sumsq / `prologue_dim` + eps),
    the model's width and eps `prologue_eps`), norms each head (same eps) and rotates it (pairs (i, i +
    D/2), or (2i, 2i + 1) with `rope_interleaved`), rounding to the caches' dtype where `QKVPrologue.apply` does.
    split_out=True: with 1 < n_split <= SPLIT_OUT_MAX[_ONE_ROW] (B <= SPLIT_OUT_MAX_ROWS) the splits come back
    unmerged, as `lucebox_jax.pending_inputs.AttentionSplits` (for an `o` matmul that merges them on its loads: no
    merge kernel); not with partials, row_invariant or out_rows."""
    _, hkv, seq, _ = k.shape
    pro, pro_args, out_dtype = None, [], q.dtype
    if prologue is not None:
        assert append and rows is None and not (partials or pack or win_mask is not None), "prologue: decode steps"
        more = tuple(prologue.get("parts", ()))
        has_r, has_norm = prologue.get("row_sumsq") is not None, prologue.get("q_norm") is not None
        pro = ((q.shape[0],) + tuple(p.shape[0] for p in more), has_r, has_norm, float(prologue_eps),
               bool(rope_interleaved), int(prologue_dim))
        pro_args = [*more, *([prologue["row_sumsq"].astype(jnp.float32)] if has_r else []),
                    prologue["cos"].astype(jnp.float32), prologue["sin"].astype(jnp.float32),
                    *([prologue["q_norm"], prologue["k_norm"]] if has_norm else [])]
        out_dtype = k.dtype
        bsz, hq, d = lengths.shape[0], q.shape[2], q.shape[3]
    else:
        bsz, hq, d = q.shape
    hq -= 2 * hkv if append else 0
    g = hq // hkv
    assert g * hkv == hq and d & (d - 1) == 0, (q.shape, k.shape)
    bh = max(16, _next_pow2(g))
    bk = min(block_k, max(16, _next_pow2(seq)))
    max_split = _cdiv(seq, bk)
    pack = pack and window_rows > 0 and not row_invariant
    assert not (sliding and (pack or win_mask is not None)), "sliding windows: plain rows and chain windows only"
    assert not (sliding and window_rows > sliding), (sliding, window_rows)
    if n_split is None:
        n_split = 1
        units = (1 if row_invariant else bsz // window_rows * position_blocks(window_rows, g) if pack
                 else bsz)  # programs a split, over kv heads
        while units * hkv * n_split < min_programs and n_split * 2 <= max_split:
            n_split *= 2
    n_split = max(1, min(n_split, max_split))
    chunk = _cdiv(_cdiv(seq, n_split), bk) * bk
    n_split = _cdiv(seq, chunk)
    qg = q if append else q.reshape(bsz, hkv, g, d)
    lengths = lengths.astype(jnp.int32)
    nw = 0 if win_mask is None else win_mask.shape[-1]
    assert nw in (0, 1, 2), win_mask.shape
    assert not (append and (partials or (nw and not window_rows))), "append is for a decode step or a short verify"
    assert not (nw and window_rows) or window_rows <= 32 * nw, (nw, window_rows)
    assert (append and rows is not None) == (window_rows > 0), "window_rows goes with append and rows"
    assert not window_rows or (bsz % window_rows == 0 and window_rows <= seq), (bsz, window_rows, seq)
    if pack:
        kern = functools.partial(window_kernel, g=g, win_rows=window_rows, bk=bk, chunk=chunk, seq=seq,
                                 qk_scale=scale * _LOG2E, n_split=n_split, partials=partials, nw=nw)
    else:
        kern = functools.partial(
            _kernel, g=g, bh=bh, bk=bk, chunk=chunk, seq=seq, qk_scale=scale * _LOG2E, n_split=n_split,
            partials=partials, nw=nw, has_rows=rows is not None, append=append, win_rows=window_rows,
            sliding=sliding, pro=pro,
        )
    if n_split == 1 and not partials:
        out_shape = [jax.ShapeDtypeStruct((bsz, hkv, g, d), out_dtype)]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((bsz, hkv, n_split, g, d), jnp.float32),
            jax.ShapeDtypeStruct((bsz, hkv, n_split, g), jnp.float32),
            jax.ShapeDtypeStruct((bsz, hkv, n_split, g), jnp.float32),
        ]
    # no rows: row b reads cache row b by its program id (an arange passed in would cost a kernel a call)
    row_arg = [] if rows is None else [rows.astype(jnp.int32)]
    aliases = {}
    if append:  # caches aliased in (the arguments after lengths, rows, q) and out (the last two outputs)
        at = 2 + len(row_arg)
        aliases = {at: len(out_shape), at + 1: len(out_shape) + 1}
        out_shape = out_shape + [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    outs = pl.pallas_call(
        kern,
        out_shape=out_shape,
        grid=(bsz // window_rows * position_blocks(window_rows, g) if pack else bsz, hkv, n_split),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="attention_decode",
    )(lengths, *row_arg, qg, k, v, *pro_args,
      *([] if win_mask is None else [win_mask.astype(jnp.int32).reshape(bsz, hkv, g, nw)]))
    assert not (partials and out_rows > bsz), "out_rows is for a finished output"
    merge = functools.partial(_merge_splits, dtype=out_dtype, bsz=bsz, hq=hq, d=d, n_split=n_split, partials=partials,
                              row_invariant=row_invariant, combine=combine, interpret=interpret,
                              out_rows=max(out_rows, bsz), split_out=split_out)
    if append:
        *outs, k, v = outs
        return merge(outs), k, v
    return merge(outs)


def _merge_splits(outs, *, dtype, bsz, hq, d, n_split, partials, row_invariant, combine, interpret, out_rows,
                  split_out=False):
    """The kernel's outputs -> the attention output: as they are (one split), or the splits merged; out_rows rows,
    zero past bsz (by the combine kernel, else a pad); split_out: the splits unmerged (`AttentionSplits`)."""
    hkv = outs[0].shape[1]
    g = hq // hkv
    pad = lambda o: o if out_rows == bsz else jnp.pad(o, ((0, out_rows - bsz), (0, 0), (0, 0)))  # noqa: E731
    if n_split == 1 and not partials:
        return pad(outs[0].reshape(bsz, hq, d))
    o, m, l = outs
    if split_out and not (partials or row_invariant) and out_rows == bsz and bsz <= SPLIT_OUT_MAX_ROWS \
            and n_split <= (SPLIT_OUT_MAX_ONE_ROW if bsz == 1 else SPLIT_OUT_MAX):
        return AttentionSplits(o, m, l, dtype=jnp.dtype(dtype).name)
    if combine == "kernel" and not (partials or row_invariant):
        return _combine(o, m, l, dtype, out_rows, interpret)
    assert combine in ("xla", "kernel"), combine
    m_max = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp2(m - m_max)  # [B, Hkv, ns, G]
    add = (lambda t: ordered_sum(jnp.moveaxis(t, 2, 0))) if row_invariant else (lambda t: jnp.sum(t, axis=2))
    l_tot = add(w * l)
    o_tot = add(w[..., None] * o)
    if partials:
        return o_tot.reshape(bsz, hq, d), m_max[:, :, 0].reshape(bsz, hq), l_tot.reshape(bsz, hq)
    out = o_tot / jnp.where(l_tot > 0, l_tot, 1.0)[..., None]
    return pad(out.reshape(bsz, hq, d).astype(dtype))


def _combine(o, m, l, dtype, out_rows: int, interpret: bool):  # noqa: E741
    """The splits merged by `_combine_kernel` -> [out_rows, Hq, D] in dtype (zero past o's rows)."""
    bsz, hkv, n_split, g, d = o.shape
    out = pl.pallas_call(
        functools.partial(_combine_kernel, n_split=n_split, nsp=_next_pow2(n_split), bsz=bsz),
        out_shape=jax.ShapeDtypeStruct((out_rows, hkv, g, d), dtype),
        grid=(out_rows, hkv, g),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="attention_decode_combine",
    )(o, m, l)
    return out.reshape(out_rows, hkv * g, d)


def merge_splits(splits: AttentionSplits, interpret: bool = False) -> jax.Array:
    """A split_out call's splits merged by the combine kernel, as the call would have: [B, Hq * D]."""
    out = _combine(splits.o, splits.m, splits.l, jnp.dtype(splits.dtype), splits.o.shape[0], interpret)
    return out.reshape(splits.shape)


def attention_decode_reference(q, k, v, lengths, rows=None, *, scale: float, sliding: int = 0):
    """Plain jnp, float32: row b attends to cache row rows[b] (default b), positions < lengths[b] (and, with a
    sliding window W, >= lengths[b] - W)."""
    if rows is not None:
        k, v = k[rows], v[rows]
    bsz, hq, d = q.shape
    hkv, seq = k.shape[1], k.shape[2]
    qg = q.reshape(bsz, hkv, hq // hkv, d).astype(jnp.float32)
    s = jnp.einsum("bkgd,bksd->bkgs", qg, k.astype(jnp.float32), precision=lax.Precision.HIGHEST) * scale
    mask = jnp.arange(seq)[None, :] < lengths[:, None]
    if sliding:
        mask &= jnp.arange(seq)[None, :] >= lengths[:, None] - sliding
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgs,bksd->bkgd", p, v.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return o.reshape(bsz, hq, d).astype(q.dtype)


def attention_decode_pallas(q, k, v, lengths, rows=None, win_mask=None, *, scale, append: bool = False,
                            window_rows: int = 0, out_rows: int = 0, sliding: int = 0, interpret: bool | None = None,
                            **overrides):
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    invariant = overrides.get("row_invariant", False)
    pack = (PACK_WINDOWS == "1" or (PACK_WINDOWS != "0" and q.shape[-1] >= PACK_MIN_HEAD_DIM)) and append \
        and window_rows > 0 and not invariant and not sliding
    cfg = default_config(lengths.shape[0], k.shape[1], k.shape[2], q.shape[-1], invariant, mapped_rows=rows is not None,
                         packed=pack)
    if pack and math.prod(packed_tiles(window_rows, q.shape[1] // k.shape[1] - 2)) >= 128:
        cfg["num_warps"] = 8  # (a [128+, D] float32 accumulator: 8 warps hold it without spilling)
    cfg.update(overrides)
    return attention_decode(q, k, v, lengths, rows, win_mask, append=append, window_rows=window_rows,
                            out_rows=out_rows, pack=pack, sliding=sliding, scale=float(scale), interpret=interpret,
                            **cfg)

