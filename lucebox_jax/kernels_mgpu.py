"""Registers the Mosaic-GPU Hopper kernel (`pallas_kernels/mgpu_qmatmul.py`) as `mgpu` for `qmatmul` and `qmatmul8`.

It runs only on an NVIDIA Hopper GPU (sm_90): asking for it elsewhere is refused by the registry with the kernels
that can run. Its `prepare` repacks each linear weight once, when the engine is built, into the kernel's group-major
layout (a device-side reshape, milliseconds per weight; the checkpoint keeps the engine's own format, which every
other kernel reads). Shapes the kernel cannot tile stay in the engine's format and go to the Pallas-Triton kernel;
rows beyond `MGPU_MAX_M` (prefill) go to XLA's dequantize + dot.

Configurations per shape come from `pallas_kernels/mgpu_tuned.json` (written by `benchmarks/bench_mgpu.py` on an
H200), else from `mgpu_qmatmul.default_config`. Two names: `mgpu` repacks every shape it tiles; `best` only the
shapes whose table entry measured faster than Pallas-Triton (`"default": true`), leaving the rest to Pallas-Triton.
`best` is the default on Hopper (`HOPPER_DEFAULT`); elsewhere Pallas-Triton and XLA stay the defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp

from . import ops
from .quant import Int8Array, QuantArray

INTERPRET = False  # tests set plgpu.InterpretGPUParams() to run the kernel in Mosaic GPU's interpreter on the CPU
# LUCEBOX_MGPU_PDL=1 (read at import): every configuration with `pdl` (programmatic dependent launch: a kernel
# prefetches its first weights while the kernel before it finishes). Off: it made the H200's 8B decode step 20% slower
# (and the H100's 2.6% slower beside XLA's --xla_gpu_enable_pdl kernels, which alone changed nothing).
PDL = os.environ.get("LUCEBOX_MGPU_PDL", "") == "1"
# LUCEBOX_MGPU_DECODE (read at import): how int4 codes on the `perm` load path become bf16. `split` (default):
# `split_decode` on every configuration that takes it, the weights repacked in the split order (H100, 8B step: the
# Mosaic-GPU matmuls 2,050 -> 1,983 us, the step -2.6 to -2.8%, in two A/Bs; benchmarks/RESULTS.md); `cast`: Mosaic's
# own cast, as before
DECODE = os.environ.get("LUCEBOX_MGPU_DECODE", "split")
if DECODE not in ("split", "cast"):
    raise ValueError(f"LUCEBOX_MGPU_DECODE={DECODE!r}: split or cast")
MGPU_MAX_M = 64  # rows above this (prefill chunks) are compute-bound: XLA's dequantize + dot serves them
# LUCEBOX_MGPU_TUNED (read at import): another table in this file's format, for A/B runs of the whole step
TUNED = os.environ.get("LUCEBOX_MGPU_TUNED") or os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pallas_kernels", "mgpu_tuned.json")


def hopper_reason() -> str | None:
    """None on an NVIDIA Hopper GPU, else why the Mosaic-GPU kernel cannot run."""
    if jax.default_backend() != "gpu":
        return f"it needs an NVIDIA Hopper GPU (sm_90); the backend here is {jax.default_backend()!r}"
    cc = str(getattr(jax.devices()[0], "compute_capability", "") or "")
    if not cc.startswith("9."):
        return f"it needs an NVIDIA Hopper GPU (sm_90); this GPU is sm_{cc.replace('.', '') or '?'}"
    return None


@functools.lru_cache(maxsize=1)
def tuned_table() -> dict:
    try:
        with open(TUNED) as f:
            return {k: v for k, v in json.load(f).items() if not k.startswith("_")}  # "_about": provenance
    except FileNotFoundError:
        return {}


def tuned_key(m_bucket: int, k: int, n: int, g: int, bits: int) -> str:
    return f"m{m_bucket}_k{k}_n{n}_g{g}_b{bits}"


def m_bucket(m: int) -> int:
    # (token_tile's steps, but for its 40-token tile: 33-40 rows share the 48-row entry)
    return 16 if m <= 16 else 32 if m <= 32 else 48 if m <= 48 else 64


# Rows past 16 with no tuned entry of their own take the 16-row entry's tiles and schedule with their wider token
# tile, not `default_config`'s untuned split-K: on an H100 an 8B tree of 32 + root went 4.22 -> 3.73 ms, gate+up at 40
# rows 38.3 -> 34.3 us, down 24.2 -> 20.2 us (benchmarks/RESULTS.md). LUCEBOX_MGPU_WIDE=0 (read at import): the old way.
WIDE_FROM_16 = os.environ.get("LUCEBOX_MGPU_WIDE", "1") != "0"


def config_for(m: int, k: int, n: int, g: int, bits: int, pair: bool | None = None):
    """The configuration for M rows of a shape: its tuned entry (or the 16-row one's, widened), else `default_config`.
    pair: the weight's rows (`MgpuWeight.k_pair`, which the kernel follows) where known; None: as the table says."""
    from pallas_kernels import mgpu_qmatmul as mg

    cfg = None
    entry = tuned_table().get(tuned_key(m_bucket(m), k, n, g, bits))
    if entry is None and m > 16 and WIDE_FROM_16 and (e16 := tuned_table().get(tuned_key(16, k, n, g, bits))):
        entry = {"cfg": {**e16["cfg"], "tile_t": mg.token_tile(m, g)}}
    if entry is not None:
        cfg = mg.MgpuConfig(**entry["cfg"])
        if cfg.tile_t < mg.token_tile(m, g):  # an entry timed at fewer rows of its bucket (40 of 48, say) still
            cfg = dataclasses.replace(cfg, tile_t=mg.token_tile(m, g))  # takes the rows in one token tile, not two
        if pair is not None and cfg.pair != pair:
            cfg = dataclasses.replace(cfg, pair=pair)
        cfg = cfg if mg.check_config(k, n, g, bits, cfg) is None else None
    cfg = with_decode(cfg or mg.default_config(m, k, n, g, bits, pair=bool(pair)), k, n, g, bits)
    return dataclasses.replace(cfg, pdl=True) if cfg is not None and PDL else cfg


def with_decode(cfg, k: int, n: int, g: int, bits: int):
    """`cfg` with the int4 decode `LUCEBOX_MGPU_DECODE` picks, where the configuration takes it (benchmarks time
    configurations through this too, so that they time what the engine runs)."""
    from pallas_kernels import mgpu_qmatmul as mg

    if cfg is None:
        return cfg
    alt = dataclasses.replace(cfg, split_decode=DECODE == "split")
    return alt if mg.check_config(k, n, g, bits, alt) is None else dataclasses.replace(cfg, split_decode=False)


def _bits(w) -> int:
    return 4 if isinstance(w, QuantArray) else 8


def _tiles(w) -> bool:
    k, n = w.shape
    return isinstance(w, (QuantArray, Int8Array)) and config_for(1, k, n, w.group_size, _bits(w)) is not None


def measured_faster(w) -> bool:
    """The H200 benchmark timed mgpu faster than Pallas-Triton on this shape at decode rows (M <= 16)."""
    k, n = w.shape
    entry = tuned_table().get(tuned_key(16, k, n, w.group_size, _bits(w)))
    return bool(entry and entry.get("default"))


def _repack(w):
    k, n = w.shape
    g, bits = w.group_size, _bits(w)
    cfg = config_for(1, k, n, g, bits)
    return _repack_jit()(w, **stored_order(cfg, g, bits))


def stored_order(cfg, g: int, bits: int) -> dict:
    """The repack knobs (`mgpu_qmatmul.repack`) that serve `cfg`: the K order its loads and decode want, its rows."""
    from pallas_kernels import mgpu_qmatmul as mg

    k_perm = (mg.perm_ok(g, bits) or cfg.pair) and cfg.loads == "perm"
    return dict(k_perm=k_perm, k_split=k_perm and cfg.split_decode, k_pair=cfg.pair)


def abstract_weight(k: int, n: int, g: int, bits: int, cfg):
    """A [K, N] weight as `_repack` stores it for `cfg`, without data (`repack` traced: its dtypes, code order and
    rows), for lowering and compiling on a machine without the GPU: int4 g32 with mins (a Q4_1 / Q4_K import), other
    int4 groups and int8 symmetric."""
    from pallas_kernels import mgpu_qmatmul as mg

    sds = jax.ShapeDtypeStruct
    groups = sds((k // g, n), jnp.float16)
    if bits == 4:
        w = QuantArray(sds((k // 2, n), jnp.uint8), groups, groups if g == 32 else None, group_size=g)
    else:
        w = Int8Array(sds((k, n), jnp.int8), groups, group_size=g)
    return jax.eval_shape(functools.partial(mg.repack, **stored_order(cfg, g, bits)), w)


@functools.lru_cache(maxsize=1)
def _repack_jit():
    from pallas_kernels import mgpu_qmatmul as mg

    # one jit: a weight shape compiles once, not per layer
    return jax.jit(mg.repack, static_argnames=("k_perm", "k_split", "k_pair"))


def prepare(w):
    """`mgpu`: every shape the kernel tiles is repacked."""
    return _repack(w) if _tiles(w) else w


def prepare_best(w):
    """`best`: only the shapes where the benchmark measured mgpu faster; the rest stay for Pallas-Triton."""
    return _repack(w) if _tiles(w) and measured_faster(w) else w


def _run(x, w, fallback, parts=False):
    """parts=True: the product as a tuple of partial sums (`quant.linear_parts`)."""
    from pallas_kernels import mgpu_qmatmul as mg

    if not isinstance(w, mg.MgpuWeight):  # a shape prepare left in the engine's format
        return fallback(x, w, parts=True) if parts and ops.takes(fallback, "parts") else (
            (fallback(x, w)[None],) if parts else fallback(x, w))
    m = x.shape[0]
    k, n = w.shape
    cfg = config_for(m, k, n, w.group_size, w.bits, pair=w.k_pair) if m <= MGPU_MAX_M else None
    if cfg is None:
        return (mg.reference(x, w)[None],) if parts else mg.reference(x, w)
    num_sms = getattr(jax.devices()[0], "core_count", 132)
    return _matmul_jit()(x, w, cfg, num_sms=num_sms, interpret=INTERPRET, parts=parts)


@functools.lru_cache(maxsize=1)
def _matmul_jit():
    """The kernel behind a nested jit: the layers' calls of one shape are traced and lowered once and called as one
    function (on this project's CPU, lowering 32 calls took 6.3 s unjitted and 0.4 s so), not once per layer."""
    from pallas_kernels import mgpu_qmatmul as mg

    return jax.jit(mg.mgpu_matmul, static_argnames=("cfg", "num_sms", "interpret", "parts"))


def _pallas_or_xla(op: str):
    names = ops.available(op)
    return ops.get(op, "pallas" if "pallas" in names else "xla")


# `best` is the Hopper default: on the H200 a whole 8B-shaped decode step with it ran 1.13-1.19x Pallas-Triton at
# batch 1 (two sessions), and greedy tokens through `mgpu` on the embedded model equal the CPU reference's
# (benchmarks/RESULTS.md, issue 11). Its cost is compile time (88 s against 14 s for that step; the persistent
# compilation cache keeps it to the first run). `--kernels qmatmul=pallas,qmatmul8=pallas` opts out.
HOPPER_DEFAULT = True


def _any_measured_faster() -> tuple[str, ...]:
    return ("gpu:sm90",) if HOPPER_DEFAULT and any(e.get("default") for e in tuned_table().values()) else ()


def padded_rows(m: int) -> int:
    """Rows the kernel runs m as: TMA takes x's rows as they are up to 8, past that a multiple of 8 (mgpu_matmul pads
    to it, one XLA kernel a call, unless the caller's rows are already so)."""
    return m if m <= 8 or m > MGPU_MAX_M else -(-m // 8) * 8


@ops.register("qmatmul", "mgpu", prepare=prepare, usable=hopper_reason, rows=padded_rows)
def qmatmul_mgpu_op(x, w, parts=False):
    return _run(x, w, _pallas_or_xla("qmatmul"), parts)


@ops.register("qmatmul8", "mgpu", prepare=prepare, usable=hopper_reason, rows=padded_rows)
def qmatmul8_mgpu_op(x, w, parts=False):
    return _run(x, w, _pallas_or_xla("qmatmul8"), parts)


# `best`: mgpu per shape where measured faster, Pallas-Triton elsewhere
@ops.register("qmatmul", "best", prepare=prepare_best, usable=hopper_reason, default_on=_any_measured_faster(),
              rows=padded_rows)
def qmatmul_best_op(x, w, parts=False, x_pending=None):
    # x_pending (an unfinished input, `quant.linear`): to Pallas-Triton where the shape stays there, finished in jnp
    # before an mgpu shape (the model hands none to an mgpu weight: `quant.takes_pending`)
    if x_pending is not None:
        fallback = _pallas_or_xla("qmatmul")
        if not _is_mgpu(w) and ops.takes(fallback, "x_pending"):
            return fallback(None, w, parts=parts, x_pending=x_pending)
        x = x_pending.merged()
    return _run(x, w, _pallas_or_xla("qmatmul"), parts)


def _is_mgpu(w) -> bool:
    from pallas_kernels import mgpu_qmatmul as mg

    return isinstance(w, mg.MgpuWeight)


@ops.register("qmatmul8", "best", prepare=prepare_best, usable=hopper_reason, default_on=_any_measured_faster(),
              rows=padded_rows)
def qmatmul8_best_op(x, w, parts=False):
    return _run(x, w, _pallas_or_xla("qmatmul8"), parts)
