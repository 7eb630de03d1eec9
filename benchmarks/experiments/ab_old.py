"""The seesaw split kernels of an earlier commit against the working tree's, in one process (H200 experiment; not part
of openmla). Machines differ by up to 6.5% (RESULTS.md runs 60-62), so an A/B across calls or processes is noise.

    python3 benchmarks/experiments/ab_old.py --prepare REV   # here: REV's openmla as _ab_old/openmla_old
    python3 benchmarks/experiments/ab_old.py                 # on the H200: alternating timings, best of 3

``--prepare`` runs ``git archive REV openmla`` into ``_ab_old/`` and renames the package's imports, so that both
versions load side by side (``_ab_old/`` is untracked and travels with the working tree). The timing mode prints,
per shape, the largest difference of each variant's output from the old kernel's and the split kernel's time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OLD = os.path.join(ROOT, "_ab_old")
ROUNDS = int(os.environ.get("AB_ROUNDS", "3"))
SCALE_LOG2 = 576**-0.5 * 1.4426950408889634
# (h, b, seq, qlen, variants of the working tree; the old kernel runs the first)
SHAPES = [(128, 128, 8192, 1, ("seesaw-pair-el",)), (128, 128, 8192, 2, ("seesaw-pair-el",)),
          (32, 128, 8192, 1, ("seesaw",)), (16, 128, 8192, 2, ("seesaw",)), (128, 1, 32768, 1, ("seesaw",))]


def prepare(rev: str) -> None:
    os.makedirs(OLD, exist_ok=True)
    cmd = f"rm -rf openmla openmla_old && git -C {ROOT} archive {rev} openmla | tar -x && mv openmla openmla_old"
    subprocess.run(cmd, shell=True, check=True, cwd=OLD)
    for base, _, files in os.walk(os.path.join(OLD, "openmla_old")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(base, name)
                text = open(path).read()
                text = re.sub(r"\bopenmla\.", "openmla_old.", text)
                text = re.sub(r"from openmla import", "from openmla_old import", text)
                text = re.sub(r"^import openmla$", "import openmla_old", text, flags=re.M)
                open(path, "w").write(text)
    print(f"{rev}'s openmla is in {OLD}/openmla_old")


def main() -> int:
    if sys.argv[1:2] == ["--prepare"]:
        prepare(sys.argv[2])
        return 0
    sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks"), OLD]
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("ab_old: needs an sm90 GPU")
        return 0
    from problems import make_problem
    from common import bench_us
    from openmla_old.ops import decode_gluon as dg_old

    import openmla
    from openmla.ops import decode_gluon as dg
    for h, b, s, qlen, variants in SHAPES:
        q, cache, bt, sl, qsl = make_problem(h, b, s, qlen, 2.0)
        plan = openmla.plan_decode(sl, qsl, h, max_query_len=qlen, max_seq_len=s)
        out = torch.empty(q.shape[0], h, 512, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(q.shape[0], h, dtype=torch.float32, device="cuda")
        flops = 2.0 * q.shape[0] * h * s * (576 + 512)
        cands = [("old " + variants[0], dg_old, variants[0])] + [("new " + v, dg, v) for v in variants]

        def run(mod, v):
            mod.mla_decode_split_gluon(q, cache, bt, sl, qsl, plan, out, lse, SCALE_LOG2, 1.0, True, 512, variant=v)

        ref = None
        for name, mod, v in cands:  # final rows only where no request is split (else out holds no result)
            run(mod, v)
            torch.cuda.synchronize()
            if int(plan.num_splits.max()) == 1:
                ref = out.float().clone() if ref is None else ref
                print(f"  {name}: max |out - old| {(out.float() - ref).abs().max().item():.3e}")
        times = {name: [] for name, _, _ in cands}
        for _ in range(ROUNDS):  # alternating, so that clock drift does not favour one
            for name, mod, v in cands:
                times[name].append(bench_us(lambda mod=mod, v=v: run(mod, v)))
        print(f"## h{h} b{b} s{s} q{qlen} (split kernel only): " + " | ".join(
            f"{k} {min(t):.1f} us ({flops / min(t) / 1e6:.1f} TF; {', '.join(f'{x:.1f}' for x in t)})"
            for k, t in times.items()), flush=True)  # fmt: skip
        del q, cache
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
