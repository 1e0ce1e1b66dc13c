#!/usr/bin/env bash
# The decode attention's split, A/B on the GPU: `bench_decode.py` on the embedded model's shapes (random weights)
# under each LUCEBOX_ATTN_DECODE setting (';'-separated, the first empty: the default), at each context in CTXS.
# One split has no merge kernel (one fewer a layer) but fewer programs read the cache; which wins depends on the
# context and the batch. Usage on the device (repo root): bash benchmarks/gpu_attn_split_ab.sh  (logs under $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
IFS=';' read -ra SETS <<< "${ATTN_SETS:-;n_split=1,block_k=128}"
for ctx in ${CTXS:-256 1024}; do
  for i in "${!SETS[@]}"; do
    mkdir -p "$OUT/ab_${ctx}_$i"
    LUCEBOX_ATTN_DECODE="${SETS[$i]}" OUT="$OUT/ab_${ctx}_$i" timeout "${AB_SECONDS:-120}" \
      python3 benchmarks/bench_decode.py --models "${AB_MODELS:-smollm2-135m}" --batches "${AB_BATCHES:-1,32}" \
      --xla-batches "" --kernel-sets qmatmul=best,qmatmul8=best --reps 2 --ctx "$ctx" >"$OUT/attn_ab_${ctx}_$i.log" 2>&1
    echo "ctx $ctx LUCEBOX_ATTN_DECODE='${SETS[$i]}':"
    grep -E "^(smollm2|llama3)|ERROR|Error" "$OUT/attn_ab_${ctx}_$i.log" | tail -4
  done
done
