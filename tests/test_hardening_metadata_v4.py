"""Hardening of the V3.2 (SparseMLAMetadataBuilder) and V4 (V4MetadataBuilder) metadata builders: bad steps are
refused by name on host values alone, padded and empty steps index nothing, and V4's request tensors live in
persistent buffers. The refusal tests failed before this change (built silently or failed without naming the input)."""

from __future__ import annotations

import pytest
import torch

from openmla.metadata import BatchSpec, SparseMLAMetadataBuilder, V4MetadataBuilder
from openmla.metadata.v4 import ring_blocks

BS, WINDOW = 4, 4


def _spec(qlens, seq_lens, device, *, width=None, rows=None, table=None, max_seq_len=None, max_query_len=None,
          with_cpu_seq=True, slot_rows=None):  # fmt: skip
    """Request b owns blocks 10*b + i (recognisable); slots follow the table, -1 on padding rows."""
    B = len(qlens)
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    width = width if width is not None else max([-(-s // BS) for s in seq_lens], default=1)
    if table is None:
        table = [[10 * b + i for i in range(width)] for b in range(B)]
    bt = torch.tensor(table, dtype=torch.int32).reshape(B, width)
    T = rows if rows is not None else qsl[-1]
    slots = [-1] * (T if slot_rows is None else slot_rows)
    for b, (q, s) in enumerate(zip(qlens, seq_lens)):
        for j in range(q):
            p = s - q + j
            if qsl[b] + j < len(slots) and 0 <= p < width * BS:
                slots[qsl[b] + j] = table[b][p // BS] * BS + p % BS
    qsl_t, sl = torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
    return BatchSpec(
        query_start_loc=qsl_t.to(device), query_start_loc_cpu=qsl_t, seq_lens=sl.to(device), block_table=bt.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), num_reqs=B, num_actual_tokens=qsl[-1],
        max_query_len=max(qlens, default=0) if max_query_len is None else max_query_len,
        max_seq_len=max(seq_lens, default=0) if max_seq_len is None else max_seq_len,
        seq_lens_cpu=sl if with_cpu_seq else None, num_input_tokens=T,
    )  # fmt: skip


def _sparse(device, **kw):
    args = dict(index_topk=6, block_size=BS, max_num_seqs=4, max_model_len=32, max_num_batched_tokens=16,
                device=device, decode_threshold=2)  # fmt: skip
    return SparseMLAMetadataBuilder(**{**args, **kw})


def _v4(device, **kw):
    args = dict(block_size=BS, window=WINDOW, ratios=(2, 8), max_num_seqs=4, max_num_batched_tokens=16,
                max_model_len=32, device=device)  # fmt: skip
    return V4MetadataBuilder(**{**args, **kw})


def _builders(device):
    return {"sparse": _sparse(device), "v4": _v4(device), "v4-ring": _v4(device, swa_ring_blocks=4)}


KINDS = ["sparse", "v4", "v4-ring"]


# ---------------------------------------------------------------------------- plain definitions (SPEC 6.2, 6.5, 7.5)
def _rows(qlens, seq_lens, T):
    """(request, position) of each of T rows; (-1, None) past the last request."""
    out = [(b, s - q + j) for b, (q, s) in enumerate(zip(qlens, seq_lens)) for j in range(q)]
    return out + [(-1, None)] * (T - len(out))


def _slot(table, b, i, bs):
    return table[b][i // bs] * bs + i % bs


def _check_sparse(md, qlens, seq_lens, T, topk):
    rows = _rows(qlens, seq_lens, T)
    assert md.req_id_per_token.tolist() == [b for b, _ in rows]
    assert md.positions.tolist() == [-1 if p is None else p for _, p in rows]
    assert md.sparse_lens.tolist() == [0 if p is None else min(p + 1, topk) for _, p in rows]


def _check_v4(md, qlens, seq_lens, T, table, ratios, bs_c):
    rows = _rows(qlens, seq_lens, T)
    assert md.positions.tolist() == [0 if p is None else p for _, p in rows]
    for t, (b, p) in enumerate(rows):
        if p is None:  # padding: nothing to read
            assert md.swa_lens[t] == 0 and md.swa_indices[t].eq(-1).all()
            for r in ratios:
                assert md.compressed[r].hca_lens[t] == 0 and md.compressed[r].hca_indices[t].eq(-1).all()
            continue
        want = [_slot(table, b, i, BS) for i in range(max(0, p - WINDOW + 1), p + 1)]
        assert md.swa_indices[t].tolist() == want + [-1] * (WINDOW - len(want)), (t, b, p)
        assert md.swa_lens[t] == len(want)
        for r in ratios:
            cm = md.compressed[r]
            want = [_slot(table, b, i, bs_c[r]) for i in range((p + 1) // r)]
            got = cm.hca_indices[t].tolist()
            assert got == want + [-1] * (len(got) - len(want)) and cm.hca_lens[t] == len(want), (t, r)


# (qlens, seq_lens, rows): empty, empty with padding rows, decode-only, decode with graph padding (dummies qlen 0,
# seq 0), prefill-only, mixed with a qlen-0 request in the middle and padding rows
CASES = [
    ([], [], 0),
    ([], [], 3),
    ([1, 1, 1], [5, 9, 1], 3),
    ([1, 1, 0, 0], [7, 12, 0, 0], 4),
    ([5, 3], [5, 9], 8),
    ([1, 0, 4, 2], [6, 3, 11, 2], 10),
]


@pytest.mark.parametrize("qlens,seq_lens,rows", CASES)
def test_builders_match_plain_definitions(qlens, seq_lens, rows, device):
    """Both builders against the plain definitions (V4's empty batch used to fail: IndexError / kernel refusal)."""
    spec = _spec(qlens, seq_lens, device, width=8, rows=rows)
    table = spec.block_table.cpu().tolist()
    _check_sparse(_sparse(device).build(spec), qlens, seq_lens, rows, topk=6)
    b = _v4(device)
    _check_v4(b.build(spec), qlens, seq_lens, rows, table, (2, 8), b.bs_c)


@pytest.mark.parametrize("qlens,seq_lens,rows", CASES)
def test_v4_ring_slots_and_padding(qlens, seq_lens, rows, device):
    """With the SWA ring, padding rows (and an empty batch) write nowhere; real rows go to their state slot's ring."""
    n = 4
    b = _v4(device, swa_ring_blocks=n)
    b.state_slots[:4] = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    md = b.build(_spec(qlens, seq_lens, device, width=8, rows=rows))
    ring = [2, 0, 3, 1]
    want = [-1 if p is None else (ring[r] * n + (p // BS) % n) * BS + p % BS for r, p in _rows(qlens, seq_lens, rows)]
    assert md.slot_mapping.tolist() == want
    assert md.swa_lens.tolist() == [0 if p is None else min(WINDOW, p + 1) for _, p in _rows(qlens, seq_lens, rows)]


# ------------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("kind", KINDS)
def test_refuses_seq_len_below_query_len(kind, device):
    """Before: built, with position -1 on a real row (V4's ring mapped it into the ring, the RoPE read row -1)."""
    b = _builders(device)[kind]
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 2 is below request 1's query length 3"):
        b.build(_spec([1, 3], [4, 2], device, width=2))
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = -1"):  # a negative length is refused the same way
        b.build(_spec([0, 1], [-1, 3], device, width=1))


@pytest.mark.parametrize("kind", KINDS)
def test_refuses_block_table_narrower_than_seq_lens(kind, device):
    """Before: sparse read the persistent table's later columns (an earlier step's blocks), V4 gave -1 keys."""
    b = _builders(device)[kind]
    b.build(_spec([1], [16], device))  # a wide step first: its blocks stay in the persistent table
    with pytest.raises(ValueError, match=r"block_table has 2 columns .* up to 16 tokens \(seq_lens_cpu\)"):
        b.build(_spec([1], [16], device, width=2))
    # without the host copy, max_seq_len (an upper bound) is what the table must cover
    with pytest.raises(ValueError, match=r"up to 12 tokens \(max_seq_len, no seq_lens_cpu\)"):
        b.build(_spec([1], [8], device, width=2, max_seq_len=12, with_cpu_seq=False))
    b.build(_spec([1], [8], device, width=2, with_cpu_seq=False))  # covered: fine


def test_v4_table_need_follows_the_caches_read(device):
    """With the ring and no compressed caches the block table is never read; each ratio needs its entries' blocks."""
    _v4(device, ratios=(), swa_ring_blocks=4).build(_spec([1], [16], device, width=0))
    with pytest.raises(ValueError, match="needs 2"):  # ratio 8 > block_size 4: bs_c = 1, 16 // 8 = 2 entries
        _v4(device, ratios=(8,), swa_ring_blocks=4).build(_spec([1], [16], device, width=1))


@pytest.mark.parametrize("kind", KINDS)
def test_refuses_short_slot_mapping(kind, device):
    """Before: sparse returned a slot_mapping shorter than its rows; V4's ring failed on a shape mismatch."""
    b = _builders(device)[kind]
    with pytest.raises(ValueError, match=r"slot_mapping must have an entry for each of the 6 input rows"):
        b.build(_spec([2, 1], [4, 5], device, rows=6, slot_rows=3))


def test_v4_refuses_seq_len_beyond_max_model_len(device):
    """Before: built (positions past the RoPE table, HCA rows sized for max_model_len)."""
    b = _v4(device, max_blocks_per_seq=16)
    with pytest.raises(ValueError, match="max_model_len 32"):
        b.build(_spec([1], [40], device, width=10))
    b.build(_spec([1], [32], device, width=8))  # the limit itself is fine


def test_v4_ring_check_uses_the_real_query_length(device):
    """Before: an understated max_query_len passed the ring check, so rows 0 and 12 shared a ring slot."""
    n = ring_blocks(WINDOW, 1, BS) + 1  # 3 blocks: 12 slots
    b = _v4(device, ratios=(), swa_ring_blocks=n)
    with pytest.raises(ValueError, match=r"max_query_len must be an int >= the longest query \(13\)"):
        _spec([13], [13], device, max_query_len=1)  # BatchSpec refuses it since
    spec = _spec([13], [13], device)
    spec.max_query_len = 1  # changed after the spec's checks: the builder does not trust it either
    with pytest.raises(ValueError, match="a query of 13 rows overruns the SWA ring of 3 blocks"):
        b.build(spec)


def test_v4_refuses_bad_arguments(device):
    """Before: an AttributeError, a ZeroDivisionError, a torch error, or a silent int() / default."""
    b = _v4(device)
    with pytest.raises(TypeError, match="BatchSpec"):
        b.build(object())
    meta = _spec([1], [3], "meta")
    with pytest.raises(ValueError, match="builder's buffers"):
        b.build(meta)
    for kw, name in (
        (dict(block_size=0), "block_size"),
        (dict(max_num_seqs=-1), "max_num_seqs"),
        (dict(max_num_batched_tokens=2.5), "max_num_batched_tokens"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(window=1.5), "window"),
        (dict(max_blocks_per_seq=0), "max_blocks_per_seq"),
        (dict(swa_ring_blocks=0), "swa_ring_blocks"),
        (dict(ratios=(4, 0)), r"ratios\[1\]"),
    ):
        with pytest.raises(ValueError, match=name):
            _v4(device, **kw)


# ------------------------------------------------------------------------------------------------ CUDA graphs
def test_v4_request_tensors_are_persistent(device):
    """Before: query_start_loc / seq_lens / block_table were the spec's own tensors (a fresh spec, a new address)."""
    b = _v4(device)
    md1 = b.build(_spec([1, 1, 0, 0], [5, 9, 0, 0], device, width=8, rows=4))
    names = ("query_start_loc", "seq_lens", "block_table", "positions", "swa_indices", "swa_lens", "state_slots")
    ptrs = [getattr(md1, n).data_ptr() for n in names]
    hca = [(c.hca_indices.data_ptr(), c.row_block_table.data_ptr()) for c in md1.compressed.values()]
    md2 = b.build(_spec([1, 1, 1, 0], [17, 3, 2, 0], device, width=8, rows=4))
    assert [getattr(md2, n).data_ptr() for n in names] == ptrs
    assert [(c.hca_indices.data_ptr(), c.row_block_table.data_ptr()) for c in md2.compressed.values()] == hca
    assert md2.seq_lens.tolist() == [17, 3, 2, 0] and md2.positions.tolist() == [16, 2, 1, 0]


class _NoSync(torch.Tensor):
    """A tensor that refuses every host read: any device->host synchronisation raises."""

    _FORBIDDEN = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "__len__"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in cls._FORBIDDEN:
            raise AssertionError(f"host synchronisation: {func.__name__}() on a device tensor")
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("kind", KINDS)
def test_checks_read_host_values_only(kind, device):
    """The new checks read query_start_loc_cpu / seq_lens_cpu: the spec's device tensors are never read back."""
    b = _builders(device)[kind]
    spec = _spec([1, 1, 0, 0], [5, 9, 0, 0], device, width=8, rows=4)
    for name in ("query_start_loc", "seq_lens", "block_table"):
        setattr(spec, name, getattr(spec, name).as_subclass(_NoSync))
    b.build(spec)
