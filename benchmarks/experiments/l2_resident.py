"""Is the Gluon decode kernel limited by HBM latency or by its own schedule? (H200 experiment; not part of openmla)

Times the split kernel (ws and seesaw) on the h128 b128 s8192 shapes twice: with each request's pages scattered
over a 2 GiB pool (the benchmark's problem: every KV tile comes from HBM once), and with every request reading
the same pages (9.4 MB of KV in all: after the first touch every tile is an L2 hit). If the L2-resident time is
much lower, the kernel waits on its loads (deeper prefetch would pay); if it is about the same, the limit is the
schedule (MMA issue, barriers, softmax) and more memory parallelism would not help.

    PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/experiments/l2_resident.py [VARIANTS]

VARIANTS: comma-separated kernel variants (default "ws,seesaw").
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import openmla
from openmla.ops import decode_gluon as dg

SCALE_LOG2 = 576**-0.5 * 1.4426950408889634


def main() -> int:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9 or not dg.GLUON_AVAILABLE:
        print("l2_resident: needs an sm90 GPU with Gluon")
        return 0
    variants = (sys.argv[1] if len(sys.argv) > 1 else "ws,seesaw").split(",")
    from problems import make_problem
    from common import bench_us

    print("# split kernel alone, CUDA-graph median; 'shared' = every request reads the same pages (L2-resident)")
    for h, b, s, qlen in [(128, 128, 8192, 1), (128, 128, 8192, 2), (32, 128, 8192, 1)]:
        q, cache, bt, sl, qsl = make_problem(h, b, s, qlen, 2.0)
        plan = openmla.plan_decode(sl, qsl, h, max_query_len=qlen, max_seq_len=s)
        out = torch.empty(q.shape[0], h, 512, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(q.shape[0], h, dtype=torch.float32, device="cuda")
        flops = 2.0 * q.shape[0] * h * s * (576 + 512)
        shared_bt = bt[:1].expand_as(bt).contiguous()
        row = []
        for variant in variants:
            for name, table in (("scattered", bt), ("shared", shared_bt)):

                def fn(table=table, variant=variant):
                    dg.mla_decode_split_gluon(q, cache, table, sl, qsl, plan, out, lse, SCALE_LOG2, 1.0, True, 512,
                                              variant=variant)  # fmt: skip

                us = bench_us(fn)
                row.append(f"{variant} {name} {us:7.1f} us {flops / us / 1e6:5.1f} TF")
        print(f"h{h} b{b} s{s} q{qlen} | " + " | ".join(row), flush=True)
        del q, cache
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
