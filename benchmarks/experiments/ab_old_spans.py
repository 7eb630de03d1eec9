"""``mla_decode`` on the request-spanning schedule of an earlier commit against the working tree's, alternating in one
process (H200 experiment; not part of openmla). Prepare the old package with ``ab_old.py --prepare REV`` first.

    python3 benchmarks/experiments/ab_old_spans.py     # AB_ROUNDS (default 4) rounds; SPAN_MODE (default auto)
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROUNDS = int(os.environ.get("AB_ROUNDS", "4"))
SCALE = 576**-0.5
SHAPES = [(128, 128, 8192, 1), (128, 128, 8192, 2), (128, 128, "ragged", 1)]


def main() -> int:
    sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "_ab_old")]
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("ab_old_spans: needs an sm90 GPU")
        return 0
    import openmla_old
    from problems import make_span_problem
    from common import ab_summary, alternate_us, env_line

    import openmla

    print(env_line())
    os.environ["OPENMLA_DECODE_SPANS"] = "1"
    os.environ["OPENMLA_DECODE_SPAN_MODE"] = os.environ.get("SPAN_MODE", "auto")
    for h, b, s, qlen in SHAPES:
        q, cache, bt, sl, qsl, s_max = make_span_problem(h, b, s, qlen)
        flops = 2.0 * int(sl.sum()) * qlen * h * (576 + 512)
        mods = {"old": openmla_old, "new": openmla}
        plans = {k: m.plan_decode(sl, qsl, h, max_query_len=qlen, max_seq_len=s_max) for k, m in mods.items()}
        outs = {k: m.mla_decode(q, cache, bt, sl, qsl, SCALE, plan=plans[k])[0].float() for k, m in mods.items()}
        diff = (outs["old"] - outs["new"]).abs().max().item()
        times = alternate_us({k: lambda m=m, p=plans[k], a=(q, cache, bt, sl, qsl): m.mla_decode(*a, SCALE, plan=p)
                              for k, m in mods.items()}, ROUNDS)  # fmt: skip
        med, line = ab_summary(times, flops)
        print(f"## h{h} b{b} s{s} q{qlen} (max |diff| {diff:.2e}): {line} | new/old speedup "
              f"{med['old'] / med['new']:.4f}x", flush=True)  # fmt: skip
        outs = plans = None
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
