#!/usr/bin/env python3
"""The Mosaic-GPU qmatmul's PTX and ptxas report for one configuration, made on a machine without a GPU.

jax's CUDA plugin (the `.venv-aot` of `benchmarks/kernel_count.py`, `scripts/setup_aot.sh`) compiles for an H200 it is
only told about, Mosaic GPU's kernels included: its MLIR goes to PTX and through ptxas for sm_90a, and
MOSAIC_GPU_DUMP_PTX writes both. So, before any GPU time: whether a configuration compiles at all, its registers and
spills, and how many of each instruction a step issues (the int4 -> bf16 conversion is most of the kernel's
instructions: RESULTS.md, twenty-fourth session). A count, not a time. With --sass, also the machine code ptxas made
(nvdisasm, from the `nvidia-cuda-nvdisasm` wheel that `scripts/setup_aot.sh` installs): its opcodes in the whole kernel
and in the wgmma block (from the label before the first wgmma to the branch after the last: one step's loads, int4
decode, wgmmas and scaling), the instructions a warp really issues, PTX's register moves gone.

    .venv-aot/bin/python benchmarks/mgpu_ptx.py gate_up 'gate_up:{"pair":true,"scale_after":false}' --group 32

Each case is `shape[:json knobs]`: a decode matmul of --model (gate_up, down, qkv, o; head is int8 g32), the engine's
configuration for it at --m rows (`kernels_mgpu.config_for`) with the knobs replaced. Int4 g32 weights carry mins (a
Q4_1 / Q4_K import's layout); g128 are symmetric. Output: per case the ptxas line (registers, spills), the PTX
instruction counts, most frequent first (--top sets how many), and with --sass the SASS counts.
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
    if "--sass" in sys.argv:
        os.environ["MOSAIC_GPU_DUMP_SASS"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def weight_spec(k: int, n: int, g: int, bits: int, cfg, sharding):
    """An abstract weight as the engine stores it for `cfg` (`kernels_mgpu.abstract_weight`), on `sharding`."""
    import jax

    from lucebox_jax import kernels_mgpu as km

    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                        km.abstract_weight(k, n, g, bits, cfg))


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
    return cfg, read("ptxas"), read("ptx"), read("sass") or read("sass_ctrl")


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


SASS_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)")


def sass_counts(sass: str) -> tuple[collections.Counter, collections.Counter]:
    """Opcode -> count over the SASS (predicates left out), in all and in the wgmma block: from the last label before
    the first HGMMA to the first branch after the last one (one step of the main loop, whatever the unrolling)."""
    lines = sass.splitlines()
    ops = [(i, m.group(1)) for i, line in enumerate(lines) if (m := SASS_OP.search(line))]
    wg = [i for i, op in ops if op.startswith("HGMMA")]
    total = collections.Counter(op for _, op in ops)
    if not wg:
        return total, collections.Counter()
    start = max([i for i, line in enumerate(lines[: wg[0]]) if re.match(r"\s*\.L\w*:", line)], default=0)
    end = next((i for i, op in ops if i > wg[-1] and op in ("BRA", "EXIT")), len(lines))
    return total, collections.Counter(op for i, op in ops if start < i <= end)


def nvdisasm_on_path() -> None:
    """Puts the `nvidia-cuda-nvdisasm` wheel's binary on PATH (Mosaic GPU runs nvdisasm to dump SASS)."""
    import shutil

    import nvidia

    for root in nvidia.__path__:
        for d in glob.glob(os.path.join(root, "cu*", "bin")) + [os.path.join(root, "cuda_nvdisasm", "bin")]:
            if os.path.exists(os.path.join(d, "nvdisasm")):
                os.environ["PATH"] = d + os.pathsep + os.environ["PATH"]
    if not shutil.which("nvdisasm"):
        raise SystemExit("--sass needs nvdisasm: scripts/setup_aot.sh (or pip install nvidia-cuda-nvdisasm)")


def listing(ops: collections.Counter, top: int) -> str:
    return ", ".join(f"{op} {c}" for op, c in ops.most_common(top)) + f"; {sum(ops.values())} in all"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="+", help="shape[:json knobs], e.g. gate_up 'down:{\"split_k\": 8}'")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--group", type=int, choices=(32, 128), default=128, help="int4 group (32: with mins)")
    ap.add_argument("--m", type=int, default=1, help="rows")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--sass", action="store_true", help="also count the SASS (needs nvdisasm)")
    args = ap.parse_args(argv)
    import kernel_count as kc

    if args.sass:
        nvdisasm_on_path()
    dev = kc.aot_device()
    for case in args.cases:
        cfg, ptxas, ptx, sass = compile_case(case, args.model, args.group, args.m, dev)
        print(f"{case} g{args.group} M={args.m}: {cfg}")
        print("  " + " | ".join(re.findall(r"Used \d+ registers[^\n]*|\d+ bytes spill \w+", ptxas)))
        print("  PTX: " + listing(instruction_counts(ptx), args.top))
        if args.sass:
            total, block = sass_counts(sass)
            print("  SASS, wgmma block: " + listing(block, args.top))
            print("  SASS, kernel: " + listing(total, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
