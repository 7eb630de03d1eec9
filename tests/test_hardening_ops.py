"""Issue 28 defects 1-6 at the op level: model widths in decode, input validation, strided inputs, bad block ids,
unchecked inputs that must stay inside their tensors, and interpreter rounding.

Every test here failed on main at 64c94cf except ``test_decode_widths``, whose defect (latent widths below 64 and
rope widths below 16 give a dot with K < 16) shows only when the kernel is compiled for a GPU.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import openmla
from openmla.ops.cache import DS_MLA_ROW_BYTES
from openmla.reference import (
    concat_and_cache_mla_ref,
    expand_page_indices_ref,
    gather_cache_ref,
    mla_decode_ref,
)
from openmla.utils.testing import TOLERANCES, assert_close, pick

D_V, D_R = pick((64, 16), (512, 64))  # small latent widths keep the interpreter fast
SCALE = (D_V + D_R) ** -0.5
DTYPE = pick(torch.float32, torch.bfloat16)
TOL = TOLERANCES[DTYPE]


def _decode_batch(device, heads=2, qlens=(1, 2, 1), lens=(9, 21, 5), page=4, dtype=DTYPE, d_v=D_V, d_r=D_R):
    """q, cache, block_table, seq_lens, query_start_loc of a small paged batch (distinct random blocks)."""
    B = len(lens)
    W = max(1, -(-max(lens) // page))
    num_blocks = B * W + 2
    cache = torch.randn(num_blocks, page, d_v + d_r, device=device).to(dtype)
    bt = torch.randperm(num_blocks, device=device)[: B * W].view(B, W).int()
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    qsl = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32, device=device)
    q = torch.randn(int(qsl[-1]), heads, d_v + d_r, device=device).to(dtype)
    return q, cache, bt, sl, qsl


def _check_decode(out, q, cache, bt, sl, qsl, d_v=D_V):
    ref, _ = mla_decode_ref(q, cache, bt, sl, qsl, SCALE, d_v=d_v)
    atol, rtol, cos = TOLERANCES[q.dtype]
    assert_close("out", ref, out, atol, rtol, cos)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as ``t`` (1-D), as a view with stride 2 whose gaps hold garbage."""
    buf = torch.full((2 * t.shape[0],), 12345, dtype=t.dtype, device=t.device)
    view = buf[::2]
    view.copy_(t)
    assert view.stride(0) == 2
    return view


# ------------------------------------------------------------------ defect 1: decode at every model width
@pytest.mark.parametrize("d_v,d_r", [(16, 64), (32, 16), (64, 8), (256, 32), (512, 64), (1024, 64)],
                         ids=lambda x: str(x))  # fmt: skip
def test_decode_widths(d_v, d_r, device):
    """Latent widths below 64 and rope widths below 16 are padded inside the kernel (a dot needs K >= 16)."""
    dtype = pick(torch.float32, torch.bfloat16)
    q, cache, bt, sl, qsl = _decode_batch(device, heads=3, dtype=dtype, d_v=d_v, d_r=d_r)
    out, lse = openmla.mla_decode(q, cache, bt, sl, qsl, SCALE, d_v=d_v)
    assert out.shape == (q.shape[0], 3, d_v)
    ref, ref_lse = mla_decode_ref(q, cache, bt, sl, qsl, SCALE, d_v=d_v)
    atol, rtol, cos = TOLERANCES[dtype]
    assert_close("out", ref, out, atol, rtol, cos)
    assert_close("lse", ref_lse, lse, 1e-3, 1e-3, 1e-6)


# ------------------------------------------------------------------ defect 2: column-strided block table
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_decode_column_strided_block_table(backend, device):
    # on a GPU: 32 heads of 576 over 64-token pages, where "auto" runs the Gluon tier on sm90
    q, cache, bt, sl, qsl = _decode_batch(device, **pick({}, dict(heads=32, page=64, lens=(90, 700, 5))))
    wide = torch.full((bt.shape[0], 2 * bt.shape[1]), -7, dtype=bt.dtype, device=device)
    wide[:, ::2] = bt
    strided = wide[:, ::2]
    assert strided.stride(1) == 2 and torch.equal(strided, bt)
    out, _ = openmla.mla_decode(q, cache, strided, sl, qsl, SCALE, d_v=D_V, backend=backend)
    _check_decode(out, q, cache, bt, sl, qsl)


# ------------------------------------------------------------------ defect 3: strided 1-D index tensors
def test_decode_strided_seq_lens_and_query_start_loc(device):
    q, cache, bt, sl, qsl = _decode_batch(device)
    out, _ = openmla.mla_decode(q, cache, bt, _strided(sl), _strided(qsl), SCALE, d_v=D_V)
    _check_decode(out, q, cache, bt, sl, qsl)


def test_plan_decode_strided_seq_lens(device):
    q, cache, bt, sl, qsl = _decode_batch(device, lens=(9, 300, 5))
    want = openmla.plan_decode(sl, qsl, 2, num_sms=2)
    got = openmla.plan_decode(_strided(sl), _strided(qsl), 2, num_sms=2)
    for name in ("split_len", "num_splits", "work_indptr", "work_req", "work_split"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_concat_and_cache_strided_slot_mapping(device):
    T, blocks, page = 5, 4, 4
    kv_c, k_pe = torch.randn(T, D_V, device=device), torch.randn(T, D_R, device=device)
    slots = torch.tensor([3, 9, -1, 0, 14], dtype=torch.int64, device=device)
    cache = torch.zeros(blocks, page, D_V + D_R, device=device)
    ref = concat_and_cache_mla_ref(kv_c, k_pe, cache, slots)
    openmla.concat_and_cache_mla(kv_c, k_pe, cache, _strided(slots))
    assert torch.equal(cache, ref)


def test_gather_cache_strided_lengths_and_starts(device):
    page, blocks = 4, 8
    cache = torch.randn(blocks, page, D_V + D_R, device=device)
    bt = torch.randperm(blocks, device=device)[:6].view(2, 3).int()
    sl = torch.tensor([5, 7], dtype=torch.int32, device=device)
    starts = torch.tensor([2, 1], dtype=torch.int32, device=device)
    out = openmla.gather_cache(cache, bt, _strided(sl), seq_starts=_strided(starts), out_dtype=torch.float32)
    assert torch.equal(out, gather_cache_ref(cache, bt, sl, seq_starts=starts))


def test_flash_attn_varlen_strided_cu_seqlens(device):
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(9, 2, d, device=device) for d in (32, 32, 16))
    want, want_lse = openmla.flash_attn_varlen(q, k, v, cu, cu, 5, 5, 0.3)
    got, got_lse = openmla.flash_attn_varlen(q, k, v, _strided(cu), _strided(cu), 5, 5, 0.3)
    assert_close("out", want, got, 1e-6, 1e-6, 1e-9)
    assert_close("lse", want_lse, got_lse, 1e-6, 1e-6, 1e-9)


def test_flash_attn_varlen_checks_offsets_on_every_device(device):
    """validate=True (the default) checks the offsets on the host on any device; validate=False trusts them."""
    q, k, v = (torch.randn(9, 2, d, device=device) for d in (32, 32, 16))
    for bad in ([1, 3, 9], [0, 5, 3], [0, 3, 10]):  # not from 0, decreasing, past Tq
        cu = torch.tensor(bad, dtype=torch.int32, device=device)
        with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
            openmla.flash_attn_varlen(q, k, v, cu, cu, 9, 9, 0.3)
    cu = torch.tensor([0, 3, 9], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        openmla.flash_attn_varlen(q, k, v, cu, cu, 4, 9, 0.3)
    want, _ = openmla.flash_attn_varlen(q, k, v, cu, cu, 6, 6, 0.3)
    got, _ = openmla.flash_attn_varlen(q, k, v, cu, cu, 6, 6, 0.3, validate=False)
    assert_close("out", want, got, 0, 0, 0)


# ------------------------------------------------------------------ defect 4: block ids against the cache
@pytest.mark.parametrize("bad", ["num_blocks", -1])
def test_decode_checks_block_ids(bad, device):
    q, cache, bt, sl, qsl = _decode_batch(device)
    table = bt.clone()
    table[1, 2] = cache.shape[0] if bad == "num_blocks" else -1  # request 1 (21 keys, page 4) reads column 2
    with pytest.raises(ValueError, match="block_table refers to block"):
        openmla.mla_decode(q, cache, table, sl, qsl, SCALE, d_v=D_V)
    with pytest.raises(ValueError, match="block_table refers to block"):
        openmla.gather_cache(cache, table, sl)
    # a column no request reads may hold anything
    spare = torch.cat([bt, torch.full_like(bt[:, :1], -1)], dim=1)
    out, _ = openmla.mla_decode(q, cache, spare, sl, qsl, SCALE, d_v=D_V)
    _check_decode(out, q, cache, bt, sl, qsl)
    # unchecked, the kernel masks the bad block (its keys count as absent) and reads nothing outside the cache
    out, _ = openmla.mla_decode(q, cache, table, sl, qsl, SCALE, d_v=D_V, validate=False)
    assert torch.isfinite(out).all()
    r0, r1 = int(qsl[1]), int(qsl[2])
    ref, _ = mla_decode_ref(q, cache, bt, sl, qsl, SCALE, d_v=D_V)
    assert_close("other requests", torch.cat([ref[:r0], ref[r1:]]), torch.cat([out[:r0], out[r1:]]), *TOL)


# ------------------------------------------------------------------ defect 5: query_start_loc checks
def test_decode_checks_query_start_loc(device):
    q, cache, bt, sl, qsl = _decode_batch(device)
    shifted = qsl.clone()
    shifted[0] = 1
    with pytest.raises(ValueError, match=r"query_start_loc\[0\] must be 0"):
        openmla.mla_decode(q, cache, bt, sl, shifted, SCALE, d_v=D_V)
    with pytest.raises(ValueError, match="must not decrease"):
        bad = torch.tensor([0, 3, 2, 4], dtype=torch.int32, device=device)
        openmla.mla_decode(q, cache, bt, sl, bad, SCALE, d_v=D_V)
    # unchecked, rows outside [0, T) are never touched (here: request 2 would own rows 4..5 of 4)
    beyond = torch.tensor([0, 1, 3, 5], dtype=torch.int32, device=device)
    plan = openmla.plan_decode(sl, beyond, 2, max_query_len=2, max_seq_len=21, d_v=D_V, validate=False)
    out, lse = openmla.mla_decode(q, cache, bt, sl, beyond, SCALE, d_v=D_V, plan=plan, validate=False)
    ref, _ = mla_decode_ref(q, cache, bt, sl, qsl, SCALE, d_v=D_V)
    assert_close("rows of the requests inside q", ref[:3], out[:3], *TOL)


@pytest.mark.parametrize("split", [False, True])
def test_decode_rows_outside_unchecked(split, device):
    # unchecked, a request starting below 0 touches nothing, and one ending past T or longer than the plan's query
    # length only its rows inside both (qlens 1, 2, 1: T = 4; request 0 "starts" at -1, request 2 "ends" at 7 and
    # has 3 rows where the plan allows 2); split: every request in pieces, so the reduce runs on the same rows
    n = openmla.plan_decode(*_decode_batch(device)[3:], 2, d_v=D_V).tiling.block_n  # (the device's key tile)
    q, cache, bt, sl, qsl = _decode_batch(device, lens=(3 * n, 2 * n + 5, 2 * n + 1))
    T = q.shape[0]
    bad = qsl.clone()
    bad[0], bad[-1] = -1, T + 3
    kw = {"_min_split": n, "_max_split": n} if split else {}
    plan = openmla.plan_decode(sl, qsl, 2, d_v=D_V, **kw)
    assert (int(plan.num_splits.min()) > 1) == split
    out = torch.full((T, 2, D_V), 7.0, dtype=q.dtype, device=device)
    lse = torch.full((T, 2), 7.0, device=device)
    openmla.mla_decode(q, cache, bt, sl, bad, SCALE, d_v=D_V, plan=plan, out=out, lse=lse, validate=False)
    assert bool((out[0] == 7.0).all()) and bool((lse[0] == 7.0).all()), "a request starting below 0 wrote row 0"
    ref, ref_lse = mla_decode_ref(q, cache, bt, sl, qsl, SCALE, d_v=D_V)
    assert_close("rows 1..3", ref[1:], out[1:], *TOL)
    assert_close("lse rows 1..3", ref_lse[1:], lse[1:], 1e-3, 1e-3, 1e-6)


# ------------------------------------------------------------------ defect 6
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), "tensor", True])
def test_decode_checks_sm_scale(scale, device):
    q, cache, bt, sl, qsl = _decode_batch(device)
    if scale == "tensor":
        scale = torch.tensor(SCALE, device=device)
    with pytest.raises(ValueError, match="sm_scale"):
        openmla.mla_decode(q, cache, bt, sl, qsl, scale, d_v=D_V)


def test_plan_check_compares_cache_dtype(device):
    q, cache, bt, sl, qsl = _decode_batch(device, dtype=torch.bfloat16)
    plan = openmla.plan_decode(sl, qsl, 2)
    with pytest.raises(ValueError, match="kv_cache_dtype 'auto'.*kv_cache_dtype 'fp8'"):
        openmla.mla_decode(q, cache.to(torch.float8_e4m3fn), bt, sl, qsl, SCALE, d_v=D_V, kv_cache_dtype="fp8",
                           kv_scale=1.0, plan=plan)  # fmt: skip
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        openmla.plan_decode(sl, qsl, 2, kv_cache_dtype="fp8", out=plan)


@pytest.mark.parametrize("kw,match", [(dict(d_v=0), "d_v must be a positive int"),
                                      (dict(d_v=-5), "d_v must be a positive int"),
                                      (dict(num_sms=0), "num_sms must be a positive int")],
                         ids=["d_v0", "d_v-5", "num_sms0"])  # fmt: skip
def test_plan_decode_checks_sizes(kw, match, device):
    sl = torch.tensor([5], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=match):
        openmla.plan_decode(sl, qsl, 2, **kw)


@pytest.mark.parametrize("scale", [0.0, -0.5, "tensor0"])
def test_fp8_cache_write_checks_scale(scale, device):
    kv_c, k_pe = torch.randn(2, D_V, device=device), torch.randn(2, D_R, device=device)
    cache = torch.zeros(1, 4, D_V + D_R, device=device).to(torch.float8_e4m3fn)
    if scale == "tensor0":
        scale = torch.zeros(1, device=device)
    with pytest.raises(ValueError, match="scale must be a positive finite"):
        openmla.concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([0, 1], device=device), kv_cache_dtype="fp8",
                                     scale=scale)  # fmt: skip


def test_fp8_cache_keeps_nan(device):
    kv_c = torch.randn(2, D_V, device=device)
    kv_c[0, 3] = float("nan")
    k_pe = torch.randn(2, D_R, device=device)
    k_pe[1, 0] = float("nan")
    cache = torch.zeros(1, 4, D_V + D_R, device=device).to(torch.float8_e4m3fn)
    openmla.concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([0, 1], device=device), kv_cache_dtype="fp8",
                                 scale=0.5)  # fmt: skip
    rows = cache.view(-1, D_V + D_R)[:2].float()
    want = torch.cat([kv_c, k_pe], 1)
    assert torch.equal(torch.isnan(rows), torch.isnan(want))
    assert_close("fp8 rows", (want / 0.5).to(torch.float8_e4m3fn).float(), rows, 0, 0, 0)


def test_bf16_cache_rounds_to_nearest(device):
    """Cache writes round fp32 to bf16 to nearest even, like a torch cast (the interpreter truncated)."""
    T = 5
    kv_c, k_pe = torch.randn(T, D_V, device=device), torch.randn(T, D_R, device=device)
    cache = torch.zeros(2, 4, D_V + D_R, dtype=torch.bfloat16, device=device)
    slots = torch.arange(T, device=device)
    openmla.concat_and_cache_mla(kv_c, k_pe, cache, slots)
    want = torch.cat([kv_c, k_pe], 1).to(torch.bfloat16)
    assert torch.equal(cache.view(-1, D_V + D_R)[:T].view(torch.int16), want.view(torch.int16))


def test_ds_mla_rope_rounds_to_nearest(device):
    T = 3
    kv_c, k_pe = torch.randn(T, 512, device=device), torch.randn(T, 64, device=device)
    cache = torch.zeros(1, 4, DS_MLA_ROW_BYTES, dtype=torch.uint8, device=device)
    openmla.concat_and_cache_mla(kv_c, k_pe, cache, torch.arange(T, device=device), kv_cache_dtype="fp8_ds_mla")
    rope = cache.view(-1, DS_MLA_ROW_BYTES)[:T, 528:].contiguous().view(torch.bfloat16)
    assert torch.equal(rope.view(torch.int16), k_pe.to(torch.bfloat16).view(torch.int16))


def test_gather_cache_checks_out_dtype(device):
    cache = torch.zeros(2, 4, D_V + D_R, device=device)
    bt = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="out_dtype"):
        openmla.gather_cache(cache, bt, torch.tensor([5], dtype=torch.int32, device=device), out_dtype=torch.int32)


def test_prefill_with_context_checks_last_query_row(device):
    T, H, P, R, V, L = 4, 2, 16, 16, 16, 32
    args = dict(
        q=torch.randn(T, H, P + R, device=device), k_nope=torch.randn(T, H, P, device=device),
        k_pe=torch.randn(T, R, device=device), v=torch.randn(T, H, V, device=device),
        kv_cache=torch.randn(2, 4, L + R, device=device),
        block_table=torch.tensor([[0], [1]], dtype=torch.int32, device=device),
        context_lens=torch.tensor([2, 1], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32, device=device),  # row 3 belongs to no request
        kv_b_proj_weight=torch.randn(H * (P + V), L, device=device), sm_scale=0.2,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"query_start_loc\[-1\] \(3\) must equal q.shape\[0\] \(4\)"):
        openmla.mla_prefill_with_context(**args, chunk_size=8)


def test_expand_page_indices_refuses_int32_overflow(device):
    block_size = 16
    bt = torch.tensor([[0, 2**31 // block_size]], dtype=torch.int64, device=device)  # block 1's slots pass 2**31
    sl = torch.tensor([20], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="int32"):
        openmla.expand_page_indices(bt, sl, block_size)
    # a table below the limit still expands
    ok = torch.tensor([[0, 2**31 // block_size - 1]], dtype=torch.int64, device=device)
    indptr, idx = openmla.expand_page_indices(ok, sl, block_size)
    want_ptr, want_idx = expand_page_indices_ref(ok, sl, block_size)
    assert torch.equal(idx.cpu(), want_idx) and torch.equal(indptr.cpu(), want_ptr)


@pytest.mark.parametrize("scale", [0.0, "tensor-1"])
def test_prefill_with_context_checks_fp8_scale(scale, device):
    T, H, P, R, V, L = 2, 1, 16, 16, 16, 32
    if scale == "tensor-1":
        scale = torch.tensor([-1.0], device=device)
    with pytest.raises(ValueError, match="kv_scale must be a positive finite"):
        openmla.mla_prefill_with_context(
            torch.randn(T, H, P + R, device=device), torch.randn(T, H, P, device=device),
            torch.randn(T, R, device=device), torch.randn(T, H, V, device=device),
            torch.zeros(1, 4, L + R, device=device).to(torch.float8_e4m3fn),
            torch.tensor([[0]], dtype=torch.int32, device=device), torch.tensor([1], dtype=torch.int32, device=device),
            torch.tensor([0, 2], dtype=torch.int32, device=device), torch.randn(H * (P + V), L, device=device), 0.2,
            chunk_size=8, kv_cache_dtype="fp8", kv_scale=scale,
        )  # fmt: skip


def test_gather_cache_unchecked_stays_inside_out(device):
    """validate=False: rows past a too-short ``out`` are not written, positions past the table read as 0."""
    cache = torch.randn(2, 4, D_V + D_R, device=device)
    bt = torch.tensor([[1]], dtype=torch.int32, device=device)
    sl = torch.tensor([6], dtype=torch.int32, device=device)  # 6 positions, the table covers 4
    buf = torch.full((7, D_V + D_R), 5.0, device=device)
    openmla.gather_cache(cache, bt, sl, out=buf[:5], validate=False)
    assert torch.equal(buf[:4], cache[1]) and torch.equal(buf[4], torch.zeros_like(buf[4]))
    assert torch.equal(buf[5:], torch.full_like(buf[5:], 5.0))
    with pytest.raises(ValueError, match="out has 5 rows"):
        openmla.gather_cache(cache, torch.tensor([[1, 0]], dtype=torch.int32, device=device), sl, out=buf[:5])


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan")])
def test_decode_checks_fp8_scales(scale, device):
    q, cache, bt, sl, qsl = _decode_batch(device, dtype=torch.bfloat16)
    fp8 = cache.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv_scale must be a positive finite"):
        openmla.mla_decode(q, fp8, bt, sl, qsl, SCALE, d_v=D_V, kv_cache_dtype="fp8", kv_scale=scale)
    with pytest.raises(ValueError, match="q_scale must be a positive finite"):
        openmla.mla_decode(q.to(torch.float8_e4m3fn), fp8, bt, sl, qsl, SCALE, d_v=D_V, kv_cache_dtype="fp8",
                           kv_scale=1.0, q_scale=scale)  # fmt: skip


# ------------------------------------------------------------------ out= buffers whose elements share memory
def test_ops_refuse_overlapping_out_buffers(device):
    """An expanded (self-overlapping) out= / lse= buffer is refused by name: each element is written by its own
    program, so rows sharing memory would end up with an arbitrary winner."""
    q, cache, bt, sl, qsl = _decode_batch(device)
    T, H = q.shape[:2]
    with pytest.raises(ValueError, match="out must not overlap itself"):
        openmla.mla_decode(q, cache, bt, sl, qsl, SCALE, d_v=D_V,
                           out=torch.zeros(1, H, D_V, dtype=q.dtype, device=device).expand(T, H, D_V))  # fmt: skip
    with pytest.raises(ValueError, match="lse must not overlap itself"):
        openmla.mla_decode(q, cache, bt, sl, qsl, SCALE, d_v=D_V,
                           lse=torch.zeros(1, H, device=device).expand(T, H))  # fmt: skip
    rows = int(sl.sum())
    with pytest.raises(ValueError, match="out must not overlap itself"):
        openmla.gather_cache(cache, bt, sl, out=torch.zeros(1, cache.shape[2], dtype=cache.dtype,
                                                             device=device).expand(rows, cache.shape[2]))  # fmt: skip
    o = torch.randn(T, H, 16, device=device)
    lse = torch.randn(T, H, device=device)
    with pytest.raises(ValueError, match="out must not overlap itself"):
        openmla.merge_attn_states(o, lse, o, lse, out=torch.zeros(T, 1, 16, device=device).expand(T, H, 16))
    k_pe = torch.randn(2, D_R, device=device).to(cache.dtype)
    kv_c = torch.randn(2, D_V, device=device).to(cache.dtype)
    with pytest.raises(ValueError, match="kv_cache must not overlap itself"):
        openmla.concat_and_cache_mla(
            kv_c, k_pe, cache[:1].expand(3, *cache.shape[1:]), torch.tensor([0, 5], device=device)
        )
