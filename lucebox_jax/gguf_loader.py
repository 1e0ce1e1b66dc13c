"""GGUF import through the `gguf` library: model config from metadata, weights into the engine's formats.

Every common tensor type imports *exactly* (`gguf_quants`): Q4_0/Q4_1/Q4_K/Q2_K/Q3_K into int4 `QuantArray`s,
Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 into `Int8Array`s, F32/F16/BF16 stay dense. Other types (IQ*, TQ*, ...) are refused with
an `UnsupportedModelError` naming the tensor, or, with `lossy=True` / `LUCEBOX_LOSSY_IMPORT=1`, dequantized by
`gguf` and re-quantized to int4 (group size configurable) with the error logged. GGUF stores a linear weight as rows
of `out` features, each of `in` values (blocks along `in`); the engine's weights are [K = in, N = out].
"""

from __future__ import annotations

import logging
import os
from collections import Counter

import jax.numpy as jnp
import numpy as np

from .config import ARCHITECTURES, ModelConfig
from .errors import ModelNotFoundError, UnsupportedModelError
from .gguf_quants import EXACT, dequantize_tensor, import_embedding_parts, import_linear  # noqa: F401 - re-exported
from .model import EmbedTable, LayerWeights, Weights
from .quant import concat_n

log = logging.getLogger(__name__)


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
    gemma = _gemma3_settings(meta, dim, head_dim) if arch == "gemma3" else {}
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
        qk_norm=arch in ("qwen3", "gemma3"),
        rope_interleaved=arch == "llama",  # qwen, gemma: NEOX halves
        dtype=dtype,
        **gemma,
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


# llama.cpp's Gemma 3 constants that the GGUF does not store (llama-model.cpp, LLM_ARCH_GEMMA3)
GEMMA3_SWA_PATTERN = 6  # every 6th layer is global
GEMMA3_ROPE_BASE_LOCAL = 10000.0


def _gemma3_settings(meta: dict, dim: int, head_dim: int) -> dict:
    """Gemma 3 as configuration, following llama.cpp (q/k norm and NEOX RoPE are set above): GeGLU, embeddings times
    sqrt(dim), attention scale 1/sqrt(key_length) (HF's query_pre_attn_scalar; the 27B, 62 layers, uses dim / heads),
    five local layers of `sliding_window` keys per global one, logit softcapping only if the GGUF has it.
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


def fuse_n(ws: list):
    """Concatenate weights along N (q|k|v, gate|up) so one matmul does the work of several (exact: `concat_n`)."""
    return concat_n(ws)


def import_embedding(t, lossy: bool | None = None) -> EmbedTable:
    table, scales, mins, g = import_embedding_parts(t, lossy)
    return EmbedTable(table=jnp.asarray(table), scales=None if scales is None else jnp.asarray(scales),
                      group_size=g, mins=None if mins is None else jnp.asarray(mins))


def load_gguf(path: str, dtype: str = "float32", group_size: int = 128, lossy: bool | None = None):
    """Read a GGUF file -> (ModelConfig, Weights, metadata dict). lossy: allow re-quantizing types without an exact
    import (None: the LUCEBOX_LOSSY_IMPORT environment variable); group_size: the int4 group of that lossy path."""
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
    sandwich = cfg.arch == "gemma3"
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        wqkv = fuse_n([import_linear(need(p + f"attn_{n}.weight"), group_size, lossy) for n in "qkv"])
        bqkv = None
        if cfg.qkv_bias:
            bqkv = jnp.concatenate([vec(p + f"attn_{n}.bias") for n in "qkv"])
        layers.append(
            LayerWeights(
                attn_norm=vec(p + "attn_norm.weight"),
                wqkv=wqkv,
                wo=import_linear(need(p + "attn_output.weight"), group_size, lossy),
                ffn_norm=vec(p + "ffn_norm.weight"),
                w_gate_up=fuse_n([import_linear(need(p + f"ffn_{n}.weight"), group_size, lossy) for n in ("gate", "up")]),
                w_down=import_linear(need(p + "ffn_down.weight"), group_size, lossy),
                bqkv=bqkv,
                q_norm=vec(p + "attn_q_norm.weight") if cfg.qk_norm else None,
                k_norm=vec(p + "attn_k_norm.weight") if cfg.qk_norm else None,
                post_attn_norm=vec(p + "post_attention_norm.weight") if sandwich else None,
                post_ffn_norm=vec(p + "post_ffw_norm.weight") if sandwich else None,
            )
        )
    emb_t = need("token_embd.weight")
    tied = "output.weight" not in tensors
    head = import_linear(emb_t if tied else tensors["output.weight"], group_size, lossy)
    weights = Weights(embed=import_embedding(emb_t, lossy), layers=tuple(layers), final_norm=vec("output_norm.weight"),
                      head=head)
    cfg = cfg.replace(tied_embeddings=tied, vocab_size=int(emb_t.shape[1]))
    kinds = Counter(t.tensor_type.name for t in tensors.values())
    lossy_kinds = sorted(k for k in kinds if k not in EXACT)
    log.info("imported %s: %s%s", os.path.basename(path), ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())),
             f" (re-quantized, lossy: {', '.join(lossy_kinds)})" if lossy_kinds else " (all exact)")
    return cfg, weights, meta
