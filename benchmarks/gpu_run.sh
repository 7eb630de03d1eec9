#!/usr/bin/env bash
# One device call: environment, `openmla bench`, then the GPU test set. Logs and bench output go to $OUT (or ./out).
# usage: bash benchmarks/gpu_run.sh [bench|tests|all|ab|ab-copy] [pytest args...]   (tests -n 8 tests/test_x.py)
#   ab: this tree's openmla and .old's (benchmarks/prepare_old.sh REV, carried) in one process, alternating in the
#   same rounds (`openmla bench --against .old`, provider "before", column speedup); $BENCH_ARGS (default
#   "--family decode,prefill")
#   ab-copy: .old/openmla with this bench copied in (--label before-REV), then this tree (--label after), two
#   processes one after the other, compared point by point (python -m openmla.bench.compare)
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
  bt=${BENCH_TIMEOUT:-$([ "$what" = all ] && echo 300 || echo 540)}
  timeout "$bt" python3 -m openmla bench --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout ${TEST_TIMEOUT:-280} python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$OUT/tests_gpu.log" | tail -40
fi
if [ "$what" = ab ]; then
  [ -d .old/openmla_old ] || { echo "no .old/openmla_old: run 'bash benchmarks/prepare_old.sh REV' and carry .old" >&2
                               exit 2; }
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-570}" python3 -m openmla bench --out "$OUT" --against .old --label ab \
    ${BENCH_ARGS:---family decode,prefill} 2>&1 | tee "$OUT/bench_ab.log"
fi
if [ "$what" = ab-copy ]; then
  [ -d .old/openmla ] || { echo "no .old/openmla: run 'bash benchmarks/prepare_old.sh REV' and carry .old" >&2
                           exit 2; }
  out=$(cd "$OUT" && pwd); peers=""; [ -d .peers/flash_mla ] && peers="$PWD/.peers"
  ab_args=${BENCH_ARGS:---family decode}
  # shellcheck disable=SC2086
  (cd .old && PYTHONPATH="$PWD${peers:+:$peers}" timeout "${BENCH_TIMEOUT:-270}" python3 -m openmla.bench \
    --out "$out" --label "before-$(cat REV 2>/dev/null || echo old)" $ab_args 2>&1 | tee "$out/bench_before.log")
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-270}" python3 -m openmla.bench --out "$out" --label after $ab_args 2>&1 \
    | tee "$out/bench_after.log"
  python3 -m openmla.bench.compare "$out"/bench-before-*.csv "$out/bench-after.csv" 2>&1 | tee "$out/compare.txt"
fi
