"""Converted checkpoints: a GGUF is imported once into `checkpoints/<name>/` (orbax arrays + a JSON header holding
the config, tokenizer metadata, the source file's identity and a digest) and loaded from there later.

What the digest covers: every array's name, dtype, shape and bytes, and the header's own model-changing content
(format version, config, array spec, tokenizer metadata, conversion settings and the source GGUF's full SHA-256). The
source's SHA-256 covers every byte of the GGUF; it is recomputed whenever the file's stat identity (size, mtime,
ctime, inode, device) differs from the one recorded, and ctime changes on every write, so an edited GGUF is never
served from a stale conversion. A checkpoint whose source changed, whose format version differs, or that fails the
digest is never used: the loader rebuilds it from the GGUF (one log line), and a checkpoint folder given directly is
refused with a clear `CheckpointError`.

Conversion is safe to run from several processes at once: `conversion_lock` serialises them (an OS lock on
`<name>.lock` beside the folder), the arrays are written into a fresh temporary folder and renamed into place.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile

import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .errors import CheckpointError, ModelNotFoundError
from .model import EmbedTable, LayerWeights, Weights
from .quant import Int8Array, QuantArray

log = logging.getLogger(__name__)

FORMAT_VERSION = 3  # 2: full-source SHA-256, digest over the header; 3: int8 mins, float32 scales
HEADER = "lucebox_checkpoint.json"
ARRAYS = "arrays"


def _node_to_flat(name: str, w, out: dict, spec: dict):
    if w is None:
        return
    mins = getattr(w, "mins", None)
    if isinstance(w, (QuantArray, Int8Array)):
        spec[name] = {"type": "int4" if isinstance(w, QuantArray) else "int8", "group_size": w.group_size}
        out[name + ".codes"], out[name + ".scales"] = w.codes, w.scales
    elif isinstance(w, EmbedTable):
        spec[name] = {"type": "embed", "group_size": w.group_size, "scales": w.scales is not None}
        out[name + ".table"] = w.table
        if w.scales is not None:
            out[name + ".scales"] = w.scales
    else:
        spec[name] = {"type": "dense"}
        out[name] = w
        return
    spec[name]["mins"] = mins is not None
    if mins is not None:
        out[name + ".mins"] = mins


def _node_from_flat(name: str, arrays: dict, spec: dict):
    s = spec.get(name)
    if s is None:
        return None
    a = lambda k: jnp.asarray(arrays[k])  # noqa: E731
    mins = a(name + ".mins") if s.get("mins") else None
    if s["type"] == "int4":
        return QuantArray(a(name + ".codes"), a(name + ".scales"), mins, group_size=s["group_size"])
    if s["type"] == "int8":
        return Int8Array(a(name + ".codes"), a(name + ".scales"), mins, group_size=s["group_size"])
    if s["type"] == "embed":
        return EmbedTable(a(name + ".table"), a(name + ".scales") if s["scales"] else None, group_size=s["group_size"],
                          mins=mins)
    return a(name)


LAYER_FIELDS = ("attn_norm", "wqkv", "wo", "ffn_norm", "w_gate_up", "w_down", "bqkv", "q_norm", "k_norm",
                "post_attn_norm", "post_ffn_norm")


def weights_to_flat(w: Weights) -> tuple[dict, dict]:
    out, spec = {}, {}
    for top in ("embed", "final_norm", "head"):
        _node_to_flat(top, getattr(w, top), out, spec)
    for i, lw in enumerate(w.layers):
        for f in LAYER_FIELDS:
            _node_to_flat(f"layers.{i}.{f}", getattr(lw, f), out, spec)
    return {k: np.asarray(v) for k, v in out.items()}, spec


def weights_from_flat(arrays: dict, spec: dict, n_layers: int) -> Weights:
    layers = tuple(
        LayerWeights(**{f: _node_from_flat(f"layers.{i}.{f}", arrays, spec) for f in LAYER_FIELDS})
        for i in range(n_layers)
    )
    return Weights(embed=_node_from_flat("embed", arrays, spec), layers=layers,
                   final_norm=_node_from_flat("final_norm", arrays, spec), head=_node_from_flat("head", arrays, spec))


def digest(arrays: dict, meta: dict | None = None) -> str:
    """Hash of every array (name, dtype, shape, bytes) and of `meta` (the header's model-changing content)."""
    h = hashlib.blake2b(digest_size=16)
    for k in sorted(arrays):
        a = np.ascontiguousarray(arrays[k])
        h.update(f"{k}:{a.dtype}:{a.shape};".encode())
        h.update(a.view(np.uint8).reshape(-1).data)
    if meta is not None:
        h.update(json.dumps(meta, sort_keys=True, ensure_ascii=True).encode())
    return h.hexdigest()


def _covered(header: dict) -> dict:
    """The header fields the digest covers (all but the digest itself and the source's stat identity)."""
    src = header.get("source") or {}
    return {"format_version": header.get("format_version"), "config": header.get("config"),
            "spec": header.get("spec"), "tokenizer": header.get("tokenizer"),
            "conversion": header.get("conversion"), "source_sha256": src.get("sha256")}


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


_STAT_KEYS = ("size", "mtime_ns", "ctime_ns", "ino", "dev")


def _stat_identity(path: str) -> dict:
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino,
            "dev": st.st_dev}


def source_identity(path: str) -> dict:
    """The file's stat identity and the SHA-256 of its whole content."""
    return {"path": os.path.abspath(path), **_stat_identity(path), "sha256": file_sha256(path)}


def save(folder: str, cfg: ModelConfig, weights: Weights, tokenizer_meta: dict, source: dict | None,
         conversion: dict | None = None):
    """Write a checkpoint into a fresh temporary folder beside `folder`, then rename it into place (the caller holds
    `conversion_lock`, so no reader sees a half-written or half-swapped folder)."""
    import orbax.checkpoint as ocp

    arrays, spec = weights_to_flat(weights)
    parent, name = os.path.split(os.path.abspath(folder))
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    try:
        ck = ocp.StandardCheckpointer()
        ck.save(os.path.join(tmp, ARRAYS), arrays)
        ck.wait_until_finished()
        header = {
            "format_version": FORMAT_VERSION,
            "config": json.loads(cfg.to_json()),
            "spec": spec,
            "source": source,
            "tokenizer": tokenizer_meta,
            "conversion": conversion or {},
        }
        header["digest"] = digest(arrays, _covered(json.loads(json.dumps(header))))
        with open(os.path.join(tmp, HEADER), "w") as f:
            json.dump(header, f)
            f.flush()
            os.fsync(f.fileno())
        old = None
        if os.path.lexists(folder):
            old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
            os.rename(folder, os.path.join(old, name))
        os.rename(tmp, folder)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def conversion_lock(folder: str):
    """Exclusive OS lock (flock on `<folder>.lock`) around checking and converting one checkpoint; released when
    the process ends, also on a kill. Raises OSError when the lock file cannot be created (a read-only folder)."""
    import fcntl

    path = os.path.abspath(folder).rstrip("/") + ".lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def read_header(folder: str) -> dict:
    path = os.path.join(folder, HEADER)
    try:
        with open(path) as f:
            header = json.load(f)
    except FileNotFoundError:
        raise ModelNotFoundError(f"no checkpoint header {HEADER} in {os.path.abspath(folder)}") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"corrupt checkpoint header {path}: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"corrupt checkpoint header {path}: not a JSON object")
    if header.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {folder} has format version {header.get('format_version')}, "
                              f"this engine reads {FORMAT_VERSION}: convert the GGUF again")
    return header


def load(folder: str, dtype: str) -> tuple[ModelConfig, Weights, dict]:
    """-> (config, weights, tokenizer metadata); raises CheckpointError when anything does not check out."""
    import orbax.checkpoint as ocp

    header = read_header(folder)
    try:
        with _quiet_orbax():
            arrays = ocp.StandardCheckpointer().restore(os.path.join(os.path.abspath(folder), ARRAYS))
    except Exception as e:  # noqa: BLE001 - any failure of a corrupt folder is the same answer
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot restore checkpoint arrays in {folder}: {first}") from None
    try:
        arrays = {k: np.asarray(v) for k, v in arrays.items()}
        if digest(arrays, _covered(header)) != header.get("digest"):
            raise CheckpointError(f"checkpoint {folder} is corrupt: its arrays or header do not match the recorded "
                                  "digest")
        cfg = ModelConfig.from_dict(header["config"]).replace(dtype=dtype)
        return cfg, weights_from_flat(arrays, header["spec"], cfg.n_layers), header["tokenizer"]
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a header that passes the digest but does not fit: still corrupt
        raise CheckpointError(f"checkpoint {folder} is corrupt: {type(e).__name__}: {e}") from None


@contextlib.contextmanager
def _quiet_orbax():
    """Orbax and absl log a traceback per failed read; a corrupt checkpoint is reported once, by the caller."""
    loggers = [logging.getLogger(n) for n in ("absl", "orbax", "orbax.checkpoint", "jax._src.distributed")]
    old = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, old):
            lg.setLevel(lv)


def is_fresh(folder: str, gguf_path: str, conversion: dict | None = None) -> bool:
    """Whether the checkpoint in `folder` was converted from exactly this GGUF content with these settings."""
    try:
        header = read_header(folder)
    except (ModelNotFoundError, CheckpointError):
        return False
    if conversion is not None and header.get("conversion") != conversion:
        return False
    src = header.get("source") or {}
    if not isinstance(src, dict) or not src.get("sha256"):
        return False
    now = _stat_identity(gguf_path)
    if all(src.get(k) == now[k] for k in _STAT_KEYS):
        return True  # untouched since conversion (any write changes ctime)
    return src.get("size") == now["size"] and src["sha256"] == file_sha256(gguf_path)
