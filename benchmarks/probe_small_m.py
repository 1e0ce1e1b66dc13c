#!/usr/bin/env python3
"""The Pallas-Triton int4 matmul on the embedded model's (SmolLM2-135M) shapes at the row counts a speculative step
runs: 1 (decode), 5 (a chain verify, K = 4) and 33 (a tree of 32 + root), with the default configuration against
the small-weight split (one K tile per program, `split_k=SPLIT_ALL`, block_n 64) that M <= 16 already uses.

Why: on the H200 (2026-12-05, raw/2026-12-05b_h200_call3_spec_profile.log) a tree step's int4 matmuls took 758 us
against a plain step's 334 for the same 4 x 30 calls: above 16 rows the default is a 64-row GEMM tile with a K loop
over 18-48 tiles in 8-48 programs, latency-bound on these small weights.
    python benchmarks/probe_small_m.py [--ms 1,5,33]      (GPU; kernel time from the profiler; --interpret: CPU check)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import bench_kernels as bk  # noqa: E402
from pallas_kernels import int4_matmul as mm_mod  # noqa: E402

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}  # K x N
VARIANTS = {"default": {}, "split_all": dict(split_k=mm_mod.SPLIT_ALL, block_n=64),
            "split_all_m32": dict(split_k=mm_mod.SPLIT_ALL, block_n=64, block_m=32)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,5,33")
    ap.add_argument("--interpret", action="store_true", help="CPU: check each variant's product only")
    args = ap.parse_args()
    rows = []
    for name, (k, n) in SHAPES.items():
        for m in [int(x) for x in args.ms.split(",")]:
            sets = bk.make_q_sets(k, n, 32, False, m, 8)
            row = {"shape": name, "M": m}
            for vname, over in VARIANTS.items():
                if m <= 16 and vname != "default":
                    continue  # (M <= 16 already splits small weights)
                try:
                    fn = bk.pallas_q(dict(over, interpret=True) if args.interpret else over)
                    row[f"{vname}_err"] = round(float(bk.q_check(jax.jit(fn), *sets[0])), 5)
                    if not args.interpret:
                        row[f"{vname}_us"] = round(bk.time_sets(fn, sets) * 1e6, 2)
                        row[f"{vname}_glue_kernels"] = len(bk.TIMING.get("by_kernel_us", {})) - 1
                except Exception as e:  # noqa: BLE001 - one variant must not lose the rest
                    row[f"{vname}_error"] = f"{type(e).__name__}: {e}"[:200]
            print(json.dumps(row), flush=True)
            rows.append(row)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "probe_small_m.json"), "w") as f:
            json.dump({"device": str(jax.devices()[0]), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    jnp.zeros(1).block_until_ready()
    main()
