"""Converted checkpoints: a GGUF converts once and later loads from the checkpoint with identical weights; a changed
source GGUF or corrupted arrays are caught (rebuilt from the GGUF, or refused when the folder is given directly)."""

import logging
import os
import shutil

import numpy as np
import pytest

from gguf_factory import write_tiny_gguf
from lucebox_jax import checkpoint
from lucebox_jax.errors import CheckpointError, ModelNotFoundError
from lucebox_jax.loader import load_model


@pytest.fixture
def ck_env(tmp_path, monkeypatch):
    monkeypatch.setenv("LUCEBOX_CHECKPOINTS", str(tmp_path / "ck"))
    src = tmp_path / "m.gguf"
    write_tiny_gguf(src, seed=7)
    return src, tmp_path / "ck" / "m"


def flat(w):
    return checkpoint.weights_to_flat(w)[0]


def test_convert_then_load(ck_env):
    src, folder = ck_env
    cfg1, w1, tok1, how1 = load_model(str(src))
    assert "converted" in how1 and (folder / checkpoint.HEADER).is_file()
    cfg2, w2, tok2, how2 = load_model(str(src))
    assert how2.startswith("checkpoint") and cfg1 == cfg2 and tok1 == tok2
    a, b = flat(w1), flat(w2)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    cfg3, _, _, how3 = load_model(str(folder))  # the folder itself is a model too
    assert how3.startswith("checkpoint") and cfg3 == cfg1


def test_stale_source_rebuilds(ck_env, caplog):
    src, folder = ck_env
    load_model(str(src))
    write_tiny_gguf(src, seed=8)  # a different model under the same name
    assert not checkpoint.is_fresh(str(folder), str(src))
    with caplog.at_level(logging.WARNING):
        _, w, _, how = load_model(str(src))
    assert "converted" in how and any("stale" in r.message for r in caplog.records)
    from lucebox_jax.gguf_loader import load_gguf

    _, wref, _ = load_gguf(str(src))
    assert all(np.array_equal(flat(w)[k], v) for k, v in flat(wref).items())


def corrupt_arrays(folder):
    # three flips across the largest file: one alone can land in bytes no array is read from (the store's index and
    # padding near its end: a run of the concurrent-conversion test loaded such a checkpoint without complaint)
    files = [os.path.join(d, f) for d, _, fs in os.walk(folder / checkpoint.ARRAYS) for f in fs]
    big = max(files, key=os.path.getsize)
    data = bytearray(open(big, "rb").read())
    for q in (1, 2, 3):
        data[len(data) * q // 4] ^= 0xFF
    open(big, "wb").write(bytes(data))


def test_corrupt_checkpoint_refused_or_rebuilt(ck_env, caplog):
    src, folder = ck_env
    load_model(str(src))
    corrupt_arrays(folder)
    with pytest.raises(CheckpointError):
        load_model(str(folder))
    with caplog.at_level(logging.WARNING):
        _, _, _, how = load_model(str(src))
    assert "converted" in how
    load_model(str(folder))  # rebuilt: loads cleanly again


def test_bad_header_and_missing(ck_env, tmp_path):
    src, folder = ck_env
    load_model(str(src))
    (folder / checkpoint.HEADER).write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt checkpoint header"):
        load_model(str(folder))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="not a lucebox_jax checkpoint"):
        load_model(str(empty))
    with pytest.raises(ModelNotFoundError, match="missing.gguf"):
        load_model(str(tmp_path / "missing.gguf"))
    shutil.rmtree(folder)


def test_k_quant_checkpoint_round_trips(tmp_path, monkeypatch):
    """int8 weights with mins (Q5_K, Q5_1 embedding), float32 scales (K-quants) and group 16 survive save/load."""
    from lucebox_jax.quant import Int8Array, dequantize_np

    monkeypatch.setenv("LUCEBOX_CHECKPOINTS", str(tmp_path / "ck"))
    src = tmp_path / "kq.gguf"
    write_tiny_gguf(src, types={"attn_output": "Q5_K", "ffn_down": "Q6_K", "ffn_gate": "Q2_K", "ffn_up": "Q2_K"},
                    dim=256, ffn=256, emb_type="Q5_1", seed=5)
    _, w1, _, how1 = load_model(str(src))
    _, w2, _, how2 = load_model(str(src))
    assert "converted" in how1 and how2.startswith("checkpoint")
    a, b = flat(w1), flat(w2)
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)
    wo = w2.layers[0].wo
    assert isinstance(wo, Int8Array) and wo.mins is not None and wo.scales.dtype == np.float32
    assert w2.layers[0].w_down.group_size == 16 and w2.layers[0].w_gate_up.group_size == 16
    assert w2.embed.mins is not None
    np.testing.assert_array_equal(dequantize_np(wo), dequantize_np(w1.layers[0].wo))
