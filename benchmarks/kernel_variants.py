"""Kernel variants registered for benchmarking only, to compare whole decode steps under one flag:

    python3 benchmarks/bench_decode.py --kernels-module benchmarks.kernel_variants \
        --kernel-sets ';qmatmul=pallas_nosplit_small;qmatmul8=xla'

Why: a 135M model's int4 matmuls are a few hundred KB each, so their time is latency (launch, memory round trips),
not bytes. These variants only change knobs of the registered Pallas kernels for such small weights; a winner moves
into `pallas_kernels/int4_matmul.default_config` (H200, 2026-12-02: no split at all was 2.2x slower, one K tile per
program won and is now the default; benchmarks/RESULTS.md, "small weights").  `pallas_asmfma` is the other way
round: the big weights at M = 1 through int4_matmul's fused asm decode + FMA (`decode="asm_fma"`), to time a whole
8B step with it (`--models llama3-8b --batches 1 --kernel-sets ';qmatmul=pallas_asmfma'`).
"""

from __future__ import annotations

from lucebox_jax import kernels_xla, ops
from lucebox_jax.kernels_pallas import qmatmul_pallas_op
from pallas_kernels.int4_matmul import qmatmul_pallas

SMALL_BYTES = 8 << 20  # int4 weights below this are "small" (SmolLM2: all of them; Llama-3-8B: none)


def _small(w) -> bool:
    return w.nbytes < SMALL_BYTES


def _variant(max_m=64, **knobs):
    def fn(x, w):
        if x.shape[0] > max_m or not _small(w):
            return qmatmul_pallas_op(x, w)
        if w.group_size & (w.group_size - 1) or (x.shape[-1] // 2) % w.group_size:
            return kernels_xla.qmatmul_xla(x, w)
        return qmatmul_pallas(x, w, **knobs)

    return fn


ops.register("qmatmul", "pallas_nosplit_small")(_variant(split_k=1))
ops.register("qmatmul", "pallas_nosplit_small_n64")(_variant(split_k=1, block_n=64))
ops.register("qmatmul", "pallas_split2_small")(_variant(split_k=2))
# one K tile per program (split_k clamps to the tile count): one memory round trip per program, then the combine
ops.register("qmatmul", "pallas_splitall_small")(_variant(max_m=16, split_k=1 << 12))
ops.register("qmatmul", "pallas_splitall_small_n64")(_variant(max_m=16, split_k=1 << 12, block_n=64))
ops.register("qmatmul", "pallas_splitall_small_dot")(_variant(max_m=16, split_k=1 << 12, mode="dot", decode="asm"))


def _asm_fma(x, w):
    """M = 1: int4_matmul's fused asm decode + FMA (mode fma, block 128 x 64); other M: the registered kernel."""
    if x.shape[0] != 1 or _small(w) or (x.shape[-1] // 2) % w.group_size:
        return qmatmul_pallas_op(x, w)
    return qmatmul_pallas(x, w, mode="fma", decode="asm_fma", block_k=128, block_n=64)  # block_k halves to fit K


# decode="asm_fma" (4 instructions per weight instead of 5.4-6.8) for every big weight at M = 1 (H200: won only on
# down g128, where the tuned table now uses it; benchmarks/RESULTS.md, "Round 5")
ops.register("qmatmul", "pallas_asmfma")(_asm_fma)
