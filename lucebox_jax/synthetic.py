"""Models with random weights at real shapes, built directly on the device: tiny ones for logic tests, Gemma 3 270M
and 8B/27B/32B ones for speed work (speed does not depend on weight values; never report quality or acceptance from
these)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .model import EmbedTable, LayerWeights, Weights
from .quant import Int8Array, QuantArray

PRESETS = {
    "tiny": ModelConfig(arch="llama", vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                        ffn_dim=128, rope_theta=10000.0, max_context=512),
    "smollm2-135m": ModelConfig(arch="llama", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                                head_dim=64, ffn_dim=1536, rope_theta=100000.0, max_context=8192),
    "llama3-8b": ModelConfig(arch="llama", vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                             head_dim=128, ffn_dim=14336, rope_theta=500000.0, max_context=8192,
                             tied_embeddings=False),
    "gemma2-27b-shape": ModelConfig(arch="llama", vocab_size=256000, dim=4608, n_layers=46, n_heads=32,
                                    n_kv_heads=16, head_dim=128, ffn_dim=36864, max_context=8192,
                                    tied_embeddings=True),
    "gemma3_270m": ModelConfig(arch="gemma3", vocab_size=262144, dim=640, n_layers=18, n_heads=4, n_kv_heads=1,
                               head_dim=256, ffn_dim=2048, rope_theta=1000000.0, rms_eps=1e-6, max_context=32768,
                               qk_norm=True, rope_interleaved=False, activation="gelu_tanh",
                               embed_scale=640 ** 0.5, attn_scale=256 ** -0.5, sliding_window=512,
                               sliding_window_pattern=6, rope_theta_local=10000.0),
    "qwen3-32b": ModelConfig(arch="qwen3", vocab_size=151936, dim=5120, n_layers=64, n_heads=64, n_kv_heads=8,
                             head_dim=128, ffn_dim=25600, rope_theta=1000000.0, max_context=8192,
                             tied_embeddings=False, qk_norm=True, rope_interleaved=False),
}


def decode_matmuls(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(label, K, N) of a model's matmuls in a decode step as `random_weights` lays them out (q, k, v in one weight;
    gate and up in one), the LM head last: the shapes the kernel benchmarks and tables are keyed by."""
    return [("gate_up", cfg.dim, 2 * cfg.ffn_dim), ("down", cfg.ffn_dim, cfg.dim),
            ("qkv", cfg.dim, cfg.q_dim + 2 * cfg.kv_dim), ("o", cfg.q_dim, cfg.dim), ("head", cfg.dim, cfg.vocab_size)]


def random_int4(key, k: int, n: int, group_size: int, asymmetric: bool, scale: float) -> QuantArray:
    kc, ks, km = jax.random.split(key, 3)
    codes = jax.random.randint(kc, (k // 2, n), 0, 256, jnp.int32).astype(jnp.uint8)
    scales = (jax.random.uniform(ks, (k // group_size, n), jnp.float32, 0.5, 1.5) * scale / 7.5).astype(jnp.float16)
    mins = None
    if asymmetric:
        mins = (-(scales.astype(jnp.float32)) * 7.5 * jax.random.uniform(km, scales.shape, jnp.float32, 0.8, 1.2)
                ).astype(jnp.float16)
    return QuantArray(codes=codes, scales=scales, mins=mins, group_size=group_size)


def random_weights(cfg: ModelConfig, key=None, group_size: int = 128, asymmetric: bool = False,
                   head_int4: bool = False, linear_bits: int = 4) -> Weights:
    """Random int4 linear layers (std ~ 1/sqrt(fan_in)), int8 embedding table and head. linear_bits=8: int8 linear
    layers of group 32 instead (the layout of a Q4_K_M file, whose Q5_0/Q6_K/Q8_0 tensors import as int8)."""
    key = jax.random.key(0) if key is None else key
    keys = iter(jax.random.split(key, 8 * cfg.n_layers + 8))
    d, f = cfg.dim, cfg.ffn_dim

    def lin(k, n):
        if linear_bits == 8:
            codes = jax.random.randint(next(keys), (k, n), -127, 128, jnp.int32).astype(jnp.int8)
            return Int8Array(codes=codes, scales=jnp.full((k // 32, n), (k ** -0.5) / 64, jnp.float16), group_size=32)
        return random_int4(next(keys), k, n, group_size, asymmetric, scale=k ** -0.5)

    layers = []
    sandwich = cfg.arch == "gemma3"  # Gemma's post-attention / post-FFN norms
    for _ in range(cfg.n_layers):
        layers.append(LayerWeights(
            attn_norm=jnp.ones((d,), jnp.float32),
            wqkv=lin(d, cfg.q_dim + 2 * cfg.kv_dim),
            wo=lin(cfg.q_dim, d),
            ffn_norm=jnp.ones((d,), jnp.float32),
            w_gate_up=lin(d, 2 * f),
            w_down=lin(f, d),
            bqkv=(jax.random.normal(next(keys), (cfg.q_dim + 2 * cfg.kv_dim,), jnp.float32) * 0.1
                  if cfg.qkv_bias else None),
            q_norm=jnp.ones((cfg.head_dim,), jnp.float32) if cfg.qk_norm else None,
            k_norm=jnp.ones((cfg.head_dim,), jnp.float32) if cfg.qk_norm else None,
            post_attn_norm=jnp.ones((d,), jnp.float32) if sandwich else None,
            post_ffn_norm=jnp.ones((d,), jnp.float32) if sandwich else None,
        ))
    v = cfg.vocab_size
    emb_codes = jax.random.randint(next(keys), (v, d), -127, 128, jnp.int32).astype(jnp.int8)
    emb_scales = jnp.full((v, d // 32), 0.02 / 64, jnp.float16)
    if head_int4:
        head = lin(d, v)
    else:
        head = Int8Array(codes=jax.random.randint(next(keys), (d, v), -127, 128, jnp.int32).astype(jnp.int8),
                         scales=jnp.full((d // 32, v), (d ** -0.5) / 64, jnp.float16), group_size=32)
    return Weights(embed=EmbedTable(emb_codes, emb_scales, 32), layers=tuple(layers),
                   final_norm=jnp.ones((d,), jnp.float32), head=head)
