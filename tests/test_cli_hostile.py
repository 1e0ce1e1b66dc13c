"""Hostile command lines and environments (issue 12): bytes that are not UTF-8 in arguments and in JSONL inputs,
out-of-range and mistyped values, and a read-only HOME: one clear `error:` line or a per-request error record,
never a traceback."""

import json
import os
import subprocess
import sys

import pytest

from test_jobs import job, read_out

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(args, env=None, cwd=None, timeout=300):
    cmd = [os.fsencode(sys.executable), os.fsencode(os.path.join(ROOT, "run.py"))] + [
        a if isinstance(a, bytes) else a.encode() for a in args]
    return subprocess.run(cmd, capture_output=True, timeout=timeout, env=env, cwd=cwd)


@pytest.mark.parametrize("args, msg", [
    ([b"--prompt", b"caf\xe9 \xff"], b"--prompt is not valid UTF-8"),
    ([b"--prompt", b"hi", b"--stop", b"\xfe"], b"--stop is not valid UTF-8"),
    ([b"--prompt", b"hi", b"--system", b"\xc3("], b"--system is not valid UTF-8"),
    (["--prompt", "hi", "--seed", "-1"], b"seed must be an integer in 0..2**64-1"),
    (["--prompt", "hi", "--seed", str(2**64)], b"seed must be an integer in 0..2**64-1"),
    (["--prompt", "hi", "--max-tokens", "0"], b"max_tokens must be"),
])
def test_bad_arguments_one_error_line(args, msg):
    r = run_cli(args, timeout=120)
    assert r.returncode == 2 and msg in r.stderr, r.stderr
    assert b"Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_jsonl_bad_text_fails_per_request(tmp_path, tiny_llm):
    rows = [json.dumps({"id": "ok", "prompt": "hello", "max_tokens": 2}),
            '{"id": "\\ud800", "prompt": "lone surrogate id"}',
            '{"id": "p", "prompt": "bad \\udcff prompt"}',
            '{"id": "m", "messages": [{"role": "user", "content": "x\\ud83d"}]}',
            '{"id": "s", "prompt": "a", "stop": ["\\udfff"]}',
            '{"id": "b", "prompt": "raw bytes \xff"}'.encode("latin-1").decode("latin-1"),
            json.dumps({"id": "ok2", "prompt": "world", "max_tokens": 2})]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(r.encode("utf-8") if i != 5 else b'{"id": "b", "prompt": "raw \xff"}'
                                for i, r in enumerate(rows)) + b"\n")
    status, summ, _ = job(tmp_path, tiny_llm, None, ordered=True)
    assert status == 0 and summ.ok == 2 and summ.failed == 5
    out = read_out(tmp_path / "out.jsonl")
    got = [(r["id"], r.get("error", {}).get("type")) for r in out]
    assert got == [("ok", None), (None, "invalid_id"), ("p", "invalid_request"), ("m", "invalid_request"),
                   ("s", "invalid_sampling_params"), (None, "invalid_json"), ("ok2", None)]
    assert all("UTF-8" in r["error"]["message"] for r in out if "error" in r)


@pytest.mark.parametrize("field, value", [
    ("max_tokens", True), ("max_tokens", 2.0), ("top_k", False), ("seed", True), ("seed", -3), ("seed", 2**64),
    ("seed", 1.5), ("stop_token_ids", [1.0]), ("stop_token_ids", [True]), ("stop_token_ids", [-1]),
    ("stop_token_ids", 5), ("ignore_eos", 1), ("ignore_eos", "yes"), ("temperature", True), ("stop", [1]),
    ("repetition_penalty", "1.1"),
])
def test_mistyped_fields_refused_per_request(tmp_path, field, value):
    from lucebox_jax.jobs import read_input

    p = tmp_path / "in.jsonl"
    p.write_text(json.dumps({"id": "x", "prompt": "hi", field: value}) + "\n")
    [it] = read_input(str(p), {"max_tokens": 4, "temperature": 0.0})
    assert it.error is not None and it.error[0] == "invalid_sampling_params" and field in it.error[1]


def test_api_types_use_the_library_errors(tiny_llm):
    from lucebox_jax import InvalidRequestError, InvalidSamplingParamsError, SamplingParams

    for ids in ([1.0, 2.0], [True, 3], [-1], "12", [[1]]):
        with pytest.raises(InvalidRequestError):
            tiny_llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="UTF-8"):
        tiny_llm.generate("bad \udcff", SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError):
        tiny_llm.generate(123, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidSamplingParamsError):
        tiny_llm.generate("hi", {"max_tokens": 2})
    with pytest.raises(InvalidSamplingParamsError, match="stop token id 100000 outside"):
        tiny_llm.generate("hi", SamplingParams(max_tokens=2, stop_token_ids=[100000]))


def test_scheduler_refuses_bad_requests_typed(tiny_llm):
    from lucebox_jax import InvalidRequestError, SamplingParams
    from lucebox_jax.scheduler import Scheduler, SlotRequest

    sched = Scheduler(tiny_llm.engine, slots=2, max_len=256)
    p = SamplingParams(max_tokens=2, seed=1)
    for r in (SlotRequest(0, [1.5], p), SlotRequest(0, [10**6], p), SlotRequest(0, [1], p, frozenset({-1})),
              SlotRequest(0, [1], p, max_new=True), SlotRequest(0, [1], {"seed": 1}), SlotRequest(0, [], p)):
        with pytest.raises(InvalidRequestError):
            sched.validate(r)


def test_read_only_home_falls_back(tmp_path, tiny_gguf):
    (tmp_path / "file").write_text("")  # HOME under a regular file: nothing can be created there, even as root
    env = {k: v for k, v in os.environ.items() if k not in ("LUCEBOX_JAX_CACHE", "LUCEBOX_CHECKPOINTS")}
    env.update(HOME=str(tmp_path / "file" / "home"), LUCEBOX_CHECKPOINTS=str(tmp_path / "file" / "ck"),
               TMPDIR=str(tmp_path))
    r = run_cli(["--model", tiny_gguf, "--prompt", "hi", "--raw", "--max-tokens", "2"], env=env)
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr
    assert b"trying the temp folder" in r.stderr and b"loading the GGUF directly" in r.stderr
