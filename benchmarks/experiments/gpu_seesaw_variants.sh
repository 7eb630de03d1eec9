#!/usr/bin/env bash
# One device call (device tool): are the seesaw variants right on the H200 (the GPU test matrix, with per-step
# timeouts: a barrier bug hangs), and which is fastest (the split kernels side by side on the issue's shapes)?
# Logs go to $OUT (or /tmp).
#   bash benchmarks/experiments/gpu_seesaw_variants.sh [PYTEST_K [VARIANTS [MLA_DECODE_VARIANT]]]
# PYTEST_K selects the tests of tests/test_decode_gluon.py (default "seesaw"); VARIANTS the kernels benchmarked
# (default "64,2;seesaw"); MLA_DECODE_VARIANT, when given, also runs tests/test_decode.py with it as
# mla_decode's kernel (OPENMLA_DECODE_GLUON_VARIANT). TEST_TIMEOUT (default 200 s) bounds the -k tests (about
# 1.3 s a test on 14 workers, compiles included), BENCH_TIMEOUT (default 180 s) the benchmark (about 8-10 s per
# variant and shape with --check).
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
k=${1:-seesaw}
variants=${2:-64,2;seesaw}
export PYTHONPATH=$PWD:$PWD/benchmarks
OPENMLA_TEST_DEVICE=cuda timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_decode_gluon.py \
    -k "$k" 2>&1 | tail -25 > "$out/seesaw_variants_tests.log"
tail -25 "$out/seesaw_variants_tests.log"
timeout ${BENCH_TIMEOUT:-180} python3 -u benchmarks/bench_decode_gluon.py --check --variants "$variants" \
    --shapes "128,128,8192,1;128,128,8192,2;32,128,8192,1;16,128,8192,2;128,1,32768,1" \
    > "$out/seesaw_variants_bench.log" 2>&1
cat "$out/seesaw_variants_bench.log"
if [ -n "${3:-}" ]; then
    OPENMLA_DECODE_GLUON_VARIANT=$3 OPENMLA_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -n 14 \
        -p no:cacheprovider tests/test_decode.py 2>&1 | tail -12 > "$out/seesaw_variants_test_decode.log"
    tail -12 "$out/seesaw_variants_test_decode.log"
fi
