"""The one device loop of the server: a thread that owns the model and drives `Scheduler.run` over a live feed.

HTTP handlers (asyncio) turn requests into `Job`s and `submit` them to a bounded inbox (full: `QueueFull`, answered
429). The device thread pulls jobs from the inbox into the running continuous batch whenever the scheduler has room
(new requests join between decode calls, finished slots are refilled at once) and, per scheduler round, hands each
job the tokens it got (`Scheduler.stop_check` is the per-request, per-round hook): the job decodes them
incrementally and posts the new text to its handler's asyncio queue, thread-safely. A job whose client went away
answers the hook with "stop", so the scheduler retires its slot in the same round.

Requests asking for logprobs take a separate path: the scheduler does not compute them, `LLM.generate` (static
batches) does; they run on this same thread between scheduler rounds, batched when several are waiting, and
answer in one piece (a streamed one as one content chunk).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

import numpy as np

from ..llm import Request, find_stop
from ..sampling import SamplingParams
from ..scheduler import Finished, Scheduler, SlotRequest
from ..tokenizer import StreamDecoder

log = logging.getLogger("lucebox_jax.serve")


class QueueFull(Exception):
    """The inbox holds `max_queue` requests already."""


@dataclasses.dataclass(eq=False)
class Job:
    """One request in flight. `sink(event)` is called on the device thread with ("text", str) while streaming,
    then exactly one ("done", text, finish_reason, n_completion, logprob_entries | None) or ("error", message)."""

    ids: list[int]
    params: SamplingParams  # seed set
    stop_ids: frozenset
    max_new: int
    sink: Callable[[tuple], None]
    stream: bool = False
    prompt: str | None = None
    cancelled: bool = False  # set by the handler when its client goes away (read by the device thread)
    # device-thread state for incremental decoding
    _n_seen: int = 0
    _text: str = ""
    _sent: int = 0
    _dec: StreamDecoder | None = None
    _finished: bool = False
    # perf_counter times for /health's latency split: queued by the handler, taken by the scheduler, first token
    t_submit: float = 0.0
    t_taken: float = 0.0
    t_first: float = 0.0

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs is not None

    def cancel(self):
        self.cancelled = True

    def on_tokens(self, tokenizer, ids: list[int]) -> bool:
        """The scheduler's per-round hook: stream the new tokens' text; True retires the request (client gone or a
        stop string appeared)."""
        if self.cancelled:
            return True
        self.t_first = self.t_first or time.perf_counter()  # the first call follows the prefill's token
        stops = self.params.stop
        if not (self.stream or stops):
            return False  # nothing to show or check before the end
        if self._dec is None:
            self._dec = StreamDecoder(tokenizer, skip_special=True)
        for t in ids[self._n_seen:]:
            if t not in self.stop_ids:
                self._text += self._dec.push(t)
        self._n_seen = len(ids)
        if stops and find_stop(self._text, stops) is not None:
            return True
        if self.stream:
            hold = max((len(s) for s in stops), default=1) - 1  # a stop string may still be completing
            safe = len(self._text) - hold
            if safe > self._sent:
                self.sink(("text", self._text[self._sent:safe]))
                self._sent = safe
        return False

    def finish(self, event: tuple):
        if not self._finished:
            self._finished = True
            self.sink(event)


class EngineLoop:
    """Owns `llm` and one `Scheduler` of `slots` x `max_len`; `start()` runs the device thread."""

    def __init__(self, llm, slots: int, max_len: int, steps_per_call: int, max_queue: int = 256,
                 max_prefill_batch: int = 8, spec=None, exit_on_finish: bool = False, lookahead: bool = False):
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.slots = slots
        self.max_len = max_len
        self.inbox: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self._held: collections.deque[Job] = collections.deque()
        self._live: set[Job] = set()
        # requests are checked against max_len; the cache is rounded up to whole 64-token blocks (as jobs.py does)
        self._sched_kw = dict(slots=slots, max_len=-(-max_len // 64) * 64, steps_per_call=steps_per_call,
                              max_prefill_batch=min(max_prefill_batch, slots), spec=spec,  # spec: spec_batch
                              exit_on_finish=exit_on_finish, lookahead=lookahead)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._main, name="lucebox-device", daemon=True)
        self.stats = collections.Counter()
        # (finished count, seconds in the inbox, seconds from taken to first token) of the last finished requests
        self._latency: collections.deque[tuple[int, float, float]] = collections.deque(maxlen=4096)
        self.spec_stats: dict | None = None  # speculation's acceptance so far (device thread's snapshot)
        self._sched: Scheduler | None = None  # the running scheduler (its loop_stats for /health)

    @property
    def vocab_size(self) -> int:
        return self.llm.config.vocab_size

    # ------------------------------------------------------------------ handler side
    def make_job(self, ids: list[int], params: SamplingParams, max_new: int, sink, stream: bool,
                 prompt: str | None = None) -> Job:
        return Job(ids=ids, params=params, stop_ids=frozenset(self.llm.stop_ids_for(params)), max_new=max_new,
                   sink=sink, stream=stream, prompt=prompt)

    def submit(self, job: Job):
        job.t_submit = time.perf_counter()
        try:
            self.inbox.put_nowait(job)
        except queue.Full:
            raise QueueFull from None
        trace = self._sched.trace if self._sched is not None else None
        if trace is not None:  # (LUCEBOX_LOOP_TRACE: arrivals beside the host loop's events)
            trace.append(("s", job.t_submit))

    def start(self):
        self.thread.start()

    def stop(self, timeout: float = 5.0):
        self._stop.set()
        self.thread.join(timeout)

    def load(self, latency_since: int = 0) -> dict:
        """Requests running (in the batch or its prefill queue), waiting in the inbox, and counters; the latency split
        covers requests finished after the `latency_since`-th (a benchmark passes the count it read before its run)."""
        eng = self.llm.engine
        return {"running": len(self._live), "waiting": self.inbox.qsize() + len(self._held), "slots": self.slots,
                "started": self.stats["requests"], "cancelled": self.stats["cancelled"],
                "compiled_shapes": len(eng._seen_shapes), "compile_seconds": round(eng.compile_seconds, 2),
                "latency_ms": self._latency_summary(latency_since),
                **({"loop": self._sched.loop_stats()} if self._sched is not None else {}),
                **({"speculative": self.spec_stats} if self.spec_stats else {})}

    def _latency_summary(self, since: int = 0) -> dict:
        """Over finished requests after the `since`-th (the last 4,096 at most): time in the inbox until the scheduler
        took the request, and from then to its first token (waiting for a free slot or the running decode call, then
        prefill). `finished` counts every request timed so far."""
        got = [g[1:] for g in list(self._latency) if g[0] > since]
        out = {"finished": self.stats["timed"], "requests": len(got)}
        if not got:
            return out
        for i, name in enumerate(("inbox", "taken_to_first_token")):
            p50, p99 = np.percentile([g[i] * 1e3 for g in got], [50, 99])
            out[f"{name}_p50"], out[f"{name}_p99"] = round(float(p50), 2), round(float(p99), 2)
        return out

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    # ------------------------------------------------------------------ device thread
    def _main(self):
        while not self._stop.is_set():
            sched = Scheduler(self.llm.engine, stop_check=lambda r, ids: r.key.on_tokens(self.tokenizer, ids),
                              **self._sched_kw)
            self._sched = sched
            try:
                for finished in sched.run(self._feed()):
                    for f in finished:
                        self._done(f)
                    if sched.spec is not None:  # a host snapshot: the HTTP thread must not read donated buffers
                        self.spec_stats = sched.spec_stats()
                return
            except Exception as e:  # noqa: BLE001 - a device error fails the requests in flight, not the server
                log.exception("device loop failed; failing %d requests in flight and starting afresh", len(self._live))
                for job in list(self._live):
                    job.finish(("error", f"internal error: {type(e).__name__}: {e}"))
                self._live.clear()
                self.stats["device_errors"] += 1

    def _next(self, block: bool) -> Job | None:
        if self._held:
            return self._held.popleft()
        try:
            return self.inbox.get(timeout=0.2) if block else self.inbox.get_nowait()
        except queue.Empty:
            return None

    def _feed(self):
        """Jobs for the scheduler as SlotRequests; None when nothing is waiting (blocks briefly when idle)."""
        while not self._stop.is_set():
            job = self._next(block=not self._live)
            if job is None:
                yield None
                continue
            if job.cancelled:
                continue
            if job.wants_logprobs:
                self._run_static(job)
                continue
            self._live.add(job)
            self.stats["requests"] += 1
            job.t_taken = time.perf_counter()
            yield SlotRequest(key=job, ids=job.ids, params=job.params, stop_ids=job.stop_ids, max_new=job.max_new)

    def _done(self, f: Finished):
        job: Job = f.request.key
        self._live.discard(job)
        if job.t_submit and job.t_taken:
            first = job.t_first or time.perf_counter()
            self.stats["timed"] += 1
            self._latency.append((self.stats["timed"], job.t_taken - job.t_submit, first - job.t_taken))
        if job.cancelled:
            if f.finish_reason == "check":  # retired early by the hook, not run to its end
                self.stats["cancelled"] += 1
            return
        comp = self.llm.finish(Request(job.prompt, job.ids, job.params, job.params.seed), f.token_ids, job.max_new)
        self.stats["completion_tokens"] += len(comp.token_ids)
        job.finish(("done", comp.text, comp.finish_reason, len(comp.token_ids), None))

    def _run_static(self, first: Job):
        """Logprob requests: LLM.generate's static batch (it computes vLLM-style logprobs), between rounds."""
        batch = [first]
        while len(batch) < self.llm.max_batch:
            nxt = self._next(block=False)
            if nxt is None:
                break
            if not nxt.wants_logprobs:
                self._held.append(nxt)
                break
            if not nxt.cancelled:
                batch.append(nxt)
        self._live.update(batch)
        outs = self.llm.generate([{"prompt_token_ids": j.ids} for j in batch],
                                 [dataclasses.replace(j.params, max_tokens=j.max_new) for j in batch])
        tok = self.tokenizer
        for job, out in zip(batch, outs):
            self._live.discard(job)
            comp = out.outputs[0]
            entries = []
            for t, d in zip(comp.token_ids, comp.logprobs or []):
                if t in job.stop_ids:
                    continue
                alts = sorted((lp for lp in d.values() if lp.rank is not None and lp.rank <= job.params.logprobs),
                              key=lambda lp: lp.rank)
                entries.append((tok.decode([t]), d[t].logprob, [(a.decoded_token, a.logprob) for a in alts]))
            self.stats["requests"] += 1
            self.stats["completion_tokens"] += len(comp.token_ids)
            job.finish(("done", comp.text, comp.finish_reason, len(comp.token_ids), entries))

    def precompile(self, max_prompt: int | None = None) -> int:
        """Before `start()`: compile every prefill/insert/decode shape the loop's scheduler can meet (one throwaway
        scheduler of the same shape; jax's compile cache is shared), so no client waits on a compile. Progress on
        stderr. Returns the number of warm-up batches."""
        import sys

        from tqdm import tqdm

        if self.thread.is_alive():
            raise RuntimeError("precompile() must run before start()")
        sched = Scheduler(self.llm.engine, **self._sched_kw)
        hi = min(max_prompt or self.max_len - 1, sched.max_len - 2)
        total = len(sched.prompt_length_classes(hi)) * len([p for p in sched.prefill_sizes if p <= sched.slots])
        with tqdm(total=total, desc="compiling serving shapes", file=sys.stderr, leave=False) as bar:
            runs = sched.warmup(hi, on_run=bar.update)
        self.stats["precompile_runs"] = runs
        return runs

    def warmup(self, timeout: float = 600.0):
        """One tiny request through the running loop, so the first client does not pay the first compiles."""
        got = queue.Queue()
        ids = self.tokenizer.encode("Hello") or [0]
        job = self.make_job(ids, SamplingParams(max_tokens=2, temperature=0, seed=0, ignore_eos=True), 2,
                            got.put, stream=True)
        self.submit(job)
        ev = got.get(timeout=timeout)
        while ev[0] == "text":
            ev = got.get(timeout=timeout)
        if ev[0] == "error":
            raise RuntimeError(ev[1])
