#!/usr/bin/env bash
# First GPU check (about 3 minutes on an H200): the GPU tests of the Triton kernels with
# TRITON_INTERPRET=0 (correctness against kvq_ref on the device), the CUDA kernels' tests (nvcc
# build + bit-exactness on the device; they found the turbo-block scale bug on the first run), then
# a quick bench (32K tokens, 2 and 4 bits, batch 1) writing results/gpu/bench_<device>_quick.json.
# Usage, from the repository root: bash gpu/check_device.sh [python]
set -uo pipefail
PY=${1:-python}
cd "$(dirname "$0")/.."
mkdir -p results/gpu
export TRITON_INTERPRET=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
# a curated subset: every test compiles its own kernel specializations (a few seconds each)
timeout 110 "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_triton_paged.py \
  -k "split_counts_match_kvq_ref or fp16_precision or paged_varying or ring_band or multi_token or sees_nothing or gpu_long_cache or tuning_variants" \
  "tests/gpu/test_triton_attention.py::test_gpu_long_cache_many_heads" \
  --junitxml=results/gpu/check_device_tests.xml 2>&1 | tail -25 || status=1
XDIST=$("$PY" -c "import xdist" >/dev/null 2>&1 && echo "-n 8")
timeout 100 "$PY" -m pytest -q -p no:cacheprovider $XDIST tests/gpu/test_cuda.py \
  --junitxml=results/gpu/check_device_cuda_tests.xml 2>&1 | tail -15 || status=1
timeout 65 "$PY" gpu/bench.py --quick || status=1
exit $status
