"""The request-spanning schedule of the Hopper pair kernel (``openmla.ops.plan_spans``): the device planner against
the plain-Python one, the schedule's invariants, and ``plan_decode``'s switch. The kernel that runs it is tested on
the H200 (``tests/test_decode_gluon.py``, ``test_gluon_decode_spans``)."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import openmla
from openmla.ops.plan_spans import SPAN_FIXED, SPAN_UNIT, plan_spans, plan_spans_ref


def _inputs(lens, qlens, device):
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    qsl = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32, device=device)
    return sl, qsl


def _groups(spans):
    """Per group, its items ``(request, kv_lo, kv_hi)`` as the kernel will run them."""
    gi = spans.group_indptr.cpu().tolist()
    req, lo, hi = (x.cpu().tolist() for x in (spans.work_req, spans.work_lo, spans.work_hi))
    return [[(req[i], lo[i], hi[i]) for i in range(gi[g], gi[g + 1])] for g in range(spans.num_groups)]


def _check_schedule(spans, lens, qlens, num_groups, mode="auto"):
    groups = _groups(spans)
    assert groups == plan_spans_ref(lens, qlens, num_groups, mode)
    items = [it for g in groups for it in g]
    n_items = len(items)
    assert spans.group_indptr[0] == 0 and int(spans.group_indptr[-1]) == n_items
    assert all(r == -1 for r in spans.work_req[n_items:].cpu().tolist())
    n = spans.num_splits.cpu().tolist()
    indptr = spans.work_indptr.cpu().tolist()
    for b, (L, q) in enumerate(zip(lens, qlens)):
        mine = items[indptr[b] : indptr[b + 1]]
        assert len(mine) == n[b] and all(r == b for r, _, _ in mine)
        if q == 0:
            assert n[b] == 0
            continue
        # the pieces cover the request's keys once, in order, cut at multiples of SPAN_UNIT
        assert mine[0][1] == 0 and mine[-1][2] == L
        assert all(a[2] == c[1] for a, c in itertools.pairwise(mine))
        assert all(lo % SPAN_UNIT == 0 and lo < hi for _, lo, hi in mine) or L == 0
    assert int(spans.flags.abs().sum()) == 0
    return groups


@settings(max_examples=25, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.sampled_from([0, 1, 127, 128, 129, 640, 5000, 40000]), st.integers(0, 3)),
                  min_size=1, max_size=30),
    num_groups=st.integers(1, 70),
    mode=st.sampled_from(["auto", "cut", "snap"]),
)  # fmt: skip
def test_spans_match_reference(reqs, num_groups, mode):
    from openmla.utils.testing import suite_device

    lens, qlens = [n for n, _ in reqs], [q for _, q in reqs]
    sl, qsl = _inputs(lens, qlens, suite_device())
    spans = plan_spans(sl, qsl, num_groups, 2, len(lens) + num_groups, mode=mode)
    groups = _check_schedule(spans, lens, qlens, num_groups, mode)
    if mode == "snap":  # whole requests
        assert all(lo == 0 and hi == lens[b] for g in groups for b, lo, hi in g)


@pytest.mark.parametrize("qlen,groups", [(1, 66), (2, 33)])
def test_spans_balance_uniform_batch(qlen, groups, device):
    # h128 b128 s8k on 132 SMs: no group costs more than its share plus a unit (each item costing its fixed part
    # and its pairs), where one program per 64 rows costs 2 (qlen 1) or 4 (qlen 2) whole requests on some SMs
    lens, qlens = [8192] * 128, [qlen] * 128
    sl, qsl = _inputs(lens, qlens, device)
    spans = plan_spans(sl, qsl, groups, 132 // groups, 128 + groups, mode="cut")
    per_group = [sum(SPAN_FIXED + -(-(hi - lo) // SPAN_UNIT) for _, lo, hi in g)
                 for g in _check_schedule(spans, lens, qlens, groups, "cut")]  # fmt: skip
    assert max(per_group) <= sum(per_group) / groups + 1, per_group
    assert max(per_group) < 2 * qlen * (SPAN_FIXED + 8192 // SPAN_UNIT)
    assert int(spans.group_indptr[-1]) <= 128 + groups - 1
    # "auto" snaps: whole requests cost 2 (4) a group at most, and a cut's extra cost eats the 1.5% (2.3%) that cuts
    # save (measured, RESULTS.md run 73)
    auto = plan_spans(sl, qsl, groups, 132 // groups, 128 + groups)
    _check_schedule(auto, lens, qlens, groups)
    assert int(auto.num_splits.max()) == 1 and int(auto.group_indptr.diff().max()) == 2 * qlen


def test_spans_auto_cuts_ragged_batch(device):
    # a ragged batch: whole requests leave one group far above its share, so "auto" cuts
    lens = [16000, 16000, 500, 700, 900, 300, 1200, 600]
    sl, qsl = _inputs(lens, [1] * 8, device)
    spans = plan_spans(sl, qsl, 4, 1, 12)
    assert int(spans.num_splits.max()) > 1
    _check_schedule(spans, lens, [1] * 8, 4)


def test_spans_empty_and_tiny(device):
    # no keys (one empty item where the request sits), no query rows (no item), more groups than work
    lens, qlens = [0, 5, 0, 300], [1, 1, 0, 2]
    sl, qsl = _inputs(lens, qlens, device)
    spans = plan_spans(sl, qsl, 40, 1, 44, mode="cut")
    groups = _check_schedule(spans, lens, qlens, 40, "cut")
    assert [it for g in groups for it in g] == [(0, 0, 0), (1, 0, 5), (3, 0, 128), (3, 128, 256), (3, 256, 300)]
    with pytest.raises(ValueError, match="capacity"):
        plan_spans(sl, qsl, 40, 1, 43)


def test_plan_decode_spans_switch(device):
    # _spans=True: plan_decode adds the schedule for 64-row tiles (any device); False: never; the default adds it
    # only where mla_decode runs the pair kernel (an sm90 GPU); out= keeps its buffers
    lens, qlens = [3000, 64, 0, 9000], [1, 2, 1, 1]
    sl, qsl = _inputs(lens, qlens, device)
    plan = openmla.plan_decode(sl, qsl, 128, num_sms=16, _spans=True)
    assert plan.spans is not None and plan.spans.num_groups == 4 and plan.spans.readers == 4
    _check_schedule(plan.spans, lens, qlens, 4)
    ptr = plan.spans.work_lo.data_ptr()
    again = openmla.plan_decode(sl, qsl, 128, num_sms=16, max_query_len=2, out=plan, _spans=True)
    assert again.spans.work_lo.data_ptr() == ptr and again.work_req.data_ptr() == plan.work_req.data_ptr()
    # 16 heads (16-row portable tiles; the Gluon kernels' 64-row blocks hold 16 heads x 4 query tokens: one reader)
    narrow = openmla.plan_decode(sl, qsl, 16, num_sms=16, _spans=True)
    assert narrow.spans is not None and narrow.spans.num_groups == 16 and narrow.spans.readers == 1
    _check_schedule(narrow.spans, lens, qlens, 16)
    # the default adds none off sm90 (nor on it below 64 heads: the seesaw kernel runs there)
    assert openmla.plan_decode(sl, qsl, 16, num_sms=16).spans is None
    assert openmla.plan_decode(sl, qsl, 128, num_sms=16, _spans=False).spans is None
    with pytest.raises(ValueError, match="mode"):
        plan_spans(sl, qsl, 4, 1, 8, mode="even")
