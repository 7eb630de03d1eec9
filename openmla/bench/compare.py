"""``python -m openmla.bench.compare BEFORE.csv AFTER.csv``: two bench runs side by side, point by point.

For each openmla point in both files: its p50 in each run, ``speedup`` = before / after (> 1: the second run is
faster), and ``peer drift`` = the peer's after / before p50 at the same point: the peer's code did not change, so
its drift is the machine's (clocks, power) and bounds what a speedup of that size means.
"""

from __future__ import annotations

import csv
import sys


def _rows(path: str) -> dict[tuple, dict]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    own = {(r["family"], r["shape"], r["dtype"]): r for r in rows if r["provider"] == "openmla"}
    peers = {(r["family"], r["shape"], r["provider"]): r for r in rows if r["provider"] != "openmla"}
    for key, r in own.items():
        p = peers.get((key[0], key[1], r["peer"])) if r["peer"] else None
        r["_peer_us"] = float(p["p50_us"]) if p and p["p50_us"] else None
    return own


def compare(before: str, after: str) -> list[dict]:
    """``[{family, shape, dtype, before_us, after_us, speedup, peer_drift}]`` for the points both runs timed."""
    a, b = _rows(before), _rows(after)
    out = []
    for key in a:
        if key not in b or not a[key]["p50_us"] or not b[key]["p50_us"]:
            continue
        t0, t1 = float(a[key]["p50_us"]), float(b[key]["p50_us"])
        p0, p1 = a[key]["_peer_us"], b[key]["_peer_us"]
        drift = p1 / p0 if p0 and p1 else None
        out.append(dict(family=key[0], shape=key[1], dtype=key[2], before_us=t0, after_us=t1, speedup=t0 / t1,
                        peer_drift=drift))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m openmla.bench.compare BEFORE.csv AFTER.csv", file=sys.stderr)
        return 2
    rows = compare(*argv)
    print(f"# {argv[0]} -> {argv[1]}: speedup = before / after; peer drift = the peer's after / before")
    print(
        f"{'family':<8} {'shape':<26} {'dtype':>5} {'before_us':>10} {'after_us':>10} {'speedup':>8} {'peer drift':>10}"
    )
    for r in rows:
        drift = f"{r['peer_drift']:.3f}" if r["peer_drift"] else ""
        print(f"{r['family']:<8} {r['shape']:<26} {r['dtype']:>5} {r['before_us']:>10.1f} {r['after_us']:>10.1f} "
              f"{r['speedup']:>7.3f}x {drift:>10}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
