"""``seesaw-pair-el`` on 32-key tiles in a ring of four stages (H200 experiment, prototype; not part of openmla).

Run 116 (``mma_energy.py``'s ring) kept the tensor pipe 88% busy with four 32-key stages where two 64-key stages (the
seesaw kernels' ring, same 144 KB) kept 64%: a refill then has a whole pair of tiles to land in. This is that ring
in the pair schedule, for the regular plan only (one program per work item and head / query block; no spans, no
trace). Pair ``i`` is tiles a (warpgroup 0) and b (warpgroup 1) at keys ``kv_lo + 64 i`` and ``+ 32``, in stages
``2 (i % 2)`` and ``2 (i % 2) + 1``. Each warpgroup runs el's order per pair (lazy row max, P at its own row max,
its own P V from registers, the other's from the stage's rope columns), refills the stage halves it read last with
the tiles of pair ``i + 2`` (their rows looked up a pair ahead), and computes the scores of its tile of pair ``i + 1``,
whose stages were refilled a pair earlier. The pair loop is unrolled by two so that every stage index is a
compile-time constant (plus a runtime zero, as el's). The final rows go out from the MMA layout (``_store_result``).

    PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/experiments/pair32.py      # A/B against seesaw-pair-el
    AB_SHAPES="128,128,8192,2" AB_ROUNDS=3 ...

Per shape (``proto_ab.ab_against_el``): the largest differences from seesaw-pair-el's outputs (the same plan, split
kernels only: final rows, LSE and the partials of split requests) and both kernels' times alternating in one process.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks"), os.path.dirname(os.path.abspath(__file__))]

from openmla.ops._gluon import (  # noqa: E402
    GLUON_AVAILABLE,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

SHAPES = [(128, 128, 8192, 1), (128, 128, 8192, 2)]

if GLUON_AVAILABLE:
    from proto_ab import _program_has_rows
    from openmla.ops.decode_gluon_seesaw import (
        _lazy_max,
        _pair_qk_half,
        _pair_rescale,
        _pair_row_max,
        _pair_signal,
        _seesaw_issue_q,
        _seesaw_item,
        _seesaw_limit,
        _seesaw_wait_q,
        _sum_row_sums,
    )
    from openmla.ops.decode_gluon_tiles import _box_ok, _kv_rows, _store_result, _zero_tail

    @gluon.jit
    def _p32_issue(lat_desc, rope_desc, lat_smem, rope_smem, bar, STAGE: gl.constexpr, z, row,
                   LAT_HALF: gl.constexpr, ROPE: gl.constexpr):  # fmt: skip
        """One refill group of a 32-key stage: latent half ``LAT_HALF`` (+ the rope columns) of the tile at TMA
        row ``row``, on ``bar``."""
        mbarrier.expect(bar, (5 if ROPE else 4) * 32 * 64 * 2)
        tma.async_copy_global_to_shared(lat_desc, [row, LAT_HALF * 256], bar,
                                        lat_smem.index(STAGE + z).slice(LAT_HALF * 256, 256, dim=1))  # fmt: skip
        if ROPE:
            tma.async_copy_global_to_shared(rope_desc, [row, 512], bar, rope_smem.index(STAGE + z))

    @gluon.jit
    def _p32_pair(i, b_s, acc, b_l, m_run, ok, ra1, rb1, ra2, rb2, lat_desc, rope_desc, q_smem, lat_smem, rope_smem,
                  m_smem, ready_l, ready_r, m_ready, p_ready, p_bt, kv_lo, kv_hi, L, n_pairs, limit, lim_lo, key0,
                  scale_log2, num_blocks, max_blocks, PAGE: gl.constexpr, PAR: gl.constexpr,
                  WG: gl.constexpr):  # fmt: skip
        """Pair ``i`` (``i % 2 == PAR``) for warpgroup ``WG``; ``b_s``: the scores of its tile, ``ok``: that tile's
        box is valid, ``ra1`` / ``rb1`` and ``ra2`` / ``rb2``: the TMA rows of pairs i + 1 and i + 2. Returns the
        next tile's scores, the state and the rows shifted by a pair."""
        O_LAYOUT: gl.constexpr = acc.type.layout
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
        ROW_S: gl.constexpr = m_run.type.layout
        P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
        P_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
        SA: gl.constexpr = 2 * PAR
        SB: gl.constexpr = 2 * PAR + 1
        z = (L >> 31) & i  # a runtime zero: the operand descriptors are rebuilt per pair, not hoisted
        lat_a = lat_smem.index(SA + z)
        lat_b = lat_smem.index(SB + z)
        p_a = rope_smem.index(SA + z)._reinterpret(gl.bfloat16, [64, 32], P_SMEM)  # P over the rope columns
        p_b = rope_smem.index(SB + z)._reinterpret(gl.bfloat16, [64, 32], P_SMEM)
        n0 = kv_lo + i * 64
        my_n0 = n0 + 32 * WG
        b_s, row_max = _pair_row_max(b_s, ok, ok, my_n0, limit, lim_lo, key0, scale_log2, True)
        refill = i + 2 < n_pairs
        if WG == 0:
            m_a = _lazy_max(m_run, row_max)
            m_smem.index(0).store(m_a)
            _pair_signal(m_ready.index(0), 0, False)
            acc, b_l = _pair_rescale(acc, b_l, m_run, m_a, ROW_O, True)
            m_use = gl.where(m_a == float("-inf"), 0.0, m_a)
            b_p = gl.exp2(b_s * scale_log2 - gl.expand_dims(m_use, 1))
            b_l = b_l + gl.sum(b_p, axis=1)
            p_bf = b_p.to(gl.bfloat16)
            if my_n0 + 32 > L:  # rows past the sequence: zeros before any P V reads them
                _zero_tail(lat_a, my_n0, L, 32, 4)
            p_a.store(p_bf)
            fence_async_shared()
            _pair_signal(p_ready.index(0), 0, False)
            p_op = gl.convert_layout(p_bf, P_LAYOUT)
            acc = warpgroup_mma(p_op, lat_a.slice(0, 256, dim=1), acc, is_async=True)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
            if refill:  # stage SA's L half: warpgroup 0 read it last
                gl.thread_barrier()
                _p32_issue(lat_desc, rope_desc, lat_smem, rope_smem, ready_l.index(SA), SA, z, ra2, 0, False)
            mbarrier.wait(m_ready.index(1), PAR)
            m_b = m_smem.index(1).load(ROW_S)
            acc, b_l = _pair_rescale(acc, b_l, m_a, m_b, ROW_O, True)
            mbarrier.wait(p_ready.index(1), PAR)
            acc = warpgroup_mma(p_b, lat_b.slice(0, 256, dim=1), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            if refill:  # stage SB's L half and rope columns (P_b): warpgroup 0 read them last
                gl.thread_barrier()
                _p32_issue(lat_desc, rope_desc, lat_smem, rope_smem, ready_l.index(SB), SB, z, rb2, 0, True)
        else:
            mbarrier.wait(m_ready.index(0), PAR)
            m_a = m_smem.index(0).load(ROW_S)
            m_b = _lazy_max(m_a, row_max)
            m_smem.index(1).store(m_b)
            _pair_signal(m_ready.index(1), 0, False)
            m_use = gl.where(m_b == float("-inf"), 0.0, m_b)
            b_p = gl.exp2(b_s * scale_log2 - gl.expand_dims(m_use, 1))
            l_b = gl.sum(b_p, axis=1)
            p_bf = b_p.to(gl.bfloat16)
            if my_n0 + 32 > L:
                _zero_tail(lat_b, my_n0, L, 32, 4)
            p_b.store(p_bf)
            fence_async_shared()
            _pair_signal(p_ready.index(1), 0, False)
            acc, b_l = _pair_rescale(acc, b_l, m_run, m_a, ROW_O, True)
            mbarrier.wait(p_ready.index(0), PAR)
            acc = warpgroup_mma(p_a, lat_a.slice(256, 256, dim=1), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            if refill:  # stage SA's R half and rope columns (P_a): warpgroup 1 read them last
                gl.thread_barrier()
                _p32_issue(lat_desc, rope_desc, lat_smem, rope_smem, ready_r.index(SA), SA, z, ra2, 1, True)
            acc, b_l = _pair_rescale(acc, b_l, m_a, m_b, ROW_O, True)
            b_l = b_l + l_b
            p_op = gl.convert_layout(p_bf, P_LAYOUT)
            acc = warpgroup_mma(p_op, lat_b.slice(256, 256, dim=1), acc, is_async=True)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
            if refill:  # stage SB's R half
                gl.thread_barrier()
                _p32_issue(lat_desc, rope_desc, lat_smem, rope_smem, ready_r.index(SB), SB, z, rb2, 1, False)
        # the rows of pair i + 3's tiles (pair i + 1's refills), looked up during the wait for the next scores
        ra3 = _kv_rows(p_bt, n0 + 192, kv_hi, max_blocks, num_blocks, PAGE, 0)
        rb3 = _kv_rows(p_bt, n0 + 224, kv_hi, max_blocks, num_blocks, PAGE, 0)
        if i + 1 < n_pairs:  # this warpgroup's tile of pair i + 1 (its stage was refilled during pair i - 1)
            SN: gl.constexpr = 2 * (1 - PAR) + WG
            phn = ((i + 1) // 2) & 1
            lat_n = lat_smem.index(SN + z)
            rope_n = rope_smem.index(SN + z)
            b_s = _pair_qk_half(q_smem, lat_n, rope_n, b_s, ready_l.index(SN), phn, z, 0, WG == 1, True)
            b_s = _pair_qk_half(q_smem, lat_n, rope_n, b_s, ready_r.index(SN), phn, z, 1, WG == 0, False)
            b_s = warpgroup_mma_wait(0, deps=(b_s,))
        if WG == 0:
            ok_next = ra1 < num_blocks * PAGE
        else:
            ok_next = rb1 < num_blocks * PAGE
        return b_s, acc, b_l, m_b, ok_next, ra2, rb2, ra3, rb3

    @gluon.jit
    def _p32_wg(q, lat_desc, rope_desc, q_smem, lat_smem, rope_smem, m_smem, l_smem, ready_l, ready_r, m_ready,
                p_ready, qbar, lbar, block_table, seq_lens, query_start_loc, work_req, work_split, num_splits,
                split_len, out, lse, o_part, lse_part, scale_log2, v_scale, stride_q_t, stride_q_h, stride_bt_b,
                stride_o_t, stride_o_h, H, num_blocks, max_blocks, PAGE: gl.constexpr, MAX_QLEN: gl.constexpr,
                BLOCK_H: gl.constexpr, Q_PER: gl.constexpr, CAUSAL: gl.constexpr, N_HB: gl.constexpr,
                N_QB: gl.constexpr, WG: gl.constexpr):  # fmt: skip
        BLOCK_M: gl.constexpr = BLOCK_H * Q_PER
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 32, 16])  # fmt: skip
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 256, 16])  # fmt: skip
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        COL_S: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
        i_w, i_h, i_q, i_b, q_start, qlen, L, kv_lo, kv_hi = _seesaw_item(
            block_table, seq_lens, query_start_loc, work_req, work_split, split_len, Q_PER, CAUSAL, N_HB, N_QB)
        n_pairs = gl.cdiv(gl.maximum(kv_hi - kv_lo, 0), 64)
        p_bt = block_table + i_b * stride_bt_b
        z = (L >> 31)
        _seesaw_issue_q(q, q_smem, i_h, i_q, q_start, qlen, stride_q_t, stride_q_h, H, BLOCK_H, Q_PER, WG)
        # pairs 0 and 1 into stages 0-3: warpgroup 0 the L groups, warpgroup 1 the R groups (the rope columns go
        # with warpgroup 1's group in the a stages, with warpgroup 0's in the b stages, as the pairs refill them)
        if n_pairs > 0:
            for t in gl.static_range(2):
                row = _kv_rows(p_bt, kv_lo + 32 * t, kv_hi, max_blocks, num_blocks, PAGE, 0)
                if WG == 0:
                    _p32_issue(lat_desc, rope_desc, lat_smem, rope_smem, ready_l.index(t), t, z, row, 0, t == 1)
                else:
                    _p32_issue(lat_desc, rope_desc, lat_smem, rope_smem, ready_r.index(t), t, z, row, 1, t == 0)
        if n_pairs > 1:
            for t in gl.static_range(2, 4):
                row = _kv_rows(p_bt, kv_lo + 32 * t, kv_hi, max_blocks, num_blocks, PAGE, 0)
                if WG == 0:
                    _p32_issue(lat_desc, rope_desc, lat_smem, rope_smem, ready_l.index(t), t, z, row, 0, t == 3)
                else:
                    _p32_issue(lat_desc, rope_desc, lat_smem, rope_smem, ready_r.index(t), t, z, row, 1, t == 2)
        _seesaw_wait_q(qbar, 0)
        limit = _seesaw_limit(i_q, qlen, L, kv_hi, ROW_S, BLOCK_M, Q_PER, CAUSAL)
        m_run = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW_S)
        b_l = gl.zeros([BLOCK_M], gl.float32, ROW_S)
        acc = gl.zeros([BLOCK_M, 256], gl.float32, O_LAYOUT)
        b_s = gl.zeros([BLOCK_M, 32], gl.float32, S_LAYOUT)
        key0 = gl.expand_dims(gl.arange(0, 32, layout=COL_S), 0)
        if n_pairs > 0:  # the scores of this warpgroup's tile of pair 0 (stage WG)
            b_s = _pair_qk_half(q_smem, lat_smem.index(WG + z), rope_smem.index(WG + z), b_s, ready_l.index(WG), 0, z,
                                0, WG == 1, True)  # fmt: skip
            b_s = _pair_qk_half(q_smem, lat_smem.index(WG + z), rope_smem.index(WG + z), b_s, ready_r.index(WG), 0, z,
                                1, WG == 0, False)  # fmt: skip
            b_s = warpgroup_mma_wait(0, deps=(b_s,))
        ok = _box_ok(p_bt, kv_lo + 32 * WG, kv_hi, max_blocks, num_blocks, PAGE)
        ra1 = _kv_rows(p_bt, kv_lo + 64, kv_hi, max_blocks, num_blocks, PAGE, 0)
        rb1 = _kv_rows(p_bt, kv_lo + 96, kv_hi, max_blocks, num_blocks, PAGE, 0)
        ra2 = _kv_rows(p_bt, kv_lo + 128, kv_hi, max_blocks, num_blocks, PAGE, 0)
        rb2 = _kv_rows(p_bt, kv_lo + 160, kv_hi, max_blocks, num_blocks, PAGE, 0)
        lim_lo = gl.min(gl.min(limit, axis=1), axis=0)
        for j in range(0, n_pairs // 2):
            b_s, acc, b_l, m_run, ok, ra1, rb1, ra2, rb2 = _p32_pair(
                2 * j, b_s, acc, b_l, m_run, ok, ra1, rb1, ra2, rb2, lat_desc, rope_desc, q_smem, lat_smem, rope_smem,
                m_smem, ready_l, ready_r, m_ready, p_ready, p_bt, kv_lo, kv_hi, L, n_pairs, limit, lim_lo, key0,
                scale_log2, num_blocks, max_blocks, PAGE, 0, WG)  # fmt: skip
            b_s, acc, b_l, m_run, ok, ra1, rb1, ra2, rb2 = _p32_pair(
                2 * j + 1, b_s, acc, b_l, m_run, ok, ra1, rb1, ra2, rb2, lat_desc, rope_desc, q_smem, lat_smem,
                rope_smem, m_smem, ready_l, ready_r, m_ready, p_ready, p_bt, kv_lo, kv_hi, L, n_pairs, limit, lim_lo,
                key0, scale_log2, num_blocks, max_blocks, PAGE, 1, WG)  # fmt: skip
        if n_pairs % 2 == 1:
            b_s, acc, b_l, m_run, ok, ra1, rb1, ra2, rb2 = _p32_pair(
                n_pairs - 1, b_s, acc, b_l, m_run, ok, ra1, rb1, ra2, rb2, lat_desc, rope_desc, q_smem, lat_smem,
                rope_smem, m_smem, ready_l, ready_r, m_ready, p_ready, p_bt, kv_lo, kv_hi, L, n_pairs, limit, lim_lo,
                key0, scale_log2, num_blocks, max_blocks, PAGE, 0, WG)  # fmt: skip
        b_l = _sum_row_sums(b_l, l_smem, lbar, 0, WG)
        _store_result(acc, b_l, m_run, v_scale, num_splits, out, lse, o_part, lse_part, stride_o_t, stride_o_h, H,
                      i_w, i_h, i_q, i_b, q_start, qlen, MAX_QLEN, BLOCK_H, Q_PER, WG * 256, WG == 0)  # fmt: skip

    @gluon.jit
    def _p32_kernel(q, lat_desc, rope_desc, block_table, seq_lens, query_start_loc, work_req, work_split,
                    num_splits, split_len, out, lse, o_part, lse_part, scale_log2, v_scale, stride_q_t, stride_q_h,
                    stride_bt_b, stride_o_t, stride_o_h, H, num_blocks, max_blocks, PAGE: gl.constexpr,
                    MAX_QLEN: gl.constexpr, BLOCK_H: gl.constexpr, Q_PER: gl.constexpr, CAUSAL: gl.constexpr,
                    WG_REGS: gl.constexpr, N_HB: gl.constexpr, N_QB: gl.constexpr,
                    num_warps: gl.constexpr):  # fmt: skip
        if not _program_has_rows(work_req, query_start_loc, Q_PER, N_HB, N_QB):
            return
        Q_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        VEC_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [9, BLOCK_H * Q_PER, 64], Q_SMEM)
        lat_smem = gl.allocate_shared_memory(gl.bfloat16, [4, 32, 512], lat_desc.layout)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [4, 32, 64], rope_desc.layout)
        m_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H * Q_PER], VEC_SMEM)
        l_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H * Q_PER], VEC_SMEM)
        ready_l = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        ready_r = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        m_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        sync = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(4):
            mbarrier.init(ready_l.index(st), count=1)
            mbarrier.init(ready_r.index(st), count=1)
        for st in gl.static_range(2):
            mbarrier.init(m_ready.index(st), count=1)
            mbarrier.init(p_ready.index(st), count=1)
            mbarrier.init(sync.index(st), count=2)  # 0: Q stored (both halves); 1: row sums stored
        fence_async_shared()
        gl.warp_specialize([
            (_p32_wg, (q, lat_desc, rope_desc, q_smem, lat_smem, rope_smem, m_smem, l_smem, ready_l, ready_r, m_ready,
                       p_ready, sync.index(0), sync.index(1), block_table, seq_lens, query_start_loc, work_req,
                       work_split, num_splits, split_len, out, lse, o_part, lse_part, scale_log2, v_scale, stride_q_t,
                       stride_q_h, stride_bt_b, stride_o_t, stride_o_h, H, num_blocks, max_blocks, PAGE, MAX_QLEN,
                       BLOCK_H, Q_PER, CAUSAL, N_HB, N_QB, 0)),
            (_p32_wg, (q, lat_desc, rope_desc, q_smem, lat_smem, rope_smem, m_smem, l_smem, ready_l, ready_r, m_ready,
                       p_ready, sync.index(0), sync.index(1), block_table, seq_lens, query_start_loc, work_req,
                       work_split, num_splits, split_len, out, lse, o_part, lse_part, scale_log2, v_scale, stride_q_t,
                       stride_q_h, stride_bt_b, stride_o_t, stride_o_h, H, num_blocks, max_blocks, PAGE, MAX_QLEN,
                       BLOCK_H, Q_PER, CAUSAL, N_HB, N_QB, 1)),
        ], [4], [WG_REGS])  # fmt: skip


def launch_pair32(q, kv_cache, block_table, seq_lens, query_start_loc, plan, out, lse, scale_log2: float,
                  causal: bool = True) -> None:  # fmt: skip
    """The prototype's split kernel with ``mla_decode_split_gluon``'s arguments (bf16 cache, the regular plan,
    32-row boxes): final rows of single-split requests, partials of the others."""
    from proto_ab import launch_proto

    launch_proto(_p32_kernel, 32, q, kv_cache, block_table, seq_lens, query_start_loc, plan, out, lse, scale_log2,
                 causal)


def main() -> int:
    from proto_ab import ab_against_el

    return ab_against_el("p32", launch_pair32, SHAPES)


if __name__ == "__main__":
    sys.exit(main())
