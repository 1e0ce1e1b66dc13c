"""Fault injection for batch jobs (issue 12). Real `run.py --input` subprocesses on the tiny model are killed at
random points (before the model loads, mid-generation, between records), run concurrently on one output, resumed
over torn last lines, and pointed at outputs that cannot be written. The invariant after every scenario: each input
line ends up in the output exactly once (a result by id, or an error record by id or by line), the input and every
other file are unchanged."""

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from lucebox_jax.jobs import LINE_ERRORS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 20


def make_input(tmp_path):
    rows = [json.dumps({"id": f"r{i}", "prompt": f"request number {i}", "max_tokens": 4 + i % 5}) for i in range(N)]
    rows[3] = "{torn json"  # line errors are recorded once too
    rows[7] = json.dumps({"id": "r1", "prompt": "duplicate id"})
    rows[11] = json.dumps({"id": "r11", "prompt": "x", "temperature": True})
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def expected_keys(inp):
    keys, seen = [], set()
    for n, line in enumerate(inp.read_text().splitlines(), start=1):
        try:
            rid = json.loads(line)["id"]
        except (ValueError, KeyError):
            keys.append(("line", n))
            continue
        keys.append(("line", n) if rid in seen else ("id", rid))
        seen.add(rid)
    return sorted(keys, key=str)


def output_keys(out):
    keys = []
    for line in out.read_text().splitlines():
        rec = json.loads(line)  # every line a whole record
        err = rec.get("error")
        if err and (err["type"] in LINE_ERRORS or rec["id"] is None):
            keys.append(("line", rec["line"]))
        else:
            keys.append(("id", rec["id"]))
    return sorted(keys, key=str)


def snapshot(folder, skip):
    return {p: hashlib.sha256(open(os.path.join(folder, p), "rb").read()).hexdigest()
            for p in sorted(os.listdir(folder)) if p != skip and os.path.isfile(os.path.join(folder, p))}


def command(tiny_gguf, inp, out, *extra):
    return [sys.executable, os.path.join(ROOT, "run.py"), "--model", tiny_gguf, "--no-checkpoint", "--input",
            str(inp), "--output", str(out), "--batch-size", "1", "--steps-per-call", "2", "--quiet", *extra]


def scenario(tmp_path, tiny_gguf):
    """(input, output, hashes of the other files, the job's command line)."""
    inp = make_input(tmp_path)
    out = tmp_path / "out.jsonl"
    return inp, out, snapshot(tmp_path, out.name), command(tiny_gguf, inp, out)


def start(cmd):
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def lines_in(out):
    return out.read_bytes().count(b"\n") if out.exists() else 0


def kill_after(p, out, n_lines, extra_s, sig=signal.SIGKILL, timeout=120):
    """Kill `p` once the output holds n_lines lines, plus extra_s seconds (or when it ends by itself)."""
    deadline = time.time() + timeout
    while time.time() < deadline and p.poll() is None and lines_in(out) < n_lines:
        time.sleep(0.005)
    time.sleep(extra_s)
    if p.poll() is None:
        p.send_signal(sig)
    p.communicate(timeout=60)
    return p.returncode


def finish(cmd, out, inp, others):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert output_keys(out) == expected_keys(inp)  # each input line exactly once
    assert snapshot(inp.parent, out.name) == others  # the input and every other file unchanged
    return r


def test_killed_at_random_points_each_id_exactly_once(tmp_path, tiny_gguf):
    inp, out, others, cmd = scenario(tmp_path, tiny_gguf)
    rng = random.Random(12)
    for n_lines, sig in ((0, signal.SIGKILL), (rng.randint(2, 6), signal.SIGKILL), (rng.randint(8, 12), signal.SIGTERM),
                         (rng.randint(13, 16), signal.SIGKILL)):
        kill_after(start(cmd), out, n_lines, rng.uniform(0.0, 0.05), sig)
        keys = output_keys(out) if out.exists() else []
        assert len(keys) == len(set(keys)), "a record was written twice"
        assert snapshot(tmp_path, out.name) == others
    finish(cmd, out, inp, others)


def test_concurrent_jobs_on_one_output(tmp_path, tiny_gguf):
    inp, out, others, cmd = scenario(tmp_path, tiny_gguf)
    procs = [start(cmd) for _ in range(3)]
    results = [(p.wait(timeout=300), p.communicate()[1]) for p in procs]
    assert all(rc in (0, 2) for rc, _ in results), results
    for rc, err in results:
        assert rc == 0 or "in use by another job" in err, err
    assert sum(rc == 0 for rc, _ in results) >= 1
    keys = output_keys(out)
    assert len(keys) == len(set(keys))
    finish(cmd, out, inp, others)


def test_torn_last_lines_resume_exactly_once(tmp_path, tiny_gguf):
    inp, out, others, cmd = scenario(tmp_path, tiny_gguf)
    kill_after(start(cmd), out, 5, 0.0)
    lines = out.read_text().splitlines(keepends=True)
    last = lines[-1]
    out.write_text("".join(lines[:-1]) + last[: len(last) // 2])  # the last record torn in half
    r = finish(cmd, out, inp, others)
    assert "cut off a torn last line" in r.stderr


@pytest.mark.parametrize("kind", ["folder", "under_a_file", "missing_folder"])
def test_unwritable_outputs_change_nothing(tmp_path, tiny_gguf, kind):
    inp = make_input(tmp_path)
    (tmp_path / "outdir").mkdir()
    out = {"folder": tmp_path / "outdir", "under_a_file": inp / "o.jsonl",
           "missing_folder": tmp_path / "nope" / "o.jsonl"}[kind]
    before = snapshot(tmp_path, None)
    r = subprocess.run(command(tiny_gguf, inp, out), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    assert snapshot(tmp_path, None) == before and os.listdir(tmp_path / "outdir") == []
