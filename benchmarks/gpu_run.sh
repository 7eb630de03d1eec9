#!/usr/bin/env bash
# One device call: environment, benchmarks, then the GPU test set. Logs go to $OUT (or ./out).
# usage: bash benchmarks/gpu_run.sh [bench|tests|all] [pytest args...]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OPENMLA_TEST_DEVICE=cuda
OUT=${OUT:-out}; mkdir -p "$OUT"
what=${1:-all}; shift || true
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 280 python3 benchmarks/bench_decode.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_decode.log"
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout ${TEST_TIMEOUT:-280} python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$OUT/tests_gpu.log" | tail -40
fi
