#!/usr/bin/env python3
"""Speculation inside continuous batching (issue 13, item 5): a batch job at several slot counts with and without a
drafter, on the same requests; output tok/s, acceptance and whether the greedy outputs are equal. One run:

    cd <repo> && PYTHONPATH=. python3 benchmarks/bench_spec_batch.py --model /tmp/SmolLM2-135M-Instruct.Q4_1.gguf \
        --eagle checkpoints/SmolLM2-135M-Instruct.Q4_1-eagle                      # GPU: slots 8 and 128
    PYTHONPATH=. python3 benchmarks/bench_spec_batch.py --tiny                    # CPU smoke run (random weights)

For each slot count S: N = --per-slot x S chat requests (a fixed set of prompts outside the draft head's training
prompts, greedy, up to --max-tokens each, stopping at EOS) run through `Scheduler` (what `run.py --input` uses):
plain, then with each drafter under the default policy (`spec_batch.BatchSpec`: no speculation above 32 slots, a
slot stops speculating below its break-even acceptance; above 32 slots that is the plain run, recorded without
running it again), and, where the default policy turns speculation off (S > 32), also forced on (`max_slots = S`)
to show what it would cost; `--always` adds a run with every slot
speculating throughout (no slot limit, no acceptance floor). Every configuration runs twice; the second
run is timed (compile excluded). Greedy outputs are compared with the plain run per request (on bfloat16 the
verify can round differently from the decode step, so a few may differ; see README).

`--profile`: one more run of each job under the profiler, its GPU kernels per scheduler decode call.
`--tiny`: the synthetic tiny model (random int4 weights, an untrained eagle head, random prompts) at 2 and 4 slots,
float32: a CPU check that the whole benchmark runs (numbers mean nothing there).
A deadline (--budget seconds, default 220) skips what is left. Results: $OUT/bench_spec_batch.json (else
/tmp/spec_batch_bench/) and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from lucebox_jax import quant  # noqa: E402

T0 = time.time()
TEMPLATES = [
    "Explain how {t} works in three sentences.",
    "Write a haiku about {t}.",
    "Give two surprising facts about {t}.",
    "Write a Python function that has something to do with {t}.",
    "What would a child ask about {t}? Answer briefly.",
    "Describe {t} to someone from the year 1800.",
    "List four words related to {t}, one per line.",
    "Summarize why {t} matters, in one paragraph.",
]
TOPICS = [  # none of these is among lucebox_jax/train_prompts.py's topics
    "lighthouses", "bicycles", "glaciers", "origami", "coffee", "submarines", "rainbows", "dominoes",
    "penguins", "calendars", "bridges", "tea ceremonies", "comets", "umbrellas", "libraries", "sundials",
]


def chat_requests(n: int) -> list[str]:
    ps = [TEMPLATES[i % len(TEMPLATES)].format(t=TOPICS[(i // len(TEMPLATES) + i) % len(TOPICS)])
          for i in range(len(TEMPLATES) * len(TOPICS))]
    return [ps[i % len(ps)] for i in range(n)]


def log(*a):
    print(*a, flush=True)


def save(out_dir):
    with open(os.path.join(out_dir, "bench_spec_batch.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def setup(args):
    """-> (engine, {drafter name: Drafter}, prompt token lists for `n` requests, stop ids)."""
    from lucebox_jax.drafters import EagleDrafter, build

    if args.tiny:
        from lucebox_jax.drafters.eagle import EagleConfig, init_head
        from lucebox_jax.engine import Engine
        from lucebox_jax.ops import KernelSet
        from lucebox_jax.synthetic import PRESETS, random_weights

        cfg = PRESETS["tiny"]
        eng = Engine(cfg, random_weights(cfg, jax.random.key(3), group_size=32, asymmetric=True), KernelSet())
        hc = EagleConfig.for_target(cfg)
        drafters = {n: EagleDrafter(hc, init_head(hc, jax.random.key(1)), eng) if n == "eagle" else build(n, eng)
                    for n in args.drafters.split(",")}
        rng = np.random.default_rng(0)

        def prompts(n):
            return [[int(t) for t in rng.integers(0, cfg.vocab_size, int(rng.integers(3, 30)))] for _ in range(n)]

        return eng, drafters, prompts, frozenset()
    from lucebox_jax import LLM

    llm = LLM(args.model, dtype=args.dtype)
    tok = llm.get_tokenizer()
    drafters = {}
    for name in args.drafters.split(","):
        spec = f"eagle:{args.eagle}" if name == "eagle" and args.eagle else name
        try:
            drafters[name] = build(spec, llm.engine, tokenizer=tok)
        except Exception as e:  # noqa: BLE001 - report it, run the rest
            log(f"drafter {name}: {e}")
            RESULTS["errors"].append(f"{name}: {e}")

    def prompts(n):
        return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in chat_requests(n)]

    from lucebox_jax import SamplingParams

    return llm.engine, drafters, prompts, frozenset(llm.stop_ids_for(SamplingParams()))


RESULTS: dict = {"device": None, "runs": [], "errors": [], "skipped": []}


def profile_job(eng, ids, slots, steps, max_tokens, stops, spec, label):
    """GPU kernels of one more run of the job, per scheduler decode call (plain or speculative): where a
    speculating call's time goes against a plain one's; None off the GPU."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_decode import print_profile, profile_summary
    from gpu_trace import trace_gpu_events

    sched, reqs = make_job(eng, ids, slots, steps, max_tokens, stops, spec)
    t = time.perf_counter()
    evs = trace_gpu_events(lambda: [None for _ in sched.run(reqs)])
    wall_ms = (time.perf_counter() - t) * 1e3
    if not evs:
        return None
    calls = max(1, sched.stats["decode_calls"])
    prof = profile_summary(evs, calls, wall_ms / calls, top=12)
    prof["decode_calls"], prof["spec_calls"] = calls, sched.stats["spec_calls"]
    log(f"profile, {label}: per decode call ({calls} calls, {sched.stats['spec_calls']} speculative; admissions "
        f"included):")
    print_profile(prof)
    return prof


def make_job(eng, ids, slots, steps, max_tokens, stops, spec=None):
    """A scheduler for the job and its greedy requests."""
    from lucebox_jax import SamplingParams
    from lucebox_jax.scheduler import Scheduler, SlotRequest

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0)
    max_len = -(-(max(len(p) for p in ids) + max_tokens) // 64) * 64
    sched = Scheduler(eng, slots=slots, max_len=max_len, steps_per_call=steps, max_prefill_batch=min(8, slots),
                      spec=spec)
    return sched, [SlotRequest(i, p, sp, stops, max_tokens) for i, p in enumerate(ids)]


def run_job(eng, ids, slots, steps, max_tokens, stops, spec=None, reps: int = 1):
    """One job over `ids` 1 + reps times (compile, then timed); -> (token lists, median timed seconds, compile
    seconds, spec stats)."""
    c0 = eng.compile_seconds
    out, times, stats = None, [], None
    for rep in range(1 + reps):
        sched, reqs = make_job(eng, ids, slots, steps, max_tokens, stops, spec)
        c1 = eng.compile_seconds
        t = time.perf_counter()
        got = {f.request.key: f.token_ids for batch in sched.run(reqs) for f in batch}
        if rep:
            times.append(time.perf_counter() - t - (eng.compile_seconds - c1))
        out = [got[i] for i in range(len(ids))]
        stats = sched.spec_stats()
    return out, float(np.median(times)), eng.compile_seconds - c0, stats


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF (default: the embedded model)")
    p.add_argument("--eagle", default=None, help="draft head folder for the eagle drafter (default: the shipped one)")
    p.add_argument("--drafters", default="eagle,ngram")
    p.add_argument("--slots", default=None, help="slot counts (default 8,128; --tiny 2,4)")
    p.add_argument("--per-slot", type=int, default=2, help="requests per slot")
    p.add_argument("--reps", type=int, default=1, help="timed runs of each job after its compile run (median)")
    p.add_argument("--max-tokens", type=int, default=None, help="default 128 (--tiny 16)")
    p.add_argument("--k", type=int, default=4, help="drafts per step")
    p.add_argument("--steps", type=int, default=None, help="steps per scheduler call (default 8 CPU / 16 GPU)")
    p.add_argument("--dtype", default=None, help="compute dtype (default: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--min-accept", type=float, default=None, help="per-slot acceptance floor (default: break-even)")
    p.add_argument("--always", action="store_true", help="also run each drafter with every slot speculating "
                   "throughout (no slot limit, no acceptance floor): the raw cost or gain of speculation")
    p.add_argument("--tiny", action="store_true", help="CPU smoke configuration (random weights)")
    p.add_argument("--budget", type=float, default=220.0)
    p.add_argument("--profile", action="store_true", help="GPU kernels per decode call of one more run of each job")
    args = p.parse_args(argv)
    out_dir = os.environ.get("OUT") or "/tmp/spec_batch_bench"
    os.makedirs(out_dir, exist_ok=True)
    from lucebox_jax.engine import enable_compilation_cache
    from lucebox_jax.spec_batch import DEFAULT_MAX_SLOTS, BatchSpec

    enable_compilation_cache()
    RESULTS["device"] = str(jax.devices()[0])
    slot_counts = [int(s) for s in (args.slots or ("2,4" if args.tiny else "8,128")).split(",")]
    max_tokens = args.max_tokens or (16 if args.tiny else 128)
    steps = args.steps or (8 if jax.default_backend() == "cpu" else 16)
    eng, drafters, make_prompts, stops = setup(args)
    RESULTS["config"] = {"model": "tiny (random)" if args.tiny else (args.model or "embedded"), "k": args.k,
                         "max_tokens": max_tokens, "per_slot": args.per_slot, "steps": steps, "reps": args.reps,
                         "dtype": eng.cfg.dtype, "default_max_slots": DEFAULT_MAX_SLOTS,
                         "row_invariant": quant.ROW_INVARIANT}
    rows = []
    for slots in slot_counts:
        ids = make_prompts(args.per_slot * slots)
        base, base_s, base_c, _ = run_job(eng, ids, slots, steps, max_tokens, stops, reps=args.reps)
        n_tok = sum(map(len, base))
        rec = base_rec = {"slots": slots, "drafter": "plain", "policy": "-", "tok_s": n_tok / base_s,
                          "seconds": base_s, "completion_tokens": n_tok, "compile_s": base_c, "requests": len(ids)}
        RESULTS["runs"].append(rec)
        rows.append(rec)
        save(out_dir)
        log(f"S={slots} plain: {rec['tok_s']:.1f} tok/s ({n_tok} tokens, {base_s:.2f} s, compile {base_c:.1f} s)")
        if args.profile:
            rec["profile"] = profile_job(eng, ids, slots, steps, max_tokens, stops, None, f"S={slots} plain")
        for name, d in drafters.items():
            policies = [("default", None, args.min_accept)]
            if slots > DEFAULT_MAX_SLOTS:
                policies.append(("forced", slots, args.min_accept))
            if args.always:
                policies.append(("always", slots, 0.0))
            for policy, max_slots, floor in policies:
                if policy == "default" and slots > DEFAULT_MAX_SLOTS:  # the policy turns speculation off: plain
                    rec = {**base_rec, "drafter": name, "policy": "default", "speedup": 1.0,
                           "greedy_equal": len(ids), "spec": {"off": f"{slots} slots > {DEFAULT_MAX_SLOTS}"}}
                    RESULTS["runs"].append(rec)
                    rows.append(rec)
                    continue
                if time.time() - T0 > args.budget:
                    RESULTS["skipped"].append(f"S={slots} {name} {policy}")
                    log(f"skip S={slots} {name} {policy}: budget")
                    continue
                spec = BatchSpec(d, args.k, max_slots=max_slots, min_accept=floor)
                got, s, c, st = run_job(eng, ids, slots, steps, max_tokens, stops, spec, reps=args.reps)
                same = sum(a == b for a, b in zip(got, base))
                m = sum(map(len, got))
                rec = {"slots": slots, "drafter": name, "policy": policy, "tok_s": m / s, "seconds": s,
                       "completion_tokens": m, "compile_s": c, "requests": len(ids),
                       "speedup": (m / s) / (n_tok / base_s), "greedy_equal": same, "spec": st}
                if args.profile:
                    rec["profile"] = profile_job(eng, ids, slots, steps, max_tokens, stops, spec,
                                                 f"S={slots} {name} {policy}")
                RESULTS["runs"].append(rec)
                rows.append(rec)
                st = st or {}
                acc = st.get("mean_accepted")
                log(f"S={slots} {name} ({policy}): {rec['tok_s']:.1f} tok/s, x{rec['speedup']:.2f}, equal "
                    f"{same}/{len(ids)}, accepted/step {acc if acc is None else round(acc, 2)}, "
                    f"{st.get('spec_calls', 0)} spec / {st.get('plain_calls', 0)} plain calls")
                save(out_dir)
    save(out_dir)
    log(f"\n{RESULTS['device']}, {RESULTS['config']}\n")
    log("| slots | drafter | policy | tok/s | vs plain | greedy equal | accepted/step | spec / plain calls |")
    log("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        st = r.get("spec") or {}
        log(f"| {r['slots']} | {r['drafter']} | {r['policy']} | {r['tok_s']:.1f} | "
            f"{'x%.2f' % r['speedup'] if 'speedup' in r else '-'} | "
            f"{'%d/%d' % (r['greedy_equal'], r['requests']) if 'greedy_equal' in r else '-'} | "
            f"{'%.2f' % st['mean_accepted'] if 'mean_accepted' in st else st.get('off', '-')} | "
            f"{st.get('spec_calls', '-')} / {st.get('plain_calls', '-')} |")
    return RESULTS


if __name__ == "__main__":
    main()
