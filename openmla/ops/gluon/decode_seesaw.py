"""The seesaw Gluon decode kernels for bf16 caches on Hopper (``variant="seesaw"`` and ``"pair"`` of
:func:`openmla.ops.gluon.decode.mla_decode_split_gluon`, which launches them; same grid, arguments and results as
the warp-specialised kernel there). Two 4-warp partitions, no producer warp: each warpgroup holds half of the
``[64, 512]`` fp32 output and loads its own 64-key tiles by TMA. ``seesaw``: each warpgroup computes the scores of
alternate tiles (the comment above ``_seesaw_wg``); ``pair``: FlashMLA's seesaw order over pairs of tiles (the
comment above ``_pair_wg0``), optionally on the request-spanning schedule of :mod:`openmla.ops.plan_spans`.
``docs/kernels.md`` has the design and the measurements behind it."""

from __future__ import annotations

from openmla.ops.gluon._lang import (
    GLUON_AVAILABLE,
    async_copy,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# the pair kernel's "lazy" row max (as FlashAttention 4 does): a row's reference max moves only when the row's new
# scores exceed it by more than LAZY_T (log2 units), so P <= 2^LAZY_T (in range for bf16 and the fp32 sums) and
# most tiles leave every reference max where it was: the rescale multiply of O is skipped per warp (a vote)
LAZY_T = gl.constexpr(8.0)
LOG2E = gl.constexpr(1.4426950408889634)

# ``_seesaw_rescale_lazy``'s multiply: one asm over a thread's 128 output values (operands: 128 outputs tied to the
# 128 inputs, 128 copies of the warp's vote, 128 factors), skipped with a uniform branch when the vote is 0
RESCALE_PACK = gl.constexpr(128)
RESCALE_ASM = gl.constexpr(
    "{ .reg .pred p; setp.ne.s32 p, $256, 0; @!p bra.uni LAZY_SKIP; "
    + " ".join(f"mul.f32 ${i}, ${i}, ${384 + i};" for i in range(128))
    + " LAZY_SKIP: }"
)
RESCALE_CONSTRAINTS = gl.constexpr(",".join(["=f"] * 128 + [str(i) for i in range(128)] + ["r"] * 128 + ["f"] * 128))

if GLUON_AVAILABLE:
    from openmla.ops.gluon.decode_tiles import (
        _box_ok,
        _key_limit,
        _kv_rows,
        _q_ptrs,
        _row_count,
        _store_result,
        _zero_tail,
    )

    # ---- "seesaw" kernel: two 4-warp partitions (warpgroup 0 = the default partition, warpgroup 1 a worker),
    # no producer warp. Tile t of a work item lives in stage t % 2 and belongs to warpgroup t % 2, which loads it
    # (TMA), computes its full 64-key scores S_t = Q K_t^T (m64n64 wgmmas: Q is read from shared memory once per
    # 64 keys, not once per 32 as in the ws kernel), its softmax with the running row max M_{t-1} of the other
    # warpgroup's tile, and writes P_t over the tile's rope columns (the scores are done with them) and M_t.
    # Both warpgroups add P_t V_t to their half of the output columns. Per own tile t a warpgroup
    #   1. waits for P_{t-1} / M_{t-1} of the other warpgroup's tile, rescales, issues P_{t-1} V_{t-1},
    #   2. issues S_t right behind it (it overlaps the other warpgroup's softmax of tile t - 1 or t + 1): the X
    #      chunks, then a wait for the P V alone and the release of tile t - 1's "Y" half (see 5), then the Y
    #      chunks,
    #   3. runs the softmax of S_t, writes P_t / M_t,
    #   4. adds its own P_t V_t,
    #   5. refills its stage with tile t + 2 in two TMA groups with their own barriers: X = its own half of the
    #      latent columns (only its own P V reads it: refilled at once), Y = the other half + the rope columns (P
    #      lives there; refilled once the other warpgroup's P_t V_t released it). S_{t+2} chains the X chunks
    #      first, so most of the load latency is hidden behind step 1 of the next tile.
    # Each copy moves half a latent row of a box (the compiler puts a partition-wide barrier between copies that
    # share a barrier, so few wide copies beat many narrow ones).
    # Every shared-memory buffer is indexed with a compile-time stage (own = WG, other = 1 - WG) plus a runtime
    # zero: a stage indexed with a runtime value inside these branches gave wrong wgmma operands past the first
    # k-step on the H200 (Triton 3.6 / ptxas 12.8), and purely compile-time indices let the compiler hoist every
    # operand descriptor out of the loop and spill (~350 B a thread).

    @gluon.jit
    def _seesaw_item(block_table, seq_lens, query_start_loc, work_req, work_split, split_len, num_tokens,
                     MAX_QLEN: gl.constexpr, Q_PER: gl.constexpr, CAUSAL: gl.constexpr, N_HB: gl.constexpr,
                     N_QB: gl.constexpr):  # fmt: skip
        """The program's work item, head block, query block, request, its query rows and its key range
        ``[kv_lo, kv_hi)`` (causal: cut at the block's last query token)."""
        pid = gl.program_id(0)
        i_w = pid // (N_HB * N_QB)
        i_h = pid % N_HB
        i_q = (pid // N_HB) % N_QB
        i_b = gl.load(work_req + i_w).to(gl.int64)  # >= 0: the parent returned for empty slots
        q_start, qlen = _row_count(query_start_loc, i_b, num_tokens, MAX_QLEN)
        L = gl.load(seq_lens + i_b)
        chunk = gl.load(split_len + i_b)
        kv_lo = gl.load(work_split + i_w) * chunk
        kv_hi = gl.minimum(L, kv_lo + chunk)
        if CAUSAL:  # the block's last query token sees keys < L - qlen + (its index + 1)
            kv_hi = gl.minimum(kv_hi, L - qlen + gl.minimum(i_q * Q_PER + Q_PER, qlen))
        return i_w, i_h, i_q, i_b, q_start, qlen, L, kv_lo, kv_hi

    @gluon.jit
    def _seesaw_issue_q(q, q_smem, i_h, i_q, q_start, qlen, stride_q_t, stride_q_h, H, BLOCK_H: gl.constexpr,
                        Q_PER: gl.constexpr, WG: gl.constexpr):  # fmt: skip
        """Start copying Q [64, 576] into 9 swizzled chunks (cp.async, 16 bytes a thread; rows past the query or
        the heads are zero-filled): each warpgroup copies alternate chunks; ``_seesaw_wait_q`` completes it. Issued
        before the first tiles' block ids are looked up, so that the two latencies overlap."""
        LD_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        p_q, m_ld, o_c = _q_ptrs(q, q_start, qlen, i_h, i_q, H, stride_q_t, stride_q_h, BLOCK_H, Q_PER, LD_LAYOUT)
        for c in gl.static_range(9):
            if c % 2 == WG:
                async_copy.async_copy_global_to_shared(q_smem.index(c), p_q + (c * 64 + o_c), mask=m_ld)
        async_copy.commit_group()

    @gluon.jit
    def _seesaw_wait_q(qbar, ph):
        """Wait for this warpgroup's Q copies (``_seesaw_issue_q``), then for the other warpgroup's (phase ``ph``:
        the parity of the items this program did before)."""
        async_copy.wait_group(0)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(qbar, count=1)
        mbarrier.wait(qbar, ph)

    @gluon.jit
    def _sum_row_sums(b_l, l_smem, lbar, ph, WG: gl.constexpr):
        """The row sums of both warpgroups' halves: this warpgroup's ``b_l`` plus the other's, exchanged through
        ``l_smem`` (``lbar`` phase ``ph``; every MMA and copy of both warpgroups is done once it returns)."""
        VEC: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        l_smem.index(WG).store(gl.convert_layout(b_l, VEC))
        gl.thread_barrier()
        mbarrier.arrive(lbar, count=1)
        mbarrier.wait(lbar, ph)
        return b_l + gl.convert_layout(l_smem.index(1 - WG).load(VEC), b_l.type.layout)

    @gluon.jit
    def _seesaw_finish(acc, b_l, m_run, l_smem, lbar, ph, buf, num_splits, out, lse, o_part, lse_part, v_scale,
                       stride_o_t, stride_o_h, H, i_w, i_h, i_q, i_b, q_start, qlen, MAX_QLEN: gl.constexpr,
                       BLOCK_H: gl.constexpr, Q_PER: gl.constexpr, WG: gl.constexpr):  # fmt: skip
        """Both warpgroups saw every tile at the same running max ``m_run``: the row sum is the sum of the two
        halves' sums (exchanged through ``l_smem``, ``lbar`` phase ``ph``); normalise this warpgroup's 256 output
        columns and store them (and, from warpgroup 0, the LSE) as final rows or as the work item's partial.
        ``buf``: a free ``[64, 256]`` bf16 shared buffer of this warpgroup (every MMA and copy is done once both
        warpgroups passed ``lbar``) that stages bf16 final rows (``_store_out_staged``)."""
        b_l = _sum_row_sums(b_l, l_smem, lbar, ph, WG)
        n_split = gl.load(num_splits + i_b)
        if (n_split == 1) & (out.dtype.element_ty == gl.bfloat16):
            _store_out_staged(acc, b_l, m_run, v_scale, buf, out, lse, stride_o_t, stride_o_h, H, i_h, i_q,
                              q_start, qlen, BLOCK_H, Q_PER, WG * 256, WG == 0)  # fmt: skip
        else:
            _store_result(acc, b_l, m_run, v_scale, num_splits, out, lse, o_part, lse_part, stride_o_t, stride_o_h,
                          H, i_w, i_h, i_q, i_b, q_start, qlen, MAX_QLEN, BLOCK_H, Q_PER, WG * 256,
                          WG == 0)  # fmt: skip

    @gluon.jit
    def _span_finish(acc, b_l, m_run, l_smem, lbar, ph, stage, num_splits, span_indptr, span_flags, out, lse, o_part,
                     lse_part, v_scale, stride_o_t, stride_o_h, H, it, reader, i_h, i_q, i_b, q_start, qlen,
                     MAX_QLEN: gl.constexpr, BLOCK_H: gl.constexpr, Q_PER: gl.constexpr, READERS: gl.constexpr,
                     WG: gl.constexpr, out_desc, OUT_TMA: gl.constexpr, part_desc, pbar,
                     MERGE_TMA: gl.constexpr):  # fmt: skip
        """``_seesaw_finish`` for item ``it`` of the request-spanning schedule (``SPANS``), which merges the pieces of
        a cut request itself (no reduce). ``stage``: this warpgroup's stage ``[64, 512]`` (free: every MMA and copy is
        done once both warpgroups passed ``lbar``).
        - A request in one piece: the final rows, staged through the stage's latent half this warpgroup refills for
          the next item (``_store_out_staged``).
        - Another piece than the request's last: its partial (normalised fp32, the LSE from both warpgroups) into
          ``o_part`` / ``lse_part``, then this warpgroup's 128 threads count themselves into its flag
          (``span_flags[(it * READERS + reader) * 2 + WG]``, release at GPU scope).
        - The request's last piece: its accumulator goes to the stage as fp32 (the program's last item: nothing is
          copied there any more); for each other piece it waits until the flag reads 128 (acquire), resets it to 0
          for the next launch and adds the partial, weighted by the LSEs, 64 columns at a time; then the final rows.
        The program runs its group's items last to first, so a request's last piece is its group's last item and the
        other pieces are the first items of lower groups, whose programs (lower program ids, started no later) do
        not wait before them: no circular wait. ``MERGE_TMA`` (a block whose rows all exist): the last piece keeps its
        accumulator in registers and copies each other piece's partial by TMA into its stage (``_span_merge_tma``)."""
        VEC: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        b_l = _sum_row_sums(b_l, l_smem, lbar, ph, WG)
        first = gl.load(span_indptr + i_b)
        last = gl.load(span_indptr + i_b + 1) - 1
        zero = gl.zeros([128], gl.int32, VEC)  # one flag access per thread of the warpgroup
        if it < last:
            _store_result(acc, b_l, m_run, v_scale, num_splits, out, lse, o_part, lse_part, stride_o_t, stride_o_h, H,
                          it, i_h, i_q, i_b, q_start, qlen, MAX_QLEN, BLOCK_H, Q_PER, WG * 256, True)  # fmt: skip
            gl.atomic_add(span_flags + ((it * READERS + reader) * 2 + WG) + zero, zero + 1, sem="release", scope="gpu")
        elif first == last:
            buf = stage.slice(WG * 256, 256, dim=1)
            if OUT_TMA:  # (the next item's copies into this half wait for the store: tma.store_wait)
                if (i_q * Q_PER + Q_PER <= qlen) & (i_h * BLOCK_H + BLOCK_H <= H):  # every row of the block exists
                    _store_out_tma(acc, b_l, m_run, v_scale, buf, out_desc, lse, H, i_h, i_q, q_start, BLOCK_H, Q_PER,
                                   WG * 256, WG == 0)  # fmt: skip
                else:
                    _store_out_staged(acc, b_l, m_run, v_scale, buf, out, lse, stride_o_t, stride_o_h, H, i_h, i_q,
                                      q_start, qlen, BLOCK_H, Q_PER, WG * 256, WG == 0)  # fmt: skip
            else:
                _store_out_staged(acc, b_l, m_run, v_scale, buf, out, lse, stride_o_t, stride_o_h, H, i_h, i_q,
                                  q_start, qlen, BLOCK_H, Q_PER, WG * 256, WG == 0)  # fmt: skip
        elif MERGE_TMA:
            if (i_q * Q_PER + Q_PER <= qlen) & (i_h * BLOCK_H + BLOCK_H <= H):  # every row of the block exists
                acc, b_l, m_run = _span_merge_tma(acc, b_l, m_run, part_desc, pbar, stage, lse_part, span_flags,
                                                  v_scale, H, i_h, i_q, reader, first, last, MAX_QLEN, BLOCK_H, Q_PER,
                                                  READERS, WG)  # fmt: skip
                buf = stage.slice(WG * 256, 256, dim=1)
                if OUT_TMA:
                    _store_out_tma(acc, b_l, m_run, v_scale, buf, out_desc, lse, H, i_h, i_q, q_start, BLOCK_H, Q_PER,
                                   WG * 256, WG == 0)  # fmt: skip
                else:
                    _store_out_staged(acc, b_l, m_run, v_scale, buf, out, lse, stride_o_t, stride_o_h, H, i_h, i_q,
                                      q_start, qlen, BLOCK_H, Q_PER, WG * 256, WG == 0)  # fmt: skip
            else:
                _span_last_piece(acc, b_l, m_run, stage, span_flags, out, lse, o_part, lse_part, v_scale,
                                 stride_o_t, stride_o_h, H, reader, i_h, i_q, q_start, qlen, first, last,
                                 MAX_QLEN, BLOCK_H, Q_PER, READERS, WG)  # fmt: skip
        else:
            _span_last_piece(acc, b_l, m_run, stage, span_flags, out, lse, o_part, lse_part, v_scale, stride_o_t,
                             stride_o_h, H, reader, i_h, i_q, q_start, qlen, first, last, MAX_QLEN, BLOCK_H, Q_PER,
                             READERS, WG)  # fmt: skip

    @gluon.jit
    def _span_last_piece(acc, b_l, m_run, stage, span_flags, out, lse, o_part, lse_part, v_scale, stride_o_t,
                         stride_o_h, H, reader, i_h, i_q, q_start, qlen, first, last, MAX_QLEN: gl.constexpr,
                         BLOCK_H: gl.constexpr, Q_PER: gl.constexpr, READERS: gl.constexpr,
                         WG: gl.constexpr):  # fmt: skip
        """``_span_finish`` for a request's last piece: its accumulator goes to ``stage`` as fp32; for each other
        piece it waits until the flag reads 128 (acquire), resets it and adds the partial, weighted by the LSEs, 64
        columns at a time; then the final rows."""
        VEC: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        CH: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])  # a [64, 64] fp32 chunk, 16-byte rows
        ROW_C: gl.constexpr = gl.SliceLayout(1, CH)
        F_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])
        BLOCK_M: gl.constexpr = BLOCK_H * Q_PER
        zero = gl.zeros([128], gl.int32, VEC)  # one flag access per thread of the warpgroup
        f_acc = stage._reinterpret(gl.float32, [BLOCK_M, 256], F_SMEM)
        f_acc.store(acc)
        o_m = gl.arange(0, BLOCK_M, layout=ROW_C)
        o_t = i_q * Q_PER + o_m // BLOCK_H
        o_h = i_h * BLOCK_H + o_m % BLOCK_H
        m_r = (o_t < qlen) & (o_h < H)
        o_c = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, CH)), 0)
        b_m = gl.convert_layout(m_run, ROW_C)
        b_den = gl.convert_layout(b_l, ROW_C)
        for j in range(first, last):
            p_f = span_flags + ((j * READERS + reader) * 2 + WG) + zero
            n_in = gl.min(gl.atomic_add(p_f, zero, sem="acquire", scope="gpu"), axis=0)
            while n_in < 128:
                n_in = gl.min(gl.atomic_add(p_f, zero, sem="acquire", scope="gpu"), axis=0)
            gl.thread_barrier()  # every thread saw 128 before the flag goes back to 0
            gl.store(p_f, zero)
            row = (j.to(gl.int64) * MAX_QLEN + o_t) * H + o_h
            lse_p = gl.load(lse_part + row, mask=m_r, other=float("-inf"), cache_modifier=".cg") * LOG2E
            m_new = gl.maximum(b_m, lse_p)
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            a_own = gl.exp2(b_m - m_use)
            w_p = gl.exp2(lse_p - m_use)
            b_den = b_den * a_own + w_p
            b_m = m_new
            w_p = w_p / v_scale  # the partial was normalised times v_scale
            for c in gl.static_range(4):
                chunk = f_acc.slice(c * 64, 64, dim=1)
                p_o = o_part + gl.expand_dims(row * 512 + WG * 256 + c * 64, 1) + o_c
                o_p = gl.load(p_o, mask=gl.expand_dims(m_r, 1), other=0.0, cache_modifier=".cg")
                chunk.store(chunk.load(CH) * gl.expand_dims(a_own, 1) + o_p * gl.expand_dims(w_p, 1))
        empty_r = b_den == 0.0
        b_inv = gl.where(empty_r, 0.0, v_scale / gl.where(empty_r, 1.0, b_den))
        p_out = out + gl.expand_dims((q_start + o_t).to(gl.int64) * stride_o_t + o_h * stride_o_h + WG * 256, 1)
        for c in gl.static_range(4):
            b_o = f_acc.slice(c * 64, 64, dim=1).load(CH) * gl.expand_dims(b_inv, 1)
            gl.store(p_out + c * 64 + o_c, b_o.to(out.dtype.element_ty), mask=gl.expand_dims(m_r, 1))
        if WG == 0:
            b_lse = gl.where(empty_r, float("-inf"),
                             (b_m + gl.log2(gl.where(empty_r, 1.0, b_den))) * 0.6931471805599453)  # fmt: skip
            gl.store(lse + (q_start + o_t).to(gl.int64) * H + o_h, b_lse, mask=m_r)

    @gluon.jit
    def _span_merge_tma(acc, b_l, m_run, part_desc, pbar, stage, lse_part, span_flags, v_scale, H, i_h, i_q, reader,
                        first, last, MAX_QLEN: gl.constexpr, BLOCK_H: gl.constexpr, Q_PER: gl.constexpr,
                        READERS: gl.constexpr, WG: gl.constexpr):  # fmt: skip
        """``_span_finish``'s merge for a request's last piece whose block rows all exist: for each other piece
        ``j`` of the request, wait for its flag (acquire; then reset it), copy its fp32 partial (this warpgroup's
        ``[64, 256]``, ``part_desc``: ``o_part`` as ``[rows, 512]``) by TMA into this warpgroup's stage (free: the
        program's last item, every MMA done), and add it, weighted by the LSEs, into the accumulator in registers.
        Returns the accumulator, row sums and row max to finish with."""
        BLOCK_M: gl.constexpr = BLOCK_H * Q_PER
        ROW_S: gl.constexpr = b_l.type.layout
        ROW_O: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
        VEC: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        part = stage._reinterpret(gl.float32, [BLOCK_M, 256], part_desc.layout)
        o_ms = gl.arange(0, BLOCK_M, layout=ROW_S)
        o_ts = i_q * Q_PER + o_ms // BLOCK_H
        o_hs = i_h * BLOCK_H + o_ms % BLOCK_H
        zero = gl.zeros([128], gl.int32, VEC)  # one flag access per thread of the warpgroup
        for j in range(first, last):
            p_f = span_flags + ((j * READERS + reader) * 2 + WG) + zero
            n_in = gl.min(gl.atomic_add(p_f, zero, sem="acquire", scope="gpu"), axis=0)
            while n_in < 128:
                n_in = gl.min(gl.atomic_add(p_f, zero, sem="acquire", scope="gpu"), axis=0)
            gl.thread_barrier()  # every thread saw 128 before the flag goes back to 0
            gl.store(p_f, zero)
            # the partial's generic stores (seen through the acquire) before this copy's async-proxy reads
            gl.inline_asm_elementwise("fence.proxy.async.global; mov.b32 $0, 0;", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)  # fmt: skip
            row0 = (j * MAX_QLEN + i_q * Q_PER) * H + i_h * BLOCK_H
            mbarrier.expect(pbar, BLOCK_M * 256 * 4)
            for t in gl.static_range(Q_PER):
                tma.async_copy_global_to_shared(part_desc, [row0 + t * H, WG * 256], pbar,
                                                part.slice(t * BLOCK_H, BLOCK_H, dim=0))  # fmt: skip
            lse_p = gl.load(lse_part + (j.to(gl.int64) * MAX_QLEN + o_ts) * H + o_hs, cache_modifier=".cg") * LOG2E
            m_new = gl.maximum(m_run, lse_p)
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            a_own = gl.exp2(m_run - m_use)
            w_p = gl.exp2(lse_p - m_use)
            b_l = b_l * a_own + w_p
            m_run = m_new
            w_p = w_p / v_scale  # the partial was normalised times v_scale
            mbarrier.wait(pbar, (j - first) & 1)
            o_p = part.load(acc.type.layout)
            acc = acc * gl.expand_dims(gl.convert_layout(a_own, ROW_O), 1) + o_p * gl.expand_dims(
                gl.convert_layout(w_p, ROW_O), 1
            )
            gl.thread_barrier()  # every thread read the partial before the next copy (or the final rows) lands there
        return acc, b_l, m_run

    @gluon.jit
    def _store_out_staged(acc, b_l, m_run, v_scale, buf, out, lse, stride_o_t, stride_o_h, H, i_h, i_q, q_start,
                          qlen, BLOCK_H: gl.constexpr, Q_PER: gl.constexpr, COL0: gl.constexpr,
                          WRITE_LSE: gl.constexpr):  # fmt: skip
        """``_store_result``'s final rows (bf16 ``out``), staged through shared memory: the MMA layout's 4-byte
        stores (8 rows x 16 bytes a warp instruction) become 16-byte stores of whole 512-byte row segments."""
        BLOCK_M: gl.constexpr = BLOCK_H * Q_PER
        NCOL: gl.constexpr = acc.shape[1]
        ROW_S: gl.constexpr = b_l.type.layout
        ROW_O: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
        ST: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        empty_r = b_l == 0.0
        b_inv = gl.where(empty_r, 0.0, v_scale / gl.where(empty_r, 1.0, b_l))
        buf.store((acc * gl.expand_dims(gl.convert_layout(b_inv, ROW_O), 1)).to(gl.bfloat16))
        gl.thread_barrier()
        b_o = buf.load(ST)
        o_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ST))
        o_t = i_q * Q_PER + o_m // BLOCK_H
        o_h = i_h * BLOCK_H + o_m % BLOCK_H
        m_o = gl.expand_dims((o_t < qlen) & (o_h < H), 1)
        row = (q_start + o_t).to(gl.int64)
        o_v = gl.expand_dims(COL0 + gl.arange(0, NCOL, layout=gl.SliceLayout(0, ST)), 0)
        gl.store(out + gl.expand_dims(row * stride_o_t + o_h * stride_o_h, 1) + o_v, b_o, mask=m_o)
        if WRITE_LSE:
            b_lse = gl.where(empty_r, float("-inf"),
                             (m_run + gl.log2(gl.where(empty_r, 1.0, b_l))) * 0.6931471805599453)  # fmt: skip
            o_ms = gl.arange(0, BLOCK_M, layout=ROW_S)
            o_ts = i_q * Q_PER + o_ms // BLOCK_H
            o_hs = i_h * BLOCK_H + o_ms % BLOCK_H
            gl.store(lse + (q_start + o_ts).to(gl.int64) * H + o_hs, b_lse, mask=(o_ts < qlen) & (o_hs < H))

    @gluon.jit
    def _store_out_tma(acc, b_l, m_run, v_scale, buf, out_desc, lse, H, i_h, i_q, q_start, BLOCK_H: gl.constexpr,
                       Q_PER: gl.constexpr, COL0: gl.constexpr, WRITE_LSE: gl.constexpr):  # fmt: skip
        """``_store_out_staged`` for a block whose ``Q_PER`` x ``BLOCK_H`` rows all exist, by TMA: the bf16 rows go
        to ``buf`` and one ``[BLOCK_H, 256]`` box a query token goes out through ``out_desc`` (``out`` as
        ``[T * H, 512]``) without waiting; ``tma.store_wait`` must run before anything overwrites ``buf``."""
        BLOCK_M: gl.constexpr = BLOCK_H * Q_PER
        ROW_S: gl.constexpr = b_l.type.layout
        ROW_O: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
        empty_r = b_l == 0.0
        b_inv = gl.where(empty_r, 0.0, v_scale / gl.where(empty_r, 1.0, b_l))
        buf.store((acc * gl.expand_dims(gl.convert_layout(b_inv, ROW_O), 1)).to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        row0 = (q_start + i_q * Q_PER) * H + i_h * BLOCK_H
        for t in gl.static_range(Q_PER):
            tma.async_copy_shared_to_global(out_desc, [row0 + t * H, COL0], buf.slice(t * BLOCK_H, BLOCK_H, dim=0))
        if WRITE_LSE:
            b_lse = gl.where(empty_r, float("-inf"),
                             (m_run + gl.log2(gl.where(empty_r, 1.0, b_l))) * 0.6931471805599453)  # fmt: skip
            o_ms = gl.arange(0, BLOCK_M, layout=ROW_S)
            o_ts = i_q * Q_PER + o_ms // BLOCK_H
            o_hs = i_h * BLOCK_H + o_ms % BLOCK_H
            gl.store(lse + (q_start + o_ts).to(gl.int64) * H + o_hs, b_lse)

    @gluon.jit
    def _seesaw_rescale(acc, b_l, m_prev, m_new, ROW_O: gl.constexpr):
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        b_alpha = gl.exp2(m_prev - m_use)
        return acc * gl.expand_dims(gl.convert_layout(b_alpha, ROW_O), 1), b_l * b_alpha

    @gluon.jit
    def _lazy_max(m_ref, row_max):
        """The pair kernel's reference row max: ``m_ref`` unless the row max exceeds it by more than ``LAZY_T``
        (then the row max; a row whose reference is still -inf takes any finite row max)."""
        return gl.where(row_max > m_ref + LAZY_T, row_max, m_ref)

    @gluon.jit
    def _seesaw_rescale_lazy(acc, b_l, m_prev, m_new, ROW_O: gl.constexpr):
        """``_seesaw_rescale`` for ``_lazy_max`` references: each warp multiplies its rows of O only when one of
        them has a factor other than 1 (a warp vote, then a branch inside the asm: 128 multiplies a thread
        skipped); the row sums are always multiplied."""
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        b_alpha = gl.convert_layout(gl.exp2(m_prev - m_use), ROW_O)
        # 1 in every row of a warp where some factor is not exactly 1 (each thread holds two rows)
        moved = gl.inline_asm_elementwise(
            "{ .reg .pred p, q; setp.neu.f32 p, $2, 0f3F800000; setp.neu.or.f32 p, $3, 0f3F800000, p; "
            "vote.sync.any.pred q, p, -1; selp.u32 $0, 1, 0, q; mov.u32 $1, $0; }",
            "=r,=r,f,f", [b_alpha], dtype=gl.int32, is_pure=True, pack=2)  # fmt: skip
        acc = gl.inline_asm_elementwise(RESCALE_ASM, RESCALE_CONSTRAINTS,
                                        [acc, gl.expand_dims(moved, 1), gl.expand_dims(b_alpha, 1)],
                                        dtype=gl.float32, is_pure=True, pack=RESCALE_PACK)  # fmt: skip
        return acc, b_l * gl.convert_layout(b_alpha, b_l.type.layout)

    @gluon.jit
    def _seesaw_other_pv(acc, b_l, m_prev, oth_lat, oth_rope, m_smem, pready, ready_y, ph, WG: gl.constexpr,
                         ROW_S: gl.constexpr, ROW_O: gl.constexpr):  # fmt: skip
        """Once the other warpgroup's P and row max of its tile are stored (``pready``, phase ``ph``) and the
        tile's Y group is there: rescales to that row max and issues the P V (its P over its rope columns x this
        warpgroup's half of its V). Returns the accumulator with the MMA still running (the caller waits), the
        rescaled row sums and the new row max."""
        OTH: gl.constexpr = 1 - WG
        mbarrier.wait(pready.index(OTH), ph)
        mbarrier.wait(ready_y.index(OTH), ph)
        m_new = m_smem.index(OTH).load(ROW_S)
        acc, b_l = _seesaw_rescale(acc, b_l, m_prev, m_new, ROW_O)
        acc = warpgroup_mma(oth_rope, oth_lat.slice(WG * 256, 256, dim=1), acc, is_async=True)
        return acc, b_l, m_new

    @gluon.jit
    def _seesaw_issue(lat_desc, rope_desc, lat_smem, rope_smem, bar, stage, r0, r1, LAT_HALF: gl.constexpr,
                      ROPE: gl.constexpr):  # fmt: skip
        """TMA of one refill group of a stage: latent half ``LAT_HALF`` (256 columns; + the rope columns when
        ``ROPE``) of a 64-key tile, on barrier ``bar``. The descriptors' boxes are ``[BOX, 256]`` / ``[BOX, 64]``:
        ``BOX`` 32 (rows ``r0``, ``r1`` of the tile's two 32-key boxes; a page may hold 32 keys) or 64 (rows ``r0``:
        the whole tile on one page). One copy per box through ``lat_desc`` (the lowering gives each of the
        partition's 4 warps one message) and one per box through ``rope_desc``. The compiler puts a
        partition-wide barrier between consecutive copies that share ``bar``: 6 a tile with 32-row boxes, 3 with
        64 (18 with one copy per ``[32, 64]`` chunk ran 3-5% slower)."""
        BOX: gl.constexpr = lat_desc.block_shape[0]
        n_chunks: gl.constexpr = 5 if ROPE else 4
        mbarrier.expect(bar, n_chunks * 64 * 64 * 2)
        for h in gl.static_range(64 // BOX):
            row = r0 if h == 0 else r1
            lat = lat_smem.index(stage).slice(h * BOX, BOX, dim=0)
            tma.async_copy_global_to_shared(lat_desc, [row, LAT_HALF * 256], bar, lat.slice(LAT_HALF * 256, 256, dim=1))
            if ROPE:
                tma.async_copy_global_to_shared(rope_desc, [row, 512], bar,
                                                rope_smem.index(stage).slice(h * BOX, BOX, dim=0))  # fmt: skip

    @gluon.jit
    def _seesaw_tile(k, acc, b_l, m_prev, lat_desc, rope_desc, q_smem, lat_smem, rope_smem, m_smem, ready_x, ready_y,
                     empty_y, pready, p_bt, kv_lo, kv_hi, L, n_own, limit, s_zero, key0, scale_log2, num_blocks,
                     max_blocks, PAGE: gl.constexpr, WG: gl.constexpr, FIRST: gl.constexpr):  # fmt: skip
        """Tile ``t = WG + 2 k`` of warpgroup ``WG`` (steps 1-5 of the comment above ``_seesaw_wg``); ``FIRST``:
        t = 0, no other tile before it. Returns the updated ``acc``, ``b_l``, ``m_prev``."""
        BLOCK_N: gl.constexpr = 64
        HALF: gl.constexpr = 256
        NW: gl.constexpr = 4
        OWN: gl.constexpr = WG
        OTH: gl.constexpr = 1 - WG
        ROW_S: gl.constexpr = gl.SliceLayout(1, s_zero.type.layout)
        ROW_O: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
        t = WG + 2 * k  # this warpgroup's tile; t - 1 is the other's (none for t = 0)
        n0 = kv_lo + t * BLOCK_N
        z = (L >> 31) & k  # a runtime 0 (seq_lens >= 0): descriptors rebuilt per iteration, not hoisted
        own_lat = lat_smem.index(OWN + z)
        own_rope = rope_smem.index(OWN + z)
        oth_lat = lat_smem.index(OTH + z)
        oth_rope = rope_smem.index(OTH + z)
        # 1. P V of the other warpgroup's tile t - 1 (its P over its rope columns x this warpgroup's half of
        #    its V, both in the other stage's Y group), issued and left running: the scores MMAs of step 2 queue
        #    right behind it (no drain of the tensor pipe in between); the other stage's Y group goes back to its
        #    owner once the P V is done, before the Y chunks of step 2
        if not FIRST:
            acc, b_l, m_prev = _seesaw_other_pv(acc, b_l, m_prev, oth_lat, oth_rope, m_smem, pready, ready_y,
                                                (k - 1 + WG) & 1, WG, ROW_S, ROW_O)  # fmt: skip
        # 2. S_t: the X chunks (this warpgroup's latent half), then the Y chunks (the other half, the rope)
        ok0 = _box_ok(p_bt, n0, kv_hi, max_blocks, num_blocks, PAGE)
        ok1 = _box_ok(p_bt, n0 + 32, kv_hi, max_blocks, num_blocks, PAGE)
        mbarrier.wait(ready_x.index(OWN), k & 1)
        b_s = s_zero
        for c in gl.static_range(4):
            b_s = warpgroup_mma(q_smem.index(OWN * 4 + c + z),
                                own_lat.slice((OWN * 4 + c) * 64, 64, dim=1).permute((1, 0)), b_s,
                                use_acc=c > 0, is_async=True)  # fmt: skip
        if not FIRST:  # step 1's P V done (the 4 X MMAs run on): the other stage's Y group goes back to its owner
            acc = warpgroup_mma_wait(4, deps=(acc,))
            gl.thread_barrier()  # every warp's P V is done before one thread releases the Y group
            mbarrier.arrive(empty_y.index(OTH), count=1)
        mbarrier.wait(ready_y.index(OWN), k & 1)
        for c in gl.static_range(4):
            b_s = warpgroup_mma(q_smem.index(OTH * 4 + c + z),
                                own_lat.slice((OTH * 4 + c) * 64, 64, dim=1).permute((1, 0)), b_s,
                                is_async=True)  # fmt: skip
        b_s = warpgroup_mma(q_smem.index(8 + z), own_rope.permute((1, 0)), b_s, is_async=True)
        acc, b_s = warpgroup_mma_wait(0, deps=(acc, b_s))
        if n0 + BLOCK_N > L:  # rows past the sequence: zeros before any P V reads them (S masks them)
            _zero_tail(own_lat, n0, L, BLOCK_N, NW)
        # 3. softmax of S_t (keys masked as a range [lo, hi) per row: an invalid box is the first or the
        #    second half of the tile); P_t over the rope columns, M_t
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
        # 5. refill with tile t + 2: X now, Y once the other warpgroup's P_t V_t released it
        if k + 1 < n_own:
            r0 = _kv_rows(p_bt, n0 + 2 * BLOCK_N, kv_hi, max_blocks, num_blocks, PAGE, 0)
            r1 = _kv_rows(p_bt, n0 + 2 * BLOCK_N, kv_hi, max_blocks, num_blocks, PAGE, 1)
            _seesaw_issue(lat_desc, rope_desc, lat_smem, rope_smem, ready_x.index(OWN), OWN, r0, r1, OWN, False)
            mbarrier.wait(empty_y.index(OWN), k & 1)
            _seesaw_issue(lat_desc, rope_desc, lat_smem, rope_smem, ready_y.index(OWN), OWN, r0, r1, OTH, True)
        return acc, b_l, m_prev

    @gluon.jit
    def _seesaw_wg(q, lat_desc, rope_desc, q_smem, lat_smem, rope_smem, m_smem, l_smem, ready_x, ready_y,
                   empty_y, pready, qbar, lbar, block_table, seq_lens, query_start_loc, work_req, work_split,
                   num_splits, split_len, out, lse, o_part, lse_part, scale_log2, v_scale, stride_q_t, stride_q_h,
                   stride_bt_b, stride_o_t, stride_o_h, H, num_blocks, max_blocks, num_tokens, PAGE: gl.constexpr,
                   MAX_QLEN: gl.constexpr, BLOCK_H: gl.constexpr, Q_PER: gl.constexpr, CAUSAL: gl.constexpr,
                   N_HB: gl.constexpr, N_QB: gl.constexpr, WG: gl.constexpr):  # fmt: skip
        BLOCK_M: gl.constexpr = BLOCK_H * Q_PER
        BLOCK_N: gl.constexpr = 64
        HALF: gl.constexpr = 256  # output columns of this warpgroup
        OWN: gl.constexpr = WG  # stage of this warpgroup's tiles
        OTH: gl.constexpr = 1 - WG  # stage of the other warpgroup's tiles
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])  # fmt: skip
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF, 16])  # fmt: skip
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        COL_S: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)

        i_w, i_h, i_q, i_b, q_start, qlen, L, kv_lo, kv_hi = _seesaw_item(
            block_table, seq_lens, query_start_loc, work_req, work_split, split_len, num_tokens, MAX_QLEN, Q_PER,
            CAUSAL, N_HB, N_QB)  # fmt: skip
        n_tiles = gl.cdiv(gl.maximum(kv_hi - kv_lo, 0), BLOCK_N)
        n_own = gl.maximum(n_tiles - WG + 1, 0) // 2  # tiles WG, WG + 2, ...
        p_bt = block_table + i_b * stride_bt_b

        _seesaw_issue_q(q, q_smem, i_h, i_q, q_start, qlen, stride_q_t, stride_q_h, H, BLOCK_H, Q_PER, WG)
        if n_own > 0:  # the first own tile, both groups
            n0 = kv_lo + WG * BLOCK_N
            r0 = _kv_rows(p_bt, n0, kv_hi, max_blocks, num_blocks, PAGE, 0)
            r1 = _kv_rows(p_bt, n0, kv_hi, max_blocks, num_blocks, PAGE, 1)
            _seesaw_issue(lat_desc, rope_desc, lat_smem, rope_smem, ready_x.index(OWN), OWN, r0, r1, OWN, False)
            _seesaw_issue(lat_desc, rope_desc, lat_smem, rope_smem, ready_y.index(OWN), OWN, r0, r1, OTH, True)

        _seesaw_wait_q(qbar, 0)
        limit = gl.expand_dims(_key_limit(i_q, qlen, L, kv_hi, ROW_S, BLOCK_M, Q_PER, CAUSAL), 1)
        m_prev = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW_S)
        b_l = gl.zeros([BLOCK_M], gl.float32, ROW_S)
        acc = gl.zeros([BLOCK_M, HALF], gl.float32, O_LAYOUT)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT)
        key0 = gl.expand_dims(gl.arange(0, BLOCK_N, layout=COL_S), 0)

        if WG == 0:  # noqa: SIM102  (its first tile has no tile of the other warpgroup before it)
            if n_own > 0:
                acc, b_l, m_prev = _seesaw_tile(
                    0, acc, b_l, m_prev, lat_desc, rope_desc, q_smem, lat_smem, rope_smem, m_smem, ready_x, ready_y,
                    empty_y, pready, p_bt, kv_lo, kv_hi, L, n_own, limit, s_zero, key0, scale_log2, num_blocks,
                    max_blocks, PAGE, WG, True)  # fmt: skip
        for k in range(1 - WG, n_own):
            acc, b_l, m_prev = _seesaw_tile(
                k, acc, b_l, m_prev, lat_desc, rope_desc, q_smem, lat_smem, rope_smem, m_smem, ready_x, ready_y,
                empty_y, pready, p_bt, kv_lo, kv_hi, L, n_own, limit, s_zero, key0, scale_log2, num_blocks,
                max_blocks, PAGE, WG, False)  # fmt: skip

        t = WG + 2 * n_own - 1  # the other warpgroup's tile after this warpgroup's last one (at most one)
        if (t >= 0) & (t < n_tiles):
            acc, b_l, m_prev = _seesaw_other_pv(acc, b_l, m_prev, lat_smem.index(OTH), rope_smem.index(OTH), m_smem,
                                                pready, ready_y, (n_own - 1 + WG) & 1, WG, ROW_S, ROW_O)  # fmt: skip
            acc = warpgroup_mma_wait(0, deps=(acc,))

        _seesaw_finish(acc, b_l, m_prev, l_smem, lbar, 0, lat_smem.index(OWN).slice(0, HALF, dim=1), num_splits, out,
                       lse, o_part, lse_part, v_scale, stride_o_t, stride_o_h, H, i_w, i_h, i_q, i_b, q_start, qlen,
                       MAX_QLEN, BLOCK_H, Q_PER, WG)  # fmt: skip

    # ---- "pair" kernel (FlashMLA's published seesaw order): the tiles go in pairs, a = 2i in stage 0 (scores by
    # warpgroup 0), b = 2i + 1 in stage 1 (scores by warpgroup 1); warpgroup 0 holds output columns [0, 256) ("L"),
    # warpgroup 1 [256, 512) ("R"). Each P is published at its own warpgroup's row max as soon as its softmax is
    # done, so that no P V waits for the other warpgroup's softmax, and every block id is looked up a pair ahead.
    # Per pair:
    #   WG0: row max of S_a -> M_a out (before the exponentials); O_L to M_a; P_a = exp(S_a - M_a) over stage 0's
    #        rope columns -> out; O_L += P_a V_aL (P_a in registers); refills stage 0's L half; M_b in: O_L to M_b;
    #        P_b in: O_L += P_b V_bL; refills stage 1's L half + rope (P_b's columns); looks up the block ids of
    #        the next pair's refills; the scores of a + 2.
    #   WG1: row max of S_b; M_a in -> M_b = max(M_a, row max) out; P_b = exp(S_b - M_b) over stage 1's rope
    #        columns -> out; O_R to M_a; P_a in: O_R += P_a V_aR; refills stage 0's R half + rope (P_a's columns);
    #        O_R to M_b; O_R += P_b V_bR (P_b in registers); refills stage 1's R half; looks up the next block ids;
    #        the scores of b + 2.
    # Each softmax overlaps the other warpgroup's MMAs. Each stage is refilled in two TMA groups by the last
    # warpgroup to read them, with no "empty" barrier. A missing tile b (an odd tile count) is loaded as zeros
    # (out-of-bounds rows) and masked. Each softmax takes its row max on the raw scores and folds the scale into the
    # exponent (exp2(s * scale - m): one FMA a score), and masks keys only in a tile that needs it
    # (``_pair_mask_raw``: a uniform branch). The reference row maxes M_a and M_b are lazy (``_lazy_max``: a row's
    # reference moves only when its scores exceed it by more than LAZY_T), so nearly every factor of the four O
    # rescales a pair is exactly 1 and ``_seesaw_rescale_lazy`` skips the multiplies per warp.

    @gluon.jit
    def _pair_signal(bar):
        """This warpgroup's shared-memory writes so far go to the other warpgroup: a partition barrier, then one
        arrive on the mbarrier ``bar``."""
        gl.thread_barrier()
        mbarrier.arrive(bar, count=1)

    @gluon.jit
    def _pair_mask_raw(b_s, ok0, ok1, n0, limit, lim_lo, key0):
        """The raw scores with ``-inf`` outside each row's ``[lo, hi)`` (an invalid 32-key box is the first or the
        second half of the tile), in a uniform branch taken only for a tile with an invalid box or a key at or past
        some row's limit (``lim_lo``: the least of them); the scores of the other tiles go through untouched."""
        if (ok0 == 0) | (ok1 == 0) | (n0 + 64 > lim_lo):
            lo = gl.where(ok0, n0, n0 + 32)
            hi = gl.minimum(limit, gl.where(ok1, n0 + 64, n0 + 32))
            key = key0 + n0
            b_s = gl.where((key >= lo) & (key < hi), b_s, float("-inf"))
        return b_s

    @gluon.jit
    def _pair_row_max(b_s, ok0, ok1, n0, limit, lim_lo, key0, scale_log2):
        """The masked raw scores (``_pair_mask_raw``) and their row max in log2 units (scaled once)."""
        b_s = _pair_mask_raw(b_s, ok0, ok1, n0, limit, lim_lo, key0)
        row_max = gl.max(b_s, axis=1) * scale_log2
        return b_s, row_max

    @gluon.jit
    def _pair_exp(b_s, m_use, scale_log2):
        """P = exp2(scores * scale - row max) for ``_pair_row_max``'s raw scores (one FMA a score)."""
        return gl.exp2(b_s * scale_log2 - gl.expand_dims(m_use, 1))

    @gluon.jit
    def _pair_rows_ahead(p_bt, n, kv_hi, max_blocks, num_blocks, PAGE: gl.constexpr, LAST: gl.constexpr):
        """The TMA rows of the two 32-key boxes of the tiles at keys ``n`` and ``n + 64`` (the next pair's
        refills); zeros (unused) for the ``LAST`` pair."""
        if not LAST:
            r0 = _kv_rows(p_bt, n, kv_hi, max_blocks, num_blocks, PAGE, 0)
            r1 = _kv_rows(p_bt, n, kv_hi, max_blocks, num_blocks, PAGE, 1)
            r2 = _kv_rows(p_bt, n + 64, kv_hi, max_blocks, num_blocks, PAGE, 0)
            r3 = _kv_rows(p_bt, n + 64, kv_hi, max_blocks, num_blocks, PAGE, 1)
        else:
            r0 = n * 0
            r1 = r0
            r2 = r0
            r3 = r0
        return r0, r1, r2, r3

    @gluon.jit
    def _pair_qk_half(q_smem, lat, rope, b_s, bar, ph, z, HALF_IDX: gl.constexpr, ROPE: gl.constexpr,
                      FIRST: gl.constexpr):  # fmt: skip
        """Wait for one TMA group of a stage (latent half ``HALF_IDX``, + the rope when ``ROPE``) and issue its
        scores MMAs (chained async onto ``b_s``; ``FIRST``: the first half of the tile)."""
        mbarrier.wait(bar, ph)
        for c in gl.static_range(4):
            b_s = warpgroup_mma(q_smem.index(HALF_IDX * 4 + c + z),
                                lat.slice((HALF_IDX * 4 + c) * 64, 64, dim=1).permute((1, 0)), b_s,
                                use_acc=(c > 0) or not FIRST, is_async=True)  # fmt: skip
        if ROPE:
            b_s = warpgroup_mma(q_smem.index(8 + z), rope.permute((1, 0)), b_s, is_async=True)
        return b_s

    @gluon.jit
    def _pair_refill(lat_desc, rope_desc, lat_smem, rope_smem, bar, p_bt, n0, kv_hi, max_blocks, num_blocks,
                     STAGE: gl.constexpr, HALF_IDX: gl.constexpr, ROPE: gl.constexpr, PAGE: gl.constexpr):  # fmt: skip
        """TMA of one group (latent half ``HALF_IDX`` [+ rope]) of the tile at key ``n0`` into ``STAGE``."""
        r0 = _kv_rows(p_bt, n0, kv_hi, max_blocks, num_blocks, PAGE, 0)
        r1 = _kv_rows(p_bt, n0, kv_hi, max_blocks, num_blocks, PAGE, 1)
        _seesaw_issue(lat_desc, rope_desc, lat_smem, rope_smem, bar, STAGE, r0, r1, HALF_IDX, ROPE)

    @gluon.jit
    def _pair_stages(lat_smem, rope_smem, L, i):
        """``(z, lat0, lat1, rope0, rope1)``: the two stages' latent and rope buffers, indexed with a runtime zero
        ``z`` (the descriptors are rebuilt per iteration, not hoisted out of the loop)."""
        z = (L >> 31) & i
        return z, lat_smem.index(0 + z), lat_smem.index(1 + z), rope_smem.index(0 + z), rope_smem.index(1 + z)

    @gluon.jit
    def _pair_next_scores(q_smem, lat, rope, b_s, bar_l, bar_r, ph, z, ROPE_L: gl.constexpr):
        """A pair's last step: a warpgroup's scores of its next tile, the L half first (with the rope columns when
        ``ROPE_L``, else with the R half), each once its refill landed (phase ``ph``)."""
        b_s = _pair_qk_half(q_smem, lat, rope, b_s, bar_l, ph, z, 0, ROPE_L, True)
        b_s = _pair_qk_half(q_smem, lat, rope, b_s, bar_r, ph, z, 1, not ROPE_L, False)
        b_s = warpgroup_mma_wait(0, deps=(b_s,))
        return b_s

    @gluon.jit
    def _pair_tail(b_s, lat_desc, rope_desc, q_smem, lat_smem, rope_smem, lat, rope, ready_l, ready_r, rb0, rb1,
                   o0, o1, p_bt, n0, kv_hi, max_blocks, num_blocks, z, ph, PAGE: gl.constexpr,
                   LAST: gl.constexpr, WG: gl.constexpr):  # fmt: skip
        """The pairs' common end for warpgroup ``WG``, after its last P V: refills stage 1's half that it read last
        (the L half with the rope columns, where P_b lived, for warpgroup 0; the R half for warpgroup 1; rows
        ``rb0`` / ``rb1``), looks up the rows of the next pair's refills (the tiles two pairs after this warpgroup's
        tile at ``n0``, and the one after it) and computes the scores of its next tile from its own stage (``lat`` /
        ``rope``). Returns the scores, the validity of that tile's two boxes (rows ``o0`` / ``o1``, looked up a pair
        ago) and the rows looked up."""
        if not LAST:
            gl.thread_barrier()  # this warpgroup was the last reader of that half
            if WG == 0:
                bar = ready_l.index(1)
            else:
                bar = ready_r.index(1)
            _seesaw_issue(lat_desc, rope_desc, lat_smem, rope_smem, bar, 1, rb0, rb1, WG, WG == 0)
        na0, na1, nb0, nb1 = _pair_rows_ahead(p_bt, n0 + (256 - 64 * WG), kv_hi, max_blocks, num_blocks, PAGE, LAST)
        if not LAST:
            b_s = _pair_next_scores(q_smem, lat, rope, b_s, ready_l.index(WG), ready_r.index(WG), ph ^ 1, z, WG == 1)
        limit_rows = num_blocks * PAGE  # _kv_rows' row for an invalid box
        return b_s, o0 < limit_rows, o1 < limit_rows, na0, na1, nb0, nb1

    @gluon.jit
    def _pair_wg0(i, b_s, acc, b_l, m_run, ok0, ok1, ra0, ra1, rb0, rb1, lat_desc, rope_desc, q_smem, lat_smem,
                  rope_smem, m_smem, ready_l, ready_r, m_ready, p_ready, p_bt, kv_lo, kv_hi, L, limit, lim_lo, key0,
                  scale_log2, num_blocks, max_blocks, PAGE: gl.constexpr, LAST: gl.constexpr):  # fmt: skip
        """Warpgroup 0, pair ``i`` (the comment above; ``b_s`` = the finished scores of tile a). Returns the scores
        of tile a + 2 (finished; unchanged when ``LAST``), O_L, its row sums, the reference max M_b, and the
        looked-up state carried from pair to pair: ``ok0`` / ``ok1`` (the validity of tile a's two 32-key boxes, for
        the mask) and ``ra*`` / ``rb*`` (the TMA rows of tiles a + 2 and b + 2, this pair's refills)."""
        O_LAYOUT: gl.constexpr = acc.type.layout
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
        ROW_S: gl.constexpr = m_run.type.layout
        P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
        z, lat0, lat1, rope0, rope1 = _pair_stages(lat_smem, rope_smem, L, i)
        ph = i & 1
        n0 = kv_lo + i * 128  # tile a; tile b starts at n0 + 64
        # no global load before the row max: the block ids were looked up during the previous pair's wait for its
        # scores (the compiler moves a loaded block id into a uniform register right after its load, so a load
        # here would stall the softmax)
        b_s, row_max = _pair_row_max(b_s, ok0, ok1, n0, limit, lim_lo, key0, scale_log2)
        m_a = _lazy_max(m_run, row_max)
        m_smem.index(0).store(m_a)
        _pair_signal(m_ready.index(0))
        acc, b_l = _seesaw_rescale_lazy(acc, b_l, m_run, m_a, ROW_O)
        m_a_use = gl.where(m_a == float("-inf"), 0.0, m_a)
        b_p = _pair_exp(b_s, m_a_use, scale_log2)
        b_l = b_l + gl.sum(b_p, axis=1)
        p_bf = b_p.to(gl.bfloat16)
        if n0 + 64 > L:  # rows past the sequence: zeros before any P V reads them (S masked them)
            _zero_tail(lat0, n0, L, 64, 4)
        rope0.store(p_bf)
        fence_async_shared()
        _pair_signal(p_ready.index(0))
        p_op = gl.convert_layout(p_bf, P_LAYOUT)
        acc = warpgroup_mma(p_op, lat0.slice(0, 256, dim=1), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        if not LAST:  # stage 0's L half: warpgroup 0 was its last reader
            gl.thread_barrier()
            _seesaw_issue(lat_desc, rope_desc, lat_smem, rope_smem, ready_l.index(0), 0, ra0, ra1, 0, False)
        mbarrier.wait(m_ready.index(1), ph)
        m_b = m_smem.index(1).load(ROW_S)
        acc, b_l = _seesaw_rescale_lazy(acc, b_l, m_a, m_b, ROW_O)
        mbarrier.wait(p_ready.index(1), ph)
        acc = warpgroup_mma(rope1, lat1.slice(0, 256, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        b_s, ok0, ok1, na0, na1, nb0, nb1 = _pair_tail(
            b_s, lat_desc, rope_desc, q_smem, lat_smem, rope_smem, lat0, rope0, ready_l, ready_r, rb0, rb1, ra0,
            ra1, p_bt, n0, kv_hi, max_blocks, num_blocks, z, ph, PAGE, LAST, 0)  # fmt: skip
        return b_s, acc, b_l, m_b, ok0, ok1, na0, na1, nb0, nb1

    @gluon.jit
    def _pair_wg1(i, b_s, acc, b_l, m_run, ok0, ok1, ra0, ra1, rb0, rb1, lat_desc, rope_desc, q_smem, lat_smem,
                  rope_smem, m_smem, ready_l, ready_r, m_ready, p_ready, p_bt, kv_lo, kv_hi, L, limit, lim_lo, key0,
                  scale_log2, num_blocks, max_blocks, PAGE: gl.constexpr, LAST: gl.constexpr):  # fmt: skip
        """Warpgroup 1, pair ``i`` (the comment above ``_pair_wg0``); arguments and results as ``_pair_wg0``
        (``ok0`` / ``ok1``: tile b's boxes)."""
        O_LAYOUT: gl.constexpr = acc.type.layout
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
        ROW_S: gl.constexpr = m_run.type.layout
        P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
        z, lat0, lat1, rope0, rope1 = _pair_stages(lat_smem, rope_smem, L, i)
        ph = i & 1
        n0 = kv_lo + i * 128 + 64  # tile b
        b_s, row_max = _pair_row_max(b_s, ok0, ok1, n0, limit, lim_lo, key0, scale_log2)
        mbarrier.wait(m_ready.index(0), ph)
        m_a = m_smem.index(0).load(ROW_S)
        m_b = _lazy_max(m_a, row_max)
        m_smem.index(1).store(m_b)
        _pair_signal(m_ready.index(1))
        m_b_use = gl.where(m_b == float("-inf"), 0.0, m_b)
        b_p = _pair_exp(b_s, m_b_use, scale_log2)
        l_b = gl.sum(b_p, axis=1)
        p_bf = b_p.to(gl.bfloat16)
        if n0 + 64 > L:
            _zero_tail(lat1, n0, L, 64, 4)
        rope1.store(p_bf)
        fence_async_shared()
        _pair_signal(p_ready.index(1))
        acc, b_l = _seesaw_rescale_lazy(acc, b_l, m_run, m_a, ROW_O)
        mbarrier.wait(p_ready.index(0), ph)
        acc = warpgroup_mma(rope0, lat0.slice(256, 256, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        if not LAST:  # stage 0's R half and rope columns (P_a): warpgroup 1 was their last reader
            gl.thread_barrier()
            _seesaw_issue(lat_desc, rope_desc, lat_smem, rope_smem, ready_r.index(0), 0, ra0, ra1, 1, True)
        acc, b_l = _seesaw_rescale_lazy(acc, b_l, m_a, m_b, ROW_O)
        b_l = b_l + l_b
        p_op = gl.convert_layout(p_bf, P_LAYOUT)
        acc = warpgroup_mma(p_op, lat1.slice(256, 256, dim=1), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        b_s, ok0, ok1, na0, na1, nb0, nb1 = _pair_tail(
            b_s, lat_desc, rope_desc, q_smem, lat_smem, rope_smem, lat1, rope1, ready_l, ready_r, rb0, rb1, rb0,
            rb1, p_bt, n0, kv_hi, max_blocks, num_blocks, z, ph, PAGE, LAST, 1)  # fmt: skip
        return b_s, acc, b_l, m_b, ok0, ok1, na0, na1, nb0, nb1

    @gluon.jit
    def _pair_wg(q, lat_desc, rope_desc, q_smem, lat_smem, rope_smem, m_smem, l_smem, ready_l, ready_r, m_ready,
                 p_ready, qbar, lbar, block_table, seq_lens, query_start_loc, work_req, work_split, num_splits,
                 split_len, group_indptr, span_indptr, span_flags, out, lse, o_part, lse_part, scale_log2, v_scale,
                 stride_q_t, stride_q_h, stride_bt_b, stride_o_t, stride_o_h, H, num_blocks, max_blocks, num_tokens,
                 PAGE: gl.constexpr, MAX_QLEN: gl.constexpr, BLOCK_H: gl.constexpr, Q_PER: gl.constexpr,
                 CAUSAL: gl.constexpr, N_HB: gl.constexpr, N_QB: gl.constexpr, WG: gl.constexpr, SPANS: gl.constexpr,
                 out_desc, OUT_TMA: gl.constexpr, part_desc, pbar, MERGE_TMA: gl.constexpr):  # fmt: skip
        """One warpgroup of the pair kernel: its program's work item, or (``SPANS``) every item of its group, last to
        first (``work_split`` / ``split_len`` then hold each item's first key / key end, ``group_indptr`` the
        groups' items, ``span_indptr`` the requests' items, ``span_flags`` the pieces' flags:
        ``openmla.ops.plan_spans``, ``_span_finish``). The mbarriers run on across items: a stage's barriers
        complete once a pair (``g0``, the pairs done before, gives their phase), the Q and row-sum exchanges once an
        item (``seg``). ``OUT_TMA`` (``SPANS``): final rows by TMA (``_store_out_tma``)."""
        if SPANS:
            pid = gl.program_id(0)
            grp = pid // (N_HB * N_QB)
            reader = pid % (N_HB * N_QB)
            i_h = pid % N_HB
            i_q = (pid // N_HB) % N_QB
            it_lo = gl.load(group_indptr + grp)
            it_hi = gl.load(group_indptr + grp + 1)
            g0 = it_lo * 0
            seg = it_lo * 0
            for k in range(it_lo, it_hi):
                it = it_lo + it_hi - 1 - k
                i_b = gl.load(work_req + it).to(gl.int64)
                q_start, qlen = _row_count(query_start_loc, i_b, num_tokens, MAX_QLEN)
                if i_q * Q_PER < qlen:  # (the same test in both warpgroups)
                    L = gl.load(seq_lens + i_b)
                    kv_lo = gl.load(work_split + it)
                    kv_hi = gl.load(split_len + it)
                    if CAUSAL:
                        kv_hi = gl.minimum(kv_hi, L - qlen + gl.minimum(i_q * Q_PER + Q_PER, qlen))
                    # the previous item's shared-memory reads and writes (output staging, zero tails) before this
                    # item's copies into the same buffers
                    fence_async_shared()
                    gl.thread_barrier()
                    g0 = _pair_item(
                        q, lat_desc, rope_desc, q_smem, lat_smem, rope_smem, m_smem, l_smem, ready_l, ready_r,
                        m_ready, p_ready, qbar, lbar, block_table, num_splits, span_indptr, span_flags, out, lse,
                        o_part, lse_part, scale_log2, v_scale, stride_q_t, stride_q_h, stride_bt_b, stride_o_t,
                        stride_o_h, H, num_blocks, max_blocks, it, reader, i_h, i_q, i_b, q_start, qlen, L, kv_lo,
                        kv_hi, g0, seg & 1, PAGE, MAX_QLEN, BLOCK_H, Q_PER, CAUSAL, WG, True, N_HB * N_QB, out_desc,
                        OUT_TMA, part_desc, pbar, MERGE_TMA)  # fmt: skip
                    seg += 1
            if OUT_TMA:  # the last item's final rows leave shared memory before the program ends
                tma.store_wait(0)
        else:
            i_w, i_h, i_q, i_b, q_start, qlen, L, kv_lo, kv_hi = _seesaw_item(
                block_table, seq_lens, query_start_loc, work_req, work_split, split_len, num_tokens, MAX_QLEN, Q_PER,
                CAUSAL, N_HB, N_QB)  # fmt: skip
            _pair_item(q, lat_desc, rope_desc, q_smem, lat_smem, rope_smem, m_smem, l_smem, ready_l, ready_r,
                       m_ready, p_ready, qbar, lbar, block_table, num_splits, span_indptr, span_flags, out, lse,
                       o_part, lse_part, scale_log2, v_scale, stride_q_t, stride_q_h, stride_bt_b, stride_o_t,
                       stride_o_h, H, num_blocks, max_blocks, i_w, 0, i_h, i_q, i_b, q_start, qlen, L, kv_lo, kv_hi,
                       0, 0, PAGE, MAX_QLEN, BLOCK_H, Q_PER, CAUSAL, WG, False, 1, out_desc, False, part_desc, pbar,
                       False)  # fmt: skip

    @gluon.jit
    def _pair_item(q, lat_desc, rope_desc, q_smem, lat_smem, rope_smem, m_smem, l_smem, ready_l, ready_r, m_ready,
                   p_ready, qbar, lbar, block_table, num_splits, span_indptr, span_flags, out, lse, o_part, lse_part,
                   scale_log2, v_scale, stride_q_t, stride_q_h, stride_bt_b, stride_o_t, stride_o_h, H, num_blocks,
                   max_blocks, i_w, reader, i_h, i_q, i_b, q_start, qlen, L, kv_lo, kv_hi, g0, sph,
                   PAGE: gl.constexpr, MAX_QLEN: gl.constexpr, BLOCK_H: gl.constexpr, Q_PER: gl.constexpr,
                   CAUSAL: gl.constexpr, WG: gl.constexpr, SPANS: gl.constexpr, READERS: gl.constexpr, out_desc,
                   OUT_TMA: gl.constexpr, part_desc, pbar, MERGE_TMA: gl.constexpr):  # fmt: skip
        """One work item (keys ``[kv_lo, kv_hi)`` of request ``i_b``, partial slot ``i_w``) for warpgroup ``WG``;
        ``g0``: the pairs this program did before (the stage barriers' phase), ``sph``: the Q / row-sum barriers'
        phase. Returns ``g0`` plus this item's pairs. The pairs are numbered on from ``g0`` (their phase is the
        number's parity; key ``kv_lo`` is pair ``g0``'s tile a). ``SPANS``: the item ends in ``_span_finish``
        (``reader``: the program's index in its group of ``READERS``). ``OUT_TMA``: its final rows leave by TMA, so
        the half that staged the previous item's rows is refilled last, after ``tma.store_wait``."""
        BLOCK_M: gl.constexpr = BLOCK_H * Q_PER
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 64, 16])  # fmt: skip
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 256, 16])  # fmt: skip
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        COL_S: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)

        n_pairs = gl.cdiv(gl.maximum(kv_hi - kv_lo, 0), 128)
        p_bt = block_table + i_b * stride_bt_b
        _seesaw_issue_q(q, q_smem, i_h, i_q, q_start, qlen, stride_q_t, stride_q_h, H, BLOCK_H, Q_PER, WG)
        if n_pairs > 0:  # tiles 0 and 1: warpgroup 0 loads the L groups, warpgroup 1 the R groups
            if WG == 0:
                bars = ready_l
            else:
                bars = ready_r
            if OUT_TMA:
                # the half the previous item's final rows may still be leaving by TMA (stage 0's L half / stage 1's R
                # half) last: the other stage's group first, then the wait for the store's reads
                _pair_refill(lat_desc, rope_desc, lat_smem, rope_smem, bars.index(1 - WG), p_bt, kv_lo + 64 * (1 - WG),
                             kv_hi, max_blocks, num_blocks, 1 - WG, WG, True, PAGE)  # fmt: skip
                tma.store_wait(0)
                gl.thread_barrier()
                _pair_refill(lat_desc, rope_desc, lat_smem, rope_smem, bars.index(WG), p_bt, kv_lo + 64 * WG, kv_hi,
                             max_blocks, num_blocks, WG, WG, False, PAGE)  # fmt: skip
            else:
                _pair_refill(lat_desc, rope_desc, lat_smem, rope_smem, bars.index(0), p_bt, kv_lo, kv_hi, max_blocks,
                             num_blocks, 0, WG, WG == 1, PAGE)  # fmt: skip
                _pair_refill(lat_desc, rope_desc, lat_smem, rope_smem, bars.index(1), p_bt, kv_lo + 64, kv_hi,
                             max_blocks, num_blocks, 1, WG, WG == 0, PAGE)  # fmt: skip

        _seesaw_wait_q(qbar, sph)
        limit = gl.expand_dims(_key_limit(i_q, qlen, L, kv_hi, ROW_S, BLOCK_M, Q_PER, CAUSAL), 1)
        m_run = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW_S)
        b_l = gl.zeros([BLOCK_M], gl.float32, ROW_S)
        acc = gl.zeros([BLOCK_M, 256], gl.float32, O_LAYOUT)
        b_s = gl.zeros([BLOCK_M, 64], gl.float32, S_LAYOUT)
        key0 = gl.expand_dims(gl.arange(0, 64, layout=COL_S), 0)

        if n_pairs > 0:  # the scores of this warpgroup's first tile (stage WG)
            z = L >> 31
            lat = lat_smem.index(WG + z)
            rope = rope_smem.index(WG + z)
            if OUT_TMA and WG == 0:  # stage 0's R half + rope came first (warpgroup 1's), its L half last
                b_s = _pair_qk_half(q_smem, lat, rope, b_s, ready_r.index(WG), g0 & 1, z, 1, True, True)
                b_s = _pair_qk_half(q_smem, lat, rope, b_s, ready_l.index(WG), g0 & 1, z, 0, False, False)
            else:
                b_s = _pair_qk_half(q_smem, lat, rope, b_s, ready_l.index(WG), g0 & 1, z, 0, WG == 1, True)
                b_s = _pair_qk_half(q_smem, lat, rope, b_s, ready_r.index(WG), g0 & 1, z, 1, WG == 0, False)
            b_s = warpgroup_mma_wait(0, deps=(b_s,))
        # the validity of this warpgroup's first tile's two boxes (for its mask) and the rows of the first pair's
        # refills (tiles 2 and 3); the pairs look up the later ones a pair ahead
        n_first = kv_lo + WG * 64
        ok0 = _box_ok(p_bt, n_first, kv_hi, max_blocks, num_blocks, PAGE)
        ok1 = _box_ok(p_bt, n_first + 32, kv_hi, max_blocks, num_blocks, PAGE)
        ra0, ra1, rb0, rb1 = _pair_rows_ahead(p_bt, kv_lo + 128, kv_hi, max_blocks, num_blocks, PAGE, False)
        lim_lo = gl.min(gl.min(limit, axis=1), axis=0)  # tiles wholly below it need no mask
        kv_base = kv_lo - g0 * 128  # pair i's tile a starts at kv_base + 128 i
        for i in range(g0, g0 + n_pairs - 1):
            if WG == 0:
                b_s, acc, b_l, m_run, ok0, ok1, ra0, ra1, rb0, rb1 = _pair_wg0(
                    i, b_s, acc, b_l, m_run, ok0, ok1, ra0, ra1, rb0, rb1, lat_desc, rope_desc, q_smem, lat_smem,
                    rope_smem, m_smem, ready_l, ready_r, m_ready, p_ready, p_bt, kv_base, kv_hi, L, limit, lim_lo,
                    key0, scale_log2, num_blocks, max_blocks, PAGE, False)  # fmt: skip
            else:
                b_s, acc, b_l, m_run, ok0, ok1, ra0, ra1, rb0, rb1 = _pair_wg1(
                    i, b_s, acc, b_l, m_run, ok0, ok1, ra0, ra1, rb0, rb1, lat_desc, rope_desc, q_smem, lat_smem,
                    rope_smem, m_smem, ready_l, ready_r, m_ready, p_ready, p_bt, kv_base, kv_hi, L, limit, lim_lo,
                    key0, scale_log2, num_blocks, max_blocks, PAGE, False)  # fmt: skip
        if n_pairs > 0:
            if WG == 0:
                b_s, acc, b_l, m_run, ok0, ok1, ra0, ra1, rb0, rb1 = _pair_wg0(
                    g0 + n_pairs - 1, b_s, acc, b_l, m_run, ok0, ok1, ra0, ra1, rb0, rb1, lat_desc, rope_desc,
                    q_smem, lat_smem, rope_smem, m_smem, ready_l, ready_r, m_ready, p_ready, p_bt, kv_base, kv_hi,
                    L, limit, lim_lo, key0, scale_log2, num_blocks, max_blocks, PAGE, True)  # fmt: skip
            else:
                b_s, acc, b_l, m_run, ok0, ok1, ra0, ra1, rb0, rb1 = _pair_wg1(
                    g0 + n_pairs - 1, b_s, acc, b_l, m_run, ok0, ok1, ra0, ra1, rb0, rb1, lat_desc, rope_desc,
                    q_smem, lat_smem, rope_smem, m_smem, ready_l, ready_r, m_ready, p_ready, p_bt, kv_base, kv_hi,
                    L, limit, lim_lo, key0, scale_log2, num_blocks, max_blocks, PAGE, True)  # fmt: skip

        # staging buffer: a latent half that only this warpgroup refills at the start of the next item (stage 0's L
        # half / stage 1's R half), so the other warpgroup's copies for that item cannot overwrite it
        if SPANS:
            _span_finish(acc, b_l, m_run, l_smem, lbar, sph, lat_smem.index(WG), num_splits, span_indptr, span_flags,
                         out, lse, o_part, lse_part, v_scale, stride_o_t, stride_o_h, H, i_w, reader, i_h, i_q, i_b,
                         q_start, qlen, MAX_QLEN, BLOCK_H, Q_PER, READERS, WG, out_desc, OUT_TMA, part_desc,
                         pbar.index(WG), MERGE_TMA)  # fmt: skip
        else:
            _seesaw_finish(acc, b_l, m_run, l_smem, lbar, sph, lat_smem.index(WG).slice(WG * 256, 256, dim=1),
                           num_splits, out, lse, o_part, lse_part, v_scale, stride_o_t, stride_o_h, H, i_w, i_h, i_q,
                           i_b, q_start, qlen, MAX_QLEN, BLOCK_H, Q_PER, WG)  # fmt: skip
        return g0 + n_pairs

    @gluon.jit(do_not_specialize=["num_tokens"])
    def _mla_decode_gluon_seesaw_kernel(
        q, lat_desc, rope_desc, block_table, seq_lens, query_start_loc, work_req, work_split, num_splits,
        split_len, out, lse, o_part, lse_part, scale_log2, v_scale, stride_q_t, stride_q_h, stride_bt_b,
        stride_o_t, stride_o_h, H, num_blocks, max_blocks, num_tokens, group_indptr, span_indptr, span_flags, out_desc,
        part_desc, PAGE: gl.constexpr, MAX_QLEN: gl.constexpr, BLOCK_H: gl.constexpr, Q_PER: gl.constexpr,
        CAUSAL: gl.constexpr, WG_REGS: gl.constexpr, N_HB: gl.constexpr, N_QB: gl.constexpr,
        PAIR: gl.constexpr, SPANS: gl.constexpr, OUT_TMA: gl.constexpr, MERGE_TMA: gl.constexpr,
        num_warps: gl.constexpr,
    ):  # fmt: skip
        """The seesaw kernels (bf16 cache, 64-key tiles, 2 stages); same grid and results as the ws kernel.
        ``PAIR=False``: ``variant="seesaw"`` (the comment above ``_seesaw_wg``); ``PAIR=True``: ``"pair"`` (the
        comment above ``_pair_wg0``). ``lat_desc`` / ``rope_desc``: ``[BOX, 256]`` / ``[BOX, 64]`` boxes over the
        cache's 2-D view. ``SPANS`` (pair kernel): the request-spanning schedule of ``openmla.ops.plan_spans``:
        program ``pid`` runs the items ``group_indptr[g]:group_indptr[g+1]`` of group ``g = pid // (N_HB * N_QB)``,
        with ``work_split`` / ``split_len`` holding each item's first key and key end, ``span_indptr`` each
        request's items and ``span_flags`` the pieces' flags (``_span_finish``; else these three are unused).
        ``OUT_TMA`` / ``MERGE_TMA`` (``SPANS``): final rows by TMA through ``out_desc``, cut requests merged from
        partials copied by TMA through ``part_desc``."""
        BLOCK_M: gl.constexpr = BLOCK_H * Q_PER
        gl.static_assert(BLOCK_M == 64, "64 rows per program (one wgmma M per warpgroup)")
        gl.static_assert(num_warps == 4, "warpgroup 0 is the default partition")
        gl.static_assert(PAIR or not SPANS, "SPANS: the pair schedule")
        gl.static_assert(SPANS or not OUT_TMA, "OUT_TMA: the request-spanning schedule's final rows")
        gl.static_assert(SPANS or not MERGE_TMA, "MERGE_TMA: the request-spanning schedule's merges")
        Q_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        VEC_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])

        if not SPANS:  # programs of unused slots and query blocks past the request's rows have nothing to do
            pid = gl.program_id(0)
            i_w = pid // (N_HB * N_QB)
            i_q = (pid // N_HB) % N_QB
            i_b = gl.load(work_req + i_w)
            if i_b < 0:
                return
            i_b = i_b.to(gl.int64)
            q_start, qlen = _row_count(query_start_loc, i_b, num_tokens, MAX_QLEN)
            if i_q * Q_PER >= qlen:
                return

        q_smem = gl.allocate_shared_memory(gl.bfloat16, [9, BLOCK_M, 64], Q_SMEM)
        lat_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 512], lat_desc.layout)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], rope_desc.layout)
        m_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], VEC_SMEM)
        l_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], VEC_SMEM)
        # four pairs of mbarriers, per stage / warpgroup st (all count 1):
        #   seesaw: bar_a = ready_x (the owner's latent half landed), bar_b = ready_y (the other half + the rope
        #           landed), bar_c = empty_y (the other warpgroup is done with the Y group), bar_d = pready (the
        #           owner stored P and M of the stage's tile);
        #   pair:   bar_a = ready_l (stage st's L half landed; stage 1: + the rope), bar_b = ready_r (the R half;
        #           stage 0: + the rope), bar_c = m_ready (warpgroup st stored its row max), bar_d = p_ready
        #           (warpgroup st stored its P)
        bar_a = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        bar_b = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        bar_c = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        bar_d = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        sync = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(2):
            mbarrier.init(bar_a.index(st), count=1)
            mbarrier.init(bar_b.index(st), count=1)
            mbarrier.init(bar_c.index(st), count=1)
            mbarrier.init(bar_d.index(st), count=1)
            mbarrier.init(sync.index(st), count=2)  # 0: Q stored (both halves); 1: row sums stored
        if MERGE_TMA:  # per warpgroup: a partial copied for the merge (_span_merge_tma)
            pbar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for st in gl.static_range(2):
                mbarrier.init(pbar.index(st), count=1)
        else:
            pbar = sync
        fence_async_shared()

        # (the partition list and the argument tuples must be literals: a JIT function in a variable, or a tuple
        # in a variable, loses the compile-time values the partitions need)
        if PAIR:
            gl.warp_specialize([
                (_pair_wg, (q, lat_desc, rope_desc, q_smem, lat_smem, rope_smem, m_smem, l_smem, bar_a, bar_b,
                            bar_c, bar_d, sync.index(0), sync.index(1), block_table, seq_lens, query_start_loc,
                            work_req, work_split, num_splits, split_len, group_indptr, span_indptr, span_flags,
                            out, lse, o_part, lse_part, scale_log2, v_scale, stride_q_t, stride_q_h, stride_bt_b,
                            stride_o_t, stride_o_h, H, num_blocks, max_blocks, num_tokens, PAGE, MAX_QLEN, BLOCK_H,
                            Q_PER, CAUSAL, N_HB, N_QB, 0, SPANS, out_desc, OUT_TMA, part_desc, pbar, MERGE_TMA)),
                (_pair_wg, (q, lat_desc, rope_desc, q_smem, lat_smem, rope_smem, m_smem, l_smem, bar_a, bar_b,
                            bar_c, bar_d, sync.index(0), sync.index(1), block_table, seq_lens, query_start_loc,
                            work_req, work_split, num_splits, split_len, group_indptr, span_indptr, span_flags,
                            out, lse, o_part, lse_part, scale_log2, v_scale, stride_q_t, stride_q_h, stride_bt_b,
                            stride_o_t, stride_o_h, H, num_blocks, max_blocks, num_tokens, PAGE, MAX_QLEN, BLOCK_H,
                            Q_PER, CAUSAL, N_HB, N_QB, 1, SPANS, out_desc, OUT_TMA, part_desc, pbar, MERGE_TMA)),
            ], [4], [WG_REGS])  # fmt: skip
        else:
            gl.warp_specialize([
                (_seesaw_wg, (q, lat_desc, rope_desc, q_smem, lat_smem, rope_smem, m_smem, l_smem, bar_a, bar_b,
                              bar_c, bar_d, sync.index(0), sync.index(1), block_table, seq_lens, query_start_loc,
                              work_req, work_split, num_splits, split_len, out, lse, o_part, lse_part, scale_log2,
                              v_scale, stride_q_t, stride_q_h, stride_bt_b, stride_o_t, stride_o_h, H, num_blocks,
                              max_blocks, num_tokens, PAGE, MAX_QLEN, BLOCK_H, Q_PER, CAUSAL, N_HB, N_QB, 0)),
                (_seesaw_wg, (q, lat_desc, rope_desc, q_smem, lat_smem, rope_smem, m_smem, l_smem, bar_a, bar_b,
                              bar_c, bar_d, sync.index(0), sync.index(1), block_table, seq_lens, query_start_loc,
                              work_req, work_split, num_splits, split_len, out, lse, o_part, lse_part, scale_log2,
                              v_scale, stride_q_t, stride_q_h, stride_bt_b, stride_o_t, stride_o_h, H, num_blocks,
                              max_blocks, num_tokens, PAGE, MAX_QLEN, BLOCK_H, Q_PER, CAUSAL, N_HB, N_QB, 1)),
            ], [4], [WG_REGS])  # fmt: skip

        for st in gl.static_range(2):
            mbarrier.invalidate(bar_a.index(st))
            mbarrier.invalidate(bar_b.index(st))
            mbarrier.invalidate(bar_c.index(st))
            mbarrier.invalidate(bar_d.index(st))
            mbarrier.invalidate(sync.index(st))
            if MERGE_TMA:
                mbarrier.invalidate(pbar.index(st))
