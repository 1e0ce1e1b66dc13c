set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
which ncu; ncu --version | tail -1
S="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SchedulerStats --section InstructionStats"
timeout 200 ncu --clock-control none -k regex:int4 $S --log-file $OUT/ncu.txt python3 benchmarks/ncu_int4.py --reps 1 \
  gate_up:g32a:1 gate_up:g128s:1 o:g32a:1 down:g128s:1 \
  'gate_up:g32a:1:{"mode":"fma","decode":"f32","block_k":32,"block_n":128,"num_warps":4,"num_stages":4}' 2>&1 | grep -v -i "warn\|deprecat" | tail -8
timeout 120 ncu --clock-control none -k regex:int4 --launch-count 1 --section SourceCounters --page source --print-source sass --csv --log-file $OUT/sass_g32.csv python3 benchmarks/ncu_int4.py --reps 0 gate_up:g32a:1 2>&1 | tail -2
timeout 120 ncu --clock-control none -k regex:int4 --launch-count 1 --section SourceCounters --page source --print-source sass --csv --log-file $OUT/sass_g128.csv python3 benchmarks/ncu_int4.py --reps 0 gate_up:g128s:1 2>&1 | tail -2
ls -la $OUT
grep -E "int4_matmul|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per Thread|Issue Slots Busy|No Eligible|Theoretical Occupancy|Block Limit|Grid Size|Executed Ipc A" $OUT/ncu.txt | head -150
