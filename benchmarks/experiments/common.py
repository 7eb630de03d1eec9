"""Helpers the experiments share: timing, alternating A/B rounds, sustained load, the bandwidth yardstick."""

from __future__ import annotations

import os
import statistics
import subprocess
import time

import torch
import triton


def bench_us(fn, graph: bool = True, rep: int = 100) -> float:
    """Median time of ``fn`` in microseconds (CUDA-graph replay when ``graph``, else do_bench); ``rep``: ms
    of each timed batch (smaller for long sweeps)."""
    if graph:
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3
        except Exception as exc:  # capture can fail for code that syncs; fall back and say so
            print(f"# cuda graph capture failed ({type(exc).__name__}: {exc}); timing with do_bench")
    return triton.testing.do_bench(fn, warmup=max(5, rep // 4), rep=rep, return_mode="median") * 1e3


def alternate_us(fns: dict, rounds: int) -> dict:
    """``{name: [us per round]}``: each of ``fns`` (name -> callable) timed ``rounds`` times by ``bench_us``, the
    callables alternating within each round (the A/B experiments: only timings in one process compare)."""
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            times[k].append(bench_us(fn))
    return times


def ab_summary(times: dict, flops: float) -> tuple[dict, str]:
    """The medians of ``alternate_us``'s timings and one line of them: ``name median us (TFLOPS; each round) | ...``."""
    med = {k: statistics.median(t) for k, t in times.items()}
    line = " | ".join(f"{k} {med[k]:.1f} us ({flops / med[k] / 1e6:.1f} TF; {', '.join(f'{x:.1f}' for x in t)})"
                      for k, t in times.items())  # fmt: skip
    return med, line


def shapes_from_env(default: list) -> list:
    """``AB_SHAPES`` ("h,b,seq,qlen;..."; seq may be "ragged") as tuples, else ``default``."""
    if not os.environ.get("AB_SHAPES"):
        return default
    return [tuple(x if x == "ragged" else int(x) for x in s.split(",")) for s in os.environ["AB_SHAPES"].split(";")]


def sustained_load(run, seconds: float) -> dict:
    """Call ``run`` back to back (20 calls between synchronisations) for about ``seconds`` while ``nvidia-smi``
    samples the SM clock, board power and throttle reasons every 100 ms. Returns ``us`` (per call), and the medians
    ``clock`` (MHz) and ``power`` (W) with the ``reasons`` over the ``samples`` drawing more than 300 W (``clock`` and
    ``power`` None when there is none; ``rows`` then holds the raw samples)."""
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active",
                            "--format=csv,noheader,nounits", "-lms", "100"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    n, t0 = 0, time.perf_counter()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            run()
        n += 20
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    rows = [line.split(", ") for line in smi.communicate()[0].strip().splitlines()]
    busy = [(float(c), float(p), r) for c, p, r in rows if float(p) > 300]
    res = dict(us=start.elapsed_time(end) * 1e3 / n, samples=len(busy), rows=rows[:3], clock=None, power=None,
               reasons=sorted({r for _, _, r in busy}))  # fmt: skip
    if busy:
        res.update(clock=statistics.median(c for c, _, _ in busy), power=statistics.median(p for _, p, _ in busy))
    return res


def read_bandwidth_gbs(gib: float = 4.0) -> float:
    """GB/s of a read-only ``torch.sum`` over ``gib`` GiB of bf16 (the bandwidth yardstick)."""
    x = torch.randn(int(gib * 2**30) // 2, dtype=torch.bfloat16, device="cuda")
    t = triton.testing.do_bench(lambda: x.sum(), warmup=10, rep=200, return_mode="median") * 1e-3
    return gib * 2**30 / t / 1e9


def env_line() -> str:
    """Device, versions and the git commit (``+dirty`` when tracked files differ from it: a copied tree)."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True).stdout.strip()  # fmt: skip
        sha += "+dirty" if sha and dirty else ""
    except OSError:
        sha = "?"
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return f"# {name} | torch {torch.__version__} | triton {triton.__version__} | git {sha or '?'}"
