"""Checkpoint integrity (issue 12): the digest covers every byte of the source GGUF and the checkpoint's own header,
concurrent first conversions do not break each other, a corrupt checkpoint is rebuilt with one log line and no
traceback, and a read-only checkpoint folder falls back to reading the GGUF."""

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from gguf_factory import write_tiny_gguf
from lucebox_jax import checkpoint
from lucebox_jax.errors import CheckpointError
from lucebox_jax.gguf_loader import load_gguf
from lucebox_jax.loader import load_model
from test_checkpoint import corrupt_arrays, flat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def big_env(tmp_path, monkeypatch):
    """A GGUF over 2 MiB (the old identity hashed only its first and last MiB)."""
    monkeypatch.setenv("LUCEBOX_CHECKPOINTS", str(tmp_path / "ck"))
    src = tmp_path / "big.gguf"
    write_tiny_gguf(src, seed=3, dim=256, ffn=4096, n_heads=4, n_kv=2)
    assert os.path.getsize(src) > 3 << 20
    return src, tmp_path / "ck" / "big"


def test_middle_byte_change_is_never_served_stale(big_env, caplog):
    src, folder = big_env
    load_model(str(src))
    st = os.stat(src)
    data = bytearray(src.read_bytes())
    data[len(data) // 2] ^= 0x5A  # inside tensor data, far from both ends; same size
    src.write_bytes(bytes(data))
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime too
    with caplog.at_level(logging.WARNING):
        _, w, _, how = load_model(str(src))
    assert "converted" in how and any("stale" in r.message for r in caplog.records)
    _, wref, _ = load_gguf(str(src))
    a, b = flat(w), flat(wref)
    assert all(np.array_equal(a[k], b[k]) for k in b)


def test_header_edit_breaks_the_digest(big_env):
    src, folder = big_env
    load_model(str(src))
    hp = folder / checkpoint.HEADER
    h = json.loads(hp.read_text())
    h["config"]["rms_eps"] = 0.5  # changes the model without touching an array
    hp.write_text(json.dumps(h))
    with pytest.raises(CheckpointError, match="digest"):
        load_model(str(folder))
    _, _, _, how = load_model(str(src))
    assert "converted" in how
    del h["digest"]
    hp.write_text(json.dumps(h))  # a header missing keys: refused, not a KeyError
    with pytest.raises(CheckpointError):
        checkpoint.load(str(folder), "float32")


def _load_in_subprocess(src, ck_root, n):
    code = ("import logging, sys; logging.basicConfig(level=logging.WARNING); from lucebox_jax.loader import "
            "load_model; print(load_model(sys.argv[1])[3])")
    env = dict(os.environ, LUCEBOX_CHECKPOINTS=str(ck_root), JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(src)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(n)]
    return [(p.wait(timeout=300), *p.communicate()) for p in procs]


def test_concurrent_first_conversions_and_quiet_rebuild(tmp_path):
    src = tmp_path / "m.gguf"
    write_tiny_gguf(src, seed=5)
    ck = tmp_path / "ck"
    res = _load_in_subprocess(src, ck, 3)
    assert all(rc == 0 for rc, _, _ in res), [e for _, _, e in res]
    hows = [out.strip() for _, out, _ in res]
    assert sum("converted" in h for h in hows) == 1, hows  # one converts, the others wait and load it
    assert sorted(os.listdir(ck)) == ["m", "m.lock"]  # no temporary folders left
    load_model(str(ck / "m"))
    corrupt_arrays(ck / "m")
    [(rc, out, err)] = _load_in_subprocess(src, ck, 1)
    assert rc == 0 and "converted" in out
    assert "Traceback" not in err and len([x for x in err.splitlines() if x.strip()]) == 1, err
    assert "rebuilding" in err


def test_unwritable_checkpoint_folder_falls_back(tmp_path, monkeypatch, caplog):
    src = tmp_path / "m.gguf"
    write_tiny_gguf(src, seed=6)
    (tmp_path / "file").write_text("x")  # a folder that cannot be created (works as root too, unlike chmod)
    monkeypatch.setenv("LUCEBOX_CHECKPOINTS", str(tmp_path / "file" / "ck"))
    with caplog.at_level(logging.WARNING):
        _, _, _, how = load_model(str(src))
    assert how.startswith("gguf") and any("loading the GGUF directly" in r.message for r in caplog.records)
