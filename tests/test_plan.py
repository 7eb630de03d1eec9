"""``plan_decode``: the work-item layout (every key once, requests launched longest split first, the reduce's merge
list), the decode output on a reordered ragged batch, and the private tuning overrides (``_min_split``,
``_max_split``, ``_item_cost``, ``_slots``, and the spanning schedule's ``_spans_mode`` / ``_span_cut``; used by
``openmla bench``): honoured, validated, and the defaults unchanged."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import openmla
from openmla.ops import plan as P
from openmla.ops.plan_spans import SPAN_CUT, plan_spans_ref
from openmla.reference import mla_decode_ref
from openmla.utils.testing import TOLERANCES, assert_close, on_gpu, pick, suite_device


def _batch(lens, device):
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    return sl, torch.arange(len(lens) + 1, dtype=torch.int32, device=device)


def _fields(plan):
    return [getattr(plan, k).tolist() for k in ("split_len", "num_splits", "work_indptr", "work_req", "work_split")]


def _check_layout(plan, lens, qlens):
    """The plan's work items against its own ``num_splits`` / ``split_len``: every key once, the requests launched by
    decreasing split length (ties in batch order), each request's items contiguous and in split order, and the
    reduce's merge list. Returns the launch order."""
    B = len(lens)
    n, per, req, split = (x.cpu().tolist() for x in (plan.num_splits, plan.split_len, plan.work_req, plan.work_split))
    indptr = plan.work_indptr.cpu().tolist()
    for b, (L, rows) in enumerate(zip(lens, qlens)):
        assert n[b] == (0 if rows == 0 else max(1, -(-L // per[b]))), (b, L, n[b], per[b])
        assert per[b] % plan.tiling.block_n == 0 and per[b] <= plan.tiling.max_split
        assert (per[b] > 0) == (n[b] > 0)
    order = sorted(range(B), key=lambda b: (-per[b], b))  # requests without splits (per 0) last
    total = sum(n)
    assert len(indptr) == B + 1 and indptr[0] == 0 and indptr[-1] == total <= plan.capacity
    for j, b in enumerate(order):  # work_indptr is cumulative in launch order
        assert indptr[j + 1] - indptr[j] == n[b], (j, b)
        assert req[indptr[j] : indptr[j + 1]] == [b] * n[b] and split[indptr[j] : indptr[j + 1]] == list(range(n[b]))
    assert all(r == -1 for r in req[total:])
    # item by item: split length non-increasing, ties in batch order
    keys = [(-per[r], r) for r in req[:total]]
    assert keys == sorted(keys)
    # the reduce's list: exactly the requests with more than one split, in launch order, each with its first item
    first = {b: indptr[j] for j, b in enumerate(order)}
    multi = [b for b in order if n[b] > 1]
    assert int(plan.num_merge) == len(multi)
    info = plan.merge_info.cpu().tolist()
    assert [r[0] for r in info] == multi + [-1] * (B - len(multi))
    assert [r[1:] for r in info[: len(multi)]] == [[first[b], n[b]] for b in multi]
    assert all(r[2] == 0 for r in info[len(multi) :])
    return order


@settings(max_examples=20, deadline=None)
@given(
    lens=st.lists(st.one_of(st.integers(0, 5000), st.sampled_from([0, 16, 300, 4096])), min_size=1, max_size=40),
    qlen=st.integers(0, 3),
    heads=st.sampled_from([1, 16, 128]),
    num_sms=st.sampled_from([1, 8, 132]),
)
def test_plan_covers_every_key_once(lens, qlen, heads, num_sms):
    # (the sampled lengths give ties in split length: those keep batch order)
    dev = suite_device()
    B = len(lens)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=dev) * qlen
    qsl[1] = qsl[0]  # the first request has no query rows
    qlens = (qsl[1:] - qsl[:-1]).tolist()
    plan = openmla.plan_decode(sl, qsl, heads, num_sms=num_sms)
    _check_layout(plan, lens, qlens)
    # rebuilt in place (out=): the same layout
    again = openmla.plan_decode(sl, qsl, heads, num_sms=num_sms, out=plan)
    _check_layout(again, lens, qlens)


@pytest.mark.parametrize("qlen", [1, 2])
def test_uniform_batch_keeps_batch_order(qlen):
    # equal requests (and equal split lengths from different lengths): items in batch order, as before the reorder
    dev = suite_device()
    for lens in ([1000] * 8, [3000] * 5 + [2995], [20] * 3):
        sl = torch.tensor(lens, dtype=torch.int32, device=dev)
        qsl = torch.arange(len(lens) + 1, dtype=torch.int32, device=dev) * qlen
        plan = openmla.plan_decode(sl, qsl, 16, num_sms=8)
        n = plan.num_splits.tolist()
        assert len(set(plan.split_len.tolist())) == 1, (lens, plan.split_len.tolist())
        assert _check_layout(plan, lens, [qlen] * len(lens)) == list(range(len(lens)))
        total = sum(n)
        assert plan.work_req.tolist()[:total] == [b for b in range(len(lens)) for _ in range(n[b])]
        assert plan.work_indptr.tolist() == [0, *itertools.accumulate(n)]


def _in_batch_order(plan):
    """``plan`` with its work items laid out request by request in batch order (the layout before the
    longest-first launch order) and fresh partial buffers."""
    n = plan.num_splits.tolist()
    B, dev = len(n), plan.work_req.device
    req = [b for b in range(B) for _ in range(n[b])]
    split = [s for b in range(B) for s in range(n[b])]
    starts = [0, *itertools.accumulate(n)]
    pad = plan.capacity - len(req)
    info = [[b, starts[b], n[b]] for b in range(B) if n[b] > 1]
    n_merge = len(info)
    info += [[-1, 0, 0]] * (B - n_merge)

    def t(x):
        return torch.tensor(x, dtype=torch.int32, device=dev)

    return dataclasses.replace(
        plan, work_req=t(req + [-1] * pad), work_split=t(split + [0] * pad), work_indptr=t(starts),
        merge_info=t(info).view(B, 3), num_merge=t([n_merge]),
        o_part=torch.empty_like(plan.o_part), lse_part=torch.empty_like(plan.lse_part),
    )  # fmt: skip


@pytest.mark.parametrize("heads,num_sms", [(16, pick(2, 16)), (64, pick(16, 132))])
def test_ragged_decode_unchanged(heads, num_sms, monkeypatch):
    # a ragged batch launched longest split first: the same output as the batch-order layout (bit for bit: each item
    # and each merge computes the same thing), and right against the fp32 reference; NaN past every request's keys
    dev = suite_device()
    if not on_gpu():  # tiny CPU requests still split
        monkeypatch.setattr(P, "_MIN_SPLIT", 64)
        monkeypatch.setattr(P, "_MIN_SPLIT_64_ROWS", 64)
    torch.manual_seed(42)
    lens = pick([37, 700, 0, 333, 700, 5, 150], [300, 30001, 0, 9001, 30001, 17, 4000])
    qlens = [1, 2, 1, 0, 1, 2, 1]
    page, B = 16, len(lens)
    W = -(-max(lens) // page)
    cache = torch.randn(B * W + 2, page, 576, device=dev).to(torch.bfloat16)
    bt = torch.randperm(B * W + 2, device=dev)[: B * W].view(B, W).int()
    used = torch.zeros(cache.shape[0] * page, dtype=torch.bool, device=dev)
    for b, L in enumerate(lens):
        pos = torch.arange(L, device=dev)
        used[bt[b, pos // page].long() * page + pos % page] = True
    cache.view(-1, 576)[~used] = float("nan")
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32, device=dev)
    q = torch.randn(int(qsl[-1]), heads, 576, device=dev).to(torch.bfloat16)
    plan = openmla.plan_decode(sl, qsl, heads, num_sms=num_sms)
    order = _check_layout(plan, lens, qlens)
    assert order != sorted(order) and int(plan.num_merge) >= 2, (order, plan.num_splits.tolist())
    scale = 576**-0.5
    out, lse = openmla.mla_decode(q, cache, bt, sl, qsl, scale, plan=plan)
    out0, lse0 = openmla.mla_decode(q, cache, bt, sl, qsl, scale, plan=_in_batch_order(plan))
    assert torch.equal(out, out0) and torch.equal(lse, lse0)
    ref_out, ref_lse = mla_decode_ref(q, cache, bt, sl, qsl, scale)
    atol, rtol, cos = TOLERANCES[torch.bfloat16]
    assert_close("out", ref_out, out, atol, rtol, cos)
    assert_close("lse", ref_lse, lse, 1e-3, 1e-3, 1e-6)


def test_overrides_honoured():
    dev = suite_device()
    sl, qsl = _batch([4096, 1000, 37], dev)
    base = openmla.plan_decode(sl, qsl, 16, num_sms=8)
    n = base.tiling.block_n
    # None everywhere is the default plan
    same = openmla.plan_decode(sl, qsl, 16, num_sms=8, _min_split=None, _max_split=None, _item_cost=None, _slots=None)
    assert _fields(same) == _fields(base) and same.capacity == base.capacity
    # min = max: that split length for every request long enough; shorter ones keep one split
    fixed = openmla.plan_decode(sl, qsl, 16, num_sms=8, _min_split=8 * n, _max_split=8 * n)
    assert fixed.split_len.tolist()[:2] == [8 * n, 8 * n]
    assert fixed.num_splits.tolist() == [-(-4096 // (8 * n)), -(-1000 // (8 * n)), 1]
    assert fixed.capacity >= 3 * -(-4096 // (8 * n)) and int(fixed.work_indptr[-1]) == sum(fixed.num_splits.tolist())
    # one slot and no item cost: splits as long as they can be (any more would only add waves)
    one = openmla.plan_decode(sl, qsl, 16, num_sms=8, _slots=1, _item_cost=0)
    assert one.num_splits.tolist() == [-(-L // base.tiling.max_split) for L in (4096, 1000, 37)]
    # many slots, a short floor: the longest request is cut finer than with the default floor
    fine = openmla.plan_decode(sl, qsl, 16, num_sms=8, _slots=64, _min_split=n)
    wide = openmla.plan_decode(sl, qsl, 16, num_sms=8, _slots=64)
    assert fine.num_splits[0] > wide.num_splits[0] >= 1


@pytest.mark.parametrize("heads", [16, 64])
def test_max_splits_bounds_every_request(heads):
    # plan.max_splits (the reduce's step over splits) is never below a request's split count: random batches, short
    # and long requests, a max_seq_len above the longest, the tuning overrides
    dev = suite_device()
    g = torch.Generator().manual_seed(heads)
    for trial in range(12):
        B = int(torch.randint(1, 9, (1,), generator=g))
        lens = torch.randint(0, 3000 if trial % 2 else 200, (B,), generator=g).tolist()
        sl, qsl = _batch(lens, dev)
        for kw in ({}, {"max_seq_len": max(lens) + 500, "max_query_len": 1}, {"_slots": 64, "_min_split": 16},
                   {"_min_split": 4096, "_max_split": 128}):  # fmt: skip
            plan = openmla.plan_decode(sl, qsl, heads, num_sms=8, **kw)
            assert 1 <= int(plan.num_splits.max()) <= plan.max_splits, (lens, kw, plan.max_splits)


def test_overrides_validated():
    dev = suite_device()
    sl, qsl = _batch([300, 20], dev)
    t = openmla.plan_decode(sl, qsl, 4).tiling
    for kw in (dict(_min_split=0), dict(_max_split=t.block_n + 1), dict(_max_split=t.max_split + t.block_n),
               dict(_item_cost=-1), dict(_slots=0), dict(_slots=2.0), dict(_min_split=True)):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(kw))):
            openmla.plan_decode(sl, qsl, 4, **kw)
    plan = openmla.plan_decode(sl, qsl, 4, _item_cost=0, _max_split=t.block_n)
    assert plan.split_len.tolist() == [t.block_n, t.block_n]


def test_defaults_unchanged(monkeypatch):
    """An override plans as the module constant it replaces would (so the defaults still come from those constants);
    the cases differ from the default plan, so the overrides reach the kernel."""
    dev = suite_device()
    sl, qsl = _batch([600, 20, 2000, 50], dev)
    base = openmla.plan_decode(sl, qsl, 16, num_sms=1)
    for const, kw in (("_ITEM_COST", dict(_item_cost=4096)), ("_MIN_SPLIT", dict(_min_split=1024))):
        with monkeypatch.context() as m:
            m.setattr(P, const, next(iter(kw.values())))
            moved = openmla.plan_decode(sl, qsl, 16, num_sms=1)
        assert _fields(openmla.plan_decode(sl, qsl, 16, num_sms=1, **kw)) == _fields(moved)
        if dev.type == "cpu":  # the interpreter's tiling (16-key tiles): both change this plan
            assert _fields(moved) != _fields(base), const
    assert _fields(openmla.plan_decode(sl, qsl, 16, num_sms=1)) == _fields(base)


def _span_groups(spans):
    """Per group, its items ``(request, kv_lo, kv_hi)`` (as ``plan_spans_ref`` gives them)."""
    gi = spans.group_indptr.tolist()
    req, lo, hi = (x.tolist() for x in (spans.work_req, spans.work_lo, spans.work_hi))
    return [[(req[i], lo[i], hi[i]) for i in range(gi[g], gi[g + 1])] for g in range(spans.num_groups)]


def test_spans_overrides_honoured():
    """h64 q1 (64-row tiles, one reader) on 8 groups: 4 equal requests snap under "auto" (4 of 8 groups), "cut" and
    a zero cut cost spread them over all 8; None is "auto" with ``SPAN_CUT``, and the split plan stays as it was."""
    dev = suite_device()
    lens = [1024] * 4
    sl, qsl = _batch(lens, dev)
    kw = dict(num_sms=8, _spans=True)
    base = openmla.plan_decode(sl, qsl, 64, **kw)
    assert base.spans is not None and base.spans.num_groups == 8
    snap = plan_spans_ref(lens, [1] * 4, 8, "snap")
    cut = plan_spans_ref(lens, [1] * 4, 8, "cut")
    assert snap != cut and sum(map(bool, snap)) == 4 and sum(map(bool, cut)) == 8
    assert _span_groups(base.spans) == snap == plan_spans_ref(lens, [1] * 4, 8, "auto", SPAN_CUT)
    for extra, want in ((dict(_spans_mode=None, _span_cut=None), snap), (dict(_spans_mode="auto"), snap),
                        (dict(_span_cut=SPAN_CUT), snap), (dict(_spans_mode="snap"), snap),
                        (dict(_spans_mode="cut"), cut), (dict(_span_cut=0), cut),
                        (dict(_spans_mode="auto", _span_cut=0), cut)):  # fmt: skip
        plan = openmla.plan_decode(sl, qsl, 64, **kw, **extra)
        assert _span_groups(plan.spans) == want, extra
        assert _fields(plan) == _fields(base), extra  # the split plan does not depend on the spans mode
    # out= rewrites the schedule in place with the new mode
    again = openmla.plan_decode(sl, qsl, 64, **kw, _spans_mode="cut", out=base)
    assert again.spans is base.spans and _span_groups(base.spans) == cut
    # where the plan has no spanning schedule (no 64-row tiles) the mode changes nothing
    small = openmla.plan_decode(sl, qsl, 16, num_sms=8, _spans_mode="cut")
    assert small.spans is None and _fields(small) == _fields(openmla.plan_decode(sl, qsl, 16, num_sms=8))


def test_spans_overrides_validated():
    dev = suite_device()
    sl, qsl = _batch([300, 20], dev)
    for kw, match in ((dict(_spans_mode="cutt"), "_spans_mode"), (dict(_spans_mode=1), "_spans_mode"),
                      (dict(_span_cut=-1), "_span_cut"), (dict(_span_cut=1.5), "_span_cut"),
                      (dict(_span_cut=True), "_span_cut"), (dict(_spans=False, _spans_mode="cut"), "_spans=False"),
                      (dict(_spans=False, _span_cut=2), "_spans=False"),
                      (dict(_spans_mode="snap", _span_cut=2), "'auto' only")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            openmla.plan_decode(sl, qsl, 64, _spans=kw.pop("_spans", True), **kw)
