r"""``openmla bench --family sparse_v4``: DeepSeek V4 sparse attention (fp8_v4 caches) beside FlashMLA's MODEL1 kernels.

python benchmarks/bench_sparse_v4.py                     # issue 31 item 7's table (decode h8-h128, prefill)
python benchmarks/bench_sparse_v4.py --shapes "v4decode h64 b128 q2 w128 k512;v4decode h128 b128 q2 w128 k1024"
python benchmarks/bench_sparse_v4.py --shapes "v4prefill h64 t4096 k512 w128 paged;v4prefill h64 t4096 k512 w128 \
paged gather"                                             # prefill paged, or through a gathered bf16 workspace
python benchmarks/bench_sparse_v4.py --shapes sweep      # tile and split variants
"""

import sys

from openmla.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["--family", "sparse_v4", *sys.argv[1:]]))
