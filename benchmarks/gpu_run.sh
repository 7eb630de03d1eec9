#!/usr/bin/env bash
# One device call: environment, `openmla bench`, then the GPU test set. Logs and bench output go to $OUT (or ./out).
# usage: bash benchmarks/gpu_run.sh [bench|tests|tests1|tests2|tests3|tests4|all|ab|ab-copy|dcp] [pytest args...]
#   tests [pytest args] (default: the whole suite); tests1/2/3/4: the GPU suite in four parts (one device call
#   each; ~1.3 tests/s with -n 14 on the H200; part 4: the sparse kernels, ~450 tests, many Gluon compiles). Every tests mode: -v, -n $TEST_WORKERS (14), per-test
#   limit $TEST_EACH (300 s, where pytest-timeout is installed), --durations=40, $OUT/tests_gpu.log (all output),
#   $OUT/fail.log (each failure's traceback as it happens) and $OUT/fail.log.progress (each test's start, outcome
#   and time), so a run killed mid-way still tells; $TEST_TIMEOUT (540 s; 280 in all) ends pytest with SIGINT,
#   which still prints its summary
#   ab: this tree's openmla and .old's (benchmarks/prepare_old.sh REV, carried) in one process, alternating in the
#   same rounds (`openmla bench --against .old`, provider "before", column speedup); $BENCH_ARGS (default
#   "--family decode,prefill")
#   ab-copy: .old/openmla with this bench copied in (--label before-REV), then this tree (--label after), two
#   processes one after the other, compared point by point (python -m openmla.bench.compare)
#   dcp: on a machine of N >= 2 GPUs (NVLink multicast off): the DCP tests through NCCL (W = 2 / 4 / 8 where there
#   are as many GPUs), `openmla generate --dcp N` against --dcp 1 (the tokens must be identical), and
#   benchmarks/bench_dcp.py at W = 1, 2, 4, ... N ($DCP_SHAPES, default the issue's 128 heads, batch 32, 128k
#   keys), rows in $OUT/dcp.csv
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
p1="decode_gluon merge metadata plan_spans hardening_metadata indices cli bench v4_cache v4_indices"
p2="decode prefill prefill_gluon hardening_ops cache chunked_prefill rope_ops mla_layer engine"
p4="sparse_gluon sparse_mla"
# shellcheck disable=SC2046,SC2086  # word lists; tests3: every file not in parts 1, 2 or 4 (new test files land there)
case $what in
  tests1) set -- $(printf 'tests/test_%s.py ' $p1) "$@" ;;
  tests2) set -- $(printf 'tests/test_%s.py ' $p2) "$@" ;;
  tests3) set -- tests $(printf -- '--ignore=tests/test_%s.py ' $p1 $p2 $p4) "$@" ;;
  tests4) set -- $(printf 'tests/test_%s.py ' $p4) "$@" ;;
esac
if [[ $what == tests* ]] || [ "$what" = all ]; then
  each=(); python3 -c "import pytest_timeout" 2>/dev/null && each=(--timeout "${TEST_EACH:-300}")
  timeout -s INT -k 30 "${TEST_TIMEOUT:-$([ "$what" = all ] && echo 280 || echo 540)}" python3 -m pytest -v -rfE \
    -p no:cacheprovider -n "${TEST_WORKERS:-14}" "${each[@]}" --durations=40 --fail-log "$OUT/fail.log" "$@" \
    > "$OUT/tests_gpu.log" 2>&1
  tail -n 12 "$OUT/tests_gpu.log"
  [ -f "$OUT/fail.log.progress" ] && awk -F'\t' '$2 == "start" {run[$4] = 1; n++} $2 != "start" {delete run[$4]} $2 ~ /failed|error|crashed/ {print}
    END {print n " started; still running at the end:"; for (t in run) print "  " t}' "$OUT/fail.log.progress"
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
if [ "$what" = dcp ]; then
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  n=$(nvidia-smi -L | wc -l)
  timeout -s INT "${TEST_TIMEOUT:-300}" python3 -m pytest -v -rfE -p no:cacheprovider tests/test_parallel_dcp.py \
    tests/test_parallel_engine.py tests/test_parallel_sharding.py "$@" > "$OUT/tests_dcp.log" 2>&1
  tail -n 8 "$OUT/tests_dcp.log"
  gen=(python3 -m openmla generate --prompt-ids 7,3,9,27,101,4,8,15,16,23,42 --prompt-ids 40,41,42,40,41,42,40
       --max-new-tokens 24 --speculate 2 --json)
  "${gen[@]}" --dcp 1 2>/dev/null | tail -n 1 > "$OUT/generate_dcp1.json"
  "${gen[@]}" --dcp "$n" 2>/dev/null | tail -n 1 > "$OUT/generate_dcp$n.json"
  if cmp -s "$OUT/generate_dcp1.json" "$OUT/generate_dcp$n.json"; then echo "generate --dcp $n: the tokens of --dcp 1"
  else echo "generate --dcp $n DIFFERS from --dcp 1:"; cat "$OUT/generate_dcp1.json" "$OUT/generate_dcp$n.json"; fi
  shapes=${DCP_SHAPES:-"H128 b32 s131072 q1;H128 b32 s131072 q2"}
  timeout 120 python3 benchmarks/bench_dcp.py --shapes "$shapes" --csv "$OUT/dcp.csv" 2>&1 | tee "$OUT/bench_dcp.log"
  for w in 2 4 8; do
    [ "$w" -le "$n" ] || break
    timeout 180 torchrun --standalone --nproc-per-node "$w" benchmarks/bench_dcp.py --shapes "$shapes" \
      --csv "$OUT/dcp.csv" 2>&1 | grep -v "^W[0-9]\|OMP_NUM_THREADS\|^\*" | tee -a "$OUT/bench_dcp.log"
  done
fi
