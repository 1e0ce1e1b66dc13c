"""Int4 GEMV for small M (decode) on a K-major, group-local repack of the int4 codes (Pallas-Triton).

    y [M, N] = x [M, K] @ W [K, N],  W[k, n] = s[k // g, n] * q[k, n] + m[k // g, n]   (asymmetric)
                                     W[k, n] = s[k // g, n] * (q[k, n] - 8)             (symmetric)

Layout ("K-major, group-local half-split", made once at load time by `repack_kmajor` from the engine's codes):
    kcodes uint8 [N, K / 2]: byte (n, G g/2 + j), 0 <= j < g/2, holds q[G g + j, n] in its low nibble and
    q[G g + g/2 + j, n] in its high nibble: both nibbles of a byte are in group G, and the x values a group's bytes
    meet are two contiguous runs, x[G g : G g + g/2] and x[G g + g/2 : (G+1) g].  Scales and mins keep [K / g, N].
Why (H200, ncu): the N-major kernel of `int4_matmul.py` spends ~5.4-6.8 instructions per weight at M = 1 and runs
at 25% occupancy (127 registers).  Here a thread holds 16 consecutive bytes of ONE column, so
  * one inline-asm call per 4 bytes decodes and multiplies 8 weights: the nibble is shifted to bit 19 and 1.0's
    exponent ORed in (lop3), which makes the float32 f = 1 + q / 16 with no int -> float convert, then
    x_lo f_lo + x_hi f_hi (mul + fma): 3 instructions per weight, summed over the group inside the thread;
  * the scale and min are applied once per (column, group): sum_k x W = 16 s (P - X) + m X (asym) or
    s (16 P - 24 X) (sym), P = sum x f, X = sum x over the group.
Grid (N / block_n, split_k); a program owns block_n columns and a range of whole groups, `groups_per_step` of them
per loop step (separate loads, all in flight); split-K partials are summed by XLA.  Each row of x redoes the decode
(M = 1 is the intended use: M = 4 measured 1.6-2.8x slower than int4_matmul).  X: computed per call outside the
kernel ("outside": one small XLA reduction) or from the loaded x vectors ("inside").  In interpret mode (CPU) the
asm is replaced by the same arithmetic in jnp (`tests/test_asm_text.py` runs the asm text itself on the CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .int4_matmul import ptx_nibble_f32, split_plan

__all__ = ["gemv_default_config", "int4_gemv", "int4_gemv_reference", "repack_kmajor", "unpack_kmajor"]

def repack_kmajor(codes, group_size: int):
    """Half-split codes uint8 [K/2, N] -> K-major group-local codes uint8 [N, K/2] (see the module docstring)."""
    kh, n = codes.shape
    g = group_size
    lo = jnp.concatenate([codes & 0xF, codes >> 4], axis=0)  # q [K, N]
    q = lo.T.reshape(n, 2 * kh // g, 2, g // 2)  # [N, groups, (first half, second half), g/2]
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, kh).astype(jnp.uint8)


def unpack_kmajor(kcodes, group_size: int):
    """K-major group-local codes uint8 [N, K/2] -> integer codes q [K, N] (uint8, 0..15)."""
    n, kh = kcodes.shape
    g = group_size
    b = kcodes.reshape(n, 2 * kh // g, 1, g // 2)
    q = jnp.concatenate([b & 0xF, b >> 4], axis=2)  # [N, groups, 2, g/2]
    return q.reshape(n, 2 * kh).T


def _asm_dot() -> str:
    """Per byte b of the 32-bit word $4 (4 packed code bytes): $b = x_lo_b f_lo_b + x_hi_b f_hi_b with x_lo_b =
    $(5 + b), x_hi_b = $(9 + b) and f = 1 + q / 16 of the low / high nibble."""
    lines = ["{", ".reg .b32 t, u;"]
    for b in range(4):
        lines += ptx_nibble_f32("t", "$4", 8 * b) + ptx_nibble_f32("u", "$4", 8 * b + 4)
        lines += [f"mul.rn.f32 t, ${5 + b}, t;", f"fma.rn.f32 ${b}, ${9 + b}, u, t;"]
    lines.append("}")
    return "\n".join(lines)


def _dot_jnp(c, x_lo, x_hi):
    """What `_asm_dot` computes, in jnp (interpret mode)."""
    f_lo = 1.0 + (c & 0xF).astype(jnp.float32) / 16.0
    f_hi = 1.0 + (c >> 4).astype(jnp.float32) / 16.0
    return x_lo * f_lo + x_hi * f_hi


def _scaled(p, xsum, s, mn):
    """sum_k x_k W_k over one group from P = sum x (1 + q/16) and X = sum x."""
    if mn is None:
        return s * (16.0 * p - 24.0 * xsum)
    return 16.0 * s * (p - xsum) + mn * xsum


def _kernel(*refs, g, bn, n_cols, m, steps_per_split, n_steps, gps, has_mins, asm, out_partial, xsum_inside,
            prefetch, scales_nk):
    refs = list(refs)
    x_ref = refs.pop(0)
    xs_ref = None if xsum_inside else refs.pop(0)
    c_ref, s_ref = refs.pop(0), refs.pop(0)
    mn_ref = refs.pop(0) if has_mins else None
    (o_ref,) = refs
    pid_n, pid_k = pl.program_id(0), pl.program_id(1)
    n0 = pid_n * bn
    h = g // 2  # bytes per group and column
    ragged = n_cols % bn != 0
    cols = n0 + jnp.arange(bn)
    lm = dict(mask=(cols < n_cols)[:, None], other=0) if ragged else {}
    vm = dict(mask=(cols < n_cols)[None, :], other=0) if ragged else {}
    t0 = pid_k * steps_per_split
    t1 = jnp.minimum(t0 + steps_per_split, n_steps)

    def vec(ref, j):  # [bn, 1] float32 scale (or min) column of group j
        if scales_nk:  # [N, K/g]: already a column
            return plgpu.load(ref.at[pl.ds(n0, bn), pl.ds(j, 1)], **lm).astype(jnp.float32)
        return plgpu.load(ref.at[pl.ds(j, 1), pl.ds(n0, bn)], **vm).astype(jnp.float32).T

    def load_step(t):
        """Everything step t reads from memory: per group its code tile, scale (and min), x runs and X."""
        out = []
        for sub in range(gps):
            gi = t * gps + sub
            c = plgpu.load(c_ref.at[pl.ds(n0, bn), pl.ds(pl.multiple_of(gi * h, h), h)], **lm)  # [bn, g/2] u8
            s = vec(s_ref, gi)
            mn = vec(mn_ref, gi) if mn_ref is not None else jnp.zeros_like(s)
            xs = []
            for r in range(m):
                x_lo = x_ref[pl.ds(r, 1), pl.ds(gi * g, h)]  # [1, g/2] float32
                x_hi = x_ref[pl.ds(r, 1), pl.ds(gi * g + h, h)]
                if xsum_inside:
                    xsum = jnp.sum(x_lo) + jnp.sum(x_hi)
                else:
                    xsum = xs_ref[pl.ds(r, 1), pl.ds(gi, 1)][0, 0]
                xs.append((x_lo, x_hi, xsum))
            out.append((c, s, mn, tuple(xs)))
        return tuple(out)

    def compute(acc, loaded):
        acc = list(acc)
        for c, s, mn, xs in loaded:
            for r, (x_lo, x_hi, xsum) in enumerate(xs):
                xl, xh = jnp.broadcast_to(x_lo, (bn, h)), jnp.broadcast_to(x_hi, (bn, h))
                if asm:
                    (p,) = plgpu.elementwise_inline_asm(
                        _asm_dot(), args=[c, xl, xh], constraints="=r,=r,=r,=r," + ",".join(["r"] * 9), pack=4,
                        result_shape_dtypes=[jax.ShapeDtypeStruct((bn, h), jnp.float32)],
                    )
                else:
                    p = _dot_jnp(c, xl, xh)
                acc[r] = acc[r] + _scaled(jnp.sum(p, axis=1, keepdims=True), xsum, s,
                                          mn if mn_ref is not None else None)
        return tuple(acc)

    zero = tuple(jnp.zeros((bn, 1), jnp.float32) for _ in range(m))
    if prefetch:  # software pipelining: step t + 1's loads are issued before step t's math
        def body(t, carry):
            acc, cur = carry
            nxt = load_step(jnp.minimum(t + 1, t1 - 1))
            return compute(acc, cur), nxt

        acc, _ = lax.fori_loop(t0, t1, body, (zero, load_step(t0)))
    else:
        acc = lax.fori_loop(t0, t1, lambda t, a: compute(a, load_step(t)), zero)
    sm = dict(mask=(cols < n_cols)[None, :]) if ragged else {}
    for r in range(m):
        row = acc[r].T  # [1, bn]
        if out_partial:
            plgpu.store(o_ref.at[pid_k, pl.ds(r, 1), pl.ds(n0, bn)], row, **sm)
        else:
            plgpu.store(o_ref.at[pl.ds(r, 1), pl.ds(n0, bn)], row.astype(o_ref.dtype), **sm)


def gemv_default_config(m: int, k: int, n: int, group_size: int) -> dict:
    """Tuning knobs: the variant that was best (or within 0.5%) on 7 of the 8 Llama-3-8B cases at M = 1 (H200,
    benchmarks/RESULTS.md "Round 4"): 128 columns x 2 groups (g32) or 1 group (g128) per step, 4 warps, prefetch."""
    return dict(block_n=128, groups_per_step=max(1, 64 // group_size), split_k=None, num_warps=4, num_stages=1,
                min_programs=1056, xsum="outside", prefetch=True)


@functools.partial(jax.jit, static_argnames=("group_size", "block_n", "groups_per_step", "split_k", "num_warps",
                                             "num_stages", "min_programs", "xsum", "prefetch", "scales_nk",
                                             "interpret"))
def int4_gemv(x, kcodes, scales, mins=None, *, group_size: int, block_n: int = 256, groups_per_step: int = 2,
              split_k: int | None = None, num_warps: int = 4, num_stages: int = 3, min_programs: int = 1056,
              xsum: str = "outside", prefetch: bool = True, scales_nk: bool = False,
              interpret: bool = False):
    """x [M, K] @ int4 W (kcodes uint8 [N, K/2] from `repack_kmajor`, scales/mins float16 [K/g, N]) -> [M, N] in
    x.dtype.  groups_per_step must divide K/g (it is reduced until it does); split_k None: enough K splits for
    `min_programs` programs; xsum: "outside" | "inside" (where X = sum of x per group is computed); prefetch: load
    the next step's tiles before this step's math (the loop carries them); scales_nk: scales/mins come K-major,
    [N, K/g] (loaded as columns, no transpose in the kernel)."""
    m, k = x.shape
    n, kh = kcodes.shape
    g = group_size
    assert k == 2 * kh and k % g == 0 and g % 8 == 0, (x.shape, kcodes.shape, g)
    assert xsum in ("outside", "inside"), xsum
    n_groups = k // g
    assert scales.shape == ((n, n_groups) if scales_nk else (n_groups, n)), (scales.shape, scales_nk)
    gps = max(1, min(groups_per_step, n_groups))
    while n_groups % gps:
        gps -= 1
    n_steps = n_groups // gps
    n_blocks = -(-n // block_n)
    split_k, steps_per_split = split_plan(n_steps, n_blocks, split_k, min_programs)
    xf = x.astype(jnp.float32)
    out_partial = split_k > 1
    kern = functools.partial(
        _kernel, g=g, bn=block_n, n_cols=n, m=m, steps_per_split=steps_per_split, n_steps=n_steps, gps=gps,
        has_mins=mins is not None, asm=not interpret, out_partial=out_partial, xsum_inside=xsum == "inside",
        prefetch=prefetch, scales_nk=scales_nk,
    )
    out_shape = (jax.ShapeDtypeStruct((split_k, m, n), jnp.float32) if out_partial
                 else jax.ShapeDtypeStruct((m, n), x.dtype))
    args = [xf] + ([] if xsum == "inside" else [xf.reshape(m, n_groups, g).sum(axis=-1)])
    args += [kcodes, scales] + ([mins] if mins is not None else [])
    out = pl.pallas_call(
        kern, out_shape=out_shape, grid=(n_blocks, split_k),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="int4_gemv",
    )(*args)
    if out_partial:
        out = jnp.sum(out, axis=0)
    return out.astype(x.dtype)


def int4_gemv_reference(x, kcodes, scales, mins=None, *, group_size: int):
    """Plain jnp on the K-major codes: dequantize to float32, one float32 dot, result in x.dtype."""
    q = unpack_kmajor(kcodes, group_size).astype(jnp.float32)
    s = jnp.repeat(scales.astype(jnp.float32), group_size, axis=0)
    w = s * (q - 8.0) if mins is None else s * q + jnp.repeat(mins.astype(jnp.float32), group_size, axis=0)
    return jnp.dot(x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST).astype(x.dtype)
