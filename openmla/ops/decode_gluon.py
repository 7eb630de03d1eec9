"""Hopper (sm90) tier of the dense MLA decode: a Gluon split-KV kernel with TMA, mbarriers and wgmma.

Same contract as the portable kernel of :mod:`openmla.ops.decode` (``_mla_decode_split``): one program
owns one work item of a :class:`~openmla.ops.plan.DecodePlan` (one KV split of one request) and one
block of 64 rows (``BLOCK_H`` heads x ``Q_PER`` query tokens folded, row ``m`` -> token
``i_q * Q_PER + m // BLOCK_H``, head ``i_h * BLOCK_H + m % BLOCK_H``). A single-split request gets its
final rows in ``out``/``lse``; the others get a normalised fp32 partial and its natural-log LSE in
``plan.o_part``/``plan.lse_part``, merged afterwards by the existing reduce kernel (not run here).

Design (the measurements behind it: ``docs/gluon_decode_plan.md``):

* ``num_warps = 8``: two warpgroups, no warp specialisation. ``Q [64, 576]`` is loaded once (masked
  ``gl.load``, so any head count / query length / stride works) into shared memory as 9 chunks
  ``[64, 64]`` with the 128-byte-swizzled NVMMA layout.
* KV tiles of ``BLOCK_N`` (32 or 64) tokens arrive by TMA over a 2-D view ``[num_blocks * PAGE, 576]``
  of the cache, 32 keys at a time (the plan's split granularity, so a box never crosses a page; a
  64-key tile is two 32-key loads with their own page lookups): a ``[32, 512]`` latent load (eight
  128-byte-swizzled ``[32, 64]`` TMA messages, one per warp) + a ``[32, 64]`` rope load, into a ring of
  ``STAGES`` buffers,
  each ``[BLOCK_N, 512]`` (latent = V, the first 512 columns of K) + ``[BLOCK_N, 64]`` (rope), one
  mbarrier per stage. A box whose keys all lie past the split or whose block id is out of range
  (< 0 or >= num_blocks) is aimed at row ``num_blocks * PAGE``, wholly outside the descriptor: TMA
  fills it with zeros and reads nothing; its keys are masked to -inf.
* Scores ``S = Q K^T`` [64, BLOCK_N] by ``warpgroup_mma`` (9 chained async MMAs over the 64-column
  chunks), layout ``NVMMADistributedLayout([3, 0], warps_per_cta=[4, 2])``: the two warpgroups take
  half of the tile's keys each (no duplicated QK^T). Online softmax in base 2 in registers; the row
  max/sum across the warpgroups go through shared memory (``gl.max``/``gl.sum``).
* ``P`` (bf16) to shared memory, then ``O += P V`` with ``V`` = the latent buffer of the same stage,
  the ``[64, 512]`` fp32 accumulator split by columns over the warpgroups (128 registers a thread).
* ``OVERLAP=True``: the scores MMA of tile ``j + 1`` is issued (async) before the softmax of tile
  ``j``, so the tensor cores work during the softmax; ``OVERLAP=False`` is the plain serial loop.
  A stage is refilled once the P V of its tile is done, so the loads run ``STAGES - 1`` tiles ahead
  of the serial loop but only ``STAGES - 2`` ahead of the overlapped one (which holds tiles j and
  j + 1): OVERLAP needs 3+ stages, i.e. 32-key tiles (4 stages fit).
* ``ws=True`` (``_mla_decode_gluon_ws_kernel``, same results up to rounding of the row sum): warp
  specialisation. A 1-warp producer partition (32 registers) does the page lookups and issues every TMA
  load, waiting on per-stage "empty" mbarriers; the two consumer warpgroups (default partition, 232
  registers after ``setmaxnreg``) wait on per-stage "ready" mbarriers, run the serial loop and release a
  stage with one ``mbarrier.arrive`` after the P V. The row sum is kept per key column and reduced once
  at the end. CTA-wide barriers per 64-key tile in the steady state: 5 (loop top, row max x 2, P, after
  P V) instead of 12 (the serial loop also syncs before each of its 4 TMA messages and reduces the sum).
* Keys past the sequence end inside a valid page hold anything (stale data, NaN in the tests): the
  tile that holds the sequence end has those rows of its latent buffer zeroed in shared memory before
  the MMAs (a NaN there would survive ``P = 0`` in ``P V``); their scores are masked to -inf anyway.

Shared memory: Q 73,728 B + STAGES x BLOCK_N x 1,152 B + P 64 x BLOCK_N x 2 B (+ 528 B of barriers and
reduction scratch): 64 x 2 stages = 229,904 B, 32 x 4 = 225,824 B, 32 x 3 = 188,952 B (limit 232,448).
Registers (sm90 offline compile, 8 warps): 64/2/serial 228-230, 32/4/overlap 246-248, 32/3/overlap
250-252, no spill; 64/2/overlap reaches 255 with a few spilled bytes (and no prefetch), not offered.

Limits: bf16 q and cache (fp8 is not handled here), d_qk = 576 = 512 + 64, page size a multiple of 32,
split lengths multiples of 32, cache rows of one page contiguous across pages (a 2-D view). Gluon
needs ``triton.experimental.gluon`` (Triton >= 3.5); without it ``gluon_decode_supported`` is False
and importing this module still works.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton

if TYPE_CHECKING:
    from openmla.ops.plan import DecodePlan

__all__ = ["GLUON_AVAILABLE", "gluon_decode_config", "gluon_decode_supported", "mla_decode_split_gluon"]

try:  # Gluon ships inside triton >= 3.5; keep `import openmla` working without it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    GLUON_AVAILABLE = True
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed triton
    GLUON_AVAILABLE = False

D_V = 512
D_R = 64
D_QK = D_V + D_R
BLOCK_M = 64  # rows per program: one wgmma M of 64 per warpgroup
SUB_N = 32  # keys per TMA box: the plan's split granularity, so a box never crosses a page
NUM_WARPS = 8
SMEM_LIMIT = 232448  # bytes of shared memory a block may use on sm90
# registers of the 1-warp producer partition of the ``ws=True`` variant: 24 spills a few bytes (its
# arguments arrive through shared memory); 32 leaves the two consumer warpgroups 232 (no spill)
WS_PRODUCER_REGS = 32


if GLUON_AVAILABLE:

    @gluon.jit
    def _box_ok(p_bt, n, kv_hi, max_blocks, num_blocks, PAGE: gl.constexpr):
        """Whether the 32-key box starting at key ``n`` is in the split and has a valid block id."""
        i_pg = n // PAGE
        blk = gl.load(p_bt + i_pg, mask=(n < kv_hi) & (i_pg < max_blocks), other=-1)
        return (n < kv_hi) & (blk >= 0) & (blk < num_blocks)

    @gluon.jit
    def _kv_rows(p_bt, n0, kv_hi, max_blocks, num_blocks, PAGE: gl.constexpr, SUB: gl.constexpr):
        """TMA row of the 32-key box starting at key ``n0 + SUB * 32`` (an out-of-bounds row when masked)."""
        n = n0 + SUB * 32
        i_pg = n // PAGE
        blk = gl.load(p_bt + i_pg, mask=(n < kv_hi) & (i_pg < max_blocks), other=-1)
        ok = (n < kv_hi) & (blk >= 0) & (blk < num_blocks)
        # a box wholly outside the descriptor's rows: TMA writes zeros, reads nothing, counts the bytes
        return gl.where(ok, blk * PAGE + n % PAGE, num_blocks * PAGE)

    @gluon.jit
    def _issue_kv(lat_desc, rope_desc, lat_smem, rope_smem, bars, stage, row0, row1, NSUB: gl.constexpr):
        """Start the TMA loads of one KV tile (NSUB boxes of 32 keys: [32, 512] latent + [32, 64] rope)."""
        bar = bars.index(stage)
        mbarrier.expect(bar, NSUB * 32 * 576 * 2)
        for h in gl.static_range(NSUB):
            row = row0 if h == 0 else row1
            tma.async_copy_global_to_shared(lat_desc, [row, 0], bar, lat_smem.index(stage).slice(h * 32, 32, dim=0))
            tma.async_copy_global_to_shared(rope_desc, [row, 512], bar, rope_smem.index(stage).slice(h * 32, 32, dim=0))

    @gluon.jit
    def _qk(q_smem, lat, rope, s_init):
        """Start ``S = Q K^T`` for one tile: 8 latent chunks + the rope chunk, chained async wgmmas."""
        s = warpgroup_mma(q_smem.index(0), lat.slice(0, 64, dim=1).permute((1, 0)), s_init, use_acc=False,
                          is_async=True)  # fmt: skip
        for c in gl.static_range(1, 8):
            s = warpgroup_mma(q_smem.index(c), lat.slice(c * 64, 64, dim=1).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(q_smem.index(8), rope.permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _zero_tail(lat, n0, L, BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
        """Zero the rows of a landed latent tile whose keys are >= L (they are not part of the sequence)."""
        z_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        o_r = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, z_layout))
        keep = gl.expand_dims(o_r < L, 1)
        for c in gl.static_range(8):
            buf = lat.slice(c * 64, 64, dim=1)
            x = buf.load(z_layout)
            buf.store(gl.where(keep, x, gl.zeros_like(x)))
        fence_async_shared()  # generic-proxy writes before the async-proxy (wgmma) reads
        gl.thread_barrier()

    @gluon.jit
    def _mla_decode_gluon_fwd_kernel(
        q,  # [T, H, 576] bf16
        lat_desc,  # TMA descriptor over kv_cache viewed as [num_blocks * PAGE, 576] bf16, block [32, 512]
        rope_desc,  # the same view, block [32, 64] (the rope columns 512:576)
        block_table,  # [B, W] int32
        seq_lens,  # [B]
        query_start_loc,  # [B + 1]
        work_req,  # [capacity]
        work_split,  # [capacity]
        num_splits,  # [B]
        split_len,  # [B]
        out,  # [T, H, 512] q.dtype
        lse,  # [T, H] fp32
        o_part,  # [capacity, MAX_QLEN, H, 512] fp32
        lse_part,  # [capacity, MAX_QLEN, H] fp32
        scale_log2,  # sm_scale * log2(e) (* q/kv scales)
        v_scale,  # kv_scale, 1.0 for a bf16 cache
        stride_q_t,
        stride_q_h,
        stride_bt_b,
        stride_o_t,
        stride_o_h,
        H,
        num_blocks,
        max_blocks,
        PAGE: gl.constexpr,
        MAX_QLEN: gl.constexpr,
        BLOCK_H: gl.constexpr,
        Q_PER: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        CAUSAL: gl.constexpr,
        OVERLAP: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        BLOCK_M: gl.constexpr = BLOCK_H * Q_PER
        D_V: gl.constexpr = 512
        D_R: gl.constexpr = 64
        NSUB: gl.constexpr = BLOCK_N // 32
        gl.static_assert(BLOCK_M == 64, "64 rows per program (one wgmma M per warpgroup)")
        gl.static_assert(num_warps == 8, "two warpgroups")
        gl.static_assert(BLOCK_N == 32 or BLOCK_N == 64, "BLOCK_N is 32 or 64")

        # register layouts: scores [64, BLOCK_N] and output [64, 512], both split by columns over the
        # two warpgroups (warps_per_cta [4, 2]); their row slices coincide
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, BLOCK_N // 2, 16])  # fmt: skip
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, 256, 16])  # fmt: skip
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        COL_S: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
        COL_O: gl.constexpr = gl.SliceLayout(0, O_LAYOUT)
        LD_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])  # q: 16 B a thread
        ROW_LD: gl.constexpr = gl.SliceLayout(1, LD_LAYOUT)
        COL_LD: gl.constexpr = gl.SliceLayout(0, LD_LAYOUT)
        Q_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        P_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.bfloat16)

        i_w = gl.program_id(0)
        i_h = gl.program_id(1)
        i_q = gl.program_id(2)
        i_b = gl.load(work_req + i_w)
        if i_b < 0:
            return
        i_b = i_b.to(gl.int64)
        q_start = gl.load(query_start_loc + i_b)
        qlen = gl.load(query_start_loc + i_b + 1) - q_start
        if i_q * Q_PER >= qlen:
            return
        L = gl.load(seq_lens + i_b)
        i_s = gl.load(work_split + i_w)
        chunk = gl.load(split_len + i_b)
        kv_lo = i_s * chunk
        kv_hi = gl.minimum(L, kv_lo + chunk)
        if CAUSAL:  # keys past the last visible one of this row block are not loaded
            kv_hi = gl.minimum(kv_hi, L - qlen + gl.minimum(i_q * Q_PER + Q_PER, qlen))
        n_tiles = gl.cdiv(gl.maximum(kv_hi - kv_lo, 0), BLOCK_N)
        p_bt = block_table + i_b * stride_bt_b

        # ---- shared memory: Q (9 x [64, 64]), KV ring (latent [BLOCK_N, 512] + rope [BLOCK_N, 64]), P
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [9, BLOCK_M, 64], Q_SMEM)
        lat_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D_V], lat_desc.layout)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D_R], rope_desc.layout)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_N], P_SMEM)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(bars.index(st), count=1)
        fence_async_shared()  # barrier inits visible to the async proxy before the first TMA

        # ---- prologue: the first STAGES tiles in flight
        for st in gl.static_range(STAGES):
            if st < n_tiles:
                n0 = kv_lo + st * BLOCK_N
                r0 = _kv_rows(p_bt, n0, kv_hi, max_blocks, num_blocks, PAGE, 0)
                r1 = r0
                if NSUB == 2:
                    r1 = _kv_rows(p_bt, n0, kv_hi, max_blocks, num_blocks, PAGE, 1)
                _issue_kv(lat_desc, rope_desc, lat_smem, rope_smem, bars, st, r0, r1, NSUB)

        # ---- Q rows -> shared memory while the first tiles load
        o_m = gl.arange(0, BLOCK_M, layout=ROW_LD)
        o_t = i_q * Q_PER + o_m // BLOCK_H
        o_h = i_h * BLOCK_H + o_m % BLOCK_H
        m_ld = gl.expand_dims((o_t < qlen) & (o_h < H), 1)
        p_q = q + gl.expand_dims((q_start + o_t).to(gl.int64) * stride_q_t + o_h * stride_q_h, 1)
        o_c = gl.expand_dims(gl.arange(0, 64, layout=COL_LD), 0)
        for c in gl.static_range(9):
            b_q = gl.load(p_q + (c * 64 + o_c), mask=m_ld, other=0.0)
            q_smem.index(c).store(b_q.to(gl.bfloat16))
        fence_async_shared()  # generic-proxy Q writes before the wgmma reads
        gl.thread_barrier()

        # ---- per-row state (rows of the scores layout)
        o_ms = gl.arange(0, BLOCK_M, layout=ROW_S)
        o_ts = i_q * Q_PER + o_ms // BLOCK_H
        if CAUSAL:
            limit = L - qlen + o_ts + 1  # keys [0, limit) are visible to each row
        else:
            limit = gl.full([BLOCK_M], 0, gl.int32, ROW_S) + L
        limit = gl.expand_dims(gl.minimum(limit, kv_hi), 1)
        o_ns = gl.arange(0, BLOCK_N, layout=COL_S)
        b_m = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW_S)
        b_l = gl.full([BLOCK_M], 0.0, gl.float32, ROW_S)
        acc = gl.zeros([BLOCK_M, D_V], gl.float32, O_LAYOUT)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT)

        if OVERLAP:
            if n_tiles > 0:
                mbarrier.wait(bars.index(0), 0)
                if kv_lo + BLOCK_N > L:
                    _zero_tail(lat_smem.index(0), kv_lo, L, BLOCK_N, num_warps)
                s_next = _qk(q_smem, lat_smem.index(0), rope_smem.index(0), s_zero)
                s_next = warpgroup_mma_wait(0, deps=(s_next,))
            else:
                s_next = s_zero
        for j in range(n_tiles):
            stage = j % STAGES
            n0 = kv_lo + j * BLOCK_N
            # page rows of the tile that will refill this stage (loads in flight during the MMAs)
            nn = n0 + STAGES * BLOCK_N
            r0 = _kv_rows(p_bt, nn, kv_hi, max_blocks, num_blocks, PAGE, 0)
            r1 = r0
            if NSUB == 2:
                r1 = _kv_rows(p_bt, nn, kv_hi, max_blocks, num_blocks, PAGE, 1)
            # keys of a 32-key box with an invalid block id are masked (their box was read as zeros)
            ok0 = _box_ok(p_bt, n0, kv_hi, max_blocks, num_blocks, PAGE)
            ok_n = (o_ns < 32) & ok0
            if NSUB == 2:
                ok1 = _box_ok(p_bt, n0 + 32, kv_hi, max_blocks, num_blocks, PAGE)
                ok_n = ok_n | ((o_ns >= 32) & ok1)
            m_n = gl.expand_dims(ok_n, 0) & (gl.expand_dims(n0 + o_ns, 0) < limit)

            lat = lat_smem.index(stage)
            if OVERLAP:
                b_s = s_next
                if j + 1 < n_tiles:  # next tile's scores on the tensor cores during this softmax
                    nstage = (j + 1) % STAGES
                    mbarrier.wait(bars.index(nstage), ((j + 1) // STAGES) & 1)
                    if n0 + 2 * BLOCK_N > L:
                        _zero_tail(lat_smem.index(nstage), n0 + BLOCK_N, L, BLOCK_N, num_warps)
                    s_tok = _qk(q_smem, lat_smem.index(nstage), rope_smem.index(nstage), s_zero)
                else:
                    s_tok = warpgroup_mma_init(s_zero)
            else:
                mbarrier.wait(bars.index(stage), (j // STAGES) & 1)
                if n0 + BLOCK_N > L:
                    _zero_tail(lat, n0, L, BLOCK_N, num_warps)
                b_s = _qk(q_smem, lat, rope_smem.index(stage), s_zero)
                b_s = warpgroup_mma_wait(0, deps=(b_s,))

            # ---- online softmax (base 2)
            b_s = gl.where(m_n, b_s * scale_log2, float("-inf"))
            b_m_new = gl.maximum(b_m, gl.max(b_s, axis=1))
            b_m_use = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)
            b_alpha = gl.exp2(b_m - b_m_use)
            b_p = gl.exp2(b_s - gl.expand_dims(b_m_use, 1))
            b_l = b_l * b_alpha + gl.sum(b_p, axis=1)
            b_m = b_m_new
            p_smem.store(b_p.to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()  # each warpgroup reads all of P

            # ---- O = O * alpha + P V
            acc = acc * gl.expand_dims(gl.convert_layout(b_alpha, ROW_O), 1)
            acc = warpgroup_mma(p_smem, lat, acc, is_async=True)
            if OVERLAP:
                s_next, acc = warpgroup_mma_wait(0, deps=(s_tok, acc))
            else:
                acc = warpgroup_mma_wait(0, deps=(acc,))
            gl.thread_barrier()  # both warpgroups are done with this stage and with P
            if j + STAGES < n_tiles:
                _issue_kv(lat_desc, rope_desc, lat_smem, rope_smem, bars, stage, r0, r1, NSUB)

        for st in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(st))

        # ---- epilogue: normalise; final rows or a partial. The request's scalars are read again
        # here rather than kept in registers across the loop (the loop needs all 255)
        i_w = gl.program_id(0)
        i_h = gl.program_id(1)
        i_q = gl.program_id(2)
        i_b = gl.load(work_req + i_w).to(gl.int64)
        q_start = gl.load(query_start_loc + i_b)
        qlen = gl.load(query_start_loc + i_b + 1) - q_start
        n_split = gl.load(num_splits + i_b)
        empty = b_l == 0.0
        b_lse = gl.where(empty, float("-inf"), (b_m + gl.log2(gl.where(empty, 1.0, b_l))) * 0.6931471805599453)
        b_inv = gl.where(empty, 0.0, v_scale / gl.where(empty, 1.0, b_l))
        b_o = acc * gl.expand_dims(gl.convert_layout(b_inv, ROW_O), 1)
        o_mo = gl.arange(0, BLOCK_M, layout=ROW_O)
        o_to = i_q * Q_PER + o_mo // BLOCK_H
        o_ho = i_h * BLOCK_H + o_mo % BLOCK_H
        m_o = gl.expand_dims((o_to < qlen) & (o_ho < H), 1)
        o_v = gl.expand_dims(gl.arange(0, D_V, layout=COL_O), 0)
        # the LSE in the scores' row layout (b_m, b_l live there)
        o_ms = gl.arange(0, BLOCK_M, layout=ROW_S)
        o_ts = i_q * Q_PER + o_ms // BLOCK_H
        o_hs = i_h * BLOCK_H + o_ms % BLOCK_H
        m_s = (o_ts < qlen) & (o_hs < H)
        if n_split == 1:
            row = (q_start + o_to).to(gl.int64)
            p_o = out + gl.expand_dims(row * stride_o_t + o_ho * stride_o_h, 1) + o_v
            gl.store(p_o, b_o.to(out.dtype.element_ty), mask=m_o)
            gl.store(lse + (q_start + o_ts).to(gl.int64) * H + o_hs, b_lse, mask=m_s)
        else:
            part = (i_w.to(gl.int64) * MAX_QLEN + o_to) * H + o_ho
            gl.store(o_part + gl.expand_dims(part * D_V, 1) + o_v, b_o, mask=m_o)
            gl.store(lse_part + (i_w.to(gl.int64) * MAX_QLEN + o_ts) * H + o_hs, b_lse, mask=m_s)


    # ---------------------------------------------------------------------------------------------
    # Warp-specialised variant (``ws=True``): a 1-warp producer partition issues every TMA load of the
    # KV ring (page lookups included) and waits on per-stage "empty" mbarriers; the default partition
    # (the two consumer warpgroups) waits on per-stage "ready" mbarriers and computes exactly what the
    # serial loop of ``_mla_decode_gluon_fwd_kernel`` computes (same MMAs, same softmax, same order).

    @gluon.jit
    def _ws_producer(lat_desc, rope_desc, lat_smem, rope_smem, ready, empty, p_bt, kv_lo, kv_hi, n_tiles,
                     max_blocks, num_blocks, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr):  # fmt: skip
        NSUB: gl.constexpr = BLOCK_N // 32
        for j in range(n_tiles):
            stage = j % STAGES
            n0 = kv_lo + j * BLOCK_N
            r0 = _kv_rows(p_bt, n0, kv_hi, max_blocks, num_blocks, PAGE, 0)
            r1 = r0
            if NSUB == 2:
                r1 = _kv_rows(p_bt, n0, kv_hi, max_blocks, num_blocks, PAGE, 1)
            # the consumers released this stage (fresh barriers pass parity 1 at once: the first lap)
            mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)
            _issue_kv(lat_desc, rope_desc, lat_smem, rope_smem, ready, stage, r0, r1, NSUB)

    @gluon.jit
    def _ws_consumer(q, q_smem, lat_smem, rope_smem, p_smem, ready, empty, p_bt, block_table, query_start_loc,
                     num_splits, out, lse, o_part, lse_part, scale_log2, v_scale, stride_q_t, stride_q_h,
                     stride_o_t, stride_o_h, H, num_blocks, max_blocks, i_w, i_h, i_q, i_b, q_start, qlen, L,
                     kv_lo, kv_hi, n_tiles, PAGE: gl.constexpr, MAX_QLEN: gl.constexpr,
                     BLOCK_H: gl.constexpr, Q_PER: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     CAUSAL: gl.constexpr):  # fmt: skip
        BLOCK_M: gl.constexpr = BLOCK_H * Q_PER
        D_V: gl.constexpr = 512
        NSUB: gl.constexpr = BLOCK_N // 32
        NW: gl.constexpr = 8
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, BLOCK_N // 2, 16])  # fmt: skip
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, 256, 16])  # fmt: skip
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        COL_S: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
        COL_O: gl.constexpr = gl.SliceLayout(0, O_LAYOUT)
        LD_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
        ROW_LD: gl.constexpr = gl.SliceLayout(1, LD_LAYOUT)
        COL_LD: gl.constexpr = gl.SliceLayout(0, LD_LAYOUT)

        # ---- Q rows -> shared memory while the producer starts the first tiles
        o_m = gl.arange(0, BLOCK_M, layout=ROW_LD)
        o_t = i_q * Q_PER + o_m // BLOCK_H
        o_h = i_h * BLOCK_H + o_m % BLOCK_H
        m_ld = gl.expand_dims((o_t < qlen) & (o_h < H), 1)
        p_q = q + gl.expand_dims((q_start + o_t).to(gl.int64) * stride_q_t + o_h * stride_q_h, 1)
        o_c = gl.expand_dims(gl.arange(0, 64, layout=COL_LD), 0)
        for c in gl.static_range(9):
            b_q = gl.load(p_q + (c * 64 + o_c), mask=m_ld, other=0.0)
            q_smem.index(c).store(b_q.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()

        o_ms = gl.arange(0, BLOCK_M, layout=ROW_S)
        o_ts = i_q * Q_PER + o_ms // BLOCK_H
        if CAUSAL:
            limit = L - qlen + o_ts + 1
        else:
            limit = gl.full([BLOCK_M], 0, gl.int32, ROW_S) + L
        limit = gl.expand_dims(gl.minimum(limit, kv_hi), 1)
        o_ns = gl.arange(0, BLOCK_N, layout=COL_S)
        b_m = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW_S)
        # the row sums stay per key column (each thread its own keys) until the epilogue: no cross-warpgroup
        # reduction of the sum in the loop
        b_lv = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT)
        acc = gl.zeros([BLOCK_M, D_V], gl.float32, O_LAYOUT)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT)

        for j in range(n_tiles):
            stage = j % STAGES
            n0 = kv_lo + j * BLOCK_N
            ok0 = _box_ok(p_bt, n0, kv_hi, max_blocks, num_blocks, PAGE)
            ok_n = (o_ns < 32) & ok0
            if NSUB == 2:
                ok1 = _box_ok(p_bt, n0 + 32, kv_hi, max_blocks, num_blocks, PAGE)
                ok_n = ok_n | ((o_ns >= 32) & ok1)
            m_n = gl.expand_dims(ok_n, 0) & (gl.expand_dims(n0 + o_ns, 0) < limit)

            lat = lat_smem.index(stage)
            mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
            if n0 + BLOCK_N > L:
                _zero_tail(lat, n0, L, BLOCK_N, NW)
            b_s = _qk(q_smem, lat, rope_smem.index(stage), s_zero)
            b_s = warpgroup_mma_wait(0, deps=(b_s,))

            b_s = gl.where(m_n, b_s * scale_log2, float("-inf"))
            b_m_new = gl.maximum(b_m, gl.max(b_s, axis=1))
            b_m_use = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)
            b_alpha = gl.exp2(b_m - b_m_use)
            b_p = gl.exp2(b_s - gl.expand_dims(b_m_use, 1))
            b_lv = b_lv * gl.expand_dims(b_alpha, 1) + b_p
            b_m = b_m_new
            p_smem.store(b_p.to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()  # each warpgroup reads all of P

            acc = acc * gl.expand_dims(gl.convert_layout(b_alpha, ROW_O), 1)
            acc = warpgroup_mma(p_smem, lat, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            gl.thread_barrier()  # both warpgroups are done with this stage and with P
            mbarrier.arrive(empty.index(stage), count=1)  # the producer may refill it

        b_l = gl.sum(b_lv, axis=1)
        n_split = gl.load(num_splits + i_b)
        empty_r = b_l == 0.0
        b_lse = gl.where(empty_r, float("-inf"),
                         (b_m + gl.log2(gl.where(empty_r, 1.0, b_l))) * 0.6931471805599453)  # fmt: skip
        b_inv = gl.where(empty_r, 0.0, v_scale / gl.where(empty_r, 1.0, b_l))
        b_o = acc * gl.expand_dims(gl.convert_layout(b_inv, ROW_O), 1)
        o_mo = gl.arange(0, BLOCK_M, layout=ROW_O)
        o_to = i_q * Q_PER + o_mo // BLOCK_H
        o_ho = i_h * BLOCK_H + o_mo % BLOCK_H
        m_o = gl.expand_dims((o_to < qlen) & (o_ho < H), 1)
        o_v = gl.expand_dims(gl.arange(0, D_V, layout=COL_O), 0)
        o_hs = i_h * BLOCK_H + o_ms % BLOCK_H
        m_s = (o_ts < qlen) & (o_hs < H)
        if n_split == 1:
            row = (q_start + o_to).to(gl.int64)
            p_o = out + gl.expand_dims(row * stride_o_t + o_ho * stride_o_h, 1) + o_v
            gl.store(p_o, b_o.to(out.dtype.element_ty), mask=m_o)
            gl.store(lse + (q_start + o_ts).to(gl.int64) * H + o_hs, b_lse, mask=m_s)
        else:
            part = (i_w.to(gl.int64) * MAX_QLEN + o_to) * H + o_ho
            gl.store(o_part + gl.expand_dims(part * D_V, 1) + o_v, b_o, mask=m_o)
            gl.store(lse_part + (i_w.to(gl.int64) * MAX_QLEN + o_ts) * H + o_hs, b_lse, mask=m_s)

    @gluon.jit
    def _mla_decode_gluon_ws_kernel(
        q, lat_desc, rope_desc, block_table, seq_lens, query_start_loc, work_req, work_split, num_splits,
        split_len, out, lse, o_part, lse_part, scale_log2, v_scale, stride_q_t, stride_q_h, stride_bt_b,
        stride_o_t, stride_o_h, H, num_blocks, max_blocks,
        PAGE: gl.constexpr, MAX_QLEN: gl.constexpr, BLOCK_H: gl.constexpr, Q_PER: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, PRODUCER_REGS: gl.constexpr,
        num_warps: gl.constexpr,
    ):  # fmt: skip
        """Same arguments and results as ``_mla_decode_gluon_fwd_kernel`` (serial loop), warp-specialised."""
        BLOCK_M: gl.constexpr = BLOCK_H * Q_PER
        gl.static_assert(BLOCK_M == 64, "64 rows per program (one wgmma M per warpgroup)")
        gl.static_assert(num_warps == 8, "two consumer warpgroups in the default partition")
        gl.static_assert(BLOCK_N == 32 or BLOCK_N == 64, "BLOCK_N is 32 or 64")
        Q_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        P_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.bfloat16)

        i_w = gl.program_id(0)
        i_h = gl.program_id(1)
        i_q = gl.program_id(2)
        i_b = gl.load(work_req + i_w)
        if i_b < 0:
            return
        i_b = i_b.to(gl.int64)
        q_start = gl.load(query_start_loc + i_b)
        qlen = gl.load(query_start_loc + i_b + 1) - q_start
        if i_q * Q_PER >= qlen:
            return
        L = gl.load(seq_lens + i_b)
        i_s = gl.load(work_split + i_w)
        chunk = gl.load(split_len + i_b)
        kv_lo = i_s * chunk
        kv_hi = gl.minimum(L, kv_lo + chunk)
        if CAUSAL:
            kv_hi = gl.minimum(kv_hi, L - qlen + gl.minimum(i_q * Q_PER + Q_PER, qlen))
        n_tiles = gl.cdiv(gl.maximum(kv_hi - kv_lo, 0), BLOCK_N)
        p_bt = block_table + i_b * stride_bt_b

        q_smem = gl.allocate_shared_memory(gl.bfloat16, [9, BLOCK_M, 64], Q_SMEM)
        lat_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 512], lat_desc.layout)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], rope_desc.layout)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_N], P_SMEM)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(ready.index(st), count=1)
            mbarrier.init(empty.index(st), count=1)
        fence_async_shared()  # barrier inits visible to the async proxy and the other partitions

        gl.warp_specialize([
            (_ws_consumer, (q, q_smem, lat_smem, rope_smem, p_smem, ready, empty, p_bt, block_table,
                            query_start_loc, num_splits, out, lse, o_part, lse_part, scale_log2, v_scale,
                            stride_q_t, stride_q_h, stride_o_t, stride_o_h, H, num_blocks, max_blocks, i_w, i_h,
                            i_q, i_b, q_start, qlen, L, kv_lo, kv_hi, n_tiles, PAGE, MAX_QLEN, BLOCK_H, Q_PER,
                            BLOCK_N, STAGES, CAUSAL)),
            (_ws_producer, (lat_desc, rope_desc, lat_smem, rope_smem, ready, empty, p_bt, kv_lo, kv_hi, n_tiles,
                            max_blocks, num_blocks, PAGE, BLOCK_N, STAGES)),
        ], [1], [PRODUCER_REGS])  # fmt: skip

        for st in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(st))
            mbarrier.invalidate(empty.index(st))

def gluon_decode_config(num_heads: int, max_query_len: int) -> tuple[int, int]:
    """``(BLOCK_H, Q_PER)`` of the Gluon kernel: 64 rows = heads x query tokens, heads first."""
    block_h = min(triton.next_power_of_2(max(1, num_heads)), BLOCK_M)
    return block_h, BLOCK_M // block_h


def _kv_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


def gluon_decode_supported(q: torch.Tensor, kv_cache: torch.Tensor, plan: DecodePlan,
                           kv_cache_dtype: str = "auto") -> bool:  # fmt: skip
    """Whether :func:`mla_decode_split_gluon` handles this call.

    True on an sm90 CUDA device with Gluon available, bf16 q and cache (``kv_cache_dtype="auto"``),
    d_qk 576 (512 + 64), a page size that is a multiple of 32, a plan whose split lengths are
    multiples of 32 (``plan.tiling.block_n % 32 == 0``) and a cache whose pages are evenly strided
    rows (a 2-D view ``[num_blocks * page, 576]`` with 16-byte-aligned rows). Any head count and
    query length (rows are padded to 64: heads x query tokens).
    """
    if not GLUON_AVAILABLE or kv_cache_dtype != "auto":
        return False
    if q.device.type != "cuda" or kv_cache.device != q.device:
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    if q.dtype != torch.bfloat16 or kv_cache.dtype != torch.bfloat16:
        return False
    if q.dim() != 3 or kv_cache.dim() != 3 or q.shape[2] != D_QK or kv_cache.shape[2] != D_QK:
        return False
    if plan.d_v != D_V:
        return False
    page = kv_cache.shape[1]
    if page % SUB_N or plan.tiling.block_n % SUB_N:
        return False
    s0, s1, s2 = kv_cache.stride()
    if s2 != 1 or s0 != page * s1 or (s1 * 2) % 16 or kv_cache.data_ptr() % 16:
        return False
    return kv_cache.shape[0] * page < 2**31  # int32 TMA row coordinates


def mla_decode_split_gluon(q, kv_cache, block_table, seq_lens, query_start_loc, plan: DecodePlan, out, lse,
                           scale_log2: float, v_scale: float, causal: bool, d_v: int, *, block_n: int = 64,
                           stages: int | None = None, overlap: bool = False, ws: bool | None = None) -> None:  # fmt: skip
    r"""Launch the Gluon split-KV kernel (same meaning as ``_mla_decode_split`` in ``ops/decode.py``).

    Writes the final rows of single-split requests into ``out``/``lse`` and the normalised fp32
    partials of the others into ``plan.o_part``/``plan.lse_part``; the caller runs the reduce.

    Args:
        q (torch.Tensor): `[T, H, 576]` bf16.
        kv_cache (torch.Tensor): `[num_blocks, page, 576]` bf16 (page a multiple of 32).
        block_table (torch.Tensor): `[B, W]` int32. seq_lens: `[B]` int32. query_start_loc: `[B + 1]` int32.
        plan (DecodePlan): from :func:`openmla.plan_decode` for this batch.
        out (torch.Tensor): `[T, H, 512]` bf16. lse: `[T, H]` fp32, contiguous.
        scale_log2 (float): ``sm_scale * log2(e)`` (times the q/kv scales).
        v_scale (float): multiplies the output (1.0 for a bf16 cache).
        causal (bool): query t of a request with qlen L sees keys ``[0, seq_len - L + t]``.
        d_v (int): must be 512.
        block_n (int): keys per KV tile, 32 or 64 (keyword-only tuning knob).
        stages (int | None): KV ring depth (default: 2 for 64-key tiles; 4 for 32 with overlap, else 3).
        overlap (bool): issue the next tile's scores MMA before this tile's softmax (needs stages >= 3).
        ws (bool | None): the warp-specialised variant (``_mla_decode_gluon_ws_kernel``): a 1-warp
            producer partition issues the TMA loads on per-stage empty/ready mbarriers; the consumers
            run the serial loop (not combinable with ``overlap``). None: on unless ``overlap`` (measured
            4-8% faster than the plain serial loop on the H200, benchmarks/RESULTS.md run 10).
    """
    if ws is None:
        ws = not overlap
    if d_v != D_V:
        raise ValueError(f"the Gluon decode kernel needs d_v = {D_V}; got {d_v}")
    if block_n not in (32, 64):
        raise ValueError(f"block_n must be 32 or 64; got {block_n}")
    if stages is None:
        stages = 2 if block_n == 64 else (4 if overlap else 3)
    if ws and overlap:
        raise ValueError("ws=True runs the serial loop; overlap=True is not offered with it")
    if overlap and stages < 3:
        raise ValueError("overlap=True needs stages >= 3 (tiles j and j + 1 are resident together)")
    smem = 64 * 576 * 2 + stages * block_n * D_QK * 2 + 64 * block_n * 2 + 1024
    if smem > SMEM_LIMIT:
        raise ValueError(f"block_n={block_n} x stages={stages} needs {smem} B of shared memory (> {SMEM_LIMIT})")
    H = q.shape[1]
    num_blocks, page, _ = kv_cache.shape
    block_h, q_per = gluon_decode_config(H, plan.max_query_len)
    kv2d = kv_cache.as_strided((num_blocks * page, D_QK), (kv_cache.stride(1), 1))
    shape, strides = [num_blocks * page, D_QK], [kv_cache.stride(1), 1]
    lat_desc = TensorDescriptor(kv2d, shape, strides, [SUB_N, D_V], _kv_layout())
    rope_desc = TensorDescriptor(kv2d, shape, strides, [SUB_N, D_R], _kv_layout())
    grid = (plan.capacity, triton.cdiv(H, block_h), triton.cdiv(plan.max_query_len, q_per))
    if ws:
        _mla_decode_gluon_ws_kernel[grid](
            q, lat_desc, rope_desc, block_table, seq_lens, query_start_loc, plan.work_req, plan.work_split,
            plan.num_splits, plan.split_len, out, lse, plan.o_part, plan.lse_part, scale_log2, v_scale,
            q.stride(0), q.stride(1), block_table.stride(0), out.stride(0), out.stride(1),
            H, num_blocks, block_table.shape[1],
            PAGE=page, MAX_QLEN=plan.max_query_len, BLOCK_H=block_h, Q_PER=q_per, BLOCK_N=block_n, STAGES=stages,
            CAUSAL=causal, PRODUCER_REGS=WS_PRODUCER_REGS, num_warps=NUM_WARPS,
        )  # fmt: skip
        return
    _mla_decode_gluon_fwd_kernel[grid](
        q, lat_desc, rope_desc, block_table, seq_lens, query_start_loc, plan.work_req, plan.work_split, plan.num_splits,
        plan.split_len, out, lse, plan.o_part, plan.lse_part, scale_log2, v_scale,
        q.stride(0), q.stride(1), block_table.stride(0), out.stride(0), out.stride(1),
        H, num_blocks, block_table.shape[1],
        PAGE=page, MAX_QLEN=plan.max_query_len, BLOCK_H=block_h, Q_PER=q_per, BLOCK_N=block_n, STAGES=stages,
        CAUSAL=causal, OVERLAP=overlap, num_warps=NUM_WARPS,
    )  # fmt: skip
