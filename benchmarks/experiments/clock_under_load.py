"""The SM clock and board power while one decode shape runs back to back (issue 6: the 700 W cap at h128).

Runs ``mla_decode_split_gluon`` (split kernel only, the regular plan) for about ``SECONDS`` seconds per shape while
``nvidia-smi`` samples the SM clock, power and throttle reasons every 100 ms; prints the medians over the samples
taken while the kernel ran, with the kernel's time per call and the energy a call takes (median power x time).
Before that, after a second's rest, the same call timed as the benchmarks time it (``bench_us``: CUDA-graph replays
of about 50 ms, "burst"): at the 700 W cap the two can rank kernels differently (RESULTS.md run 107).
A sixth field ``snap`` / ``cut`` / ``auto`` runs ``mla_decode`` instead, with the request-spanning schedule in that
mode (``OPENMLA_DECODE_SPAN_MODE``; ``seq`` may then be ``ragged``: 512-16384 keys a request, a fixed draw).
``CLOCK_L2=1``: every request reads request 0's pages (after the first touch every KV tile is an L2 hit), so that the
energy a call takes with and without the HBM reads can be compared.

    PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/experiments/clock_under_load.py
    CLOCK_SHAPES="128,128,8192,2,seesaw-pair-el;128,128,8192,2,seesaw-pair-elm" ...   # other shapes / variants
    CLOCK_SHAPES="128,128,8192,2,seesaw-pair-eltm,snap;128,128,8192,2,seesaw-pair-eltm,cut" ...   # spanning modes
"""

from __future__ import annotations

import os
import sys
import time

SECONDS = 4.0
SHAPES = [(128, 128, 8192, 1, "seesaw-pair-el", None), (128, 128, 8192, 2, "seesaw-pair-el", None),
          (32, 128, 8192, 1, "seesaw", None)]
if os.environ.get("CLOCK_SHAPES"):  # "h,b,seq,qlen,variant[,mode];..."
    SHAPES = [(int(f[0]), int(f[1]), f[2] if f[2] == "ragged" else int(f[2]), int(f[3]), f[4],
               f[5] if len(f) > 5 else None)
              for f in (item.split(",") for item in os.environ["CLOCK_SHAPES"].split(";"))]  # fmt: skip
SCALE = 576**-0.5


def main() -> int:
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("clock_under_load: needs an sm90 GPU")
        return 0
    from problems import make_span_problem
    from common import bench_us, sustained_load

    import openmla
    from openmla.ops import decode_gluon as dg

    scale_log2 = SCALE * 1.4426950408889634
    for h, b, s, qlen, variant, mode in SHAPES:
        q, cache, bt, sl, qsl, s_max = make_span_problem(h, b, s, qlen)
        if os.environ.get("CLOCK_L2") == "1":
            bt.copy_(bt[:1].expand_as(bt))
        out = torch.empty(q.shape[0], h, 512, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(q.shape[0], h, dtype=torch.float32, device="cuda")
        if mode is None:
            plan = openmla.plan_decode(sl, qsl, h, max_query_len=qlen, max_seq_len=s_max)

            def run():
                dg.mla_decode_split_gluon(q, cache, bt, sl, qsl, plan, out, lse, scale_log2, 1.0, True, 512,
                                          variant=variant)  # fmt: skip
        else:  # mla_decode (split kernel and, for cut pieces, nothing else) on the spanning schedule
            os.environ["OPENMLA_DECODE_SPANS"], os.environ["OPENMLA_DECODE_SPAN_MODE"] = "1", mode
            os.environ["OPENMLA_DECODE_GLUON_VARIANT"] = variant
            plan = openmla.plan_decode(sl, qsl, h, max_query_len=qlen, max_seq_len=s_max)

            def run():
                openmla.mla_decode(q, cache, bt, sl, qsl, SCALE, plan=plan, out=out, lse=lse)

        run()
        torch.cuda.synchronize()
        time.sleep(1.0)
        burst = bench_us(run, rep=50)  # (bench_decode.py --rep 50)
        load = sustained_load(run, SECONDS)
        us = load["us"]
        flops = 2.0 * int(sl.sum()) * qlen * h * (576 + 512)
        name = f"h{h} b{b} s{s} q{qlen} {variant}" + (f" {mode}" if mode else "")
        name += " (L2-resident)" if os.environ.get("CLOCK_L2") == "1" else ""
        for var in ("OPENMLA_DECODE_SPANS", "OPENMLA_DECODE_SPAN_MODE", "OPENMLA_DECODE_GLUON_VARIANT"):
            os.environ.pop(var, None)
        if load["power"] is not None:
            print(f"{name}: burst {burst:.1f} us ({flops / burst / 1e6:.1f} TF); sustained {us:.1f} us a call "
                  f"({flops / us / 1e6:.1f} TF), SM clock median {load['clock']:.0f} MHz, power median "
                  f"{load['power']:.0f} W over {load['samples']} samples ({load['power'] * us / 1e3:.1f} mJ a call), "
                  f"throttle reasons {load['reasons']}", flush=True)  # fmt: skip
        else:
            print(f"{name}: burst {burst:.1f} us; sustained {us:.1f} us a call, no busy sample ({load['rows']})",
                  flush=True)  # fmt: skip
        del q, cache
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
