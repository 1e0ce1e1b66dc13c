"""The Python API, modelled on vLLM's offline API:

    from lucebox_jax import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(out[0].outputs[0].text, out[0].outputs[0].token_ids)
    llm.chat([{"role": "user", "content": "Hi"}])
    for piece in llm.stream("Once upon a time", SamplingParams(max_tokens=32)): print(piece, end="")
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from . import ops
from .engine import Engine, StepOut, enable_compilation_cache
from .errors import EmptyPromptError, InvalidRequestError, InvalidSamplingParamsError, PromptTooLongError
from .loader import load_model, model_name
from .ops import KernelSet
from .sampling import RowParams, SamplingParams, is_int, static_sampling, utf8_ok
from .tokenizer import StreamDecoder, Tokenizer


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str  # "stop" (end-of-turn token or stop string) or "length"
    stop_reason: str | int | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    metrics: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Request:
    """A tokenized request: what `finish` needs to turn generated ids into a `CompletionOutput` (jobs.py too)."""

    prompt: str | None
    ids: list[int]
    params: SamplingParams
    seed: int


class LLM:
    """A loaded model with its tokenizer, compiled steps and kernel choice."""

    def __init__(self, model: str | None = None, *, kernels=None, kernels_module: str | None = None,
                 dtype: str | None = None, max_context: int | None = None, max_batch: int = 32, seed: int = 0,
                 use_checkpoint: bool = True, compilation_cache: bool = True, group_size: int = 128,
                 draft=None, num_draft: int | str = 4, tree: int | None = None, tree_beam: int | None = None,
                 tensor_parallel: int = 1):
        t0 = time.perf_counter()
        for name, v, lo in (("max_batch", max_batch, 1), ("max_context", max_context, 2), ("seed", seed, 0)):
            if (v is not None or name != "max_context") and (not is_int(v) or v < lo):
                raise InvalidRequestError(f"{name} must be an integer >= {lo}, got {v!r}")
        if compilation_cache:
            enable_compilation_cache()
        if kernels_module:
            ops.import_kernel_module(kernels_module)
        kernel_set = KernelSet.resolve(kernels)
        if tensor_parallel != 1:  # before the (slow) load
            from .parallel import check_devices

            check_devices(tensor_parallel)
        cfg, weights, tok_meta, self.source = load_model(model, dtype, use_checkpoint, group_size)
        if max_context is not None:
            cfg = cfg.replace(max_context=min(cfg.max_context, max_context))
        self.tokenizer = Tokenizer.from_gguf_metadata(tok_meta)
        self.engine = Engine(cfg, weights, kernel_set, tensor_parallel=tensor_parallel)  # parallel.py splits it
        self.engine.model_name = model_name(model)  # finds the model's shipped draft head (drafters/eagle.py)
        self.spec = None  # speculative decoding (speculative.py): draft "eagle" | "layers:N" | "ngram" | "model:PATH"
        if draft is not None:
            from .speculative import SpeculativeDecoder

            self.spec = SpeculativeDecoder.create(self.engine, draft, num_draft, tokenizer=self.tokenizer, tree=tree,
                                                  tree_beam=tree_beam)
        self.max_batch = max_batch
        self.time_phases = False  # benchmarks: wait for the first token so last_stats has prefill_seconds
        self._rng = np.random.default_rng(seed)
        self.load_seconds = time.perf_counter() - t0
        self.last_stats: dict = {}

    # ------------------------------------------------------------------ properties
    @property
    def config(self):
        return self.engine.cfg

    @property
    def kernels(self) -> KernelSet:
        return self.engine.kernels

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    # ------------------------------------------------------------------ requests
    def stop_ids_for(self, p: SamplingParams) -> set[int]:
        """Token ids that end a completion under `p` (its stop_token_ids, plus end-of-turn unless ignore_eos)."""
        ids = set(p.stop_token_ids or [])
        if not p.ignore_eos:
            ids |= set(self.tokenizer.eot_ids)
        return ids

    def _request(self, prompt, params: SamplingParams) -> Request:
        if not isinstance(params, SamplingParams):
            raise InvalidSamplingParamsError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        bad = [t for t in params.stop_token_ids or [] if t >= self.config.vocab_size]
        if bad:
            raise InvalidSamplingParamsError(f"stop token id {bad[0]} outside the vocabulary "
                                             f"(0..{self.config.vocab_size - 1})")
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise EmptyPromptError("a prompt dict needs 'prompt_token_ids'")
            ids, text = prompt["prompt_token_ids"], None
            if not isinstance(ids, (list, tuple)) or not all(is_int(i) for i in ids):
                raise InvalidRequestError(f"prompt_token_ids must be a list of integers, got {ids!r:.80}")
            ids = [int(i) for i in ids]
            bad = [i for i in ids if not 0 <= i < self.config.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"token id {bad[0]} outside the vocabulary (0..{self.config.vocab_size - 1})")
        elif isinstance(prompt, str):
            if not utf8_ok(prompt):
                raise InvalidRequestError("the prompt is not valid UTF-8 text (it holds a lone surrogate, e.g. "
                                          "from undecodable bytes)")
            ids, text = self.tokenizer.encode(prompt), prompt
        else:
            raise InvalidRequestError(f"a prompt is a string or a dict with 'prompt_token_ids', got "
                                      f"{type(prompt).__name__}")
        if not ids:
            raise EmptyPromptError("empty prompt: it has no tokens")
        limit = self.config.max_context
        if len(ids) >= limit:
            raise PromptTooLongError(f"prompt has {len(ids)} tokens but the context limit is {limit} tokens "
                                     "(prompt plus at least one generated token)")
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31 - 1))
        return Request(text, ids, params, seed)

    def _requests(self, prompts, sampling_params) -> list[Request]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        try:
            prompts = list(prompts)
        except TypeError:
            raise InvalidRequestError(f"prompts must be a string, a dict or a list of them, got "
                                      f"{type(prompts).__name__}") from None
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)):
            raise InvalidSamplingParamsError(f"sampling_params must be SamplingParams or a list of them, got "
                                             f"{type(sampling_params).__name__}")
        if len(sampling_params) != len(prompts):
            raise InvalidSamplingParamsError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        return [self._request(p, sp) for p, sp in zip(prompts, sampling_params)]

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Raw prompts (no chat template), as strings or {"prompt_token_ids": [...]}; one RequestOutput each."""
        reqs = self._requests(prompts, sampling_params)
        # the scheduler speculates with a fixed K and no tree; adaptive K and trees run as static batches
        chain = self.spec is None or not (self.spec.adaptive or self.spec.tree_width)
        if len(reqs) > self.max_batch and chain and all(
                r.params.logprobs is None and r.params.prompt_logprobs is None for r in reqs):
            return self._generate_continuous(reqs, use_tqdm)
        outs: list[RequestOutput | None] = [None] * len(reqs)
        order = sorted(range(len(reqs)), key=lambda i: len(reqs[i].ids))  # similar lengths batch together
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), desc="generate", unit="req")
        for s in range(0, len(order), self.max_batch):
            idx = order[s: s + self.max_batch]
            for i, o in zip(idx, self._generate_batch([reqs[i] for i in idx])):
                o.request_id = str(i)
                outs[i] = o
            if bar:
                bar.update(len(idx))
        if bar:
            bar.close()
        return outs

    def _generate_continuous(self, reqs: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        """More prompts than `max_batch`: continuous batching over `max_batch` slots (scheduler.py), so a finished
        request's slot is refilled at once instead of waiting for the longest request of a static batch."""
        from .scheduler import Scheduler, SlotRequest

        cfg = self.config
        budgets = [min(r.params.max_tokens, cfg.max_context - len(r.ids)) for r in reqs]
        sreqs = [SlotRequest(i, r.ids, dataclasses.replace(r.params, seed=r.seed),
                             frozenset(self.stop_ids_for(r.params)),
                             m) for i, (r, m) in enumerate(zip(reqs, budgets))]
        max_len = self.engine.cache_len_for(max(len(r.ids) + m for r, m in zip(reqs, budgets)))
        spec = None
        if self.spec is not None:  # speculation per slot (spec_batch.py)
            from .spec_batch import BatchSpec

            spec = BatchSpec.from_decoder(self.spec)
        sched = Scheduler(self.engine, slots=self.max_batch, max_len=max_len, spec=spec,
                          sampling=static_sampling([r.params for r in sreqs]))
        outs: list[RequestOutput | None] = [None] * len(reqs)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), desc="generate", unit="req")
        for batch in sched.run(sreqs):
            for f in batch:
                i = f.request.key
                outs[i] = RequestOutput(str(i), reqs[i].prompt, reqs[i].ids, None,
                                        [self.finish(reqs[i], f.token_ids, budgets[i])])
            if bar:
                bar.update(len(batch))
        if bar:
            bar.close()
        if spec is not None:
            self.last_stats = {"speculative": sched.spec_stats()}
        return outs

    def chat(self, messages, sampling_params=None, add_generation_prompt: bool = True, use_tqdm: bool = False):
        """One conversation (a list of {"role", "content"}) or a list of them, through the model's chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _generate_batch(self, reqs: list[Request]) -> list[RequestOutput]:
        eng, cfg = self.engine, self.config
        b = len(reqs)
        t0 = time.perf_counter()
        c0 = eng.compile_seconds
        row_max = np.array([min(r.params.max_tokens, cfg.max_context - len(r.ids)) for r in reqs], np.int32)
        need = max(len(r.ids) + m for r, m in zip(reqs, row_max))
        max_len = self.spec.cache_len(need) if self.spec else eng.cache_len_for(need)
        want_prompt_lp = any(r.params.prompt_logprobs is not None for r in reqs)
        n_lp = max([r.params.logprobs or 0 for r in reqs] + [0])
        rp = RowParams.from_params([dataclasses.replace(r.params, seed=r.seed) for r in reqs], static=True)
        hidden, per_pos = None, [None] * b
        if want_prompt_lp:  # every position's logits come back to the host
            last, per_pos, cache, *h = eng.prefill(eng.new_cache(b, max_len), [r.ids for r in reqs],
                                                   all_logits=True, hidden_layers=self._draft_features())
            hidden = h[0] if h else None
            first, seen = eng.first_token(last, rp, [len(r.ids) for r in reqs], eng.new_seen([r.ids for r in reqs]),
                                          n_lp)
        else:
            first, cache, seen, hidden = eng.start([r.ids for r in reqs], max_len, rp, n_lp, self._draft_features())
        if self.time_phases:
            jax.block_until_ready(first)
            t_prefill = time.perf_counter() - t0 - (eng.compile_seconds - c0)
        stop_ids = [self.stop_ids_for(r.params) for r in reqs]  # per row: one row's stops never end another
        if self.spec is not None:
            bufs, count, cache = self.spec.loop(cache, [r.ids for r in reqs], first, rp, seen, stop_ids, row_max, n_lp,
                                                hidden)
        else:
            bufs, count, cache, _ = eng.loop(cache, first, rp, seen, stop_ids, row_max, n_lp)
        toks, count = np.asarray(bufs.tokens), np.asarray(count)
        dt = time.perf_counter() - t0 - (eng.compile_seconds - c0)
        outs = []
        for r_i, r in enumerate(reqs):
            ids = [int(t) for t in toks[r_i, : count[r_i]]]
            comp = self.finish(r, ids, row_max[r_i])
            if r.params.logprobs is not None:
                comp.logprobs = self._logprob_dicts(
                    np.asarray(bufs.top_ids[r_i]), np.asarray(bufs.top_vals[r_i]), np.asarray(bufs.logprob[r_i]),
                    comp.token_ids, r.params.logprobs)
            plp = self._prompt_logprobs(per_pos[r_i], r.ids, r.params.prompt_logprobs) if (
                r.params.prompt_logprobs is not None) else None
            outs.append(RequestOutput("", r.prompt, r.ids, plp, [comp],
                                      metrics={"batch_seconds": dt, "batch_size": b}))
        self.last_stats = {"seconds": dt, "completion_tokens": int(count.sum()), "batch": b,
                           "compile_seconds": eng.compile_seconds - c0}
        if self.time_phases:
            self.last_stats["prefill_seconds"] = t_prefill
        if self.spec is not None:
            self.last_stats["speculative"] = self.spec.last_stats
        return outs

    def _draft_features(self) -> tuple | None:
        """The target layers whose hidden states a draft head starts from (the prefill returns them), or None."""
        return self.spec.drafter.hidden_layers if self.spec is not None else None

    def finish(self, r: Request, ids: list[int], row_max: int) -> CompletionOutput:
        """Token ids -> text with end-of-turn tokens and stop strings applied (vLLM conventions)."""
        stop_ids = self.stop_ids_for(r.params)
        finish, reason = "length", None
        for j, t in enumerate(ids):
            if t in stop_ids:
                ids, finish, reason = ids[: j + 1], "stop", t
                break
        text_ids = [t for t in ids if t not in stop_ids]
        text = self.tokenizer.decode(text_ids, skip_special=True)
        cut = find_stop(text, r.params.stop)
        if cut is not None:
            pos, s = cut
            text, finish, reason = text[:pos], "stop", s
            # keep the fewest tokens whose text contains the stop string
            for j in range(1, len(text_ids) + 1):
                if find_stop(self.tokenizer.decode(text_ids[:j], skip_special=True), [s]) is not None:
                    ids = text_ids[:j]
                    break
        return CompletionOutput(0, text, ids, None, finish, reason)

    def _logprob_dicts(self, top_ids, top_vals, chosen_lp, token_ids, k):
        out = []
        for j, t in enumerate(token_ids):
            d = {int(i): Logprob(float(v), rank + 1, self.tokenizer.decode([int(i)]))
                 for rank, (i, v) in enumerate(zip(top_ids[j][:k], top_vals[j][:k]))}
            if t not in d:
                d[t] = Logprob(float(chosen_lp[j]), None, self.tokenizer.decode([t]))
            out.append(d)
        return out

    def _prompt_logprobs(self, logits: np.ndarray, ids: list[int], k: int):
        lp = jax.nn.log_softmax(jnp.asarray(logits[:-1]), axis=-1)
        out: list = [None]
        if len(ids) > 1:
            top_v, top_i = jax.lax.top_k(lp, max(k, 1))
            top_v, top_i, lp = np.asarray(top_v), np.asarray(top_i), np.asarray(lp)
            for p in range(1, len(ids)):
                pairs = zip(top_i[p - 1][:k], top_v[p - 1][:k])
                d = {int(i): Logprob(float(v), r + 1) for r, (i, v) in enumerate(pairs)}
                t = ids[p]
                if t not in d:
                    rank = int((lp[p - 1] > lp[p - 1, t]).sum()) + 1
                    d[t] = Logprob(float(lp[p - 1, t]), rank)
                out.append(d)
        return out

    # ------------------------------------------------------------------ streaming
    def stream(self, prompt, params: SamplingParams | None = None, chunk: int = 8) -> Iterator[str]:
        """Yield the completion's text as it is produced (never splitting a UTF-8 character); afterwards
        `self.last_stats` holds token counts, timings and the finish reason.

        Tokens are decoded on device `chunk` at a time (one program per chunk, no host round trip per token);
        the text of each token is yielded as soon as its chunk returns."""
        params = params or SamplingParams()
        r = self._request(prompt, params)
        eng, cfg = self.engine, self.config
        max_new = min(params.max_tokens, cfg.max_context - len(r.ids))
        stop_ids = self.stop_ids_for(params)
        c0 = eng.compile_seconds
        t0 = time.perf_counter()
        cache = eng.new_cache(1, self.spec.cache_len(len(r.ids) + max_new) if self.spec else
                              eng.cache_len_for(len(r.ids) + max_new))
        rp = RowParams.from_params([dataclasses.replace(params, seed=r.seed)], static=True)
        last, _, cache, *hidden = eng.prefill(cache, [r.ids], hidden_layers=self._draft_features())
        seen = eng.new_seen([r.ids])
        out, seen = eng.first_token(last, rp, [len(r.ids)], seen)
        pending = [int(out.tokens[0])]
        spec_it = self.spec.stream_chunks(cache, [r.ids], out, rp, seen, stop_ids, max_new,
                                          hidden[0] if hidden else None) if self.spec else None
        t_first = time.perf_counter()
        c1 = eng.compile_seconds
        dec = StreamDecoder(self.tokenizer)
        ids: list[int] = []
        text, emitted, finish = "", 0, None
        hold = max((len(s) for s in params.stop), default=1) - 1
        while finish is None:
            for tok in pending:
                ids.append(tok)
                if tok in stop_ids:
                    finish = "stop"
                    break
                text += dec.push(tok)
                cut = find_stop(text, params.stop)
                if cut is not None:
                    text, finish = text[: cut[0]], "stop"
                    break
                if len(ids) >= max_new:
                    finish = "length"
                    break
            safe = len(text) if finish else len(text) - hold  # hold back a possible stop-string prefix
            if safe > emitted:
                yield text[emitted:safe]
                emitted = safe
            if finish:
                break
            if spec_it is not None:  # speculative: the tokens of a few draft + verify steps
                pending = next(spec_it, None)
                if pending is None:
                    finish = "length"
                    break
                continue
            n = min(chunk, max_new - len(ids))
            bufs, count, cache, seen = eng.loop(cache, StepOut.of_tokens(jnp.asarray([ids[-1]], jnp.int32)), rp,
                                                seen, stop_ids, np.array([n + 1], np.int32))
            pending = [int(t) for t in np.asarray(bufs.tokens[0, 1: int(count[0])])]
        if finish == "length":
            text += dec.flush()
        if len(text) > emitted:
            yield text[emitted:]
        t_end = time.perf_counter()
        compile_s = eng.compile_seconds - c0
        prefill_s = max(t_first - t0 - (c1 - c0), 1e-9)
        decode_s = max(t_end - t_first - (eng.compile_seconds - c1), 1e-9)
        self.last_stats = {
            "prompt_tokens": len(r.ids), "completion_tokens": len(ids), "token_ids": ids, "text": text,
            "finish_reason": finish, "compile_seconds": compile_s,
            "prefill_seconds": prefill_s, "decode_seconds": decode_s,
            "prefill_tok_s": len(r.ids) / prefill_s,
            "decode_tok_s": (len(ids) - 1) / decode_s if len(ids) > 1 else 0.0,
        }
        if self.spec is not None:
            self.last_stats["speculative"] = self.spec.last_stats


def find_stop(text: str, stops) -> tuple[int, str] | None:
    """(position, stop string) of the earliest stop string in `text`, or None."""
    best = None
    for s in stops or []:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "StepOut"]
