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
    if quant.ROW_INVARIANT and q.shape[0] > 1:
        # one row at a time: XLA's CPU contraction splits its work by the batch size, so a row's sums would depend on
        # how many rows share the call (quant.ROW_INVARIANT)
        def one(args):
            return _attention(*(a[None] for a in args), scale=scale, window=window)[0]

        return jax.lax.map(one, (q, k, v, start))
    return _attention(q, k, v, start, scale=scale, window=window)


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


@ops.register("attention_decode", "xla", default_on=("cpu",))
def attention_decode_xla(q, k, v, lengths, rows=None, *, scale, window: int | None = None):
    if rows is not None:  # query row b reads cache row rows[b]
        k, v = k[rows], v[rows]
    out = attention_prefill_xla(q[:, None], k, v, lengths - 1, scale=scale, window=window)
    return out[:, 0]
