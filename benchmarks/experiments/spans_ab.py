"""``mla_decode`` with and without the request-spanning schedule (``openmla.ops.plan_spans``), alternating in one
process (H200 experiment; not part of openmla). Machines differ by up to 6.5% (RESULTS.md runs 60-62), so only an
A/B within one process means anything.

    python3 benchmarks/experiments/spans_ab.py      # AB_ROUNDS (default 4) alternating timings per shape

Each row times the whole call (split kernel + reduce) under a CUDA graph, per shape: the largest difference of the
two outputs, each plan's time in every round, the medians and the TFLOPS of the medians.
"""

from __future__ import annotations

import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROUNDS = int(os.environ.get("AB_ROUNDS", "4"))
SCALE = 576**-0.5
# (h, b, seq or "ragged", qlen)
SHAPES = [(128, 128, 8192, 1), (128, 128, 8192, 2), (128, 132, 8192, 1), (128, 64, 8192, 2), (64, 128, 8192, 2),
          (128, 128, "ragged", 1), (128, 128, 4096, 1)]


def main() -> int:
    sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("spans_ab: needs an sm90 GPU")
        return 0
    from bench_decode_gluon import make_problem
    from common import bench_us, env_line

    import openmla

    print(env_line())
    for h, b, s, qlen in SHAPES:
        s_max = 16384 if s == "ragged" else s
        q, cache, bt, sl, qsl = make_problem(h, b, s_max, qlen, 2.0)
        if s == "ragged":  # 512 .. 16384 keys, a fixed draw
            gen = torch.Generator(device="cpu").manual_seed(0)
            sl.copy_(torch.randint(512, 16385, (b,), generator=gen, dtype=torch.int32))
        keys = int(sl.sum()) * qlen
        flops = 2.0 * keys * h * (576 + 512)
        plans = {}
        for mode in ("0", "1"):
            os.environ["OPENMLA_DECODE_SPANS"] = mode
            plans[mode] = openmla.plan_decode(sl, qsl, h, max_query_len=qlen, max_seq_len=s_max)
        os.environ.pop("OPENMLA_DECODE_SPANS")
        outs = {m: openmla.mla_decode(q, cache, bt, sl, qsl, SCALE, plan=p)[0].float() for m, p in plans.items()}
        diff = (outs["0"] - outs["1"]).abs().max().item()
        times = {m: [] for m in plans}
        for _ in range(ROUNDS):
            for m, p in plans.items():
                times[m].append(bench_us(lambda p=p: openmla.mla_decode(q, cache, bt, sl, qsl, SCALE, plan=p)))
        med = {m: statistics.median(t) for m, t in times.items()}
        sp = plans["1"].spans
        extra = f"{sp.num_groups} groups, {int(sp.group_indptr[-1])} items" if sp is not None else "no spans"
        print(f"## h{h} b{b} s{s} q{qlen} ({extra}; max |diff| {diff:.2e}): "
              + " | ".join(f"spans={m} median {med[m]:.1f} us ({flops / med[m] / 1e6:.1f} TF; "
                           f"{', '.join(f'{x:.1f}' for x in t)})" for m, t in times.items())
              + f" | spans/no {med['0'] / med['1']:.4f}x", flush=True)  # fmt: skip
        del q, cache, outs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
