"""V4 index sets (SWA, CSA top-k, HCA, combine_topk_swa_indices) against the references."""

import pytest
import torch

import openmla  # noqa: F401
from openmla.ops.v4_indices import combine_topk_swa_indices, csa_topk_indices, hca_indices, swa_indices
from openmla.reference.v4 import (
    combine_topk_swa_indices_ref,
    csa_topk_global_ref,
    hca_indices_ref,
    swa_indices_ref,
)
from openmla.utils.testing import pick


def _batch(qlens, ctx, block_size, device, pad_tokens=2):
    """query_start_loc, seq_lens and a shuffled block table (non-unit column stride) for the requests."""
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32, device=device)
    seq = torch.tensor([q + c for q, c in zip(qlens, ctx)], dtype=torch.int32, device=device)
    B = len(qlens)
    W = int(seq.max()) // block_size + 2
    table = torch.randperm(B * W * 2, device=device)[: B * W].view(W, B).t().int()
    return qsl, seq, table, int(qsl[-1]) + pad_tokens


# decode (qlen 1), verify (qlen 3), prefill, a short request, an empty one, a long context
QLENS = pick([1, 3, 9, 2, 0, 1], [1, 3, 700, 2, 0, 1, 64])
CTX = pick([40, 6, 0, 0, 5, 1], [5000, 6, 0, 0, 5, 1, 300])


@pytest.mark.parametrize("window", [4, 16, 128])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_swa_indices(window, block_size, device):
    qsl, seq, table, T = _batch(QLENS, CTX, block_size, device)
    slots = torch.zeros(T, dtype=torch.int64, device=device)
    slots[1] = -1  # an invalid token inside a request
    ref_i, ref_l = swa_indices_ref(qsl, seq, table, block_size, window, T, is_valid=slots >= 0)
    idx, lens = swa_indices(qsl, seq, table, block_size=block_size, window=window, num_tokens=T, slot_mapping=slots)
    assert torch.equal(lens.cpu(), ref_l) and torch.equal(idx.cpu(), ref_i)
    assert int(lens[-1]) == 0 and bool((idx[-1] == -1).all())  # padding token past query_start_loc[B]
    # graph buffers: wider rows, pre-filled with junk
    buf_i = torch.full((T + 3, window + 5), 77, dtype=torch.int32, device=device)
    buf_l = torch.full((T + 3,), 77, dtype=torch.int32, device=device)
    idx2, lens2 = swa_indices(qsl, seq, table, block_size=block_size, window=window, num_tokens=T,
                              slot_mapping=slots, out_indices=buf_i, out_lens=buf_l)  # fmt: skip
    assert idx2.data_ptr() == buf_i.data_ptr() and torch.equal(lens2.cpu(), ref_l)
    assert torch.equal(idx2[:, :window].cpu(), ref_i) and bool((idx2[:, window:] == -1).all())


@pytest.mark.parametrize("ratio", [4, 16])
@pytest.mark.parametrize("topk", [3, 64])
def test_csa_topk_indices(ratio, topk, device):
    bs_c = 4
    qsl, seq, table, T = _batch(QLENS, CTX, bs_c, device)
    n_max = int(seq.max()) // ratio
    # random local ids: some valid, some future (non-causal), -1 holes, repeated and out-of-range ones
    tk = torch.randint(-1, n_max + 3, (T, topk), device=device)
    tk[0, 0] = 0  # index 0 is a real entry, not a sentinel
    tk[2] = -1  # an all-invalid row
    slots = torch.zeros(T, dtype=torch.int64, device=device)
    slots[3] = -1
    ref_i, ref_l = csa_topk_global_ref(tk, qsl, seq, table, bs_c, ratio, is_valid=slots >= 0)
    idx, lens = csa_topk_indices(tk, qsl, seq, table, block_size=bs_c, ratio=ratio, slot_mapping=slots)
    assert torch.equal(lens.cpu(), ref_l) and torch.equal(idx.cpu(), ref_i)
    assert int(lens[2]) == 0 and int(lens[3]) == 0
    # strided rows (a column slice of a wider buffer)
    wide = torch.full((T, topk + 7), -1, dtype=torch.int32, device=device)
    wide[:, :topk] = tk
    idx2, lens2 = csa_topk_indices(wide[:, :topk], qsl, seq, table, block_size=bs_c, ratio=ratio, slot_mapping=slots)
    assert torch.equal(idx2.cpu(), ref_i) and torch.equal(lens2.cpu(), ref_l)


@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize("ratio", [4, 128])
def test_hca_indices(local, ratio, device):
    bs_c = 2
    qsl, seq, table, T = _batch(QLENS, CTX, bs_c * ratio, device)
    width = int(seq.max()) // ratio + 3
    bt = None if local else table
    ref_i, ref_l = hca_indices_ref(qsl, seq, bt, bs_c, ratio, width, T)
    idx, lens = hca_indices(qsl, seq, bt, block_size=bs_c, ratio=ratio, width=width, num_tokens=T)
    assert torch.equal(lens.cpu(), ref_l) and torch.equal(idx.cpu(), ref_i)
    with pytest.raises(ValueError, match="compressed entries but width"):
        hca_indices(qsl, seq, bt, block_size=bs_c, ratio=4, width=1, num_tokens=T)


def test_hca_entry_mid_decode_step(device):
    """A verify step at positions 6, 7, 8 (ratio 4): entry 1 appears at position 7, in the step's middle."""
    qsl = torch.tensor([0, 3], dtype=torch.int32, device=device)
    seq = torch.tensor([9], dtype=torch.int32, device=device)
    table = torch.tensor([[5, 2, 7]], dtype=torch.int32, device=device)
    idx, lens = hca_indices(qsl, seq, table, block_size=1, ratio=4, width=4, num_tokens=3)
    assert lens.tolist() == [1, 2, 2]
    assert idx.tolist() == [[5, -1, -1, -1], [5, 2, -1, -1], [5, 2, -1, -1]]


@pytest.mark.parametrize("ratio,topk", [(4, 8), (128, 40), (1, 0)])
@pytest.mark.parametrize("window", [4, 128])
def test_combine_topk_swa_indices(ratio, topk, window, device):
    qlens = pick([5, 1, 9], [300, 1, 1000])
    ctx = pick([40, 3, 0], [4000, 3, 0])
    base = 7  # the requests' tokens start at offset 7 of a larger batch
    qsl = torch.tensor([base] + [base + int(x) for x in torch.tensor(qlens).cumsum(0)], device=device)
    seq = torch.tensor([q + c for q, c in zip(qlens, ctx)], device=device)
    gather = torch.minimum(seq, torch.tensor(qlens, device=device) + window - 1)
    gather[0] += 1  # more than needed is fine
    gather = torch.minimum(seq, gather)
    N = int(seq.max()) // ratio if topk else 0
    M = N + int(gather.max()) + 3
    Tq = sum(qlens)
    tk = torch.randint(-1, N + 2, (Tq, max(topk, 1) + 2), device=device)[:, : topk + 2 if topk else 0]
    ref_i, ref_l = combine_topk_swa_indices_ref(tk, qsl, seq, gather, window, ratio, topk, M, N,
                                                (topk + window + 127) // 128 * 128)  # fmt: skip
    idx, lens = combine_topk_swa_indices(tk, qsl, seq, gather, window=window, ratio=ratio, topk=topk, M=M, N=N)
    assert idx.shape == ref_i.shape
    assert torch.equal(lens.cpu(), ref_l) and torch.equal(idx.cpu(), ref_i)
    assert int(idx.max()) < len(qlens) * M  # inside the workspace
    with pytest.raises(ValueError, match="cover each query's window"):
        combine_topk_swa_indices(tk, qsl, seq, gather - 1, window=window, ratio=ratio, topk=topk, M=M, N=N)
    with pytest.raises(ValueError, match="exceeds M"):
        combine_topk_swa_indices(tk, qsl, seq, gather, window=window, ratio=ratio, topk=topk, M=N + 1, N=N)


def test_index_errors(device):
    qsl, seq, table, T = _batch([2, 1], [3, 0], 4, device)
    with pytest.raises(ValueError, match="seq_lens must be >="):
        swa_indices(qsl, torch.tensor([1, 1], device=device), table, block_size=4, window=8, num_tokens=T)
    with pytest.raises(ValueError, match="block_table"):
        swa_indices(qsl, seq, table[:1], block_size=4, window=8, num_tokens=T)
    with pytest.raises(ValueError, match="covers only"):
        swa_indices(qsl, seq + 100, table, block_size=4, window=8, num_tokens=T)
    with pytest.raises(ValueError, match="out_indices"):
        swa_indices(qsl, seq, table, block_size=4, window=8, num_tokens=T,
                    out_indices=torch.zeros(T, 4, dtype=torch.int32, device=device))  # fmt: skip
    with pytest.raises(TypeError, match="topk_indices"):
        csa_topk_indices(torch.zeros(T, 4, device=device), qsl, seq, table, block_size=1, ratio=4)
    with pytest.raises(ValueError, match="topk 9 exceeds"):
        combine_topk_swa_indices(torch.zeros(T, 4, dtype=torch.int32, device=device), qsl, seq, seq, window=4,
                                 ratio=4, topk=9, M=20, N=2)  # fmt: skip


@pytest.mark.gpu
def test_index_sets_cuda_graph(device):
    """swa / csa / hca index sets captured once and replayed for a later decode step (buffers updated in place)."""
    qsl, seq, table, T = _batch([1, 1, 1], [40, 6, 130], 16, device, pad_tokens=1)
    topk = torch.randint(-1, 40, (T, 8), device=device, dtype=torch.int32)
    bufs = {k: (torch.empty(T, w, dtype=torch.int32, device=device), torch.empty(T, dtype=torch.int32, device=device))
            for k, w in (("swa", 16), ("csa", 8), ("hca", 64))}  # fmt: skip

    def fn():
        swa_indices(qsl, seq, table, block_size=16, window=16, num_tokens=T, out_indices=bufs["swa"][0],
                    out_lens=bufs["swa"][1])  # fmt: skip
        csa_topk_indices(topk, qsl, seq, table, block_size=4, ratio=4, out_indices=bufs["csa"][0],
                         out_lens=bufs["csa"][1])  # fmt: skip
        hca_indices(qsl, seq, table, block_size=4, ratio=4, width=64, num_tokens=T, out_indices=bufs["hca"][0],
                    out_lens=bufs["hca"][1])  # fmt: skip

    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    seq += 3  # a later step: every request three tokens longer
    topk.random_(-1, 40)
    graph.replay()
    torch.cuda.synchronize()
    want = {
        "swa": swa_indices_ref(qsl, seq, table, 16, 16, T),
        "csa": csa_topk_global_ref(topk, qsl, seq, table, 4, 4),
        "hca": hca_indices_ref(qsl, seq, table, 4, 4, 64, T),
    }
    for k, (ref_i, ref_l) in want.items():
        assert torch.equal(bufs[k][1].cpu(), ref_l), k
        assert torch.equal(bufs[k][0].cpu(), ref_i), k


def test_ragged_form(device):
    """Dense rows + lens -> build_ragged_indices_from_dense: the valid entries, token after token."""
    qsl, seq, table, T = _batch(QLENS, CTX, 16, device)
    idx, lens = swa_indices(qsl, seq, table, block_size=16, window=8, num_tokens=T)
    indptr, flat = openmla.build_ragged_indices_from_dense(idx, lens)
    ref_i, ref_l = swa_indices_ref(qsl, seq, table, 16, 8, T)
    want = torch.cat([ref_i[t, : ref_l[t]] for t in range(T)])
    assert int(indptr[-1]) == want.numel() and torch.equal(flat[: want.numel()].cpu(), want)


def _strided(t):
    """The same values as a non-contiguous 1-D view."""
    return torch.stack([t, torch.full_like(t, 12345)], dim=1)[:, 0]


def test_strided_index_inputs(device):
    qsl, seq, table, T = _batch(QLENS, CTX, 16, device)
    slots = torch.zeros(T, dtype=torch.int64, device=device)
    slots[2] = -1
    ref = swa_indices(qsl, seq, table, block_size=16, window=8, num_tokens=T, slot_mapping=slots)
    got = swa_indices(_strided(qsl), _strided(seq), table, block_size=16, window=8, num_tokens=T,
                      slot_mapping=_strided(slots))  # fmt: skip
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    tk = torch.randint(-1, 10, (T, 5), device=device)
    ref = csa_topk_indices(tk, qsl, seq, table, block_size=4, ratio=4)
    got = csa_topk_indices(tk, _strided(qsl), _strided(seq), table, block_size=4, ratio=4)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
