#!/usr/bin/env bash
# One GPU call that runs the whole-model decode benchmark and then the peer sections in the time left.
# Usage on the device machine (repo root, .peers carried):  BUDGET=480 bash benchmarks/gpu_all.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-480}
start=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
timeout $(( $(left) - ${PEER_SECONDS:-200} )) python3 benchmarks/bench_decode.py ${DECODE_ARGS:-} 2>&1 \
  | grep -v -i "warn\|donat\|deprecat" | tee "$OUT/decode.log"
if [ -f .peers/peer_bench.py ] && [ "$(left)" -gt 60 ]; then
  python3 .peers/peer_bench.py --sections "${PEER_SECTIONS:-B,D_int4_b1,C_static_b1}" --budget $(( $(left) - 10 )) 2>&1 \
    | tail -40 | tee "$OUT/peer.log"
fi
echo "=== decode table"; sed -n '/^copy bandwidth .*; /,$p' "$OUT/decode.log"
