"""``openmla bench --family sparse``: sparse MLA (V3.2 DSA) decode and prefill beside FlashMLA.

python benchmarks/bench_sparse.py                          # issue 29's table (decode h16-128 b1-128 q1-2, prefill)
python benchmarks/bench_sparse.py --shapes "decode h128 b128 q2 k2048;prefill h128 t4096 k2048"
python benchmarks/bench_sparse.py --shapes "decode h64 b64 q1 k2048 tile32x8x2;decode h64 b64 q1 k2048 tile64x8x2"
"""

import sys

from openmla.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["--family", "sparse", *sys.argv[1:]]))
