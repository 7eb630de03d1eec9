"""Family ``decode``: dense paged MLA decode (``openmla.mla_decode``) beside FlashMLA's dense decode.

A shape spec is space-separated fields: ``h<heads> b<batch> s<keys> [q<qlen>] [bf16|fp8]``, where ``s`` is
``s8192`` (every request 8192 keys), ``s8192~4096`` (lengths drawn from N(8192, 4096) clamped to [1, 16384]) or
``s512..16384`` (uniform in [512, 16384]); draws are seeded, the same in every run. Example: ``h128 b128 s8192 q2``.

Each point: a cache of 64-token pages scattered over a pool of at least 2 GiB (larger than L2), q in bf16, causal,
the plan built once outside the timed region (as an engine does once a step); CUDA-graph replay medians.
TFLOPS = 2 * h * qlen * sum(seq_lens) * (576 + 512) (FlashMLA's count: every query row against all keys);
bytes = the KV rows of every request + q + out (``openmla.utils.perf``). FlashMLA (``flash_mla``, optional) runs
the same q, block table and lengths on the bf16 cache (fp8 points too: an fp8 point is compared with FlashMLA's
bf16 decode); ``check`` is the cosine similarity of the two outputs.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch

import openmla
from openmla.bench.context import BenchContext, cosine
from openmla.utils.perf import decode_bytes, decode_flops

OP = "mla_decode"
PAGE = 64
D_QK, D_V = 576, 512
SCALE = 192**-0.5
POOL_GIB = 2.0

_SHAPES = [
    "h128 b128 s8192 q1", "h128 b128 s8192 q2", "h128 b32 s4096 q1", "h128 b8 s4096 q1", "h64 b128 s8192 q1",
    "h32 b128 s8192 q1", "h32 b128 s8192 q2", "h16 b128 s8192 q1", "h16 b128 s8192 q2", "h16 b128 s8192~4096 q1",
    "h128 b128 s512..16384 q1", "h128 b1 s32768 q1", "h16 b1 s32768 q1",
]  # fmt: skip
_FP8 = ["h128 b128 s8192 q1 fp8", "h128 b128 s8192 q2 fp8", "h16 b128 s8192 q1 fp8", "h16 b128 s8192 q2 fp8",
        "h128 b1 s32768 q1 fp8"]  # fmt: skip
PRESETS = {
    "default": _SHAPES + _FP8,  # issue 34's table and the README's figures; fp8 caches beside bf16
    "quick": ["h128 b128 s8192 q1", "h16 b128 s8192 q2", "h128 b1 s32768 q1", "h16 b128 s8192 q1 fp8"],
    "full": [f"h{h} b{b} s{s} q{q}" for q in (1, 2) for h in (16, 32, 64, 128) for b in (1, 8, 32, 64, 128)
             for s in (1024, 4096, 8192, 32768)],  # 160 points: use --rounds 1 --rep 20
    "tiny": ["h2 b2 s70 q1", "h4 b3 s50~30 q2", "h2 b2 s40 q1 fp8"],  # CPU (interpreter)
}  # fmt: skip


@dataclass(frozen=True)
class DecodeShape:
    h: int
    b: int
    s: int  # the mean for ~, the upper bound for ..
    q: int = 1
    dtype: str = "bf16"  # the cache's
    lo: int = 0  # s<lo>..<s>
    std: int = 0  # s<s>~<std>

    def __str__(self) -> str:
        s = f"{self.s}~{self.std}" if self.std else f"{self.lo}..{self.s}" if self.lo else f"{self.s}"
        return f"h{self.h} b{self.b} s{s} q{self.q}"

    def lengths(self) -> list[int]:
        """Keys of each request (seeded draws for ragged batches)."""
        g = torch.Generator().manual_seed(0)
        if self.std:
            x = torch.randn(self.b, generator=g, dtype=torch.float64) * self.std + self.s
            return x.round().clamp(1, 2 * self.s).long().tolist()
        if self.lo:
            return torch.randint(self.lo, self.s + 1, (self.b,), generator=g).tolist()
        return [self.s] * self.b


def parse(spec: str) -> DecodeShape:
    """``"h128 b128 s8192 q2 fp8"`` -> :class:`DecodeShape` (ValueError on a bad spec)."""
    f: dict = {}
    try:
        for tok in spec.replace(",", " ").split():
            if tok in ("bf16", "fp8"):
                f["dtype"] = tok
            elif tok[0] == "s" and "~" in tok:
                f["s"], f["std"] = (int(x) for x in tok[1:].split("~"))
            elif tok[0] == "s" and ".." in tok:
                f["lo"], f["s"] = (int(x) for x in tok[1:].split(".."))
            elif tok[0] in "hbsq":
                f[tok[0]] = int(tok[1:])
            else:
                raise ValueError(tok)
        shape = DecodeShape(**f)
    except (ValueError, TypeError, IndexError):
        raise ValueError(f"bad decode shape {spec!r}: want 'h<heads> b<batch> s<keys>|s<mean>~<std>|s<lo>..<hi> "
                         "[q<qlen>] [bf16|fp8]'") from None  # fmt: skip
    if min(shape.h, shape.b, shape.s, shape.q) < 1 or shape.q > 16 or (shape.lo and not 1 <= shape.lo <= shape.s):
        raise ValueError(f"bad decode shape {spec!r}: sizes must be >= 1, qlen <= 16, lo <= hi")
    return shape


def run(shape: DecodeShape, ctx: BenchContext) -> list[dict]:
    """Time one point: openmla and, when importable, FlashMLA, alternating; returns its rows."""
    dev, fp8 = ctx.device, shape.dtype == "fp8"
    lens = shape.lengths()
    h, b, ql, s_max, T = shape.h, shape.b, shape.q, max(lens), shape.b * shape.q
    pages = b * math.ceil(s_max / PAGE)
    pool = max(pages, int(POOL_GIB * 2**30 / (PAGE * D_QK * 2))) if dev.type == "cuda" else pages
    torch.manual_seed(0)
    cache = torch.randn(pool, PAGE, D_QK, device=dev, dtype=torch.bfloat16)
    kv = cache.to(torch.float8_e4m3fn) if fp8 else cache
    block_table = torch.randperm(pool, device=dev)[:pages].view(b, -1).int()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    qsl = torch.arange(b + 1, dtype=torch.int32, device=dev) * ql
    q = torch.randn(T, h, D_QK, device=dev, dtype=torch.bfloat16)
    kv_dtype = "fp8" if fp8 else "auto"
    plan = openmla.plan_decode(seq_lens, qsl, h, max_query_len=ql, max_seq_len=s_max, kv_cache_dtype=kv_dtype)
    out = torch.empty(T, h, D_V, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(T, h, dtype=torch.float32, device=dev)
    kw = dict(kv_cache_dtype="fp8", kv_scale=1.0) if fp8 else {}
    # the batch is valid by construction: skip the host check where the API has one (older checkouts do not)
    own_kw = dict(kw, validate=False) if "validate" in inspect.signature(openmla.mla_decode).parameters else kw

    def own():
        openmla.mla_decode(q, kv, block_table, seq_lens, qsl, SCALE, plan=plan, out=out, lse=lse, **own_kw)

    own()
    fns, check, old_check = {"openmla": own}, None, None
    old = ctx.baseline  # --against: the older openmla on the same inputs, its own plan and buffers
    if old is not None:
        plan_o = old.plan_decode(seq_lens, qsl, h, max_query_len=ql, max_seq_len=s_max, kv_cache_dtype=kv_dtype)
        out_o, lse_o = torch.empty_like(out), torch.empty_like(lse)

        def before():
            old.mla_decode(q, kv, block_table, seq_lens, qsl, SCALE, plan=plan_o, out=out_o, lse=lse_o, **kw)

        before()
        old_check, fns["before"] = cosine(out_o, out), before
    fm = ctx.peer("flash_mla")
    if fm is not None:
        q4, kc, meta = q.view(b, ql, h, D_QK), cache.view(pool, PAGE, 1, D_QK), fm.get_mla_metadata()[0]

        def peer():
            return fm.flash_mla_with_kvcache(q4, kc, block_table, seq_lens, D_V, meta, softmax_scale=SCALE,
                                             causal=True)  # fmt: skip

        try:
            check = cosine(out, peer()[0].reshape(T, h, D_V))
            fns["flashmla"] = peer
        except Exception as exc:  # the peer refuses this shape: its column stays empty
            ctx.note(f"# flashmla failed at {shape} {shape.dtype}: {type(exc).__name__}: {exc}".splitlines()[0])
    elif fp8:
        del cache  # only the peer reads the bf16 copy
    timings = ctx.time(fns, graph=True)
    keys = sum(lens)
    ours = ("openmla", "before")  # read the cache openmla reads; the peer reads bf16
    nbytes = {p: decode_bytes(keys, D_QK * (1 if fp8 and p in ours else 2), T, h) for p in fns}
    dtypes = {p: shape.dtype if p in ours else "bf16" for p in fns}
    rows = ctx.rows(OP, str(shape), timings, flops=decode_flops(keys * ql, h), nbytes=nbytes, dtype=dtypes,
                    peer="flashmla", check=check)  # fmt: skip
    for r in rows:
        if r["provider"] == "before":
            r["check"] = old_check  # the older openmla's output against this one's
    return rows
