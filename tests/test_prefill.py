"""flash_attn_varlen against the fp32 reference: ragged batches, causal or not, d_qk != d_v, GQA, fp8."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import openmla.ops.prefill as prefill_ops
from openmla import flash_attn_varlen
from openmla.reference import flash_attn_varlen_ref
from openmla.utils.testing import TOLERANCES, assert_close, on_gpu, pick

FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _fixed_tiles(monkeypatch):
    """On a GPU, one fixed tile per head-dim class: autotuning every test shape costs minutes of compiles."""
    monkeypatch.setattr(prefill_ops, "AUTOTUNE", False)


# (query lengths, key lengths) per request. "mixed" holds a length-1 request, an empty query, a request
# without keys, Lk > Lq (context) and Lq > Lk (causal rows that see nothing).
LAYOUTS = {
    "mixed": pick(
        cpu=([5, 0, 19, 1, 6, 3], [9, 4, 19, 1, 0, 2]),
        gpu=([300, 0, 1000, 1, 257, 40], [700, 17, 1000, 1, 0, 20]),
    ),
    "equal": pick(cpu=([17, 17], [17, 17]), gpu=([1024] * 4, [1024] * 4)),
    "lk_gt_lq": pick(cpu=([3, 1, 8], [20, 33, 8]), gpu=([100, 1, 513], [2000, 4097, 600])),
    "lq_gt_lk": pick(cpu=([12, 30], [3, 0]), gpu=([512, 300], [100, 0])),
}
DIMS = [(192, 128), (128, 128), (64, 64)]
H = pick(cpu=2, gpu=16)


def _cu(lens, device):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def _inputs(lq, lk, h, h_kv, d_qk, d_v, dtype, device):
    """Random q/k/v (fp8: scaled into range, with descales) and the cu_seqlens."""
    cu_q, cu_k = _cu(lq, device), _cu(lk, device)
    q = torch.randn(sum(lq), h, d_qk, device=device)
    k = torch.randn(sum(lk), h_kv, d_qk, device=device)
    v = torch.randn(sum(lk), h_kv, d_v, device=device)
    kw = {}
    if dtype == FP8:
        ds = [torch.tensor([s], device=device) for s in (0.02, 0.05, 0.01)]
        # clamp into e4m3's range: torch turns values beyond +-448 into NaN (seen on the GPU shapes)
        q, k, v = ((x / s).clamp(-448, 448) for x, s in zip((q, k, v), ds))
        kw = dict(q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
    return q.to(dtype), k.to(dtype), v.to(dtype), cu_q, cu_k, kw


def _tol(dtype):
    # fp8: the reference reads the same fp8 values, so only the bf16 output rounding (and bf16 p on the
    # GPU) differ: bf16 tolerances apply
    return TOLERANCES[torch.bfloat16 if dtype == FP8 else dtype]


def _check(lq, lk, h, h_kv, d_qk, d_v, dtype, causal, device):
    q, k, v, cu_q, cu_k, kw = _inputs(lq, lk, h, h_kv, d_qk, d_v, dtype, device)
    scale = d_qk**-0.5
    out, lse = flash_attn_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), scale, causal=causal, **kw)
    ref_out, ref_lse = flash_attn_varlen_ref(q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), scale, causal=causal,
                                             **{n: t.cpu() for n, t in kw.items()})  # fmt: skip
    assert out.dtype == (torch.bfloat16 if dtype == FP8 else dtype)
    assert lse.dtype == torch.float32 and lse.shape == (sum(lq), h)
    assert_close("out", ref_out, out, *_tol(dtype))
    assert_close("lse", ref_lse, lse, *_tol(dtype))
    return out, lse


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, FP8], ids=["bf16", "fp16", "fp32", "fp8"]
)
@pytest.mark.parametrize("dims", DIMS, ids=[f"DQK{a}-DV{b}" for a, b in DIMS])
def test_dims_dtypes(dims, dtype, causal, device):
    lq, lk = LAYOUTS["mixed"]
    out, lse = _check(lq, lk, H, H, *dims, dtype, causal, device)
    assert not torch.isnan(out).any()
    # the request without keys (index 4) gives out 0, lse -inf
    r0 = sum(lq[:4])
    assert (out[r0 : r0 + lq[4]] == 0).all() and torch.isneginf(lse[r0 : r0 + lq[4]]).all()


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_layouts(layout, causal, backend, monkeypatch, device):
    # "auto" is the Hopper Gluon kernel for these inputs on an sm90 GPU, the Triton kernel elsewhere
    monkeypatch.setenv("OPENMLA_PREFILL_BACKEND", backend)
    lq, lk = LAYOUTS[layout]
    _check(lq, lk, H, H, 192, 128, torch.bfloat16, causal, device)


def test_backend_argument(device):
    lq, lk = LAYOUTS["mixed"]
    q, k, v, cu_q, cu_k, _ = _inputs(lq, lk, 2, 2, 192, 128, torch.bfloat16, device)
    with pytest.raises(ValueError, match="backend"):
        flash_attn_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), 0.1, backend="cudnn")
    f32 = [t.float() for t in (q, k, v)]
    with pytest.raises(ValueError, match="gluon"):  # fp32 inputs (and any CPU tensor) have no Gluon kernel
        flash_attn_varlen(*f32, cu_q, cu_k, max(lq), max(lk), 0.1, backend="gluon")
    out_t, lse_t = flash_attn_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), 0.1, backend="triton")
    out_a, lse_a = flash_attn_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), 0.1, return_lse=False)
    assert lse_a is None
    assert_close("auto vs triton", out_t, out_a, *TOLERANCES[torch.bfloat16])


def test_causal_rows_without_keys(device):
    """Lq > Lk, causal: the first Lq - Lk rows see nothing (out 0, lse -inf, no NaN)."""
    lq, lk = [7], [3]
    out, lse = _check(lq, lk, H, H, 64, 64, torch.bfloat16, True, device)
    assert (out[:4] == 0).all() and torch.isneginf(lse[:4]).all()
    assert torch.isfinite(lse[4:]).all()


@pytest.mark.parametrize("h,h_kv", [(4, 2), (4, 1), pick(cpu=(3, 1), gpu=(128, 8))], ids=lambda x: str(x))
def test_gqa(h, h_kv, device):
    lq, lk = LAYOUTS["lk_gt_lq"]
    _check(lq, lk, h, h_kv, 192, 128, torch.bfloat16, True, device)


@pytest.mark.parametrize(
    "dims", [(80, 48), (24, 8), (8, 16), (576, 512)], ids=["DQK80-DV48", "DQK24-DV8", "DQK8-DV16", "DQK576-DV512"]
)
def test_odd_head_dims(dims, device):
    """Non power-of-two rests are padded with masks; 576/512 is the absorbed-MLA shape."""
    lq, lk = pick(cpu=([4, 9], [11, 9]), gpu=([100, 300], [700, 300]))
    _check(lq, lk, 2, 1, *dims, torch.bfloat16, True, device)


@settings(max_examples=pick(cpu=12, gpu=25), deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 24), st.integers(0, 40)), min_size=1, max_size=4),
    heads=st.sampled_from([(1, 1), (2, 2), (3, 1), (4, 2)]),
    dims=st.sampled_from(DIMS + [(96, 32)]),
    causal=st.booleans(),
)
def test_fuzz(lens, heads, dims, causal):
    """Random ragged batches (hypothesis), bf16; a NaN anywhere would fail the comparison."""
    from openmla.utils.testing import suite_device

    torch.manual_seed(42)
    lq, lk = [a for a, _ in lens], [b for _, b in lens]
    _check(lq, lk, *heads, *dims, torch.bfloat16, causal, suite_device())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_autotuned(dtype, monkeypatch, device):
    """The autotuned launch (the GPU default) on the MLA shape."""
    monkeypatch.setattr(prefill_ops, "AUTOTUNE", True)
    lq, lk = LAYOUTS["mixed"]
    _check(lq, lk, H, H, 192, 128, dtype, True, device)


def test_out_buffer_and_strided_inputs(device):
    lq, lk = LAYOUTS["mixed"]
    q, k, v, cu_q, cu_k, _ = _inputs(lq, lk, H, H, 192, 128, torch.bfloat16, device)
    # strided views: q and k slices of wider rows, out a slice of a wider buffer
    q_wide = torch.randn(q.shape[0], H, 256, device=device).to(q.dtype)
    q_wide[..., :192] = q
    big = torch.zeros(q.shape[0], H, 160, dtype=q.dtype, device=device)
    out = big[..., 16:144]
    res, lse = flash_attn_varlen(q_wide[..., :192], k, v, cu_q, cu_k, max(lq), max(lk), 0.1, out=out)
    assert res.data_ptr() == out.data_ptr()
    assert (big[..., :16] == 0).all() and (big[..., 144:] == 0).all()
    ref_out, ref_lse = flash_attn_varlen_ref(q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), 0.1)
    assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
    assert_close("lse", ref_lse, lse, *TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("autotune", [False, pytest.param(True, marks=pytest.mark.gpu)], ids=["fixed", "autotuned"])
def test_misaligned_value_rows(autotune, monkeypatch, device):
    """V rows 16- but not 32-byte aligned (the value half of a kv projection at qk_nope 24, v_head_dim 16 or 32):
    on the H200 (triton 3.6) every tile config faulted with an illegal address on them, so the launcher reads
    them from an aligned copy (_v_rows_aligned)."""
    monkeypatch.setattr(prefill_ops, "AUTOTUNE", autotune)
    lq, lk = pick(cpu=([5, 11], [5, 11]), gpu=([16, 37, 300], [16, 37, 300]))
    for d_v in (16, 32):
        q, k, _, cu_q, cu_k, _ = _inputs(lq, lk, 8, 8, 88, d_v, torch.bfloat16, device)
        kv = torch.randn(sum(lk), 8, 24 + d_v, device=device).to(torch.bfloat16)
        v = kv[..., 24:]  # base 48 bytes in, rows (24 + d_v) * 2 bytes apart
        assert v.data_ptr() % 32 and prefill_ops._v_rows_aligned(v) is not v
        a = prefill_ops._v_rows_aligned(v)
        assert a.data_ptr() % 32 == 0 and all(st * 2 % 32 == 0 for st in a.stride()[:2]) and torch.equal(a, v)
        out, lse = flash_attn_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), 0.1, causal=True)
        ref_out, ref_lse = flash_attn_varlen_ref(q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), 0.1, causal=True)
        assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
        assert_close("lse", ref_lse, lse, *TOLERANCES[torch.bfloat16])
    aligned = torch.randn(4, 2, 32, device=device).to(torch.bfloat16)
    assert prefill_ops._v_rows_aligned(aligned) is aligned


def test_no_lse(device):
    q, k, v, cu_q, cu_k, _ = _inputs([5, 3], [5, 6], 2, 2, 64, 64, torch.float16, device)
    out, lse = flash_attn_varlen(q, k, v, cu_q, cu_k, 5, 6, 0.125, return_lse=False)
    assert lse is None
    ref_out, _ = flash_attn_varlen_ref(q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), 0.125)
    assert_close("out", ref_out, out, *TOLERANCES[torch.float16])


def test_fp8_default_descales(device):
    q, k, v, cu_q, cu_k, _ = _inputs([6, 2], [6, 9], 2, 2, 192, 128, torch.bfloat16, device)
    q, k, v = q.to(FP8), k.to(FP8), v.to(FP8)
    out, lse = flash_attn_varlen(q, k, v, cu_q, cu_k, 6, 9, 0.07)
    ref_out, ref_lse = flash_attn_varlen_ref(q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), 0.07)
    assert out.dtype == torch.bfloat16
    assert_close("out", ref_out, out, *_tol(FP8))
    assert_close("lse", ref_lse, lse, *_tol(FP8))


@pytest.mark.parametrize("shape", ["empty_batch", "no_tokens"])
def test_empty(shape, device):
    lens = [] if shape == "empty_batch" else [0, 0]
    q, k, v, cu_q, cu_k, _ = _inputs(lens, lens, 2, 2, 64, 64, torch.bfloat16, device)
    out, lse = flash_attn_varlen(q, k, v, cu_q, cu_k, 0, 0, 0.1)
    assert out.shape == (0, 2, 64) and lse.shape == (0, 2)


def _bad_calls(device):
    q, k, v, cu_q, cu_k, _ = _inputs([4, 2], [4, 3], 4, 2, 64, 32, torch.bfloat16, device)
    base = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4, max_seqlen_k=4, sm_scale=0.1)
    one = torch.ones(1, device=device)
    return [
        ("int_q", dict(q=q.int()), TypeError, "q"),
        ("k_dtype", dict(k=k.half()), TypeError, "k"),
        ("q_2d", dict(q=q[:, 0]), ValueError, "q"),
        ("head_dim", dict(k=k[..., :32]), ValueError, "head dim"),
        ("v_rows", dict(v=v[:3]), ValueError, "v"),
        ("gqa", dict(q=q[:, :3]), ValueError, "multiple"),
        ("cu_float", dict(cu_seqlens_q=cu_q.float()), TypeError, "cu_seqlens_q"),
        ("cu_len", dict(cu_seqlens_k=cu_k[:2]), ValueError, "cu_seqlens_k"),
        ("max_seqlen", dict(max_seqlen_q=-1), ValueError, "max_seqlen_q"),
        ("scale", dict(sm_scale=float("nan")), ValueError, "sm_scale"),
        ("descale_bf16", dict(q_descale=one), ValueError, "q_descale"),
        ("out_shape", dict(out=torch.empty(6, 4, 64, dtype=torch.bfloat16, device=device)), ValueError, "out"),
        ("out_dtype", dict(out=torch.empty(6, 4, 32, dtype=torch.float16, device=device)), TypeError, "out"),
        ("last_dim_stride", dict(q=q.transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "q"),
    ], base


@pytest.mark.parametrize("case", range(14), ids=lambda i: f"bad{i}")
def test_bad_inputs(case, device):
    cases, base = _bad_calls(device)
    name, change, exc, word = cases[case]
    with pytest.raises(exc, match=word):
        flash_attn_varlen(**{**base, **change})


def test_bad_fp8_descale(device):
    q, k, v, cu_q, cu_k, _ = _inputs([2], [2], 2, 2, 64, 64, FP8, device)
    with pytest.raises(ValueError, match="k_descale"):
        flash_attn_varlen(q, k, v, cu_q, cu_k, 2, 2, 0.1, k_descale=torch.ones(2, device=device))
    with pytest.raises(ValueError, match="v_descale"):
        flash_attn_varlen(q, k, v, cu_q, cu_k, 2, 2, 0.1, v_descale=torch.ones(1, dtype=torch.float64, device=device))


@pytest.mark.skipif(on_gpu(), reason="the lengths are checked against max_seqlen_q only for CPU tensors")
def test_max_seqlen_too_small(device):
    q, k, v, cu_q, cu_k, _ = _inputs([4, 2], [4, 3], 2, 2, 64, 64, torch.bfloat16, device)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        flash_attn_varlen(q, k, v, cu_q, cu_k, 3, 4, 0.1)


_SM90_SCRIPT = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import openmla.ops.prefill as P

kern = P._flash_attn_varlen_fwd_kernel
for dt, qk, pv, bm, bn, warps, stages in [
    ("*bf16", tl.bfloat16, tl.bfloat16, 128, 64, 8, 3),
    ("*fp8e4nv", tl.float8e4nv, tl.bfloat16, 128, 64, 8, 2),
]:
    D1, BD1, D2, BD2 = P._split_head_dim(192, 32 if qk == tl.float8e4nv else 16)
    const = dict(GROUP=1, D1=D1, BLOCK_D1=BD1, D2=D2, BLOCK_D2=BD2, HAS_D2=D2 > 0, D_V=128, BLOCK_DV=128,
                 CAUSAL=True, STORE_LSE=True, HAS_DESCALE=qk == tl.float8e4nv, QK_DTYPE=qk, PV_DTYPE=pv,
                 DOT_PRECISION="tf32", SCALE_POS=True, BLOCK_M=bm, BLOCK_N=bn)
    ptrs = dict(q=dt, k=dt, v=dt, o="*bf16", lse="*fp32", cu_seqlens_q="*i32", cu_seqlens_k="*i32",
                q_descale="*fp32", k_descale="*fp32", v_descale="*fp32", sm_scale="fp32")
    sig = {n: "constexpr" if n in const else ptrs.get(n, "i32") for n in kern.arg_names}
    # the launcher marks 16-byte aligned pointers and strides divisible by 16 (as the real launches are)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kern.arg_names)
             if n not in const and (n.startswith("stride") or sig[n].startswith("*"))}
    c = triton.compile(ASTSource(kern, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages))
    assert "wgmma" in c.asm["ptx"], "expected Hopper warpgroup MMA"
print("compiled")
"""


@pytest.mark.skipif(on_gpu(), reason="the GPU runs compile the kernels for real")
def test_compiles_for_sm90():
    """Compile (no launch) for an H100/H200 through Triton's CUDA backend: catches GPU-only errors on CPU."""
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    res = subprocess.run([sys.executable, "-c", _SM90_SCRIPT], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]


def test_negative_and_zero_scale(device):
    """sm_scale <= 0 takes the scale-first softmax (the row max may not be taken before scaling)."""
    lq, lk = LAYOUTS["mixed"]
    q, k, v, cu_q, cu_k, _ = _inputs(lq, lk, 2, 2, 192, 128, torch.bfloat16, device)
    for scale in (-0.05, 0.0):
        out, lse = flash_attn_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), scale, backend="triton")
        ref_out, ref_lse = flash_attn_varlen_ref(q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), scale)
        assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
        assert_close("lse", ref_lse, lse, *TOLERANCES[torch.bfloat16])
