"""Int4 GEMV for small M (decode, speculative verify) on a K-major repack of the int4 codes (Pallas-Triton).

    y [M, N] = x [M, K] @ W [K, N],  W[k, n] = s[k // g, n] * q[k, n] + m[k // g, n]   (asymmetric)
                                     W[k, n] = s[k // g, n] * (q[k, n] - 8)             (symmetric)

Layout ("K-major words", made once at load time by `repack_kmajor` from the engine's half-split codes):
    words uint32 [N, K / 8]: byte b (0..3) of word (n, i) is byte 4 i + b of column n of the half-split codes, i.e.
    its low nibble is q[4 i + b, n] and its high nibble q[K/2 + 4 i + b, n].  Scales and mins keep their
    [K / g, N] layout.
Why: a GEMV is bound by the bytes it reads, and the N-major layout of `int4_matmul.py` spends ~6.8 instructions per
weight at M = 1 (H200 profile: bf16 -> f32 shifts, unfused multiply and add, 16 per-column scales per thread) with
25% occupancy.  Here one 16-byte load gives a thread 32 weights of ONE column, so
  * the decode is 2 instructions per weight: shift the nibble to bit 19 and OR in 1.0's exponent, which makes the
    float32 f = 1 + q / 16 (no int -> float convert);
  * the products are one fused multiply-add per weight inside the same inline asm (P += x f), summed over the
    group in the thread before any cross-thread work;
  * the scale and min are applied once per (column, group): sum_k x W = 16 s (P - X) + m X (asym) or
    s (16 P - 24 X) (sym), with X = sum of x over the group, computed once per call outside the kernel.
Grid (N / block_n, split_k); a program owns block_n columns and a range of whole groups; split-K partials are summed
by XLA.  M <= 16: each row of x reuses the loaded words (the decode is redone per row; M > 4 costs compute).
In interpret mode (CPU) the asm is replaced by the same arithmetic in jnp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["int4_gemv", "int4_gemv_reference", "repack_kmajor", "gemv_default_config"]

_ONE = 0x3F800000  # float32 1.0
_MASK = 0x00780000  # the 4 bits below 1.0's exponent that make 1 + q / 16


def repack_kmajor(codes):
    """Half-split codes uint8 [K/2, N] -> K-major words uint32 [N, K/8] (see the module docstring)."""
    kh, n = codes.shape
    assert kh % 4 == 0, codes.shape
    return lax.bitcast_convert_type(codes.T.reshape(n, kh // 4, 4), jnp.uint32)


def _shift(nib: int) -> tuple[str, int]:
    """PTX shift that moves nibble `nib` (0..7, bit 4*nib) of a word to bit 19."""
    d = 19 - 4 * nib
    return ("shl.b32", d) if d >= 0 else ("shr.b32", -d)


def _asm_dot4(half: int) -> str:
    """$0 = sum over the 4 bytes b of word $1 of x_b * (1 + q_b / 16), q_b the low (half 0) or high (half 1) nibble
    of byte b; x_b is operand $(2 + b).  12 instructions for 4 weights."""
    lines = ["{", ".reg .b32 t, a;"]
    for b in range(4):
        op, d = _shift(2 * b + half)
        lines.append(f"{op} t, $1, {d};")
        lines.append(f"lop3.b32 t, t, {_MASK:#010x}, {_ONE:#010x}, 0xEA;")
        lines.append(f"mul.rn.f32 a, $2, t;" if b == 0 else f"fma.rn.f32 a, ${2 + b}, t, a;")
    lines += ["mov.b32 $0, a;", "}"]
    return "\n".join(lines)


def _dot4_jnp(wd, xs, half: int):
    """What `_asm_dot4` computes, in jnp (interpret mode)."""
    acc = None
    for b in range(4):
        q = ((wd >> (8 * b + 4 * half)) & 0xF).astype(jnp.float32)
        t = xs[b] * (1.0 + q / 16.0)
        acc = t if acc is None else acc + t
    return acc


def _group_sum(wd, xs, half: int, asm: bool):
    """[bn] float32: sum over the group of x_k * (1 + q_k / 16) for one half."""
    if asm:
        (p,) = plgpu.elementwise_inline_asm(
            _asm_dot4(half), args=[wd] + xs, constraints="=r,r,r,r,r,r", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(wd.shape, jnp.float32)],
        )
    else:
        p = _dot4_jnp(wd, xs, half)
    return jnp.sum(p, axis=1)


def _scaled(p, xsum, s, mn):
    """sum_k x_k W_k over one group from P = sum x (1 + q/16) and X = sum x:  asym 16 s (P - X) + m X,
    sym s (16 P - 24 X)."""
    if mn is None:
        return s * (16.0 * p - 24.0 * xsum)
    return 16.0 * s * (p - xsum) + mn * xsum


def _kernel(*refs, nh, g, bn, n_cols, m, groups_per_split, n_groups, has_mins, asm, out_partial):
    if has_mins:
        x_ref, xs_ref, w_ref, s_ref, mn_ref, o_ref = refs
    else:
        x_ref, xs_ref, w_ref, s_ref, o_ref = refs
        mn_ref = None
    pid_n, pid_k = pl.program_id(0), pl.program_id(1)
    n0 = pid_n * bn
    gw = g // 4  # words per group and column
    ragged = n_cols % bn != 0
    cols = n0 + jnp.arange(bn)
    lm = dict(mask=(cols < n_cols)[:, None], other=0) if ragged else {}
    vm = dict(mask=(cols < n_cols)[None, :], other=0) if ragged else {}
    g0 = pid_k * groups_per_split
    g1 = jnp.minimum(g0 + groups_per_split, n_groups)

    def row(ref, j):
        return plgpu.load(ref.at[pl.ds(j, 1), pl.ds(n0, bn)], **vm).astype(jnp.float32)[0]

    def body(gi, acc):
        w0 = pl.multiple_of(gi * gw, gw)
        wd = plgpu.load(w_ref.at[pl.ds(n0, bn), pl.ds(w0, gw)], **lm)  # [bn, gw] uint32
        s_lo, s_hi = row(s_ref, gi), row(s_ref, gi + nh)
        m_lo = m_hi = None
        if mn_ref is not None:
            m_lo, m_hi = row(mn_ref, gi), row(mn_ref, gi + nh)
        new = []
        for r in range(m):
            out = acc[r]
            for half, s, mn in ((0, s_lo, m_lo), (1, s_hi, m_hi)):
                k0 = half * nh * g + w0 * 4  # x of byte b of each word of this group: stride 4 along K
                xs = [jnp.broadcast_to(x_ref[pl.ds(r, 1), pl.ds(k0 + b, gw, stride=4)], (bn, gw)) for b in range(4)]
                p = _group_sum(wd, xs, half, asm)
                xsum = xs_ref[pl.ds(r, 1), pl.ds(gi + half * nh, 1)][0, 0]
                out = out + _scaled(p, xsum, s, mn)
            new.append(out)
        return tuple(new)

    acc = lax.fori_loop(g0, g1, body, tuple(jnp.zeros((bn,), jnp.float32) for _ in range(m)))
    sm = dict(mask=(cols < n_cols)[None, :]) if ragged else {}
    for r in range(m):
        if out_partial:
            plgpu.store(o_ref.at[pid_k, pl.ds(r, 1), pl.ds(n0, bn)], acc[r][None, :], **sm)
        else:
            plgpu.store(o_ref.at[pl.ds(r, 1), pl.ds(n0, bn)], acc[r][None, :].astype(o_ref.dtype), **sm)


def gemv_default_config(m: int, k: int, n: int, group_size: int) -> dict:
    """Tuning knobs (H200: see benchmarks/RESULTS.md)."""
    return dict(block_n=128, split_k=None, num_warps=4, num_stages=3, min_programs=1056)


@functools.partial(jax.jit, static_argnames=("group_size", "block_n", "split_k", "num_warps", "num_stages",
                                             "min_programs", "interpret"))
def int4_gemv(x, words, scales, mins=None, *, group_size: int, block_n: int = 128, split_k: int | None = None,
              num_warps: int = 4, num_stages: int = 3, min_programs: int = 1056, interpret: bool = False):
    """x [M, K] @ int4 W (K-major words uint32 [N, K/8] from `repack_kmajor`, scales/mins float16 [K/g, N]) ->
    [M, N] in x.dtype.  group_size: a multiple of 4 dividing K/2; split_k None: enough K splits for
    `min_programs` programs."""
    from .int4_matmul import split_plan

    m, k = x.shape
    n, kw = words.shape
    g = group_size
    assert k == 8 * kw and (k // 2) % g == 0 and g % 4 == 0, (x.shape, words.shape, g)
    nh = k // 2 // g  # groups per half
    n_blocks = -(-n // block_n)
    split_k, groups_per_split = split_plan(nh, n_blocks, split_k, min_programs)
    xf = x.astype(jnp.float32)
    xsum = xf.reshape(m, k // g, g).sum(axis=-1)  # X per group
    out_partial = split_k > 1
    kern = functools.partial(
        _kernel, nh=nh, g=g, bn=block_n, n_cols=n, m=m, groups_per_split=groups_per_split, n_groups=nh,
        has_mins=mins is not None, asm=not interpret, out_partial=out_partial,
    )
    out_shape = (jax.ShapeDtypeStruct((split_k, m, n), jnp.float32) if out_partial
                 else jax.ShapeDtypeStruct((m, n), x.dtype))
    args = [xf, xsum, words, scales] + ([mins] if mins is not None else [])
    out = pl.pallas_call(
        kern, out_shape=out_shape, grid=(n_blocks, split_k),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="int4_gemv",
    )(*args)
    if out_partial:
        out = jnp.sum(out, axis=0)
    return out.astype(x.dtype)


def int4_gemv_reference(x, codes, scales, mins=None, *, group_size: int):
    """Plain jnp on the half-split codes: dequantize to float32, one float32 dot, result in x.dtype."""
    from .int4_matmul import int4_matmul_reference

    return int4_matmul_reference(x, codes, scales, mins, group_size=group_size)
