#!/usr/bin/env bash
# One device call: environment, benchmarks, then the GPU test set. Logs go to $OUT (or ./out).
# usage: bash benchmarks/gpu_run.sh [bench|tests|all|hopper-tests|hopper-bench] [pytest args...]
#   hopper-tests / hopper-bench: the Hopper (Gluon) kernels (decode incl. fp8 caches, prefill) and the
#   reduce's programmatic dependent launch: their tests with time limits (a barrier-phase bug hangs
#   rather than fails; under 2 minutes on the H200 with -n 8, at most ~9 min), then their benchmarks
#   (at most ~7 min): two device calls
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
if [ "$what" = hopper-tests ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_decode_gluon.py \
    -k "tile_counts or empty_rows or split_starts or fp8" 2>&1 | tee "$OUT/tests_gluon_new.log" | tail -15
  OPENMLA_PREFILL_AUTOTUNE=0 OPENMLA_GPU_TEST_TIMEOUT=60 timeout 240 python3 -m pytest -q -rf -p no:cacheprovider -n 4 \
    tests/test_prefill_gluon.py 2>&1 | tee "$OUT/tests_prefill_gluon.log" | tail -30
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py -k pdl 2>&1 | tail -3
fi
if [ "$what" = hopper-bench ]; then
  timeout 120 python3 benchmarks/bench_decode_gluon.py --check --variants "64,2" \
    --shapes "128,128,8192,1;32,128,8192,1;128,1,32768,1" 2>&1 | tee "$OUT/bench_decode_gluon.log"
  timeout 90 python3 benchmarks/bench_decode_gluon.py --check --fp8 --variants "64,2" \
    --shapes "128,128,8192,1;16,128,8192,1;128,1,32768,1" 2>&1 | tee "$OUT/bench_decode_gluon_fp8.log"
  OPENMLA_BENCH_HANG_S=45 timeout 150 python3 benchmarks/bench_prefill_gluon.py 2>&1 | tee "$OUT/bench_prefill_gluon.log"
  timeout 60 python3 benchmarks/sweep_decode.py --shapes "128,1,32768,1;16,1,32768,1" --variants "default;pdl=1" \
    2>&1 | tee "$OUT/sweep_pdl.log"
fi
