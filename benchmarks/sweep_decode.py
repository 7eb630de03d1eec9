"""Sweep the decode planner's and kernel's knobs in one process (for tuning on a GPU).

Each variant sets the planner's module-level knobs (fixed cost per work item, shortest and longest
split) and optionally a tile override, then times a few shapes with CUDA-graph replay. The bandwidth
yardstick is measured once. One line per (variant, shape); the best variant per shape is marked.

    python benchmarks/sweep_decode.py
    python benchmarks/sweep_decode.py --shapes "16,128,8192,1;128,1,32768,1" \\
        --variants "item_cost=0;item_cost=1024;max_tiles=64;tiling=32,4,2|min_split=512"

A variant is ``key=value[|key=value...]`` with keys item_cost, min_split, max_tiles, tiling (block_n,warps,stages),
tma (0/1: full KV tiles through TMA descriptors), backend (auto/triton/gluon),
pdl (0/1: programmatic dependent launch of the reduce), reduce_programs (reduce programs per SM),
reduce_tile (partial elements a one-head reduce program loads per step, at most 64 splits; default 8192),
gluon_variant (ws/seesaw: the Gluon kernel for bf16 caches).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import openmla  # noqa: E402
import openmla.ops.decode as decode_mod  # noqa: E402
import openmla.ops.plan as plan_mod  # noqa: E402
from bench_decode import PAGE, SCALE, make_problem, parse_shapes  # noqa: E402
from common import bench_us, env_line, read_bandwidth_gbs  # noqa: E402

DEFAULT_SHAPES = "16,128,8192,1;16,128,8192,2;128,128,8192,1;128,1,32768,1;16,8,4096,1"
DEFAULT_VARIANTS = "default;item_cost=0;item_cost=1024;max_tiles=64;tiling=64,4,3;min_split=128"


def _apply(variant: str):
    """Set the knobs of one variant; returns a function that restores them."""
    saved = (plan_mod._ITEM_COST, plan_mod._MIN_SPLIT_ENV, plan_mod._MAX_SPLIT_TILES,
             os.environ.get("OPENMLA_DECODE_TILING"), os.environ.get("OPENMLA_DECODE_TMA"),
             os.environ.get("OPENMLA_DECODE_BACKEND"), decode_mod._PDL, decode_mod._REDUCE_PROGRAMS_PER_SM,
             decode_mod._REDUCE_TILE_ONE_HEAD, decode_mod._REDUCE_MAX_BLOCK_S,
             os.environ.get("OPENMLA_DECODE_GLUON_VARIANT"))

    def restore():
        (plan_mod._ITEM_COST, plan_mod._MIN_SPLIT_ENV, plan_mod._MAX_SPLIT_TILES, tiling, tma, backend, pdl, rp,
         tile, max_s, gvar) = saved  # fmt: skip
        decode_mod._PDL, decode_mod._REDUCE_PROGRAMS_PER_SM = pdl, rp
        decode_mod._REDUCE_TILE_ONE_HEAD, decode_mod._REDUCE_MAX_BLOCK_S = tile, max_s
        for name, value in (("OPENMLA_DECODE_TILING", tiling), ("OPENMLA_DECODE_TMA", tma),
                            ("OPENMLA_DECODE_BACKEND", backend), ("OPENMLA_DECODE_GLUON_VARIANT", gvar)):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    if variant != "default":
        for item in variant.split("|"):
            key, value = item.split("=", 1)
            if key == "item_cost":
                plan_mod._ITEM_COST = int(value)
            elif key == "min_split":
                plan_mod._MIN_SPLIT_ENV = value
            elif key == "max_tiles":
                plan_mod._MAX_SPLIT_TILES = int(value)
            elif key == "tiling":
                os.environ["OPENMLA_DECODE_TILING"] = value
            elif key == "tma":
                os.environ["OPENMLA_DECODE_TMA"] = value
            elif key == "backend":
                os.environ["OPENMLA_DECODE_BACKEND"] = value
            elif key == "pdl":
                decode_mod._PDL = value == "1"
            elif key == "reduce_programs":
                decode_mod._REDUCE_PROGRAMS_PER_SM = int(value)
            elif key == "reduce_tile":
                decode_mod._REDUCE_TILE_ONE_HEAD = int(value)
            elif key == "gluon_variant":
                os.environ["OPENMLA_DECODE_GLUON_VARIANT"] = value
            else:
                raise ValueError(f"unknown knob {key!r} in variant {variant!r}")
    return restore


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="h,b,s,qlen[,fp8];...")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="';'-separated; knobs inside one joined by '|'")
    ap.add_argument("--pool-gib", type=float, default=2.0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_decode needs a CUDA GPU")
        return 0
    print(env_line())
    bw = read_bandwidth_gbs()
    print(f"# read-only torch.sum bandwidth: {bw:.0f} GB/s; page {PAGE}")
    print(f"{'shape':>22} {'variant':>28} {'us':>9} {'%bw':>6} {'TFLOPS':>7} {'items':>6}")
    for h, b, s, qlen, fp8 in parse_shapes(args.shapes):
        q, cache, bt, sl, qsl = make_problem(h, b, s, qlen, fp8, args.pool_gib)  # freed on the next shape
        out = torch.empty(q.shape[0], h, 512, dtype=torch.bfloat16, device="cuda")
        kw = dict(kv_cache_dtype="fp8", kv_scale=1.0) if fp8 else {}
        nbytes = b * s * 576 * (1 if fp8 else 2) + q.numel() * 2 + out.numel() * 2
        rows = []
        for variant in args.variants.split(";"):
            restore = _apply(variant)
            try:
                plan = openmla.plan_decode(sl, qsl, h, max_query_len=qlen, max_seq_len=s,
                                kv_cache_dtype="fp8" if fp8 else "auto")
                us = bench_us(lambda: openmla.mla_decode(q, cache, bt, sl, qsl, SCALE, plan=plan, out=out, **kw))
                rows.append((variant, us, int(plan.work_indptr[-1])))
            except Exception as exc:  # a variant that does not compile or fit is reported, not fatal
                rows.append((variant, float("nan"), f"{type(exc).__name__}"))
            finally:
                restore()
        best = min((r[1] for r in rows if r[1] == r[1]), default=None)
        name = f"h{h} b{b} s{s} q{qlen}{' fp8' if fp8 else ''}"
        for variant, us, items in rows:
            gbs = nbytes / us / 1e3
            tf = 2.0 * b * qlen * h * s * 1088 / us / 1e6
            mark = " *" if us == best else ""
            print(f"{name:>22} {variant:>28} {us:>9.1f} {100 * gbs / bw:>5.1f}% {tf:>7.1f} {items!s:>6}{mark}",
                  flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
