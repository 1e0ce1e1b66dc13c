"""GGUF import: quantized tensors land exactly in our int4/int8 formats (against gguf's own dequantization, per type
in test_gguf_quants.py), fused q|k|v and gate|up stay exact, every supported architecture loads, bad files fail
clearly."""

import logging

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gguf_factory import write_tiny_gguf
from lucebox_jax import gguf_loader as gl
from lucebox_jax.errors import ModelNotFoundError, UnsupportedModelError
from lucebox_jax.model import EmbedTable, init_cache, forward
from lucebox_jax.ops import KernelSet
from lucebox_jax.quant import Int8Array, QuantArray, dequantize_np


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixed") / "mixed.gguf"
    write_tiny_gguf(path, types={"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q4_0", "attn_output": "Q8_0",
                                 "ffn_gate": "Q4_1", "ffn_up": "F16", "ffn_down": "Q5_0"}, seed=1)
    return str(path)


@pytest.mark.parametrize("suffix,kind,cls", [("attn_q", "Q4_0", QuantArray), ("attn_k", "Q4_1", QuantArray),
                                              ("attn_output", "Q8_0", Int8Array)])
def test_exact_import(mixed_gguf, suffix, kind, cls):
    reader = gguf.GGUFReader(mixed_gguf)
    for t in reader.tensors:
        if t.name.endswith(f"{suffix}.weight"):
            assert t.tensor_type.name == kind
            w = gl.import_linear(t, 128)
            assert isinstance(w, cls)
            ref = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(w.shape[1], w.shape[0]).T
            np.testing.assert_array_equal(dequantize_np(w), ref)


def test_embedded_model_tensors_exact(smol):
    """Every Q4_1 tensor of the embedded model, after q|k|v and gate|up fusion, equals gguf's dequantization."""
    from lucebox_jax.loader import default_model_path

    reader = gguf.GGUFReader(default_model_path())
    t = {x.name: x for x in reader.tensors}
    w = smol.engine.weights
    deq = lambda n: gl.dequantize_tensor(t[n]).T  # noqa: E731
    for i in (0, 29):
        p = f"blk.{i}."
        np.testing.assert_array_equal(dequantize_np(w.layers[i].wqkv),
                                      np.concatenate([deq(p + f"attn_{n}.weight") for n in "qkv"], axis=1))
        np.testing.assert_array_equal(dequantize_np(w.layers[i].w_down), deq(p + "ffn_down.weight"))
    np.testing.assert_array_equal(dequantize_np(w.head), deq("token_embd.weight"))


def test_symmetric_and_asymmetric_fuse_exactly(mixed_gguf):
    reader = gguf.GGUFReader(mixed_gguf)
    t = {x.name: x for x in reader.tensors}
    parts = [gl.import_linear(t[f"blk.0.attn_{n}.weight"], 128) for n in "qkv"]  # Q4_0, Q4_1, Q4_0
    fused = gl.fuse_n(parts)
    assert isinstance(fused, QuantArray) and fused.mins is not None
    np.testing.assert_array_equal(dequantize_np(fused), np.concatenate([dequantize_np(p) for p in parts], axis=1))


def test_q5_0_imports_exactly_as_int8(mixed_gguf):
    reader = gguf.GGUFReader(mixed_gguf)
    t = next(x for x in reader.tensors if x.name == "blk.0.ffn_down.weight")
    assert t.tensor_type.name == "Q5_0"
    w = gl.import_linear(t, 32)
    assert isinstance(w, Int8Array)
    np.testing.assert_array_equal(dequantize_np(w), gl.dequantize_tensor(t).T)


def test_k_quant_model_loads_exactly(tmp_path):
    """A Q4_K_M-like file (K-quants need in % 256 == 0): every fused weight, the head and the embedding rows equal
    gguf's dequantization of what was written."""
    path = tmp_path / "kq.gguf"
    written = write_tiny_gguf(path, types={"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K",
                                           "attn_output": "Q5_K", "ffn_gate": "Q3_K", "ffn_up": "Q2_K",
                                           "ffn_down": "Q6_K"}, dim=256, ffn=256, emb_type="Q6_K", seed=3)
    cfg, w, _ = gl.load_gguf(str(path))
    for i in range(cfg.n_layers):
        p, lw = f"blk.{i}.", w.layers[i]
        np.testing.assert_array_equal(dequantize_np(lw.wqkv),
                                      np.concatenate([written[p + f"attn_{n}.weight"].T for n in "qkv"], axis=1))
        np.testing.assert_array_equal(dequantize_np(lw.w_gate_up), np.concatenate(
            [written[p + f"ffn_{n}.weight"].T for n in ("gate", "up")], axis=1))
        np.testing.assert_array_equal(dequantize_np(lw.wo), written[p + "attn_output.weight"].T)
        np.testing.assert_array_equal(dequantize_np(lw.w_down), written[p + "ffn_down.weight"].T)
    emb = written["token_embd.weight"]
    np.testing.assert_array_equal(dequantize_np(w.head), emb.T)
    assert w.embed.table.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(w.embed.lookup(jnp.arange(emb.shape[0]), jnp.float32)), emb)
    # the forward over these formats (int8 with mins, group 16, float32 scales) equals it over dense copies
    dense = jax.tree_util.tree_map(lambda a: jnp.asarray(dequantize_np(a)), w, is_leaf=lambda a: isinstance(
        a, (QuantArray, Int8Array)))
    dense = dense.replace(embed=EmbedTable(jnp.asarray(emb)))
    toks, start = jnp.arange(8)[None], jnp.zeros((1,), jnp.int32)
    got, _ = forward(cfg, KernelSet(), w, init_cache(cfg, 1, 16), toks, start)
    ref, _ = forward(cfg, KernelSet(), dense, init_cache(cfg, 1, 16), toks, start)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-4)


def test_f16_kept_dense(mixed_gguf):
    reader = gguf.GGUFReader(mixed_gguf)
    t = next(x for x in reader.tensors if x.name == "blk.0.ffn_up.weight")
    w = gl.import_linear(t, 128)
    assert not isinstance(w, (QuantArray, Int8Array))
    np.testing.assert_array_equal(np.asarray(w, np.float32), gl.dequantize_tensor(t).T)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_architectures_load_and_run(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(path, arch=arch, tied=(arch != "qwen3"))
    cfg, w, meta = gl.load_gguf(str(path))
    assert cfg.arch == arch and cfg.qkv_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
    assert cfg.tied_embeddings == (arch != "qwen3")
    assert cfg.rope_interleaved == (arch == "llama")
    cache = init_cache(cfg, 1, 16)
    logits, _ = forward(cfg, KernelSet(), w, cache, jnp.arange(8)[None], jnp.zeros((1,), jnp.int32))
    assert logits.shape == (1, 8, cfg.vocab_size) and bool(jnp.all(jnp.isfinite(logits)))


def test_unknown_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    write_tiny_gguf(path, arch="mamba")
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'mamba'.*llama"):
        gl.load_gguf(str(path))


def test_missing_and_garbage_files(tmp_path):
    with pytest.raises(ModelNotFoundError, match="nope.gguf"):
        gl.load_gguf(str(tmp_path / "nope.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelNotFoundError, match="cannot read GGUF"):
        gl.load_gguf(str(bad))
