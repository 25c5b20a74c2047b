#!/usr/bin/env bash
# The device check, unattended, within 8 minutes on an H200 (every step has its own time limit):
#  1. the Triton kernels' GPU tests (TRITON_INTERPRET=0: against kvq_ref on the device), a subset;
#  2. the CUDA kernels' tests on the GPU: quantize and row-layout attention (tests/gpu/test_cuda.py) and
#     the fragment kernel (tests/gpu/test_cuda_fragment_attention.py, its GPU cases), with xdist when
#     installed (each configuration is one nvcc build);
#  3. the quick bench (gpu/bench.py --quick: 32K tokens, 2 and 4 bits, batch 1, bands 0 and 64, the Triton and CUDA
#     backends (CUDA with the merge as a dependent launch, and plainly: cuda-plain), fp16 FlashAttention,
#     the read probe), results/gpu/bench_<device>_quick.json;
#  4. ncu on the fragment kernel at 2, 3 and 4 bits (batch 16, 8 heads, 32K tokens, d = 128, G = 4):
#     warp instructions, ALU- and FMA-pipe instructions, DRAM bytes and time of one split-kernel launch,
#     compared per token-head with the static counts (+-10 %) in results/gpu/ncu_fragment_<device>.json.
# A step that fails or runs out of time does not stop the others; the exit status says whether all passed.
# Usage, from the repository root: bash gpu/check_device.sh [python]
set -uo pipefail
PY=${1:-python}
cd "$(dirname "$0")/.."
mkdir -p results/gpu
export TRITON_INTERPRET=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
XDIST=$("$PY" -c "import xdist" >/dev/null 2>&1 && echo "-n 8")
DEVICE=$("$PY" -c "import re, torch; print(re.sub(r'[^A-Za-z0-9]+', '_', torch.cuda.get_device_name()).strip('_').lower())" 2>/dev/null || echo unknown)
# 1. (a curated subset: every test compiles its own kernel specializations, a few seconds each)
timeout 90 "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_triton_paged.py \
  -k "split_counts_match_kvq_ref or fp16_precision or paged_varying or ring_band or sees_nothing or gpu_long_cache" \
  --junitxml=results/gpu/check_device_tests.xml 2>&1 | tail -15 || status=1
# 2.
timeout 120 "$PY" -m pytest -q -p no:cacheprovider $XDIST tests/gpu/test_cuda.py tests/gpu/test_cuda_fragment_attention.py \
  -k "not host" --junitxml=results/gpu/check_device_cuda_tests.xml 2>&1 | tail -15 || status=1
# 3.
timeout 120 "$PY" gpu/bench.py --quick || status=1
# 4.
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
METRICS=$("$PY" -c "from gpu.cuda.device_check import METRICS; print(','.join(METRICS))")
for bits in 2 3 4; do
  timeout 45 "$NCU" --profile-from-start off --clock-control none --csv --metrics "$METRICS" \
    --kernel-name regex:kvq_frag_split_kernel "$PY" -m gpu.cuda.device_check profile --bits "$bits" \
    > "results/gpu/ncu_fragment_${bits}bit.csv" 2>&1 || status=1
done
timeout 40 "$PY" -m gpu.cuda.device_check compare results/gpu/ncu_fragment_{2,3,4}bit.csv \
  --out "results/gpu/ncu_fragment_${DEVICE}.json" || status=1
exit $status
