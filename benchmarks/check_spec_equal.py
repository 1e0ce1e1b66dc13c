#!/usr/bin/env python3
"""Greedy speculative output against plain greedy output on the embedded model's real weights, token for token, at
batch 1 and in one static batch, for a chain and a tree (issue 13's lossless target; bfloat16 flips greedy tokens
unless LUCEBOX_ROW_INVARIANT=1, README "Speculative decoding").

    LUCEBOX_ROW_INVARIANT=1 python benchmarks/check_spec_equal.py --dtype bfloat16 [--model X.gguf] [--tree 32]

Chat prompts from the benchmark set (`bench_spec_batch.chat_requests`), `--max-tokens` new tokens each. Prints one
line per (drafter, batch) with the prompts whose tokens equal plain greedy's, and the first differing position of
each other one; writes $OUT/check_spec_equal.json. Runs on the CPU (minutes) or a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="GGUF or checkpoint (default: the embedded model)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tree", type=int, default=32, help="tree nodes for the eagle tree run (0: none)")
    ap.add_argument("--drafters", default="eagle,ngram")
    args = ap.parse_args(argv)

    import jax

    from bench_spec_batch import chat_requests
    from lucebox_jax import LLM, SamplingParams, quant

    out_dir = os.environ.get("OUT") or "/tmp"
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, seed=0)
    chats = [[{"role": "user", "content": p}] for p in chat_requests(args.prompts)]
    plain = LLM(args.model, dtype=args.dtype, max_batch=args.prompts)
    runs = [(d, None) for d in args.drafters.split(",")]
    if args.tree and "eagle" in args.drafters.split(","):
        runs.append(("eagle", args.tree))
    res = {"device": str(jax.devices()[0]), "dtype": plain.engine.cfg.dtype, "row_invariant": quant.ROW_INVARIANT,
           "args": vars(args), "rows": []}
    ref = {}
    for batch in (1, args.prompts):
        t0 = time.perf_counter()
        outs = [o for s in range(0, len(chats), batch) for o in plain.chat(chats[s:s + batch], sp)]
        ref[batch] = [list(o.outputs[0].token_ids) for o in outs]
        print(f"plain, batch {batch}: {time.perf_counter() - t0:.1f} s", flush=True)
    same_width = ref[1] == ref[args.prompts]
    print(f"plain batch 1 == plain batch {args.prompts}: {same_width}", flush=True)
    res["plain_batch1_equals_batch"] = same_width
    for drafter, tree in runs:
        llm = LLM(args.model, dtype=args.dtype, max_batch=args.prompts, draft=drafter, num_draft=args.k, tree=tree)
        for batch in (1, args.prompts):
            t0 = time.perf_counter()
            outs = [o for s in range(0, len(chats), batch) for o in llm.chat(chats[s:s + batch], sp)]
            got = [list(o.outputs[0].token_ids) for o in outs]
            diffs = [first_difference(g, r) for g, r in zip(got, ref[batch])]
            equal = sum(d is None for d in diffs)
            name = f"{drafter}" + (f" tree {tree}" if tree else f" K={args.k}")
            print(f"{name}, batch {batch}: {equal} of {len(got)} equal to plain greedy; first differences {diffs}; "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
            res["rows"].append({"drafter": name, "batch": batch, "equal": equal, "of": len(got),
                                "first_differences": diffs})
        del llm
    with open(os.path.join(out_dir, "check_spec_equal.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
