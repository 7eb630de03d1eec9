#!/usr/bin/env bash
# Before/after on one GPU machine: put REV's openmla package into .old/ (git-ignored through .git/info/exclude) with
# this tree's openmla/bench copied in (it uses only the public API), then carry ".old" to the device and run
# `bash benchmarks/gpu_run.sh ab` there: REV's openmla is timed with --label before, this tree's with --label after.
# usage: bash benchmarks/prepare_old.sh REV      (e.g. 64c94cf)
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: bash benchmarks/prepare_old.sh REV}
rm -rf .old && mkdir .old
git archive "$rev" openmla | tar -x -C .old
rm -rf .old/openmla/bench && cp -r openmla/bench .old/openmla/bench
find .old -name __pycache__ -prune -exec rm -rf {} +
git rev-parse --short "$rev" > .old/REV
grep -qx '/.old/' .git/info/exclude 2>/dev/null || echo '/.old/' >> .git/info/exclude
echo "$(cat .old/REV)'s openmla with this tree's openmla/bench is in .old/ (carry it: [\".old\"])"
