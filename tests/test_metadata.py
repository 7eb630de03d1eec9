"""MLAMetadataBuilder: decode/prefill split, uniform speculative padding, persistent buffers, no host sync."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openmla.metadata import BatchSpec, MLAMetadataBuilder, split_decodes_and_prefills, uniform_padded_query_len
from openmla.metadata import dense as dense_mod


def make_spec(qlens, seq_lens, device, *, block_size=4, width=None, num_input_tokens=None, with_cpu_seq=True):
    """A BatchSpec whose block tables give request b the blocks 100*b + i (distinct, recognisable)."""
    B = len(qlens)
    qsl = torch.zeros(B + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(qlens, dtype=torch.int32), 0)
    width = width or max(1, max(-(-s // block_size) for s in seq_lens) if seq_lens else 1)
    bt = torch.tensor([[100 * b + i for i in range(width)] for b in range(B)], dtype=torch.int32).reshape(B, width)
    n = int(qsl[-1])
    rows = num_input_tokens or n
    return BatchSpec(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=bt.to(device),
        slot_mapping=torch.full((rows,), -1, dtype=torch.int64, device=device),
        num_reqs=B,
        num_actual_tokens=n,
        max_query_len=max(qlens) if qlens else 0,
        max_seq_len=max(seq_lens) if seq_lens else 0,
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32) if with_cpu_seq else None,
        num_input_tokens=rows,
    )


def make_builder(device, **kw):
    args = dict(
        num_heads=4,
        block_size=4,
        max_num_seqs=8,
        max_model_len=64,
        max_num_batched_tokens=64,
        device=device,
        decode_threshold=3,
        dtype=torch.float32,
    )
    args.update(kw)
    return MLAMetadataBuilder(**args)


# ----------------------------------------------------------------------------- split rule
@pytest.mark.parametrize(
    "qlens, threshold, expected",
    [
        ([1, 1, 1], 1, 3),
        ([1, 3, 1], 1, 1),  # the first long query starts the prefills
        ([3, 3, 2, 7, 1], 3, 3),  # verify rows (qlen <= 1 + k) are decodes; the trailing 1 is a prefill
        ([5, 1], 3, 0),
        ([], 1, 0),
        ([0, 0, 2], 2, 3),  # padding requests (qlen 0) count as decodes
    ],
    ids=["all-decode", "mixed", "verify-rows", "prefill-first", "empty", "padding"],
)
def test_split_decodes_and_prefills(qlens, threshold, expected):
    assert split_decodes_and_prefills(qlens, threshold) == expected


# ---------------------------------------------------------------- uniform MTP padding rule
@pytest.mark.parametrize(
    "qlens, num_tokens, expected",
    [
        ([3, 3, 0, 0], 12, 3),  # graph for 4 requests x 3 rows, 2 real: dummies get qlen 3
        ([0, 0], 4, 2),  # only dummies (capture-time batch)
        ([3, 3, 3, 3], 12, 0),  # no dummy request: nothing to synthesize
        ([3, 3, 0, 0], 6, 0),  # no padded rows
        ([1, 1, 0, 0], 4, 0),  # uniform qlen 1: the arange layout covers dummies
        ([3, 3, 0], 10, 0),  # rows do not divide over the requests
        ([3, 2, 0, 0], 12, 0),  # real requests not uniform
        ([3, 0, 3, 0], 12, 0),  # a dummy in the middle
        ([2, 2, 0, 0], 12, 0),  # real qlen differs from the padded uniform length
        ([], 4, 0),
    ],
    ids=["pad", "all-dummy", "no-dummy", "no-pad-rows", "qlen1", "indivisible", "ragged", "dummy-middle",
         "qlen-mismatch", "empty"],
)  # fmt: skip
def test_uniform_padded_query_len(qlens, num_tokens, expected):
    assert uniform_padded_query_len(qlens, max(qlens, default=0), num_tokens) == expected


# --------------------------------------------------------------------------- builder
def test_build_mixed_batch_split(device):
    # 2 verify rows (qlen 3, 2), one decode, then 2 prefills (one with context, one fresh)
    qlens = [3, 2, 1, 6, 4]
    seq_lens = [10, 7, 5, 14, 4]
    b = make_builder(device, workspace_tokens=5)
    md = b.build(make_spec(qlens, seq_lens, device))
    assert (md.num_decodes, md.num_prefills) == (3, 2)
    assert (md.num_decode_tokens, md.num_prefill_tokens, md.num_actual_tokens) == (6, 10, 16)
    d = md.decode
    assert d.query_start_loc.tolist() == [0, 3, 5, 6]
    assert d.seq_lens.tolist() == [10, 7, 5]
    assert d.block_table[:, :3].tolist() == [[0, 1, 2], [100, 101, 102], [200, 201, 202]]
    assert (d.max_query_len, d.num_tokens, d.uniform_query_len) == (3, 6, 0)
    assert d.plan is not None and d.plan.batch_size == 3 and d.plan.max_query_len == 3
    p = md.prefill
    assert p.query_start_loc.tolist() == [0, 6, 10] and p.query_start_loc_cpu.tolist() == [0, 6, 10]
    assert p.max_query_len == 6
    assert p.seq_lens.tolist() == [14, 4]
    assert p.block_table[:, 0].tolist() == [300, 400]
    assert p.context_lens_cpu.tolist() == [8, 0]
    ctx = p.chunked_context
    # workspace of 5 tokens, rounded down to whole blocks of 4: 8 context tokens -> 2 chunks
    assert (ctx.chunk_size, ctx.num_chunks, ctx.total_context_tokens) == (4, 2, 8)
    assert ctx.context_lens.tolist() == [8, 0]


def test_build_prefill_without_context_has_no_chunks(device):
    md = make_builder(device).build(make_spec([5, 4], [5, 4], device))
    assert md.num_decodes == 0 and md.decode is None
    assert md.prefill.chunked_context is None


def test_build_prefill_reads_device_seq_lens_without_cpu_copy(device):
    md = make_builder(device).build(make_spec([5], [9], device, with_cpu_seq=False))
    assert md.prefill.context_lens_cpu.tolist() == [4]


def test_uniform_padding_build(device):
    """A CUDA-graph replay: 4 captured requests x 3 rows, 2 real; dummies get qlen 3 and seq_len 3."""
    spec = make_spec([3, 3, 0, 0], [9, 12, 0, 0], device, num_input_tokens=12)
    md = make_builder(device).build(spec)
    d = md.decode
    assert md.num_prefills == 0 and md.num_decode_tokens == 12 and md.num_actual_tokens == 6
    assert d.uniform_query_len == 3 and d.max_query_len == 3 and d.num_tokens == 12
    assert d.query_start_loc.tolist() == [0, 3, 6, 9, 12]
    assert d.seq_lens.tolist() == [9, 12, 3, 3]


def test_qlen1_padding_build(device):
    """Plain decode graph: padding requests own one row each (arange) with seq_len 0 (an empty row)."""
    spec = make_spec([1, 1, 0, 0], [9, 5, 0, 0], device, num_input_tokens=4)
    d = make_builder(device).build(spec).decode
    assert d.uniform_query_len == 0 and d.num_tokens == 4
    assert d.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert d.seq_lens.tolist() == [9, 5, 0, 0]


def test_decode_buffers_are_persistent(device):
    """Two builds of the same shape hand the layers the same addresses (what a captured graph reads)."""
    b = make_builder(device)
    md1 = b.build(make_spec([2, 2, 0], [6, 9, 0], device, num_input_tokens=6))
    ptrs = [t.data_ptr() for t in (md1.decode.seq_lens, md1.decode.query_start_loc, md1.decode.block_table)]
    plan_ptrs = [md1.decode.plan.work_req.data_ptr(), md1.decode.plan.split_len.data_ptr()]
    md2 = b.build(make_spec([2, 0, 0], [17, 0, 0], device, num_input_tokens=6))
    assert [t.data_ptr() for t in (md2.decode.seq_lens, md2.decode.query_start_loc, md2.decode.block_table)] == ptrs
    assert [md2.decode.plan.work_req.data_ptr(), md2.decode.plan.split_len.data_ptr()] == plan_ptrs
    assert md2.decode.seq_lens.tolist() == [17, 2, 2]  # new values, dummies padded to the uniform qlen


class _NoSync(torch.Tensor):
    """A tensor that refuses every host read: any device->host synchronisation raises."""

    _FORBIDDEN = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "__len__"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in cls._FORBIDDEN:
            raise AssertionError(f"host synchronisation: {name}() on a device tensor")
        if name == "to" and any(isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu" for a in args):
            raise AssertionError("host synchronisation: .to('cpu') on a device tensor")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_decode_only_build_does_not_sync(device, monkeypatch):
    """Decode-only builds read host values only from the CPU copies: device tensors are never read back.

    The device tensors of the spec refuse host reads; plan_decode (an op with its own checks) is
    replaced by a recorder so that only the builder's own code is under test here (the GPU test
    below runs the real planner under torch's sync debug mode).
    """
    calls = []

    def plan_stub(
        seq_lens,
        qo_indptr,
        num_heads,
        *,
        max_query_len=None,
        max_seq_len=None,
        d_v=512,
        kv_cache_dtype="auto",
        out=None,
        validate=True,
    ):
        assert max_seq_len == 64  # the builder's max_model_len: a capacity that fits every replay
        assert validate is False  # the builder checked the batch on the host; the planner must not sync
        calls.append((type(seq_lens), max_query_len))
        return object()

    monkeypatch.setattr(dense_mod, "plan_decode", plan_stub)
    b = make_builder(device)
    for qlens, seqs, rows in (([3, 3, 0, 0], [9, 12, 0, 0], 12), ([1, 1, 1], [4, 8, 2], 3), ([2, 3], [5, 6], 5)):
        spec = make_spec(qlens, seqs, device, num_input_tokens=rows)
        for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
            setattr(spec, name, getattr(spec, name).as_subclass(_NoSync))
        md = b.build(spec)
        assert md.num_prefills == 0
    assert [c[1] for c in calls] == [3, 1, 3]
    # the same trap does fire on a prefill build without a CPU copy of seq_lens (the trap works)
    spec = make_spec([5], [9], device, with_cpu_seq=False)
    spec.seq_lens = spec.seq_lens.as_subclass(_NoSync)
    with pytest.raises(AssertionError, match="host synchronisation"):
        b.build(spec)


@pytest.mark.gpu
def test_decode_only_build_no_sync_cuda(device):
    """On the GPU: a decode-only build (real planner included) under torch's sync debug mode."""
    b = make_builder(device)
    spec = make_spec([3, 3, 0, 0], [9, 12, 0, 0], device, num_input_tokens=12)
    b.build(spec)  # first build allocates the plan
    spec = make_spec([3, 0, 0, 0], [30, 0, 0, 0], device, num_input_tokens=12)  # its H2D copies may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        b.build(spec)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# --------------------------------------------------------------------------- errors
def test_batch_spec_validation(device):
    spec = make_spec([2, 1], [4, 3], device)
    with pytest.raises(TypeError, match="int32"):
        BatchSpec(**{**spec.__dict__, "seq_lens": spec.seq_lens.long()})
    with pytest.raises(ValueError, match="num_actual_tokens"):
        BatchSpec(**{**spec.__dict__, "num_actual_tokens": 2})
    with pytest.raises(ValueError, match=r"seq_lens must be \[2\]"):
        BatchSpec(**{**spec.__dict__, "seq_lens": spec.seq_lens[:1]})
    with pytest.raises(TypeError, match="integer"):
        BatchSpec(**{**spec.__dict__, "slot_mapping": spec.slot_mapping.float()})
    with pytest.raises(ValueError, match="num_input_tokens"):
        BatchSpec(**{**spec.__dict__, "num_input_tokens": 1})


def test_builder_validation(device):
    with pytest.raises(ValueError, match="block_size"):
        make_builder(device, block_size=0)
    b = make_builder(device, max_num_seqs=2)
    with pytest.raises(ValueError, match="sized for 2"):
        b.build(make_spec([1, 1, 1], [2, 2, 2], device))
    with pytest.raises(TypeError, match="BatchSpec"):
        b.build({"num_reqs": 1})
    with pytest.raises(ValueError, match="below request 0's query length"):
        make_builder(device).build(make_spec([5], [3], device))
    # a block table narrower than the longest request: the decode buffer's later columns hold an earlier step's
    # blocks, so it is refused (from seq_lens_cpu, else max_seq_len), not read
    for with_cpu_seq in (True, False):
        with pytest.raises(ValueError, match="block_table has 2 columns"):
            make_builder(device).build(make_spec([1, 1], [3, 9], device, width=2, with_cpu_seq=with_cpu_seq))


# ------------------------------------------------------------------------ property
@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 6), st.integers(0, 9)), min_size=1, max_size=6),
    st.integers(1, 3),
)
def test_split_properties(reqs, threshold):
    """Any ragged batch: decodes are the leading short queries and the tensors agree with the host split."""
    from openmla.utils.testing import suite_device

    device = suite_device()  # hypothesis and function-scoped fixtures do not mix
    qlens = [q for q, _ in reqs]
    seq_lens = [q + c for q, c in reqs]
    md = make_builder(device, decode_threshold=threshold, workspace_tokens=7).build(make_spec(qlens, seq_lens, device))
    nd = md.num_decodes
    assert all(q <= threshold for q in qlens[:nd])
    assert nd == len(qlens) or qlens[nd] > threshold
    assert md.num_decode_tokens == sum(qlens[:nd]) and md.num_prefill_tokens == sum(qlens[nd:])
    if nd:
        assert md.decode.seq_lens.tolist() == seq_lens[:nd]
        assert md.decode.query_start_loc[-1].item() == md.num_decode_tokens
    if md.prefill is not None:
        ctx = [s - q for q, s in zip(qlens[nd:], seq_lens[nd:])]
        assert md.prefill.context_lens_cpu.tolist() == ctx
        cc = md.prefill.chunked_context
        assert (cc is None) == (sum(ctx) == 0)
        if cc is not None:
            assert cc.num_chunks == -(-sum(ctx) // cc.chunk_size) and cc.chunk_size == 4
