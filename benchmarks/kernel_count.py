#!/usr/bin/env python3
"""GPU kernels per step, counted by XLA's own GPU compiler on a machine without a GPU.

jax's CUDA plugin compiles for a GPU it is only told about (deviceless AOT: a topology made from a target description
of an H200, `H200_TARGET` below). The compiled HLO lists every kernel the GPU would launch: XLA fusions, Pallas
(Triton or Mosaic GPU) custom calls, cuBLAS calls, copies. On a launch-bound model (the embedded SmolLM2-135M runs
~500 kernels a token in ~1.2 ms on the H200) the count is what a step costs, so this measures, without a device,
what a change removes. It is a count, not a time: times come from the GPU benchmarks.

Setup once (a venv beside .venv with jax's CUDA plugin; ~4 GB, CPU only):  bash scripts/setup_aot.sh
Run:  .venv-aot/bin/python benchmarks/kernel_count.py [--configs decode,chain,tree] [--kernels best|pallas|...]

Configurations, on the embedded model (or --model), each compiled with the shapes of a short real run on the CPU
(one prompt; its cache holds 256 positions): `decode` one plain decode step at batch 1 and `batch` at --batch rows
(the body of `generate_loop`); `chain` one speculative step with the shipped EAGLE head, K = --k (the body of
`spec_chunk`); `tree` the same with a tree of --tree nodes; `slots` / `spec-slots` one step of a batch job's decode
call at --slots rows, plain / speculating (`scheduler.decode_chunk`, `spec_batch.spec_decode_chunk`); `insert` an
admission's insert of its prefilled rows (up to 8) into --slots slots (`scheduler.insert_rows`); `prefill` a prompt's
start program (`engine.start_step`: a new cache, the prefill, the seen mask, the first token), `spec-prefill` the
same returning the head's feature layers.
`--synthetic llama3-8b` instead counts one `decode_step` of random weights at those shapes (never made: shapes only).
Output: per configuration, kernels by kind and by call path, and $OUT/kernel_count.json;
`--compare BEFORE.json AFTER.json` prints what a change added or removed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# the CPU runs the model (to learn each call's shapes); the CUDA plugin only compiles, with no driver to check
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

# an H200 as XLA's GPU compiler sees it (GpuTargetConfigProto, text format; the numbers are the device's data sheet)
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 150754820096 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
device_description_str: "NVIDIA H200"
"""

# HLO instructions that launch nothing
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
         "replica-id", "opt-barrier"}


# ------------------------------------------------------------------------------------------------ counting
def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    comps: dict[str, list[str]] = {}
    entry, cur = "", None
    for line in hlo.splitlines():
        m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m:
            cur = m.group(2)
            comps[cur] = []
            entry = cur if m.group(1) else entry
        elif cur is not None and line.startswith("  ") and " = " in line:
            comps[cur].append(line.strip())
    return comps, entry


def _opcode(ins: str) -> str:
    m = re.search(r"(?<![\w.%\-])([a-z][a-z0-9\-]*)\(", ins.split(" = ", 1)[1])  # the type has no "word("
    return m.group(1) if m else "?"


def _frames(hlo: str) -> dict[int, tuple]:
    """stack_frame_id -> the Python call path of an instruction's source, outermost first: ((function, file, line),
    ...), from the module's FileNames / FunctionNames / FileLocations / StackFrames tables."""
    tables: dict[str, dict[int, str]] = {}
    cur = None
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            cur = tables.setdefault(line, {})
        elif cur is not None and (m := re.match(r"^(\d+) (.*)$", line)):
            cur[int(m.group(1))] = m.group(2)
        elif not line.strip():
            cur = None
    files, funcs = tables.get("FileNames", {}), tables.get("FunctionNames", {})
    locs = {}
    for i, v in tables.get("FileLocations", {}).items():
        d = dict(re.findall(r"(\w+)=(\d+)", v))
        locs[i] = (funcs.get(int(d["function_name_id"]), "?").strip('"'),
                   os.path.basename(files.get(int(d["file_name_id"]), "?").strip('"')), int(d["line"]))
    raw = {i: dict(re.findall(r"(\w+)=(\d+)", v)) for i, v in tables.get("StackFrames", {}).items()}
    paths: dict[int, tuple] = {}

    def path(i: int) -> tuple:
        if i not in paths:
            parent = int(raw[i]["parent_frame_id"]) - 1  # printed 1-based; 0 = no parent
            here = locs[int(raw[i]["file_location_id"])]
            paths[i] = (path(parent) if parent in raw and parent != i else ()) + (here,)
        return paths[i]

    return {i: path(i) for i in raw}


def count_kernels(hlo: str, where: collections.Counter | None = None, branch: str = "largest") -> collections.Counter:
    """Kernels one run of a compiled (optimised, scheduled) HLO module launches, by kind: `fusion:kLoop`,
    `custom-call:<target>`, `copy`, ... A while loop's body and condition count once per known trip (once per
    iteration when the trip count is unknown: `loops` says so); a conditional counts its largest branch (`branch=
    "smallest"`: its smallest, e.g. the greedy branch of the sampling switch).
    `where` (optional) is filled with the same kernels by the Python call path of their source."""
    comps, entry = _computations(hlo)
    frames = _frames(hlo) if where is not None else {}
    if not entry:
        raise ValueError("no ENTRY computation in this HLO text")

    def walk(name: str, mult: int, acc: collections.Counter, at: collections.Counter | None = where):
        for ins in comps[name]:
            op = _opcode(ins)
            if op in _FREE:
                continue
            if at is not None and op not in ("while", "conditional", "call"):
                f = re.search(r"stack_frame_id=(\d+)", ins)
                at[frames.get(int(f.group(1)), ()) if f else ()] += mult
            if op == "while":
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins)
                n = int(trip.group(1)) if trip else 1
                acc["loops (trip " + (str(n) if trip else "unknown: counted once") + ")"] += 1
                for key in ("body", "condition"):
                    walk(re.search(key + r"=%?([\w.\-]+)", ins).group(1), mult * n, acc, at)
            elif op == "conditional":
                if "branch_computations=" in ins:
                    names = re.findall(r"%?([\w.\-]+)", ins.split("branch_computations={", 1)[1].split("}", 1)[0])
                else:
                    names = [re.search(k + r"=%?([\w.\-]+)", ins).group(1)
                             for k in ("true_computation", "false_computation")]
                branches = []
                for b in names:
                    sub, sub_at = collections.Counter(), collections.Counter()
                    walk(b, mult, sub, sub_at if at is not None else None)
                    branches.append((sub, sub_at))
                acc["conditionals"] += 1
                big, big_at = (max if branch == "largest" else min)(branches, key=lambda x: total(x[0]))
                acc.update(big)
                if at is not None:
                    at.update(big_at)
            elif op == "call":
                walk(re.search(r"to_apply=%?([\w.\-]+)", ins).group(1), mult, acc, at)
            elif op == "custom-call":
                acc["custom-call:" + re.search(r'custom_call_target="([^"]+)"', ins).group(1)] += mult
            elif op == "fusion":
                kind = re.search(r"kind=(\w+)", ins)
                acc["fusion:" + (kind.group(1) if kind else "?")] += mult
            else:
                acc[op] += mult

    acc: collections.Counter = collections.Counter()
    walk(entry, 1, acc)
    return acc


def jitted_name(hlo: str) -> str:
    """The jitted function a compiled module is: `HloModule jit_<name>`."""
    m = re.match(r"HloModule jit_([\w.]+)", hlo)
    return m.group(1) if m else ""


def by_call_path(where: collections.Counter, depth: int, root: str = "") -> collections.Counter:
    """Kernels by the first `depth` functions of their call path, from the jitted function `root` down (the frames
    that called it, such as this script's, are left out)."""
    out: collections.Counter = collections.Counter()
    for path, n in where.items():
        names = [f for f, _, _ in path]
        at = [i for i, f in enumerate(names) if f.rsplit(".", 1)[-1] == root]  # "a.<locals>.root" is root too
        names = names[at[0]:] if at else names
        out[" > ".join(names[:depth]) or "(no source)"] += n
    return out


def total(c: collections.Counter) -> int:
    """Kernels in a count (the loop and conditional markers are not kernels)."""
    return sum(v for k, v in c.items() if not k.startswith(("loops", "conditionals")))


# ------------------------------------------------------------------------------------------------ compiling
def aot_device():
    """A compile-only H200 (needs jax's CUDA plugin; no GPU, no driver)."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", topology_name="", target_config=H200_TARGET,
                                        topology="1x1x1")
    return topo.devices[0]


@contextlib.contextmanager
def gpu_tracing():
    """While tracing for the AOT device: kernels lower for the GPU (not interpret mode, which they pick on a CPU
    backend), and Pallas-Triton lowers for an H200."""
    import jax
    from jax._src.pallas.triton import gpu_info

    saved = jax.default_backend, gpu_info.get_gpu_info
    jax.default_backend = lambda: "gpu"
    gpu_info.get_gpu_info = lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    try:
        yield
    finally:
        jax.default_backend, gpu_info.get_gpu_info = saved


def compile_for(dev, fn, static: tuple, arrays: tuple, **static_kw) -> str:
    """HLO text of the jitted `fn(*static, *arrays, **static_kw)` compiled for `dev`, each array replaced by its
    shape there (nothing is computed or copied)."""
    import jax

    sh = jax.sharding.SingleDeviceSharding(dev)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), arrays)
    with gpu_tracing():
        lowered = fn.trace(*static, *abstract, **static_kw).lower()
    text = lowered.compile().as_text()
    if os.environ.get("DUMP_HLO"):  # the compiled module, to read what a count is made of (DUMP_HLO=<folder>)
        os.makedirs(os.environ["DUMP_HLO"], exist_ok=True)
        with open(os.path.join(os.environ["DUMP_HLO"], f"hlo_{jitted_name(text) or 'step'}.txt"), "w") as f:
            f.write(text)
    return text


# ------------------------------------------------------------------------------------------------ configurations
def capture(module, name: str, run):
    """The arguments of the first call of `module.name` made by `run()` (which is stopped there)."""
    got = {}

    class _Stop(Exception):
        pass

    def record(*a, **kw):
        got["args"], got["kw"] = a, kw
        raise _Stop

    saved = getattr(module, name)
    setattr(module, name, record)
    try:
        run()
    except _Stop:
        pass
    finally:
        setattr(module, name, saved)
    if not got:
        raise RuntimeError(f"{module.__name__}.{name} was not called")
    return got["args"], got["kw"]


def compile_config(name: str, args, cpu_llm, gpu_engine, dev) -> str:
    """Compile one configuration for `dev` with the GPU engine's kernels; its arguments' shapes come from a short
    real run of the same configuration on the CPU."""
    from lucebox_jax import SamplingParams, engine, scheduler, spec_batch, speculative
    from lucebox_jax.drafters import build
    from lucebox_jax.speculative import SpeculativeDecoder

    cfg, ks, w = gpu_engine.cfg, gpu_engine.kernels, gpu_engine.weights
    greedy = SamplingParams(max_tokens=4, temperature=args.temperature, seed=0)  # (greedy unless --temperature)
    prompt = ["Write a haiku about the sea."]
    if name in ("decode", "batch"):
        rows = prompt * (1 if name == "decode" else args.batch)
        a, kw = capture(engine, "generate_loop", lambda: cpu_llm.generate(rows, greedy))
        return compile_for(dev, engine.generate_loop, (cfg, ks), (w, *a[3:]), **kw)
    if name in ("prefill", "spec-prefill"):  # one prompt's start program (with the head's feature layers: spec-)
        if name == "spec-prefill":
            cpu_llm.spec = SpeculativeDecoder.create(cpu_llm.engine, "eagle", args.k, tokenizer=cpu_llm.tokenizer)
        try:  # (start_step is called on every generate; prefill_step only traced inside it, once)
            a, kw = capture(engine, "start_step", lambda: cpu_llm.generate(prompt, greedy))
        finally:
            cpu_llm.spec = None
        return compile_for(dev, engine.start_step, (cfg, ks), (w, a[3], a[4]), max_len=a[5], **kw)
    if name in ("chain", "tree"):
        tree = args.tree if name == "tree" else None
        cpu_llm.spec = SpeculativeDecoder.create(cpu_llm.engine, "eagle", args.k, tokenizer=cpu_llm.tokenizer,
                                                 tree=tree)
        try:
            a, kw = capture(speculative, "spec_chunk", lambda: cpu_llm.generate(prompt, greedy))
        finally:
            cpu_llm.spec = None
        drafter = build("eagle", gpu_engine)
        return compile_for(dev, speculative.spec_chunk, (cfg, ks, drafter), (w, drafter.params, *a[5:]), **kw)
    if name in ("slots", "spec-slots"):  # a batch job's decode call (scheduler.py), plain or speculating per slot
        saved = cpu_llm.max_batch
        cpu_llm.max_batch = args.slots  # more prompts than slots: the scheduler runs them
        if name == "spec-slots":
            cpu_llm.spec = SpeculativeDecoder.create(cpu_llm.engine, "eagle", args.k, tokenizer=cpu_llm.tokenizer)
        target = (spec_batch, "spec_decode_chunk") if cpu_llm.spec is not None else (scheduler, "decode_chunk")
        try:
            a, kw = capture(*target, lambda: cpu_llm.generate(prompt * (args.slots + 1), greedy))
        finally:
            cpu_llm.max_batch, cpu_llm.spec = saved, None
        if name == "slots":
            return compile_for(dev, scheduler.decode_chunk, (cfg, ks), (w, *a[3:]), **kw)
        drafter = build("eagle", gpu_engine)
        return compile_for(dev, spec_batch.spec_decode_chunk, (cfg, ks, drafter), (w, drafter.params, *a[5:]), **kw)
    if name == "insert":  # an admission's insert of its prefilled rows into a batch job's slots (scheduler.py)
        saved = cpu_llm.max_batch
        cpu_llm.max_batch = args.slots
        try:
            a, kw = capture(scheduler, "insert_rows", lambda: cpu_llm.generate(prompt * (args.slots + 1), greedy))
        finally:
            cpu_llm.max_batch = saved
        return compile_for(dev, scheduler.insert_rows, (), a, **kw)
    raise SystemExit(f"unknown configuration {name!r}: decode, batch, chain, tree, slots, spec-slots, insert, "
                     "prefill, spec-prefill")


def compile_synthetic_decode(preset: str, args, ks, dev) -> str:
    """One decode step of a synthetic model's shapes (synthetic.PRESETS; weights only as shapes, never made):
    int4 g--group (or int8 g32: --linear-bits 8) with a Q8_0-style int8 head, as bench_decode builds them, batch
    --batch-syn, cache --context."""
    import jax
    import jax.numpy as jnp

    from lucebox_jax import engine, ops, synthetic
    from lucebox_jax.model import init_cache
    from lucebox_jax.sampling import RowParams, SamplingParams

    cfg = synthetic.PRESETS[preset].replace(dtype="bfloat16")
    b = args.batch_syn
    w = jax.eval_shape(lambda: ops.prepare_weights(  # (int8 layers are g32 whatever --group says)
        synthetic.random_weights(cfg, jax.random.key(0), args.group, linear_bits=args.linear_bits), ks))
    cache = jax.eval_shape(lambda: init_cache(cfg, b, args.context))
    rp = RowParams.from_params([SamplingParams(temperature=0.0)] * b, static=True)  # as LLM.generate runs it
    seen = jax.ShapeDtypeStruct((b, cfg.vocab_size), jnp.bool_)
    tokens = jax.ShapeDtypeStruct((b,), jnp.int32)
    if args.tree_syn:  # a tree verify of --tree-syn nodes (and the root), chains of depth 4 as bench_spec times it
        from lucebox_jax.tree import tree_verify

        n, depth = args.tree_syn, 4
        width = -(-n // depth)
        parent = jnp.asarray([[0 if i < width else i - width + 1 for i in range(n)]] * b, jnp.int32)
        depths = jnp.asarray([[1 + i // width for i in range(n)]] * b, jnp.int32)
        def fn(w_, c_, tok, nodes, st, sn):  # -> (accepted, path, next token, cache): the cache donated, as run
            out = tree_verify(cfg, ks, w_, c_, tok, nodes, parent, depths, st, sn, width, depth)
            return (*out[:3], out[5])

        fn = jax.jit(fn, donate_argnums=1)
        nodes = jax.ShapeDtypeStruct((b, n), jnp.int32)
        return compile_for(dev, fn, (), (w, cache, tokens, nodes, rp, seen))
    if args.verify_syn:  # a speculative chain verify of K = --verify-syn drafts (K + 1 rows a sequence)
        from lucebox_jax import speculative

        drafts = jax.ShapeDtypeStruct((b, args.verify_syn), jnp.int32)
        active = jax.ShapeDtypeStruct((b,), jnp.bool_)
        return compile_for(dev, speculative.verify_step, (cfg, ks), (w, cache, tokens, drafts, None, rp, seen, active),
                           n_logprobs=0)
    return compile_for(dev, engine.decode_step, (cfg, ks), (w, cache, tokens, rp, seen), n_logprobs=0)


def compare(before: dict, after: dict) -> list[str]:
    """Markdown lines: what changed between two kernel_count.json files, per configuration, by kind and call path."""
    out = []
    same = before.get("depth") is not None and before.get("depth") == after.get("depth")
    keys = ("by_kind", "by_source") if same else ("by_kind",)
    if len(keys) == 1:
        out.append("(call paths not compared: the two runs used different (or unrecorded) --depth)")
    for name in [n for n in after["configs"] if n in before["configs"]]:
        a, b = before["configs"][name], after["configs"][name]
        out += [f"\n{name}: {a['kernels']} -> {b['kernels']} kernels ({b['kernels'] - a['kernels']:+d})",
                "| kernels by | what | before | after |", "|---|---|---|---|"]
        for key in keys:
            for what in sorted(set(a[key]) | set(b[key])):
                x, y = a[key].get(what, 0), b[key].get(what, 0)
                if x != y:
                    out.append(f"| {key[3:]} | {what} | {x} | {y} |")
    return out


# ------------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF or checkpoint (default: the embedded model)")
    p.add_argument("--configs", default="decode,chain,tree",
                   help="decode, batch, chain, tree, slots, spec-slots (comma-separated)")
    p.add_argument("--kernels", default=None,
                   help="the GPU kernel set, e.g. 'qmatmul=pallas' (default: the H200's defaults)")
    p.add_argument("--k", type=int, default=4, help="drafts per step (chain) and tree depth")
    p.add_argument("--tree", type=int, default=32, help="tree nodes")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the steps counted")
    p.add_argument("--batch", type=int, default=32, help="rows of the batch configuration")
    p.add_argument("--slots", type=int, default=8, help="slots of the slots / spec-slots configurations")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--synthetic", default=None, help="count one decode step of these synthetic.PRESETS shapes "
                   "instead (e.g. llama3-8b); --configs is ignored")
    p.add_argument("--batch-syn", type=int, default=1, help="rows of the synthetic decode step")
    p.add_argument("--verify-syn", type=int, default=0, help="with --synthetic: count a chain verify of this many "
                   "drafts instead of a decode step")
    p.add_argument("--tree-syn", type=int, default=0, help="with --synthetic: count a tree verify of this many nodes")
    p.add_argument("--context", type=int, default=1024, help="cache length of the synthetic decode step")
    p.add_argument("--group", type=int, default=128, help="int4 group size of the synthetic weights (as bench_decode)")
    p.add_argument("--linear-bits", type=int, choices=(4, 8), default=4,
                   help="8: int8 g32 linear layers (a Q4_K_M file's layout, as bench_decode --linear-bits 8)")
    p.add_argument("--branch", choices=("smallest", "largest"), default="smallest",
                   help="which branch of a conditional the tables count (smallest: greedy sampling)")
    p.add_argument("--depth", type=int, default=4, help="call-path levels in the by-source table")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), default=None,
                   help="compile nothing: what changed between two kernel_count.json files")
    args = p.parse_args(argv)
    if args.compare:
        with open(args.compare[0]) as f, open(args.compare[1]) as g:
            print("\n".join(compare(json.load(f), json.load(g))))
        return 0

    import jax

    from lucebox_jax import LLM, ops
    from lucebox_jax.engine import Engine
    from lucebox_jax.ops import KernelSet

    dev = aot_device()
    if args.synthetic:
        cpu_llm = gpu_engine = None
        args.configs = (f"tree{args.tree_syn}" if args.tree_syn else f"verify{args.verify_syn}" if args.verify_syn
                        else "decode") + \
            f":{args.synthetic}:batch{args.batch_syn}"
    ops._load_builtins()
    chosen = {op: ops._DEFAULTS["gpu"][op] for op in ops.OPS}
    chosen.update(ops._DEFAULTS.get("gpu:sm90", {}))
    chosen.update(ops.parse_spec(args.kernels))
    ks = KernelSet(**chosen)  # not resolve(): it would refuse GPU kernels on this CPU
    if not args.synthetic:
        cpu_llm = LLM(args.model, dtype=args.dtype, compilation_cache=False)  # a CPU run gives each call its shapes
        gpu_engine = Engine(cpu_llm.engine.cfg, cpu_llm.engine.weights, ks)
        gpu_engine.model_name = cpu_llm.engine.model_name
    out = {"device": "NVIDIA H200 (compile only)", "jax": jax.__version__, "kernels": ks.describe(),
           "model": args.synthetic or cpu_llm.source, "depth": args.depth, "configs": {}}
    print(f"kernels: {ks.describe()}", flush=True)
    for name in args.configs.split(","):
        t0 = time.time()
        where: collections.Counter = collections.Counter()
        hlo = (compile_synthetic_decode(args.synthetic, args, ks, dev) if args.synthetic
               else compile_config(name, args, cpu_llm, gpu_engine, dev))
        c = count_kernels(hlo, where, branch=args.branch)
        other = total(count_kernels(hlo, branch="smallest" if args.branch == "largest" else "largest"))
        by_source = by_call_path(where, args.depth, jitted_name(hlo))
        out["configs"][name] = {"kernels": total(c), "kernels_other_branches": other, "by_kind": dict(c.most_common()),
                                "by_source": dict(by_source.most_common())}
        print(f"\n{name}: {total(c)} kernels with each conditional's {args.branch} branch, {other} with its "
              f"{'smallest' if args.branch == 'largest' else 'largest'} ({time.time() - t0:.0f} s to compile)")
        print("| kind | kernels |\n|---|---|")
        for k, v in c.most_common():
            print(f"| {k} | {v} |")
        print(f"\n| where (call path, {args.depth} levels below the step) | kernels |\n|---|---|")
        for k, v in by_source.most_common():
            print(f"| {k} | {v} |")
    os.makedirs(os.environ.get("OUT") or "/tmp", exist_ok=True)
    path = os.path.join(os.environ.get("OUT") or "/tmp", "kernel_count.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
