"""GGUF import through the `gguf` library: model config from metadata, weights into the engine's formats.

Q4_0 / Q4_1 tensors import *exactly* into int4 `QuantArray`s (group 32; Q4_1's d and m become scale and min), Q8_0
into `Int8Array`, F32/F16/BF16 stay dense, and any other type is dequantized by `gguf` and re-quantized to int4
(group size configurable) with its reconstruction error logged. GGUF stores a linear weight as rows of `out`
features, each of `in` values (blocks of 32 along `in`); the engine's weights are [K = in, N = out].
"""

from __future__ import annotations

import logging
import os

import jax.numpy as jnp
import numpy as np

from .config import ARCHITECTURES, ModelConfig
from .errors import ModelNotFoundError, UnsupportedModelError
from .model import EmbedTable, LayerWeights, Weights
from .quant import Int8Array, QuantArray, dequantize_np, pack_int4, quantize_int4

log = logging.getLogger(__name__)

Q4_0, Q4_1, Q8_0 = "Q4_0", "Q4_1", "Q8_0"
DENSE = ("F32", "F16", "BF16")


def open_reader(path: str):
    import gguf

    if not os.path.isfile(path):
        raise ModelNotFoundError(f"model file not found: {os.path.abspath(path)}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/OSError/struct errors on a bad file
        raise ModelNotFoundError(f"cannot read GGUF file {os.path.abspath(path)}: {e}") from e


def read_metadata(reader) -> dict:
    """Every scalar/string/array metadata field as plain Python values."""
    meta = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            meta[name] = field.contents()
        except Exception:  # a field type the library cannot decode: skip, it is not one we need
            continue
    return meta


def config_from_metadata(meta: dict, dtype: str = "float32") -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"
        )

    def get(key, default=None):
        v = meta.get(f"{arch}.{key}", default)
        if v is None:
            raise UnsupportedModelError(f"GGUF metadata lacks {arch}.{key}")
        return v

    def num(key, default=None, kind=int):
        v = get(key, default)
        try:
            if isinstance(v, bool) or (kind is int and float(v) != int(v)):
                raise ValueError
            return kind(v)
        except (TypeError, ValueError, OverflowError):
            raise UnsupportedModelError(f"GGUF metadata {arch}.{key} is {v!r:.60}, not a number of the right "
                                        "kind") from None

    dim = num("embedding_length")
    n_heads = num("attention.head_count")
    if n_heads < 1 or dim < 1:
        raise UnsupportedModelError(f"degenerate model: {n_heads} attention heads, embedding length {dim}")
    head_dim = num("attention.key_length", dim // n_heads)
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    cfg = ModelConfig(
        arch=arch,
        vocab_size=int(vocab),
        dim=dim,
        n_layers=num("block_count"),
        n_heads=n_heads,
        n_kv_heads=num("attention.head_count_kv", n_heads),
        head_dim=head_dim,
        ffn_dim=num("feed_forward_length"),
        rope_theta=num("rope.freq_base", 10000.0, float),
        rms_eps=num("attention.layer_norm_rms_epsilon", 1e-6, float),
        max_context=num("context_length", 2048),
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        rope_interleaved=arch == "llama",
        dtype=dtype,
    )
    validate_config(cfg, has_key_length=f"{arch}.attention.key_length" in meta)
    return cfg


def validate_config(cfg: ModelConfig, has_key_length: bool = True):
    """Refuse metadata the engine cannot run (zero or non-dividing heads, odd head size, ...) as UnsupportedModelError
    instead of a ZeroDivisionError or a shape error deep in jit."""
    problems = [f"{name} is {v}, must be >= {lo}" for name, v, lo in (
        ("block_count", cfg.n_layers, 1), ("attention.head_count_kv", cfg.n_kv_heads, 1),
        ("feed_forward_length", cfg.ffn_dim, 1), ("vocabulary size", cfg.vocab_size, 1),
        ("context_length", cfg.max_context, 2), ("head size", cfg.head_dim, 2)) if v < lo]
    if cfg.n_kv_heads >= 1 and cfg.n_heads % cfg.n_kv_heads:
        problems.append(f"{cfg.n_heads} attention heads do not divide into {cfg.n_kv_heads} key/value heads")
    if cfg.head_dim % 2:
        problems.append(f"head size {cfg.head_dim} is odd (RoPE rotates pairs)")
    if not has_key_length and cfg.dim % cfg.n_heads:
        problems.append(f"embedding length {cfg.dim} is not a multiple of {cfg.n_heads} heads")
    if not (cfg.rope_theta > 0 and cfg.rms_eps > 0) or not all(map(np.isfinite, (cfg.rope_theta, cfg.rms_eps))):
        problems.append(f"rope.freq_base {cfg.rope_theta} and layer_norm_rms_epsilon {cfg.rms_eps} must be > 0")
    if problems:
        raise UnsupportedModelError("unsupported model metadata: " + "; ".join(problems))


def check_shapes(cfg: ModelConfig, tensors: dict):
    """Each tensor the engine reads has the shape the config implies (GGUF lists dims innermost first)."""
    d, hd, f = cfg.dim, cfg.head_dim, cfg.ffn_dim
    want = {"output_norm.weight": (d,)}
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        want.update({p + "attn_q.weight": (d, cfg.n_heads * hd), p + "attn_k.weight": (d, cfg.n_kv_heads * hd),
                     p + "attn_v.weight": (d, cfg.n_kv_heads * hd), p + "attn_output.weight": (cfg.n_heads * hd, d),
                     p + "ffn_gate.weight": (d, f), p + "ffn_up.weight": (d, f), p + "ffn_down.weight": (f, d),
                     p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,), p + "attn_q_norm.weight": (hd,),
                     p + "attn_k_norm.weight": (hd,)})
    emb = tensors.get("token_embd.weight")
    if emb is not None:
        want["token_embd.weight"] = (d, int(emb.shape[1]) if len(emb.shape) > 1 else -1)
        want["output.weight"] = want["token_embd.weight"]
    for name, shape in want.items():
        t = tensors.get(name)
        if t is not None and tuple(int(x) for x in t.shape) != shape:
            raise UnsupportedModelError(f"tensor {name} has shape {[int(x) for x in t.shape]}, but the metadata "
                                        f"implies {list(shape)}")


def _blocks(t, block_bytes: int) -> np.ndarray:
    """Raw tensor bytes as [out, n_blocks, block_bytes]."""
    data = np.asarray(t.data, np.uint8)
    return data.reshape(data.shape[0], -1, block_bytes)


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> float16 [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def import_q4(t) -> QuantArray:
    """Q4_0 / Q4_1 -> QuantArray, bit-exact. Block: d (f16)[, m (f16)], 16 bytes: low nibbles are elements
    0..15, high nibbles 16..31."""
    kind = t.tensor_type.name
    bb = 18 if kind == Q4_0 else 20
    blk = _blocks(t, bb)
    out, nb = blk.shape[:2]
    d = _f16(blk[..., 0:2])  # [out, nb]
    m = _f16(blk[..., 2:4]) if kind == Q4_1 else None
    qs = blk[..., bb - 16 :]  # [out, nb, 16]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(out, nb * 32)  # [out, in]
    return QuantArray(
        codes=jnp.asarray(pack_int4(q.T)),
        scales=jnp.asarray(np.ascontiguousarray(d.T)),
        mins=None if m is None else jnp.asarray(np.ascontiguousarray(m.T)),
        group_size=32,
    )


def _q8_parts(t) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 -> (codes int8 [out, in], scales float16 [out, in // 32])."""
    blk = _blocks(t, 34)
    out, nb = blk.shape[:2]
    d = _f16(blk[..., 0:2])
    q = np.ascontiguousarray(blk[..., 2:]).view(np.int8).reshape(out, nb * 32)
    return q, d


def import_q8(t) -> Int8Array:
    q, d = _q8_parts(t)
    return Int8Array(codes=jnp.asarray(q.T.copy()), scales=jnp.asarray(d.T.copy()), group_size=32)


def dequantize_tensor(t) -> np.ndarray:
    """Any GGUF tensor -> float32 [out, in] (or its 1-D shape), through the gguf library."""
    import gguf

    try:
        arr = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    except NotImplementedError as e:
        raise UnsupportedModelError(f"tensor {t.name} has type {t.tensor_type.name}, which gguf cannot read: {e}")
    return np.asarray(arr, np.float32).reshape(tuple(int(s) for s in reversed(t.shape)))


def import_linear(t, group_size: int):
    kind = t.tensor_type.name
    if kind in (Q4_0, Q4_1):
        return import_q4(t)
    if kind == Q8_0:
        return import_q8(t)
    w = dequantize_tensor(t).T  # [in, out]
    if kind in DENSE:
        return jnp.asarray(w.astype(np.float16 if kind == "F16" else np.float32))
    g = group_size if w.shape[0] % (2 * group_size) == 0 else 32
    qa = quantize_int4(w, group_size=g)
    err = np.linalg.norm(dequantize_np(qa) - w) / max(np.linalg.norm(w), 1e-30)
    log.warning("re-quantized %s (%s) to int4 g%d: relative error %.4f", t.name, kind, g, err)
    return qa


def fuse_n(ws: list):
    """Concatenate weights along N (q|k|v, gate|up) so one matmul does the work of several."""
    if all(isinstance(w, QuantArray) for w in ws) and len({w.group_size for w in ws}) == 1:
        if any(w.mins is not None for w in ws):  # symmetric -> asymmetric is exact: min = -8 * scale
            mins = [w.mins if w.mins is not None else (-8 * w.scales.astype(jnp.float32)).astype(jnp.float16)
                    for w in ws]
            mins = jnp.concatenate(mins, axis=1)
        else:
            mins = None
        return QuantArray(
            codes=jnp.concatenate([w.codes for w in ws], axis=1),
            scales=jnp.concatenate([w.scales for w in ws], axis=1),
            mins=mins,
            group_size=ws[0].group_size,
        )
    if all(isinstance(w, Int8Array) for w in ws) and len({w.group_size for w in ws}) == 1:
        return Int8Array(codes=jnp.concatenate([w.codes for w in ws], axis=1),
                         scales=jnp.concatenate([w.scales for w in ws], axis=1), group_size=ws[0].group_size)
    if all(not isinstance(w, (QuantArray, Int8Array)) for w in ws):
        return jnp.concatenate([jnp.asarray(w, jnp.float32) for w in ws], axis=1)
    dense = np.concatenate([dequantize_np(w) for w in ws], axis=1)  # mixed formats: one int4 re-quantization
    return quantize_int4(dense, group_size=32)


def import_embedding(t) -> EmbedTable:
    if t.tensor_type.name == Q8_0:
        q, d = _q8_parts(t)
        return EmbedTable(table=jnp.asarray(q), scales=jnp.asarray(d), group_size=32)
    return EmbedTable(table=jnp.asarray(dequantize_tensor(t).astype(np.float16)))


def load_gguf(path: str, dtype: str = "float32", group_size: int = 128):
    """Read a GGUF file -> (ModelConfig, Weights, metadata dict)."""
    reader = open_reader(path)
    meta = read_metadata(reader)
    cfg = config_from_metadata(meta, dtype)
    tensors = {t.name: t for t in reader.tensors}
    check_shapes(cfg, tensors)

    def need(name):
        if name not in tensors:
            raise UnsupportedModelError(f"GGUF file {path} lacks tensor {name!r}")
        return tensors[name]

    def vec(name):
        return jnp.asarray(dequantize_tensor(need(name)).reshape(-1), jnp.float32)

    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        wqkv = fuse_n([import_linear(need(p + f"attn_{n}.weight"), group_size) for n in "qkv"])
        bqkv = None
        if cfg.qkv_bias:
            bqkv = jnp.concatenate([vec(p + f"attn_{n}.bias") for n in "qkv"])
        layers.append(
            LayerWeights(
                attn_norm=vec(p + "attn_norm.weight"),
                wqkv=wqkv,
                wo=import_linear(need(p + "attn_output.weight"), group_size),
                ffn_norm=vec(p + "ffn_norm.weight"),
                w_gate_up=fuse_n([import_linear(need(p + f"ffn_{n}.weight"), group_size) for n in ("gate", "up")]),
                w_down=import_linear(need(p + "ffn_down.weight"), group_size),
                bqkv=bqkv,
                q_norm=vec(p + "attn_q_norm.weight") if cfg.qk_norm else None,
                k_norm=vec(p + "attn_k_norm.weight") if cfg.qk_norm else None,
            )
        )
    emb_t = need("token_embd.weight")
    tied = "output.weight" not in tensors
    head = import_linear(emb_t if tied else tensors["output.weight"], group_size)
    weights = Weights(embed=import_embedding(emb_t), layers=tuple(layers), final_norm=vec("output_norm.weight"),
                      head=head)
    cfg = cfg.replace(tied_embeddings=tied, vocab_size=int(emb_t.shape[1]))
    for name, t in tensors.items():
        kind = t.tensor_type.name
        if kind not in (Q4_0, Q4_1, Q8_0) + DENSE:
            log.info("tensor %s of type %s was re-quantized", name, kind)
    return cfg, weights, meta
