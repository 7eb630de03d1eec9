"""Options and driver of ``openmla bench`` (also ``python -m openmla.bench``).

``openmla bench [--family decode,prefill] [--shapes PRESET|SPECS] [--quick] [--rep MS] [--rounds N] [--out DIR]
[--label L] [--no-peers] [--no-plot] [--list]``

``--shapes`` takes a preset name (``default``, ``quick``, ``full``, ``tiny``; ``tiny`` is the default on the CPU)
or shape specs separated by ``;``; a spec may name its family (``"decode:h128 b32 s4096 q1;prefill:h128 n4096"``),
else it belongs to the one selected family whose ``parse`` takes it. Writes ``DIR/bench[-LABEL].csv`` and ``.json``
and, with matplotlib, ``DIR/bench[-LABEL]-<family>.png``. Exit codes: 0 done, 1 an openmla point failed, 2 bad
arguments.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import time
import traceback

from openmla.bench import FAMILIES, load_family

__all__ = ["add_arguments", "main", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``openmla bench`` on parser ``p``."""
    p.add_argument("--family", default=None, help=f"comma-separated families (default: all of {', '.join(FAMILIES)})")
    p.add_argument("--shapes", default=None, metavar="PRESET|SPECS",
                   help="preset (default, quick, full, tiny) or ';'-separated specs, e.g. 'h128 b128 s8192 q2 fp8' "
                        "(default: 'default' on a GPU, 'tiny' on the CPU)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="the 'quick' preset, 2 rounds and shorter yardstick sweeps")
    p.add_argument("--rep", type=int, default=50, metavar="MS", help="ms of each timed batch (default 50)")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds per point (default 3; 2 with --quick)")
    p.add_argument("--out", default="bench-out", metavar="DIR", help="output folder (default ./bench-out)")
    p.add_argument("--label", default="", help="stored in every row and the file names (e.g. 'before', 'after')")
    p.add_argument("--no-peers", action="store_true", help="time openmla alone (no FlashMLA, no cuDNN)")
    p.add_argument("--against", default=None, metavar="DIR",
                   help="also time the older openmla package DIR/openmla_old (benchmarks/prepare_old.sh) as provider "
                        "'before', alternating in the same rounds (decode, prefill)")  # fmt: skip
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plots")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after each point, each provider's kernel times over N calls (torch profiler; GPU only): "
                        "printed and in the column 'kernels'")  # fmt: skip
    p.add_argument("--list", action="store_true", help="print the families, their presets and exit")


def _plan(args, device) -> dict[str, list]:
    """``{family: [shape, ...]}`` from ``--family`` / ``--shapes`` (ValueError on bad input). Without ``--family``
    every registered family runs that imports (an older checkout may lack a family's API) and has the preset."""
    explicit = args.family is not None
    fams = [f.strip() for f in args.family.split(",") if f.strip()] if explicit else list(FAMILIES)
    mods = {}
    for f in fams:
        try:
            mods[f] = load_family(f)
        except ImportError as exc:
            if explicit:
                raise ValueError(f"family {f} does not import: {exc}") from None
            print(f"# family {f} skipped: it does not import here ({type(exc).__name__}: {exc})")
    fams = list(mods)
    preset = args.shapes or ("tiny" if device.type != "cuda" else "quick" if args.quick else "default")
    if any(preset in m.PRESETS for m in mods.values()) or re.fullmatch(r"[A-Za-z_-]+", preset):
        missing = [f for f, m in mods.items() if preset not in m.PRESETS]
        if len(missing) == len(mods) or (explicit and missing):
            raise ValueError(f"unknown preset {preset!r} for {', '.join(missing)}")
        for f in missing:
            print(f"# family {f} skipped: it has no preset {preset!r}")
        return {f: [m.parse(s) for s in m.PRESETS[preset]] for f, m in mods.items() if f not in missing}
    out: dict[str, list] = {}
    for spec in (s.strip() for s in preset.split(";")):
        if not spec:
            continue
        head, colon, rest = spec.partition(":")  # 'family:spec'; a colon later in a spec is its own ("g:lazy")
        fam, body = (head.strip(), rest) if colon and head.strip() in FAMILIES else ("", spec)
        if fam:
            mods.setdefault(fam, load_family(fam))
            out.setdefault(fam, []).append(mods[fam].parse(body))
            continue
        fits = {}  # an unprefixed spec belongs to the one selected family that parses it
        for f in fams:
            try:
                fits[f] = mods[f].parse(body)
            except ValueError as err:
                last = err
        if len(fits) != 1:
            if not fits:
                raise last
            raise ValueError(f"shape {spec!r} fits {', '.join(fits)}: prefix it with its family ('decode:...')")
        ((f, shape),) = fits.items()
        out.setdefault(f, []).append(shape)
    return out


def _baseline(path: str | None):
    """The package ``openmla_old`` from folder ``path`` (``--against``), or None (ValueError if it does not import)."""
    if not path:
        return None
    import importlib

    sys.path.insert(0, os.path.abspath(path))
    try:
        return importlib.import_module("openmla_old")
    except ImportError as exc:
        raise ValueError(
            f"--against {path}: no importable openmla_old there ({exc}); see benchmarks/prepare_old.sh"
        ) from None


def _against_rev(path: str | None) -> str | None:
    """The revision ``benchmarks/prepare_old.sh`` recorded in ``path/REV``, else the path itself."""
    if not path:
        return None
    try:
        with open(os.path.join(path, "REV")) as f:
            return f.read().strip()
    except OSError:
        return path


def run(args) -> int:
    """Run ``openmla bench`` for parsed ``args``; returns the exit code."""
    import torch

    from openmla.bench import report
    from openmla.bench.context import BenchContext
    from openmla.bench.timing import Timer, environment, gather_bandwidth, gather_rows, matmul_peak, read_bandwidth

    if args.list:
        for name in FAMILIES:
            try:
                mod = load_family(name)
            except ImportError as exc:
                print(f"{name}: does not import here ({exc})")
                continue
            print(f"{name} ({mod.OP}): " + "; ".join(f"{k} ({len(v)})" for k, v in mod.PRESETS.items()))
            for k, v in mod.PRESETS.items():
                if k != "full":
                    print(f"  {k}: " + "; ".join(v))
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    plan = _plan(args, device)
    if args.rep < 1 or (args.rounds is not None and args.rounds < 1):
        raise ValueError("--rep and --rounds must be >= 1")
    if args.profile < 0:
        raise ValueError(f"--profile must be >= 0 (calls profiled a point); got {args.profile}")
    rounds = args.rounds or (2 if args.quick else 3)
    baseline = _baseline(args.against)
    env = environment(args.label)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(f"# openmla bench | {env['gpu']} | torch {env['torch']} | triton {env['triton']} | git {env['git']}"
          f"{' | label ' + args.label if args.label else ''} | {rounds} rounds x {args.rep} ms")  # fmt: skip
    if baseline is not None:
        print(f"# against {baseline.__file__} (provider 'before'; speedup = before p50 / openmla p50)")
    if device.type != "cuda":
        print("# no CUDA device: the Triton interpreter on the CPU (timings check the plumbing, not the hardware)")
    bw, bw_sweep = read_bandwidth(device, args.quick)
    peak, peak_sweep = matmul_peak(device, args.quick)
    print(
        f"# read bandwidth (torch.sum, bf16): {bw:.0f} GB/s, the best of "
        + ", ".join(f"{g:g} GiB {v:.0f}" for g, v in bw_sweep)
        + f"; bf16 matmul peak: {peak:.1f} TFLOPS, the best of "
        + ", ".join(f"n{n} {t:.1f}" for n, t in peak_sweep)
    )
    # the random-row gather rate for the row sizes the planned families read (GATHER_ROW_BYTES: sparse decode)
    gather, gather_sweeps = {}, {}
    for rb in sorted({b for f in plan for b in getattr(load_family(f), "GATHER_ROW_BYTES", ())}):
        gather[rb], gather_sweeps[rb] = gather_bandwidth(device, rb, args.quick)
        print(f"# gather of {rb}-byte rows at random slots: {gather[rb]:.4g} GB/s, the best of "
              + ", ".join(f"{r} rows x {w} warps {v:.4g}" for (r, w), v in gather_sweeps[rb]))  # fmt: skip
    rows: list[dict] = []
    for rb, g in gather.items():
        row = dict.fromkeys(report.COLUMNS, "")
        us = gather_rows(device) * rb / g / 1e3
        row.update(env, family="roofline", op=f"gather{rb}", provider="triton", shape=f"{rb}B", dtype="uint8",
                   p50_us=us, gbs=g, bw_gbs=bw, frac_bw=g / bw, peak_tflops=peak, _point="")  # fmt: skip
        rows.append(row)
    for key, sweep, unit in (("read", bw_sweep, "gbs"), ("matmul", peak_sweep, "tflops")):
        for size, val in sweep:
            us = size * 2**30 / val / 1e3 if unit == "gbs" else 2.0 * size**3 / val / 1e6
            row = dict.fromkeys(report.COLUMNS, "")
            row.update(env, family="roofline", op=key, provider="torch", shape=f"{size:g}GiB" if unit == "gbs" else
                       f"n{size}", dtype="bf16", p50_us=us, bw_gbs=bw, peak_tflops=peak, _point="")  # fmt: skip
            row[unit] = val
            rows.append(row)

    out_dir = report.ensure_dir(args.out)
    stem = os.path.join(out_dir, report.file_stem(args.label))
    meta = dict(env, device=str(device), started=started, finished=None, bw_gbs=bw, bw_sweep=bw_sweep,
                peak_tflops=peak, peak_sweep=peak_sweep, gather_gbs=gather, gather_sweeps=gather_sweeps, rounds=rounds,
                rep_ms=args.rep, peers=not args.no_peers, profile_calls=args.profile,
                against=_against_rev(args.against), argv=sys.argv[1:])  # fmt: skip

    def save() -> None:  # after every point: a run cut short (a time limit) keeps what it measured
        report.write_csv(stem + ".csv", rows)
        report.write_json(stem + ".json", meta, rows)

    progress = report.Progress(sum(len(v) for v in plan.values()))
    ctx = BenchContext(device, Timer(device, args.rep, rounds), peers=not args.no_peers, quick=args.quick, bw_gbs=bw,
                       peak_tflops=peak, env=env, note=progress.line, baseline=baseline, gather_gbs=gather,
                       profile_calls=args.profile)  # fmt: skip
    failed = 0
    try:
        for fam, shapes in plan.items():
            mod = load_family(fam)
            ctx.family = fam
            progress.line(f"## {fam}: {mod.OP}, {len(shapes)} points")
            width = max([26] + [len(str(s)) for s in shapes])
            progress.line(report.header(width))
            for shape in shapes:
                dtype = getattr(shape, "dtype", "")
                progress.start(f"{fam} {shape} {dtype}")
                try:
                    got = mod.run(shape, ctx)
                except Exception as exc:  # one failed point must not end the sweep
                    traceback.print_exc(file=sys.stderr)
                    got = [ctx.error_row(mod.OP, str(shape), dtype, f"{type(exc).__name__}: {exc}".splitlines()[0])]
                failed += sum(1 for r in got if r["provider"] == "openmla" and r["error"])
                rows += got
                save()
                for line in report.table_lines(got, width):
                    progress.line(line)
                progress.advance()
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        progress.close()

    meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    save()
    written = [stem + ".csv", stem + ".json"]
    if not args.no_plot:
        title = f"openmla bench | {env['gpu']} | git {env['git']}" + (f" | {args.label}" if args.label else "")
        for fam in plan:
            path = f"{stem}-{fam}.png"
            if not report.plot(path, fam, rows, bw, peak, f"{fam}: {title}"):
                print("# plots skipped: matplotlib is not installed (pip install 'openmla[bench]')")
                break
            written.append(path)
    bad = [r for r in rows if r["provider"] in ("openmla", "before") and r["check"] != "" and r["check"] < 0.99]
    for r in bad:  # openmla's check is against the peer, the older openmla's against this one
        other = r["peer"] if r["provider"] == "openmla" else "the older openmla (--against)"
        print(f"# WARNING: {r['family']} {r['shape']} {r['dtype']}: output differs from {other} (cos {r['check']})")
    print(f"# {len(rows)} rows, {failed} failed points; wrote " + ", ".join(written))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` as ``openmla bench``'s options and run; returns the exit code."""
    p = argparse.ArgumentParser(prog="openmla bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except ValueError as err:
        print(f"openmla bench: error: {err}", file=sys.stderr)
        return 2
