"""Hopper W4A16 / W8A16 matmul in Pallas Mosaic GPU: TMA pipeline, warp specialisation, swap-AB wgmma, group
scales (and mins) applied in registers, split-K; registered as kernel `mgpu` by `lucebox_jax/kernels_mgpu.py`.

Swap-AB: the weight is the wgmma M side (output features n, `tile_m` rows per compute warpgroup) and the activations
x^T the N side (`tile_t` tokens, a multiple of 8, `token_tile`: TMA fills the rows past M with zeros), so a decode
step with one token still fills the tensor-core tile from the weight. The sums are stored transposed, token-major.
The weight is repacked once at load time (`repack`) into a group-major layout whose pipeline step is a clean TMA box:

  codes    int4 (or int8) [K // g, N, g]  signed: c = q - 8 for int4 (the engine's `QuantArray` stores q in 0..15)
  scales   float16/32     [K // g, N]     unchanged from `QuantArray` / `Int8Array` if symmetric; bf16 with mins
  offsets  bf16           [K // g, N]     or None (symmetric): mins + 8 * scales for int4 (folding back the shift,
                                          rounded to the scales' dtype first), mins for int8
  value    = scales * c + offsets

Each pipeline step brings `groups` groups of one CTA's rows: codes [groups, 2 * tile_m, g], their scales and offsets,
and the x rows [tile_t, groups * g] (K-minor; each group's wgmma reads its part as a transposed view, x^T). Per group,
a compute warpgroup loads its [tile_m, g] codes into registers (one of three paths, `LOADS`: the K-permuted `perm`
layout lets 32-bit loads land codes where wgmma wants them), converts them to bf16 (on `perm`, in the `split_decode`
order, by `_decode_split`'s shift, LOP3 and subtract a register), applies the group's per-row scale
(and min) as a row broadcast, and issues one wgmma against the group's x^T; the step's wgmmas are waited for once,
after the last group (`wait_each_group` waits after each, which keeps one group's registers live at a time). With
`scale_after` (symmetric weights) each group's raw codes go into a fresh accumulator instead (a step's groups all
issued before any is read, so one group's conversion overlaps the previous group's wgmma), and its float32 sums are
scaled: tm x tile_t multiplies, not tm x g. Int4 g32 (16-byte rows, too narrow for `perm`) may be stored two groups
a row (`pair`, `repack(k_pair=True)`): the kernel then steps in 64-wide rows and scales each half by its own group.
A work item is (output tile, token tile, K split); with `split_k` > 1 each split writes float32 partial sums that
one small XLA reduction adds. With `stream_k` the grid is instead every tile's K steps laid end to end and cut into
one equal run per CTA (`stream_plan`): one unbroken pipeline per SM, a tile cut between two CTAs summed after from
their float32 partials (`sum_stream_parts`). `reference` is the plain-jnp twin; `qmatmul_mgpu_reference` the same
on the engine's `QuantArray`.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax

from lucebox_jax.quant import Int8Array, QuantArray, unpack_int4


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    tile_m: int = 64  # output features per compute warpgroup (wgmma M: a multiple of 64)
    tile_t: int = 16  # tokens per tile (wgmma N)
    groups: int = 4  # quantization groups per pipeline step
    steps: int = 4  # pipeline stages in flight
    split_k: int = 1  # K splits (each a separate work item; float32 partials summed after)
    compute_wgs: int = 2  # compute warpgroups per CTA, each owning tile_m rows
    lhs_smem: bool = False  # stage the dequantized tile in shared memory for wgmma (interpret mode needs this;
    #                         compiled, not on perm loads: `check_config`)
    wait_each_group: bool = False  # wgmma_wait after every group rather than once per pipeline step
    loads: str = "perm"  # how codes reach the WGMMA register layout (see `LOADS`); follows the weight's `k_perm`
    ctas_per_sm: int = 1  # persistent CTAs launched per SM (2 if shared memory and registers let two reside)
    probe: str = ""  # timing attribution only, results wrong (see `PROBES`); "" is the kernel
    pdl: bool = False  # programmatic dependent launch: the kernel may start while the one before it (which writes
    #                    x) still runs; it prefetches its first weight steps into L2, then waits for that kernel
    scale_after: bool = False  # symmetric weights: wgmma on the raw codes per group, the scale applied in float32 to
    #                            the group's partial sums (tm x tile_t values, not tm x g); asymmetric ones scale before
    stream_k: bool = False  # one pipeline per CTA over an equal share of all (tile, K step) steps, crossing tile
    #                         boundaries (see `stream_plan`); with `split_k` 1: it replaces the K splits
    pair: bool = False  # int4 g32 (Q4_1 / Q4_K imports): codes stored two groups a 32-byte row (`repack(k_pair=True)`),
    #                     so they take the `perm` loads (and `split_decode`) of 64-wide groups; each half of a row is
    #                     scaled by its own group (`_halves`). Like `loads`, the kernel then follows the weight
    split_decode: bool = False  # perm loads: the weight in `perm_k(split=True)` order (`repack(k_split=True)`), each
    #                             register decoded by a shift, a LOP3 and a subtract (`_decode_split`), where
    #                             Mosaic's cast takes a PRMT, a LOP3 and a subtract a register, and a shift a word.
    #                             It asks for that order at repack; like `loads`, the kernel then follows the weight


# How a compute warpgroup brings a [tile_m, g] block of codes from shared memory into wgmma's register layout:
#   narrow  the WGMMA layout directly: 2 codes per shared-memory load (8 bits for int4), converted 2 at a time
#   wide    Mosaic GPU's upcast layout: 8 int4 (4 int8) per 32-bit load, then warp shuffles into the WGMMA layout
#   perm    int4 only: codes stored K-permuted within each 32 (`repack(k_perm=True)`) so that one 32-bit load gives
#           a thread exactly the 8 codes the WGMMA layout wants from it: converted 8 at a time, no shuffles
LOADS = ("narrow", "wide", "perm")

# Variants that leave one stage out, to place the kernel's time by differences (ncu segfaulted on this kernel):
#   skip_scale    codes converted and fed to wgmma unscaled (no scale / offset loads, multiplies or adds)
#   skip_convert  wgmma gets zeros: no code loads from shared memory, no conversion, no scaling (TMA still copies)
#   skip_x        the x^T tile is not copied: the wgmmas read a scratch tile (codes, scales as in the kernel)
#   skip_mma      a step does nothing: the TMA pipeline and its barriers alone (what the skeleton can stream)
PROBES = ("", "skip_scale", "skip_convert", "skip_x", "skip_mma")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MgpuWeight:
    """A weight repacked for this kernel (see the module docstring). `k`, `n`, `group_size`, `bits` are static."""

    codes: jax.Array
    scales: jax.Array
    offsets: jax.Array | None
    group_size: int = dataclasses.field(metadata=dict(static=True), default=32)
    bits: int = dataclasses.field(metadata=dict(static=True), default=4)
    k_perm: bool = dataclasses.field(metadata=dict(static=True), default=False)  # codes stored in `perm_k` order
    k_split: bool = dataclasses.field(metadata=dict(static=True), default=False)  # ... its `split` order (split_decode)
    k_pair: bool = dataclasses.field(metadata=dict(static=True), default=False)  # g32 codes two groups a row (`pair`)

    prepared_by = "mgpu"  # the registered kernel that made it (lucebox_jax.quant.linear dispatches it there)

    @property
    def matmul_op(self) -> str:
        return "qmatmul" if self.bits == 4 else "qmatmul8"

    @property
    def shape(self) -> tuple[int, int]:
        g, n, gs = self.codes.shape
        return (g * gs, n)

    @property
    def nbytes(self) -> int:
        b = self.codes.size * self.bits // 8 + self.scales.size * 2
        sb = self.scales.dtype.itemsize
        return b + self.scales.size * (sb - 2) + (self.offsets.size * sb if self.offsets is not None else 0)


def perm_k(width: int, split: bool = False) -> list[int]:
    """The stored order of K within each 32 for `loads="perm"`: stored column 8q + e of a 32-chunk holds real column
    8 (e // 2) + 2q + e % 2. Mosaic GPU's upcast layout gives lane q of a row the stored columns 8q..8q+7; its WGMMA
    layout wants from lane q the real columns 2q, 2q+1 of each 8 (PTX wgmma register fragments). `split` (for
    `split_decode`): stored 8q + e holds real 8 (e % 4) + 2q + e // 4, so that register i's pair is
    nibbles i and i + 4 of the 32-bit word (bits 4i and 16 + 4i: one shift puts both at the bottom of their 16-bit
    halves)."""
    if split:
        one = [8 * (e % 4) + 2 * q + e // 4 for q in range(4) for e in range(8)]
    else:
        one = [8 * (e // 2) + 2 * q + e % 2 for q in range(4) for e in range(8)]
    return [32 * c + j for c in range(width // 32) for j in one]


def perm_ok(g: int, bits: int) -> bool:
    """`loads="perm"` needs int4 rows of at least 32 bytes (swizzled shared memory): groups of 64, 128, 256."""
    return bits == 4 and g % 64 == 0 and g <= 256


def unperm_k(a: jax.Array, split: bool = False) -> jax.Array:
    """Stored (`perm_k`) order -> real K order along the last axis (a multiple of 32)."""
    *lead, g = a.shape
    if split:
        a = a.reshape(*lead, g // 32, 4, 2, 4)  # chunk, lane q, e // 4, e % 4 -> chunk, e % 4, q, e // 4
        return jnp.transpose(a, (*range(len(lead)), len(lead), len(lead) + 3, len(lead) + 1, len(lead) + 2)
                             ).reshape(*lead, g)
    a = a.reshape(*lead, g // 32, 4, 4, 2)  # chunk, lane q, pair e // 2, e % 2
    return jnp.swapaxes(a, -3, -2).reshape(*lead, g)


# LUCEBOX_MGPU_SCALES (read at import; an A/B knob): `stored` keeps a weight-with-mins' scales and offsets in the
# scales' own dtype, as before the bf16 default (the kernel then converts them every step; the same values)
BF16_SCALES = os.environ.get("LUCEBOX_MGPU_SCALES", "bf16") != "stored"


def repack(w, k_perm: bool = False, k_split: bool = False, k_pair: bool = False) -> MgpuWeight:
    """QuantArray (half-split uint8 [K/2, N]) or Int8Array ([K, N]) -> group-major signed codes [K/g, N, g];
    `k_perm` (int4, `perm_ok`) stores each group's K in `perm_k` order for `loads="perm"` (`k_split`: its split
    order, for `split_decode`); `k_pair` (int4 g32, with `k_perm`) two groups a row, codes [K/64, N, 64]."""
    g = w.group_size
    offsets = None
    if isinstance(w, QuantArray):
        q = unpack_int4(w.codes).astype(jnp.int8) - 8  # [K, N] in -8..7
        bits = 4
        if w.mins is not None:
            offsets = w.mins.astype(jnp.float32) + 8.0 * w.scales.astype(jnp.float32)
    elif isinstance(w, Int8Array):
        q, bits, offsets = w.codes, 8, w.mins
    else:
        raise TypeError(f"mgpu repack takes QuantArray or Int8Array, not {type(w).__name__}")
    if offsets is not None:
        offsets = offsets.astype(w.scales.dtype)
    k, n = q.shape
    if k_pair and not (bits == 4 and g == 32 and k_perm and k % 64 == 0):
        raise ValueError(f"k_pair needs k_perm and int4 codes in groups of 32 (K a multiple of 64), not {bits}-bit "
                         f"g{g}")
    cg = 2 * g if k_pair else g  # the stored row: one group, or two
    codes = q.reshape(k // cg, cg, n).transpose(0, 2, 1)
    if k_split and not k_perm:
        raise ValueError("k_split is an order of k_perm: pass both")
    if k_perm:
        if not perm_ok(cg, bits):
            raise ValueError(f"k_perm needs int4 codes in groups of 64, 128 or 256, not {bits}-bit g{g}")
        codes = codes[:, :, jnp.asarray(perm_k(cg, k_split))]
    codes = codes.astype(jnp.int4) if bits == 4 else codes.astype(jnp.int8)
    scales = w.scales
    if offsets is not None and BF16_SCALES:
        # with mins the kernel always scales before the wgmma, in bf16: stored so, it loads them ready (the same
        # values it rounded to before; 48 fewer SASS instructions a step at 8B gate+up g32, `benchmarks/mgpu_ptx.py`)
        scales, offsets = scales.astype(jnp.bfloat16), offsets.astype(jnp.bfloat16)
    return MgpuWeight(codes=codes, scales=scales, offsets=offsets, group_size=g, bits=bits, k_perm=k_perm,
                      k_split=k_split, k_pair=k_pair)


def dequantize_mgpu(w: MgpuWeight, dtype=jnp.float32) -> jax.Array:
    """The repacked weight as a dense [K, N] array (plain jnp; the reference semantics)."""
    c = w.codes.astype(jnp.float32)  # [K/g, N, g] ([K/2g, N, 2g] paired)
    if w.k_perm:
        c = unperm_k(c, w.k_split)
    if w.k_pair:  # -> one group a row
        kp, n, cg = c.shape
        c = c.reshape(kp, n, 2, cg // 2).transpose(0, 2, 1, 3).reshape(2 * kp, n, cg // 2)
    s = w.scales.astype(jnp.float32)[:, :, None]
    v = c * s
    if w.offsets is not None:
        v = v + w.offsets.astype(jnp.float32)[:, :, None]
    kg, n, g = c.shape
    return v.transpose(0, 2, 1).reshape(kg * g, n).astype(dtype)


def reference(x: jax.Array, w: MgpuWeight) -> jax.Array:
    """Plain-jnp twin of `mgpu_matmul`: x [M, K] @ dequantized w, float32 accumulation, x.dtype out."""
    return jnp.dot(x, dequantize_mgpu(w, x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def check_config(k: int, n: int, g: int, bits: int, cfg: MgpuConfig) -> str | None:
    """Why `cfg` cannot serve this shape, or None."""
    cta_m = cfg.tile_m * cfg.compute_wgs
    if cfg.tile_m % 64:
        return f"tile_m {cfg.tile_m} is not a multiple of 64"
    if cfg.probe not in PROBES:
        return f"probe {cfg.probe!r} is not one of {PROBES}"
    if cfg.compute_wgs not in (1, 2):  # 4 warpgroups of 64 rows hung on the H200 (2026-12-03, fourth session)
        return f"compute_wgs {cfg.compute_wgs}: only 1 or 2 compute warpgroups run"
    if n % cta_m:
        return f"N {n} is not a multiple of the CTA tile {cta_m}"
    if cta_m > 256:  # the scales' TMA box spans the CTA's rows; Mosaic GPU's async copies take at most 256 a dimension
        return f"a CTA of {cta_m} rows: TMA boxes take at most 256"
    if g % 16 or g * bits // 8 < 16:
        return f"group {g} too small for a TMA box of {bits}-bit codes (needs >= 16 bytes and a multiple of 16)"
    if cfg.pair and not (bits == 4 and g == 32 and cfg.loads == "perm" and not cfg.scale_after):
        return "pair takes int4 groups of 32 on perm loads, without scale_after"
    cg = 2 * g if cfg.pair else g  # a stored row of codes: the K a `groups` step counts in
    if k % cg:
        return f"K {k} is not a multiple of the group {g}" + (" pair" if cfg.pair else "")
    kg = k // cg
    if kg % (cfg.groups * cfg.split_k):
        return f"{kg} groups do not split into {cfg.split_k} splits of steps of {cfg.groups} groups"
    if cfg.tile_t % 8 or cfg.tile_t > 256:  # wgmma N; the x tile's rows (K-minor, 8-row TMA tiling)
        return f"tile_t {cfg.tile_t} must be a multiple of 8 up to 256"
    if cfg.stream_k and cfg.split_k != 1:
        return "stream_k takes split_k 1 (it splits K itself)"
    if cfg.lhs_smem and cfg.loads == "perm":  # (interpret mode stages the tile in shared memory on any config)
        return "lhs_smem on perm loads: undoing the stored K order takes a transpose Mosaic GPU does not lower"
    if cfg.split_decode and not (cfg.loads == "perm" and perm_ok(cg, bits)):
        return "split_decode needs perm loads (int4 in groups of 64, 128 or 256, or of 32 paired)"
    return None


def stream_plan(tiles: int, steps_per_tile: int, ctas: int) -> tuple[int, int, "np.ndarray"]:
    """Stream-K: the tiles' K steps laid end to end (tile-major), cut into equal runs of `per_cta` steps, one run per
    CTA, so every SM streams the same number of bytes through one unbroken pipeline (a grid of whole work items
    leaves SMs idle in its last wave: gate+up's 112 tiles on 132 SMs, down's 256 split-K items in 1.9 waves). A tile
    cut between CTAs gets one float32 partial sum from each, in slots 0, 1, ... of a [parts, M, N] output, summed
    after. Returns (per_cta, ctas used, written [parts, tiles] bool: which slots each tile's CTAs write)."""
    import numpy as np

    total = tiles * steps_per_tile
    per_cta = -(-total // max(1, min(ctas, total)))
    first = np.arange(tiles) * steps_per_tile // per_cta  # the CTA that starts each tile
    last = ((np.arange(tiles) + 1) * steps_per_tile - 1) // per_cta
    parts = int((last - first).max()) + 1
    written = np.arange(parts)[:, None] <= (last - first)[None, :]
    return per_cta, -(-total // per_cta), written


def sum_stream_parts(out: jax.Array, written, tile_rows: int, tile_cols: int) -> jax.Array:
    """Adds a stream-K kernel's partial sums [parts, rows, N]: only the slots a tile's CTAs wrote (`written`
    [parts, tiles], tiles numbered column tile major, then row tile); the others hold whatever memory held."""
    import numpy as np

    parts, rows, n = out.shape
    t_tiles = -(-rows // tile_rows)
    w = np.asarray(written).reshape(parts, n // tile_cols, t_tiles)[:, :, np.arange(rows) // tile_rows]
    mask = jnp.asarray(w.transpose(0, 2, 1))[:, :, :, None]  # [parts, rows, column tiles, 1]: small
    out = out.reshape(parts, rows, n // tile_cols, tile_cols)
    return jnp.where(mask, out, 0.0).sum(axis=0).reshape(rows, n)


def load_mode(cfg: MgpuConfig, w: MgpuWeight) -> str:
    """The load path that serves `w`: a K-permuted weight needs `perm`; `perm` asked of a plain one (int8, int4 g32)
    runs `narrow`, which the H200 timed 5-12% faster than `wide` in every pair (round 3, benchmarks/RESULTS.md)."""
    if cfg.loads not in LOADS:
        raise ValueError(f"MgpuConfig.loads {cfg.loads!r} is not one of {LOADS}")
    if w.k_perm:
        return "perm"
    return "narrow" if cfg.loads == "perm" else cfg.loads


def _as_wgmma_layout(a: jax.Array) -> jax.Array:
    """Relabels a [rows, 32j] array loaded in the upcast-4x layout as the WGMMA layout without moving data: with
    codes stored in `perm_k` order, lane q's 8 values of a 32-chunk are the real columns lane q owns in the WGMMA
    layout's four 8-column tiles, two each (its register for column tile 4c + i is slice 2i:2i+2 of chunk c's)."""
    import jax.experimental.mosaic.gpu as mgpu
    import jax.experimental.pallas.mosaic_gpu as plgpu
    import numpy as np
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
                       return_type=plgpu.ShapeDtypeStruct(a.shape, a.dtype, layout=plgpu.Layout.WGMMA))
    def relabel(_, x):
        out = np.empty(mgpu.WGMMA_LAYOUT.registers_shape(a.shape), dtype=object)
        for idx in np.ndindex(out.shape):
            src = x.registers[(idx[0], idx[1] // 4, *idx[2:])]
            out[idx] = mgpu_utils.vector_slice(src, slice(2 * (idx[1] % 4), 2 * (idx[1] % 4) + 2))
        return mgpu.FragmentedArray(_registers=out, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    return relabel(a)


def _decode_split(a: jax.Array) -> jax.Array:
    """int4 codes [rows, 32j] loaded in the upcast-4x layout, stored in `perm_k(split=True)` order -> bf16 codes in
    the WGMMA layout. Register i of a 32-bit word w of 8 codes is (w >> 4i) & 0x000F000F ^ 0x43084308 (one SHF, none
    for i = 0, and one LOP3: the codes of nibbles i and i + 4 in the low bits of each 16-bit half, the sign bit
    flipped, the exponent of 128 set, i.e. c + 136 as bf16), minus 136 as bf16x2 (0x43084308)."""
    import jax.experimental.mosaic.gpu as mgpu
    import jax.experimental.pallas.mosaic_gpu as plgpu
    import numpy as np
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
                       return_type=plgpu.ShapeDtypeStruct(a.shape, jnp.bfloat16, layout=plgpu.Layout.WGMMA))
    def decode(_, x):
        i32 = ir.IntegerType.get_signless(32)
        bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
        out = np.empty(mgpu.WGMMA_LAYOUT.registers_shape(a.shape), dtype=object)
        words = {}
        for idx in np.ndindex(out.shape):
            src = (idx[0], idx[1] // 4, *idx[2:])
            if src not in words:
                words[src] = mgpu_utils.bitcast(x.registers[src], i32)
            i = idx[1] % 4
            shift = f"shr.b32 t, $1, {4 * i};" if i else "mov.b32 t, $1;"
            last = "lop3.b32 t, t, 0x000F000F, 0x43084308, 0x6a; mov.b32 b, 0x43084308; sub.bf16x2 $0, t, b;"
            r = llvm.inline_asm(i32, [words[src]], f"{{ .reg .b32 t, b; {shift} {last} }}", "=r,r")
            out[idx] = mgpu_utils.bitcast(r, bf16x2)
        return mgpu.FragmentedArray(_registers=out, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    return decode(a)


def _halves(a: jax.Array, b: jax.Array, interpret: bool = False) -> jax.Array:
    """Two [rows, 2h] arrays in the WGMMA layout -> columns :h of `a` and h: of `b` (a paired row's two groups). In
    the WGMMA layout a register holds two columns of one 8-column tile, and the tiles are the registers' second axis:
    the result only relabels registers, no instruction runs."""
    if interpret:
        h = a.shape[1] // 2
        return jnp.concatenate([a[:, :h], b[:, h:]], axis=1)
    import jax.experimental.mosaic.gpu as mgpu
    import jax.experimental.pallas.mosaic_gpu as plgpu
    import numpy as np

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA),
                       return_type=plgpu.ShapeDtypeStruct(a.shape, a.dtype, layout=plgpu.Layout.WGMMA))
    def pick(_, x, y):
        regs = np.empty(x.registers.shape, dtype=object)
        half = x.registers.shape[1] // 2  # 8-column tiles of the first group
        for idx in np.ndindex(regs.shape):
            regs[idx] = (x if idx[1] < half else y).registers[idx]
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    return pick(a, b)


def _same_kernel_same_name() -> None:
    """jax 0.11.2 names every Pallas Mosaic-GPU kernel it lowers `kernel_<counter>` inside the module (the attribute
    `mosaic_gpu.dump_basename`), so the 32 layers' identical kernels hash differently and each is compiled on its
    own: the H200 took 150-160 s to compile an 8B decode step that used this kernel. Naming a module after its
    contents, before jax's counter does, makes identical kernels identical modules (one hash, one compile). Only the
    name of jax's debug dump files changes."""
    import hashlib

    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir

    dialect = mgpu.dialect
    original = getattr(dialect, "get_or_set_dump_options", None)
    if original is None or getattr(original, "_lucebox", False):
        return

    def named(module):
        attrs = module.operation.attributes
        if "mosaic_gpu.dump_basename" not in attrs:
            digest = hashlib.sha256(str(module).encode()).hexdigest()[:16]
            attrs["mosaic_gpu.dump_basename"] = ir.StringAttr.get(f"mosaic_gpu_{digest}", module.context)
        return original(module)

    named._lucebox = True
    dialect.get_or_set_dump_options = named


def mgpu_matmul(x: jax.Array, w: MgpuWeight, cfg: MgpuConfig = MgpuConfig(), *, num_sms: int = 132,
                interpret: bool = False, parts: bool = False):
    """x [M, K] (bf16) @ w -> [M, N] in x.dtype, on a Hopper GPU (Mosaic GPU).
    parts=True: a tuple of arrays [P, R, N] (R >= M rows; rows past M are not the product's) whose sum over P is
    the product before its cast: split-K's float32 partials as the kernel wrote them, else the product as one part
    (`quant.linear_parts`)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    _same_kernel_same_name()
    m, k = x.shape
    k2, n = w.shape
    if k != k2:
        raise ValueError(f"x has K = {k}, the weight {k2}")
    g, bits = w.group_size, w.bits
    cfg = dataclasses.replace(cfg, pair=w.k_pair)  # like the load path, the rows follow the weight
    why = check_config(k, n, g, bits, cfg)
    if why:
        raise ValueError(f"mgpu_matmul config {cfg} cannot serve K={k} N={n} g={g}: {why}")
    cg = w.codes.shape[-1]  # the K of a stored row of codes: the group, or two paired
    sg = cg // g  # scale groups a row
    tm, tt, gps, wgs, splits = cfg.tile_m, cfg.tile_t, cfg.groups, cfg.compute_wgs, cfg.split_k
    cta_m = tm * wgs
    mp = _round_up(max(m, 1), tt)
    n_tiles, t_tiles = n // cta_m, mp // tt
    steps_per_split = k // cg // gps // splits
    work = n_tiles * t_tiles * splits
    asym = w.offsets is not None
    stream = cfg.stream_k
    if stream:  # (split_k is 1: steps_per_split is a tile's K steps)
        per_cta, stream_ctas, written = stream_plan(n_tiles * t_tiles, steps_per_split, num_sms * cfg.ctas_per_sm)
    want_parts, n_parts = parts, written.shape[0] if stream else splits  # float32 partial sums per output element
    out_dtype = jnp.float32 if n_parts > 1 else jnp.bfloat16
    # On the GPU x [M, K] goes in as it is and the output comes out token-major, [M, N]: a token tile reaching past M
    # reads zeros (TMA fills rows out of bounds) and its writes past row M are dropped. A decode step then runs no pad,
    # transpose or slice kernel around each matmul (4 pads per layer, 1.5-2.2 us each on the H200), and split-K
    # partials are M rows, not 16. TMA takes a dimension smaller than the shared-memory tile's or a multiple of it:
    # past 8 rows, x and the output are padded to a multiple of 8. The interpreter clamps slices instead of filling
    # them: there x is padded to whole token tiles.
    direct = interpret is False
    xr = (m if m <= 8 else _round_up(m, 8)) if direct else mp
    xp = x.astype(jnp.bfloat16)
    xp = xp if xr == m else jnp.pad(xp, ((0, xr - m), (0, 0)))  # [M (or padded rows), K]

    code_swz = plgpu.find_swizzle(cg * bits, "lhs")
    x_swz = min(plgpu.find_swizzle(cg * 16, "rhs"), 128)  # x rows are K-minor: a group's K is one or more swizzle tiles
    out_swz = min(plgpu.find_swizzle(tm * jnp.dtype(out_dtype).itemsize * 8, "out"), 128)
    code_tf = (plgpu.TilingTransform((8, code_swz * 8 // bits)),)
    if code_swz >= 32:  # a 16-byte row (int4, g = 32) takes no swizzle
        code_tf += (plgpu.SwizzleTransform(code_swz),)
    x_tf = (plgpu.TilingTransform((8, x_swz * 8 // 16)), plgpu.SwizzleTransform(x_swz))
    out_bits = jnp.dtype(out_dtype).itemsize * 8
    out_tf = (plgpu.TilingTransform((8, out_swz * 8 // out_bits)), plgpu.SwizzleTransform(out_swz))
    lhs_smem = cfg.lhs_smem or interpret is not False
    scaled = cfg.probe not in ("skip_scale", "skip_convert")  # (skip_x and skip_mma keep the kernel's scaling)
    after = cfg.scale_after and w.offsets is None and scaled
    wide_layout = plgpu.Layout.WGMMA_UPCAST_4X if bits == 4 else plgpu.Layout.WGMMA_UPCAST_2X
    loads = load_mode(cfg, w)
    a_swz = plgpu.find_swizzle(cg * 16, "lhs")
    a_tf = (plgpu.TilingTransform((8, a_swz * 8 // 16)), plgpu.SwizzleTransform(a_swz))

    copy_x = cfg.probe != "skip_x"

    def kernel(x_gmem, c_gmem, s_gmem, *rest, out_smem, a_smem=None, x_scratch=None):
        if asym:
            mn_gmem, out_gmem = rest
        else:
            (out_gmem,), mn_gmem = rest, None
        if cfg.pdl and not lhs_smem:
            # Launched early (PDL), before the kernel that writes x has finished: the weights do not depend on it, so
            # this CTA's first work item's first `steps` steps of codes go to L2 now; nothing reads x before the wait
            # (a stream-K CTA's first step sits anywhere in a tile: it only waits)
            if not stream:
                first = lax.axis_index("sm")
                g0 = (first % splits) * steps_per_split * gps
                pre = min(cfg.steps, steps_per_split) * gps
                plgpu.async_prefetch(c_gmem.at[pl.ds(g0, pre), pl.ds(first // splits // t_tiles * cta_m, cta_m), :])
            plgpu.griddepcontrol_wait()
            plgpu.griddepcontrol_launch_dependents()  # the next kernel's own launch may overlap this one's tail

        def pipeline(body, context, at=None):
            # at(step) -> (column tile, token tile, K step) for a stream-K run over whole arrays; None: one work item's
            # slices, stepping along K
            at = at or (lambda st: (0, 0, st))
            specs = [
                plgpu.BlockSpec((gps, cta_m, cg), lambda st: (at(st)[2], at(st)[0], 0), transforms=code_tf),
                plgpu.BlockSpec((gps * sg, cta_m), lambda st: (at(st)[2], at(st)[0])),
            ]
            if asym:
                specs.append(plgpu.BlockSpec((gps * sg, cta_m), lambda st: (at(st)[2], at(st)[0])))
            if copy_x:
                specs.append(plgpu.BlockSpec((tt, gps * cg), lambda st: (at(st)[1], at(st)[2]), transforms=x_tf))
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(per_cta if stream else steps_per_split,), memory_registers=40, in_specs=specs,
                wg_axis="wg", num_compute_wgs=wgs, max_concurrent_steps=cfg.steps, compute_context=context)

        ignore = lambda *_, **__: None  # noqa: E731
        gmem_args = (c_gmem, s_gmem) + ((mn_gmem,) if asym else ()) + ((x_gmem,) if copy_x else ())

        def step(c_smem, s_smem, mn_smem, x_smem, acc_ref):
            """One pipeline step's groups into acc_ref (a wgmma accumulator; with `after`, a float32 array)."""
            if cfg.probe == "skip_mma":
                return acc_ref
            wrows = pl.ds(lax.axis_index("wg") * tm, tm)
            row_layout = plgpu.Layout.WGMMA.reduce(1)

            def per_row(ref, j):  # row j's per-output values over its [tm, cg] codes (paired: each half its own)
                vals = [lax.broadcast_in_dim(plgpu.load(ref.at[j * sg + h, wrows], layout=row_layout)
                                             .astype(jnp.bfloat16), (tm, cg), (0,)) for h in range(sg)]
                return vals[0] if sg == 1 else _halves(*vals, interpret=interpret is not False)

            def operand(j):  # row j's [tm, cg] codes in wgmma's register layout, scaled unless `after`
                # bf16 math: the H200 timed float32 dequantization at up to 1.8x the kernel time (round 2)
                if cfg.probe == "skip_convert":
                    wq = plgpu.layout_cast(jnp.full((tm, cg), 0, jnp.bfloat16), plgpu.Layout.WGMMA)
                elif lhs_smem or loads == "narrow":  # interpret mode undoes a stored K order in jnp
                    wq = c_smem[j, wrows, :].astype(jnp.bfloat16)
                    wq = unperm_k(wq, w.k_split) if w.k_perm else wq
                elif loads == "wide":
                    wq = plgpu.load(c_smem.at[j, wrows, :], layout=wide_layout)
                    wq = plgpu.layout_cast(wq, plgpu.Layout.WGMMA).astype(jnp.bfloat16)
                else:
                    wq = plgpu.load(c_smem.at[j, wrows, :], layout=plgpu.Layout.WGMMA_UPCAST_4X)
                    # like the load path, the decode follows the weight (repacked once, for M = 1's configuration)
                    wq = _decode_split(wq) if w.k_split else _as_wgmma_layout(wq.astype(jnp.bfloat16))
                wv = wq if not scaled or after else wq * per_row(s_smem, j)
                if asym and scaled:  # (`after` is never asymmetric)
                    wv = wv + per_row(mn_smem, j)
                if lhs_smem:  # (one buffer per group: a later group must not overwrite an unread one)
                    a_smem[lax.axis_index("wg"), j] = wv
                    plgpu.commit_smem()
                    wv = a_smem.at[lax.axis_index("wg"), j]
                return wv

            def x_rows(j):  # row j's x^T [cg, tt]: a transposed view of the K-minor tile
                return x_smem.at[:, pl.ds(j * cg, cg)].transpose((1, 0))

            if after:
                # every group's wgmma into its own accumulator before any is read, so group j + 1's loads
                # and conversion overlap group j's wgmma; the first read waits for them all
                def group_mmas(*gaccs):
                    for j, gacc in enumerate(gaccs):
                        plgpu.wgmma(gacc, operand(j), x_rows(j))
                    return tuple(gacc[...] for gacc in gaccs)

                grp_sums = pl.run_scoped(group_mmas, *[plgpu.ACC((tm, tt), jnp.float32) for _ in range(gps)])
                for j, part in enumerate(grp_sums):
                    sc = plgpu.load(s_smem.at[j, wrows], layout=row_layout).astype(jnp.float32)
                    acc_ref = acc_ref + part * lax.broadcast_in_dim(sc, (tm, tt), (0,))  # an array here
                return acc_ref
            for j in range(gps):
                plgpu.wgmma(acc_ref, operand(j), x_rows(j))
                if cfg.wait_each_group or j == gps - 1:
                    plgpu.wgmma_wait(0)
            return acc_ref

        def smem_refs(refs):  # a body's refs after the scales -> (mins or None, x tile, carry)
            refs = refs if copy_x else refs[:-1] + (x_scratch, refs[-1])
            return refs if asym else (None,) + tuple(refs)

        def store(acc, slot, n_idx, t_idx):
            """A compute warpgroup's [tm, tt] sums into output slot `slot` (split or stream part), stored transposed:
            the output is token-major [M, N], as the model wants it (the transposed WGMMA layout holds each thread's
            values in pairs of rows: whole vectors there)."""
            wg = lax.axis_index("wg")
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            out_smem.at[wg].transpose((1, 0))[...] = plgpu.layout_cast(acc.astype(out_dtype),
                                                                      plgpu.Layout.WGMMA_TRANSPOSED)
            plgpu.commit_smem()
            dst = out_gmem.at[slot] if n_parts > 1 else out_gmem
            plgpu.copy_smem_to_gmem(out_smem.at[wg], dst.at[pl.ds(t_idx * tt, tt), pl.ds(n_idx * cta_m, cta_m)]
                                    .at[:, pl.ds(wg * tm, tm)])

        def zeros():
            return plgpu.layout_cast(jnp.full((tm, tt), 0, jnp.float32), plgpu.Layout.WGMMA)

        @functools.partial(pl.run_scoped, allocs=pipeline(ignore, ignore).get_allocations(*gmem_args),
                           collective_axes="wg")
        def _scope(allocs):
            if stream:
                # one pipeline over this CTA's run of global steps; at a tile's last step (or the run's) the sums so
                # far go to this CTA's slot of that tile and the carry starts again from zero
                total = n_tiles * t_tiles * steps_per_split
                base = lax.axis_index("sm") * per_cta

                def at(st):
                    gs = jnp.minimum(base + st, total - 1)  # (the last CTA's run may reach past the end: reloads)
                    lin = gs // steps_per_split
                    return lin // t_tiles, lin % t_tiles, gs % steps_per_split

                def body(idx, c_smem, s_smem, *refs):
                    mn_smem, x_smem, carry = smem_refs(refs)
                    if after:
                        carry = step(c_smem, s_smem, mn_smem, x_smem, carry)
                    else:
                        def one(acc_ref):
                            step(c_smem, s_smem, mn_smem, x_smem, acc_ref)
                            return acc_ref[...]

                        carry = carry + pl.run_scoped(one, plgpu.ACC((tm, tt), jnp.float32))
                    (st,) = idx
                    gs = base + st
                    lin = jnp.minimum(gs, total - 1) // steps_per_split
                    ends = (gs % steps_per_split == steps_per_split - 1) | (st == per_cta - 1)

                    @pl.when(ends & (gs < total))
                    def _():
                        slot = lax.axis_index("sm") - lin * steps_per_split // per_cta
                        store(carry, slot, lin // t_tiles, lin % t_tiles)

                    return carry * jnp.where(ends, 0.0, 1.0).astype(jnp.float32)

                pipeline(body, lambda run: run(zeros()), at)(*gmem_args, allocations=allocs)
                return

            @plgpu.nd_loop((work,), collective_axes="sm")
            def _work(info):
                (idx,) = info.index
                split = idx % splits
                rest_idx = idx // splits
                t_idx = rest_idx % t_tiles
                n_idx = rest_idx // t_tiles
                grp = pl.ds(split * steps_per_split * gps, steps_per_split * gps)
                rows = pl.ds(n_idx * cta_m, cta_m)
                toks = pl.ds(t_idx * tt, tt)
                kr = pl.ds(split * steps_per_split * gps * cg, steps_per_split * gps * cg)
                grp_s = pl.ds(split * steps_per_split * gps * sg, steps_per_split * gps * sg)

                def context(run):
                    if after:  # the carry is the float32 sum in registers; each group's wgmma gets a fresh ACC
                        store(run(zeros()), split, n_idx, t_idx)
                        return

                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tt), jnp.float32))
                    def _acc(acc_ref):
                        run(acc_ref)
                        store(acc_ref[...], split, n_idx, t_idx)

                def body(_, c_smem, s_smem, *refs):
                    return step(c_smem, s_smem, *smem_refs(refs))

                args = [c_gmem.at[grp, rows, :], s_gmem.at[grp_s, rows]]
                if asym:
                    args.append(mn_gmem.at[grp_s, rows])
                if copy_x:
                    args.append(x_gmem.at[toks, kr])
                pipeline(body, context)(*args, allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    out_shape = (n_parts, xr, n) if n_parts > 1 else (xr, n)
    f = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid=(stream_ctas if stream else min(num_sms * cfg.ctas_per_sm, work),),
        grid_names=("sm",),
        num_threads=wgs + 1,
        thread_name="wg",
        interpret=interpret,
        # `perm` needs inline Mosaic GPU (lane semantics); the others keep the upstream kernel's warpgroup semantics
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane if loads == "perm"
                                             and not lhs_smem else plgpu.LoweringSemantics.Warpgroup),
        scratch_types=dict(out_smem=plgpu.SMEM((wgs, tt, tm), out_dtype, transforms=out_tf),
                           **({"a_smem": plgpu.SMEM((wgs, gps, tm, cg), jnp.bfloat16, transforms=a_tf)}
                              if lhs_smem else {}),
                           **({} if copy_x else {"x_scratch": plgpu.SMEM((tt, gps * cg), jnp.bfloat16,
                                                                         transforms=x_tf)})),
    )
    args = (xp, w.codes, w.scales) + ((w.offsets,) if asym else ())
    out = f(*args)
    if want_parts and n_parts > 1 and not stream:
        return (out,)
    if stream and n_parts > 1:
        out = sum_stream_parts(out, written, tt, cta_m)
    elif n_parts > 1:
        out = out.sum(axis=0)
    return (out[None],) if want_parts else out[:m].astype(x.dtype)


def token_tile(m: int, g: int) -> int:
    """Tokens per tile (wgmma N) for M rows: 16 for decode (8 timed no faster at one row), wider for more rows: 40 for
    a tree of 32 nodes and its root (33 rows, padded to 40; on an H100 its 8B verify took 3.48 -> 3.38 ms against 48),
    else 32 / 48 / 64. Any group width takes any of them: x is K-minor in shared memory, so its swizzle follows the
    group, not the tile (the first kernel's x^T was token-minor, which capped tiles at the group width: a 40-row int8
    head of g32 ran as two 32-token tiles, streaming the head twice)."""
    if TOKEN_TILES == "tight" and m > 16:
        return min(_round_up(m, 8), 64)
    if TOKEN_TILES == "" and 32 < m <= 40:
        return 40
    return 16 if m <= 16 else 32 if m <= 32 else 48 if m <= 48 else 64


# LUCEBOX_MGPU_TIGHT (read at import; an A/B knob): 1 rounds every row count past 16 up to a multiple of 8 (24 and 56
# untimed), 0 takes 48 for 33-40 rows as before the 40-token tile
TOKEN_TILES = {"1": "tight", "0": "old"}.get(os.environ.get("LUCEBOX_MGPU_TIGHT", ""), "")


def default_config(m: int, k: int, n: int, g: int, bits: int, *, num_sms: int = 132,
                   pair: bool = False) -> MgpuConfig | None:
    """A configuration for a shape nobody tuned (None if the kernel cannot tile it): the widest CTA that divides N,
    pipeline steps of about 64 bytes of codes per row (the best steps of the first H200 sweep), and the fewest K
    splits that give every SM a work item. pair: for a weight stored two groups a row (`MgpuConfig.pair`)."""
    cg = 2 * g if pair else g
    tt, kg, row_bytes = token_tile(m, g), k // cg, cg * bits // 8
    if k % cg:
        return None
    groups = max([d for d in range(1, kg + 1) if kg % d == 0 and d * row_bytes <= 64] or [1])
    for tile_m, wgs in ((128, 2), (64, 2), (128, 1), (64, 1)):
        if n % (tile_m * wgs):
            continue
        tiles = n // (tile_m * wgs) * -(-max(m, 1) // tt)
        splits = [s for s in range(1, 17) if (kg // groups) % s == 0]
        split = next((s for s in splits if tiles * s >= num_sms), splits[-1])
        cfg = MgpuConfig(tile_m=tile_m, tile_t=tt, groups=groups, steps=4, split_k=split, compute_wgs=wgs, pair=pair)
        if check_config(k, n, g, bits, cfg) is None:
            return cfg
    return None


def candidate_configs(m: int, k: int, n: int, g: int, bits: int, *, num_sms: int = 132) -> list[MgpuConfig]:
    """The configurations worth timing for one shape: CTA tiles of 64-256 rows, pipeline steps of 64-256 bytes of
    codes per row, and the K splits that give the grid between one and about eight work items per SM; for each tile
    and step size, also the stream-K schedule."""
    tt = token_tile(m, g)
    row_bytes = g * bits // 8
    out = []
    for tile_m in (64, 128):
        for wgs in (1, 2):
            for groups in (1, 2, 4, 8, 16):
                if not 64 <= groups * row_bytes <= 256:
                    continue
                ok_splits = []
                for split in (1, 2, 4, 8, 16):
                    cfg = MgpuConfig(tile_m=tile_m, tile_t=tt, groups=groups, steps=4, split_k=split, compute_wgs=wgs)
                    if check_config(k, n, g, bits, cfg):
                        continue
                    work = (n // (tile_m * wgs)) * (-(-m // tt)) * split
                    if work >= num_sms // 2:
                        ok_splits.append(cfg)
                    if work >= num_sms * 2:
                        break
                out.extend(ok_splits[:2])
                cfg = MgpuConfig(tile_m=tile_m, tile_t=tt, groups=groups, steps=4, compute_wgs=wgs, stream_k=True)
                if not check_config(k, n, g, bits, cfg):
                    out.append(cfg)  # one run per SM over all tiles: no split to choose
    if bits == 4 and g == 32:  # each also on rows of two groups (`pair`), a step of as many bytes
        twins = [dataclasses.replace(c, pair=True, groups=c.groups // 2) for c in out if c.groups % 2 == 0]
        out += [c for c in twins if not check_config(k, n, g, bits, c)]
    return out
