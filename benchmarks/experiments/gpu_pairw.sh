#!/usr/bin/env bash
# One device call (H200 experiment; not part of openmla), prepared in the nineteenth session: seesaw-pair-el with its
# refills issued by two copy warps (pairw.py) against el, split kernels on the regular plan, outputs compared; a
# ragged-length q2 batch first (split requests: partials compared), then h128 b128 s8k q1 and q2. Logs go to $OUT.
#   bash benchmarks/experiments/gpu_pairw.sh      (about 3 minutes, most of it compiling)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/benchmarks"
OUT=${OUT:-out}; mkdir -p "$OUT"
AB_ROUNDS=3 timeout 400 python3 benchmarks/experiments/pairw.py 2>&1 | tee "$OUT/pairw.txt"
