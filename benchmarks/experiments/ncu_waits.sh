#!/usr/bin/env bash
# One device call (device tool): where do the seesaw kernels wait, and how busy are the tensor pipe and memory?
# For h128 b128 s8192 qlen 1, one launch of each variant:
#  1. ncu's source counters (stall samples per SASS instruction), summarised by ncu_waits.py: stall reasons, the
#     hottest instructions, the samples of each mbarrier wait by barrier name;
#  2. ncu's SpeedOfLight / ComputeWorkloadAnalysis / MemoryWorkloadAnalysis sections plus the tensor-pipe
#     activity metric (its name looked up in this ncu's metric list).
# Logs go to $OUT (or /tmp).
#   bash benchmarks/experiments/ncu_waits.sh [VARIANTS]      (default "seesaw seesaw-pair")
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
export PYTHONPATH=$PWD:$PWD/benchmarks
# mbarriers in allocation order (the seesaw kernel entry: bar_a, bar_b, bar_c, bar_d, sync, two of each)
declare -A BARS=(
    [seesaw]=ready_x0,ready_x1,ready_y0,ready_y1,empty_y0,empty_y1,pready0,pready1,qbar,lbar
    [seesaw-pair]=ready_l0,ready_l1,ready_r0,ready_r1,m_ready0,m_ready1,p_ready0,p_ready1,qbar,lbar
    [seesaw-pair-r]=ready_l0,ready_l1,ready_r0,ready_r1,m_ready0,m_ready1,p_ready0,p_ready1,qbar,lbar
    [seesaw-pair-es]=ready_l0,ready_l1,ready_r0,ready_r1,m_ready0,m_ready1,p_ready0,p_ready1,qbar,lbar
)
tensor=$(ncu --query-metrics --chip gh100 2>/dev/null | awk '{print $1}' \
    | grep -E '^sm__pipe_tensor_op_(gmma|hmma)_cycles_active$' | head -1)
metrics=${tensor:+--metrics ${tensor}.avg.pct_of_peak_sustained_active,${tensor}.max.pct_of_peak_sustained_active}
echo "tensor-pipe metric: ${tensor:-none found}"
for v in ${1:-seesaw seesaw-pair}; do
    timeout 240 ncu --clock-control none -k regex:_mla_decode_gluon --launch-count 1 --section SourceCounters \
        --section WarpStateStats --import-source yes -f -o "$out/waits_$v" \
        python3 benchmarks/experiments/profile_ws.py --variant "$v" --shape h128b128 > "$out/waits_${v}_ncu.log" 2>&1
    tail -3 "$out/waits_${v}_ncu.log"
    ncu -i "$out/waits_$v.ncu-rep" --page source --csv --print-source sass > "$out/waits_${v}_sass.csv" 2>&1
    python3 benchmarks/experiments/ncu_waits.py "$out/waits_${v}_sass.csv" --bars "${BARS[$v]:-}" \
        | grep -v "columns:" > "$out/waits_$v.txt"
    cat "$out/waits_$v.txt"
    rm -f "$out/waits_$v.ncu-rep" "$out/waits_${v}_sass.csv"
    timeout 240 ncu --clock-control none -k regex:_mla_decode_gluon --launch-count 1 --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis $metrics \
        python3 benchmarks/experiments/profile_ws.py --variant "$v" --shape h128b128 > "$out/util_$v.txt" 2>&1
    grep -E "Duration|Throughput|Busy|Issue|Hit Rate|pipe_tensor|Executed Ipc|Bandwidth" "$out/util_$v.txt"
done
