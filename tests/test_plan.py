"""``plan_decode``'s private tuning overrides (``_min_split``, ``_max_split``, ``_item_cost``, ``_slots``, and the
spanning schedule's ``_spans_mode`` / ``_span_cut``; used by ``openmla bench``): honoured, validated, and the defaults
unchanged."""

from __future__ import annotations

import pytest
import torch

import openmla
from openmla.ops import plan as P
from openmla.ops.plan_spans import SPAN_CUT, plan_spans_ref
from openmla.utils.testing import suite_device


def _batch(lens, device):
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    return sl, torch.arange(len(lens) + 1, dtype=torch.int32, device=device)


def _fields(plan):
    return [getattr(plan, k).tolist() for k in ("split_len", "num_splits", "work_indptr", "work_req", "work_split")]


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
