"""Board power of TMA copies alone (issue 6: would 2-CTA multicast, which halves the L2-to-SM bytes, save energy?).

Streams ``[64, 256]`` bf16 boxes into every SM with ``tma_throughput._tma_stream`` back to back for about
``SECONDS`` seconds per pool and ring depth while ``nvidia-smi`` samples the power and SM clock every 100 ms;
prints the chip's GB/s with the median power and clock over the busy samples, and the idle power before the runs.
A small pool stays in L2 (L2-to-SM bytes only), the 2 GiB pool comes from HBM.

    PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/experiments/copy_power.py
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import torch

SECONDS = 3.0


def sample(run, seconds: float) -> tuple[float, float, float]:
    """(calls a second, median W, median MHz) while ``run`` repeats for ``seconds``."""
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "100"], stdout=subprocess.PIPE, text=True)  # fmt: skip
    time.sleep(0.3)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            run()
        n += 10
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    smi.terminate()
    rows = [[float(x) for x in line.split(", ")] for line in smi.communicate()[0].strip().splitlines()]
    busy = rows[len(rows) // 5 :]
    return n / dt, statistics.median(p for _, p in busy), statistics.median(c for c, _ in busy)


def main() -> int:
    from openmla.ops._gluon import GLUON_AVAILABLE

    if not GLUON_AVAILABLE or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("copy_power: needs Gluon and an sm90 GPU")
        return 0
    from experiments.tma_throughput import BOX, make_stream

    smi = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
                         check=False, capture_output=True, text=True).stdout.strip()  # fmt: skip
    print(f"idle: {smi} (MHz, W)", flush=True)
    iters = 4000
    for pool_bytes in (24 << 20, 2 << 30):
        launch, _, sms, pool = make_stream(pool_bytes, iters)
        for stages in (1, 2, 4):

            def run(launch=launch, stages=stages):
                launch(stages)

            run()
            torch.cuda.synchronize()
            calls, watts, mhz = sample(run, SECONDS)
            gbs = calls * sms * iters * BOX / 1e9
            print(f"pool {pool_bytes / 2**20:6.0f} MiB stages {stages}: {gbs:6.0f} GB/s into the SMs, "
                  f"power median {watts:.0f} W, SM clock median {mhz:.0f} MHz", flush=True)  # fmt: skip
        del launch, pool  # (the launch holds the pool's descriptor)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
