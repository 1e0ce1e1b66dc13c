#!/usr/bin/env python3
"""One GPU run for issue 11: the Mosaic-GPU W4A16 / W8A16 kernel (`pallas_kernels/mgpu_qmatmul.py`) at Llama-3-8B
layer shapes (or another preset's: --model qwen3-32b), swept over its configurations, against the Pallas-Triton
kernel and XLA in the same call.

    cd <repo> && PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/bench_mgpu.py [--budget 420] [--ms 1,16,64]

Timing and bandwidth accounting are bench_kernels.py's (R input sets over 240 MB so L2 never holds the next one,
GPU kernel time from the profiler: every kernel the op launches, the x pad/transpose and split-K sum included).
Every timed configuration is first checked against the float32 reference. Results: $OUT/bench_mgpu.json, and the
best configuration per (shape, quant, M) in $OUT/mgpu_tuned.json (with --write-tuned also in
pallas_kernels/mgpu_tuned.json, the engine's table: `"default": true` where it beat Pallas-Triton); a table prints
last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_kernels as bk  # noqa: E402
from lucebox_jax import kernels_mgpu as km  # noqa: E402
from lucebox_jax import kernels_xla  # noqa: E402
from lucebox_jax.quant import Int8Array, dequantize  # noqa: E402
from lucebox_jax.synthetic import PRESETS, decode_matmuls  # noqa: E402
from pallas_kernels import mgpu_qmatmul as mg  # noqa: E402

OUT = bk.OUT
RES: dict = {"copy_GBps": None, "rows": [], "errors": []}


def model_cases(name: str) -> list[tuple[str, int, int, int, int]]:
    """(label, K, N, group, bits) of a `synthetic.PRESETS` model's decode matmuls (`synthetic.decode_matmuls`): the
    int4 g128 shapes first (the decode benchmark's layout), then the int8 g32 head, then g32 (Q4_1 / Q4_K imports)."""
    *ops4, (_, hk, hn) = decode_matmuls(PRESETS[name])
    return ([(lb, k, n, 128, 4) for lb, k, n in ops4] + [("head", hk, hn, 32, 8)]
            + [(lb, k, n, 32, 4) for lb, k, n in ops4])


CASES = model_cases("llama3-8b")


def make_sets(k, n, g, bits, m):
    if bits == 4:
        nb = k * n // 2 + k // g * n * 4
        sets = bk.make_q_sets(k, n, g, g == 128, m, bk.n_sets(nb))
    else:
        sets = []
        key = jax.random.PRNGKey(n + m)
        for _ in range(bk.n_sets(k * n)):
            key, k1, k2, k3 = jax.random.split(key, 4)
            x = jax.random.normal(k1, (m, k), jnp.float32).astype(jnp.bfloat16)
            codes = jax.random.randint(k2, (k, n), -127, 128, dtype=jnp.int32).astype(jnp.int8)
            scales = (jax.random.uniform(k3, (k // g, n), jnp.float32, 0.5, 1.5) * 0.001).astype(jnp.float16)
            sets.append((x, Int8Array(codes=codes, scales=scales, group_size=g)))
    return sets


def check(fn, x, w_orig, w_run):
    ref = jnp.dot(x.astype(jnp.float32), dequantize(w_orig, jnp.float32))
    return bk.rel_err(fn(x, w_run), ref)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=420)
    ap.add_argument("--ms", default="1,16,64")
    ap.add_argument("--cases", default="", help="only these shapes by label, e.g. gate_up,down")
    ap.add_argument("--model", default="llama3-8b", choices=sorted(PRESETS),
                    help="whose layer shapes (synthetic.PRESETS; e.g. qwen3-32b, gemma2-27b-shape)")
    ap.add_argument("--groups", default="", help="only these group sizes, e.g. 32 (the Q4_1 / Q4_K imports)")
    ap.add_argument("--max-configs", type=int, default=0, help="time an even spread of at most this many")
    ap.add_argument("--loads", default=",".join(mg.LOADS),
                    help="load paths (MgpuConfig.loads) timed on the default and the tabled configuration")
    ap.add_argument("--steps", default="", help="pipeline depths (MgpuConfig.steps) timed on those, e.g. 4,6,8 "
                    "(default: each configuration's own)")
    ap.add_argument("--variants", default="", help="';'-separated JSON objects of MgpuConfig fields, each applied to "
                    "the engine's configuration (km.config_for) and timed first, e.g. '{\"scale_after\": true}'")
    ap.add_argument("--no-sweep", action="store_true", help="time only the load paths, depths and variants")
    ap.add_argument("--write-tuned", action="store_true",
                    help="also write the table to pallas_kernels/mgpu_tuned.json (the engine's per-shape choice)")
    args = ap.parse_args()
    t0 = time.time()
    bw = bk.bench_copy()
    RES["copy_GBps"] = bw
    ms = [int(v) for v in args.ms.split(",")]
    tuned = {}
    kept = dict(km.tuned_table())  # read before this run writes the engine's table
    cases = [c for c in model_cases(args.model) if (not args.cases or c[0] in args.cases.split(","))
             and (not args.groups or str(c[3]) in args.groups.split(","))]
    for m in ms:
        for label, k, n, g, bits in cases:
            if time.time() - t0 > args.budget:
                RES["errors"].append(f"budget: skipped {label} g{g} M={m}")
                continue
            sets = make_sets(k, n, g, bits, m)
            msets = [(x, mg.repack(w)) for x, w in sets]
            perm = mg.perm_ok(g, bits) and "perm" in args.loads.split(",")
            psets = [(x, mg.repack(w, k_perm=True)) for x, w in sets] if perm else msets  # K-permuted copies
            ssets = None  # the same in the split order, for `split_decode` configurations (made when one is timed)
            pairs = {}  # int4 g32 stored two groups a row (`pair`), by split order (made when one is timed)
            nbytes = sets[0][1].nbytes + m * k * 2 + m * n * 2
            row = {"case": label, "k": k, "n": n, "g": g, "bits": bits, "m": m, "bytes": nbytes, "configs": []}
            base_fn = kernels_xla.qmatmul_xla if bits == 4 else kernels_xla.qmatmul8_xla
            try:
                from lucebox_jax import kernels_pallas  # noqa: F401
                from lucebox_jax import ops
                pfn = ops.get("qmatmul" if bits == 4 else "qmatmul8", "pallas")
                row["pallas_us"] = bk.time_sets(pfn, sets, trials=3) * 1e6
                row["xla_us"] = bk.time_sets(base_fn, sets, trials=3) * 1e6 if m == 1 else None
            except Exception as e:  # noqa: BLE001
                RES["errors"].append(f"baseline {label} g{g} M={m}: {type(e).__name__}: {str(e)[:300]}")
            cands = mg.candidate_configs(m, k, n, g, bits)
            if args.max_configs and len(cands) > args.max_configs:
                step = len(cands) / args.max_configs
                cands = [cands[int(i * step)] for i in range(args.max_configs)]
            # each load path (and pipeline depth) on what an untuned engine runs and on the table's configuration, then
            # the sweep
            # `perm` asked of a weight it cannot serve (int8, int4 g32) runs `narrow`, as the engine's `load_mode` does
            loads = list(dict.fromkeys(ld if ld != "perm" or mg.perm_ok(g, bits) else "narrow"
                                       for ld in args.loads.split(",")))
            first = [mg.default_config(m, k, n, g, bits)]
            entry = km.tuned_table().get(km.tuned_key(km.m_bucket(m), k, n, g, bits))
            if entry:
                first.append(mg.MgpuConfig(**entry["cfg"]))
            # and what the engine runs (past 16 rows with no entry of its own: the 16-row entry widened); variants
            # apply to it
            first.append(km.config_for(m, k, n, g, bits))
            depths = [int(v) for v in args.steps.split(",") if v] or [None]
            # with the engine's int4 decode (split_decode where it applies; LUCEBOX_MGPU_DECODE=cast: Mosaic's cast), so
            # the table is chosen on what the engine runs; a variant naming split_decode sets it
            first = [km.with_decode(dataclasses.replace(c, loads=ld, steps=st or c.steps), k, n, g, bits)
                     for c in first if c is not None for ld in loads for st in depths]
            base = first[-1] if first else None
            for v in [json.loads(v) for v in args.variants.split(";") if v.strip()] if base else []:
                cfg = dataclasses.replace(base, **v)
                cfg = cfg if "split_decode" in v else km.with_decode(cfg, k, n, g, bits)  # (e.g. other loads: off)
                if why := mg.check_config(k, n, g, bits, cfg):  # (e.g. `pair` on the narrow loads g32 falls to)
                    print(f"  variant {json.dumps(v)} on {label} g{g} M={m} skipped: {why}", flush=True)
                    RES["errors"].append(f"variant {json.dumps(v)} on {label} g{g} M={m}: {why}")
                else:
                    first.append(cfg)
            first = list(dict.fromkeys(first))
            cands = [km.with_decode(c, k, n, g, bits) for c in cands]
            cands = first + ([] if args.no_sweep else [c for c in cands if c not in first])
            for cfg in cands:
                if time.time() - t0 > args.budget:
                    break
                fn = lambda x, w, cfg=cfg: mg.mgpu_matmul(x, w, cfg)  # noqa: E731
                run_sets = psets if cfg.loads == "perm" else msets
                if cfg.pair:  # int4 g32 two groups a row (its own copies: the kernel follows the weight's rows)
                    pairs[cfg.split_decode] = pairs.get(cfg.split_decode) or [
                        (x, mg.repack(w, k_perm=True, k_split=cfg.split_decode, k_pair=True)) for x, w in sets]
                    run_sets = pairs[cfg.split_decode]
                elif cfg.split_decode:
                    ssets = ssets or [(x, mg.repack(w, k_perm=True, k_split=True)) for x, w in sets]
                    run_sets = ssets
                # a crash in compile names its config; the elapsed time shows a config started near the budget's end
                print(f"  trying {label} g{g} M={m} {cfg} at {time.time() - t0:.0f} s", flush=True)
                try:
                    t_c = time.time()
                    err = check(jax.jit(fn), sets[0][0], sets[0][1], run_sets[0][1])
                    compile_s = time.time() - t_c  # the first call: compile (Mosaic GPU's included) and one run
                    us = bk.time_sets(fn, run_sets, trials=3) * 1e6
                    # the op's kernels by name: the Mosaic-GPU kernel (the largest) and the glue XLA adds around it
                    # (x pad/transpose, split-K sum, output transpose), which a model step may fuse into neighbours
                    kern = dict(list(bk.TIMING.get("by_kernel_us", {}).items())[:6])
                    main_us = max(kern.values(), default=None)
                    span = bk.TIMING.get("span")  # GPU time from first start to last end (what PDL overlap shows)
                    row["configs"].append({"cfg": cfg.__dict__, "us": us, "err": err, "compile_s": compile_s,
                                           "kernel_us": main_us, "kernels_us": kern,
                                           "span_us": span and span * 1e6})
                    alone = f" (its main kernel {main_us:.1f} us, {nbytes / main_us / 1e3 / bw:.0%} of copy; " \
                            f"{len(kern)} kernels; span {span * 1e6:.1f} us)" if main_us and span else ""
                    print(f"  {label} g{g} M={m} {cfg}: {us:.1f} us{alone} err {err:.1e} compile {compile_s:.1f} s",
                          flush=True)
                except Exception as e:  # noqa: BLE001
                    RES["errors"].append(f"{label} g{g} M={m} {cfg}: {type(e).__name__}: {str(e)[:400]}")
                    print(f"  {label} g{g} M={m} {cfg}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            good = [c for c in row["configs"] if c["err"] < 2e-2]
            if good:
                best = min(good, key=lambda c: c["us"])
                row["best"] = best
                p_us = row.get("pallas_us")
                tuned[km.tuned_key(km.m_bucket(m), k, n, g, bits)] = {
                    "cfg": best["cfg"], "us": round(best["us"], 2), "pallas_us": p_us and round(p_us, 2),
                    "default": bool(p_us and best["us"] < p_us),
                    "measured": f"{time.strftime('%Y-%m-%d')} {jax.devices()[0].device_kind}"}
            RES["rows"].append(row)
            del sets, msets, psets, ssets, pairs
            with open(os.path.join(OUT, "bench_mgpu.json"), "w") as f:
                json.dump(RES, f, indent=1, default=str)
            about = (f"Per-shape Mosaic-GPU configurations for lucebox_jax/kernels_mgpu.py, keyed m<rows bucket>"
                     f"_k_n_g_b<bits>: the best timed configuration per shape and Pallas-Triton's time in the same "
                     f"call; default = mgpu measured faster. Written by benchmarks/bench_mgpu.py "
                     f"{' '.join(sys.argv[1:])} on {jax.devices()[0].device_kind}, {time.strftime('%Y-%m-%d')}; "
                     f"entries with an older `measured` were kept from earlier runs (shapes this one did not time).")
            with open(os.path.join(OUT, "mgpu_tuned.json"), "w") as f:
                json.dump({"_about": about, **tuned}, f, indent=1)
            if args.write_tuned and tuned:  # the engine's table: this run's shapes replace theirs, the others stay
                with open(km.TUNED, "w") as f:
                    json.dump({"_about": about, **{**kept, **tuned}}, f, indent=1)
    print(f"\ncopy bandwidth {bw:.0f} GB/s")
    print("case g bits M | mgpu us GB/s %bw (main kernel alone) | pallas us | xla us | pallas/mgpu | best config")
    for r in RES["rows"]:
        b = r.get("best")
        if not b:
            print(f"{r['case']} g{r['g']} {r['bits']} {r['m']} | no config ran")
            continue
        gbs = r["bytes"] / b["us"] / 1e3
        p, x = r.get("pallas_us"), r.get("xla_us")
        c = b["cfg"]
        ku = b.get("kernel_us")
        alone = f" ({ku:.1f} {100 * r['bytes'] / ku / 1e3 / bw:.0f}% alone)" if ku else ""
        print(f"{r['case']} g{r['g']} {r['bits']} {r['m']} | {b['us']:.1f} {gbs:.0f} {100 * gbs / bw:.0f}%{alone} | "
              f"{p and round(p, 1)} | {x and round(x, 1)} | {p and round(p / b['us'], 2)} | "
              f"tm{c['tile_m']} wg{c['compute_wgs']} gr{c['groups']} st{c['steps']} sk{c['split_k']} tt{c['tile_t']} "
              f"{c.get('loads')}")
    for e in RES["errors"][:20]:
        print("ERR", e[:300])


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
