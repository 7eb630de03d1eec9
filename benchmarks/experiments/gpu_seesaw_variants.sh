#!/usr/bin/env bash
# One device call (device tool): are the seesaw variants right on the H200 (the GPU test matrix, with per-test
# timeouts: a barrier bug hangs), and which is fastest (the split kernels side by side with ws on the issue's
# shapes)? Logs go to $OUT (or /tmp).
#   bash benchmarks/experiments/gpu_seesaw_variants.sh
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
export PYTHONPATH=$PWD:$PWD/benchmarks
OPENMLA_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_decode_gluon.py \
    -k "seesaw" 2>&1 | tail -15 > "$out/seesaw_variants_tests.log"
tail -4 "$out/seesaw_variants_tests.log"
timeout 240 python3 -u benchmarks/bench_decode_gluon.py --check --variants "64,2;seesaw" \
    --shapes "128,128,8192,1;128,128,8192,2;32,128,8192,1;16,128,8192,2;128,1,32768,1" \
    > "$out/seesaw_variants_bench.log" 2>&1
cat "$out/seesaw_variants_bench.log"
