#!/usr/bin/env python3
"""One GPU run: copy bandwidth, then every Pallas kernel against its XLA baseline (issue 3).

    cd <repo> && PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/bench_kernels.py [--sweep] [--quick]

  * copy bandwidth: a 4 GiB device-to-device elementwise copy in JAX (bytes read + written);
  * qmatmul (int4 W4A16) at Llama-3-8B layer shapes (qkv 4096x6144, o 4096x4096, gate+up 4096x28672,
    down 14336x4096), M = 1, 2, 4, 8, 16, 64, 512, group 32 asymmetric and group 128 symmetric, pallas vs xla;
  * attention_decode at B=8, Hq=32, Hkv=8, D=128, bf16, S = 1k, 4k, 16k, 32k (full lengths), pallas vs xla vs jax's
    shipped jax.experimental.pallas.ops.gpu.decode_attention.gqa (on its own [B, S, Hkv, D] layout);
  * attention_prefill at a few shapes, pallas vs xla.
`--sweep` instead times variants of the kernels' tuning knobs (block sizes, warps, stages, split-K, decode path).

Timing: one jitted function applies the op to R different input sets (R chosen so the sets total >= 400 MB, so
the 50-60 MB L2 never holds the next set), called n times back to back (async dispatch keeps the GPU busy);
warmup first, then the median over trials of (wall time / (n * R)).  Every timed kernel is first checked against
the float32 reference on the same inputs.  Results go to $OUT/bench_kernels.json; a short table prints last.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lucebox_jax import kernels_xla  # noqa: E402
from lucebox_jax.quant import QuantArray  # noqa: E402
from pallas_kernels import attention_decode as dec_mod  # noqa: E402
from pallas_kernels import attention_prefill as pre_mod  # noqa: E402
from pallas_kernels import int4_matmul as mm_mod  # noqa: E402

OUT = os.environ.get("OUT") or "/tmp/bench_kernels_out"
os.makedirs(OUT, exist_ok=True)
RESULTS: dict = {"device": None, "copy": None, "qmatmul": [], "decode": [], "prefill": [], "sweep": [], "errors": []}
T_START = time.time()


def log(*a):
    print(*a, flush=True)


def save():
    with open(os.path.join(OUT, "bench_kernels.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def rel_err(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def time_sets(fn, sets, trials=9, n=4):
    """Median seconds per application of fn over the list of input tuples `sets`."""
    f = jax.jit(lambda ss: [fn(*s) for s in ss])
    jax.block_until_ready(f(sets))
    jax.block_until_ready(f(sets))
    ts = []
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(n):
            out = f(sets)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t) / (n * len(sets)))
    return statistics.median(ts)


def n_sets(nbytes, total=400e6, lo=2, hi=48):
    return int(max(lo, min(hi, -(-total // nbytes))))


# ------------------------------------------------------------------------------------------------ copy bandwidth
def bench_copy():
    n = 2**30  # 4 GiB of uint32
    x = jnp.arange(n, dtype=jnp.uint32)
    f = jax.jit(lambda a: a + jnp.uint32(1))
    jax.block_until_ready(f(x))
    ts = []
    for _ in range(15):
        t = time.perf_counter()
        y = f(x)
        y.block_until_ready()
        ts.append(time.perf_counter() - t)
        del y
    t = statistics.median(ts)
    gbps = 2 * 4 * n / t / 1e9
    RESULTS["copy"] = {"bytes_rw": 8 * n, "ms": t * 1e3, "GBps": gbps}
    log(f"copy bandwidth: {gbps:.0f} GB/s ({t * 1e3:.3f} ms for 4 GiB read + 4 GiB write)")
    del x
    return gbps


# ------------------------------------------------------------------------------------------------ qmatmul
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
QUANTS = {"g32a": (32, False), "g128s": (128, True)}


def rand_quant(key, k, n, g, sym):
    k1, k2, k3 = jax.random.split(key, 3)
    codes = jax.random.randint(k1, (k // 2, n), 0, 256, dtype=jnp.int32).astype(jnp.uint8)
    scales = (jax.random.uniform(k2, (k // g, n), jnp.float32, 0.5, 1.5) * 0.01).astype(jnp.float16)
    mins = None if sym else (jax.random.normal(k3, (k // g, n), jnp.float32) * 0.05).astype(jnp.float16)
    return QuantArray(codes=codes, scales=scales, mins=mins, group_size=g)


def qbytes(w: QuantArray, m, k, n):
    return w.nbytes + m * k * 2 + m * n * 2


def make_q_sets(k, n, g, sym, m, nsets):
    key = jax.random.PRNGKey(k * 7 + n + g + m)
    sets = []
    for i in range(nsets):
        key, k1, k2 = jax.random.split(key, 3)
        sets.append((jax.random.normal(k1, (m, k), jnp.float32).astype(jnp.bfloat16), rand_quant(k2, k, n, g, sym)))
    return sets


def q_check(fn, x, w):
    y = fn(x, w)
    r = mm_mod.int4_matmul_reference(x.astype(jnp.float32), w.codes, w.scales, w.mins, group_size=w.group_size)
    return rel_err(y, r)


def pallas_q(cfg):
    def fn(x, w):
        c = mm_mod.default_config(x.shape[0], x.shape[1], w.codes.shape[1], w.group_size, x.dtype)
        c.update(cfg)
        c["block_k"] = min(c["block_k"], w.group_size)
        return mm_mod.int4_matmul(x, w.codes, w.scales, w.mins, group_size=w.group_size, **c)

    return fn


def bench_qmatmul(shapes, quants, ms, cfg_override=None, tag="pallas", with_xla=True, bw=None):
    rows = []
    for sname in shapes:
        k, n = SHAPES[sname]
        for qname in quants:
            g, sym = QUANTS[qname]
            for m in ms:
                if time.time() - T_START > ARGS.budget:
                    log("budget reached, skipping the rest of qmatmul")
                    return rows
                w0 = rand_quant(jax.random.PRNGKey(1), k, n, g, sym)
                nb = qbytes(w0, m, k, n)
                sets = make_q_sets(k, n, g, sym, m, n_sets(nb))
                row = {"shape": sname, "K": k, "N": n, "quant": qname, "M": m, "bytes": nb, "sets": len(sets)}
                impls = [(tag, pallas_q(cfg_override or {}))]
                if with_xla:
                    impls.append(("xla", kernels_xla.qmatmul_xla))
                for name, fn in impls:
                    try:
                        row[f"{name}_err"] = q_check(jax.jit(fn), *sets[0])
                        t = time_sets(fn, sets)
                        row[f"{name}_us"] = t * 1e6
                        row[f"{name}_GBps"] = nb / t / 1e9
                        if bw:
                            row[f"{name}_frac_bw"] = nb / t / 1e9 / bw
                    except Exception as e:  # noqa: BLE001
                        row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                        RESULTS["errors"].append(traceback.format_exc()[-2000:])
                log(json.dumps({kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in row.items()}))
                rows.append(row)
                del sets
    return rows


# ------------------------------------------------------------------------------------------------ attention
def bench_decode(seqs, bw, variants=None, with_xla=True, with_jax=True, B=8, HQ=32, HKV=8, D=128):
    rows = []
    scale = D**-0.5
    for s in seqs:
        if time.time() - T_START > ARGS.budget:
            log("budget reached, skipping the rest of decode")
            return rows
        kvb = 2 * B * HKV * s * D * 2
        nb = kvb + 2 * B * HQ * D * 2
        ns = n_sets(nb, total=600e6, hi=16)
        key = jax.random.PRNGKey(s)
        sets = []
        for i in range(ns):
            key, a, b_, c = jax.random.split(key, 4)
            q = jax.random.normal(a, (B, HQ, D), jnp.bfloat16)
            kk = jax.random.normal(b_, (B, HKV, s, D), jnp.bfloat16)
            vv = jax.random.normal(c, (B, HKV, s, D), jnp.bfloat16)
            sets.append((q, kk, vv, jnp.full((B,), s, jnp.int32)))
        ref = dec_mod.attention_decode_reference(*sets[0], scale=scale)
        impls = []
        for vname, cfg in (variants or [("pallas", {})]):
            impls.append((vname, functools.partial(dec_mod.attention_decode_pallas, scale=scale, interpret=False, **cfg)))
        if with_xla:
            impls.append(("xla", functools.partial(kernels_xla.attention_decode_xla, scale=scale)))
        row = {"S": s, "B": B, "Hq": HQ, "Hkv": HKV, "D": D, "bytes": nb, "sets": ns}
        for name, fn in impls:
            try:
                row[f"{name}_err"] = rel_err(jax.jit(fn)(*sets[0]), ref)
                t = time_sets(fn, sets)
                row[f"{name}_us"], row[f"{name}_GBps"] = t * 1e6, nb / t / 1e9
                row[f"{name}_frac_bw"] = nb / t / 1e9 / bw
            except Exception as e:  # noqa: BLE001
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                RESULTS["errors"].append(traceback.format_exc()[-2000:])
        if with_jax:
            try:
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    from jax.experimental.pallas.ops.gpu import decode_attention as jda
                tsets = [(q, kk.transpose(0, 2, 1, 3), vv.transpose(0, 2, 1, 3), ln) for q, kk, vv, ln in sets]
                fn = lambda q, kk, vv, ln: jda.gqa(q, kk, vv, kv_seq_len=ln, sm_scale=scale)  # noqa: E731
                row["jax_gqa_err"] = rel_err(jax.jit(fn)(*tsets[0]), ref)
                t = time_sets(fn, tsets)
                row["jax_gqa_us"], row["jax_gqa_GBps"] = t * 1e6, nb / t / 1e9
                row["jax_gqa_frac_bw"] = nb / t / 1e9 / bw
                del tsets
            except Exception as e:  # noqa: BLE001
                row["jax_gqa_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        log(json.dumps({kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in row.items()}))
        rows.append(row)
        del sets
    return rows


def bench_prefill(cases, bw, variants=None, with_xla=True):
    rows = []
    for (B, T, S, st, HQ, HKV, D) in cases:
        if time.time() - T_START > ARGS.budget:
            log("budget reached, skipping the rest of prefill")
            return rows
        scale = D**-0.5
        key = jax.random.PRNGKey(T + S)
        k1, k2, k3 = jax.random.split(key, 3)
        nb = 2 * B * HKV * min(S, st + T) * D * 2 + 2 * B * T * HQ * D * 2
        flops = 4 * B * HQ * D * sum(min(S, st + t + 1) for t in range(T))
        ns = n_sets(nb, total=400e6, hi=8)
        sets = []
        for i in range(ns):
            key, a, b_, c = jax.random.split(key, 4)
            sets.append((
                jax.random.normal(a, (B, T, HQ, D), jnp.bfloat16),
                jax.random.normal(b_, (B, HKV, S, D), jnp.bfloat16),
                jax.random.normal(c, (B, HKV, S, D), jnp.bfloat16),
                jnp.full((B,), st, jnp.int32),
            ))
        ref = pre_mod.attention_prefill_reference(*sets[0], scale=scale)
        impls = [(vn, functools.partial(pre_mod.attention_prefill_pallas, scale=scale, interpret=False, **cfg))
                 for vn, cfg in (variants or [("pallas", {})])]
        if with_xla:
            impls.append(("xla", functools.partial(kernels_xla.attention_prefill_xla, scale=scale)))
        row = {"B": B, "T": T, "S": S, "start": st, "Hq": HQ, "Hkv": HKV, "D": D, "bytes": nb, "flops": flops}
        for name, fn in impls:
            try:
                row[f"{name}_err"] = rel_err(jax.jit(fn)(*sets[0]), ref)
                t = time_sets(fn, sets, trials=5, n=2)
                row[f"{name}_us"], row[f"{name}_TFLOPs"] = t * 1e6, flops / t / 1e12
                row[f"{name}_GBps"] = nb / t / 1e9
            except Exception as e:  # noqa: BLE001
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                RESULTS["errors"].append(traceback.format_exc()[-2000:])
        log(json.dumps({kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in row.items()}))
        rows.append(row)
        del sets
    return rows


# ------------------------------------------------------------------------------------------------ sweep
def sweep(bw):
    qv = [
        ("f32_dot_n128_k32_w4_s4", dict(decode="f32", mode="dot", block_n=128, block_k=32, num_warps=4, num_stages=4)),
        ("f32_fma_n128_k32_w4_s4", dict(decode="f32", mode="fma", block_n=128, block_k=32, num_warps=4, num_stages=4)),
        ("f32_fma_n256_k32_w8_s4", dict(decode="f32", mode="fma", block_n=256, block_k=32, num_warps=8, num_stages=4)),
        ("asm_dot_n128_k32_w4_s4", dict(decode="asm", mode="dot", block_n=128, block_k=32, num_warps=4, num_stages=4)),
        ("asm_dot_n64_k32_w4_s4", dict(decode="asm", mode="dot", block_n=64, block_k=32, num_warps=4, num_stages=4)),
        ("asm_dot_n256_k32_w8_s3", dict(decode="asm", mode="dot", block_n=256, block_k=32, num_warps=8, num_stages=3)),
        ("asm_dot_n128_k32_w4_s6", dict(decode="asm", mode="dot", block_n=128, block_k=32, num_warps=4, num_stages=6)),
        ("asm_dot_n128_k32_w8_s4", dict(decode="asm", mode="dot", block_n=128, block_k=32, num_warps=8, num_stages=4)),
        ("asm_dot_n128_k32_w4_s4_p264", dict(decode="asm", mode="dot", block_n=128, block_k=32, num_warps=4, num_stages=4, min_programs=264)),
        ("asm_dot_n128_k32_w4_s4_p1056", dict(decode="asm", mode="dot", block_n=128, block_k=32, num_warps=4, num_stages=4, min_programs=1056)),
        ("asm_dot_n128_k64_w4_s3", dict(decode="asm", mode="dot", block_n=128, block_k=64, num_warps=4, num_stages=3)),
        ("asm_fma_n128_k32_w4_s4", dict(decode="asm", mode="fma", block_n=128, block_k=32, num_warps=4, num_stages=4)),
    ]
    for sname, qname, m in [("qkv", "g32a", 1), ("gate_up", "g128s", 1), ("down", "g32a", 1), ("qkv", "g32a", 16),
                            ("gate_up", "g32a", 16)]:
        for vname, cfg in qv:
            if time.time() - T_START > ARGS.budget * 0.55:
                break
            if cfg["mode"] == "fma" and m != 1:
                continue
            if cfg["block_k"] > QUANTS[qname][0]:
                continue
            r = bench_qmatmul([sname], [qname], [m], cfg_override=cfg, tag="v", with_xla=(vname == qv[0][0]), bw=bw)
            for row in r:
                row["variant"] = vname
                RESULTS["sweep"].append(row)
            save()
    # GEMM tiles at M = 64 / 512
    for m in (64, 512):
        for vname, cfg in [("gemm_f32_m64_n128", dict(decode="f32", block_m=64, block_n=128, block_k=32, num_warps=4, num_stages=3)),
                           ("gemm_asm_m64_n128", dict(decode="asm", block_m=64, block_n=128, block_k=32, num_warps=4, num_stages=3)),
                           ("gemm_asm_m128_n128_w8", dict(decode="asm", block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=3))]:
            if time.time() - T_START > ARGS.budget * 0.65:
                break
            r = bench_qmatmul(["gate_up"], ["g32a"], [m], cfg_override=cfg, tag="v", with_xla=vname.startswith("gemm_f32"), bw=bw)
            for row in r:
                row["variant"] = vname
                RESULTS["sweep"].append(row)
            save()
    dv = [
        ("dec_k64_w4_s3", dict(block_k=64, num_warps=4, num_stages=3)),
        ("dec_k32_w4_s4", dict(block_k=32, num_warps=4, num_stages=4)),
        ("dec_k128_w4_s2", dict(block_k=128, num_warps=4, num_stages=2)),
        ("dec_k128_w8_s3", dict(block_k=128, num_warps=8, num_stages=3)),
        ("dec_k64_w4_s3_p528", dict(block_k=64, num_warps=4, num_stages=3, min_programs=528)),
        ("dec_k64_w4_s3_p1056", dict(block_k=64, num_warps=4, num_stages=3, min_programs=1056)),
    ]
    if time.time() - T_START < ARGS.budget * 0.85:
        for row in bench_decode([4096, 32768], bw, variants=dv, with_jax=False):
            row["variant"] = "decode"
            RESULTS["sweep"].append(row)
        save()
    pv = [("pre_t_default", {}), ("pre_k128_w8", dict(block_k=128, num_warps=8, num_stages=2)),
          ("pre_bt128rows_w8", dict(block_t=32, block_k=64, num_warps=8, num_stages=2))]
    if time.time() - T_START < ARGS.budget * 0.93:
        for row in bench_prefill([(1, 2048, 2048, 0, 32, 8, 128), (8, 5, 4096, 4000, 32, 8, 128)], bw, variants=pv):
            row["variant"] = "prefill"
            RESULTS["sweep"].append(row)
        save()


# ------------------------------------------------------------------------------------------------ table
def fmt(v, p=1):
    return "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))


def table(bw):
    lines = [f"device: {RESULTS['device']}   copy bandwidth: {fmt(bw, 0)} GB/s"]
    if RESULTS["qmatmul"]:
        lines.append("qmatmul (bf16 x, int4 W)       M   pallas_us  GB/s  %bw | xla_us  GB/s  %bw | xla/pallas")
        for r in RESULTS["qmatmul"]:
            p, x = r.get("pallas_us"), r.get("xla_us")
            lines.append(
                f"{r['shape']:>8} {r['K']:>5}x{r['N']:<5} {r['quant']:>5} {r['M']:>4} {fmt(p):>10} {fmt(r.get('pallas_GBps'), 0):>5}"
                f" {fmt(100 * r['pallas_frac_bw'] if 'pallas_frac_bw' in r else None, 0):>4} | {fmt(x):>6}"
                f" {fmt(r.get('xla_GBps'), 0):>5} {fmt(100 * r['xla_frac_bw'] if 'xla_frac_bw' in r else None, 0):>4} |"
                f" {fmt(x / p if p and x else None, 2):>6}"
            )
    if RESULTS["decode"]:
        lines.append("decode B=8 Hq=32 Hkv=8 D=128 bf16:  S  pallas_us  %bw | xla_us  %bw | jax_gqa_us %bw")
        for r in RESULTS["decode"]:
            lines.append(
                f"{r['S']:>36} {fmt(r.get('pallas_us')):>9} {fmt(100 * r.get('pallas_frac_bw', 0), 0):>4} |"
                f" {fmt(r.get('xla_us')):>6} {fmt(100 * r.get('xla_frac_bw', 0), 0):>4} |"
                f" {fmt(r.get('jax_gqa_us')):>9} {fmt(100 * r.get('jax_gqa_frac_bw', 0), 0):>4}"
            )
    if RESULTS["prefill"]:
        lines.append("prefill (B,T,S,start,Hq,Hkv,D)        pallas_us TFLOP/s | xla_us TFLOP/s")
        for r in RESULTS["prefill"]:
            lines.append(
                f"{str((r['B'], r['T'], r['S'], r['start'], r['Hq'], r['Hkv'], r['D'])):>36} {fmt(r.get('pallas_us')):>9}"
                f" {fmt(r.get('pallas_TFLOPs')):>6} | {fmt(r.get('xla_us')):>7} {fmt(r.get('xla_TFLOPs')):>6}"
            )
    if RESULTS["sweep"]:
        lines.append("sweep: variant  shape quant M  us  GB/s  %bw  err")
        for r in RESULTS["sweep"]:
            if "shape" in r:
                lines.append(
                    f"{r['variant']:>30} {r['shape']:>7} {r['quant']:>5} {r['M']:>3} {fmt(r.get('v_us')):>7}"
                    f" {fmt(r.get('v_GBps'), 0):>5} {fmt(100 * r.get('v_frac_bw', 0), 0):>3} {fmt(r.get('v_err'), 4)}"
                    + (f" | xla {fmt(r.get('xla_us'))}" if "xla_us" in r else "")
                    + (f" ERR {r['v_error'][:120]}" if "v_error" in r else "")
                )
            else:
                keys = [k[:-3] for k in r if k.endswith("_us")]
                lines.append(f"{r['variant']:>10} " + " ".join(
                    f"{k}={fmt(r[k + '_us'])}us/{fmt(r.get(k + '_err'), 4)}" for k in keys)
                    + f" S={r.get('S')} T={r.get('T')}")
    return "\n".join(lines)


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; later sections are skipped past it")
    ap.add_argument("--sections", default="copy,qmatmul,decode,prefill")
    ARGS = ap.parse_args()
    dev = jax.devices()[0]
    RESULTS["device"] = f"{dev.platform}:{getattr(dev, 'device_kind', '?')} jax {jax.__version__}"
    log(RESULTS["device"])
    secs = ARGS.sections.split(",")
    bw = bench_copy() if "copy" in secs or ARGS.sweep else None
    save()
    if ARGS.sweep:
        sweep(bw)
    else:
        if "qmatmul" in secs:
            ms = (1, 2, 4, 8, 16, 64, 512) if not ARGS.quick else (1, 16)
            shapes = list(SHAPES) if not ARGS.quick else ["qkv", "gate_up"]
            for sname in shapes:
                RESULTS["qmatmul"] += bench_qmatmul([sname], list(QUANTS), ms, bw=bw)
                save()
        if "decode" in secs:
            RESULTS["decode"] = bench_decode([1024, 4096, 16384, 32768], bw)
            save()
        if "prefill" in secs:
            RESULTS["prefill"] = bench_prefill(
                [(1, 2048, 2048, 0, 32, 8, 128), (4, 512, 4096, 1024, 32, 8, 128), (8, 5, 4096, 4000, 32, 8, 128)], bw
            )
            save()
    save()
    log(f"total {time.time() - T_START:.0f} s")
    log(table(bw))
    with open(os.path.join(OUT, "table.txt"), "w") as f:
        f.write(table(bw) + "\n")


ARGS = None
if __name__ == "__main__":
    main()
