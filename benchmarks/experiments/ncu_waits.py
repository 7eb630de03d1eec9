"""Summarise ncu source-page CSVs of a Gluon decode kernel: which instructions and source lines stall the warps.
(H200 experiment helper; not part of openmla.)

    python3 benchmarks/experiments/ncu_waits.py SASS_CSV [LINES_CSV]

SASS_CSV: ``ncu -i REP --page source --csv --print-source sass``; LINES_CSV: the same with ``--print-source
cuda`` (per source line, through the kernel's line info). Prints the columns found, the 30 hottest SASS
instructions by stall samples, the samples of every mbarrier wait site (``SYNCS ... TRYWAIT``) grouped by its
barrier operand (the shared-memory offset names the barrier), and the 30 hottest source lines.
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


def summarise(path: str, what: str) -> None:
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
        waits: dict[str, float] = defaultdict(float)
        for r in rows:
            text = r[src]
            if "SYNCS" in text and "TRYWAIT" in text:
                m = re.search(r"\[([^\]]+)\]", text)
                waits[m.group(1) if m else text.strip()] += _num(r[col])
        print("# mbarrier wait sites (SYNCS ... TRYWAIT) by barrier operand")
        for key, v in sorted(waits.items(), key=lambda kv: -kv[1]):
            print(f"{100 * v / total:6.2f}%  [{key}]")


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    summarise(sys.argv[1], "sass")
    if len(sys.argv) > 2:
        summarise(sys.argv[2], "lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
