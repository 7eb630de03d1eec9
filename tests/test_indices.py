"""expand_page_indices against the reference, with output buffers (CUDA-graph use) and odd strides."""

import pytest
import torch

import openmla
from openmla.reference import expand_page_indices_ref
from openmla.utils.testing import pick


@pytest.mark.parametrize("block_size", [1, 16, 64, 7])
@pytest.mark.parametrize("buffers", [False, True])
def test_expand_page_indices(block_size, buffers, device):
    lens = pick([5, 0, 1, 33, 300], [1, 0, 8192, 37, 32768, 4096])
    B = len(lens)
    W = (max(lens) + block_size - 1) // block_size + 1
    table = torch.randperm(B * W * 2, device=device)[: B * W].view(W, B).t().int()  # non-unit column stride
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    ref_indptr, ref_idx = expand_page_indices_ref(table, seq_lens, block_size)
    if buffers:
        indptr_buf = torch.full((B + 3,), 99, dtype=torch.int32, device=device)
        idx_buf = torch.full((sum(lens) + 10,), 99, dtype=torch.int32, device=device)
        indptr, idx = openmla.expand_page_indices(table, seq_lens, block_size, out_indptr=indptr_buf,
                                                  out_indices=idx_buf)  # fmt: skip
        assert indptr.data_ptr() == indptr_buf.data_ptr() and idx.data_ptr() == idx_buf.data_ptr()
        assert torch.equal(indptr[B + 1 :].cpu(), torch.full((2,), sum(lens), dtype=torch.int32))  # padded reqs
        assert bool((idx[sum(lens) :] == -1).all())
        idx = idx[: sum(lens)]
        indptr = indptr[: B + 1]
    else:
        indptr, idx = openmla.expand_page_indices(table, seq_lens, block_size)
    assert indptr.dtype == torch.int32 and idx.dtype == torch.int32
    assert torch.equal(indptr.cpu(), ref_indptr) and torch.equal(idx.cpu(), ref_idx)


def test_expand_page_indices_int64_table(device):
    table = torch.tensor([[3, 1], [0, 2]], dtype=torch.int64, device=device)
    indptr, idx = openmla.expand_page_indices(table, torch.tensor([3, 4], device=device), 2)
    assert idx.tolist() == [6, 7, 2, 0, 1, 4, 5] and indptr.tolist() == [0, 3, 7]


def test_expand_page_indices_errors(device):
    table = torch.zeros(2, 3, dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="block_table"):
        openmla.expand_page_indices(table.float(), torch.tensor([1, 2], device=device), 4)
    with pytest.raises(ValueError, match="covers 12 tokens"):
        openmla.expand_page_indices(table, torch.tensor([1, 13], device=device), 4)
    with pytest.raises(ValueError, match="seq_lens"):
        openmla.expand_page_indices(table, torch.tensor([1], device=device), 4)
    with pytest.raises(ValueError, match="out_indices holds 2"):
        openmla.expand_page_indices(table, torch.tensor([1, 2], device=device), 4,
                                    out_indices=torch.zeros(2, dtype=torch.int32, device=device))  # fmt: skip
