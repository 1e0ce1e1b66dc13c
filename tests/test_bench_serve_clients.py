"""benchmarks/bench_serve.py: its client side, with clients spread over processes (one asyncio httpx client cannot
keep up with many streams), returns every request with its chunk stamps against a stand-in OpenAI-style SSE server
(uvicorn + Starlette in a subprocess, loopback only), so the multi-process path is checked without a model; its offline
side reports the median of several runs."""

import os
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

STAND_IN = r'''
import asyncio, json, sys
import uvicorn
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

async def completions(request):
    body = await request.json()
    n = body["max_tokens"]
    async def events():
        for i in range(n):
            await asyncio.sleep(0.01)
            yield "data: " + json.dumps({"choices": [{"index": 0, "text": f"t{i}"}]}) + "\n\n"
        yield "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": n}}) + "\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")

app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
'''


@pytest.fixture(scope="module")
def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        p = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", STAND_IN, str(p)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", p), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None:
                    pytest.fail(proc.stderr.read()[-2000:])
                time.sleep(0.2)
        yield p
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.mark.parametrize("per_process", [0, 2])
def test_clients_in_processes_return_every_request(port, per_process):
    import bench_serve

    prompts = [[[1, 2, 3]] * 2 for _ in range(5)]  # 5 clients x 2 requests each
    reqs, wall = bench_serve.run_client_processes(port, prompts, 4, per_process)
    assert len(reqs) == 10 and not [r for r in reqs if r.get("error")]
    assert all(r["tokens"] == 4 and len(r["stamps"]) == 4 for r in reqs)
    assert 0.08 <= wall < 30  # each client's two requests take at least 2 x 4 x 10 ms, one after the other
    row = bench_serve.summarize(reqs, wall)
    assert row["completion_tokens"] == 40 and row["failed_requests"] == 0


def test_offline_side_is_the_median_of_its_runs(tiny_llm):
    """The server / offline ratio's denominator: --offline-reps runs of the same requests, their median reported and
    each run listed (one ~3 s run varied by up to 23% on the H200)."""
    import bench_serve

    a = bench_serve.parse_args(["--small", "--offline-reps", "3", "--max-context", "64"])
    prompts = [[[1, 2, 3, 4]] * 2 for _ in range(2)]
    off = bench_serve.bench_offline(tiny_llm, a, 2, prompts)
    runs = off["tok_s_runs"]
    assert len(runs) == 3 and runs == sorted(runs) and off["tok_s"] == runs[1]
    assert off["completion_tokens"] == 4 * a.new_tokens
    loop = off["loop"]  # where the median run's wall clock went (Scheduler.loop_stats)
    assert loop["decode_calls"] > 0 and 0 < loop["decode_share"] <= 1 and 0 < loop["admit_share"] < 1
    assert 0 < loop["occupancy"] <= 1


def test_loop_trace_agrees_with_the_loop_counters(tiny_llm, monkeypatch):
    """LUCEBOX_LOOP_TRACE: the offline side's scheduler records every dispatch, wait and admission, and
    bench_serve.trace_summary counts the same decode calls and admissions as Scheduler.loop_stats; the wait is part
    of each call as the host saw it."""
    import bench_serve

    monkeypatch.setenv("LUCEBOX_LOOP_TRACE", "1000")
    a = bench_serve.parse_args(["--small", "--offline-reps", "1", "--max-context", "64", "--trace", "1000"])
    prompts = [[[1, 2, 3, 4]] * 3 for _ in range(2)]
    off = bench_serve.bench_offline(tiny_llm, a, 2, prompts)
    trace, loop = off["loop"].pop("_trace"), off["loop"]
    assert {e[0] for e in trace} >= {"d", "w", "a"}
    got = bench_serve.trace_summary(trace)
    assert got["calls"] == loop["decode_calls"] and got["admissions"] == loop["prefill_calls"]
    assert 0 < got["waited"] <= got["call"] and 0 <= got["late"] <= 1 and got["rows_mean"] <= 2
    assert got["idle_p50"] >= 0 and got["after_return_p50"] >= 0 and got["dispatch_p50"] >= 0
    # windows keep only the events that start inside them
    t0 = min(e[1] for e in trace)
    assert bench_serve.trace_summary(trace, [(t0 - 2, t0 - 1)]) == {}
