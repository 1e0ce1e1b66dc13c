#!/usr/bin/env bash
# One H200 call for issue 11: where the Mosaic-GPU qmatmul spends its time (ncu on the tabled configurations), then
# configuration variants timed against the tabled ones and Pallas-Triton in the same call (bench_mgpu.py).
# Usage on the device (repo root): bash benchmarks/gpu_mgpu_probe.sh   (results under $OUT, one archive probe.tgz)
# NCU=0 / SWEEP=0 skip a part; NCU_CASES, VARIANTS (VARIANTS_<case> for one shape; PAIR_G128=1 for the g32 shapes on
# their g128 twins' configurations, paired), CASES, SWEEP_GROUPS (e.g. 32), SWEEP_BUDGET (per shape) adjust.
# ncu segfaulted under this script's first version on 2026-12-03 (fourth session), on a process's second case: each
# case now runs in its own ncu process; NCU defaults to 0. NCU_SOURCE=1 adds stall samples per SASS instruction (CSV).
# FULL_SWEEP=1: also an even spread of MAX_CONFIGS (12) candidate configurations per shape, after the variants;
# TUNED=1: the sweep also writes the engine's table (bench_mgpu --write-tuned; a copy comes back in the archive);
# DECODE=1: then the whole 8B-shaped step, `best` (the new table) against Pallas-Triton, and the tinygemm peer
# (.peers carried) in the same call; PROFILE=1 adds the per-kernel profile of each step, DECODE_SETS other kernel sets,
# PDL_AB=1 the same step again with LUCEBOX_MGPU_PDL=1 (programmatic dependent launch; PDL_SETS, default `best` only);
# DECODE_AB=cast|split again with LUCEBOX_MGPU_DECODE=... (the other int4 decode; split is the default); TABLE_AB
# the step with table entries changed (see below); MS (rows, default 1) and
# DECODE_BATCHES (default 1) take lists such as 1,16,64 and 1,8; FLAG_AB='f1;f2' the batch-1 step under each XLA_FLAGS;
# DECODE_VARIANTS (bench_decode --variants, e.g. engine,dynamic_sampling,norm_first,attn_combine_xla) and
# DECODE_MODELS (default llama3-8b) and DECODE_GROUP (int4 group, e.g. 32) widen the step's run;
# ATTN_AB=1 the batch-1 step with LUCEBOX_ATTN_COMBINE=kernel (ATTN_MODELS); TREE_AB=1 (no DECODE needed) the 8B
# verify of 9 rows and of a 32-node tree with attention_tree=xla, then =pallas (bench_spec.py part B).
# VERIFY_AB=1: the same 8B verifies (9 rows, a tree of 32) once per ';'-separated set of environment assignments in
# VERIFY_ENVS (default: the engine's defaults, then the twenty-seventh session's way, LUCEBOX_MGPU_WIDE=0
# LUCEBOX_TREE_ROWS=32, then the defaults again; one process each, compiles shared through a persistent cache; ~6
# minutes), e.g. VERIFY_ENVS='LUCEBOX_ATTN_PACK=0;' for the packed window's A/B; VERIFY_ARGS go to bench_spec.py
# (--syn-profile: where each verify's time goes, kernels by category).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
if [ "${NCU:-0}" = 1 ]; then
  # the sections that say whether the kernel waits on memory, on its own instructions, or on barriers and wgmma
  # one ncu process a case (the fourth session's segfault came on a process's second case)
  for c in ${NCU_CASES:-gate_up down}; do
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${NCU_TIMEOUT:-150}" ncu --clock-control none --profile-from-start off \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section InstructionStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
      python3 benchmarks/ncu_mgpu.py "$c" --reps 1 > "$OUT/ncu_${c%%:*}.log" 2>&1
    echo "ncu rc $? $c"
    grep -E "case |  [a-z_0-9]+ \(|Duration|DRAM Throughput|Memory Throughput|Warp Cycles Per Issued|Issue Slots Busy|Registers Per|Achieved Occ|Executed Ipc|No Eligible|Grid Size|stalled" "$OUT/ncu_${c%%:*}.log" | grep -v " 0$" | head -60
  done
  # NCU_SOURCE=1: the same cases' stall samples per SASS instruction (the full set to a report, then its source page
  # as CSV): which instructions the compute warps wait on
  if [ "${NCU_SOURCE:-0}" = 1 ]; then
    for c in ${NCU_CASES:-gate_up down}; do
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${NCU_TIMEOUT:-150}" ncu --clock-control none --profile-from-start off \
        --set full --import-source no -k regex:mosaic -o "$OUT/ncu_src_${c%%:*}" \
        python3 benchmarks/ncu_mgpu.py "$c" --reps 1 > "$OUT/ncu_src_${c%%:*}.log" 2>&1
      echo "ncu source rc $? $c"
      ncu --import "$OUT/ncu_src_${c%%:*}.ncu-rep" --page source --csv --print-source sass \
        > "$OUT/ncu_sass_${c%%:*}.csv" 2> "$OUT/ncu_sass_${c%%:*}.err"
      echo "sass rows $(wc -l < "$OUT/ncu_sass_${c%%:*}.csv")"; head -c 600 "$OUT/ncu_sass_${c%%:*}.csv"; echo
    done
  fi
fi
# by default (round 6): what bounds the skeleton, on the tabled (scale_after) configurations: no x^T copy; the TMA
# pipeline and barriers alone, as tabled, deeper, and with larger boxes (round 5 timed skip_scale / skip_convert,
# chains and scale_after: VARIANTS='{"probe":"skip_scale"};{"probe":"skip_convert"};{"scale_after":true}'; `chains` was removed in the seventh session)
DEFAULT_VARIANTS='{"probe":"skip_x"};{"probe":"skip_mma"};{"probe":"skip_mma","steps":8};{"probe":"skip_mma","groups":4,"steps":2};{"probe":"skip_mma","split_k":2}'
# STREAM=1 (tenth session, built on the CPU): the variants are the stream-K schedule on the tabled configuration, with
# its own step size, with one group a step (finer runs), 6 steps in flight, and two CTAs an SM (2 steps each);
# CASES then defaults to the four g128 shapes and the head
if [ "${STREAM:-0}" = 1 ]; then
  DEFAULT_VARIANTS='{"stream_k":true,"split_k":1};{"stream_k":true,"split_k":1,"groups":1};{"stream_k":true,"split_k":1,"steps":6};{"stream_k":true,"split_k":1,"ctas_per_sm":2,"steps":2}'
  CASES=${CASES:-gate_up down qkv o head}
fi
# PAIR_G128=1 (with SWEEP_GROUPS=32): each g32 shape's variants are its g128 twin's tabled (16-row) configuration on
# rows of two groups (`pair`, as many bytes a step: twice the groups, no scale_after), also with 6 steps in flight
pair_variants() {
  python3 -c "import json,sys; from lucebox_jax import kernels_mgpu as km
k,n={'gate_up':(4096,28672),'down':(14336,4096),'qkv':(4096,6144),'o':(4096,4096)}[sys.argv[1]]
c=dict(km.tuned_table()[km.tuned_key(16,k,n,128,4)]['cfg'])
c.update(pair=True, groups=2*c['groups'], scale_after=False); c.pop('split_decode', None)
print(json.dumps(c) + ';' + json.dumps({**c, 'steps': 6}))" "$1"
}
# MODEL=qwen3-32b (or gemma2-27b-shape): the sweep times that preset's shapes (bench_mgpu.py --model); LIKE_8B=1:
# each shape's variants are the 8B table's 16-row configuration of the same op, and it on 64-row tiles (a schedule
# the 8B sweeps found, for shapes no sweep has timed)
like_8b_variants() {
  python3 -c "import json,sys; from lucebox_jax import kernels_mgpu as km, synthetic as sy
k,n=dict((l,(k,n)) for l,k,n in sy.decode_matmuls(sy.PRESETS['llama3-8b']))[sys.argv[1]]
g,b=(32,8) if sys.argv[1]=='head' else (128,4)
c=dict(km.tuned_table()[km.tuned_key(16,k,n,g,b)]['cfg'])
print(json.dumps(c) + ';' + json.dumps({**c, 'tile_m': 64}))" "$1"
}
# VARIANTS_<case> (e.g. VARIANTS_down='{"tile_m":128}') replaces VARIANTS for that shape alone
per_case_variants() {
  local v="VARIANTS_$1"
  if [ "${PAIR_G128:-0}" = 1 ]; then pair_variants "$1"; elif [ "${LIKE_8B:-0}" = 1 ]; then like_8b_variants "$1"
  elif [ -n "${!v+x}" ]; then echo "${!v}"
  else echo "${VARIANTS-$DEFAULT_VARIANTS}"; fi
}
if [ "${SWEEP:-1}" = 1 ]; then
  # one process per shape: a configuration that crashes the compiler loses only its shape (the log's last "trying")
  # SWEEP_GRACE (70 s): a configuration started just inside the budget compiles twice (check, timing) and is profiled
  for c in ${CASES:-gate_up down qkv o}; do
    timeout "$(( ${SWEEP_BUDGET:-60} + ${SWEEP_GRACE:-70} ))" python3 benchmarks/bench_mgpu.py --ms "${MS:-1}" --cases "$c" --loads perm \
      --model "${MODEL:-llama3-8b}" \
      $([ -n "${SWEEP_GROUPS:-}" ] && echo --groups "$SWEEP_GROUPS") \
      $([ "${FULL_SWEEP:-0}" = 1 ] && echo --max-configs "${MAX_CONFIGS:-12}" || echo --no-sweep) \
      --budget "${SWEEP_BUDGET:-60}" --variants "$(per_case_variants "$c")" $([ "${TUNED:-0}" = 1 ] && echo --write-tuned) > "$OUT/sweep_$c.log" 2>&1
    echo "rc $? $c"; grep -E "^  [a-z_]+ g|^[a-z_]+ g[0-9]+ [48] |copy bandwidth" "$OUT/sweep_$c.log" | cut -c1-250
    mv "$OUT/bench_mgpu.json" "$OUT/bench_mgpu_$c.json" 2>/dev/null
  done
fi
[ "${TUNED:-0}" = 1 ] && cp pallas_kernels/mgpu_tuned.json "$OUT/"
GROUP_ARG=$([ -n "${DECODE_GROUP:-}" ] && echo --group "$DECODE_GROUP")  # e.g. 32: int4 g32 with mins (Q4_K imports)
if [ "${DECODE:-0}" = 1 ]; then
  SETS=${DECODE_SETS:-qmatmul=best,qmatmul8=best;qmatmul=pallas,qmatmul8=pallas}
  DUMP_HLO=$([ "${PROFILE:-0}" = 1 ] && echo "$OUT") timeout "${DECODE_SECONDS:-150}" python3 benchmarks/bench_decode.py \
    --models "${DECODE_MODELS:-llama3-8b}" $GROUP_ARG --batches "${DECODE_BATCHES:-1}" --xla-batches '' \
    --kernel-sets "$SETS" \
    --reps 2 --variants "${DECODE_VARIANTS:-engine}" \
    $([ "${PROFILE:-0}" = 1 ] && echo --profile) > "$OUT/decode.log" 2>&1  # (PROFILE=1 also keeps the step's HLO)
  if [ "${PDL_AB:-0}" = 1 ]; then  # the same step with programmatic dependent launch (LUCEBOX_MGPU_PDL=1)
    LUCEBOX_MGPU_PDL=1 timeout "${DECODE_SECONDS:-150}" python3 benchmarks/bench_decode.py --models llama3-8b \
      --batches "${DECODE_BATCHES:-1}" \
      --xla-batches '' --kernel-sets "${PDL_SETS:-qmatmul=best,qmatmul8=best}" --reps 2 > "$OUT/decode_pdl.log" 2>&1
    echo "with LUCEBOX_MGPU_PDL=1:"; sed -n '/^copy bandwidth .*; /,$p' "$OUT/decode_pdl.log"; echo "without:"
  fi
  if [ -n "${DECODE_AB:-}" ]; then  # the same step with another int4 decode (LUCEBOX_MGPU_DECODE=cast|split)
    LUCEBOX_MGPU_DECODE=$DECODE_AB timeout "${DECODE_SECONDS:-150}" python3 benchmarks/bench_decode.py \
      --models "${DECODE_MODELS:-llama3-8b}" $GROUP_ARG --batches "${DECODE_BATCHES:-1}" --xla-batches '' \
      --kernel-sets "qmatmul=best,qmatmul8=best" --reps 2 $([ "${PROFILE:-0}" = 1 ] && echo --profile) \
      > "$OUT/decode_ab.log" 2>&1
    mv "$OUT/bench_decode.json" "$OUT/bench_decode_ab.json" 2>/dev/null
    echo "with LUCEBOX_MGPU_DECODE=$DECODE_AB:"; sed -n '/^copy bandwidth .*; /,$p' "$OUT/decode_ab.log" | grep -v "fusion" | head -40
    echo "without:"
  fi
  # TABLE_AB='label:json;...': the step again with the table's entries updated (LUCEBOX_MGPU_TUNED), e.g.
  # 'gu_stream:{"m16_k4096_n28672_g128_b4":{"stream_k":true}}' (each label's own process)
  IFS=';' read -ra TABLES <<< "${TABLE_AB:-}"
  for t in "${TABLES[@]}"; do
    python3 -c "import json,sys; t=json.load(open('pallas_kernels/mgpu_tuned.json')); d=json.loads(sys.argv[1])
for k,v in d.items(): t[k]['cfg'].update(v)
json.dump(t, open(sys.argv[2],'w'), indent=1)" "${t#*:}" "/tmp/table_${t%%:*}.json"
    LUCEBOX_MGPU_TUNED="/tmp/table_${t%%:*}.json" timeout "${DECODE_SECONDS:-150}" python3 benchmarks/bench_decode.py \
      --models "${DECODE_MODELS:-llama3-8b}" $GROUP_ARG --batches "${DECODE_BATCHES:-1}" --xla-batches '' \
      --kernel-sets "qmatmul=best,qmatmul8=best" --reps 2 $([ "${PROFILE:-0}" = 1 ] && echo --profile) \
      > "$OUT/decode_table_${t%%:*}.log" 2>&1
    mv "$OUT/bench_decode.json" "$OUT/bench_decode_table_${t%%:*}.json" 2>/dev/null
    echo "table ${t%%:*} (${t#*:}):"; sed -n '/^copy bandwidth .*; /,$p' "$OUT/decode_table_${t%%:*}.log" | grep -v "fusion" | head -30
  done
  # FLAG_AB='flags;flags': the `best` step at batch 1 again under each XLA_FLAGS setting (fewer, larger fusions?)
  IFS=';' read -ra FLAG_SETS <<< "${FLAG_AB:-}"
  for i in "${!FLAG_SETS[@]}"; do
    XLA_FLAGS="${FLAG_SETS[$i]}" timeout "${DECODE_SECONDS:-150}" python3 benchmarks/bench_decode.py --models llama3-8b \
      --batches 1 --xla-batches '' --kernel-sets "qmatmul=best,qmatmul8=best" --reps 2 > "$OUT/decode_flags$i.log" 2>&1
    echo "XLA_FLAGS=${FLAG_SETS[$i]}:"; sed -n '/^copy bandwidth .*; /,$p' "$OUT/decode_flags$i.log" | grep -v "^{"
  done
  if [ "${ATTN_AB:-0}" = 1 ]; then  # the decode attention's splits merged by a second Pallas kernel instead of XLA
    LUCEBOX_ATTN_COMBINE=kernel timeout "${DECODE_SECONDS:-150}" python3 benchmarks/bench_decode.py --models \
      "${ATTN_MODELS:-llama3-8b,smollm2-135m}" --batches 1 --xla-batches '' --kernel-sets "qmatmul=best,qmatmul8=best" \
      --reps 2 > "$OUT/decode_combine.log" 2>&1
    echo "LUCEBOX_ATTN_COMBINE=kernel:"; sed -n '/^copy bandwidth .*; /,$p' "$OUT/decode_combine.log" | grep -v "^{"
  fi
  sed -n '/^copy bandwidth .*; /,$p' "$OUT/decode.log"; grep -A24 "profile per step" "$OUT/decode.log" | grep -v "^  [a-z_.0-9]*fusion[a-z_.0-9]* " | head -60
  [ -f .peers/peer_bench.py ] && timeout 150 python3 .peers/peer_bench.py --sections D_int4_b1 --budget 140 \
    > "$OUT/peer.log" 2>&1; grep "^D |" "$OUT/peer.log"
fi
if [ "${TREE_AB:-0}" = 1 ]; then  # 8B verify costs (a chain of 9 rows, a tree of 32) with the XLA and Pallas tree attention
  for tk in xla pallas; do
    timeout 200 python3 benchmarks/bench_spec.py --no-embedded --syn-ks 8 --syn-trees 32 --budget 170 \
      --syn-kernels "attention_tree=$tk" > "$OUT/spec_syn_$tk.log" 2>&1
    echo "attention_tree=$tk:"; grep -E "decode step|^\| (8|tree)" "$OUT/spec_syn_$tk.log"
  done
fi
if [ "${VERIFY_AB:-0}" = 1 ]; then  # the 8B verify's knobs, one process a set
  # (the last set, " ": the defaults again)
  IFS=';' read -ra ENV_SETS <<< "${VERIFY_ENVS-;LUCEBOX_MGPU_WIDE=0 LUCEBOX_TREE_ROWS=32; }"
  i=0
  for e in "${ENV_SETS[@]}"; do
    i=$((i + 1))
    env $e JAX_COMPILATION_CACHE_DIR=/tmp/jcc JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1 OUT="$OUT/verify_ab$i" \
      timeout "${VERIFY_SECONDS:-120}" python3 benchmarks/bench_spec.py --no-embedded --syn-ks 8 --syn-trees 32 \
      --no-syn-drafts --budget "$(( ${VERIFY_SECONDS:-120} - 10 ))" --syn-kernels attention_tree=pallas \
      ${VERIFY_ARGS:-} > "$OUT/verify_ab$i.log" 2>&1
    echo "[$e]:"; grep -E "decode step:|verify K|tree verify" "$OUT/verify_ab$i.log"
  done
fi
(cd "$OUT" && tar czf /tmp/probe.tgz * 2>/dev/null && rm -rf "$OUT"/* && mv /tmp/probe.tgz . ; ls)
