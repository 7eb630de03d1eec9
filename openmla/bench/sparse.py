"""Family ``sparse``: sparse MLA over top-k slot lists (``openmla.sparse_mla``) beside FlashMLA's sparse kernels.

A shape spec is space-separated fields: ``decode h<heads> b<batch> [q<qlen>] k<topk> [fp8|bf16]`` (b x qlen query
rows, each with its own top-k list, the 656-byte ``fp8_ds_mla`` cache by default) or ``prefill h<heads> t<queries>
k<topk> [s<kv rows>]`` (a bf16 cache of s rows, default 32768); an optional ``tile<BLOCK_N>x<warps>x<stages>``,
``split<n>`` or ``f16dq`` (fp8 rows dequantised in fp16) times one of ``sparse_mla``'s private variants (tuning);
``gluon`` / ``triton`` also time that kernel (``_kernel=``: the sm90 Gluon kernel of openmla/ops/gluon/sparse.py, or
the portable Triton one) on the same inputs in the same rounds, as provider ``gluon`` / ``triton`` beside
``openmla`` (``sparse_mla``'s default pick; ``split<n>`` applies to both); ``g:<variant>[+<variant>...]`` times the
Gluon kernel with those private variants (``_gluon_opts``: ``nanpack``, ``lazy``, ``staged``, ``wide``) as provider
``g:<variants>`` beside the default. Example: ``decode h128 b128 q2 k2048``, ``decode h64 b64 q1 k2048 triton``,
``decode h128 b128 q1 k2048 g:staged+nanpack``.

Each point: slots drawn uniformly (seeded) from a cache of at least 2 GiB of 64-token blocks on the GPU (decode;
larger than L2), no -1 entries, every top-k entry valid. TFLOPS = 2 * h * rows * topk * (576 + 512) (FlashMLA's
count); bytes = rows * topk * bytes a row + q + out. Peers (``flash_mla``, optional): decode runs
``flash_mla_with_kvcache`` with ``indices`` on the same fp8 bytes; it takes 64 or 128 heads only, so h < 64 is
timed on q padded to 64 heads (the FLOP count stays the real one, and the ratio is against that padded call);
prefill runs ``flash_mla_sparse_fwd`` on the same bf16 rows. ``check`` is the cosine similarity of the outputs.
Decode points are CUDA-graph replays, prefill points ``do_bench`` medians.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import openmla
from openmla.bench.context import BenchContext, add_variant, cosine
from openmla.utils.perf import decode_bytes, decode_flops

OP = "sparse_mla"
BLOCK = 64
D_QK, D_V = 576, 512
ROW_BYTES = {"fp8": 656, "bf16": 2 * D_QK}
SCALE = 192**-0.5
POOL_GIB = 2.0
PEER_HEADS = (64, 128)  # the head counts FlashMLA's sparse decode takes
GATHER_ROW_BYTES = (ROW_BYTES["fp8"],)  # the run measures the random-row gather rate of these (column frac_gather)

_DECODE = [f"decode h{h} b{b} q{q} k2048" for q in (1, 2) for h in (16, 32, 64, 128) for b in (1, 64, 128)]
PRESETS = {
    "default": _DECODE + ["prefill h128 t4096 k2048"],  # issue 29's table
    "quick": ["decode h128 b128 q1 k2048", "decode h64 b64 q1 k2048", "decode h16 b128 q1 k2048",
              "decode h128 b1 q1 k2048", "prefill h128 t4096 k2048"],
    "tiny": ["decode h2 b2 q1 k40", "decode h3 b1 q2 k20 bf16", "prefill h2 t3 k30 s64"],  # CPU (interpreter)
    # tuning: the tile variants (BLOCK_N x warps x stages) that compile for sm90 without spills, and split counts
    "sweep": [f"decode h{h} b{b} q1 k2048 tile{t}" for h, b in ((128, 128), (64, 64))
              for t in ("32x8x2", "16x8x2", "32x8x3", "64x8x2")]
             + [f"decode h16 b128 q1 k2048 tile{t}" for t in ("32x4x2", "16x4x3", "16x4x2")]
             + [f"decode h32 b128 q1 k2048 tile{t}" for t in ("32x8x2", "64x8x2")]
             + [f"prefill h128 t4096 k2048 tile{t}" for t in ("64x8x2", "32x8x2", "32x8x3", "64x8x3")]
             + [f"decode h{h} b1 q1 k2048 split{n}" for h in (16, 128) for n in (1, 4, 8, 16, 32)]
             + [f"decode h{h} b{b} q1 k2048 f16dq" for h, b in ((128, 128), (64, 64), (16, 128))],
    # the default (the Gluon kernel on sm90) beside the Triton one
    "kernels": [f"decode h{h} b{b} q{q} k2048 triton" for h, b, q in ((128, 128, 1), (64, 64, 1), (128, 1, 1),
                                                                      (64, 128, 2), (128, 64, 2), (16, 128, 1),
                                                                      (32, 128, 1), (1, 128, 1))]
               + ["decode h128 b128 q1 k2048 bf16 triton", "prefill h128 t4096 k2048 triton",
                  "prefill h64 t4096 k2048 triton"],
    # the Gluon kernel's default (gluon_sparse.DEFAULT_OPTS) beside its plain code and the variant subsets (fp8
    # points; bf16 and prefill: the plain code)
    "gopts": [f"decode {p} q1 k2048 g:{v}" for p in ("h128 b128", "h64 b64", "h16 b128", "h128 b1")
              for v in ("plain", "nanpack+lazy", "staged", "staged+nanpack")]
             + ["decode h128 b128 q1 k2048 bf16 g:plain", "prefill h128 t4096 k2048 g:plain"]
             # batch 1 (0.45x FlashMLA): forced split counts against the planner's (32 of 64 keys at h128)
             + [f"decode h{h} b1 q1 k2048 split{n}" for h in (128, 64) for n in (4, 8, 16)],
    # the asymmetric consumers ("asym", the default for bf16 rows since stop 48) beside the lazy plain code they
    # replaced, and on fp8_ds_mla rows through the plain producer (where "staged" stays)
    "asym": [f"prefill h{h} t{t} k2048 g:lazy" for h, t in ((128, 4096), (128, 1024), (64, 4096))]
            + [f"decode h{h} b{b} q1 k2048 bf16 g:lazy" for h, b in ((128, 128), (64, 128), (128, 32))]
            + [f"decode {p} q1 k2048 g:asym+nanpack+lazy" for p in ("h128 b128", "h64 b64")],
    # H <= 32: the narrow kernel (the default there) beside the 64-head one ("wide")
    "narrow": [f"decode h{h} b{b} q{q} k2048 g:wide" for h in (16, 32) for b in (1, 64, 128) for q in (1, 2)]
              + ["decode h8 b128 q1 k2048 g:wide", "decode h16 b128 q1 k2048 bf16 g:wide"],
    # the narrow kernel's plain producers (g:nanpack) beside the default, which runs the "ring" (raw half-tile stages)
    # on fp8_ds_mla rows at H <= 16 in one split
    "ring": [f"decode h{h} b{b} q{q} k2048 g:nanpack" for h in (8, 16) for b in (1, 64, 128) for q in (1, 2)],
}  # fmt: skip


@dataclass(frozen=True)
class SparseShape:
    mode: str  # "decode" or "prefill"
    h: int
    k: int
    b: int = 1
    q: int = 1
    t: int = 0  # prefill queries
    s: int = 32768  # prefill kv rows
    dtype: str = "fp8"  # the cache's (prefill: bf16)
    tile: tuple = ()
    split: int = 0
    f16dq: bool = False  # the _fp16_dequant variant (fp8 rows widened and scaled in fp16)
    kernel: str = ""  # "gluon" / "triton": also time that kernel (provider of the same name)
    gopts: tuple = ()  # the Gluon kernel's private variants (_gluon_opts; provider "g:<variants>")

    def __str__(self) -> str:
        extra = (
            (" tile" + "x".join(map(str, self.tile)) if self.tile else "")
            + (f" split{self.split}" if self.split else "")
            + (" f16dq" if self.f16dq else "")
            + (f" g:{'+'.join(self.gopts)}" if self.gopts else f" {self.kernel}" if self.kernel else "")
        )
        if self.mode == "decode":
            return f"decode h{self.h} b{self.b} q{self.q} k{self.k}{extra}"
        return f"prefill h{self.h} t{self.t} k{self.k} s{self.s}{extra}"

    @property
    def rows(self) -> int:
        return self.b * self.q if self.mode == "decode" else self.t


def parse_tuning(tok: str, f: dict) -> bool:
    """A shape token ``tile<N>x<warps>x<stages>`` or ``split<n>`` into ``f`` (``tile`` / ``split``); False for
    any other token. Raises ValueError on a malformed one."""
    if tok.startswith("tile"):
        f["tile"] = tuple(int(x) for x in tok[4:].split("x"))
        if len(f["tile"]) != 3:
            raise ValueError(tok)
        return True
    if tok.startswith("split"):
        f["split"] = int(tok[5:])
        return True
    return False


def parse(spec: str) -> SparseShape:
    """``"decode h128 b128 q2 k2048"`` / ``"prefill h128 t4096 k2048"`` -> :class:`SparseShape`."""
    toks = spec.replace(",", " ").split()
    bad = ValueError(
        f"bad sparse shape {spec!r}: want 'decode h<heads> b<batch> [q<qlen>] k<topk> [fp8|bf16]' or "
        "'prefill h<heads> t<queries> k<topk> [s<kv rows>]', optional tile<N>x<warps>x<stages>, split<n>, f16dq, "
        "gluon|triton|g:<variant>[+<variant>]|g:plain"
    )
    if not toks or toks[0] not in ("decode", "prefill"):
        raise bad
    f: dict = {"mode": toks[0]}
    if toks[0] == "prefill":
        f["dtype"] = "bf16"
    try:
        for tok in toks[1:]:
            if tok in ("fp8", "bf16"):
                f["dtype"] = tok
            elif tok == "f16dq":
                f["f16dq"] = True
            elif tok in ("gluon", "triton"):
                f["kernel"] = tok
            elif tok.startswith("g:") and len(tok) > 2:
                f["kernel"], f["gopts"] = "gluon", tuple(tok[2:].split("+"))
            elif parse_tuning(tok, f):
                pass
            elif tok[0] in "hkbqts":
                f[tok[0]] = int(tok[1:])
            else:
                raise ValueError(tok)
        shape = SparseShape(**f)
    except (ValueError, TypeError, IndexError):
        raise bad from None
    if min(shape.h, shape.k, shape.b, shape.q, shape.s) < 1 or (shape.mode == "prefill" and shape.t < 1):
        raise bad
    if shape.mode == "prefill" and shape.dtype != "bf16":
        raise ValueError(f"bad sparse shape {spec!r}: prefill points use a bf16 cache")
    return shape


def _cache(shape: SparseShape, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """(the cache openmla reads, its bf16 rows [slots, 576] or None): fp8_ds_mla bytes or bf16 rows, 64-row blocks."""
    row_bytes = ROW_BYTES[shape.dtype]
    if shape.mode == "prefill":
        slots = shape.s
    else:
        want = int(POOL_GIB * 2**30 / row_bytes) if dev.type == "cuda" else 4 * shape.k
        slots = max(shape.rows * shape.k, want)
    blocks = -(-slots // BLOCK)
    torch.manual_seed(0)
    if shape.dtype == "bf16":
        cache = torch.randn(blocks, BLOCK, D_QK, device=dev, dtype=torch.bfloat16)
        return cache, cache.view(-1, D_QK)
    # fp8_ds_mla bytes written by openmla's cache writer, a chunk of blocks at a time (bounded scratch)
    cache = torch.empty(blocks, BLOCK, 656, dtype=torch.uint8, device=dev)
    chunk = 1 << 16
    flat_slots = blocks * BLOCK
    for s0 in range(0, flat_slots, chunk):
        n = min(chunk, flat_slots - s0)
        rows = torch.randn(n, D_QK, device=dev, dtype=torch.bfloat16)
        slot = torch.arange(s0, s0 + n, device=dev, dtype=torch.int64)
        openmla.concat_and_cache_mla(rows[:, :512], rows[:, 512:], cache, slot, kv_cache_dtype="fp8_ds_mla",
                                     validate=False)  # fmt: skip
    return cache, None


def run(shape: SparseShape, ctx: BenchContext) -> list[dict]:
    """Time one point: openmla and, when importable, FlashMLA, alternating; returns its rows."""
    dev = ctx.device
    h, k, rows = shape.h, shape.k, shape.rows
    cache, rows_bf16 = _cache(shape, dev)
    slots = cache.shape[0] * cache.shape[1]
    g = torch.Generator(device=dev).manual_seed(1)
    kv_slots = slots if shape.mode == "decode" else shape.s
    idx = torch.randint(0, kv_slots, (rows, k), device=dev, dtype=torch.int32, generator=g)
    q = torch.randn(rows, h, D_QK, device=dev, dtype=torch.bfloat16)
    out = torch.empty(rows, h, D_V, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(rows, h, dtype=torch.float32, device=dev)
    kv_dtype = "fp8_ds_mla" if shape.dtype == "fp8" else "auto"
    priv = {}
    if shape.tile:
        priv["_tiling_override"] = shape.tile
    if shape.split:
        priv["_num_splits_override"] = shape.split
    if shape.f16dq:
        priv["_fp16_dequant"] = True

    def own():
        openmla.sparse_mla(q, cache, idx, SCALE, kv_cache_dtype=kv_dtype, out=out, lse=lse, **priv)

    own()
    fns, check = {"openmla": own}, None
    if shape.kernel:  # that kernel on the same inputs, into its own buffers; checked against the default's output
        out_g, lse_g = torch.empty_like(out), torch.empty_like(lse)
        priv_g = {"_num_splits_override": shape.split} if shape.split else {}
        if shape.gopts:  # "plain": the kernel without variants
            priv_g["_gluon_opts"] = () if shape.gopts == ("plain",) else shape.gopts
        name = f"g:{'+'.join(shape.gopts)}" if shape.gopts else shape.kernel

        def other():
            openmla.sparse_mla(q, cache, idx, SCALE, kv_cache_dtype=kv_dtype, out=out_g, lse=lse_g,
                               _kernel=shape.kernel, **priv_g)  # fmt: skip

        add_variant(ctx, fns, name, other, out, out_g, shape)
    if ctx.baseline is not None:  # --against: the older openmla's default on the same inputs, its own buffers
        out_o, lse_o = torch.empty_like(out), torch.empty_like(lse)

        def before():
            ctx.baseline.sparse_mla(q, cache, idx, SCALE, kv_cache_dtype=kv_dtype, out=out_o, lse=lse_o, **priv)

        add_variant(ctx, fns, "before", before, out, out_o, shape)
    fm = ctx.peer("flash_mla")
    if fm is not None:
        try:
            if shape.mode == "decode":
                hp = next((p for p in PEER_HEADS if p >= h), None)
                if hp is None or shape.dtype != "fp8":
                    raise ValueError(f"FlashMLA's sparse decode takes {PEER_HEADS} heads and an fp8 cache")
                qp = torch.zeros(shape.b, shape.q, hp, D_QK, device=dev, dtype=torch.bfloat16)
                qp[:, :, :h] = q.view(shape.b, shape.q, h, D_QK)
                ip, failed = idx.view(shape.b, shape.q, k), None
                # the same 656-byte rows as FlashMLA's own tests hold them (float8_e4m3fn), else as uint8 (vLLM)
                for kc in (cache.view(torch.float8_e4m3fn).unsqueeze(2), cache.unsqueeze(2)):
                    meta = fm.get_mla_metadata()[0]

                    def peer(kc=kc, meta=meta):
                        return fm.flash_mla_with_kvcache(qp, kc, None, None, D_V, meta, softmax_scale=SCALE,
                                                         causal=False, is_fp8_kvcache=True, indices=ip)  # fmt: skip

                    try:
                        got = peer()[0][:, :, :h].reshape(rows, h, D_V)
                        break
                    except Exception as exc:  # noqa: BLE001 - try the other dtype, report the last failure
                        failed = exc
                else:
                    raise failed
            else:
                kv3, i3 = rows_bf16.unsqueeze(1), idx.unsqueeze(1)

                def peer():
                    return fm.flash_mla_sparse_fwd(q, kv3, i3, SCALE, D_V)

                got = peer()[0]
            check = cosine(out, got)
            fns["flashmla"] = peer
        except Exception as exc:  # the peer refuses this shape: its column stays empty
            ctx.note(f"# flashmla failed at {shape}: {type(exc).__name__}: {exc}".splitlines()[0])
    timings = ctx.time(fns, graph=shape.mode == "decode")
    nbytes = decode_bytes(rows * k, ROW_BYTES[shape.dtype], rows, h)
    gather = ROW_BYTES["fp8"] if shape.mode == "decode" and shape.dtype == "fp8" else None  # rows at random slots
    return ctx.rows(OP, str(shape), timings, flops=decode_flops(rows * k, h), nbytes=nbytes, dtype=shape.dtype,
                    peer="flashmla", check=check, gather_bytes=gather)  # fmt: skip
