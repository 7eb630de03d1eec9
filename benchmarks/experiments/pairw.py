"""``seesaw-pair-el`` with its refills issued by two copy warps (H200 experiment, prototype; not part of openmla).

Run 116's model of the kernel's ring (two 64-key stages, MMAs fed through it) kept the tensor pipe 70% busy with a
copy warp issuing the refills where the MMA warps issuing them kept 64% (from L2; +1% from HBM). Run 32 had tried a
copy warp in the old seesaw kernel and lost 1-3%. This is el's order (regular plan only: no spans, no trace) with
every refill moved off the warpgroups: where el's warpgroup issues a refill group (after its last MMA on that stage
half), it now arrives on that group's ``empty`` mbarrier and goes on. Two 1-warp partitions, one per warpgroup's
groups and in that warpgroup's order, wait for the release and issue the group for the next pair (their own block-id
lookups; the prologue's first tiles too). The warpgroups still look up the rows a pair ahead for their masks.

    PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/experiments/pairw.py      # A/B against seesaw-pair-el
    AB_SHAPES="128,128,8192,2" AB_ROUNDS=3 ...

Per shape (``proto_ab.ab_against_el``): the largest differences from seesaw-pair-el's outputs (the same plan, split
kernels only: final rows, LSE and the partials of split requests) and both kernels' times alternating in one process.
Run 121 (RESULTS.md): outputs identical to el's, 0.979x / 0.972x / 0.965x el's speed at h128 b16 s1000 q2 / b128 s8k
q1 / q2. Dropped.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks"), os.path.dirname(os.path.abspath(__file__))]

from openmla.ops._gluon import GLUON_AVAILABLE, fence_async_shared, gl, gluon, mbarrier  # noqa: E402
from openmla.ops._gluon import warpgroup_mma, warpgroup_mma_wait  # noqa: E402

SHAPES = [(128, 16, 1000, 2), (128, 128, 8192, 1), (128, 128, 8192, 2)]
COPY_REGS = 32  # registers of each copy warp

if GLUON_AVAILABLE:
    from proto_ab import _program_has_rows
    from openmla.ops.decode_gluon_seesaw import (
        _pair_exp,
        _pair_next_scores,
        _pair_qk_half,
        _pair_ref_max,
        _pair_rescale,
        _pair_row_max,
        _pair_rows_ahead,
        _pair_signal,
        _pair_stages,
        _seesaw_issue,
        _seesaw_issue_q,
        _seesaw_item,
        _seesaw_limit,
        _seesaw_wait_q,
        _sum_row_sums,
    )
    from openmla.ops.decode_gluon_tiles import _box_ok, _store_result, _zero_tail

    @gluon.jit
    def _pw_tail(i, b_s, q_smem, lat, rope, ready_l, ready_r, empty, o0, o1, p_bt, n0, kv_hi, max_blocks,
                 num_blocks, z, ph, PAGE: gl.constexpr, LAST: gl.constexpr, WG: gl.constexpr):  # fmt: skip
        """el's ``_pair_tail`` with the stage-1 refill released to the copy warp (group 2: stage 1's L half + rope,
        warpgroup 0; group 3: its R half, warpgroup 1) instead of issued."""
        if not LAST:
            _pair_signal(empty.index(2 + WG), 0, False)
        na0, na1, nb0, nb1 = _pair_rows_ahead(p_bt, n0 + (256 - 64 * WG), kv_hi, max_blocks, num_blocks, PAGE, LAST)
        if not LAST:
            b_s = _pair_next_scores(q_smem, lat, rope, b_s, ready_l.index(WG), ready_r.index(WG), ph ^ 1, z, WG == 1,
                                    0, 0, i, False)  # fmt: skip
        limit_rows = num_blocks * PAGE
        return b_s, o0 < limit_rows, o1 < limit_rows, na0, na1, nb0, nb1

    @gluon.jit
    def _pw_wg0(i, b_s, acc, b_l, m_run, ok0, ok1, ra0, ra1, rb0, rb1, q_smem, lat_smem, rope_smem, m_smem, ready_l,
                ready_r, m_ready, p_ready, empty, p_bt, kv_lo, kv_hi, L, limit, lim_lo, key0, scale_log2, num_blocks,
                max_blocks, PAGE: gl.constexpr, LAST: gl.constexpr):  # fmt: skip
        """Warpgroup 0, pair ``i``: el's ``_pair_wg0e`` with its refills released (group 0: stage 0's L half)."""
        O_LAYOUT: gl.constexpr = acc.type.layout
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
        ROW_S: gl.constexpr = m_run.type.layout
        P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
        z, lat0, lat1, rope0, rope1 = _pair_stages(lat_smem, rope_smem, L, i, True)
        ph = i & 1
        n0 = kv_lo + i * 128
        b_s, row_max = _pair_row_max(b_s, ok0, ok1, n0, limit, lim_lo, key0, scale_log2, True)
        m_a = _pair_ref_max(m_run, row_max, True)
        m_smem.index(0).store(m_a)
        _pair_signal(m_ready.index(0), 0, False)
        acc, b_l = _pair_rescale(acc, b_l, m_run, m_a, ROW_O, True)
        m_a_use = gl.where(m_a == float("-inf"), 0.0, m_a)
        b_p = _pair_exp(b_s, m_a_use, scale_log2, True)
        b_l = b_l + gl.sum(b_p, axis=1)
        p_bf = b_p.to(gl.bfloat16)
        if n0 + 64 > L:
            _zero_tail(lat0, n0, L, 64, 4)
        rope0.store(p_bf)
        fence_async_shared()
        _pair_signal(p_ready.index(0), 0, False)
        p_op = gl.convert_layout(p_bf, P_LAYOUT)
        acc = warpgroup_mma(p_op, lat0.slice(0, 256, dim=1), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        if not LAST:  # stage 0's L half: warpgroup 0 was its last reader
            _pair_signal(empty.index(0), 0, False)
        mbarrier.wait(m_ready.index(1), ph)
        m_b = m_smem.index(1).load(ROW_S)
        acc, b_l = _pair_rescale(acc, b_l, m_a, m_b, ROW_O, True)
        mbarrier.wait(p_ready.index(1), ph)
        acc = warpgroup_mma(rope1, lat1.slice(0, 256, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        b_s, ok0, ok1, na0, na1, nb0, nb1 = _pw_tail(i, b_s, q_smem, lat0, rope0, ready_l, ready_r, empty, ra0, ra1,
                                                     p_bt, n0, kv_hi, max_blocks, num_blocks, z, ph, PAGE, LAST, 0)
        return b_s, acc, b_l, m_b, ok0, ok1, na0, na1, nb0, nb1

    @gluon.jit
    def _pw_wg1(i, b_s, acc, b_l, m_run, ok0, ok1, ra0, ra1, rb0, rb1, q_smem, lat_smem, rope_smem, m_smem, ready_l,
                ready_r, m_ready, p_ready, empty, p_bt, kv_lo, kv_hi, L, limit, lim_lo, key0, scale_log2, num_blocks,
                max_blocks, PAGE: gl.constexpr, LAST: gl.constexpr):  # fmt: skip
        """Warpgroup 1, pair ``i``: el's ``_pair_wg1e`` with its refills released (group 1: stage 0's R half and
        rope columns)."""
        O_LAYOUT: gl.constexpr = acc.type.layout
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
        ROW_S: gl.constexpr = m_run.type.layout
        P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
        z, lat0, lat1, rope0, rope1 = _pair_stages(lat_smem, rope_smem, L, i, True)
        ph = i & 1
        n0 = kv_lo + i * 128 + 64
        b_s, row_max = _pair_row_max(b_s, ok0, ok1, n0, limit, lim_lo, key0, scale_log2, True)
        mbarrier.wait(m_ready.index(0), ph)
        m_a = m_smem.index(0).load(ROW_S)
        m_b = _pair_ref_max(m_a, row_max, True)
        m_smem.index(1).store(m_b)
        _pair_signal(m_ready.index(1), 0, False)
        m_b_use = gl.where(m_b == float("-inf"), 0.0, m_b)
        b_p = _pair_exp(b_s, m_b_use, scale_log2, True)
        l_b = gl.sum(b_p, axis=1)
        p_bf = b_p.to(gl.bfloat16)
        if n0 + 64 > L:
            _zero_tail(lat1, n0, L, 64, 4)
        rope1.store(p_bf)
        fence_async_shared()
        _pair_signal(p_ready.index(1), 0, False)
        acc, b_l = _pair_rescale(acc, b_l, m_run, m_a, ROW_O, True)
        mbarrier.wait(p_ready.index(0), ph)
        acc = warpgroup_mma(rope0, lat0.slice(256, 256, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        if not LAST:  # stage 0's R half and rope columns (P_a): warpgroup 1 was their last reader
            _pair_signal(empty.index(1), 0, False)
        acc, b_l = _pair_rescale(acc, b_l, m_a, m_b, ROW_O, True)
        b_l = b_l + l_b
        p_op = gl.convert_layout(p_bf, P_LAYOUT)
        acc = warpgroup_mma(p_op, lat1.slice(256, 256, dim=1), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        b_s, ok0, ok1, na0, na1, nb0, nb1 = _pw_tail(i, b_s, q_smem, lat1, rope1, ready_l, ready_r, empty, rb0, rb1,
                                                     p_bt, n0, kv_hi, max_blocks, num_blocks, z, ph, PAGE, LAST, 1)
        return b_s, acc, b_l, m_b, ok0, ok1, na0, na1, nb0, nb1

    @gluon.jit
    def _pw_wg(q, q_smem, lat_smem, rope_smem, m_smem, l_smem, ready_l, ready_r, m_ready, p_ready, empty, qbar,
               lbar, block_table, seq_lens, query_start_loc, work_req, work_split, num_splits, split_len, out, lse,
               o_part, lse_part, scale_log2, v_scale, stride_q_t, stride_q_h, stride_bt_b, stride_o_t, stride_o_h, H,
               num_blocks, max_blocks, PAGE: gl.constexpr, MAX_QLEN: gl.constexpr, BLOCK_H: gl.constexpr,
               Q_PER: gl.constexpr, CAUSAL: gl.constexpr, N_HB: gl.constexpr, N_QB: gl.constexpr,
               WG: gl.constexpr):  # fmt: skip
        """One warpgroup's work item (el's ``_pair_item`` on the regular plan, without its copies)."""
        BLOCK_M: gl.constexpr = BLOCK_H * Q_PER
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 64, 16])  # fmt: skip
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 256, 16])  # fmt: skip
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        COL_S: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
        i_w, i_h, i_q, i_b, q_start, qlen, L, kv_lo, kv_hi = _seesaw_item(
            block_table, seq_lens, query_start_loc, work_req, work_split, split_len, Q_PER, CAUSAL, N_HB, N_QB)
        n_pairs = gl.cdiv(gl.maximum(kv_hi - kv_lo, 0), 128)
        p_bt = block_table + i_b * stride_bt_b
        _seesaw_issue_q(q, q_smem, i_h, i_q, q_start, qlen, stride_q_t, stride_q_h, H, BLOCK_H, Q_PER, WG)
        _seesaw_wait_q(qbar, 0)
        limit = _seesaw_limit(i_q, qlen, L, kv_hi, ROW_S, BLOCK_M, Q_PER, CAUSAL)
        m_run = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW_S)
        b_l = gl.zeros([BLOCK_M], gl.float32, ROW_S)
        acc = gl.zeros([BLOCK_M, 256], gl.float32, O_LAYOUT)
        b_s = gl.zeros([BLOCK_M, 64], gl.float32, S_LAYOUT)
        key0 = gl.expand_dims(gl.arange(0, 64, layout=COL_S), 0)
        if n_pairs > 0:  # the scores of this warpgroup's first tile (stage WG), copied by the copy warps
            z = (L >> 31)
            lat = lat_smem.index(WG + z)
            rope = rope_smem.index(WG + z)
            b_s = _pair_qk_half(q_smem, lat, rope, b_s, ready_l.index(WG), 0, z, 0, WG == 1, True)
            b_s = _pair_qk_half(q_smem, lat, rope, b_s, ready_r.index(WG), 0, z, 1, WG == 0, False)
            b_s = warpgroup_mma_wait(0, deps=(b_s,))
        n_first = kv_lo + WG * 64
        ok0 = _box_ok(p_bt, n_first, kv_hi, max_blocks, num_blocks, PAGE)
        ok1 = _box_ok(p_bt, n_first + 32, kv_hi, max_blocks, num_blocks, PAGE)
        ra0, ra1, rb0, rb1 = _pair_rows_ahead(p_bt, kv_lo + 128, kv_hi, max_blocks, num_blocks, PAGE, False)
        lim_lo = gl.min(gl.min(limit, axis=1), axis=0)
        for i in range(0, n_pairs - 1):
            if WG == 0:
                b_s, acc, b_l, m_run, ok0, ok1, ra0, ra1, rb0, rb1 = _pw_wg0(
                    i, b_s, acc, b_l, m_run, ok0, ok1, ra0, ra1, rb0, rb1, q_smem, lat_smem, rope_smem, m_smem,
                    ready_l, ready_r, m_ready, p_ready, empty, p_bt, kv_lo, kv_hi, L, limit, lim_lo, key0,
                    scale_log2, num_blocks, max_blocks, PAGE, False)  # fmt: skip
            else:
                b_s, acc, b_l, m_run, ok0, ok1, ra0, ra1, rb0, rb1 = _pw_wg1(
                    i, b_s, acc, b_l, m_run, ok0, ok1, ra0, ra1, rb0, rb1, q_smem, lat_smem, rope_smem, m_smem,
                    ready_l, ready_r, m_ready, p_ready, empty, p_bt, kv_lo, kv_hi, L, limit, lim_lo, key0,
                    scale_log2, num_blocks, max_blocks, PAGE, False)  # fmt: skip
        if n_pairs > 0:
            if WG == 0:
                b_s, acc, b_l, m_run, ok0, ok1, ra0, ra1, rb0, rb1 = _pw_wg0(
                    n_pairs - 1, b_s, acc, b_l, m_run, ok0, ok1, ra0, ra1, rb0, rb1, q_smem, lat_smem, rope_smem,
                    m_smem, ready_l, ready_r, m_ready, p_ready, empty, p_bt, kv_lo, kv_hi, L, limit, lim_lo, key0,
                    scale_log2, num_blocks, max_blocks, PAGE, True)  # fmt: skip
            else:
                b_s, acc, b_l, m_run, ok0, ok1, ra0, ra1, rb0, rb1 = _pw_wg1(
                    n_pairs - 1, b_s, acc, b_l, m_run, ok0, ok1, ra0, ra1, rb0, rb1, q_smem, lat_smem, rope_smem,
                    m_smem, ready_l, ready_r, m_ready, p_ready, empty, p_bt, kv_lo, kv_hi, L, limit, lim_lo, key0,
                    scale_log2, num_blocks, max_blocks, PAGE, True)  # fmt: skip
        b_l = _sum_row_sums(b_l, l_smem, lbar, 0, WG)
        _store_result(acc, b_l, m_run, v_scale, num_splits, out, lse, o_part, lse_part, stride_o_t, stride_o_h, H,
                      i_w, i_h, i_q, i_b, q_start, qlen, MAX_QLEN, BLOCK_H, Q_PER, WG * 256, WG == 0)  # fmt: skip

    @gluon.jit
    def _pw_copier(lat_desc, rope_desc, lat_smem, rope_smem, ready_l, ready_r, empty, block_table, seq_lens,
                   query_start_loc, work_req, work_split, split_len, stride_bt_b, num_blocks, max_blocks,
                   PAGE: gl.constexpr, Q_PER: gl.constexpr, CAUSAL: gl.constexpr, N_HB: gl.constexpr,
                   N_QB: gl.constexpr, WG: gl.constexpr):  # fmt: skip
        """The copy warp of warpgroup ``WG``'s refill groups, in that warpgroup's order: pair 0's tiles, then for
        each pair ``i`` but the last, once the group is released (``empty``, phase ``i % 2``), the group's tile of
        pair ``i + 1``. Warpgroup 0's groups: stage 0's L half (0), stage 1's L half + rope (2); warpgroup 1's:
        stage 0's R half + rope (1), stage 1's R half (3)."""
        i_w, i_h, i_q, i_b, q_start, qlen, L, kv_lo, kv_hi = _seesaw_item(
            block_table, seq_lens, query_start_loc, work_req, work_split, split_len, Q_PER, CAUSAL, N_HB, N_QB)
        n_pairs = gl.cdiv(gl.maximum(kv_hi - kv_lo, 0), 128)
        p_bt = block_table + i_b * stride_bt_b
        if n_pairs > 0:
            ra0, ra1, rb0, rb1 = _pair_rows_ahead(p_bt, kv_lo, kv_hi, max_blocks, num_blocks, PAGE, False)
            if WG == 0:
                _seesaw_issue(lat_desc, rope_desc, lat_smem, rope_smem, ready_l.index(0), 0, ra0, ra1, 0, False)
                _seesaw_issue(lat_desc, rope_desc, lat_smem, rope_smem, ready_l.index(1), 1, rb0, rb1, 0, True)
            else:
                _seesaw_issue(lat_desc, rope_desc, lat_smem, rope_smem, ready_r.index(0), 0, ra0, ra1, 1, True)
                _seesaw_issue(lat_desc, rope_desc, lat_smem, rope_smem, ready_r.index(1), 1, rb0, rb1, 1, False)
        for i in range(0, n_pairs - 1):
            ra0, ra1, rb0, rb1 = _pair_rows_ahead(p_bt, kv_lo + 128 * (i + 1), kv_hi, max_blocks, num_blocks, PAGE,
                                                  False)  # fmt: skip
            ph = i & 1
            if WG == 0:
                mbarrier.wait(empty.index(0), ph)
                _seesaw_issue(lat_desc, rope_desc, lat_smem, rope_smem, ready_l.index(0), 0, ra0, ra1, 0, False)
                mbarrier.wait(empty.index(2), ph)
                _seesaw_issue(lat_desc, rope_desc, lat_smem, rope_smem, ready_l.index(1), 1, rb0, rb1, 0, True)
            else:
                mbarrier.wait(empty.index(1), ph)
                _seesaw_issue(lat_desc, rope_desc, lat_smem, rope_smem, ready_r.index(0), 0, ra0, ra1, 1, True)
                mbarrier.wait(empty.index(3), ph)
                _seesaw_issue(lat_desc, rope_desc, lat_smem, rope_smem, ready_r.index(1), 1, rb0, rb1, 1, False)

    @gluon.jit
    def _pw_kernel(q, lat_desc, rope_desc, block_table, seq_lens, query_start_loc, work_req, work_split, num_splits,
                   split_len, out, lse, o_part, lse_part, scale_log2, v_scale, stride_q_t, stride_q_h, stride_bt_b,
                   stride_o_t, stride_o_h, H, num_blocks, max_blocks, PAGE: gl.constexpr, MAX_QLEN: gl.constexpr,
                   BLOCK_H: gl.constexpr, Q_PER: gl.constexpr, CAUSAL: gl.constexpr, WG_REGS: gl.constexpr,
                   COPY_REGS: gl.constexpr, N_HB: gl.constexpr, N_QB: gl.constexpr,
                   num_warps: gl.constexpr):  # fmt: skip
        if not _program_has_rows(work_req, query_start_loc, Q_PER, N_HB, N_QB):
            return
        BLOCK_M: gl.constexpr = BLOCK_H * Q_PER
        Q_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        VEC_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [9, BLOCK_M, 64], Q_SMEM)
        lat_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 512], lat_desc.layout)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], rope_desc.layout)
        m_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], VEC_SMEM)
        l_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], VEC_SMEM)
        ready_l = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ready_r = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        m_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        sync = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(2):
            mbarrier.init(ready_l.index(st), count=1)
            mbarrier.init(ready_r.index(st), count=1)
            mbarrier.init(m_ready.index(st), count=1)
            mbarrier.init(p_ready.index(st), count=1)
            mbarrier.init(sync.index(st), count=2)  # 0: Q stored (both halves); 1: row sums stored
        for g in gl.static_range(4):
            mbarrier.init(empty.index(g), count=1)
        fence_async_shared()
        gl.warp_specialize([
            (_pw_wg, (q, q_smem, lat_smem, rope_smem, m_smem, l_smem, ready_l, ready_r, m_ready, p_ready, empty,
                      sync.index(0), sync.index(1), block_table, seq_lens, query_start_loc, work_req, work_split,
                      num_splits, split_len, out, lse, o_part, lse_part, scale_log2, v_scale, stride_q_t, stride_q_h,
                      stride_bt_b, stride_o_t, stride_o_h, H, num_blocks, max_blocks, PAGE, MAX_QLEN, BLOCK_H, Q_PER,
                      CAUSAL, N_HB, N_QB, 0)),
            (_pw_wg, (q, q_smem, lat_smem, rope_smem, m_smem, l_smem, ready_l, ready_r, m_ready, p_ready, empty,
                      sync.index(0), sync.index(1), block_table, seq_lens, query_start_loc, work_req, work_split,
                      num_splits, split_len, out, lse, o_part, lse_part, scale_log2, v_scale, stride_q_t, stride_q_h,
                      stride_bt_b, stride_o_t, stride_o_h, H, num_blocks, max_blocks, PAGE, MAX_QLEN, BLOCK_H, Q_PER,
                      CAUSAL, N_HB, N_QB, 1)),
            (_pw_copier, (lat_desc, rope_desc, lat_smem, rope_smem, ready_l, ready_r, empty, block_table, seq_lens,
                          query_start_loc, work_req, work_split, split_len, stride_bt_b, num_blocks, max_blocks, PAGE,
                          Q_PER, CAUSAL, N_HB, N_QB, 0)),
            (_pw_copier, (lat_desc, rope_desc, lat_smem, rope_smem, ready_l, ready_r, empty, block_table, seq_lens,
                          query_start_loc, work_req, work_split, split_len, stride_bt_b, num_blocks, max_blocks, PAGE,
                          Q_PER, CAUSAL, N_HB, N_QB, 1)),
        ], [4, 1, 1], [WG_REGS, COPY_REGS, COPY_REGS])  # fmt: skip


def launch_pairw(q, kv_cache, block_table, seq_lens, query_start_loc, plan, out, lse, scale_log2: float,
                 causal: bool = True) -> None:  # fmt: skip
    """The prototype's split kernel with ``mla_decode_split_gluon``'s arguments (bf16 cache, the regular plan,
    64-row boxes): final rows of single-split requests, partials of the others."""
    from proto_ab import launch_proto

    launch_proto(_pw_kernel, 64, q, kv_cache, block_table, seq_lens, query_start_loc, plan, out, lse, scale_log2,
                 causal, COPY_REGS=COPY_REGS)


def main() -> int:
    from proto_ab import ab_against_el

    return ab_against_el("pw", launch_pairw, SHAPES)


if __name__ == "__main__":
    sys.exit(main())
