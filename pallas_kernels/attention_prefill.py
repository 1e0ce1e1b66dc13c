"""Causal flash attention with per-row start offsets (Pallas-Triton): prefill and speculative-verify windows.

    query t of row b sits at absolute position start[b] + t and sees cache positions <= start[b] + t.

q [B, T, Hq, D], k/v [B, Hkv, S, D] (the static cache, already holding this window's keys), start [B] int32.

Grid (B, Hkv, cdiv(T, block_t)).  GQA: a program takes `block_t` consecutive queries of all G = Hq / Hkv query heads
of one kv head at once, as one [block_t * Gp, D] tile (Gp = next power of two >= G; padding rows are masked loads
and masked stores), so each K/V tile is read once per kv head, not once per query head.  It walks the kv tiles in
two phases: tiles entirely below the causal limit of the tile's first query (no mask at all), then the few tiles
that straddle the diagonal (masked); tiles past the causal limit of the tile's last query are never read.
Online softmax in float32 with exp2.

`sliding=W` (a sliding-window layer, Gemma 3's local attention): query p also sees only keys > p - W. A third phase
comes first then, the tiles that straddle the window's lower edge for some row (masked), and tiles wholly below the
first query's window are never read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["attention_prefill", "attention_prefill_reference", "attention_prefill_pallas"]

_LOG2E = 1.4426950408889634
_NEG = -1e30


def _next_pow2(v: int) -> int:
    return 1 << max(0, int(v) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kernel(start_ref, q_ref, k_ref, v_ref, o_ref, *, g, gp, bt, bk, t_len, seq, qk_scale, sliding=0):
    b, h, tb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    d = q_ref.shape[-1]
    rows = bt * gp
    t0 = tb * bt
    st = start_ref[b]
    t_idx = t0 + jnp.arange(bt)
    g_idx = jnp.arange(gp)
    qmask = (t_idx < t_len)[:, None, None] & (g_idx < g)[None, :, None]  # [bt, gp, 1]
    q = plgpu.load(q_ref.at[b, pl.ds(t0, bt), pl.ds(h * g, gp), :], mask=qmask, other=0)
    q = (q.astype(jnp.float32) * qk_scale).astype(k_ref.dtype).reshape(rows, d)
    qpos = st + t0 + jnp.arange(rows) // gp  # absolute position of each tile row
    t_last = jnp.minimum(t0 + bt, t_len) - 1
    hi = jnp.minimum(st + t_last + 1, seq)  # keys [0, hi) are visible to some row
    n_blocks = (hi + bk - 1) // bk
    n_full = jnp.minimum(jnp.minimum(st + t0 + 1, seq) // bk, n_blocks)  # keys visible to every row
    first, full_from = 0, 0  # (sliding) the first tile any row sees; the first one above every row's lower edge
    if sliding:
        first = jnp.minimum(jnp.maximum(st + t0 - sliding + 1, 0) // bk, n_blocks)
        full_from = jnp.clip((jnp.maximum(st + t_last - sliding + 1, 0) + bk - 1) // bk, first, n_full)

    def step(i, carry, masked):
        acc, m_i, l_i = carry
        k0 = pl.multiple_of(i * bk, bk)
        kpos = k0 + jnp.arange(bk)
        if masked:  # (with a window, keys below every row's window are not loaded either)
            kin = (kpos < seq) & (kpos > st + t0 - sliding) if sliding else kpos < seq
            k = plgpu.load(k_ref.at[b, h, pl.ds(k0, bk), :], mask=kin[:, None], other=0)
            v = plgpu.load(v_ref.at[b, h, pl.ds(k0, bk), :], mask=kin[:, None], other=0)
        else:
            k = k_ref[b, h, pl.ds(k0, bk), :]
            v = v_ref[b, h, pl.ds(k0, bk), :]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32)  # [rows, bk]
        if masked:
            vis = (kpos[None, :] <= qpos[:, None]) & kin[None, :]
            if sliding:
                vis &= kpos[None, :] > qpos[:, None] - sliding
            s = jnp.where(vis, s, _NEG)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        alpha = jnp.exp2(m_i - m_new)
        # (a row that sees none of an edge tile keeps m = -1e30 and sums exp2(0) = 1 there: its first visible key
        # makes alpha exp2(-1e30 - m) = 0, which clears that; the keys loaded there are cache entries, finite)
        p = jnp.exp2(s - m_new[:, None])
        l_new = l_i * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return acc, m_new, l_new

    init = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32))
    if sliding:  # the window's lower edge first (masked), then as without a window
        init = lax.fori_loop(first, full_from, functools.partial(step, masked=True), init)
    carry = lax.fori_loop(full_from, n_full, functools.partial(step, masked=False), init)
    acc, m_i, l_i = lax.fori_loop(n_full, n_blocks, functools.partial(step, masked=True), carry)
    out = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
    out = out.astype(o_ref.dtype).reshape(bt, gp, d)
    plgpu.store(o_ref.at[b, pl.ds(t0, bt), pl.ds(h * g, gp), :], out, mask=qmask)


def default_config(t: int, g: int) -> dict:
    gp = _next_pow2(g)
    bt = max(1, min(_next_pow2(t), max(1, 64 // gp)))
    if bt * gp < 16:
        bt = 16 // gp
    if t <= 16:  # verify windows: few query rows, long cache (H200: 88.9 us vs 99.9 at T=5, S=4096, B=8)
        return dict(block_t=bt, block_k=128, num_warps=8, num_stages=2)
    return dict(block_t=bt, block_k=64, num_warps=4, num_stages=2)


@functools.partial(
    jax.jit, static_argnames=("scale", "block_t", "block_k", "num_warps", "num_stages", "interpret", "sliding")
)
def attention_prefill(
    q, k, v, start, *, scale: float, block_t: int | None = None, block_k: int = 64, num_warps: int = 4,
    num_stages: int = 2, interpret: bool = False, sliding: int = 0,
):
    """q [B, T, Hq, D], k/v [B, Hkv, S, D], start [B] int32 -> [B, T, Hq, D] (q.dtype); sliding=W > 0: query p
    sees keys p - W < k <= p only."""
    bsz, t_len, hq, d = q.shape
    _, hkv, seq, _ = k.shape
    g = hq // hkv
    assert g * hkv == hq and d & (d - 1) == 0, (q.shape, k.shape)
    gp = _next_pow2(g)
    bt = block_t or default_config(t_len, g)["block_t"]
    if bt * gp < 16:
        bt = _next_pow2(_cdiv(16, gp))
    bk = min(block_k, max(16, _next_pow2(seq)))
    kern = functools.partial(
        _kernel, g=g, gp=gp, bt=bt, bk=bk, t_len=t_len, seq=seq, qk_scale=scale * _LOG2E, sliding=sliding
    )
    return pl.pallas_call(
        kern,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(bsz, hkv, _cdiv(t_len, bt)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="attention_prefill",
    )(start.astype(jnp.int32), q, k, v)


def attention_prefill_reference(q, k, v, start, *, scale: float, sliding: int = 0):
    """Plain jnp, float32 (sliding=W: keys p - W < k <= p)."""
    bsz, t_len, hq, d = q.shape
    hkv, seq = k.shape[1], k.shape[2]
    qg = q.reshape(bsz, t_len, hkv, hq // hkv, d).astype(jnp.float32)
    s = jnp.einsum("btkgd,bksd->bkgts", qg, k.astype(jnp.float32), precision=lax.Precision.HIGHEST) * scale
    qpos = start[:, None] + jnp.arange(t_len)[None, :]
    mask = jnp.arange(seq)[None, None, :] <= qpos[:, :, None]  # [B, T, S]
    if sliding:
        mask &= jnp.arange(seq)[None, None, :] > qpos[:, :, None] - sliding
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bksd->btkgd", p, v.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return o.reshape(bsz, t_len, hq, d).astype(q.dtype)


def attention_prefill_pallas(q, k, v, start, *, scale, interpret: bool | None = None, row_invariant: bool = False,
                             sliding: int = 0, **overrides):
    """row_invariant: the tiles of a long window for every T (block_k depends on T otherwise), so a query's output
    does not depend on the window it was prefilled in (lucebox_jax.quant.ROW_INVARIANT)."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    cfg = default_config(64 if row_invariant else q.shape[1], q.shape[2] // k.shape[1])
    cfg.update(overrides)
    return attention_prefill(q, k, v, start, scale=float(scale), interpret=interpret, sliding=sliding, **cfg)
