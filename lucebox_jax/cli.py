"""Command line: `python run.py --prompt "..."` streams a chat answer from the embedded model (or --model), printing
load/compile time, prefill and decode speed to stderr. Flags are named as llama.cpp and vLLM users expect. Every bad
input ends in a one-line `error: ...` and exit status 2."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .errors import LuceboxError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="run.py", description="lucebox_jax: int4 LLM inference on JAX/XLA")
    p.add_argument("--prompt", "-p", help="prompt text (chat template applied unless --raw)")
    p.add_argument("--model", "-m", help="a .gguf file, a converted checkpoint folder or a known model name "
                                        "(gemma3-270m; default: embedded SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--system", help="system message for the chat template")
    p.add_argument("--raw", action="store_true", help="send the prompt as-is, without the chat template")
    p.add_argument("--max-tokens", "-n", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--kernels", default=None, help="op=name,... e.g. qmatmul=xla,attention_decode=pallas")
    p.add_argument("--kernels-module", default=None, help="import this module first (it registers kernels)")
    p.add_argument("--list-kernels", action="store_true", help="print the registered kernels and exit")
    p.add_argument("--max-context", type=int, default=None, help="cap the context length (tokens)")
    p.add_argument("--output-format", choices=("text", "json"), default="text")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model over N devices of this host (Megatron style, jax.sharding); default 1")
    p.add_argument("--no-checkpoint", action="store_true", help="read the GGUF directly, never convert it")
    p.add_argument("--verbose", "-v", action="store_true")
    p.add_argument("--draft", default=None, metavar="eagle[:PATH]|MODEL|layers:N|ngram",
                   help="speculative decoding drafter: eagle (the model's trained draft head, or eagle:FOLDER), "
                        "a draft model (.gguf or checkpoint sharing the vocabulary), "
                        "layers:N (the target's first N layers), or ngram[:N] (prompt lookup)")
    p.add_argument("--num-draft", default="4", metavar="K|auto",
                   help="draft tokens per step with --draft (default 4); auto adapts K in 1,2,4,8")
    p.add_argument("--tree", type=int, default=None, metavar="N",
                   help="with --draft eagle: verify a tree of N draft nodes (depth K; the N best of what a beam of "
                        "N // K drafts) in one target forward instead of a chain of K")
    p.add_argument("--tree-beam", type=int, default=None, metavar="W",
                   help="with --tree: the beam's width (default N // K); a wider beam drafts more candidates to choose "
                        "the N nodes from")
    from .jobs import add_job_arguments

    add_job_arguments(p)  # --input/--output batch jobs (jobs.py)
    from .serve import add_serve_arguments

    add_serve_arguments(p)  # --serve (serve/)
    return p


def _params(args):
    from .sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repeat_penalty,
                          seed=args.seed, stop=args.stop)


def _json_default(o):
    """numpy scalars and arrays in the stats -> plain JSON."""
    return o.tolist() if hasattr(o, "tolist") else str(o)


def _list_kernels() -> str:
    from . import ops

    return "\n".join(f"{op}: {', '.join(ops.available(op))} (default here: {ops.default_name(op)})" for op in ops.OPS)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        return _run(args)
    except LuceboxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


def _check_text_args(args):
    """Arguments the OS gave as bytes that are not UTF-8 arrive as lone surrogates (surrogateescape): refuse them
    with the flag's name instead of a UnicodeEncodeError from the tokenizer or the terminal."""
    from .errors import InvalidRequestError
    from .sampling import utf8_ok

    texts = [("--prompt", args.prompt), ("--system", args.system)] + [("--stop", s) for s in args.stop or []]
    for flag, value in texts:
        if value is not None and not utf8_ok(value):
            raise InvalidRequestError(f"{flag} is not valid UTF-8 text (undecodable bytes "
                                      f"{value.encode('utf-8', 'surrogateescape')[:40]!r})")


def _run(args) -> int:
    from . import ops
    from .errors import EmptyPromptError

    _check_text_args(args)

    if args.kernels_module:
        ops.import_kernel_module(args.kernels_module)
    if args.list_kernels:
        print(_list_kernels())
        return 0
    if args.serve:
        from .serve import run_serve_from_args

        return run_serve_from_args(args)
    if args.input is not None or args.output is not None:
        from .jobs import JobError, run_job_from_args

        if args.input is None:
            raise JobError("--output needs --input FILE")
        return run_job_from_args(args)
    if args.prompt is None:
        raise EmptyPromptError("no prompt: pass --prompt TEXT")
    if not args.prompt.strip():
        raise EmptyPromptError("empty prompt: pass a non-empty --prompt")
    params = _params(args)  # validate before the (slow) model load
    from .llm import LLM

    llm = LLM(args.model, kernels=args.kernels, max_context=args.max_context, use_checkpoint=not args.no_checkpoint,
              draft=args.draft, num_draft=args.num_draft, tree=args.tree, tree_beam=args.tree_beam,
              tensor_parallel=args.tensor_parallel)
    prompt = args.prompt
    if not args.raw and llm.tokenizer.chat_template:
        msgs = ([{"role": "system", "content": args.system}] if args.system else [])
        msgs.append({"role": "user", "content": args.prompt})
        prompt = llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    text_out = args.output_format == "text"
    for piece in llm.stream(prompt, params):
        if text_out:
            sys.stdout.write(piece)
            sys.stdout.flush()
    s = llm.last_stats
    if text_out:
        sys.stdout.write("\n")
    else:
        print(json.dumps({
            "text": s["text"], "token_ids": s["token_ids"], "finish_reason": s["finish_reason"],
            "usage": {"prompt_tokens": s["prompt_tokens"], "completion_tokens": s["completion_tokens"],
                      "total_tokens": s["prompt_tokens"] + s["completion_tokens"]},
            "timings": {k: round(s[k], 4) for k in ("compile_seconds", "prefill_seconds", "decode_seconds",
                                                     "prefill_tok_s", "decode_tok_s")},
            **({"speculative": s["speculative"]} if s.get("speculative") else {}),
        }, ensure_ascii=False, default=_json_default))
    print(f"[{llm.source}; kernels {llm.kernels.describe()}]\n"
          f"load {llm.load_seconds:.2f} s | compile {s['compile_seconds']:.2f} s | "
          f"prefill {s['prompt_tokens']} tok at {s['prefill_tok_s']:.1f} tok/s | "
          f"decode {s['completion_tokens']} tok at {s['decode_tok_s']:.1f} tok/s | finish: {s['finish_reason']}",
          file=sys.stderr)
    if s.get("speculative"):
        from .speculative import format_stats

        print(format_stats(s["speculative"]), file=sys.stderr)
    return 0
