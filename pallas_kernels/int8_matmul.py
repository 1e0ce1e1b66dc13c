"""W8A16 int8 matmul over `lucebox_jax.quant.Int8Array` (Pallas-Triton): the LM head (GGUF Q8_0, often the largest
single weight: 525 MB for Llama-3-8B's 128k vocabulary) and any other int8 weight.

    y [M, N] = x [M, K] @ W [K, N],   W[k, n] = scales[k // g, n] * q[k, n]   (q int8 [K, N], scales [K/g, N])

Scales may be float16 or float32 (K-quant imports).  Weights with mins (GGUF Q5_1 / Q5_K: W = s q + m) run the same
kernel on s q and add the mins' term outside it, sum_k x[m, k] mins[k // g, n] = (x summed per group) @ mins: one
small XLA dot over K/g rows (`qmatmul8_pallas`).

Why a kernel: XLA's fused dequantize + dot streams the int8 weight at a fraction of the bandwidth at decode shapes.
The int8 codes are exact in bf16, so each group of `g` rows is one tensor-core dot of the *unscaled* codes, and the
group's scale multiplies the [M, block_n] partial product: one convert per weight, no per-weight scale multiply.

Grid (N / block_n, split_k, M / block_m).  A program owns `block_n` columns and a contiguous range of K tiles of
`block_k` rows (a multiple of g: block_k / g dots per step).  A block holds >= 16 rows of x (tensor-core
tile); rows past M are masked on load and store, never padded in memory.
Split-K partials (float32 [split_k, M, N]) are summed by XLA; with enough column blocks there is no split at all.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .int4_matmul import ordered_sum, row_masks, split_plan  # the same row masking, split-K sizing, ordered sum

__all__ = ["int8_matmul", "int8_matmul_reference", "default_config", "qmatmul8_pallas", "mins_term"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kernel(x_ref, c_ref, s_ref, o_ref, *, g, bm, bn, bk, n_cols, tiles_per_split, n_tiles, out_partial, m_rows):
    pid_n, pid_k, pid_m = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n0 = pid_n * bn
    m0 = pid_m * bm
    cmask = (n0 + jnp.arange(bn)) < n_cols
    ragged = n_cols % bn != 0  # no masks at all when block_n divides N
    lm = dict(mask=cmask[None, :], other=0) if ragged else {}
    sm = dict(mask=cmask[None, :]) if ragged else {}
    cdt = x_ref.dtype
    rmask, sm = row_masks(m0, bm, m_rows, cmask, ragged, sm)
    t0 = pid_k * tiles_per_split
    t1 = jnp.minimum(t0 + tiles_per_split, n_tiles)

    def body(t, acc):
        r0 = pl.multiple_of(t * bk, bk)
        for j in range(bk // g):  # one dot per group: unscaled codes, then the group's scale on the partial
            rg = r0 + j * g
            c = plgpu.load(c_ref.at[pl.ds(rg, g), pl.ds(n0, bn)], **lm)
            s = plgpu.load(s_ref.at[pl.ds(rg // g, 1), pl.ds(n0, bn)], **lm).astype(jnp.float32)
            if rmask is None:
                xs = x_ref[pl.ds(m0, bm), pl.ds(rg, g)]
            else:
                xs = plgpu.load(x_ref.at[pl.ds(m0, bm), pl.ds(rg, g)], mask=rmask[:, None], other=0)
            acc = acc + jnp.dot(xs, c.astype(cdt), preferred_element_type=jnp.float32) * s
        return acc

    res = lax.fori_loop(t0, t1, body, jnp.zeros((bm, bn), jnp.float32))
    if out_partial:
        plgpu.store(o_ref.at[pid_k, pl.ds(m0, bm), pl.ds(n0, bn)], res, **sm)
    else:
        plgpu.store(o_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], res.astype(o_ref.dtype), **sm)


def default_config(m: int, k: int, n: int, group_size: int) -> dict:
    """Knobs for the shape (H200 choice recorded in benchmarks/RESULTS.md, "int8 head")."""
    del m, n
    bk = group_size * max(1, 64 // group_size)
    while k % bk:
        bk //= 2
    return dict(block_n=128, block_k=max(bk, group_size), num_warps=4, num_stages=4, min_programs=264)


@functools.partial(
    jax.jit,
    static_argnames=("group_size", "block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages",
                     "interpret", "min_programs", "reduce", "parts"),
)
def int8_matmul(x, codes, scales, *, group_size: int, block_m: int | None = None, block_n: int = 128,
                block_k: int = 64, split_k: int | None = None, num_warps: int = 4, num_stages: int = 4,
                interpret: bool = False, min_programs: int = 264, reduce: str = "xla", parts: bool = False):
    """x [M, K] @ int8 W (codes int8 [K, N], scales float16/float32 [K/g, N]) -> [M, N] in x.dtype.

    block_k: rows per loop step, a multiple of group_size dividing K; group_size >= 16 (a tensor-core dot per
    group); split_k: K splits (None: split until there are `min_programs` programs); reduce: "xla" (partials summed
    by XLA) | "ordered" (summed in split order, `int4_matmul.ordered_sum`)."""
    m, k = x.shape
    kc, n = codes.shape
    g = group_size
    assert k == kc and k % g == 0 and g >= 16, (x.shape, codes.shape, g)
    assert block_k % g == 0 and k % block_k == 0, (k, g, block_k)
    bm = max(16, min(block_m or 16, 1 << max(4, (m - 1).bit_length())))
    bn = block_n
    n_blocks, m_blocks = _cdiv(n, bn), _cdiv(m, bm)
    n_tiles = k // block_k
    split_k, tiles_per_split = split_plan(n_tiles, n_blocks * m_blocks, split_k, min_programs)
    out_partial = split_k > 1
    out_shape = (jax.ShapeDtypeStruct((split_k, m, n), jnp.float32) if out_partial
                 else jax.ShapeDtypeStruct((m, n), x.dtype))
    kern = functools.partial(_kernel, g=g, bm=bm, bn=bn, bk=block_k, n_cols=n, tiles_per_split=tiles_per_split,
                             n_tiles=n_tiles, out_partial=out_partial, m_rows=m)
    out = pl.pallas_call(
        kern,
        out_shape=out_shape,
        grid=(n_blocks, split_k, m_blocks),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="int8_matmul",
    )(x, codes, scales)
    if parts:  # (as int4_matmul's: the partials, or the product as one part)
        return (out,) if out_partial and reduce == "xla" else (
            (ordered_sum(out) if out_partial else out)[None],)
    if out_partial:
        out = ordered_sum(out) if reduce == "ordered" else jnp.sum(out, axis=0)
    return out.astype(x.dtype)


def int8_matmul_reference(x, codes, scales, mins=None, *, group_size: int):
    """Plain jnp: dequantize to float32, one float32 dot, result in x.dtype."""
    w = codes.astype(jnp.float32) * jnp.repeat(scales.astype(jnp.float32), group_size, axis=0)
    if mins is not None:
        w = w + jnp.repeat(mins.astype(jnp.float32), group_size, axis=0)
    return jnp.dot(x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST).astype(x.dtype)


def mins_term(x, mins, group_size: int):
    """float32 [M, N]: x [M, K] @ (mins repeated over each group of K rows), as (x summed per group) @ mins."""
    m, k = x.shape
    xs = jnp.sum(x.astype(jnp.float32).reshape(m, k // group_size, group_size), axis=-1)
    return jnp.dot(xs, mins.astype(jnp.float32), precision=lax.Precision.HIGHEST)


def qmatmul8_pallas(x, w, *, interpret: bool | None = None, row_invariant: bool = False, parts: bool = False,
                    **overrides):
    """Registry-shaped entry point: x [M, K] @ Int8Array -> [M, N] (x.dtype); mins through `mins_term`.
    row_invariant: one configuration for every M (16-row tiles, the split-K of one row block, ordered sum), so a
    row's result does not depend on M (weights without mins; `mins_term` is an XLA dot). parts: the product as
    partial sums (`int8_matmul`), the mins term one more part."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    m, k = x.shape
    n = w.codes.shape[1]
    cfg = default_config(m, k, n, w.group_size)
    cfg.update(overrides)
    while k % cfg["block_k"] and cfg["block_k"] > w.group_size:  # e.g. K = 576 with block_k 128
        cfg["block_k"] //= 2
    if row_invariant:
        split = split_plan(k // cfg["block_k"], _cdiv(n, cfg["block_n"]), cfg.get("split_k"),
                           cfg.get("min_programs", 264))[0]
        cfg.update(block_m=16, split_k=split, reduce="ordered")
    y = int8_matmul(x, w.codes, w.scales, group_size=w.group_size, interpret=interpret, parts=parts, **cfg)
    if parts:
        return y if w.mins is None else y + (mins_term(x, w.mins, w.group_size)[None],)
    if w.mins is None:
        return y
    return (y.astype(jnp.float32) + mins_term(x, w.mins, w.group_size)).astype(x.dtype)
