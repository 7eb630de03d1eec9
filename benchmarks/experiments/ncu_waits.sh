#!/usr/bin/env bash
# One device call (device tool): where do the seesaw kernels wait? ncu's source counters (stall samples per SASS
# instruction and per Python source line, through Triton's line info) for h128 b128 s8192 qlen 1, one launch of
# each variant, summarised by ncu_waits.py (the hottest instructions; the samples of each mbarrier wait site,
# named by its shared-memory offset). Logs go to $OUT (or /tmp).
#   bash benchmarks/experiments/ncu_waits.sh [VARIANTS]      (default "seesaw seesaw-pair")
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
export PYTHONPATH=$PWD:$PWD/benchmarks
for v in ${1:-seesaw seesaw-pair}; do
    timeout 240 ncu --clock-control none -k regex:_mla_decode_gluon --launch-count 1 --section SourceCounters \
        --section WarpStateStats --import-source yes -f -o "$out/waits_$v" \
        python3 benchmarks/experiments/profile_ws.py --variant "$v" --shape h128b128 > "$out/waits_${v}_ncu.log" 2>&1
    tail -3 "$out/waits_${v}_ncu.log"
    ncu -i "$out/waits_$v.ncu-rep" --page source --csv --print-source sass > "$out/waits_${v}_sass.csv" 2>&1
    ncu -i "$out/waits_$v.ncu-rep" --page source --csv --print-source cuda > "$out/waits_${v}_lines.csv" 2>&1
    python3 benchmarks/experiments/ncu_waits.py "$out/waits_${v}_sass.csv" "$out/waits_${v}_lines.csv" \
        | tee "$out/waits_$v.txt"
    rm -f "$out/waits_$v.ncu-rep"
done
