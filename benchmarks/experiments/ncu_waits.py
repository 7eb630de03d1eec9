"""Summarise ncu source-page CSVs of a Gluon decode kernel: which instructions and source lines stall the warps.
(H200 experiment helper; not part of openmla.)

    python3 benchmarks/experiments/ncu_waits.py SASS_CSV [LINES_CSV] [--bars NAME,NAME,...]

SASS_CSV: ``ncu -i REP --page source --csv --print-source sass``; LINES_CSV: the same with ``--print-source
cuda`` (per source line, through the kernel's line info). Prints the columns found, the stall reasons summed
over the kernel, the 30 hottest SASS instructions by stall samples, and the samples of every mbarrier wait
grouped by barrier. A wait is a ``SYNCS ... TRYWAIT`` and the retry branch after it; the samples land on that
branch, so each branch's samples go to the barrier operand of the TRYWAIT just before it. ``--bars`` names the
kernel's mbarriers in allocation order (8 bytes apart from the lowest offset seen).
"""

from __future__ import annotations

import csv
import re
import sys
from collections import defaultdict


def _rows(path: str) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as f:
        text = f.read()
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"') and "Source" in line), None)
    if start is None:
        print(f"{path}: no CSV header found; first lines:\n" + "\n".join(lines[:10]))
        return [], []
    reader = csv.DictReader(lines[start:])
    return list(reader.fieldnames or []), list(reader)


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def _sample_column(fields: list[str]) -> str | None:
    for key in ("Warp Stall Sampling (All Samples)", "Warp Stall Sampling (All Cycles)", "stall_all"):
        for f in fields:
            if f.startswith(key):
                return f
    cands = [f for f in fields if "Sampl" in f]
    return cands[0] if cands else None


def summarise(path: str, what: str, bars: list[str] | None = None) -> None:
    fields, rows = _rows(path)
    if not rows:
        return
    col = _sample_column(fields)
    print(f"# {what}: {len(rows)} rows; columns: {fields}")
    if col is None:
        print("no stall-sample column")
        return
    total = sum(_num(r[col]) for r in rows) or 1.0
    src = "Source" if "Source" in fields else fields[0]
    print(f"# {what}: the 30 hottest by '{col}' (total {total:.0f})")
    for r in sorted(rows, key=lambda r: -_num(r[col]))[:30]:
        addr = r.get("Address", r.get("Line", ""))
        print(f"{100 * _num(r[col]) / total:6.2f}%  {addr:>8}  {r[src].strip()[:110]}")
    if what == "sass":
        reasons = [f for f in fields if f.startswith("stall_") and "Not Issued" not in f]
        print("# stall reasons over the kernel (share of all samples)")
        sums = {f: sum(_num(r[f]) for r in rows) for f in reasons}
        for f, v in sorted(sums.items(), key=lambda kv: -kv[1])[:12]:
            print(f"{100 * v / total:6.2f}%  {f}")
        waits: dict[str, float] = defaultdict(float)
        last_wait = None
        for r in rows:
            text = r[src]
            if "SYNCS" in text and "TRYWAIT" in text:
                m = re.search(r"\[([^\]]+)\]", text)
                last_wait = m.group(1) if m else text.strip()
                waits[last_wait] += _num(r[col])
            elif "BRA" in text and last_wait is not None:
                waits[last_wait] += _num(r[col])  # the retry branch of that wait
                last_wait = None
        offsets = {k: int(m.group(1), 16) for k in waits if (m := re.search(r"0x([0-9a-f]+)$", k))}
        base = min(offsets.values(), default=0)
        print("# mbarrier waits (TRYWAIT + its retry branch) by barrier")
        for key, v in sorted(waits.items(), key=lambda kv: -kv[1]):
            slot = (offsets[key] - base) // 8 if key in offsets else -1
            name = bars[slot] if bars and 0 <= slot < len(bars) else ""
            print(f"{100 * v / total:6.2f}%  [{key}] {name}")
        mma = sum(_num(r[col]) for r in rows if "HGMMA" in r[src] or "WARPGROUP.DEPBAR" in r[src])
        print(f"{100 * mma / total:6.2f}%  HGMMA issue + WARPGROUP.DEPBAR (waits for this warp's own MMAs)")


def main() -> int:
    args = sys.argv[1:]
    bars = None
    if "--bars" in args:
        i = args.index("--bars")
        bars = args[i + 1].split(",")
        del args[i : i + 2]
    if not args:
        print(__doc__)
        return 2
    summarise(args[0], "sass", bars)
    if len(args) > 1:
        summarise(args[1], "lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
