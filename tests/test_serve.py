"""The OpenAI-compatible server (lucebox_jax/serve/): one real server process per module on a free loopback port,
serving a tiny random-weights GGUF (byte tokens, a chat template, context 2048) with an API key, driven by the
official `openai` client (and raw http.client for bodies the client cannot send). Answers are checked against
in-process `LLM.generate` / `LLM.chat` on the same file; every request loop is bounded in count and time."""

import asyncio
import concurrent.futures
import http.client
import json
import os
import socket
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from lucebox_jax import SamplingParams  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "test-key-123"
MODEL = "tiny"
SLOTS = 8
CONTEXT = 2048


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _raw(port, method, path, body=None, headers=None, timeout=60):
    """(status, headers, parsed JSON or text) over a fresh loopback connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        h = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **(headers or {})}
        conn.request(method, path, body=data, headers={k: v for k, v in h.items() if v is not None})
        r = conn.getresponse()
        text = r.read().decode()
        try:
            return r.status, dict(r.getheaders()), json.loads(text)
        except ValueError:
            return r.status, dict(r.getheaders()), text
    finally:
        conn.close()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from gguf_factory import write_tiny_gguf

    path = tmp_path_factory.mktemp("serve") / "tiny-2k.gguf"
    write_tiny_gguf(path, context=CONTEXT)
    return str(path)


@pytest.fixture(scope="module")
def llm(model_path):
    """The same model in-process: the reference the server's answers must equal."""
    from lucebox_jax import LLM

    return LLM(model_path, use_checkpoint=False)


@pytest.fixture(scope="module")
def server(model_path):
    yield from _serve(model_path)


def _serve(model_path, *extra):
    port = _free_port()
    cmd = [sys.executable, "-m", "lucebox_jax.serve", "--port", str(port), "--api-key", KEY, "--served-model-name",
           MODEL, "--batch-size", str(SLOTS), "--max-body-kb", "64", "--model", model_path, "--no-checkpoint", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"server exited ({proc.returncode}): {proc.stderr.read()[-3000:]}")
            try:
                if _raw(port, "GET", "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("server did not come up within 300 s")
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key=KEY, max_retries=0, timeout=120)


def _greedy(n):
    return SamplingParams(temperature=0, max_tokens=n)


def _stream_text(stream, kind="chat"):
    """(text, finish_reason, usage, number of chunks) of an openai stream, checking the chunk sequence."""
    text, finish, usage, n = "", None, None, 0
    for i, c in enumerate(stream):
        n += 1
        if c.usage is not None:
            assert c.choices == [] and finish is not None  # the usage chunk comes last, after the finish chunk
            usage = c.usage
            continue
        assert finish is None, "nothing but usage after the finish chunk"
        ch = c.choices[0]
        if kind == "chat":
            assert c.object == "chat.completion.chunk"
            if i == 0:
                assert ch.delta.role == "assistant"
            text += ch.delta.content or ""
        else:
            text += ch.text
        finish = ch.finish_reason
    return text, finish, usage, n


# ---------------------------------------------------------------------------------------------------- routes, auth
def test_health_models_and_api_key(server, client):
    assert _raw(server, "GET", "/health", headers={"Authorization": None})[0] == 200
    before = _raw(server, "GET", "/health")[2]["latency_ms"]["finished"]
    client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0)
    lat = _raw(server, "GET", f"/health?latency_since={before}")[2]["latency_ms"]  # where time to first token went
    assert lat["finished"] == before + 1 and lat["requests"] == 1
    assert 0 <= lat["inbox_p50"] <= lat["inbox_p99"] and 0 < lat["taken_to_first_token_p50"] < 60_000
    assert _raw(server, "GET", "/health?latency_since=x")[0] == 400
    assert [m.id for m in client.models.list().data] == [MODEL]
    for auth in (None, "Bearer wrong", f"Basic {KEY}"):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")):
            status, _, body = _raw(server, method, path, {"model": MODEL, "prompt": "hi"}, {"Authorization": auth})
            assert status == 401 and body["error"]["code"] == "invalid_api_key", (auth, path, body)
    bad = openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="nope", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# ---------------------------------------------------------------------------------------------------- greedy = LLM
def test_chat_greedy_equals_llm_chat(server, client, llm):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    want = llm.chat(msgs, _greedy(24))[0]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == want.outputs[0].text
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    assert r.choices[0].finish_reason == want.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.outputs[0].token_ids)
    s = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    text, finish, usage, _ = _stream_text(s)
    assert (text, finish) == (want.outputs[0].text, want.outputs[0].finish_reason)
    assert usage.completion_tokens == r.usage.completion_tokens and usage.prompt_tokens == r.usage.prompt_tokens


def test_completion_greedy_equals_llm_generate(server, client, llm):
    prompt = "The three primary colors are"
    want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 20
    text, finish, usage, n = _stream_text(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True, extra_body={"ignore_eos": True}),
        "completion")
    assert (text, finish, usage) == (want.text, "length", None) and n >= 2
    ids = llm.tokenizer.encode(prompt)  # a token-id prompt answers the same
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.text


def test_seeded_sampling_and_stop_strings(server, client, llm):
    """A seeded sampled answer equals LLM.generate's (the seed, not the batch, fixes the draw); stop strings cut it
    where LLM.generate does, streamed or not."""
    prompt, kw = "Once upon a time", dict(temperature=1.0, seed=1, max_tokens=32)
    sp = dict(kw, ignore_eos=True)
    full = llm.generate([prompt], SamplingParams(**sp))[0].outputs[0].text
    r = client.completions.create(model=MODEL, prompt=prompt, extra_body={"ignore_eos": True}, **kw)
    assert r.choices[0].text == full
    k = next(i for i in range(len(full) // 3, len(full) - 2) if "\ufffd" not in full[i:i + 2])
    stop = full[k:k + 2]  # two characters from inside the answer
    want = llm.generate([prompt], SamplingParams(stop=[stop], **sp))[0].outputs[0].text
    assert want == full[:full.find(stop)]
    r = client.completions.create(model=MODEL, prompt=prompt, stop=[stop], extra_body={"ignore_eos": True}, **kw)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    text, finish, _, _ = _stream_text(client.completions.create(model=MODEL, prompt=prompt, stop=stop, stream=True,
                                                                extra_body={"ignore_eos": True}, **kw), "completion")
    assert (text, finish) == (want, "stop")


def test_logprobs(server, client, llm):
    msgs = [{"role": "user", "content": "Name a color."}]
    want = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=8, logprobs=3))[0].outputs[0]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == want.text
    ids = [t for t in want.token_ids if t not in llm.tokenizer.eot_ids]
    assert len(content) == len(ids)
    for lp, t, d in zip(content, ids, want.logprobs):
        assert lp.logprob == pytest.approx(d[t].logprob, abs=1e-4)
        assert len(lp.top_logprobs) == 3 and lp.top_logprobs[0].logprob >= lp.top_logprobs[-1].logprob
    c = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for d, v in zip(lp.top_logprobs, lp.token_logprobs):  # keyed by text: byte tokens may share the key "\ufffd"
        assert 1 <= len(d) <= 2 and max(d.values()) == pytest.approx(v)  # greedy: the chosen token is the best


# ---------------------------------------------------------------------------------------------------- concurrency
def test_32_concurrent_streams(server, client, llm):
    n = 32
    convs = [[{"role": "user", "content": f"Write the number {i} in words."}] for i in range(n)]
    want = [o.outputs[0].text for o in llm.chat(convs, _greedy(16))]

    def one(i):
        s = client.chat.completions.create(model=MODEL, messages=convs[i], max_tokens=16, temperature=0,
                                           stream=True)
        return _stream_text(s)[0]

    before = _raw(server, "GET", "/health")[2]["loop"]
    with concurrent.futures.ThreadPoolExecutor(n) as ex:
        got = list(ex.map(one, range(n), timeout=240))
    assert got == want
    health = _raw(server, "GET", "/health")[2]
    assert health["running"] == 0
    loop = health["loop"]  # the scheduler's own account: decode calls ran, with slots busy, taking time
    assert loop["decode_calls"] > before["decode_calls"] and loop["decode_s"] > before["decode_s"] > 0
    assert loop["busy_slot_calls"] - before["busy_slot_calls"] >= n  # each request sat in a slot for >= 1 call
    assert 0 < loop["occupancy"] <= 1 and loop["admit_s"] > 0


def test_cancelled_stream_frees_its_slot(server, client):
    before = _raw(server, "GET", "/health")[2]
    s = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=1500, temperature=0,
                                  stream=True, extra_body={"ignore_eos": True})
    it = iter(s)
    for _ in range(3):
        next(it)
    assert _raw(server, "GET", "/health")[2]["running"] == 1
    s.close()  # the client goes away mid-stream
    deadline, load = time.time() + 30, None
    while time.time() < deadline:  # 1500 tokens would take minutes; the slot must free within a round or two
        load = _raw(server, "GET", "/health")[2]
        if load["running"] == 0:
            break
        time.sleep(0.1)
    assert load["running"] == 0 and load["cancelled"] == before["cancelled"] + 1, load
    # a client that leaves while waiting for a non-streamed answer frees its slot too
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "Count:", "max_tokens": 1500,
                                                        "ignore_eos": True}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    deadline = time.time() + 30
    while time.time() < deadline and _raw(server, "GET", "/health")[2]["running"] == 0:
        time.sleep(0.05)
    conn.close()
    while time.time() < deadline:
        load = _raw(server, "GET", "/health")[2]
        if load["running"] == 0:
            break
        time.sleep(0.1)
    assert load["running"] == 0 and load["cancelled"] == before["cancelled"] + 2, load
    # the freed slot serves the next requests: a full batch of them
    with concurrent.futures.ThreadPoolExecutor(SLOTS) as ex:
        outs = list(ex.map(lambda i: client.completions.create(model=MODEL, prompt=f"{i} + {i} =", max_tokens=4,
                                                               temperature=0), range(SLOTS), timeout=120))
    assert all(o.usage.completion_tokens >= 1 for o in outs)


# ---------------------------------------------------------------------------------------------------- bad input
def test_malformed_burst_then_good_request(server, client):
    good_chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    cases = [
        ("/v1/chat/completions", b"{not json", 400, "invalid_json"),
        ("/v1/chat/completions", b"\xff\xfe", 400, "invalid_json"),
        ("/v1/chat/completions", b"[" * 60_000, 400, "invalid_json"),
        ("/v1/chat/completions", [1, 2], 400, None),
        ("/v1/chat/completions", {"messages": good_chat["messages"]}, 400, "missing_required_parameter"),
        ("/v1/chat/completions", {**good_chat, "model": "gpt-4"}, 404, "model_not_found"),
        ("/v1/chat/completions", {**good_chat, "messages": "hi"}, 400, "invalid_type"),
        ("/v1/chat/completions", {**good_chat, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
        ("/v1/chat/completions", {**good_chat, "messages": [{"role": "user", "content": 5}]}, 400, "invalid_type"),
        ("/v1/chat/completions", {**good_chat, "temperature": "hot"}, 400, "invalid_type"),
        ("/v1/chat/completions", {**good_chat, "temperature": 7}, 400, "invalid_value"),
        ("/v1/chat/completions", {**good_chat, "top_p": 0}, 400, "invalid_value"),
        ("/v1/chat/completions", {**good_chat, "max_tokens": 0}, 400, "invalid_value"),
        ("/v1/chat/completions", {**good_chat, "max_tokens": True}, 400, "invalid_type"),
        ("/v1/chat/completions", {**good_chat, "max_tokens": 10 ** 6}, 400, "context_length_exceeded"),
        ("/v1/chat/completions", {**good_chat, "n": 2}, 400, "unsupported_value"),
        ("/v1/chat/completions", {**good_chat, "stop": [1]}, 400, "invalid_type"),
        ("/v1/chat/completions", {**good_chat, "seed": "x"}, 400, "invalid_type"),
        ("/v1/chat/completions", {**good_chat, "top_logprobs": 50, "logprobs": True}, 400, "invalid_value"),
        ("/v1/chat/completions", {**good_chat, "stream_options": {"include_usage": True}}, 400, None),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, None),
        ("/v1/completions", {"model": MODEL, "prompt": [10 ** 9]}, 400, None),
        ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "unsupported_value"),
        ("/v1/completions", {"model": MODEL, "prompt": "word " * 2100}, 400, "context_length_exceeded"),
        ("/v1/completions", {"model": MODEL, "prompt": "x" * 70_000}, 413, "request_too_large"),
    ]
    for path, body, status, code in cases:
        got, _, err = _raw(server, "POST", path, body)
        assert got == status, (path, body if len(str(body)) < 200 else "...", got, err)
        assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
        if code:
            assert err["error"]["code"] == code, (body, err)
    assert _raw(server, "GET", "/v1/nothing")[0] == 404
    assert _raw(server, "GET", "/v1/chat/completions")[0] == 405
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
    r = client.chat.completions.create(**good_chat)
    assert r.choices[0].message.content and r.usage.completion_tokens >= 1
    assert _raw(server, "GET", "/health")[0] == 200


# ---------------------------------------------------------------------------------------------------- queue bound
def test_full_queue_answers_429(llm):
    """In-process, the device thread not started: the inbox fills and the next request gets 429 + Retry-After."""
    from lucebox_jax.serve.app import ServerConfig, create_app
    from lucebox_jax.serve.engine_loop import EngineLoop

    engine = EngineLoop(llm, slots=1, max_len=64, steps_per_call=1, max_queue=2)
    app = create_app(engine, ServerConfig(model_name="tiny"))
    body = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}).encode()

    async def post():
        sent, msgs = [], [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if msgs:
                return msgs.pop()
            await asyncio.sleep(3600)

        async def send(m):
            sent.append(m)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json"),
                                              (b"content-length", str(len(body)).encode())],
                 "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1)}
        await asyncio.wait_for(app(scope, receive, send), 10)
        return sent

    async def main():
        waiting = [asyncio.ensure_future(post()) for _ in range(2)]  # fill the inbox (nothing drains it)
        await asyncio.sleep(0.2)
        assert engine.inbox.qsize() == 2
        sent = await post()
        for t in waiting:
            t.cancel()
        return sent

    sent = asyncio.run(main())
    start = sent[0]
    assert start["status"] == 429 and (b"retry-after", b"1") in start["headers"]
    assert json.loads(sent[1]["body"])["error"]["code"] == "queue_full"


def test_serve_flags_fail_before_loading():
    from lucebox_jax.cli import main

    assert main(["--serve", "--draft", "ngram", "--tree", "8"]) == 2
    assert main(["--serve", "--draft", "ngram", "--num-draft", "auto"]) == 2
    assert main(["--serve", "--port", "70000"]) == 2
    assert main(["--serve", "--batch-size", "0"]) == 2
    assert main(["--serve", "--keep-alive", "0"]) == 2


def test_engine_process_is_the_default_only_with_a_gpu_plugin(tmp_path, monkeypatch):
    """Unless asked either way, the server runs its device loop in a child process only where jax has a GPU plugin
    (found without starting jax here) and JAX_PLATFORMS does not leave the GPU out; `--no-engine-process` parses."""
    import types

    from lucebox_jax.cli import build_parser
    from lucebox_jax.serve import engine_process_default

    plugins = types.ModuleType("jax_plugins")
    plugins.__path__ = [str(tmp_path)]
    monkeypatch.setitem(sys.modules, "jax_plugins", plugins)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert not engine_process_default()  # the namespace, no plugin in it
    (tmp_path / "xla_cuda13").mkdir()
    (tmp_path / "xla_cuda13" / "__init__.py").write_text("")
    assert engine_process_default()
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert not engine_process_default()
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert engine_process_default()
    monkeypatch.setitem(sys.modules, "jax_plugins", None)  # no plugin namespace at all: the import fails
    assert not engine_process_default()
    p = build_parser()
    assert p.parse_args(["--serve"]).engine_process is None
    assert p.parse_args(["--serve", "--no-engine-process"]).engine_process is False
    assert p.parse_args(["--serve", "--engine-process"]).engine_process is True


def test_idle_connection_outlives_pooled_clients_expiry(server):
    """A keep-alive connection idle for 6 s still serves its next request: pooled clients (httpx, the openai client)
    reuse idle connections for up to 5 s, uvicorn's own default; at equal timeouts a reused connection can be closed
    under a new request (an httpx.ReadError in the H200 benchmark at 128 clients, 2026-12-04)."""
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=30)
    try:
        for wait in (0, 6.0):
            time.sleep(wait)
            conn.request("GET", "/health")
            r = conn.getresponse()
            assert r.status == 200 and json.loads(r.read())["slots"] == SLOTS
            assert r.getheader("connection", "").lower() != "close"
    finally:
        conn.close()


def test_speculating_server_answers_like_plain_greedy(model_path, llm):
    """`--draft ngram`: each slot drafts and verifies inside the continuous batch; greedy answers of concurrent
    requests equal plain `LLM.generate`."""
    prompts = ["one two three one two three one two", "The three primary colors are", "a b a b a b a b"]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(prompts, sp)]
    for port in _serve(model_path, "--draft", "ngram", "--num-draft", "3"):
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            got = list(ex.map(lambda p: c.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0,
                                                             extra_body={"ignore_eos": True}).choices[0].text,
                              prompts))
        assert got == want
        st = _raw(port, "GET", "/health")[2]["speculative"]
        assert st["drafter"].startswith("ngram") and st["row_steps"] > 0 and st["mean_accepted"] > 0


@pytest.mark.parametrize("flag", ["--engine-process", "--lookahead"])
def test_server_variants_serve_like_the_default(model_path, llm, flag):
    """`--engine-process`: the model and device loop in a child process; `--lookahead`: each decode call dispatched
    before the last one's tokens are read. Either way greedy answers (concurrent, streamed and not) equal
    LLM.generate's, a cancelled stream frees its slot, and a bad request is a 4xx; /health reports the child's loop."""
    prompt = "The three primary colors are"
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = llm.generate([prompt], sp)[0].outputs[0].text
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    want_chat = llm.chat(msgs, _greedy(12))[0].outputs[0]
    for port in _serve(model_path, flag):
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            got = list(ex.map(lambda _: c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                             extra_body={"ignore_eos": True}).choices[0].text,
                              range(3)))
        assert got == [want] * 3
        text, finish, _, _ = _stream_text(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12,
                                                                    temperature=0, stream=True))
        assert (text, finish) == (want_chat.text, want_chat.finish_reason)
        health = _raw(port, "GET", "/health")[2]
        assert health["status"] == "ok" and health["slots"] == SLOTS
        assert (health.get("engine_process", 0) > 0) == (flag == "--engine-process")
        s = c.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=1500, temperature=0, stream=True,
                                 extra_body={"ignore_eos": True})
        it = iter(s)
        for _ in range(3):
            next(it)
        s.close()
        deadline, load = time.time() + 30, None
        while time.time() < deadline:
            load = _raw(port, "GET", "/health")[2]
            if load["running"] == 0:
                break
            time.sleep(0.1)
        assert load["running"] == 0 and load["cancelled"] >= 1, load
        assert _raw(port, "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -3})[0] == 400
        assert c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text == want
