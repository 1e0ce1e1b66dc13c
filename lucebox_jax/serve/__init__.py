"""OpenAI-compatible HTTP server over the continuous-batching scheduler: `python run.py --serve` or
`python -m lucebox_jax.serve`.

protocol.py validates OpenAI bodies and builds responses, engine_loop.py is the one device thread that feeds the
scheduler from a bounded queue, app.py holds the Starlette routes. Starlette and uvicorn are imported only when a
server starts, so the rest of the package does not need them.
"""

from __future__ import annotations

import argparse
import os
import pkgutil
import sys


def add_serve_arguments(p):
    g = p.add_argument_group("OpenAI-compatible server (--serve)")
    g.add_argument("--serve", action="store_true", help="serve /v1/chat/completions, /v1/completions, /v1/models "
                                                        "and /health over HTTP (see README)")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health "
                                                  "(default: the LUCEBOX_API_KEY environment variable, else none)")
    g.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model "
                                                            "file's name without .gguf)")
    g.add_argument("--max-queue", type=int, default=256, help="requests waiting beyond the running batch before "
                                                             "new ones get 429 (default 256)")
    g.add_argument("--warmup", choices=("full", "basic"), default=None,
                   help="full: compile every prefill shape up to the context before serving, so no request waits on "
                        "a compile (default on a GPU; later starts reuse jax's compilation cache); basic: one tiny "
                        "request (default on the CPU, where compiles are slow)")
    g.add_argument("--max-body-kb", type=int, default=1024, help="largest request body accepted (default 1024 KiB)")
    g.add_argument("--exit-on-finish", action="store_true",
                   help="end a decode call as soon as a request finishes, not after --steps-per-call steps (its "
                        "client hears sooner and sends its next request sooner; more, shorter calls)")
    g.add_argument("--lookahead", action="store_true",
                   help="dispatch each decode call before reading the last one's tokens, so the device never waits "
                        "for the host between calls; a new request joins one call later (--serve and --input jobs; "
                        "off: on the H200 the server ran 11% slower with it)")
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the model and its device loop in a process of their own, so the HTTP side does not "
                        "share one interpreter lock with them (default: on where jax has a GPU plugin, off on the "
                        "CPU; on the H200 at 32 clients 0.82-0.86 of the offline job's tok/s against 0.78 in-process)")
    g.add_argument("--keep-alive", type=float, default=30.0,
                   help="seconds an idle HTTP connection is kept open (default 30). Longer than the 5 s for which "
                        "pooled clients (httpx, so the openai client) reuse an idle connection: at uvicorn's default "
                        "of 5 s the two expire together and a reused connection can be closed under a new request")


def _model_name(args) -> str:
    if args.served_model_name:
        return args.served_model_name
    from ..loader import default_model_path

    path = os.path.normpath(args.model or default_model_path())
    name = os.path.basename(path)
    return name[:-5] if name.endswith(".gguf") else name


def run_serve_from_args(args) -> int:
    """Load the model, start the device loop, serve until interrupted."""
    from ..jobs import JobError

    for flag in ("input", "output", "prompt"):
        if getattr(args, flag, None) is not None:
            raise JobError(f"--serve and --{flag} are mutually exclusive")
    from ..spec_batch import cli_chain_error

    if why := cli_chain_error(args):
        raise JobError(why)
    if not 0 <= args.port <= 65535:
        raise JobError(f"--port must be in 0..65535, got {args.port}")
    if not args.keep_alive > 0:
        raise JobError(f"--keep-alive must be > 0 seconds, got {args.keep_alive}")
    for flag, lo in (("batch_size", 1), ("steps_per_call", 1), ("max_queue", 1), ("max_body_kb", 1),
                     ("max_context", 2)):
        v = getattr(args, flag)
        if v is not None and v < lo:
            raise JobError(f"--{flag.replace('_', '-')} must be >= {lo}, got {v}")
    try:
        import uvicorn

        from .app import ServerConfig, create_app
    except ImportError as e:
        raise JobError(f"--serve needs starlette and uvicorn ({e}); pip install starlette uvicorn") from None

    name = _model_name(args)
    api_key = args.api_key or os.environ.get("LUCEBOX_API_KEY") or None
    # 8 on the GPU too (batch jobs: 16): a request arriving mid-call waits for the running call, and on the H200 at 32
    # clients 8 steps answered first tokens in 71 ms p50 against 16 steps' 117 ms (benchmarks/RESULTS.md, issue 15)
    steps = args.steps_per_call or 8
    llm_kwargs = dict(model=args.model, kernels=args.kernels, max_context=args.max_context,
                      use_checkpoint=not args.no_checkpoint, tensor_parallel=args.tensor_parallel, draft=args.draft,
                      num_draft=args.num_draft)
    in_child = engine_process_default() if args.engine_process is None else args.engine_process
    if in_child:  # (before anything starts jax here: the child must have the device to itself)
        from .engine_process import EngineClient

        print(f"loading {name} in an engine process ...", file=sys.stderr, flush=True)
        engine = EngineClient(llm_kwargs, loop_kwargs(args, steps), warmup=args.warmup, max_queue=args.max_queue)
        engine.start()
        load_s, compile_s = engine.info["load_seconds"], engine.info["compile_seconds"]
        where = f", engine process {engine.proc.pid}"
    else:
        print(f"loading {name} ...", file=sys.stderr, flush=True)
        llm, engine = start_engine_loop(llm_kwargs, loop_kwargs(args, steps), args.warmup)
        load_s, compile_s, where = llm.load_seconds, llm.engine.compile_seconds, ""
    app = create_app(engine, ServerConfig(model_name=name, api_key=api_key, max_body_bytes=args.max_body_kb * 1024))
    print(f"serving {name} on http://{args.host}:{args.port}/v1 ({engine.slots} slots, context {engine.max_len}, "
          f"{steps} steps per call{where}{', API key required' if api_key else ''}; load {load_s:.1f} s, compile "
          f"{compile_s:.1f} s)", file=sys.stderr, flush=True)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        print(f"warning: bound to {args.host} without --api-key: anyone who can reach this port can use the model",
              file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=2, timeout_keep_alive=args.keep_alive)
    engine.stop()
    return 0


def engine_process_default() -> bool:
    """Whether `--engine-process` is on when not asked: where jax will run on a GPU (a jax CUDA or ROCm plugin is
    installed and JAX_PLATFORMS does not leave the GPU out), decided without starting jax in this process, which must
    leave the device to the child. On the H200 at 32 clients it served 0.82-0.86 of the offline job's tok/s against
    0.78 in-process, and 0.82 at 8 clients (benchmarks/RESULTS.md, issue 15). Off on the CPU, where it was not
    measured: there the device loop is the CPU's own compute, which a second process does not take off the HTTP side."""
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    if platforms and not any(p in platforms for p in ("cuda", "gpu", "rocm")):
        return False
    try:
        import jax_plugins  # the namespace package jax finds its PJRT plugins in
    except ImportError:
        return False
    return any(m.name.startswith(("xla_cuda", "xla_rocm")) for m in pkgutil.iter_modules(jax_plugins.__path__))


def loop_kwargs(args, steps: int) -> dict:
    """EngineLoop's settings from the command line (the slot count may be None: `start_engine_loop` resolves it)."""
    return dict(slots=args.batch_size, steps_per_call=steps, max_queue=args.max_queue,
                exit_on_finish=args.exit_on_finish, lookahead=getattr(args, "lookahead", False),
                spec_max_slots=getattr(args, "spec_max_slots", None))


def start_engine_loop(llm_kwargs: dict, loop_kw: dict, warmup: str | None):
    """Load the model, build the device loop, compile its serving shapes (`warmup` "full"; default on a GPU), start
    it and run one tiny request through it: (llm, EngineLoop). The in-process server and `--engine-process`'s child
    both start here."""
    import jax

    from ..jobs import default_shape
    from ..llm import LLM
    from .engine_loop import EngineLoop

    gpu = jax.default_backend() != "cpu"
    llm = LLM(**{**llm_kwargs, "max_context": server_context(llm_kwargs.get("max_context"), gpu)})
    loop_kw = dict(loop_kw)
    slots, ctx = default_shape(llm.engine, loop_kw.pop("slots"), llm.config.max_context)
    spec_max_slots = loop_kw.pop("spec_max_slots", None)
    spec = None
    if llm.spec is not None:  # speculation per slot inside the continuous batch (spec_batch.py), as batch jobs do
        from ..spec_batch import BatchSpec

        spec = BatchSpec.from_decoder(llm.spec, max_slots=spec_max_slots)
    # the device thread must get the GIL back quickly from the HTTP thread when a decode call returns
    sys.setswitchinterval(5e-4)
    engine = EngineLoop(llm, slots=slots, max_len=ctx, spec=spec, **loop_kw)
    if (warmup or ("full" if gpu else "basic")) == "full":
        print(f"compiling the serving shapes (prompts up to {ctx - 1} tokens; --warmup basic skips this) ...",
              file=sys.stderr, flush=True)
        engine.precompile()
    engine.start()
    engine.warmup()
    return llm, engine


def server_context(max_context: int | None, gpu: bool) -> int:
    return max_context or (4096 if gpu else 2048)
