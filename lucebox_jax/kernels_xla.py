"""Plain-XLA implementations of every op, registered as `xla`: the CPU default and the reference the Pallas kernels
are tested against. Math in float32, outputs in the input dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import ops, quant
from .quant import Int8Array, QuantArray, dequantize

_NEG = -1e30


@ops.register("qmatmul", "xla", default_on=("cpu",))
def qmatmul_xla(x: jax.Array, w: QuantArray) -> jax.Array:
    """Dequantize then one dot (XLA fuses the dequant into the dot's operand)."""
    wd = dequantize(w, x.dtype)
    return jnp.dot(x, wd, preferred_element_type=jnp.float32).astype(x.dtype)


@ops.register("qmatmul8", "xla", default_on=("cpu",))
def qmatmul8_xla(x: jax.Array, w: Int8Array) -> jax.Array:
    """int8 weights: dequantize then one dot."""
    wd = dequantize(w, x.dtype)
    return jnp.dot(x, wd, preferred_element_type=jnp.float32).astype(x.dtype)


def _gqa_scores(q, k, scale):
    # q [B, T, Hkv, G, D], k [B, Hkv, S, D] -> [B, Hkv, G, T, S]
    return jnp.einsum("btkgd,bksd->bkgts", q.astype(jnp.float32), k.astype(jnp.float32)) * scale


@ops.register("attention_prefill", "xla", default_on=("cpu",))
def attention_prefill_xla(q, k, v, start, *, scale, window: int | None = None):
    if quant.ROW_INVARIANT:  # every query as a decode row of its own (see _one_query_at_a_time)
        b, t, hq, d = q.shape
        lengths = (start[:, None] + jnp.arange(1, t + 1)[None, :]).reshape(b * t)
        rows = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)
        return _one_query_at_a_time(q.reshape(b * t, hq, d), k, v, lengths, rows, scale, window).reshape(q.shape)
    return _attention(q, k, v, start, scale=scale, window=window)


def _one_query_at_a_time(q, k, v, lengths, rows, scale, window):
    """q [N, Hq, D]: query n reads cache row rows[n] up to lengths[n], one query per loop step. XLA's CPU contraction
    splits its work by the shapes it is given (14 of 150 rows differed between one row and three), so with
    quant.ROW_INVARIANT every query is computed by the same one-query program whatever the batch or window."""
    def one(args):
        qi, li, ri = args
        kr, vr = (jax.lax.dynamic_index_in_dim(c, ri, keepdims=True) for c in (k, v))
        return _attention(qi[None, None], kr, vr, (li - 1)[None], scale=scale, window=window)[0, 0]

    return jax.lax.map(one, (q, lengths.astype(jnp.int32), rows.astype(jnp.int32)))


def _attention(q, k, v, start, *, scale, window):
    b, t, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    scores = _gqa_scores(qg, k, scale)
    qpos = start[:, None] + jnp.arange(t)[None, :]  # [B, T]
    kpos = jnp.arange(s)[None, None, :]
    mask = kpos <= qpos[:, :, None]  # [B, T, S]
    if window is not None:  # sliding window: the last `window` positions, the query's own included
        mask &= kpos > qpos[:, :, None] - window
    scores = jnp.where(mask[:, None, None], scores, _NEG)
    if quant.ROW_INVARIANT:  # a softmax whose sum's order does not depend on the batch (quant.ROW_INVARIANT)
        from .model import ordered_row_sum

        e = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
        p = e / ordered_row_sum(e)
    else:
        p = jax.nn.softmax(scores, axis=-1)
    o = jnp.einsum("bkgts,bksd->btkgd", p, v.astype(jnp.float32))
    return o.reshape(b, t, hq, d).astype(q.dtype)


def pad_rows(o, out_rows: int):
    """[B, ...] -> [max(B, out_rows), ...], zero past B: an attention output handed over at a matmul's padded rows
    (`attention_decode`'s `out_rows`, where a kernel cannot write them itself)."""
    return jnp.pad(o, ((0, max(out_rows - o.shape[0], 0)),) + ((0, 0),) * (o.ndim - 1))


def write_kv(cache_l, new, start):
    """cache_l [B, Hkv, S, hd] <- new [B, T, Hkv, hd] at positions start[b] .. start[b] + T - 1 of each row.

    One row is written with a plain dynamic-update-slice: the vmapped form becomes a clipping scatter, which XLA on
    the GPU lowers at batch 1 as a select against the slot's old value, read by a kernel of its own (2 of the ~13
    small kernels per layer of a decode step). Both clamp the start the same way, so the cache is the same."""
    new = new.transpose(0, 2, 1, 3).astype(cache_l.dtype)
    if cache_l.shape[0] == 1:
        return jax.lax.dynamic_update_slice(cache_l, new, (0, 0, start[0], 0))
    return jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice(c, n, (0, s, 0)))(cache_l, new, start)


@ops.register("kv_move", "xla", default_on=("cpu",))
def kv_move_xla(caches, src, dst):
    """Per cache, the source slots gathered and written back as one block (`write_kv`: one row, no scatter)."""
    def one(c):
        got = jnp.take_along_axis(c, src[:, None, :, None], axis=2)  # [B, Hkv, n, D]
        return write_kv(c, got.transpose(0, 2, 1, 3), dst)

    return tuple(one(c) for c in caches)


@ops.register("attention_decode", "xla", default_on=("cpu",))
def attention_decode_xla(q, k, v, lengths, rows=None, *, scale, window: int | None = None):
    if quant.ROW_INVARIANT:
        rows = jnp.arange(q.shape[0], dtype=jnp.int32) if rows is None else rows
        return _one_query_at_a_time(q, k, v, lengths, rows, scale, window)
    if rows is not None:  # query row b reads cache row rows[b]
        k, v = k[rows], v[rows]
    out = attention_prefill_xla(q[:, None], k, v, lengths - 1, scale=scale, window=window)
    return out[:, 0]


def tree_rows_xla(q, kc, vc, lengths, window_anc, t: int, *, scale):
    """A token tree's nodes as decode rows, by XLA (`attention_decode(append=True, window_rows=t, window_anc=)` where
    its kernel cannot run): q [B * T, Hq + 2 Hkv, hd] (queries, then the nodes' keys and values), lengths [B * T]
    (start + t + 1: node t's slot, + 1), window_anc [B * T, T] (the nodes each row sees) -> (out [B * T, Hq, hd], kc,
    vc) with the window written at slots start .. start + T - 1 first."""
    n, h, hd = q.shape
    hkv = kc.shape[1]
    hq, b = h - 2 * hkv, n // t
    qq = q[:, :hq].reshape(b, t, hq, hd)
    kw, vw = q[:, hq:hq + hkv].reshape(b, t, hkv, hd), q[:, hq + hkv:].reshape(b, t, hkv, hd)
    start = lengths[::t] - 1
    kc, vc = write_kv(kc, kw, start), write_kv(vc, vw, start)
    o = attention_tree_xla(qq, kc, vc, start, kw, vw, window_anc.reshape(b, t, t), scale=scale)
    return o.reshape(n, hq, hd), kc, vc


@ops.register("attention_tree", "xla", default_on=("cpu", "gpu"))
def attention_tree_xla(q, kc, vc, n_visible, k_win, v_win, anc, *, scale, positions=None, window=None):
    """Attention of a token tree: q [B, T, Hq, hd] sees cache slots < n_visible[b] of kc/vc [B, Hkv, S, hd] and the
    window keys k_win/v_win [B, T2, Hkv, hd] where anc [B, T, T2] (its ancestors and itself). With a sliding `window`
    W, a node at positions[b, t] sees only cache slots > positions - W (its ancestors are nearer than W)."""
    b, t, hq, hd = q.shape
    hkv, s = kc.shape[1], kc.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, hd).astype(jnp.float32)
    sc = jnp.einsum("bthgd,bhsd->bhgts", qg, kc.astype(jnp.float32)) * scale
    slot = jnp.arange(s)[None, None, :]
    seen = slot < n_visible[:, None, None]  # [B, T, S]
    if window is not None:
        seen = seen & (slot > positions[:, :, None] - window)
    sc = jnp.where(seen[:, None, None], sc, _NEG)
    sw = jnp.einsum("bthgd,bjhd->bhgtj", qg, k_win.astype(jnp.float32)) * scale
    sw = jnp.where(anc[:, None, None], sw, _NEG)
    p = jax.nn.softmax(jnp.concatenate([sc, sw], axis=-1), axis=-1)
    o = (jnp.einsum("bhgts,bhsd->bthgd", p[..., :s], vc.astype(jnp.float32))
         + jnp.einsum("bhgtj,bjhd->bthgd", p[..., s:], v_win.astype(jnp.float32)))
    return o.reshape(b, t, hq, hd).astype(q.dtype)
