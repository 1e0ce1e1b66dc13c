#!/usr/bin/env python3
"""Batch-job throughput: output tokens/s of N requests (prompts of 128-512 random tokens, 128 new tokens each, greedy,
EOS ignored) through the continuous-batching scheduler at 1, 8, 32, 64 and 128 slots, on

  smol  the embedded SmolLM2-135M (Q4_1 GGUF),
  8b    a synthetic Llama-3-8B-shaped int4 model (random weights: speed only, never quality),
  hf    the peer: Hugging Face transformers `generate` with a static cache (transformers' automatic torch.compile)
        on a SmolLM2-135M-shaped LlamaForCausalLM with random bf16 weights, static batches of `slots` prompts of the
        mean prompt length (a static batch cannot mix lengths without padding).

Each section runs in its own subprocess with a time cap (a slow compile loses only the rest of its section) and
writes its results as it goes; the parent prints a table and writes bench_batch.json to $OUT (or --out).
Compile time is reported apart: each slot count first runs a short warm-up job, and any compile left inside the
timed job is subtracted (`tok_s`) and also shown (`tok_s_raw` includes it).

GPU (one call, < 8 minutes):   PYTHONUNBUFFERED=1 python benchmarks/bench_batch.py
CPU smoke run:                 python benchmarks/bench_batch.py --small
Options: --sections smol,hf,8b  --slots 1,8,32  --budget 450  --section-budget smol=110,hf=130,8b=200
         --requests-per-slot 2 --min-requests 8 --new-tokens 128 --prompt-min 128 --prompt-max 512
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="smol,hf,8b")
    p.add_argument("--slots", default=None, help="comma list (default 1,8,32,64,128; --small: 1,4)")
    p.add_argument("--small", action="store_true", help="tiny sizes for a CPU smoke run")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run")
    p.add_argument("--section-budget", default="smol=110,hf=130,8b=200",
                   help="seconds per section (--small: smol=240)")
    p.add_argument("--requests-per-slot", type=float, default=2.0)
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--prompt-min", type=int, default=None)
    p.add_argument("--prompt-max", type=int, default=None)
    p.add_argument("--steps-per-call", type=int, default=16)
    p.add_argument("--prefill-batch", type=int, default=8, help="most requests prefilled together")
    p.add_argument("--min-prefill-len", type=int, default=0,
                   help="pad every prefill chunk to at least this bucket (fewer shapes to compile)")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.slots = [int(x) for x in (a.slots or ("1,4" if a.small else "1,8,32,64,128")).split(",")]
    a.new_tokens = a.new_tokens or (16 if a.small else 128)
    a.prompt_min = a.prompt_min or (8 if a.small else 128)
    a.prompt_max = a.prompt_max or (40 if a.small else 512)
    if a.small:  # few shapes to compile on a CPU
        a.steps_per_call = min(a.steps_per_call, 8)
        a.prefill_batch = min(a.prefill_batch, 2)
        a.min_prefill_len = max(a.min_prefill_len, 64)
    return a


class Part:
    """A section's results, rewritten to disk after every change (a killed worker keeps what it measured)."""

    def __init__(self, path):
        self.path = path
        self.d = {}

    def set(self, k, v):
        self.d[k] = v
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.d, f, indent=1)
        os.replace(tmp, self.path)


# ------------------------------------------------------------------------------------------ our engine
def _requests(a, n, vocab, seed=0, new_tokens=None):
    import numpy as np

    from lucebox_jax.sampling import SamplingParams
    from lucebox_jax.scheduler import SlotRequest

    rng = np.random.default_rng(seed)
    nt = new_tokens or a.new_tokens
    out = []
    for i in range(n):
        ln = int(rng.integers(a.prompt_min, a.prompt_max + 1))
        ids = [int(x) for x in rng.integers(3, min(vocab, 30000), size=ln)]  # byte-ish random ids, no specials
        out.append(SlotRequest(i, ids, SamplingParams(temperature=0, max_tokens=nt, seed=i, ignore_eos=True),
                               frozenset(), nt))
    return out


def _run_sched(a, eng, slots, reqs, max_len):
    from lucebox_jax.scheduler import Scheduler

    sched = Scheduler(eng, slots=slots, max_len=max_len, steps_per_call=a.steps_per_call,
                      max_prefill_batch=min(a.prefill_batch, slots), min_prefill_len=a.min_prefill_len)
    c0 = eng.compile_seconds
    t0 = time.perf_counter()
    n_tok = 0
    for batch in sched.run(reqs):
        n_tok += sum(len(f.token_ids) for f in batch)
    wall = time.perf_counter() - t0
    return dict(wall_s=wall, compile_s=eng.compile_seconds - c0, completion_tokens=n_tok,
                prompt_tokens=sum(len(r.ids) for r in reqs), requests=len(reqs),
                decode_calls=sched.stats["decode_calls"], prefill_calls=sched.stats["prefill_calls"])


def worker_engine(a, which, part: Part, deadline):
    import jax

    from lucebox_jax.engine import Engine, enable_compilation_cache

    enable_compilation_cache()
    part.set("device", str(jax.devices()[0]))
    part.set("jax", jax.__version__)
    t0 = time.perf_counter()
    from lucebox_jax.errors import ModelNotFoundError
    from lucebox_jax.ops import KernelSet
    from lucebox_jax.synthetic import PRESETS, random_weights

    eng = None
    if which == "smol":
        from lucebox_jax import LLM

        try:
            eng = LLM().engine
            part.set("weights", "embedded GGUF")
        except ModelNotFoundError:  # the GPU machine has no GGUF: same shapes, random weights (speed is the same)
            part.set("weights", "random at SmolLM2-135M shapes (GGUF not on this machine)")
    if eng is None:
        preset = "tiny" if a.small else ("smollm2-135m" if which == "smol" else "llama3-8b")
        cfg = PRESETS[preset].replace(dtype="float32" if jax.default_backend() == "cpu" else "bfloat16")
        g32 = a.small or which == "smol"
        w = random_weights(cfg, group_size=32 if g32 else 128, asymmetric=which == "smol")
        jax.block_until_ready(w)
        eng = Engine(cfg, w, KernelSet.resolve())
    part.set("load_s", round(time.perf_counter() - t0, 2))
    part.set("kernels", eng.kernels.describe())
    max_len = -(-(a.prompt_max + a.new_tokens) // 64) * 64
    part.set("shape", dict(prompt=[a.prompt_min, a.prompt_max], new_tokens=a.new_tokens, cache=max_len,
                           steps_per_call=a.steps_per_call, prefill_batch=a.prefill_batch))
    runs = {}
    for slots in a.slots:
        if time.time() > deadline - 10:
            runs[str(slots)] = {"skipped": "time budget"}
            part.set("runs", runs)
            continue
        try:
            n = max(a.min_requests, int(round(slots * a.requests_per_slot)))
            # warm-up: the shapes of this slot count (short completions), then the timed job
            w = _run_sched(a, eng, slots, _requests(a, min(n, slots + a.prefill_batch), eng.cfg.vocab_size, seed=99,
                                                    new_tokens=2 * a.steps_per_call), max_len)
            r = _run_sched(a, eng, slots, _requests(a, n, eng.cfg.vocab_size), max_len)
            r["warmup_s"] = round(w["wall_s"], 2)
            r["warmup_compile_s"] = round(w["compile_s"], 2)
            r["tok_s_raw"] = r["completion_tokens"] / r["wall_s"]
            r["tok_s"] = r["completion_tokens"] / max(r["wall_s"] - r["compile_s"], 1e-9)
            runs[str(slots)] = r
            log(f"  {which} slots {slots:4d}: {n} req, {r['completion_tokens']} tok in {r['wall_s']:.2f} s "
                f"(compile {r['compile_s']:.2f} s) -> {r['tok_s']:.1f} tok/s "
                f"[warm-up {w['wall_s']:.1f} s]")
        except Exception as e:  # noqa: BLE001 - e.g. out of memory at a large slot count
            runs[str(slots)] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            log(f"  {which} slots {slots}: ERROR {type(e).__name__}: {str(e)[:300]}")
        part.set("runs", runs)


# ------------------------------------------------------------------------------------------ HF peer
def worker_hf(a, part: Part, deadline):
    try:
        import torch
        import transformers
    except ImportError as e:
        part.set("skipped", f"transformers peer not available: {e}")
        log(f"  hf: skipped ({e})")
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    part.set("transformers", transformers.__version__)
    part.set("torch", torch.__version__)
    smol = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    if a.small:
        smol = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    cfg = LlamaConfig(**smol, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32).eval()
    gc = model.generation_config
    gc.eos_token_id = gc.bos_token_id = None
    gc.pad_token_id = 0
    gc.do_sample = False
    plen = (a.prompt_min + a.prompt_max) // 2
    n_new = a.new_tokens
    part.set("shape", dict(prompt=plen, new_tokens=n_new, note="static batches of equal-length prompts"))

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    runs = {}
    for b in a.slots:
        if time.time() > deadline - 15:
            runs[str(b)] = {"skipped": "time budget"}
            part.set("runs", runs)
            continue
        try:
            ids = torch.randint(3, smol["vocab_size"], (b, plen), device=dev)
            kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                      cache_implementation="static", max_new_tokens=n_new, min_new_tokens=n_new)

            def gen():
                sync()
                t = time.perf_counter()
                with torch.no_grad():
                    out = model.generate(ids, **kw)
                sync()
                return time.perf_counter() - t, out

            warm = [gen()[0] for _ in range(2)]  # compiles
            times = []
            for _ in range(2):
                if times and time.time() > deadline - 10:
                    break
                t, out = gen()
                times.append(t)
            assert out.shape[1] == plen + n_new, out.shape
            t = min(times)
            runs[str(b)] = dict(warmup_s=[round(x, 2) for x in warm], wall_s=t, completion_tokens=b * n_new,
                                tok_s=b * n_new / t)
            log(f"  hf slots {b:4d}: {b * n_new} tok in {t:.2f} s -> {b * n_new / t:.1f} tok/s "
                f"[warm-up {sum(warm):.1f} s]")
        except Exception as e:  # noqa: BLE001
            runs[str(b)] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            log(f"  hf slots {b}: ERROR {type(e).__name__}: {str(e)[:300]}")
        part.set("runs", runs)


# ------------------------------------------------------------------------------------------ orchestrator
def table(res, slots):
    names = [s for s in res if isinstance(res[s], dict)]
    lines = ["| slots | " + " | ".join(f"{n} tok/s" for n in names) + " |",
             "| ---: | " + " | ".join("---:" for _ in names) + " |"]
    for s in slots:
        row = []
        for n in names:
            r = res[n].get("runs", {}).get(str(s), {})
            if not r and res[n].get("skipped"):
                row.append(str(res[n]["skipped"])[:40])
            elif "tok_s" in r:
                extra = f" ({r['compile_s']:.1f} s compile left)" if r.get("compile_s", 0) > 0.5 else ""
                row.append(f"{r['tok_s']:,.0f}{extra}")
            else:
                row.append(r.get("error", r.get("skipped", "-"))[:40])
        lines.append(f"| {s} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv=None):
    a = parse_args(argv)
    if a.worker:
        part = Part(a.part)
        deadline = float(os.environ["BENCH_DEADLINE"])
        if a.worker == "hf":
            worker_hf(a, part, deadline)
        else:
            worker_engine(a, a.worker, part, deadline)
        return 0
    out_dir = a.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="bench_batch_")
    os.makedirs(out_dir, exist_ok=True)
    caps = dict(kv.split("=") for kv in a.section_budget.split(","))
    if a.small and "smol=" not in " ".join(sys.argv):
        caps["smol"] = 240
    t_end = time.time() + a.budget
    res = {"args": {k: v for k, v in vars(a).items() if k not in ("worker", "part")}}
    path = os.path.join(out_dir, "bench_batch.json")
    for sec in [s.strip() for s in a.sections.split(",") if s.strip()]:
        left = t_end - time.time()
        cap = min(float(caps.get(sec, left)), left)
        if cap < 20:
            res[sec] = {"skipped": "time budget"}
            continue
        log(f"== {sec} (cap {cap:.0f} s)")
        part_path = os.path.join(out_dir, f"part_{sec}.json")
        env = dict(os.environ, BENCH_DEADLINE=str(time.time() + cap - 5), PYTHONUNBUFFERED="1")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", sec, "--part", part_path, *(argv or sys.argv[1:])]
        t0 = time.time()
        try:
            p = subprocess.run(cmd, env=env, timeout=cap, cwd=ROOT)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        try:
            with open(part_path) as f:
                res[sec] = json.load(f)
        except (OSError, json.JSONDecodeError):
            res[sec] = {}
        res[sec]["worker_rc"] = rc
        res[sec]["section_s"] = round(time.time() - t0, 1)
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    print(table({k: v for k, v in res.items() if k != "args"}, a.slots))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
