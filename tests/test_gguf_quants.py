"""Every GGUF type with an exact import lands in our int4/int8 formats with the values `gguf.quants.dequantize` gives,
bit for bit (scales are stored in float16 only where that is exact, else float32, so no rounding is allowed anywhere:
assert_array_equal); the token embedding keeps the same codes; types without an exact import are refused or, on
request, re-quantized with a logged warning."""

import logging

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from gguf_factory import fake_tensor
from lucebox_jax import gguf_quants as gq
from lucebox_jax.errors import UnsupportedModelError
from lucebox_jax.model import EmbedTable
from lucebox_jax.quant import Int8Array, QuantArray, concat_n, dequantize, dequantize_np

# type -> (our class, group size, scale dtype of a tensor of random blocks)
EXPECTED = {
    "Q4_0": (QuantArray, 32, np.float16), "Q4_1": (QuantArray, 32, np.float16), "Q5_0": (Int8Array, 32, np.float16),
    "Q5_1": (Int8Array, 32, np.float16), "Q8_0": (Int8Array, 32, np.float16), "Q4_K": (QuantArray, 32, np.float32),
    "Q5_K": (Int8Array, 32, np.float32), "Q6_K": (Int8Array, 16, np.float32), "Q2_K": (QuantArray, 16, np.float32),
    "Q3_K": (QuantArray, 16, np.float32),
}


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_linear_import_is_exact(kind):
    t, ref = fake_tensor(kind)
    w = gq.import_linear(t)
    cls, g, sdt = EXPECTED[kind]
    assert isinstance(w, cls) and w.group_size == g and w.scales.dtype == sdt
    assert (w.mins is None) == (kind in ("Q4_0", "Q5_0", "Q8_0", "Q6_K", "Q3_K"))
    np.testing.assert_array_equal(dequantize_np(w), ref.T)
    np.testing.assert_array_equal(np.asarray(dequantize(w)), ref.T)  # the jnp path the xla kernel uses


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K"])
def test_k_quant_scales_need_float32(kind):
    """The reason for float32 scales: rounding the exact scales to float16 changes the weights."""
    t, ref = fake_tensor(kind)
    w = gq.import_linear(t)
    rounded = w.replace(scales=w.scales.astype(jnp.float16),
                        mins=None if w.mins is None else w.mins.astype(jnp.float16))
    assert not np.array_equal(dequantize_np(rounded), ref.T)


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_embedding_rows_are_exact(kind):
    t, ref = fake_tensor(kind, out=40, n_in=256, seed=1)
    table, scales, mins, g = gq.import_embedding_parts(t)
    assert table.dtype == np.int8 and table.shape == ref.shape
    emb = EmbedTable(jnp.asarray(table), jnp.asarray(scales), group_size=g,
                     mins=None if mins is None else jnp.asarray(mins))
    ids = jnp.array([[0, 7, 39, 7]])
    np.testing.assert_array_equal(np.asarray(emb.lookup(ids, jnp.float32))[0], ref[[0, 7, 39, 7]])


def test_fuse_mixed_formats_exactly():
    """q|k|v of a Q4_K_M file (Q4_K, Q4_K, Q6_K) and Q5_0 with Q8_0: one exact weight (int4 promoted to int8,
    groups refined to 16, float16 scales widened)."""
    parts = [gq.import_linear(fake_tensor(k, out=32, seed=i)[0]) for i, k in enumerate(["Q4_K", "Q3_K", "Q6_K",
                                                                                         "Q5_0", "Q8_0", "Q4_0"])]
    fused = concat_n(parts)
    assert isinstance(fused, Int8Array) and fused.group_size == 16 and fused.scales.dtype == np.float32
    np.testing.assert_array_equal(dequantize_np(fused), np.concatenate([dequantize_np(p) for p in parts], axis=1))
    int4 = concat_n([parts[0], parts[1], parts[5]])  # Q4_K (g32, mins), Q3_K (g16), Q4_0: stays int4
    assert isinstance(int4, QuantArray) and int4.group_size == 16 and int4.mins is not None
    np.testing.assert_array_equal(dequantize_np(int4), np.concatenate([dequantize_np(parts[i]) for i in (0, 1, 5)],
                                                                      axis=1))


def test_unsupported_type_is_refused_naming_tensor_and_type(monkeypatch):
    monkeypatch.delenv(gq.LOSSY_ENV, raising=False)
    t, _ = fake_tensor("IQ4_NL", out=16, n_in=256)
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.test_IQ4_NL\.weight.*IQ4_NL.*LUCEBOX_LOSSY_IMPORT"):
        gq.import_linear(t)
    with pytest.raises(UnsupportedModelError, match="IQ4_NL"):
        gq.import_embedding_parts(t)


def test_lossy_path_is_opt_in_and_logged(monkeypatch, caplog):
    t, ref = fake_tensor("IQ4_NL", out=16, n_in=256)
    monkeypatch.setenv(gq.LOSSY_ENV, "1")
    with caplog.at_level(logging.WARNING):
        w = gq.import_linear(t, group_size=32)
    assert isinstance(w, QuantArray)
    assert any("LOSSY" in r.message and "IQ4_NL" in r.message for r in caplog.records)
    err = np.linalg.norm(dequantize_np(w) - ref.T) / np.linalg.norm(ref)
    assert 0 < err < 0.15
    assert isinstance(gq.import_linear(t, lossy=True), QuantArray)
    monkeypatch.delenv(gq.LOSSY_ENV)
    with pytest.raises(UnsupportedModelError):
        gq.import_linear(t, lossy=False)


def gemma3_270m_path():
    """The real Q4_K_M file (Q5_0, Q4_K, Q6_K, Q8_0, F32 tensors): the `gemma3-270m` named model, installed and
    assembled on first use."""
    from lucebox_jax import named_models

    return named_models.resolve("gemma3-270m")


@pytest.mark.slow
def test_real_q4_k_m_file_imports_exactly():
    """Gemma 3 270M Q4_K_M: one tensor of every (type, role) and sampled embedding rows equal gguf's values."""
    reader = gguf.GGUFReader(gemma3_270m_path())
    seen = {}
    for t in reader.tensors:
        seen.setdefault((t.tensor_type.name, t.name.split(".")[-2]), t)
    assert {k for k, _ in seen} == {"F32", "Q5_0", "Q4_K", "Q6_K", "Q8_0"}
    for (kind, _), t in seen.items():
        if kind in gq.CONVERTERS and t.name != "token_embd.weight":
            np.testing.assert_array_equal(dequantize_np(gq.import_linear(t)), gq.dequantize_tensor(t).T)
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    table, scales, mins, g = gq.import_embedding_parts(emb)
    assert table.dtype == np.int8 and table.shape == (262144, 640) and mins is None
    ids = np.random.default_rng(0).integers(0, 262144, 64)
    ref = gguf.quants.dequantize(np.asarray(emb.data)[ids], emb.tensor_type)
    np.testing.assert_array_equal(table[ids].astype(np.float32) * np.repeat(scales[ids].astype(np.float32), g, 1), ref)
