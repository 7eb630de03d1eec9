"""Family ``sparse_v4``: DeepSeek V4 attention (``sparse_mla`` on fp8_v4 caches) beside FlashMLA's MODEL1 kernels.

A shape spec is space-separated fields:

``v4decode h<heads> b<batch> [q<qlen>] [w<window>] k<compressed top-k> [wb<swa block>] [eb<compressed block>] [elen]
[bf16] [norope] [split<n>] [tile<N>x<warps>x<stages>]``: b x qlen query rows (qlen 2 by default), each with a window of
w (128) consecutive slots of the request in the SWA cache (blocks of wb = 256) as the main source and k slots drawn
uniformly from the compressed cache (blocks of eb = 64) as the extra source; ``elen``: per-request compressed lengths
drawn in [1, k] (FlashMLA's extra_topk_length); per-head sinks; the inverse RoPE fused (``norope``: without it);
``bf16``: both caches bf16 (no peer). Both caches span at least 1 GiB each on the GPU (larger than L2).

``v4prefill h<heads> t<queries> k<top-k> [s<kv rows>]``: one bf16 workspace of s rows (32768) and t queries with k
slots each (FlashMLA's sparse prefill on the same rows). ``v4prefill h<heads> t<queries> k<compressed top-k>
w<window> paged [gather]``: one request of t new tokens, the window over its SWA fp8_v4 cache (blocks of 256) and k
of its t / 4 compressed entries (fp8_v4, blocks of 64); openmla reads the paged caches, or with ``gather`` first
gathers both into one bf16 workspace (``gather_cache_v4``, timed with it) and reads that (the pair of points says
which route prefill should take); the peer runs FlashMLA's sparse prefill on the gathered workspace (gather untimed);
a note names a point whose two routes disagree.

``gluon`` / ``triton`` (any point) also time that kernel (``sparse_mla(_kernel=...)``: the sm90 Gluon kernel of
openmla/ops/gluon/sparse.py, the default's pick on sm90, or the portable Triton one) on the same inputs in the same
rounds, as provider ``gluon`` / ``triton`` beside ``openmla`` (the default's pick; ``split<n>`` applies to both),
checked against the default's output (a note below cosine 0.9999); ``g:lazy`` likewise times the Gluon kernel with
that private variant (``_gluon_opts``).

TFLOPS = 2 * h * (attended keys) * (512 + 512) (FlashMLA's count for MODEL1); bytes = unique rows read x bytes a row
+ q + out. Decode's peer is ``flash_mla_with_kvcache`` with ``indices`` / ``extra_k_cache`` /
``extra_indices_in_kvcache`` / ``extra_topk_length`` / ``attn_sink`` on the same fp8_v4 bytes; it takes 64 or 128
heads only, so h < 64 runs on q padded to 64 heads (the ratio is against that padded call). FlashMLA applies no
inverse RoPE: ``check`` is the cosine similarity with an openmla call without it. openmla is timed with
``validate=False``; decode points are CUDA-graph replays, prefill points ``do_bench`` medians.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openmla import allocate_v4_cache, concat_and_cache_v4, gather_cache_v4, sparse_mla
from openmla.bench.context import BenchContext, add_variant, cosine
from openmla.bench.sparse import parse_tuning
from openmla.utils.perf import decode_bytes

OP = "sparse_mla v4"
D = 512
SCALE = 512**-0.5
FP8_ROW, BF16_ROW = 584, 1024
POOL_GIB = 1.0  # each decode cache on the GPU at least (larger than L2)
PEER_HEADS = (64, 128)  # the head counts FlashMLA's sparse decode takes
# the run measures the random-row gather rate of fp8_v4 rows (576 data + 8 exponent bytes, read as one 584-byte row;
# column frac_gather of the decode points, whose window rows are in order: it can pass 1)
GATHER_ROW_BYTES = (FP8_ROW,)
NUM_POS = 1 << 16  # rows of the cos / sin table (positions drawn below it)
PREFILL_RATIO = 4  # compressed entries per token of a paged prefill point (CSA)

_DECODE = [f"v4decode h{h} b128 q2 w128 k{k}" + e for h, k in ((64, 512), (128, 1024)) for e in ("", " eb2 elen")]
_SMALL = [f"v4decode h{h} b128 q2 w128 k512" for h in (8, 16, 32)]
_PREFILL = ["v4prefill h64 t4096 k512", "v4prefill h128 t4096 k1024"] + [
    f"v4prefill h{h} t4096 k{k} w128 paged" + e for h, k in ((64, 512), (128, 1024)) for e in ("", " gather")
]
PRESETS = {
    "default": _DECODE + _SMALL + ["v4decode h64 b128 q2 w128 k512 norope", "v4decode h64 b1 q2 w128 k512"] + _PREFILL,
    "quick": ["v4decode h64 b128 q2 w128 k512", "v4decode h128 b128 q2 w128 k1024", "v4decode h16 b128 q2 w128 k512",
              "v4prefill h128 t4096 k1024", "v4prefill h64 t4096 k512 w128 paged",
              "v4prefill h64 t4096 k512 w128 paged gather"],
    # the Triton kernel and the Gluon kernel's private variants beside the default (the Gluon kernel on sm90):
    # "lazy" everywhere, "staged" (+ "lazy") on the fp8_v4 points
    "kernels": [f"{p} {k}" for p in ("v4decode h64 b128 q2 w128 k512", "v4decode h128 b128 q2 w128 k1024",
                                      "v4decode h16 b128 q2 w128 k512", "v4decode h64 b1 q2 w128 k512",
                                      "v4prefill h64 t4096 k512 w128 paged")
                for k in ("triton", "g:lazy", "g:staged", "g:staged+lazy")]
               + [f"{p} {k}" for p in ("v4decode h64 b128 q2 w128 k512 bf16", "v4prefill h128 t4096 k1024",
                                        "v4prefill h64 t4096 k512 w128 paged gather")
                  for k in ("triton", "g:lazy")],
    # the asymmetric consumers ("asym", the default for bf16 rows since stop 48) beside the plain code they replaced,
    # and on fp8_v4 rows (where the plain code stays)
    "asym": [f"{p} g:plain" for p in ("v4prefill h128 t4096 k1024", "v4prefill h64 t4096 k512",
                                      "v4prefill h64 t4096 k512 w128 paged gather",
                                      "v4decode h64 b128 q2 w128 k512 bf16")]
            + [f"{p} g:asym+lazy" for p in ("v4decode h64 b128 q2 w128 k512", "v4decode h128 b128 q2 w128 k1024",
                                            "v4prefill h64 t4096 k512 w128 paged")],
    # H <= 32: the narrow kernel (the default there) beside the 64-head one ("wide")
    "narrow": [f"v4decode h{h} b{b} q2 w128 k512 g:wide" for h in (8, 16, 32) for b in (1, 128)]
              + ["v4decode h16 b128 q2 w128 k512 eb2 elen g:wide", "v4decode h16 b128 q1 w128 k512 g:wide"],
    # the fp8_v4 staging default ("ring" at h8 / h16) beside the plain code, and the 64-head kernel's private
    # "staged" (+ "lazy"; the default at 33-64 heads in stops 54-55) beside its default (the plain code)
    "staging": [f"v4decode h{h} b128 q2 w128 k512 g:plain" for h in (8, 16)]
               + ["v4decode h16 b128 q2 w128 k512 eb2 elen g:plain"]
               + [f"{p} g:{g}" for p in ("v4decode h64 b128 q2 w128 k512", "v4prefill h64 t4096 k512 w128 paged")
                  for g in ("staged", "staged+lazy")],
    "tiny": ["v4decode h2 b2 q2 w8 k8 wb16 eb4", "v4decode h3 b1 q1 w4 k6 eb2 elen bf16",
             "v4prefill h2 t6 k8 s32", "v4prefill h2 t6 k8 w4 paged gather"],  # CPU (interpreter)
    # tuning: tiles (32x8x2 spills 8-16 bytes at 64 heads offline, the others none; 16-key tiles at 16 heads take
    # 61 KB of shared memory instead of 107: 3 programs an SM) and split counts
    "sweep": [f"v4decode h{h} b128 q2 w128 k{k} tile{t}" for h, k in ((64, 512), (128, 1024))
              for t in ("32x8x3", "16x8x2", "32x8x2")]
             + [f"v4decode h{h} b128 q2 w128 k512 tile{t}" for h in (16, 32)
                for t in ("32x4x2", "16x4x2", "16x4x3", "32x8x2", "16x8x2")]
             + [f"v4decode h64 b{b} q2 w128 k512 split{n}" for b in (1, 8) for n in (1, 4, 8, 16)],
}  # fmt: skip


@dataclass(frozen=True)
class V4AttnShape:
    mode: str  # "v4decode" or "v4prefill"
    h: int
    k: int
    b: int = 1
    q: int = 2
    w: int = 128
    wb: int = 256
    eb: int = 64
    t: int = 0
    s: int = 32768
    elen: bool = False
    dtype: str = "fp8"  # the caches' ("bf16": both bf16; prefill workspace points: bf16)
    rope: bool = True
    paged: bool = False
    gather: bool = False  # paged prefill through a gathered bf16 workspace
    tile: tuple = ()
    split: int = 0
    kernel: str = ""  # "gluon" / "triton": also time that kernel (provider of the same name)
    gopts: tuple = ()  # "g:lazy": the Gluon kernel with those variants (provider "g:<variants>"; g:plain: none)
    spec: str = ""

    def __str__(self) -> str:
        return self.spec

    @property
    def rows(self) -> int:
        return self.b * self.q if self.mode == "v4decode" else self.t


def parse(spec: str) -> V4AttnShape:
    """``"v4decode h64 b128 q2 w128 k512"`` / ``"v4prefill h128 t4096 k1024"`` -> :class:`V4AttnShape`."""
    toks = spec.replace(",", " ").split()
    bad = ValueError(
        f"bad sparse_v4 shape {spec!r}: want 'v4decode h<heads> b<batch> [q<qlen>] [w<window>] k<topk> [wb<n>] "
        "[eb<n>] [elen] [bf16] [norope]' or 'v4prefill h<heads> t<queries> k<topk> [s<rows>] [w<window> paged]', "
        "optional tile<N>x<warps>x<stages>, split<n>, gluon|triton"
    )
    if not toks or toks[0] not in ("v4decode", "v4prefill"):
        raise bad
    f: dict = {"mode": toks[0]}
    flags = {"elen": ("elen", True), "bf16": ("dtype", "bf16"), "fp8": ("dtype", "fp8"), "norope": ("rope", False),
             "paged": ("paged", True), "gather": ("gather", True)}  # fmt: skip
    try:
        for tok in toks[1:]:
            if tok in flags:
                f[flags[tok][0]] = flags[tok][1]
            elif tok in ("gluon", "triton"):
                f["kernel"] = tok
            elif tok.startswith("g:") and len(tok) > 2:
                f["kernel"], f["gopts"] = "gluon", tuple(tok[2:].split("+"))
            elif parse_tuning(tok, f):
                pass
            elif tok[:2] in ("wb", "eb"):
                f[tok[:2]] = int(tok[2:])
            elif tok[0] in "hkbqtsw":
                f[tok[0]] = int(tok[1:])
            else:
                raise ValueError(tok)
        shape = V4AttnShape(**f, spec=" ".join(toks))
    except (ValueError, TypeError, IndexError):
        raise bad from None
    if min(shape.h, shape.k, shape.b, shape.q, shape.w, shape.wb, shape.eb, shape.s) < 1:
        raise bad
    if shape.mode == "v4prefill" and (shape.t < 1 or shape.elen or shape.dtype != "fp8" or not shape.rope):
        raise bad
    if shape.mode == "v4decode" and (shape.t or shape.paged or shape.gather) or (shape.gather and not shape.paged):
        raise bad
    return shape


def _fill(cache, slots: int, kv_dtype: str, dev) -> None:
    """Random rows (~N(0, 1)) in every slot, written by openmla's V4 cache writer a chunk at a time."""
    chunk = 1 << 16
    for s0 in range(0, slots, chunk):
        n = min(chunk, slots - s0)
        rows = torch.randn(n, D, device=dev, dtype=torch.bfloat16)
        slot = torch.arange(s0, s0 + n, device=dev, dtype=torch.int64)
        concat_and_cache_v4(rows[:, :448], rows[:, 448:], cache, slot, kv_cache_dtype=kv_dtype, validate=False)


def _cache(min_slots: int, block: int, kv_dtype: str, dev, pool: bool):
    slots = min_slots
    if pool and dev.type == "cuda":
        slots = max(slots, int(POOL_GIB * 2**30 / (FP8_ROW if kv_dtype == "fp8_v4" else BF16_ROW)))
    blocks = -(-slots // block)
    cache = allocate_v4_cache(blocks, block, kv_cache_dtype=kv_dtype, device=dev)
    _fill(cache, blocks * block, kv_dtype, dev)
    return cache, blocks * block


def _rope(rows: int, dev, gen):
    inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32, device=dev) / 64))
    ang = torch.arange(NUM_POS, dtype=torch.float32, device=dev)[:, None] * inv[None, :]
    cs = torch.cat([ang.cos(), ang.sin()], dim=1)
    return torch.randint(0, NUM_POS, (rows,), device=dev, dtype=torch.int32, generator=gen), cs


def _priv(shape: V4AttnShape) -> dict:
    """validate=False (the engine's hot path: no host sync a call) and the shape's private tuning variants."""
    priv = {"validate": False}
    if shape.tile:
        priv["_tiling_override"] = shape.tile
    if shape.split:
        priv["_num_splits_override"] = shape.split
    return priv


def _kernel_provider(shape: V4AttnShape) -> str:
    """The provider name of ``shape.kernel``'s rows: ``g:<variants>`` for Gluon variants, else the kernel's name."""
    return f"g:{'+'.join(shape.gopts)}" if shape.gopts else shape.kernel


def _add_kernel(shape: V4AttnShape, ctx: BenchContext, fns: dict, call, out: torch.Tensor, lse: torch.Tensor) -> None:
    """``shape.kernel`` (``_kernel=``) on the same inputs into its own buffers, as provider ``fns[shape.kernel]``;
    ``call(out, lse, **kw)`` runs the point's openmla call. A note when refused or off the default's output."""
    if not shape.kernel:
        return
    out_k, lse_k = torch.empty_like(out), torch.empty_like(lse)
    kw = {"_gluon_opts": () if shape.gopts == ("plain",) else shape.gopts} if shape.gopts else {}

    def other():
        call(out_k, lse_k, _kernel=shape.kernel, **kw)

    add_variant(ctx, fns, _kernel_provider(shape), other, out, out_k, shape)


def _run_decode(shape: V4AttnShape, ctx: BenchContext) -> list[dict]:
    dev = ctx.device
    h, b, ql, w, k, rows = shape.h, shape.b, shape.q, shape.w, shape.k, shape.rows
    kv_dtype = "fp8_v4" if shape.dtype == "fp8" else "auto"
    torch.manual_seed(0)
    g = torch.Generator(device=dev).manual_seed(1)
    cache, slots = _cache(b * (w + ql), shape.wb, kv_dtype, dev, True)
    ecache, e_slots = _cache(rows * k if dev.type != "cuda" else 1, shape.eb, kv_dtype, dev, True)
    # the window: each request's last w + qlen - 1 tokens are consecutive slots from a random start
    start = torch.randint(0, slots - (w + ql - 1) + 1, (b,), device=dev, generator=g)
    off = torch.arange(ql, device=dev)[:, None] + torch.arange(w, device=dev)[None, :]  # [qlen, w]
    idx = (start[:, None, None] + off[None]).reshape(rows, w).int()
    eidx = torch.randint(0, e_slots, (rows, k), device=dev, dtype=torch.int32, generator=g)
    elen_b = torch.randint(1, k + 1, (b,), device=dev, dtype=torch.int32, generator=g) if shape.elen else None
    elen = elen_b.repeat_interleave(ql) if shape.elen else None
    sink = torch.randn(h, device=dev, generator=g)
    pos, cs = _rope(rows, dev, g)
    q = torch.randn(rows, h, D, device=dev, dtype=torch.bfloat16)
    out = torch.empty(rows, h, D, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(rows, h, dtype=torch.float32, device=dev)
    kw = dict(kv_cache_dtype=kv_dtype, attn_sink=sink, extra_kv_cache=ecache, extra_indices=eidx,
              extra_topk_length=elen, **_priv(shape))  # fmt: skip
    rope = dict(inv_rope_positions=pos, cos_sin_cache=cs) if shape.rope else {}

    def call(o, ls, **k):
        sparse_mla(q, cache, idx, SCALE, out=o, lse=ls, **kw, **rope, **k)

    def own():
        call(out, lse)

    own()
    fns, check = {"openmla": own}, None
    _add_kernel(shape, ctx, fns, call, out, lse)
    if ctx.baseline is not None:  # --against: the older openmla's default on the same inputs, its own buffers
        out_o, lse_o = torch.empty_like(out), torch.empty_like(lse)

        def before():
            ctx.baseline.sparse_mla(q, cache, idx, SCALE, out=out_o, lse=lse_o, **kw, **rope)

        add_variant(ctx, fns, "before", before, out, out_o, shape)
    fm = ctx.peer("flash_mla")
    if fm is not None:
        try:
            hp = next((p for p in PEER_HEADS if p >= h), None)
            if hp is None or kv_dtype != "fp8_v4":
                raise ValueError(f"FlashMLA's sparse decode takes {PEER_HEADS} heads and an fp8 cache")
            plain = sparse_mla(q, cache, idx, SCALE, **kw)[0]  # no inverse RoPE, as FlashMLA
            qp = torch.zeros(b, ql, hp, D, device=dev, dtype=torch.bfloat16)
            qp[:, :, :h] = q.view(b, ql, h, D)
            sp = torch.zeros(hp, device=dev)
            sp[:h] = sink
            kc = cache.view(torch.float8_e4m3fn).unsqueeze(2)
            ekc = ecache.view(torch.float8_e4m3fn).unsqueeze(2)
            ip, eip = idx.view(b, ql, w), eidx.view(b, ql, k)
            meta = fm.get_mla_metadata()[0]

            def peer():
                return fm.flash_mla_with_kvcache(qp, kc, None, None, D, meta, softmax_scale=SCALE, is_fp8_kvcache=True,
                                                 indices=ip, attn_sink=sp, extra_k_cache=ekc,
                                                 extra_indices_in_kvcache=eip, extra_topk_length=elen_b)  # fmt: skip

            got = peer()[0][:, :, :h].reshape(rows, h, D)
            check = cosine(plain, got)
            fns["flashmla"] = peer
        except Exception as exc:  # the peer refuses this shape: its column stays empty
            ctx.note(f"# flashmla failed at {shape}: {type(exc).__name__}: {exc}".splitlines()[0])
    timings = ctx.time(fns, graph=True)
    e_keys = float(elen.sum()) if shape.elen else rows * k
    keys = rows * w + e_keys
    row_bytes = FP8_ROW if kv_dtype == "fp8_v4" else BF16_ROW
    nbytes = decode_bytes(int(b * (w + ql - 1) + e_keys), row_bytes, rows, h, d_qk=D, d_v=D)
    return ctx.rows(OP, str(shape), timings, flops=2.0 * h * keys * 2 * D, nbytes=nbytes, dtype=shape.dtype,
                    peer="flashmla", check=check, gather_bytes=FP8_ROW if kv_dtype == "fp8_v4" else None)  # fmt: skip


def _run_prefill_ws(shape: V4AttnShape, ctx: BenchContext) -> list[dict]:
    dev = ctx.device
    h, k, t, s = shape.h, shape.k, shape.t, shape.s
    torch.manual_seed(0)
    g = torch.Generator(device=dev).manual_seed(1)
    ws = torch.randn(s, D, device=dev, dtype=torch.bfloat16)
    idx = torch.randint(0, s, (t, k), device=dev, dtype=torch.int32, generator=g)
    q = torch.randn(t, h, D, device=dev, dtype=torch.bfloat16)
    sink = torch.randn(h, device=dev, generator=g)
    pos, cs = _rope(t, dev, g)
    out = torch.empty(t, h, D, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(t, h, dtype=torch.float32, device=dev)
    kv = ws.view(s, 1, D)

    def call(o, ls, **k):
        sparse_mla(q, kv, idx, SCALE, attn_sink=sink, inv_rope_positions=pos, cos_sin_cache=cs, out=o, lse=ls,
                   **_priv(shape), **k)  # fmt: skip

    def own():
        call(out, lse)

    own()
    fns, check = {"openmla": own}, None
    _add_kernel(shape, ctx, fns, call, out, lse)
    fm = ctx.peer("flash_mla")
    if fm is not None:
        try:
            plain = sparse_mla(q, kv, idx, SCALE, attn_sink=sink)[0]
            i3 = idx.unsqueeze(1)

            def peer():
                return fm.flash_mla_sparse_fwd(q, kv, i3, SCALE, D, attn_sink=sink)

            check = cosine(plain, peer()[0])
            fns["flashmla"] = peer
        except Exception as exc:
            ctx.note(f"# flashmla failed at {shape}: {type(exc).__name__}: {exc}".splitlines()[0])
    timings = ctx.time(fns, graph=False)
    nbytes = decode_bytes(min(s, t * k), BF16_ROW, t, h, d_qk=D, d_v=D)
    return ctx.rows(OP, str(shape), timings, flops=2.0 * h * t * k * 2 * D, nbytes=nbytes, dtype="bf16",
                    peer="flashmla", check=check)  # fmt: skip


def _run_prefill_paged(shape: V4AttnShape, ctx: BenchContext) -> list[dict]:
    dev = ctx.device
    h, k, t, w = shape.h, shape.k, shape.t, shape.w
    n_c = max(1, t // PREFILL_RATIO)
    torch.manual_seed(0)
    g = torch.Generator(device=dev).manual_seed(1)
    cache = _cache(t, shape.wb, "fp8_v4", dev, False)[0]
    ecache = _cache(n_c, shape.eb, "fp8_v4", dev, False)[0]
    # one request: token i at slot i of the SWA cache (blocks in order), compressed entry j at slot j
    i = torch.arange(t, device=dev)
    win = i[:, None] - torch.arange(w, device=dev)[None, :]  # [t, w], newest first: the lens valid ones lead
    lens = torch.clamp(i + 1, max=w).int()
    idx = torch.where(win >= 0, win, -1).int()
    kk = min(k, n_c)
    eidx = torch.argsort(torch.rand(t, n_c, device=dev, generator=g), dim=1)[:, :kk].int()
    q = torch.randn(t, h, D, device=dev, dtype=torch.bfloat16)
    sink = torch.randn(h, device=dev, generator=g)
    pos, cs = _rope(t, dev, g)
    out = torch.empty(t, h, D, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(t, h, dtype=torch.float32, device=dev)
    rope = dict(inv_rope_positions=pos, cos_sin_cache=cs)
    # the workspace route: rows [0, n_c) the compressed entries, then the t tokens; one index list per query
    ws = torch.empty(n_c + t, D, dtype=torch.bfloat16, device=dev)
    bt = torch.arange(-(-t // shape.wb), device=dev, dtype=torch.int32)[None, :]
    ebt = torch.arange(-(-n_c // shape.eb), device=dev, dtype=torch.int32)[None, :]
    seq = torch.tensor([t], device=dev, dtype=torch.int32)
    e_seq = torch.tensor([n_c], device=dev, dtype=torch.int32)
    wlens = (lens + kk).int()
    widx = torch.cat([eidx, torch.where(idx >= 0, idx + n_c, -1).int()], 1)  # the first wlens entries are valid

    def call_paged(o, ls, **k):
        sparse_mla(q, cache, idx, SCALE, kv_cache_dtype="fp8_v4", topk_length=lens, attn_sink=sink,
                   extra_kv_cache=ecache, extra_indices=eidx, out=o, lse=ls, **rope, **_priv(shape), **k)  # fmt: skip

    def call_ws(o, ls, **k):
        gather_cache_v4(ecache, ebt, e_seq, out=ws, validate=False)
        gather_cache_v4(cache, bt, seq, out=ws[n_c:], validate=False)
        sparse_mla(q, ws.view(-1, 1, D), widx, SCALE, topk_length=wlens, attn_sink=sink, out=o, lse=ls, **rope,
                   **_priv(shape), **k)  # fmt: skip

    def own():
        call_paged(out, lse)

    def own_ws():
        call_ws(out, lse)

    own()
    ref = out.clone()
    own_ws()
    agree = cosine(ref, out)  # the two routes attend to the same keys (in another order)
    if agree < 0.999:
        ctx.note(f"# {shape}: the paged and gathered routes differ (cosine {agree:.6f})")
    fns, check = {"openmla": own_ws if shape.gather else own}, None
    _add_kernel(shape, ctx, fns, call_ws if shape.gather else call_paged, out, lse)
    fm = ctx.peer("flash_mla")
    if fm is not None:
        try:
            kv, i3 = ws.view(-1, 1, D), widx.unsqueeze(1)

            def peer():
                return fm.flash_mla_sparse_fwd(q, kv, i3, SCALE, D, attn_sink=sink, topk_length=wlens)

            plain = sparse_mla(q, kv, widx, SCALE, topk_length=wlens, attn_sink=sink)[0]  # no inverse RoPE
            check = cosine(plain, peer()[0])
            fns["flashmla"] = peer
        except Exception as exc:
            ctx.note(f"# flashmla failed at {shape}: {type(exc).__name__}: {exc}".splitlines()[0])
    timings = ctx.time(fns, graph=False)
    keys = float(wlens.sum())
    own_bytes = FP8_ROW + 2 * BF16_ROW if shape.gather else FP8_ROW  # the gather writes and reads the workspace
    nb = {"openmla": decode_bytes(t + n_c, own_bytes, t, h, d_qk=D, d_v=D),
          "flashmla": decode_bytes(t + n_c, BF16_ROW, t, h, d_qk=D, d_v=D)}  # fmt: skip
    dt = {"openmla": "fp8", "flashmla": "bf16"}
    if shape.kernel:  # the other kernel runs the same route
        nb[_kernel_provider(shape)], dt[_kernel_provider(shape)] = nb["openmla"], dt["openmla"]
    return ctx.rows(OP, str(shape), timings, flops=2.0 * h * keys * 2 * D, nbytes=nb, dtype=dt, peer="flashmla",
                    check=check)  # fmt: skip


def run(shape: V4AttnShape, ctx: BenchContext) -> list[dict]:
    """Time one point: openmla and, when importable, FlashMLA, alternating; returns its rows."""
    if shape.mode == "v4decode":
        return _run_decode(shape, ctx)
    return _run_prefill_paged(shape, ctx) if shape.paged else _run_prefill_ws(shape, ctx)
