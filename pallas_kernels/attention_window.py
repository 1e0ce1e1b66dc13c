"""A speculative verify's window packed into one program per kv head (Pallas-Triton; `attention_decode(pack=True)`).

`attention_decode(append=True, rows=, window_rows=T)` runs a verify of T new positions as B * T decode rows, one
program per (row, kv head, split): each of the T rows of a window reads the same cache prefix (every slot before the
window), so the prefix is streamed T times. Here one program takes the whole window: its T positions x G query heads
are one [T' * G', D] tile (T' and G' the next powers of two, at least 16 rows in all; row i is position i // G',
head i % G'), the prefix is streamed once for all of them, and the window's own keys 0..t (or, for a token tree, the
keys whose bit is set in the row's mask) are merged in the last split, as in the per-row kernel. The window's keys
and values are written into the cache by that split, at the window's slots (placed as a dynamic-update-slice places
T rows), after every read of the prefix: no read meets a write.

Grid (B x P, Hkv, n_split) for B windows of P position blocks: a window whose tile would pass MAX_TILE_ROWS rows
(a tree of 33 nodes and its root at G = 4) takes P programs of T' positions each, every one streaming the prefix.
Outputs as the per-row kernel's (one row per position), so the splits merge the same way
(`attention_decode._merge_splits`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_NEG = -1e30


def _next_pow2(v: int) -> int:
    return 1 << max(0, int(v) - 1).bit_length()


MAX_TILE_ROWS = 64  # rows of a program's tile (positions x heads); longer windows take several programs


def packed_tiles(t: int, g: int) -> tuple[int, int]:
    """(T', G'): the window positions and query heads a program's tile holds (powers of two, T' * G' >= 16; T'
    below the window's length when a whole window would pass MAX_TILE_ROWS rows)."""
    bg = _next_pow2(g)
    return max(min(_next_pow2(t), max(MAX_TILE_ROWS // bg, 1)), -(-16 // bg)), bg


def position_blocks(t: int, g: int) -> int:
    """Programs a window's positions take (each T' of them, `packed_tiles`)."""
    return -(-t // packed_tiles(t, g)[0])


def bits_visible(words: list, j, jmask):
    """Window key j visible to a row where bit j of its mask words (each [rows, 1], 32 keys a word) is set."""
    word = words[0] if len(words) == 1 else jnp.where(j[None, :] < 32, words[0], words[1])  # [rows, keys]
    return (((word >> (j[None, :] & 31)) & 1) == 1) & jmask[None, :]


def merge_visible(acc, m_i, l_i, s, vis, v):
    """One online-softmax update of (acc, m, l) by a block of keys: scores s [rows, keys] in log2 units, seen where
    vis, values v [keys, D]. A row that saw nothing yet keeps m = -1e30, so its invisible keys are zeroed."""
    s = jnp.where(vis, s, _NEG)
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.where(vis, jnp.exp2(s - m_new[:, None]), 0.0)
    l_i = l_i * alpha + jnp.sum(p, axis=1)
    return acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32), m_new, l_i


def window_kernel(len_ref, row_ref, q_ref, k_ref, v_ref, *refs, g, win_rows, bk, chunk, seq, qk_scale, n_split,
                  partials, nw):
    win_ref, refs = (refs[0], refs[1:]) if nw else (None, refs)
    *out_refs, ko_ref, vo_ref = refs
    hkv = k_ref.shape[1]
    hq = hkv * g
    tq, bg = packed_tiles(win_rows, g)
    nblk = position_blocks(win_rows, g)
    bh = tq * bg
    w, h, sp = pl.program_id(0) // nblk, pl.program_id(1), pl.program_id(2)
    p0 = (pl.program_id(0) % nblk) * tq  # this program's first position in the window
    w0 = w * win_rows  # the window's first row
    r0 = w0 + p0  # this program's first row
    kb = row_ref[w0]
    wstart = jnp.clip(len_ref[w0] - 1, 0, seq - win_rows)  # (clamped as dynamic_update_slice clamps)
    length = jnp.minimum(jnp.minimum(len_ref[w0], seq), wstart)  # the prefix: slots before the window
    start = sp * chunk
    end = jnp.minimum(start + chunk, length)
    n_blocks = jnp.maximum(end - start + bk - 1, 0) // bk
    ti, gi = jnp.arange(tq), jnp.arange(bg)
    qmask = (p0 + ti < win_rows)[:, None, None] & (gi < g)[None, :, None]
    d = q_ref.shape[-1]
    q = plgpu.load(q_ref.at[pl.ds(r0, tq), pl.ds(h * g, bg), :], mask=qmask, other=0).reshape(bh, d)
    q = (q.astype(jnp.float32) * qk_scale).astype(k_ref.dtype)

    def body(i, carry):
        acc, m_i, l_i = carry
        k0 = pl.multiple_of(start + i * bk, bk)
        kmask = (k0 + jnp.arange(bk)) < end
        k = plgpu.load(k_ref.at[kb, h, pl.ds(k0, bk), :], mask=kmask[:, None], other=0)
        s = jnp.where(kmask[None, :], jnp.dot(q, k.T, preferred_element_type=jnp.float32), _NEG)  # [bh, bk]
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(s - m_new[:, None])
        v = plgpu.load(v_ref.at[kb, h, pl.ds(k0, bk), :], mask=kmask[:, None], other=0)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return acc, m_new, l_i * alpha + jnp.sum(p, axis=1)

    init = (jnp.zeros((bh, d), jnp.float32), jnp.full((bh,), _NEG, jnp.float32), jnp.zeros((bh,), jnp.float32))
    acc, m_i, l_i = lax.fori_loop(0, n_blocks, body, init)
    # the window's keys and values (q's rows w0 .. w0 + T - 1) as one block, merged in the last split
    tw = max(16, _next_pow2(win_rows))  # (the tensor-core dot's 16 columns at least)
    j = jnp.arange(tw)
    jmask = j < win_rows
    kw = plgpu.load(q_ref.at[pl.ds(w0, tw), hq + h, :], mask=jmask[:, None], other=0).astype(k_ref.dtype)
    vw = plgpu.load(q_ref.at[pl.ds(w0, tw), hq + hkv + h, :], mask=jmask[:, None], other=0).astype(v_ref.dtype)
    s = jnp.dot(q, kw.T, preferred_element_type=jnp.float32)  # [bh, tw]
    if nw:  # a tree: key j where the row's bit j is set
        vis = bits_visible([plgpu.load(win_ref.at[pl.ds(r0, tq), h, pl.ds(0, bg), pl.ds(x, 1)], mask=qmask, other=0)
                            .reshape(bh, 1) for x in range(nw)], j, jmask)
    else:  # a chain: position t sees keys 0..t
        vis = (j[None, :] <= p0 + (jnp.arange(bh) // bg)[:, None]) & jmask[None, :]
    acc, m_i, l_i = merge_visible(acc, m_i, l_i, s, vis & (sp == n_split - 1), vw)

    @pl.when((sp == n_split - 1) & (p0 == 0))  # (one program a window and kv head writes it)
    def _():
        plgpu.store(ko_ref.at[kb, h, pl.ds(wstart, tw), :], kw, mask=jmask[:, None])
        plgpu.store(vo_ref.at[kb, h, pl.ds(wstart, tw), :], vw, mask=jmask[:, None])

    omask = qmask[..., 0]
    if n_split == 1 and not partials:
        (o_ref,) = out_refs
        out = (acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]).reshape(tq, bg, d)
        plgpu.store(o_ref.at[pl.ds(r0, tq), h, pl.ds(0, bg), :], out.astype(o_ref.dtype), mask=qmask)
    else:
        o_ref, m_ref, l_ref = out_refs
        plgpu.store(o_ref.at[pl.ds(r0, tq), h, sp, pl.ds(0, bg), :], acc.reshape(tq, bg, d), mask=qmask)
        plgpu.store(m_ref.at[pl.ds(r0, tq), h, sp, pl.ds(0, bg)], m_i.reshape(tq, bg), mask=omask)
        plgpu.store(l_ref.at[pl.ds(r0, tq), h, sp, pl.ds(0, bg)], l_i.reshape(tq, bg), mask=omask)
