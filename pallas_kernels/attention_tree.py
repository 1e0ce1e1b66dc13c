"""Attention of a speculative token tree: the committed cache through the flash-decoding kernel, the tree in jnp.

    node t of row b sees cache slots < n_visible[b] (the committed prefix)
                    and the window keys j where anc[b, t, j] (its ancestors and itself: the tree's own new keys)

The prefix is the long part. It runs through `attention_decode` (Pallas-Triton) with every node's query heads as
extra query rows of their kv head: G x T rows per kv head, cut into tiles of at most `rows_per_tile` (the kernel
holds one [rows, D] float32 accumulator per program), each tile a query row of its own that reads its batch row's
cache (`rows=`). The kernel returns the softmax unnormalised (acc, max, sum). The window is a few dozen keys: a small
float32 einsum, merged with the prefix by their maxima. When the window's keys also sit in the cache right after the
prefix (`in_cache=True`: the model's tree verify writes them there) and number at most 64, the kernel reads them
there too, each node's ancestors passed as bits (`win_mask`), and returns the normalised output: one kernel and its
split merge, nothing in jnp (no window einsum, softmax pieces and merge in XLA). XLA's einsum over the whole cache,
which upcasts it to float32 and writes [T, S] scores per head, is what this replaces
(`lucebox_jax.kernels_xla.attention_tree_xla`); `attention_tree_reference` is the plain-jnp twin.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import attention_decode as decode_kernel
from .attention_decode import attention_decode

__all__ = ["attention_tree", "attention_tree_reference", "ancestor_words"]

_LOG2E = 1.4426950408889634
_NEG = -1e30


def attention_tree(q, k, v, n_visible, k_win, v_win, anc, *, scale: float, rows_per_tile: int = 64,
                   interpret: bool = False, in_cache: bool = False, **cfg):
    """q [B, T, Hq, D], k/v [B, Hkv, S, D] (the cache), n_visible [B] int32, k_win/v_win [B, T2, Hkv, D], anc
    [B, T, T2] bool -> [B, T, Hq, D] (q.dtype). cfg: attention_decode's knobs (block_k, num_warps, ...).
    in_cache: the window's keys also sit in the cache at slots n_visible + j (the model's tree verify writes them
    there): then, for a window of at most 64, the kernel reads them there too, each node's ancestors given as bits
    (`win_mask`), and nothing is left to merge in jnp."""
    b, t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    n = g * t  # query rows per kv head, ordered (g, t)
    r = min(n, rows_per_tile)
    c = -(-n // r)  # tiles per kv head

    def tiles(a):  # [B, T, Hkv, G, ...] -> [B * C, Hkv * R, ...]: R query rows of one kv head a tile
        a = a.transpose(0, 2, 3, 1, *range(4, a.ndim)).reshape(b, hkv, n, *a.shape[4:])
        a = jnp.pad(a, ((0, 0), (0, 0), (0, c * r - n)) + ((0, 0),) * (a.ndim - 3))
        return a.reshape(b, hkv, c, r, *a.shape[3:]).swapaxes(1, 2).reshape(b * c, hkv * r, *a.shape[3:])

    def back(a):  # [B * C, Hkv * R, ...] -> [B, Hkv, G, T, ...]
        a = a.reshape(b, c, hkv, r, *a.shape[2:]).swapaxes(1, 2).reshape(b, hkv, c * r, *a.shape[2:])
        return a[:, :, :n].reshape(b, hkv, g, t, *a.shape[3:])

    splits = decode_kernel.row_splits(d, k.shape[2])  # a tree's nodes take the verify rows' splits
    if splits > 0:
        cfg.setdefault("n_split", splits)
    qr = tiles(q.reshape(b, t, hkv, g, d))
    cache_row = jnp.repeat(jnp.arange(b, dtype=jnp.int32), c)
    lengths = jnp.repeat(n_visible.astype(jnp.int32), c)
    t2 = anc.shape[-1]
    if in_cache and t2 <= 64:
        words = ancestor_words(anc)  # [B, T, nw]
        nw = words.shape[-1]
        win = tiles(jnp.broadcast_to(words[:, :, None, None], (b, t, hkv, g, nw)))
        out = attention_decode(qr, k, v, lengths, cache_row, win, scale=scale, interpret=interpret, **cfg)
        return back(out).transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d)
    acc, m, l = attention_decode(qr, k, v, lengths, cache_row, scale=scale, partials=True, interpret=interpret, **cfg)
    acc, m, l = back(acc), back(m), back(l)
    # the window's scores and sum as the flash kernels take them: operands in the cache's dtype (q . k products of
    # bf16 values are exact in float32), float32 accumulation, the probabilities rounded to v's dtype for p . v;
    # float32 `HIGHEST` einsums cost XLA's multi-pass matmuls for a few dozen keys
    wt = k_win.dtype
    qg = q.reshape(b, t, hkv, g, d).astype(wt)
    sw = jnp.einsum("bthgd,bjhd->bhgtj", qg, k_win, preferred_element_type=jnp.float32,
                    precision=lax.Precision.HIGHEST if wt == jnp.float32 else None)
    sw = jnp.where(anc[:, None, None], sw * (scale * _LOG2E), _NEG)  # log2 units, as the kernel's
    m2 = jnp.max(sw, axis=-1)
    p2 = jnp.exp2(sw - m2[..., None])
    acc2 = jnp.einsum("bhgtj,bjhd->bhgtd", p2.astype(v_win.dtype), v_win, preferred_element_type=jnp.float32,
                      precision=lax.Precision.HIGHEST if v_win.dtype == jnp.float32 else None)
    mm = jnp.maximum(m, m2)
    a1, a2 = jnp.exp2(m - mm), jnp.exp2(m2 - mm)  # a1 = 0 where the prefix is empty (m = -1e30)
    out = (acc * a1[..., None] + acc2 * a2[..., None]) / (l * a1 + jnp.sum(p2, axis=-1) * a2)[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d).astype(q.dtype)


def ancestor_words(anc):
    """anc [..., T2] bool (T2 <= 64) -> [..., nw] int32, nw = ceil(T2 / 32): bit j % 32 of word j // 32 is anc[j]
    (the flash-decoding kernel's `win_mask`)."""
    t2 = anc.shape[-1]
    nw = -(-t2 // 32)
    pad = [(0, 0)] * (anc.ndim - 1) + [(0, 32 * nw - t2)]
    bits = jnp.pad(anc, pad).reshape(*anc.shape[:-1], nw, 32).astype(jnp.uint32)
    return lax.bitcast_convert_type(jnp.sum(bits << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32),
                                    jnp.int32)


def attention_tree_reference(q, k, v, n_visible, k_win, v_win, anc, *, scale: float):
    """Plain jnp, float32: one softmax over the visible cache slots and the node's window keys."""
    b, t, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d).astype(jnp.float32)
    hi = lax.Precision.HIGHEST
    sc = jnp.einsum("bthgd,bhsd->bhgts", qg, k.astype(jnp.float32), precision=hi) * scale
    sc = jnp.where((jnp.arange(s)[None, :] < n_visible[:, None])[:, None, None, None], sc, -jnp.inf)
    sw = jnp.einsum("bthgd,bjhd->bhgtj", qg, k_win.astype(jnp.float32), precision=hi) * scale
    sw = jnp.where(anc[:, None, None], sw, -jnp.inf)
    p = jax.nn.softmax(jnp.concatenate([sc, sw], axis=-1), axis=-1)
    o = (jnp.einsum("bhgts,bhsd->bthgd", p[..., :s], v.astype(jnp.float32), precision=hi)
         + jnp.einsum("bhgtj,bjhd->bthgd", p[..., s:], v_win.astype(jnp.float32), precision=hi))
    return o.reshape(b, t, hq, d).astype(q.dtype)
