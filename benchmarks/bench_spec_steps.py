#!/usr/bin/env python3
"""What a speculative step costs, in plain decode steps, at the embedded model's shapes with random weights.

`bench_spec.py` needs the embedded GGUF (98 MB: two device calls to carry); this needs nothing but the repository:
SmolLM2-135M shapes with random int4 weights (`synthetic.PRESETS`), the shipped draft head, one prompt of random
token ids at batch 1, the GPU's default kernels. It times the plain loop and the speculative loop (a chain of K
drafts, a tree of N nodes at depth K) at two generation lengths and takes the difference, so prefill and start cancel:
ms a plain step, ms a speculative step, and their ratio. Random weights accept almost no drafts, so this says nothing
of acceptance; which drafts are made does not depend on the step's kernels, so with the acceptance measured on the
real model (`--accepted`, from `bench_spec.py`) the speedup the step implies is (1 + accepted) x plain / speculative
ms, printed as an estimate. Knobs read from the environment (LUCEBOX_ATTN_DECODE, LUCEBOX_TREE_ROWS) A/B by process.

Usage: python benchmarks/bench_spec_steps.py [--configs 4,15@5] [--tokens 64,192] [--accepted 4=2.15,15@5=2.89]
       [--temperature 0.7] (sampled steps; LUCEBOX_TREE_WALK=seq for the sampled tree walk of before)
CPU smoke test: --preset tiny --head random --tokens 8,16 --reps 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from lucebox_jax import SamplingParams, ops  # noqa: E402
from lucebox_jax.drafters.eagle import (USE_DRAFT_VOCAB, EagleConfig, EagleDrafter, init_head,  # noqa: E402
                                        load_draft_vocab, load_head, shipped_head_dir)
from lucebox_jax.engine import Engine  # noqa: E402
from lucebox_jax.ops import KernelSet  # noqa: E402
from lucebox_jax.sampling import RowParams  # noqa: E402
from lucebox_jax.speculative import SpeculativeDecoder  # noqa: E402
from lucebox_jax.synthetic import PRESETS, random_weights  # noqa: E402

HEAD_OF = {"smollm2-135m": "SmolLM2-135M-Instruct.Q4_1"}


def generate(eng, spec, prompt, max_new, need, temperature=0.0):
    """One prompt, greedy (or sampled at `temperature`, seed 0), `max_new` tokens (no stop) in a cache for `need`
    positions (the same for both lengths: one compile of each loop, and the same cache shapes): -> (seconds, target
    steps of the loop)."""
    rp = RowParams.from_params([SamplingParams(temperature=temperature, seed=0)])
    t0 = time.perf_counter()
    cache = eng.new_cache(1, spec.cache_len(need) if spec else eng.cache_len_for(need))
    hidden = spec.drafter.hidden_layers if spec else None
    last, _, cache, *h = eng.prefill(cache, [prompt], hidden_layers=hidden)
    seen = eng.new_seen([prompt])
    first, seen = eng.first_token(last, rp, [len(prompt)], seen)
    if spec is None:
        bufs, count, _, _ = eng.loop(cache, first, rp, seen, set(), np.full(1, max_new))
        np.asarray(count)
        return time.perf_counter() - t0, max_new - 1
    bufs, count, _ = spec.loop(cache, [prompt], first, rp, seen, set(), np.full(1, max_new), hidden=h[0])
    np.asarray(count)
    return time.perf_counter() - t0, spec.last_stats["target_steps"]


def ms_per_step(eng, spec, prompt, lengths, reps, temperature=0.0):
    """Median over reps of (t(long) - t(short)) / (steps(long) - steps(short)), in ms; the first runs compile."""
    need = len(prompt) + max(lengths)
    for n in lengths:
        generate(eng, spec, prompt, n, need, temperature)
    out, acc = [], []
    for _ in range(reps):
        (t1, s1), (t2, s2) = (generate(eng, spec, prompt, n, need, temperature) for n in lengths)
        out.append(1e3 * (t2 - t1) / max(s2 - s1, 1))
        if spec is not None:
            acc.append(spec.last_stats["mean_accepted"])
    return statistics.median(out), (statistics.median(acc) if acc else None), out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="smollm2-135m")
    ap.add_argument("--head", default=None, help="a head folder, or 'random' (default: the preset's shipped head)")
    ap.add_argument("--configs", default="4,15@5", help="K (a chain) or N@K (a tree of N nodes at depth K)")
    ap.add_argument("--tokens", default="64,192", help="the two generation lengths")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--accepted", default="", help="measured accepted drafts a step per config, e.g. 4=2.15")
    ap.add_argument("--kernels", default=None)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampled steps (plain and speculative) at this temperature; 0: greedy")
    ap.add_argument("--name", default="bench_spec_steps", help="$OUT/NAME.json")
    args = ap.parse_args()

    cfg = PRESETS[args.preset].replace(dtype="bfloat16" if jax.default_backend() == "gpu" else "float32")
    ks = KernelSet.resolve(args.kernels)
    eng = Engine(cfg, ops.prepare_weights(random_weights(cfg, jax.random.key(0), group_size=32, asymmetric=True), ks),
                 ks)
    vocab = None
    if args.head == "random":
        hc = EagleConfig.for_target(cfg)
        head = init_head(hc, jax.random.key(1))
    else:
        folder = args.head or shipped_head_dir(HEAD_OF.get(args.preset, args.preset))
        hc, head, _ = load_head(folder)
        vocab = load_draft_vocab(folder, hc.vocab_size) if USE_DRAFT_VOCAB else None
    drafter = EagleDrafter(hc, head, eng, draft_vocab=vocab)
    prompt = [int(t) for t in np.random.default_rng(0).integers(10, cfg.vocab_size - 10, args.prompt_len)]
    lengths = [int(x) for x in args.tokens.split(",")]
    accepted = dict(kv.split("=") for kv in args.accepted.split(",") if kv)
    env = {k: os.environ[k] for k in ("LUCEBOX_ATTN_DECODE", "LUCEBOX_TREE_ROWS", "LUCEBOX_DRAFT_VOCAB",
                                      "LUCEBOX_TREE_WALK", "LUCEBOX_SPLIT_O", "LUCEBOX_GATED_DOWN")
           if k in os.environ}
    print(f"device {jax.devices()[0]}; {args.preset} random int4 weights; kernels {ks.describe()}; env {env}; "
          f"draft vocabulary {drafter.draft_vocab_size or 'whole'}; temperature {args.temperature}", flush=True)
    plain, _, plain_runs = ms_per_step(eng, None, prompt, lengths, args.reps, args.temperature)
    print(f"plain: {plain:.4f} ms a step (runs {[round(x, 4) for x in plain_runs]})", flush=True)
    rows = [{"config": "plain", "ms_per_step": plain, "runs": plain_runs}]
    for c in args.configs.split(","):
        nodes, k = (int(c.split("@")[0]), int(c.split("@")[1])) if "@" in c else (None, int(c))
        spec = SpeculativeDecoder(eng, drafter, k, tree=nodes)
        ms, acc, runs = ms_per_step(eng, spec, prompt, lengths, args.reps, args.temperature)
        row = {"config": c, "ms_per_step": ms, "plain_steps": ms / plain, "random_accepted": acc, "runs": runs}
        line = (f"{'tree ' + c if nodes else 'chain K=' + c}: {ms:.4f} ms a speculative step = {ms / plain:.3f} plain "
                f"steps (random weights accepted {acc:.2f} a step)")
        if c in accepted:
            row["est_speedup"] = (1 + float(accepted[c])) / row["plain_steps"]
            line += f"; with {accepted[c]} accepted (measured on the real model): x{row['est_speedup']:.2f} (estimate)"
        print(line, flush=True)
        rows.append(row)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"{args.name}.json"), "w") as f:
            json.dump({"device": str(jax.devices()[0]), "env": env, "preset": args.preset,
                       "temperature": args.temperature, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
