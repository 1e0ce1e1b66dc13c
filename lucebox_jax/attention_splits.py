"""A split decode attention's partial results, handed to the next matmul unmerged.

Flash-decoding splits each row's keys into chunks; the chunks' unnormalised outputs are merged by their maxima before
the `o` projection. On a launch-bound model that merge is a kernel a layer (30 a step of the embedded model). When
the `o` matmul's kernel can merge the splits as it loads its input (`qmatmul` implementations that take `x_splits`,
Pallas-Triton's int4 matmul), the attention kernel returns this object instead of its output and `quant.linear`
passes it on; anywhere else `merged()` makes the output in jnp.

  o  float32 [B, Hkv, S, G, D]  each split's unnormalised sum of values (G = query heads a kv head)
  m  float32 [B, Hkv, S, G]     its running maximum of the scores, in log2 units
  l  float32 [B, Hkv, S, G]     its sum of exp2(score - m); 0 for a split that saw no key
  out[b, h] = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s,  M = max_s m_s, in `dtype`
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class AttentionSplits:
    o: jax.Array
    m: jax.Array
    l: jax.Array  # noqa: E741
    dtype: str = struct.field(pytree_node=False, default="bfloat16")  # the merged output's

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
