#!/usr/bin/env bash
# One GPU call, nothing carried but the repository: the `gpu`-marked tests of TESTS, then plain decoding
# (bench_decode.py, the embedded model's shapes, random weights) and speculative steps (bench_spec_steps.py, the same
# shapes and the shipped head) under each ';'-separated set of environment assignments in ENV_AB, one process each,
# sets in the order given (e.g. new;old;new). Results under $OUT (logs.tgz holds them all).
# Usage on the device (repo root):
#   ENV_AB='LUCEBOX_SPLIT_O=1 LUCEBOX_GATED_DOWN=1;LUCEBOX_SPLIT_O=0 LUCEBOX_GATED_DOWN=0' \
#     TESTS=tests/test_pending_inputs.py bash benchmarks/gpu_env_ab.sh
# DECODE_ARGS (default --batches 1,8 --ctx 256 --reps 3), STEPS_ARGS (default --configs 4,15@5 --reps 2; STEPS=0 skips
# them), TEST_SECONDS, DECODE_SECONDS, STEPS_SECONDS (timeouts) adjust.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
if [ -n "${TESTS:-}" ]; then
  timeout "${TEST_SECONDS:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu $TESTS > "$OUT/gpu_tests.log" 2>&1
  tail -3 "$OUT/gpu_tests.log"
fi
IFS=';' read -ra SETS <<< "${ENV_AB:-}"
for i in "${!SETS[@]}"; do
  echo "== set $i: ${SETS[$i]}"
  env ${SETS[$i]} OUT="$OUT/decode$i" timeout "${DECODE_SECONDS:-150}" python3 benchmarks/bench_decode.py \
    --models smollm2-135m --xla-batches '' ${DECODE_ARGS:---batches 1,8 --ctx 256 --reps 3} > "$OUT/decode$i.log" 2>&1
  grep -E "^smollm2" "$OUT/decode$i.log" | tail -4
  if [ "${STEPS:-1}" = 1 ]; then
    env ${SETS[$i]} OUT="$OUT" timeout "${STEPS_SECONDS:-150}" python3 benchmarks/bench_spec_steps.py \
      --name "steps$i" ${STEPS_ARGS:---configs 4,15@5 --reps 2} > "$OUT/steps$i.log" 2>&1
    tail -4 "$OUT/steps$i.log"
  fi
done
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz *.log *.json decode* 2>/dev/null; ls)
