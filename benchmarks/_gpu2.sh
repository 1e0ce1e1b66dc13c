set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
F="warn\|donat\|deprecat"
S="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis --section SchedulerStats --section InstructionStats"
timeout 100 ncu --clock-control none -k regex:int4 $S --log-file $OUT/ncu_gemv.txt python3 benchmarks/ncu_int4.py --reps 0 \
  'gate_up:g32a:1:{"gemv": true}' 'gate_up:g128s:1:{"gemv": true}' 2>&1 | grep -v -i "$F" | tail -4
timeout 60 ncu --clock-control none -k regex:int4 --launch-count 1 --section SourceCounters --page source --print-source sass --csv --log-file $OUT/sass_gemv.csv python3 benchmarks/ncu_int4.py --reps 0 'gate_up:g32a:1:{"gemv": true}' 2>&1 | tail -2
grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Instructions  " $OUT/ncu_gemv.txt
timeout 330 python3 benchmarks/bench_gemv.py --budget 300 2>&1 | grep -v -i "$F" > $OUT/gemv.log
tail -30 $OUT/gemv.log
