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

    dim = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", dim // n_heads))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    gemma = _gemma3_settings(meta, dim, head_dim) if arch == "gemma3" else {}
    return ModelConfig(
        arch=arch,
        vocab_size=int(vocab),
        dim=dim,
        n_layers=int(get("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        ffn_dim=int(get("feed_forward_length")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        max_context=int(get("context_length", 2048)),
        qkv_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "gemma3"),
        rope_interleaved=arch == "llama",  # qwen, gemma: NEOX halves
        dtype=dtype,
        **gemma,
    )


# llama.cpp's Gemma 3 constants that the GGUF does not store (llama-model.cpp, LLM_ARCH_GEMMA3)
GEMMA3_SWA_PATTERN = 6  # every 6th layer is global
GEMMA3_ROPE_BASE_LOCAL = 10000.0


def _gemma3_settings(meta: dict, dim: int, head_dim: int) -> dict:
    """Gemma 3 as configuration, following llama.cpp (q/k norm and NEOX RoPE are set above): GeGLU, embeddings times sqrt(dim),
    attention scale 1/sqrt(key_length) (HF's query_pre_attn_scalar; the 27B, 62 layers, uses dim / heads), five
    local layers of `sliding_window` keys per global one, logit softcapping only if the GGUF has it.
    The GGUF's norm weights already hold Gemma's (1 + w): convert_hf_to_gguf.py adds the 1, so they apply as is."""
    rope_scale = 1.0
    if meta.get("gemma3.rope.scaling.type") == "linear":
        rope_scale = float(meta.get("gemma3.rope.scaling.factor", 1.0))
    n_heads = int(meta["gemma3.attention.head_count"])
    scale_dim = dim / n_heads if int(meta.get("gemma3.block_count", 0)) == 62 else head_dim  # 27B: d / heads
    return dict(
        activation="gelu_tanh",
        embed_scale=float(np.sqrt(np.float32(dim))),
        attn_scale=float(1.0 / np.sqrt(np.float32(scale_dim))),
        sliding_window=int(meta.get("gemma3.attention.sliding_window", 0)),
        sliding_window_pattern=GEMMA3_SWA_PATTERN,
        rope_theta_local=GEMMA3_ROPE_BASE_LOCAL,
        rope_scale=rope_scale,
        final_softcap=float(meta.get("gemma3.final_logit_softcapping", 0.0) or 0.0),
    )


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

    def need(name):
        if name not in tensors:
            raise UnsupportedModelError(f"GGUF file {path} lacks tensor {name!r}")
        return tensors[name]

    def vec(name):
        return jnp.asarray(dequantize_tensor(need(name)).reshape(-1), jnp.float32)

    layers = []
    sandwich = cfg.arch == "gemma3"
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
                post_attn_norm=vec(p + "post_attention_norm.weight") if sandwich else None,
                post_ffn_norm=vec(p + "post_ffw_norm.weight") if sandwich else None,
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
