"""GGUF tensor types -> the engine's int4 / int8 formats, exactly (no re-quantization).

Each converter reads a tensor's raw blocks ([out, n_blocks, block_bytes], blocks along `in`) and returns `Rows`:
integer codes [out, in], per-group scales (and mins) [out, in // g]. The value of an element is the one
`gguf.quants.dequantize` computes, bit for bit:

  Q4_0  int4 g32  d (q - 8)              Q5_0  int8 g32  d (q - 16)         Q8_0  int8 g32  d q
  Q4_1  int4 g32  d q + m                Q5_1  int8 g32  d q + m
  Q4_K  int4 g32  (d sc) q - dmin m      Q5_K  int8 g32  (d sc) q - dmin m  Q6_K  int8 g16  (d sc) (q - 32)
  Q2_K  int4 g16  (d sc) q - dmin m      Q3_K  int4 g16  (d sc) q, q in -4..3 (stored as q + 8, symmetric)

Scale dtype: a K-quant's per-group scale is a float16 super-block scale times a 4-8 bit integer, which needs up to
19 significant bits: float16 cannot hold it, float32 holds it exactly (as do gguf's own float32 products). So a
tensor's scales and mins are float16 when every one of them is a float16 value (Q4_0/Q4_1/Q5_x/Q8_0 always) and
float32 otherwise (K-quants, in practice): exact in every case, at 1 extra bit per weight for int4 g32 (6 bits
instead of 5 with mins) and 1 for int8 g16 (10 bits instead of 9).

Types without an exact converter (IQ*, TQ*, MXFP4, ...) raise `UnsupportedModelError` naming the tensor and the type,
unless lossy import is asked for (`LUCEBOX_LOSSY_IMPORT=1` or `load_gguf(..., lossy=True)`): then `gguf` dequantizes
them and they are re-quantized to int4 with the error logged as a warning.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax.numpy as jnp
import numpy as np

from .errors import UnsupportedModelError
from .quant import Int8Array, QuantArray, dequantize_np, pack_int4, quantize_int4

log = logging.getLogger(__name__)

DENSE = ("F32", "F16", "BF16")
LOSSY_ENV = "LUCEBOX_LOSSY_IMPORT"


@dataclasses.dataclass
class Rows:
    """A quantized tensor in GGUF's row order: value[o, i] = scales[o, i // g] * (codes[o, i] - offset) + mins."""

    codes: np.ndarray  # [out, in]: uint8 0..15 (bits 4) or int8 (bits 8)
    scales: np.ndarray  # [out, in // g] float16 or float32
    mins: np.ndarray | None
    group_size: int
    bits: int  # 4: int4 codes (symmetric means value = s (q - 8)); 8: int8 codes (value = s q)


def _blocks(t, block_bytes: int) -> np.ndarray:
    """Raw tensor bytes as [out, n_blocks, block_bytes]."""
    data = np.asarray(t.data, np.uint8)
    return data.reshape(data.shape[0], -1, block_bytes)


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> float32 [...] (the float16 value, exactly)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 2n]: the n low nibbles, then the n high nibbles (ggml's order within a run)."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _bits(b: np.ndarray, n: int) -> np.ndarray:
    """[..., m] bytes -> [..., n, m]: bit j of every byte in row j."""
    return (b[..., None, :] >> np.arange(n, dtype=np.uint8)[:, None]) & 1


def _store_dtype(*arrays) -> type:
    """float16 when every value is a float16 value (the scale is stored exactly either way), else float32."""
    for a in arrays:
        if a is not None and not np.array_equal(a.astype(np.float16).astype(np.float32), a):
            return np.float32
    return np.float16


def _rows(codes, scales, mins, group_size, bits) -> Rows:
    """Flatten [out, groups, g] codes and [out, groups] scales/mins into `Rows` with the exact storage dtype."""
    out = codes.shape[0]
    dt = _store_dtype(scales, mins)
    return Rows(codes=codes.reshape(out, -1), scales=scales.reshape(out, -1).astype(dt),
                mins=None if mins is None else mins.reshape(out, -1).astype(dt), group_size=group_size, bits=bits)


def q4_0(t) -> Rows:
    b = _blocks(t, 18)
    return _rows(_nibbles(b[..., 2:]), _f16(b[..., 0:2]), None, 32, 4)


def q4_1(t) -> Rows:
    b = _blocks(t, 20)
    return _rows(_nibbles(b[..., 4:]), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 32, 4)


def _q5_codes(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: 4 low bits in nibbles, bit 4 of element j is bit j of the little-endian 32-bit qh."""
    high = _bits(qh, 8).transpose(0, 1, 3, 2).reshape(*qh.shape[:-1], 32)  # byte i bit j -> element 8 i + j
    return _nibbles(qs) | (high << 4)


def q5_0(t) -> Rows:
    b = _blocks(t, 22)
    q = _q5_codes(b[..., 2:6], b[..., 6:]).astype(np.int8) - np.int8(16)
    return _rows(q, _f16(b[..., 0:2]), None, 32, 8)


def q5_1(t) -> Rows:
    b = _blocks(t, 24)
    q = _q5_codes(b[..., 4:8], b[..., 8:]).astype(np.int8)
    return _rows(q, _f16(b[..., 0:2]), _f16(b[..., 2:4]), 32, 8)


def q8_0(t) -> Rows:
    b = _blocks(t, 34)
    return _rows(np.ascontiguousarray(b[..., 2:]).view(np.int8), _f16(b[..., 0:2]), None, 32, 8)


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (float32)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_affine(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K header (d, dmin, 12 scale bytes) -> per-32 scales d sc and mins -dmin m [out, nb, 8]."""
    sc, mn = _k_scale_min(b[..., 4:16])
    return _f16(b[..., 0:2])[..., None] * sc, -(_f16(b[..., 2:4])[..., None] * mn)


def _k_low4(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> [.., 8, 32] codes: sub-blocks 2c and 2c + 1 are the low and high nibbles of bytes 32c..32c+31."""
    lead = qs.shape[:-1]
    q = qs.reshape(*lead, 4, 32)
    return np.stack([q & 0xF, q >> 4], axis=-2).reshape(*lead, 8, 32)


def q4_k(t) -> Rows:
    b = _blocks(t, 144)
    s, m = _k_affine(b)
    return _rows(_k_low4(b[..., 16:]), s, m, 32, 4)


def q5_k(t) -> Rows:
    b = _blocks(t, 176)
    s, m = _k_affine(b)
    q = _k_low4(b[..., 48:]) | (_bits(b[..., 16:48], 8) << 4)  # sub-block j's bit 4: bit j of the 32 qh bytes
    return _rows(q.astype(np.int8), s, m, 32, 8)


def q6_k(t) -> Rows:
    b = _blocks(t, 210)
    lead = b.shape[:2]
    ql = b[..., 0:128].reshape(*lead, 2, 64)
    ql = np.stack([ql & 0xF, ql >> 4], axis=-2).reshape(*lead, 8, 32)
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    q = (ql | ((qh & 3).reshape(*lead, 8, 32) << 4)).astype(np.int8) - np.int8(32)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    return _rows(q.reshape(*lead, 16, 16), _f16(b[..., 208:210])[..., None] * sc, None, 16, 8)


def q2_k(t) -> Rows:
    b = _blocks(t, 84)
    lead = b.shape[:2]
    sc = b[..., 0:16]
    qs = b[..., 16:80].reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    q = (qs & 3).reshape(*lead, 16, 16)
    s = _f16(b[..., 80:82])[..., None] * (sc & 0xF).astype(np.float32)
    m = -(_f16(b[..., 82:84])[..., None] * (sc >> 4).astype(np.float32))
    return _rows(q, s, m, 16, 4)


def q3_k(t) -> Rows:
    b = _blocks(t, 110)
    lead = b.shape[:2]
    hmask, qs, sb = b[..., 0:32], b[..., 32:96], b[..., 96:108]
    low = (sb[..., 0:8, None] >> np.array([0, 4], np.uint8)).transpose(0, 1, 3, 2).reshape(*lead, 16) & 0xF
    high = (sb[..., 8:12, None] >> np.array([0, 2, 4, 6], np.uint8)).transpose(0, 1, 3, 2).reshape(*lead, 16) & 3
    sc = (low | (high << 4)).astype(np.int8) - np.int8(32)
    ql = (qs.reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]).reshape(*lead, 16, 16) & 3
    qh = (hmask.reshape(*lead, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]).reshape(*lead, 16, 16) & 1
    q = ql.astype(np.int8) - ((qh ^ 1) << 2).astype(np.int8)  # -4..3; a set hmask bit means no offset
    return _rows((q + 8).astype(np.uint8), _f16(b[..., 108:110])[..., None] * sc.astype(np.float32), None, 16, 4)


CONVERTERS = {"Q4_0": q4_0, "Q4_1": q4_1, "Q5_0": q5_0, "Q5_1": q5_1, "Q8_0": q8_0, "Q4_K": q4_k, "Q5_K": q5_k,
              "Q6_K": q6_k, "Q2_K": q2_k, "Q3_K": q3_k}
EXACT = tuple(CONVERTERS) + DENSE


def rows_to_linear(r: Rows):
    """GGUF rows [out, in] -> the engine's [K = in, N = out] QuantArray (bits 4) or Int8Array (bits 8)."""
    scales = jnp.asarray(np.ascontiguousarray(r.scales.T))
    mins = None if r.mins is None else jnp.asarray(np.ascontiguousarray(r.mins.T))
    if r.bits == 4:
        return QuantArray(codes=jnp.asarray(pack_int4(r.codes.T)), scales=scales, mins=mins, group_size=r.group_size)
    return Int8Array(codes=jnp.asarray(np.ascontiguousarray(r.codes.T)), scales=scales, mins=mins,
                     group_size=r.group_size)


def rows_as_int8(r: Rows) -> Rows:
    """int4 rows as int8 rows (symmetric codes shifted to q - 8), exact: the embedding table's format."""
    if r.bits == 8:
        return r
    q = r.codes.astype(np.int8)
    return dataclasses.replace(r, codes=q - np.int8(8) if r.mins is None else q, bits=8)


def dequantize_tensor(t) -> np.ndarray:
    """Any GGUF tensor -> float32 [out, in] (or its 1-D shape), through the gguf library."""
    import gguf

    try:
        arr = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    except NotImplementedError as e:
        raise UnsupportedModelError(f"tensor {t.name} has type {t.tensor_type.name}, which gguf cannot read: {e}")
    return np.asarray(arr, np.float32).reshape(tuple(int(s) for s in reversed(t.shape)))


def lossy_allowed(lossy: bool | None) -> bool:
    if lossy is not None:
        return lossy
    return os.environ.get(LOSSY_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def refuse(t):
    raise UnsupportedModelError(
        f"tensor {t.name} has GGUF type {t.tensor_type.name}, which has no exact import (exact types: "
        f"{', '.join(EXACT)}); set {LOSSY_ENV}=1 to re-quantize such tensors to int4 with the error logged")


def requantize(t, group_size: int) -> QuantArray:
    """The explicit lossy path: gguf dequantizes, we re-quantize to int4 and log the relative error."""
    w = dequantize_tensor(t).T  # [in, out]
    g = group_size if w.shape[0] % (2 * group_size) == 0 else 32
    qa = quantize_int4(w, group_size=g)
    err = np.linalg.norm(dequantize_np(qa) - w) / max(np.linalg.norm(w), 1e-30)
    log.warning("LOSSY import: re-quantized %s (%s) to int4 g%d, relative error %.4f", t.name, t.tensor_type.name,
                g, err)
    return qa


def import_linear(t, group_size: int = 128, lossy: bool | None = None):
    """One GGUF linear weight -> the engine's [K = in, N = out] weight: exact for `EXACT` types."""
    kind = t.tensor_type.name
    if kind in CONVERTERS:
        return rows_to_linear(CONVERTERS[kind](t))
    if kind in DENSE:
        w = dequantize_tensor(t).T
        return jnp.asarray(w.astype(np.float16 if kind == "F16" else np.float32))
    if not lossy_allowed(lossy):
        refuse(t)
    return requantize(t, group_size)


def import_embedding_parts(t, lossy: bool | None = None) -> tuple[np.ndarray, np.ndarray | None,
                                                                   np.ndarray | None, int]:
    """Token embedding -> (table [V, D], scales, mins, group_size): int8 codes with their exact per-group scales for
    quantized types (Gemma 3's 640 x 262144 Q8_0 table stays int8: 168 MB, not 671 MB of float32), dense otherwise."""
    kind = t.tensor_type.name
    if kind in CONVERTERS:
        r = rows_as_int8(CONVERTERS[kind](t))
        return r.codes, r.scales, r.mins, r.group_size
    if kind not in DENSE and not lossy_allowed(lossy):
        refuse(t)
    if kind not in DENSE:
        log.warning("LOSSY import: embedding %s (%s) dequantized to float16", t.name, kind)
    dense = dequantize_tensor(t)
    return dense.astype(np.float32 if kind == "F32" else np.float16), None, None, 32
