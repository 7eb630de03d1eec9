"""Output of ``openmla bench``: the progress bar, the printed table, CSV, JSON and the PNG plots."""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import time

# One CSV row per (point, provider); the same keys in the JSON rows.
COLUMNS = [
    "label", "family", "op", "provider", "shape", "dtype", "p50_us", "p20_us", "p80_us", "gbs", "tflops", "frac_bw",
    "frac_peak", "frac_gather", "peer", "ratio", "check", "speedup", "timer", "samples", "flops", "bytes", "bw_gbs",
    "peak_tflops", "gpu", "torch", "triton", "git", "error", "kernels",
]  # fmt: skip


class Progress:
    """A progress bar over ``total`` points (rich when installed, else one plain line per point on stderr);
    ``line`` prints a table line to stdout without breaking the bar."""

    def __init__(self, total: int, use_rich: bool = True) -> None:
        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        self._rich = None
        if use_rich:
            try:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            except ImportError:
                pass
            else:
                cols = (BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.description}"))
                self._rich = Progress(*cols)
                self._rich.start()
                self._task = self._rich.add_task("", total=total)

    def start(self, desc: str) -> None:
        """A point begins."""
        if self._rich is not None:
            self._rich.update(self._task, description=desc)
        else:
            print(f"[{self.done + 1}/{self.total} {time.perf_counter() - self.t0:.0f}s] {desc}", file=sys.stderr,
                  flush=True)  # fmt: skip

    def advance(self) -> None:
        self.done += 1
        if self._rich is not None:
            self._rich.advance(self._task)

    def line(self, text: str) -> None:
        if self._rich is not None:
            self._rich.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None


def _f(x, fmt: str, width: int) -> str:
    """``x`` formatted, or a blank column when missing."""
    if x is None or x == "" or (isinstance(x, float) and math.isnan(x)):
        return " " * width
    if 0 < abs(x) < 1 and fmt in (".0f", ".1f"):  # CPU-sized figures keep 3 significant digits
        fmt = ".3g"
    return f"{x:{fmt}}".rjust(width)


def header(width: int = 26) -> str:
    """The table's header line; ``width``: the shape column's."""
    return HEADER.replace(f"{'shape':<26}", f"{'shape':<{width}}", 1)


HEADER = (f"{'shape':<26} {'dtype':>5} {'us':>9} {'GB/s':>6} {'TFLOPS':>6} {'%bw':>5} {'%peak':>5} | "
          f"{'peer':<16} {'peer_us':>9} {'peer_TF':>7} {'ratio':>6} {'check':>8}")  # fmt: skip


def table_lines(rows: list[dict], width: int = 26) -> list[str]:
    """One line per openmla row of one point, its peer's figures beside it (``ratio`` = peer us / openmla us);
    ``width``: the shape column's."""
    lines = []
    for r in rows:
        if r["provider"] != "openmla":
            continue
        peer = next((p for p in rows if r["peer"] and p["provider"] == r["peer"]), None)
        line = (f"{r['shape']:<{width}} {r['dtype']:>5} {_f(r['p50_us'], '.1f', 9)} {_f(r['gbs'], '.0f', 6)} "
                f"{_f(r['tflops'], '.1f', 6)} {_f(r['frac_bw'] * 100 if r['frac_bw'] != '' else '', '.1f', 5)} "
                f"{_f(r['frac_peak'] * 100 if r['frac_peak'] != '' else '', '.1f', 5)} | ")  # fmt: skip
        if peer is not None:
            name = peer["provider"] + (f"({peer['dtype']})" if peer["dtype"] != r["dtype"] else "")
            line += (f"{name:<16} {_f(peer['p50_us'], '.1f', 9)} {_f(peer['tflops'], '.1f', 7)} "
                     f"{_f(r['ratio'], '.3f', 5)}x {_f(r['check'], '.5f', 8)}")  # fmt: skip
            if peer["error"]:
                line += f"  peer error: {peer['error']}"
        before = next((p for p in rows if p["provider"] == "before" and p["_point"] == r["_point"]), None)
        if before is not None:  # --against: the older openmla, timed in the same rounds
            line += f"  | before {_f(before['p50_us'], '.1f', 9).strip()} us, {_f(r['speedup'], '.3f', 5).strip()}x"
        if r.get("frac_gather", "") != "":  # a sparse decode point: its share of the run's random-row gather rate
            line += f"  | gather {r['frac_gather'] * 100:.1f}%"
        if r["error"]:
            line += f"  ERROR: {r['error']}"
        lines.append(line.rstrip())
    return lines


def file_stem(label: str) -> str:
    """``bench`` or ``bench-<label>`` (characters outside [A-Za-z0-9._-] become ``_``)."""
    if not label:
        return "bench"
    return "bench-" + "".join(c if c.isalnum() or c in "._-" else "_" for c in label)


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def write_json(path: str, meta: dict, rows: list[dict]) -> None:
    def clean(x):  # JSON has no nan
        return None if isinstance(x, float) and not math.isfinite(x) else x

    with open(path, "w") as f:
        rows = [{k: clean(v) for k, v in r.items() if not k.startswith("_")} for r in rows]
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


def plot(path: str, family: str, rows: list[dict], bw_gbs: float, peak_tflops: float, title: str) -> bool:
    """Grouped bars of GB/s and TFLOPS per point and provider against the measured bandwidth and matmul peak
    (dashed lines). False (and nothing written) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in rows if r["family"] == family]
    points = list(dict.fromkeys(r["_point"] for r in rows if r["provider"] == "openmla"))
    names = {r["_point"]: f"{r['shape']} {r['dtype']}" for r in rows if r["provider"] == "openmla"}
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    if not points:
        return False
    width = 0.8 / len(providers)
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 0.55 * len(points) + 3), 8), sharex=True)
    for ax, key, ref, unit in ((axes[0], "gbs", bw_gbs, "GB/s"), (axes[1], "tflops", peak_tflops, "TFLOPS")):
        for i, prov in enumerate(providers):
            vals = []
            for pt in points:
                hit = [r[key] for r in rows if r["_point"] == pt and r["provider"] == prov and r[key] != ""]
                vals.append(hit[0] if hit else 0.0)
            ax.bar([j + (i - (len(providers) - 1) / 2) * width for j in range(len(points))], vals, width, label=prov)
        what = "read bandwidth (torch.sum)" if key == "gbs" else "bf16 matmul peak"
        ax.axhline(ref, color="k", ls="--", lw=1, label=f"measured {what}: {ref:.4g} {unit}")
        ax.set_ylabel(unit)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes[1].set_xticks(range(len(points)))
    axes[1].set_xticklabels([names[p] for p in points], rotation=60, ha="right", fontsize=8)
    axes[0].set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def ensure_dir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path
