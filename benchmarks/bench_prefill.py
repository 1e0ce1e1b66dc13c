"""Prompt prefill time (random weights at a preset's shapes): the engine's chunked prefill (`Engine.prefill`, chunks
of 512 tokens) of one or more prompts of a few lengths, median wall time after a compile run, tokens/s.

Written for Gemma 3's sliding-window layers in the Pallas prefill kernel (A/B: one process each with
LUCEBOX_ATTN_SLIDING=0 and =1; the knob is read at import):
    LUCEBOX_ATTN_SLIDING=0 python3 benchmarks/bench_prefill.py --model gemma3_270m --lengths 512,2048,4096
    python3 benchmarks/bench_prefill.py --small          # CPU smoke run
Prints one JSON line per (batch, length): ms, prompt tokens/s, and a hash of the last logits rounded to 2 decimals
(the same kernels give the same hash; two attention paths round differently, so an A/B's hashes need not agree)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from lucebox_jax.engine import Engine  # noqa: E402
from lucebox_jax.ops import KernelSet  # noqa: E402
from lucebox_jax.synthetic import PRESETS, random_weights  # noqa: E402


def time_prefill(eng: Engine, batch: int, length: int, reps: int) -> dict:
    rng = np.random.default_rng(length)
    prompts = [rng.integers(1, eng.cfg.vocab_size, length).tolist() for _ in range(batch)]
    max_len = ((length + 16 + 255) // 256) * 256
    ts = []
    for i in range(reps + 1):  # the first run compiles
        cache = eng.new_cache(batch, max_len)
        jax.block_until_ready(cache)
        t = time.perf_counter()
        last, _, cache = eng.prefill(cache, prompts)
        jax.block_until_ready(last)
        if i:
            ts.append(time.perf_counter() - t)
    ms = float(np.median(ts)) * 1e3
    digest = hashlib.sha1(np.asarray(last, np.float32).round(2).tobytes()).hexdigest()[:12]
    return dict(batch=batch, length=length, ms=ms, tok_s=batch * length / ms * 1e3, logits_sha=digest)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3_270m")
    ap.add_argument("--kernels", default="", help="kernel spec, e.g. 'attention_prefill=xla' (default: the engine's)")
    ap.add_argument("--lengths", default="512,2048,4096")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--linear-bits", type=int, choices=(4, 8), default=8,
                    help="int8 g32 linear layers (8, as a Q4_K_M file imports) or int4 g32 (4)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="tiny shapes on the CPU")
    a = ap.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    if a.small:
        a.model, a.lengths, a.batches, a.reps = "tiny", "40,600", "1,2", 1
    cfg = PRESETS[a.model].replace(dtype="bfloat16" if gpu else "float32")
    weights = random_weights(cfg, jax.random.key(0), group_size=32, asymmetric=True, linear_bits=a.linear_bits)
    eng = Engine(cfg, weights, KernelSet.resolve(a.kernels or None))
    head = dict(model=a.model, kernels=eng.kernels.describe(), device=str(jax.devices()[0]),
                sliding_env=os.environ.get("LUCEBOX_ATTN_SLIDING", "1"))
    for b in map(int, a.batches.split(",")):
        for n in map(int, a.lengths.split(",")):
            print(json.dumps({**head, **time_prefill(eng, b, n, a.reps)}), flush=True)


if __name__ == "__main__":
    main()
