"""Seesaw decode kernel, second schedule (H200 experiment; not part of openmla until it passes on a GPU).

The package's ``variant="seesaw"`` (``openmla/ops/decode_gluon.py``, RESULTS.md run 26) matches the ws kernel at
qlen 1. In its schedule a warpgroup refills its stage only after the other warpgroup's P V of the stage's tile, and
the other warpgroup does that P V after its own scores, so the TMA latency of every tile is on the critical path
(per tile: latency + scores + P V). This version changes two things:

* order per own tile t: (1) the other warpgroup's tile t - 1 first (P_{t-1} V_{t-1}, releasing it at once),
  (2) the scores S_t, (3) softmax, P_t, (4) own P_t V_t, (5) the refill with tile t + 2; ``PV_FIRST=False`` swaps
  (1) and (2) (the package kernel's order) to measure the split refill alone;
* split refill: a stage is two TMA groups with their own barriers. X = the owner's half of the latent columns (read
  only by the owner's P V: refilled right after it), Y = the other half + the rope columns (P lives there: refilled
  after the other warpgroup's P V). The scores chain the 4 X chunks first, then waits for Y.

All TMA boxes are one 128-byte-swizzled ``[32, 64]`` chunk (one descriptor for latent and rope). Stage and Q-chunk
indices get the runtime zero of the package kernel (no hoisted descriptors). Everything else (grid, masks, partials,
the epilogue) is the package kernel's.

    PYTHONPATH=$PWD python3 benchmarks/experiments/seesaw_v2.py                 # correctness (decode problems) + bench
    PYTHONPATH=$PWD python3 benchmarks/experiments/seesaw_v2.py --compile-only  # offline sm90 compile (CPU)
"""

from __future__ import annotations

import argparse
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _REPO)

import torch
import triton

from openmla.ops import decode_gluon as dg
from openmla.ops._gluon import (
    GLUON_AVAILABLE,
    TensorDescriptor,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

WG_REGS = 240
CHUNK_BYTES = 32 * 64 * 2  # one [32, 64] bf16 box

if GLUON_AVAILABLE:
    from openmla.ops.decode_gluon import _box_ok, _kv_rows, _seesaw_rescale, _zero_tail

    @gluon.jit
    def _issue_part(desc, lat_smem, rope_smem, bar, stage, r0, r1, LAT_HALF: gl.constexpr, ROPE: gl.constexpr):
        """TMA of one refill group of a stage: the 4 latent chunks of half ``LAT_HALF`` (+ the rope chunk when
        ``ROPE``) for both 32-key boxes (rows ``r0`` and ``r1``) of a 64-key tile, on barrier ``bar``."""
        n_chunks: gl.constexpr = 5 if ROPE else 4
        mbarrier.expect(bar, 2 * n_chunks * 32 * 64 * 2)
        for h in gl.static_range(2):
            row = r0 if h == 0 else r1
            lat = lat_smem.index(stage).slice(h * 32, 32, dim=0)
            for c in gl.static_range(4):
                tma.async_copy_global_to_shared(desc, [row, (LAT_HALF * 4 + c) * 64], bar,
                                                lat.slice((LAT_HALF * 4 + c) * 64, 64, dim=1))  # fmt: skip
            if ROPE:
                tma.async_copy_global_to_shared(desc, [row, 512], bar, rope_smem.index(stage).slice(h * 32, 32, dim=0))

    @gluon.jit
    def _v2_other_tile(acc, b_l, m_prev, oth_lat, oth_rope, m_smem, pready, ready_y, empty_y, ph, WG: gl.constexpr,
                       ROW_S: gl.constexpr, ROW_O: gl.constexpr):  # fmt: skip
        """P V of the other warpgroup's tile (its P over its rope columns, this warpgroup's half of its V: both in
        the other stage's Y group); releases that group to its owner."""
        OTH: gl.constexpr = 1 - WG
        mbarrier.wait(pready.index(OTH), ph)
        mbarrier.wait(ready_y.index(OTH), ph)
        m_new = m_smem.index(OTH).load(ROW_S)
        acc, b_l = _seesaw_rescale(acc, b_l, m_prev, m_new, ROW_O)
        acc = warpgroup_mma(oth_rope, oth_lat.slice(WG * 256, 256, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        gl.thread_barrier()
        mbarrier.arrive(empty_y.index(OTH), count=1)
        return acc, b_l, m_new

    @gluon.jit
    def _v2_wg(q, desc, q_smem, lat_smem, rope_smem, m_smem, l_smem, ready_x, ready_y, empty_y, pready, qbar, lbar,
               block_table, seq_lens, query_start_loc, work_req, work_split, num_splits, split_len, out, lse, o_part,
               lse_part, scale_log2, v_scale, stride_q_t, stride_q_h, stride_bt_b, stride_o_t, stride_o_h, H,
               num_blocks, max_blocks, PAGE: gl.constexpr, MAX_QLEN: gl.constexpr, BLOCK_H: gl.constexpr,
               Q_PER: gl.constexpr, CAUSAL: gl.constexpr, N_HB: gl.constexpr, N_QB: gl.constexpr,
               PV_FIRST: gl.constexpr, WG: gl.constexpr):  # fmt: skip
        BLOCK_M: gl.constexpr = BLOCK_H * Q_PER
        BLOCK_N: gl.constexpr = 64
        HALF: gl.constexpr = 256
        NW: gl.constexpr = 4
        OWN: gl.constexpr = WG
        OTH: gl.constexpr = 1 - WG
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])  # fmt: skip
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF, 16])  # fmt: skip
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        COL_S: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
        COL_O: gl.constexpr = gl.SliceLayout(0, O_LAYOUT)
        LD_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
        ROW_LD: gl.constexpr = gl.SliceLayout(1, LD_LAYOUT)
        COL_LD: gl.constexpr = gl.SliceLayout(0, LD_LAYOUT)

        pid = gl.program_id(0)
        i_w = pid // (N_HB * N_QB)
        i_h = pid % N_HB
        i_q = (pid // N_HB) % N_QB
        i_b = gl.load(work_req + i_w).to(gl.int64)
        q_start = gl.load(query_start_loc + i_b)
        qlen = gl.load(query_start_loc + i_b + 1) - q_start
        L = gl.load(seq_lens + i_b)
        chunk = gl.load(split_len + i_b)
        kv_lo = gl.load(work_split + i_w) * chunk
        kv_hi = gl.minimum(L, kv_lo + chunk)
        if CAUSAL:
            kv_hi = gl.minimum(kv_hi, L - qlen + gl.minimum(i_q * Q_PER + Q_PER, qlen))
        n_tiles = gl.cdiv(gl.maximum(kv_hi - kv_lo, 0), BLOCK_N)
        n_own = gl.maximum(n_tiles - WG + 1, 0) // 2
        p_bt = block_table + i_b * stride_bt_b

        if n_own > 0:  # the first own tile, both groups
            n0 = kv_lo + WG * BLOCK_N
            r0 = _kv_rows(p_bt, n0, kv_hi, max_blocks, num_blocks, PAGE, 0)
            r1 = _kv_rows(p_bt, n0, kv_hi, max_blocks, num_blocks, PAGE, 1)
            _issue_part(desc, lat_smem, rope_smem, ready_x.index(OWN), OWN, r0, r1, OWN, False)
            _issue_part(desc, lat_smem, rope_smem, ready_y.index(OWN), OWN, r0, r1, OTH, True)

        o_m = gl.arange(0, BLOCK_M, layout=ROW_LD)
        o_t = i_q * Q_PER + o_m // BLOCK_H
        o_h = i_h * BLOCK_H + o_m % BLOCK_H
        m_ld = gl.expand_dims((o_t < qlen) & (o_h < H), 1)
        p_q = q + gl.expand_dims((q_start + o_t).to(gl.int64) * stride_q_t + o_h * stride_q_h, 1)
        o_c = gl.expand_dims(gl.arange(0, 64, layout=COL_LD), 0)
        for c in gl.static_range(9):
            if c % 2 == WG:
                b_q = gl.load(p_q + (c * 64 + o_c), mask=m_ld, other=0.0)
                q_smem.index(c).store(b_q.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(qbar, count=1)
        mbarrier.wait(qbar, 0)

        o_ms = gl.arange(0, BLOCK_M, layout=ROW_S)
        o_ts = i_q * Q_PER + o_ms // BLOCK_H
        if CAUSAL:
            limit = L - qlen + o_ts + 1
        else:
            limit = gl.full([BLOCK_M], 0, gl.int32, ROW_S) + L
        limit = gl.expand_dims(gl.minimum(limit, kv_hi), 1)
        m_prev = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW_S)
        b_l = gl.zeros([BLOCK_M], gl.float32, ROW_S)
        acc = gl.zeros([BLOCK_M, HALF], gl.float32, O_LAYOUT)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT)
        key0 = gl.expand_dims(gl.arange(0, BLOCK_N, layout=COL_S), 0)

        for k in range(n_own):
            t = WG + 2 * k
            n0 = kv_lo + t * BLOCK_N
            z = (L >> 31) & k  # a runtime 0 (seq_lens >= 0): descriptors rebuilt per iteration, not hoisted
            own_lat = lat_smem.index(OWN + z)
            own_rope = rope_smem.index(OWN + z)
            oth_lat = lat_smem.index(OTH + z)
            oth_rope = rope_smem.index(OTH + z)
            # 1. (PV_FIRST) the other warpgroup's tile t - 1: its P (over its rope columns) x this warpgroup's half
            #    of its V (both in the other stage's Y group), released at once
            if PV_FIRST:
                if t >= 1:
                    acc, b_l, m_prev = _v2_other_tile(acc, b_l, m_prev, oth_lat, oth_rope, m_smem, pready, ready_y,
                                                      empty_y, (k - 1 + WG) & 1, WG, ROW_S, ROW_O)  # fmt: skip
            # 2. S_t: the X chunks (this warpgroup's half), then the Y chunks (the other half and the rope)
            ok0 = _box_ok(p_bt, n0, kv_hi, max_blocks, num_blocks, PAGE)
            ok1 = _box_ok(p_bt, n0 + 32, kv_hi, max_blocks, num_blocks, PAGE)
            mbarrier.wait(ready_x.index(OWN), k & 1)
            b_s = s_zero
            for c in gl.static_range(4):
                b_s = warpgroup_mma(q_smem.index(OWN * 4 + c + z),
                                    own_lat.slice((OWN * 4 + c) * 64, 64, dim=1).permute((1, 0)), b_s,
                                    use_acc=c > 0, is_async=True)  # fmt: skip
            mbarrier.wait(ready_y.index(OWN), k & 1)
            for c in gl.static_range(4):
                b_s = warpgroup_mma(q_smem.index(OTH * 4 + c + z),
                                    own_lat.slice((OTH * 4 + c) * 64, 64, dim=1).permute((1, 0)), b_s,
                                    is_async=True)  # fmt: skip
            b_s = warpgroup_mma(q_smem.index(8 + z), own_rope.permute((1, 0)), b_s, is_async=True)
            b_s = warpgroup_mma_wait(0, deps=(b_s,))
            if not PV_FIRST:  # 1. after the scores: they run while the other warpgroup is in its softmax
                if t >= 1:
                    acc, b_l, m_prev = _v2_other_tile(acc, b_l, m_prev, oth_lat, oth_rope, m_smem, pready, ready_y,
                                                      empty_y, (k - 1 + WG) & 1, WG, ROW_S, ROW_O)  # fmt: skip
            if n0 + BLOCK_N > L:  # rows past the sequence: zeros before any P V reads them (S masks them)
                _zero_tail(own_lat, n0, L, BLOCK_N, NW)
            # 3. softmax of S_t, P_t over the rope columns, M_t
            lo = gl.where(ok0, n0, n0 + 32)
            hi = gl.minimum(limit, gl.where(ok1, n0 + BLOCK_N, n0 + 32))
            key = key0 + n0
            b_s = gl.where((key >= lo) & (key < hi), b_s * scale_log2, float("-inf"))
            m_new = gl.maximum(m_prev, gl.max(b_s, axis=1))
            acc, b_l = _seesaw_rescale(acc, b_l, m_prev, m_new, ROW_O)
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            b_p = gl.exp2(b_s - gl.expand_dims(m_use, 1))
            b_l = b_l + gl.sum(b_p, axis=1)
            m_prev = m_new
            own_rope.store(b_p.to(gl.bfloat16))
            m_smem.index(OWN).store(m_new)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(pready.index(OWN), count=1)
            # 4. own P_t V_t
            acc = warpgroup_mma(own_rope, own_lat.slice(WG * HALF, HALF, dim=1), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            gl.thread_barrier()  # every warp's P V is done before one thread refills the stage
            # 5. refill with tile t + 2: X now (only this warpgroup read it), Y after the other's P_t V_t
            if k + 1 < n_own:
                r0 = _kv_rows(p_bt, n0 + 2 * BLOCK_N, kv_hi, max_blocks, num_blocks, PAGE, 0)
                r1 = _kv_rows(p_bt, n0 + 2 * BLOCK_N, kv_hi, max_blocks, num_blocks, PAGE, 1)
                _issue_part(desc, lat_smem, rope_smem, ready_x.index(OWN), OWN, r0, r1, OWN, False)
                mbarrier.wait(empty_y.index(OWN), k & 1)
                _issue_part(desc, lat_smem, rope_smem, ready_y.index(OWN), OWN, r0, r1, OTH, True)

        t = WG + 2 * n_own - 1  # the other warpgroup's tile after this warpgroup's last one (at most one)
        if (t >= 0) & (t < n_tiles):
            ph_oth = (n_own - 1 + WG) & 1
            mbarrier.wait(pready.index(OTH), ph_oth)
            mbarrier.wait(ready_y.index(OTH), ph_oth)
            m_new = m_smem.index(OTH).load(ROW_S)
            acc, b_l = _seesaw_rescale(acc, b_l, m_prev, m_new, ROW_O)
            m_prev = m_new
            acc = warpgroup_mma(rope_smem.index(OTH), lat_smem.index(OTH).slice(WG * HALF, HALF, dim=1), acc,
                                is_async=True)  # fmt: skip
            acc = warpgroup_mma_wait(0, deps=(acc,))

        VEC: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        l_smem.index(WG).store(gl.convert_layout(b_l, VEC))
        gl.thread_barrier()
        mbarrier.arrive(lbar, count=1)
        mbarrier.wait(lbar, 0)
        b_l = b_l + gl.convert_layout(l_smem.index(OTH).load(VEC), ROW_S)

        n_split = gl.load(num_splits + i_b)
        empty_r = b_l == 0.0
        b_lse = gl.where(empty_r, float("-inf"),
                         (m_prev + gl.log2(gl.where(empty_r, 1.0, b_l))) * 0.6931471805599453)  # fmt: skip
        b_inv = gl.where(empty_r, 0.0, v_scale / gl.where(empty_r, 1.0, b_l))
        b_o = acc * gl.expand_dims(gl.convert_layout(b_inv, ROW_O), 1)
        o_mo = gl.arange(0, BLOCK_M, layout=ROW_O)
        o_to = i_q * Q_PER + o_mo // BLOCK_H
        o_ho = i_h * BLOCK_H + o_mo % BLOCK_H
        m_o = gl.expand_dims((o_to < qlen) & (o_ho < H), 1)
        o_v = gl.expand_dims(WG * HALF + gl.arange(0, HALF, layout=COL_O), 0)
        o_hs = i_h * BLOCK_H + o_ms % BLOCK_H
        m_s = (o_ts < qlen) & (o_hs < H) & (WG == 0)
        if n_split == 1:
            row = (q_start + o_to).to(gl.int64)
            p_o = out + gl.expand_dims(row * stride_o_t + o_ho * stride_o_h, 1) + o_v
            gl.store(p_o, b_o.to(out.dtype.element_ty), mask=m_o)
            gl.store(lse + (q_start + o_ts).to(gl.int64) * H + o_hs, b_lse, mask=m_s)
        else:
            part = (i_w.to(gl.int64) * MAX_QLEN + o_to) * H + o_ho
            gl.store(o_part + gl.expand_dims(part * 512, 1) + o_v, b_o, mask=m_o)
            gl.store(lse_part + (i_w.to(gl.int64) * MAX_QLEN + o_ts) * H + o_hs, b_lse, mask=m_s)

    @gluon.jit
    def _seesaw_v2_kernel(
        q, desc, block_table, seq_lens, query_start_loc, work_req, work_split, num_splits, split_len, out, lse,
        o_part, lse_part, scale_log2, v_scale, stride_q_t, stride_q_h, stride_bt_b, stride_o_t, stride_o_h, H,
        num_blocks, max_blocks,
        PAGE: gl.constexpr, MAX_QLEN: gl.constexpr, BLOCK_H: gl.constexpr, Q_PER: gl.constexpr,
        CAUSAL: gl.constexpr, WG_REGS_: gl.constexpr, N_HB: gl.constexpr, N_QB: gl.constexpr,
        PV_FIRST: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        BLOCK_M: gl.constexpr = BLOCK_H * Q_PER
        gl.static_assert(BLOCK_M == 64, "64 rows per program")
        gl.static_assert(num_warps == 4, "warpgroup 0 is the default partition")
        Q_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        VEC_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])

        pid = gl.program_id(0)
        i_w = pid // (N_HB * N_QB)
        i_q = (pid // N_HB) % N_QB
        i_b = gl.load(work_req + i_w)
        if i_b < 0:
            return
        i_b = i_b.to(gl.int64)
        q_start = gl.load(query_start_loc + i_b)
        qlen = gl.load(query_start_loc + i_b + 1) - q_start
        if i_q * Q_PER >= qlen:
            return

        q_smem = gl.allocate_shared_memory(gl.bfloat16, [9, BLOCK_M, 64], Q_SMEM)
        lat_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 512], desc.layout)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], desc.layout)
        m_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], VEC_SMEM)
        l_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], VEC_SMEM)
        ready_x = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ready_y = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty_y = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        pready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        sync = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(2):
            mbarrier.init(ready_x.index(st), count=1)
            mbarrier.init(ready_y.index(st), count=1)
            mbarrier.init(empty_y.index(st), count=1)
            mbarrier.init(pready.index(st), count=1)
            mbarrier.init(sync.index(st), count=2)
        fence_async_shared()

        gl.warp_specialize([
            (_v2_wg, (q, desc, q_smem, lat_smem, rope_smem, m_smem, l_smem, ready_x, ready_y, empty_y, pready,
                      sync.index(0), sync.index(1), block_table, seq_lens, query_start_loc, work_req, work_split,
                      num_splits, split_len, out, lse, o_part, lse_part, scale_log2, v_scale, stride_q_t, stride_q_h,
                      stride_bt_b, stride_o_t, stride_o_h, H, num_blocks, max_blocks, PAGE, MAX_QLEN, BLOCK_H, Q_PER,
                      CAUSAL, N_HB, N_QB, PV_FIRST, 0)),
            (_v2_wg, (q, desc, q_smem, lat_smem, rope_smem, m_smem, l_smem, ready_x, ready_y, empty_y, pready,
                      sync.index(0), sync.index(1), block_table, seq_lens, query_start_loc, work_req, work_split,
                      num_splits, split_len, out, lse, o_part, lse_part, scale_log2, v_scale, stride_q_t, stride_q_h,
                      stride_bt_b, stride_o_t, stride_o_h, H, num_blocks, max_blocks, PAGE, MAX_QLEN, BLOCK_H, Q_PER,
                      CAUSAL, N_HB, N_QB, PV_FIRST, 1)),
        ], [4], [WG_REGS_])  # fmt: skip

        for st in gl.static_range(2):
            mbarrier.invalidate(ready_x.index(st))
            mbarrier.invalidate(ready_y.index(st))
            mbarrier.invalidate(empty_y.index(st))
            mbarrier.invalidate(pready.index(st))
            mbarrier.invalidate(sync.index(st))


def seesaw_v2_split(q, kv_cache, block_table, seq_lens, query_start_loc, plan, out, lse, scale_log2, v_scale, causal,
                    pv_first=True):  # fmt: skip
    """Launch the v2 split kernel (bf16 cache, page a multiple of 32); same contract as ``mla_decode_split_gluon``.
    ``pv_first``: the other warpgroup's P V before this warpgroup's scores (False: after them)."""
    if kv_cache.dtype != torch.bfloat16:
        raise ValueError("seesaw v2 takes a bf16 cache")
    H = q.shape[1]
    num_blocks, page, _ = kv_cache.shape
    block_h, q_per = dg.gluon_decode_config(H, plan.max_query_len)
    kv2d = kv_cache.as_strided((num_blocks * page, dg.D_QK), (kv_cache.stride(1), 1))
    desc = TensorDescriptor(kv2d, [num_blocks * page, dg.D_QK], [kv_cache.stride(1), 1], [32, 64], dg._kv_layout())
    n_hb, n_qb = triton.cdiv(H, block_h), triton.cdiv(plan.max_query_len, q_per)
    _seesaw_v2_kernel[(plan.capacity * n_hb * n_qb,)](
        q, desc, block_table, seq_lens, query_start_loc, plan.work_req, plan.work_split, plan.num_splits,
        plan.split_len, out, lse, plan.o_part, plan.lse_part, scale_log2, v_scale, q.stride(0), q.stride(1),
        block_table.stride(0), out.stride(0), out.stride(1), H, num_blocks, block_table.shape[1],
        PAGE=page, MAX_QLEN=plan.max_query_len, BLOCK_H=block_h, Q_PER=q_per, CAUSAL=causal, WG_REGS_=WG_REGS,
        N_HB=n_hb, N_QB=n_qb, PV_FIRST=pv_first, num_warps=4,
    )  # fmt: skip


def compile_only() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from seesaw_debug import _PTR, _nvmma, ptxas_info
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from openmla.utils.sm90_report import resource_report

    fn = _seesaw_v2_kernel
    ok = True
    for block_h, causal, pv_first in ((64, False, True), (16, True, True), (64, False, False), (16, True, False)):
        cons = dict(PAGE=64, MAX_QLEN=4, BLOCK_H=block_h, Q_PER=64 // block_h, CAUSAL=causal, WG_REGS_=WG_REGS,
                    N_HB=2, N_QB=1, PV_FIRST=pv_first, num_warps=4)  # fmt: skip
        sig, attrs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in cons:
                sig[name] = "constexpr"
            elif name == "desc":
                sig[name] = f"tensordesc<bf16[32, 64],{_nvmma(128, 16)}>"
            elif name in _PTR:
                sig[name] = _PTR[name]
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif name in ("scale_log2", "v_scale"):
                sig[name] = "fp32"
            else:
                sig[name] = "i32"
        k = triton.compile(GluonASTSource(fn, sig, constexprs=cons, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})  # fmt: skip
        r = resource_report(k)
        px = ptxas_info(k.asm["ptx"])
        smem = r["shared"] + r["static_shared"]
        line_ok = r["wgmma"] > 0 and r["tma"] > 0 and r["regs"] <= 255 and smem <= dg.SMEM_LIMIT
        ok &= line_ok
        print(f"BLOCK_H {block_h} CAUSAL {int(causal)} PV_FIRST {int(pv_first)} | regs {r['regs']} | spill {px['spill']} | stack {r['stack']} "
              f"| shared {smem} | wgmma {r['wgmma']} tma {r['tma']} | setmaxnreg {r['setmaxnreg']} "
              f"| {'ok' if line_ok else 'FAIL'}")  # fmt: skip
    return 0 if ok else 1


def run_gpu() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import itertools

    import openmla
    from bench_decode_gluon import make_problem
    from common import bench_us
    from openmla.ops.decode import _mla_decode_reduce
    from openmla.reference import mla_decode_ref
    from openmla.utils.testing import TOLERANCES, assert_close

    dev = torch.device("cuda")
    scale = 576**-0.5
    l2e = 1.4426950408889634
    torch.manual_seed(0)

    def batch(heads, qlens, lens, page=64):
        B = len(lens)
        W = max(1, -(-max(lens) // page)) + 1
        nb = B * W + 3
        cache = torch.randn(nb, page, 576, device=dev).to(torch.bfloat16)
        bt = torch.randperm(nb, device=dev)[: B * W].view(B, W).int()
        used = torch.zeros(nb * page, dtype=torch.bool, device=dev)
        for b, n in enumerate(lens):
            pos = torch.arange(n, device=dev)
            used[bt[b, pos // page].long() * page + pos % page] = True
        cache.view(-1, 576)[~used] = float("nan")
        sl = torch.tensor(lens, dtype=torch.int32, device=dev)
        qsl = torch.tensor([0] + list(itertools.accumulate(qlens)), dtype=torch.int32, device=dev)
        q = torch.randn(int(qsl[-1]), heads, 576, device=dev).to(torch.bfloat16)
        return q, cache, bt, sl, qsl

    fails = {True: 0, False: 0}  # per order (pv_first)
    lens_sets = {"ragged": [4096, 0, 3, 8191, 1000, 33, 2048, 17],
                 "tiles": [0, 1, 31, 32, 33, 63, 64, 65, 127, 128, 129, 191, 192, 193, 256, 257, 320]}  # fmt: skip
    for heads, qlen, causal, lset, page, num_sms in [
        (16, 1, True, "ragged", 64, None), (128, 1, False, "ragged", 64, None), (32, 2, True, "ragged", 64, None),
        (16, 4, True, "tiles", 32, None), (128, 1, True, "tiles", 64, None), (128, 2, True, "ragged", 64, 4),
        (64, 1, False, "ragged", 64, 132),
    ]:  # fmt: skip
        lens = lens_sets[lset]
        q, cache, bt, sl, qsl = batch(heads, [qlen] * len(lens), lens, page)
        plan = openmla.plan_decode(sl, qsl, heads, num_sms=num_sms)
        ref_o, ref_l = mla_decode_ref(q, cache, bt, sl, qsl, scale, causal=causal)
        for pv_first in (True, False):
            out = torch.full((q.shape[0], heads, 512), float("nan"), dtype=q.dtype, device=dev)
            lse = torch.full((q.shape[0], heads), float("nan"), dtype=torch.float32, device=dev)
            plan.o_part.fill_(float("nan"))
            plan.lse_part.fill_(float("nan"))
            tag = (f"{'pv-first' if pv_first else 'qk-first'} h{heads} q{qlen} {'causal' if causal else 'full'} "
                   f"{lset} page {page} sms {num_sms}")  # fmt: skip
            try:
                seesaw_v2_split(q, cache, bt, sl, qsl, plan, out, lse, scale * l2e, 1.0, causal, pv_first)
                _mla_decode_reduce(qsl, plan, out, lse, 512)
                assert not torch.isnan(out).any(), "NaN in out"
                assert_close("out", ref_o, out, *TOLERANCES[torch.bfloat16])
                assert_close("lse", ref_l, lse, 1e-3, 1e-3, 1e-6)
                print(f"PASS {tag}", flush=True)
            except Exception as exc:  # noqa: BLE001
                fails[pv_first] += 1
                print(f"FAIL {tag}: {str(exc).splitlines()[0][:200]}", flush=True)
                if "illegal" in str(exc).lower():
                    return 1
    orders = [o for o in (True, False) if not fails[o]]
    print(f"# failures: pv-first {fails[True]}, qk-first {fails[False]}; timing the orders that passed")
    if not orders:
        return 1
    print("# split kernel alone, CUDA-graph median (us) and TFLOPS; same plan for every kernel")
    for h, b, s, qlen in [(128, 128, 8192, 1), (128, 128, 8192, 2), (32, 128, 8192, 1), (128, 1, 32768, 1)]:

        q, cache, bt, sl, qsl = make_problem(h, b, s, qlen, 2.0)
        plan = openmla.plan_decode(sl, qsl, h, max_query_len=qlen, max_seq_len=s)
        out = torch.empty(q.shape[0], h, 512, dtype=torch.bfloat16, device=dev)
        lse = torch.empty(q.shape[0], h, dtype=torch.float32, device=dev)
        flops = 2.0 * q.shape[0] * h * s * (576 + 512)
        row = []
        for name in ["ws", "seesaw"] + [("v2-pv-first" if o else "v2-qk-first") for o in orders]:
            if name.startswith("v2"):

                def fn(pv_first=name == "v2-pv-first"):
                    seesaw_v2_split(q, cache, bt, sl, qsl, plan, out, lse, scale * l2e, 1.0, True, pv_first)
            else:

                def fn(name=name):
                    dg.mla_decode_split_gluon(q, cache, bt, sl, qsl, plan, out, lse, scale * l2e, 1.0, True, 512,
                                              variant=name)  # fmt: skip

            us = bench_us(fn)
            row.append(f"{name} {us:8.1f} us {flops / us / 1e6:6.1f} TF")
        print(f"h{h} b{b} s{s} q{qlen} | " + " | ".join(row), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    if not GLUON_AVAILABLE:
        print("seesaw_v2: triton.experimental.gluon is not available")
        return 0
    if args.compile_only:
        return compile_only()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("seesaw_v2: needs an sm90 GPU (offline check: --compile-only)")
        return 0
    return run_gpu()


if __name__ == "__main__":
    sys.exit(main())
