"""merge_attn_states against the fp32 reference, empty parts (-inf, +inf, NaN LSEs), in-place use, and
the merge of two key subsets against attention over all keys."""

from __future__ import annotations

import pytest
import torch

import openmla.ops.prefill as prefill_ops
from openmla import flash_attn_varlen, merge_attn_states
from openmla.reference import flash_attn_varlen_ref, merge_attn_states_ref
from openmla.utils.testing import TOLERANCES, assert_close, pick

T, H, D = pick(cpu=(7, 3, 40), gpu=(4096, 128, 128))
INF = float("inf")


@pytest.fixture(autouse=True)
def _fixed_tiles(monkeypatch):
    """On a GPU, one fixed tile per head-dim class: autotuning every test shape costs minutes of compiles."""
    monkeypatch.setattr(prefill_ops, "AUTOTUNE", False)


def _parts(dtype, device):
    out_a = torch.randn(T, H, D, device=device).to(dtype)
    out_b = torch.randn(T, H, D, device=device).to(dtype)
    lse_a = torch.randn(T, H, device=device) * 3
    lse_b = torch.randn(T, H, device=device) * 3
    # token 0: both empty; 1: a empty (-inf) and garbage; 2: a +inf (FA2's empty); 3: b NaN; 4: one head
    lse_a[0] = -INF
    lse_b[0] = -INF
    lse_a[1] = -INF
    out_a[1] = float("nan")
    lse_a[2] = INF
    out_a[2] = float("nan")
    lse_b[3] = float("nan")
    out_b[3] = float("nan")
    lse_b[4, 0] = -INF
    return out_a, lse_a, out_b, lse_b


def _check(out_a, lse_a, out_b, lse_b, out, lse, dtype):
    ref_out, ref_lse = merge_attn_states_ref(out_a.cpu(), lse_a.cpu(), out_b.cpu(), lse_b.cpu())
    assert_close("out", ref_out, out, *TOLERANCES[dtype])
    assert_close("lse", ref_lse, lse, *TOLERANCES[torch.float32])
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_merge(dtype, device):
    out_a, lse_a, out_b, lse_b = _parts(dtype, device)
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert out.dtype == dtype and lse.dtype == torch.float32
    _check(out_a, lse_a, out_b, lse_b, out, lse, dtype)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()  # both empty
    assert torch.equal(out[1], out_b[1]) and torch.equal(lse[1], lse_b[1])  # a empty: b unchanged
    assert torch.equal(out[3], out_a[3]) and torch.equal(lse[3], lse_a[3])


def test_in_place_and_strided_lse(device):
    """out = out_a, out_lse = lse_a (the chunked-context accumulator), LSEs stored [H, T]."""
    out_a, lse_a, out_b, lse_b = _parts(torch.float32, device)
    ref = merge_attn_states_ref(out_a.cpu(), lse_a.cpu(), out_b.cpu(), lse_b.cpu())
    lse_a_t = lse_a.t().contiguous().t()  # [T, H] view of [H, T] storage
    lse_b_t = lse_b.t().contiguous().t()
    res, res_lse = merge_attn_states(out_a, lse_a_t, out_b, lse_b_t, out=out_a, out_lse=lse_a_t)
    assert res.data_ptr() == out_a.data_ptr() and res_lse.data_ptr() == lse_a_t.data_ptr()
    assert_close("out", ref[0], out_a, *TOLERANCES[torch.float32])
    assert_close("lse", ref[1], lse_a_t, *TOLERANCES[torch.float32])


def test_mixed_dtypes(device):
    """bf16 parts into an fp32 accumulator and back."""
    out_a, lse_a, out_b, lse_b = _parts(torch.bfloat16, device)
    acc = out_a.float()
    out, lse = merge_attn_states(acc, lse_a, out_b, lse_b, out=acc)
    assert out.dtype == torch.float32
    _check(out_a, lse_a, out_b, lse_b, out, lse, torch.float32)


def test_empty(device):
    z = torch.zeros(0, H, D, device=device)
    out, lse = merge_attn_states(z, torch.zeros(0, H, device=device), z, torch.zeros(0, H, device=device))
    assert out.shape == (0, H, D) and lse.shape == (0, H)


def test_merge_of_key_halves_is_full_attention(device):
    """Attention over keys [0, s) merged with keys [s, Lk) equals attention over all of them."""
    lq, lk, split = pick(cpu=([5, 3, 1], [9, 4, 6], [3, 0, 6]), gpu=([500, 300, 1], [900, 400, 600], [300, 0, 600]))
    h, dqk, dv = pick(cpu=(2, 192, 128), gpu=(16, 192, 128))

    def cu(xs):
        return torch.tensor([0] + torch.tensor(xs).cumsum(0).tolist(), dtype=torch.int32, device=device)

    q = torch.randn(sum(lq), h, dqk, device=device).to(torch.bfloat16)
    ks = [torch.randn(n, h, dqk, device=device).to(torch.bfloat16) for n in lk]
    vs = [torch.randn(n, h, dv, device=device).to(torch.bfloat16) for n in lk]
    first = [n for n in split]
    second = [n - s for n, s in zip(lk, split)]
    k1 = torch.cat([k[:s] for k, s in zip(ks, split)])
    v1 = torch.cat([v[:s] for v, s in zip(vs, split)])
    k2 = torch.cat([k[s:] for k, s in zip(ks, split)])
    v2 = torch.cat([v[s:] for v, s in zip(vs, split)])
    scale = dqk**-0.5
    o1, l1 = flash_attn_varlen(q, k1, v1, cu(lq), cu(first), max(lq), max(first), scale, causal=False)
    o2, l2 = flash_attn_varlen(q, k2, v2, cu(lq), cu(second), max(lq), max(second), scale, causal=False)
    out, lse = merge_attn_states(o1, l1, o2, l2)
    k, v = torch.cat(ks), torch.cat(vs)
    ref_out, ref_lse = flash_attn_varlen_ref(q.cpu(), k.cpu(), v.cpu(), cu(lq).cpu(), cu(lk).cpu(), scale, causal=False)
    # two bf16 roundings (the parts, then the merge) instead of one
    atol, rtol, cos = TOLERANCES[torch.bfloat16]
    assert_close("out", ref_out, out, 2 * atol, 2 * rtol, 2 * cos)
    assert_close("lse", ref_lse, lse, atol, rtol, cos)


@pytest.mark.parametrize(
    "change,exc,word",
    [
        (dict(lse_a="bf16"), TypeError, "lse_a"),
        (dict(lse_b="short"), ValueError, "lse_b"),
        (dict(out_b="short"), ValueError, "out_b"),
        (dict(out_a="int"), TypeError, "out_a"),
        (dict(out="wrong"), ValueError, "out"),
        (dict(out_lse="fp16"), TypeError, "out_lse"),
    ],
    ids=["lse_dtype", "lse_shape", "out_b_shape", "out_a_dtype", "out_shape", "out_lse_dtype"],
)
def test_bad_inputs(change, exc, word, device):
    out_a, lse_a, out_b, lse_b = _parts(torch.float32, device)
    bad = {
        "bf16": lse_a.bfloat16(),
        "short": lse_b[:-1] if "lse_b" in change else out_b[:-1],
        "int": out_a.int(),
        "wrong": torch.empty(T, H, D + 1, device=device),
        "fp16": lse_a.half(),
    }
    args = dict(out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)
    kw = {}
    for name, what in change.items():
        (args if name in args else kw)[name] = bad[what]
    with pytest.raises(exc, match=word):
        merge_attn_states(args["out_a"], args["lse_a"], args["out_b"], args["lse_b"], **kw)
