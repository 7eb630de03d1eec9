"""Where does an item of the request-spanning schedule spend its time? (H200 experiment; not part of openmla)

Runs seesaw-pair-el on the plan's spanning schedule ("snap" and "cut" modes) once with the cycle trace on
(``mla_decode_split_gluon(..., spans=, trace=)``: with ``spans`` each item has its own trace row, with ``%clock64`` at
its start, Q stored, first scores, loop end and finish, and ``%globaltimer`` at its start and finish) and prints per
shape and mode:
- the SM clock during the traced launch (each item's cycles over its nanoseconds);
- the loop's cycles a pair, and each kind of item's fixed cycles (its cycles less its pairs times that period; whole
  requests, first pieces of cut requests, last pieces), split into prologue (start to first scores) and epilogue
  (loop end to finish), and the epilogue's steps (``_span_finish``'s events, medians over both warpgroups);
- the gap between one item's finish and the next item's start in a program;
- the programs' end times from the launch's first start (globaltimer): the mean, the largest, and the largest over
  the mean (the imbalance the schedule leaves), and the spread of the programs' start times.

    PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/experiments/span_trace.py
    TRACE_VARIANTS=seesaw-pair-el,seesaw-pair-elt TRACE_MODES=snap AB_SHAPES="128,128,8192,2" ...   # (defaults:
        seesaw-pair-el; snap,cut; the three shapes below)
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import openmla
from openmla.ops import decode_gluon as dg

SCALE_LOG2 = 576**-0.5 * 1.4426950408889634
# (h, b, seq or "ragged", qlen)
SHAPES = [(128, 128, 8192, 1), (128, 128, 8192, 2), (128, 128, "ragged", 1)]


# the epilogue's steps per kind of item: (name, from event, to event); events 3 (loop done) and 4 (finished) of
# _pair_item, 5-9 of _span_finish
EPILOGUE = {
    "whole": [("row sums", 3, 5), ("final rows", 5, 4)],
    "other piece": [("row sums", 3, 5), ("partial stored", 5, 6), ("flag raised", 6, 7), ("rest", 7, 4)],
    "last piece": [("row sums", 3, 5), ("accumulator to the stage", 5, 6), ("flag seen and reset", 6, 7),
                   ("partial added", 7, 8), ("final rows", 8, 9), ("rest", 9, 4)],
}


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def analyse(trace: torch.Tensor, spans, readers: int, np_: int, ne: int) -> dict:
    """The statistics of the module docstring from one traced launch (warpgroup 0 of every item and program)."""
    slots = spans.work_req.shape[0]
    t2 = trace[: slots * readers * 2 * (np_ + 1) * ne].view(slots, readers, 2, np_ + 1, ne)[:, :, :, np_, :]
    t2 = t2.cpu().double()  # [item, reader, warpgroup, event]
    t = t2[:, :, 0, :]
    g_ptr = spans.group_indptr.cpu().tolist()
    lo, hi = spans.work_lo.cpu().tolist(), spans.work_hi.cpu().tolist()
    req = spans.work_req.cpu().tolist()
    s_ptr = spans.work_indptr.cpu().tolist()
    pairs = [-(-(h - l) // 128) for l, h in zip(lo, hi)]
    kind = []
    for it, b in enumerate(req):
        if b < 0:
            kind.append(None)
        elif s_ptr[b + 1] - s_ptr[b] == 1:
            kind.append("whole")
        else:
            kind.append("last piece" if it == s_ptr[b + 1] - 1 else "other piece")
    items = [it for g in range(spans.num_groups) for it in range(g_ptr[g], g_ptr[g + 1])]
    ok = [it for it in items if t[it, 0, 4] > t[it, 0, 0] > 0]
    ghz = med([float((t[it, r, 4] - t[it, r, 0]) / (t[it, r, 15] - t[it, r, 14])) for it in ok for r in range(readers)
               if t[it, r, 15] > t[it, r, 14]])  # fmt: skip
    period = med([float((t[it, 0, 3] - t[it, 0, 2]) / pairs[it]) for it in ok if pairs[it] >= 8])
    res = {"items": len(items), "ghz": ghz, "period": period, "kinds": {}}
    for k in ("whole", "other piece", "last piece"):
        sel = [it for it in ok if kind[it] == k]
        if sel:
            steps = []
            for name, a, b_ in EPILOGUE[k]:  # the epilogue's steps (_span_finish's events), both warpgroups
                d = [float(t2[it, r, w, b_] - t2[it, r, w, a]) for it in sel for r in range(readers) for w in (0, 1)
                     if t2[it, r, w, a] > 0 and t2[it, r, w, b_] > 0]  # fmt: skip
                steps.append((name, med(d)))
            res["kinds"][k] = dict(
                n=len(sel), pairs=med([pairs[it] for it in sel]),
                fixed=med([float(t[it, 0, 4] - t[it, 0, 0]) - pairs[it] * period for it in sel]),
                pro=med([float(t[it, 0, 2] - t[it, 0, 0]) for it in sel]),
                epi=med([float(t[it, 0, 4] - t[it, 0, 3]) for it in sel]), steps=steps)  # fmt: skip
    gaps, ends, starts = [], [], []
    for g in range(spans.num_groups):
        seq = list(range(g_ptr[g + 1] - 1, g_ptr[g] - 1, -1))  # the order the programs run them
        for r in range(readers):
            run = [it for it in seq if t[it, r, 15] > 0]
            if not run:
                continue
            gaps += [float(t[b_, r, 0] - t[a, r, 4]) for a, b_ in zip(run, run[1:])]
            starts.append(float(t[run[0], r, 14]))
            ends.append(float(t[run[-1], r, 15]))
    t0 = min(starts)
    ends = [e - t0 for e in ends]
    res.update(gap=med(gaps), end_mean=statistics.mean(ends) / 1e3, end_max=max(ends) / 1e3,
               imbalance=max(ends) / statistics.mean(ends), start_spread=(max(starts) - t0) / 1e3)
    return res


def main() -> int:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("span_trace: needs an sm90 GPU")
        return 0
    from problems import make_span_problem
    from common import bench_us, env_line

    from openmla.ops.decode_gluon_seesaw import TRACE_NE, TRACE_NP

    np_, ne = TRACE_NP.value, TRACE_NE.value
    from common import shapes_from_env

    print(env_line())
    variants = os.environ.get("TRACE_VARIANTS", "seesaw-pair-el").split(",")
    modes = os.environ.get("TRACE_MODES", "snap,cut").split(",")
    for h, b, s, qlen in shapes_from_env(SHAPES):
        q, cache, bt, sl, qsl, s_max = make_span_problem(h, b, s, qlen)
        flops = 2.0 * int(sl.sum()) * qlen * h * (576 + 512)
        out = torch.empty(q.shape[0], h, 512, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(q.shape[0], h, dtype=torch.float32, device="cuda")
        for mode, variant in [(m, v) for m in modes for v in variants]:
            os.environ["OPENMLA_DECODE_SPANS"], os.environ["OPENMLA_DECODE_SPAN_MODE"] = "1", mode
            plan = openmla.plan_decode(sl, qsl, h, max_query_len=qlen, max_seq_len=s_max)
            spans = plan.spans
            readers = spans.readers
            trace = torch.zeros(spans.work_req.shape[0] * readers * 2 * (np_ + 1) * ne, dtype=torch.int64,
                                device="cuda")  # fmt: skip

            def run(tr=None, plan=plan, a=(q, cache, bt, sl, qsl), o=(out, lse), v=variant):
                dg.mla_decode_split_gluon(*a, plan, *o, SCALE_LOG2, 1.0, True, 512, variant=v, spans=plan.spans,
                                          trace=tr)  # fmt: skip

            us = bench_us(run)
            us_t = bench_us(lambda tr=trace: run(tr))
            trace.zero_()
            run(trace)
            torch.cuda.synchronize()
            r = analyse(trace, spans, readers, np_, ne)
            print(f"## h{h} b{b} s{s} q{qlen} {mode} {variant}: {us:.1f} us ({flops / us / 1e6:.1f} TFLOPS), traced {us_t:.1f} us; "
                  f"{spans.num_groups} groups x {readers}, {r['items']} items; SM clock {r['ghz']:.3f} GHz; pair "
                  f"{r['period']:.0f} cycles; gap between items {r['gap']:.0f} cycles; program ends mean "
                  f"{r['end_mean']:.1f} us, max {r['end_max']:.1f} us (max/mean {r['imbalance']:.4f}); starts spread "
                  f"{r['start_spread']:.1f} us", flush=True)  # fmt: skip
            for k, v in r["kinds"].items():
                print(f"   {k}: {v['n']} items, median {v['pairs']:.0f} pairs; fixed {v['fixed']:.0f} cycles "
                      f"(prologue {v['pro']:.0f}, epilogue {v['epi']:.0f}: "
                      + ", ".join(f"{n} {d:.0f}" for n, d in v["steps"]) + ")")  # fmt: skip
        for var in ("OPENMLA_DECODE_SPANS", "OPENMLA_DECODE_SPAN_MODE"):
            os.environ.pop(var)
        del q, cache
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
