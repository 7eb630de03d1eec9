"""Launch the Gluon (warp-specialised) decode split kernel once per shape, for a profiler (H200; not part of openmla).

    ncu --clock-control none -k regex:_mla_decode_gluon --launch-count 2 --section SpeedOfLight \\
        --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \\
        python3 benchmarks/experiments/profile_ws.py

Shapes: h128 b128 s8192 qlen 1 (compute-bound, issue 6's 560 TFLOPS target) and h128 b1 s32768 (the batch-1
latency target). Each shape's kernel is compiled by a first launch that ncu also sees, so profile with
``--launch-skip 0 --launch-count 2`` and read the first report of each shape, or pass ``--shape``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

import openmla
from openmla.ops import decode_gluon as dg

SHAPES = {"h128b128": (128, 128, 8192), "h128b1": (128, 1, 32768)}


def launch(H: int, B: int, S: int, times: int, variant: str = "ws") -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    page = 64
    nb = B * S // page
    cache = torch.randn(nb, page, 576, device=dev, generator=g, dtype=torch.bfloat16)
    bt = torch.randperm(nb, device=dev, generator=g).view(B, S // page).int()
    sl = torch.full((B,), S, dtype=torch.int32, device=dev)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=dev)
    q = torch.randn(B, H, 576, device=dev, generator=g, dtype=torch.bfloat16)
    plan = openmla.plan_decode(sl, qsl, H, max_query_len=1, max_seq_len=S)
    out = torch.empty(B, H, 512, device=dev, dtype=torch.bfloat16)
    lse = torch.empty(B, H, device=dev, dtype=torch.float32)
    scale = 576**-0.5 * 1.4426950408889634
    items = int((plan.work_req >= 0).sum())
    print(f"{variant} H {H} B {B} S {S}: {items} work items, {plan.capacity * math.ceil(H / 64)} programs", flush=True)
    for _ in range(times):
        dg.mla_decode_split_gluon(q, cache, bt, sl, qsl, plan, out, lse, scale, 1.0, True, 512, variant=variant)
    torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="h128b128,h128b1")
    ap.add_argument("--times", type=int, default=1)
    ap.add_argument("--variant", default="ws", help="a kernel variant (ws, seesaw, seesaw-pair), or both (ws then seesaw)")
    args = ap.parse_args()
    for name in args.shape.split(","):
        for v in ("ws", "seesaw") if args.variant == "both" else (args.variant,):
            launch(*SHAPES[name], args.times, v)
    return 0


if __name__ == "__main__":
    sys.exit(main())
