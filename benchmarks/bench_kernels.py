#!/usr/bin/env python3
"""One GPU run: copy bandwidth, then every Pallas kernel against its XLA baseline (issue 3).

    cd <repo> && PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/bench_kernels.py [--budget 420] [--quick] [--sweep]

  * copy bandwidth: a 4 GiB device-to-device elementwise copy in JAX (bytes read + written);
  * qmatmul (int4 W4A16) at Llama-3-8B layer shapes (qkv 4096x6144, o 4096x4096, gate+up 4096x28672,
    down 14336x4096), M = 1, 2, 4, 8, 16, 64, 512, group 32 asymmetric and group 128 symmetric, pallas vs xla;
  * attention_decode at B=8, Hq=32, Hkv=8, D=128, bf16, S = 1k, 4k, 16k, 32k (full lengths), pallas vs xla vs jax's
    shipped jax.experimental.pallas.ops.gpu.decode_attention.gqa (on its own [B, S, Hkv, D] layout);
  * attention_prefill at a few shapes, pallas vs xla.
The kernels run with their registered defaults (`default_config` in each pallas_kernels module).
`--sections ...,qsweep` first times qmatmul variants and uses the winners; `--sweep` only times variants.
`--sections copy,decode_knobs`: the batch-8 decode attention at S = 1k and 4k (the 8B batch-8 step's attention: 787
of its 3,265 us on an H100, ~48% of copy bandwidth), the kernel's defaults (the engine's knobs at batch 8; the splits
merged by XLA here) against 10 block / warp / stage / split settings (`DECODE_KNOBS`) and jax's gqa kernel.
`--sections copy,qsweep2` runs the staged M <= 16 int4 GEMV sweep (see `qsweep2`) and writes the best config per
(shape, group, M-bucket) to $OUT/int4_tuned.json (copy it to pallas_kernels/int4_tuned.json); `--small` is its CPU
smoke test (tiny shapes, interpret mode).

Timing: one jitted function applies the op to R different input sets (R chosen so the sets total >= 240 MB, so
the 50-60 MB L2 never holds the next set), called n times back to back after two warmup calls.  The reported time
("_us") is GPU kernel time from the JAX profiler: the sum of the durations of every kernel the op launches (the
Pallas kernel plus e.g. the split-K / split-S combine fusion), divided by n * R.  "_wall_us" is the wall-clock
median over trials of (wall time / (n * R)): it includes host launch overhead, which dominates for few-us kernels
launched one by one (in the model, XLA's command buffers / CUDA graphs hide most of it).  Every timed kernel is first checked against
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
from pallas_kernels import int8_matmul as mm8_mod  # noqa: E402

from gpu_trace import busy_and_span_ns, per_name_ns, trace_gpu_events  # noqa: E402  (benchmarks/, the script's folder)

OUT = os.environ.get("OUT") or "/tmp/bench_kernels_out"
os.makedirs(OUT, exist_ok=True)
RESULTS: dict = {"device": None, "copy": None, "qmatmul": [], "q8": [], "decode": [], "prefill": [], "sweep": [],
                 "errors": []}
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


def _device_kernel_ns(run):
    """Run `run()` under the JAX profiler; (sum of GPU kernel durations, GPU span) in ns, or (None, None). The
    durations by kernel name go to TIMING["by_kernel_ns"] (what the op's glue kernels cost beside its main one)."""
    evs = trace_gpu_events(run)
    TIMING["by_kernel_ns"] = per_name_ns(evs)
    return busy_and_span_ns(evs)


def _profiled_ns(f, sets, n):
    """n back-to-back calls f(sets) under the profiler -> (GPU busy ns, GPU span ns); (None, None) on failure."""
    def run():
        o = None
        for _ in range(n):
            o = f(sets)
        jax.block_until_ready(o)

    try:
        return _device_kernel_ns(run)
    except Exception as e:  # noqa: BLE001 - timing falls back to wall clock
        RESULTS["errors"].append(f"profiler: {type(e).__name__}: {e}")
        return None, None


TIMING = {}


def time_sets(fn, sets, trials=7, n=3):
    """Seconds per application of fn over the input tuples `sets`: the GPU kernel time (sum of the durations of
    every kernel the op launches, from the profiler, over n back-to-back calls); the wall-clock median over trials
    is kept in TIMING["wall"] (it includes host launch overhead when kernels are a few us)."""
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
    TIMING["wall"] = statistics.median(ts)
    busy, span = _profiled_ns(f, sets, n)
    TIMING["span"] = None if span is None else span * 1e-9 / (n * len(sets))
    TIMING["by_kernel_us"] = {k: v * 1e-3 / (n * len(sets)) for k, v in TIMING.pop("by_kernel_ns", {}).items()}
    if busy is None:
        return TIMING["wall"]
    return busy * 1e-9 / (n * len(sets))


def n_sets(nbytes, total=240e6, lo=2, hi=16):
    return int(max(lo, min(hi, -(-total // nbytes))))


# ------------------------------------------------------------------------------------------------ copy bandwidth
def bench_copy():
    n = 2**30  # 4 GiB
    res = {"bytes_rw": 8 * n}
    x = jax.random.bits(jax.random.PRNGKey(0), (2**15, 2**15), jnp.uint32)
    res["jax_u32_add_us"] = time_sets(lambda a: a + jnp.uint32(1), [(x,)], trials=5, n=3) * 1e6
    xf = jax.lax.bitcast_convert_type(x >> 2, jnp.float32)
    del x
    res["jax_f32_neg_us"] = time_sets(lambda a: -a, [(xf,)], trials=5, n=3) * 1e6
    del xf
    t = min(res["jax_u32_add_us"], res["jax_f32_neg_us"]) * 1e-6
    res["GBps"] = 8 * n / t / 1e9
    try:  # reference only: torch's device-to-device copy_, as the peer benchmark measures it
        import torch

        a = torch.empty(n * 4, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        for _ in range(3):
            b.copy_(a)
        torch.cuda.synchronize()
        ts = []
        for _ in range(10):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            b.copy_(a)
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1) * 1e-3)
        res["torch_copy_GBps"] = 8 * n / statistics.median(ts) / 1e9
        del a, b
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        res["torch_copy_error"] = f"{type(e).__name__}: {e}"[:200]
    RESULTS["copy"] = res
    log(f"copy bandwidth (JAX, kernel time): {res['GBps']:.0f} GB/s; torch copy_: {res.get('torch_copy_GBps', 0):.0f} GB/s")
    return res["GBps"]


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
        c = mm_mod.default_config(x.shape[0], x.shape[1], w.codes.shape[1], w.group_size, x.dtype,
                                  symmetric=w.mins is None)
        c.update(cfg)
        while (x.shape[1] // 2) % c["block_k"]:
            c["block_k"] //= 2
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
                        row[f"{name}_wall_us"] = TIMING["wall"] * 1e6
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


# ------------------------------------------------------------------------------------------------ int8 (LM head)
Q8_CASES = [(4096, 128256, 1), (4096, 128256, 8), (576, 49152, 1), (576, 49152, 32)]  # Llama-3-8B, SmolLM2 heads
Q8_VARIANTS = [("default", {}), ("n256_w8", dict(block_n=256, num_warps=8)), ("k32", dict(block_k=32)),
               ("k128_n64", dict(block_k=128, block_n=64)), ("n64_p528", dict(block_n=64, min_programs=528)),
               ("k128_s3", dict(block_k=128, num_stages=3))]


def bench_q8(bw):
    """int8 [K, N] g32 matmul (the Q8_0 LM head) at decode M: each Pallas variant against XLA's dequantize + dot."""
    from lucebox_jax.quant import Int8Array

    for k, n, m in (Q8_CASES if not ARGS.small else [(256, 1000, 1), (576, 300, 3)]):
        if time.time() - T_START > ARGS.budget:
            log("budget reached, skipping the rest of q8")
            return
        g = 32
        nb = k * n + (k // g) * n * 2 + m * (k + n) * 2
        sets = []
        key = jax.random.PRNGKey(k + n + m)
        for _ in range(n_sets(nb)):
            key, k1, k2, k3 = jax.random.split(key, 4)
            codes = jax.random.randint(k1, (k, n), -127, 128, dtype=jnp.int32).astype(jnp.int8)
            scales = (jax.random.uniform(k2, (k // g, n), jnp.float32, 0.5, 1.5) * 0.01).astype(jnp.float16)
            sets.append((jax.random.normal(k3, (m, k), jnp.float32).astype(jnp.bfloat16),
                         Int8Array(codes=codes, scales=scales, group_size=g)))
        x0, w0 = sets[0]
        ref = mm8_mod.int8_matmul_reference(x0.astype(jnp.float32), w0.codes, w0.scales, group_size=g)
        row = {"K": k, "N": n, "M": m, "bytes": nb, "sets": len(sets)}
        impls = [(f"pallas_{v}", (lambda kw: lambda x, w: mm8_mod.qmatmul8_pallas(x, w, **kw))(kw))
                 for v, kw in Q8_VARIANTS] + [("xla", kernels_xla.qmatmul8_xla)]
        for name, fn in impls:
            try:
                row[f"{name}_err"] = rel_err(jax.jit(fn)(x0, w0), ref)
                t = time_sets(fn, sets)
                row[f"{name}_us"] = t * 1e6
                row[f"{name}_frac_bw"] = nb / t / 1e9 / bw
            except Exception as e:  # noqa: BLE001
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        log(json.dumps({kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in row.items()}))
        RESULTS["q8"].append(row)
        save()
        del sets


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
        ns = n_sets(nb, total=300e6, hi=8)
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
                row[f"{name}_wall_us"] = TIMING["wall"] * 1e6
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
                row["jax_gqa_wall_us"] = TIMING["wall"] * 1e6
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
        ns = n_sets(nb, total=200e6, hi=4)
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
                t = time_sets(fn, sets, trials=3, n=2)
                row[f"{name}_us"], row[f"{name}_TFLOPs"] = t * 1e6, flops / t / 1e12
                row[f"{name}_wall_us"] = TIMING["wall"] * 1e6
                row[f"{name}_GBps"] = nb / t / 1e9
            except Exception as e:  # noqa: BLE001
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                RESULTS["errors"].append(traceback.format_exc()[-2000:])
        log(json.dumps({kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in row.items()}))
        rows.append(row)
        del sets
    return rows


# ------------------------------------------------------------------------------------------------ sweep
QVARIANTS = [
    ("f32_fma_k32", dict(decode="f32", mode="fma", block_n=128, block_k=32, num_warps=4, num_stages=4)),
    ("f32_fma_k128_w8", dict(decode="f32", mode="fma", block_n=128, block_k=128, num_warps=8, num_stages=3)),
    ("f32_dot_k32", dict(decode="f32", mode="dot", block_n=128, block_k=32, num_warps=4, num_stages=4)),
    ("f32_dot_k128", dict(decode="f32", mode="dot", block_n=128, block_k=128, num_warps=4, num_stages=3)),
    ("asm_dot_k32", dict(decode="asm", mode="dot", block_n=128, block_k=32, num_warps=4, num_stages=4)),
    ("asm_dot_k128", dict(decode="asm", mode="dot", block_n=128, block_k=128, num_warps=4, num_stages=3)),
    ("asm_dot_k128_n64", dict(decode="asm", mode="dot", block_n=64, block_k=128, num_warps=4, num_stages=4)),
    ("asm_dot_k256_w8", dict(decode="asm", mode="dot", block_n=128, block_k=256, num_warps=8, num_stages=3)),
    ("asm_dot_k64_n256_w8", dict(decode="asm", mode="dot", block_n=256, block_k=64, num_warps=8, num_stages=3)),
]
SWEEP_CASES = [("qkv", "g32a", 1), ("gate_up", "g128s", 1), ("gate_up", "g32a", 16), ("qkv", "g128s", 16)]


def sweep_qmatmul(bw):
    """Time every variant on a few cases; return (best config for M == 1, best config for 2 <= M <= 16)."""
    score = {}
    for sname, qname, m in SWEEP_CASES:
        for vi, (vname, cfg) in enumerate(QVARIANTS):
            if cfg["mode"] == "fma" and m != 1:
                continue
            r = bench_qmatmul([sname], [qname], [m], cfg_override=cfg, tag="v", with_xla=(vi == 2), bw=bw)
            for row in r:
                row["variant"] = vname
                RESULTS["sweep"].append(row)
                ok = row.get("v_err", 1.0) < 2e-2 and "v_us" in row
                score.setdefault((vname, m == 1), []).append(row["v_us"] if ok else float("inf"))
            save()
    best = {}
    for one in (True, False):
        cands = [(sum(v), k[0]) for k, v in score.items() if k[1] == one]
        cands.sort()
        best[one] = dict(QVARIANTS)[cands[0][1]] if cands and cands[0][0] < float("inf") else None
        log(f"best qmatmul variant for {'M == 1' if one else 'M in 2..16'}: {cands[:3]}")
    dot16 = best[False] or dict(QVARIANTS)["f32_dot_k32"]
    best1 = best[True] or dot16
    RESULTS["chosen"] = {"M1": best1, "M2_16": dot16}
    return best1, dot16


# (label, attention_decode knobs) for `--sections decode_knobs`: block_k, num_warps, num_stages, n_split
DECODE_KNOBS = [("default", {})] + [
    (f"k{k}_w{w}_s{st}_n{ns}", dict(block_k=k, num_warps=w, num_stages=st, n_split=ns))
    for k, w, st, ns in [(64, 4, 3, 4), (64, 4, 3, 16), (128, 4, 3, 4), (128, 8, 3, 4), (128, 8, 2, 8), (64, 8, 3, 8),
                         (64, 4, 2, 8), (32, 4, 3, 8), (256, 8, 2, 4), (128, 4, 2, 2)]]


def sweep(bw):
    sweep_qmatmul(bw)
    dv = [
        ("dec_k64_w4_s3", dict(block_k=64, num_warps=4, num_stages=3)),
        ("dec_k32_w4_s4", dict(block_k=32, num_warps=4, num_stages=4)),
        ("dec_k128_w8_s3", dict(block_k=128, num_warps=8, num_stages=3)),
    ]
    for row in bench_decode([4096, 32768], bw, variants=dv, with_jax=False):
        row["variant"] = "decode"
        RESULTS["sweep"].append(row)
    save()


# ------------------------------------------------------------------------------------------------ qsweep2
# Staged int4 GEMV sweep (M <= 16) that writes the best config per (shape, group, M-bucket) to $OUT/int4_tuned.json
# (copy it to pallas_kernels/int4_tuned.json; `default_config` reads it).  Stages, each cut off by --budget:
#   A: every Q2_M1 variant on gate+up (the largest shape) at M = 1, g32-asym and g128-sym;
#   B: the heuristic default, then the Q2_TOP_M1 best of A, on qkv, o, down at M = 1;
#   C: every Q2_M16 variant on gate+up at M = 16; D: the Q2_TOP_M16 best of C on qkv, o, down at M = 16;
#   E: the best of C/D at M = 8 on gate+up (informational; M-bucket 16 keeps the M = 16 winner).
# Each variant is compiled once (the timed jit), its first output checked against the XLA reference (rel err <
# 2e-2; a mismatch or a compile failure skips the variant, never the run), then timed like time_sets.
# Knobs not given take Q2_BASE.  "min_programs" sizes split-K (132 SMs: 264 = 2 per SM, 528 = 4, 1056 = 8).
Q2_BASE = dict(block_n=128, block_k=32, split_k=None, num_warps=4, num_stages=4, mode="dot", decode="asm",
               min_programs=528, scales_mode="tile", reduce="xla")
Q2_M1 = [  # (name, knobs); block_k > g loads [block_k/g, block_n] scale tiles broadcast in registers
    ("default", None),  # the heuristic default_config (tuned table off)
    ("dot_k128_n64_w4_s4", dict(block_k=128, block_n=64)),  # the previous best (g128: 46 us on gate+up)
    ("dot_k128_n64_w4_s5", dict(block_k=128, block_n=64, num_stages=5)),
    ("dot_k128_n64_w4_s4_at", dict(block_k=128, block_n=64, reduce="atomic")),
    ("dot_k128_n64_w4_s4_p264", dict(block_k=128, block_n=64, min_programs=264)),
    ("dot_k128_n64_w4_s3_p1056", dict(block_k=128, block_n=64, num_stages=3, min_programs=1056)),
    ("dot_k128_n128_w8_s4", dict(block_k=128, block_n=128, num_warps=8)),
    ("dot_k256_n64_w8_s3", dict(block_k=256, block_n=64, num_warps=8, num_stages=3)),
    ("dot_k64_n128_w4_s5", dict(block_k=64, block_n=128, num_stages=5)),
    ("dot_k32_n256_w8_s5", dict(block_k=32, block_n=256, num_warps=8, num_stages=5)),  # g32: no scale broadcast
    ("dot_k64_n256_w8_s4_at", dict(block_k=64, block_n=256, num_warps=8, reduce="atomic")),
    ("dott_k128_n64_w4_s4", dict(mode="dot_t", block_k=128, block_n=64)),
    ("dott_k128_n128_w8_s4", dict(mode="dot_t", block_k=128, block_n=128, num_warps=8)),
    ("fma_k128_n64_w4_s4", dict(mode="fma", block_k=128, block_n=64)),
    ("fmar_k128_n128_w8_s3_at", dict(mode="fma_r", block_k=128, block_n=128, num_warps=8, num_stages=3,
                                     reduce="atomic")),
    ("f32fma_k64_n128_w4_s4", dict(mode="fma", decode="f32", block_k=64, block_n=128)),
    # not yet timed (added after round 3): one K tile per program, which won on SmolLM2's small weights, and
    # narrower programs (more of them resident per SM)
    ("fma_k128_n64_splitall", dict(mode="fma", block_k=128, block_n=64, split_k=1 << 12)),
    ("dot_k128_n64_splitall", dict(block_k=128, block_n=64, split_k=1 << 12)),
    ("fma_k128_n32_w2_s4", dict(mode="fma", block_k=128, block_n=32, num_warps=2)),
    ("dot_k256_n32_w4_s3", dict(block_k=256, block_n=32, num_stages=3)),
]
Q2_M16 = [
    ("default", None),
    ("dot_k128_n64_w4_s4", dict(block_k=128, block_n=64)),
    ("dot_k128_n128_w8_s4", dict(block_k=128, block_n=128, num_warps=8)),
    ("dot_k64_n128_w4_s4_at", dict(block_k=64, block_n=128, reduce="atomic")),
    ("dott_k128_n64_w4_s4", dict(mode="dot_t", block_k=128, block_n=64)),
    ("dott_k128_n128_w8_s3", dict(mode="dot_t", block_k=128, block_n=128, num_warps=8, num_stages=3)),
]
Q2_TOP_M1, Q2_TOP_M16 = 3, 2
Q2_SMALL_SHAPES = {"qkv": (512, 384), "o": (512, 256), "gate_up": (512, 1024), "down": (1024, 256)}


def q2_config(knobs, m, k, n, g, sym):
    if knobs is None:
        prev = os.environ.get("LUCEBOX_INT4_TUNED")
        os.environ["LUCEBOX_INT4_TUNED"] = "off"
        try:
            cfg = mm_mod.default_config(m, k, n, g, jnp.bfloat16, on_gpu=True, symmetric=sym)
        finally:
            if prev is None:
                os.environ.pop("LUCEBOX_INT4_TUNED", None)
            else:
                os.environ["LUCEBOX_INT4_TUNED"] = prev
    else:
        cfg = dict(Q2_BASE)
        cfg.update(knobs)
    while (k // 2) % cfg["block_k"]:
        cfg["block_k"] //= 2
    return cfg


def q2_time(f, sets, small):
    """f already compiled and run once; GPU kernel time per op (profiler), or wall time."""
    trials, n = (1, 1) if small else (3, 2)
    jax.block_until_ready(f(sets))
    ts = []
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(n):
            out = f(sets)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t) / (n * len(sets)))
    wall = statistics.median(ts)
    if small:
        return wall, wall
    busy, _ = _profiled_ns(f, sets, n)
    return (wall if busy is None else busy * 1e-9 / (n * len(sets))), wall


class Q2Case:
    """Inputs of one (shape, quant, M) case, built once, shared by every variant."""

    def __init__(self, sname, qname, m, small):
        self.sname, self.qname, self.m, self.small = sname, qname, m, small
        self.k, self.n = (Q2_SMALL_SHAPES if small else SHAPES)[sname]
        self.g, self.sym = QUANTS[qname]
        if small:
            self.g = min(self.g, self.k // 4)
        w0 = rand_quant(jax.random.PRNGKey(1), self.k, self.n, self.g, self.sym)
        self.nbytes = qbytes(w0, m, self.k, self.n)
        self.sets = make_q_sets(self.k, self.n, self.g, self.sym, m, 2 if small else n_sets(self.nbytes))
        x, w = self.sets[0]
        self.ref = np.asarray(jax.jit(kernels_xla.qmatmul_xla)(x, w), np.float32)

    def key(self):
        return mm_mod.tuned_key(self.m, self.k, self.n, self.g, self.sym)


def q2_run(case, vname, knobs, bw, rows):
    if time.time() - T_START > ARGS.budget:
        return None
    cfg = q2_config(knobs, case.m, case.k, case.n, case.g, case.sym)
    row = {"shape": case.sname, "K": case.k, "N": case.n, "quant": case.qname, "M": case.m, "variant": vname,
           "cfg": cfg, "bytes": case.nbytes}
    interp = case.small

    def fn(x, w):
        return mm_mod.int4_matmul(x, w.codes, w.scales, w.mins, group_size=w.group_size, interpret=interp, **cfg)

    t0 = time.time()
    try:
        f = jax.jit(lambda ss: [fn(*s) for s in ss])
        outs = jax.block_until_ready(f(case.sets))
        row["compile_s"] = time.time() - t0
        row["err"] = rel_err(outs[0], case.ref)
        if not np.isfinite(row["err"]) or row["err"] > 2e-2:
            row["error"] = f"mismatch vs xla: rel err {row['err']:.3g}"
        else:
            t, wall = q2_time(f, case.sets, case.small)
            row["us"], row["wall_us"] = t * 1e6, wall * 1e6
            row["GBps"] = case.nbytes / t / 1e9
            row["frac_bw"] = row["GBps"] / bw
    except Exception as e:  # noqa: BLE001 - compile failures (shared memory, registers) skip the variant
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    row["total_s"] = time.time() - t0
    log(f"  {case.sname:>7} {case.qname} M={case.m:<2} {vname:<28} "
        + (f"{row['us']:8.1f} us {100 * row['frac_bw']:5.1f}%bw err {row['err']:.1e}" if "us" in row
           else f"SKIP {row.get('error', '')[:150]}") + f"  ({row['total_s']:.1f} s)")
    rows.append(row)
    RESULTS["qsweep2"].append(row)
    return row


def q2_rank(rows, variants):
    """Variant names ordered by the sum over the given rows' cases of us / best-us-of-that-case (ok rows only)."""
    best = {}
    for r in rows:
        if "us" in r:
            c = (r["shape"], r["quant"], r["M"])
            best[c] = min(best.get(c, float("inf")), r["us"])
    score = {}
    for r in rows:
        if "us" in r:
            score.setdefault(r["variant"], []).append(r["us"] / best[(r["shape"], r["quant"], r["M"])])
    names = [v for v, _ in variants if v in score]
    return sorted(names, key=lambda v: sum(score[v]) / len(score[v]))


def qsweep2(bw, small=False):
    RESULTS.setdefault("qsweep2", [])
    quants = list(QUANTS)
    others = ["qkv", "o", "down"]
    m1, m16 = dict(Q2_M1), dict(Q2_M16)
    all_rows = []
    cases = {}

    def case(sname, qname, m):
        if (sname, qname, m) not in cases:
            cases[(sname, qname, m)] = Q2Case(sname, qname, m, small)
        return cases[(sname, qname, m)]

    def stage(label, runs):
        """runs: [(shape, quant, M, variant name, variant table)], in priority order (the budget may cut the tail)."""
        log(f"qsweep2 stage {label} ({time.time() - T_START:.0f} s)")
        rows = []
        for sname, qname, m, v, table in runs:
            if time.time() - T_START > ARGS.budget:
                log("budget reached, qsweep2 stops here")
                break
            try:
                cs = case(sname, qname, m)
            except Exception as e:  # noqa: BLE001
                log(f"  {sname} {qname} M={m}: inputs failed: {type(e).__name__}: {str(e)[:200]}")
                RESULTS["errors"].append(traceback.format_exc()[-2000:])
                continue
            q2_run(cs, v, table[v], bw, rows)
            save()
        cases.clear()  # free the stage's inputs
        all_rows.extend(rows)
        return rows

    def spread(qname, m, names, table):  # the default everywhere first, then the best, the second best, ...
        order = ["default"] + [v for v in names if v != "default"]
        return [(s, qname, m, v, table) for v in order for s in others]

    for qname in quants:  # A, B per quant: M = 1
        a = stage(f"A {qname}", [("gate_up", qname, 1, v, m1) for v, _ in Q2_M1])
        stage(f"B {qname}", spread(qname, 1, q2_rank(a, Q2_M1)[:Q2_TOP_M1], m1))
    top16 = {}
    for qname in quants:  # C, D: M = 16
        c = stage(f"C {qname}", [("gate_up", qname, 16, v, m16) for v, _ in Q2_M16])
        top16[qname] = q2_rank(c, Q2_M16)[:Q2_TOP_M16]
        stage(f"D {qname}", spread(qname, 16, top16[qname], m16))
    for qname in quants:  # E: M = 8
        stage(f"E {qname}", [("gate_up", qname, 8, v, m16) for v in (["default"] + top16[qname][:1])])

    # best per (shape, quant, M-bucket); M = 8 rows are informational only
    best = {}
    for r in all_rows:
        if "us" not in r or r["M"] == 8:
            continue
        c = (r["shape"], r["quant"], r["M"])
        if c not in best or r["us"] < best[c]["us"]:
            best[c] = r
    entries = {}
    for (sname, qname, m), r in sorted(best.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
        g, sym = QUANTS[qname]
        if small:
            g = min(g, r["K"] // 4)
        key = mm_mod.tuned_key(m, r["K"], r["N"], g, sym)
        e = {kk: v for kk, v in r["cfg"].items() if kk in mm_mod._TUNABLE}
        e.update(variant=r["variant"], us=round(r["us"], 2), frac_bw=round(r["frac_bw"], 4), err=r["err"])
        entries[key] = e
    tuned = {"version": 1, "device": RESULTS["device"], "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "copy_GBps": bw, "small": small, "entries": entries}
    with open(os.path.join(OUT, "int4_tuned.json"), "w") as f:
        json.dump(tuned, f, indent=1)
    save()
    lines = ["qsweep2 best per case (M=1 and M=16 write int4_tuned.json; M=8 informational):",
             "   shape  quant  M  best variant                      us   GB/s   %bw |  default_us  speedup"]
    bycase = {}
    for r in all_rows:
        bycase.setdefault((r["shape"], r["quant"], r["M"]), []).append(r)
    for c, rs in bycase.items():
        ok = [r for r in rs if "us" in r]
        d = next((r for r in ok if r["variant"] == "default"), None)
        if not ok:
            lines.append(f"{c[0]:>8} {c[1]:>6} {c[2]:>2}  (no variant passed)")
            continue
        b = min(ok, key=lambda r: r["us"])
        lines.append(f"{c[0]:>8} {c[1]:>6} {c[2]:>2}  {b['variant']:<28} {b['us']:9.1f} {b['GBps']:6.0f}"
                     f" {100 * b['frac_bw']:5.1f} | {fmt(d['us'] if d else None):>10} "
                     f"{fmt(d['us'] / b['us'] if d else None, 2):>7}")
    n_ok = sum("us" in r for r in all_rows)
    lines.append(f"qsweep2: {len(all_rows)} runs, {n_ok} timed, {len(all_rows) - n_ok} skipped; "
                 f"{len(entries)} entries -> {os.path.join(OUT, 'int4_tuned.json')}")
    RESULTS["qsweep2_table"] = "\n".join(lines)
    log(RESULTS["qsweep2_table"])
    return tuned


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
        lines.append("decode B=8 Hq=32 Hkv=8 D=128 bf16:  S  pallas_us %bw | k128w8_us %bw | xla_us %bw | jax_gqa_us %bw")
        for r in RESULTS["decode"]:
            lines.append(
                f"{r['S']:>36} {fmt(r.get('pallas_us')):>9} {fmt(100 * r.get('pallas_frac_bw', 0), 0):>3} |"
                f" {fmt(r.get('pallas_k128_w8_us')):>9} {fmt(100 * r.get('pallas_k128_w8_frac_bw', 0), 0):>3} |"
                f" {fmt(r.get('xla_us')):>6} {fmt(100 * r.get('xla_frac_bw', 0), 0):>3} |"
                f" {fmt(r.get('jax_gqa_us')):>9} {fmt(100 * r.get('jax_gqa_frac_bw', 0), 0):>3}"
                + "".join(f" | {v}_us {fmt(r.get(v + '_us'))} {fmt(100 * r.get(v + '_frac_bw', 0), 0)}"
                          for v in ("pallas_p528", "pallas_p1056") if v + "_us" in r)
            )
    if RESULTS["prefill"]:
        lines.append("prefill (B,T,S,start,Hq,Hkv,D)        pallas_us TFLOP/s | k128w8_us | xla_us TFLOP/s")
        for r in RESULTS["prefill"]:
            lines.append(
                f"{str((r['B'], r['T'], r['S'], r['start'], r['Hq'], r['Hkv'], r['D'])):>36} {fmt(r.get('pallas_us')):>9}"
                f" {fmt(r.get('pallas_TFLOPs')):>6} | {fmt(r.get('pallas_k128_w8_us')):>9} |"
                f" {fmt(r.get('xla_us')):>7} {fmt(r.get('xla_TFLOPs')):>6}"
            )
    for r in RESULTS.get("q8", []):
        us = {kk[:-3]: v for kk, v in r.items() if kk.endswith("_us")}
        best = min(us, key=us.get) if us else None
        lines.append(f"int8 {r['K']}x{r['N']} M={r['M']}: " + " ".join(f"{kk}={fmt(v)}" for kk, v in us.items())
                     + (f" | best {best} {fmt(100 * r[best + '_frac_bw'], 0)}%bw" if best else ""))
    if RESULTS.get("qsweep2_table"):
        lines.append(RESULTS["qsweep2_table"])
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
    ap.add_argument("--sections", default="copy,qmatmul,decode,prefill",
                    help="add qsweep to time the qmatmul variants first and use the winners instead of the defaults;"
                         " qsweep2: the staged M <= 16 sweep that writes $OUT/int4_tuned.json")
    ap.add_argument("--small", action="store_true",
                    help="CPU smoke test of qsweep2: tiny shapes, interpret mode, wall time, no copy section")
    ARGS = ap.parse_args()
    dev = jax.devices()[0]
    RESULTS["device"] = f"{dev.platform}:{getattr(dev, 'device_kind', '?')} jax {jax.__version__}"
    log(RESULTS["device"])
    secs = ARGS.sections.split(",")
    bw = bench_copy() if ("copy" in secs or ARGS.sweep) and not ARGS.small else 4290.0
    save()
    if "q8" in secs:
        bench_q8(bw)
    if "qsweep2" in secs:
        try:
            qsweep2(bw, small=ARGS.small)
        except Exception:  # noqa: BLE001 - never lose the rest of the run
            RESULTS["errors"].append(traceback.format_exc()[-3000:])
            log(traceback.format_exc()[-3000:])
        save()
    if ARGS.sweep:
        sweep(bw)
    else:
        best1, dot16 = sweep_qmatmul(bw) if "qsweep" in secs else (None, None)
        gemm = dict(decode=(dot16 or {}).get("decode", "f32"), mode="dot", block_m=64, block_n=128, block_k=32,
                    num_warps=4, num_stages=3)

        def cfg_for(m):
            if best1 is None:  # registered defaults
                return {}
            if m == 1:
                return best1
            if m <= 16 and dot16:
                return dot16
            return gemm if m > 16 else {}

        order = [(1,), (2,), (4,), (8,), (16,), (64,), (512,)] if not ARGS.quick else [(1,), (16,)]
        if "qmatmul" in secs:
            first = True
            for ms in order:
                m = ms[0]
                for sname in SHAPES:
                    RESULTS["qmatmul"] += bench_qmatmul([sname], list(QUANTS), [m], cfg_override=cfg_for(m), bw=bw)
                    save()
                if first and "decode" in secs:  # decode/prefill right after M = 1, before the long tail
                    first = False
                    dv = [("pallas", {}), ("pallas_k128_w8", dict(block_k=128, num_warps=8, num_stages=3)),
                          ("pallas_p528", dict(min_programs=528)), ("pallas_p1056", dict(min_programs=1056))]
                    RESULTS["decode"] = bench_decode([1024, 4096, 16384, 32768], bw, variants=dv)
                    save()
                    if "prefill" in secs:
                        pv = [("pallas", {}), ("pallas_k128_w8", dict(block_k=128, num_warps=8, num_stages=2))]
                        RESULTS["prefill"] = bench_prefill(
                            [(1, 2048, 2048, 0, 32, 8, 128), (4, 512, 4096, 1024, 32, 8, 128),
                             (8, 5, 4096, 4000, 32, 8, 128)], bw, variants=pv)
                        save()
    if "decode_knobs" in secs:
        RESULTS["decode"] = bench_decode([1024, 4096], bw, variants=DECODE_KNOBS, with_xla=False)
        for r in RESULTS["decode"]:
            log(f"S {r['S']}: " + ", ".join(f"{n} {r.get(n + '_us', float('nan')):.1f} us"
                                           for n in [v for v, _ in DECODE_KNOBS] + ["jax_gqa"]))
    save()
    log(f"total {time.time() - T_START:.0f} s")
    log(table(bw))
    with open(os.path.join(OUT, "table.txt"), "w") as f:
        f.write(table(bw) + "\n")


ARGS = None
if __name__ == "__main__":
    main()
