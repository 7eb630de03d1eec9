"""``mla_decode`` on plans for different SM counts, alternating in one process (H200 experiment; not part of openmla).

On a uniform batch the spanning schedule's snap mode gives each group of ``readers`` SMs whole requests: at h128 b128
q2 that is 33 groups of 4 SMs for 128 requests, so 29 groups run 4 requests and 4 groups run 3. A plan for 128 SMs
makes 32 groups of exactly 4 requests: the same makespan, 4 SMs idle throughout instead of 16 SMs idle for the last
quarter, and 128 instead of 132 SMs sharing the L2-to-SM bandwidth that the refills queue for (run 122). This
measures whether that is worth a planner rule (use the fewest groups that keep the makespan).

    PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/experiments/sms_ab.py     # AB_SMS="132,128" AB_ROUNDS=4

Per shape: the largest output difference from the first plan's and each plan's time in every round (CUDA-graph
replay), the medians, their TFLOPS and each plan's speedup over the first.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROUNDS = int(os.environ.get("AB_ROUNDS", "4"))
SCALE = 576**-0.5
SHAPES = [(128, 128, 8192, 1), (128, 128, 8192, 2)]


def ab_shape(h: int, b: int, s, qlen: int, sms: list) -> str:
    """One shape's line: the plans for each SM count in ``sms`` alternating, against the first."""
    import torch
    from problems import make_span_problem
    from common import ab_summary, alternate_us

    import openmla

    q, cache, bt, sl, qsl, s_max = make_span_problem(h, b, s, qlen)
    flops = 2.0 * int(sl.sum()) * qlen * h * (576 + 512)
    plans = {f"sms{n}": openmla.plan_decode(sl, qsl, h, max_query_len=qlen, max_seq_len=s_max, num_sms=n) for n in sms}
    names = list(plans)
    groups = {k: (p.spans.num_groups if p.spans is not None else None) for k, p in plans.items()}

    def call(k):
        return openmla.mla_decode(q, cache, bt, sl, qsl, SCALE, plan=plans[k])[0]

    outs = {k: call(k).float() for k in names}
    diff = max((outs[names[0]] - outs[k]).abs().max().item() for k in names[1:])
    times = alternate_us({k: lambda k=k: call(k) for k in names}, ROUNDS)
    med, line = ab_summary(times, flops)
    speedups = ", ".join(f"{k} {med[names[0]] / med[k]:.4f}x" for k in names[1:])
    outs = plans = None
    torch.cuda.empty_cache()
    return (f"## h{h} b{b} s{s} q{qlen} (groups {groups}; max |diff| against {names[0]} {diff:.2e}): {line} | "
            f"speedup {speedups}")  # fmt: skip


def main() -> int:
    sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("sms_ab: needs an sm90 GPU")
        return 0
    from common import env_line, shapes_from_env

    sms = [int(n) for n in os.environ.get("AB_SMS", "132,128").split(",")]
    print(env_line(), "|", " vs ".join(f"sms{n}" for n in sms))
    for h, b, s, qlen in shapes_from_env(SHAPES):
        print(ab_shape(h, b, s, qlen, sms), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
