#!/usr/bin/env python3
"""What a prompt's start costs before its first decode step, piece by piece, at the embedded model's shapes.

`bench_spec.py` on the real model measured a prompt's start (cache, prefill, first token) at ~8 ms on the H100 beside
a ~0.78 ms decode step: on a 96-token answer a tenth of plain decoding and a sixth of speculative decoding, which
dilutes every speculative speedup. This says where those milliseconds go, with random int4 weights at the preset's
shapes (nothing to carry) and the shipped draft head: each step of a start (a new cache, the prefill, the seen-token
mask, the first token; for eagle the speculative state and the head's start) and the decode loop's call, timed alone
and waited on (`dispatch` = until the call returned, `total` = until its result was ready); the whole start as those
steps (one wait at the end) and as the one program the engine runs for a short prompt (`Engine.start`); the GPU
kernels of the start as steps (profiler: GPU busy time against its span). `probe_h2d.py` times one copy and one call.

Usage: python benchmarks/bench_start.py [--lens 45,100,200] [--reps 20] [--no-profile]
CPU smoke test: --preset tiny --head random --lens 8 --reps 2 --no-profile
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from lucebox_jax import SamplingParams, ops  # noqa: E402
from lucebox_jax.drafters.eagle import EagleConfig, EagleDrafter, init_head, load_head, shipped_head_dir  # noqa: E402
from lucebox_jax.engine import Engine  # noqa: E402
from lucebox_jax.ops import KernelSet  # noqa: E402
from lucebox_jax.sampling import RowParams  # noqa: E402
from lucebox_jax.speculative import SpeculativeDecoder  # noqa: E402
from lucebox_jax.synthetic import PRESETS, random_weights  # noqa: E402

HEAD_OF = {"smollm2-135m": "SmolLM2-135M-Instruct.Q4_1"}


def timed(fn):
    """(result, ms until fn returned, ms until its result was ready)."""
    t0 = time.perf_counter()
    out = fn()
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    t2 = time.perf_counter()
    return out, 1e3 * (t1 - t0), 1e3 * (t2 - t0)


def pieces(eng, spec, prompt, max_new=96):
    """One generation, each piece waited on: {piece: (dispatch ms, total ms)}; `loop` is the decode loop's call
    (for eagle one `spec_chunk` call, after `spec_init`: the buffers and the head's start)."""
    rp = RowParams.from_params([SamplingParams(temperature=0.0)], static=True)
    need = len(prompt) + max_new
    hidden_layers = spec.drafter.hidden_layers if spec else None
    out = {}
    cache, *out["cache"] = timed(lambda: eng.new_cache(1, spec.cache_len(need) if spec else eng.cache_len_for(need)))
    res, *out["prefill"] = timed(lambda: eng.prefill(cache, [prompt], hidden_layers=hidden_layers))
    last, cache, h = res[0], res[2], (res[3] if spec else None)
    seen, *out["seen"] = timed(lambda: eng.new_seen([prompt]))
    (first, seen), *out["first_token"] = timed(lambda: eng.first_token(last, rp, [len(prompt)], seen))
    if spec is None:
        _, *out["loop"] = timed(lambda: eng.loop(cache, first, rp, seen, set(), np.full(1, max_new)))
        return out
    (state, stop, row_max, _), *out["spec_init"] = timed(
        lambda: spec._init(cache, [prompt], first, seen, [set()], np.full(1, max_new), 0, h))
    _, *out["loop"] = timed(lambda: spec._chunk(state, rp, stop, row_max, 1 << 30, spec.ks[0], 0))
    return out


def whole(eng, spec, prompt, max_new=96):
    """The start as its steps (as LLM._generate_batch ran it until the one-program start): one wait at the end
    (ms)."""
    rp = RowParams.from_params([SamplingParams(temperature=0.0)], static=True)
    need = len(prompt) + max_new
    t0 = time.perf_counter()
    cache = eng.new_cache(1, spec.cache_len(need) if spec else eng.cache_len_for(need))
    res = eng.prefill(cache, [prompt], hidden_layers=spec.drafter.hidden_layers if spec else None)
    seen = eng.new_seen([prompt])
    first, seen = eng.first_token(res[0], rp, [len(prompt)], seen)
    outs = [first]
    if spec is not None:
        outs.append(spec.drafter.init_state([prompt], res[2].max_len, first=first.tokens, hidden=res[3]))
    jax.block_until_ready(outs)
    return 1e3 * (time.perf_counter() - t0)


def one_call(eng, spec, prompt, max_new=96):
    """The start as the engine now runs it for a short prompt (`Engine.start`: one program) and the head's start
    (ms, one wait)."""
    rp = RowParams.from_params([SamplingParams(temperature=0.0)], static=True)
    need = len(prompt) + max_new
    t0 = time.perf_counter()
    first, cache, seen, h = eng.start([prompt], spec.cache_len(need) if spec else eng.cache_len_for(need), rp, 0,
                                      spec.drafter.hidden_layers if spec else None)
    outs = [first, cache]
    if spec is not None:
        outs.append(spec.drafter.init_state([prompt], cache.max_len, first=first.tokens, hidden=h))
    jax.block_until_ready(outs)
    return 1e3 * (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="smollm2-135m")
    ap.add_argument("--head", default=None, help="a head folder, or 'random' (default: the preset's shipped head)")
    ap.add_argument("--lens", default="45,100,200", help="prompt lengths (bench_spec's chat prompts: 41-49 tokens)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--kernels", default=None)
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()

    cfg = PRESETS[args.preset].replace(dtype="bfloat16" if jax.default_backend() == "gpu" else "float32")
    ks = KernelSet.resolve(args.kernels)
    eng = Engine(cfg, ops.prepare_weights(random_weights(cfg, jax.random.key(0), group_size=32, asymmetric=True), ks),
                 ks)
    if args.head == "random":
        hc = EagleConfig.for_target(cfg)
        head = init_head(hc, jax.random.key(1))
    else:
        hc, head, _ = load_head(args.head or shipped_head_dir(HEAD_OF.get(args.preset, args.preset)))
    spec = SpeculativeDecoder(eng, EagleDrafter(hc, head, eng), 4)
    print(f"device {jax.devices()[0]}; {args.preset} random int4 weights; kernels {ks.describe()}", flush=True)
    rows = []
    rng = np.random.default_rng(0)
    for n in [int(x) for x in args.lens.split(",")]:
        prompt = [int(t) for t in rng.integers(10, cfg.vocab_size - 10, n)]
        for label, s in (("plain", None), ("eagle", spec)):
            for _ in range(2):  # compiles
                pieces(eng, s, prompt)
                whole(eng, s, prompt)
                one_call(eng, s, prompt)
            runs = [pieces(eng, s, prompt) for _ in range(args.reps)]
            row = {"prompt_len": n, "path": label,
                   "whole_ms": statistics.median(whole(eng, s, prompt) for _ in range(args.reps)),
                   "one_call_ms": statistics.median(one_call(eng, s, prompt) for _ in range(args.reps))}
            for key in runs[0]:
                row[key] = [round(statistics.median(r[key][i] for r in runs), 4) for i in (0, 1)]
            if not args.no_profile and jax.default_backend() == "gpu":
                from bench_decode import print_profile, profile_summary
                from gpu_trace import busy_and_span_ns, trace_gpu_events

                evs = trace_gpu_events(lambda: whole(eng, s, prompt))
                if evs:
                    busy, span = busy_and_span_ns(evs)
                    row["gpu_busy_ms"], row["gpu_span_ms"] = busy / 1e6, span / 1e6
                    row["profile"] = profile_summary(evs, 1, None, top=14)
            rows.append(row)
            parts = ", ".join(f"{k} {row[k][0]:.3f}/{row[k][1]:.3f}" for k in runs[0])
            gpu = (f"; GPU busy {row['gpu_busy_ms']:.3f} ms in a span of {row['gpu_span_ms']:.3f}"
                   if "gpu_busy_ms" in row else "")
            print(f"prompt {n}, {label}: start {row['whole_ms']:.3f} ms as steps (one wait){gpu}, "
                  f"{row['one_call_ms']:.3f} ms as one program (Engine.start); pieces (dispatch/total ms): {parts}",
                  flush=True)
            if "profile" in row:
                print_profile(row["profile"])
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_start.json"), "w") as f:
            json.dump({"device": str(jax.devices()[0]), "preset": args.preset, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
