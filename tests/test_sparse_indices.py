"""Sparse index ops against their references: top-k positions -> global slots, per-token top-k lengths,
dense -> ragged; output buffers (CUDA graphs), odd strides, sentinels and errors."""

import pytest
import torch

import openmla
from openmla.reference import (
    build_ragged_indices_from_dense_ref,
    convert_req_index_to_global_index_ref,
    sparse_seq_lens_ref,
)
from openmla.utils.testing import pick


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("with_len", [False, True])
@pytest.mark.parametrize("buffer", [False, True])
def test_convert_req_index(block_size, with_len, buffer, device):
    T, K, R, W = pick(6, 64), pick(100, 2048), 3, pick(5, 40)
    g = torch.Generator().manual_seed(1)
    req = torch.randint(0, R, (T,), generator=g, dtype=torch.int32)
    # a transposed table (column stride != 1) with some negative block numbers
    table = torch.randperm(R * W * 2, generator=g)[: R * W].view(W, R).t().int()
    table[0, 1] = -1
    tok = torch.randint(0, W * block_size + 2 * block_size, (T, K), generator=g, dtype=torch.int32)  # some past W
    tok[:, 0] = 0
    tok[0, ::3] = -1
    tok[1, 1] = -5
    lens = torch.randint(0, K + 1, (T,), generator=g, dtype=torch.int32) if with_len else None
    ref = convert_req_index_to_global_index_ref(req, table, tok, block_size, topk_length=lens)
    args = [x.to(device) for x in (req, table, tok)]
    kw = {"topk_length": lens.to(device) if with_len else None}
    if buffer:
        buf = torch.full((T, K), 99, dtype=torch.int32, device=device)
        out = openmla.convert_req_index_to_global_index(*args, block_size, out=buf, **kw)
        assert out.data_ptr() == buf.data_ptr()
    else:
        out = openmla.convert_req_index_to_global_index(*args, block_size, **kw)
    assert out.dtype == torch.int32 and out.shape == (T, K)
    assert torch.equal(out.cpu(), ref)
    assert bool((out[0, ::3] == -1).all())  # -1 stays -1


def test_convert_req_index_strided_input(device):
    tok = torch.arange(40, dtype=torch.int32, device=device).view(5, 8).t()  # [8, 5], stride (1, 8)
    table = torch.tensor([[4, 2, 0]], dtype=torch.int32, device=device)
    req = torch.zeros(8, dtype=torch.int32, device=device)
    out = openmla.convert_req_index_to_global_index(req, table, tok, 16)
    assert torch.equal(out.cpu(), convert_req_index_to_global_index_ref(req, table, tok, 16))


def test_convert_req_index_errors(device):
    req = torch.zeros(2, dtype=torch.int32, device=device)
    table = torch.zeros(1, 4, dtype=torch.int32, device=device)
    tok = torch.zeros(2, 8, dtype=torch.int32, device=device)
    f = openmla.convert_req_index_to_global_index
    with pytest.raises(TypeError, match="token_indices"):
        f(req, table, tok.float(), 16)
    with pytest.raises(ValueError, match="token_indices must have 2 entries"):
        f(req, table, tok[:1], 16)
    with pytest.raises(ValueError, match="block_size"):
        f(req, table, tok, 0)
    with pytest.raises(ValueError, match="req_id holds 1 but block_table has 1 rows"):
        f(req + 1, table, tok, 16)
    with pytest.raises(ValueError, match="out must be a contiguous int32"):
        f(req, table, tok, 16, out=torch.zeros(2, 8, dtype=torch.int64, device=device))
    # unvalidated: a bad request row gives -1, never a read outside the table
    out = f(req + 5, table, tok, 16, validate=False)
    assert bool((out == -1).all())


@pytest.mark.parametrize("buffer", [False, True])
def test_sparse_seq_lens(buffer, device):
    qlens = pick([1, 3, 0, 2, 5], [1] * 100 + [4] * 50 + [0, 7])
    seq = pick([10, 2, 0, 4000, 5], [3000] * 100 + [1, 2] * 25 + [0, 9000])
    seq[2 if len(seq) < 10 else -2] = 0
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    sl = torch.tensor(seq, dtype=torch.int32, device=device)
    T = sum(qlens)
    topk = 2048
    if buffer:  # CUDA-graph padding: rows past the batch get 0
        buf = torch.full((T + 5,), 99, dtype=torch.int32, device=device)
        out = openmla.sparse_seq_lens(qsl, sl, topk, out=buf)
        assert out.data_ptr() == buf.data_ptr() and out.shape == (T + 5,)
        assert torch.equal(out.cpu(), sparse_seq_lens_ref(qsl, sl, topk, num_tokens=T + 5))
        assert bool((out[T:] == 0).all())
    else:
        out = openmla.sparse_seq_lens(qsl, sl, topk)
        assert torch.equal(out.cpu(), sparse_seq_lens_ref(qsl, sl, topk))
    # the verify row of request 1 (qlen 3, seq_len 2): positions -1, 0, 1 -> 0, 1, 2
    if len(qlens) < 10:
        assert out[1:4].tolist() == [0, 1, 2]


def test_sparse_seq_lens_errors(device):
    qsl = torch.tensor([0, 2, 1], dtype=torch.int32, device=device)
    sl = torch.tensor([4, 4], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="non-decreasing"):
        openmla.sparse_seq_lens(qsl, sl, 8)
    with pytest.raises(ValueError, match="seq_lens must have 2 entries"):
        openmla.sparse_seq_lens(qsl, sl[:1], 8)
    with pytest.raises(ValueError, match="topk"):
        openmla.sparse_seq_lens(qsl, sl, -1)
    out = openmla.sparse_seq_lens(torch.zeros(1, dtype=torch.int32, device=device),
                                  torch.zeros(0, dtype=torch.int32, device=device), 8)  # fmt: skip
    assert out.shape == (0,)


@pytest.mark.parametrize("num_rows", [-1, 50])
@pytest.mark.parametrize("buffers", [False, True])
def test_build_ragged_indices(num_rows, buffers, device):
    R, W = pick(7, 300), pick(40, 2048)
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(-2, 80, (W, R), generator=g, dtype=torch.int32).t()  # strided rows
    lens = torch.randint(0, W + 1, (R,), generator=g, dtype=torch.int32)
    lens[0] = 0
    lens[-1] = W
    ref_indptr, ref_flat = build_ragged_indices_from_dense_ref(idx, lens, num_rows=num_rows)
    if buffers:
        bi = torch.full((R + 3,), 99, dtype=torch.int32, device=device)
        bf = torch.full((R * W + 3,), 99, dtype=torch.int32, device=device)
        indptr, flat = openmla.build_ragged_indices_from_dense(idx.to(device), lens.to(device), num_rows=num_rows,
                                                               out_indptr=bi, out_flat=bf)  # fmt: skip
        assert indptr.data_ptr() == bi.data_ptr() and flat.data_ptr() == bf.data_ptr()
    else:
        indptr, flat = openmla.build_ragged_indices_from_dense(idx.to(device), lens.to(device), num_rows=num_rows)
    assert indptr.shape == (R + 1,) and flat.shape == (R * W,)
    assert torch.equal(indptr.cpu(), ref_indptr)
    n = int(ref_indptr[-1])
    assert torch.equal(flat[:n].cpu(), ref_flat)


def test_build_ragged_indices_edges(device):
    empty = openmla.build_ragged_indices_from_dense(torch.zeros(0, 8, dtype=torch.int32, device=device),
                                                    torch.zeros(0, dtype=torch.int32, device=device))  # fmt: skip
    assert empty[0].tolist() == [0] and empty[1].shape == (0,)
    idx = torch.arange(12, dtype=torch.int32, device=device).view(3, 4)
    with pytest.raises(ValueError, match="lengths must lie in \\[0, 4\\]"):
        openmla.build_ragged_indices_from_dense(idx, torch.tensor([1, 5, 0], dtype=torch.int32, device=device))
    # unvalidated lengths are clamped to the row: nothing is copied past it
    indptr, flat = openmla.build_ragged_indices_from_dense(
        idx, torch.tensor([1, 9, -3], dtype=torch.int32, device=device), validate=False
    )
    assert indptr.tolist() == [0, 1, 5, 5] and flat[:5].tolist() == [0, 4, 5, 6, 7]
    with pytest.raises(ValueError, match="out_flat"):
        openmla.build_ragged_indices_from_dense(idx, torch.tensor([1, 1, 1], dtype=torch.int32, device=device),
                                                out_flat=torch.zeros(11, dtype=torch.int32, device=device))  # fmt: skip
