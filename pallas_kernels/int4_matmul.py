"""W4A16 int4 matmul over `lucebox_jax.quant.QuantArray` (Pallas-Triton), on the documented layout directly.

    y [M, N] = x [M, K] @ W [K, N],  W[k, n] = scales[k // g, n] * q[k, n] + mins[k // g, n]   (asymmetric)
                                     W[k, n] = scales[k // g, n] * (q[k, n] - 8)                (symmetric)

`codes` is uint8 [K/2, N], half-split (low nibble of byte (i, n): row i; high nibble: row i + K/2; see README.md).

One kernel, grid (N / block_n, split_k, M / block_m).  A program owns `block_n` columns and a contiguous range of
byte-row tiles of `block_k` rows (block_k divides g, so each tile lies inside one group of the low half and one group
of the high half).  Per tile it loads one [block_k, block_n] uint8 tile (both halves of K in one load: packed bytes,
16-byte vector accesses along N), the two scale rows (and min rows), unpacks the tile into two weight tiles and
accumulates `x_lo @ W_lo + x_hi @ W_hi` in float32.  Split-K partials (float32 [split_k, M, N]) are summed by XLA.

Weight decode ("dequant") variants, `decode=`:
  * "f32":  nibble -> float32 by a bit trick (0x3F800000 | q << 19 == 1 + q/16, no int->float convert),
            W = 16 s * f + (m - 16 s)  (sym: 16 s * f - 24 s) in float32, then cast to x.dtype.
  * "asm":  (GPU, bf16 x only) PTX inline asm: one 32-bit word of 4 packed bytes -> 8 bf16 weights with
            prmt / lop3 (bf16 magic 0x4300 | q == 128 + q), an exact bf16x2 subtract, and one bf16x2 fma/mul
            with the scale (and min): about 2 instructions per weight instead of about 4.
  * "asm_fma": (GPU, mode "fma" only) one PTX inline asm per 4 bytes does the f32 decode, the scale/min and the
            multiply-accumulate with fused FMAs: 4 instructions per weight (experimental: see `_asm_fma`).
Accumulation variants, `mode=`:
  * "dot":  block_m >= 16 rows of x (rows past M masked, not padded) times the decoded tile on the tensor cores.
  * "dot_t": the same product transposed, W^T [bn, bk] @ x^T [bk, bm]: the weight tile is the dot's M side.
  * "fma":  M == 1 only: elementwise x[k] * W[k, n] into a [block_k, block_n] float32 accumulator, one reduction at
            the end (no tensor cores, no layout conversion).
  * "fma_r": M == 1 only: the same, reduced over K every step into a [1, block_n] accumulator.
Scales when block_k > g (`scales_mode=`): "tile" loads [block_k/g, block_n] scales (and mins) per step and
broadcasts them to [block_k, block_n] in registers; "gather" loads [block_k, block_n] per-row gathers (the old way:
pipelined through shared memory, which overflows).  With no masks when block_n divides N.
Split-K reduction (`reduce=`): "xla" writes float32 partials [split_k, M, N] summed by XLA; "ordered" the same
partials summed in split order (`ordered_sum`); "atomic" atomically adds into one zeroed float32 [M, N] buffer (then
one cast).  Tuned configs: see `default_config` / `tuned_config`.
In interpret mode (CPU) "asm" is replaced by the plain-jnp decode (same function up to bf16 rounding), and
"asm_fma" (or "asm_fma" with another mode) by "f32", the same float32 arithmetic.
"""

from __future__ import annotations

import functools
import json
import logging
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lucebox_jax.pending_inputs import gate_up_columns

__all__ = ["int4_matmul", "int4_matmul_reference", "default_config", "tuned_config", "qmatmul_pallas",
           "split_plan", "row_masks", "ordered_sum", "row_invariant_config"]


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, int(v)).bit_length() - 1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def row_masks(m0, bm: int, m_rows: int, cmask, ragged: bool, store: dict):
    """x is not padded to a multiple of bm (a pad and a slice would be two more kernels per call): the row mask
    ([bm] bool, rows >= M read as 0) and the store kwargs with it (rows past M are not written).  (None, store)
    when bm divides M."""
    if m_rows % bm == 0:
        return None, store
    rmask = (m0 + jnp.arange(bm)) < m_rows
    mask = rmask[:, None] & cmask[None, :] if ragged else jnp.broadcast_to(rmask[:, None], (bm, cmask.shape[0]))
    return rmask, dict(mask=mask)


def ordered_sum(parts):
    """parts [S, ...] summed in index order, one add after another (an XLA reduce may tile the sum differently for
    different shapes; this order depends on S alone, so a row's result does not depend on how many rows share it)."""
    out = parts[0]
    for i in range(1, parts.shape[0]):
        out = out + parts[i]
    return out


def split_plan(n_tiles: int, programs: int, split_k: int | None, min_programs: int) -> tuple[int, int]:
    """(split_k, tiles per split) for K cut into `n_tiles` tiles and `programs` programs per split.  split_k None:
    double it until there are `min_programs` programs (each split keeping >= 2 tiles); an explicit split_k is
    clamped to the tile count; then rounded so no split is empty."""
    if split_k is None:
        split_k = 1
        while programs * split_k < min_programs and split_k * 2 <= n_tiles // 2:
            split_k *= 2
    split_k = max(1, min(split_k, n_tiles))
    tiles = _cdiv(n_tiles, split_k)
    return _cdiv(n_tiles, tiles), tiles


# ---------------------------------------------------------------------------------------------------------------
# weight decode
# ---------------------------------------------------------------------------------------------------------------

_F32_ONE = 0x3F800000
_MASK = 0x00780000  # the 4 mantissa bits below 1.0's exponent: (q << 19) & _MASK | 1.0 == 1 + q / 16


def _decode_f32(c, s_lo, s_hi, m_lo, m_hi):
    """uint8 tile [bk, bn] + scales/mins (float32, [1, bn] or [bk, bn]) -> (W_lo, W_hi) float32 [bk, bn]."""
    c32 = c.astype(jnp.uint32)
    f_lo = lax.bitcast_convert_type(((c32 << 19) & _MASK) | _F32_ONE, jnp.float32)  # 1 + q_lo / 16
    f_hi = lax.bitcast_convert_type(((c32 << 15) & _MASK) | _F32_ONE, jnp.float32)  # 1 + q_hi / 16
    (a_lo, b_lo), (a_hi, b_hi) = _affine(s_lo, m_lo), _affine(s_hi, m_hi)
    return f_lo * a_lo + b_lo, f_hi * a_hi + b_hi


def _affine(s, m):
    """(a, b) with W = a f + b for f = 1 + q / 16:  s (q - 8) = 16 s f - 24 s;  s q + m = 16 s f + (m - 16 s)."""
    a = 16.0 * s
    return a, (-24.0 * s if m is None else m - a)


# One 32-bit register ($3 / $2) holds 4 packed code bytes (4 consecutive elements of the tile); the output holds 4
# bf16 in two registers ($0, $1).  t0 = (b0, b1), t1 = (b2, b3) as 16-bit lanes; nibble -> (t & 0x000F000F) |
# 0x43004300 = bf16 128 + q; subtracting 128 (136 for symmetric) is exact in bf16; then one bf16x2 fma (mul) with
# the scale (and min).  Two calls (low, high nibbles): Pallas' lowering of a multi-result inline asm is broken.
def _asm(shift: bool, sym: bool) -> str:
    sh = "shr.b32 t0, t0, 4;\nshr.b32 t1, t1, 4;\n" if shift else ""
    head = (
        "{\n.reg .b32 t0, t1, k0;\n"
        "prmt.b32 t0, $2, 0, 0x4140;\n"
        "prmt.b32 t1, $2, 0, 0x4342;\n" + sh +
        "lop3.b32 t0, t0, 0x000F000F, 0x43004300, 0xEA;\n"
        "lop3.b32 t1, t1, 0x000F000F, 0x43004300, 0xEA;\n"
    )
    if sym:
        return head + (
            "mov.b32 k0, 0x43084308;\n"
            "sub.rn.bf16x2 t0, t0, k0;\nsub.rn.bf16x2 t1, t1, k0;\n"
            "mul.rn.bf16x2 $0, t0, $3;\nmul.rn.bf16x2 $1, t1, $4;\n}"
        )
    return head + (
        "mov.b32 k0, 0x43004300;\n"
        "sub.rn.bf16x2 t0, t0, k0;\nsub.rn.bf16x2 t1, t1, k0;\n"
        "fma.rn.bf16x2 $0, t0, $3, $5;\nfma.rn.bf16x2 $1, t1, $4, $6;\n}"
    )


def _decode_asm(c, s_lo, s_hi, m_lo, m_hi):
    """GPU-only decode to bf16 through PTX inline asm (see _asm); scales/mins float32 [1, bn] or [bk, bn]."""
    shape = c.shape
    bc = lambda v: jnp.broadcast_to(v.astype(jnp.bfloat16), shape)  # noqa: E731
    out = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    res = []
    for hi, s_, m_ in ((False, s_lo, m_lo), (True, s_hi, m_hi)):
        args = [c, bc(s_)] + ([] if m_ is None else [bc(m_)])
        cons = "=r,=r,r,r,r" if m_ is None else "=r,=r,r,r,r,r,r"
        (w,) = plgpu.elementwise_inline_asm(
            _asm(hi, m_ is None), args=args, constraints=cons, pack=4, result_shape_dtypes=[out]
        )
        res.append(w)
    return tuple(res)


def _decode_asm_emulated(c, s_lo, s_hi, m_lo, m_hi):
    """What _decode_asm computes, in jnp (interpret mode): bf16 scale/min, one bf16 rounding of q*s+m."""
    q_lo = (c & 0xF).astype(jnp.float32)
    q_hi = (c >> 4).astype(jnp.float32)
    r = lambda v: v.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    if m_lo is None:
        return ((q_lo - 8.0) * r(s_lo)).astype(jnp.bfloat16), ((q_hi - 8.0) * r(s_hi)).astype(jnp.bfloat16)
    return (q_lo * r(s_lo) + r(m_lo)).astype(jnp.bfloat16), (q_hi * r(s_hi) + r(m_hi)).astype(jnp.bfloat16)


def ptx_nibble_f32(reg: str, word: str, bit: int) -> list[str]:
    """PTX lines: `reg` = float32 1 + q / 16 for the nibble q at `bit` of `word` (shift it to bit 19, then one lop3
    keeps those 4 bits and ORs in 1.0's exponent: no int -> float convert)."""
    d = 19 - bit
    shift = f"shl.b32 {reg}, {word}, {d};" if d >= 0 else f"shr.b32 {reg}, {word}, {-d};"
    return [shift, f"lop3.b32 {reg}, {reg}, {_MASK:#010x}, {_F32_ONE:#010x}, 0xEA;"]


def _asm_fma() -> str:
    """Fused decode + multiply-accumulate for mode "fma" (float32, 4 instructions per weight): per byte b of the
    word $4, acc_b = $(29+b) + x_lo (a_lo f_lo + b_lo) + x_hi (a_hi f_hi + b_hi) with f = 1 + q/16 made by a shift
    and a lop3 (1.0's exponent ORed in), x_lo = $(5+b), x_hi = $(9+b), a_lo/b_lo = $(13+b)/$(17+b), a_hi/b_hi =
    $(21+b)/$(25+b); the result goes to $b.  Why: Pallas-Triton emits the jnp version as a widening, separate
    FMUL and FADD, ~6.8 instructions per weight (ncu, benchmarks/RESULTS.md "Round 4")."""
    lines = ["{", ".reg .b32 t, u;"]
    for b in range(4):
        lines += ptx_nibble_f32("t", "$4", 8 * b) + ptx_nibble_f32("u", "$4", 8 * b + 4) + [
            f"fma.rn.f32 t, t, ${13 + b}, ${17 + b};", f"fma.rn.f32 u, u, ${21 + b}, ${25 + b};",
            f"fma.rn.f32 ${b}, ${5 + b}, t, ${29 + b};", f"fma.rn.f32 ${b}, ${9 + b}, u, ${b};",
        ]
    lines.append("}")
    return "\n".join(lines)


def _fma_asm_step(c, x_lo, x_hi, s_lo, s_hi, m_lo, m_hi, acc):
    """acc [bk, bn] + x_lo W_lo + x_hi W_hi through `_asm_fma` (scales/mins float32 [1, bn] or [bk, bn])."""
    shape = c.shape
    (a_lo, b_lo), (a_hi, b_hi) = _affine(s_lo, m_lo), _affine(s_hi, m_hi)
    bc = lambda v: jnp.broadcast_to(v, shape)  # noqa: E731
    args = [c, bc(x_lo[:, None]), bc(x_hi[:, None]), bc(a_lo), bc(b_lo), bc(a_hi), bc(b_hi), acc]
    (out,) = plgpu.elementwise_inline_asm(
        _asm_fma(), args=args, constraints="=r,=r,=r,=r," + ",".join(["r"] * 29), pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)],
    )
    return out


# ---------------------------------------------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------------------------------------------


def _split_cols(refs, rows, c0, bk, m_rows, st):
    """Columns c0 .. c0 + bk of a split attention's output for `rows`, merged here (`AttentionSplits`): the refs are
    its o [B, Hkv * S * G * D], m and l [B, Hkv * S * G], float32. -> [len(rows), bk] in the output's dtype."""
    o_ref, m_ref, l_ref = refs
    _, hkv, ns, nsp, gq, d, dtype = st
    c = c0 + jnp.arange(bk)
    head = c // d
    s = jnp.arange(nsp)
    mi = ((head // gq)[None, :] * ns + s[:, None]) * gq + (head % gq)[None, :]  # [nsp, bk]: (kv, split, q head)
    mask = (rows < m_rows)[:, None, None] & (s < ns)[None, :, None]
    r = rows[:, None, None]
    o = plgpu.load(o_ref.at[r, (mi * d + (c % d)[None, :])[None]], mask=mask, other=0.0)
    m = plgpu.load(m_ref.at[r, mi[None]], mask=mask, other=_NEG)
    l = plgpu.load(l_ref.at[r, mi[None]], mask=mask, other=0.0)  # noqa: E741
    w = jnp.exp2(m - jnp.max(m, axis=1, keepdims=True))
    l_tot = jnp.sum(w * l, axis=1)
    return (jnp.sum(w * o, axis=1) / jnp.where(l_tot > 0, l_tot, 1.0)).astype(dtype)


def _gated_cols(refs, rows, c0, bk, m_rows, st):
    """Columns c0 .. c0 + bk of the down projection's input for `rows`, made here from gate+up's partial sums
    (`GatedInput`, its arithmetic and roundings): the refs are each part [P * R, 2 I], then row_sumsq [R] if any."""
    _, shapes, ffn, groups, eps, width, has_r, dtype = st
    dt = jnp.dtype(dtype)
    ok = rows < m_rows
    sums = []
    for col in gate_up_columns(c0 + jnp.arange(bk), ffn, groups):  # gate, up
        tot = 0.0
        for ref, (p, r_rows, pp) in zip(refs, shapes):
            q = jnp.arange(pp)
            mask = ok[:, None, None] & (q < p)[None, :, None]
            v = plgpu.load(ref.at[(q[None, :] * r_rows + rows[:, None])[:, :, None], col[None, None, :]], mask=mask,
                           other=0.0)
            tot = tot + jnp.sum(v.astype(jnp.float32), axis=1)
        sums.append(tot)
    if has_r:
        ss = plgpu.load(refs[len(shapes)].at[rows], mask=ok, other=0.0)
        r = lax.rsqrt(ss / width + eps)[:, None]
        sums = [(v.astype(dt).astype(jnp.float32) * r) for v in sums]
    gate, up = (v.astype(dt).astype(jnp.float32) for v in sums)
    return (gate / (1.0 + jnp.exp(-gate)) * up).astype(dt)


_LOADERS = {"splits": _split_cols, "gated": _gated_cols}


_NEG = -1e30  # a masked split's maximum (the attention kernel's)


def _kernel(*refs, k_half, g, bm, bn, bk, n_cols, tiles_per_split, n_tiles, mode, decode, has_mins, out_partial,
            m_rows, scales_mode="tile", reduce="xla", pending=None):
    if reduce == "atomic" and out_partial:  # last input: the zeroed float32 output it aliases (unused here)
        refs = refs[:-2] + refs[-1:]
    pend_refs = None
    if pending is not None:  # x is unfinished (`lucebox_jax.pending_inputs`): finished as it loads (`_LOADERS`);
        n_in = _pending_arrays(pending)  # its last array's ref stays in x's place below, never read as x
        pend_refs, refs = refs[:n_in], refs[n_in - 1:]
        load_pending = functools.partial(_LOADERS[pending[0]], pend_refs, m_rows=m_rows, st=pending)
    if has_mins:
        x_ref, c_ref, s_ref, m_ref, o_ref = refs
    else:
        x_ref, c_ref, s_ref, o_ref = refs
        m_ref = None
    pid_n, pid_k, pid_m = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n0 = pid_n * bn
    cols = n0 + jnp.arange(bn)
    cmask = cols < n_cols
    ragged = n_cols % bn != 0  # no masks at all when block_n divides N
    lm = dict(mask=cmask[None, :], other=0) if ragged else {}
    sm = dict(mask=cmask[None, :]) if ragged else {}
    nh = k_half // g  # groups in the low half
    t0 = pid_k * tiles_per_split
    t1 = jnp.minimum(t0 + tiles_per_split, n_tiles)
    m0 = pid_m * bm
    cdt = jnp.bfloat16 if decode == "asm" else jnp.dtype(pending[-1]) if pending is not None else x_ref.dtype
    rmask, sm = row_masks(m0, bm, m_rows, cmask, ragged, sm)

    def load_x(c0):
        if pend_refs is not None:
            return load_pending(m0 + jnp.arange(bm), c0, bk).astype(cdt)
        if rmask is None:
            return x_ref[pl.ds(m0, bm), pl.ds(c0, bk)].astype(cdt)
        return plgpu.load(x_ref.at[pl.ds(m0, bm), pl.ds(c0, bk)], mask=rmask[:, None], other=0).astype(cdt)

    if bk <= g:  # one scale row per half and tile: [1, bn] loads

        def load_scales(ref, r0):
            j = r0 // g
            lo = plgpu.load(ref.at[pl.ds(j, 1), pl.ds(n0, bn)], **lm)
            hi = plgpu.load(ref.at[pl.ds(j + nh, 1), pl.ds(n0, bn)], **lm)
            return lo.astype(jnp.float32), hi.astype(jnp.float32)

    elif scales_mode == "tile":  # the tile spans bk / g groups: one [bk/g, bn] load, broadcast in registers

        def load_scales(ref, r0):
            j = r0 // g
            ng = bk // g
            lo = plgpu.load(ref.at[pl.ds(j, ng), pl.ds(n0, bn)], **lm).astype(jnp.float32)
            hi = plgpu.load(ref.at[pl.ds(j + nh, ng), pl.ds(n0, bn)], **lm)
            hi = hi.astype(jnp.float32)
            ex = lambda v: jnp.broadcast_to(v[:, None, :], (ng, g, bn)).reshape(bk, bn)  # noqa: E731
            return ex(lo), ex(hi)

    else:  # "gather": per-row gathered [bk, bn] scale loads (L1 hits; pipelined into shared memory: can overflow)

        def load_scales(ref, r0):
            rows = (r0 + jnp.arange(bk)) // g
            lmg = dict(mask=jnp.broadcast_to(cmask[None, :], (bk, bn)), other=0) if ragged else {}
            lo = plgpu.load(ref.at[rows[:, None], cols[None, :]], **lmg)
            hi = plgpu.load(ref.at[rows[:, None] + nh, cols[None, :]], **lmg)
            return lo.astype(jnp.float32), hi.astype(jnp.float32)

    def row_x(c0):  # the one row's x columns c0 .. c0 + bk, float32 (the FMA modes: M == 1)
        if pend_refs is not None:
            return load_pending(jnp.zeros((1,), jnp.int32), c0, bk)[0].astype(jnp.float32)
        return x_ref[0, pl.ds(c0, bk)].astype(jnp.float32)

    def body(t, acc):
        r0 = pl.multiple_of(t * bk, bk)
        c = plgpu.load(c_ref.at[pl.ds(r0, bk), pl.ds(n0, bn)], **lm)
        s_lo, s_hi = load_scales(s_ref, r0)
        m_lo = m_hi = None
        if m_ref is not None:
            m_lo, m_hi = load_scales(m_ref, r0)
        if decode == "asm_fma":  # mode "fma" only (checked by the wrapper)
            x_lo, x_hi = row_x(r0), row_x(k_half + r0)
            return _fma_asm_step(c, x_lo, x_hi, s_lo, s_hi, m_lo, m_hi, acc)
        if decode == "asm":
            w_lo, w_hi = _decode_asm(c, s_lo, s_hi, m_lo, m_hi)
        elif decode == "asm_emulated":
            w_lo, w_hi = _decode_asm_emulated(c, s_lo, s_hi, m_lo, m_hi)
        else:
            w_lo, w_hi = _decode_f32(c, s_lo, s_hi, m_lo, m_hi)
        if mode in ("fma", "fma_r"):
            x_lo, x_hi = row_x(r0), row_x(k_half + r0)
            w_lo, w_hi = w_lo.astype(jnp.float32), w_hi.astype(jnp.float32)
            p = x_lo[:, None] * w_lo + x_hi[:, None] * w_hi
            return acc + (jnp.sum(p, axis=0)[None, :] if mode == "fma_r" else p)
        x_lo, x_hi = load_x(r0), load_x(k_half + r0)
        if mode == "dot_t":  # W^T [bn, bk] @ x^T [bk, bm]: the weight tile is the (large) M-side operand
            dn = (((0,), (1,)), ((), ()))
            acc = acc + lax.dot_general(w_lo.astype(cdt), x_lo, dn, preferred_element_type=jnp.float32)
            return acc + lax.dot_general(w_hi.astype(cdt), x_hi, dn, preferred_element_type=jnp.float32)
        acc = acc + jnp.dot(x_lo, w_lo.astype(cdt), preferred_element_type=jnp.float32)
        return acc + jnp.dot(x_hi, w_hi.astype(cdt), preferred_element_type=jnp.float32)

    if mode == "fma":
        acc = lax.fori_loop(t0, t1, body, jnp.zeros((bk, bn), jnp.float32))
        res = jnp.sum(acc, axis=0)[None, :]
    elif mode == "fma_r":
        res = lax.fori_loop(t0, t1, body, jnp.zeros((1, bn), jnp.float32))
    elif mode == "dot_t":
        res = lax.fori_loop(t0, t1, body, jnp.zeros((bn, bm), jnp.float32)).T
    else:
        res = lax.fori_loop(t0, t1, body, jnp.zeros((bm, bn), jnp.float32))
    if out_partial and reduce == "atomic":  # float32 [m_blocks * bm, n_blocks * bn], zeroed by the caller: no mask
        plgpu.atomic_add(o_ref, (pl.ds(m0, bm), pl.ds(n0, bn)), res)
    elif out_partial:
        plgpu.store(o_ref.at[pid_k, pl.ds(m0, bm), pl.ds(n0, bn)], res, **sm)
    else:
        plgpu.store(o_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], res.astype(o_ref.dtype), **sm)


# Optional tuned table (written by `benchmarks/bench_kernels.py --sections qsweep2` as $OUT/int4_tuned.json and
# copied here): {"entries": {"<M-bucket>:<K>:<N>:<g>:<sym|asym>": {knobs of int4_matmul}}}; M-bucket 1 (M == 1),
# 16 (M <= 16), 64 (M <= 64).  LUCEBOX_INT4_TUNED=<path> points elsewhere; LUCEBOX_INT4_TUNED=off ignores it.
TUNED_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "int4_tuned.json")
_TUNABLE = ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages", "mode", "decode", "min_programs",
            "scales_mode", "reduce")


SMALL_WEIGHT_BYTES = 8 << 20  # int4 codes below this take the latency-bound heuristics (no tuned entry)
SMALL_SPLIT_MAX_N = 1024  # 17-64 rows of small weights split one K tile a program up to this many outputs
SPLIT_ALL = 1 << 12  # split_k is clamped to the number of K tiles: one tile per program


def m_bucket(m: int) -> int | None:
    return 1 if m == 1 else 16 if m <= 16 else 64 if m <= 64 else None


def tuned_key(m: int, k: int, n: int, group_size: int, symmetric: bool) -> str | None:
    mb = m_bucket(m)
    return None if mb is None else f"{mb}:{k}:{n}:{group_size}:{'sym' if symmetric else 'asym'}"


@functools.lru_cache(maxsize=4)
def _load_tuned(path: str) -> dict:
    try:
        with open(path) as f:
            ent = json.load(f).get("entries", {})
        return {key: {kk: v for kk, v in cfg.items() if kk in _TUNABLE} for key, cfg in ent.items()}
    except FileNotFoundError:
        return {}
    except Exception as e:  # noqa: BLE001 - a broken table must not break the kernel
        logging.getLogger(__name__).warning("ignoring int4 tuned table %s (%s: %s)", path, type(e).__name__, e)
        return {}


def tuned_config(m: int, k: int, n: int, group_size: int, symmetric: bool | None = None) -> dict | None:
    """The tuned table's entry for this case (symmetric None: either), or None."""
    path = os.environ.get("LUCEBOX_INT4_TUNED", TUNED_PATH)
    if path.lower() in ("", "0", "off", "none"):
        return None
    table = _load_tuned(path)
    for sym in ((symmetric,) if symmetric is not None else (False, True)):
        key = tuned_key(m, k, n, group_size, sym)
        if key is not None and key in table:
            return dict(table[key])
    return None


def default_config(m: int, k: int, n: int, group_size: int, dtype=jnp.bfloat16, on_gpu: bool = True,
                   symmetric: bool | None = None) -> dict:
    """Tuning knobs: the tuned table's entry (`tuned_config`) when there is one (GPU only), else the heuristics
    picked from the H200 sweep (benchmarks/RESULTS.md, "Kernels (issue 3)").

    M == 1, g < 128: float32 decode + elementwise FMA accumulation (best on qkv g32: 18.7 us vs 20.9 asm/dot);
    M <= 16, g >= 128: asm decode, tensor-core dot, block_k = 128 (one whole group per step), block_n = 64
      (46.0 us vs 64.7-71.2 for every other variant on gate_up 4096x28672 g128 at M = 1);
    M <= 16 otherwise: asm decode + dot, block_k = 32, block_n = 128;  M > 16: 64-row GEMM tiles (the registry
    sends M > 64 to XLA, which is faster there).  Codes under SMALL_WEIGHT_BYTES at M <= 16, or at M <= 64 with at
    most SMALL_SPLIT_MAX_N outputs: one K tile per program (split_k = number of tiles), block_n 64 when M > 1."""
    asm_ok = on_gpu and jnp.dtype(dtype) == jnp.bfloat16
    cfg = dict(block_n=128, block_k=min(32, group_size), split_k=None, num_warps=4, num_stages=4, mode="dot",
               decode="asm" if asm_ok else "f32")
    tuned = tuned_config(m, k, n, group_size, symmetric) if on_gpu else None
    if tuned:
        cfg.update(tuned)
        if cfg.get("decode") == "asm" and not asm_ok:
            cfg["decode"] = "f32"
        return cfg
    if m > 16:
        cfg.update(block_m=64, block_n=128, num_warps=4, num_stages=3)
    elif group_size >= 128 and asm_ok:
        cfg.update(block_n=64, block_k=128)
    elif m == 1:
        cfg.update(mode="fma", decode="f32")
    if on_gpu and (m <= 16 or n <= SMALL_SPLIT_MAX_N) and k * n // 2 < SMALL_WEIGHT_BYTES:
        # small weights (SmolLM2-135M: all of them) are latency-bound: one K tile per program, so each program
        # makes one memory round trip instead of a loop of them (H200: 808 -> 892 tok/s at batch 1, 6,446 ->
        # 7,320 at batch 8 with block_n 64; benchmarks/RESULTS.md, "small weights"). Above 16 rows (a 64-row tile)
        # only for narrow outputs: at 33 rows (H100, 2026-12-05) qkv 5.4 -> 4.2 us, o 5.6 -> 3.7, down 5.6 -> 4.6,
        # but gate_up (N = 3,072) 5.7 -> 6.3
        cfg.update(split_k=SPLIT_ALL)
        if m > 1:
            cfg.update(block_n=64)
    return cfg


@functools.partial(
    jax.jit,
    static_argnames=(
        "group_size", "block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages", "mode", "decode",
        "interpret", "min_programs", "scales_mode", "reduce", "parts",
    ),
)
def int4_matmul(
    x, codes, scales, mins=None, pending=None, *, group_size: int, block_m: int | None = None, block_n: int = 128,
    block_k: int = 32, split_k: int | None = None, num_warps: int = 4, num_stages: int = 4, mode: str = "dot",
    decode: str = "f32", interpret: bool = False, min_programs: int = 528, scales_mode: str = "tile",
    reduce: str = "xla", parts: bool = False,
):
    """x [M, K] @ int4 W (codes uint8 [K/2, N], scales/mins float16 [K/g, N]) -> [M, N] in x.dtype.

    block_k: byte rows per loop step (a power of two dividing K/2; a divisor or a multiple of group_size);
    split_k: K splits (None: enough programs to fill the chip, `min_programs` of them); decode: "f32" | "asm" (GPU,
    bf16) | "asm_fma" (GPU, mode "fma"); mode: "dot" | "dot_t" (W^T x^T: the weight tile is the dot's M side) |
    "fma" | "fma_r" (M == 1 only; "fma_r" reduces over K every step into a [1, block_n] accumulator); scales_mode
    (block_k > g only): "tile" (one [block_k/g, block_n] scale load per step, broadcast in registers) | "gather"
    (per-row gathered loads);
    reduce (split_k > 1): "xla" (float32 partials [split_k, M, N] summed by XLA) | "atomic" (float32 atomic adds
    into one zeroed [M, N] buffer, then one cast);
    parts=True: a tuple of arrays [P, M, N] whose sum over P is the product before its cast (split-K's float32
    partials as the kernel wrote them; `quant.linear_parts`);
    pending: x left unfinished (`lucebox_jax.pending_inputs`: a split decode attention's output, gate+up's partial
    sums; x is then None): each program finishes its x columns as it loads them."""
    if pending is not None:
        x = jax.ShapeDtypeStruct(pending.shape, jnp.dtype(pending.dtype))  # (its shape and dtype only)
    m, k = x.shape
    k_half, n = codes.shape
    g = group_size
    assert k == 2 * k_half, (x.shape, codes.shape)
    assert k_half % g == 0 and (g % block_k == 0 or block_k % g == 0), (k_half, g, block_k)
    assert k_half % block_k == 0, (k_half, block_k)
    assert mode in ("dot", "dot_t", "fma", "fma_r") and reduce in ("xla", "ordered", "atomic"), (mode, reduce)
    assert scales_mode in ("tile", "gather"), scales_mode
    if decode == "asm" and (interpret or x.dtype != jnp.bfloat16):
        decode = "asm_emulated" if x.dtype == jnp.bfloat16 else "f32"
    if mode in ("fma", "fma_r") and m != 1:
        mode = "dot"
    if decode == "asm_fma" and (interpret or mode != "fma"):  # the same float32 arithmetic in jnp
        decode = "f32"
    if mode in ("fma", "fma_r"):
        bm = 1
    else:
        bm = block_m or 16
        bm = max(16, min(bm, 1 << max(4, (m - 1).bit_length())))
    bn = block_n
    n_blocks = _cdiv(n, bn)
    m_blocks = _cdiv(m, bm)
    n_tiles = k_half // block_k
    split_k, tiles_per_split = split_plan(n_tiles, n_blocks * m_blocks, split_k, min_programs)
    out_partial = split_k > 1
    atomic = out_partial and reduce == "atomic"
    kern = functools.partial(
        _kernel, k_half=k_half, g=g, bm=bm, bn=bn, bk=block_k, n_cols=n, tiles_per_split=tiles_per_split,
        n_tiles=n_tiles, mode=mode, decode=decode, has_mins=mins is not None, out_partial=out_partial,
        scales_mode=scales_mode, reduce=reduce, m_rows=m, pending=None if pending is None else _pending_static(pending),
    )
    if atomic:
        out_shape = jax.ShapeDtypeStruct((m_blocks * bm, n_blocks * bn), jnp.float32)
    elif out_partial:
        out_shape = jax.ShapeDtypeStruct((split_k, m, n), jnp.float32)
    else:
        out_shape = jax.ShapeDtypeStruct((m, n), x.dtype)
    xs = [x] if pending is None else _pending_inputs(pending)
    args = xs + [codes, scales] + ([mins] if mins is not None else [])
    aliases = {}
    if atomic:
        aliases = {len(args): 0}
        args.append(jnp.zeros(out_shape.shape, jnp.float32))
    out = pl.pallas_call(
        kern,
        out_shape=out_shape,
        grid=(n_blocks, split_k, m_blocks),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="int4_matmul",
    )(*args)
    if atomic:
        out = out[:m, :n]
    elif out_partial and parts and reduce == "xla":
        return (out,)
    elif out_partial:
        out = ordered_sum(out) if reduce == "ordered" else jnp.sum(out, axis=0)
    return (out[None],) if parts else out.astype(x.dtype)


def _pending_static(p) -> tuple:
    """The kernel's static view of a pending input: ("splits", Hkv, S, S rounded up to a power of two, G, D, dtype)
    or ("gated", ((P, R, P rounded up), ...) a part, I, groups, eps, width, has row_sumsq, dtype)."""
    if p.kind == "splits":
        _, hkv, ns, gq, d = p.o.shape
        return "splits", hkv, ns, 1 << (ns - 1).bit_length(), gq, d, p.dtype
    shapes = tuple((a.shape[0], a.shape[1], 1 << (a.shape[0] - 1).bit_length()) for a in p.parts)
    return "gated", shapes, p.ffn, p.groups, float(p.eps), p.width, p.row_sumsq is not None, p.dtype


def _pending_inputs(p) -> list:
    """A pending input's arrays as the kernel takes them (2-D, rows first)."""
    if p.kind == "splits":
        b = p.o.shape[0]
        return [a.reshape(b, -1) for a in (p.o, p.m, p.l)]
    return [a.reshape(-1, a.shape[-1]) for a in p.parts] + ([p.row_sumsq.astype(jnp.float32)]
                                                             if p.row_sumsq is not None else [])


def _pending_arrays(st: tuple) -> int:
    return 3 if st[0] == "splits" else len(st[1]) + int(st[6])


def int4_matmul_reference(x, codes, scales, mins=None, *, group_size: int):
    """Plain jnp: dequantize to float32, one float32 dot, result in x.dtype."""
    lo = (codes & 0xF).astype(jnp.float32)
    hi = (codes >> 4).astype(jnp.float32)
    q = jnp.concatenate([lo, hi], axis=0)
    s = jnp.repeat(scales.astype(jnp.float32), group_size, axis=0)
    w = s * (q - 8.0) if mins is None else s * q + jnp.repeat(mins.astype(jnp.float32), group_size, axis=0)
    y = jnp.dot(x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)
    return y.astype(x.dtype)


def row_invariant_config(cfg: dict, n_tiles: int, n: int) -> dict:
    """`cfg` made the same for every M: 16-row dot tiles (no one-row FMA path), the split-K the shape would get at
    one row block, fixed, and partials summed in order."""
    cfg = dict(cfg, block_m=16, reduce="ordered")
    if cfg.get("mode") in ("fma", "fma_r"):
        cfg.update(mode="dot", decode="asm" if cfg.get("decode") == "asm_fma" else cfg.get("decode", "f32"))
    cfg["split_k"] = split_plan(n_tiles, _cdiv(n, cfg["block_n"]), cfg.get("split_k"), cfg.get("min_programs", 528))[0]
    return cfg


def qmatmul_pallas(x, w, *, interpret: bool | None = None, row_invariant: bool = False, parts: bool = False,
                   x_pending=None, **overrides):
    """Registry-shaped entry point: x [M, K] @ QuantArray -> [M, N] (x.dtype). row_invariant: one configuration
    for every M (`row_invariant_config`); parts: the product as partial sums (`int4_matmul`); x_pending: x left
    unfinished (`int4_matmul`'s pending; x None)."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    m, k = x.shape if x_pending is None else x_pending.shape
    n = w.codes.shape[1]
    g = w.group_size
    dtype = x.dtype if x_pending is None else jnp.dtype(x_pending.dtype)
    cfg = default_config(16 if row_invariant else m, k, n, g, dtype, on_gpu=not interpret,
                         symmetric=w.mins is None)
    cfg.update(overrides)
    if g & (g - 1) or (k // 2) % g:
        raise ValueError(f"int4_matmul needs a power-of-two group size dividing K/2 (g={g}, K={k})")
    while (k // 2) % cfg["block_k"]:
        cfg["block_k"] //= 2
    if row_invariant:
        cfg = row_invariant_config(cfg, (k // 2) // cfg["block_k"], n)
    if x_pending is not None:
        # finished on the loads only where a program takes one K tile (the small weights' configuration): Triton's
        # software pipeline stages the [rows, splits, block_k] loads in shared memory (8 rows, 8 splits: 305 KB
        # asked of 227), so one stage, which a single tile does not miss; else finished first (a split attention by
        # its combine kernel, gate+up's sums in jnp: the model's own path)
        tiles = (k // 2) // cfg["block_k"]
        if split_plan(tiles, 1, cfg.get("split_k"), cfg.get("min_programs", 528))[1] == 1:
            cfg["num_stages"] = 1
        elif x_pending.kind == "splits":
            from .attention_decode import merge_splits

            x, x_pending = merge_splits(x_pending, interpret=interpret), None
        else:
            x, x_pending = x_pending.merged(), None
    return int4_matmul(x, w.codes, w.scales, w.mins, x_pending, group_size=g, interpret=interpret, parts=parts,
                       **cfg)
