"""Input validation of the DeepSeek V3.2 sparse ops (sparse_mla, apply_attn_sink, the index ops, the lightning
indexer): strided inputs handled or refused, bad arguments refused naming the argument, nothing read, written or
wrapped outside what the docstrings promise. Tiny shapes on every device."""

from __future__ import annotations

import pytest
import torch

import openmla
from openmla.ops.indexer import alloc_indexer_k_cache
from openmla.reference import (
    apply_attn_sink_ref,
    concat_and_cache_indexer_k_ref,
    convert_req_index_to_global_index_ref,
    indexer_logits_ref,
    indexer_topk_ref,
    sparse_mla_ref,
)
from openmla.utils.testing import assert_close


def _strided(t: torch.Tensor, fill: int = 12345) -> torch.Tensor:
    """The same values as ``t`` (1-D), as a view with stride 2 whose gaps hold ``fill``."""
    buf = torch.full((2 * t.shape[0],), fill, dtype=t.dtype, device=t.device)
    view = buf[::2]
    view.copy_(t)
    return view


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


# ------------------------------------------------------------------ convert_req_index_to_global_index
def _convert_case(device):
    bt = _i32([[3, 1, -1], [0, 2, 5]], device)
    tok = _i32([[0, 5, 9, -1], [1, 4, 11, 12]], device)
    return _i32([1, 0], device), bt, tok, _i32([3, 2], device)


@pytest.mark.parametrize("validate", [True, False])
def test_convert_strided_req_id_and_topk_length(validate, device):
    """1-D req_id / topk_length with a stride (or expanded) are read by their strides, not as dense arrays."""
    req, bt, tok, lens = _convert_case(device)
    f = openmla.convert_req_index_to_global_index
    want = convert_req_index_to_global_index_ref(req, bt, tok, 4, lens)
    # gaps of 12345 (a request row past the table) and 0 (a length that keeps nothing) would show
    got = f(_strided(req), bt, tok, 4, topk_length=_strided(lens, fill=0), validate=validate)
    assert torch.equal(got.cpu(), want)
    same = _i32([1], device).expand(2)
    got = f(same, bt, tok, 4, validate=validate)
    assert torch.equal(got.cpu(), convert_req_index_to_global_index_ref(same, bt, tok, 4))


def test_convert_refuses_int32_slot_overflow(device):
    """A selected block whose slots pass int32 is refused (the int32 output would wrap); garbage in block-table
    entries no token selects is not."""
    req, bt, tok, _ = _convert_case(device)
    f = openmla.convert_req_index_to_global_index
    big = bt.clone()
    big[0, 0] = 2**31 // 4  # selected by token 1 (request 0, position 1)
    with pytest.raises(ValueError, match="overflow the int32 output"):
        f(req, big, tok, 4)
    with pytest.raises(ValueError, match="overflow the int32 output"):
        f(req, big.long() * 2**10, tok, 4)  # an int64 table is not truncated either
    # unchecked: such a slot becomes -1 (skipped by sparse_mla), never a wrapped or truncated slot
    want = f(req, bt, tok, 4)
    got = f(req, big, tok, 4, validate=False)
    assert int(got[1, 0]) == -1 and want[1, 0] >= 0
    got[1, 0] = want[1, 0]
    assert torch.equal(got, want)
    unused = bt.clone()
    unused[0, 2] = 2**30  # request 0's third block: position 11 sits past topk_length 2 below, 9 is request 1's
    lens = _i32([3, 2], device)
    got = f(req, unused, tok, 4, topk_length=lens)
    assert torch.equal(got.cpu(), convert_req_index_to_global_index_ref(req, unused, tok, 4, lens))


def test_convert_refusals(device):
    req, bt, tok, lens = _convert_case(device)
    f = openmla.convert_req_index_to_global_index
    with pytest.raises(TypeError, match="req_id must be an int32 or int64 index tensor"):
        f(req.float(), bt, tok, 4)
    with pytest.raises(ValueError, match="topk_length must be 1-D"):
        f(req, bt, tok, 4, topk_length=lens[None])
    with pytest.raises(ValueError, match=r"out must have shape \[2, 4\]"):
        f(req, bt, tok, 4, out=torch.zeros(8, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        f(req, bt, tok, 4.0)


# ------------------------------------------------------------------ sparse_seq_lens
def test_sparse_seq_lens_checks_num_tokens_and_out(device):
    qsl, sl = _i32([0, 2, 3], device), _i32([5, 1], device)
    f = openmla.sparse_seq_lens
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="num_tokens must be a non-negative int"):
            f(qsl, sl, 3, num_tokens=bad)
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        f(qsl, sl, 3, out=[0, 0, 0])
    # a 2-D buffer came back as its first rows ([2, 2] for 3 tokens, one entry unwritten)
    with pytest.raises(ValueError, match="out must be 1-D"):
        f(qsl, sl, 3, out=torch.zeros(2, 2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="out must be 1-D"):
        f(qsl, sl, 3, num_tokens=3, out=torch.zeros(2, 2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="seq_lens must be contiguous"):
        f(qsl, _strided(sl), 3)


# ------------------------------------------------------------------ build_ragged_indices_from_dense
def test_build_ragged_checks_num_rows_and_buffers(device):
    idx = torch.arange(12, dtype=torch.int32, device=device).view(3, 4)
    lens = _i32([1, 4, 2], device)
    f = openmla.build_ragged_indices_from_dense
    with pytest.raises(ValueError, match="num_rows must be >= 0, or -1"):
        f(idx, lens, num_rows=-5)
    # 2-D buffers came back sliced by rows: indptr [2, 2], flat [3, 4]
    with pytest.raises(ValueError, match="out_indptr must be 1-D"):
        f(idx, lens, out_indptr=torch.zeros(2, 2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="out_flat must be 1-D"):
        f(idx, lens, out_flat=torch.zeros(3, 4, dtype=torch.int32, device=device))


def test_build_ragged_refuses_int32_overflow(device):
    """More entries than int32 indptr addresses: the prefix sum would wrap and the copy write outside flat."""
    R, W = 2**16, 2**15 + 1
    idx = torch.zeros(1, 1, dtype=torch.int32, device=device).expand(R, W)  # no memory behind it
    with pytest.raises(ValueError, match="int32 indptr"):
        openmla.build_ragged_indices_from_dense(idx, torch.zeros(R, dtype=torch.int32, device=device))


# ------------------------------------------------------------------ sparse_mla / apply_attn_sink
D_V, D_R = 64, 16
D = D_V + D_R
SCALE = D**-0.5


def _sparse_case(device, T=3, H=2, nb=4, bs=4, K=6):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(T, H, D, generator=g).to(device)
    cache = torch.randn(nb, bs, D, generator=g).to(device)
    idx = torch.randint(-2, nb * bs + 3, (T, K), generator=g, dtype=torch.int32).to(device)
    return q, cache, idx


def _check_sparse(got, want):
    assert_close("out", want[0], got[0], 1e-5, 1e-5, 1e-9)
    assert_close("lse", want[1], got[1], 1e-5, 1e-5, 1e-9)


@pytest.mark.parametrize("splits", [1, 3])
def test_sparse_mla_strided_inputs(splits, device):
    """Strides of q's and the cache's first two dims, expanded index rows and strided out / lse buffers are read
    and written by their strides (one split and the split merge)."""
    q, cache, idx = _sparse_case(device)
    T, H = q.shape[:2]
    sink = torch.tensor([0.3, -0.5], device=device)
    q_s = torch.zeros(H, T, 2 * D, device=device)[:, :, :D].transpose(0, 1)
    q_s.copy_(q)
    c_s = torch.zeros(cache.shape[0], 2 * cache.shape[1], D + 8, device=device)[:, ::2, :D]
    c_s.copy_(cache)
    rows = idx[:1].expand(T, idx.shape[1])
    out_buf = torch.zeros(T, 2 * H, D_V + 4, device=device)[:, ::2, :D_V]
    lse_buf = torch.zeros(2 * T, H, device=device)[::2]
    out, lse = openmla.sparse_mla(q_s, c_s, rows, SCALE, d_v=D_V, attn_sink=sink, out=out_buf, lse=lse_buf,
                                  _num_splits_override=splits)  # fmt: skip
    assert out.data_ptr() == out_buf.data_ptr() and lse.data_ptr() == lse_buf.data_ptr()
    _check_sparse((out, lse), sparse_mla_ref(q, cache, rows.contiguous(), SCALE, d_v=D_V, attn_sink=sink))


def test_sparse_mla_refusals(device):
    q, cache, idx = _sparse_case(device)
    T, H = q.shape[:2]
    f = openmla.sparse_mla
    lens = _i32([6, 2, 0], device)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):  # was "unhashable type: 'list'"
        f(q, cache, idx, SCALE, d_v=D_V, kv_cache_dtype=["auto"])
    with pytest.raises(ValueError, match="indices must be contiguous in its last dimension"):
        f(q, cache, idx.t().contiguous().t(), SCALE, d_v=D_V)
    with pytest.raises(ValueError, match="topk_length must be contiguous in its last dimension"):
        f(q, cache, idx, SCALE, d_v=D_V, topk_length=_strided(lens))
    with pytest.raises(ValueError, match="attn_sink must be contiguous in its last dimension"):
        f(q, cache, idx, SCALE, d_v=D_V, attn_sink=_strided(torch.zeros(H, device=device), fill=0))
    indptr = _i32([0, 6, 8, 8], device)
    with pytest.raises(ValueError, match=r"indices\[0\] \(indptr\) must be contiguous"):
        f(q, cache, (_strided(indptr), idx.flatten()), SCALE, d_v=D_V)
    with pytest.raises(ValueError, match="out must be contiguous in its last dimension"):
        f(q, cache, idx, SCALE, d_v=D_V, out=torch.zeros(T, H, 2 * D_V, device=device)[..., ::2])
    with pytest.raises(ValueError, match="extra_topk_length must lie in"):
        f(q, cache, idx, SCALE, d_v=D_V, extra_kv_cache=cache, extra_indices=idx, extra_topk_length=lens + 1)
    # buffers written in place whose elements share memory (expanded views) are refused, not raced over
    with pytest.raises(ValueError, match="out must not overlap itself"):
        f(q, cache, idx, SCALE, d_v=D_V, out=torch.zeros(1, H, D_V, device=device).expand(T, H, D_V))
    with pytest.raises(ValueError, match="lse must not overlap itself"):
        f(q, cache, idx, SCALE, d_v=D_V, lse=torch.zeros(1, H, device=device).expand(T, H))


def test_apply_attn_sink_strided(device):
    g = torch.Generator().manual_seed(4)
    T, H = 3, 2
    out = torch.randn(H, T, 8, generator=g).to(device).transpose(0, 1)
    lse = torch.randn(H, T, generator=g).to(device).t()
    sink = torch.randn(H, generator=g).to(device)
    got = openmla.apply_attn_sink(out, lse, sink)
    assert_close("out", apply_attn_sink_ref(out, lse, sink), got, 1e-6, 1e-6, 1e-9)
    with pytest.raises(ValueError, match="out must be contiguous in its last dimension"):
        openmla.apply_attn_sink(torch.zeros(T, H, 16, device=device)[..., ::2], lse, sink)
    shared = torch.zeros(1, H, 8, device=device).expand(T, H, 8)
    openmla.apply_attn_sink(shared, lse, sink)  # read only: an expanded out is fine
    with pytest.raises(ValueError, match="out must not overlap itself"):
        openmla.apply_attn_sink(shared, lse, sink, inplace=True)


# ------------------------------------------------------------------ lightning indexer
def _indexer_case(device, H=2, Di=16, bs=4, nb=8):
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(nb, bs, Di, generator=g).to(device)
    bt = _i32([[3, 0, 5], [6, 1, -1]], device)
    sl, qsl = _i32([9, 5], device), _i32([0, 1, 3], device)
    q = torch.randn(3, H, Di, generator=g).to(device)
    w = torch.randn(3, H, generator=g).to(device)
    return q, w, cache, bt, sl, qsl


@pytest.mark.parametrize("validate", [True, False])
def test_indexer_strided_seq_lens_and_query_start_loc(validate, device):
    """1-D seq_lens / query_start_loc with a stride are read by their strides (the gaps hold 12345)."""
    q, w, cache, bt, sl, qsl = _indexer_case(device)
    want = indexer_logits_ref(q, w, cache, bt, sl, qsl)
    got = openmla.indexer_logits(q, w, cache, bt, _strided(sl), _strided(qsl), validate=validate)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert_close("logits", want, got, 1e-5, 1e-5, 1e-9)
    top = openmla.indexer_topk(q, w, cache, bt, _strided(sl), _strided(qsl), 4, validate=validate)
    assert torch.equal(top.cpu(), indexer_topk_ref(q, w, cache, bt, sl, qsl, 4).cpu())


def test_indexer_refuses_bool_lengths(device):
    q, w, cache, bt, sl, qsl = _indexer_case(device)
    with pytest.raises(ValueError, match="max_seq_len must be a non-negative int"):
        openmla.indexer_logits(q, w, cache, bt, sl, qsl, max_seq_len=True, validate=False)
    with pytest.raises(ValueError, match="max_query_len must be a positive int"):
        openmla.indexer_topk(q, w, cache, bt, sl, qsl, 4, max_query_len=True)
    with pytest.raises(ValueError, match="block_table must be contiguous in its last dimension"):
        openmla.indexer_logits(q, w, cache, bt.t().contiguous().t(), sl, qsl)


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("validate", [True, False])
def test_concat_indexer_k_strided_slot_mapping(cache_dtype, validate, device):
    g = torch.Generator().manual_seed(6)
    k = torch.randn(5, 16, generator=g).to(device)
    slots = torch.tensor([3, 9, -1, 0, 14], device=device)
    cache = alloc_indexer_k_cache(4, 4, 16, cache_dtype=cache_dtype, dtype=torch.float32, device=device)
    want = concat_and_cache_indexer_k_ref(k, cache.clone(), slots, cache_dtype=cache_dtype)
    openmla.concat_and_cache_indexer_k(k, cache, _strided(slots, fill=-1), cache_dtype=cache_dtype, validate=validate)
    assert torch.equal(cache, want)
    with pytest.raises(ValueError, match="cache must not overlap itself"):  # written in place
        openmla.concat_and_cache_indexer_k(k, cache[:1].expand(*cache.shape), slots, cache_dtype=cache_dtype)
