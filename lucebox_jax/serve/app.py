"""The HTTP side (Starlette): OpenAI routes over an `EngineLoop`.

GET /health (never needs the key), GET /v1/models, POST /v1/completions, POST /v1/chat/completions. Each POST is
read with a size cap, validated (`protocol.parse_request`), tokenized here (chat template of the model), checked
against the context, and submitted to the device loop; the answer is one JSON object or server-sent events exactly
as OpenAI streams them. Every failure is an OpenAI-style error body with a 4xx/5xx status; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import os
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import LuceboxError
from ..sampling import SamplingParams
from . import protocol as P
from .engine_loop import EngineLoop, QueueFull


@dataclasses.dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    retry_after_s: int = 1


def error_response(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def create_app(engine: EngineLoop, cfg: ServerConfig) -> Starlette:
    names = (cfg.model_name,)
    created = int(time.time())

    def check_key(request: Request):
        if cfg.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), cfg.api_key.encode()):
            raise P.APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'", None,
                             "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def read_json(request: Request):
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise P.bad("bad Content-Length header", None, "invalid_request")
            if int(length) > cfg.max_body_bytes:
                raise P.APIError(413, f"request body over {cfg.max_body_bytes} bytes", None, "request_too_large")
        body, size = bytearray(), 0
        async for part in request.stream():
            size += len(part)
            if size > cfg.max_body_bytes:
                raise P.APIError(413, f"request body over {cfg.max_body_bytes} bytes", None, "request_too_large")
            body += part
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as e:  # (UnicodeDecodeError is a ValueError; nesting too deep)
            raise P.bad(f"We could not parse the JSON body of your request: {e}", None, "invalid_json") from None

    def tokenize(gen: P.GenRequest) -> tuple[list[int], str | None]:
        tok, vocab = engine.tokenizer, engine.vocab_size
        if gen.prompt_ids is not None:
            bad_ids = [t for t in gen.prompt_ids if not 0 <= t < vocab]
            if bad_ids:
                raise P.bad(f"token id {bad_ids[0]} is outside the vocabulary (0..{vocab - 1})", "prompt")
            return gen.prompt_ids, None
        text = gen.prompt
        if gen.messages is not None:
            try:
                text = tok.apply_chat_template(gen.messages, add_generation_prompt=True)
            except Exception as e:  # noqa: BLE001 - a template's own error (e.g. role order) is the client's
                raise P.bad(f"the chat template refused these messages: {e}", "messages") from None
        ids = tok.encode(text)
        if not ids:
            raise P.bad("the prompt has no tokens", "messages" if gen.messages is not None else "prompt")
        return ids, text

    def make_params(gen: P.GenRequest, n_prompt: int) -> tuple[SamplingParams, int]:
        ctx = engine.max_len
        param = "messages" if gen.kind == "chat" else "prompt"
        if n_prompt >= ctx:
            raise P.bad(f"This model's maximum context length is {ctx} tokens; the prompt has {n_prompt} tokens "
                        "(prompt plus at least one generated token must fit)", param, "context_length_exceeded")
        max_new = gen.max_tokens if gen.max_tokens is not None else ctx - n_prompt
        if n_prompt + max_new > ctx:
            raise P.bad(f"This model's maximum context length is {ctx} tokens; the prompt has {n_prompt} tokens "
                        f"and max_tokens asks for {max_new} more ({n_prompt + max_new})", "max_tokens",
                        "context_length_exceeded")
        seed = gen.seed if gen.seed is not None else int.from_bytes(os.urandom(4), "little") >> 1
        try:
            params = SamplingParams(max_tokens=max_new, temperature=gen.temperature, top_k=gen.top_k,
                                    top_p=gen.top_p, min_p=gen.min_p, repetition_penalty=gen.repetition_penalty,
                                    seed=seed, stop=gen.stop, ignore_eos=gen.ignore_eos, logprobs=gen.logprobs)
        except LuceboxError as e:
            raise P.bad(str(e)) from None
        return params, max_new

    async def generate(request: Request, kind: str) -> Response:
        check_key(request)
        gen = P.parse_request(await read_json(request), kind, names)
        ids, text = tokenize(gen)
        params, max_new = make_params(gen, len(ids))
        aloop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def sink(ev):  # called on the device thread
            aloop.call_soon_threadsafe(events.put_nowait, ev)

        job = engine.make_job(ids, params, max_new, sink, gen.stream, text)
        try:
            engine.submit(job)
        except QueueFull:
            raise P.APIError(429, "the server's queue is full; retry shortly", None, "queue_full",
                             "rate_limit_exceeded", headers={"Retry-After": str(cfg.retry_after_s)}) from None
        rid = P.new_id(kind)
        if gen.stream:
            return StreamingResponse(stream_events(gen, rid, job, events, len(ids)), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        ev = await wait_or_disconnect(request, job, events)
        if ev is None:
            return Response(status_code=499)  # nobody is listening any more
        if ev[0] == "error":
            raise P.APIError(500, ev[1], None, "internal_error")
        _, out_text, finish, n_comp, entries = ev
        lp = P.logprobs_object(kind, entries) if entries is not None else None
        return JSONResponse(P.completion_body(kind, rid, gen.model, out_text, finish, len(ids), n_comp, lp))

    async def wait_or_disconnect(request: Request, job, events: asyncio.Queue):
        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        got = asyncio.ensure_future(events.get())
        gone = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({got, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not got.done():
                got.cancel()
                job.cancel()
        return got.result() if got.done() and not got.cancelled() else None

    async def stream_events(gen: P.GenRequest, rid: str, job, events: asyncio.Queue, n_prompt: int):
        kind, model, usage_on = gen.kind, gen.model, gen.include_usage
        created_at = int(time.time())

        def chunk(text, finish=None, lp=None, role=False):
            return _sse(P.chunk(kind, rid, created_at, model, text, finish, lp, role, usage_on))

        try:
            if kind == "chat":
                yield chunk("", role=True)
            sent = ""
            while True:
                ev = await events.get()
                if ev[0] == "text":
                    sent += ev[1]
                    yield chunk(ev[1])
                    continue
                if ev[0] == "error":
                    yield _sse(P.APIError(500, ev[1], None, "internal_error").body())
                    break
                _, text, finish, n_comp, entries = ev
                rest = text[len(sent):] if text.startswith(sent) else ""
                if entries is not None:
                    yield chunk(rest, lp=P.logprobs_object(kind, entries))
                elif rest:
                    yield chunk(rest)
                yield chunk(None, finish)
                if usage_on:
                    yield _sse(P.usage_chunk(kind, rid, created_at, model, n_prompt, n_comp))
                break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()  # a client gone mid-stream frees its slot; after "done" this changes nothing

    async def chat(request: Request):
        return await generate(request, "chat")

    async def completions(request: Request):
        return await generate(request, "completion")

    async def models(request: Request):
        check_key(request)
        return JSONResponse({"object": "list", "data": [
            {"id": n, "object": "model", "created": created, "owned_by": "lucebox_jax",
             "max_model_len": engine.max_len} for n in names]})

    async def health(request: Request):
        if not engine.alive:
            return JSONResponse({"status": "error", "detail": "the device loop stopped"}, status_code=503)
        try:
            since = int(request.query_params.get("latency_since", 0))
        except ValueError:
            raise P.APIError(400, "latency_since must be an integer", "latency_since", "invalid_value") from None
        return JSONResponse({"status": "ok", **engine.load(since)})

    async def api_error(request: Request, exc: P.APIError):
        return error_response(exc)

    async def http_error(request: Request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(P.APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                         None, code))

    async def server_error(request: Request, exc: Exception):
        return error_response(P.APIError(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_error"))

    routes = [Route("/health", health), Route("/v1/models", models),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={P.APIError: api_error, HTTPException: http_error,
                                                        Exception: server_error})
