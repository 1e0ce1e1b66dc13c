#!/usr/bin/env python3
"""The Mosaic-GPU qmatmul's PTX and ptxas report for one configuration, made on a machine without a GPU.

jax's CUDA plugin (the `.venv-aot` of `benchmarks/kernel_count.py`, `scripts/setup_aot.sh`) compiles for an H200 it is
only told about, Mosaic GPU's kernels included: its MLIR goes to PTX and through ptxas for sm_90a, and
MOSAIC_GPU_DUMP_PTX writes both. So, before any GPU time: whether a configuration compiles at all, its registers and
spills, and how many of each instruction a step issues (the int4 -> bf16 conversion is most of the kernel's
instructions: RESULTS.md, twenty-fourth session). A count, not a time.

    .venv-aot/bin/python benchmarks/mgpu_ptx.py gate_up 'gate_up:{"pair":true,"scale_after":false}' --group 32

Each case is `shape[:json knobs]`: a decode matmul of --model (gate_up, down, qkv, o; head is int8 g32), the engine's
configuration for it at --m rows (`kernels_mgpu.config_for`) with the knobs replaced. Int4 g32 weights carry mins (a
Q4_1 / Q4_K import's layout); g128 are symmetric. Output: per case the ptxas line (registers, spills) and the PTX
instruction counts, most frequent first; --top sets how many.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import re
import sys
import tempfile

DUMP = tempfile.mkdtemp(prefix="mgpu_ptx_") if __name__ == "__main__" else None  # (importing it dumps nothing)
if DUMP:  # before jax reads them
    os.environ.update(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=DUMP)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def weight_spec(k: int, n: int, g: int, bits: int, cfg, sharding):
    """An abstract weight as `kernels_mgpu` repacks it for `cfg` (codes order and rows follow the configuration)."""
    import jax
    import jax.numpy as jnp

    from lucebox_jax import kernels_mgpu as km
    from pallas_kernels import mgpu_qmatmul as mg

    cg = 2 * g if cfg.pair else g
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
    return mg.MgpuWeight(codes=sds((k // cg, n, cg), jnp.int4 if bits == 4 else jnp.int8),
                         scales=sds((k // g, n), jnp.float16),
                         offsets=sds((k // g, n), jnp.float16) if bits == 4 and g == 32 else None,
                         group_size=g, bits=bits, **km.stored_order(cfg, g, bits))


def compile_case(case: str, model: str, group: int, m: int, dev) -> tuple[object, str, str]:
    """Compiles one case for `dev`; returns its configuration, the ptxas report and the PTX."""
    import jax
    import jax.numpy as jnp

    from lucebox_jax import kernels_mgpu as km
    from lucebox_jax.synthetic import PRESETS, decode_matmuls
    from pallas_kernels import mgpu_qmatmul as mg

    import kernel_count as kc  # (here: importing it sets the CPU platform for the process)

    label, _, knobs = case.partition(":")
    k, n = {lb: (k, n) for lb, k, n in decode_matmuls(PRESETS[model])}[label]
    g, bits = (32, 8) if label == "head" else (group, 4)
    knobs = json.loads(knobs) if knobs else {}
    cfg = dataclasses.replace(km.config_for(m, k, n, g, bits, pair=knobs.get("pair")), **knobs)
    if why := mg.check_config(k, n, g, bits, cfg):
        raise SystemExit(f"{case}: {why}")
    sh = jax.sharding.SingleDeviceSharding(dev)
    for f in glob.glob(os.path.join(DUMP, "*")):
        os.remove(f)
    with kc.gpu_tracing():
        lowered = jax.jit(lambda x, w: mg.mgpu_matmul(x, w, cfg)).trace(
            jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=sh), weight_spec(k, n, g, bits, cfg, sh)).lower()
    lowered.compile()
    read = lambda ext: "".join(open(p).read() for p in sorted(glob.glob(os.path.join(DUMP, f"*.{ext}"))))  # noqa
    return cfg, read("ptxas"), read("ptx")


def instruction_counts(ptx: str) -> collections.Counter:
    """Opcode -> count over the PTX's statements, the inline-asm blocks' included (several to a line, in braces);
    declarations, labels and predicates left out."""
    ptx = re.sub(r"//[^\n]*|^\s*\.(loc|file)\b[^\n]*", "", ptx, flags=re.M)  # (debug lines end in no ';')
    ops = collections.Counter()
    for stmt in re.split(r"[;{}]", ptx):
        stmt = re.sub(r"^\s*(\$?\w+:\s*)?(@!?%\w+\s+)?", "", stmt)
        op = re.match(r"[a-z][\w.]*", stmt)
        if op and op.group() != "ret":
            ops[op.group()] += 1
    return ops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="+", help="shape[:json knobs], e.g. gate_up 'down:{\"split_k\": 8}'")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--group", type=int, choices=(32, 128), default=128, help="int4 group (32: with mins)")
    ap.add_argument("--m", type=int, default=1, help="rows")
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args(argv)
    import kernel_count as kc

    dev = kc.aot_device()
    for case in args.cases:
        cfg, ptxas, ptx = compile_case(case, args.model, args.group, args.m, dev)
        ops = instruction_counts(ptx)
        print(f"{case} g{args.group} M={args.m}: {cfg}")
        print("  " + " | ".join(re.findall(r"Used \d+ registers[^\n]*|\d+ bytes spill \w+", ptxas)))
        print("  " + ", ".join(f"{op} {c}" for op, c in ops.most_common(args.top)) + f"; {sum(ops.values())} in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
