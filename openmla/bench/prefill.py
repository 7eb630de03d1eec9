"""Family ``prefill``: MLA prefill (``openmla.flash_attn_varlen``, d_qk 192 / d_v 128, causal) beside cuDNN SDPA.

A shape spec is ``h<heads> n<tokens a request> [t<tokens a batch>] [bf16|fp8]``: ``max(1, t // n)`` requests of
``n`` tokens (t defaults to 16384). Example: ``h128 n4096 fp8``.

Each point: q, k, v from ``randn`` (fp8: per-tensor quantised, scale = amax / 448, descales passed), timed by
``triton.testing.do_bench`` medians (prefill is not launch-bound). TFLOPS = 2 * sum(n (n + 1) / 2) * h * (192 + 128)
(``openmla.utils.perf.prefill_flops``); bytes = q + k + v + out. The peer is
``torch.nn.functional.scaled_dot_product_attention`` with the cuDNN backend, always bf16 (fp8 points are compared
with it on the bf16 values), V padded to 192 if cuDNN wants equal head dims (the FLOP count stays the real one);
``check`` is the cosine similarity of the two outputs.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass

import torch

import openmla
from openmla.bench.context import BenchContext, add_variant, cosine
from openmla.utils.perf import prefill_flops

OP = "flash_attn_varlen"
D_QK, D_V = 192, 128
SCALE = D_QK**-0.5
FP8 = torch.float8_e4m3fn

PRESETS = {
    "default": [f"h128 n{n} {d}" for n in (1024, 4096, 8192, 16384) for d in ("bf16", "fp8")],  # 16k tokens a batch
    "quick": ["h128 n4096 bf16", "h128 n4096 fp8"],
    "full": [f"h{h} n{n} {d}" for h in (16, 128) for n in (1024, 4096, 16384) for d in ("bf16", "fp8")],
    "tiny": ["h2 n32 t64 bf16", "h2 n24 t48 fp8"],  # CPU (interpreter)
    # the portable Triton kernel's fp8 path beside the default (the Gluon kernel on sm90) and cuDNN bf16
    "fp8": [f"h{h} n{n} fp8 t8" for h, n in ((128, 1024), (128, 4096), (128, 16384), (16, 4096))],
}


@dataclass(frozen=True)
class PrefillShape:
    h: int
    n: int
    t: int = 16384
    dtype: str = "bf16"
    t8: bool = False  # fp8: also time the portable kernel's fp8 path (flash_attn_varlen(backend="triton")), "t8"

    @property
    def batch(self) -> int:
        return max(1, self.t // self.n)

    def __str__(self) -> str:
        return f"h{self.h} n{self.n} t{self.t}" + (" t8" if self.t8 else "")


def parse(spec: str) -> PrefillShape:
    """``"h128 n4096 t16384 fp8"`` -> :class:`PrefillShape` (ValueError on a bad spec)."""
    f: dict = {}
    try:
        for tok in spec.replace(",", " ").split():
            if tok in ("bf16", "fp8"):
                f["dtype"] = tok
            elif tok == "t8":
                f["t8"] = True
            elif tok[0] in "hnt":
                f[tok[0]] = int(tok[1:])
            else:
                raise ValueError(tok)
        shape = PrefillShape(**f)
    except (ValueError, TypeError, IndexError):
        raise ValueError(f"bad prefill shape {spec!r}: want 'h<heads> n<tokens a request> [t<tokens a batch>] "
                         "[bf16|fp8] [t8]'") from None  # fmt: skip
    if min(shape.h, shape.n, shape.t) < 1:
        raise ValueError(f"bad prefill shape {spec!r}: sizes must be >= 1")
    if shape.t8 and shape.dtype != "fp8":
        raise ValueError(f"bad prefill shape {spec!r}: t8 times the fp8 path (add fp8)")
    return shape


def _fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor quantisation: stored = x / scale, scale = amax / 448 (`[1]` fp32)."""
    scale = (x.abs().amax().float() / 448.0).clamp_min(1e-12).reshape(1)
    return (x.float() / scale).to(FP8), scale


def _cudnn(q, k, v, B: int, L: int, backend=None):
    """A closure running SDPA (cuDNN unless ``backend``) over the batch ``[B, H, L, D]`` and its output as
    ``[T, H, d_v]``, or raise."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    backend = SDPBackend.CUDNN_ATTENTION if backend is None else backend

    h = q.shape[1]
    qs, ks, vs = (x.view(B, L, h, -1).transpose(1, 2).contiguous() for x in (q, k, v))
    err = None
    for pad in (False, True):
        vv = torch.nn.functional.pad(vs, (0, D_QK - D_V)) if pad else vs

        def fn(vv=vv):
            with sdpa_kernel(backend):
                return sdpa(qs, ks, vv, is_causal=True, scale=SCALE)

        try:
            with warnings.catch_warnings():  # SDPA explains each backend it refuses
                warnings.simplefilter("ignore", UserWarning)
                o = fn()
        except RuntimeError as exc:  # cuDNN refuses unequal head dims on some versions: pad V
            err = exc
            continue
        return fn, o[..., :D_V].transpose(1, 2).reshape(B * L, h, D_V)
    raise err


def _unchecked(pkg, kw: dict) -> dict:
    """``kw`` plus ``validate=False`` where ``pkg.flash_attn_varlen`` has it (the offsets are valid by construction;
    older checkouts have no host check)."""
    return dict(kw, validate=False) if "validate" in inspect.signature(pkg.flash_attn_varlen).parameters else kw


def run(shape: PrefillShape, ctx: BenchContext) -> list[dict]:
    """Time one point: openmla and, on a GPU with peers on, cuDNN SDPA (bf16), alternating; returns its rows."""
    dev, h, L, B = ctx.device, shape.h, shape.n, shape.batch
    T = B * L
    torch.manual_seed(0)
    q, k = (torch.randn(T, h, D_QK, device=dev, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(T, h, D_V, device=dev, dtype=torch.bfloat16)
    cu = torch.arange(B + 1, dtype=torch.int32, device=dev) * L
    fp8 = shape.dtype == "fp8"
    if fp8:
        (q8, sq), (k8, sk), (v8, sv) = _fp8(q), _fp8(k), _fp8(v)
        args, kw = (q8, k8, v8), dict(q_descale=sq, k_descale=sk, v_descale=sv)
    else:
        args, kw = (q, k, v), {}
    out = torch.empty(T, h, D_V, dtype=torch.bfloat16, device=dev)
    own_kw = _unchecked(openmla, kw)

    def own():
        openmla.flash_attn_varlen(*args, cu, cu, L, L, SCALE, causal=True, out=out, **own_kw)

    own()
    fns, check, old_check = {"openmla": own}, None, None
    if shape.t8:  # the portable kernel's fp8 path on the same inputs, into its own buffer
        out_t = torch.empty_like(out)

        def t8():
            openmla.flash_attn_varlen(*args, cu, cu, L, L, SCALE, causal=True, out=out_t, backend="triton", **own_kw)

        add_variant(ctx, fns, "t8", t8, out, out_t, shape)
    old = ctx.baseline  # --against: the older openmla on the same inputs
    if old is not None:
        out_o = torch.empty_like(out)
        old_kw = _unchecked(old, kw)  # as ours: timed without graphs, a check's sync would count against it alone

        def before():
            old.flash_attn_varlen(*args, cu, cu, L, L, SCALE, causal=True, out=out_o, **old_kw)

        before()
        old_check, fns["before"] = cosine(out_o, out), before
    if ctx.peers and dev.type == "cuda":
        try:
            peer, ref = _cudnn(q, k, v, B, L)
            check = cosine(out, ref)
            fns["cudnn"] = peer
            del ref
        except Exception as exc:  # no cuDNN attention here: the column stays empty
            ctx.note(f"# cudnn sdpa failed at {shape}: {type(exc).__name__}: {exc}".splitlines()[0])
    timings = ctx.time(fns, graph=False)
    ours = ("openmla", "before", "t8")  # read openmla's inputs; the peer reads bf16
    elem = {p: 1 if fp8 and p in ours else 2 for p in fns}
    nbytes = {p: T * h * ((2 * D_QK + D_V) * elem[p] + D_V * 2) for p in fns}
    dtypes = {p: shape.dtype if p in ours else "bf16" for p in fns}
    flops = prefill_flops(B * L * (L + 1) // 2, h, D_QK, D_V)
    rows = ctx.rows(OP, str(shape), timings, flops=flops, nbytes=nbytes, dtype=dtypes, peer="cudnn", check=check)
    for r in rows:
        if r["provider"] == "before":
            r["check"] = old_check  # the older openmla's output against this one's
    return rows
