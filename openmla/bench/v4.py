"""Family ``v4``: the DeepSeek V4 helper ops: fp8_v4 cache write / gather, the compressor, inverse RoPE, index sets.

A shape spec is ``<op> <fields>``:
    ``write t<tokens>``: ``concat_and_cache_v4`` of T rows into an fp8_v4 cache (64-token blocks);
        bytes = T * (512 * 2 read + 584 written).
    ``gather b<requests> s<keys>``: ``gather_cache_v4`` of every request's rows to bf16; bytes = B * S * (584 + 1024).
    ``compress r<ratio> b<requests> q<qlen> s<seq_len>``: one ``compress_kv`` step (d = 512, overlap for ratio 4)
        writing fp8_v4 entries; bytes = inputs (2 x T x coff*512 bf16) + per entry its rows from earlier steps
        (``max(coff*r - q, 0)`` x 512 fp32 kv + score) and 584 + the state rows the step writes.
    ``inv_rope t<tokens> h<heads>``: ``inverse_rope_rows`` on bf16 ``[T, H, 512]``; bytes = T * H * 64 * 2 * 2.
    ``swa b<requests> q<qlen> s<seq_len> [w<window>]``: ``swa_indices``; bytes = T * W * 4 (the rows written).
    ``norm_rope t<tokens> h<heads>``: ``rms_norm_rope`` in place on V4's q heads, bf16 ``[T, H, 512]`` (the
        unweighted norm, then RoPE), beside peer ``torch``: the torch formulation it replaces in the layer (15-odd
        kernels); bytes = T * H * 512 * 2 * 2.
No FLOPs are counted (memory-bound helpers: read the GB/s column). Timed validate=False (the engine's hot path)
under CUDA-graph replay; no other peer (FlashMLA has none of these as a separate op).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import openmla
from openmla.bench.context import BenchContext, cosine

PRESETS = {
    "default": ["write t4096", "gather b32 s4096", "compress r4 b128 q1 s8192", "compress r128 b128 q1 s8192",
                "compress r4 b1 q8192 s8192", "compress r128 b1 q8192 s8192", "inv_rope t128 h64",
                "inv_rope t128 h128", "swa b128 q2 s8192 w128", "norm_rope t64 h64", "norm_rope t128 h64",
                "norm_rope t8192 h64"],
    "quick": ["write t4096", "compress r4 b128 q1 s8192", "inv_rope t128 h128", "norm_rope t128 h64"],
    "tiny": ["write t16", "gather b2 s20", "compress r4 b2 q3 s8", "inv_rope t3 h2", "swa b2 q2 s9 w4",
             "norm_rope t3 h2"],
}  # fmt: skip
OP = "v4 ops (concat_and_cache_v4, gather_cache_v4, compress_kv, inverse_rope_rows, swa_indices, rms_norm_rope)"
OPS = ("write", "gather", "compress", "inv_rope", "swa", "norm_rope")
_DEFAULTS = {"t": 0, "b": 1, "s": 0, "q": 1, "r": 4, "h": 1, "w": 128}


@dataclass(frozen=True)
class V4Shape:
    op: str
    f: dict = field(default_factory=dict, compare=False)
    spec: str = ""

    def __str__(self) -> str:
        return self.spec

    def __getattr__(self, k):
        if k in _DEFAULTS:
            return self.f.get(k, _DEFAULTS[k])
        raise AttributeError(k)


def parse(spec: str) -> V4Shape:
    """``"compress r4 b128 q1 s8192"`` -> :class:`V4Shape` (ValueError on a bad spec)."""
    toks = spec.split()
    if not toks or toks[0] not in OPS:
        raise ValueError(f"bad v4 shape {spec!r}: want '<{'|'.join(OPS)}> <fields>'")
    f = {}
    for tok in toks[1:]:
        if tok[0] not in _DEFAULTS or not tok[1:].isdigit() or int(tok[1:]) < 1:
            raise ValueError(f"bad v4 shape {spec!r}: field {tok!r} (t, b, s, q, r, h, w followed by an int >= 1)")
        f[tok[0]] = int(tok[1:])
    shape = V4Shape(toks[0], f, " ".join(toks))
    if shape.op in ("compress", "swa") and shape.s < shape.q:
        raise ValueError(f"bad v4 shape {spec!r}: s (seq_len) must be >= q")
    return shape


def _batch(b, q, s, dev):
    qsl = torch.arange(b + 1, dtype=torch.int32, device=dev) * q
    return qsl, torch.full((b,), s, dtype=torch.int32, device=dev)


def run(shape: V4Shape, ctx: BenchContext) -> list[dict]:
    """Time one point (openmla only); returns its row."""
    dev, op = ctx.device, shape.op
    torch.manual_seed(0)
    bs = 64
    if op == "write":
        T = shape.t
        cache = openmla.allocate_v4_cache(T // bs + 1, bs, device=dev)
        kv_c = torch.randn(T, 448, device=dev, dtype=torch.bfloat16)
        k_pe = torch.randn(T, 64, device=dev, dtype=torch.bfloat16)
        slots = torch.randperm((T // bs + 1) * bs, device=dev)[:T]
        openmla.concat_and_cache_v4(kv_c, k_pe, cache, slots)

        def fn():
            openmla.concat_and_cache_v4(kv_c, k_pe, cache, slots, validate=False)

        nbytes, dtype = T * (512 * 2 + 584), "fp8"
    elif op == "gather":
        b, s = shape.b, shape.s
        nbk = b * ((s + bs - 1) // bs)
        cache = openmla.allocate_v4_cache(nbk, bs, device=dev)
        table = torch.randperm(nbk, device=dev).view(b, -1).int()
        lens = torch.full((b,), s, dtype=torch.int32, device=dev)
        out = torch.empty(b * s, 512, dtype=torch.bfloat16, device=dev)
        openmla.gather_cache_v4(cache, table, lens, out=out)

        def fn():
            openmla.gather_cache_v4(cache, table, lens, out=out, validate=False)

        nbytes, dtype = b * s * (584 + 1024), "fp8"
    elif op == "compress":
        r, b, q, s = shape.r, shape.b, shape.q, shape.s
        coff, T = (2 if r == 4 else 1), b * q
        kv = torch.randn(T, coff * 512, device=dev, dtype=torch.bfloat16)
        score = torch.randn(T, coff * 512, device=dev, dtype=torch.bfloat16)
        state = openmla.allocate_compressor_state(b, r, 512, overlap=coff == 2, device=dev)
        bs_c = max(bs // r, 1) if r <= bs else 2
        W = s // r // bs_c + 1
        cache = openmla.allocate_v4_cache(b * W, bs_c, device=dev)
        table = torch.arange(b * W, dtype=torch.int32, device=dev).view(b, W)
        inv_freq = 1.0 / 160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32, device=dev) / 64)
        ang = torch.arange(s + 1, dtype=torch.float32, device=dev)[:, None] * inv_freq
        cos_sin = torch.cat([ang.cos(), ang.sin()], dim=1)
        weight = torch.ones(512, device=dev)
        qsl, seq = _batch(b, q, s, dev)
        slots = torch.arange(b, dtype=torch.int32, device=dev)
        args = (kv, score, state, slots, qsl, seq, weight, cos_sin, cache, table)
        openmla.compress_kv(*args, ratio=r)

        def fn():
            openmla.compress_kv(*args, ratio=r, validate=False)

        entries = b * (s // r - (s - q) // r)
        ring = coff * r
        state_rows = max(ring - q, 0)  # an entry's rows from earlier steps (read as fp32 kv + score)
        nbytes = 2 * T * coff * 512 * 2 + entries * (state_rows * 512 * 8 + 584) + b * min(q, ring) * coff * 512 * 8
        dtype = "fp8"
    elif op == "inv_rope":
        T, h = shape.t, shape.h
        o = torch.randn(T, h, 512, device=dev, dtype=torch.bfloat16)
        pos = torch.randint(0, 4096, (T,), device=dev)
        ang = torch.arange(4096, dtype=torch.float32, device=dev)[:, None] * torch.rand(32, device=dev)
        table = torch.cat([ang.cos(), ang.sin()], dim=1)
        openmla.inverse_rope_rows(o, pos, table)

        def fn():
            openmla.inverse_rope_rows(o, pos, table, validate=False)

        nbytes, dtype = T * h * 64 * 2 * 2 + T * 64 * 4, "bf16"
    elif op == "norm_rope":
        return _run_norm_rope(shape, ctx)
    else:  # swa
        b, q, s, w = shape.b, shape.q, shape.s, shape.w
        qsl, seq = _batch(b, q, s, dev)
        nbk = (s + bs - 1) // bs
        table = torch.randperm(b * nbk, device=dev).view(b, nbk).int()
        T = b * q
        out_i = torch.empty(T, w, dtype=torch.int32, device=dev)
        out_l = torch.empty(T, dtype=torch.int32, device=dev)
        kw = dict(block_size=bs, window=w, num_tokens=T, out_indices=out_i, out_lens=out_l)
        openmla.swa_indices(qsl, seq, table, **kw)

        def fn():
            openmla.swa_indices(qsl, seq, table, validate=False, **kw)

        nbytes, dtype = T * w * 4, "bf16"
    timings = ctx.time({"openmla": fn}, graph=True)
    return ctx.rows(op, str(shape), timings, flops=0.0, nbytes=nbytes, dtype=dtype)


def _run_norm_rope(shape: V4Shape, ctx: BenchContext) -> list[dict]:
    """``rms_norm_rope`` on V4 q heads in place, beside the torch formulation the layer had (peer "torch")."""
    dev, T, h = ctx.device, shape.t, shape.h
    x = torch.randn(T, h, 512, device=dev, dtype=torch.bfloat16)
    pos = torch.randint(0, 4096, (T,), device=dev)
    ang = torch.arange(4096, dtype=torch.float32, device=dev)[:, None] * torch.rand(32, device=dev)
    table = torch.cat([ang.cos(), ang.sin()], dim=1)
    y = x.clone()

    def fn():  # in place on a copy of x that the torch path does not read
        openmla.rms_norm_rope(y, 1e-6, positions=pos, cos_sin_cache=table, out=y, validate=False)

    def torch_q():  # the unweighted norm, then GPT-J RoPE on the last 64 dims in fp32 (the layer's code before)
        q = x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6).to(x.dtype)
        cs = table[pos]
        cos, sin = cs[:, None, :32], cs[:, None, 32:]
        rope = q[..., -64:].float()
        a, b = rope[..., 0::2], rope[..., 1::2]
        rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        return torch.cat([q[..., :-64], rot.to(q.dtype)], dim=-1)

    fn()
    want = openmla.rms_norm_rope(x, 1e-6, positions=pos, cos_sin_cache=table)
    check = cosine(want, torch_q())
    timings = ctx.time({"openmla": fn, "torch": torch_q}, graph=True)
    return ctx.rows("rms_norm_rope", str(shape), timings, flops=0.0, nbytes=T * h * 512 * 2 * 2, dtype="bf16",
                    peer="torch", check=check)  # fmt: skip
