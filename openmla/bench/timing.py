"""Timing for ``openmla bench``: alternating A/B rounds, CUDA-graph replay, the roofline measured in the run.

On a GPU each callable is timed by ``triton.testing.do_bench_cudagraph`` (decode: launch-bound, so graph replay) or
``triton.testing.do_bench`` (prefill), the providers alternating within each round so that clock drift hits them
alike; only timings taken in one process compare. On the CPU (Triton interpreter) ``time.perf_counter`` stands in:
the figures check the plumbing, not the hardware.
"""

from __future__ import annotations

import functools
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import triton  # after openmla (the parent package), which sets TRITON_INTERPRET on a machine without CUDA
import triton.language as tl


def quantile(xs: list[float], q: float) -> float:
    """Linear-interpolated quantile of ``xs`` (``q`` in [0, 1]); nan when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class Timing:
    """The samples (us per call) of one callable, pooled over the rounds; ``error`` set when it failed."""

    samples_us: list[float] = field(default_factory=list)
    timer: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.samples_us)

    @property
    def p50(self) -> float:
        return quantile(self.samples_us, 0.5)

    @property
    def p20(self) -> float:
        return quantile(self.samples_us, 0.2)

    @property
    def p80(self) -> float:
        return quantile(self.samples_us, 0.8)


def _sync() -> None:
    """Wait for the device after a failure; a sticky CUDA error surfaces at the next call instead of here."""
    try:
        torch.cuda.synchronize()
    except Exception:
        pass


class Timer:
    """Times callables on ``device``: ``rep`` ms per timed batch, ``rounds`` alternating rounds."""

    def __init__(self, device: torch.device, rep: int = 50, rounds: int = 3) -> None:
        self.device = device
        self.rep = rep
        self.rounds = rounds

    def _once(self, fn: Callable[[], object], graph: bool) -> tuple[list[float], str]:
        if self.device.type != "cuda":  # no warm-up: a family calls openmla once before it times it
            out = []
            for _ in range(2):
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1e6)
            return out, "cpu"
        if graph:
            try:
                ms = triton.testing.do_bench_cudagraph(fn, rep=self.rep, return_mode="all")
                return [t * 1e3 for t in ms], "cuda-graph"
            except Exception as exc:  # capture can fail for code that syncs; fall back and say so in the row
                _sync()
                print(f"# cuda graph capture failed ({type(exc).__name__}: {exc}); timing with do_bench", flush=True)
        ms = triton.testing.do_bench(fn, warmup=max(5, self.rep // 4), rep=self.rep, return_mode="all")
        return [t * 1e3 for t in ms], "do_bench"

    def alternate(self, fns: dict[str, Callable[[], object]], *, graph: bool = True) -> dict[str, Timing]:
        """``{name: Timing}``: every callable timed once a round, in turn, for ``rounds`` rounds. A callable that
        raises gets ``Timing.error`` and drops out of the later rounds; the others go on."""
        res = {k: Timing() for k in fns}
        use_graph = dict.fromkeys(fns, graph)
        for _ in range(self.rounds):
            for k, fn in fns.items():
                t = res[k]
                if t.error:
                    continue
                try:
                    samples, timer = self._once(fn, use_graph[k])
                except Exception as exc:
                    t.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                    if self.device.type == "cuda":
                        _sync()
                    continue
                use_graph[k] = timer == "cuda-graph"  # a failed capture is not retried every round
                t.samples_us += samples
                t.timer = timer if not t.timer or t.timer == timer else "mixed"
        return res


def read_bandwidth(device: torch.device, quick: bool = False) -> tuple[float, list[tuple[float, float]]]:
    """GB/s of a read-only ``torch.sum`` over bf16 buffers of several sizes (all larger than L2): returns the best
    one (the bandwidth yardstick of the run) and ``[(GiB, GB/s), ...]``."""
    sizes = ((1.0, 4.0) if quick else (0.5, 1.0, 2.0, 4.0)) if device.type == "cuda" else (1 / 64,)
    sweep = []
    for gib in sizes:
        x = torch.ones(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device)
        sweep.append((gib, gib * 2**30 / _seconds(x.sum, device, 10) / 1e9))
        x = None  # freed before the next, larger buffer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return max(g for _, g in sweep), sweep


def _seconds(fn: Callable[[], object], device: torch.device, warmup_ms: int) -> float:
    """Median seconds of ``fn`` (``do_bench`` on a GPU, one timed call after a warm-up on the CPU)."""
    if device.type == "cuda":
        return triton.testing.do_bench(fn, warmup=warmup_ms, rep=100, return_mode="median") * 1e-3
    fn()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def matmul_peak(device: torch.device, quick: bool = False) -> tuple[float, list[tuple[int, float]]]:
    """TFLOPS of a bf16 ``torch.matmul`` of square matrices (the compute yardstick of the run): the best one and
    ``[(n, TFLOPS), ...]``."""
    sizes = ((8192,) if quick else (4096, 8192, 16384)) if device.type == "cuda" else (128,)
    sweep = []
    for n in sizes:
        a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2))
        sweep.append((n, 2.0 * n**3 / _seconds(functools.partial(torch.matmul, a, b), device, 25) / 1e12))
        a = b = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return max(t for _, t in sweep), sweep


@triton.jit
def _gather_rows_kernel(pool, slots, out, n_rows, ROW_WORDS: tl.constexpr, BLOCK_W: tl.constexpr,
                        ROWS: tl.constexpr):  # fmt: skip
    # ROWS whole rows of ROW_WORDS int32 words at the given slots, folded into one word a program (kept live)
    o_r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    m_r = o_r < n_rows
    s = tl.load(slots + o_r, mask=m_r, other=0).to(tl.int64)
    o_w = tl.arange(0, BLOCK_W)
    x = tl.load(pool + s[:, None] * ROW_WORDS + o_w[None, :], mask=m_r[:, None] & (o_w[None, :] < ROW_WORDS), other=0)
    tl.store(out + tl.program_id(0), tl.xor_sum(tl.xor_sum(x, axis=1), axis=0))


# (rows a program, warps) the gather yardstick tries; the best one is the run's figure (H200, stop 56: 16 x 4 the best
# of the last four, so smaller tiles are tried too)
GATHER_CONFIGS = ((16, 4), (8, 2), (8, 4), (32, 4), (32, 8), (64, 8))
GATHER_ROWS = 262144  # rows gathered a call: V3.2 decode's b128 q1 top-k 2048
GATHER_POOL_GIB = 1.0  # the pool they are drawn from (far larger than L2)


def gather_rows(device: torch.device) -> int:
    """Rows a call of the gather yardstick reads: GATHER_ROWS on a GPU, 64 under the interpreter."""
    return GATHER_ROWS if device.type == "cuda" else 64


def gather_bandwidth(device: torch.device, row_bytes: int, quick: bool = False) -> tuple[float, list]:
    """GB/s of reading whole ``row_bytes``-byte rows (a multiple of 4) at uniformly random slots of a 1 GiB pool:
    the roofline of a sparse decode, which reads each selected cache row whole from a random place. Returns the best
    of :data:`GATHER_CONFIGS` and ``[((rows a program, warps), GB/s), ...]``. The CPU (interpreter) gathers 64 rows
    of a small pool, to check the plumbing."""
    if row_bytes % 4:
        raise ValueError(f"row_bytes must be a multiple of 4, got {row_bytes}")
    cuda = device.type == "cuda"
    words = row_bytes // 4
    n_slots = int(GATHER_POOL_GIB * 2**30) // row_bytes if cuda else 1024
    n_rows = gather_rows(device)
    pool = torch.ones(n_slots * words, dtype=torch.int32, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    slots = torch.randint(0, n_slots, (n_rows,), dtype=torch.int32, device=device, generator=g)
    configs = (GATHER_CONFIGS[:3] if quick else GATHER_CONFIGS) if cuda else GATHER_CONFIGS[:1]
    sweep = []
    for rows, warps in configs:
        grid = (triton.cdiv(n_rows, rows),)
        out = torch.empty(grid[0], dtype=torch.int32, device=device)

        def fn(rows=rows, warps=warps, grid=grid, out=out):
            _gather_rows_kernel[grid](pool, slots, out, n_rows, ROW_WORDS=words,
                                      BLOCK_W=triton.next_power_of_2(words), ROWS=rows, num_warps=warps)  # fmt: skip

        sweep.append(((rows, warps), n_rows * row_bytes / _seconds(fn, device, 10) / 1e9))
    pool = None
    if cuda:
        torch.cuda.empty_cache()
    return max(v for _, v in sweep), sweep


def kernel_times(fn: Callable[[], object], calls: int) -> dict[str, float]:
    """The device time a call of ``fn`` spends in each CUDA kernel (or copy) it launches, over ``calls`` calls after
    one warm-up call (torch profiler; eager launches, not the timed CUDA graph): ``{name: us a call}``, longest
    first (:func:`kernel_summary`)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return kernel_summary(((e.name, e.device_time) for e in prof.events() if e.device_type == cuda), calls)


def kernel_summary(events, calls: int) -> dict[str, float]:
    """``(name, us)`` events of ``calls`` calls -> ``{short name: us a call}``, longest first. A short name drops a
    leading ``void `` and anything from the first ``<`` or ``(`` (template arguments, parameters)."""
    total: dict[str, float] = {}
    for name, us in events:
        short = name.removeprefix("void ")
        for stop in "<(":
            short = short.split(stop, 1)[0]
        total[short] = total.get(short, 0.0) + us
    return dict(sorted(((n, t / calls) for n, t in total.items()), key=lambda x: -x[1]))


def format_kernels(times: dict[str, float]) -> str:
    """``{name: us}`` -> ``"name 79.3; name 10.8"`` (the CSV column ``kernels``)."""
    return "; ".join(f"{n} {us:.1f}" for n, us in times.items())


def environment(label: str = "") -> dict:
    """GPU name, versions, the git commit of the package's checkout (``+dirty``: tracked files differ from it;
    ``?`` outside a checkout) and the label, stored in every row."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sha = "?"
    try:
        run = dict(capture_output=True, text=True, cwd=root, timeout=10)
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], **run).stdout.strip()
        if head:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], **run).stdout.strip()
            sha = head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, git=sha, label=label)
