"""benchmarks/bench_admit.py (what one scheduler admission costs, by phase) runs its CPU smoke configuration and
reports, per group size and prompt length, a time per admission whose synchronised phases are the scheduler's own
device calls (the start, one program for a prompt of one chunk: cache, prefill and first tokens; the insert)."""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_bench_admit_small(tmp_path, monkeypatch):
    import bench_admit

    monkeypatch.setenv("OUT", str(tmp_path))
    bench_admit.main(["--small"])
    res = json.loads((tmp_path / "bench_admit.json").read_text())
    assert [(r["group"], r["prompt"]) for r in res["rows"]] == [(1, 16), (1, 40), (2, 16), (2, 40)]
    for r in res["rows"]:
        assert set(r["phases_ms"]) == {"start", "insert"}
        assert r["ms"] > 0 and r["synced_ms"] >= sum(r["phases_ms"].values()) * 0.99
