"""Benchmark MLA prefill attention (``openmla.flash_attn_varlen``, d_qk 192 / d_v 128, causal) on a CUDA GPU.

For each shape: openmla's median time (``triton.testing.do_bench``) and TFLOPS, counted as
``2 * sum_b(causal pairs) * H * (192 + 128)`` with ``L (L + 1) / 2`` pairs for a request of length L
(``openmla.utils.perf.prefill_flops``), next to ``torch.nn.functional.scaled_dot_product_attention``
on the same problem in bf16 (every SDPA backend that accepts it, the best one reported; V is padded to
192 for the backends that need equal head dims, the FLOP count stays the real one; ragged batches run
one request per SDPA call). fp8 rows time openmla with float8_e4m3fn q/k/v against the bf16 SDPA.
``ratio`` = SDPA time / openmla time (> 1: openmla is faster). Each openmla result is checked against
SDPA's (cosine similarity) before it is timed.

    python benchmarks/bench_prefill.py             # H {16, 128} x L {1k, 4k, 16k} x {equal, ragged} x {bf16, fp8}
    python benchmarks/bench_prefill.py --quick     # a handful of shapes
    python benchmarks/bench_prefill.py --dry-run   # CPU: tiny shapes through the Triton interpreter (logic check)

Batches hold about ``--tokens`` tokens (16k by default): "equal" is ``max(1, tokens // L)`` requests of
length L; "ragged" cycles through lengths ``L, L/4, L/2, 3L/4`` up to the same total (at least one of each).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
import openmla  # noqa: E402  (sets TRITON_INTERPRET on a machine without CUDA)
from openmla.utils.perf import prefill_flops  # noqa: E402
from openmla.ops.prefill import _use_gluon  # noqa: E402

D_QK, D_V = 192, 128
SCALE = D_QK**-0.5
FP8 = torch.float8_e4m3fn


def batch_lengths(L: int, kind: str, tokens: int) -> list[int]:
    """Request lengths of an "equal" or "ragged" batch of about ``tokens`` tokens."""
    if kind == "equal":
        return [L] * max(1, tokens // L)
    pattern = [L, max(1, L // 4), max(1, L // 2), max(1, 3 * L // 4)]
    lens = []
    for n in itertools.cycle(pattern):
        if sum(lens) >= tokens and len(lens) >= len(pattern):
            break
        lens.append(n)
    return lens


def causal_pairs(lens: list[int]) -> int:
    return sum(n * (n + 1) // 2 for n in lens)


def make_problem(h: int, lens: list[int], device: str):
    T = sum(lens)
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=device)
    q = torch.randn(T, h, D_QK, device=device, dtype=torch.bfloat16)
    k = torch.randn(T, h, D_QK, device=device, dtype=torch.bfloat16)
    v = torch.randn(T, h, D_V, device=device, dtype=torch.bfloat16)
    return q, k, v, cu


def to_fp8(x: torch.Tensor):
    """Per-tensor quantisation: stored = x / scale, scale = amax / 448."""
    scale = (x.abs().amax().float() / 448.0).clamp_min(1e-12).reshape(1)
    return (x.float() / scale).to(FP8), scale


def sdpa_backends():
    from torch.nn.attention import SDPBackend

    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }


def make_sdpa(q, k, v, lens, backend, pad_v: bool):
    """A closure running SDPA over the batch (one call for equal lengths, one per request otherwise)
    and returning the output as ``[T, H, D_V]``."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    h = q.shape[1]
    if pad_v:
        v = torch.nn.functional.pad(v, (0, D_QK - D_V))
    if len(set(lens)) == 1:
        B, L = len(lens), lens[0]
        qs, ks, vs = (x.view(B, L, h, -1).transpose(1, 2).contiguous() for x in (q, k, v))  # [B, H, L, D]
        groups = [(qs, ks, vs)]
    else:
        groups, start = [], 0
        for n in lens:
            groups.append(tuple(x[start : start + n].transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v)))
            start += n

    def run():
        outs = []
        with sdpa_kernel(backend):
            for qq, kk, vv in groups:
                outs.append(sdpa(qq, kk, vv, is_causal=True, scale=SCALE))
        return outs

    def as_tokens(outs):
        rows = [o.transpose(1, 2).reshape(-1, h, o.shape[-1]) for o in outs]
        return torch.cat(rows)[..., :D_V]

    return run, as_tokens


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-30))


def timer(device: str):
    if device == "cuda":
        import triton

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    return lambda fn: min(_cpu_time(fn) for _ in range(2))


def _cpu_time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def run_shape(h, L, kind, dtype, args, device, sdpa_cache):
    lens = batch_lengths(L, kind, args.tokens)
    flops = prefill_flops(causal_pairs(lens), h, D_QK, D_V)
    bench = timer(device)
    key = (h, L, kind)

    # the problem and SDPA in bf16 with its best backend, shared by the bf16 and fp8 rows of a shape
    if key not in sdpa_cache:
        torch.manual_seed(0)
        q, k, v, cu = make_problem(h, lens, device)
        best, ref = (math.inf, "-"), None
        for name, backend in sdpa_backends().items():
            for pad_v in (False, True):
                try:
                    run, as_tokens = make_sdpa(q, k, v, lens, backend, pad_v)
                    out = as_tokens(run())
                    us = bench(run)
                except (RuntimeError, ValueError):
                    continue
                ref = out if ref is None else ref
                label = name + ("+padV" if pad_v else "")
                if us < best[0]:
                    best = (us, label)
                break  # the backend runs without padding: no need to try it padded
        sdpa_cache[key] = (best, ref, (q, k, v, cu))
    (sdpa_us, sdpa_name), ref, (q, k, v, cu) = sdpa_cache[key]

    if dtype == FP8:
        (q8, sq), (k8, sk), (v8, sv) = to_fp8(q), to_fp8(k), to_fp8(v)
        call = dict(q=q8, k=k8, v=v8, q_descale=sq, k_descale=sk, v_descale=sv)
    else:
        call = dict(q=q, k=k, v=v)
    out = torch.empty(q.shape[0], h, D_V, dtype=torch.bfloat16, device=device)

    def fn():
        openmla.flash_attn_varlen(
            call["q"], call["k"], call["v"], cu, cu, max(lens), max(lens), SCALE, causal=True, return_lse=True,
            q_descale=call.get("q_descale"), k_descale=call.get("k_descale"), v_descale=call.get("v_descale"), out=out,
        )  # fmt: skip

    fn()
    cos = cosine(out.float(), ref.float()) if ref is not None else float("nan")
    us = bench(fn)
    descales = (call["q_descale"],) if "q_descale" in call else None
    impl = "gluon" if _use_gluon(None, call["q"], call["k"], call["v"], descales, out) else "triton"
    return dict(impl=impl,
        h=h, L=L, batch=kind, B=len(lens), tokens=sum(lens), dtype="fp8" if dtype == FP8 else "bf16",
        us=us, tflops=flops / us / 1e6, sdpa=sdpa_name, sdpa_us=sdpa_us, sdpa_tflops=flops / sdpa_us / 1e6,
        ratio=sdpa_us / us, cos=cos,
    )  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a handful of shapes (H 16/128, L 4k, equal/ragged)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreter: checks the logic")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per batch (default 16384)")
    ap.add_argument("--heads", default=None, help="comma-separated head counts (default 16,128)")
    ap.add_argument("--lens", default=None, help="comma-separated request lengths (default 1024,4096,16384)")
    ap.add_argument("--csv", default=None, help="also write the rows to this CSV file")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)  # SDPA explains every backend it refuses

    if args.dry_run:
        device = "cpu"
        heads, lens, kinds, dtypes = [2], [24, 40], ["equal", "ragged"], [torch.bfloat16, FP8]
        if args.tokens == ap.get_default("tokens"):
            args.tokens = 64
    else:
        if not torch.cuda.is_available():
            print("bench_prefill needs a CUDA GPU (use --dry-run to check the script on the CPU)")
            return 0
        device = "cuda"
        heads, lens, kinds, dtypes = [16, 128], [1024, 4096, 16384], ["equal", "ragged"], [torch.bfloat16, FP8]
        if args.quick:
            lens = [4096]
    if args.heads:
        heads = [int(x) for x in args.heads.split(",")]
    if args.lens:
        lens = [int(x) for x in args.lens.split(",")]

    from common import env_line

    print(env_line() + (" | DRY RUN (interpreter, CPU timings)" if args.dry_run else ""))
    print(f"# flash_attn_varlen causal, d_qk {D_QK} / d_v {D_V}; ~{args.tokens} tokens per batch; "
          "TFLOPS = 2 * causal pairs * H * (192 + 128); SDPA always bf16")  # fmt: skip
    hdr = (f"{'H':>4} {'L':>6} {'batch':>6} {'B':>3} {'tokens':>6} {'dtype':>5} {'us':>10} {'TFLOPS':>7} "
           f"{'sdpa':>14} {'sdpa_us':>10} {'sdpa_TF':>7} {'ratio':>6} {'cos':>8} {'impl':>6}")  # fmt: skip
    print(hdr)
    rows, sdpa_cache = [], {}
    t0 = time.time()
    for h, L, kind in itertools.product(heads, lens, kinds):
        for dtype in dtypes:
            r = run_shape(h, L, kind, dtype, args, device, sdpa_cache)
            rows.append(r)
            print(f"{r['h']:>4} {r['L']:>6} {r['batch']:>6} {r['B']:>3} {r['tokens']:>6} {r['dtype']:>5} "
                  f"{r['us']:>10.1f} {r['tflops']:>7.1f} {r['sdpa']:>14} {r['sdpa_us']:>10.1f} "
                  f"{r['sdpa_tflops']:>7.1f} {r['ratio']:>5.2f}x {r['cos']:>8.5f} {r['impl']:>6}", flush=True)  # fmt: skip
        sdpa_cache.clear()
        if device == "cuda":
            torch.cuda.empty_cache()
    print(f"# {len(rows)} rows in {time.time() - t0:.0f} s")
    bad = [r for r in rows if not (r["cos"] > (0.99 if r["dtype"] == "fp8" else 0.9999))]
    if bad:
        print(f"# WARNING: {len(bad)} rows disagree with SDPA (cos below 0.9999 bf16 / 0.99 fp8)")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
