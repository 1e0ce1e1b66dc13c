"""What one admission of the continuous-batching scheduler costs (issue 15): prefill of a group of new requests,
their first tokens, and the insert into the running batch's slots.

The H200 measured admissions at 28% of the offline job's wall time and 33% of the server's (2026-12-04, ninth
session), about 21 ms per group of 8 prompts of 64-256 tokens on a 135M model. This times `Scheduler._admit` per
group size and prompt length, split into its phases (each phase synchronised, so the split is wall time per phase),
and with `--profile` lists the GPU kernels of one admission (GPU busy time against wall time: launch- or host-bound).
`dispatch_ms` is the host's time in `_admit` alone: it waits for nothing on the device (tenth session).
Random weights at the named shapes (the cost does not depend on weight values).

    PYTHONUNBUFFERED=1 python benchmarks/bench_admit.py                     # GPU: smollm2-135m, 32 slots
    python benchmarks/bench_admit.py --small                                # CPU smoke run
Writes $OUT/bench_admit.json (without $OUT: a new temporary folder).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from lucebox_jax.engine import Engine  # noqa: E402
from lucebox_jax.ops import KernelSet  # noqa: E402
from lucebox_jax.sampling import SamplingParams  # noqa: E402
from lucebox_jax.scheduler import Scheduler, SlotRequest  # noqa: E402
from lucebox_jax.synthetic import PRESETS, random_weights  # noqa: E402

from bench_decode import print_profile, profile_summary  # noqa: E402
from gpu_trace import trace_gpu_events  # noqa: E402


class PhaseTimer:
    """Wraps a scheduler's device calls so each one is synchronised and its wall time added to its phase."""

    def __init__(self, sched: Scheduler):
        self.t: dict[str, float] = {}
        eng = sched.engine
        inner = eng._timed_first

        def timed(key, fn, *args, **kw):
            t0 = time.perf_counter()
            out = jax.block_until_ready(inner(key, fn, *args, **kw))
            name = key[0] if isinstance(key, tuple) else str(key)
            self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - t0
            return out

        eng._timed_first = timed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--groups", default="1,2,4,8")
    ap.add_argument("--prompt-lens", default="64,128,256")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kernels", default=None, help="kernel spec, e.g. 'qmatmul=xla' (default: the backend's)")
    ap.add_argument("--profile", action="store_true", help="GPU kernels of one admission per case")
    ap.add_argument("--small", action="store_true", help="tiny CPU smoke run")
    a = ap.parse_args(argv)
    if a.small:
        a.model, a.slots, a.max_len, a.groups, a.prompt_lens, a.reps = "tiny", 4, 128, "1,2", "16,40", 2
    dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    cfg = PRESETS[a.model].replace(dtype=dtype)
    small = a.model in ("tiny", "smollm2-135m", "gemma3_270m")
    weights = random_weights(cfg, jax.random.key(0), group_size=32 if small else 128, asymmetric=small)
    eng = Engine(cfg, weights, KernelSet.resolve(a.kernels))
    sched = Scheduler(eng, slots=a.slots, max_len=a.max_len, max_prefill_batch=8)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, seed=0, max_tokens=4, ignore_eos=True)
    rows = []
    out_dir = os.environ.get("OUT") or tempfile.mkdtemp(prefix="bench_admit_")
    print(f"{jax.devices()[0]}; {a.model}, {a.slots} slots, cache {a.max_len}; kernels {eng.kernels.describe()}")
    print(f"{'group':>5} {'prompt':>6} {'ms/admit':>9} {'dispatch':>8} {'ms/request':>10}  phases (ms)")
    for p in [int(x) for x in a.groups.split(",")]:
        for n in [int(x) for x in a.prompt_lens.split(",")]:
            def group():
                return [SlotRequest(i, rng.integers(0, cfg.vocab_size, n).tolist(), params, frozenset(), 4)
                        for i in range(p)]
            slots = list(range(p))
            sched._admit(group(), slots)  # compiles
            jax.block_until_ready(sched.state)
            ts, ds = [], []
            for _ in range(a.reps):
                g = group()
                t0 = time.perf_counter()
                sched._admit(g, slots)
                ds.append(time.perf_counter() - t0)  # host time: the admission only dispatches
                jax.block_until_ready(sched.state)
                ts.append(time.perf_counter() - t0)
            ms, dispatch_ms = float(np.median(ts)) * 1e3, float(np.median(ds)) * 1e3
            timer = PhaseTimer(sched)  # one more admission, every device call synchronised
            t0 = time.perf_counter()
            sched._admit(group(), slots)
            sync_ms = (time.perf_counter() - t0) * 1e3
            eng._timed_first = Engine._timed_first.__get__(eng)
            phases = {k: round(v * 1e3, 2) for k, v in timer.t.items()}
            r = dict(group=p, prompt=n, ms=round(ms, 2), dispatch_ms=round(dispatch_ms, 2),
                     ms_per_request=round(ms / p, 2), synced_ms=round(sync_ms, 2),
                     phases_ms=phases)
            if a.profile:
                g = group()
                evs = trace_gpu_events(lambda: (sched._admit(g, slots), jax.block_until_ready(sched.state)))
                if evs:
                    r["profile"] = profile_summary(evs, 1, ms, top=12)
            rows.append(r)
            print(f"{p:5} {n:6} {ms:9.2f} {dispatch_ms:8.2f} {ms / p:10.2f}  {phases} (synchronised: {sync_ms:.2f})",
                  flush=True)
            if "profile" in r:
                print_profile(r["profile"])
    res = {"device": str(jax.devices()[0]), "model": a.model, "slots": a.slots, "max_len": a.max_len,
           "kernels": eng.kernels.describe(), "date": time.strftime("%Y-%m-%d"), "rows": rows}
    path = os.path.join(out_dir, "bench_admit.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
