"""Benchmark paged MLA decode (DeepSeek V3 shapes) on a CUDA GPU.

For each shape: time (us, CUDA-graph replay median), KV GB/s (bytes actually read: q + the KV rows of
every request + out), TFLOPS (2 * T * H * seq * (576 + 512)), the fraction of the read-only
bandwidth of a large ``torch.sum`` measured in the same run, and the same shape through a plain
PyTorch implementation for scale; both kernel tiers side by side ("triton_us": the portable kernel,
"gluon_us": the Hopper kernel where it applies, the faster one starred; "tier": the one ``mla_decode``
picks by default, whose time is "us"; "split_us" / "red_us": its split kernel and reduce alone, the split kernel
on the plan's request-spanning schedule where ``mla_decode`` runs it, which needs no reduce: "red_us" 0). KV pages
are scattered over a pool of at least ``--pool-gib`` GiB (larger than L2).

    python benchmarks/bench_decode.py            # the issue's target shapes and a reduced sweep
    python benchmarks/bench_decode.py --full     # h {16,32,64,128} x b {1,8,32,64,128} x s {1k..32k} x qlen {1,2}
    python benchmarks/bench_decode.py --full --kv bf16   # half of it (then --kv fp8)
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import openmla  # noqa: E402
from openmla.ops import decode as dec  # noqa: E402
from common import bench_us as _bench_us  # noqa: E402
from common import env_line, read_bandwidth_gbs  # noqa: E402

PAGE = 64
SCALE = 192**-0.5


def parse_shapes(text: str) -> list[tuple[int, int, int, int, bool]]:
    """``"h,b,s,qlen[,fp8];..."`` -> ``[(h, b, s, qlen, fp8), ...]``."""
    shapes = []
    for item in text.split(";"):
        f = item.split(",")
        shapes.append((int(f[0]), int(f[1]), int(f[2]), int(f[3]), len(f) > 4 and f[4] == "fp8"))
    return shapes


def make_problem(h, b, s, qlen, fp8, pool_gib):
    dev = "cuda"
    pages_needed = b * (-(-s // PAGE))
    row_bytes = 576 * (1 if fp8 else 2)
    pool_pages = max(pages_needed, int(pool_gib * 2**30 / (PAGE * row_bytes)))
    cache = torch.randn(pool_pages, PAGE, 576, device=dev, dtype=torch.bfloat16)
    if fp8:
        cache = cache.to(torch.float8_e4m3fn)
    block_table = torch.randperm(pool_pages, device=dev)[:pages_needed].view(b, -1).int()
    seq_lens = torch.full((b,), s, dtype=torch.int32, device=dev)
    qsl = torch.arange(b + 1, dtype=torch.int32, device=dev) * qlen
    q = torch.randn(b * qlen, h, 576, device=dev, dtype=torch.bfloat16)
    return q, cache, block_table, seq_lens, qsl


def torch_decode(q, cache, block_table, seq_lens, qlen, s, fp8):
    """Plain PyTorch (gather + two batched matmuls), uniform lengths, causal."""
    b = block_table.shape[0]
    pos = torch.arange(s, device=q.device)
    slots = block_table[:, pos // PAGE].long() * PAGE + pos % PAGE  # [b, s]
    kv = cache.view(-1, 576)[slots]  # [b, s, 576]
    if fp8:
        kv = kv.to(torch.bfloat16)
    qq = q.view(b, qlen, -1, 576).flatten(1, 2)  # [b, qlen*h, 576]
    scores = torch.matmul(qq, kv.transpose(1, 2)).float() * SCALE
    t = torch.arange(qlen, device=q.device).repeat_interleave(q.shape[1])
    scores.masked_fill_(pos[None, None, :] > (s - qlen + t)[None, :, None], float("-inf"))
    p = torch.softmax(scores, -1).to(torch.bfloat16)
    return torch.matmul(p, kv[..., :512])


def run_shape(h, b, s, qlen, fp8, bw, args):
    q, cache, bt, sl, qsl = make_problem(h, b, s, qlen, fp8, args.pool_gib)
    plan = openmla.plan_decode(sl, qsl, h, max_query_len=qlen, max_seq_len=s,
                                kv_cache_dtype="fp8" if fp8 else "auto")
    out = torch.empty(q.shape[0], h, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(q.shape[0], h, dtype=torch.float32, device="cuda")
    kw = dict(kv_cache_dtype="fp8", kv_scale=1.0) if fp8 else {}

    def call(backend):
        return lambda: openmla.mla_decode(q, cache, bt, sl, qsl, SCALE, plan=plan, out=out, lse=lse,
                                          backend=backend, **kw)  # fmt: skip

    graph = not args.no_graph
    rep = args.rep or (20 if args.full else 100)

    def bench_us(fn, graph):
        return _bench_us(fn, graph, rep)

    us = bench_us(call("auto"), graph=graph)
    # both tiers side by side (the Gluon tier only where it applies: sm90, bf16 cache)
    tier_us = {"triton": bench_us(call("triton"), graph=graph), "gluon": float("nan")}
    use_gluon = dec._use_gluon("auto", q, cache, plan, "fp8" if fp8 else "auto")
    if dec.gluon_decode_supported(q, cache, plan, "fp8" if fp8 else "auto"):
        tier_us["gluon"] = bench_us(call("gluon"), graph=graph)
    winner = min((t for t in tier_us if tier_us[t] == tier_us[t]), key=tier_us.get)
    # the split kernel mla_decode picks and the reduce, timed on their own (same arguments it passes)
    scale_log2 = SCALE * 1.4426950408889634
    compute = dec.compute_dtype(torch.float16 if fp8 else torch.bfloat16)

    variant = dec._gluon_variant("fp8" if fp8 else "auto", h, qlen, b, plan.num_sms)
    # the request-spanning schedule where mla_decode runs it (its kernel merges cut requests: no reduce)
    spans = plan.spans if use_gluon and variant in dec.SPAN_VARIANTS else None

    def split():
        args = (q, cache, bt, sl, qsl, plan, out, lse, scale_log2, 1.0, True, 512)
        if use_gluon:
            dec.mla_decode_split_gluon(*args, variant=variant, spans=spans)
        else:
            dec._mla_decode_split(*args, compute)

    split_us = bench_us(split, graph=graph)
    reduce_us = 0.0 if spans is not None else bench_us(lambda: dec._mla_decode_reduce(qsl, plan, out, lse, 512),
                                                       graph=graph)  # fmt: skip
    plan_us = bench_us(lambda: openmla.plan_decode(sl, qsl, h, max_query_len=qlen, max_seq_len=s, out=plan),
                       False)
    row_bytes = 576 * (1 if fp8 else 2)
    nbytes = b * s * row_bytes + q.numel() * 2 + out.numel() * 2
    flops = 2.0 * b * qlen * h * s * (576 + 512)
    gbs = nbytes / us / 1e3
    torch_us = float("nan")
    if b * s <= args.torch_max_tokens:
        torch_us = bench_us(lambda: torch_decode(q, cache, bt, sl, qlen, s, fp8), graph=False)
    return dict(h=h, b=b, s=s, qlen=qlen, kv="fp8" if fp8 else "bf16", us=us, gbs=gbs, tflops=flops / us / 1e6,
                frac=gbs / bw, plan_us=plan_us, split_us=split_us, reduce_us=reduce_us, torch_us=torch_us,
                splits=int(plan.work_indptr[-1]), triton_us=tier_us["triton"], gluon_us=tier_us["gluon"],
                winner=winner, tier="gluon" if use_gluon else "triton")  # the problem's tensors are freed on return


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="the whole sweep of the issue")
    ap.add_argument("--pool-gib", type=float, default=2.0, help="KV pool size (pages scattered over it)")
    ap.add_argument("--no-graph", action="store_true", help="time with do_bench instead of CUDA graphs")
    ap.add_argument("--torch-max-tokens", type=int, default=300_000, help="largest b*s for the PyTorch baseline")
    ap.add_argument("--shapes", default=None, help="h,b,s,qlen[,fp8];... explicit shapes")
    ap.add_argument("--rep", type=int, default=None,
                    help="ms per timed batch (default 100; 20 with --full, which times 160-320 shapes)")
    ap.add_argument("--kv", choices=["bf16", "fp8", "both"], default="both",
                    help="cache dtypes of the --full sweep (run them as two calls where time is short)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA GPU")
        return 0
    print(env_line())
    bw = read_bandwidth_gbs()
    print(f"# read-only torch.sum bandwidth: {bw:.0f} GB/s")
    if args.shapes:
        shapes = parse_shapes(args.shapes)
    elif args.full:
        shapes = [(h, b, s, ql, fp8) for fp8, ql, h, b, s in itertools.product(
            {"bf16": [False], "fp8": [True], "both": [False, True]}[args.kv], [1, 2], [16, 32, 64, 128], [1, 8, 32, 64, 128], [1024, 4096, 8192, 32768])]
    else:
        shapes = [
            (16, 128, 8192, 1, False), (16, 128, 8192, 2, False), (32, 128, 8192, 1, False),
            (64, 128, 8192, 1, False), (128, 128, 8192, 1, False), (128, 128, 8192, 2, False),
            (128, 1, 32768, 1, False), (16, 1, 32768, 1, False), (16, 8, 4096, 1, False),
            (128, 32, 4096, 1, False), (16, 64, 1024, 1, False),
            (16, 128, 8192, 1, True), (16, 128, 8192, 2, True), (128, 128, 8192, 1, True), (128, 1, 32768, 1, True),
        ]  # fmt: skip
    hdr = f"{'h_q':>4} {'b':>4} {'seq':>6} {'qlen':>4} {'kv':>4} {'us':>9} {'GB/s':>7} {'TFLOPS':>7} {'%bw':>6} " \
          f"{'tier':>6} {'triton_us':>9} {'gluon_us':>9} {'splits':>6} {'split_us':>8} {'red_us':>7} {'plan_us':>7} " \
          f"{'torch_us':>9} {'speedup':>7}"
    print(hdr)
    for shape in shapes:
        r = run_shape(*shape, bw, args)
        torch.cuda.empty_cache()
        print(f"{r['h']:>4} {r['b']:>4} {r['s']:>6} {r['qlen']:>4} {r['kv']:>4} {r['us']:>9.1f} {r['gbs']:>7.0f} "
              f"{r['tflops']:>7.1f} {100 * r['frac']:>5.1f}% {r['tier']:>6} "
              f"{r['triton_us']:>8.1f}{'*' if r['winner'] == 'triton' else ' '} "
              f"{r['gluon_us']:>8.1f}{'*' if r['winner'] == 'gluon' else ' '} {r['splits']:>6} {r['split_us']:>8.1f} "
              f"{r['reduce_us']:>7.1f} {r['plan_us']:>7.1f} {r['torch_us']:>9.1f} {r['torch_us'] / r['us']:>6.1f}x",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
