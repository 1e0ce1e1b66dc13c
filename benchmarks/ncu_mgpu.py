#!/usr/bin/env python3
"""Run Mosaic-GPU qmatmul cases (`pallas_kernels/mgpu_qmatmul.py`) a fixed number of times so Nsight Compute can
read their hardware counters.

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section WarpStateStats ... python3 benchmarks/ncu_mgpu.py gate_up 'down:{"split_k": 8}'

Each case is `shape[:json knobs]`, a shape of bench_mgpu.CASES at int4 g128 (or `head` for the int8 head); the
knobs replace fields of the engine's tabled configuration for that shape (M = 1), or of the default one. Like
ncu_int4.py: ncu replays every kernel many times, so this only compiles, checks once and launches `--reps` times;
only those launches are profiled (cuProfilerStart/Stop, for `--profile-from-start off`).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_mgpu as bm  # noqa: E402
from lucebox_jax import kernels_mgpu as km  # noqa: E402
from pallas_kernels import mgpu_qmatmul as mg  # noqa: E402


def config_for(label: str, knobs: dict, m: int = 1):
    _, k, n, g, bits = next(c for c in bm.CASES if c[0] == label)
    entry = km.tuned_table().get(km.tuned_key(km.m_bucket(m), k, n, g, bits))
    cfg = mg.MgpuConfig(**entry["cfg"]) if entry else mg.default_config(m, k, n, g, bits)
    cfg = dataclasses.replace(cfg, **knobs)
    # the engine's int4 decode for it, unless the knobs name one
    return (k, n, g, bits), cfg if "split_decode" in knobs else km.with_decode(cfg, k, n, g, bits)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    cuda = ctypes.CDLL("libcuda.so.1")
    for case in args.cases:
        label, _, knobs = case.partition(":")
        (k, n, g, bits), cfg = config_for(label, json.loads(knobs) if knobs else {})
        x, w = bm.make_sets(k, n, g, bits, 1)[0]
        wr = mg.repack(w, k_perm=cfg.loads == "perm" and mg.perm_ok(g, bits), k_split=cfg.split_decode)
        fn = jax.jit(lambda x, w, cfg=cfg: mg.mgpu_matmul(x, w, cfg))
        err = bm.check(fn, x, w, wr)
        fn(x, wr).block_until_ready()
        cuda.cuProfilerStart()  # with `ncu --profile-from-start off`, only these launches are profiled
        for _ in range(args.reps):
            fn(x, wr).block_until_ready()
        cuda.cuProfilerStop()
        print(f"case {case}: {cfg} rel err {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
