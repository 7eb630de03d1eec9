"""``openmla bench --family decode``: kept so that ``python benchmarks/bench_decode.py [options]`` still works.

python benchmarks/bench_decode.py                       # the default decode preset beside FlashMLA
python benchmarks/bench_decode.py --shapes "h128 b128 s8192 q2;h16 b128 s8192 q1 fp8"
"""

import sys

from openmla.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["--family", "decode", *sys.argv[1:]]))
