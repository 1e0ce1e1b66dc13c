"""One Mosaic-GPU qmatmul configuration on one 8B shape, alone in its process: compiled, checked against the float32
product and timed. For configurations that may not return (the stream-K variants on qkv and o did not finish within
80 s on the H200, 2026-12-05): run each under `timeout` so a hang costs only its own process.
Usage (GPU): timeout 40 python3 benchmarks/probe_stream_k.py qkv '{"stream_k": true, "split_k": 1, "steps": 2}'
The JSON replaces fields of the shape's tabled configuration (`kernels_mgpu`); prints one line. Another preset's
shape: `qwen3-32b:qkv` (`synthetic.decode_matmuls`). Pallas-Triton is timed the same way after it."""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from lucebox_jax import kernels_mgpu, kernels_pallas, ops  # noqa: F401 (registers the Pallas-Triton kernels)
from lucebox_jax.quant import dequantize, quantize_int4
from lucebox_jax.synthetic import PRESETS, decode_matmuls
from pallas_kernels import mgpu_qmatmul as mg


def main() -> None:
    case, change = sys.argv[1], json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}")
    model, _, op = case.rpartition(":")
    k, n = next((k, n) for label, k, n in decode_matmuls(PRESETS[model or "llama3-8b"]) if label == op)
    m, g = int(change.pop("m", 1)), 128
    base = kernels_mgpu.config_for(m, k, n, g, 4)
    cfg = dataclasses.replace(base, **change)
    plan = mg.stream_plan(n // (cfg.tile_m * cfg.compute_wgs), k // g // cfg.groups, 132 * cfg.ctas_per_sm)[:2] \
        if cfg.stream_k else None
    print(f"{case} M={m} {cfg} stream plan (steps per CTA, CTAs) {plan}", flush=True)
    rng = np.random.default_rng(0)
    w = quantize_int4((rng.standard_normal((k, n)) * k ** -0.5).astype(np.float32), group_size=g, symmetric=True)
    perm = cfg.loads == "perm" and mg.perm_ok(g, 4)
    pw = mg.repack(w, k_perm=perm, k_split=perm and cfg.split_decode)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    f = jax.jit(lambda x, w: mg.mgpu_matmul(x, w, cfg))
    t0 = time.perf_counter()
    y = np.asarray(f(x, pw), np.float32)
    first = time.perf_counter() - t0
    ref = np.asarray(jnp.dot(x.astype(jnp.float32), dequantize(w)))
    err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    us = wall_us(f, x, pw)
    print(f"{case} ok: first call (compile) {first:.1f} s, err {err:.1e}, {us:.1f} us a call (wall, dispatch included)")
    pallas = jax.jit(lambda x, w: ops.get("qmatmul", "pallas")(x, w))
    print(f"{case} Pallas-Triton: {wall_us(pallas, x, w):.1f} us a call (wall, dispatch included)", flush=True)


def wall_us(f, x, w, n: int = 50) -> float:
    for _ in range(5):
        f(x, w).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(n):
        out = f(x, w)
    out.block_until_ready()
    return (time.perf_counter() - t0) / n * 1e6


if __name__ == "__main__":
    main()
