"""``mla_decode`` with two Gluon kernel variants (``OPENMLA_DECODE_GLUON_VARIANT``, read per call) on the same plan,
alternating in one process (H200 experiment; not part of openmla). Machines differ by up to 6.5% (RESULTS.md runs
60-62), so only an A/B within one process means anything.

    python3 benchmarks/experiments/variant_ab.py seesaw-pair-es seesaw-pair-el    # AB_ROUNDS (default 4) rounds
    python3 benchmarks/experiments/variant_ab.py A B C ...    # each against the first
    AB_SHAPES="128,128,8192,2" python3 benchmarks/experiments/variant_ab.py A B     # only these (h,b,seq,qlen;...)

Per shape: the largest difference of B's output from A's, each variant's time in every round (CUDA-graph replay),
the medians, their TFLOPS and B's speedup over A. The plan is ``plan_decode``'s (with its spanning schedule where
``OPENMLA_DECODE_SPANS`` allows), for ``AB_NUM_SMS`` SMs if set.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROUNDS = int(os.environ.get("AB_ROUNDS", "4"))
SCALE = 576**-0.5
SHAPES = [(128, 128, 8192, 1), (128, 128, 8192, 2), (128, 128, "ragged", 1)]


def main() -> int:
    sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("variant_ab: needs an sm90 GPU")
        return 0
    from problems import make_span_problem
    from common import ab_summary, alternate_us, env_line, shapes_from_env

    import openmla

    names = sys.argv[1:] if len(sys.argv) >= 3 else ["seesaw-pair-es", "seesaw-pair-el"]
    print(env_line(), "|", " vs ".join(names))
    for h, b, s, qlen in shapes_from_env(SHAPES):
        q, cache, bt, sl, qsl, s_max = make_span_problem(h, b, s, qlen)
        flops = 2.0 * int(sl.sum()) * qlen * h * (576 + 512)
        num_sms = int(os.environ["AB_NUM_SMS"]) if os.environ.get("AB_NUM_SMS") else None
        plan = openmla.plan_decode(sl, qsl, h, max_query_len=qlen, max_seq_len=s_max, num_sms=num_sms)

        def call(v):
            os.environ["OPENMLA_DECODE_GLUON_VARIANT"] = v
            return openmla.mla_decode(q, cache, bt, sl, qsl, SCALE, plan=plan)[0]

        outs = {v: call(v).float() for v in names}
        diff = max((outs[names[0]] - outs[v]).abs().max().item() for v in names[1:])
        times = alternate_us({v: lambda v=v: call(v) for v in names}, ROUNDS)  # (call sets the variant)
        med, line = ab_summary(times, flops)
        speedups = ", ".join(f"{v} {med[names[0]] / med[v]:.4f}x" for v in names[1:])
        print(f"## h{h} b{b} s{s} q{qlen} (max |diff| against {names[0]} {diff:.2e}): {line} | speedup "
              f"{speedups}", flush=True)  # fmt: skip
        outs = plan = None
        torch.cuda.empty_cache()
    os.environ.pop("OPENMLA_DECODE_GLUON_VARIANT", None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
