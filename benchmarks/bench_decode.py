"""Whole-model decode benchmark (issue 3): tok/s and the fraction of the bandwidth bound for a full decode step.

In one run: the copy bandwidth (JAX device-to-device copy, bytes read + written), then for each model and kernel set
the on-device generation loop (`engine.generate_loop`) at a fixed context, reporting ms/token, tok/s, the bytes one
step must read (weights + the KV cache up to the context) and that over the measured copy bandwidth. Models use
random weights at real shapes (speed does not depend on weight values): SmolLM2-135M (the embedded model's shapes)
and Llama-3-8B, int4 group 128; also `gemma3_270m` (group 32; `--linear-bits 8` for int8 layers as in its Q4_K_M
file; benchmarks/bench_gemma3.py runs it beside transformers); `--group 32` gives the larger shapes g32 int4 with mins
(a Q4_1 / Q4_K import's layout). Also counts the kernels one compiled decode step launches.

    PYTHONUNBUFFERED=1 python benchmarks/bench_decode.py                       # GPU defaults
    python benchmarks/bench_decode.py --small                                   # CPU smoke run
    python benchmarks/bench_decode.py --models smollm2-135m --batches 1 --profile   # + per-kernel GPU time/step
--profile runs each timed loop once more under the JAX profiler and adds, per row, GPU kernels by name and by coarse
category (launches/step, us/step) with GPU-busy vs GPU-span vs wall time per step (the gaps between kernels).
Writes $OUT/bench_decode.json (without $OUT: a new temporary folder, named in the output) and prints a table last.
DUMP_HLO=<folder> also writes each compiled step's optimized HLO there (to name the fusions a profile lists).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from lucebox_jax.engine import decode_step, generate_loop, sample_first  # noqa: E402
from lucebox_jax.model import init_cache  # noqa: E402
from lucebox_jax import ops  # noqa: E402
from lucebox_jax.ops import KernelSet  # noqa: E402
from lucebox_jax.quant import weight_nbytes  # noqa: E402
from lucebox_jax.sampling import RowParams, SamplingParams  # noqa: E402
from lucebox_jax.synthetic import PRESETS, random_weights  # noqa: E402

from gpu_trace import busy_and_span_ns, trace_gpu_events  # noqa: E402  (benchmarks/ is on sys.path)


def copy_bandwidth(nbytes: int) -> float:
    """Bytes read + written per second by an elementwise pass over `nbytes`: GPU kernel time from the profiler when
    there is a GPU trace (the wall-clock figure swung 3.2-3.8 TB/s between H200 calls), else the wall-clock median."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0000001)
    f(x).block_until_ready()
    ts = []
    for _ in range(10):
        t = time.perf_counter()
        f(x).block_until_ready()
        ts.append(time.perf_counter() - t)
    try:
        busy, _ = busy_and_span_ns(trace_gpu_events(lambda: [f(x).block_until_ready() for _ in range(5)]))
    except Exception:  # noqa: BLE001 - no profiler: fall back to wall clock
        busy = None
    return 2 * nbytes / (busy * 1e-9 / 5 if busy else float(np.median(ts)))


def count_kernels(compiled_text: str) -> int:
    """Kernel launches in the entry computation of an optimized HLO module (fusions, custom calls, copies...)."""
    entry = compiled_text[compiled_text.rfind("ENTRY"):]
    ops_ = re.findall(r"=\s*[\w\[\]{},: ]*?\b(fusion|custom-call|copy|convolution|dot|all-reduce|scatter|gather|"
                      r"dynamic-update-slice|reduce|sort|while|conditional)\(", entry)
    return len(ops_)


CATEGORIES = [(r"mosaic|kernel_\d|mgpu", "Mosaic-GPU matmul"), (r"int(\d)_matmul", r"pallas int\1 GEMV"), (r"attention|decode", "pallas attention"),
              (r"gemm|dot|cublas|cutlass|matmul", "XLA matmul"), (r"memset|memcpy|copy", "copy"),
              (r"reduce", "XLA reduce fusion"), (r"fusion|wrapped_|^loop_|^input_", "XLA fusion")]


def kernel_category(name: str) -> str:
    for pat, cat in CATEGORIES:
        m = re.search(pat, name, re.I)
        if m:
            return m.expand(cat)
    return "other"


def profile_summary(events, steps: int, wall_ms: float | None = None, top: int = 15) -> dict:
    """Aggregate (name, start_ns, duration_ns) events over `steps` decode steps: per kernel name and per category,
    launches/step and us/step (sorted by time; the top `top` names plus "other"), GPU-busy/span/wall per step."""
    agg, cats = {}, {}
    for name, _, dur in events:
        for d, k in ((agg, name), (cats, kernel_category(name))):
            n, t = d.get(k, (0, 0))
            d[k] = (n + 1, t + dur)

    def rows(d):
        return [dict(name=k, launches=n / steps, us=t / 1e3 / steps)
                for k, (n, t) in sorted(d.items(), key=lambda x: -x[1][1])]

    kern = rows(agg)
    for r in kern:
        r["category"] = kernel_category(r["name"])
    if len(kern) > top:
        rest = kern[top:]
        kern = kern[:top] + [dict(name=f"other ({len(rest)} names)", launches=sum(r["launches"] for r in rest),
                                  us=sum(r["us"] for r in rest), category="")]
    lo = min(s for _, s, _ in events)
    hi = max(s + d for _, s, d in events)
    return dict(steps=steps, busy_us_per_step=sum(d for *_, d in events) / 1e3 / steps,
                span_us_per_step=(hi - lo) / 1e3 / steps, wall_us_per_step=None if wall_ms is None else wall_ms * 1e3,
                launches_per_step=len(events) / steps, kernels=kern, categories=rows(cats),
                idle=idle_summary(events, steps))


def idle_summary(events, steps: int, min_gap_us: float = 5.0, top: int = 6) -> dict:
    """Where the GPU waits inside the span: idle time per step in gaps of >= min_gap_us, summed by the kernel that
    ran before each gap (a host sync or a slow launch shows up after the same kernel every step)."""
    evs = sorted(events, key=lambda e: e[1])
    end, prev, total, by = evs[0][1] + evs[0][2], evs[0][0], 0.0, {}
    for name, st, dur in evs[1:]:
        gap = (st - end) / 1e3
        if gap >= min_gap_us:
            total += gap
            n, t = by.get(prev, (0, 0.0))
            by[prev] = (n + 1, t + gap)
        if st + dur >= end:
            end, prev = st + dur, name
    after = [dict(name=k, gaps=n / steps, us=t / steps) for k, (n, t) in sorted(by.items(), key=lambda x: -x[1][1])]
    return dict(us_per_step=total / steps, min_gap_us=min_gap_us, after=after[:top])


def print_profile(p: dict):
    if "error" in p:
        print(f"  profile: {p['error']}")
        return
    wall = "" if p["wall_us_per_step"] is None else f"  wall {p['wall_us_per_step']:.1f}"
    print(f"  profile per step (us): GPU busy {p['busy_us_per_step']:.1f}  span {p['span_us_per_step']:.1f}{wall}  "
          f"launches {p['launches_per_step']:.1f}")
    busy = max(p["busy_us_per_step"], 1e-9)
    idle = p.get("idle")
    if idle:
        print(f"  idle in gaps >= {idle['min_gap_us']:.0f} us: {idle['us_per_step']:.1f} us/step; after:")
        for r in idle["after"]:
            print(f"    {r['name'][:62]:62} {r['gaps']:6.2f} gaps/step {r['us']:8.2f} us/step")
    for title, key in (("kernel", "kernels"), ("category", "categories")):
        print(f"  {title:60} {'n/step':>7} {'us/step':>9} {'%busy':>6}")
        for r in p[key]:
            print(f"  {r['name'][:60]:60} {r['launches']:7.1f} {r['us']:9.2f} {100 * r['us'] / busy:6.1f}")


VARIANTS = {  # how the step is built, beside its kernels (--variants): what the engine does now, and what it did
    "engine": "greedy fixed on the host (LLM.generate's RowParams), one-row norms scaled after the matmul",
    "dynamic_sampling": "the sampling branch chosen on device (one lax.switch a step; the scheduler's slots do so)",
    "norm_first": "one-row norms applied before the matmul (rms_norm; 2 kernels more a layer)",
    "write_kv_first": "the step's K/V written to the cache by XLA before the attention kernel (2 kernels more a "
                      "layer; the engine's decode kernel appends them itself)",
    "attn_combine_xla": "the decode attention's splits merged by XLA fusions (LUCEBOX_ATTN_COMBINE=xla)",
    "xla_prologue": "q, k, v summed, normed and rotated by XLA fusions before the attention kernel "
                    "(LUCEBOX_QKV_PROLOGUE=0; the engine's decode kernel does it on its loads)",
    "check4": "the loop's condition read every 4 steps, not every step (generate_loop(steps_per_check=4): no "
              "predicate copied to the host inside; 1 step past the 127 timed runs)",
    "attn=SPEC": "the decode attention's knobs (LUCEBOX_ATTN_DECODE with + for commas, e.g. "
                 "attn=n_split=20+num_stages=1)",
}


def known_variant(v: str) -> bool:
    return v in VARIANTS or v.startswith("attn=")


def bench_model(name, cfg, weights, kernels: KernelSet, batch: int, ctx: int, n_tokens: int, reps: int,
                profile: bool = False, variant: str = "engine"):
    from lucebox_jax import model as model_mod

    jax.clear_caches()  # the switches below are read when the step is traced: each variant traces afresh
    model_mod.DEFER_ONE_ROW_NORM = variant != "norm_first"
    model_mod.APPEND_KV = variant != "write_kv_first"
    qkv_prologue = model_mod.QKV_PROLOGUE
    model_mod.QKV_PROLOGUE = qkv_prologue and variant != "xla_prologue"
    old_combine = os.environ.get("LUCEBOX_ATTN_COMBINE")
    if variant == "attn_combine_xla":
        os.environ["LUCEBOX_ATTN_COMBINE"] = "xla"
    old_attn = os.environ.get("LUCEBOX_ATTN_DECODE")
    if variant.startswith("attn="):
        os.environ["LUCEBOX_ATTN_DECODE"] = variant[5:].replace("+", ",")
    try:
        return _bench_model(name, cfg, weights, kernels, batch, ctx, n_tokens, reps, profile, variant)
    finally:
        model_mod.DEFER_ONE_ROW_NORM = model_mod.APPEND_KV = True
        model_mod.QKV_PROLOGUE = qkv_prologue
        for key, old in (("LUCEBOX_ATTN_COMBINE", old_combine), ("LUCEBOX_ATTN_DECODE", old_attn)):
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _bench_model(name, cfg, weights, kernels, batch, ctx, n_tokens, reps, profile, variant):
    s = ctx + n_tokens + 16
    s = ((s + 255) // 256) * 256
    cache = init_cache(cfg, batch, s)
    cache = cache.replace(lengths=jnp.full((batch,), ctx, jnp.int32))  # positions hold zeros: same cost as real KV
    rp = RowParams.from_params([SamplingParams(temperature=0)] * batch, static=variant != "dynamic_sampling")
    seen = jnp.zeros((batch, cfg.vocab_size), bool)
    logits = jnp.zeros((batch, cfg.vocab_size), jnp.float32)
    first, seen = sample_first(logits, rp, jnp.full((batch,), ctx), seen)
    stop = jnp.full((batch, 1), -2, jnp.int32)  # per-row stop ids [B, K]: none
    row_max = jnp.full((batch,), n_tokens, jnp.int32)
    t0 = time.perf_counter()
    lowered = decode_step.lower(cfg, kernels, weights, cache, first.tokens, rp, seen)
    hlo = lowered.compile().as_text()
    n_kernels = count_kernels(hlo)
    if os.environ.get("DUMP_HLO"):  # the optimized step, to name every fusion a profile lists (DUMP_HLO=<folder>)
        with open(os.path.join(os.environ["DUMP_HLO"], f"step_hlo_{name}_b{batch}_{kernels.qmatmul}.txt"), "w") as f:
            f.write(hlo)
    args = dict(max_new=n_tokens, steps_per_check=4 if variant == "check4" else 1)
    out = generate_loop(cfg, kernels, weights, cache, first, rp, seen, stop, row_max, **args)
    jax.block_until_ready(out)
    compile_s = time.perf_counter() - t0
    ts = []
    for _ in range(reps):
        cache = init_cache(cfg, batch, s).replace(lengths=jnp.full((batch,), ctx, jnp.int32))
        seen = jnp.zeros((batch, cfg.vocab_size), bool)
        jax.block_until_ready(cache)
        t = time.perf_counter()
        bufs, count, cache, _ = generate_loop(cfg, kernels, weights, cache, first, rp, seen, stop, row_max, **args)
        jax.block_until_ready(bufs.tokens)
        ts.append(time.perf_counter() - t)
    assert int(jnp.min(count)) == n_tokens
    dt = float(np.median(ts)) / (n_tokens - 1)  # the loop decodes n_tokens - 1 steps after the first token
    kv_bytes = (2 * cfg.n_layers * batch * cfg.n_kv_heads * cfg.head_dim * (ctx + n_tokens // 2)
                * jnp.dtype(cfg.dtype).itemsize)
    w_bytes = weight_nbytes(weights) - weights.embed.table.nbytes - (
        weights.embed.scales.nbytes if weights.embed.scales is not None else 0) + batch * cfg.dim * 3
    r = dict(model=name, kernels=kernels.describe(), variant=variant, batch=batch, ctx=ctx, ms_per_step=dt * 1e3,
             tok_s=batch / dt, step_bytes=w_bytes + kv_bytes, weight_bytes=w_bytes, kv_bytes=kv_bytes,
             kernels_per_step=n_kernels, compile_s=compile_s,
             tokens_sha=hashlib.sha1(np.asarray(bufs.tokens).tobytes()).hexdigest()[:12])  # same tokens <=> same math
    if profile:  # the same compiled loop once more, under the profiler
        try:
            cache = init_cache(cfg, batch, s).replace(lengths=jnp.full((batch,), ctx, jnp.int32))
            seen = jnp.zeros((batch, cfg.vocab_size), bool)
            jax.block_until_ready((cache, seen))
            evs = trace_gpu_events(lambda: jax.block_until_ready(
                generate_loop(cfg, kernels, weights, cache, first, rp, seen, stop, row_max, **args)))
            r["profile"] = (profile_summary(evs, n_tokens - 1, dt * 1e3) if evs else
                            {"error": f"no GPU trace (backend {jax.default_backend()})"})
        except Exception as e:  # profiling must never lose the row
            r["profile"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return r


def short(kernels: str) -> str:
    """Only the ops whose kernel differs from this backend's default ("default" when none does)."""
    pairs = [item.split("=", 1) for item in kernels.split(",") if "=" in item]
    diff = [f"{op}={name}" for op, name in pairs if name != ops.default_name(op)]
    return ",".join(diff) or "default"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="tiny CPU smoke run")
    ap.add_argument("--models", default="smollm2-135m,llama3-8b")
    ap.add_argument("--kernel-sets", default=None, help="';'-separated specs, e.g. 'qmatmul=xla;qmatmul=pallas'")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--xla-batches", default="1,32", help="batches that also run the XLA baseline kernels")
    ap.add_argument("--linear-bits", type=int, choices=(4, 8), default=4,
                    help="random int4 (default) or int8 g32 linear layers (8: a Q4_K_M file's layout)")
    ap.add_argument("--group", type=int, choices=(32, 128), default=None,
                    help="int4 group size (default: 32 with mins for the small models, as their Q4_1 files; 128 "
                         "symmetric for the 8B / 27B / 32B shapes; 32 there: a Q4_1 / Q4_K import's layout)")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU time per step (JAX profiler), per row")
    ap.add_argument("--kernels-module", default=None, help="module whose @ops.register calls add kernels to compare")
    ap.add_argument("--variants", default="engine", help="comma list of " + ", ".join(
        f"{k} ({v})" for k, v in VARIANTS.items()))
    args = ap.parse_args(argv)
    bad = [v for v in args.variants.split(",") if not known_variant(v)]
    if bad:
        ap.error(f"unknown --variants {bad}; valid: {', '.join(VARIANTS)}")
    if args.kernels_module:
        ops.import_kernel_module(args.kernels_module)
    backend = jax.default_backend()
    dtype = "bfloat16" if backend == "gpu" else "float32"
    if args.small:
        args.models, args.batches, args.ctx, args.tokens, args.reps = "tiny", "1,4", 64, 16, 2
    out_dir = os.environ.get("OUT") or tempfile.mkdtemp(prefix="bench_decode_")  # never the repo (cwd)
    os.makedirs(out_dir, exist_ok=True)
    results = {"device": str(jax.devices()[0]), "backend": backend, "jax": jax.__version__,
               "date": time.strftime("%Y-%m-%d"), "rows": []}
    bw = copy_bandwidth(256 << 20 if args.small else 4 << 30)
    results["copy_bandwidth_GBs"] = bw / 1e9
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    specs = args.kernel_sets.split(";") if args.kernel_sets else (
        ["", "qmatmul=xla,attention_decode=xla,attention_prefill=xla"] if backend == "gpu" else [""])
    for model in args.models.split(","):
        cfg = PRESETS[model].replace(dtype=dtype)
        small = model in ("tiny", "smollm2-135m", "gemma3_270m")
        g = args.group or (32 if small else 128)
        weights = random_weights(cfg, jax.random.key(0), group_size=g, asymmetric=g == 32,
                                 linear_bits=args.linear_bits)
        jax.block_until_ready(weights)
        seen_specs, prepared = set(), {}
        for spec in specs:
            ks = KernelSet.resolve(spec or None)
            if ks in seen_specs:
                continue
            seen_specs.add(ks)
            for b in [int(x) for x in args.batches.split(",")]:
                if model == "llama3-8b" and b > 8:
                    continue
                is_xla = ks.qmatmul == "xla" and backend == "gpu"
                if is_xla and (b not in [int(x) for x in args.xla_batches.split(",")] or
                               (model == "llama3-8b" and b != 1)):
                    continue  # the XLA baseline only where it is compared (compiles are the cost)
                for variant in args.variants.split(","):
                    try:
                        if ks not in prepared:  # kernels that repack weights (mgpu) do it once per kernel set
                            prepared.clear()
                            prepared[ks] = ops.prepare_weights(weights, ks)
                        r = bench_model(model, cfg, prepared[ks], ks, b, args.ctx, args.tokens, args.reps,
                                        args.profile, variant)
                    except Exception as e:  # one failing kernel set must not lose the rest of the run
                        r = dict(model=model, kernels=ks.describe(), variant=variant, batch=b,
                                 error=f"{type(e).__name__}: {e}"[:300])
                    if "tok_s" in r:
                        r["bw_fraction"] = r["step_bytes"] / (r["ms_per_step"] / 1e3) / bw
                    results["rows"].append(r)
                    print(json.dumps({k: v for k, v in r.items() if k != "profile"}), flush=True)
                    if "profile" in r:
                        try:
                            print_profile(r["profile"])
                        except Exception as e:  # noqa: BLE001
                            print(f"  profile print failed: {type(e).__name__}: {e}")
                        sys.stdout.flush()
                    with open(os.path.join(out_dir, "bench_decode.json"), "w") as f:
                        json.dump(results, f, indent=1)
        del weights, prepared
    print(f"\nresults: {os.path.join(out_dir, 'bench_decode.json')}")
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; {results['device']}; jax {jax.__version__}")
    print(f"{'model':14} {'kernels':40} {'B':>3} {'ms/step':>8} {'tok/s':>9} {'MB/step':>8} {'%bw':>5} {'launch':>6}")
    for r in results["rows"]:
        label = short(r["kernels"]) + ("" if r.get("variant", "engine") == "engine" else f" [{r['variant']}]")
        if "error" in r:
            print(f"{r['model']:14} {label[:40]:40} {r['batch']:>3} ERROR {r['error'][:60]}")
            continue
        print(f"{r['model']:14} {label[:40]:40} {r['batch']:>3} {r['ms_per_step']:8.3f} "
              f"{r['tok_s']:9.0f} "
              f"{r['step_bytes'] / 1e6:8.1f} {100 * r['bw_fraction']:5.1f} {r['kernels_per_step']:>6}")


if __name__ == "__main__":
    main()
