#!/usr/bin/env python3
"""The K-major int4 GEMV (`pallas_kernels/int4_gemv.py`) against the registered int4 kernel, one GPU run.

    PYTHONPATH=. python3 benchmarks/bench_gemv.py [--budget 300] [--ms 1,4,16] [--variants all|default]

At Llama-3-8B layer shapes, g32 asymmetric and g128 symmetric: copy bandwidth first, then for each case the
registered `qmatmul` Pallas kernel (`int4_matmul`, tuned table), its fused asm decode + FMA variants (`MM_VARIANTS`,
M = 1) and each GEMV variant, µs of GPU kernel time (JAX profiler, split-K combine included) over input sets larger
than L2, checked against the float32 reference first.
Writes $OUT/bench_gemv.json; a short table prints last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_kernels as bk  # noqa: E402
from pallas_kernels import int4_gemv as gv  # noqa: E402
from pallas_kernels import int4_matmul as mm  # noqa: E402

VARIANTS = {
    "default": {},
    "nk": dict(scales_nk=True),
    "nopf": dict(prefetch=False),
    "n64": dict(block_n=64),
    "n256": dict(block_n=256),
    "w4": dict(num_warps=4),
    "gps1": dict(groups_per_step=1),
    "gps4": dict(groups_per_step=4),
    "s2": dict(num_stages=2),
    "inside": dict(xsum="inside"),
    "p528": dict(min_programs=528),
    "p2112": dict(min_programs=2112),
}


# int4_matmul (N-major, the registered kernel) with the fused asm decode + FMA, at M = 1 (knobs over its defaults)
MM_VARIANTS = {
    "asmfma_k128_n64": dict(mode="fma", decode="asm_fma", block_k=128, block_n=64, num_warps=4, num_stages=4),
    "asmfma_k64_n128": dict(mode="fma", decode="asm_fma", block_k=64, block_n=128, num_warps=4, num_stages=4),
    "asmfma_k32_n128": dict(mode="fma", decode="asm_fma", block_k=32, block_n=128, num_warps=4, num_stages=4),
    "asmfma_k128_n64_w8": dict(mode="fma", decode="asm_fma", block_k=128, block_n=64, num_warps=8, num_stages=3),
}


def mm_fn(knobs):
    def fn(x, w):
        return mm.qmatmul_pallas(x, w, interpret=False, **knobs)

    return fn


def gemv_fn(knobs):
    def fn(x, kcodes, scales, mins, scales_t, mins_t, g):
        cfg = gv.gemv_default_config(x.shape[0], x.shape[1], kcodes.shape[0], g)
        cfg.update(knobs)
        if cfg.get("scales_nk"):
            scales, mins = scales_t, mins_t
        return gv.int4_gemv(x, kcodes, scales, mins, group_size=g, **cfg)

    return fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=300.0)
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--variants", default="all", help="all | default | comma list of VARIANTS names")
    ap.add_argument("--shapes", default="gate_up,down,qkv,o")
    ap.add_argument("--mm-variants", type=int, default=1, help="1: also time int4_matmul's MM_VARIANTS at M = 1")
    ap.add_argument("--no-gemv", action="store_true", help="only int4_matmul and its MM_VARIANTS")
    args = ap.parse_args()
    t0 = time.time()
    bw = bk.bench_copy()
    rows = []
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    for m in [int(v) for v in args.ms.split(",")]:
        for sname in args.shapes.split(","):
            k, n = bk.SHAPES[sname]
            for qname, (g, sym) in bk.QUANTS.items():
                if time.time() - t0 > args.budget:
                    break
                w0 = bk.rand_quant(jax.random.PRNGKey(1), k, n, g, sym)
                nb = bk.qbytes(w0, m, k, n)
                qsets = bk.make_q_sets(k, n, g, sym, m, bk.n_sets(nb))
                gemv_names = [] if args.no_gemv else names if m == 1 else names[:2]
                ksets = [(x, gv.repack_kmajor(w.codes, g), w.scales, w.mins, w.scales.T.copy(),
                          None if w.mins is None else w.mins.T.copy()) for x, w in qsets] if gemv_names else []
                row = {"shape": sname, "quant": qname, "M": m, "bytes": nb}
                impls = [("int4_matmul", mm_fn({}), qsets)]
                if m == 1 and args.mm_variants:
                    impls += [(f"mm_{vn}", mm_fn(kn), qsets) for vn, kn in MM_VARIANTS.items()]
                for vn in gemv_names:
                    f = gemv_fn(VARIANTS[vn])
                    impls.append((f"gemv_{vn}", lambda *a, f=f, g=g: f(*a, g), ksets))
                x, w = qsets[0]
                ref = mm.int4_matmul_reference(x.astype(jnp.float32), w.codes, w.scales, w.mins, group_size=g)
                for name, fn, sets in impls:
                    if time.time() - t0 > args.budget:
                        break
                    try:
                        row[f"{name}_err"] = bk.rel_err(jax.jit(fn)(*sets[0]), ref)
                        t = bk.time_sets(fn, sets)
                        row[f"{name}_us"] = round(t * 1e6, 2)
                        row[f"{name}_bw"] = round(nb / t / 1e9 / bw, 4)
                    except Exception as e:  # noqa: BLE001 - keep the rest of the run
                        row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
                        traceback.print_exc()
                print(json.dumps(row), flush=True)
                rows.append(row)
                del qsets, ksets
                with open(os.path.join(bk.OUT, "bench_gemv.json"), "w") as fh:
                    json.dump({"copy_GBps": bw, "rows": rows}, fh, indent=1)
    print(f"copy {bw:.0f} GB/s; total {time.time() - t0:.0f} s")
    print("shape quant M | int4_matmul us (%bw) | best variant (gemv_* or mm_*) us (%bw)")
    for r in rows:
        best = min(((kk[:-3], v) for kk, v in r.items()
                    if kk.startswith(("gemv_", "mm_")) and kk.endswith("_us")),
                   key=lambda t: t[1], default=(None, None))
        base = r.get("int4_matmul_us")
        bb = r.get("int4_matmul_bw")
        line = f"{r['shape']} {r['quant']} M={r['M']} | {base} ({bb}) | {best[0]} {best[1]}"
        if best[0]:
            line += f" ({r.get(best[0] + '_bw')})"
        print(line)


if __name__ == "__main__":
    main()
