"""What a family's ``run`` gets: the device, the timer, the run's yardsticks, optional peers and row building."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable

import torch

from openmla.bench.timing import Timer, Timing, format_kernels, kernel_times


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two outputs (1.0 = same direction), computed in fp64; 0.0 when either holds NaN or inf
    (so that the run's warning names the point)."""
    a, b = a.double().flatten(), b.double().flatten()
    c = float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-30))
    return c if math.isfinite(c) else 0.0


def add_variant(ctx: BenchContext, fns: dict, name: str, fn, ref: torch.Tensor, got: torch.Tensor, where) -> None:
    """Run a variant ``fn`` (writing ``got``) once; keep it as provider ``fns[name]`` when it runs, with a note when
    its output is off the default's ``ref`` (cosine < 0.9999) or when it is refused or fails (its row stays empty)."""
    try:
        fn()
        c = cosine(ref, got)
        if c < 0.9999:
            ctx.note(f"# {name} vs the default at {where}: cosine {c:.6f}")
        fns[name] = fn
    except Exception as exc:
        ctx.note(f"# {name} failed at {where}: {type(exc).__name__}: {exc}".splitlines()[0])


class BenchContext:
    """The run as a family sees it.

    Attributes:
        device (torch.device): cuda when present, else cpu (the Triton interpreter: tiny shapes only).
        peers (bool): peers may be timed (False with ``--no-peers``).
        quick (bool): ``--quick`` was given (families may time less).
        bw_gbs (float): the read bandwidth measured in this run (GB/s). peak_tflops (float): the bf16 matmul peak.
        gather_gbs (dict): ``{row bytes: GB/s}``, the random-row gather rate measured in this run for the row sizes
            the planned families declare (``GATHER_ROW_BYTES``).
        env (dict): gpu, torch, triton, git and label, copied into every row.
        profile_calls (int): ``--profile N``: after timing a point, each provider's kernels are profiled over N calls
            (CUDA only; the column ``kernels`` and a printed line); 0: not profiled.
        baseline (module | None): an older openmla package (``--against``), renamed ``openmla_old``; a family that
            supports it times its ops as provider ``"before"`` in the same rounds (``speedup`` = before / openmla).
    """

    def __init__(self, device: torch.device, timer: Timer, *, peers: bool, quick: bool, bw_gbs: float,
                 peak_tflops: float, env: dict, note: Callable[[str], None] = print,
                 baseline=None, gather_gbs: dict | None = None, profile_calls: int = 0) -> None:  # fmt: skip
        self.device, self.timer, self.peers, self.quick = device, timer, peers, quick
        self.bw_gbs, self.peak_tflops, self.env = bw_gbs, peak_tflops, env
        self.note = note  # prints a line beside the progress bar
        self.baseline = baseline
        self.gather_gbs = gather_gbs or {}
        self.family = ""  # set by the runner before each family's points
        self._peer_cache: dict[str, object] = {}
        self._point = 0
        self.profile_calls = profile_calls
        self._kernels: dict[str, str] = {}  # provider -> its kernels at the point timed last (``profile_calls``)

    def peer(self, module: str):
        """The peer ``module`` imported (e.g. ``"flash_mla"``), or None when peers are off, there is no GPU or
        it does not import (said once per run)."""
        if not self.peers or self.device.type != "cuda":
            return None
        if module not in self._peer_cache:
            try:
                self._peer_cache[module] = importlib.import_module(module)
            except Exception as exc:  # a missing or broken peer is an empty column, never an error
                self.note(f"# peer {module} not available ({type(exc).__name__}: {exc}); its column stays empty")
                self._peer_cache[module] = None
        return self._peer_cache[module]

    def time(self, fns: dict[str, Callable[[], object]], *, graph: bool = True) -> dict[str, Timing]:
        """Time ``{provider: callable}`` in alternating rounds (see :class:`openmla.bench.timing.Timer`); with
        ``profile_calls`` on a GPU, then each provider's kernels (``kernels`` column of :meth:`rows`)."""
        timings = self.timer.alternate(fns, graph=graph)
        self._kernels = {}
        if self.profile_calls > 0 and self.device.type == "cuda":
            for prov, fn in fns.items():
                try:
                    self._kernels[prov] = format_kernels(kernel_times(fn, self.profile_calls))
                except Exception as exc:  # a failed profile leaves the column empty, never the row
                    self.note(f"# profile of {prov} failed: {type(exc).__name__}: {exc}".splitlines()[0])
                    continue
                self.note(f"#   {prov} kernels (us a call): {self._kernels[prov]}")
        return timings

    def rows(self, op: str, shape: str, timings: dict[str, Timing], *, flops: float, nbytes: float | dict,
             dtype: str | dict, peer: str | None = None, check: float | None = None,
             gather_bytes: int | None = None) -> list[dict]:  # fmt: skip
        """The rows of one point: one per provider in ``timings`` (``"openmla"`` first).

        ``nbytes`` and ``dtype`` are one value or ``{provider: value}`` (a peer may read another dtype).
        ``peer`` names the provider the openmla row is compared with: its ``ratio`` = peer p50 / openmla p50
        (> 1: openmla faster). ``check``: cosine similarity of openmla's output with the peer's.
        ``gather_bytes``: the cache's row size, when the point reads its rows at random slots: ``frac_gather`` is then
        GB/s over this run's gather rate for rows of that size (where measured).
        """
        self._point += 1
        g_gbs = self.gather_gbs.get(gather_bytes, float("nan"))
        rows = []
        for prov, t in timings.items():
            nb = nbytes[prov] if isinstance(nbytes, dict) else nbytes
            us = t.p50 if t.ok else float("nan")
            ok = t.ok and us > 0  # an empty graph can time as 0
            gbs = nb / us / 1e3 if ok else float("nan")
            tflops = flops / us / 1e6 if ok else float("nan")
            row = dict(self.env, family=self.family, op=op, provider=prov, shape=shape,
                       dtype=dtype[prov] if isinstance(dtype, dict) else dtype, p50_us=us, p20_us=t.p20, p80_us=t.p80,
                       gbs=gbs, tflops=tflops, frac_bw=gbs / self.bw_gbs, frac_peak=tflops / self.peak_tflops,
                       frac_gather=gbs / g_gbs, peer="", ratio=float("nan"), check=float("nan"), speedup=float("nan"),
                       timer=t.timer,
                       samples=len(t.samples_us),
                       flops=flops, bytes=nb, bw_gbs=self.bw_gbs, peak_tflops=self.peak_tflops, error=t.error,
                       kernels=self._kernels.get(prov, ""),
                       _point=f"{self.family}#{self._point}")  # fmt: skip
            if prov == "openmla" and peer and peer in timings:
                row["peer"] = peer
                if check is not None:
                    row["check"] = check
                if ok and timings[peer].ok:
                    row["ratio"] = timings[peer].p50 / t.p50
            if prov == "openmla" and ok and "before" in timings and timings["before"].ok:
                row["speedup"] = timings["before"].p50 / t.p50
            rows.append(row)
        return [{k: ("" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows]

    def error_row(self, op: str, shape: str, dtype: str, error: str) -> dict:
        """The row of a point that failed before it was timed (setup, first call)."""
        self._point += 1
        row = dict.fromkeys(("p50_us", "p20_us", "p80_us", "gbs", "tflops", "frac_bw", "frac_peak", "frac_gather",
                             "peer", "ratio",
                             "check", "speedup", "timer", "samples", "flops", "bytes", "kernels"), "")  # fmt: skip
        row.update(
            self.env,
            family=self.family,
            op=op,
            provider="openmla",
            shape=shape,
            dtype=dtype,
            bw_gbs=self.bw_gbs,
            peak_tflops=self.peak_tflops,
            error=error,
            _point=f"{self.family}#{self._point}",
        )
        return row
