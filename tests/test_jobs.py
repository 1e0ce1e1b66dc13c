"""JSONL batch jobs (jobs.py): parsing and validation (an error record per bad line, the job goes on), resume
(skip what the output holds, repair a torn last line), --ordered, empty input, per-request seeds, and a real
`run.py --input` subprocess killed part-way and rerun: every id exactly once, same texts as an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from lucebox_jax.jobs import JobConfig, read_input, run_job, scan_output

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOTS, STEPS = 2, 4  # as in test_scheduler.py: the same compiled programs
DEFAULTS = dict(max_tokens=8, temperature=0.0)


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    return str(path)


def read_out(path):
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def job(tmp_path, llm, rows, out="out.jsonl", **kw):
    inp = write_jsonl(tmp_path / "in.jsonl", rows) if rows is not None else str(tmp_path / "in.jsonl")
    cfg = JobConfig(input=inp, output=str(tmp_path / out), slots=SLOTS, steps_per_call=STEPS, quiet=True,
                    defaults=dict(DEFAULTS), **kw)
    logs = []
    status, summ = run_job(cfg, llm=llm, log=logs.append)
    return status, summ, logs


def requests(n, max_tokens=(3, 8, 5, 1, 7)):
    words = ["alpha", "beta gamma", "delta", "x", "the quick brown fox", "zeta eta", "hello", "jumps over"]
    return [{"id": f"r{i}", "prompt": words[i % len(words)] + f" {i}", "max_tokens": max_tokens[i % len(max_tokens)]}
            for i in range(n)]


def test_bad_lines_become_error_records(tmp_path, tiny_llm):
    rows = [
        {"id": "ok1", "prompt": "hello", "max_tokens": 4},
        "{not json",
        {"prompt": "no id"},
        {"id": "ok1", "prompt": "duplicate"},
        {"id": "np"},
        {"id": "both", "prompt": "a", "messages": [{"role": "user", "content": "b"}]},
        {"id": "badmsg", "messages": [{"role": "user"}]},
        {"id": "temp", "prompt": "a", "temperature": -1},
        {"id": "stop", "prompt": "a", "stop": 5},
        {"id": "long", "prompt": "y" * 300},
        "",
        [1, 2],
        {"id": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "seed": 4,
         "temperature": 0.8},
    ]
    status, summ, _ = job(tmp_path, tiny_llm, rows, ordered=True)
    assert status == 0 and summ.ok == 2 and summ.failed == 10
    out = read_out(tmp_path / "out.jsonl")
    errs = [(r["id"], r["line"], r["error"]["type"]) for r in out if "error" in r]
    assert errs == [(None, 2, "invalid_json"), (None, 3, "missing_id"), ("ok1", 4, "duplicate_id"),
                    ("np", 5, "invalid_request"), ("both", 6, "invalid_request"), ("badmsg", 7, "invalid_request"),
                    ("temp", 8, "invalid_sampling_params"), ("stop", 9, "invalid_sampling_params"),
                    ("long", 10, "prompt_too_long"), (None, 12, "invalid_request")]
    assert "context limit is 256" in next(r for r in out if r["id"] == "long")["error"]["message"]
    ok = [r for r in out if "error" not in r]
    assert [r["id"] for r in ok] == ["ok1", "chat"]
    for r in ok:
        assert r["finish_reason"] in ("stop", "length") and "token_ids" not in r
        assert r["usage"]["prompt_tokens"] > 0 and 0 < r["usage"]["completion_tokens"] <= 4
    # a rerun finds everything done (error records included) and writes nothing
    before = (tmp_path / "out.jsonl").read_bytes()
    status, summ, logs = job(tmp_path, tiny_llm, rows, ordered=True)
    assert status == 0 and summ.skipped == 12 and summ.ok == summ.failed == 0
    assert (tmp_path / "out.jsonl").read_bytes() == before and "nothing to do" in logs[0]


def test_empty_input(tmp_path, tiny_llm):
    (tmp_path / "in.jsonl").write_text("\n  \n")
    status, summ, logs = job(tmp_path, None, None)  # no model needed
    assert status == 0 and "no requests" in logs[0]
    assert not (tmp_path / "out.jsonl").exists()
    r = subprocess.run([sys.executable, os.path.join(ROOT, "run.py"), "--input", str(tmp_path / "in.jsonl"),
                        "--output", str(tmp_path / "o.jsonl")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "no requests" in r.stderr and not (tmp_path / "o.jsonl").exists()


def test_cli_flag_errors(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", requests(1))
    for args, msg in ((["--input", inp, "--prompt", "x", "--output", "o"], "mutually exclusive"),
                      (["--input", inp], "needs --output"),
                      (["--input", str(tmp_path / "nope.jsonl"), "--output", "o"], "input file not found")):
        r = subprocess.run([sys.executable, os.path.join(ROOT, "run.py"), *args], capture_output=True, text=True,
                           timeout=120, cwd=tmp_path)
        assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_resume_repairs_torn_line_and_ordered(tmp_path, tiny_llm):
    rows = requests(7)
    status, summ, _ = job(tmp_path, tiny_llm, rows, out="full.jsonl", token_ids=True, ordered=True)
    full = read_out(tmp_path / "full.jsonl")
    assert status == 0 and summ.ok == 7 and [r["id"] for r in full] == [f"r{i}" for i in range(7)]
    for r, q in zip(full, rows):
        assert r["usage"]["completion_tokens"] == len(r["token_ids"]) <= q["max_tokens"]
    # a crash left 3 complete lines and half of a fourth
    lines = (tmp_path / "full.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "part.jsonl").write_text("".join(lines[:3]) + lines[3][:20])
    assert scan_output(str(tmp_path / "part.jsonl"), repair=False)[0] == {json.dumps(f"r{i}") for i in range(3)}
    status, summ, _ = job(tmp_path, tiny_llm, rows, out="part.jsonl", token_ids=True)
    assert status == 0 and summ.skipped == 3 and summ.ok == 4
    part = read_out(tmp_path / "part.jsonl")
    assert sorted(r["id"] for r in part) == sorted(r["id"] for r in full)
    assert {r["id"]: r for r in part} == {r["id"]: r for r in full}


def test_seeds_reproduce(tmp_path, tiny_llm):
    base = {"prompt": "once upon a time", "temperature": 1.0, "top_p": 0.9, "max_tokens": 8}
    rows = [{"id": "a", "seed": 7, **base}, {"id": "filler", "prompt": "zzz", "max_tokens": 5},
            {"id": "b", "seed": 7, **base}, {"id": "c", "seed": 8, **base}, {"id": "d", **base}]
    job(tmp_path, tiny_llm, rows, token_ids=True)
    out = {r["id"]: r for r in read_out(tmp_path / "out.jsonl")}
    assert out["a"]["token_ids"] == out["b"]["token_ids"] != out["c"]["token_ids"]
    # alone, in another slot and batch: the same draws; unseeded requests get a seed derived from the id
    job(tmp_path, tiny_llm, [rows[2], rows[4]], out="again.jsonl", token_ids=True)
    again = {r["id"]: r for r in read_out(tmp_path / "again.jsonl")}
    assert again["b"]["token_ids"] == out["b"]["token_ids"] and again["d"]["token_ids"] == out["d"]["token_ids"]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_job_resumes_exactly_once(tmp_path, tiny_gguf, tiny_llm, sig):
    rows = requests(24, max_tokens=(12, 16, 9, 14))
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, os.path.join(ROOT, "run.py"), "--model", tiny_gguf, "--no-checkpoint", "--input", inp,
           "--output", str(out), "--batch-size", "1", "--steps-per-call", "2", "--max-tokens", "8", "--quiet"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:
        if out.exists() and out.read_text().count("\n") >= 4:
            break
        time.sleep(0.05)
    assert p.poll() is None, p.communicate()[1]
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    if sig == signal.SIGTERM:  # a clean stop: summary printed, exit 130
        assert p.returncode == 130 and "interrupted" in err and "in flight lost" in err, err
    n_first = len(out.read_text().splitlines())
    assert 4 <= n_first < len(rows)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"{len(rows) - n_first} ok" in r.stderr and f"{n_first} skipped" in r.stderr
    resumed = read_out(out)
    assert sorted(x["id"] for x in resumed) == sorted(x["id"] for x in rows)  # each exactly once
    job(tmp_path, tiny_llm, rows, out="ref.jsonl")
    ref = {x["id"]: x for x in read_out(tmp_path / "ref.jsonl")}
    assert {x["id"]: x for x in resumed} == ref


def test_read_input_and_scan_output_units(tmp_path):
    p = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": 5, "prompt": "a", "stop": "x"}, {"id": True, "prompt": "b"},
                                             {"id": "z", "messages": [{"role": "user", "content": "c"}],
                                              "max_tokens": 2.5}])
    items = read_input(p, dict(DEFAULTS))
    assert items[0].error is None and items[0].id == 5 and items[0].params.stop == ["x"]
    assert items[1].error[0] == "invalid_id"
    assert items[2].error[0] == "invalid_sampling_params"
    o = tmp_path / "o.jsonl"
    o.write_text('{"id": "a", "text": ""}\n{"id": null, "line": 3, "error": {"type": "invalid_json"}}\n'
                 '{"id": "b", "line": 4, "error": {"type": "duplicate_id"}}\ngarbage\n{"id": "c", "te')
    ids, lines = scan_output(str(o))
    assert ids == {'"a"'} and lines == {3, 4}
    assert o.read_text().endswith("garbage\n")  # torn tail cut off


def test_lookahead_job_writes_the_same_records(tmp_path, tiny_llm):
    """`--lookahead` (JobConfig.lookahead): the same records, stop strings and seeded draws included, as without it;
    and the command line sets it."""
    import argparse

    from lucebox_jax.jobs import job_config_from_args

    rows = requests(7) + [{"id": "s", "prompt": "alpha 1", "max_tokens": 8, "stop": ["a"]},
                          {"id": "t", "prompt": "once upon a time", "temperature": 1.0, "seed": 3, "max_tokens": 8}]
    job(tmp_path, tiny_llm, rows, out="plain.jsonl", token_ids=True)
    job(tmp_path, tiny_llm, rows, out="ahead.jsonl", token_ids=True, lookahead=True)
    strip = lambda rs: sorted((r["id"], r.get("text"), r.get("token_ids"), r.get("finish_reason")) for r in rs)  # noqa: E731
    assert strip(read_out(tmp_path / "ahead.jsonl")) == strip(read_out(tmp_path / "plain.jsonl"))
    assert len(read_out(tmp_path / "ahead.jsonl")) == len(rows)
    args = argparse.Namespace(prompt=None, output="o.jsonl", input="i.jsonl", batch_size=None, steps_per_call=None,
                              max_context=None, spec_max_slots=None, draft=None, max_tokens=8, temperature=0.0,
                              top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, stop=None, seed=0, token_ids=False,
                              ordered=False, quiet=True, lookahead=True)
    assert job_config_from_args(args).lookahead
