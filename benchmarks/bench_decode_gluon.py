"""Time the Hopper (Gluon) split-KV decode kernel against the portable one (sm90 GPU only).

For each shape: the split kernel alone (CUDA-graph replay median, us) for every Gluon variant
("BLOCK_N,STAGES" of the warp-specialised kernel; a seesaw variant, with "+box32" / "+box64" for 32- / 64-row
TMA boxes (default: 64 where pages allow); or "seesaw-const": the seesaw kernel with compile-time stage indices,
which spills; kept as a diagnostic) and for the portable kernel with the same plan, the reduce alone, and
TFLOPS = 2 * T * H * seq * (576 + 512) / us / 1e6 of the split kernel. KV pages of 64 tokens scattered over a pool
larger than L2; causal; the plan is built once outside the timed region.

    python benchmarks/bench_decode_gluon.py
    python benchmarks/bench_decode_gluon.py --shapes "128,128,8192,1;32,128,8192,1" --variants "64,2;32,3;seesaw"
    python benchmarks/bench_decode_gluon.py --check   # also compare each variant with the portable output
    python benchmarks/bench_decode_gluon.py --fp8 --variants "64,2"   # e4m3 cache (64-key tiles only)

With ``--fp8`` the cache is float8_e4m3fn (per-tensor scale 0.05); the portable kernel runs its fp8 path
(fp16 products) and the Gluon ws kernel its widening path; GB/s counts the fp8 bytes read.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import bench_us, env_line

import openmla
from openmla.ops import decode as dec
from openmla.ops import decode_gluon as dg

PAGE = 64
SCALE = 192**-0.5
LOG2E = 1.4426950408889634
SHAPES = "128,128,8192,1;32,128,8192,1;128,1,32768,1;64,128,8192,1;16,128,8192,4;128,128,8192,2"
# "block_n,stages" of the warp-specialised kernel, or a seesaw variant
VARIANTS = "64,2;32,3;seesaw"
KV_SCALE = 0.05


def make_problem(h, b, s, qlen, pool_gib, fp8=False):
    pages_needed = b * (-(-s // PAGE))
    pool_pages = max(pages_needed, int(pool_gib * 2**30 / (PAGE * 576 * (1 if fp8 else 2))))
    if fp8:
        cache = torch.empty(pool_pages, PAGE, 576, device="cuda", dtype=torch.float8_e4m3fn)
        for i in range(0, pool_pages, 4096):  # in slices: no fp32 copy of the whole pool
            cache[i : i + 4096] = (torch.randn(min(4096, pool_pages - i), PAGE, 576, device="cuda") / KV_SCALE / 4).to(
                torch.float8_e4m3fn)  # fmt: skip
    else:
        cache = torch.randn(pool_pages, PAGE, 576, device="cuda", dtype=torch.bfloat16)
    block_table = torch.randperm(pool_pages, device="cuda")[:pages_needed].view(b, -1).int()
    seq_lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    qsl = torch.arange(b + 1, dtype=torch.int32, device="cuda") * qlen
    q = torch.randn(b * qlen, h, 576, device="cuda", dtype=torch.bfloat16)
    return q, cache, block_table, seq_lens, qsl


def make_span_problem(h, b, s, qlen):
    """``make_problem`` over a 2 GiB pool for the spanning-schedule experiments; ``s == "ragged"``: 512 .. 16384
    keys a request, a fixed draw. Returns ``(q, cache, block_table, seq_lens, qsl, s_max)``."""
    s_max = 16384 if s == "ragged" else s
    q, cache, bt, sl, qsl = make_problem(h, b, s_max, qlen, 2.0)
    if s == "ragged":
        gen = torch.Generator(device="cpu").manual_seed(0)
        sl.copy_(torch.randint(512, 16385, (b,), generator=gen, dtype=torch.int32))
    return q, cache, bt, sl, qsl, s_max


def run_shape(h, b, s, qlen, variants, args):
    """Print one line per kernel for one shape (tensors are freed when this returns)."""
    q, cache, bt, sl, qsl = make_problem(h, b, s, qlen, args.pool_gib, args.fp8)
    kv_dtype = "fp8" if args.fp8 else "auto"
    kv_s = KV_SCALE if args.fp8 else 1.0
    plan = openmla.plan_decode(sl, qsl, h, max_query_len=qlen, max_seq_len=s, kv_cache_dtype=kv_dtype)
    T = q.shape[0]
    out = torch.empty(T, h, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(T, h, dtype=torch.float32, device="cuda")
    flops = 2.0 * T * h * s * (576 + 512)
    kv_bytes = b * s * 576 * cache.element_size()
    n_items = int(plan.work_indptr[-1])
    head = f"{h:<4} {b:<5} {s:<6} {qlen:<4} |"

    def reduce():
        dec._mla_decode_reduce(qsl, plan, out, lse, 512)

    def portable():
        dec._mla_decode_split(q, cache, bt, sl, qsl, plan, out, lse, SCALE * kv_s * LOG2E, kv_s, True, 512,
                              dec.compute_dtype(torch.float16 if args.fp8 else torch.bfloat16))  # fmt: skip

    def line(name, us):
        return (f"{head} {name:<15} | {us:10.1f} | {flops / us / 1e6:7.1f} | {kv_bytes / (us + red_us) / 1e3:7.0f} | "
                f"{us + red_us:10.1f} | {n_items}")  # fmt: skip

    red_us = bench_us(reduce)
    print(line("portable", bench_us(portable)))
    if args.check:
        portable()
        reduce()
        ref = out.float().clone()
    if not dg.gluon_decode_supported(q, cache, plan, kv_dtype):
        print(f"{head} gluon: not supported here")
        return
    for v in variants:
        if v[0].startswith("seesaw"):  # "seesaw...[+box32|+box64]": TMA box rows (default: 64 where pages allow)
            base, _, opt = v[0].partition("+")
            if opt not in ("", "box32", "box64"):
                raise SystemExit(f"unknown variant option {opt!r} in {v[0]!r}")
            kw = {"variant": base, **({"box_rows": int(opt[3:])} if opt else {})}
            name = f"gluon {v[0]}"
        else:
            block_n, stages = (int(x) for x in v)
            kw = {"block_n": block_n, "stages": stages}
            name = f"gluon {block_n},{stages}"

        def gluon(kw=kw):
            dg.mla_decode_split_gluon(q, cache, bt, sl, qsl, plan, out, lse, SCALE * kv_s * LOG2E, kv_s, True, 512,
                                      **kw)  # fmt: skip

        try:
            text = line(name, bench_us(gluon))
        except Exception as exc:  # noqa: BLE001  (a variant that does not compile or launch here)
            print(f"{head} {name:<15} | failed: {type(exc).__name__}: {exc}")
            continue
        if args.check:
            # poison every output first: out/lse and the plan's partials still hold the portable kernel's
            # results, so a Gluon kernel that skipped rows or items would otherwise compare equal
            for t in (out, lse, plan.o_part, plan.lse_part):
                t.fill_(float("nan"))
            gluon()
            reduce()
            n_nan = int(torch.isnan(out).sum())
            diff = float((out.float() - ref).abs().nan_to_num(float("inf")).max())
            text += f" | max|diff| vs portable {diff:.3e}" + (f" | {n_nan} NaN in out" if n_nan else "")
        print(text)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES, help='"h,b,s,qlen;..."')
    ap.add_argument("--variants", default=VARIANTS, help='"block_n,stages;..."')
    ap.add_argument("--pool-gib", type=float, default=2.0)
    ap.add_argument("--check", action="store_true", help="compare every variant's output with the portable kernel")
    ap.add_argument("--fp8", action="store_true", help="float8_e4m3fn cache (only the ws 64,2 Gluon variant applies)")
    args = ap.parse_args(argv)
    print(env_line())
    variants = [tuple(v.strip().split(",")) for v in args.variants.split(";")]
    print("h_q  b     seq    qlen | kernel          |   split_us |  TFLOPS | GB/s+red | +reduce_us | work items")
    for item in args.shapes.split(";"):
        h, b, s, qlen = (int(x) for x in item.split(","))
        run_shape(h, b, s, qlen, variants, args)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
