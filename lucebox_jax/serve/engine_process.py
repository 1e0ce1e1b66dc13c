"""`--engine-process`: the model and its device loop (`EngineLoop`) in a child process of their own, so the HTTP
side (asyncio, SSE encoding) and the device loop do not take turns on one interpreter lock.

The parent keeps what a request handler needs at once: the tokenizer (rebuilt from the child's metadata), the
context length, the vocabulary size, and a bound on requests in flight (past it, `QueueFull` and a 429, as the
in-process loop does). Requests go to the child over a command queue; each job's events (streamed text, its end)
come back over an event queue, which a reader thread hands to the job's sink. A client that goes away sends a
cancel. vLLM runs its engine core in a process of its own for the same reason.

The default where jax has a GPU plugin (`serve.engine_process_default`): on the H200 at 32 clients the server gave
0.82-0.86 of the offline job's tok/s this way against 0.78 in-process (2026-12-05, benchmarks/RESULTS.md). In-process
on the CPU, and with `--no-engine-process`.
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing as mp
import queue
import threading
import time
from typing import Callable

from ..sampling import SamplingParams
from .engine_loop import QueueFull


@dataclasses.dataclass(eq=False)
class RemoteJob:
    """The parent's handle of a request running in the child; `cancel()` tells the child."""

    id: int
    ids: list[int]
    params: SamplingParams
    max_new: int
    sink: Callable[[tuple], None]
    stream: bool
    prompt: str | None
    owner: "EngineClient"
    cancelled: bool = False

    def cancel(self):
        if not self.cancelled:
            self.cancelled = True
            if self.owner._forget(self.id):  # still in flight (a cancelled job sends no end event): tell the child
                self.owner._send(("cancel", self.id))


class EngineClient:
    """EngineLoop's interface (make_job, submit, load, alive, tokenizer, max_len, vocab_size) over a child process
    that loads the model and runs the loop. `start()` returns once the child has compiled and warmed up."""

    def __init__(self, llm_kwargs: dict, loop_kwargs: dict, warmup: str | None = None, max_queue: int = 256,
                 start_timeout: float = 3600.0):
        ctx = mp.get_context("spawn")  # (a forked jax runtime is not safe)
        self._cmd = ctx.Queue()
        self._evt = ctx.Queue()
        self.proc = ctx.Process(target=_child_main, args=(llm_kwargs, loop_kwargs, warmup, self._cmd, self._evt),
                                name="lucebox-engine", daemon=True)
        self.max_queue = max_queue
        self.start_timeout = start_timeout
        self._ids = itertools.count()
        self._jobs: dict[int, RemoteJob] = {}
        self._lock = threading.Lock()
        self._replies: dict[int, queue.Queue] = {}
        self.info: dict = {}
        self.tokenizer = None
        self._reader = threading.Thread(target=self._read, name="lucebox-engine-events", daemon=True)

    # ------------------------------------------------------------------ lifecycle
    def start(self):
        from ..tokenizer import Tokenizer

        self.proc.start()
        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                kind, payload = self._evt.get(timeout=1.0)
                break
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"the engine process exited ({self.proc.exitcode}) before it was ready") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the engine process did not start within {self.start_timeout:.0f} s") from None
        if kind != "ready":
            raise RuntimeError(f"the engine process failed to start: {payload}")
        self.info = payload
        self.tokenizer = Tokenizer.from_gguf_metadata(payload.pop("tokenizer"))
        self._reader.start()

    def stop(self, timeout: float = 5.0):
        self._send(("stop",))
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.terminate()

    @property
    def alive(self) -> bool:
        return self.proc.is_alive() and self._reader.is_alive()

    @property
    def max_len(self) -> int:
        return self.info["max_len"]

    @property
    def slots(self) -> int:
        return self.info["slots"]

    @property
    def vocab_size(self) -> int:
        return self.info["vocab_size"]

    # ------------------------------------------------------------------ handler side
    def make_job(self, ids: list[int], params: SamplingParams, max_new: int, sink, stream: bool,
                 prompt: str | None = None) -> RemoteJob:
        return RemoteJob(next(self._ids), ids, params, max_new, sink, stream, prompt, self)

    def submit(self, job: RemoteJob):
        with self._lock:
            if len(self._jobs) >= self.slots + self.max_queue:  # the child's slots and its inbox are full
                raise QueueFull
            self._jobs[job.id] = job
        self._send(("submit", job.id, job.ids, job.params, job.max_new, job.stream, job.prompt))

    def load(self, latency_since: int = 0) -> dict:
        rid = next(self._ids)
        box: queue.Queue = queue.Queue()
        self._replies[rid] = box
        self._send(("load", rid, latency_since))
        try:
            out = box.get(timeout=10)
        except queue.Empty:
            out = {"error": "the engine process did not answer within 10 s"}
        finally:
            self._replies.pop(rid, None)
        return {**out, "engine_process": self.proc.pid}

    def _forget(self, jid: int) -> bool:
        """Drop a job from those in flight; whether it was."""
        with self._lock:
            return self._jobs.pop(jid, None) is not None

    def _send(self, msg):
        try:
            self._cmd.put(msg)
        except (ValueError, OSError):  # the queue is closed: the process is stopping
            pass

    def _read(self):
        """Events from the child to their jobs' sinks (and /health replies), until the child ends."""
        while True:
            try:
                msg = self._evt.get(timeout=1.0)
            except queue.Empty:
                if not self.proc.is_alive():
                    break
                continue
            except (EOFError, OSError):
                break
            if msg[0] == "ev":
                _, jid, ev = msg
                job = self._jobs.get(jid)
                if ev[0] in ("done", "error"):
                    with self._lock:
                        self._jobs.pop(jid, None)
                if job is not None:
                    job.sink(ev)
            elif msg[0] == "load":
                box = self._replies.get(msg[1])
                if box is not None:
                    box.put(msg[2])
        with self._lock:  # the child is gone: every request in flight ends with an error
            jobs, self._jobs = list(self._jobs.values()), {}
        for job in jobs:
            job.sink(("error", "the engine process ended"))


def _child_main(llm_kwargs: dict, loop_kwargs: dict, warmup: str, cmd, evt):
    """The engine process: load the model, compile, run EngineLoop, and serve the parent's commands until told to
    stop or until the parent is gone (a parent killed without stopping it must not leave it running)."""
    import os

    parent = os.getppid()
    try:
        from . import start_engine_loop

        llm, engine = start_engine_loop(llm_kwargs, loop_kwargs, warmup)
    except Exception as e:  # noqa: BLE001 - the parent reports it
        evt.put(("failed", f"{type(e).__name__}: {e}"))
        return
    evt.put(("ready", {"tokenizer": llm.tokenizer.to_metadata(), "max_len": engine.max_len, "slots": engine.slots,
                       "vocab_size": llm.config.vocab_size, "load_seconds": llm.load_seconds,
                       "compile_seconds": llm.engine.compile_seconds}))
    evt.cancel_join_thread()  # from here, exiting does not wait for a parent that may no longer read the events
    jobs: dict = {}

    def sink_for(jid):
        def sink(ev):
            if ev[0] in ("done", "error"):
                jobs.pop(jid, None)
            evt.put(("ev", jid, ev))
        return sink

    while True:
        try:
            msg = cmd.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # orphaned
                engine.stop()
                os._exit(0)
            continue
        if msg[0] == "submit":
            _, jid, ids, params, max_new, stream, prompt = msg
            job = engine.make_job(ids, params, max_new, sink_for(jid), stream, prompt)
            jobs[jid] = job
            try:
                engine.submit(job)
            except QueueFull:
                job.finish(("error", "the server's queue is full"))
        elif msg[0] == "cancel":
            job = jobs.pop(msg[1], None)
            if job is not None:
                job.cancel()
        elif msg[0] == "load":
            evt.put(("load", msg[1], engine.load(msg[2])))
        elif msg[0] == "stop":
            engine.stop()
            os._exit(0)  # (no interpreter teardown: nothing is left to flush, and a device runtime can hang in it)
