#!/usr/bin/env python3
"""Run a few int4 GEMV cases a fixed number of times so Nsight Compute can read their hardware counters.

    ncu --clock-control none -k regex:int4 --section SpeedOfLight ... \
        python3 benchmarks/ncu_int4.py gate_up:g32a:1 'o:g128s:1:{"block_k": 64}'

Each case is `shape:quant:M[:json knobs]` (shapes and quants of bench_kernels.py; knobs override the registered
default config; {"gemv": true, ...} runs the K-major GEMV of pallas_kernels/int4_gemv.py instead).  Why a separate
script: ncu replays each kernel dozens of times, so the timed benchmark can't run under it; this one only compiles
each case and launches it `--reps` times, nothing else on the GPU in between.  Run it after any other GPU job, with
XLA_PYTHON_CLIENT_PREALLOCATE=false (once, a job started after ncu runs failed with CUDA out of memory).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_kernels import QUANTS, SHAPES, pallas_q, q_check, rand_quant  # noqa: E402


def parse(case: str):
    parts = case.split(":", 3)
    sname, qname, m = parts[0], parts[1], int(parts[2])
    knobs = json.loads(parts[3]) if len(parts) > 3 else {}
    return sname, qname, m, knobs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    for case in args.cases:
        sname, qname, m, knobs = parse(case)
        k, n = SHAPES[sname]
        g, sym = QUANTS[qname]
        key = jax.random.PRNGKey(k + n + m)
        w = rand_quant(key, k, n, g, sym)
        x = jax.random.normal(jax.random.PRNGKey(1), (m, k), jnp.float32).astype(jnp.bfloat16)
        if knobs.pop("gemv", False):  # the K-major GEMV of pallas_kernels/int4_gemv.py
            from pallas_kernels import int4_gemv as gv

            cfg = gv.gemv_default_config(m, k, n, g) | knobs
            wd = gv.repack_kmajor(w.codes, g)
            fn = jax.jit(lambda x, w, wd=wd, g=g, cfg=cfg: gv.int4_gemv(x, wd, w.scales, w.mins, group_size=g, **cfg))
        else:
            fn = jax.jit(pallas_q(knobs))
        err = q_check(fn, x, w)  # compiles, runs once, checks
        for _ in range(args.reps):
            fn(x, w).block_until_ready()
        print(f"case {case}: rel err {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
