"""Gemma 3 as configuration, on a tiny random model: sliding-window attention equals a plain numpy loop (llama.cpp's
rule: a query at p sees keys p - W < k <= p), prefill, decode, chunked prefill and speculative verify (chain and
tree) agree with one another past the window (with XLA's attention and the Pallas kernels'), and
the GGUF metadata of a `gemma3` file maps to llama.cpp's settings (every 6th layer global, local RoPE base 10000)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lucebox_jax import ops
from lucebox_jax.drafters import build
from lucebox_jax.engine import Engine
from lucebox_jax.gguf_loader import config_from_metadata
from lucebox_jax.kernels_xla import attention_decode_xla, attention_prefill_xla
from lucebox_jax.ops import KernelSet
from lucebox_jax.reference import naive_greedy
from lucebox_jax.speculative import SpeculativeDecoder
from lucebox_jax.synthetic import PRESETS, random_weights

# 4 layers, window 6, layers 1 and 3 global: prompts of 20+ tokens cross the window many times
CFG = PRESETS["gemma3_270m"].replace(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                                     ffn_dim=128, sliding_window=6, sliding_window_pattern=2, embed_scale=8.0,
                                     attn_scale=0.25, max_context=512)
KS = KernelSet()


def numpy_attention(q, k, v, qpos, scale, window):
    """q [T, Hq, D] at absolute positions qpos [T]; k, v [Hkv, S, D]; plain loops."""
    t, hq, d = q.shape
    g = hq // k.shape[0]
    out = np.zeros_like(q)
    for i in range(t):
        keys = [j for j in range(k.shape[1]) if j <= qpos[i] and (window is None or qpos[i] - j < window)]
        for h in range(hq):
            s = np.array([q[i, h] @ k[h // g, j] for j in keys]) * scale
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v[h // g, keys]
    return out


@pytest.mark.parametrize("window", [None, 1, 5, 64])
def test_window_attention_equals_numpy(window):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 7, 4, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 24, 8)).astype(np.float32) for _ in range(2))
    start = np.array([0, 13], np.int32)
    got = np.asarray(attention_prefill_xla(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(start),
                                           scale=0.3, window=window))
    for b in range(2):
        ref = numpy_attention(q[b], k[b], v[b], start[b] + np.arange(7), 0.3, window)
        np.testing.assert_allclose(got[b], ref, rtol=1e-5, atol=1e-5)
    lengths = start + 7
    dec = np.asarray(attention_decode_xla(jnp.asarray(q[:, -1]), jnp.asarray(k), jnp.asarray(v),
                                          jnp.asarray(lengths), scale=0.3, window=window))
    np.testing.assert_allclose(dec, got[:, -1], rtol=1e-5, atol=1e-5)


def test_pallas_decode_kernel_takes_short_windows():
    """The Pallas decode kernel applies a window shorter than the cache itself (`sliding`; interpret mode here)."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, 2, 32, 16)), jnp.float32) for _ in range(2))
    lengths = jnp.asarray([30], jnp.int32)
    pallas = ops.get("attention_decode", "pallas")
    want = attention_decode_xla(q, k, v, lengths, scale=0.25, window=4)
    np.testing.assert_allclose(pallas(q, k, v, lengths, scale=0.25, window=4), want, rtol=1e-4, atol=1e-4)
    full = attention_decode_xla(q, k, v, lengths, scale=0.25)
    assert not np.allclose(want, full)  # the window matters here
    # a window covering the whole cache masks nothing
    np.testing.assert_allclose(pallas(q, k, v, lengths, scale=0.25, window=32), full, rtol=1e-4, atol=1e-4)


def test_prefill_decode_and_verify_past_the_window_with_the_pallas_kernels(eng):
    """The same model with the Pallas attention kernels (interpret mode): the prompt's prefill, decode steps and a
    chain verify's rows past the window attend through the kernels' sliding windows and give the naive generator's
    tokens."""
    pe = Engine(CFG, eng.weights, KernelSet.resolve("attention_decode=pallas,attention_prefill=pallas", backend="cpu"))
    assert pe.kernels.attention_decode == "pallas" and pe.kernels.attention_prefill == "pallas"
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, CFG.vocab_size, 21)]
    ref = naive_greedy(CFG, KS, eng.weights, prompt, 10)
    assert greedy(pe, prompt, 10) == ref
    assert greedy(pe, prompt, 10, SpeculativeDecoder(pe, build("layers:1", pe), 3)) == ref


def test_config_layer_pattern():
    cfg = PRESETS["gemma3_270m"]
    assert [i for i in range(cfg.n_layers) if cfg.layer_window(i) is None] == [5, 11, 17]
    assert cfg.layer_rope(0) == (10000.0, 1.0) and cfg.layer_rope(5) == (1e6, 1.0)
    assert PRESETS["tiny"].layer_window(0) is None


def test_config_from_gemma3_metadata():
    meta = {"general.architecture": "gemma3", "gemma3.embedding_length": 640, "gemma3.attention.head_count": 4,
            "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 256, "gemma3.block_count": 18,
            "gemma3.feed_forward_length": 2048, "gemma3.rope.freq_base": 1e6, "gemma3.attention.sliding_window": 512,
            "gemma3.context_length": 32768, "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
            "tokenizer.ggml.tokens": ["a"] * 262144}
    cfg = config_from_metadata(meta)
    assert (cfg.arch, cfg.qk_norm, cfg.rope_interleaved, cfg.activation) == ("gemma3", True, False, "gelu_tanh")
    assert cfg.embed_scale == pytest.approx(640 ** 0.5) and cfg.attn_scale == pytest.approx(1 / 16)
    assert (cfg.sliding_window, cfg.rope_theta_local, cfg.final_softcap, cfg.rope_scale) == (512, 1e4, 0.0, 1.0)
    scaled = config_from_metadata({**meta, "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0,
                                   "gemma3.final_logit_softcapping": 30.0})
    assert scaled.layer_rope(5) == (1e6, 1 / 8) and scaled.layer_rope(0) == (1e4, 1.0)
    assert scaled.final_softcap == 30.0


@pytest.fixture(scope="module")
def eng():
    w = random_weights(CFG, jax.random.key(5), group_size=32)
    keys = iter(jax.random.split(jax.random.key(6), 4 * CFG.n_layers))
    norm = lambda n: 1 + 0.3 * jax.random.normal(next(keys), (n,))  # noqa: E731 - non-trivial sandwich norms
    layers = tuple(lw.replace(post_attn_norm=norm(CFG.dim), post_ffn_norm=norm(CFG.dim),
                              q_norm=norm(CFG.head_dim), k_norm=norm(CFG.head_dim)) for lw in w.layers)
    return Engine(CFG, w.replace(layers=layers), KS)


def greedy(eng, prompt, n, spec=None):
    from test_speculative import run

    return run(eng, spec, [prompt], n)[0]


def test_decode_and_verify_past_the_window_equal_full_forwards(eng):
    """The on-device decode loop and the speculative loop (verify over K + 1 positions) give the naive generator's
    tokens (a full prefill-path forward per token) on a prompt several windows long."""
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, CFG.vocab_size, 23)]
    ref = naive_greedy(CFG, KS, eng.weights, prompt, 12)
    assert greedy(eng, prompt, 12) == ref
    # layer skip: its drafts run the windowed first layer, the verify all layers over K + 1 positions
    assert greedy(eng, prompt, 12, SpeculativeDecoder(eng, build("layers:1", eng), 3)) == ref


def test_tree_verify_past_the_window_equals_plain(eng):
    """A tree verify (`--tree`, an untrained EAGLE head) on the windowed model: each node sees only the last W
    positions, as a decode step would (tree attention once ignored the window, so the root's logits past the window
    differed from plain decoding)."""
    from lucebox_jax.drafters.eagle import EagleConfig, EagleDrafter, init_head

    hc = EagleConfig.for_target(CFG)
    spec = SpeculativeDecoder(eng, EagleDrafter(hc, init_head(hc, jax.random.key(2)), eng), 3, tree=9)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, CFG.vocab_size, 23)]
    assert greedy(eng, prompt, 12, spec) == naive_greedy(CFG, KS, eng.weights, prompt, 12)


def test_window_changes_the_output(eng):
    """Guard against a window that is never applied: the same weights without windows give other logits."""
    from lucebox_jax.reference import full_logits

    seq = jnp.asarray([list(range(3, 35))])
    a = np.asarray(full_logits(CFG, KS, eng.weights, seq))[0]
    b = np.asarray(full_logits(CFG.replace(sliding_window=10_000), KS, eng.weights, seq))[0]  # same RoPE bases
    np.testing.assert_allclose(a[:6], b[:6], rtol=1e-4, atol=1e-4)  # within the first window: identical
    assert np.abs(a[10:] - b[10:]).max() > 1e-2
