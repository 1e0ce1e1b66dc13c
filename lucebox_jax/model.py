"""The transformer (RMSNorm, RoPE, GQA attention, SwiGLU MLP) as pure functions over pytree weights and a static KV
cache. Llama, Qwen2 (qkv bias), Qwen3 (q/k norm) and Gemma 3 (GeGLU, sandwich norms, q/k norm, scaled embeddings,
sliding-window layers with their own RoPE base) share this one forward, differing only by configuration; every linear
layer goes through `quant.linear`, and attention through the kernel registry, so the model never branches on
quantization or kernel.

Layers are a tuple of per-layer weights unrolled inside one jit: on the H200 a `lax.scan` over stacked layer weights
ran 3-4x slower for decode GEMVs."""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
from flax import struct

from . import ops, quant
from .config import ModelConfig
from .kernels_xla import write_kv as _write_kv
from .ops import KernelSet
from .pending_inputs import GatedInput
from .qkv_prologue import QKVPrologue, head_norm, rope_tables, rotate
from .quant import linear


@struct.dataclass
class EmbedTable:
    """Token embeddings by row: dense [V, D], or int8 codes [V, D] with scales [V, D // g] (and mins: row value =
    scale * q + min), the exact import of any quantized GGUF table (Q8_0, Q6_K, Q4_K, ...)."""

    table: jax.Array
    scales: jax.Array | None = None
    group_size: int = struct.field(pytree_node=False, default=32)
    mins: jax.Array | None = None

    def lookup(self, ids: jax.Array, dtype) -> jax.Array:
        rows = self.table[ids].astype(jnp.float32)
        if self.scales is not None:
            rows = rows * jnp.repeat(self.scales[ids].astype(jnp.float32), self.group_size, axis=-1)
        if self.mins is not None:
            rows = rows + jnp.repeat(self.mins[ids].astype(jnp.float32), self.group_size, axis=-1)
        return rows.astype(dtype)


@struct.dataclass
class LayerWeights:
    attn_norm: jax.Array  # [D]
    wqkv: object  # [D, (Hq + 2 Hkv) * hd]: q, k, v fused into one matmul
    wo: object  # [Hq * hd, D]
    ffn_norm: jax.Array  # [D]
    w_gate_up: object  # [D, 2 F]: gate and up fused
    w_down: object  # [F, D]
    bqkv: jax.Array | None = None  # Qwen2
    q_norm: jax.Array | None = None  # Qwen3, [hd]
    k_norm: jax.Array | None = None
    post_attn_norm: jax.Array | None = None  # Gemma sandwich norms: on the attention / FFN output before the residual
    post_ffn_norm: jax.Array | None = None
    # Column layout of the fused outputs: `groups` blocks, each holding 1/groups of every part (q|k|v, gate|up).
    # 1 is the plain concatenation; tensor parallelism (parallel.py) regroups so each device's columns are one block.
    qkv_groups: int = struct.field(pytree_node=False, default=1)
    gate_up_groups: int = struct.field(pytree_node=False, default=1)


@struct.dataclass
class Weights:
    embed: EmbedTable
    layers: tuple
    final_norm: jax.Array
    head: object  # [D, V]


@struct.dataclass
class KVCache:
    """Static-shape cache: k, v per layer [B, Hkv, S, D]; `lengths` [B] = valid positions per row.

    Positions at or past a row's length hold stale data that attention masks by position, so rejected speculative
    tokens need no rollback: the length is simply not advanced."""

    k: tuple
    v: tuple
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> KVCache:
    shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
    dt = jnp.dtype(cfg.dtype)
    return KVCache(
        k=tuple(jnp.zeros(shape, dt) for _ in range(cfg.n_layers)),
        v=tuple(jnp.zeros(shape, dt) for _ in range(cfg.n_layers)),
        lengths=jnp.zeros((batch,), jnp.int32),
    )


# one-row norms scaled after their matmul (normed_linear); False: before it, as rms_norm (benchmarks A/B this)
DEFER_ONE_ROW_NORM = True
# ... norms of up to this many rows (LUCEBOX_DEFER_NORM_ROWS; 1 by default). At 64 an 8B tree of 32's norms become
# reductions as a decode step's (a Triton normalization fusion otherwise): 372 -> 371 kernels, the tree 3.42-3.45 ->
# 3.38-3.39 ms on an H100 (2026-12-07, two pairs, inside the spread between sessions), but the embedded model's batch,
# chain and tree steps gain 29-35 kernels (AOT counts), so 1 stays the default
DEFER_NORM_ROWS = int(os.environ.get("LUCEBOX_DEFER_NORM_ROWS", "1") or "1")
# a decode step's K/V appended by the decode kernel itself when it takes `append` (False: written first; A/B)
APPEND_KV = True
# ... and, where the kernel takes `prologue`, the step's qkv partial sums as the matmul wrote them, summed, normed and
# rotated by the attention kernel on its loads (qkv_prologue.py; LUCEBOX_QKV_PROLOGUE=0: by XLA first, the A/B)
QKV_PROLOGUE = os.environ.get("LUCEBOX_QKV_PROLOGUE", "1") != "0"
# ... in steps of up to this many rows, or any with q/k norms (H100, 2026-12-07, ms a step without -> with: the
# embedded shapes 0.757 -> 0.741-0.747 at batch 1, 0.908 -> 0.928-0.931 at 16, 1.178 -> 1.189-1.200 at 32; the 8B
# shapes 2.429 -> 2.420 at 1, 2.965 -> 2.955 at 8; Gemma 3 270M 0.913 -> 0.820 at 1, 0.907 -> 0.866-0.878 at 8)
QKV_PROLOGUE_ROWS = 8
# ... and a short verify's window (LUCEBOX_VERIFY_APPEND=0 writes it first: A/B in benchmarks)
APPEND_VERIFY = os.environ.get("LUCEBOX_VERIFY_APPEND", "1") != "0"
# ... and a tree verify of at most `tree_rows_limit` rows (nodes and root), as decode rows with its ancestors as bits:
# 64 at head dims >= 128, where the window runs packed (an 8B tree of 32 + root on an H100: 3.73 -> 3.60-3.65 ms), 32
# below (longer trees there are untimed as rows); LUCEBOX_TREE_ROWS=N sets it for all (0: the tree attention kernel)
TREE_AS_ROWS = int(os.environ["LUCEBOX_TREE_ROWS"]) if os.environ.get("LUCEBOX_TREE_ROWS") else None


def tree_rows_limit(head_dim: int) -> int:
    if TREE_AS_ROWS is not None:
        return TREE_AS_ROWS
    return 64 if head_dim >= 128 else 32


# a decode step's attention splits handed to the `o` matmul unmerged where its kernel merges them on its loads
# (`pending_inputs.py`: no merge kernel a layer). Off by default until a GPU has timed it and run its compiled tests
# (tested in interpret mode and compiled for an H200 without one): LUCEBOX_SPLIT_O=1 turns it on
SPLIT_O = os.environ.get("LUCEBOX_SPLIT_O", "0") == "1"
# ... and, in steps of up to GATED_DOWN_ROWS rows, gate+up's partial sums to the down matmul as written, which makes
# its input (the norm's deferred scale, silu(gate) * up) on its loads: no XLA fusion between the two a layer
# (`pending_inputs.GatedInput`); off by default as SPLIT_O is: LUCEBOX_GATED_DOWN=1 turns it on
GATED_DOWN = os.environ.get("LUCEBOX_GATED_DOWN", "0") == "1"
GATED_DOWN_ROWS = 16
# the residual stream kept at the matmul kernel's padded rows (ops.padded_rows; LUCEBOX_PAD_ROWS=0: the kernel pads
# each input itself, the A/B in benchmarks)
PAD_ROWS = os.environ.get("LUCEBOX_PAD_ROWS", "1") != "0"
# a speculative verify of at most this many positions runs its attention as decode rows (`forward(verify=True)`)
VERIFY_AS_DECODE_ROWS = 16

_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda v: jax.nn.gelu(v, approximate=True)}


def ordered_row_sum(v):
    """Sum over the last axis in an order fixed by its length alone (halving adds, then the odd leftovers in turn):
    elementwise adds only, so neither the row count nor XLA's choice of reduction code changes a row's result
    (quant.ROW_INVARIANT)."""
    rest = []
    while v.shape[-1] > 1:
        if v.shape[-1] % 2:
            rest.append(v[..., -1:])
            v = v[..., :-1]
        h = v.shape[-1] // 2
        v = v[..., :h] + v[..., h:]
    for r in reversed(rest):
        v = v + r
    return v


def rms_norm(x, w, eps):
    if not quant.ROW_INVARIANT:
        return head_norm(x, w, eps)
    xf = x.astype(jnp.float32)
    sq = xf * xf
    y = xf * jax.lax.rsqrt(ordered_row_sum(sq) / sq.shape[-1] + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def rms_norm_deferred(x, w, eps):
    """RMS norm with its per-row scale left for later: -> (x * w in x's dtype, r [.., 1] float32), so that
    rms_norm(x, w) @ W == r * ((x * w) @ W). The caller applies r to the matmul's output, inside the fusion that
    already reads it. At one row XLA runs a norm as two kernels (a reduction to a scalar, then the scaling that waits
    for it); here the reduction and x * w read x side by side and no kernel waits on the reduction: 2 kernels fewer
    a layer, 64 of 595 in an 8B decode step (`benchmarks/kernel_count.py`). Row-invariant mode keeps `rms_norm`."""
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(jnp.float32)).astype(x.dtype), r


def one_deferred_row(x) -> bool:
    """Whether a norm before a matmul on x [..., D] defers its scale (`rms_norm_deferred`): one row (up to
    DEFER_NORM_ROWS), not in the row-invariant mode."""
    return math.prod(x.shape[:-1]) <= DEFER_NORM_ROWS and DEFER_ONE_ROW_NORM and not quant.ROW_INVARIANT


def normed_linear(x, norm_w, eps, lw_w, bias=None, *, kernels):
    """linear(rms_norm(x, norm_w), lw_w) + bias. For one row the norm's scale is applied after the matmul
    (rms_norm_deferred); for more rows XLA already makes the norm one kernel, and deferring it measured more kernels
    (a tree step: 602 -> 619). Row-invariant mode always normalizes first (bit-exact rows)."""
    if not one_deferred_row(x):
        return linear(rms_norm(x, norm_w, eps), lw_w, bias, kernels=kernels)
    h, r = rms_norm_deferred(x, norm_w, eps)
    y = linear(h, lw_w, kernels=kernels).astype(jnp.float32) * r
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def rope(x, positions, theta, interleaved, pos_scale=1.0):
    """x [B, T, H, hd], positions [B, T]. interleaved: rotate pairs (2i, 2i+1) (GGUF llama); else (i, i + hd/2).
    pos_scale: linear RoPE scaling (positions times 1 / factor)."""
    cos, sin = rope_tables(positions, x.shape[-1], theta, pos_scale)  # [B, T, hd/2]
    return rotate(x, cos[:, :, None], sin[:, :, None], interleaved)


def _prologue_attend(cfg, kernels, attn, lw, x, kc, vc, start, tables, scale, extra):
    """A decode step's attention with the kernel doing what lies between the qkv matmul and it (`QKVPrologue`):
    the attention norm (its row scale deferred as `normed_linear` defers it), the matmul's partial sums as written,
    and the RoPE tables (cos, sin) [B, hd/2] of the layer. -> (out [B, Hq, hd], k cache, v cache)."""
    xr = x.reshape(-1, x.shape[-1])
    if one_deferred_row(x):  # rms_norm_deferred's h; for its scale, the sum of squares its mean divides
        xf = xr.astype(jnp.float32)
        h, ss = rms_norm_deferred(xr, lw.attn_norm, cfg.rms_eps)[0], jnp.sum(xf * xf, axis=-1)
    else:
        h, ss = rms_norm(xr, lw.attn_norm, cfg.rms_eps), None
    heads = cfg.n_heads + 2 * cfg.n_kv_heads
    parts = tuple(p.reshape(*p.shape[:2], heads, cfg.head_dim) for p in quant.linear_parts(h, lw.wqkv, kernels))
    pro = QKVPrologue(*tables, ss, lw.q_norm, lw.k_norm, cfg.n_heads, cfg.n_kv_heads, cfg.rms_eps, x.shape[-1],
                      cfg.rope_interleaved, jnp.dtype(cfg.dtype).name)
    return attn(parts, kc, vc, start + 1, scale=scale, append=True, prologue=pro, **extra)


def _gated_input(cfg, lw, x, kernels) -> GatedInput:
    """The down projection's input for rows x [M, D], left for its kernel to finish: the FFN norm (its row scale
    deferred as `normed_linear` defers it, as the sum of squares) and gate+up's partial sums as written."""
    if one_deferred_row(x):
        xf = x.astype(jnp.float32)
        h, ss = rms_norm_deferred(x, lw.ffn_norm, cfg.rms_eps)[0], jnp.sum(xf * xf, axis=-1)
    else:
        h, ss = rms_norm(x, lw.ffn_norm, cfg.rms_eps), None
    return GatedInput(quant.linear_parts(h, lw.w_gate_up, kernels), ss, rows=x.shape[0], ffn=cfg.ffn_dim,
                      groups=lw.gate_up_groups, eps=cfg.rms_eps, width=x.shape[-1], dtype=jnp.dtype(cfg.dtype).name)


def split_parts(y, groups: int, sizes: tuple[int, ...]) -> list:
    """y [..., sum(sizes)] laid out as `groups` equal blocks, each holding 1/groups of every part in order -> the
    parts [..., size] (groups=1: plain slicing)."""
    lead = y.shape[:-1]
    y = y.reshape(*lead, groups, -1)
    parts, off = [], 0
    for s in sizes:
        parts.append(y[..., off: off + s // groups].reshape(*lead, s))
        off += s // groups
    return parts


def tree_rows(c, win, start, tree):
    """One decode row per tree node (quant.ROW_INVARIANT): c [B, Hkv, S, hd] -> [B * T, Hkv, S, hd], row (b, t) the
    cache of row b with its root-to-t path, win [B, T, Hkv, hd] (the window's new keys or values, in window order),
    at slots start .. start + depth[t], where plain decoding would have put them. Slots past that hold other nodes
    and are past the row's length. A copy of the cache per node: this mode is for equality, not speed."""
    depth, anc = tree
    b, t = depth.shape
    on_path = anc[:, :, None, :] & (depth[:, None, None, :] == jnp.arange(t)[None, None, :, None])
    path = jnp.argmax(on_path, axis=-1)  # [B, T nodes, T depths]: the window index of node t's ancestor at depth j
    kv = jnp.take_along_axis(win[:, None], path[..., None, None], axis=2)  # [B, T, T, Hkv, hd]
    kv = kv.reshape(b * t, t, *win.shape[2:]).transpose(0, 2, 1, 3).astype(c.dtype)
    rows = jnp.repeat(c, t, axis=0)
    return jax.vmap(lambda cc, n, st: jax.lax.dynamic_update_slice(cc, n, (0, st, 0)))(rows, kv, jnp.repeat(start, t))


def to_rows(v, r: int):
    """[B, T, X] -> [r, X]: the B * T rows, then zero rows up to r (`forward`'s padded residual stream)."""
    v = v.reshape(-1, v.shape[-1])
    return jnp.pad(v, ((0, r - v.shape[0]), (0, 0)))


def from_rows(v, b: int, t: int):
    """[r, X] -> [B, T, X]: the real rows of `to_rows`."""
    return v[: b * t].reshape(b, t, v.shape[-1])


def _decode_rows(positions):
    """A verify's B x T positions as decode rows: (lengths [B * T], cache row of each [B * T])."""
    b, t = positions.shape
    return (positions + 1).reshape(b * t), jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)


def _attend(kernels, attn, q, k, v, kc, vc, start, positions, tree, scale, extra, decode, as_decode,
            tree_as_decode, tree_extra):
    """One layer's attention over the cache kc/vc, which already holds this call's keys k/v at start.. (forward)."""
    b, t, hq, hd = q.shape
    if tree_as_decode:  # node (b, t) reads its own row of B * T, up to its position
        lens = (positions + 1).reshape(b * t)
        return attn(q.reshape(b * t, hq, hd), tree_rows(kc, k, start, tree), tree_rows(vc, v, start, tree), lens,
                    scale=scale, **extra).reshape(b, t, hq, hd)
    if tree is not None:  # (the window was just written at slots start .. start + t - 1: a kernel may read it)
        return ops.get("attention_tree", kernels.attention_tree)(q, kc, vc, start, k, v, tree[1], scale=scale,
                                                                 positions=positions, window=extra.get("window"),
                                                                 **tree_extra)
    if decode:
        return attn(q[:, 0], kc, vc, start + 1, scale=scale, **extra)[:, None]
    if as_decode:  # B * T decode rows: row (b, t) reads cache row b up to position start + t
        lens, rows = _decode_rows(positions)
        return attn(q.reshape(b * t, hq, hd), kc, vc, lens, rows, scale=scale, **extra).reshape(b, t, hq, hd)
    return attn(q, kc, vc, start, scale=scale, **extra)


def forward(cfg: ModelConfig, kernels: KernelSet, w: Weights, cache: KVCache, tokens, start, *, last_only=None,
            hidden_layers: tuple | None = None, tree=None, verify: bool = False):
    """Run `tokens` [B, T] at absolute positions start[b] + t; write their K/V into the cache.

    Returns (logits, cache). `cache.lengths` is left unchanged: the caller decides how far each row advances.
    last_only: None for logits at every position [B, T, V]; else an index array [B] -> logits [B, V] of that position.
    hidden_layers: layer indices (static); then returns (logits, cache, hidden [B, T, len * D]): the residual stream
    after each of those layers at every position, concatenated (draft heads read it; see drafters/eagle.py).
    tree: (depth [B, T], anc [B, T, T]) for a token tree (speculative tree verify): token t sits at position
    start + depth[t] but in cache slot start + t, and sees committed slots < start plus its ancestors `anc[t]`.
    verify: the tokens are a speculative verify; up to VERIFY_AS_DECODE_ROWS of them (any number with
    quant.ROW_INVARIANT) each position's attention then runs as a decode row of its own (the decode kernel over that
    row's cache prefix, when the attention_decode kernel takes `rows`): cheaper than the prefill kernel for a few
    queries, and with quant.ROW_INVARIANT it rounds exactly as a plain decode step would (the matmul kernels are
    row-invariant in that mode too). A tree runs so in that mode whether or not
    `verify` is given: each node a decode row over its own copy of the cache holding its path (`tree_rows`).
    """
    b, t = tokens.shape
    dt = jnp.dtype(cfg.dtype)
    hd, hq, hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    scale = cfg.attn_scale if cfg.attn_scale is not None else 1.0 / math.sqrt(hd)
    positions = start[:, None] + (jnp.arange(t, dtype=jnp.int32)[None, :] if tree is None else tree[0])
    x = w.embed.lookup(tokens, dt)
    if cfg.embed_scale != 1.0:
        x = (x.astype(jnp.float32) * cfg.embed_scale).astype(dt)
    # where the matmul kernel would pad B * T rows to more (mgpu: 9 -> 16), the residual stream is kept at that many
    # rows, zero past B * T: the norms then write the matmuls' inputs padded, and no pad kernel runs before them
    lw0 = w.layers[0]
    n_rows = quant.matmul_rows((lw0.wqkv, lw0.wo, lw0.w_gate_up, lw0.w_down), b * t, kernels) if PAD_ROWS else b * t
    pad = (lambda v: to_rows(v, n_rows)) if n_rows > b * t else (lambda v: v)
    unpad = (lambda v: from_rows(v, b, t)) if n_rows > b * t else (lambda v: v)
    x = pad(x)
    new_k, new_v = [], []
    decode = t == 1
    # a short verify's positions as decode rows: on the H200 an 8B verify of 9 rows spent 914 us a step in the prefill
    # kernel (28 us a layer for 9 queries), a decode step 131 us in the decode kernel
    as_decode = verify and t > 1 and tree is None and (quant.ROW_INVARIANT or (  # (ROW_INVARIANT: read at trace time)
        t <= VERIFY_AS_DECODE_ROWS and ops.accepts("attention_decode", kernels.attention_decode, "rows")))
    tree_as_decode = tree is not None and quant.ROW_INVARIANT
    hidden = [None] * len(hidden_layers or ())
    by_rows = decode or as_decode or tree_as_decode
    tree_extra = {"in_cache": True} if tree is not None and ops.accepts(
        "attention_tree", kernels.attention_tree, "in_cache") else {}
    attn = ops.get("attention_decode" if by_rows else "attention_prefill",
                   kernels.attention_decode if by_rows else kernels.attention_prefill)
    # a decode kernel that appends the step's own K/V itself saves the cache writes' 2 kernels a layer; so does one
    # that appends a short verify's window (`window_rows`; not in the row-invariant mode, whose verify must round as
    # decode steps that read the window from the cache)
    append = decode and APPEND_KV and ops.accepts("attention_decode", kernels.attention_decode, "append")
    prologue = (append and QKV_PROLOGUE and not quant.ROW_INVARIANT and (b <= QKV_PROLOGUE_ROWS or cfg.qk_norm)
                and ops.accepts("attention_decode", kernels.attention_decode, "prologue"))
    split_o = ({"split_out": True} if append and SPLIT_O and n_rows == b * t and quant.takes_pending(lw0.wo, kernels)
               and ops.accepts("attention_decode", kernels.attention_decode, "split_out") else {})
    gated = (GATED_DOWN and cfg.activation == "silu" and n_rows == b * t <= GATED_DOWN_ROWS
             and quant.takes_pending(lw0.w_down, kernels))
    rope_of = {}  # a decode step's RoPE tables, once per (theta, scale)
    append_rows = (as_decode and APPEND_VERIFY and not quant.ROW_INVARIANT
                   and ops.accepts("attention_decode", kernels.attention_decode, "window_rows"))
    # a short tree the same way: node t a decode row writing its K/V at slot start + t and seeing its ancestors
    tree_rows_anc = None
    # ... and hands its output over padded to the residual stream's rows, where it can (no pad kernel before o)
    out_rows = ({"out_rows": n_rows} if n_rows > b * t and ops.accepts("attention_decode", kernels.attention_decode,
                                                                      "out_rows") else {})
    if (tree is not None and not tree_as_decode and t <= tree_rows_limit(hd)
            and ops.accepts("attention_decode", kernels.attention_decode, "window_anc")):
        tree_rows_anc = tree[1].reshape(b * t, t)
    for i, lw in enumerate(w.layers):
        theta, pos_scale = cfg.layer_rope(i)
        window = cfg.layer_window(i)
        extra = {} if window is None else {"window": window}  # kernels without windows keep their old signature
        if prologue and lw.bqkv is None and lw.qkv_groups == 1:
            if (theta, pos_scale) not in rope_of:
                rope_of[theta, pos_scale] = rope_tables(positions[:, 0], hd, theta, pos_scale)
            o, kc, vc = _prologue_attend(cfg, kernels, attn, lw, x, cache.k[i], cache.v[i], start,
                                         rope_of[theta, pos_scale], scale, {**extra, **split_o})
            o = o if split_o else o[:, None]
        else:
            qkv = unpad(normed_linear(x, lw.attn_norm, cfg.rms_eps, lw.wqkv, lw.bqkv, kernels=kernels))
            q, k, v = split_parts(qkv, lw.qkv_groups, (cfg.q_dim, cfg.kv_dim, cfg.kv_dim))
            q, k, v = q.reshape(b, t, hq, hd), k.reshape(b, t, hkv, hd), v.reshape(b, t, hkv, hd)
            if lw.q_norm is not None:
                q = rms_norm(q, lw.q_norm, cfg.rms_eps)
                k = rms_norm(k, lw.k_norm, cfg.rms_eps)
            q = rope(q, positions, theta, cfg.rope_interleaved, pos_scale)
            k = rope(k, positions, theta, cfg.rope_interleaved, pos_scale)
            if append:  # the kernel writes the step's K/V into the cache and attends, in one call
                o, kc, vc = attn(jnp.concatenate([q, k, v], axis=2)[:, 0], cache.k[i], cache.v[i], start + 1,
                                 scale=scale, append=True, **extra, **split_o)
                o = o if split_o else o[:, None]
            elif append_rows or (tree_rows_anc is not None and window is None):
                # B * T decode rows (as `_attend`'s as_decode), the kernel writing the window; a tree's node t sits at
                # slot start + t (its position is its depth's) and sees the window keys of its ancestors
                slots = positions if tree is None else start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
                lens, rows = _decode_rows(slots)
                anc = {} if tree is None else {"window_anc": tree_rows_anc}
                o, kc, vc = ops.get("attention_decode", kernels.attention_decode)(
                    jnp.concatenate([q, k, v], axis=2).reshape(b * t, hq + 2 * hkv, hd), cache.k[i], cache.v[i], lens,
                    rows, scale=scale, append=True, window_rows=t, **extra, **anc, **out_rows)
                o = o.reshape(n_rows, hq, hd) if out_rows else o.reshape(b, t, hq, hd)
            else:
                kc, vc = _write_kv(cache.k[i], k, start), _write_kv(cache.v[i], v, start)
                o = _attend(kernels, attn, q, k, v, kc, vc, start, positions, tree, scale, extra, decode, as_decode,
                            tree_as_decode, tree_extra)
        new_k.append(kc)
        new_v.append(vc)
        if split_o:  # a decode step: the kernel's splits unmerged (`AttentionSplits`), or its output at one split
            o = linear(o if hasattr(o, "merged") else o.reshape(b, hq * hd), lw.wo, kernels=kernels)[:, None]
        else:
            o = linear(o.reshape(n_rows, hq * hd) if o.ndim == 3 else pad(o.reshape(b, t, hq * hd)),  # 3: out_rows
                       lw.wo, kernels=kernels)
        x = x + (o if lw.post_attn_norm is None else rms_norm(o, lw.post_attn_norm, cfg.rms_eps))
        if gated:
            o = linear(_gated_input(cfg, lw, x.reshape(b * t, -1), kernels), lw.w_down, kernels=kernels)
            o = o.reshape(b, t, -1)
        else:
            gate, up = split_parts(normed_linear(x, lw.ffn_norm, cfg.rms_eps, lw.w_gate_up, kernels=kernels),
                                   lw.gate_up_groups, (cfg.ffn_dim, cfg.ffn_dim))
            act = _ACTIVATIONS[cfg.activation](gate.astype(jnp.float32))
            o = linear((act * up.astype(jnp.float32)).astype(dt), lw.w_down, kernels=kernels)
        x = x + (o if lw.post_ffn_norm is None else rms_norm(o, lw.post_ffn_norm, cfg.rms_eps))
        if hidden_layers is not None and i in hidden_layers:
            hidden[hidden_layers.index(i)] = unpad(x)
    x = unpad(x)
    if last_only is not None:  # kept [B, 1, D]: a reduction over [B, D] may round differently (row invariance)
        x = jnp.take_along_axis(x, last_only[:, None, None], axis=1)
    x = rms_norm(x, w.final_norm, cfg.rms_eps)
    logits = linear(x, w.head, kernels=kernels).astype(jnp.float32)
    if cfg.final_softcap > 0:
        logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
    if last_only is not None:
        logits = logits[:, 0]
    cache = KVCache(k=tuple(new_k), v=tuple(new_v), lengths=cache.lengths)
    if hidden_layers is not None:
        return logits, cache, jnp.concatenate(hidden, axis=-1)
    return logits, cache
