"""Family ``indexer``: the V3.2 lightning indexer (``openmla.indexer_logits`` / ``indexer_topk``), pass by pass.

A shape spec is space-separated fields: ``decode b<batch> s<keys> [q<qlen>] [h<heads>] [d<dim>] [k<topk>] [fp8|bf16]
[qbf16]`` (b requests of s keys each, the last q of them queries) or ``prefill t<queries> s<keys> ...`` (one request
of s keys whose last t are queries, ``max_query_len=t``). Defaults: h64 d128 k2048, fp8 cache (block-split, 64-token
blocks, scattered over a shuffled block table) and an e4m3 q (vLLM's contract: q's per-head scale folded into the
weights); ``qbf16`` scores a bf16 q against the fp8 cache, ``bf16`` keeps a bf16 cache (and q).
An optional ``tile<block_n>x<split>x<warps>x<stages>`` times a scores tiling (the private ``_tiling=`` argument of
``indexer_logits`` / ``indexer_topk``), and ``ttile<block>x<warps>`` a top-k tiling (``_topk_tiling=``), ``tma`` /
``notma`` key tiles by TMA or by pointer loads (``_tma=``; TMA is the default), ``tsplit<n>`` top-k rows split
over n programs (``_topk_split=n``); tuning only.

Each point gives four rows: ``indexer_logits`` (the scores pass; bytes = keys read once per request + q + weights
+ the fp32 logits written, so ``frac_bw`` is the fraction of the read bandwidth measured in the same run; FLOPs =
2 h d per (row, causal key)); ``indexer_topk_pass``, providers ``openmla`` (the radix select) and ``torch``
(``torch.topk`` for the threshold; ``ratio`` = torch / radix, ``check`` 1 when both chose the same), over the same
logits (bytes = the logits read); ``indexer_topk`` (both passes, the public call).
Decode points are CUDA-graph replays, prefill ``do_bench``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import openmla
from openmla.bench.context import BenchContext
from openmla.ops.indexer import alloc_indexer_k_cache, logits_topk, quantize_indexer_q

OP = "indexer_logits"
BLOCK = 64

PRESETS = {
    "default": ["decode b128 s32768", "decode b128 s32768 notma", "decode b128 s32768 qbf16", "decode b128 s32768 q2",
                "decode b64 s8192", "decode b1 s32768", "prefill t4096 s32768", "prefill t4096 s32768 notma",
                "prefill t4096 s32768 qbf16"],
    "quick": ["decode b128 s32768", "decode b128 s32768 notma", "decode b128 s32768 q2", "prefill t4096 s32768",
              "prefill t4096 s32768 notma", "prefill t1024 s32768", "prefill t2048 s32768"],
    "tiny": ["decode b2 s40 h4 d32 k8", "decode b2 s33 q2 h3 d32 k8 qbf16", "prefill t5 s30 h2 d32 k8 bf16"],
}  # fmt: skip


@dataclass(frozen=True)
class IndexerShape:
    mode: str  # "decode" or "prefill"
    s: int  # keys per request
    b: int = 1
    q: int = 1  # decode query rows per request (prefill: t)
    t: int = 0
    h: int = 64
    d: int = 128
    k: int = 2048
    cache: str = "fp8"
    qdtype: str = "fp8"
    tile: tuple = ()
    ttile: tuple = ()
    tma: bool | None = None  # None: the op's default (TMA); False: the pointer loads
    tsplit: int = 0

    def __str__(self) -> str:
        extra = (
            (" qbf16" if self.qdtype == "bf16" and self.cache == "fp8" else "")
            + (" tile" + "x".join(map(str, self.tile)) if self.tile else "")
            + (" ttile" + "x".join(map(str, self.ttile)) if self.ttile else "")
            + ({True: " tma", False: " notma"}.get(self.tma, ""))
            + (f" tsplit{self.tsplit}" if self.tsplit else "")
        )
        head = f"decode b{self.b} s{self.s} q{self.q}" if self.mode == "decode" else f"prefill t{self.t} s{self.s}"
        return f"{head} h{self.h} d{self.d} k{self.k} {self.cache}{extra}"

    @property
    def qlen(self) -> int:
        return self.q if self.mode == "decode" else self.t


def parse(spec: str) -> IndexerShape:
    """``"decode b128 s32768"`` / ``"prefill t4096 s32768 qbf16"`` -> :class:`IndexerShape`."""
    toks = spec.replace(",", " ").split()
    bad = ValueError(f"bad indexer shape {spec!r}: want 'decode b<batch> s<keys> [q<qlen>]' or 'prefill "
                     "t<queries> s<keys>', optional h<heads> d<dim> k<topk> fp8|bf16 qbf16 "
                     "tile<n>x<split>x<warps>x<stages>")  # fmt: skip
    if not toks or toks[0] not in ("decode", "prefill"):
        raise bad
    f: dict = {"mode": toks[0]}
    try:
        for tok in toks[1:]:
            if tok in ("fp8", "bf16"):
                f["cache"] = tok
            elif tok.startswith("tsplit"):
                f["tsplit"] = int(tok[6:])
            elif tok in ("tma", "notma"):
                f["tma"] = tok == "tma"
            elif tok == "qbf16":
                f["qdtype"] = "bf16"
            elif tok.startswith("ttile"):
                f["ttile"] = tuple(int(x) for x in tok[5:].split("x"))
                if len(f["ttile"]) != 2:
                    raise ValueError(tok)
            elif tok.startswith("tile"):
                f["tile"] = tuple(int(x) for x in tok[4:].split("x"))
                if len(f["tile"]) != 4:
                    raise ValueError(tok)
            elif tok[0] in "sbqthdk":
                f[tok[0]] = int(tok[1:])
            else:
                raise ValueError(tok)
        if f.get("cache") == "bf16":
            f["qdtype"] = "bf16"
        shape = IndexerShape(**f)
    except (ValueError, TypeError, IndexError):
        raise bad from None
    if min(shape.s, shape.b, shape.q, shape.h, shape.d, shape.k) < 1 or shape.qlen > shape.s or shape.d % 4:
        raise bad
    if shape.tsplit < 0 or min(shape.tile + shape.ttile, default=1) < 1:
        raise bad
    if shape.mode == "prefill" and (shape.t < 1 or shape.b != 1):
        raise bad
    return shape


def _inputs(shape: IndexerShape, dev):
    """q, weights, k_cache, block_table, seq_lens, query_start_loc (keys written by openmla's cache writer)."""
    torch.manual_seed(0)
    B, S, H, D = shape.b, shape.s, shape.h, shape.d
    W = -(-S // BLOCK)
    cache_dtype = "fp8" if shape.cache == "fp8" else "auto"
    cache = alloc_indexer_k_cache(B * W, BLOCK, D, cache_dtype=cache_dtype, device=dev)
    block_table = torch.randperm(B * W, device=dev, dtype=torch.int64).to(torch.int32).view(B, W)
    chunk = 1 << 20
    slots_all = (block_table.long()[:, :, None] * BLOCK + torch.arange(BLOCK, device=dev)).view(B, -1)[:, :S].flatten()
    for s0 in range(0, slots_all.numel(), chunk):
        sl = slots_all[s0 : s0 + chunk]
        k = torch.randn(sl.numel(), D, device=dev, dtype=torch.bfloat16)
        openmla.concat_and_cache_indexer_k(k, cache, sl, cache_dtype=cache_dtype, scale_fmt="ue8m0", validate=False)
    T = B * shape.qlen
    q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    weights = torch.randn(T, H, device=dev) * D**-0.5 * H**-0.5
    if shape.qdtype == "fp8":  # per (row, head) e4m3 with a power-of-two scale, folded into the weights
        q, s = quantize_indexer_q(q, scale_fmt="ue8m0")
        weights = weights * s
    seq_lens = torch.full((B,), S, dtype=torch.int32, device=dev)
    qsl = torch.arange(B + 1, device=dev, dtype=torch.int32) * shape.qlen
    return (q, weights, cache, block_table, seq_lens, qsl), cache_dtype


def run(shape: IndexerShape, ctx: BenchContext) -> list[dict]:
    """Time one point: the scores pass, the top-k pass (radix select and torch.topk) and the whole call."""
    dev = ctx.device
    # the shape's variant, through the ops' private arguments, passed only when set (the module constants
    # otherwise; a copy of this bench run against an older openmla then passes none)
    skw = {k: v for k, v in (("_tiling", shape.tile),) if v} | ({} if shape.tma is None else {"_tma": shape.tma})
    tkw = {k: v for k, v in (("_topk_tiling", shape.ttile), ("_topk_split", shape.tsplit)) if v}
    args, cache_dtype = _inputs(shape, dev)
    q = args[0]
    T, H, D = q.shape
    S, K = shape.s, shape.k
    mql = shape.qlen  # the engine knows it: verify rows share a dot, prefill rows spread over programs
    kw = dict(cache_dtype=cache_dtype, max_query_len=mql, validate=False, **skw)
    logits = torch.empty(T, args[3].shape[1] * BLOCK, dtype=torch.float32, device=dev)
    idx = torch.empty(T, K, dtype=torch.int32, device=dev)
    idx2 = torch.empty_like(idx)
    graph = shape.mode == "decode"

    def scores():
        openmla.indexer_logits(*args, out=logits, **kw)

    def select(impl, out):
        return lambda: logits_topk(logits, K, out=out, topk_impl=impl, **tkw)

    def whole():
        openmla.indexer_topk(*args, K, out=idx, **kw, **tkw)

    openmla.indexer_logits(*args, out=logits, cache_dtype=cache_dtype, max_query_len=mql, **skw)  # validated once
    select("triton", idx)()
    select("torch", idx2)()
    same = 1.0 if torch.equal(idx, idx2) else 0.0  # both passes pick the same positions
    rows = []
    ncache = shape.b * S * (D + 4 if cache_dtype == "fp8" else 2 * D)
    pairs = shape.b * sum(S - shape.qlen + j + 1 for j in range(shape.qlen))  # causal (row, key) pairs
    qbytes = q.numel() * q.element_size() + 4 * T * H
    tag = f"q{shape.qdtype}" + ("" if cache_dtype == "fp8" else "-cache-bf16")
    t_scores = ctx.time({"openmla": scores}, graph=graph)
    rows += ctx.rows(OP, str(shape), t_scores, flops=2.0 * pairs * H * D, nbytes=ncache + qbytes + logits.numel() * 4,
                     dtype=tag)  # fmt: skip
    t_sel = ctx.time({"openmla": select("triton", idx), "torch": select("torch", idx2)}, graph=graph)
    rows += ctx.rows("indexer_topk_pass", str(shape), t_sel, flops=0.0, nbytes=logits.numel() * 4.0, dtype="fp32",
                     peer="torch", check=same)  # fmt: skip
    t_all = ctx.time({"openmla": whole}, graph=graph)
    rows += ctx.rows("indexer_topk", str(shape), t_all, flops=2.0 * pairs * H * D,
                     nbytes=ncache + qbytes + logits.numel() * 8, dtype=tag + "+topk")  # fmt: skip
    return rows
