#!/usr/bin/env bash
# One device call for the next H200 session (device tool): are the seesaw variants prepared offline
# (seesaw-wide, seesaw-loader, seesaw-loader-pf; not yet run on a GPU) right, and which is fastest? Tests first
# (a barrier bug hangs: per-test timeouts), then the split kernels side by side. Logs go to $OUT (or /tmp).
#   bash benchmarks/experiments/gpu_seesaw_variants.sh
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
export PYTHONPATH=$PWD:$PWD/benchmarks
OPENMLA_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_decode_gluon.py \
    -k "seesaw" 2>&1 | tail -15 > "$out/seesaw_variants_tests.log"
tail -4 "$out/seesaw_variants_tests.log"
timeout 240 python3 -u benchmarks/bench_decode_gluon.py --check \
    --variants "64,2;seesaw;seesaw-wide;seesaw-loader;seesaw-loader-pf" \
    --shapes "128,128,8192,1;128,128,8192,2;32,128,8192,1;16,128,8192,2;128,1,32768,1" \
    > "$out/seesaw_variants_bench.log" 2>&1
cat "$out/seesaw_variants_bench.log"
