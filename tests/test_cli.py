"""The CLI as a user runs it (real subprocesses): a streamed answer from the embedded model, JSON output, and one-line
errors with exit status 2 for every kind of bad input."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, env=None, timeout=600):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, os.path.join(ROOT, "run.py"), *args], capture_output=True, text=True,
                          timeout=timeout, env=e, cwd=ROOT)


def test_capital_of_france_streams():
    r = run("--prompt", "What is the capital of France?", "--max-tokens", "24")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "decode" in r.stderr and "tok/s" in r.stderr and "compile" in r.stderr


def test_json_output_on_tiny_model(tiny_gguf, tmp_path):
    r = run("--model", tiny_gguf, "--prompt", "hello", "--max-tokens", "5", "--output-format", "json",
            "--temperature", "0.8", "--seed", "3", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.01",
            "--repeat-penalty", "1.1", "--kernels", "qmatmul=xla,attention_decode=xla",
            env={"LUCEBOX_CHECKPOINTS": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    assert set(obj) >= {"text", "token_ids", "finish_reason", "usage"}
    assert obj["usage"]["completion_tokens"] == len(obj["token_ids"]) <= 5
    assert obj["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("args,msg", [
    (["--model", "/nowhere/model.gguf", "--prompt", "x"], "/nowhere/model.gguf"),
    (["--prompt", "x", "--temperature", "-1"], "temperature must be >= 0"),
    (["--prompt", "x", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--prompt", "   "], "empty prompt"),
    (["--prompt", "x", "--kernels", "qmatmul=nope"], "valid: "),
])
def test_bad_input_one_line_error(args, msg):
    r = run(*args)
    assert r.returncode == 2
    lines = [x for x in r.stderr.strip().splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and msg in lines[0], r.stderr


def test_prompt_over_context_names_limit(tiny_gguf, tmp_path):
    r = run("--model", tiny_gguf, "--raw", "--prompt", "x" * 50, "--max-context", "16",
            env={"LUCEBOX_CHECKPOINTS": str(tmp_path)})
    assert r.returncode == 2 and "context limit is 16 tokens" in r.stderr


def test_list_kernels():
    r = run("--list-kernels")
    assert r.returncode == 0 and "qmatmul:" in r.stdout and "xla" in r.stdout
