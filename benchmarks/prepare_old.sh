#!/usr/bin/env bash
# Before/after on one GPU machine: put REV's openmla package into .old/ (git-ignored through .git/info/exclude), as
# .old/openmla with this tree's openmla/bench copied in (it uses only the public API: `cd .old && python -m
# openmla.bench --label before`) and as .old/openmla_old (imports renamed) for `openmla bench --against .old`, which
# times both versions in one process, alternating in the same rounds. Carry ".old" to the device and run
# `bash benchmarks/gpu_run.sh ab` there.
# usage: bash benchmarks/prepare_old.sh REV      (e.g. 64c94cf)
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: bash benchmarks/prepare_old.sh REV}
rm -rf .old && mkdir .old
git archive "$rev" openmla | tar -x -C .old
rm -rf .old/openmla/bench && cp -r openmla/bench .old/openmla/bench
find .old -name __pycache__ -prune -exec rm -rf {} +
# the same package renamed openmla_old, for `openmla bench --against .old` (both versions in one process)
cp -r .old/openmla .old/openmla_old && rm -rf .old/openmla_old/bench
find .old/openmla_old -name '*.py' -exec sed -i -E -e 's/\bopenmla\./openmla_old./g' \
  -e 's/^(\s*)from openmla import/\1from openmla_old import/' -e 's/^(\s*)import openmla\b/\1import openmla_old/' {} +
git rev-parse --short "$rev" > .old/REV
grep -qx '/.old/' .git/info/exclude 2>/dev/null || echo '/.old/' >> .git/info/exclude
echo "$(cat .old/REV)'s openmla with this tree's openmla/bench is in .old/ (carry it: [\".old\"])"
