"""Tensor-parallel benchmark (issue 16): decode speed over 1, 2, 4 and 8 GPUs of one host (parallel.py).

Cases (random int4 weights at real shapes, group 128; speed does not depend on weight values):
- `70b`: Llama-3-70B shapes, batch 1: decode tok/s on each GPU count (>= 2 by default), with the share of the
  aggregate bandwidth bound (the bytes one step reads on all GPUs together over N x one GPU's copy bandwidth).
- `8b`: Llama-3-8B shapes at batch 1 and 32: tok/s, the same share and the speed-up over one GPU.
- `job`: a batch job's throughput on 8B shapes through the continuous-batching scheduler with 128 slots
  (`--job-requests` prompts of 64-192 tokens, `--job-tokens` new tokens each, EOS ignored).

    python3 benchmarks/bench_tp.py                                  # all cases on every GPU count the host has
    python3 benchmarks/bench_tp.py --cases 70b --gpus 2,4,8         # one case (compiles of 80 layers take a while)
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/bench_tp.py --tiny --gpus 1,2
                                                                    # CPU smoke run: tiny shapes, simulated devices
Writes $OUT/bench_tp.json and bench_tp.md (without $OUT: a new temporary folder, named in the output).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from lucebox_jax.config import ModelConfig  # noqa: E402
from lucebox_jax.engine import Engine, generate_loop, sample_first  # noqa: E402
from lucebox_jax.ops import KernelSet  # noqa: E402
from lucebox_jax.sampling import RowParams, SamplingParams  # noqa: E402
from lucebox_jax.scheduler import SlotRequest, generate_ids  # noqa: E402
from lucebox_jax.synthetic import PRESETS, random_weights  # noqa: E402

from bench_decode import copy_bandwidth  # noqa: E402  (one GPU's copy bandwidth, as bench_decode measures it)

LLAMA3_70B = ModelConfig(arch="llama", vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                         head_dim=128, ffn_dim=28672, rope_theta=500000.0, max_context=8192, tied_embeddings=False)
TINY = PRESETS["tiny"]


def step_bytes(eng: Engine, cache) -> tuple[int, int]:
    """(bytes all devices read per decode step, most any one device reads): every weight but the embedding table
    (a row lookup) and the KV cache, per device from its addressable shards."""
    per_dev: dict = {}
    leaves = jax.tree.leaves((eng.weights.layers, eng.weights.head, eng.weights.final_norm, cache.k, cache.v))
    for a in leaves:
        for s in a.addressable_shards:
            per_dev[s.device] = per_dev.get(s.device, 0) + s.data.nbytes
    return sum(per_dev.values()), max(per_dev.values())


def decode_row(name, cfg, weights, kernels, n: int, batch: int, ctx: int, n_tokens: int, reps: int,
               bw: float) -> dict:
    """tok/s of the on-device decode loop at context `ctx` on n devices, and its share of the bandwidth bound."""
    eng = Engine(cfg, weights, kernels, tensor_parallel=n)
    s = ((ctx + n_tokens + 16 + 255) // 256) * 256
    rp = RowParams.from_params([SamplingParams(temperature=0)] * batch)
    first, _ = sample_first(jnp.zeros((batch, cfg.vocab_size), jnp.float32), rp, jnp.full((batch,), ctx),
                            jnp.zeros((batch, cfg.vocab_size), bool))
    stop = jnp.full((batch, 1), -2, jnp.int32)
    row_max = jnp.full((batch,), n_tokens, jnp.int32)

    def once():
        cache = eng.new_cache(batch, s).replace(lengths=jnp.full((batch,), ctx, jnp.int32))
        seen = jnp.zeros((batch, cfg.vocab_size), bool)
        jax.block_until_ready((cache, seen))
        t = time.perf_counter()
        bufs, count, _, _ = generate_loop(cfg, eng.kernels, eng.weights, cache, first, rp, seen, stop, row_max,
                                          max_new=n_tokens)
        jax.block_until_ready(bufs.tokens)
        assert int(jnp.min(count)) == n_tokens
        return time.perf_counter() - t

    t0 = time.perf_counter()
    once()
    compile_s = time.perf_counter() - t0
    dt = float(np.median([once() for _ in range(reps)])) / (n_tokens - 1)
    total, most = step_bytes(eng, eng.new_cache(batch, s))
    bound = total / (n * bw)  # seconds per step if every device streamed its share at full bandwidth
    return dict(case="decode", model=name, gpus=n, batch=batch, ctx=ctx, ms_per_step=dt * 1e3, tok_s=batch / dt,
                step_bytes_all=total, step_bytes_max_device=most, aggregate_bound_tok_s=batch / bound,
                share_of_bound=bound / dt, kernels=eng.kernels.describe(), compile_s=compile_s)


def job_row(cfg, weights, kernels, n: int, slots: int, n_req: int, new_tokens: int,
            prompt_len: tuple[int, int]) -> dict:
    """Throughput of a batch job through the scheduler: generated tokens per second of wall time (warm)."""
    eng = Engine(cfg, weights, kernels, tensor_parallel=n)
    rng = np.random.default_rng(0)

    def reqs(k):
        return [SlotRequest(i, [int(t) for t in rng.integers(0, cfg.vocab_size, int(rng.integers(*prompt_len)))],
                            SamplingParams(temperature=0, seed=i, ignore_eos=True), frozenset(), new_tokens)
                for i in range(k)]

    max_len = prompt_len[1] + new_tokens + 16
    kw = dict(slots=slots, max_len=max_len, steps_per_call=16, max_prefill_batch=min(16, slots))
    t0 = time.perf_counter()
    generate_ids(eng, reqs(min(n_req, slots + 16)), **kw)  # warm-up: compiles every shape the job uses
    compile_s = time.perf_counter() - t0
    t = time.perf_counter()
    done = generate_ids(eng, reqs(n_req), **kw)
    wall = time.perf_counter() - t
    toks = sum(len(f.token_ids) for f in done.values())
    return dict(case="batch_job", model="llama3-8b" if cfg.dim == 4096 else "tiny-as-8b", gpus=n, slots=slots,
                requests=n_req, completion_tokens=toks, wall_s=wall, tok_s=toks / wall, warmup_s=compile_s)


def table(rows: list[dict]) -> str:
    out = ["| case | model | GPUs | batch/slots | tok/s | speed-up vs 1 GPU | share of aggregate bw bound |",
           "|---|---|---:|---:|---:|---:|---:|"]
    base = {(r["case"], r["model"], r.get("batch", r.get("slots"))): r["tok_s"] for r in rows
            if r.get("gpus") == 1 and "tok_s" in r}
    for r in rows:
        if "error" in r:
            out.append(f"| {r['case']} | {r['model']} | {r['gpus']} | | ERROR {r['error'][:80]} | | |")
            continue
        b = r.get("batch", r.get("slots"))
        ref = base.get((r["case"], r["model"], b))
        sp = f"{r['tok_s'] / ref:.2f}x" if ref else ""
        share = f"{100 * r['share_of_bound']:.0f}%" if "share_of_bound" in r else ""
        out.append(f"| {r['case']} | {r['model']} | {r['gpus']} | {b} | {r['tok_s']:.1f} | {sp} | {share} |")
    return "\n".join(out)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="70b,8b,job", help="comma list of 70b, 8b, job")
    ap.add_argument("--gpus", default=None, help="GPU counts (default: 1, 2, 4, 8 up to the devices present)")
    ap.add_argument("--ctx", type=int, default=1024, help="decode context (positions already in the cache)")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps timed per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--job-slots", type=int, default=128)
    ap.add_argument("--job-requests", type=int, default=384)
    ap.add_argument("--job-tokens", type=int, default=128)
    ap.add_argument("--kernels", default=None, help="op=name,... for every row (default: the backend's defaults; a "
                    "kernel that repacks weights at load, mgpu/best, takes its fallback when split, so compare with "
                    "qmatmul=pallas,qmatmul8=pallas)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shapes for every case")
    ap.add_argument("--out", default=None, help="results folder (default $OUT, else a new temporary folder)")
    a = ap.parse_args(argv)
    kernels = KernelSet.resolve(a.kernels)
    gpu = jax.default_backend() == "gpu"
    dtype = "bfloat16" if gpu else "float32"
    n_dev = jax.device_count()
    gpus = [int(x) for x in a.gpus.split(",")] if a.gpus else [n for n in (1, 2, 4, 8) if n <= n_dev]
    cases = a.cases.split(",")
    if a.tiny:
        a.ctx, a.tokens, a.reps, a.job_slots, a.job_requests, a.job_tokens = 32, 8, 1, 4, 6, 6
    out_dir = a.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="bench_tp_")
    os.makedirs(out_dir, exist_ok=True)
    bw = copy_bandwidth(64 << 20 if a.tiny else 4 << 30)
    meta = {"device": str(jax.devices()[0]), "devices": n_dev, "jax": jax.__version__, "date": time.strftime("%F"),
            "copy_bandwidth_GBs_one_device": bw / 1e9, "args": vars(a)}
    print(f"{n_dev} x {meta['device']}; copy bandwidth {bw / 1e9:.0f} GB/s per device", flush=True)
    rows: list[dict] = []

    def record(n, fn, *args):
        try:
            r = fn(*args)
        except Exception as e:  # one failing configuration must not lose the others
            r = dict(case=fn.__name__, model="?", gpus=n, error=f"{type(e).__name__}: {e}"[:300])
        rows.append(r)
        print(json.dumps(r), flush=True)
        with open(os.path.join(out_dir, "bench_tp.json"), "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)

    if "70b" in cases:
        cfg = (TINY if a.tiny else LLAMA3_70B).replace(dtype=dtype)
        w = random_weights(cfg, jax.random.key(0), group_size=32 if a.tiny else 128)
        for n in [g for g in gpus if g >= 2 or a.tiny]:
            record(n, decode_row, "tiny-as-70b" if a.tiny else "llama3-70b", cfg, w, kernels, n, 1, a.ctx,
                   a.tokens, a.reps, bw)
        del w
    if "8b" in cases or "job" in cases:
        cfg = (TINY if a.tiny else PRESETS["llama3-8b"]).replace(dtype=dtype)
        w = random_weights(cfg, jax.random.key(0), group_size=32 if a.tiny else 128)
        for n in gpus if "8b" in cases else ():
            for b in (1, 32):
                record(n, decode_row, "tiny-as-8b" if a.tiny else "llama3-8b", cfg, w, kernels, n, b, a.ctx,
                       a.tokens, a.reps, bw)
        for n in [g for g in gpus if g <= 4] if "job" in cases else ():
            record(n, job_row, cfg, w, kernels, n, a.job_slots, a.job_requests, a.job_tokens,
                   (8, 24) if a.tiny else (64, 192))
    md = table(rows)
    with open(os.path.join(out_dir, "bench_tp.md"), "w") as f:
        f.write(f"{n_dev} x {meta['device']}, jax {jax.__version__}, copy bandwidth {bw / 1e9:.0f} GB/s per device\n\n"
                + md + "\n")
    print("\n" + md + f"\n\nresults: {out_dir}/bench_tp.json, bench_tp.md")
    return rows


if __name__ == "__main__":
    main()
