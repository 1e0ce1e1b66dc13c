"""Quantized weight pytrees (int4, int8) and the one matmul dispatch point every linear layer uses.

The model calls `linear(x, w)` whatever `w` is (int4 `QuantArray`, int8 `Int8Array` or a plain array), so it never
branches on quantization. The int4 layout is the contract the GPU kernels implement; `pallas_kernels/README.md`
documents it:

  codes  uint8 [K // 2, N]   two 4-bit codes per byte, "half-split": the low nibble of byte (i, n) is the code of
                             row i, the high nibble the code of row i + K // 2 (so a kernel unpacks a byte tile into
                             two contiguous row tiles, no interleave)
  scales float16 or float32 [K // g, N] one scale per group of g consecutive rows (along K, the reduction axis)
  mins   same dtype and shape as scales, or None
  value  = scales * q + mins      (asymmetric, e.g. GGUF Q4_1, Q4_K, Q2_K: exact)
  value  = scales * (q - 8)       (symmetric, mins is None, e.g. GGUF Q4_0, Q3_K: exact)

The int8 layout (`Int8Array`): codes int8 [K, N], scales/mins [K // g, N], value = scales * q (+ mins).
Scales are float16 where every scale of the tensor is a float16 value, else float32 (a K-quant's d * sc needs up to
19 significant bits): GGUF imports keep the exact products, never a rounded scale (`lucebox_jax/gguf_quants.py`).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class QuantArray:
    """An int4 [K, N] weight with per-group scales (and optional mins) along K."""

    codes: jax.Array  # uint8 [K // 2, N]
    scales: jax.Array  # float16 or float32 [K // g, N]
    mins: jax.Array | None  # like scales, or None (symmetric)
    group_size: int = struct.field(pytree_node=False, default=32)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0] * 2, self.codes.shape[1])

    @property
    def nbytes(self) -> int:
        return _nbytes(self.codes, self.scales, self.mins)


@struct.dataclass
class Int8Array:
    """An int8 [K, N] weight with per-group scales (and optional mins) along K: value = scale * q (+ min).
    GGUF Q8_0 / Q5_0 / Q6_K import symmetric, Q5_1 / Q5_K with mins, all exactly."""

    codes: jax.Array  # int8 [K, N]
    scales: jax.Array  # float16 or float32 [K // g, N]
    mins: jax.Array | None = None  # like scales, or None (symmetric)
    group_size: int = struct.field(pytree_node=False, default=32)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.codes, self.scales, self.mins)


def _nbytes(*arrays) -> int:
    """Bytes of the given arrays (None skipped; works on abstract ShapeDtypeStructs too)."""
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in arrays if a is not None)


def unpack_int4(codes):
    """uint8 [K//2, N] -> integer codes [K, N] in 0..15 (same array library as the input)."""
    xp = jnp if isinstance(codes, jax.Array) else np
    lo = codes & 0xF
    hi = codes >> 4
    return xp.concatenate([lo, hi], axis=0)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Integer codes [K, N] in 0..15 -> half-split packed uint8 [K//2, N]."""
    q = np.asarray(q, np.uint8)
    k = q.shape[0]
    if k % 2:
        raise ValueError(f"int4 packing needs an even number of rows, got {k}")
    return (q[: k // 2] | (q[k // 2 :] << 4)).astype(np.uint8)


def dequantize(w, dtype=jnp.float32):
    """Any weight -> dense [K, N] array of `dtype` (reference semantics of the formats above)."""
    if isinstance(w, QuantArray):
        q = unpack_int4(w.codes).astype(jnp.float32)
        k, n = q.shape
        s = jnp.repeat(w.scales.astype(jnp.float32), w.group_size, axis=0)
        if w.mins is None:
            return (s * (q - 8.0)).astype(dtype)
        return (s * q + jnp.repeat(w.mins.astype(jnp.float32), w.group_size, axis=0)).astype(dtype)
    if isinstance(w, Int8Array):
        s = jnp.repeat(w.scales.astype(jnp.float32), w.group_size, axis=0)
        v = w.codes.astype(jnp.float32) * s
        if w.mins is not None:
            v = v + jnp.repeat(w.mins.astype(jnp.float32), w.group_size, axis=0)
        return v.astype(dtype)
    return jnp.asarray(w, dtype)


def dequantize_np(w) -> np.ndarray:
    """NumPy twin of `dequantize` for host-side checks (float32)."""
    if isinstance(w, QuantArray):
        q = unpack_int4(np.asarray(w.codes)).astype(np.float32)
        s = np.repeat(np.asarray(w.scales, np.float32), w.group_size, axis=0)
        if w.mins is None:
            return s * (q - 8.0)
        return s * q + np.repeat(np.asarray(w.mins, np.float32), w.group_size, axis=0)
    if isinstance(w, Int8Array):
        s = np.repeat(np.asarray(w.scales, np.float32), w.group_size, axis=0)
        v = np.asarray(w.codes, np.float32) * s
        if w.mins is not None:
            v = v + np.repeat(np.asarray(w.mins, np.float32), w.group_size, axis=0)
        return v
    return np.asarray(w, np.float32)


def quantize_int4(w: np.ndarray, group_size: int = 128, symmetric: bool = False) -> QuantArray:
    """Round-to-nearest int4 quantization of a dense [K, N] float weight, groups of `group_size` rows along K."""
    w = np.asarray(w, np.float32)
    k, n = w.shape
    if k % group_size or k % 2:
        raise ValueError(f"int4 quantization needs K ({k}) divisible by the group size ({group_size}) and by 2")
    g = w.reshape(k // group_size, group_size, n)
    if symmetric:
        amax = np.abs(g).max(axis=1)
        scale = (amax / 7.0).astype(np.float16)
        sf = np.where(scale == 0, 1.0, scale.astype(np.float32))
        q = np.clip(np.rint(g / sf[:, None, :]) + 8, 0, 15)
        mins = None
    else:
        lo, hi = g.min(axis=1), g.max(axis=1)
        scale = ((hi - lo) / 15.0).astype(np.float16)
        mins = lo.astype(np.float16)
        sf = np.where(scale == 0, 1.0, scale.astype(np.float32))
        q = np.clip(np.rint((g - mins.astype(np.float32)[:, None, :]) / sf[:, None, :]), 0, 15)
    codes = pack_int4(q.reshape(k, n))
    return QuantArray(
        codes=jnp.asarray(codes),
        scales=jnp.asarray(scale),
        mins=None if mins is None else jnp.asarray(mins),
        group_size=group_size,
    )


def quantize_int8(w: np.ndarray, group_size: int = 32) -> Int8Array:
    """Symmetric int8 quantization of a dense [K, N] weight, groups along K."""
    w = np.asarray(w, np.float32)
    k, n = w.shape
    g = w.reshape(k // group_size, group_size, n)
    scale = (np.abs(g).max(axis=1) / 127.0).astype(np.float16)
    sf = np.where(scale == 0, 1.0, scale.astype(np.float32))
    q = np.clip(np.rint(g / sf[:, None, :]), -127, 127).astype(np.int8)
    return Int8Array(codes=jnp.asarray(q.reshape(k, n)), scales=jnp.asarray(scale), group_size=group_size)


def regroup(w, group_size: int):
    """The same int4/int8 weight with finer groups (`group_size` divides w.group_size): scales/mins repeated, exact."""
    if w.group_size == group_size:
        return w
    if w.group_size % group_size:
        raise ValueError(f"cannot regroup group size {w.group_size} into {group_size}")
    r = w.group_size // group_size
    rep = lambda a: None if a is None else jnp.repeat(a, r, axis=0)  # noqa: E731
    return w.replace(scales=rep(w.scales), mins=rep(w.mins), group_size=group_size)


def int4_as_int8(w: QuantArray) -> Int8Array:
    """An int4 weight as int8, exactly: symmetric codes become q - 8, asymmetric keep q and their mins."""
    q = unpack_int4(w.codes).astype(jnp.int8)
    if w.mins is None:
        q = q - jnp.int8(8)
    return Int8Array(codes=q, scales=w.scales, mins=w.mins, group_size=w.group_size)


def _as_asymmetric(w, dtype):
    """(scales, mins) in `dtype` with mins present: an int4 symmetric weight's s (q - 8) is s q + (-8 s), exact in
    float32 and in float16 short of overflow; an int8 symmetric weight's min is 0."""
    s = w.scales.astype(dtype)
    if w.mins is not None:
        return s, w.mins.astype(dtype)
    if isinstance(w, QuantArray):
        return s, (-8 * w.scales.astype(jnp.float32)).astype(dtype)
    return s, jnp.zeros_like(s)


def concat_n(ws: list):
    """Concatenate weights along N (q|k|v, gate|up) so one matmul does the work of several, exactly: groups become
    the finest group size, scales float32 if any is, int4 becomes int8 when an int8 part is present, and anything
    mixed with a dense part becomes dense float32."""
    if any(not isinstance(w, (QuantArray, Int8Array)) for w in ws):
        return jnp.concatenate([dequantize(w, jnp.float32) for w in ws], axis=1)
    if any(isinstance(w, Int8Array) for w in ws):
        ws = [int4_as_int8(w) if isinstance(w, QuantArray) else w for w in ws]
    g = min(w.group_size for w in ws)
    ws = [regroup(w, g) for w in ws]
    dtype = jnp.result_type(*[w.scales.dtype for w in ws])
    if any(w.mins is not None for w in ws):
        scales, mins = zip(*[_as_asymmetric(w, dtype) for w in ws])
        mins = jnp.concatenate(mins, axis=1)
    else:
        scales, mins = [w.scales.astype(dtype) for w in ws], None
    return type(ws[0])(codes=jnp.concatenate([w.codes for w in ws], axis=1), scales=jnp.concatenate(scales, axis=1),
                       mins=mins, group_size=g)


# A row's result can depend on how many rows share a call: XLA's CPU dot takes a matrix-vector path for one row
# (float32: most outputs differ in the last bit; bfloat16: about 1 in 10^4 after rounding), and the Pallas kernels
# pick tiles, split-K and attention splits by the row count. A decode step and a speculative verify (K + 1 rows)
# then disagree, and in bfloat16 greedy tokens flip. With LUCEBOX_ROW_INVARIANT=1 (read at import) a single row is
# computed as two here on the CPU, the Pallas kernels use one configuration for every row count (kernels_pallas),
# a verify runs its attention as decode rows (model.forward(verify=)), XLA's CPU attention takes one query at a time
# (kernels_xla), rms_norm sums in a fixed order, every cache gets the same margin and XLA's excess precision is off
# (below). It costs speed (on the CPU the one-row path alone cost about a third of decode; the whole mode's cost is
# not measured), hence off by default. Not covered: the `mgpu` kernel, tree
# verify, XLA's GPU dot.
ROW_INVARIANT = os.environ.get("LUCEBOX_ROW_INVARIANT", "0") == "1"
# attention's splits and sums depend on the cache length, and a speculative job's cache holds the verify's extra
# positions: in this mode every cache gets this margin, plain or speculative (verify spans up to it)
ROW_INVARIANT_CACHE_MARGIN = 32
if ROW_INVARIANT and "xla_allow_excess_precision" not in os.environ.get("XLA_FLAGS", ""):
    # XLA may otherwise keep a bfloat16 op's result in float32 inside a fusion, and fusions differ between a decode
    # step and a verify (a last-position gather splits one): read when XLA first compiles, so set before that
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false").strip()


def matmul_rows(ws, m: int, kernels) -> int:
    """The rows `linear` runs m rows as on any of the weights `ws` (ops.padded_rows; a tensor-parallel weight by its
    shards' kernel): m, or more where a matmul kernel pads its input itself."""
    from . import ops

    out = m
    for w in ws:
        w = getattr(w, "w", w) if hasattr(w, "apply_linear") else w  # (parallel.ShardedLinear: the shards' weight)
        op = getattr(w, "matmul_op", None) or ("qmatmul" if isinstance(w, QuantArray)
                                               else "qmatmul8" if isinstance(w, Int8Array) else None)
        if op is not None and kernels is not None:
            out = max(out, ops.padded_rows(op, getattr(kernels, op), m, w))
    return out


def linear(x: jax.Array, w, bias=None, kernels=None) -> jax.Array:
    """The one matmul dispatch point: x [..., K] @ w [K, N] -> [..., N] in x's dtype.

    int4 weights go through the registered `qmatmul` kernel chosen by `kernels` (a `KernelSet`), int8 weights through
    `qmatmul8`, weights a kernel repacked for itself back to that kernel, dense weights through XLA, tensor-parallel
    weights (`parallel.ShardedLinear`) through this same dispatch once per shard.
    x may be an input left unfinished (`pending_inputs`: a split decode attention's output, gate+up's partial sums):
    a kernel that takes `x_pending` finishes it as it loads x (`takes_pending`), anything else gets it finished first.
    """
    from . import ops

    if hasattr(x, "merged"):  # a pending input
        if not takes_pending(w, kernels):
            return linear(x.merged(), w, bias, kernels)
        y = ops.get("qmatmul", kernels.qmatmul)(None, w, x_pending=x)
        return y if bias is None else y + bias.astype(y.dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    one_row = ROW_INVARIANT and x2.shape[0] == 1 and jax.default_backend() == "cpu"
    if one_row:  # computed as two rows: see ROW_INVARIANT
        x2 = jnp.concatenate([x2, x2])
    if isinstance(w, QuantArray):
        fn = ops.get("qmatmul", kernels.qmatmul if kernels is not None else None)
        y = fn(x2, w)
    elif isinstance(w, Int8Array):
        y = ops.get("qmatmul8", kernels.qmatmul8 if kernels is not None else None)(x2, w)
    elif hasattr(w, "prepared_by"):  # repacked at engine build for one kernel (ops.prepare_weights): back to it
        y = ops.get(w.matmul_op, w.prepared_by)(x2, w)
    elif hasattr(w, "apply_linear"):  # a tensor-parallel weight (parallel.py): this same dispatch, once per shard
        y = w.apply_linear(x2, kernels)
    else:
        y = jnp.dot(x2, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    y = y[:1] if one_row else y
    y = y.reshape(*lead, y.shape[-1])
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y


def takes_pending(w, kernels) -> bool:
    """Whether `linear` hands a pending input to w's kernel unfinished (an int4 weight whose `qmatmul` takes
    `x_pending`; never in the row-invariant mode, whose sums are ordered)."""
    from . import ops

    return (isinstance(w, QuantArray) and kernels is not None and not ROW_INVARIANT
            and ops.accepts("qmatmul", kernels.qmatmul, "x_pending"))


def linear_parts(x: jax.Array, w, kernels=None) -> tuple:
    """x [M, K] @ w as a tuple of arrays [P, R, N] (R >= M; rows from M on are padding) whose sum over every P is
    the product before `linear`'s cast to x's dtype: a kernel that takes `parts` hands over its split-K partial
    sums as it wrote them (no kernel runs to add them; a consumer that can, `qkv_prologue`, adds them on its loads),
    any other weight or kernel the product itself as one part."""
    from . import ops

    op, name = None, None
    if isinstance(w, QuantArray):
        op, name = "qmatmul", kernels.qmatmul if kernels is not None else None
    elif isinstance(w, Int8Array):
        op, name = "qmatmul8", kernels.qmatmul8 if kernels is not None else None
    elif hasattr(w, "prepared_by"):
        op, name = w.matmul_op, w.prepared_by
    if op is not None and not ROW_INVARIANT and ops.accepts(op, name or ops.default_name(op), "parts"):
        return tuple(ops.get(op, name)(x, w, parts=True))
    return (linear(x, w, kernels=kernels)[None],)


def weight_nbytes(tree) -> int:
    """Bytes of every weight leaf in a pytree (what one decode step must read)."""
    total = 0
    is_w = lambda t: isinstance(t, (QuantArray, Int8Array)) or hasattr(t, "prepared_by")  # noqa: E731
    for leaf in jax.tree_util.tree_leaves(tree, is_leaf=is_w):
        if is_w(leaf):
            total += leaf.nbytes
        elif hasattr(leaf, "nbytes"):
            total += leaf.nbytes
    return total


__all__ = [
    "QuantArray",
    "Int8Array",
    "pack_int4",
    "unpack_int4",
    "dequantize",
    "dequantize_np",
    "quantize_int4",
    "quantize_int8",
    "regroup",
    "int4_as_int8",
    "concat_n",
    "linear",
    "linear_parts",
    "takes_pending",
    "weight_nbytes",
]
