#!/usr/bin/env bash
# The same whole-model decode benchmark (bench_decode.py) under several XLA_FLAGS settings, one process each (XLA
# reads its flags once, at start-up). Why: a 135M model's step is ~470 small kernels, so how XLA launches them (CUDA
# graphs, "command buffers", and which op types go into them) may matter as much as the kernels themselves.
# tokens_sha in each row must agree across settings: the flags change how kernels are launched, never the math.
# Usage on the device machine (repo root):
#   ARGS="--models smollm2-135m --batches 1,32" bash benchmarks/bench_xla_flags.sh
# SETTINGS="0 2" runs only those settings (indices into NAMES); TAG names this run's files.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
ALL="FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"
declare -a NAMES=(default no_graphs graphs_all graphs_all_min1)
declare -a FLAGS=("" "--xla_gpu_enable_command_buffer=" "--xla_gpu_enable_command_buffer=$ALL"
                  "--xla_gpu_enable_command_buffer=$ALL --xla_gpu_graph_min_graph_size=1")
for i in ${SETTINGS:-0 1 2 3}; do
  n=${TAG:-}${NAMES[$i]}
  XLA_FLAGS="${FLAGS[$i]}" timeout "${RUN_SECONDS:-90}" python3 benchmarks/bench_decode.py --xla-batches 0 ${ARGS:-} \
    2>&1 | grep -v -i "warn\|donat\|deprecat" > "$OUT/flags_$n.log"
  [ -f "$OUT/bench_decode.json" ] && mv "$OUT/bench_decode.json" "$OUT/flags_$n.json"
done
echo "setting          model          B  ms/step    tok/s  tokens_sha"
for i in ${SETTINGS:-0 1 2 3}; do
  n=${TAG:-}${NAMES[$i]}
  python3 - "$OUT/flags_$n.json" "$n" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))
    rows = rows["rows"] if isinstance(rows, dict) else rows
except Exception as e:
    print(f"{sys.argv[2]:16} failed: {type(e).__name__}: {e}"[:100]); sys.exit()
for r in rows:
    if "error" in r:
        print(f"{sys.argv[2]:16} {r['model']:14} {r['batch']:2d} error: {r['error']}"[:120])
        continue
    print(f"{sys.argv[2]:16} {r['model']:14} {r['batch']:2d} {r['ms_per_step']:8.3f} {r['tok_s']:8.0f}"
          f"  {r.get('tokens_sha')}")
PY
done
