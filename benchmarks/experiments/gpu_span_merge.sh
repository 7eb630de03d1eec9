#!/usr/bin/env bash
# One device call (device tool) for the branch exp/span-merge: is seesaw-pair-eltm (the last piece of a cut request
# merges the other pieces' fp32 partials copied by TMA, its accumulator kept in registers) right on the H200, and
# is it faster than seesaw-pair-elt where requests are cut (a ragged batch; h128 q2 with OPENMLA_DECODE_SPAN_MODE=cut,
# the case the plan doc's step 0' left: cut mode ties snap at q2 because a cut costs about 6 pairs)?
# Logs go to $OUT (or /tmp).
#   bash benchmarks/experiments/gpu_span_merge.sh
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
export PYTHONPATH=$PWD:$PWD/benchmarks
OPENMLA_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_decode_gluon.py \
    -k "eltm or (spans and elt)" 2>&1 | tail -8 > "$out/span_merge_tests.txt"
cat "$out/span_merge_tests.txt"
# cut mode forced: the ragged batch (cut by auto anyway), h128 q2 and q1 (snapped by auto)
OPENMLA_DECODE_SPAN_MODE=cut AB_ROUNDS=4 AB_SHAPES="128,128,ragged,1;128,128,8192,2;128,128,8192,1" timeout 200 \
    python3 benchmarks/experiments/variant_ab.py seesaw-pair-elt seesaw-pair-eltm > "$out/span_merge_ab_cut.txt" 2>&1
cat "$out/span_merge_ab_cut.txt"
# the modes (regular plan, snap, cut, auto) with the TMA merge: does cut now beat snap at h128 b128?
OPENMLA_DECODE_GLUON_VARIANT=seesaw-pair-eltm AB_ROUNDS=4 AB_SHAPES="128,128,8192,2;128,128,8192,1" timeout 150 \
    python3 benchmarks/experiments/spans_ab.py > "$out/span_merge_modes.txt" 2>&1
cat "$out/span_merge_modes.txt"
TRACE_VARIANTS=seesaw-pair-elt,seesaw-pair-eltm TRACE_MODES=cut AB_SHAPES="128,128,8192,2;128,128,ragged,1" \
    timeout 120 python3 benchmarks/experiments/span_trace.py > "$out/span_merge_trace.txt" 2>&1
cat "$out/span_merge_trace.txt"
