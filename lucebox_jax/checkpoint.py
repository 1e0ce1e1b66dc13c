"""Converted checkpoints: a GGUF is imported once into `checkpoints/<name>/` (orbax arrays + a JSON header holding
the config, tokenizer metadata, the source file's identity and a digest of every array) and loaded from there later.

A checkpoint whose source GGUF changed, whose format version differs, or whose arrays fail the digest is never used
silently: `load_or_convert` rebuilds it from the GGUF, and a checkpoint folder given directly is refused with a
clear `CheckpointError`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil

import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .errors import CheckpointError, ModelNotFoundError
from .model import EmbedTable, LayerWeights, Weights
from .quant import Int8Array, QuantArray

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: int8 weights and embeddings may carry mins; scales float16 or float32
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


def digest(arrays: dict) -> str:
    h = hashlib.blake2b(digest_size=16)
    for k in sorted(arrays):
        a = np.ascontiguousarray(arrays[k])
        h.update(f"{k}:{a.dtype}:{a.shape};".encode())
        h.update(a.view(np.uint8).reshape(-1).data)
    return h.hexdigest()


def source_identity(path: str) -> dict:
    """Size, mtime and a hash of the file's first and last MiB: cheap, and changes when the file does."""
    st = os.stat(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if st.st_size > 2 << 20:
            f.seek(-(1 << 20), os.SEEK_END)
            h.update(f.read(1 << 20))
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "head_tail_sha256": h.hexdigest()}


def save(folder: str, cfg: ModelConfig, weights: Weights, tokenizer_meta: dict, source: dict | None):
    import orbax.checkpoint as ocp

    arrays, spec = weights_to_flat(weights)
    tmp = folder.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    ck = ocp.StandardCheckpointer()
    ck.save(os.path.join(os.path.abspath(tmp), ARRAYS), arrays)
    ck.wait_until_finished()
    header = {
        "format_version": FORMAT_VERSION,
        "config": json.loads(cfg.to_json()),
        "spec": spec,
        "digest": digest(arrays),
        "source": source,
        "tokenizer": tokenizer_meta,
    }
    with open(os.path.join(tmp, HEADER), "w") as f:
        json.dump(header, f)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


def read_header(folder: str) -> dict:
    path = os.path.join(folder, HEADER)
    try:
        with open(path) as f:
            header = json.load(f)
    except FileNotFoundError:
        raise ModelNotFoundError(f"no checkpoint header {HEADER} in {os.path.abspath(folder)}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"corrupt checkpoint header {path}: {e}") from e
    if header.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {folder} has format version {header.get('format_version')}, "
                              f"this engine reads {FORMAT_VERSION}: convert the GGUF again")
    return header


def load(folder: str, dtype: str) -> tuple[ModelConfig, Weights, dict]:
    """-> (config, weights, tokenizer metadata); raises CheckpointError when anything does not check out."""
    import orbax.checkpoint as ocp

    header = read_header(folder)
    try:
        arrays = ocp.StandardCheckpointer().restore(os.path.join(os.path.abspath(folder), ARRAYS))
    except Exception as e:
        raise CheckpointError(f"cannot restore checkpoint arrays in {folder}: {e}") from e
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    if digest(arrays) != header["digest"]:
        raise CheckpointError(f"checkpoint {folder} is corrupt: its arrays do not match the recorded digest")
    cfg = ModelConfig.from_dict(header["config"]).replace(dtype=dtype)
    return cfg, weights_from_flat(arrays, header["spec"], cfg.n_layers), header["tokenizer"]


def is_fresh(folder: str, gguf_path: str) -> bool:
    try:
        header = read_header(folder)
    except (ModelNotFoundError, CheckpointError):
        return False
    src = header.get("source") or {}
    ident = source_identity(gguf_path)
    return all(src.get(k) == ident[k] for k in ("size", "head_tail_sha256"))
