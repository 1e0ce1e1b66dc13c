#!/usr/bin/env python3
"""Serving benchmark: N concurrent streaming clients against the OpenAI-compatible server (lucebox_jax/serve/),
against the same requests as an offline batch job (the Scheduler directly, no HTTP).

For each client count N (default 1, 8, 32, 128) a server process is started with N decode slots (`--batch-size N`,
so both sides decode at the same width), warmed up, then N clients each send `--requests-per-client` streaming
/v1/completions requests one after another (token-id prompts of random length in [prompt-min, prompt-max], greedy,
`ignore_eos`, exactly `--new-tokens` tokens each; usage chunk on). Measured per request: time to first token (first
non-empty content chunk; the server sends each request's tokens once per scheduler round), the gaps between content
chunks (ITL per chunk, each chunk holding up to --steps-per-call tokens) and time per output token after the first
(TPOT). Per level: output tok/s over the level's wall time, TTFT / ITL / TPOT p50 and p99, of the median of
--server-reps runs of the workload against one server. Then, in this process, the
same requests run through `Scheduler.run` with the same slots, context and steps per call (compile excluded; the
median of --offline-reps runs, each listed in the JSON); the ratio server / offline is the serving overhead.
Targets (issue 15): ratio >= 0.8 at 32 clients, TTFT p50 < 100 ms at 8. `--engine-process-ab` runs each level's
server twice, in-process and with `--engine-process`, against the one offline baseline; `--lookahead` runs the
scheduler's lookahead on both sides.

GPU, one call (< 4 minutes; the embedded model's GGUF in /tmp):
    PYTHONUNBUFFERED=1 python3 benchmarks/bench_serve.py --model /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
CPU smoke run:   python benchmarks/bench_serve.py --small
`--trace N` keeps the host loop's last N events on both sides (Scheduler, LUCEBOX_LOOP_TRACE) and writes them with
each request's stamps to trace_<clients>[_ep|_offline].json, summarised per level (`trace_summary`): where a decode
call's time and the gaps between calls went.
Writes bench_serve.json and bench_serve.md (and each server's log) to $OUT (or --out). Needs starlette + uvicorn for
the server and httpx for the clients.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

try:
    import httpx
except ImportError:  # some environments ship the fork under another name
    import httpx2 as httpx


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF or checkpoint (default: the embedded model)")
    p.add_argument("--clients", default=None, help="comma list (default 1,8,32,128; --small: 1,4)")
    p.add_argument("--requests-per-client", type=int, default=None,
                   help="default 8: a longer run, where all clients starting at once and the last requests finishing "
                        "alone weigh less (--small: 2)")
    p.add_argument("--min-requests", type=int, default=8, help="at least this many requests per level")
    p.add_argument("--new-tokens", type=int, default=None, help="default 128 (--small: 8)")
    p.add_argument("--prompt-min", type=int, default=None, help="default 64 (--small: 8)")
    p.add_argument("--prompt-max", type=int, default=None, help="default 256 (--small: 24)")
    p.add_argument("--max-context", type=int, default=512)
    p.add_argument("--steps-per-call", type=int, default=None, help="default 8 (the server's default)")
    p.add_argument("--exit-on-finish", action="store_true", help="start the server with --exit-on-finish")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="the server's device loop in a process of its own, or not (default: the server's own "
                        "default, on where jax runs on a GPU)")
    p.add_argument("--lookahead", action="store_true",
                   help="the scheduler's lookahead on both sides: the server's --lookahead and the offline job's")
    p.add_argument("--engine-process-ab", action="store_true",
                   help="each level twice, in-process then --engine-process, against one offline baseline")
    p.add_argument("--clients-per-process", type=int, default=16,
                   help="client processes of this many clients each (0: all in this process)")
    p.add_argument("--budget", type=float, default=225.0, help="seconds for the whole run; levels left out after")
    p.add_argument("--no-offline", action="store_true", help="skip the offline comparison")
    p.add_argument("--server-reps", type=int, default=3, help="runs of the workload per server; the row is the median")
    p.add_argument("--offline-reps", type=int, default=3, help="offline runs per level; the ratio uses their median")
    p.add_argument("--warmup", choices=("full", "basic"), default="full", help="the server's --warmup")
    p.add_argument("--small", action="store_true", help="tiny sizes for a CPU smoke run")
    p.add_argument("--trace", type=int, default=0,
                   help="keep the host loop's last N events on both sides (LUCEBOX_LOOP_TRACE) and write them, with "
                        "each request's send / first chunk / end stamps, to trace_<clients>.json")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    a.clients = [int(x) for x in (a.clients or ("1,4" if a.small else "1,8,32,128")).split(",")]
    a.requests_per_client = a.requests_per_client or (2 if a.small else 8)
    a.new_tokens = a.new_tokens or (8 if a.small else 128)
    a.prompt_min = a.prompt_min or (8 if a.small else 64)
    a.prompt_max = a.prompt_max or (24 if a.small else 256)
    a.steps_per_call = a.steps_per_call or 8
    if a.engine_process is None:  # as `run.py --serve` starts (named to the server either way)
        from lucebox_jax.serve import engine_process_default

        a.engine_process = engine_process_default()
    if a.prompt_max + a.new_tokens > a.max_context:
        p.error(f"--prompt-max + --new-tokens ({a.prompt_max + a.new_tokens}) over --max-context {a.max_context}")
    return a


def pct(xs, q):
    return float(np.percentile(xs, q)) * 1e3 if len(xs) else None


def workload(a, n_clients: int, vocab: int = 49152):
    """Per client, its list of prompts (token ids); fixed by the seed so both sides see the same requests."""
    rng = np.random.default_rng(n_clients)
    per = max(a.requests_per_client, -(-a.min_requests // n_clients))
    return [[[int(t) for t in rng.integers(100, min(vocab, 30000), rng.integers(a.prompt_min, a.prompt_max + 1))]
             for _ in range(per)] for _ in range(n_clients)]


# ---------------------------------------------------------------------------------------------------- server side
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(a, slots: int, out_dir: str, deadline: float, engine_process: bool = False):
    port = free_port()
    cmd = [sys.executable, "-m", "lucebox_jax.serve", "--port", str(port), "--batch-size", str(slots),
           "--max-context", str(a.max_context), "--steps-per-call", str(a.steps_per_call), "--served-model-name",
           "bench", "--max-queue", "4096", "--warmup", a.warmup] + (["--model", a.model] if a.model else []) + (
           ["--exit-on-finish"] if a.exit_on_finish else []) + (["--lookahead"] if a.lookahead else []) + (
           # named both ways: the server's own default is the engine process on a GPU
           ["--engine-process" if engine_process else "--no-engine-process"])
    logf = open(os.path.join(out_dir, f"server_{slots}{'_ep' if engine_process else ''}.log"), "w")
    env = {**os.environ, **({"LUCEBOX_LOOP_TRACE": str(a.trace)} if a.trace else {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT, env=env)
    t0 = time.perf_counter()
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see server_{slots}.log")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, port, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise TimeoutError("server did not come up in the time left")


async def one_request(client, url, ids, new_tokens):
    body = {"model": "bench", "prompt": ids, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, n_tok, text = [], 0, []
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                c = json.loads(line[6:])
                if c.get("usage"):
                    n_tok = c["usage"]["completion_tokens"]
                for ch in c.get("choices", []):
                    if ch.get("text"):
                        stamps.append(time.perf_counter())
                        text.append(ch["text"])
    except httpx.TransportError as e:  # a dropped connection fails this request, not the level: counted, reported
        return {"t0": t0, "stamps": [], "end": time.perf_counter(), "tokens": 0,
                "error": f"{type(e).__name__}: {e} (after {len(stamps)} chunks, {time.perf_counter() - t0:.2f} s)"}
    return {"t0": t0, "stamps": stamps, "end": time.perf_counter(), "tokens": n_tok}


async def run_clients(port, prompts, new_tokens):
    url = f"http://127.0.0.1:{port}/v1/completions"
    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        async def client_loop(mine):
            return [await one_request(client, url, ids, new_tokens) for ids in mine]

        res = await asyncio.gather(*(client_loop(m) for m in prompts))
    return [r for per in res for r in per]


def _client_process(args):
    """One client process's share of the clients, started at `start_at` (perf_counter is the machine's monotonic
    clock, so stamps compare across processes)."""
    port, prompts, new_tokens, start_at = args
    while time.perf_counter() < start_at:
        time.sleep(0.001)
    return asyncio.run(run_clients(port, prompts, new_tokens))


def run_client_processes(port, prompts, new_tokens, per_process: int):
    """The clients spread over processes of `per_process` clients each (one asyncio httpx client streams a few
    hundred chunks a second at most: encode/httpx#3215), so the client side does not bound the server's figure.
    -> (requests, wall seconds from the first request sent to the last response ended)."""
    if per_process <= 0 or len(prompts) <= per_process:
        reqs = asyncio.run(run_clients(port, prompts, new_tokens))
    else:
        import multiprocessing

        groups = [prompts[i:i + per_process] for i in range(0, len(prompts), per_process)]
        with multiprocessing.get_context("spawn").Pool(len(groups)) as pool:
            pool.map(time.sleep, [0.0] * len(groups))  # every worker started and imported before the clock starts
            start_at = time.perf_counter() + 0.5
            res = pool.map(_client_process, [(port, g, new_tokens, start_at) for g in groups], chunksize=1)
        reqs = [r for per in res for r in per]
    return reqs, max(r["end"] for r in reqs) - min(r["t0"] for r in reqs)


def summarize(reqs, wall):
    failed = [r["error"] for r in reqs if r.get("error")]
    reqs = [r for r in reqs if not r.get("error")]
    ttft = [r["stamps"][0] - r["t0"] for r in reqs if r["stamps"]]
    itl = [b - a for r in reqs for a, b in zip(r["stamps"], r["stamps"][1:])]
    tpot = [(r["end"] - r["stamps"][0]) / (r["tokens"] - 1) for r in reqs if r["stamps"] and r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in reqs)
    chunks = sum(len(r["stamps"]) for r in reqs)
    return {"requests": len(reqs), "completion_tokens": tokens, "wall_s": round(wall, 3),
            "tok_s": round(tokens / wall, 1), "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99), "tpot_p50_ms": pct(tpot, 50),
            "tpot_p99_ms": pct(tpot, 99), "tokens_per_chunk": round(tokens / max(chunks, 1), 2),
            "failed_requests": len(failed), "failures": failed[:5]}


def bench_server_level(a, n, out_dir, deadline, engine_process: bool = False):
    proc, port, startup = start_server(a, n, out_dir, deadline, engine_process)
    t0 = time.perf_counter()
    try:
        prompts = workload(a, n)
        # warm-up (compiles are not what this measures): every prefill group size at the shortest, middle and
        # longest prompt, then the whole workload with 2 new tokens each
        longest = max((ids for per in prompts for ids in per), key=len)
        warm = [[[longest[:length]] for _ in range(size)] for size in sorted({min(p, n) for p in (1, 2, 4, 8)})
                for length in sorted({a.prompt_min, (a.prompt_min + a.prompt_max) // 2, a.prompt_max})] + [prompts]
        warm_failed = [r["error"] for w in warm for r in asyncio.run(run_clients(port, w, 2)) if r.get("error")]
        t_warm = time.perf_counter() - t0
        before = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()
        # the same workload --server-reps times against this server: one run is ~2 s on the GPU and its rate moved
        # 0.70-0.93 of the offline job between calls (2026-12-05); the row is the median run, the loop split over all
        runs = [run_client_processes(port, prompts, a.new_tokens, a.clients_per_process)
                for _ in range(max(1, a.server_reps))]
        since = before.get("latency_ms", {}).get("finished", 0)
        after = httpx.get(f"http://127.0.0.1:{port}/health?latency_since={since}", timeout=5).json()
        rows = sorted((summarize(reqs, wall) for reqs, wall in runs), key=lambda r: r["tok_s"])
        row = rows[len(rows) // 2]
        row["tok_s_runs"] = [r["tok_s"] for r in rows]
        row["failed_requests"] = sum(r["failed_requests"] for r in rows)
        row["failures"] = [f for r in rows for f in r["failures"]][:5]
        row["server_latency_ms"] = after.get("latency_ms")  # the server's split of TTFT: inbox, then to first token
        row["server_loop"] = loop_delta(before.get("loop"), after.get("loop"), sum(w for _, w in runs))
        if a.trace:
            row["_trace"] = {"loop": (after.get("loop") or {}).get("trace", []),
                             "requests": [[(r["t0"], r["stamps"][0] if r["stamps"] else None, r["end"]) for r in reqs]
                                          for reqs, _ in runs]}
        # a compile inside the measured run is a multi-second stall for every stream: count them
        row["compiles_during_run"] = after.get("compiled_shapes", 0) - before.get("compiled_shapes", 0)
        row["compile_s_during_run"] = round(after.get("compile_seconds", 0) - before.get("compile_seconds", 0), 2)
        row["server_startup_s"] = round(startup, 1)
        row["warmup_s"] = round(t_warm, 1)
        row["warmup_failed_requests"], row["warmup_failures"] = len(warm_failed), warm_failed[:5]
        if row["failed_requests"] or warm_failed:
            log(f"clients={n}: {row['failed_requests']} requests failed in the run, {len(warm_failed)} in the "
                f"warm-up: {(row['failures'] or warm_failed)[:2]}")
        return row, prompts
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


def loop_delta(before: dict | None, after: dict | None, wall: float) -> dict | None:
    """The scheduler's loop counters (Scheduler.loop_stats) over one run: the share of the wall clock spent in decode
    calls and in admissions, and the slots' occupancy at the start of its decode calls."""
    if not after:
        return None
    before = before or {}
    d = {k: after.get(k, 0) - before.get(k, 0)
         for k in ("decode_calls", "decode_s", "wait_s", "admit_s", "busy_slot_calls", "prefill_calls")}
    return {"decode_calls": d["decode_calls"], "prefill_calls": d["prefill_calls"],
            "decode_share": round(d["decode_s"] / wall, 3) if wall else None,
            "wait_share": round(d["wait_s"] / wall, 3) if wall else None,
            "admit_share": round(d["admit_s"] / wall, 3) if wall else None,
            "occupancy": round(d["busy_slot_calls"] / (d["decode_calls"] * after["slots"]), 3)
            if d["decode_calls"] else None}


def trace_summary(events, windows=None) -> dict:
    """The host loop's trace (Scheduler, LUCEBOX_LOOP_TRACE) in a few figures, ms per decode call unless named:
    `call` the host's view of a call (dispatch until its tokens were read), `waited` the part of it spent blocked on
    the device, `late` the share of calls whose tokens the host found ready (waited < 0.05 ms: the device may have
    idled before the host came), `gap` from a call's tokens read to the next dispatch (the device idle between
    calls without lookahead: reads, admissions, the feed), `idle_p50` the median from a call's tokens read to the
    next admission or dispatch (the device's idle between calls where the host waits for them), `after_return_p50`
    the median from a dispatch's return to the next admission or dispatch (the idle where a call holds the thread
    that dispatches it until it ends), `dispatch_p50` the median from a dispatch to its return, `hooks` / `handback`
    the streaming hooks and the caller's time on finished requests a round, `admit` ms an admission,
    `feed_blocked_s` the loop blocked on an empty feed,
    `inbox_ms` arrival (\"s\", the server) to the next admission's start. `windows`: (start, end) pairs, the
    measured runs: only events starting inside one count (not the warm-up's)."""
    ev = sorted((tuple(e) for e in events if windows is None or any(a <= e[1] <= b for a, b in windows)),
                key=lambda e: e[1])
    if not ev:
        return {}
    disp = [e for e in ev if e[0] == "d"]
    waits = [e for e in ev if e[0] == "w"]
    calls, waited, gaps = [], [], []
    for d, w in zip(disp, waits):  # without lookahead each dispatch's tokens are read at the next wait
        calls.append(w[2] - d[1])
        waited.append(w[2] - w[1])
    starts = [e[1] for e in ev if e[0] in "ad"]
    idle, after_return, held = [], [], []
    for i, e in enumerate(ev):  # a dispatch returns when the host's next event starts (arrivals are another thread's)
        back = next((x[1] for x in ev[i + 1:] if x[0] != "s"), None) if e[0] == "d" else None
        if back is not None:
            held.append(back - e[1])
        nxt = next((t for t in starts if t > back), None) if back is not None else None
        if nxt is not None:
            after_return.append(nxt - back)
    for w in waits:
        nxt = next((d for d in disp if d[1] >= w[2]), None)
        if nxt is not None:
            gaps.append(nxt[1] - w[2])
        nxt = next((t for t in starts if t >= w[2]), None)
        if nxt is not None:
            idle.append(nxt - w[2])
    adm = [e[2] - e[1] for e in ev if e[0] == "a"]
    admit_starts = [e[1] for e in ev if e[0] == "a"]
    inbox = []
    for e in ev:
        if e[0] == "s":
            nxt = next((t for t in admit_starts if t >= e[1]), None)
            if nxt is not None:
                inbox.append(nxt - e[1])

    def ms(xs):
        return round(1e3 * float(np.mean(xs)), 3) if xs else None

    span = (sum(b - a for a, b in windows) if windows
            else max(e[2] if e[0] in "wafyh" else e[1] for e in ev) - ev[0][1])
    return {"span_s": round(span, 3), "calls": len(disp), "rows_mean": round(float(np.mean([d[2] for d in disp])), 2)
            if disp else None, "call": ms(calls), "waited": ms(waited),
            "late": round(float(np.mean([x < 5e-5 for x in waited])), 3) if waited else None,
            "gap": ms(gaps), "gap_share": round(sum(gaps) / span, 3) if span > 0 else None,
            "idle_p50": round(1e3 * float(np.percentile(idle, 50)), 3) if idle else None,
            "after_return_p50": round(1e3 * float(np.percentile(after_return, 50)), 3) if after_return else None,
            "dispatch_p50": round(1e3 * float(np.percentile(held, 50)), 3) if held else None,
            "hooks": ms([e[2] - e[1] for e in ev if e[0] == "h"]),
            "handback": ms([e[2] - e[1] for e in ev if e[0] == "y"]), "admissions": len(adm), "admit": ms(adm),
            "feed_blocked_s": round(sum(e[2] - e[1] for e in ev if e[0] == "f"), 4),
            "inbox_ms": ms(inbox)}


# ---------------------------------------------------------------------------------------------------- offline side
def bench_offline(llm, a, n, prompts):
    from lucebox_jax import SamplingParams
    from lucebox_jax.scheduler import Scheduler, SlotRequest

    eng = llm.engine
    flat = [ids for per in prompts for ids in per]

    def reqs(new):
        return [SlotRequest(i, ids, SamplingParams(temperature=0, max_tokens=new, seed=0, ignore_eos=True),
                            frozenset(), new) for i, ids in enumerate(flat)]

    def run(new):
        sched = Scheduler(eng, slots=n, max_len=a.max_context, steps_per_call=a.steps_per_call,
                          max_prefill_batch=min(8, n), lookahead=a.lookahead)
        c0, t0 = eng.compile_seconds, time.perf_counter()
        tokens = sum(len(f.token_ids) for batch in sched.run(reqs(new)) for f in batch)
        dt = time.perf_counter() - t0 - (eng.compile_seconds - c0)
        loop = loop_delta(None, sched.loop_stats(), dt)
        if sched.trace is not None:
            loop["_trace"] = list(sched.trace)
        return tokens, dt, loop

    run(4)  # warm-up: the same shapes
    # a run of ~3 s varied by up to 23% between runs on one H200 (2026-12-04, seventh session): the ratio's denominator
    # is the median of several
    runs = sorted((run(a.new_tokens) for _ in range(max(1, a.offline_reps))), key=lambda r: r[0] / r[1])
    tokens, dt, loop = runs[len(runs) // 2]  # the median run (the upper one of two)
    return {"requests": len(flat), "completion_tokens": tokens, "seconds": round(dt, 3), "tok_s": round(tokens / dt, 1),
            "tok_s_runs": [round(t / d, 1) for t, d, _ in runs], "loop": loop}


def fmt(v, nd=1):
    return "-" if v is None else f"{v:.{nd}f}"


def main(argv=None):
    a = parse_args(argv)
    t_start = time.time()
    deadline = t_start + a.budget
    out_dir = a.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="bench_serve_")
    os.makedirs(out_dir, exist_ok=True)
    # the server processes and this one (offline runs) share the GPU: no process may take most of its memory
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if a.trace:  # the offline side's schedulers (this process) keep a trace too
        os.environ["LUCEBOX_LOOP_TRACE"] = str(a.trace)
    import jax

    result = {"device": str(jax.devices()[0]), "args": {k: v for k, v in vars(a).items() if k != "out"},
              "levels": {}}
    json_path = os.path.join(out_dir, "bench_serve.json")

    def save():
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)

    llm = None
    if not a.no_offline:
        from lucebox_jax import LLM

        llm = LLM(a.model, max_context=a.max_context)
        result["model"] = llm.source
    for n in a.clients:
        if time.time() > deadline - 20:
            log(f"clients={n}: skipped (budget)")
            result["levels"][str(n)] = {"skipped": "budget"}
            continue
        lv = result["levels"][str(n)] = {}
        prompts = None
        # (key, --engine-process): the server as asked, and with --engine-process-ab the other way too
        modes = [("server", a.engine_process)] + ([("server_engine_process", True)] if a.engine_process_ab else [])
        if a.engine_process_ab:
            modes[0] = ("server", False)
        for key, ep in modes:
            if key != "server" and time.time() > deadline - 20:
                lv[key] = {"skipped": "budget"}
                continue
            log(f"clients={n}: starting a server with {n} slots{' (--engine-process)' if ep else ''} ...")
            try:
                row, prompts = bench_server_level(a, n, out_dir, deadline, ep)
            except Exception as e:  # noqa: BLE001 - one level failing keeps the others
                log(f"clients={n}: failed: {type(e).__name__}: {e}")
                lv[key] = {"error": f"{type(e).__name__}: {e}"}
                save()
                continue
            trace = row.pop("_trace", None)
            lv[key] = row
            log(f"clients={n}: {key} {row}")
            save()
            if trace is not None:
                windows = [(min(r[0] for r in run), max(r[2] for r in run)) for run in trace["requests"] if run]
                row["trace_summary"] = trace_summary(trace["loop"], windows)
                with open(os.path.join(out_dir, f"trace_{n}{'_ep' if ep else ''}.json"), "w") as f:
                    json.dump(trace, f)
                log(f"clients={n}: {key} loop trace {row['trace_summary']}")
                save()
        if llm is not None and prompts is not None:  # the ratio's denominator, even past the budget: a level
            # without it says little (the H200's first server start took 161 of 170 s on 2026-12-04 and lost it)
            off = bench_offline(llm, a, n, prompts)
            trace = off["loop"].pop("_trace", None)
            lv["offline"] = off
            if trace is not None:
                off["trace_summary"] = trace_summary(trace)
                with open(os.path.join(out_dir, f"trace_{n}_offline.json"), "w") as f:
                    json.dump({"loop": trace}, f)
                log(f"clients={n}: offline loop trace {off['trace_summary']}")
            for key, _ in modes:
                if "tok_s" in lv.get(key, {}):
                    lv[f"{key}_over_offline"] = round(lv[key]["tok_s"] / off["tok_s"], 3)
            log(f"clients={n}: offline {off}; over offline: "
                f"{ {k: v for k, v in lv.items() if k.endswith('_over_offline')} }")
            save()
    result["wall_s"] = round(time.time() - t_start, 1)
    save()
    lines = ["| clients | server tok/s | offline tok/s | ratio | TTFT p50 / p99 ms | ITL p50 / p99 ms (per chunk) | "
             "TPOT p50 / p99 ms | tokens/chunk |", "|---|---|---|---|---|---|---|---|"]
    for n, lv in result["levels"].items():
        o = lv.get("offline") or {}
        for key in ("server", "server_engine_process"):
            s = lv.get(key)
            name = f"{n}{' (engine process)' if key != 'server' else ''}"
            if key != "server" and s is None:
                continue
            if not s or "tok_s" not in s:
                lines.append(f"| {name} | {s or lv} |  |  |  |  |  |  |")
                continue
            lines.append(f"| {name} | {s['tok_s']} | {o.get('tok_s', '-')} | {lv.get(f'{key}_over_offline', '-')} | "
                         f"{fmt(s['ttft_p50_ms'])} / {fmt(s['ttft_p99_ms'])} | {fmt(s['itl_p50_ms'])} / "
                         f"{fmt(s['itl_p99_ms'])} | {fmt(s['tpot_p50_ms'], 2)} / {fmt(s['tpot_p99_ms'], 2)} | "
                         f"{s['tokens_per_chunk']} |" + (f" ({s['failed_requests']} requests failed)"
                                                          if s.get("failed_requests") else ""))
    loops = ["| clients | side | wall in decode calls | of it waiting on the device | wall in admissions (prefill) | "
             "slot occupancy | decode calls | admissions |", "|---|---|---|---|---|---|---|---|"]
    for n, lv in result["levels"].items():
        for side, lp in (("server", (lv.get("server") or {}).get("server_loop")),
                         ("engine process", (lv.get("server_engine_process") or {}).get("server_loop")),
                         ("offline", (lv.get("offline") or {}).get("loop"))):
            if lp:
                loops.append(f"| {n} | {side} | {lp['decode_share']} | {lp.get('wait_share', '-')} | "
                             f"{lp['admit_share']} | {lp['occupancy']} | "
                             f"{lp['decode_calls']} | {lp.get('prefill_calls', '-')} |")
    if len(loops) > 2:  # where each side's wall clock went (Scheduler.loop_stats)
        lines += [""] + loops
    md = (f"bench_serve on {result['device']}: {a.new_tokens} new tokens per request, prompts {a.prompt_min}-"
          f"{a.prompt_max} tokens, context {a.max_context}, {a.steps_per_call} steps per call, server slots = clients, "
          f"{a.clients_per_process or 'all'} clients per client process"
          f"{', --exit-on-finish' if a.exit_on_finish else ''}{', --lookahead (both sides)' if a.lookahead else ''}"
          f"{', in-process against --engine-process' if a.engine_process_ab else ''}"
          f"{', --engine-process' if a.engine_process and not a.engine_process_ab else ''}"
          "\n\n" + "\n".join(lines) + "\n")
    with open(os.path.join(out_dir, "bench_serve.md"), "w") as f:
        f.write(md)
    print(md)
    log(f"results in {out_dir}")


if __name__ == "__main__":
    main()
