"""Copy a few KV-cache slots within each row, in every cache at once (Pallas-Triton): one launch where XLA runs a
gather and a dynamic-update-slice per cache (a speculative tree's accepted path, moved to where a chain puts it, was
2 kernels a layer: 63 of a tree step's ~600 on the embedded model).

    out[l][b, h, d_b + j] = cache[l][b, h, src[b, j]],   j < n,   d_b = dst[b] placed as a dynamic-update-slice
                                                                  places an n-slot block (from the end if negative,
                                                                  then clamped into the cache)

Grid (B, Hkv): a program takes one row and kv head and, cache after cache, loads its n source slots and then stores
them, so a slot that is both a source and a destination is read before it is written (as in the gather-then-write
it replaces). The caches are aliased in and out: nothing else is copied.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["kv_move", "kv_move_reference"]


def _kernel(src_ref, dst_ref, *refs, n_caches: int, n: int, seq: int):
    ins, outs = refs[:n_caches], refs[n_caches:]
    b, h = pl.program_id(0), pl.program_id(1)
    d = dst_ref[b]
    d = jnp.clip(jnp.where(d < 0, d + seq, d), 0, seq - n)
    srcs = [jnp.clip(src_ref[b, j], 0, seq - 1) for j in range(n)]
    for c_in, c_out in zip(ins, outs):
        rows = [plgpu.load(c_in.at[b, h, pl.ds(s, 1), :]) for s in srcs]  # [1, D] each, all before any store
        for j, row in enumerate(rows):
            plgpu.store(c_out.at[b, h, pl.ds(d + j, 1), :], row)


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps"))
def kv_move(caches: tuple, src, dst, *, interpret: bool = False, num_warps: int = 1) -> tuple:
    """caches: tuple of [B, Hkv, S, D] (one shape and dtype), src [B, n] int32, dst [B] int32 -> the caches with
    slots src[b, j] copied to dst[b] + j (see the module docstring), updated in place when the caller donates them."""
    caches = tuple(caches)
    bsz, hkv, seq, _ = caches[0].shape
    n = src.shape[1]
    assert all(c.shape == caches[0].shape and c.dtype == caches[0].dtype for c in caches), "one cache shape"
    return tuple(pl.pallas_call(
        functools.partial(_kernel, n_caches=len(caches), n=n, seq=seq),
        out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches],
        grid=(bsz, hkv),
        input_output_aliases={2 + i: i for i in range(len(caches))},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kv_move",
    )(src.astype(jnp.int32), dst.astype(jnp.int32), *caches))


def kv_move_reference(caches: tuple, src, dst) -> tuple:
    """Plain jnp: every source slot gathered, then written as one block per row at dst (a dynamic-update-slice)."""
    def one(c):
        got = jnp.take_along_axis(c, jnp.clip(src, 0, c.shape[2] - 1)[:, None, :, None], axis=2)  # [B, Hkv, n, D]
        return jax.vmap(lambda cc, g, s: jax.lax.dynamic_update_slice(cc, g, (0, s, 0)))(c, got, dst)

    return tuple(one(c) for c in caches)
