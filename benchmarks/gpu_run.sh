#!/usr/bin/env bash
# One device call: environment, `openmla bench`, then the GPU test set. Logs and bench output go to $OUT (or ./out).
# usage: bash benchmarks/gpu_run.sh [bench|tests|all] [pytest args...]   (e.g. tests -n 8 tests/test_decode_gluon.py)
#   bench: `openmla bench` with $BENCH_ARGS (e.g. BENCH_ARGS="--quick" or "--family decode --label after"; shape
#   specs hold spaces: run `python3 -m openmla bench --shapes ...` directly for those);
#   FlashMLA is timed beside it when importable (../shared/peers/README.md: the .peers folder)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OPENMLA_TEST_DEVICE=cuda
OUT=${OUT:-out}; mkdir -p "$OUT"
what=${1:-all}; shift || true
if ls .peers/flash_mla/*.so.gz >/dev/null 2>&1; then
  gunzip -kf .peers/flash_mla/*.so.gz && export PYTHONPATH="$PWD/.peers:$PYTHONPATH"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "$what" = bench ] || [ "$what" = all ]; then
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
  timeout "${BENCH_TIMEOUT:-$([ "$what" = all ] && echo 300 || echo 540)}" python3 -m openmla bench --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout ${TEST_TIMEOUT:-280} python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$OUT/tests_gpu.log" | tail -40
fi
