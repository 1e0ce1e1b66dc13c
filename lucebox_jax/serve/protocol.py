"""OpenAI request validation and response shapes for the server (no HTTP, no device): a JSON body becomes a
`GenRequest` or an `APIError` (status + OpenAI error body); finished or partial completions become OpenAI objects.

Fields follow the OpenAI API (`max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `seed`, `stop`, `n`,
`logprobs` / `top_logprobs`, `stream`, `stream_options.include_usage`) plus vLLM's extensions `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`. Unknown fields are ignored (as vLLM does); fields we cannot honour with a
non-default value (`n` > 1, `echo`, `suffix`, `best_of` > 1, penalties, `logit_bias`, `tools`, a JSON
`response_format`) are a 400.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit (completions allow 5; we allow 20 as vLLM does)
MAX_STOP = 16


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 etype: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.etype = etype or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.etype, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


@dataclasses.dataclass
class GenRequest:
    """A validated request: what to prompt with (text, chat messages or token ids) and how to sample."""

    kind: str  # "chat" | "completion"
    model: str
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = None  # None: up to the end of the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives per position (0: only the chosen token's); None: no logprobs
    stream: bool = False
    include_usage: bool = False


# ---------------------------------------------------------------------------------------------------- field checks
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise bad(f"'{name}' must be an integer, got {type(v).__name__}", name, "invalid_type")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise bad(f"'{name}' must be {rng}, got {v}", name)
    return v


def _num(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v):
        raise bad(f"'{name}' must be a number, got {type(v).__name__}", name, "invalid_type")
    if v < lo or v > hi or (lo_open and v == lo):
        raise bad(f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", name)
    return float(v)


def _bool(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean, got {type(v).__name__}", name, "invalid_type")
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(v) > MAX_STOP:
        raise bad(f"'stop' holds at most {MAX_STOP} strings, got {len(v)}", "stop")
    return [s for s in v if s]


def _unsupported(body: dict):
    n = body.get("n")
    if n is not None and n != 1:
        if not _is_int(n):
            raise bad(f"'n' must be an integer, got {type(n).__name__}", "n", "invalid_type")
        raise bad(f"n={n} is not supported (one choice per request); send the request {n} times with different "
                  "seeds", "n", "unsupported_value")
    best_of = body.get("best_of")
    if best_of not in (None, 1):
        raise bad("'best_of' other than 1 is not supported", "best_of", "unsupported_value")
    for name in ("presence_penalty", "frequency_penalty"):
        v = body.get(name)
        if v not in (None, 0, 0.0):
            raise bad(f"'{name}' is not supported (use 'repetition_penalty'); send 0 or leave it out", name,
                      "unsupported_value")
    if body.get("logit_bias"):
        raise bad("'logit_bias' is not supported", "logit_bias", "unsupported_value")
    if body.get("echo"):
        raise bad("'echo' is not supported", "echo", "unsupported_value")
    if body.get("suffix"):
        raise bad("'suffix' is not supported", "suffix", "unsupported_value")
    rf = body.get("response_format")
    if rf is not None and (not isinstance(rf, dict) or rf.get("type") != "text"):
        raise bad("'response_format' other than {'type': 'text'} is not supported", "response_format",
                  "unsupported_value")
    if body.get("tools") or body.get("functions"):
        raise bad("tool calling is not supported", "tools", "unsupported_value")


def _messages(v) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages", "invalid_type")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", where, "invalid_type")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"{where}.role must be one of system, developer, user, assistant, tool; got {role!r}",
                      f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"{where}.content parts must be {{'type': 'text', 'text': ...}} (no images or audio)",
                              f"{where}.content", "unsupported_value")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise bad(f"{where}.content must be a string or a list of text parts", f"{where}.content",
                      "invalid_type")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _prompt(v) -> tuple[str | None, list[int] | None]:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # a batch of one
    if isinstance(v, str):
        if not v:
            raise bad("'prompt' must not be empty", "prompt")
        return v, None
    if isinstance(v, list) and v and all(_is_int(t) for t in v):
        return None, list(v)
    if isinstance(v, list) and len(v) > 1 and all(isinstance(p, (str, list)) for p in v):
        raise bad("a list of several prompts is not supported; send one request per prompt", "prompt",
                  "unsupported_value")
    raise bad("'prompt' must be a non-empty string or a non-empty list of token ids", "prompt", "invalid_type")


def parse_request(body, kind: str, model_names: tuple[str, ...]) -> GenRequest:
    """Validate an OpenAI chat (`kind` "chat") or completions ("completion") body; raises APIError."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_type")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required (a string; see GET /v1/models)", "model", "missing_required_parameter")
    if model not in model_names:
        raise APIError(404, f"The model '{model}' does not exist; this server serves {', '.join(model_names)}",
                       "model", "model_not_found")
    _unsupported(body)
    r = GenRequest(kind=kind, model=model)
    if kind == "chat":
        if "messages" not in body:
            raise bad("'messages' is required", "messages", "missing_required_parameter")
        r.messages = _messages(body["messages"])
        mct = _int(body, "max_completion_tokens", 1)
        r.max_tokens = mct if mct is not None else _int(body, "max_tokens", 1)
        if _bool(body, "logprobs"):
            top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
            r.logprobs = top or 0
        elif body.get("top_logprobs") is not None:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    else:
        if "prompt" not in body:
            raise bad("'prompt' is required", "prompt", "missing_required_parameter")
        r.prompt, r.prompt_ids = _prompt(body["prompt"])
        r.max_tokens = _int(body, "max_tokens", 1)
        r.logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS)
    r.temperature = _num(body, "temperature", 1.0, 0.0, 2.0)
    r.top_p = _num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    r.min_p = _num(body, "min_p", 0.0, 0.0, 1.0)
    r.repetition_penalty = _num(body, "repetition_penalty", 1.0, 0.0, 10.0, lo_open=True)
    top_k = _int(body, "top_k", -1)
    r.top_k = 0 if top_k in (None, -1) else top_k
    r.seed = _int(body, "seed")
    if r.seed is not None:
        r.seed &= 0x7FFFFFFF  # any 64-bit seed is accepted; the device key takes 31 bits
    r.stop = _stop(body)
    r.ignore_eos = _bool(body, "ignore_eos")
    r.stream = _bool(body, "stream")
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("'stream_options' must be an object", "stream_options", "invalid_type")
        if not r.stream:
            raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
        r.include_usage = _bool(so, "include_usage")
    return r


# ---------------------------------------------------------------------------------------------------- responses
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(n_prompt: int, n_completion: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


def logprobs_object(kind: str, entries: list[tuple[str, float, list[tuple[str, float]]]], text_start: int = 0):
    """entries: (token text, its logprob, [(alternative text, logprob), ...] best first) per generated token."""
    if kind == "chat":
        def item(t, lp):
            return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

        return {"content": [dict(item(t, lp), top_logprobs=[item(a, alp) for a, alp in alts])
                            for t, lp, alts in entries]}
    offsets, pos = [], text_start
    for t, _, _ in entries:
        offsets.append(pos)
        pos += len(t)
    tops = []
    for _, _, alts in entries:
        d = {}
        for a, alp in alts:  # keyed by text: tokens with the same text (e.g. partial UTF-8 bytes) keep the best
            d.setdefault(a, alp)
        tops.append(d)
    return {"tokens": [t for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": tops, "text_offset": offsets}


def completion_body(kind: str, rid: str, model: str, text: str, finish_reason: str, n_prompt: int,
                    n_completion: int, logprobs=None) -> dict:
    choice = {"index": 0, "logprobs": logprobs, "finish_reason": finish_reason}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
        obj = "chat.completion"
    else:
        choice["text"] = text
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage(n_prompt, n_completion)}


def chunk(kind: str, rid: str, created: int, model: str, text: str | None, finish_reason: str | None = None,
          logprobs=None, role: bool = False, with_usage: bool = False) -> dict:
    """One streamed chunk; `role` marks the chat stream's first chunk; `with_usage` adds "usage": null (as OpenAI
    does on every chunk when stream_options.include_usage is set)."""
    if kind == "chat":
        delta = {"role": "assistant", "content": text or ""} if role else ({} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if with_usage:
        out["usage"] = None
    return out


def usage_chunk(kind: str, rid: str, created: int, model: str, n_prompt: int, n_completion: int) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(n_prompt, n_completion)}
