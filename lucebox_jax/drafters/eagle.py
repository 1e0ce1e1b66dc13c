"""`eagle[:PATH]`: a trained EAGLE-3-style draft head.

One small decoder layer reads the target's own hidden states (the residual stream after a low, a middle and the last
layer, each RMS-normalised, through one projection `fc`) together with the embedding of the current token, and
predicts the next token with the target's embedding table and LM head (the same arrays, never copied). It then drafts
autoregressively on its own output hidden state, K steps per round.

Position bookkeeping (matches the target's cache contract): the head's input at position p is (feature of position
p, token at p + 1) and its output predicts the token at p + 2. After a verify over [tok, d_1..d_K] at positions
start .. start + K with n drafts accepted, `absorb` runs the head over that window with the target's true features
and the committed tokens [d_1..d_n, next] (one fixed-shape pass; positions past n are rewritten later) and keeps its
output at position start + n: the first draft of the next round comes from true features. `propose` then drafts
d_1 from it and K - 1 more steps feeding its own hidden state back. The head has its own one-layer KV cache.

The head file: `eagle.json` (head config, target identity, training summary) + `head.msgpack` (float16 arrays,
flax.serialization). `--draft eagle` loads `checkpoints/<model name>-eagle/`, `eagle:PATH` a given folder.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization, struct

from .. import ops
from ..engine import Engine, pow2_at_least
from ..model import (VERIFY_AS_DECODE_ROWS, EmbedTable, _decode_rows, _write_kv, forward, init_cache, normed_linear,
                     one_deferred_row, rms_norm, rms_norm_deferred, rope)
from ..quant import Int8Array, QuantArray
from ..sampling import descending_rank, small_top_k
from .base import DraftError, Drafter, register

HEAD_FILE, CONFIG_FILE = "head.msgpack", "eagle.json"
# optional: the token ids the head drafts among (sorted int32), so that a draft step's LM head reads only their columns
# (EAGLE-3's draft vocabulary). Read only under LUCEBOX_DRAFT_VOCAB=1: on the H100 the shipped head's 16,384 made a
# chain step no faster (1.098 against 1.087 ms; benchmarks/RESULTS.md) and accept 0.5% fewer drafts.
VOCAB_FILE = "draft_vocab.npy"
USE_DRAFT_VOCAB = os.environ.get("LUCEBOX_DRAFT_VOCAB", "0") == "1"
FORMAT = "lucebox-eagle-1"
# K - 1 draft steps as straight-line code instead of a loop: an XLA while loop inside the speculative loop's body
# splits the body's CUDA graph around it (LUCEBOX_DRAFT_UNROLL=0 keeps the `lax.scan` loop, for A/B)
UNROLL_DRAFT = os.environ.get("LUCEBOX_DRAFT_UNROLL", "1") != "0"


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """Static shape of a head and the target it belongs to (hashable: a jit static argument)."""

    dim: int
    feature_layers: tuple
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    target_layers: int
    rope_theta: float = 10000.0
    rope_interleaved: bool = True
    rms_eps: float = 1e-5
    dtype: str = "float32"

    @classmethod
    def for_target(cls, cfg, ffn_mult: float = 2.0) -> "EagleConfig":
        n = cfg.n_layers
        layers = tuple(sorted({min(2, n - 1), n // 2, n - 1}))  # low, middle, last (as EAGLE-3)
        return cls(dim=cfg.dim, feature_layers=layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                   head_dim=cfg.head_dim, ffn_dim=int(round(cfg.dim * ffn_mult / 32)) * 32,
                   vocab_size=cfg.vocab_size, target_layers=n, rope_theta=cfg.rope_theta,
                   rope_interleaved=cfg.rope_interleaved, rms_eps=cfg.rms_eps, dtype=cfg.dtype)

    @property
    def q_dim(self):
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self):
        return self.n_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["feature_layers"] = list(self.feature_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EagleConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in names}
        return cls(**{**d, "feature_layers": tuple(d["feature_layers"])})


@struct.dataclass
class HeadWeights:
    fc: jax.Array  # [F * D, D] fused target features -> D
    norm_emb: jax.Array  # [D]
    norm_feat: jax.Array  # [D]
    wqkv: jax.Array  # [2 D, q + 2 kv]: attention reads [embedding, feature]
    wo: jax.Array  # [q, D]
    ffn_norm: jax.Array  # [D]
    w_gate_up: jax.Array  # [D, 2 F]
    w_down: jax.Array  # [F, D]
    out_norm: jax.Array  # [D] before the target's LM head


@struct.dataclass
class OutIn:
    """A head matrix stored [N, K] (out, in) for inference. A one-row product x [1, K] @ w [K, N] is a column
    reduction to XLA's GPU compiler: it wrote the float32 product [K, N] in one kernel and reduced it in a second
    (qkv, o and down in each draft step, gate+up in some; 4 bytes a weight each way); over [N, K] it is one fused row
    reduction."""

    t: jax.Array


_MATRICES = ("fc", "wqkv", "wo", "w_gate_up", "w_down")


def for_inference(head: HeadWeights, dtype) -> HeadWeights:
    """The head in `dtype` with its matrices as `OutIn` (the drafter's layout; training keeps [K, N] arrays)."""
    head = jax.tree.map(lambda a: jnp.asarray(a, dtype), head)
    return head.replace(**{f: OutIn(getattr(head, f).T) for f in _MATRICES})


def init_head(hc: EagleConfig, key) -> HeadWeights:
    """Random head (std 1/sqrt(fan_in); output projections scaled down so a fresh head starts near its input)."""
    d, nf = hc.dim, len(hc.feature_layers)
    ks = jax.random.split(key, 5)
    nrm = lambda k, shape, s=1.0: jax.random.normal(k, shape, jnp.float32) * s / math.sqrt(shape[0])  # noqa: E731
    one = jnp.ones((d,), jnp.float32)
    return HeadWeights(fc=nrm(ks[0], (nf * d, d)), norm_emb=one, norm_feat=one,
                       wqkv=nrm(ks[1], (2 * d, hc.q_dim + 2 * hc.kv_dim)), wo=nrm(ks[2], (hc.q_dim, d), 0.1),
                       ffn_norm=one, w_gate_up=nrm(ks[3], (d, 2 * hc.ffn_dim)),
                       w_down=nrm(ks[4], (hc.ffn_dim, d), 0.1), out_norm=one)


# ---------------------------------------------------------------------------------------------------- the layer
def fuse_features(hc: EagleConfig, hw: HeadWeights, feats):
    """Target hidden states [..., F * D] -> head input g [..., D] (each layer's slice RMS-normalised first)."""
    d = hc.dim
    parts = [rms_norm(feats[..., i * d:(i + 1) * d], jnp.ones((d,), jnp.float32), hc.rms_eps)
             for i in range(len(hc.feature_layers))]
    return _mm(jnp.concatenate(parts, axis=-1), hw.fc)


def _mm(x, w):
    """x [..., K] @ w (an [K, N] array, or `OutIn`) -> [..., N] in x's dtype (float32 accumulation)."""
    if isinstance(w, OutIn):
        return jnp.einsum("...k,nk->...n", x, w.t.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


def head_qkv(hc: EagleConfig, hw: HeadWeights, g, emb, positions):
    """g, emb [B, T, D] at positions [B, T] -> q [B, T, Hq, hd], k, v [B, T, Hkv, hd] (RoPE applied)."""
    b, t, _ = g.shape
    x = jnp.concatenate([rms_norm(emb, hw.norm_emb, hc.rms_eps), rms_norm(g, hw.norm_feat, hc.rms_eps)], axis=-1)
    qkv = _mm(x, hw.wqkv)
    q = qkv[..., : hc.q_dim].reshape(b, t, hc.n_heads, hc.head_dim)
    k = qkv[..., hc.q_dim: hc.q_dim + hc.kv_dim].reshape(b, t, hc.n_kv_heads, hc.head_dim)
    v = qkv[..., hc.q_dim + hc.kv_dim:].reshape(b, t, hc.n_kv_heads, hc.head_dim)
    q = rope(q, positions, hc.rope_theta, hc.rope_interleaved)
    k = rope(k, positions, hc.rope_theta, hc.rope_interleaved)
    return q, k, v


def head_out(hc: EagleConfig, hw: HeadWeights, g, o):
    """Residual on g: attention output o [B, T, Hq * hd], then the MLP -> the head's hidden state h [B, T, D]."""
    h = g + _mm(o, hw.wo)
    if one_deferred_row(h):  # a draft step's one row: the norm's scale after the matmul (model.rms_norm_deferred)
        unscaled, r = rms_norm_deferred(h, hw.ffn_norm, hc.rms_eps)
        gu = _mm(unscaled, hw.w_gate_up).astype(jnp.float32) * r
    else:
        gu = _mm(rms_norm(h, hw.ffn_norm, hc.rms_eps), hw.w_gate_up).astype(jnp.float32)
    act = jax.nn.silu(gu[..., : hc.ffn_dim]) * gu[..., hc.ffn_dim:]
    return h + _mm(act.astype(h.dtype), hw.w_down)


def head_logits(hc: EagleConfig, hw: HeadWeights, h, lm_head, kernels=None, slot=None):
    """h [..., D] -> logits [..., V] (float32) through the target's LM head; with a draft vocabulary `lm_head` holds
    only its columns and `slot` [V] is each token's column there (-1: not in it, logit -inf). (A gather by slot: one
    kernel a draft step, where a scatter into a -inf array made two.)"""
    logits = normed_linear(h, hw.out_norm, hc.rms_eps, lm_head, kernels=kernels).astype(jnp.float32)
    if slot is None:
        return logits
    return jnp.where(slot >= 0, jnp.take(logits, jnp.maximum(slot, 0), axis=-1), -jnp.inf)


def draft_lm_head(lm_head, ids):
    """The LM head's columns `ids` (exact: quantized columns keep their codes and scales), or None for a weight a
    kernel repacked or a tensor-parallel one (drafts then read the whole head)."""
    if isinstance(lm_head, (Int8Array, QuantArray)):
        return type(lm_head)(codes=lm_head.codes[:, ids], scales=lm_head.scales[:, ids],
                             mins=None if lm_head.mins is None else lm_head.mins[:, ids],
                             group_size=lm_head.group_size)
    if isinstance(lm_head, (jax.Array, np.ndarray)) and lm_head.ndim == 2:
        return lm_head[:, ids]
    return None


def _cached_layer(hc, hw, cache, g, emb, start, decode_kernel: str | None = None):
    """The head over T positions start .. start + T - 1 with its KV cache (keys at positions <= each query).
    decode_kernel: an `attention_decode` implementation that appends (the target's, on the GPU): a draft step (T = 1)
    writes its K/V and attends in that kernel, and a verify's catch-up (T <= 16) runs as the target's verify does, as
    decode rows writing their window; XLA's cache writes and attention made 7 kernels each (a chain step at K = 4:
    456 -> 438 kernels)."""
    t = g.shape[1]
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    q, k, v = head_qkv(hc, hw, g, emb, positions)
    scale = 1.0 / math.sqrt(hc.head_dim)
    if decode_kernel is not None and (t == 1 or (t <= VERIFY_AS_DECODE_ROWS and ops.accepts(
            "attention_decode", decode_kernel, "window_rows"))):
        attend = ops.get("attention_decode", decode_kernel)
        qkv = jnp.concatenate([q, k, v], axis=2)
        if t == 1:
            o, kc, vc = attend(qkv[:, 0], cache[0], cache[1], start + 1, scale=scale, append=True)
        else:
            lens, rows = _decode_rows(positions)
            o, kc, vc = attend(qkv.reshape(-1, *qkv.shape[2:]), cache[0], cache[1], lens, rows, scale=scale,
                               append=True, window_rows=t)
        return head_out(hc, hw, g, o.reshape(*g.shape[:2], hc.q_dim)), (kc, vc)
    kc, vc = _write_kv(cache[0], k, start), _write_kv(cache[1], v, start)
    o = ops.get("attention_prefill", "xla")(q, kc, vc, start, scale=scale)
    return head_out(hc, hw, g, o.reshape(*g.shape[:2], hc.q_dim)), (kc, vc)


def appending_decode(kernels) -> str | None:
    """The kernel set's `attention_decode` if it appends a step's K/V itself and runs on whole arrays (not a
    tensor-parallel wrapper, whose shards are the target's heads), else None."""
    name = None if kernels is None else kernels.attention_decode
    if name is None or "@" in name or not ops.accepts("attention_decode", name, "append"):
        return None
    return name


@struct.dataclass
class EagleParams:
    head: HeadWeights
    embed: EmbedTable  # the target's (same arrays)
    lm_head: object  # the target's
    draft_head: object = None  # the LM head's columns of the draft vocabulary (None: drafts read lm_head)
    draft_slot: jax.Array | None = None  # [V] each token's column in draft_head, -1 outside the vocabulary

    def draft_logits(self, hc, h, kernels):
        """The head's logits [..., V] for drafting: over the draft vocabulary when there is one."""
        if self.draft_head is None:
            return head_logits(hc, self.head, h, self.lm_head, kernels)
        return head_logits(hc, self.head, h, self.draft_head, kernels, self.draft_slot)


@struct.dataclass
class EagleState:
    k: jax.Array  # [B, Hkv, S, hd] the head's own cache
    v: jax.Array
    h_last: jax.Array  # [B, D] head output at position start - 1 (input: true feature, token at start)


# ---------------------------------------------------------------------------------------------------- the drafter
class EagleDrafter(Drafter):
    """The draft head on a target `Engine`; `hc` static, `head` weights as data (see the module docstring)."""

    def __init__(self, hc: EagleConfig, head: HeadWeights, engine: Engine, name: str = "eagle",
                 draft_vocab: np.ndarray | None = None):
        cfg = engine.cfg
        if (hc.vocab_size, hc.dim, hc.target_layers) != (cfg.vocab_size, cfg.dim, cfg.n_layers):
            raise DraftError(f"draft head {name} was trained for a target with vocabulary {hc.vocab_size}, width "
                             f"{hc.dim} and {hc.target_layers} layers; this model has {cfg.vocab_size}, {cfg.dim} "
                             f"and {cfg.n_layers}")
        self.hc = dataclasses.replace(hc, dtype=cfg.dtype)
        self.target = engine
        self.name = name
        self.hidden_layers = self.hc.feature_layers
        self.key = ("eagle", self.hc, cfg, engine.kernels)
        dt = jnp.dtype(cfg.dtype)
        sub = None if draft_vocab is None else draft_lm_head(engine.weights.head, draft_vocab)
        self.draft_vocab_size = None if sub is None else len(draft_vocab)
        slot = None
        if sub is not None:
            slot = np.full(cfg.vocab_size, -1, np.int32)
            slot[draft_vocab] = np.arange(len(draft_vocab), dtype=np.int32)
        self._params = EagleParams(for_inference(head, dt), engine.weights.embed, engine.weights.head, sub,
                                   None if slot is None else jnp.asarray(slot))
        self.cost_ratio = 0.1  # one layer + the LM head of a 30-layer target (adaptive K only)

    @property
    def params(self):
        return self._params

    def init_state(self, prompts, cache_len, first=None, hidden=None):
        """The head over positions 0 .. P - 1 with the next tokens (prompt[1:] + the first generated token), from
        the target's features of the prompt: `hidden` [B, >= 1, F] as the prefill returned them
        (`Engine.prefill(hidden_layers=)`), else one extra forward of the target over the prompts."""
        if first is None:
            raise DraftError("the eagle drafter needs the first generated token to start")
        b = len(prompts)
        t = pow2_at_least(max(len(p) for p in prompts), 16)
        nxt = np.zeros((b, t), np.int32)
        for r, p in enumerate(prompts):  # (the first generated token goes in at `last` on the device: no wait here)
            nxt[r, : len(p) - 1] = p[1:]
        last = np.asarray([len(p) - 1 for p in prompts], np.int32)
        eng = self.target
        if hidden is not None:
            nxt, last = jax.device_put((nxt, last))
            return eng._timed_first(("eagle-start", self.key, b, t, hidden.shape, hidden.dtype, cache_len),
                                    _head_start_jit, self.hc, self._params, hidden, nxt, first, last, cache_len, t)
        toks = np.zeros((b, t), np.int32)
        for r, p in enumerate(prompts):
            toks[r, : len(p)] = p
        toks, nxt, last = jax.device_put((toks, nxt, last))
        return eng._timed_first(("eagle-init", self.key, b, t, cache_len), _eagle_init, eng.cfg, eng.kernels,
                                self.hc, eng.weights, self._params, toks, nxt, first, last, cache_len)

    def absorb(self, params, state: EagleState, hidden, tokens, n, start):
        hc = self.hc
        g = fuse_features(hc, params.head, hidden.astype(jnp.dtype(hc.dtype)))
        emb = params.embed.lookup(jnp.maximum(tokens, 0), jnp.dtype(hc.dtype))
        h, (kc, vc) = _cached_layer(hc, params.head, (state.k, state.v), g, emb, start,
                                    appending_decode(self.target.kernels))
        h_last = jnp.take_along_axis(h, n[:, None, None], axis=1)[:, 0]
        return EagleState(kc, vc, h_last)

    def propose(self, params, state: EagleState, prev, tok, start, rp, k):
        from ..speculative import draw

        hc, ks = self.hc, self.target.kernels
        dt = jnp.dtype(hc.dtype)
        d1, q1 = draw(params.draft_logits(hc, state.h_last, ks), rp, start + 1)

        def step(carry, j):
            kc, vc, h, d = carry
            emb = params.embed.lookup(d[:, None], dt)
            h2, (kc, vc) = _cached_layer(hc, params.head, (kc, vc), h[:, None], emb, start - 1 + j,
                                         appending_decode(ks))
            d2, q2 = draw(params.draft_logits(hc, h2[:, 0], ks), rp, start + j + 1)
            return (kc, vc, h2[:, 0], d2), (d2, q2)

        if k == 1:
            return d1[:, None], q1[:, None], state
        (kc, vc, _, _), (ds, qs) = jax.lax.scan(step, (state.k, state.v, state.h_last, d1),
                                                jnp.arange(1, k, dtype=jnp.int32), unroll=UNROLL_DRAFT)
        drafts = jnp.concatenate([d1[:, None], ds.T], axis=1)
        q = jnp.concatenate([q1[:, None], qs.transpose(1, 0, 2)], axis=1)
        return drafts, q, state.replace(k=kc, v=vc)

    def propose_tree(self, params, state: EagleState, tok, start, width: int, depth: int, nodes: int = 0, rp=None):
        """A token tree of `nodes` (default width * depth) nodes, EAGLE-2's way at a fixed size. Expansion is a beam:
        the `width` most likely tokens after `tok`, then at each depth the `width` best (by cumulative log
        probability) of the width * width children of the frontier run the head, each on its own chain (committed
        cache + its ancestors' keys: the pattern the head was trained on). The tree is then the best `nodes` of ALL
        the candidates drafted, whatever their depth (`select_nodes`): deep where the head is sure, bushy where it is
        not. The head's cache past the committed prefix may be written (its drafts' keys; the next absorb rewrites
        those slots before anything reads them).
        Sampled rows (rp given, temperature > 0) of a tree of exactly width * depth nodes draw each node's children
        from the head's filtered distribution instead (`tree.draft_children`) and keep the whole beam as the tree, so
        that how many children a node has never depends on the draws (tree.py, "Sampled trees").
        -> tokens [B, N], parent [B, N] (window index, 0 = the root `tok`), depth [B, N] (1..depth), q
        [B, 1 + N, V] (each window node's draft distribution; None unless sampled trees are possible) and the
        state; nodes in window order are shallow first, parents before children, at most `width` children a node."""
        from ..tree import children_noise, draft_children

        hc = self.hc
        tree_kernel = self.target.kernels.attention_tree
        tree_attention = ops.get("attention_tree", tree_kernel)
        dt = jnp.dtype(hc.dtype)
        b, w = tok.shape[0], width
        n_nodes = nodes or w * depth
        sample = rp is not None and n_nodes == w * depth
        logits = params.draft_logits(hc, state.h_last, self.target.kernels)
        # rows known to sample (a static mode): every level's Gumbel noise in one draw (the same values a level
        # would draw; one RNG program instead of one a level). With the mode decided on device each level draws its
        # own inside the sampled branch, so that an all-greedy batch draws none
        noise = (children_noise(rp, start[:, None] + 1 + jnp.arange(depth, dtype=start.dtype)[None], w,
                                logits.shape[-1]) if sample and rp.mode else None)
        level = (lambda d, s: None if noise is None else noise[:, d, :s])  # noqa: E731
        score, ftok, q_root = draft_children(logits[:, None], rp, start + 1, w, sample, level(0, 1))
        score, ftok = score[:, 0], ftok[:, 0]  # [B, W]
        g = jnp.broadcast_to(state.h_last[:, None], (b, w, hc.dim))
        # the keys drafted so far, each at a fixed window index: frontier slot i's key at depth d is (d - 1) * W + i;
        # anc[b, i] marks the window keys on slot i's chain (its ancestors and itself), carried with the beam
        wn = w * (depth - 1)
        kw = jnp.zeros((b, max(wn, 1), hc.n_kv_heads, hc.head_dim), dt)
        vw = jnp.zeros_like(kw)
        anc = jnp.zeros((b, w, max(wn, 1)), bool)
        # with a tree kernel that reads the window from the cache, the keys also go into the head's cache past the
        # committed prefix (slots start .. start + wn - 1, inside the verify's own window: scratch until the next
        # absorb rewrites them): one kernel reads prefix and window, no window einsums and merge in XLA
        in_cache = 0 < wn <= min(64, n_nodes + 1) and ops.accepts("attention_tree", tree_kernel, "in_cache")
        kc, vc = state.k, state.v
        # every candidate drafted: token, cumulative log probability, parent (candidate index, -1 = the root), depth,
        # whether the beam kept it
        cands = [(ftok, score, jnp.full((b, w), -1, jnp.int32), 1, jnp.ones((b, w), bool))]
        frontier = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32)[None], (b, w))  # candidate index of each slot
        fronts, q_fronts = [], []  # the frontiers that drafted children, and their distributions
        base = w
        own = jnp.eye(w, dtype=bool)[None]
        for d in range(1, depth):
            pos = jnp.broadcast_to((start - 1 + d)[:, None], (b, w))
            q, k, v = head_qkv(hc, params.head, g, params.embed.lookup(ftok, dt), pos)
            lo = (d - 1) * w
            kw, vw = kw.at[:, lo:lo + w].set(k), vw.at[:, lo:lo + w].set(v)
            anc = anc.at[:, :, lo:lo + w].set(jnp.broadcast_to(own, (b, w, w)))
            extra = {}
            if in_cache:
                kc, vc = _write_kv(kc, k, start + lo), _write_kv(vc, v, start + lo)
                extra = {"in_cache": True}
            o = tree_attention(q, kc, vc, start, kw, vw, anc, scale=1.0 / math.sqrt(hc.head_dim), **extra)
            h = head_out(hc, params.head, g, o.reshape(b, w, hc.q_dim))
            logits = params.draft_logits(hc, h, self.target.kernels)
            top_lp, top_tok, q_front = draft_children(logits, rp, start + 1 + d, w, sample, level(d, w))  # [B, W, W]
            fronts.append(frontier)
            q_fronts.append(q_front)
            cand = (score[:, :, None] + top_lp).reshape(b, w * w)
            rank = descending_rank(cand)  # (comparisons: no sort kernel)
            score, best = small_top_k(cand, w, rank)
            kept = rank < w
            cands.append((top_tok.reshape(b, w * w), cand, jnp.repeat(frontier, w, axis=1), d + 1, kept))
            pw = best // w  # parent's frontier slot
            ftok = jnp.take_along_axis(top_tok.reshape(b, w * w), best, axis=1)
            take = lambda a: jnp.take_along_axis(a, pw.reshape(b, w, *([1] * (a.ndim - 2))), axis=1)  # noqa: E731
            g, anc = take(h), take(anc)
            frontier = base + best
            base += w * w
        state = state.replace(k=kc, v=vc)
        hot = None if not sample else rp.temperature > 0
        toks, parent, dep, window = select_nodes(cands, n_nodes, beam_only=hot)
        if not sample:
            return toks, parent, dep, None, state
        # each window node's distribution: the root's, then each drafting frontier's (deepest nodes: none needed)
        rows = jnp.arange(b)[:, None]
        q_win = jnp.zeros((b, 1 + n_nodes, q_root.shape[-1]), jnp.float32).at[:, 0].set(q_root[:, 0])
        for f, qf in zip(fronts, q_fronts):
            wf = jnp.take_along_axis(window, f, axis=1)  # window index of each frontier slot (0: not in the tree)
            q_win = q_win.at[rows, jnp.where(wf > 0, wf, n_nodes + 1)].set(qf, mode="drop")
        return toks, parent, dep, q_win, state


def select_nodes(cands, n: int, beam_only=None):
    """The n best of the drafted candidates, list of (tokens [B, C], cumulative log prob [B, C], parent candidate
    index [B, C] (-1: the root), depth[, kept by the beam [B, C]]) in candidate-index order, as a tree: -> tokens,
    parent (window index, 0 = the root), depth, each [B, n], in candidate-index order (shallow first, parents before
    children), and each candidate's window index [B, C total] (0: not chosen). Each candidate ranks strictly below
    its parent (its log probability adds one <= 0, and an equal or rounded-up sum is pushed one float below the
    parent's), so a chosen node's parent is always chosen too. Rows where `beam_only` [B] is set choose the
    candidates the beam kept (exactly n of them: the caller's tree is the whole beam)."""
    ranks = []
    for c in cands:
        _, score, par, d = c[:4]
        r = score.astype(jnp.float32)
        if d > 1:
            parent_rank = jnp.take_along_axis(jnp.concatenate(ranks, axis=1), par, axis=1)
            r = jnp.minimum(r, jnp.nextafter(parent_rank, jnp.float32(-jnp.inf)))
        if beam_only is not None:
            r = jnp.where(beam_only[:, None] & ~c[4], -jnp.inf, r)
        ranks.append(r)
    toks = jnp.concatenate([c[0] for c in cands], axis=1)
    par = jnp.concatenate([c[2] for c in cands], axis=1)
    dep = jnp.concatenate([jnp.full(c[0].shape, c[3], jnp.int32) for c in cands], axis=1)
    b, total = toks.shape
    # the n best in candidate order, as lax.top_k then a sort would pick them, from comparisons (no sort kernels):
    # window index = how many chosen candidates up to and including this one
    chosen = (descending_rank(jnp.concatenate(ranks, axis=1)) < n).astype(jnp.int32)
    window = jnp.where(chosen > 0, jnp.cumsum(chosen, axis=1), 0)
    at = window[:, None, :] == jnp.arange(1, n + 1, dtype=jnp.int32)[None, :, None]  # [B, n, C]
    pick = jnp.sum(jnp.where(at, jnp.arange(total, dtype=jnp.int32), 0), axis=-1)
    rows = jnp.arange(b)[:, None]
    p = par[rows, pick]
    parent = jnp.where(p < 0, 0, window[rows, jnp.maximum(p, 0)])
    return toks[rows, pick].astype(jnp.int32), parent.astype(jnp.int32), dep[rows, pick], window


def _eagle_init_impl(cfg, kernels, hc, weights, params, toks, nxt, first, last, cache_len):
    b, t = toks.shape
    scratch = init_cache(cfg, b, t)
    _, _, hidden = forward(cfg, kernels, weights, scratch, toks, jnp.zeros((b,), jnp.int32),
                           last_only=jnp.zeros((b,), jnp.int32), hidden_layers=hc.feature_layers)
    return _head_start(hc, params, hidden, nxt, first, last, cache_len)


def _head_start_from(hc, params, hidden, nxt, first, last, cache_len, t):
    """_head_start from the prefill's features [B, T', F], cut or padded to t positions (positions past a
    prompt's end are never read before absorb rewrites them)."""
    hidden = hidden[:, :t] if hidden.shape[1] >= t else jnp.pad(hidden, ((0, 0), (0, t - hidden.shape[1]), (0, 0)))
    return _head_start(hc, params, hidden, nxt, first, last, cache_len)


def _head_start(hc, params, hidden, nxt, first, last, cache_len):
    """The head over the prompt's features hidden [B, T, F] and next tokens nxt [B, T] (prompt[1:], the first
    generated token `first` [B] put in at each row's `last` prompt position): its cache and its output there."""
    b = hidden.shape[0]
    nxt = nxt.at[jnp.arange(b), last].set(first.astype(nxt.dtype))
    shape = (b, hc.n_kv_heads, cache_len, hc.head_dim)
    dt = jnp.dtype(hc.dtype)
    empty = EagleState(jnp.zeros(shape, dt), jnp.zeros(shape, dt), jnp.zeros((b, hc.dim), dt))
    g = fuse_features(hc, params.head, hidden.astype(dt))
    emb = params.embed.lookup(nxt, dt)
    h, (kc, vc) = _cached_layer(hc, params.head, (empty.k, empty.v), g, emb, jnp.zeros((b,), jnp.int32))
    return EagleState(kc, vc, jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0])


_eagle_init = jax.jit(_eagle_init_impl, static_argnames=("cfg", "kernels", "hc", "cache_len"))
_head_start_jit = jax.jit(_head_start_from, static_argnames=("hc", "cache_len", "t"))


# ---------------------------------------------------------------------------------------------------- files
def save_head(folder: str, hc: EagleConfig, head: HeadWeights, info: dict | None = None):
    """Write eagle.json + head.msgpack (float16) into `folder` (atomically: temp files, then rename)."""
    os.makedirs(folder, exist_ok=True)
    arrays = {k: np.asarray(v, np.float32).astype(np.float16) for k, v in serialization.to_state_dict(head).items()}
    blob = serialization.msgpack_serialize(arrays)
    meta = {"format": FORMAT, "config": hc.to_dict(), **(info or {})}
    for name, data, mode in ((HEAD_FILE, blob, "wb"), (CONFIG_FILE, json.dumps(meta, indent=1, default=str), "w")):
        tmp = os.path.join(folder, name + ".tmp")
        with open(tmp, mode) as f:
            f.write(data)
        os.replace(tmp, os.path.join(folder, name))


def load_head(folder: str) -> tuple[EagleConfig, HeadWeights, dict]:
    cfg_path, head_path = os.path.join(folder, CONFIG_FILE), os.path.join(folder, HEAD_FILE)
    if not (os.path.isfile(cfg_path) and os.path.isfile(head_path)):
        raise DraftError(f"no draft head in {os.path.abspath(folder)} (needs {CONFIG_FILE} and {HEAD_FILE}); "
                         "train one with: python -m lucebox_jax.train_draft --model MODEL --out FOLDER")
    try:
        with open(cfg_path) as f:
            meta = json.load(f)
        if meta.get("format") != FORMAT:
            raise DraftError(f"{cfg_path}: format {meta.get('format')!r}, expected {FORMAT!r}")
        hc = EagleConfig.from_dict(meta["config"])
        with open(head_path, "rb") as f:
            arrays = serialization.msgpack_restore(f.read())
        head = serialization.from_state_dict(init_head(hc, jax.random.key(0)),
                                             {k: jnp.asarray(v, jnp.float32) for k, v in arrays.items()})
    except DraftError:
        raise
    except Exception as e:  # noqa: BLE001 - any corrupt file ends in one clear error
        raise DraftError(f"cannot read the draft head in {folder}: {e}") from e
    want = jax.tree.map(jnp.shape, init_head(hc, jax.random.key(0)))
    if jax.tree.map(jnp.shape, head) != want:
        raise DraftError(f"draft head in {folder} has array shapes that do not match its {CONFIG_FILE}")
    return hc, head, meta


def load_draft_vocab(folder: str, vocab_size: int) -> np.ndarray | None:
    """The head's draft vocabulary (`VOCAB_FILE`: sorted, distinct token ids), or None where the folder has none."""
    path = os.path.join(folder, VOCAB_FILE)
    if not os.path.isfile(path):
        return None
    try:
        ids = np.load(path)
    except Exception as e:  # noqa: BLE001 - a corrupt file ends in one clear error
        raise DraftError(f"cannot read the draft vocabulary {path}: {e}") from e
    if (ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or len(ids) == 0 or ids.min() < 0
            or ids.max() >= vocab_size or np.any(np.diff(ids) <= 0)):
        raise DraftError(f"{path}: not sorted distinct token ids below the vocabulary size {vocab_size}")
    return ids.astype(np.int32)


def shipped_head_dir(model_name: str) -> str:
    """Where the head of a model (GGUF name without extension) is looked for: the repository's checkpoints/ first,
    then $LUCEBOX_CHECKPOINTS."""
    from ..loader import REPO_ROOT

    cands = [os.path.join(REPO_ROOT, "checkpoints", f"{model_name}-eagle")]
    if os.environ.get("LUCEBOX_CHECKPOINTS"):
        cands.append(os.path.join(os.environ["LUCEBOX_CHECKPOINTS"], f"{model_name}-eagle"))
    return next((c for c in cands if os.path.isfile(os.path.join(c, CONFIG_FILE))), cands[0])


@register("eagle", "eagle[:PATH]")
def _eagle(arg: str, engine: Engine, tokenizer=None) -> Drafter:
    if arg:
        folder = arg
    else:
        name = getattr(engine, "model_name", None)
        if not name:
            raise DraftError("eagle without a path needs to know the loaded model's name; use eagle:PATH")
        folder = shipped_head_dir(name)
    hc, head, _ = load_head(folder)
    return EagleDrafter(hc, head, engine, f"eagle:{os.path.basename(os.path.normpath(folder))}",
                        load_draft_vocab(folder, hc.vocab_size) if USE_DRAFT_VOCAB else None)
