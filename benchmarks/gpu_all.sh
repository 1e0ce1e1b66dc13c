#!/usr/bin/env bash
# One GPU call for issue 3's table, each step capped so the rest still runs: the kernel benchmark (copy bandwidth,
# int4 qmatmul vs XLA over the 8B layer shapes and M, int8 head, attention), the whole-model decode benchmark, then
# the peer sections in the time left.
# Usage on the device machine (repo root, .peers carried):  BUDGET=570 bash benchmarks/gpu_all.sh
# KERNEL_SECONDS=0 skips the kernel step; DECODE_ARGS / PEER_SECTIONS / PEER_SECONDS adjust the others;
# KERNEL_SECTIONS picks bench_kernels' sections; GPU_TESTS=0 skips the `gpu`-marked pytest run that comes first;
# GEMV_SECONDS=N adds benchmarks/bench_gemv.py;
# DECODE=0 skips the decode benchmark and the peers (e.g. a first call of tests + kernels, a second of decode + peers).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-570}
start=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
export PYTHONUNBUFFERED=1 PYTHONPATH=.
F="warn\|donat\|deprecat"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "${GPU_TESTS:-1}" = 1 ]; then  # the `gpu`-marked tests: compiled kernels against their references
  timeout "${GPU_TESTS_SECONDS:-150}" python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu \
    tests/test_pallas_kernels.py tests/test_int4_gemv.py > "$OUT/gpu_tests.log" 2>&1
fi
if [ "${GEMV_SECONDS:-0}" -gt 0 ]; then  # int4_matmul's asm_fma variants and the K-major GEMV at M = 1
  timeout $(( GEMV_SECONDS + 30 )) python3 benchmarks/bench_gemv.py --ms 1 --budget "$GEMV_SECONDS" ${GEMV_ARGS:-} \
    2>&1 | grep -v -i "$F" > "$OUT/gemv.log"
fi
KS=${KERNEL_SECONDS:-200}
if [ "$KS" -gt 0 ]; then
  timeout $(( KS + 20 )) python3 benchmarks/bench_kernels.py \
    --sections "${KERNEL_SECTIONS:-copy,qmatmul,q8,decode,prefill}" --budget "$KS" 2>&1 | grep -v -i "$F" > "$OUT/kernels.log"
fi
if [ "${DECODE:-1}" = 1 ]; then
  dt=$(( $(left) - ${PEER_SECONDS:-200} )); [ "$dt" -lt 60 ] && dt=60
  timeout "$dt" python3 benchmarks/bench_decode.py ${DECODE_ARGS:-} 2>&1 | grep -v -i "$F" > "$OUT/decode.log"
fi
if [ "${DECODE:-1}" = 1 ] && [ -f .peers/peer_bench.py ] && [ "$(left)" -gt 60 ]; then
  python3 .peers/peer_bench.py --sections "${PEER_SECTIONS:-B,D_int4_b1,C_static_b1,C_static_b32}" \
    --budget $(( $(left) - 10 )) 2>&1 | tail -40 > "$OUT/peer.log"
fi
echo "=== gpu tests"; tail -3 "$OUT/gpu_tests.log" 2>/dev/null
echo "=== gemv"; sed -n '/^shape quant M/,$p' "$OUT/gemv.log" 2>/dev/null
echo "=== kernels"; [ -f "$OUT/table.txt" ] && cat "$OUT/table.txt"
echo "=== peers"; grep "^[A-D] |" "$OUT/peer.log" 2>/dev/null
echo "=== decode table"; sed -n '/^copy bandwidth .*; /,$p' "$OUT/decode.log"
