#!/usr/bin/env python3
"""Speculative decoding benchmark (issues 4, 13). One run, CPU or GPU:

    cd <repo> && PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/bench_spec.py            # GPU: A + B
    PYTHONPATH=. python3 benchmarks/bench_spec.py --small                                     # CPU: A, small
    python3 benchmarks/bench_spec.py --model /tmp/SmolLM2-135M-Instruct.Q4_1.gguf --drafters eagle,ngram --ks 4

A. Embedded SmolLM2-135M-Instruct (or --model): for each drafter (eagle = the model's shipped draft head, also with
   a --tree of N nodes; ngram; layers:N; a separate draft model = the embedded model itself, i.e. acceptance upper
   bound at full draft cost) and K, on the same chat prompts at batch 1, greedy and
   temperature 0.7: mean accepted drafts per step, tokens per target step, and wall-clock speedup over plain decoding
   (each speculative pass is timed right after a plain pass of the same prompts; speedup = median of the per-pair
   ratios, which keeps a noisy shared machine from biasing one side). Compile time is excluded. Sampled rows run
   --sampled-reps pairs (default 8), each with seeds of its own: one seed set's acceptance is mostly luck. The
   timed pairs run as `generate` does, with no wait between a prompt's phases; one more pair waits after the
   first token and after the head's start, for the per-phase times (prefill, head start, ms a step) and its own
   speedup (`speedup_waiting_between_phases`; by inference the waits expose the next program's launch, which the
   speculative pass has one more of; from 2026-12-05 to 2026-12-08 every pair waited so).
B. (GPU, or --synthetic) Llama-3-8B-shaped random int4 weights: time of one verify over K + 1 tokens (target forward
   + acceptance) relative to one decode step, K = 1, 2, 4, 8, 16, and of a tree of 32 nodes (--syn-trees), at
   context 1024, batch 1; and the cost of one
   draft token for layers:8 and a Llama-3.2-1B-shaped draft. From these, a PROJECTED speedup for assumed acceptance
   rates (random weights say nothing about acceptance; no acceptance is measured here).

--profile adds, per configuration, the GPU kernels per target step of one prompt, plain and speculative.
A global deadline (--budget seconds, default 330) skips what is left, so the run fits one < 6 minute GPU call.
Results: $OUT/bench_spec.json (or /tmp/spec_bench/bench_spec.json) and markdown tables on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

OUT = os.environ.get("OUT") or "/tmp/spec_bench"
os.makedirs(OUT, exist_ok=True)
T0 = time.time()
RESULTS: dict = {"device": None, "embedded": [], "synthetic": None, "errors": [], "skipped": []}

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Repeat the following sentence exactly three times: The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? Answer in one sentence.",
    "List the days of the week, one per line.",
    "Explain in two sentences what a hash table is.",
    "Fix the bug: def add(a, b): return a - b",
]


def parse_tree(text: str) -> tuple[int, int, int | None]:
    """--tree's items: N (depth 4), N@K, or N@K/W (a beam of W) -> (N, K, W or None)."""
    n, _, rest = text.strip().partition("@")
    k, _, w = rest.partition("/")
    return int(n), int(k) if k else 4, int(w) if w else None


def log(*a):
    print(*a, flush=True)


def save():
    with open(os.path.join(OUT, "bench_spec.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def left(budget):
    return budget - (time.time() - T0)


# ------------------------------------------------------------------------------------------------ A: embedded
def bench_embedded(args):
    from lucebox_jax import LLM, SamplingParams
    from lucebox_jax.loader import default_model_path
    from lucebox_jax.speculative import SpeculativeDecoder

    llm = LLM(args.model, kernels=args.kernels)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[: args.prompts]]
    drafters = args.drafters.split(",")
    ks = [int(k) for k in args.ks.split(",")]
    temps = [float(t) for t in args.temps.split(",")]

    def one_pass(temp, phases=None, rep=0):
        """Each prompt alone (batch 1); -> (seconds, tokens, spec stats per prompt). phases: a dict that collects
        the seconds of each phase and the loop's steps, summed over the prompts; the pass then waits after the first
        token and after the head's start to tell them apart (waits a plain `generate` never makes: the timed pairs
        run without them). rep: sampled rows draw with seeds of their own a repetition (plain and speculative
        passes of one pair alike)."""
        llm.time_phases = phases is not None
        if llm.spec is not None:
            llm.spec.time_phases = phases is not None
        secs, toks, stats = 0.0, 0, []
        for i, p in enumerate(prompts):
            sp = SamplingParams(temperature=temp, max_tokens=args.max_tokens, ignore_eos=True,
                                seed=100 + i + (1000 * rep if temp > 0 else 0))
            out = llm.generate(p, sp)
            secs += llm.last_stats["seconds"]
            n = len(out[0].outputs[0].token_ids)
            toks += n
            st = llm.last_stats.get("speculative")
            if st is not None:
                stats.append(st)
            if phases is not None:
                pre = llm.last_stats["prefill_seconds"]
                init = st["init_seconds"] if st else 0.0
                for key, v in (("prefill", pre), ("init", init), ("loop", llm.last_stats["seconds"] - pre - init),
                               ("steps", st["target_steps"] if st else n - 1), ("prompts", 1)):
                    phases[key] = phases.get(key, 0.0) + v
        return secs, toks, stats

    def phase_ms(ph: dict) -> dict:
        """Per prompt: prefill and the head's start in ms; the decode loop in ms a target step (the part a
        speculative step must keep under tokens-per-step plain steps)."""
        n = max(ph["prompts"], 1)  # (prompts x reps)
        return {"prefill_ms": round(1e3 * ph["prefill"] / n, 3), "init_ms": round(1e3 * ph["init"] / n, 3),
                "loop_ms_per_step": round(1e3 * ph["loop"] / max(ph["steps"], 1), 4)}

    configs = [(d, k, None) for k in sorted(ks, key=lambda k: (k != 4, k)) for d in drafters]  # K=4 of each first
    trees = [parse_tree(x) for x in str(args.tree).split(",") if x.strip() and parse_tree(x)[0]]
    eagles = [d for d in drafters if d.startswith("eagle")]
    for n, k, beam in reversed(trees):  # eagle drafters also with tree verification (each given, in that order)
        configs[1:1] = [(d, k, (n, beam)) for d in eagles]
    if args.self_draft:
        configs.append((f"model:{args.model or default_model_path()}", args.self_draft_k, None))
    for temp in temps:  # warm the plain path
        llm.spec = None
        one_pass(temp)
    for d, k, tree in configs:
        if left(args.budget) < args.reserve:
            RESULTS["skipped"].append(f"embedded {d} K={k} tree={tree}")
            log(f"skip {d} K={k} tree={tree}: budget")
            continue
        try:
            spec = SpeculativeDecoder.create(llm.engine, d, k, tokenizer=tok, tree=tree and tree[0],
                                             tree_beam=tree and tree[1])
        except Exception as e:  # noqa: BLE001
            RESULTS["errors"].append(f"{d} K={k} tree={tree}: {e}")
            continue
        for temp in temps:
            llm.spec = spec
            c0 = llm.engine.compile_seconds
            one_pass(temp)  # compile
            compile_s = llm.engine.compile_seconds - c0
            ratios, base_tps, spec_tps, all_stats = [], [], [], []
            for rep in range(args.reps if temp == 0 else args.sampled_reps):
                llm.spec = None
                bs, bt, _ = one_pass(temp, rep=rep)
                llm.spec = spec
                ss, st, stats = one_pass(temp, rep=rep)
                ratios.append(bs / ss)
                base_tps.append(bt / bs)
                spec_tps.append(st / ss)
                all_stats += stats
            ph_plain, ph_spec = {}, {}  # one more pair (the first seed set's), waiting between phases
            llm.spec = None
            bs, _, _ = one_pass(temp, ph_plain)
            llm.spec = spec
            ss, _, _ = one_pass(temp, ph_spec)
            hist = np.sum([s["acceptance_histogram"] for s in all_stats], axis=0)
            steps = int(hist.sum())
            mean_acc = float(np.dot(np.arange(len(hist)), hist) / max(steps, 1))
            row = {"drafter": spec.drafter.name + (f" tree{tree[0]}" + (f"/beam{tree[1]}" if tree[1] else "")
                                                   if tree else ""), "k": k, "temperature": temp,
                   "mean_accepted": round(mean_acc, 3),
                   "tokens_per_step": round(mean_acc + 1, 3), "histogram": hist.tolist(),
                   "plain_tok_s": round(statistics.median(base_tps), 2),
                   "spec_tok_s": round(statistics.median(spec_tps), 2),
                   "speedup": round(statistics.median(ratios), 3), "speedup_pairs": [round(r, 3) for r in ratios],
                   "compile_s": round(compile_s, 1),
                   "phases_plain": phase_ms(ph_plain), "phases_spec": phase_ms(ph_spec),
                   "speedup_waiting_between_phases": round(bs / ss, 3)}
            RESULTS["embedded"].append(row)
            save()
            log(f"{row['drafter']:>24} K={k} T={temp}: accepted {mean_acc:.2f}/step, {row['spec_tok_s']} vs "
                f"{row['plain_tok_s']} tok/s, speedup x{row['speedup']}  hist {row['histogram']}")
            pp, ps = row["phases_plain"], row["phases_spec"]
            log(f"{'':>24} a prompt: prefill {pp['prefill_ms']} / {ps['prefill_ms']} ms, head start "
                f"{ps['init_ms']} ms; loop {pp['loop_ms_per_step']} ms a plain step, {ps['loop_ms_per_step']} ms a "
                f"speculative step ({ps['loop_ms_per_step'] / max(pp['loop_ms_per_step'], 1e-9):.2f} plain steps); "
                f"x{row['speedup_waiting_between_phases']} in that pair")
            if args.profile:
                profile_one(llm, prompts[0], temp, args.max_tokens, spec, row)
                save()
        llm.spec = None


def profile_one(llm, prompt, temp, max_tokens, spec, row):
    """GPU kernels of one prompt's generation, plain and speculative, per target step (a decode step, or a
    speculative step: draft, verify, accept; the prompt's prefill is included, once): where a step that should cost
    about one plain step plus a little spends its time on this launch-bound model."""
    from bench_decode import print_profile, profile_summary
    from gpu_trace import trace_gpu_events

    from lucebox_jax import SamplingParams

    sp = SamplingParams(temperature=temp, max_tokens=max_tokens, ignore_eos=True, seed=100)
    for label, s in (("plain", None), ("speculative", spec)):
        llm.spec = s
        evs = trace_gpu_events(lambda: llm.generate(prompt, sp))
        if not evs:
            return
        hist = llm.last_stats.get("speculative", {}).get("acceptance_histogram")
        steps = int(sum(hist)) if s is not None and hist else max_tokens
        prof = profile_summary(evs, max(steps, 1), None, top=12)
        row.setdefault("profiles", {})[label] = prof
        log(f"profile, {label} ({steps} target steps):")
        print_profile(prof)
    llm.spec = spec


# ------------------------------------------------------------------------------------------------ B: synthetic 8B
def bench_synthetic(args):
    from lucebox_jax.config import ModelConfig
    from lucebox_jax.model import forward, init_cache
    from lucebox_jax.ops import KernelSet
    from lucebox_jax.sampling import RowParams, SamplingParams
    from lucebox_jax.speculative import _verify, expected_tokens
    from lucebox_jax.synthetic import PRESETS, decode_matmuls, random_weights

    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    cfg = PRESETS[args.syn_preset].replace(dtype=dtype)
    from lucebox_jax import ops

    kernels = KernelSet.resolve(args.syn_kernels)
    # repacked once for kernels that prepare weights (mgpu/best): unprepared weights would run their fallback
    # g128 where every K divides (the 8B shapes), else g32 (the embedded shapes' K = 576 and 1536: a Q4_1 file's)
    g = 128 if all(k % 256 == 0 for _, k, _ in decode_matmuls(cfg)) else 32
    w = ops.prepare_weights(random_weights(cfg, jax.random.key(0), group_size=g), kernels)
    ctx, s_len, reps = args.context, 2 * args.context, args.syn_reps
    rp = RowParams.from_params([SamplingParams(temperature=0)])
    seen = jnp.zeros((1, cfg.vocab_size), bool)

    def timed(fn, *a, label=""):
        out = fn(*a)
        jax.block_until_ready(out)
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            jax.block_until_ready(fn(*a))
            ts.append(time.perf_counter() - t)
        ms = statistics.median(ts) / reps * 1e3  # ms per step
        if args.syn_profile:  # where a verify's time goes beyond a decode step's: GPU kernels per step by category
            from bench_decode import print_profile, profile_summary
            from gpu_trace import trace_gpu_events

            evs = trace_gpu_events(lambda: jax.block_until_ready(fn(*a)))
            if evs:
                prof = profile_summary(evs, reps, ms, top=10)
                res.setdefault("profiles", {})[label] = prof
                log(f"profile, {label}:")
                print_profile(prof)
        return ms

    def loop_of(step_fn, c):
        @jax.jit
        def run(weights, cache):
            def body(_, carry):
                cache, acc = carry
                out, cache = step_fn(c, weights, cache)
                return cache.replace(lengths=jnp.full((1,), ctx, jnp.int32)), acc + out
            return jax.lax.fori_loop(0, reps, body, (cache, jnp.float32(0)))[1]
        return run

    def decode_fn(c):
        def f(_, weights, cache):
            logits, cache = forward(c, kernels, weights, cache, jnp.zeros((1, 1), jnp.int32), cache.lengths,
                                    last_only=jnp.zeros((1,), jnp.int32))
            return logits[0, 0], cache
        return f

    def verify_fn(k):
        def f(c, weights, cache):
            out, cache = _verify(c, kernels, weights, cache, jnp.zeros((1,), jnp.int32), jnp.zeros((1, k), jnp.int32),
                                 None, rp, seen, jnp.ones((1,), bool), 0)
            return out.next_token[0].astype(jnp.float32), cache
        return f

    def tree_fn(nodes, depth=4):
        from lucebox_jax.tree import tree_verify

        w = -(-nodes // depth)  # (15 nodes: 4 chains, the last one a node short)
        parent = jnp.asarray([[0 if i < w else i - w + 1 for i in range(nodes)]], jnp.int32)  # w chains of `depth`
        depths = jnp.asarray([[1 + i // w for i in range(nodes)]], jnp.int32)

        def f(c, weights, cache):
            n, _, nxt, _, _, cache = tree_verify(c, kernels, weights, cache, jnp.zeros((1,), jnp.int32),
                                                 jnp.zeros((1, nodes), jnp.int32), parent, depths, rp, seen, w, depth)
            return nxt[0].astype(jnp.float32), cache
        return f

    def fresh(c):
        return init_cache(c, 1, s_len).replace(lengths=jnp.full((1,), ctx, jnp.int32))

    res = {"model": f"{args.syn_preset} shape, random int4 + int8 head", "context": ctx, "dtype": dtype,
           "kernels": kernels.describe(), "verify": [], "draft": [], "projection": []}
    RESULTS["synthetic"] = res
    dec = timed(loop_of(decode_fn(cfg), cfg), w, fresh(cfg), label="decode")
    res["decode_ms"] = round(dec, 3)
    log(f"target decode step: {dec:.2f} ms")
    for k in [int(x) for x in args.syn_ks.split(",") if x]:
        if left(args.budget) < 45:
            RESULTS["skipped"].append(f"synthetic verify K={k}")
            continue
        v = timed(loop_of(verify_fn(k), cfg), w, fresh(cfg), label=f"verify K={k}")
        res["verify"].append({"k": k, "verify_ms": round(v, 3), "ratio": round(v / dec, 3)})
        save()
        log(f"target verify K={k} ({k + 1} tokens): {v:.2f} ms = {v / dec:.2f} x decode")
    for nodes in [int(x) for x in args.syn_trees.split(",") if x]:
        if left(args.budget) < 45:
            RESULTS["skipped"].append(f"synthetic tree verify {nodes}")
            continue
        v = timed(loop_of(tree_fn(nodes), cfg), w, fresh(cfg), label=f"tree {nodes}")
        res.setdefault("tree_verify", []).append({"nodes": nodes, "verify_ms": round(v, 3), "ratio": round(v / dec, 3)})
        save()
        log(f"target tree verify of {nodes} nodes (+ root): {v:.2f} ms = {v / dec:.2f} x decode")
    nl = min(8, cfg.n_layers - 1)
    drafts = [(f"layers:{nl}", cfg.replace(n_layers=nl), w.replace(layers=w.layers[:nl]))]
    c1 = ModelConfig(arch="llama", vocab_size=cfg.vocab_size, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                     head_dim=64, ffn_dim=8192, rope_theta=500000.0, max_context=8192, tied_embeddings=True,
                     dtype=dtype)
    if left(args.budget) > 60 and not args.no_syn_drafts:
        drafts.append(("llama3.2-1b-shape model", c1, random_weights(c1, jax.random.key(1))))
    for name, c, dw in drafts:
        if left(args.budget) < 40 or args.no_syn_drafts:
            RESULTS["skipped"].append(f"synthetic draft {name}")
            continue
        d = timed(loop_of(decode_fn(c), c), dw, fresh(c), label=f"draft {name}")
        res["draft"].append({"drafter": name, "draft_ms": round(d, 3), "ratio": round(d / dec, 3)})
        log(f"draft {name}: {d:.2f} ms per token = {d / dec:.2f} x target decode")
    save()
    # projection: tokens per step for an assumed per-draft acceptance alpha / (verify + K drafts), in decode steps
    costs = [("ngram", 0.0)] + [(x["drafter"], x["ratio"]) for x in res["draft"]]
    for name, c in costs:
        for alpha in (0.5, 0.7, 0.9):
            for v in res["verify"]:
                k = v["k"]
                sp = expected_tokens(alpha, k) / (v["ratio"] + k * c)
                res["projection"].append({"drafter": name, "alpha": alpha, "k": k, "projected_speedup": round(sp, 3)})
    save()


def tables():
    lines = []
    if RESULTS["embedded"]:
        lines += ["| drafter | K | temp | accepted drafts/step | tokens/step | plain tok/s | spec tok/s | speedup |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in RESULTS["embedded"]:
            lines.append(f"| {r['drafter']} | {r['k']} | {r['temperature']} | {r['mean_accepted']:.2f} | "
                         f"{r['tokens_per_step']:.2f} | {r['plain_tok_s']} | {r['spec_tok_s']} | x{r['speedup']:.2f} |")
    syn = RESULTS["synthetic"]
    if syn:
        lines += ["", f"{syn['model']}, context {syn['context']}, decode step {syn.get('decode_ms')} ms",
                  "| K | verify ms | verify / decode |", "|---|---|---|"]
        lines += [f"| {v['k']} | {v['verify_ms']} | {v['ratio']} |" for v in syn["verify"]]
        lines += [f"| tree {v['nodes']} nodes | {v['verify_ms']} | {v['ratio']} |" for v in syn.get("tree_verify", [])]
        lines += ["", "| draft | ms/token | / target decode |", "|---|---|---|"]
        lines += [f"| {d['drafter']} | {d['draft_ms']} | {d['ratio']} |" for d in syn["draft"]]
        if syn["projection"]:
            ks = sorted({p["k"] for p in syn["projection"]})
            lines += ["", "PROJECTED speedup (assumed acceptance alpha, not measured) | " + " | ".join(
                f"K={k}" for k in ks), "|---|" + "---|" * len(ks)]
            groups: dict = {}
            for p in syn["projection"]:
                groups.setdefault((p["drafter"], p["alpha"]), {})[p["k"]] = p["projected_speedup"]
            for (d, a), row in groups.items():
                lines.append(f"| {d}, alpha {a} | " + " | ".join(f"x{row.get(k, float('nan')):.2f}" for k in ks) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="CPU-sized: 3 prompts, 48 tokens, fewer configs")
    ap.add_argument("--synthetic", action="store_true", help="run part B even without a GPU")
    ap.add_argument("--no-embedded", action="store_true")
    ap.add_argument("--model", default=None, help="GGUF or checkpoint for part A (default: the embedded model)")
    ap.add_argument("--no-synthetic", action="store_true")
    ap.add_argument("--drafters", default=None)
    ap.add_argument("--ks", default=None)
    ap.add_argument("--tree", default="32", help="eagle drafters also with a tree of N nodes at depth 4, or N@K at "
                    "depth K (beam N // K), or N@K/W with a beam of W, a comma list (0: off); e.g. 15@5: 15 nodes "
                    "+ root verify as 16 rows, the matmul kernels' small-M configuration")
    ap.add_argument("--kernels", default=None, help="kernel choices for part A, e.g. kv_move=xla (an A/B against "
                    "the defaults)")
    ap.add_argument("--temps", default="0,0.7")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--sampled-reps", type=int, default=None,
                    help="pairs at temperature > 0, each with seeds of its own (default 8; 4 prompts x 96 tokens "
                         "of one seed set gave a sampled tree 1.79 accepted drafts on two H100s, 2.81 on an H200)")
    ap.add_argument("--self-draft", action=argparse.BooleanOptionalAction, default=None,
                    help="also the embedded model as its own separate draft model")
    ap.add_argument("--self-draft-k", type=int, default=4)
    ap.add_argument("--syn-ks", default="1,2,4,8,16", help="chain verify sizes")
    ap.add_argument("--syn-trees", default="32", help="tree verify sizes (nodes; 8 branches x depth 4 for 32)")
    ap.add_argument("--syn-reps", type=int, default=16)
    ap.add_argument("--syn-preset", default="llama3-8b", help="synthetic.PRESETS name (tiny: a CPU smoke test)")
    ap.add_argument("--syn-kernels", default=None,
                    help="kernel choices for part B, e.g. attention_tree=pallas (default: the backend's defaults)")
    ap.add_argument("--profile", action="store_true",
                    help="GPU kernels per target step of one embedded-model prompt, plain and speculative, per config")
    ap.add_argument("--no-syn-drafts", action="store_true", help="part B: the verifies only, no draft models timed")
    ap.add_argument("--syn-profile", action="store_true",
                    help="part B: GPU kernels per step of each timed loop by category (JAX profiler)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--budget", type=float, default=330.0, help="seconds for the whole run")
    ap.add_argument("--reserve", type=float, default=None, help="seconds kept for part B")
    args = ap.parse_args()
    gpu = jax.default_backend() == "gpu"
    small = args.small or not gpu
    args.drafters = args.drafters or "eagle,ngram,layers:8"
    args.ks = args.ks or ("2,4" if small else "2,4,8")
    args.prompts = args.prompts or (3 if small else 4)
    args.max_tokens = args.max_tokens or (48 if small else 96)
    args.reps = args.reps or 2
    args.sampled_reps = args.sampled_reps or (2 if small else 8)
    args.self_draft = (not small) if args.self_draft is None else args.self_draft
    run_syn = not args.no_synthetic and (gpu or args.synthetic)
    if args.reserve is None:
        args.reserve = 180.0 if run_syn else 0.0
    RESULTS["device"] = str(jax.devices()[0])
    RESULTS["args"] = vars(args)
    log(f"device {RESULTS['device']}; {vars(args)}")
    if not args.no_embedded:
        try:
            bench_embedded(args)
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            RESULTS["errors"].append(f"embedded: {e!r}")
    if run_syn:
        try:
            bench_synthetic(args)
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            RESULTS["errors"].append(f"synthetic: {e!r}")
    RESULTS["total_s"] = round(time.time() - T0, 1)
    save()
    log("\n" + tables())
    log(f"\ntotal {RESULTS['total_s']} s; skipped: {RESULTS['skipped']}; errors: {RESULTS['errors']}")


if __name__ == "__main__":
    main()
