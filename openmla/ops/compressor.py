"""DeepSeek V4 KV compressor (SPEC §7.3): softmax-pooled windows of r tokens -> one compressed cache entry.

For ratio ``r`` and head dim ``d`` (512 for the attention cache, 128 for the indexer's), each token brings
projections ``kv [coff*d]`` and ``score [coff*d]`` (``score`` already holds the ``ape[pos % r]`` bias).
Entry ``i`` covers tokens ``[i*r, (i+1)*r)`` and is emitted by the step whose tokens include position
``(i+1)*r - 1``:
    rows: ``coff = 1``: the window's r tokens, all d dims; ``coff = 2`` (overlap, ratio 4 in V4): the previous
        window's r tokens with dims ``[0, d)`` then the window's own r tokens with dims ``[d, 2d)``; rows
        before position 0 are kv 0 / score -inf;
    ``c[ch] = sum_rows kv[row, ch] * softmax_rows(score[:, ch])`` (per channel), then
    ``c = RMSNorm(c) * norm_weight`` (eps given), then GPT-J RoPE on ``c[d-64:]`` at position ``i*r``;
    stored at compressed slot ``block_table[b, i // bs] * bs + i % bs`` of a cache with block size ``bs``.
All of it in fp32.

Decode state (CUDA-graph friendly, one fixed tensor): ``state [num_slots, 2, coff*r, coff*d]`` fp32;
``state[s, 0, p % (coff*r)]`` and ``state[s, 1, p % (coff*r)]`` hold the kv and score rows of position p
of the request owning slot s, for its last ``coff*r`` positions. A step reads rows before its first
token from there, rows inside the step from ``kv`` / ``score``, then (a second launch) stores its last
``coff*r`` tokens' rows. A request must bring every token through the compressor in order, in one or
many steps; a fresh request needs no reset (rows before position 0 are never read from the state).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from openmla.device import INTERPRET
from openmla.ops._bf16 import to_bf16
from openmla.ops._validate import (
    FLOAT16_DTYPES,
    capturing,
    check_index,
    check_no_overlap,
    check_positive_ints,
    check_tensor,
    describe,
)
from openmla.ops.cache import check_block_table
from openmla.ops.cache_v4 import V4_D, _block_stride, _check_v4_cache, store_v4_row
from openmla.ops.rope import load_cos_sin, rope_pairs
from openmla.ops.v4_indices import check_int32_slot_table

__all__ = ["allocate_compressor_state", "compress_kv"]

_FLOAT_DTYPES = FLOAT16_DTYPES + (torch.float32,)
BLOCK_ROWS = 16  # window rows pooled per loop iteration
NUM_WARPS = 8  # the pooling program holds several [BLOCK_ROWS, 512] fp32 tiles
ROPE_DIM = 64


def allocate_compressor_state(
    num_slots: int, ratio: int, head_dim: int, *, overlap: bool, device: torch.device | str | None = None
) -> torch.Tensor:
    """A zeroed compressor state ``[num_slots, 2, coff*ratio, coff*head_dim]`` fp32 (coff = 2 with overlap)."""
    from openmla.device import default_device

    check_positive_ints(("ratio", ratio), ("head_dim", head_dim))
    if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 0:
        raise ValueError(f"num_slots must be an int >= 0; got {num_slots!r}")
    coff = 2 if overlap else 1
    device = default_device() if device is None else torch.device(device)
    return torch.zeros(num_slots, 2, coff * ratio, coff * head_dim, dtype=torch.float32, device=device)


@triton.jit
def _find_request(query_start_loc, i_t, B: tl.constexpr, BLOCK_B: tl.constexpr):
    """The request owning flat token i_t (B when i_t is past query_start_loc[B]: a padding token)."""
    o_b = tl.arange(0, BLOCK_B)
    ends = tl.load(query_start_loc + 1 + o_b, mask=o_b < B, other=2147483647)
    return tl.sum((ends <= i_t).to(tl.int32))


@triton.jit
def _compress_kv_fwd_kernel(
    kv,  # [T, COFF*D]
    score,  # [T, COFF*D]
    state,  # [S, 2, COFF*RATIO, COFF*D] fp32
    query_start_loc,  # [B + 1]
    seq_lens,  # [B]
    state_slots,  # [B]
    block_table,  # [B, W]
    norm_weight,  # [D]
    cos_sin_cache,  # [P, 64]
    cache,  # MODE 1: fp8_v4 uint8; MODE 0: auto [num_blocks, block_size, D]; MODE 2: none
    cache_b16,  # fp8_v4: bf16 view
    entry_rows,  # [T, D] (HAS_ROWS): the entry a token emits, at its row
    entry_slots,  # [T] int32 (HAS_SLOTS): the compressed slot a token wrote, else -1
    stride_kv_t,
    stride_sc_t,
    stride_st_s,
    stride_st_k,
    stride_st_r,
    stride_bt_b,
    stride_bt_w,
    stride_cache_b,
    stride_cache_o,
    stride_cs,
    stride_er_t,
    num_state_slots,
    num_blocks,
    block_size,
    max_blocks,
    num_pos,
    eps,
    B: tl.constexpr,
    BLOCK_B: tl.constexpr,
    D: tl.constexpr,
    COFF: tl.constexpr,
    RATIO: tl.constexpr,
    BLOCK_R: tl.constexpr,
    MODE: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
):
    # One program per token; only a token that closes a window (pos + 1 = multiple of RATIO) works.
    i_t = tl.program_id(0)
    if HAS_SLOTS:
        tl.store(entry_slots + i_t, -1)  # overwritten below by a token that emits an entry
    i_b = _find_request(query_start_loc, i_t, B, BLOCK_B)
    if i_b >= B:
        return
    q0 = tl.load(query_start_loc + i_b)
    start_pos = tl.load(seq_lens + i_b) - (tl.load(query_start_loc + i_b + 1) - q0)
    pos = start_pos + (i_t - q0)
    if (i_t < q0) | (pos < 0) | ((pos + 1) % RATIO != 0):  # rows before query_start_loc[0] belong to no request
        return
    i_b = i_b.to(tl.int64)
    i_e = (pos + 1) // RATIO - 1  # the entry this token completes
    slot = tl.load(state_slots + i_b).to(tl.int64)
    m_slot = (slot >= 0) & (slot < num_state_slots)
    slot = tl.where(m_slot, slot, 0)
    row0 = (i_e + 1 - COFF) * RATIO  # position of the first pooled row

    o_d = tl.arange(0, D)
    b_m = tl.full((D,), float("-inf"), tl.float32)
    b_l = tl.zeros((D,), tl.float32)
    b_acc = tl.zeros((D,), tl.float32)
    for j0 in range(0, COFF * RATIO, BLOCK_R):
        o_j = j0 + tl.arange(0, BLOCK_R)
        p = row0 + o_j
        m_j = (o_j < COFF * RATIO) & (p >= 0)
        chan = (o_j // RATIO) * D  # overlap: previous window -> dims [0, D), own window -> [D, 2D)
        tok = (q0 + p - start_pos).to(tl.int64)
        # rows of this step come from the inputs (tok < 0 only from an unchecked negative query_start_loc[0])
        m_in = m_j & (p >= start_pos) & (tok >= 0)
        m_st = m_j & (p < start_pos) & m_slot  # earlier rows from the state ring
        ring = tl.where(p >= 0, p % (COFF * RATIO), 0).to(tl.int64)
        o_in = tl.where(m_in, tok, 0)[:, None]
        p_st = state + slot * stride_st_s + ring[:, None] * stride_st_r + chan[:, None] + o_d[None, :]
        b_kv = tl.load(kv + o_in * stride_kv_t + chan[:, None] + o_d[None, :], mask=m_in[:, None], other=0.0)
        b_kv = tl.where(m_st[:, None], tl.load(p_st, mask=m_st[:, None], other=0.0), b_kv.to(tl.float32))
        b_s = tl.load(score + o_in * stride_sc_t + chan[:, None] + o_d[None, :], mask=m_in[:, None], other=0.0)
        b_s = tl.where(m_st[:, None], tl.load(p_st + stride_st_k, mask=m_st[:, None], other=0.0), b_s.to(tl.float32))
        b_s = tl.where((m_in | m_st)[:, None], b_s, float("-inf"))
        # per-channel online softmax over the rows
        b_mn = tl.maximum(b_m, tl.max(b_s, axis=0))
        b_ms = tl.where(b_mn == float("-inf"), 0.0, b_mn)
        b_alpha = tl.exp(b_m - b_ms)
        b_p = tl.exp(b_s - b_ms[None, :])
        b_l = b_l * b_alpha + tl.sum(b_p, axis=0)
        b_acc = b_acc * b_alpha + tl.sum(b_p * b_kv, axis=0)
        b_m = b_mn
    b_c = tl.where(b_l > 0, b_acc / b_l, 0.0)

    b_w = tl.load(norm_weight + o_d).to(tl.float32)
    b_c = b_c / tl.sqrt(tl.sum(b_c * b_c, axis=0) / D + eps) * b_w
    e_pos = tl.full((1,), 0, tl.int64) + i_e * RATIO
    b_cos, b_sin = load_cos_sin(cos_sin_cache, e_pos, stride_cs, num_pos, 32, D, D - 64)
    b_c = tl.reshape(rope_pairs(tl.reshape(b_c, (1, D)), b_cos, b_sin, 1, D, False), (D,))

    i_blk = i_e // block_size
    m_blk = i_blk < max_blocks
    blk = tl.load(block_table + i_b * stride_bt_b + tl.where(m_blk, i_blk, 0) * stride_bt_w, mask=m_blk, other=-1)
    blk = blk.to(tl.int64)
    valid = (blk >= 0) & (blk < num_blocks)
    blk = tl.where(valid, blk, 0)
    off = i_e % block_size
    if HAS_SLOTS:
        tl.store(entry_slots + i_t, tl.where(valid, blk * block_size + off, -1).to(tl.int32))
    if HAS_ROWS:
        b_o = b_c
        if entry_rows.dtype.element_ty == tl.bfloat16:
            b_o = to_bf16(b_o, EXACT_ROUND)
        tl.store(entry_rows + i_t.to(tl.int64) * stride_er_t + o_d, b_o.to(entry_rows.dtype.element_ty))
    if MODE == 1:  # D == 512: rows 0..6 of the [8, 64] view are the nope groups, row 7 the rope dims
        b_n = tl.reshape(b_c, (8, 64))
        b_r = tl.sum(tl.where(tl.arange(0, 8)[:, None] == 7, b_n, 0.0), axis=0)
        store_v4_row(cache, cache_b16, blk * stride_cache_b, off, block_size, b_n, b_r, valid, EXACT_ROUND)
    elif MODE == 0:
        if cache.dtype.element_ty == tl.bfloat16:
            b_c = to_bf16(b_c, EXACT_ROUND)
        p_c = cache + blk * stride_cache_b + off * stride_cache_o + o_d
        tl.store(p_c, b_c.to(cache.dtype.element_ty), mask=valid)


@triton.jit
def _compressor_state_fwd_kernel(
    kv,  # [T, CD]
    score,  # [T, CD]
    state,  # [S, 2, RING, CD] fp32
    query_start_loc,
    seq_lens,
    state_slots,
    stride_kv_t,
    stride_sc_t,
    stride_st_s,
    stride_st_k,
    stride_st_r,
    num_state_slots,
    B: tl.constexpr,
    BLOCK_B: tl.constexpr,
    CD: tl.constexpr,
    RING: tl.constexpr,
):
    # Each of a request's last RING tokens of this step stores its rows at ring index pos % RING.
    i_t = tl.program_id(0)
    i_b = _find_request(query_start_loc, i_t, B, BLOCK_B)
    if i_b >= B:
        return
    q0 = tl.load(query_start_loc + i_b)
    q1 = tl.load(query_start_loc + i_b + 1)
    pos = tl.load(seq_lens + i_b) - (q1 - q0) + (i_t - q0)
    slot = tl.load(state_slots + i_b).to(tl.int64)
    if (i_t < q0) | (pos < 0) | (i_t < q1 - RING) | (slot < 0) | (slot >= num_state_slots):
        return
    o_c = tl.arange(0, CD)
    p_st = state + slot * stride_st_s + (pos % RING).to(tl.int64) * stride_st_r + o_c
    i_t = i_t.to(tl.int64)
    tl.store(p_st, tl.load(kv + i_t * stride_kv_t + o_c).to(tl.float32))
    tl.store(p_st + stride_st_k, tl.load(score + i_t * stride_sc_t + o_c).to(tl.float32))


def compress_kv(
    kv: torch.Tensor,
    score: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    norm_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor | None,
    block_table: torch.Tensor,
    *,
    ratio: int,
    eps: float = 1e-6,
    kv_cache_dtype: str = "fp8_v4",
    block_size: int | None = None,
    entry_rows: torch.Tensor | None = None,
    entry_slots: torch.Tensor | None = None,
    validate: bool = True,
) -> None:
    r"""Run one step of the V4 compressor: emit every entry whose window closes in this step, update the state.

    Token t of request b sits at ``pos = seq_lens[b] - qlen_b + (t - query_start_loc[b])``; a token with
    ``(pos + 1) % ratio == 0`` emits entry ``(pos + 1) // ratio - 1`` into ``kv_cache`` (module docstring).
    Entries come out bit-identical whether a request's tokens arrive in one prefill, in chunks or one by one.

    Args:
        kv (torch.Tensor): `[T, coff*d]`, bf16/fp16/fp32; per-token compressor kv projections
            (``coff = 2`` for the overlapping windows of ratio 4, else 1; d = norm_weight's length).
        score (torch.Tensor): `[T, coff*d]`, same dtypes; gate projections plus ``ape[pos % ratio]``.
        state (torch.Tensor): `[num_slots, 2, coff*ratio, coff*d]` fp32 (``allocate_compressor_state``).
        state_slots (torch.Tensor): `[B]`, int32/int64; each request's state slot (distinct per request).
        query_start_loc (torch.Tensor): `[B + 1]`, int32/int64; tokens past ``query_start_loc[B]`` are padding.
        seq_lens (torch.Tensor): `[B]`, int32/int64; context + new tokens per request.
        norm_weight (torch.Tensor): `[d]`, fp32 (bf16/fp16 read as fp32); the RMSNorm weight. d is a power
            of two >= 64 (512 main, 128 indexer).
        cos_sin_cache (torch.Tensor): `[P, 64]` fp32, V4's "compress" RoPE table (``[cos | sin]`` per position).
        kv_cache (torch.Tensor | None): the compressed cache: "fp8_v4" (d = 512) or "auto" ``[num_blocks, bs, d]``
            (bf16/fp16/fp32); None: write only ``entry_rows`` / ``entry_slots`` (e.g. to store the indexer's keys
            with ``concat_and_cache_indexer_k(entry_rows, cache, entry_slots, cache_dtype="fp8")``).
        block_table (torch.Tensor): `[B, max_blocks]`, int32/int64; the compressed cache's blocks per request.
        ratio (int): tokens per entry (4 CSA, 128 HCA; any >= 1).
        eps (float): RMSNorm epsilon (the model's ``rms_norm_eps``).
        kv_cache_dtype (str): "fp8_v4" or "auto" (ignored without a cache).
        block_size (int | None): the compressed cache's block size; required without a cache, else it must
            equal ``kv_cache.shape[1]``.
        entry_rows (torch.Tensor | None): `[>= T, d]` bf16/fp16/fp32: row t receives the (unquantised) entry
            token t emits; other rows are untouched.
        entry_slots (torch.Tensor | None): int32 `[>= T]`: the compressed slot token t's entry went to, -1 for
            tokens that emit none (every one of the first T is written).
        validate (bool): host-synchronising checks: ``seq_lens >= qlen``, distinct in-range state slots,
            the RoPE table and block table cover the emitted entries. Unchecked, entries through a missing
            block are dropped and nothing outside a tensor is read or written.
    """
    check_tensor("kv", kv, dtypes=_FLOAT_DTYPES, ndim=2)
    dev = kv.device
    T, cd = kv.shape
    check_tensor("score", score, dtypes=_FLOAT_DTYPES, shape=(T, cd), device=dev)
    check_tensor("norm_weight", norm_weight, dtypes=_FLOAT_DTYPES, ndim=1, device=dev)
    d = norm_weight.shape[0]
    if d < 64 or d & (d - 1):
        raise ValueError(f"norm_weight's length d must be a power of two >= 64; got {describe(norm_weight)}")
    if cd not in (d, 2 * d):
        raise ValueError(f"kv must be [T, d] or [T, 2*d] (overlap) with d = {d}; got {describe(kv)}")
    coff = cd // d
    check_positive_ints(("ratio", ratio))
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 <= eps < math.inf:
        raise ValueError(f"eps must be a finite float >= 0 (a negative one can make the RMSNorm NaN); got {eps!r}")
    ring = coff * ratio
    check_tensor("state", state, dtypes=(torch.float32,), shape=(None, 2, ring, cd), device=dev)
    check_no_overlap("state", state)  # written in place
    check_index("query_start_loc", query_start_loc, ndim=1, device=dev)
    B = query_start_loc.shape[0] - 1
    if B < 0:
        raise ValueError(f"query_start_loc must have B + 1 >= 1 entries; got {describe(query_start_loc)}")
    check_index("seq_lens", seq_lens, ndim=1, device=dev, length=B)
    check_index("state_slots", state_slots, ndim=1, device=dev, length=B)
    # 1-D index tensors are read densely (a strided one is copied)
    query_start_loc, seq_lens = query_start_loc.contiguous(), seq_lens.contiguous()
    state_slots = state_slots.contiguous()
    check_tensor("cos_sin_cache", cos_sin_cache, dtypes=_FLOAT_DTYPES, ndim=2, shape=(None, ROPE_DIM), device=dev)
    if kv_cache is None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size (a positive int) is required without a kv_cache; got {block_size!r}")
        if entry_rows is None and entry_slots is None:
            raise ValueError("compress_kv needs a kv_cache, entry_rows or entry_slots to write")
        cache, mode = kv, 2  # a placeholder pointer: nothing is stored to it
    else:
        cache, mode = _check_v4_cache(kv_cache, kv_cache_dtype, auto_width=d)
        if cache.device != dev:
            raise ValueError(f"kv_cache must be on {dev} like kv; got {describe(cache)}")
        if mode == 0:
            check_no_overlap("kv_cache", cache)  # (an fp8_v4 cache's strides are checked above)
        if mode == 1 and d != V4_D:
            raise ValueError(f"an fp8_v4 compressed cache holds d = {V4_D}; got d = {d} (use an auto cache)")
        if block_size is not None and block_size != cache.shape[1]:
            raise ValueError(f"block_size {block_size} differs from kv_cache's {cache.shape[1]}")
    if entry_rows is not None:
        check_tensor("entry_rows", entry_rows, dtypes=_FLOAT_DTYPES, ndim=2, device=dev)
        if entry_rows.shape[0] < T or entry_rows.shape[1] != d:
            raise ValueError(f"entry_rows must be [>= {T}, {d}]; got {describe(entry_rows)}")
        check_no_overlap("entry_rows", entry_rows)
    if entry_slots is not None:
        check_tensor("entry_slots", entry_slots, dtypes=(torch.int32,), ndim=1, device=dev)
        if entry_slots.shape[0] < T:
            raise ValueError(f"entry_slots must be int32 [>= {T}]; got {describe(entry_slots)}")
    check_index("block_table", block_table, ndim=2, device=dev)
    if block_table.shape[0] != B:
        raise ValueError(f"block_table must have B = {B} rows; got {describe(block_table)}")
    bs = cache.shape[1] if mode != 2 else block_size
    if validate and not capturing() and B > 0:
        qlen = (query_start_loc[1:] - query_start_loc[:-1]).long()
        seq = seq_lens.long()
        # a negative start would pool rows before kv's first one
        if int(query_start_loc[0]) < 0 or int(qlen.min()) < 0 or int(query_start_loc[-1]) > T:
            raise ValueError(f"query_start_loc must start at >= 0, be non-decreasing and end at most at T = {T}")
        if int((seq - qlen).min()) < 0:
            raise ValueError("seq_lens must be >= each request's query length")
        live = state_slots[qlen > 0].long()
        if live.numel():
            if int(live.min()) < 0 or int(live.max()) >= state.shape[0]:
                raise ValueError(f"state_slots must lie in [0, {state.shape[0]}) for requests with tokens")
            if live.unique().numel() != live.numel():
                raise ValueError("state_slots must be distinct for the requests of one step")
        first = (seq - qlen) // ratio
        n_new = seq // ratio - first
        if int(n_new.max()) > 0:
            top = int((seq // ratio)[n_new > 0].max()) - 1
            if top * ratio >= cos_sin_cache.shape[0]:
                raise ValueError(f"entry {top} needs RoPE position {top * ratio}; cos_sin_cache has "
                                 f"{cos_sin_cache.shape[0]} positions")  # fmt: skip
            if mode != 2:
                check_block_table(block_table, n_new, first, bs, cache.shape[0])
            else:  # no cache: the entry_slots written must still fit int32
                check_int32_slot_table(block_table, n_new, first, bs)
    if B == 0 and entry_slots is not None:
        entry_slots[:T].fill_(-1)
    if T == 0 or B == 0:
        return
    c16 = cache.view(torch.bfloat16) if mode == 1 else cache
    stride_b = _block_stride(cache) if mode == 1 else cache.stride(0) if mode == 0 else 0
    BLOCK_B = triton.next_power_of_2(B)
    _compress_kv_fwd_kernel[(T,)](
        kv, score, state, query_start_loc, seq_lens, state_slots, block_table, norm_weight, cos_sin_cache,
        cache, c16, entry_rows if entry_rows is not None else kv, entry_slots if entry_slots is not None else seq_lens,
        kv.stride(0), score.stride(0), state.stride(0), state.stride(1), state.stride(2),
        block_table.stride(0), block_table.stride(1), stride_b, cache.stride(1) if mode != 2 else 0,
        cos_sin_cache.stride(0), entry_rows.stride(0) if entry_rows is not None else 0,
        state.shape[0], cache.shape[0] if mode != 2 else 2**62, bs, block_table.shape[1], cos_sin_cache.shape[0],
        float(eps), B=B, BLOCK_B=BLOCK_B, D=d, COFF=coff, RATIO=ratio,
        BLOCK_R=min(BLOCK_ROWS, triton.next_power_of_2(ring)), MODE=mode, HAS_ROWS=entry_rows is not None,
        HAS_SLOTS=entry_slots is not None, EXACT_ROUND=INTERPRET, num_warps=NUM_WARPS,
    )  # fmt: skip
    # after the pooling above read the rows of earlier steps: store this step's last rows
    _compressor_state_fwd_kernel[(T,)](
        kv, score, state, query_start_loc, seq_lens, state_slots, kv.stride(0), score.stride(0),
        state.stride(0), state.stride(1), state.stride(2), state.shape[0],
        B=B, BLOCK_B=BLOCK_B, CD=cd, RING=ring,
    )  # fmt: skip
