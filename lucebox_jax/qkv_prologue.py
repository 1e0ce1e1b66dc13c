"""The steps between a decode step's qkv matmul and its attention, handed to an attention kernel to do itself.

In a decode step XLA runs, between the qkv matmul kernel and the attention kernel, one fusion that sums the matmul's
split-K partials, scales the row by its deferred norm, applies RoPE and concatenates q, k, v; with q/k norms (Qwen3,
Gemma 3) two more. An `attention_decode` kernel that takes `prologue=` does those steps on its own loads instead:
the model hands it the matmul's partial sums as they are (`quant.linear_parts`) and a `QKVPrologue` with what the
steps need. `apply` is the same steps in jnp: the reference, and the fallback of a kernel's paths that cannot.

The steps round as the model's own path rounds (`model.normed_linear`, `model.rms_norm`, `model.rope`): the product
cast to the model's dtype, times the row's norm scale and cast again, each q/k norm and the rotation computed in
float32 and cast; only the order in which partials are added may differ (XLA's reduction against the kernel's).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def rope_tables(positions, hd: int, theta: float, pos_scale: float = 1.0):
    """positions [...] -> (cos, sin) [..., hd / 2] float32: the angles of RoPE's hd / 2 frequency pairs."""
    inv = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    ang = (positions.astype(jnp.float32) * pos_scale)[..., None] * inv
    return jnp.cos(ang), jnp.sin(ang)


def rotate(x, cos, sin, interleaved: bool):
    """x [..., hd] rotated by (cos, sin) [..., hd / 2] (broadcast), in float32, returned in x's dtype.
    interleaved: pairs (2i, 2i + 1) (GGUF llama); else (i, i + hd / 2) (NEOX: qwen, gemma)."""
    hd = x.shape[-1]
    xf = x.astype(jnp.float32)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)
    else:
        x1, x2 = xf[..., : hd // 2], xf[..., hd // 2:]
        out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x.dtype)


def full_tables(cos, sin, interleaved: bool):
    """(cos, sin) [..., hd / 2] -> (C, S) [..., hd] with rotate(x) == x * C + x[partner] * S, partner(i) = i ^ 1
    (interleaved) or i +- hd / 2: C is cos on both columns of a pair, S -sin on its first and sin on its second (the
    same products and sums as `rotate`, so the same float32 values)."""
    if interleaved:
        return (jnp.stack([cos, cos], axis=-1).reshape(*cos.shape[:-1], -1),
                jnp.stack([-sin, sin], axis=-1).reshape(*sin.shape[:-1], -1))
    return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([-sin, sin], axis=-1)


def head_norm(x, w, eps: float):
    """RMS norm over the last axis, float32 inside, x's dtype out (`model.rms_norm` outside row-invariant mode)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class QKVPrologue:
    """What turns a decode step's qkv partial sums into its attention input, for B rows.

    The partials come as a tuple of arrays [P_i, R, Hq + 2 Hkv, hd] (R >= B rows; rows from B on are padding) whose
    sum over every P_i is the qkv product (`quant.linear_parts`). cos / sin [B, hd / 2]: each row's rotation;
    row_sumsq [R] float32 or None: the attention norm's per-row sum of squares over the model's `width`, its scale
    rsqrt(sumsq / width + eps) deferred past the matmul (`model.rms_norm_deferred`; the sum, not the scale, so that
    no kernel runs to make the scale); q_norm / k_norm [hd] or None: the per-head norms."""

    cos: jax.Array
    sin: jax.Array
    row_sumsq: jax.Array | None
    q_norm: jax.Array | None
    k_norm: jax.Array | None
    n_heads: int
    n_kv_heads: int
    eps: float
    width: int
    interleaved: bool
    dtype: str

    def apply(self, parts: tuple) -> jax.Array:
        """The prologue in jnp: -> [B, Hq + 2 Hkv, hd] in `dtype` (q heads, then k, then v; the attention kernels'
        `append` input)."""
        dt = jnp.dtype(self.dtype)
        b, hq, hkv = self.cos.shape[0], self.n_heads, self.n_kv_heads
        y = sum(jnp.sum(p.astype(jnp.float32), axis=0) for p in parts).astype(dt)
        if self.row_sumsq is not None:
            r = jax.lax.rsqrt(self.row_sumsq / self.width + self.eps)
            y = (y.astype(jnp.float32) * r[:, None, None]).astype(dt)
        y = y[:b]
        q, k, v = y[:, :hq], y[:, hq: hq + hkv], y[:, hq + hkv:]
        if self.q_norm is not None:
            q, k = head_norm(q, self.q_norm, self.eps), head_norm(k, self.k_norm, self.eps)
        cos, sin = self.cos[:, None], self.sin[:, None]
        q, k = rotate(q, cos, sin, self.interleaved), rotate(k, cos, sin, self.interleaved)
        return jnp.concatenate([q, k, v], axis=1)
