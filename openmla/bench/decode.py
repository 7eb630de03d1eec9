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

Tuning (issue 34): any further field is a variant, timed as its own provider (named by the field) beside the default
in the same rounds, on the same inputs, into its own buffers, its ``check`` the cosine against the default's output. A
variant is settings joined by ``+``: ``triton`` / ``gluon`` (``mla_decode``'s backend), ``seesaw`` / ``pair`` (that
Gluon kernel, forced; ``ws`` / ``narrow`` the fp8-cache ones), ``spans0`` / ``spans1`` (``plan_decode``'s ``_spans``:
pair runs the spanning schedule where the plan has one), ``spanscut`` / ``spanssnap`` (``_spans_mode``: that schedule
always cut / snapped), ``cutcost<N>`` (``_span_cut``: "auto"'s cut cost in units for ``SPAN_CUT``), ``minsplit<N>``,
``maxsplit<N>``, ``split<N>`` (both), ``itemcost<N>``, ``slots<N>`` (the planner's constants for this variant's plan:
``plan_decode``'s ``_min_split`` etc.), ``sms<N>`` (``plan_decode``'s ``num_sms``: the spanning schedule then cuts
the batch over ``N // readers`` groups), ``reduce`` (the reduce kernel alone, on that variant's plan, after one full
call: meaningful where the default path runs a reduce). Example: ``h128 b32 s4096 q1 pair pair+spans1 reduce``.
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass

import torch

import openmla
import openmla.ops.decode as _dec
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
    # issue 34's weak shapes with the alternatives the plan analysis points at, b132 probes (is a b128 s8k batch on
    # 128 of 132 SMs limited by the SMs or by HBM?) and the shapes that are ahead (pair at b1: the rule "pair for
    # 2+ readers at any batch" must keep it); about 4-5 minutes on an H200 with FlashMLA. The h64 b128 spanning
    # schedule snaps (128 of 132 groups): spanscut fills the 4 idle SMs (at h128 b32 "auto" already cuts; h32 / h16
    # plan 32- / 16-row tiles, which get no spanning schedule). At h128 b32 the default is pair + spans: pair+spans0
    # is the pair kernel on the regular plan with the reduce (stop 57, H100 profiler: 79.3 + 10.8 us against the
    # spanning schedule's 94.4); pair+spans1+sms128: the schedule on 64 groups, which cuts each b32 request in two
    # halves merged in the kernel (on 66 groups "auto" cuts it in three pieces)
    "issue34": ["h128 b32 s4096 q1 pair+spans0 pair+spans1+sms128 reduce", "h128 b8 s4096 q1 pair pair+spans1 reduce",
                "h16 b128 s8192~4096 q1 maxsplit4096 maxsplit2048 maxsplit1024 gluon reduce",
                "h64 b128 s8192 q1 pair pair+spans1 pair+spans1+spanscut", "h64 b132 s8192 q1",
                "h32 b128 s8192 q1 pair", "h16 b128 s8192 q1 gluon", "h16 b132 s8192 q1", "h128 b128 s8192 q1",
                "h128 b128 s8192 q2", "h128 b1 s32768 q1 pair pair+spans1", "h16 b1 s32768 q1"],
    # the dispatch rules against the choices they replaced: the Gluon kernel from 16 rows (bf16; "triton" the
    # portable kernel) and the pair kernel from 40% of the SMs' programs ("seesaw" the other Gluon kernel)
    "dispatch": ["h16 b1 s32768 q1 triton", "h16 b8 s4096 q1 triton", "h16 b32 s4096 q1 triton",
                 "h16 b128 s8192 q2 triton", "h16 b128 s8192~4096 q1 triton", "h64 b64 s4096 q1 seesaw",
                 "h128 b24 s4096 q1 seesaw pair+spans1", "h128 b16 s4096 q1 seesaw pair+spans1",
                 "h64 b32 s8192 q1 pair+spans1"],
    # small and middle batches (issue 34's remaining gaps): fewer, longer splits (less fp32 partial traffic: at h128
    # b8 s4k the 64 items write and the reduce reads 16.8 MB) against the planner's pick
    "splits": ["h128 b8 s4096 q1 minsplit1024 minsplit2048 split4096 reduce",
               "h128 b16 s4096 q1 minsplit1024 minsplit2048 reduce", "h64 b8 s4096 q1 minsplit1024 minsplit2048",
               "h64 b32 s4096 q1 minsplit1024 minsplit2048", "h16 b32 s4096 q1 minsplit1024 minsplit2048 gluon",
               "h16 b8 s4096 q1 minsplit1024 gluon", "h128 b1 s32768 q1 maxsplit2048 maxsplit8192",
               # the fp8 cache (half the bytes) beside the bf16 points above: ws against the portable kernel
               "h16 b128 s8192 q1 fp8 triton", "h64 b128 s8192 q1 fp8 triton", "h128 b128 s8192 q1 fp8"],
    # h16 / h32 (issue 34: 0.976x FlashMLA at b128 q1 on the H200, stop 56): the pair kernel (64-row blocks: 32 heads
    # x 2 query slots, 16 x 4) against the default (seesaw + reduce). On the H100 (stops 57-58) pair was 0.989-1.006x
    # the default and pair + the spanning schedule 0.93-1.009x (ragged and cut onto 132 SMs included: RESULTS.md);
    # the H200 had pair 1.043x at h32 b128 q1 (stop 56): these points repeat that on an H200
    "narrowpair": [f"h{h} b128 s8192 q{q} pair" for h, q in ((32, 1), (16, 1), (32, 2), (16, 2))]
                  + ["h16 b128 s8192~4096 q1 pair", "h32 b128 s8192~4096 q1 pair", "h32 b64 s8192 q1 pair"],
    # ragged batches (issue 34): the plan launches requests longest split first; the uniform control keeps batch order
    # (an A/B against batch order: --against an older checkout)
    "ragged": ["h16 b128 s8192~4096 q1", "h16 b128 s4096~4000 q1", "h128 b128 s8192~4096 q1",
               "h64 b128 s8192~4096 q1", "h16 b128 s8192 q1"],
    # the fp8 cache (half the bytes) at narrow tiles: the narrow kernel (the default up to 32 rows) against ws, beside
    # the bf16 cache on the same shapes (FlashMLA reads bf16 at every point)
    "fp8": ["h16 b128 s8192 q1 fp8 ws", "h16 b128 s8192 q1", "h16 b128 s8192 q2 fp8 ws", "h16 b128 s8192 q2",
            "h32 b128 s8192 q1 fp8 ws", "h32 b128 s8192 q1", "h8 b128 s8192 q1 fp8 ws", "h16 b64 s8192 q1 fp8 ws",
            "h16 b128 s8192~4096 q1 fp8 ws", "h16 b1 s32768 q1 fp8 ws", "h16 b32 s4096 q1 fp8 ws",
            "h64 b128 s8192 q1 fp8", "h128 b128 s8192 q1 fp8"],
}  # fmt: skip

# variant settings: (pattern, what it sets); plan settings become plan_decode's private keywords
_PLAN_INTS = {"minsplit": ("_min_split",), "maxsplit": ("_max_split",), "split": ("_min_split", "_max_split"),
              "itemcost": ("_item_cost",), "slots": ("_slots",), "cutcost": ("_span_cut",),
              "sms": ("num_sms",)}  # fmt: skip
# the spanning schedule's switches: field -> (plan_decode keyword, value)
_PLAN_FLAGS = {"spans0": ("_spans", False), "spans1": ("_spans", True), "spanscut": ("_spans_mode", "cut"),
               "spanssnap": ("_spans_mode", "snap")}  # fmt: skip
_RESERVED = ("openmla", "flashmla", "before")  # provider names taken


@dataclass(frozen=True)
class DecodeShape:
    h: int
    b: int
    s: int  # the mean for ~, the upper bound for ..
    q: int = 1
    dtype: str = "bf16"  # the cache's
    lo: int = 0  # s<lo>..<s>
    std: int = 0  # s<s>~<std>
    variants: tuple = ()  # tuning variants (module docstring), each timed as the provider of its name

    def __str__(self) -> str:
        s = f"{self.s}~{self.std}" if self.std else f"{self.lo}..{self.s}" if self.lo else f"{self.s}"
        return f"h{self.h} b{self.b} s{s} q{self.q}" + "".join(f" {v}" for v in self.variants)

    def lengths(self) -> list[int]:
        """Keys of each request (seeded draws for ragged batches)."""
        g = torch.Generator().manual_seed(0)
        if self.std:
            x = torch.randn(self.b, generator=g, dtype=torch.float64) * self.std + self.s
            return x.round().clamp(1, 2 * self.s).long().tolist()
        if self.lo:
            return torch.randint(self.lo, self.s + 1, (self.b,), generator=g).tolist()
        return [self.s] * self.b


def parse_variant(tok: str) -> dict:
    """A variant field (``pair+spans1``, ``maxsplit2048``, ``reduce``, ...) -> its settings: ``backend``, ``variant``,
    ``reduce`` and ``plan`` (plan_decode's private keywords). Raises ValueError on an unknown or clashing setting."""
    got: dict = {"plan": {}}
    if tok in _RESERVED:
        raise ValueError(tok)
    for part in tok.split("+"):
        m = re.fullmatch(r"([a-z]+)(\d*)", part)
        name, num = (m.group(1), m.group(2)) if m else ("", "")
        if part in ("triton", "gluon"):
            key, val = "backend", part
        elif part in ("seesaw", "pair", "ws", "narrow"):
            key, val = "variant", part
        elif part in _PLAN_FLAGS:
            key, val = _PLAN_FLAGS[part]
        elif part == "reduce":
            key, val = "reduce", True
        elif name in _PLAN_INTS and num:
            key, val = name, int(num)
        else:
            raise ValueError(part)
        if key in got or key in got["plan"] or (key in _PLAN_INTS and any(k in got["plan"] for k in _PLAN_INTS[key])):
            raise ValueError(part)  # set twice
        if key in _PLAN_INTS:
            got["plan"].update(dict.fromkeys(_PLAN_INTS[key], val))
        elif key.startswith("_"):
            got["plan"][key] = val
        else:
            got[key] = val
    sp = got["plan"]
    if (sp.get("_spans") is False and ("_spans_mode" in sp or "_span_cut" in sp)) or (
        "_span_cut" in sp and "_spans_mode" in sp
    ):
        raise ValueError(tok)  # a mode or cut cost without the schedule; a cut cost where the mode is forced
    gluon_on_triton = "variant" in got and got.get("backend") == "triton"
    if gluon_on_triton or (got.get("reduce") and ("backend" in got or "variant" in got)):
        raise ValueError(tok)  # a Gluon kernel on the Triton backend; the reduce alone times no split kernel
    return got


def parse(spec: str) -> DecodeShape:
    """``"h128 b128 s8192 q2 fp8"`` -> :class:`DecodeShape` (ValueError on a bad spec)."""
    f: dict = {}
    variants: list[str] = []
    try:
        for tok in spec.replace(",", " ").split():
            if tok in ("bf16", "fp8"):
                f["dtype"] = tok
            elif tok[0] == "s" and "~" in tok:
                f["s"], f["std"] = (int(x) for x in tok[1:].split("~"))
            elif tok[0] == "s" and ".." in tok:
                f["lo"], f["s"] = (int(x) for x in tok[1:].split(".."))
            elif tok[0] in "hbsq" and tok[1:].isdigit():
                f[tok[0]] = int(tok[1:])
            else:
                parse_variant(tok)
                if tok in variants:
                    raise ValueError(tok)
                variants.append(tok)
        shape = DecodeShape(**f, variants=tuple(variants))
    except (ValueError, TypeError, IndexError):
        raise ValueError(f"bad decode shape {spec!r}: want 'h<heads> b<batch> s<keys>|s<mean>~<std>|s<lo>..<hi> "
                         "[q<qlen>] [bf16|fp8] [variant ...]', a variant being settings joined by '+': triton, "
                         "gluon, seesaw, pair, spans0, spans1, spanscut, spanssnap, cutcost<N>, minsplit<N>, "
                         "maxsplit<N>, split<N>, itemcost<N>, slots<N>, sms<N>, reduce") from None  # fmt: skip
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
    checks = {}  # variant -> cosine against the default's output
    for name in shape.variants:
        try:
            fns[name], checks[name] = _variant_fn(name, q, kv, block_table, seq_lens, qsl, h, ql, s_max, kv_dtype,
                                                  own_kw, out)  # fmt: skip
            if checks[name] < 0.9999:
                ctx.note(f"# {name} vs the default at {shape}: cosine {checks[name]:.6f}")
        except Exception as exc:  # refused or failed: its row stays out, the note says why
            ctx.note(f"# {name} failed at {shape}: {type(exc).__name__}: {exc}".splitlines()[0])
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
    ours = ("openmla", "before", *shape.variants)  # read the cache openmla reads; the peer reads bf16
    nbytes = {p: decode_bytes(keys, D_QK * (1 if fp8 and p in ours else 2), T, h) for p in fns}
    dtypes = {p: shape.dtype if p in ours else "bf16" for p in fns}
    rows = ctx.rows(OP, str(shape), timings, flops=decode_flops(keys * ql, h), nbytes=nbytes, dtype=dtypes,
                    peer="flashmla", check=check)  # fmt: skip
    for r in rows:
        if r["provider"] == "before":
            r["check"] = old_check  # the older openmla's output against this one's
        elif r["provider"] in checks:
            r["check"] = checks[r["provider"]]  # the variant's output against the default's
    return rows


def _variant_fn(name, q, kv, block_table, seq_lens, qsl, h, ql, s_max, kv_dtype, own_kw, ref):
    """``(callable, cosine against ref)`` of one variant field: its own plan (the planner's private keywords) and
    buffers, called once here."""
    cfg = parse_variant(name)
    plan = openmla.plan_decode(seq_lens, qsl, h, max_query_len=ql, max_seq_len=s_max, kv_cache_dtype=kv_dtype,
                               **cfg["plan"])  # fmt: skip
    out, lse = torch.empty_like(ref), torch.empty(ref.shape[:2], dtype=torch.float32, device=ref.device)
    kw = dict(own_kw)
    if cfg.get("backend") or cfg.get("variant"):
        kw["backend"] = cfg.get("backend", "gluon")
    if cfg.get("variant"):
        kw["_gluon_kernel"] = cfg["variant"]

    def full():
        openmla.mla_decode(q, kv, block_table, seq_lens, qsl, SCALE, plan=plan, out=out, lse=lse, **kw)

    full()
    if not cfg.get("reduce"):
        return full, cosine(ref, out)

    def reduce():  # the LSE merge alone, over the partials the full call left in the plan's buffers
        _dec._mla_decode_reduce(qsl, plan, out, lse, D_V)

    reduce()
    return reduce, cosine(ref, out)
