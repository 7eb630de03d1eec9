"""``mla_decode`` with the regular plan and the request-spanning schedule (``openmla.ops.plan_spans``) in its three
modes (snap, cut, auto), alternating in one process (H200 experiment; not part of openmla). Machines differ by up to
6.5% (RESULTS.md runs 60-62), so only an A/B within one process means anything.

    python3 benchmarks/experiments/spans_ab.py      # AB_ROUNDS (default 4) alternating timings per shape
    AB_SHAPES="128,128,8192,2" python3 benchmarks/experiments/spans_ab.py   # only these (h,b,seq,qlen;...)

Each row times the whole call (split kernel, plus the reduce for the regular plan) under a CUDA graph, per shape: the
largest difference of the outputs from the regular plan's, each plan's time in every round, the medians, their
TFLOPS and the speedups over the regular plan.
"""

from __future__ import annotations

import os
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
    from problems import make_span_problem
    from common import ab_summary, alternate_us, env_line, shapes_from_env

    import openmla

    print(env_line())
    for h, b, s, qlen in shapes_from_env(SHAPES):
        q, cache, bt, sl, qsl, s_max = make_span_problem(h, b, s, qlen)
        keys = int(sl.sum()) * qlen
        flops = 2.0 * keys * h * (576 + 512)
        plans = {}
        for name, spans, mode in (("regular", "0", "auto"), ("snap", "1", "snap"), ("cut", "1", "cut"),
                                  ("auto", "1", "auto")):  # fmt: skip
            os.environ["OPENMLA_DECODE_SPANS"], os.environ["OPENMLA_DECODE_SPAN_MODE"] = spans, mode
            plans[name] = openmla.plan_decode(sl, qsl, h, max_query_len=qlen, max_seq_len=s_max)
        for var in ("OPENMLA_DECODE_SPANS", "OPENMLA_DECODE_SPAN_MODE"):
            os.environ.pop(var)
        outs = {m: openmla.mla_decode(q, cache, bt, sl, qsl, SCALE, plan=p)[0].float() for m, p in plans.items()}
        diff = max((outs["regular"] - o).abs().max().item() for o in outs.values())
        times = alternate_us({m: lambda p=p, a=(q, cache, bt, sl, qsl): openmla.mla_decode(*a, SCALE, plan=p)
                              for m, p in plans.items()}, ROUNDS)  # fmt: skip
        med, line = ab_summary(times, flops)
        sp = {m: plans[m].spans for m in ("cut", "auto")}
        auto = "cut" if int(sp["auto"].num_splits.max()) > 1 else "snap"
        print(f"## h{h} b{b} s{s} q{qlen} (cut: {sp['cut'].num_groups} groups, {int(sp['cut'].group_indptr[-1])} "
              f"items; auto = {auto}; max |diff| {diff:.2e}): "
              + line
              + " | vs regular: " + ", ".join(f"{m} {med['regular'] / med[m]:.4f}x" for m in plans if m != "regular"),
              flush=True)  # fmt: skip
        outs = plans = None
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
