"""Benchmark the Hopper Gluon prefill kernel (``openmla.ops.prefill_gluon``) against the Triton
``flash_attn_varlen`` and cuDNN SDPA: causal bf16, d_qk 192 / d_v 128, on an sm90 GPU.

Shapes (default): H128 with 2 x 8192 tokens and H16 with 4 x 4096 tokens (``--shapes "H:L:B,..."``).
TFLOPS = 2 * causal pairs * H * (192 + 128) / us / 1e6 (``openmla.utils.perf.prefill_flops``). Every
result is checked before it is timed: cosine similarity against SDPA's output and the largest absolute
difference from the Triton kernel. Gluon variants: the default (128-key tiles, 2 stages, ping-pong
turns, one head's row blocks after the other), 4 heads' row blocks interleaved, every head's heaviest
block first, without the turns, and 64-key tiles (3 stages). Under 3 minutes on an H200.

    python benchmarks/bench_prefill_gluon.py
    python benchmarks/bench_prefill_gluon.py --shapes 128:8192:2 --no-graph
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import openmla  # noqa: E402
from bench_prefill import SCALE, causal_pairs, cosine, make_problem, make_sdpa  # noqa: E402
from common import bench_us, env_line  # noqa: E402
from openmla.ops import prefill_gluon as pg  # noqa: E402
from openmla.utils.perf import prefill_flops  # noqa: E402

#: seconds the first (compiling) call of a Gluon variant may take before the process is ended as hung
HANG_S = float(os.environ.get("OPENMLA_BENCH_HANG_S", "60"))
GLUON_VARIANTS = {
    "gluon": {},
    "gluon-hb4": {"head_block": 4},
    "gluon-hbH": {"head_block": 1 << 16},  # every head's heaviest row block first (the first version's order)
    "gluon-nopp": {"pingpong": False},
    "gluon-n64s3": {"block_n": 64, "stages": 3},
}


def run_shape(h: int, L: int, b: int, graph: bool) -> None:
    lens = [L] * b
    q, k, v, cu = make_problem(h, lens, "cuda")
    flops = prefill_flops(causal_pairs(lens), h, 192, 128)
    name = f"H{h} {b}x{L}"
    ref = None
    from torch.nn.attention import SDPBackend

    try:
        run, as_tokens = make_sdpa(q, k, v, lens, SDPBackend.CUDNN_ATTENTION, False)
        ref = as_tokens(run())
        us = bench_us(run, graph)
        print(f"{name:>14} {'sdpa-cudnn':>14} {us:>9.1f} {flops / us / 1e6:>7.1f} {'':>9} {1.0:>8.5f}", flush=True)
        sdpa_us = us
    except Exception as exc:  # noqa: BLE001 - report and go on without SDPA
        print(f"# sdpa cudnn failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        sdpa_us = float("nan")

    def triton_fn():
        return openmla.flash_attn_varlen(q, k, v, cu, cu, L, L, SCALE, causal=True, backend="triton")

    t_out, _ = triton_fn()  # autotunes on the first call
    if ref is None:
        ref = t_out
    us = bench_us(triton_fn, graph)
    print(f"{name:>14} {'triton':>14} {us:>9.1f} {flops / us / 1e6:>7.1f} {sdpa_us / us:>8.2f}x "
          f"{cosine(t_out, ref):>8.5f}", flush=True)  # fmt: skip

    for variant, kw in GLUON_VARIANTS.items():
        out = torch.empty(q.shape[0], h, 128, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(q.shape[0], h, dtype=torch.float32, device="cuda")

        def fn(kw=kw, out=out, lse=lse):
            return pg.flash_attn_varlen_gluon(q, k, v, cu, cu, L, L, SCALE, causal=True, out=out, lse=lse, **kw)

        # an mbarrier bug hangs the GPU (nothing after it can run): end the process with a traceback instead of
        # spending the caller's whole time limit
        faulthandler.dump_traceback_later(HANG_S, exit=True)
        try:
            g_out, _ = fn()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - report and go on with the next variant
            print(f"{name:>14} {variant:>14} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
            continue
        finally:
            faulthandler.cancel_dump_traceback_later()
        cos = cosine(g_out, ref)
        diff = float((g_out.float() - t_out.float()).abs().max())
        bad = torch.isnan(g_out).any().item() or cos < 0.999
        us = bench_us(fn, graph)
        print(f"{name:>14} {variant:>14} {us:>9.1f} {flops / us / 1e6:>7.1f} {sdpa_us / us:>8.2f}x {cos:>8.5f} "
              f"max|d triton| {diff:.3e}{'  WRONG' if bad else ''}", flush=True)  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="128:8192:2,16:4096:4", help="comma-separated H:L:B")
    ap.add_argument("--no-graph", action="store_true", help="time with do_bench instead of CUDA-graph replay")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    print(env_line())
    q = torch.empty(1, 1, 192, dtype=torch.bfloat16, device="cuda")
    v = torch.empty(1, 1, 128, dtype=torch.bfloat16, device="cuda")
    print(f"# gluon supported: {pg.gluon_prefill_supported(q, q, v)}")
    print("# causal bf16, d_qk 192 / d_v 128; TFLOPS = 2 * causal pairs * H * (192 + 128) / us / 1e6; "
          "ratio = SDPA us / us; cos vs SDPA")  # fmt: skip
    print(f"{'shape':>14} {'impl':>14} {'us':>9} {'TFLOPS':>7} {'ratio':>9} {'cos':>8}")
    torch.manual_seed(0)
    for spec in args.shapes.split(","):
        h, L, b = (int(x) for x in spec.split(":"))
        run_shape(h, L, b, not args.no_graph)
    return 0


if __name__ == "__main__":
    sys.exit(main())
