"""Dense paged MLA decode (absorbed MQA form): split-KV Triton kernel, LSE reduce, speculative verify.

Every cache row is K (``d_qk`` = 576 = 512 latent + 64 rope) and its first ``d_v`` = 512 values are V.
One program owns (one KV split of one request, a block of heads x query rows): it streams the split's
KV tiles once, uses each tile as K and V, keeps the online-softmax state in registers and writes
either the final output (a request with one split) or a normalised fp32 partial + LSE, which the
reduce kernel merges. The split schedule comes from :func:`openmla.plan_decode`.
"""

from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from openmla.device import INTERPRET, compute_dtype
from openmla.ops._validate import (
    FLOAT16_DTYPES,
    capturing,
    check_index,
    check_no_overlap,
    check_scale_value,
    check_tensor,
    describe,
    kernel_backend,
    scalar_scale,
)
from openmla.ops.cache import check_block_table
from openmla.ops.gluon.decode import VARIANTS as GLUON_VARIANTS
from openmla.ops.gluon.decode import (
    gluon_decode_supported,
    mla_decode_split_gluon,
)
from openmla.ops.gluon.decode_narrow import NARROW_MAX_ROWS
from openmla.ops.plan import DecodePlan, gluon_readers, pair_wanted, plan_decode

__all__ = ["mla_decode"]

_LOG2E = 1.4426950408889634
# "auto" runs the Gluon kernel on a bf16 cache for tiles of at least this many rows (heads x qlen), and for 16-row
# tiles from this batch size; measured on the H200 against the portable kernel: h16 b128 s8k 288 us vs 298, ragged
# s8k~4k 342 vs 353; b32 s4k 57.2 vs 55.2, b8 21.3 vs 20.9, b1 s32k 23.0 vs 21.9
_GLUON_AUTO_MIN_ROWS = 32
_GLUON_16ROW_MIN_BATCH = 64
# reduce programs per SM (4 warps each; they loop over the merge tasks)
_REDUCE_PROGRAMS_PER_SM = 8
# partial elements (splits x columns) a reduce program loads per step of its split loop (the partials load with
# the LSEs, so a step is one memory round trip). The one-head path keeps one [splits, columns] tensor per step
# (16384: 32 splits of a whole row, 254 registers and no spill on sm90), the head-block path three (lse, weights,
# o), so it takes a smaller tile (at 8192 it spills).
_REDUCE_TILE_ONE_HEAD = 16384
_REDUCE_TILE = 2048
_REDUCE_MAX_BLOCK_S = 64  # splits per step at most
_LN2 = 0.6931471805599453


@triton.jit
def _decode_tile(
    q0,
    q1,
    q2,
    q3,
    q_r,
    k0,
    k1,
    k2,
    k3,
    k_r,
    b_m,
    b_l,
    a0,
    a1,
    a2,
    a3,
    scale_log2,
    m_s,
    COMPUTE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One KV tile of the online softmax. The latent is handled as four column chunks (q0..q3, k0..k3,
    accumulators a0..a3): each chunk is a separate MMA operand, so no operand spans all 512 columns
    at once (with mma.sync Triton holds a whole operand in registers). K = latent + rope, V = latent."""
    b_s = tl.dot(q0, tl.trans(k0), input_precision=DOT_PRECISION)
    b_s = tl.dot(q1, tl.trans(k1), b_s, input_precision=DOT_PRECISION)
    b_s = tl.dot(q2, tl.trans(k2), b_s, input_precision=DOT_PRECISION)
    b_s = tl.dot(q3, tl.trans(k3), b_s, input_precision=DOT_PRECISION)
    b_s = tl.dot(q_r, tl.trans(k_r), b_s, input_precision=DOT_PRECISION)  # [M, N]
    b_s = tl.where(m_s, b_s * scale_log2, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
    b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    b_alpha = tl.exp2(b_m - b_m_use)
    b_p = tl.exp2(b_s - b_m_use[:, None])
    b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
    b_p = b_p.to(COMPUTE)
    a0 = tl.dot(b_p, k0, a0 * b_alpha[:, None], input_precision=DOT_PRECISION)
    a1 = tl.dot(b_p, k1, a1 * b_alpha[:, None], input_precision=DOT_PRECISION)
    a2 = tl.dot(b_p, k2, a2 * b_alpha[:, None], input_precision=DOT_PRECISION)
    a3 = tl.dot(b_p, k3, a3 * b_alpha[:, None], input_precision=DOT_PRECISION)
    return b_m_new, b_l, a0, a1, a2, a3


@triton.jit
def _load_rows(p_kv, m_n, o_c, DC: tl.constexpr, D_V: tl.constexpr, o_r, D_R: tl.constexpr, COMPUTE: tl.constexpr):
    """A tile's rows through pointers: four latent chunks [N, DC] and the rope [N, D_RP]; zeros where masked.
    Small widths are padded (a dot needs K >= 16): columns past D_V and rope columns past D_R read as 0."""
    if 4 * DC == D_V:
        m0 = m_n[:, None]
        m1 = m_n[:, None]
        m2 = m_n[:, None]
        m3 = m_n[:, None]
    else:
        m0 = m_n[:, None] & (o_c[None, :] < D_V)
        m1 = m_n[:, None] & (o_c[None, :] + DC < D_V)
        m2 = m_n[:, None] & (o_c[None, :] + 2 * DC < D_V)
        m3 = m_n[:, None] & (o_c[None, :] + 3 * DC < D_V)
    k0 = tl.load(p_kv[:, None] + o_c[None, :], mask=m0, other=0.0).to(COMPUTE)
    k1 = tl.load(p_kv[:, None] + DC + o_c[None, :], mask=m1, other=0.0).to(COMPUTE)
    k2 = tl.load(p_kv[:, None] + 2 * DC + o_c[None, :], mask=m2, other=0.0).to(COMPUTE)
    k3 = tl.load(p_kv[:, None] + 3 * DC + o_c[None, :], mask=m3, other=0.0).to(COMPUTE)
    if o_r.shape[0] == D_R:
        m_r = m_n[:, None]
    else:
        m_r = m_n[:, None] & (o_r[None, :] < D_R)
    k_r = tl.load(p_kv[:, None] + D_V + o_r[None, :], mask=m_r, other=0.0).to(COMPUTE)
    return k0, k1, k2, k3, k_r


@triton.jit
def _row_count(query_start_loc, i_b, num_tokens, MAX_QLEN: tl.constexpr):
    """Request ``i_b``'s first query row and how many of its rows a program touches: those inside ``[0, num_tokens)``,
    at most the plan's ``MAX_QLEN``, none when it starts below 0 (the query length for a checked batch; the Gluon
    kernels' ``_row_count`` is the same rule)."""
    q_start = tl.load(query_start_loc + i_b)
    n = tl.minimum(tl.minimum(tl.load(query_start_loc + i_b + 1), num_tokens) - q_start, MAX_QLEN)
    n = tl.where(q_start < 0, 0, tl.maximum(n, 0))
    return q_start, n


@triton.jit
def _store_rows(p_row, o0, o1, o2, o3, m_m, o_c, DC: tl.constexpr, D_V: tl.constexpr):
    """Store four [M, DC] column chunks to rows starting at p_row [M] (in the destination's dtype); padded
    columns (past D_V) are not stored."""
    dtype = p_row.dtype.element_ty
    if 4 * DC == D_V:
        tl.store(p_row[:, None] + o_c[None, :], o0.to(dtype), mask=m_m[:, None])
        tl.store(p_row[:, None] + DC + o_c[None, :], o1.to(dtype), mask=m_m[:, None])
        tl.store(p_row[:, None] + 2 * DC + o_c[None, :], o2.to(dtype), mask=m_m[:, None])
        tl.store(p_row[:, None] + 3 * DC + o_c[None, :], o3.to(dtype), mask=m_m[:, None])
    else:
        tl.store(p_row[:, None] + o_c[None, :], o0.to(dtype), mask=m_m[:, None] & (o_c[None, :] < D_V))
        tl.store(p_row[:, None] + DC + o_c[None, :], o1.to(dtype), mask=m_m[:, None] & (o_c[None, :] + DC < D_V))
        tl.store(p_row[:, None] + 2 * DC + o_c[None, :], o2.to(dtype),
                 mask=m_m[:, None] & (o_c[None, :] + 2 * DC < D_V))  # fmt: skip
        tl.store(p_row[:, None] + 3 * DC + o_c[None, :], o3.to(dtype),
                 mask=m_m[:, None] & (o_c[None, :] + 3 * DC < D_V))  # fmt: skip


@triton.jit
def _mla_decode_fwd_kernel(
    q,  # [T, H, D_V + D_R]
    kv_cache,  # [num_blocks, PAGE, D_V + D_R]
    kc_desc,  # TMA descriptor over kv_cache as [num_blocks * PAGE, D_V + D_R], box [BLOCK_N, D_V / 4] (USE_TMA)
    kr_desc,  # the same rows from column D_V, box [BLOCK_N, D_R] (USE_TMA)
    block_table,  # [B, W]
    seq_lens,  # [B]
    query_start_loc,  # [B + 1]
    work_req,  # [capacity]
    work_split,  # [capacity]
    num_splits,  # [B]
    split_len,  # [B]
    out,  # [T, H, D_V]
    lse,  # [T, H]
    o_part,  # [capacity, MAX_QLEN, H, D_V] fp32
    lse_part,  # [capacity, MAX_QLEN, H] fp32
    scale_log2,  # sm_scale * q_scale * kv_scale * log2(e)
    v_scale,  # kv_scale (fp8 cache), 1.0 otherwise
    stride_q_t,
    stride_q_h,
    stride_kv_b,
    stride_kv_p,
    stride_bt_b,
    stride_o_t,
    stride_o_h,
    H,
    num_blocks,
    max_blocks,
    num_tokens,  # T: rows outside [0, T), and requests starting below 0, are never touched (_row_count)
    PAGE: tl.constexpr,
    MAX_QLEN: tl.constexpr,
    D_V: tl.constexpr,
    D_R: tl.constexpr,
    DC: tl.constexpr,  # latent chunk width: D_V / 4, at least 16 (padded columns masked)
    D_RP: tl.constexpr,  # rope width padded to a power of two >= 16
    BLOCK_H: tl.constexpr,
    Q_PER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_ALIGNED: tl.constexpr,
    USE_TMA: tl.constexpr,
    MAX_PAGES: tl.constexpr,
    CAUSAL: tl.constexpr,
    COMPUTE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_H * Q_PER
    i_w = tl.program_id(0)
    i_h = tl.program_id(1)
    i_q = tl.program_id(2)
    i_b = tl.load(work_req + i_w)
    if i_b < 0:
        return
    i_b = i_b.to(tl.int64)
    q_start, qlen = _row_count(query_start_loc, i_b, num_tokens, MAX_QLEN)
    if i_q * Q_PER >= qlen:
        return
    L = tl.load(seq_lens + i_b)
    i_s = tl.load(work_split + i_w)
    n_split = tl.load(num_splits + i_b)
    chunk = tl.load(split_len + i_b)
    kv_lo = i_s * chunk
    kv_hi = tl.minimum(L, kv_lo + chunk)

    # rows: Q_PER query tokens x BLOCK_H heads
    o_m = tl.arange(0, BLOCK_M)
    o_t = i_q * Q_PER + o_m // BLOCK_H  # token within the request
    o_h = i_h * BLOCK_H + o_m % BLOCK_H
    m_m = (o_t < qlen) & (o_h < H)
    if CAUSAL:
        limit = L - qlen + o_t + 1  # keys [0, limit) are visible to each row
        kv_hi = tl.minimum(kv_hi, L - qlen + tl.minimum(i_q * Q_PER + Q_PER, qlen))
    else:
        limit = L + tl.zeros([BLOCK_M], dtype=tl.int32)

    o_c = tl.arange(0, DC)
    o_r = tl.arange(0, D_RP)
    p_q = q + (q_start + o_t).to(tl.int64) * stride_q_t + o_h * stride_q_h  # [M]
    q0, q1, q2, q3, q_r = _load_rows(p_q, m_m, o_c, DC, D_V, o_r, D_R, COMPUTE)

    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    a0 = tl.zeros([BLOCK_M, DC], dtype=tl.float32)
    a1 = tl.zeros([BLOCK_M, DC], dtype=tl.float32)
    a2 = tl.zeros([BLOCK_M, DC], dtype=tl.float32)
    a3 = tl.zeros([BLOCK_M, DC], dtype=tl.float32)
    p_bt = block_table + i_b * stride_bt_b
    if PAGE_ALIGNED:
        # split lengths are multiples of BLOCK_N and BLOCK_N divides PAGE, so no tile crosses a page: one
        # block number per tile; the split's block numbers are loaded before the KV loop (with the
        # block-table load inside the loop the pipeliner kept a single KV buffer)
        o_pg = tl.arange(0, MAX_PAGES)
        i_pg0 = kv_lo // PAGE
        b_pages = tl.load(p_bt + i_pg0 + o_pg, mask=(i_pg0 + o_pg < max_blocks) & ((i_pg0 + o_pg) * PAGE < kv_hi),
                          other=-1).to(tl.int64)  # fmt: skip
    if USE_TMA:
        # tiles that every row sees whole: straight from TMA into shared memory, no masks, no address
        # registers; the causal diagonal and a partial last tile take the masked pointer loop below
        full_hi = kv_hi
        if CAUSAL:
            full_hi = tl.minimum(kv_hi, L - qlen + i_q * Q_PER + 1)
        n_tail = kv_lo + tl.maximum(full_hi - kv_lo, 0) // BLOCK_N * BLOCK_N
        for n0 in range(kv_lo, n_tail, BLOCK_N):
            blk = tl.sum(tl.where(o_pg == n0 // PAGE - i_pg0, b_pages, 0))
            ok = (blk >= 0) & (blk < num_blocks)
            # an invalid block number points past the cache: TMA reads zeros there, never out of bounds
            row = tl.where(ok, blk * PAGE + n0 % PAGE, num_blocks * PAGE).to(tl.int32)
            k0 = kc_desc.load([row, 0]).to(COMPUTE)  # [N, DC]
            k1 = kc_desc.load([row, DC]).to(COMPUTE)
            k2 = kc_desc.load([row, 2 * DC]).to(COMPUTE)
            k3 = kc_desc.load([row, 3 * DC]).to(COMPUTE)
            k_r = kr_desc.load([row, 0]).to(COMPUTE)  # [N, D_R]
            b_m, b_l, a0, a1, a2, a3 = _decode_tile(
                q0,
                q1,
                q2,
                q3,
                q_r,
                k0,
                k1,
                k2,
                k3,
                k_r,
                b_m,
                b_l,
                a0,
                a1,
                a2,
                a3,
                scale_log2,
                ok,
                COMPUTE,
                DOT_PRECISION,
            )
    else:
        n_tail = kv_lo
    for n0 in range(n_tail, kv_hi, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_n = o_n < kv_hi
        if PAGE_ALIGNED:
            blk = tl.sum(tl.where(o_pg == n0 // PAGE - i_pg0, b_pages, 0))  # splits need not start on a page
            m_n = m_n & (blk >= 0) & (blk < num_blocks)
            p_kv = kv_cache + blk * stride_kv_b + (o_n % PAGE) * stride_kv_p
        else:
            i_blk = o_n // PAGE
            blk = tl.load(p_bt + i_blk, mask=m_n & (i_blk < max_blocks), other=-1).to(tl.int64)
            m_n = m_n & (blk >= 0) & (blk < num_blocks)
            p_kv = kv_cache + tl.where(m_n, blk * stride_kv_b + (o_n % PAGE) * stride_kv_p, 0)
        k0, k1, k2, k3, k_r = _load_rows(p_kv, m_n, o_c, DC, D_V, o_r, D_R, COMPUTE)
        m_s = m_n[None, :] & (o_n[None, :] < limit[:, None])
        b_m, b_l, a0, a1, a2, a3 = _decode_tile(
            q0, q1, q2, q3, q_r, k0, k1, k2, k3, k_r, b_m, b_l, a0, a1, a2, a3, scale_log2, m_s, COMPUTE, DOT_PRECISION
        )

    empty = b_l == 0.0
    b_r = tl.where(empty, 0.0, v_scale / tl.where(empty, 1.0, b_l))[:, None]
    b_lse = tl.where(empty, float("-inf"), (b_m + tl.log2(tl.where(empty, 1.0, b_l))) * 0.6931471805599453)
    if n_split == 1:
        row = (q_start + o_t).to(tl.int64)
        tl.store(lse + row * H + o_h, b_lse, mask=m_m)
        _store_rows(out + row * stride_o_t + o_h * stride_o_h, a0 * b_r, a1 * b_r, a2 * b_r, a3 * b_r, m_m, o_c, DC,
                    D_V)  # fmt: skip
    else:
        part = (i_w.to(tl.int64) * MAX_QLEN + o_t) * H + o_h  # [M]
        tl.store(lse_part + part, b_lse, mask=m_m)
        _store_rows(o_part + part * D_V, a0 * b_r, a1 * b_r, a2 * b_r, a3 * b_r, m_m, o_c, DC, D_V)


@triton.jit
def _mla_decode_reduce_kernel(
    query_start_loc,  # [B + 1]
    merge_info,  # [B, 3]: (request, first work item, splits) of each merged request
    num_merge,  # [1]
    o_part,  # [capacity, MAX_QLEN, H, D_V] fp32
    lse_part,  # [capacity, MAX_QLEN, H] fp32
    out,  # [T, H, D_V]
    lse,  # [T, H]
    stride_o_t,
    stride_o_h,
    H,
    num_tokens,  # T (the rows of _row_count only)
    capacity,  # work items of the plan (partials past them are never read)
    MAX_QLEN: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_HB: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # A fixed grid of programs walks the tasks of the requests that have more than one split; a task is
    # one query row of one such request, BLOCK_HB heads x BLOCK_D columns. Requests with one split cost
    # nothing here.
    N_D: tl.constexpr = D_V // BLOCK_D
    n_hb = tl.cdiv(H, BLOCK_HB)
    per_row = n_hb * N_D
    per_req = MAX_QLEN * per_row
    n_tasks = tl.load(num_merge) * per_req
    for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        p_info = merge_info + (task // per_req).to(tl.int64) * 3
        rest = task % per_req
        i_t = rest // per_row
        i_hb = (rest % per_row) // N_D
        i_d = rest % N_D
        i_b = tl.load(p_info).to(tl.int64)
        w0 = tl.load(p_info + 1).to(tl.int64)
        n_split = tl.minimum(tl.load(p_info + 2), capacity - w0)
        # the partials' loads wait only on that row; the rows' bounds (_row_count, from the call's query_start_loc)
        # load beside them and mask the stores
        q_start, qlen = _row_count(query_start_loc, i_b, num_tokens, MAX_QLEN)
        row = (q_start + i_t).to(tl.int64)
        ok = i_t < qlen
        if BLOCK_HB == 1:  # one head: its LSEs as a vector over the splits (no per-column copies)
            _merge_one_head(o_part, lse_part, out, lse, row, ok, w0, n_split, i_t, i_hb, i_d, H, stride_o_t,
                            stride_o_h, MAX_QLEN, D_V, BLOCK_S, BLOCK_D)  # fmt: skip
        else:
            _merge_head_block(o_part, lse_part, out, lse, row, ok, w0, n_split, i_t, i_hb, i_d, H, stride_o_t,
                              stride_o_h, MAX_QLEN, D_V, BLOCK_S, BLOCK_HB, BLOCK_D)  # fmt: skip


@triton.jit
def _merge_finish(b_m, b_den, b_acc):
    """Merged output (``b_acc / b_den``) and natural-log LSE from the running max, denominator and weighted sum
    of an LSE merge; a row with no key (``b_den == 0``) gets 0 and -inf."""
    empty = b_den == 0.0
    b_out = tl.where(empty, 0.0, b_acc / tl.where(empty, 1.0, b_den))
    b_m_fin = tl.where(b_m == float("-inf"), 0.0, b_m)
    b_lse = tl.where(empty, float("-inf"), b_m_fin + tl.log(tl.where(empty, 1.0, b_den)))
    return b_out, b_lse


@triton.jit
def _merge_one_head(o_part, lse_part, out, lse, row, ok, w0, n_split, i_t, i_h, i_d, H, stride_o_t, stride_o_h,
                    MAX_QLEN: tl.constexpr, D_V: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK_D: tl.constexpr):  # fmt: skip
    """LSE merge of one (query row, head, BLOCK_D columns) over the request's splits (stored where ``ok``)."""
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    b_m = tl.full([], float("-inf"), dtype=tl.float32)
    b_den = tl.zeros([], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, n_split, BLOCK_S):
        o_s = s0 + tl.arange(0, BLOCK_S)
        m_s = o_s < n_split
        part = ((w0 + o_s) * MAX_QLEN + i_t) * H + i_h  # [BLOCK_S]
        b_l = tl.load(lse_part + part, mask=m_s, other=float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_l, axis=0))
        b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = tl.exp(b_m - b_m_use)
        b_w = tl.exp(b_l - b_m_use)
        # the partials load with the LSEs (its mask does not wait for them); a split without keys (weight 0) may
        # hold anything, so it is zeroed after the load
        b_o = tl.load(o_part + part[:, None] * D_V + o_d[None, :], mask=m_s[:, None], other=0.0)
        b_o = tl.where((b_w > 0)[:, None], b_o, 0.0)
        b_acc = b_acc * b_alpha + tl.sum(b_w[:, None] * b_o, axis=0)
        b_den = b_den * b_alpha + tl.sum(b_w, axis=0)
        b_m = b_m_new
    b_out, b_lse = _merge_finish(b_m, b_den, b_acc)
    tl.store(out + row * stride_o_t + i_h * stride_o_h + o_d, b_out.to(out.dtype.element_ty), mask=ok)
    if i_d == 0:
        tl.store(lse + row * H + i_h, b_lse, mask=ok)


@triton.jit
def _merge_head_block(o_part, lse_part, out, lse, row, ok, w0, n_split, i_t, i_hb, i_d, H, stride_o_t, stride_o_h,
                      MAX_QLEN: tl.constexpr, D_V: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_HB: tl.constexpr,
                      BLOCK_D: tl.constexpr):  # fmt: skip
    """LSE merge of one (query row, BLOCK_HB heads x BLOCK_D columns) over the request's splits (stored where
    ``ok``); the tile is flattened and every reduction runs over the splits, per column (heads past H are
    masked)."""
    HBD: tl.constexpr = BLOCK_HB * BLOCK_D
    o_x = tl.arange(0, HBD)
    o_h = i_hb * BLOCK_HB + o_x // BLOCK_D
    o_d = i_d * BLOCK_D + o_x % BLOCK_D
    m_x = o_h < H
    b_m = tl.full([HBD], float("-inf"), dtype=tl.float32)
    b_den = tl.zeros([HBD], dtype=tl.float32)
    b_acc = tl.zeros([HBD], dtype=tl.float32)
    for s0 in range(0, n_split, BLOCK_S):
        o_s = s0 + tl.arange(0, BLOCK_S)
        part = ((w0 + o_s[:, None]) * MAX_QLEN + i_t) * H + o_h[None, :]  # [BLOCK_S, HBD]
        m_p = (o_s < n_split)[:, None] & m_x[None, :]
        b_l = tl.load(lse_part + part, mask=m_p, other=float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_l, axis=0))
        b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = tl.exp(b_m - b_m_use)
        b_w = tl.exp(b_l - b_m_use[None, :])
        b_o = tl.where(b_w > 0, tl.load(o_part + part * D_V + o_d[None, :], mask=m_p, other=0.0), 0.0)  # (as above)
        b_acc = b_acc * b_alpha + tl.sum(b_w * b_o, axis=0)
        b_den = b_den * b_alpha + tl.sum(b_w, axis=0)
        b_m = b_m_new
    b_out, b_lse = _merge_finish(b_m, b_den, b_acc)
    tl.store(out + row * stride_o_t + o_h * stride_o_h + o_d, b_out.to(out.dtype.element_ty), mask=m_x & ok)
    tl.store(lse + row * H + o_h, b_lse, mask=m_x & (o_d == 0) & ok)


def _reduce_tiling(plan: DecodePlan, H: int, d_v: int) -> tuple[int, int, int, int]:
    """``(programs, BLOCK_HB, BLOCK_D, BLOCK_S)`` of the reduce. A task is one head's whole row by default (on the
    H200 at h128 b8 s4k 4.2 us against 8.1 for two 256-column tasks a row); narrower when the batch has too few rows
    to give a quarter of the programs a task (one long request), several heads when it has so many that each
    program would chain more than 8 of them."""
    programs = _REDUCE_PROGRAMS_PER_SM * plan.num_sms
    rows = plan.batch_size * plan.max_query_len * H  # one-head whole-row tasks when every request is merged
    block_d = d_v
    while block_d > min(128, d_v) and rows * (d_v // block_d) < programs // 4:
        block_d //= 2
    block_hb = 1
    while block_hb < min(16, triton.next_power_of_2(H)) and rows // (2 * block_hb) >= 8 * programs:
        block_hb *= 2
    hbd = block_hb * block_d
    tile = _REDUCE_TILE_ONE_HEAD if block_hb == 1 else _REDUCE_TILE
    # no wider than a request's share of the plan's work items nor its most splits (masked split rows still cost
    # registers and issue slots)
    share = triton.next_power_of_2(triton.cdiv(plan.capacity, max(1, plan.batch_size)))
    if plan.max_splits:
        share = min(share, triton.next_power_of_2(plan.max_splits))
    block_s = max(2, min(_REDUCE_MAX_BLOCK_S, tile // hbd, share))
    tasks = plan.batch_size * plan.max_query_len * triton.cdiv(H, block_hb) * (d_v // block_d)
    return max(1, min(tasks, programs)), block_hb, block_d, block_s


def _mla_decode_split(
    q,
    kv_cache,
    block_table,
    seq_lens,
    query_start_loc,
    plan: DecodePlan,
    out,
    lse,
    scale_log2: float,
    v_scale: float,
    causal: bool,
    d_v: int,
    compute,
):
    """Launch the split-KV kernel: final rows for single-split requests, partials for the others."""
    H = q.shape[1]
    t = plan.tiling
    page = kv_cache.shape[1]
    grid = (plan.capacity, triton.cdiv(H, t.block_h), triton.cdiv(plan.max_query_len, t.q_per))
    # fp32 caches (tests, the CPU engine) take half-length tiles: the same ring would not fit shared memory
    block_n = t.block_n // 2 if kv_cache.element_size() == 4 and not INTERPRET else t.block_n
    page_aligned = page % block_n == 0
    d_r = q.shape[2] - d_v
    dc, d_rp = max(d_v // 4, 16), max(triton.next_power_of_2(d_r), 16)  # a dot's K is at least 16 on the GPU
    kc_desc = kr_desc = None
    # TMA tiles for fp8 caches on sm90+ (1.26x faster there; a bf16 cache is faster through pointers)
    tma_ok = (
        not torch.cuda.is_available()
        or kv_cache.device.type != "cuda"
        or torch.cuda.get_device_capability(kv_cache.device) >= (9, 0)
    )
    want_tma = t.tma or (kv_cache.dtype == torch.float8_e4m3fn and kv_cache.device.type == "cuda")
    use_tma = (
        want_tma
        and tma_ok
        and page_aligned
        and kv_cache.stride(0) == page * kv_cache.stride(1)
        and 4 * dc == d_v
        and d_rp == d_r
    )  # TMA boxes are the unpadded chunks
    if use_tma:  # the cache as rows [num_blocks * page, d_qk]; TMA zero-fills rows outside it
        rows = kv_cache.shape[0] * page
        kc_desc = TensorDescriptor(kv_cache, [rows, d_v], [kv_cache.stride(1), 1], [block_n, d_v // 4])
        kr_desc = TensorDescriptor(kv_cache[:, :, d_v:], [rows, q.shape[2] - d_v], [kv_cache.stride(1), 1],
                                   [block_n, q.shape[2] - d_v])  # fmt: skip
    _mla_decode_fwd_kernel[grid](
        q, kv_cache, kc_desc, kr_desc, block_table, seq_lens, query_start_loc, plan.work_req, plan.work_split,
        plan.num_splits, plan.split_len, out, lse, plan.o_part, plan.lse_part, scale_log2, v_scale,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
        out.stride(0), out.stride(1), H, kv_cache.shape[0], block_table.shape[1], q.shape[0],
        PAGE=page, MAX_QLEN=plan.max_query_len, D_V=d_v, D_R=d_r, DC=dc, D_RP=d_rp,
        BLOCK_H=t.block_h, Q_PER=t.q_per, BLOCK_N=block_n, PAGE_ALIGNED=page_aligned, USE_TMA=use_tma,
        MAX_PAGES=triton.next_power_of_2(t.max_split // page + 1), CAUSAL=causal, COMPUTE=compute,
        DOT_PRECISION="ieee" if compute == tl.float32 else "tf32", num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip


def _mla_decode_reduce(query_start_loc, plan: DecodePlan, out, lse, d_v: int):
    """Launch the LSE merge of the partials of multi-split requests."""
    H = out.shape[1]
    programs, block_hb, block_d, block_s = _reduce_tiling(plan, H, d_v)
    _mla_decode_reduce_kernel[(programs,)](
        query_start_loc, plan.merge_info, plan.num_merge, plan.o_part, plan.lse_part, out, lse, out.stride(0),
        out.stride(1), H, out.shape[0], plan.capacity, MAX_QLEN=plan.max_query_len, D_V=d_v,
        BLOCK_S=block_s, BLOCK_HB=block_hb, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip


def _use_gluon(backend: str | None, q, kv_cache, plan: DecodePlan, kv_cache_dtype: str) -> bool:
    """Whether this call runs the Hopper (Gluon) split kernel."""
    backend = kernel_backend(backend, "OPENMLA_DECODE_BACKEND")
    if backend == "triton":
        return False
    ok = gluon_decode_supported(q, kv_cache, plan, kv_cache_dtype)
    if backend == "gluon":
        if not ok:
            raise ValueError(
                "backend='gluon' needs an sm90 GPU with triton.experimental.gluon, bf16 q, a bf16 cache "
                "(kv_cache_dtype='auto') or a float8_e4m3fn cache (kv_cache_dtype='fp8'), d_qk 576, a page size "
                f"that is a multiple of 32; got q {describe(q)}, "
                f"kv_cache {describe(kv_cache)}, kv_cache_dtype {kv_cache_dtype!r}"
            )
        return True
    return ok and _gluon_auto(kv_cache_dtype, plan.tiling.block_m, plan.batch_size)


def _gluon_auto(kv_cache_dtype: str, rows: int, batch_size: int) -> bool:
    """Whether "auto" takes the Gluon kernel where it applies: bf16 from _GLUON_AUTO_MIN_ROWS rows a tile, 16-row
    tiles from _GLUON_16ROW_MIN_BATCH requests; fp8 always (the portable kernel widens e4m3 in registers and spills;
    the Gluon kernel widens in shared memory: 1.9x faster at h128, 1.05x at h16)."""
    if kv_cache_dtype == "fp8" or rows >= _GLUON_AUTO_MIN_ROWS:
        return True
    return rows == 16 and batch_size >= _GLUON_16ROW_MIN_BATCH


def _gluon_variant(kv_cache_dtype: str, num_heads: int, max_query_len: int, batch_size: int, num_sms: int) -> str:
    """The Gluon kernel: for fp8 caches ``narrow`` up to 32 rows (heads x max query length), ``ws`` above (the seesaw
    kernels take bf16 caches only); ``pair`` (on the plan's request-spanning schedule) where
    :func:`openmla.ops.plan.pair_wanted` says the batch fills the SMs with 64-head programs; ``seesaw`` otherwise (it
    hides HBM latency better)."""
    if kv_cache_dtype == "fp8":
        return "narrow" if num_heads * max_query_len <= NARROW_MAX_ROWS else "ws"
    readers = gluon_readers(num_heads, max_query_len)
    return "pair" if pair_wanted(num_heads, readers, batch_size, num_sms) else "seesaw"


def _check_batch(T: int, block_table, seq_lens, query_start_loc, page: int, num_blocks: int) -> None:
    """The host checks of ``mla_decode(validate=True)``: query rows, lengths and the block ids each request reads."""
    qsl = query_start_loc.long()
    first, last, step = torch.stack([qsl[0], qsl[-1], (qsl[1:] - qsl[:-1]).min()]).tolist()
    if first != 0:
        raise ValueError(f"query_start_loc[0] must be 0; got {first}")
    if step < 0:
        raise ValueError(f"query_start_loc must not decrease; got {query_start_loc.tolist()}")
    if last != T:
        raise ValueError(f"query_start_loc[-1] ({last}) must equal q.shape[0] ({T})")
    check_block_table(block_table, seq_lens, None, page, num_blocks)


def _host_scale(name: str, scale, device) -> float:
    """A per-tensor scale as a Python float, positive and finite (a tensor is read once; not allowed while
    capturing)."""
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return check_scale_value(name, float(scale))
    if capturing():
        raise ValueError(f"pass {name} as a float while a CUDA graph is captured")
    return float(scalar_scale(name, scale, device))


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    sm_scale: float,
    *,
    causal: bool = True,
    kv_cache_dtype: str = "auto",
    kv_scale: torch.Tensor | float | None = None,
    q_scale: torch.Tensor | float | None = None,
    plan: DecodePlan | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    return_lse: bool = True,
    d_v: int = 512,
    backend: str | None = None,
    validate: bool = True,
    _gluon_kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Paged MLA decode and speculative verify (absorbed MQA form; V = kv_cache[..., :d_v]).

    Args:
        q (torch.Tensor): `[T, h_q, d_qk]` (d_qk = 576 = 512 latent + 64 rope), bf16/fp16 (fp32 for
            tests), or float8_e4m3fn with ``q_scale``; with an fp8 cache the products run in fp16; request b owns rows
            ``query_start_loc[b]:query_start_loc[b+1]``. Any head count >= 1, no padding needed.
        kv_cache (torch.Tensor): `[num_blocks, page_size, d_qk]`, q's dtype (bf16/fp16/fp32) for
            ``kv_cache_dtype="auto"`` or float8_e4m3fn for ``"fp8"``; any page size >= 1 (64 is fast).
        block_table (torch.Tensor): `[B, max_blocks]`, int32.
        seq_lens (torch.Tensor): `[B]`, int32; keys per request (context + new tokens); 0 gives
            out = 0 and lse = -inf for that request's rows.
        query_start_loc (torch.Tensor): `[B + 1]`, int32; query lengths 1 (decode) to 16 (verify).
        sm_scale (float): softmax scale (model specific; no default for MLA).
        causal (bool): query t of a request with qlen L sees keys ``[0, seq_len - L + t]``; when False
            every row sees all ``seq_len`` keys (non-causal drafts).
        kv_cache_dtype (str): "auto" or "fp8" (per-tensor ``kv_scale``: value = stored * kv_scale).
        kv_scale, q_scale (torch.Tensor | float | None): per-tensor dequantisation scales for an fp8
            cache and an fp8 q. A tensor scale is read on the host once (not CUDA-graph safe; pass a
            float when capturing).
        plan (DecodePlan | None): from :func:`openmla.plan_decode` for this batch (computed once per
            step, reused by every layer). Built here (with a host sync) when None.
        out (torch.Tensor | None): `[T, h_q, d_v]` output buffer. lse: `[T, h_q]` fp32 buffer.
        return_lse (bool): return the LSE (it is computed either way).
        d_v (int): latent width, the output width (512).
        backend (str | None): "triton" (the portable kernel), "gluon" (the Hopper kernel of
            :mod:`openmla.ops.gluon.decode`; an error where it does not apply) or "auto" (Gluon on sm90
            for the shapes where it measured faster, else Triton). None reads ``OPENMLA_DECODE_BACKEND``
            (default "auto").
        validate (bool): check the batch on the host (a device sync): ``query_start_loc`` starts at 0,
            does not decrease and ends at T; ``seq_lens`` are non-negative and covered by ``block_table``; the
            block ids of the columns each request reads lie in ``[0, num_blocks)``. Skipped while a CUDA graph
            is captured; pass False for a step already checked (e.g. by
            :class:`~openmla.metadata.MLAMetadataBuilder`, as the layers do). Unchecked,
            these are trusted, but no kernel reads outside a tensor: block ids outside the cache and
            positions past the block table count as no key, rows outside ``[0, T)`` are not touched.

    Returns:
        out: `[T, h_q, d_v]`, q.dtype (bf16 for an fp8 q).
        lse: `[T, h_q]` fp32, natural-log log-sum-exp of the scaled scores (-inf for empty rows), or
        None when ``return_lse`` is False.
    """
    check_tensor("q", q, dtypes=FLOAT16_DTYPES + (torch.float32, torch.float8_e4m3fn), ndim=3)
    dev = q.device
    T, H, d_qk = q.shape
    if not isinstance(sm_scale, numbers.Real) or isinstance(sm_scale, bool) or not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale must be a finite float; got {sm_scale!r}")
    if not isinstance(d_v, int) or isinstance(d_v, bool) or d_v < 1:
        raise ValueError(f"d_v must be a positive int; got {d_v!r}")
    if d_qk <= d_v:
        raise ValueError(f"q's last dim ({d_qk}) must exceed d_v ({d_v}): latent + rope; got {describe(q)}")
    d_r = d_qk - d_v
    if d_v & (d_v - 1) or d_r & (d_r - 1):
        raise ValueError(f"d_v ({d_v}) and the rope width ({d_r}) must be powers of two")
    if kv_cache_dtype not in ("auto", "fp8"):
        raise ValueError(f'kv_cache_dtype must be "auto" or "fp8" for mla_decode; got {kv_cache_dtype!r}')
    cache_dtypes = (torch.float8_e4m3fn,) if kv_cache_dtype == "fp8" else FLOAT16_DTYPES + (torch.float32,)
    check_tensor("kv_cache", kv_cache, dtypes=cache_dtypes, ndim=3, device=dev)
    if kv_cache.shape[2] != d_qk:
        raise ValueError(f"kv_cache rows must be {d_qk} wide like q; got {describe(kv_cache)}")
    if kv_cache.stride(2) != 1:
        raise ValueError("kv_cache must be contiguous in its last dimension")
    check_index("block_table", block_table, ndim=2, device=dev)
    B = block_table.shape[0]
    check_index("seq_lens", seq_lens, ndim=1, device=dev, length=B)
    check_index("query_start_loc", query_start_loc, ndim=1, device=dev, length=B + 1)
    # the kernels read 1-D index tensors as dense arrays, and the Gluon tier reads block_table rows as such
    seq_lens, query_start_loc = seq_lens.contiguous(), query_start_loc.contiguous()
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    if q.dtype == torch.float8_e4m3fn:
        if q_scale is None:
            raise ValueError("q_scale is required for an fp8 q")
        out_dtype = torch.bfloat16
    else:
        if q_scale is not None:
            raise ValueError("q_scale is only meaningful for an fp8 q")
        if kv_cache_dtype == "auto" and kv_cache.dtype != q.dtype:
            raise TypeError(f"kv_cache dtype {kv_cache.dtype} must match q's {q.dtype} for kv_cache_dtype='auto'")
        out_dtype = q.dtype
    # an fp8 cache is widened to fp16 (one cvt per two values; e4m3 -> bf16 costs three), so q is
    # rounded to fp16 for the products too (more mantissa than bf16; |q| must stay below 65504)
    compute = compute_dtype(torch.float16 if kv_cache_dtype == "fp8" else out_dtype)
    kv_s = _host_scale("kv_scale", kv_scale, dev) if kv_cache_dtype == "fp8" else 1.0
    q_s = _host_scale("q_scale", q_scale, dev) if q_scale is not None else 1.0
    if validate and not capturing() and B:
        _check_batch(T, block_table, seq_lens, query_start_loc, kv_cache.shape[1], kv_cache.shape[0])
    if plan is None:
        plan = plan_decode(seq_lens, query_start_loc, H, d_v=d_v, kv_cache_dtype=kv_cache_dtype)
    else:
        plan.check(B, H, d_v, kv_cache_dtype)
    if out is None:
        out = torch.empty(T, H, d_v, dtype=out_dtype, device=dev)
    else:
        check_tensor("out", out, dtypes=(out_dtype,), shape=(T, H, d_v), device=dev)
        check_no_overlap("out", out)
    if lse is None:
        lse = torch.empty(T, H, dtype=torch.float32, device=dev)
    else:
        check_tensor("lse", lse, dtypes=(torch.float32,), shape=(T, H), device=dev)
        check_no_overlap("lse", lse)
        if not lse.is_contiguous():
            raise ValueError("lse must be contiguous")
    if T and B:
        scale_log2 = sm_scale * q_s * kv_s * _LOG2E
        variant = _gluon_variant(kv_cache_dtype, H, plan.max_query_len, B, plan.num_sms)
        if _gluon_kernel is not None:  # private, for the benchmark: one of the Gluon kernels instead of the pick
            if _gluon_kernel not in GLUON_VARIANTS:
                raise ValueError(f"_gluon_kernel must be one of {GLUON_VARIANTS}; got {_gluon_kernel!r}")
            variant = _gluon_kernel
        spans = None
        if _use_gluon(backend, q, kv_cache, plan, kv_cache_dtype):
            # the request-spanning schedule where the plan has one; the pair kernel merges cut requests itself
            spans = plan.spans if variant == "pair" else None
            mla_decode_split_gluon(q, kv_cache, block_table, seq_lens, query_start_loc, plan, out, lse,
                                   scale_log2, kv_s, causal, d_v, variant=variant, spans=spans)  # fmt: skip
        else:
            _mla_decode_split(q, kv_cache, block_table, seq_lens, query_start_loc, plan, out, lse,
                              scale_log2, kv_s, causal, d_v, compute)  # fmt: skip
        if spans is None:
            _mla_decode_reduce(query_start_loc, plan, out, lse, d_v)
    return out, (lse if return_lse else None)
