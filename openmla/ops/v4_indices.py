"""DeepSeek V4 index sets (SPEC §7.5, §7.6): sliding window, CSA top-k and HCA entries as cache slots, and the
prefill workspace indices of ``combine_topk_swa_indices``.

Every function writes dense ``indices [T, width]`` int32 rows (valid entries first, -1 after) and
``lens [T]`` int32, one program per token, with optional caller-owned output buffers so that a CUDA graph
can replay them. Token t of request b sits at ``pos = seq_lens[b] - qlen_b + (t - query_start_loc[b])``;
tokens past ``query_start_loc[B]`` and tokens whose ``slot_mapping`` is negative are padding: lens 0, row -1.
Slots are ``block_table[b, i // bs] * bs + i % bs`` of a cache with block size ``bs`` (the SWA cache for
the window, the compressed cache, ``bs = block_size / ratio``, for CSA / HCA entries).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openmla.ops._validate import capturing, check_index, check_positive_ints, describe
from openmla.ops.cache import check_block_table

__all__ = ["combine_topk_swa_indices", "csa_topk_indices", "hca_indices", "swa_indices"]

PREFILL_TOPK_ALIGN = 128  # combine_topk_swa_indices row width granule (SPEC §7.6)
INT32_LIMIT = 2**31  # the index rows are int32: every slot / workspace row written must stay below it


@triton.jit
def _token_position(query_start_loc, seq_lens, slot_mapping, i_t, B: tl.constexpr, BLOCK_B: tl.constexpr,
                    HAS_SLOTS: tl.constexpr):  # fmt: skip
    """(request, position, valid) of flat token i_t; tokens are counted from query_start_loc[0]."""
    o_b = tl.arange(0, BLOCK_B)
    base = tl.load(query_start_loc)
    ends = tl.load(query_start_loc + 1 + o_b, mask=o_b < B, other=2147483647) - base
    i_b = tl.minimum(tl.sum((ends <= i_t).to(tl.int32)), B - 1)
    q0 = tl.load(query_start_loc + i_b) - base
    q1 = tl.load(query_start_loc + i_b + 1) - base
    seq = tl.load(seq_lens + i_b)
    pos = seq - (q1 - q0) + (i_t - q0)
    valid = (i_t >= q0) & (i_t < q1) & (pos >= 0)
    if HAS_SLOTS:
        valid = valid & (tl.load(slot_mapping + i_t) >= 0)
    return i_b.to(tl.int64), pos, seq, valid


@triton.jit
def _slots_of(block_table, i_b, ids, m, stride_bt_b, stride_bt_w, max_blocks, block_size):
    """Request-local ids -> slots through the block table (-1 where masked, or the block is missing)."""
    i_blk = ids // block_size
    m = m & (ids >= 0) & (i_blk < max_blocks)
    blk = tl.load(block_table + i_b * stride_bt_b + tl.where(m, i_blk, 0) * stride_bt_w, mask=m, other=-1)
    blk = blk.to(tl.int64)
    return tl.where(m & (blk >= 0), blk * block_size + ids % block_size, -1)


@triton.jit
def _window_indices_fwd_kernel(
    query_start_loc,  # [B + 1]
    seq_lens,  # [B]
    slot_mapping,  # [T] (HAS_SLOTS)
    block_table,  # [B, W]
    out_indices,  # [T, width] int32
    out_lens,  # [T] int32
    stride_bt_b,
    stride_bt_w,
    stride_out_t,
    max_blocks,
    block_size,
    width,
    ratio,
    window,
    B: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_W: tl.constexpr,
    KIND: tl.constexpr,  # 0: sliding window; 1: all visible compressed entries
    LOCAL: tl.constexpr,  # KIND 1: request-local ids instead of slots
    HAS_SLOTS: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_b, pos, seq, valid = _token_position(query_start_loc, seq_lens, slot_mapping, i_t, B, BLOCK_B, HAS_SLOTS)
    if KIND == 0:
        first = tl.maximum(pos - window + 1, 0)
        n = tl.where(valid, pos + 1 - first, 0)
    else:
        first = pos * 0
        n = tl.where(valid, tl.minimum((pos + 1) // ratio, width), 0)
    p_out = out_indices + i_t.to(tl.int64) * stride_out_t
    for w0 in range(0, width, BLOCK_W):
        o_w = w0 + tl.arange(0, BLOCK_W)
        m_w = o_w < n
        ids = (first + o_w).to(tl.int64)
        if LOCAL:
            b_i = tl.where(m_w, ids, -1)
        else:
            b_i = _slots_of(block_table, i_b, ids, m_w, stride_bt_b, stride_bt_w, max_blocks, block_size)
        tl.store(p_out + o_w, b_i.to(tl.int32), mask=o_w < width)
    tl.store(out_lens + i_t, n.to(tl.int32))


@triton.jit
def _csa_topk_fwd_kernel(
    topk_indices,  # [T, K] request-local entry ids
    query_start_loc,
    seq_lens,
    slot_mapping,
    block_table,
    out_indices,  # [T, K] int32
    out_lens,  # [T] int32
    stride_tk_t,
    stride_bt_b,
    stride_bt_w,
    stride_out_t,
    max_blocks,
    block_size,
    ratio,
    K,
    B: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
):
    # Keep the causal (i < (pos+1) // ratio), non-negative ids in their order, packed to the row's front.
    i_t = tl.program_id(0)
    i_b, pos, seq, valid = _token_position(query_start_loc, seq_lens, slot_mapping, i_t, B, BLOCK_B, HAS_SLOTS)
    n_vis = (pos + 1) // ratio
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < K
    ids = tl.load(topk_indices + i_t.to(tl.int64) * stride_tk_t + o_k, mask=m_k, other=-1).to(tl.int64)
    keep = m_k & valid & (ids >= 0) & (ids < n_vis) & (ids // block_size < max_blocks)
    slots = _slots_of(block_table, i_b, ids, keep, stride_bt_b, stride_bt_w, max_blocks, block_size)
    dest = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    n = tl.sum(keep.to(tl.int32), axis=0)
    p_out = out_indices + i_t.to(tl.int64) * stride_out_t
    tl.store(p_out + o_k, tl.full((BLOCK_K,), -1, tl.int32), mask=m_k & (o_k >= n))
    tl.store(p_out + tl.where(keep, dest, 0), slots.to(tl.int32), mask=keep)
    tl.store(out_lens + i_t, n)


@triton.jit
def _combine_topk_swa_fwd_kernel(
    topk_indices,  # [Tq, Kw] request-local compressed ids
    query_start_loc,  # [R + 1] (offset by query_start_loc[0])
    seq_lens,  # [R]
    gather_lens,  # [R]
    out_indices,  # [Tq, width] int32
    out_lens,  # [Tq] int32
    stride_tk_t,
    stride_out_t,
    Kw,
    topk,
    ratio,
    window,
    M,
    N,
    width,
    B: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_b, pos, seq, valid = _token_position(query_start_loc, seq_lens, seq_lens, i_t, B, BLOCK_B, False)
    n_top = tl.where(valid, tl.minimum((pos + 1) // ratio, topk), 0)
    g0 = seq - tl.load(gather_lens + i_b)
    s0 = tl.maximum(tl.maximum(pos - window + 1, 0), g0)
    n_swa = tl.where(valid, tl.maximum(tl.minimum(pos + 1, seq) - s0, 0), 0)
    p_out = out_indices + i_t.to(tl.int64) * stride_out_t
    for w0 in range(0, width, BLOCK_W):  # the row starts as -1
        o_w = w0 + tl.arange(0, BLOCK_W)
        tl.store(p_out + o_w, tl.full((BLOCK_W,), -1, tl.int32), mask=o_w < width)
    for k0 in range(0, topk, BLOCK_K):  # compressed entries: workspace rows [b*M, b*M + N)
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < n_top
        ids = tl.load(topk_indices + i_t.to(tl.int64) * stride_tk_t + o_k, mask=m_k & (o_k < Kw), other=-1)
        ids = ids.to(tl.int64)
        b_i = tl.where((ids >= 0) & (ids < N), i_b * M + ids, -1)
        tl.store(p_out + o_k, b_i.to(tl.int32), mask=m_k)
    for w0 in range(0, window, BLOCK_W):  # window rows: workspace rows b*M + N + (p - gather_start)
        o_w = w0 + tl.arange(0, BLOCK_W)
        m_w = o_w < n_swa
        b_i = i_b * M + N + (s0 - g0 + o_w)
        tl.store(p_out + n_top + o_w, b_i.to(tl.int32), mask=m_w & (n_top + o_w < width))
    tl.store(out_lens + i_t, (n_top + n_swa).to(tl.int32))


def _outputs(num_tokens, width, dev, out_indices, out_lens):
    for name, t in (("out_indices", out_indices), ("out_lens", out_lens)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None; got {type(t).__name__}")
    if out_indices is None:
        out_indices = torch.empty(num_tokens, width, dtype=torch.int32, device=dev)
    # rows apart: an expanded (or overlapping) buffer would have its rows written over each other
    elif (out_indices.dtype != torch.int32 or out_indices.dim() != 2 or out_indices.shape[0] < num_tokens
          or out_indices.shape[1] < width or out_indices.stride(1) != 1 or out_indices.device != dev
          or (num_tokens > 1 and out_indices.stride(0) < out_indices.shape[1])):  # fmt: skip
        raise ValueError(f"out_indices must be int32 [>= {num_tokens}, >= {width}] on {dev}, rows contiguous and "
                         f"apart; got {describe(out_indices)}, strides {out_indices.stride()}")  # fmt: skip
    if out_lens is None:
        out_lens = torch.empty(num_tokens, dtype=torch.int32, device=dev)
    elif (out_lens.dtype != torch.int32 or out_lens.dim() != 1 or out_lens.shape[0] < num_tokens
          or out_lens.device != dev or (out_lens.shape[0] > 1 and out_lens.stride(0) != 1)):  # fmt: skip
        raise ValueError(f"out_lens must be contiguous int32 [>= {num_tokens}] on {dev}; got {describe(out_lens)}")
    return out_indices, out_lens


def _check_batch(query_start_loc, seq_lens, slot_mapping, num_tokens):
    check_index("query_start_loc", query_start_loc, ndim=1)
    dev = query_start_loc.device
    B = query_start_loc.shape[0] - 1
    if B < 1:
        raise ValueError(f"query_start_loc must have B + 1 >= 2 entries; got {describe(query_start_loc)}")
    check_index("seq_lens", seq_lens, ndim=1, device=dev, length=B)
    if slot_mapping is not None:
        check_index("slot_mapping", slot_mapping, ndim=1, device=dev)
        if slot_mapping.shape[0] < num_tokens:
            raise ValueError(f"slot_mapping must cover the {num_tokens} tokens; got {describe(slot_mapping)}")
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
        raise ValueError(f"num_tokens must be a non-negative int; got {num_tokens!r}")
    return dev, B


def _dense(*ts):
    """1-D index tensors as the kernels read them: densely (a strided one is copied; None stays None)."""
    return tuple(None if t is None else t.contiguous() for t in ts)


def check_int32_slot_table(block_table, lens, starts, block_size: int) -> None:
    """check_block_table where no cache bounds the block ids: the slots ``block * block_size + offset`` written
    are int32, so every block id used must lie in ``[0, 2^31 // block_size)`` (never wrapped silently; sync)."""
    limit = INT32_LIMIT // block_size
    try:
        check_block_table(block_table, lens, starts, block_size, limit)
    except ValueError as e:
        if "refers to block" not in str(e):
            raise
        raise ValueError(f"block_table refers to a block outside [0, {limit}): the indices hold its slots "
                         f"(block * {block_size} + offset) as non-negative int32 values") from e  # fmt: skip


def _check_positions(query_start_loc, seq_lens, num_tokens):
    """Host-side: the batch fits its tokens and every request's seq_len covers its query (sync)."""
    qlen = (query_start_loc[1:] - query_start_loc[:-1]).long()
    if int(qlen.min()) < 0 or int(query_start_loc[-1] - query_start_loc[0]) > num_tokens:
        raise ValueError(f"query_start_loc must be non-decreasing and span at most num_tokens = {num_tokens}")
    if int((seq_lens.long() - qlen).min()) < 0:
        raise ValueError("seq_lens must be >= each request's query length")
    return qlen


def _grid_args(B):
    return {"B": B, "BLOCK_B": triton.next_power_of_2(B)}


def swa_indices(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    block_size: int,
    window: int,
    num_tokens: int,
    slot_mapping: torch.Tensor | None = None,
    out_indices: torch.Tensor | None = None,
    out_lens: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Sliding-window slots of every token: positions ``[max(0, pos - window + 1), pos]`` in order.

    Args:
        query_start_loc (torch.Tensor): `[B + 1]`, int32/int64.
        seq_lens (torch.Tensor): `[B]`, int32/int64; context + new tokens.
        block_table (torch.Tensor): `[B, max_blocks]`, int32/int64; the SWA cache's blocks.
        block_size (int): the SWA cache's block size. window (int): W (128 in V4).
        num_tokens (int): T, the rows to fill (tokens past ``query_start_loc[B]`` are padding).
        slot_mapping (torch.Tensor | None): `[T]`; a negative slot marks a padding token.
        out_indices (torch.Tensor | None): int32 `[>= T, >= window]`; a wider row is -1 past ``lens``.
        out_lens (torch.Tensor | None): int32 `[>= T]`.
        validate (bool): check the batch and the block table (host sync). Unchecked, a missing block gives -1.

    Returns:
        (indices, lens): `[T, width]` int32 slots (-1 past lens), `[T]` int32 ``min(window, pos + 1)``.
    """
    dev, B = _check_batch(query_start_loc, seq_lens, slot_mapping, num_tokens)
    query_start_loc, seq_lens, slot_mapping = _dense(query_start_loc, seq_lens, slot_mapping)
    check_index("block_table", block_table, ndim=2, device=dev)
    if block_table.shape[0] != B:
        raise ValueError(f"block_table must have B = {B} rows; got {describe(block_table)}")
    check_positive_ints(("block_size", block_size), ("window", window))
    out_indices, out_lens = _outputs(num_tokens, window, dev, out_indices, out_lens)
    if validate and not capturing():
        qlen = _check_positions(query_start_loc, seq_lens, num_tokens)
        first = (seq_lens.long() - qlen - window + 1).clamp_min(0)
        check_int32_slot_table(block_table, seq_lens.long() - first, first, block_size)
    if num_tokens == 0:
        return out_indices[:0], out_lens[:0]
    width = out_indices.shape[1]
    _window_indices_fwd_kernel[(num_tokens,)](
        query_start_loc, seq_lens, slot_mapping if slot_mapping is not None else seq_lens, block_table, out_indices,
        out_lens, block_table.stride(0), block_table.stride(1), out_indices.stride(0), block_table.shape[1],
        block_size, width, 1, window, BLOCK_W=min(triton.next_power_of_2(width), 256), KIND=0, LOCAL=False,
        HAS_SLOTS=slot_mapping is not None, **_grid_args(B),
    )  # fmt: skip
    return out_indices[:num_tokens], out_lens[:num_tokens]


def hca_indices(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor | None,
    *,
    block_size: int,
    ratio: int,
    width: int,
    num_tokens: int,
    slot_mapping: torch.Tensor | None = None,
    out_indices: torch.Tensor | None = None,
    out_lens: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""All visible compressed entries of every token (HCA, SPEC §7.5): ``i < (pos + 1) // ratio``.

    Args:
        block_table (torch.Tensor | None): `[B, max_blocks]` of the compressed cache: rows hold slots
            ``block_table[b, i // block_size] * block_size + i % block_size``; None: request-local ids
            ``[0, n)`` (the prefill form, for ``combine_topk_swa_indices``).
        block_size (int): the compressed cache's block size (``block_size / ratio`` of the main one).
        ratio (int): tokens per entry (128). width (int): row width, at least ``ceil(max_model_len / ratio)``.
        Others as ``swa_indices``.
        validate (bool): also checks that no token sees more than ``width`` entries (never truncated
            silently: unchecked, a row holds its first ``width`` entries).

    Returns:
        (indices, lens): `[T, width]` int32 (-1 past lens), `[T]` int32 ``(pos + 1) // ratio``.
    """
    dev, B = _check_batch(query_start_loc, seq_lens, slot_mapping, num_tokens)
    query_start_loc, seq_lens, slot_mapping = _dense(query_start_loc, seq_lens, slot_mapping)
    if block_table is not None:
        check_index("block_table", block_table, ndim=2, device=dev)
        if block_table.shape[0] != B:
            raise ValueError(f"block_table must have B = {B} rows; got {describe(block_table)}")
    check_positive_ints(("block_size", block_size), ("ratio", ratio), ("width", width))
    out_indices, out_lens = _outputs(num_tokens, width, dev, out_indices, out_lens)
    if validate and not capturing():
        _check_positions(query_start_loc, seq_lens, num_tokens)
        top = int((seq_lens.long() // ratio).max())
        if top > width:
            raise ValueError(f"a token sees {top} compressed entries but width is {width}")
        if block_table is not None:
            check_int32_slot_table(block_table, seq_lens.long() // ratio, None, block_size)
    if num_tokens == 0:
        return out_indices[:0], out_lens[:0]
    bt = block_table if block_table is not None else seq_lens.view(-1, 1)
    _window_indices_fwd_kernel[(num_tokens,)](
        query_start_loc, seq_lens, slot_mapping if slot_mapping is not None else seq_lens, bt, out_indices,
        out_lens, bt.stride(0), bt.stride(1), out_indices.stride(0), bt.shape[1], block_size, width, ratio, 1,
        BLOCK_W=min(triton.next_power_of_2(width), 256), KIND=1, LOCAL=block_table is None,
        HAS_SLOTS=slot_mapping is not None, **_grid_args(B),
    )  # fmt: skip
    return out_indices[:num_tokens], out_lens[:num_tokens]


def csa_topk_indices(
    topk_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    block_size: int,
    ratio: int,
    slot_mapping: torch.Tensor | None = None,
    out_indices: torch.Tensor | None = None,
    out_lens: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""CSA: the indexer's request-local top-k entry ids -> compressed-cache slots (SPEC §7.4, §7.5).

    Row t keeps, in order, the ids ``i`` of ``topk_indices[t]`` with ``0 <= i < (pos + 1) // ratio``
    (causal; -1 and later entries are dropped), maps them through the block table and packs them at the
    row's front; ``lens[t]`` counts them.

    Args:
        topk_indices (torch.Tensor): `[T, K]`, int32/int64 (rows may be strided); -1 = no entry.
        block_table (torch.Tensor): `[B, max_blocks]` of the compressed cache.
        block_size (int): the compressed cache's block size. ratio (int): 4.
        Others as ``swa_indices`` (T is ``topk_indices.shape[0]``).
        validate (bool): check the batch and that the block table covers each request's entries (sync).

    Returns:
        (indices, lens): `[T, K]` int32 slots (-1 past lens), `[T]` int32.
    """
    check_index("topk_indices", topk_indices, ndim=2)
    T, K = topk_indices.shape
    dev, B = _check_batch(query_start_loc, seq_lens, slot_mapping, T)
    query_start_loc, seq_lens, slot_mapping = _dense(query_start_loc, seq_lens, slot_mapping)
    if topk_indices.device != dev:
        raise ValueError(f"topk_indices must be on {dev}; got {describe(topk_indices)}")
    if K > 1 and topk_indices.stride(1) != 1:
        raise ValueError(f"topk_indices rows must be contiguous; got strides {topk_indices.stride()}")
    check_index("block_table", block_table, ndim=2, device=dev)
    if block_table.shape[0] != B:
        raise ValueError(f"block_table must have B = {B} rows; got {describe(block_table)}")
    check_positive_ints(("block_size", block_size), ("ratio", ratio))
    out_indices, out_lens = _outputs(T, K, dev, out_indices, out_lens)
    if validate and not capturing():
        _check_positions(query_start_loc, seq_lens, T)
        check_int32_slot_table(block_table, seq_lens.long() // ratio, None, block_size)
    if T == 0:
        return out_indices[:0], out_lens[:0]
    if out_indices.shape[1] > K:
        out_indices[:T, K:].fill_(-1)
    _csa_topk_fwd_kernel[(T,)](
        topk_indices, query_start_loc, seq_lens, slot_mapping if slot_mapping is not None else seq_lens,
        block_table, out_indices, out_lens, topk_indices.stride(0), block_table.stride(0), block_table.stride(1),
        out_indices.stride(0), block_table.shape[1], block_size, ratio, K, BLOCK_K=triton.next_power_of_2(max(K, 1)),
        HAS_SLOTS=slot_mapping is not None, **_grid_args(B),
    )  # fmt: skip
    return out_indices[:T], out_lens[:T]


def combine_topk_swa_indices(
    topk_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor,
    *,
    window: int,
    ratio: int,
    topk: int,
    M: int,
    N: int,
    out_indices: torch.Tensor | None = None,
    out_lens: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Indices into the prefill workspace ``kv_ws [R, M, 512]`` viewed as ``[R * M, 512]`` (SPEC §7.6).

    The workspace holds request r's compressed entries at rows ``[r*M, r*M + N)`` and its last
    ``gather_lens[r]`` raw tokens at ``[r*M + N, r*M + N + gather_lens[r])`` (``dequantize_and_gather_k_cache``
    with ``offset = N``). Row t (request r, position pos) holds
    ``[0, n_top)``, ``n_top = min((pos + 1) // ratio, topk)``: ``r*M + topk_indices[t, j]`` (-1 where that
    id is < 0 or >= N); then the window positions ``p in [max(pos - window + 1, 0, gather_start), pos]`` as
    ``r*M + N + p - gather_start`` with ``gather_start = seq_lens[r] - gather_lens[r]``; -1 after.

    Args:
        topk_indices (torch.Tensor): `[Tq, Kw]`, int32/int64; request-local compressed ids (the CSA
            indexer's top-k, or ``hca_indices(..., block_table=None)``); `[Tq, 0]` for SWA-only layers.
        query_start_loc (torch.Tensor): `[R + 1]` of these requests (may start at a non-zero offset).
        seq_lens (torch.Tensor), gather_lens (torch.Tensor): `[R]`, int32/int64.
        window (int): W. ratio (int): compress ratio (any >= 1 with topk 0 for SWA-only layers).
        topk (int): compressed entries a row may take (<= Kw). M, N (int): workspace rows per request and
            compressed rows per request.
        out_indices, out_lens: int32 buffers `[>= Tq, >= width]`, `[>= Tq]`.
        validate (bool): check the batch, ``topk <= Kw``, that the gathered rows cover each window
            (``gather_lens >= min(seq_len, qlen + window - 1)``) and fit (``N + gather_lens <= M``).

    Returns:
        (indices, lens): `[Tq, width]` int32 with ``width = ceil((topk + window) / 128) * 128``; `[Tq]` int32.
    """
    check_index("topk_indices", topk_indices, ndim=2)
    Tq, Kw = topk_indices.shape
    dev, R = _check_batch(query_start_loc, seq_lens, None, Tq)
    check_index("gather_lens", gather_lens, ndim=1, device=dev, length=R)
    query_start_loc, seq_lens, gather_lens = _dense(query_start_loc, seq_lens, gather_lens)
    if topk_indices.device != dev:
        raise ValueError(f"topk_indices must be on {dev}; got {describe(topk_indices)}")
    if Kw > 1 and topk_indices.stride(1) != 1:
        raise ValueError(f"topk_indices rows must be contiguous; got strides {topk_indices.stride()}")
    for name, v, lo in (("window", window, 1), ("ratio", ratio, 1), ("topk", topk, 0), ("M", M, 0), ("N", N, 0)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}; got {v!r}")
    if R * M > INT32_LIMIT:  # (no sync: host ints) the int32 rows r*M + i of the workspace must not wrap
        raise ValueError(f"the workspace's R * M = {R} * {M} rows exceed the int32 indices' range")
    if topk > Kw:
        raise ValueError(f"topk {topk} exceeds topk_indices' width {Kw}; got {describe(topk_indices)}")
    width = triton.cdiv(topk + window, PREFILL_TOPK_ALIGN) * PREFILL_TOPK_ALIGN
    out_indices, out_lens = _outputs(Tq, width, dev, out_indices, out_lens)
    if validate and not capturing():
        qlen = _check_positions(query_start_loc, seq_lens, Tq)
        seq, g = seq_lens.long(), gather_lens.long()
        if int(g.min()) < 0 or int((seq - g).min()) < 0:
            raise ValueError("gather_lens must lie in [0, seq_lens]")
        need = torch.minimum(seq, qlen + window - 1)
        if int((g - need).min()) < 0:
            raise ValueError("gather_lens must cover each query's window: >= min(seq_len, qlen + window - 1)")
        if N + int(g.max()) > M:
            raise ValueError(f"N {N} + gather_lens up to {int(g.max())} exceeds M = {M} workspace rows")
    if Tq == 0:
        return out_indices[:0], out_lens[:0]
    w = out_indices.shape[1]
    _combine_topk_swa_fwd_kernel[(Tq,)](
        topk_indices, query_start_loc, seq_lens, gather_lens, out_indices, out_lens, topk_indices.stride(0),
        out_indices.stride(0), Kw, topk, ratio, window, M, N, w,
        BLOCK_K=min(triton.next_power_of_2(max(topk, 1)), 1024), BLOCK_W=min(triton.next_power_of_2(window), 256),
        **_grid_args(R),
    )  # fmt: skip
    return out_indices[:Tq], out_lens[:Tq]
