"""benchmarks/bench_start.py (a prompt's start, step by step and as one program) runs its CPU smoke configuration
and reports, for plain and speculative starts, each step's dispatch and total time and both whole-start times."""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_bench_start_small(tmp_path, monkeypatch):
    import bench_start

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["bench_start.py", "--preset", "tiny", "--head", "random", "--lens", "8",
                                      "--reps", "1", "--no-profile"])
    bench_start.main()
    rows = json.loads((tmp_path / "bench_start.json").read_text())["rows"]
    assert [(r["prompt_len"], r["path"]) for r in rows] == [(8, "plain"), (8, "eagle")]
    steps = {"cache", "prefill", "seen", "first_token", "loop"}
    assert steps <= set(rows[0]) and steps | {"spec_init"} <= set(rows[1])
    for r in rows:
        assert r["whole_ms"] > 0 and r["one_call_ms"] > 0 and all(r[k][1] > 0 for k in steps)


def test_probe_h2d_runs(capsys):
    import probe_h2d

    probe_h2d.main()
    out = capsys.readouterr().out
    assert "asarray int32[8]" in out and "400 arguments" in out
