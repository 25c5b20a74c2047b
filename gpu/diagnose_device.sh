#!/usr/bin/env bash
# Second device script, after gpu/check_device.sh and gpu/bench.py (about 5 minutes on an H200):
# what the first H200 run (2026-11-30) left open.
#  1. compute-sanitizer racecheck and memcheck on the CUDA turbo-block quantize test (on the H200 it
#     stored a wrong fp16 scale with the right codes; the host emulation of the same source is exact);
#  2. ncu (speed of light, occupancy, warp states, scheduler, source counters) of the default decode
#     kernel at batch 16, 32K tokens, 2 and 4 bits, and of the append kernel;
#  3. the tuning sweep at 2, 3 and 4 bits (gpu/sweep.py).
# Writes results/gpu/diagnose_*.txt and results/gpu/sweep_<device>.json.
# Usage, from the repository root: bash gpu/diagnose_device.sh [python]
set -uo pipefail
PY=${1:-python}
cd "$(dirname "$0")/.."
mkdir -p results/gpu
export TRITON_INTERPRET=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for tool in racecheck memcheck; do
  timeout 120 "$SAN" --tool "$tool" "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_cuda.py \
    -k "turbo and not host" > "results/gpu/diagnose_sanitizer_$tool.txt" 2>&1 || status=1
  tail -5 "results/gpu/diagnose_sanitizer_$tool.txt"
done
SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section SchedulerStats --section ComputeWorkloadAnalysis --section InstructionStats \
  --section MemoryWorkloadAnalysis --section SourceCounters"
for bits in 2 4; do
  # shellcheck disable=SC2086
  timeout 120 "$NCU" --profile-from-start off --clock-control none $SECTIONS \
    --kernel-name regex:"_split_kernel|_append_kernel" "$PY" gpu/sweep.py --profile default,append \
    --batches 16 --bits "$bits" > "results/gpu/diagnose_ncu_${bits}bit.txt" 2>&1 || status=1
  grep -E "_kernel|Duration|Achieved Occupancy|Issue Slots Busy|DRAM Throughput" \
    "results/gpu/diagnose_ncu_${bits}bit.txt" | head -20
done
timeout 150 "$PY" gpu/sweep.py --bits 2,3,4 || status=1
exit $status
