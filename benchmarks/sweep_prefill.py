"""Sweep the prefill kernel's variants in one process (for tuning ``flash_attn_varlen`` on a GPU).

Each variant is ``MODE[:BLOCK_M,BLOCK_N,WARPS,STAGES]``:

    ptr    pointer loads (cp.async) for every key tile (the kernel before issue 4's sweep)
    tma    full key tiles through TMA descriptors (``OPENMLA_PREFILL_KV_TMA=1``)
    pipe   tma + q @ k^T software-pipelined one tile ahead of the softmax (``OPENMLA_PREFILL_PIPE_QK=1``)

with a fixed tile (``OPENMLA_PREFILL_TILING``); a mode without a tile autotunes over ``_configs()``.
For every shape the same process also times ``scaled_dot_product_attention`` with the cuDNN backend
(V as is and V zero-padded to 192; the faster is the yardstick; FLOPs count only the real work).
Each variant's output is checked against SDPA's (cosine) before it is timed; a variant that fails
to compile or launch is reported, not fatal.

    python benchmarks/sweep_prefill.py
    python benchmarks/sweep_prefill.py --variants "ptr:128,64,8,2;pipe:128,64,8,3" --shapes "128,8192,2"
    python benchmarks/sweep_prefill.py --dry-run     # CPU: tiny shapes through the interpreter

Shapes are ``H,L,B`` (B requests of length L, causal, d_qk 192 / d_v 128, bf16; append ``,fp8`` for
e4m3 q/k/v). TFLOPS = 2 * causal pairs * H * (192 + 128) / time; ``ratio`` = SDPA us / variant us
(> 1: faster than SDPA); the best variant per shape is marked ``*``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
import openmla  # noqa: E402  (sets TRITON_INTERPRET on a machine without CUDA)
import openmla.ops.prefill as prefill_ops  # noqa: E402
from bench_prefill import D_V, SCALE, causal_pairs, cosine, make_problem, make_sdpa, to_fp8  # noqa: E402
from openmla.utils.perf import prefill_flops  # noqa: E402

DEFAULT_SHAPES = "128,8192,2;16,4096,4"
DEFAULT_VARIANTS = (
    "ptr:128,64,8,2",  # the fixed tile before this sweep (autotune's first config)
    "ptr:128,64,8,3",
    "ptr:128,128,8,2",
    "ptr:64,64,4,3",
    "ptr:64,64,4,2",  # 106 KB shared: two CTAs per SM
    "tma:128,64,8,2",
    "tma:128,64,8,3",
    "tma:128,128,8,2",
    "tma:64,64,4,2",  # 108 KB shared: two CTAs per SM
    "pipe:128,64,8,2",
    "pipe:128,64,8,3",
    "pipe:64,64,4,2",
)
MODES = {"ptr": (False, False), "tma": (True, False), "pipe": (True, True)}


def parse_shapes(text: str):
    out = []
    for item in text.split(";"):
        parts = item.strip().split(",")
        h, L, b = (int(x) for x in parts[:3])
        out.append((h, L, b, len(parts) > 3 and parts[3] == "fp8"))
    return out


def apply_variant(variant: str):
    """Set the module knobs of one variant; returns a function restoring them."""
    saved = (prefill_ops.KV_TMA, prefill_ops.PIPE_QK, prefill_ops.AUTOTUNE, prefill_ops._TILING)

    def restore():
        prefill_ops.KV_TMA, prefill_ops.PIPE_QK, prefill_ops.AUTOTUNE, prefill_ops._TILING = saved

    mode, _, tiling = variant.partition(":")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} in variant {variant!r} (one of {', '.join(MODES)})")
    prefill_ops.KV_TMA, prefill_ops.PIPE_QK = MODES[mode]
    if tiling:
        if len(tiling.split(",")) != 4:
            raise ValueError(f"tile of {variant!r} must be BLOCK_M,BLOCK_N,WARPS,STAGES")
        prefill_ops._TILING, prefill_ops.AUTOTUNE = tiling, False
    else:
        prefill_ops._TILING, prefill_ops.AUTOTUNE = None, True
    return restore


def sdpa_cudnn(q, k, v, lens, bench):
    """Best of cuDNN SDPA with V as is and V padded to 192: (us, label, output as [T, H, D_V])."""
    from torch.nn.attention import SDPBackend

    best = (math.inf, "-", None)
    for pad_v in (False, True):
        try:
            run, as_tokens = make_sdpa(q, k, v, lens, SDPBackend.CUDNN_ATTENTION, pad_v)
            out = as_tokens(run())
            us = bench(run)
        except (RuntimeError, ValueError) as exc:
            print(f"# cudnn{'+padV' if pad_v else ''}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
            continue
        print(f"# cudnn{'+padV' if pad_v else ''}: {us:.1f} us")
        if us < best[0]:
            best = (us, "cudnn" + ("+padV" if pad_v else ""), out)
    return best


def run_shape(h, L, b, fp8, variants, device, bench) -> int:
    """Time SDPA and every variant on one shape, print the rows; returns the number of mismatches."""
    lens = [L] * b
    flops = prefill_flops(causal_pairs(lens), h, 192, D_V)
    torch.manual_seed(0)
    q, k, v, cu = make_problem(h, lens, device)
    name = f"h{h} {b}x{L}{' fp8' if fp8 else ''}"
    if device == "cuda":
        sdpa_us, sdpa_name, ref = sdpa_cudnn(q, k, v, lens, bench)
    else:
        from openmla.reference import flash_attn_varlen_ref

        sdpa_us, sdpa_name = math.nan, "ref"
        ref = flash_attn_varlen_ref(q.float(), k.float(), v.float(), cu, cu, SCALE)[0]
    if fp8:
        (q8, sq), (k8, sk), (v8, sv) = to_fp8(q), to_fp8(k), to_fp8(v)
        call = dict(q=q8, k=k8, v=v8, q_descale=sq, k_descale=sk, v_descale=sv)
    else:
        call = dict(q=q, k=k, v=v)
    out = torch.empty(q.shape[0], h, D_V, dtype=torch.bfloat16, device=device)

    def fn():
        openmla.flash_attn_varlen(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=L, max_seqlen_k=L, sm_scale=SCALE,
                                  causal=True, return_lse=True, out=out, **call)  # fmt: skip

    rows = []
    for variant in variants:
        restore = apply_variant(variant)
        try:
            out.zero_()
            fn()
            cos = cosine(out.float(), ref.float()) if ref is not None else math.nan
            rows.append((variant, bench(fn), cos, ""))
        except Exception as exc:  # noqa: BLE001  (a variant that does not compile or fit is reported, not fatal)
            rows.append((variant, math.nan, math.nan, f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"))
        finally:
            restore()
    best = min((r[1] for r in rows if not math.isnan(r[1])), default=None)
    if not math.isnan(sdpa_us):
        print(f"{name:>18} {'sdpa ' + sdpa_name:>18} {sdpa_us:>10.1f} {flops / sdpa_us / 1e6:>7.1f} {1.0:>5.2f}x")
    bad = 0
    for variant, us, cos, err in rows:
        if err:
            print(f"{name:>18} {variant:>18} {'failed':>10}  {err}")
            continue
        ok = cos > (0.99 if fp8 else 0.9999)
        bad += not ok
        mark = (" *" if us == best else "") + ("" if ok else "  MISMATCH")
        print(f"{name:>18} {variant:>18} {us:>10.1f} {flops / us / 1e6:>7.1f} {sdpa_us / us:>5.2f}x {cos:>8.5f}{mark}",
              flush=True)  # fmt: skip
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="H,L,B[,fp8];... (default %(default)s)")
    ap.add_argument("--variants", default=";".join(DEFAULT_VARIANTS), help="';'-separated MODE[:bm,bn,warps,stages]")
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep in ms (default 100)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreter: checks the logic")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    variants = [v.strip() for v in args.variants.split(";") if v.strip()]
    for v in variants:  # fail fast on a typo
        apply_variant(v)()

    if args.dry_run:
        device, shapes = "cpu", [(2, 40, 2, False), (2, 24, 3, True)]

        def bench(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6

        variants = [v.split(":")[0] for v in variants]  # the interpreter runs its own 16 x 16 tiles
        variants = list(dict.fromkeys(variants))
    else:
        if not torch.cuda.is_available():
            print("sweep_prefill needs a CUDA GPU (use --dry-run to check the script on the CPU)")
            return 0
        import triton

        from common import env_line

        print(env_line())
        device, shapes = "cuda", parse_shapes(args.shapes)

        def bench(fn):
            return triton.testing.do_bench(fn, warmup=25, rep=args.rep, return_mode="median") * 1e3

    print("# flash_attn_varlen causal, d_qk 192 / d_v 128; TFLOPS = 2 * causal pairs * H * (192 + 128) / us / 1e6;"
          " ratio = SDPA us / us")  # fmt: skip
    print(f"{'shape':>18} {'variant':>18} {'us':>10} {'TFLOPS':>7} {'ratio':>6} {'cos':>8}")
    t_start, bad = time.time(), 0
    for shape in shapes:
        bad += run_shape(*shape, variants, device, bench)
        if device == "cuda":
            torch.cuda.empty_cache()
    print(f"# {time.time() - t_start:.0f} s")
    if bad:
        print(f"# WARNING: {bad} variant rows disagree with the reference (cos below 0.9999 bf16 / 0.99 fp8)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
