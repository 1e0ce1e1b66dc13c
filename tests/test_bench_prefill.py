"""benchmarks/bench_prefill.py's CPU smoke run: one JSON row per (batch, prompt length), a prompt past one 512-token
chunk included, with the engine's kernels named."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

import bench_prefill  # noqa: E402


def test_bench_prefill_small(capsys):
    bench_prefill.main(["--small"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["batch"], r["length"]) for r in rows] == [(1, 40), (1, 600), (2, 40), (2, 600)]
    assert all(r["ms"] > 0 and r["tok_s"] > 0 and "attention_prefill=" in r["kernels"] for r in rows)
