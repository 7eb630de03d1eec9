"""Request-spanning ("persistent") schedule for the Hopper pair kernel of MLA decode.

The regular plan (:mod:`openmla.ops.plan`) runs one program per (work item, head block, query block), and a work
item is one of a request's equal splits. At h128 b128 s8k that is 256 (qlen 1) or 512 (qlen 2) programs of equal
length on 132 SMs that hold one program each: 2 / 4 rounds where 1.94 / 3.88 would do (about 3% of the time lost
to the last, partly empty round), and a ragged batch of unsplit requests balances worse still.

Here the batch's work is laid out as one sequence of units, request after request: a request with query rows costs
``SPAN_FIXED`` units (its Q load, first copies and epilogue) plus one unit per 128 keys (a pair of 64-key tiles,
what the pair kernel handles per loop step). There are ``num_groups`` groups of ``readers`` programs (the head and
query blocks that read the same KV tiles; ``num_groups * readers`` programs fill the SMs once), and each program
loops over its group's items. Two ways to fill the groups, the cheaper one (by this cost model) is taken:
- "cut": the sequence is cut into ``num_groups`` equal ranges (at multiples of 128 keys); a request cut by a group
  boundary has two or more pieces. The kernel merges them itself: the other pieces store partials and raise a flag,
  the request's last piece waits for them and writes the final rows (``_span_finish`` in
  ``gluon.decode_seesaw``). A cut costs the extra piece's fixed part plus ``cut_cost`` units (partial traffic and
  the wait).
- "snap": whole requests, each in the group that holds its midpoint (no pieces); the most loaded group decides.
A uniform batch that fits the groups in whole requests snaps (as the regular plan, but without relaunches); a
ragged one cuts. The result has the regular plan's item layout (request-major order, ``num_splits``,
``work_indptr``) with each item's key range given explicitly (``work_lo``, ``work_hi``) and each group's items in
``group_indptr``. One launch on the device, fixed-size buffers (CUDA-graph capturable; the flags reset
themselves).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["SPAN_CUT", "SPAN_FIXED", "SPAN_UNIT", "DecodeSpans", "plan_spans", "plan_spans_ref"]

SPAN_UNIT = 128  # keys per unit: one pair of 64-key tiles
# a request's fixed cost in units: about 12k cycles (Q and the first tiles before the first scores, the epilogue)
# against 5.3k a pair at h128
SPAN_FIXED = 2
# a cut's cost in units beyond the extra piece's fixed part (its partial stored and read back, the wait, the merge):
# measured 4-6 at h128 (cut against snap, docs/kernels.md)
SPAN_CUT = 6
_MODES = {"auto": 0, "cut": 1, "snap": 2}


@triton.jit
def _plan_spans_fwd_kernel(
    seq_lens,  # [B]
    query_start_loc,  # [B + 1]
    work_req,  # [capacity] out
    work_lo,  # [capacity] out
    work_hi,  # [capacity] out
    num_splits,  # [B] out
    work_indptr,  # [B + 1] out
    group_indptr,  # [G + 1] out
    B,
    NUM_GROUPS,
    capacity,
    cut_cost,
    UNIT: tl.constexpr,
    FIXED: tl.constexpr,
    MODE: tl.constexpr,  # 0: the cheaper of cut and snap, 1: cut, 2: snap
    BLOCK_B: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    # one program for the whole batch
    o_b = tl.arange(0, BLOCK_B)
    m_b = o_b < B
    L = tl.load(seq_lens + o_b, mask=m_b, other=0).to(tl.int64)
    qlen = tl.load(query_start_loc + o_b + 1, mask=m_b, other=0) - tl.load(query_start_loc + o_b, mask=m_b, other=0)
    live = m_b & (qlen > 0)
    G = NUM_GROUPS
    units = tl.where(live, (L + UNIT - 1) // UNIT, 0)
    cost = tl.where(live, FIXED + units, 0)
    ends = tl.cumsum(cost, axis=0)  # [B] unit positions: request b occupies [ends - cost, ends)
    first = ends - cost + FIXED  # its first key unit
    total = tl.maximum(tl.sum(cost, axis=0), 1)
    G = tl.minimum(G, total)  # no group with an empty range (the groups past it get no items)
    # cut: the group holding position p is the largest g with g * total // G <= p
    g_cut = ((tl.where(units > 0, first, ends - cost) + 1) * G - 1) // total
    g_last = tl.where(units > 0, (ends * G - 1) // total, g_cut)
    n_cut = tl.where(live, g_last - g_cut + 1, 0)
    # snap: the group holding the request's midpoint
    g_snap = tl.minimum(((2 * ends - cost) * G) // (2 * total), G - 1)
    if MODE == 0:
        snap_max = total * 0
        for g0 in range(0, NUM_GROUPS, BLOCK_G):
            o_g = g0 + tl.arange(0, BLOCK_G)
            load = tl.sum(tl.where((g_snap[None, :] == o_g[:, None]) & live[None, :], cost[None, :], 0), axis=1)
            snap_max = tl.maximum(snap_max, tl.max(load, axis=0))
        cut_max = (total + G - 1) // G + FIXED + cut_cost
        snap = snap_max <= cut_max
    else:
        snap = (total * 0 + MODE) == 2
    g_first = tl.where(snap, g_snap, g_cut)
    n = tl.where(snap, live.to(tl.int64), n_cut)
    i_end = tl.cumsum(n, axis=0)
    i_start = i_end - n
    tl.store(num_splits + o_b, n.to(tl.int32), mask=m_b)
    tl.store(work_indptr + 1 + o_b, i_end.to(tl.int32), mask=m_b)
    tl.store(work_indptr + o_b, tl.zeros([BLOCK_B], tl.int32), mask=o_b == 0)
    n_items = tl.sum(n, axis=0)
    for i0 in range(0, capacity, BLOCK_I):
        o_i = i0 + tl.arange(0, BLOCK_I)
        req = tl.sum(((i_end[None, :] <= o_i[:, None]) & m_b[None, :]).to(tl.int32), axis=1)  # [BLOCK_I]
        sel = o_b[None, :] == req[:, None]
        r_start = tl.sum(tl.where(sel, i_start[None, :], 0), axis=1)
        r_g = tl.sum(tl.where(sel, g_first[None, :], 0), axis=1) + (o_i - r_start)  # the item's group
        r_first = tl.sum(tl.where(sel, first[None, :], 0), axis=1)
        r_end = tl.sum(tl.where(sel, ends[None, :], 0), axis=1)
        r_len = tl.sum(tl.where(sel, L[None, :], 0), axis=1)
        u_lo = tl.maximum(r_g * total // G, r_first)
        u_hi = tl.minimum((r_g + 1) * total // G, r_end)
        kv_lo = tl.where(snap, 0, tl.maximum(u_lo - r_first, 0) * UNIT)
        kv_hi = tl.where(snap, r_len, tl.minimum(tl.maximum(u_hi - r_first, 0) * UNIT, r_len))
        valid = o_i < n_items
        m_i = o_i < capacity
        tl.store(work_req + o_i, tl.where(valid, req, -1).to(tl.int32), mask=m_i)
        tl.store(work_lo + o_i, tl.where(valid, kv_lo, 0).to(tl.int32), mask=m_i)
        tl.store(work_hi + o_i, tl.where(valid, tl.maximum(kv_hi, kv_lo), 0).to(tl.int32), mask=m_i)
    # group g's items: those of groups < g come first (items are in request order, their groups non-decreasing)
    for g0 in range(0, NUM_GROUPS + 1, BLOCK_G):
        o_g = g0 + tl.arange(0, BLOCK_G)
        before = tl.minimum(tl.maximum(o_g[:, None] - g_first[None, :], 0), n[None, :])  # [BLOCK_G, BLOCK_B]
        tl.store(
            group_indptr + o_g, tl.sum(tl.where(m_b[None, :], before, 0), axis=1).to(tl.int32), mask=o_g <= NUM_GROUPS
        )


@dataclass(frozen=True)
class DecodeSpans:
    r"""A request-spanning schedule of one decode step for the Hopper pair kernel (module docstring).

    Attributes:
        num_groups (int): program groups; group g runs items ``group_indptr[g]:group_indptr[g+1]``.
        readers (int): programs per group (head blocks x query blocks of the Gluon kernel's 64-row tiles).
        work_req (torch.Tensor): `[capacity]` int32, request of each item, -1 for unused slots.
        work_lo, work_hi (torch.Tensor): `[capacity]` int32, the item's keys ``[work_lo, work_hi)`` of its request
            (multiples of ``SPAN_UNIT`` except a request's end; empty for a request without keys).
        num_splits (torch.Tensor): `[B]` int32, items of each request (0 without query rows).
        work_indptr (torch.Tensor): `[B + 1]` int32, request b owns items ``work_indptr[b]:work_indptr[b+1]``.
        group_indptr (torch.Tensor): `[num_groups + 1]` int32.
        flags (torch.Tensor): `[capacity * readers * 2]` int32, zeros between launches: a piece's flag per program
            and warpgroup (the kernel raises and resets them; one launch at a time per schedule).
    """

    num_groups: int
    readers: int
    work_req: torch.Tensor
    work_lo: torch.Tensor
    work_hi: torch.Tensor
    num_splits: torch.Tensor
    work_indptr: torch.Tensor
    group_indptr: torch.Tensor
    flags: torch.Tensor


def plan_spans(seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_groups: int, readers: int, capacity: int,
               out: DecodeSpans | None = None, mode: str = "auto",
               cut_cost: int | None = None) -> DecodeSpans:  # fmt: skip
    r"""Build the request-spanning schedule (module docstring) on the device, in one launch.

    Args:
        seq_lens (torch.Tensor): `[B]` int32. query_start_loc (torch.Tensor): `[B + 1]` int32 (checked by the
            caller, :func:`openmla.plan_decode`).
        num_groups (int): groups to balance over (SMs // readers). readers (int): programs per group (recorded).
        capacity (int): item slots, at least ``B + num_groups`` (each group boundary adds at most one item).
        out (DecodeSpans | None): buffers of an earlier schedule with the same ``num_groups`` and capacity,
            rewritten in place.
        mode (str): "auto" (the cheaper of "cut" and "snap", module docstring), "cut" or "snap".
        cut_cost (int | None): a cut's cost in units (default ``SPAN_CUT``).
    """
    B = seq_lens.shape[0]
    dev = seq_lens.device
    if num_groups < 1 or readers < 1:
        raise ValueError(f"num_groups and readers must be >= 1; got {num_groups}, {readers}")
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {tuple(_MODES)}; got {mode!r}")
    if capacity < B + num_groups:
        raise ValueError(f"capacity ({capacity}) must be at least batch ({B}) + num_groups ({num_groups})")
    if out is not None:
        if (out.num_groups, out.readers, out.work_req.shape[0], out.num_splits.shape[0]) != (
            num_groups,
            readers,
            capacity,
            B,
        ):
            raise ValueError("out= spans were built for a different batch size, num_groups or capacity")
        spans = out
    else:
        spans = DecodeSpans(
            num_groups=num_groups, readers=readers,
            work_req=torch.empty(capacity, dtype=torch.int32, device=dev),
            work_lo=torch.empty(capacity, dtype=torch.int32, device=dev),
            work_hi=torch.empty(capacity, dtype=torch.int32, device=dev),
            num_splits=torch.empty(B, dtype=torch.int32, device=dev),
            work_indptr=torch.zeros(B + 1, dtype=torch.int32, device=dev),
            group_indptr=torch.zeros(num_groups + 1, dtype=torch.int32, device=dev),
            flags=torch.zeros(capacity * readers * 2, dtype=torch.int32, device=dev),
        )  # fmt: skip
    if B:
        _plan_spans_fwd_kernel[(1,)](
            seq_lens, query_start_loc, spans.work_req, spans.work_lo, spans.work_hi, spans.num_splits,
            spans.work_indptr, spans.group_indptr, B, num_groups, capacity, SPAN_CUT if cut_cost is None else cut_cost,
            UNIT=SPAN_UNIT, FIXED=SPAN_FIXED, MODE=_MODES[mode], BLOCK_B=triton.next_power_of_2(B), BLOCK_I=16,
            BLOCK_G=16, num_warps=8,
        )  # fmt: skip
    else:
        spans.work_req.fill_(-1)
        spans.work_indptr.zero_()
        spans.group_indptr.zero_()
    return spans


def plan_spans_ref(seq_lens: list[int], qlens: list[int], num_groups: int, mode: str = "auto",
                   cut_cost: int = SPAN_CUT) -> list[list[tuple[int, int, int]]]:  # fmt: skip
    """The schedule in plain Python, for tests: per group, its items ``(request, kv_lo, kv_hi)`` in order."""
    cost = [SPAN_FIXED + -(-n // SPAN_UNIT) if q > 0 else 0 for n, q in zip(seq_lens, qlens)]
    total = max(1, sum(cost))
    used = min(num_groups, total)  # groups with a non-empty range
    starts = [sum(cost[:b]) for b in range(len(cost))]
    groups: list[list[tuple[int, int, int]]] = [[] for _ in range(num_groups)]
    snap_of = [min((2 * s + c) * used // (2 * total), used - 1) for s, c in zip(starts, cost)]
    loads = [sum(c for b, c in enumerate(cost) if qlens[b] > 0 and snap_of[b] == g) for g in range(used)]
    snap = mode == "snap" or (mode == "auto" and max(loads) <= -(-total // used) + SPAN_FIXED + cut_cost)
    bounds = [g * total // used for g in range(used + 1)]
    for b, (n, q) in enumerate(zip(seq_lens, qlens)):
        start, end = starts[b], starts[b] + cost[b]
        if q <= 0:
            continue
        first = start + SPAN_FIXED
        if snap:
            groups[snap_of[b]].append((b, 0, n))
        elif n == 0:  # no keys: one empty item in the group holding the request's start
            groups[max(g for g in range(used) if bounds[g] <= start)].append((b, 0, 0))
        else:
            for g in range(used):
                lo, hi = max(bounds[g], first), min(bounds[g + 1], end)
                if lo < hi:
                    groups[g].append((b, (lo - first) * SPAN_UNIT, min((hi - first) * SPAN_UNIT, n)))
    return groups
