"""Matmul inputs left unfinished for the matmul kernel to finish as it loads them.

On a launch-bound model (the embedded SmolLM2-135M runs ~300 kernels a decode step) the small XLA fusion or merge
kernel between two Pallas kernels costs about as much as either. Where the next matmul's kernel can finish its input
on its loads (`qmatmul` implementations that take `x_pending`: Pallas-Triton's int4 matmul), the model hands over one
of these instead of an array and `quant.linear` passes it on; anywhere else `merged()` makes the array in jnp, the
model's own arithmetic.

`AttentionSplits`: a split decode attention's partial results, before the `o` projection.
  o  float32 [B, Hkv, S, G, D]  each split's unnormalised sum of values (G = query heads a kv head)
  m  float32 [B, Hkv, S, G]     its running maximum of the scores, in log2 units
  l  float32 [B, Hkv, S, G]     its sum of exp2(score - m); 0 for a split that saw no key
  out[b, h] = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s,  M = max_s m_s, in `dtype`

`GatedInput`: the gate+up matmul's split-K partial sums as it wrote them, before the down projection.
  parts      tuple of [P, R, 2 I] arrays (R >= rows) whose sum over P and the tuple is gate+up's product
  row_sumsq  [R] float32 or None: the FFN norm's per-row sum of squares over `width` when its scale was deferred
             (`model.rms_norm_deferred`): then gate+up = round(round(product) * rsqrt(row_sumsq / width + eps))
  gate, up   column c < I of block j = c // (I / groups) at j * 2I / groups + c % (I / groups), up I / groups after
  x[r, c]    = round(silu(gate[r, c]) * up[r, c]), each rounding to `dtype` where `model.forward` rounds
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


def gate_up_columns(c, ffn: int, groups: int):
    """gate+up's gate and up columns of down-input column(s) c (`model.split_parts`' layout of `groups` blocks)."""
    blk = ffn // groups
    g = (c // blk) * 2 * blk + c % blk
    return g, g + blk


@struct.dataclass
class AttentionSplits:
    o: jax.Array
    m: jax.Array
    l: jax.Array  # noqa: E741
    dtype: str = struct.field(pytree_node=False, default="bfloat16")  # the merged output's

    kind = "splits"

    @property
    def shape(self) -> tuple[int, int]:
        """The merged output's shape as the `o` matmul sees it: [B, Hq * D]."""
        b, hkv, _, g, d = self.o.shape
        return b, hkv * g * d

    def merged(self) -> jax.Array:
        """The attention output [B, Hq * D] (plain jnp; the combine kernel's arithmetic)."""
        w = jnp.exp2(self.m - jnp.max(self.m, axis=2, keepdims=True))
        l_tot = jnp.sum(w * self.l, axis=2)
        out = jnp.sum(w[..., None] * self.o, axis=2) / jnp.where(l_tot > 0, l_tot, 1.0)[..., None]
        return out.reshape(self.shape).astype(self.dtype)


@struct.dataclass
class GatedInput:
    parts: tuple
    row_sumsq: jax.Array | None
    rows: int = struct.field(pytree_node=False, default=1)
    ffn: int = struct.field(pytree_node=False, default=0)  # I
    groups: int = struct.field(pytree_node=False, default=1)
    eps: float = struct.field(pytree_node=False, default=1e-6)
    width: int = struct.field(pytree_node=False, default=0)  # the norm's width (the model's dim)
    dtype: str = struct.field(pytree_node=False, default="bfloat16")

    kind = "gated"

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.ffn

    def merged(self) -> jax.Array:
        """The down projection's input [rows, I] (plain jnp; `model.forward`'s arithmetic)."""
        dt = jnp.dtype(self.dtype)
        y = sum(jnp.sum(p.astype(jnp.float32), axis=0) for p in self.parts)[: self.rows].astype(dt)
        if self.row_sumsq is not None:
            r = jax.lax.rsqrt(self.row_sumsq[: self.rows, None] / self.width + self.eps)
            y = (y.astype(jnp.float32) * r).astype(dt)
        gi, ui = gate_up_columns(jnp.arange(self.ffn), self.ffn, self.groups)
        act = jax.nn.silu(y[:, gi].astype(jnp.float32))
        return (act * y[:, ui].astype(jnp.float32)).astype(dt)
