set -u
out=${OUT:-/tmp}
export PYTHONPATH=$PWD:$PWD/benchmarks
OPENMLA_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_decode_gluon.py -k "seesaw" 2>&1 | tail -15 > "$out/tests.log"
tail -3 "$out/tests.log"
timeout 110 python3 -u benchmarks/bench_decode_gluon.py --check --variants "seesaw;seesaw-sfirst" \
    --shapes "128,128,8192,1;128,128,8192,2;32,128,8192,1;16,128,8192,2;128,1,32768,1" > "$out/bench.log" 2>&1
cat "$out/bench.log"
OPENMLA_DECODE_GLUON_VARIANT=seesaw-sfirst OPENMLA_TEST_DEVICE=cuda timeout 100 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_decode.py 2>&1 | tail -8 > "$out/test_decode.log"
tail -3 "$out/test_decode.log"
