"""Where does a pair of the seesaw-pair kernel spend its cycles? (H200 experiment; not part of openmla)

Runs the split kernel (``seesaw-pair-r`` and ``seesaw-pair-ea`` by default) once with its cycle trace on (``mla_decode_split_gluon(...,
trace=)``: each warpgroup stores ``%clock64`` at fixed points of pairs 16-31 of every program) and prints, per shape
and memory mode, the median time of every point relative to the pair's start (warpgroup 0 holding the scores of
tile a), merged over both warpgroups, with the median pair period and the program's prologue/epilogue. "scattered":
the benchmark's problem (every tile from HBM once); "shared": every request reads the same pages (L2-resident).
The untraced and traced kernels are timed too, to show how much the stamps perturb the schedule.

    PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/experiments/pair_trace.py [VARIANTS] [--no-trace] [--json FILE]

VARIANTS: comma-separated pair variants (default "seesaw-pair-r,seesaw-pair-ea"), timed alternately
untraced; --no-trace: the timings only.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import openmla
from openmla.ops import decode_gluon as dg

SCALE_LOG2 = 576**-0.5 * 1.4426950408889634

# the _mark points of _pair_wg0 / _pair_wg1 (R_FIRST) and _pair_wg0e / _pair_wg1e (EARLY), in program order
EVENTS = {
    "seesaw-pair-r": {
        0: ["top: S_a ready", "softmax_a done, M_a out", "P_a V_aL issued", "M_b in", "P_a V_aL done",
            "L0 refill issued", "P_a stored, out", "P_b in", "S_a+2 L half issued (L0 landed)", "P_b V_bL done",
            "L1+rope refill issued", "S_a+2 R half issued (R0 landed)", "S_a+2 done"],
        1: ["top: S_b ready", "M_a in", "softmax_b done, M_b out", "P_b stored, out", "P_a in (P_b V_bR issued)",
            "P_b V_bR done", "R1 refill issued", "P_a V_aR done", "R0+rope refill issued",
            "S_b+2 R half issued (R1 landed)", "S_b+2 L half issued (L1 landed)", "S_b+2 done"],
    },
    "seesaw-pair-ea": {
        0: ["top: S_a ready", "M_a out", "P_a out", "P_a V_aL done", "L0 refill issued", "M_b in", "P_b in",
            "P_b V_bL done", "L1+rope refill issued", "S_a+2 L half issued (L0 landed)",
            "S_a+2 R half issued (R0 landed)", "S_a+2 done"],
        1: ["top: S_b ready", "M_a in", "M_b out", "P_b out", "P_a in", "P_a V_aR done", "R0+rope refill issued",
            "P_b V_bR done", "R1 refill issued", "S_b+2 L half issued (L1 landed)", "S_b+2 R half issued (R1 landed)",
            "S_b+2 done"],
    },
}
# points 12-13 of warpgroup 0 split its first step (the scores to M_a; 762 cycles in run 57)
EVENTS["seesaw-pair-ea"][0] += ["(row max of S_a done)", "(M_a stored)"]
EVENTS["seesaw-pair-es"] = EVENTS["seesaw-pair-el"] = EVENTS["seesaw-pair-ea"]
PROGRAM_EVENTS = ["start", "Q stored", "first scores done", "loop done", "finished"]


def analyse(trace: torch.Tensor, programs: int, np_: int, ne: int, first_wave: int, events: dict) -> dict:
    t = trace[: programs * 2 * (np_ + 1) * ne].view(programs, 2, np_ + 1, ne).cpu().double()
    pairs = t[:, :, :np_, :]
    t0 = pairs[:, 0, :, 0:1]  # [P, NP, 1]
    res = {}
    for wave, sel in (("wave1", slice(0, first_wave)), ("wave2", slice(first_wave, programs))):
        rows = []
        for wg in (0, 1):
            for e, name in enumerate(events[wg]):
                d = (pairs[sel, wg, :, e] - t0[sel, :, 0]).flatten()
                ok = (pairs[sel, wg, :, e] != 0).flatten() & (t0[sel, :, 0] != 0).flatten()
                if ok.any():
                    rows.append((float(d[ok].median()), wg, e, name))
        per = (pairs[sel, 0, 1:, 0] - pairs[sel, 0, :-1, 0]).flatten()
        per = per[(pairs[sel, 0, 1:, 0] != 0).flatten() & (pairs[sel, 0, :-1, 0] != 0).flatten()]
        prog = t[sel, :, np_, :len(PROGRAM_EVENTS)]
        p_rows = []
        for wg in (0, 1):
            for e in range(1, len(PROGRAM_EVENTS)):
                d = (prog[:, wg, e] - prog[:, wg, e - 1]).flatten()
                ok = (prog[:, wg, e] != 0) & (prog[:, wg, e - 1] != 0)
                if ok.any():
                    p_rows.append((wg, f"{PROGRAM_EVENTS[e - 1]} -> {PROGRAM_EVENTS[e]}", float(d[ok].median())))
        res[wave] = dict(timeline=sorted(rows), period=float(per.median()) if per.numel() else None,
                         period_p10=float(per.quantile(0.1)) if per.numel() else None,
                         period_p90=float(per.quantile(0.9)) if per.numel() else None, program=p_rows)
    return res


def main() -> int:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9 or not dg.GLUON_AVAILABLE:
        print("pair_trace: needs an sm90 GPU with Gluon")
        return 0
    args = sys.argv[1:]
    out_json = None
    traced = "--no-trace" not in args
    args = [a for a in args if a != "--no-trace"]
    if "--json" in args:
        i = args.index("--json")
        out_json = args[i + 1]
        del args[i : i + 2]
    variants = (args[0] if args else "seesaw-pair-r,seesaw-pair-ea").split(",")
    if any(v not in EVENTS for v in variants):
        print(f"pair_trace: variants must be among {sorted(EVENTS)}")
        return 1
    from problems import make_problem
    from common import bench_us

    from openmla.ops.decode_gluon_seesaw import TRACE_NE, TRACE_NP

    np_, ne = TRACE_NP.value, TRACE_NE.value
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    report = {}
    for h, b, s, qlen in [(128, 128, 8192, 1), (128, 128, 8192, 2)]:
        q, cache, bt, sl, qsl = make_problem(h, b, s, qlen, 2.0)
        plan = openmla.plan_decode(sl, qsl, h, max_query_len=qlen, max_seq_len=s)
        out = torch.empty(q.shape[0], h, 512, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(q.shape[0], h, dtype=torch.float32, device="cuda")
        block_h, q_per = dg.gluon_decode_config(h, qlen)
        programs = plan.capacity * -(-h // block_h) * -(-qlen // q_per)
        trace = torch.zeros(programs * 2 * (np_ + 1) * ne, dtype=torch.int64, device="cuda")
        flops = 2.0 * q.shape[0] * h * s * (576 + 512)
        shared_bt = bt[:1].expand_as(bt).contiguous()
        for mode, table in (("scattered", bt), ("shared", shared_bt)):

            def run(variant, tr=None, table=table):
                dg.mla_decode_split_gluon(q, cache, table, sl, qsl, plan, out, lse, SCALE_LOG2, 1.0, True, 512,
                                          variant=variant, trace=tr)  # fmt: skip

            times = {v: [] for v in variants}
            for _ in range(2):  # alternating, so that clock drift does not favour one variant
                for v in variants:
                    times[v].append(bench_us(lambda v=v: run(v)))
            print(f"\n## h{h} b{b} s{s} q{qlen} {mode}: " + " | ".join(
                f"{v} {min(t):.1f} us ({flops / min(t) / 1e6:.1f} TFLOPS; runs {', '.join(f'{x:.1f}' for x in t)})"
                for v, t in times.items()))  # fmt: skip
            for variant in variants if traced else []:
                us_t = bench_us(lambda v=variant: run(v, trace))
                trace.zero_()
                run(variant, trace)
                torch.cuda.synchronize()
                labels = EVENTS[variant]
                res = analyse(trace, programs, np_, ne, min(n_sm, programs), labels)
                key = f"h{h} b{b} s{s} q{qlen} {mode} {variant}"
                us = min(times[variant])
                report[key] = dict(us=us, us_traced=us_t, tflops=flops / us / 1e6, **res)
                print(f"### {variant}: {us_t:.1f} us traced; {programs} program slots")
                for wave, r in res.items():
                    print(f"#### {wave}: pair period median {r['period']:.0f} cycles (p10 {r['period_p10']:.0f}, "
                          f"p90 {r['period_p90']:.0f})")  # fmt: skip
                    for t_, wg, e, name in r["timeline"]:
                        print(f"  {t_:7.0f}  WG{wg} e{e:<2d} {name}")
                    for wg, name, d in r["program"]:
                        print(f"  program WG{wg} {name}: {d:.0f}")
        del q, cache
        torch.cuda.empty_cache()
    if out_json:
        with open(out_json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
