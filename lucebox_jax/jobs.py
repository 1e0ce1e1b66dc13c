"""Batch generation jobs over JSONL: `python run.py --input requests.jsonl --output results.jsonl`.

Input: one JSON object a line, `{"id": ..., "prompt": "..."}` or `{"id": ..., "messages": [{"role", "content"}]}`
(`custom_id` is accepted for `id`), with optional sampling fields (max_tokens, temperature, top_p, top_k, min_p, seed,
stop, repetition_penalty, stop_token_ids, ignore_eos) overriding the command line's values. Blank lines are ignored.

Output: one JSON object a line, written (flushed and fsync'ed) as each request finishes:
  {"id", "text", "finish_reason", "usage": {"prompt_tokens", "completion_tokens", "total_tokens"}[, "token_ids"]}
or, for a request that cannot run, {"id" (null when unknown), "line", "error": {"type", "message"}}.

Resume: a rerun of the same command skips what the output already holds (complete, parseable lines only; a torn last
line from a crash is cut off first, a whole last record missing its newline is kept; both reported): requests by id,
and line-level errors (bad JSON, missing or duplicate id) by line number. So an interrupted job loses only its
in-flight requests and a rerun duplicates nothing. One job owns an output at a time (`OutputLock`, an OS lock).

Generation goes through `scheduler.Scheduler` (continuous batching over a fixed number of slots).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import sys
import time
from typing import Iterator

from .errors import InvalidSamplingParamsError, LuceboxError
from .sampling import SEED_LIMIT, SamplingParams, is_int, utf8_ok

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "repetition_penalty",
                   "stop_token_ids", "ignore_eos")
# errors recorded by input line (the request has no usable id of its own): resumed by line number
LINE_ERRORS = ("invalid_json", "invalid_request", "missing_id", "invalid_id", "duplicate_id")


class JobError(LuceboxError):
    """The job cannot start (missing input, unwritable output, bad flags)."""


# ---------------------------------------------------------------------------------------------------- parsing
@dataclasses.dataclass
class Item:
    """One non-blank input line: a request to run or an error to record."""

    line: int
    id: object = None
    key: str | None = None  # canonical id (json.dumps), for duplicate detection and resume
    prompt: str | None = None
    messages: list | None = None
    params: SamplingParams | None = None
    error: tuple[str, str] | None = None  # (type, message)
    seq: int = -1  # position among this run's pending items (for --ordered)


def id_key(v) -> str:
    return json.dumps(v, ensure_ascii=False, sort_keys=True)


def _valid_id(v) -> bool:
    return (isinstance(v, str) and v != "") or (isinstance(v, int) and not isinstance(v, bool))


def parse_line(line_no: int, text: str, defaults: dict, seen: dict[str, int]) -> Item:
    """Parse and validate one input line (no tokenizer needed). `seen`: id key -> first line, updated here."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return Item(line_no, error=("invalid_json", f"line {line_no}: invalid JSON: {e}"))
    if not isinstance(obj, dict):
        return Item(line_no, error=("invalid_request", f"line {line_no}: a request is a JSON object, got "
                                                       f"{type(obj).__name__}"))
    rid = obj.get("id", obj.get("custom_id"))
    if rid is None:
        return Item(line_no, error=("missing_id", f"line {line_no}: no 'id' (or 'custom_id')"))
    if not _valid_id(rid):
        return Item(line_no, error=("invalid_id", f"line {line_no}: 'id' must be a non-empty string or an integer, "
                                                  f"got {rid!r:.80}"))
    if isinstance(rid, str) and not utf8_ok(rid):
        return Item(line_no, error=("invalid_id", f"line {line_no}: 'id' {rid!r:.80} is not valid UTF-8 text"))
    key = id_key(rid)
    if key in seen:
        return Item(line_no, id=rid, key=key,
                    error=("duplicate_id", f"line {line_no}: id {rid!r} already used on line {seen[key]}"))
    seen[key] = line_no
    it = Item(line_no, id=rid, key=key)
    has_p, has_m = "prompt" in obj, "messages" in obj
    if has_p == has_m:
        it.error = ("invalid_request", f"line {line_no}: give exactly one of 'prompt' and 'messages'"
                    if has_p else f"line {line_no}: no 'prompt' or 'messages'")
        return it
    if has_p:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            it.error = ("invalid_request", f"line {line_no}: 'prompt' must be a non-empty string")
            return it
        if not utf8_ok(obj["prompt"]):
            it.error = ("invalid_request", f"line {line_no}: 'prompt' is not valid UTF-8 text (a lone surrogate "
                                           "escape such as \\ud800)")
            return it
        it.prompt = obj["prompt"]
    else:
        msgs = obj["messages"]
        if (not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs)):
            it.error = ("invalid_request", f"line {line_no}: 'messages' must be a non-empty list of "
                                           "{\"role\": str, \"content\": str} objects")
            return it
        if not all(utf8_ok(m["role"]) and utf8_ok(m["content"]) for m in msgs):
            it.error = ("invalid_request", f"line {line_no}: 'messages' hold text that is not valid UTF-8 (a lone "
                                           "surrogate escape such as \\ud800)")
            return it
        it.messages = msgs
    kw = dict(defaults)
    kw.update({k: obj[k] for k in SAMPLING_FIELDS if k in obj})
    try:  # SamplingParams checks every field's type and range
        it.params = SamplingParams(**kw)
    except (InvalidSamplingParamsError, TypeError) as e:
        it.error = ("invalid_sampling_params", f"line {line_no}: {e}")
    return it


def read_input(path: str, defaults: dict) -> list[Item]:
    if not os.path.isfile(path):
        raise JobError(f"input file not found: {path}")
    items, seen = [], {}
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                items.append(Item(n, error=("invalid_json", f"line {n}: not UTF-8: {e}")))
                continue
            if text.strip():
                items.append(parse_line(n, text, defaults, seen))
    return items


# ---------------------------------------------------------------------------------------------------- resume
def scan_output(path: str, repair: bool = True, report: list | None = None) -> tuple[set[str], set[int]]:
    """Ids and error lines already recorded in `path`, changing nothing but a torn last line, and saying so in
    `report` (a list of messages). The last line without its newline: kept (the newline added) when it is a whole
    JSON record, cut off when not (a crash mid-write), when `repair`. Lines that are not records are left as they are
    and count as not done, so their requests run again."""
    done_ids: set[str] = set()
    done_lines: set[int] = set()
    report = report if report is not None else []
    if not os.path.exists(path):
        return done_ids, done_lines
    with open(path, "rb") as f:
        data = f.read()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        tail = data[end:]
        whole = _record(tail) is not None
        if repair:
            with open(path, "r+b") as f:
                if whole:
                    f.seek(0, os.SEEK_END)
                    f.write(b"\n")
                else:
                    f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
        if whole:
            end = len(data)
            data += b"\n"
            report.append(f"{path}: the last record had no newline; {'added it' if repair else 'it counts'}")
        else:
            report.append(f"{path}: {'cut off' if repair else 'ignoring'} a torn last line ({len(tail)} bytes, "
                          f"an interrupted write): {tail[:60]!r}")
    seen_ids: dict[str, int] = {}
    bad_lines = []
    for n, raw in enumerate(data[:end].splitlines(), start=1):
        rec = _record(raw)
        if rec is None:
            if raw.strip():
                bad_lines.append(n)
            continue
        err = rec.get("error")
        rid = rec.get("id", rec.get("custom_id"))
        if isinstance(err, dict) and (err.get("type") in LINE_ERRORS or rid is None):
            if isinstance(rec.get("line"), int):
                done_lines.add(rec["line"])
        elif _valid_id(rid):
            k = id_key(rid)
            seen_ids[k] = seen_ids.get(k, 0) + 1
            done_ids.add(k)
    if bad_lines:
        shown = ", ".join(map(str, bad_lines[:5])) + (" ..." if len(bad_lines) > 5 else "")
        report.append(f"{path}: {len(bad_lines)} line(s) are not JSON records (line {shown}); left as they are")
    dups = [k for k, c in seen_ids.items() if c > 1]
    if dups:
        report.append(f"{path}: {len(dups)} id(s) appear more than once (e.g. {dups[0]}); left as they are")
    return done_ids, done_lines


def _record(raw: bytes) -> dict | None:
    try:
        rec = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return rec if isinstance(rec, dict) else None


def is_done(it: Item, done_ids: set[str], done_lines: set[int]) -> bool:
    if it.error is not None and (it.error[0] in LINE_ERRORS or it.key is None):
        return it.line in done_lines
    return it.key in done_ids


# ---------------------------------------------------------------------------------------------------- output
class _Signals:
    """SIGINT/SIGTERM raise KeyboardInterrupt, but never in the middle of writing a record."""

    def __init__(self):
        self.critical = 0
        self.pending = False
        self.old = {}

    def __enter__(self):
        for s in (signal.SIGINT, signal.SIGTERM):
            try:
                self.old[s] = signal.signal(s, self._handler)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc):
        for s, h in self.old.items():
            signal.signal(s, h)

    def _handler(self, signum, frame):
        if self.critical:
            self.pending = True
        else:
            raise KeyboardInterrupt

    def enter(self):
        self.critical += 1

    def leave(self):
        self.critical -= 1
        if self.pending and not self.critical:
            self.pending = False
            raise KeyboardInterrupt


class OutputLock:
    """One job owns an output file at a time: an exclusive OS lock (flock) on the open file, held for the whole job
    and released by the OS when the process ends, also on a kill. A second job refuses at once. Also refuses, before
    anything is written, an output that is a folder, unwritable, not a regular file, or the input file itself under
    another name (a symlink or hard link: same device and inode)."""

    def __init__(self, path: str, input_path: str | None = None):
        self.path = path
        self.input_path = input_path
        self.fd: int | None = None

    def _same_as_input(self, st) -> bool:
        if self.input_path is None:
            return False
        try:
            si = os.stat(self.input_path)
        except OSError:
            return False
        return (si.st_dev, si.st_ino) == (st.st_dev, st.st_ino)

    def __enter__(self) -> "OutputLock":
        import fcntl
        import stat

        path = self.path
        if os.path.exists(path):
            st = os.stat(path)
            if stat.S_ISDIR(st.st_mode):
                raise JobError(f"--output {path} is a folder; give a file path")
            if not stat.S_ISREG(st.st_mode):
                raise JobError(f"--output {path} is not a regular file")
            if self._same_as_input(st):
                raise JobError(f"--output {path} is the input file {self.input_path} under another name")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o666)
        except OSError as e:
            raise JobError(f"cannot write --output {path}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise JobError(f"--output {path} is in use by another job (it holds the file's lock); wait for it to "
                           "finish or give another --output") from None
        if self._same_as_input(os.fstat(fd)):  # swapped in between: still nothing written
            os.close(fd)
            raise JobError(f"--output {path} is the input file {self.input_path} under another name")
        self.fd = fd
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)  # closing the file releases the lock
            self.fd = None


class ResultWriter:
    """Appends records to the output; `ordered`: in `seq` order, each written as soon as all before it are."""

    def __init__(self, path: str, ordered: bool, signals: _Signals | None = None, fd: int | None = None):
        self.path = path
        self.fd = fd  # the locked output (OutputLock): written through a duplicate of it
        self.ordered = ordered
        self.signals = signals
        self.f = None
        self.next_seq = 0
        self.pending: dict[int, dict] = {}
        self.written = 0
        self.dirty = False

    def _open(self):
        if self.f is None:
            self.f = (os.fdopen(os.dup(self.fd), "a", encoding="utf-8") if self.fd is not None
                      else open(self.path, "a", encoding="utf-8"))

    def put(self, seq: int, rec: dict) -> int:
        """Queue a record; returns how many records got written by this call."""
        if not self.ordered:
            self._write(rec)
            return 1
        self.pending[seq] = rec
        n = 0
        while self.next_seq in self.pending:
            self._write(self.pending.pop(self.next_seq))
            self.next_seq += 1
            n += 1
        return n

    def _write(self, rec: dict):
        self._open()
        line = json.dumps(rec, ensure_ascii=False) + "\n"
        if not utf8_ok(line):  # never expected (inputs are checked), but a record must not stop the job
            line = json.dumps(rec) + "\n"
        if self.signals:
            self.signals.enter()
        try:
            self.f.write(line)
            self.f.flush()
        finally:
            if self.signals:
                self.signals.leave()
        self.written += 1
        self.dirty = True

    def commit(self):
        """fsync what was written (once per scheduler round, not once per record)."""
        if self.f is not None and self.dirty:
            os.fsync(self.f.fileno())
            self.dirty = False

    def close(self):
        if self.f is not None:
            self.commit()
            self.f.close()
            self.f = None


def error_record(it: Item, etype: str, msg: str) -> dict:
    return {"id": it.id, "line": it.line, "error": {"type": etype, "message": msg}}


# ---------------------------------------------------------------------------------------------------- job
@dataclasses.dataclass
class JobConfig:
    input: str
    output: str
    token_ids: bool = False
    ordered: bool = False
    quiet: bool = False
    slots: int | None = None
    max_context: int | None = None
    steps_per_call: int | None = None
    seed: int = 0
    defaults: dict = dataclasses.field(default_factory=dict)  # SamplingParams fields
    spec_max_slots: int | None = None  # with a drafter (LLM(draft=...)): no speculation above this many slots
    spec_min_accept: float | None = None  # a slot stops speculating below this acceptance (spec_batch.py)
    lookahead: bool = False  # the scheduler dispatches each decode call before reading the last one's tokens

    def __post_init__(self):  # the Python API gets the same strict checks as the command line
        for name, lo in (("slots", 1), ("max_context", 2), ("steps_per_call", 1), ("spec_max_slots", 1)):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < lo):
                raise JobError(f"{name} must be an integer >= {lo}, got {v!r}")
        if not is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT:
            raise JobError(f"seed must be an integer in 0..2**64-1, got {self.seed!r}")
        if "seed" in self.defaults:
            raise JobError("defaults must not hold a seed: each request derives its own from JobConfig.seed")
        SamplingParams(**self.defaults)


@dataclasses.dataclass
class JobSummary:
    ok: int = 0
    failed: int = 0
    skipped: int = 0
    lost: int = 0  # in flight when interrupted
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_seconds: float = 0.0
    gen_seconds: float = 0.0
    load_seconds: float = 0.0
    compile_seconds: float = 0.0
    interrupted: bool = False
    slots: int = 0
    max_context: int = 0
    speculative: dict | None = None  # Scheduler.spec_stats() when the LLM has a drafter

    def line(self) -> str:
        tps = self.completion_tokens / self.gen_seconds if self.gen_seconds > 0 else 0.0
        s = (f"job: {self.ok} ok, {self.failed} failed, {self.skipped} skipped (already in output)"
             f"{f', {self.lost} in flight lost (interrupted; rerun to finish)' if self.interrupted else ''} | "
             f"tokens: {self.prompt_tokens} prompt, {self.completion_tokens} completion | {tps:.1f} tok/s | "
             f"wall {self.wall_seconds:.1f} s")
        if self.slots:
            s += (f" (load {self.load_seconds:.1f} s, compile {self.compile_seconds:.1f} s, generation "
                  f"{self.gen_seconds:.1f} s; {self.slots} slots, context {self.max_context})")
        return s


def default_shape(engine, slots: int | None = None, max_context: int | None = None) -> tuple[int, int]:
    """(slots, max_context) for this device: on the CPU 8 slots and 2048 tokens; on a GPU 4096 tokens and as many
    slots (<= 128, a power of two) as half the free memory holds in KV cache."""
    import jax

    cfg = engine.cfg
    gpu = jax.default_backend() != "cpu"
    ctx = min(cfg.max_context, max_context or (4096 if gpu else 2048))
    if slots is None:
        slots = 8
        if gpu:
            try:
                st = jax.devices()[0].memory_stats() or {}
                free = st.get("bytes_limit", 0) - st.get("bytes_in_use", 0)
                item = 2 if cfg.dtype in ("bfloat16", "float16") else 4
                per_slot = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * item * ctx + cfg.vocab_size
                n = int(0.5 * free // max(per_slot, 1))
                slots = max(1, min(128, 1 << max(0, n.bit_length() - 1))) if n > 0 else 1
            except Exception:  # noqa: BLE001 - memory stats are best effort
                slots = 32
    return slots, ctx


def _fmt_id(v) -> str:
    return repr(v) if isinstance(v, str) else str(v)


def run_job(cfg: JobConfig, llm=None, loader=None, log=None) -> tuple[int, JobSummary]:
    """Run a job; returns (exit status, summary). The model is `llm`, or `loader()` (default: the embedded model)
    called only when some request is left to run."""
    t_start = time.perf_counter()
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    summ = JobSummary()
    out_dir = os.path.dirname(os.path.abspath(cfg.output))
    if not os.path.isdir(out_dir):
        raise JobError(f"output folder does not exist: {out_dir}")
    if not os.path.isfile(cfg.input):
        raise JobError(f"input file not found: {cfg.input}")
    if os.path.exists(cfg.output) and os.path.samefile(cfg.input, cfg.output):
        raise JobError(f"--output {cfg.output} is the input file {cfg.input} under another name")
    items = read_input(cfg.input, cfg.defaults)
    if not items:
        log(f"{cfg.input}: no requests (the file is empty); nothing to do")
        return 0, summ
    with OutputLock(cfg.output, cfg.input) as lock:
        notes: list[str] = []
        done_ids, done_lines = scan_output(cfg.output, report=notes)
        for note in notes:
            log(note)
        todo = [it for it in items if not is_done(it, done_ids, done_lines)]
        summ.skipped = len(items) - len(todo)
        if not todo:
            summ.wall_seconds = time.perf_counter() - t_start
            log(f"{cfg.output}: all {len(items)} requests already done; nothing to do")
            log(summ.line())
            return 0, summ
        for i, it in enumerate(todo):
            it.seq = i
        if llm is None:
            if not cfg.quiet:
                log(f"{len(todo)} requests to run ({summ.skipped} already in {cfg.output}); loading the model ...")
            if loader is None:
                from .llm import LLM

                llm = LLM(max_context=cfg.max_context)
            else:
                llm = loader()
            summ.load_seconds = getattr(llm, "load_seconds", 0.0)
        return _generate(cfg, llm, todo, summ, t_start, log, lock.fd)


def derive_seed(job_seed: int, key: str) -> int:
    """A request's seed from the job's --seed and its id: 64 bits of a hash, so every id draws its own stream."""
    return int.from_bytes(hashlib.blake2b(f"{job_seed}:{key}".encode(), digest_size=8).digest(), "little")


def _generate(cfg: JobConfig, llm, todo: list[Item], summ: JobSummary, t_start: float, log, fd: int | None = None):
    import jax

    from .engine import check_fits
    from .llm import Request, find_stop
    from .sampling import static_sampling
    from .scheduler import Scheduler, SlotRequest

    eng, tok = llm.engine, llm.tokenizer
    slots, ctx = default_shape(eng, cfg.slots, cfg.max_context)
    steps = cfg.steps_per_call or (8 if jax.default_backend() == "cpu" else 16)
    max_len = -(-ctx // 64) * 64
    summ.slots, summ.max_context = slots, ctx
    check_fits(eng.cfg, slots, max_len)  # before anything is written: a batch that cannot fit is refused

    def stop_check(r: SlotRequest, ids: list[int]) -> bool:
        stops = r.params.stop
        if not stops:
            return False
        text = tok.decode([t for t in ids if t not in r.stop_ids], skip_special=True)
        return find_stop(text, stops) is not None

    spec = None
    if getattr(llm, "spec", None) is not None:  # speculation per slot (spec_batch.py)
        from .spec_batch import BatchSpec

        spec = BatchSpec.from_decoder(llm.spec, max_slots=cfg.spec_max_slots, min_accept=cfg.spec_min_accept)
    # every request is known: the decode calls compile the one sampling branch they need (no conditional)
    sampling = static_sampling([it.params for it in todo if it.params is not None])
    sched = Scheduler(eng, slots=slots, max_len=max_len, steps_per_call=steps,
                      max_prefill_batch=min(8, slots), stop_check=stop_check, spec=spec, lookahead=cfg.lookahead,
                      sampling=sampling)
    if spec is not None:
        log(f"speculative: {spec.describe()}" if sched.spec is not None else sched.spec_note)
    signals = _Signals()
    writer = ResultWriter(cfg.output, cfg.ordered, signals, fd)
    bar = None
    if not cfg.quiet:
        from tqdm import tqdm

        bar = tqdm(total=len(todo), unit="req", desc="batch", file=sys.stderr, dynamic_ncols=True)
    in_flight: set[int] = set()
    c0 = eng.compile_seconds
    t_gen = time.perf_counter()

    def emit(it: Item, rec: dict, ok: bool):
        if ok:
            summ.ok += 1
        else:
            summ.failed += 1
        n = writer.put(it.seq, rec)
        if bar is not None and n:
            bar.update(n)

    def requests() -> Iterator[SlotRequest]:
        for it in todo:
            if it.error is not None:
                emit(it, error_record(it, *it.error), False)
                continue
            try:
                text = it.prompt if it.prompt is not None else tok.apply_chat_template(it.messages)
                ids = tok.encode(text)
            except LuceboxError as e:
                emit(it, error_record(it, "invalid_messages" if it.messages else "invalid_request",
                                      f"line {it.line}: {e}"), False)
                continue
            except Exception as e:  # noqa: BLE001 - a template bug must not stop the job
                emit(it, error_record(it, "chat_template_error", f"line {it.line}: {type(e).__name__}: {e}"), False)
                continue
            if not ids:
                emit(it, error_record(it, "empty_prompt", f"line {it.line}: the prompt has no tokens"), False)
                continue
            if len(ids) >= ctx:
                emit(it, error_record(it, "prompt_too_long",
                                      f"line {it.line}: prompt has {len(ids)} tokens but the context limit is {ctx} "
                                      "tokens (prompt plus at least one generated token)"), False)
                continue
            bad = [t for t in it.params.stop_token_ids or [] if not 0 <= t < eng.cfg.vocab_size]
            if bad:
                emit(it, error_record(it, "invalid_sampling_params",
                                      f"line {it.line}: stop token id {bad[0]} outside the vocabulary"), False)
                continue
            p = it.params
            if p.seed is None:
                p = dataclasses.replace(p, seed=derive_seed(cfg.seed, it.key))
            in_flight.add(it.seq)
            yield SlotRequest(key=(it, len(ids)), ids=ids, params=p, stop_ids=frozenset(llm.stop_ids_for(p)),
                              max_new=min(p.max_tokens, ctx - len(ids)))
        writer.commit()

    interrupted = False
    try:
        with signals:
            for finished in sched.run(requests()):
                for f in finished:
                    it, n_prompt = f.request.key
                    comp = llm.finish(Request(it.prompt, f.request.ids, f.request.params, f.request.params.seed),
                                       f.token_ids, f.request.max_new)
                    rec = {"id": it.id, "text": comp.text, "finish_reason": comp.finish_reason,
                           "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(comp.token_ids),
                                     "total_tokens": n_prompt + len(comp.token_ids)}}
                    if cfg.token_ids:
                        rec["token_ids"] = comp.token_ids
                    in_flight.discard(it.seq)
                    summ.prompt_tokens += n_prompt
                    summ.completion_tokens += len(comp.token_ids)
                    emit(it, rec, True)
                writer.commit()
                if bar is not None:
                    dt = time.perf_counter() - t_gen - (eng.compile_seconds - c0)
                    bar.set_postfix_str(f"{summ.completion_tokens / max(dt, 1e-9):.1f} tok/s", refresh=False)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if bar is not None:
            bar.close()
        writer.close()
    summ.compile_seconds = eng.compile_seconds - c0
    summ.gen_seconds = max(time.perf_counter() - t_gen - summ.compile_seconds, 1e-9)
    summ.wall_seconds = time.perf_counter() - t_start
    summ.speculative = sched.spec_stats()
    if summ.speculative and "row_steps" in summ.speculative:
        from .speculative import format_stats

        log(format_stats(summ.speculative))
    if interrupted:
        summ.interrupted = True
        summ.lost = len(todo) - summ.ok - summ.failed
        log("interrupted: results so far are in the output; rerun the same command to finish the rest")
    log(summ.line())
    return (130 if interrupted else 0), summ


# ---------------------------------------------------------------------------------------------------- CLI
def add_job_arguments(p):
    g = p.add_argument_group("batch jobs (JSONL)")
    g.add_argument("--input", "-i", help="JSONL file of requests: run them as a batch job (see README)")
    g.add_argument("--output", "-o", help="JSONL file the results are appended to (needed with --input; "
                                         "rerunning skips ids already in it)")
    g.add_argument("--token-ids", action="store_true", help="also write each completion's token ids")
    g.add_argument("--ordered", action="store_true", help="write results in input order (default: as they finish)")
    g.add_argument("--quiet", "-q", action="store_true", help="no progress bar or logs, only the final summary")
    g.add_argument("--batch-size", type=int, default=None,
                   help="decode slots (requests generated at once; default: 8 on the CPU, from free memory on a GPU)")
    g.add_argument("--steps-per-call", type=int, default=None,
                   help="decode steps per device call between checks for finished requests (default: jobs 8 CPU, "
                        "16 GPU; --serve 8)")
    g.add_argument("--spec-max-slots", type=int, default=None,
                   help="with --draft: speculate only with at most this many slots (default 32)")


def job_config_from_args(args) -> JobConfig:
    if args.prompt is not None:
        raise JobError("--prompt and --input are mutually exclusive")
    if not args.output:
        raise JobError("--input needs --output FILE (results are appended to it)")
    if args.batch_size is not None and args.batch_size < 1:
        raise JobError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.steps_per_call is not None and args.steps_per_call < 1:
        raise JobError(f"--steps-per-call must be >= 1, got {args.steps_per_call}")
    if args.max_context is not None and args.max_context < 2:
        raise JobError(f"--max-context must be >= 2, got {args.max_context}")
    if args.spec_max_slots is not None and args.spec_max_slots < 1:
        raise JobError(f"--spec-max-slots must be >= 1, got {args.spec_max_slots}")
    from .spec_batch import cli_chain_error

    if why := cli_chain_error(args):
        raise JobError(why)
    # no seed among the defaults: a request without its own derives one from --seed and its id (derive_seed)
    defaults = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                    min_p=args.min_p, repetition_penalty=args.repeat_penalty, stop=args.stop)
    SamplingParams(**defaults, seed=args.seed)  # bad command-line values fail before anything runs
    return JobConfig(input=args.input, output=args.output, token_ids=args.token_ids, ordered=args.ordered,
                     quiet=args.quiet, slots=args.batch_size, max_context=args.max_context,
                     steps_per_call=args.steps_per_call, seed=args.seed or 0, defaults=defaults,
                     spec_max_slots=args.spec_max_slots, lookahead=bool(getattr(args, "lookahead", False)))


def run_job_from_args(args) -> int:
    cfg = job_config_from_args(args)
    if cfg.quiet:
        import logging

        logging.getLogger().setLevel(logging.ERROR)

    def loader():
        from .llm import LLM

        return LLM(args.model, kernels=args.kernels, max_context=args.max_context,
                   use_checkpoint=not args.no_checkpoint, tensor_parallel=args.tensor_parallel, draft=args.draft,
                   num_draft=args.num_draft)

    status, _ = run_job(cfg, loader=loader)
    return status
