"""Split-KV work planner for paged MLA decode.

The decode kernel runs one program per (work item, head block, query-row group); a work item is one
KV split of one request. The planner picks a single split length for the whole batch: it tries the
longest request cut into 1, 2, ... equal parts and keeps the length whose estimated time is lowest,
counting whole waves of work items over the programs that run at once (``slots``) plus a fixed cost
per item (q load, partial write, reduce). So a uniform batch gets the split count that fills the GPU
in whole waves (128 x 8k requests at 16 heads on 132 SMs, one program an SM: one split each, 128 items for 132
slots), and one long
request among many short ones is cut finely enough not to leave SMs idle. Each request's splits are
then made equal. The work items are laid out request by request, the requests by decreasing split length (ties in
batch order, so a uniform batch keeps it): the GPU hands each freed SM the next item, and launching the longest
items first leaves the short ones to even out the end of a ragged batch (the longest-processing-time-first rule;
a launch-order simulation of h16 b128 s8192~4096 on 132 SMs: the busiest SM at 1.043x the mean, 1.092x in batch
order). It runs on the device in one launch (no host synchronisation once ``max_query_len``
and ``max_seq_len`` are known), writes into fixed-size buffers (CUDA-graph capturable with ``out=``)
and is computed once per step and reused by every layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from openmla.device import INTERPRET
from openmla.ops._validate import capturing, check_index, check_positive_ints
from openmla.ops.gluon.decode import gluon_decode_config
from openmla.ops.plan_spans import _MODES as _SPAN_MODES
from openmla.ops.plan_spans import DecodeSpans, plan_spans

__all__ = ["DecodePlan", "plan_decode"]

# tokens: below this a split's fixed cost (q load, partial write) dominates; 64-row tiles take longer splits
# (h128 b1 s32k on the H200: 72 us at 512 against 92 us at 256)
_MIN_SPLIT = 256
_MIN_SPLIT_64_ROWS = 512
_MAX_SPLIT_TILES = 128  # a split spans at most this many KV tiles (its page numbers stay in registers)
# a work item's fixed cost (q load, partial write and its share of the reduce), in KV tokens
_ITEM_COST = 256
_MAX_CANDIDATES = 128  # split counts tried for the longest request


@triton.jit
def _plan_decode_fwd_kernel(
    seq_lens,  # [B]
    query_start_loc,  # [B + 1]
    split_len,  # [B] out
    num_splits,  # [B] out
    work_indptr,  # [B + 1] out, cumulative in launch order
    work_req,  # [capacity] out
    work_split,  # [capacity] out
    merge_info,  # [B, 3] out
    num_merge,  # [1] out
    B,
    capacity,
    slots,  # work items that run at once (programs per SM x SMs / programs per item)
    MIN_SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_SPLIT: tl.constexpr,
    ITEM_COST: tl.constexpr,
    N_CAND: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    # one program plans the whole batch: a single launch, no host synchronisation
    o_b = tl.arange(0, BLOCK_B)
    m_b = o_b < B
    L = tl.load(seq_lens + o_b, mask=m_b, other=0)
    qlen = tl.load(query_start_loc + o_b + 1, mask=m_b, other=0) - tl.load(query_start_loc + o_b, mask=m_b, other=0)
    L_max = tl.max(tl.where(qlen > 0, L, 0), axis=0)
    # candidate split lengths: the longest request cut into c = 1..N_CAND equal parts, in whole tiles,
    # within [MIN_SPLIT, MAX_SPLIT] (the longest request may be shorter than MIN_SPLIT)
    o_c = 1 + tl.arange(0, N_CAND)
    cand = (L_max + o_c - 1) // o_c
    cand = tl.maximum(cand, tl.minimum(MIN_SPLIT, L_max))
    cand = tl.maximum(tl.minimum((cand + BLOCK_N - 1) // BLOCK_N * BLOCK_N, MAX_SPLIT), BLOCK_N)  # [C]
    # cost of each candidate: whole waves of full-length items, or the total work over the slots
    n_bc = tl.where(qlen[None, :] > 0, tl.maximum((L[None, :] + cand[:, None] - 1) // cand[:, None], 1), 0)  # [C, B]
    per_bc = (L[None, :] + tl.maximum(n_bc, 1) - 1) // tl.maximum(n_bc, 1)
    items = tl.sum(n_bc, axis=1)
    full = tl.sum(tl.where(2 * per_bc >= cand[:, None], n_bc, 0), axis=1)
    waves = (full + slots - 1) // slots
    work = tl.sum(tl.where(n_bc > 0, L[None, :], 0), axis=1) + ITEM_COST * items
    cost = tl.maximum(waves * (cand + ITEM_COST), (work + slots - 1) // slots)
    cost = tl.where(items <= capacity, cost, 2**31 - 1)  # candidate 1 always fits (capacity covers it)
    split = tl.sum(tl.where(o_c == tl.argmin(cost, axis=0) + 1, cand, 0), axis=0)  # fewest items among ties
    n = tl.where(qlen > 0, tl.maximum((L + split - 1) // split, 1), 0)
    n1 = tl.maximum(n, 1)
    per = (L + n1 - 1) // n1  # equal splits per request, not a short tail
    per = tl.where(n > 0, tl.maximum((per + BLOCK_N - 1) // BLOCK_N * BLOCK_N, BLOCK_N), 0)
    tl.store(split_len + o_b, per.to(tl.int32), mask=m_b)
    tl.store(num_splits + o_b, n.to(tl.int32), mask=m_b)
    # launch order: the requests by decreasing split length (longest processing time first: a freed SM takes the
    # next item, so the short items fill in at the end), ties in batch order; one sort of packed int64 keys
    # (split length in tiles, BLOCK_B - 1 - request) * 2^32 + splits. Requests without splits (and the padding
    # lanes) sort last. Position j of the sorted block is the j-th request launched.
    key = ((per // BLOCK_N).to(tl.int64) * BLOCK_B + (BLOCK_B - 1 - o_b)) * 4294967296 + n
    if BLOCK_B > 1:  # (Triton 3.6, sm90: ptxas ran for over 10 minutes on the sort of a one-element block)
        key = tl.sort(key, descending=True)
    hi = key // 4294967296
    r_j = BLOCK_B - 1 - hi % BLOCK_B  # [BLOCK_B] request launched j-th
    n_j = key - hi * 4294967296  # its splits
    ends = tl.cumsum(n_j, axis=0)
    starts = ends - n_j
    tl.store(work_indptr + 1 + o_b, ends.to(tl.int32), mask=m_b)
    tl.store(work_indptr + o_b, starts.to(tl.int32), mask=o_b == 0)
    n_items = tl.sum(n, axis=0)
    # the requests with more than one split, in launch order: the reduce visits only these, and reads the work items
    # of one from one place (its partials' loads wait on one load, not on a chain of them)
    multi = ((n_j > 1) & m_b).to(tl.int32)
    n_multi = tl.sum(multi, axis=0)
    p_info = merge_info + (tl.cumsum(multi, axis=0) - 1) * 3
    tl.store(p_info, r_j.to(tl.int32), mask=multi > 0)
    tl.store(p_info + 1, starts.to(tl.int32), mask=multi > 0)
    tl.store(p_info + 2, n_j.to(tl.int32), mask=multi > 0)
    tl.store(merge_info + o_b * 3, tl.full([BLOCK_B], -1, tl.int32), mask=m_b & (o_b >= n_multi))
    tl.store(merge_info + o_b * 3 + 2, tl.zeros([BLOCK_B], tl.int32), mask=m_b & (o_b >= n_multi))
    tl.store(num_merge, n_multi)
    for i0 in range(0, capacity, BLOCK_I):
        o_i = i0 + tl.arange(0, BLOCK_I)
        pos = tl.sum(((ends[None, :] <= o_i[:, None]) & m_b[None, :]).to(tl.int32), axis=1)  # [BLOCK_I] launch slot
        hit = o_b[None, :] == pos[:, None]  # [BLOCK_I, BLOCK_B]
        req = tl.sum(tl.where(hit, r_j[None, :], 0), axis=1)
        first = tl.sum(tl.where(hit, starts[None, :], 0), axis=1)
        valid = o_i < n_items
        m_i = o_i < capacity
        tl.store(work_req + o_i, tl.where(valid, req, -1).to(tl.int32), mask=m_i)
        tl.store(work_split + o_i, tl.where(valid, o_i - first, 0).to(tl.int32), mask=m_i)


@dataclass(frozen=True)
class DecodeTiling:
    """Tile shape of the decode kernel: ``BLOCK_H`` heads x ``Q_PER`` query rows = ``block_m`` rows."""

    block_h: int
    q_per: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False  # full KV tiles through TMA descriptors (page-aligned tiles; Hopper and the interpreter)

    @property
    def programs_per_sm(self) -> int:
        """Programs that share an SM (an estimate that matches the sm90 compile reports):
        up to 255 registers per thread leave room for two 4-warp programs or one 8-warp program, and
        the KV ring (num_stages - 1 tiles of 576 bf16 columns) plus q must fit 227 KB of shared memory."""
        by_regs = 2 if self.num_warps <= 4 else 1
        ring = max(1, self.num_stages - 1) * self.block_n * 576 * 2 + self.block_m * 576 * 2
        return max(1, min(by_regs, 232448 // ring))

    @property
    def max_split(self) -> int:
        """Longest split in tokens: the kernel preloads a split's page numbers into registers."""
        return _MAX_SPLIT_TILES * self.block_n

    @property
    def block_m(self) -> int:
        return self.block_h * self.q_per


def choose_tiling(num_heads: int, max_query_len: int, kv_cache_dtype: str = "auto",
                  hopper: bool = False) -> DecodeTiling:  # fmt: skip
    """Rows per program: 16 (memory-bound, mma.sync), 32, or 64 (wgmma-sized) by heads x qlen. ``hopper``:
    the plan is for an sm90 GPU with the Gluon tier, which ``mla_decode`` runs for every fp8 cache (one
    8-warp program per SM over 64-key tiles: the plan's work items must fill those slots)."""
    rows = num_heads * max_query_len
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    block_h = min(triton_next_pow2(num_heads), block_m)
    q_per = block_m // block_h
    if INTERPRET:
        return DecodeTiling(block_h, q_per, 16, 4, 1)
    # measured on the H200: 64-token tiles, 3 stages, 4 warps for 16 and 32 rows (h16 b128 s8k: 94.8% of the
    # read bandwidth, no reduce needed); 64-token tiles, one 8-warp program per SM for 64 rows
    if block_m == 64:
        return DecodeTiling(block_h, q_per, 64, 8, 2)
    if kv_cache_dtype == "fp8" and hopper:  # the Gluon kernel's slots (h16 b128 s8k: 426 vs 469 us)
        return DecodeTiling(block_h, q_per, 64, 8, 2, True)
    if kv_cache_dtype == "fp8":  # widening e4m3 in registers: 32-token tiles through TMA, two programs per SM
        return DecodeTiling(block_h, q_per, 32, 4, 2, True)
    return DecodeTiling(block_h, q_per, 64, 4, 3)


def triton_next_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


@dataclass(frozen=True)
class DecodePlan:
    r"""A split-KV schedule for one decode step, reusable by every layer of that step.

    Attributes:
        batch_size, num_heads, max_query_len, num_sms, d_v: the configuration it was built for;
            ``mla_decode`` checks that a call matches it.
        kv_cache_dtype (str): "auto" or "fp8", the cache the tiling was chosen for (checked too).
        tiling (DecodeTiling): the kernel's tile shape.
        capacity (int): number of work-item slots (programs along grid axis 0).
        split_len (torch.Tensor): `[B]` int32, KV tokens per split of each request (a multiple of
            ``tiling.block_n``; the request's splits are as equal as that allows; 0 without splits).
        num_splits (torch.Tensor): `[B]` int32, splits of each request (1 for an empty request with
            query rows, so its rows are written; 0 for a request without query rows).
        work_indptr (torch.Tensor): `[B + 1]` int32, cumulative splits in launch order (not indexed by request):
            the j-th request launched owns work items ``work_indptr[j]:work_indptr[j+1]``; ``work_indptr[B]`` is the
            number of work items. Requests launch by decreasing ``split_len``, ties in batch order; those without
            query rows (no splits) come last.
        work_req (torch.Tensor): `[capacity]` int32, request of each work item, -1 for unused slots (after the
            last item); a request's items are contiguous.
        work_split (torch.Tensor): `[capacity]` int32, split index of each work item (a request's items in split
            order).
        o_part (torch.Tensor): `[capacity, max_query_len, num_heads, d_v]` fp32 partial outputs
            (normalised) of requests with more than one split.
        lse_part (torch.Tensor): `[capacity, max_query_len, num_heads]` fp32 natural-log partial LSEs.
        merge_info (torch.Tensor): `[B, 3]` int32, one row per request with more than one split, in launch order
            (their partials are merged by the reduce): the request, its first work item and its splits (its
            items and partials are ``first:first + splits``); then rows of (-1, any, 0).
        num_merge (torch.Tensor): `[1]` int32, how many rows of ``merge_info`` are requests.
        spans (DecodeSpans | None): the request-spanning schedule of the same batch for the Hopper pair kernel
            (:mod:`openmla.ops.plan_spans`; it shares ``o_part`` / ``lse_part``), where ``mla_decode`` runs that
            kernel (64-row tiles read by 2+ programs each, a batch that fills the SMs with them); else None.
        max_splits (int): an upper bound of any request's splits, from ``max_seq_len`` and the shortest split (the
            reduce's step over the splits; 0: unknown).
    """

    batch_size: int
    num_heads: int
    max_query_len: int
    num_sms: int
    d_v: int
    tiling: DecodeTiling
    capacity: int
    split_len: torch.Tensor
    num_splits: torch.Tensor
    work_indptr: torch.Tensor
    work_req: torch.Tensor
    work_split: torch.Tensor
    o_part: torch.Tensor
    lse_part: torch.Tensor
    merge_info: torch.Tensor
    num_merge: torch.Tensor
    spans: DecodeSpans | None = None
    kv_cache_dtype: str = "auto"
    max_splits: int = 0

    def check(self, batch_size: int, num_heads: int, d_v: int, kv_cache_dtype: str | None = None) -> None:
        """Raise when a call does not match the configuration this plan was built for (``kv_cache_dtype``
        None: not compared)."""
        dtype = self.kv_cache_dtype if kv_cache_dtype is None else kv_cache_dtype
        if (batch_size, num_heads, d_v, dtype) != (self.batch_size, self.num_heads, self.d_v, self.kv_cache_dtype):
            raise ValueError(
                f"plan was built for batch {self.batch_size}, {self.num_heads} heads, d_v {self.d_v}, "
                f"kv_cache_dtype {self.kv_cache_dtype!r}; the call has batch {batch_size}, {num_heads} heads, "
                f"d_v {d_v}, kv_cache_dtype {dtype!r}"
            )


def _gluon_tier(device: torch.device) -> bool:
    """Whether ``mla_decode`` can run the Hopper Gluon kernel on this device."""
    if INTERPRET or device.type != "cuda":
        return False
    from openmla.ops.gluon._lang import GLUON_AVAILABLE

    return GLUON_AVAILABLE and torch.cuda.get_device_capability(device)[0] == 9


# the pair kernel needs a batch whose programs fill this fraction of the SMs (H200, bf16, pair + spans vs seesaw:
# h128 s4k b24 (48 programs) 72 us vs 88, b32 85 vs 98, b16 (32) 60 vs 50, b8 51 vs 38; h64 b64 s4k 107 vs 117,
# h64 b32 s8k 109 vs 99, h64 b128 s8k 307 vs 323)
_PAIR_MIN_FILL = 0.3


def pair_wanted(num_heads: int, readers: int, batch: int, num_sms: int) -> bool:
    """Whether the sm90 decode runs the pair kernel (with the request-spanning schedule) on a bf16 cache: 64+
    heads (64-row blocks of heads alone), ``readers`` programs per KV tile, the batch's programs filling at least
    ``_PAIR_MIN_FILL`` of the SMs."""
    return num_heads >= 64 and batch * readers >= _PAIR_MIN_FILL * num_sms


def gluon_readers(num_heads: int, max_query_len: int) -> int:
    """Programs that read each KV tile in the sm90 Gluon kernels (their 64-row blocks of heads x query tokens,
    :func:`openmla.ops.gluon.decode.gluon_decode_config`), whatever the portable tiling."""
    block_h, q_per = gluon_decode_config(num_heads, max_query_len)
    return triton_cdiv(num_heads, block_h) * triton_cdiv(max_query_len, q_per)


def _spans_wanted(kv_cache_dtype: str, num_heads: int, readers: int, batch: int, num_sms: int, device: torch.device,
                  force: bool | None = None) -> bool:  # fmt: skip
    """Whether ``plan_decode`` adds the request-spanning schedule: where ``mla_decode`` runs the pair kernel
    (sm90, a bf16 cache, :func:`pair_wanted`; the Gluon kernels run 64-row blocks whatever the portable tiling).
    ``force`` (tests, bench): True adds it for every bf16 cache, False never."""
    if force is False or kv_cache_dtype != "auto" or readers > num_sms:
        return False
    return force is True or (_gluon_tier(device) and pair_wanted(num_heads, readers, batch, num_sms))


def _default_num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def plan_decode(
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_heads: int,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_sms: int | None = None,
    d_v: int = 512,
    kv_cache_dtype: str = "auto",
    out: DecodePlan | None = None,
    validate: bool = True,
    _spans: bool | None = None,
    _min_split: int | None = None,
    _max_split: int | None = None,
    _item_cost: int | None = None,
    _slots: int | None = None,
    _spans_mode: str | None = None,
    _span_cut: int | None = None,
) -> DecodePlan:
    r"""Plan the split-KV decode of a (ragged) batch.

    Args:
        seq_lens (torch.Tensor): `[B]` int32, keys per request (context + new tokens).
        query_start_loc (torch.Tensor): `[B + 1]` int32, query rows of each request.
        num_heads (int): query heads of the layers that will use the plan.
        max_query_len (int | None): the largest query length in the batch (1 for plain decode, up to
            16 for speculative verify). When None it is read from ``query_start_loc``, which
            synchronises with the host; schedulers know it and should pass it.
        max_seq_len (int | None): an upper bound of ``seq_lens`` (sizes the work-item buffers); read
            from ``seq_lens`` (a host sync) when None.
        num_sms (int | None): multiprocessors to balance over (default: the device's).
        d_v (int): output width (512 for DeepSeek's latent).
        kv_cache_dtype (str): "auto" or "fp8", the cache the layers read (fp8 caches get their own tiles).
        validate (bool): check the bounds against the tensors (one host sync). A scheduler that
            already checked its batch on the host passes False together with both bounds; the plan then
            never waits for the device.
        out (DecodePlan | None): a plan built earlier for the same batch size, heads and
            ``max_query_len``: its buffers are rewritten in place (stable addresses for CUDA graphs).
        _spans (bool | None): tests only: True adds the request-spanning schedule for every bf16 cache, False
            never; None (default) where ``mla_decode`` runs the pair kernel.
        _min_split, _max_split, _item_cost, _slots (int | None): tuning only (``openmla bench``): the shortest and
            longest split in tokens (``_max_split`` a multiple of ``tiling.block_n``, at most ``tiling.max_split``;
            both equal: that split length), a work item's fixed cost in tokens, and the work items that run at once,
            in place of ``_MIN_SPLIT`` / ``_MIN_SPLIT_64_ROWS``, ``tiling.max_split``, ``_ITEM_COST`` and the
            tiling's slots. None (default): the planner's own.
        _spans_mode (str | None), _span_cut (int | None): tuning only (``openmla bench``): the spanning schedule's
            mode ("auto", "cut" or "snap") and, for "auto", a cut's cost in units in place of ``SPAN_CUT``
            (:func:`openmla.ops.plan_spans.plan_spans`), where the plan has that schedule. None (default): "auto",
            ``SPAN_CUT``.

    Returns:
        DecodePlan: the schedule (see its attributes).
    """
    check_index("query_start_loc", query_start_loc, ndim=1)
    dev = query_start_loc.device
    B = query_start_loc.shape[0] - 1
    check_index("seq_lens", seq_lens, ndim=1, device=dev, length=B)
    seq_lens, query_start_loc = seq_lens.contiguous(), query_start_loc.contiguous()  # the kernel reads dense arrays
    check_positive_ints(("num_heads", num_heads), ("d_v", d_v), ("num_sms", num_sms if num_sms is not None else 1))
    qlen = query_start_loc[1:] - query_start_loc[:-1]
    if (validate or max_query_len is None or max_seq_len is None) and not capturing() and B:  # one host sync
        top_q, top_s, low_q, low_s = torch.stack([qlen.max(), seq_lens.max().to(qlen.dtype), qlen.min(),
                                                  seq_lens.min().to(qlen.dtype)]).tolist()  # fmt: skip
        if low_q < 0 or low_s < 0:
            raise ValueError("query_start_loc must be non-decreasing and seq_lens non-negative")
        if max_query_len is not None and top_q > max_query_len:
            raise ValueError(f"a request has {top_q} query rows but max_query_len is {max_query_len}")
        if max_seq_len is not None and top_s > max_seq_len:
            raise ValueError(f"seq_lens reaches {top_s} but max_seq_len is {max_seq_len}")
        max_query_len = max(1, top_q) if max_query_len is None else max_query_len
        max_seq_len = top_s if max_seq_len is None else max_seq_len
    elif max_query_len is None or max_seq_len is None:
        if capturing() or B:
            raise ValueError("max_query_len and max_seq_len must be given while a CUDA graph is captured")
        max_query_len, max_seq_len = max_query_len or 1, max_seq_len or 0
    if num_sms is None:
        num_sms = out.num_sms if out is not None else _default_num_sms(dev)
    if kv_cache_dtype not in ("auto", "fp8"):
        raise ValueError(f'kv_cache_dtype must be "auto" or "fp8"; got {kv_cache_dtype!r}')
    tiling = choose_tiling(num_heads, max_query_len, kv_cache_dtype, hopper=_gluon_tier(dev))
    programs_per_split = triton_cdiv(num_heads, tiling.block_h) * triton_cdiv(max_query_len, tiling.q_per)
    slots = max(1, (tiling.programs_per_sm * num_sms) // programs_per_split)
    min_split = _MIN_SPLIT_64_ROWS if tiling.block_m == 64 else _MIN_SPLIT
    max_split, item_cost = tiling.max_split, _ITEM_COST
    if (_min_split, _max_split, _item_cost, _slots) != (None,) * 4:  # tuning overrides (bench), checked here
        slots, min_split, max_split, item_cost = _tuning(tiling, slots, min_split, _min_split, _max_split,
                                                         _item_cost, _slots)  # fmt: skip
    _check_spans_tuning(_spans, _spans_mode, _span_cut)
    # splits are at most max_split long, so a batch of long requests may need more than slots
    capacity = B + max(slots, B * triton_cdiv(max_seq_len, max_split))
    # a request's splits: the batch's split length is at least min(min_split, max_split, the longest request) and a
    # whole tile, so no request has more than this many
    max_splits = max(1, triton_cdiv(max_seq_len, max(tiling.block_n, min(min_split, max_split))))

    if out is not None:
        if (out.batch_size, out.num_heads, out.max_query_len, out.d_v, out.kv_cache_dtype) != (
            B,
            num_heads,
            max_query_len,
            d_v,
            kv_cache_dtype,
        ):
            raise ValueError("out= plan was built for a different batch size, heads, max_query_len, d_v or "
                             "kv_cache_dtype")  # fmt: skip
        if out.capacity < capacity:
            raise ValueError(f"out= plan holds {out.capacity} work items; this batch needs {capacity} (max_seq_len)")
        capacity = out.capacity
        plan = out
    else:
        plan = DecodePlan(
            batch_size=B, num_heads=num_heads, max_query_len=max_query_len, num_sms=num_sms, d_v=d_v,
            kv_cache_dtype=kv_cache_dtype,
            tiling=tiling, capacity=capacity,
            split_len=torch.empty(B, dtype=torch.int32, device=dev),
            num_splits=torch.empty(B, dtype=torch.int32, device=dev),
            work_indptr=torch.zeros(B + 1, dtype=torch.int32, device=dev),
            work_req=torch.empty(capacity, dtype=torch.int32, device=dev),
            work_split=torch.empty(capacity, dtype=torch.int32, device=dev),
            o_part=torch.empty(capacity, max_query_len, num_heads, d_v, dtype=torch.float32, device=dev),
            lse_part=torch.empty(capacity, max_query_len, num_heads, dtype=torch.float32, device=dev),
            merge_info=torch.zeros(B, 3, dtype=torch.int32, device=dev),
            num_merge=torch.zeros(1, dtype=torch.int32, device=dev),
            max_splits=max_splits,
        )  # fmt: skip
    spans = None
    readers = gluon_readers(num_heads, max_query_len)
    if _spans_wanted(kv_cache_dtype, num_heads, readers, B, num_sms, dev, _spans):
        groups = num_sms // readers
        reuse = out.spans if out is not None and out.spans is not None and out.spans.num_groups == groups else None
        spans = plan_spans(seq_lens, query_start_loc, groups, readers, capacity, out=reuse,
                           mode=_spans_mode or "auto", cut_cost=_span_cut)  # fmt: skip
    if spans is not plan.spans or max_splits != plan.max_splits:
        plan = dataclasses.replace(plan, spans=spans, max_splits=max_splits)
    if B:
        _plan_decode_fwd_kernel[(1,)](
            seq_lens, query_start_loc, plan.split_len, plan.num_splits, plan.work_indptr, plan.work_req,
            plan.work_split, plan.merge_info, plan.num_merge, B, capacity, slots, MIN_SPLIT=min_split,
            BLOCK_N=tiling.block_n, MAX_SPLIT=max_split, ITEM_COST=item_cost, N_CAND=_MAX_CANDIDATES,
            BLOCK_B=triton.next_power_of_2(B), BLOCK_I=16, num_warps=8,
        )  # fmt: skip
    else:
        plan.work_indptr.zero_()
        plan.work_req.fill_(-1)
        plan.work_split.zero_()
        plan.num_merge.zero_()
    return plan


def _tuning(tiling: DecodeTiling, slots: int, min_split: int, new_min: int | None, new_max: int | None,
            new_cost: int | None, new_slots: int | None) -> tuple[int, int, int, int]:  # fmt: skip
    """``(slots, min_split, max_split, item_cost)`` with ``plan_decode``'s private overrides applied (None: kept);
    ValueError on a value the kernels cannot run (a split longer than the page numbers they preload)."""
    for name, v, low in (("_min_split", new_min, 1), ("_max_split", new_max, 1), ("_item_cost", new_cost, 0),
                         ("_slots", new_slots, 1)):  # fmt: skip
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < low):
            raise ValueError(f"{name} must be an int >= {low}; got {v!r}")
    max_split = tiling.max_split
    if new_max is not None:
        if new_max % tiling.block_n or new_max > tiling.max_split:
            raise ValueError(
                f"_max_split must be a multiple of {tiling.block_n} up to {tiling.max_split}; got {new_max}"
            )
        max_split = new_max
    return (slots if new_slots is None else new_slots, min_split if new_min is None else new_min, max_split,
            _ITEM_COST if new_cost is None else new_cost)  # fmt: skip


def _check_spans_tuning(force: bool | None, mode: str | None, cut: int | None) -> None:
    """ValueError on spanning-schedule overrides that are invalid or would change nothing (the schedule switched
    off; a cut cost where the mode is forced: only "auto" weighs it)."""
    if mode is not None and (not isinstance(mode, str) or mode not in _SPAN_MODES):
        raise ValueError(f"_spans_mode must be one of {tuple(_SPAN_MODES)}; got {mode!r}")
    if cut is not None and (not isinstance(cut, int) or isinstance(cut, bool) or cut < 0):
        raise ValueError(f"_span_cut must be an int >= 0; got {cut!r}")
    if force is False and (mode, cut) != (None, None):
        raise ValueError("_spans_mode / _span_cut need the spanning schedule; got _spans=False")
    if cut is not None and mode not in (None, "auto"):
        raise ValueError(f"_span_cut applies to _spans_mode 'auto' only; got {mode!r}")


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
