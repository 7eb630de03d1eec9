"""``openmla bench --family prefill``: kept so that ``python benchmarks/bench_prefill.py [options]`` still works.

python benchmarks/bench_prefill.py                      # the default prefill preset beside cuDNN SDPA
python benchmarks/bench_prefill.py --shapes "h128 n4096 fp8"
"""

import sys

from openmla.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["--family", "prefill", *sys.argv[1:]]))
