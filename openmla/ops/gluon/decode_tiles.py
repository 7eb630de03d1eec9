"""Gluon helpers shared by the Hopper decode kernels (:mod:`openmla.ops.gluon.decode`,
:mod:`openmla.ops.gluon.decode_seesaw`): the query rows a program may touch, page lookups of 32-key boxes for
TMA, zeroing the rows of a landed tile that lie past the sequence end, and storing a program's normalised output
rows and LSE."""

from __future__ import annotations

from openmla.ops.gluon._lang import GLUON_AVAILABLE, fence_async_shared, gl, gluon, mbarrier, tma

if GLUON_AVAILABLE:

    @gluon.jit
    def _row_count(query_start_loc, i_b, num_tokens, MAX_QLEN: gl.constexpr):
        """Request ``i_b``'s first query row and how many of its rows a program touches: those inside
        ``[0, num_tokens)``, at most the plan's ``MAX_QLEN``, none when it starts below 0. For a checked batch this is
        the query length; an unchecked ``query_start_loc`` never sends a load or store outside q, out or the
        partials."""
        q_start = gl.load(query_start_loc + i_b)
        n = gl.minimum(gl.minimum(gl.load(query_start_loc + i_b + 1), num_tokens) - q_start, MAX_QLEN)
        n = gl.where(q_start < 0, 0, gl.maximum(n, 0))
        return q_start, n

    @gluon.jit
    def _q_ptrs(q, q_start, qlen, i_h, i_q, H, stride_q_t, stride_q_h, BLOCK_H: gl.constexpr, Q_PER: gl.constexpr,
                LD: gl.constexpr):  # fmt: skip
        """A program's q rows in layout ``LD``: row pointers ``[BLOCK_H * Q_PER, 1]`` (row m: token
        ``i_q * Q_PER + m // BLOCK_H``, head ``i_h * BLOCK_H + m % BLOCK_H``), their mask (the rows that exist) and
        the column offsets ``[1, 64]`` of a 64-column chunk."""
        o_m = gl.arange(0, BLOCK_H * Q_PER, layout=gl.SliceLayout(1, LD))
        o_t = i_q * Q_PER + o_m // BLOCK_H
        o_h = i_h * BLOCK_H + o_m % BLOCK_H
        m_ld = gl.expand_dims((o_t < qlen) & (o_h < H), 1)
        p_q = q + gl.expand_dims((q_start + o_t).to(gl.int64) * stride_q_t + o_h * stride_q_h, 1)
        o_c = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, LD)), 0)
        return p_q, m_ld, o_c

    @gluon.jit
    def _q_to_smem(q, q_smem, q_start, qlen, i_h, i_q, H, stride_q_t, stride_q_h, BLOCK_H: gl.constexpr,
                   Q_PER: gl.constexpr, NUM_WARPS: gl.constexpr):  # fmt: skip
        """Load a program's q rows into the 9 swizzled 64-column chunks of ``q_smem`` (in its dtype; rows that do not
        exist are zeros), fenced for the wgmma reads and followed by a barrier of the ``NUM_WARPS`` warps."""
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
        p_q, m_ld, o_c = _q_ptrs(q, q_start, qlen, i_h, i_q, H, stride_q_t, stride_q_h, BLOCK_H, Q_PER, LD)
        for c in gl.static_range(9):
            b_q = gl.load(p_q + (c * 64 + o_c), mask=m_ld, other=0.0)
            q_smem.index(c).store(b_q.to(q_smem.dtype))  # fp16 with an fp8 cache (like the portable kernel)
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _key_limit(i_q, qlen, L, kv_hi, LAYOUT: gl.constexpr, BLOCK_M: gl.constexpr, Q_PER: gl.constexpr,
                   CAUSAL: gl.constexpr):  # fmt: skip
        """``[BLOCK_M]`` in ``LAYOUT``: the first key each of a program's rows does not see (causal: query t of the
        request's qlen sees keys ``< L - qlen + t + 1``), at most ``kv_hi``."""
        o_ts = i_q * Q_PER + gl.arange(0, BLOCK_M, layout=LAYOUT) // (BLOCK_M // Q_PER)
        if CAUSAL:
            limit = L - qlen + o_ts + 1
        else:
            limit = gl.full([BLOCK_M], 0, gl.int32, LAYOUT) + L
        return gl.minimum(limit, kv_hi)

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
    def _issue_kv(lat_desc, rope_desc, lat_smem, rope_smem, bars, stage, row0, row1, NSUB: gl.constexpr,
                  ELEM_BYTES: gl.constexpr = 2):  # fmt: skip
        """Start the TMA loads of one KV tile (NSUB boxes of 32 keys: [32, 512] latent + [32, 64] rope)."""
        bar = bars.index(stage)
        mbarrier.expect(bar, NSUB * 32 * 576 * ELEM_BYTES)
        for h in gl.static_range(NSUB):
            row = row0 if h == 0 else row1
            tma.async_copy_global_to_shared(lat_desc, [row, 0], bar, lat_smem.index(stage).slice(h * 32, 32, dim=0))
            tma.async_copy_global_to_shared(rope_desc, [row, 512], bar, rope_smem.index(stage).slice(h * 32, 32, dim=0))

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
    def _store_result(acc, b_l, m_run, v_scale, num_splits, out, lse, o_part, lse_part, stride_o_t, stride_o_h, H,
                      i_w, i_h, i_q, i_b, q_start, qlen, MAX_QLEN: gl.constexpr, BLOCK_H: gl.constexpr,
                      Q_PER: gl.constexpr, COL0: gl.constexpr, WRITE_LSE: gl.constexpr):  # fmt: skip
        """Normalise the program's output columns ``[COL0, COL0 + acc.shape[1])`` (fp32 ``acc``; row sums ``b_l``
        and running row max ``m_run``, base 2; times ``v_scale``) and store them, with the natural-log LSE when
        ``WRITE_LSE`` (-inf and zeros for a row that saw no key): the final rows of a single-split request in
        ``out`` / ``lse``, else the work item's partial in ``o_part`` / ``lse_part``."""
        BLOCK_M: gl.constexpr = BLOCK_H * Q_PER
        NCOL: gl.constexpr = acc.shape[1]
        ROW_S: gl.constexpr = b_l.type.layout
        ROW_O: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
        COL_O: gl.constexpr = gl.SliceLayout(0, acc.type.layout)
        n_split = gl.load(num_splits + i_b)
        empty_r = b_l == 0.0
        b_lse = gl.where(empty_r, float("-inf"),
                         (m_run + gl.log2(gl.where(empty_r, 1.0, b_l))) * 0.6931471805599453)  # fmt: skip
        b_inv = gl.where(empty_r, 0.0, v_scale / gl.where(empty_r, 1.0, b_l))
        b_o = acc * gl.expand_dims(gl.convert_layout(b_inv, ROW_O), 1)
        o_mo = gl.arange(0, BLOCK_M, layout=ROW_O)
        o_to = i_q * Q_PER + o_mo // BLOCK_H
        o_ho = i_h * BLOCK_H + o_mo % BLOCK_H
        m_o = gl.expand_dims((o_to < qlen) & (o_ho < H), 1)
        o_v = gl.expand_dims(COL0 + gl.arange(0, NCOL, layout=COL_O), 0)
        o_ms = gl.arange(0, BLOCK_M, layout=ROW_S)
        o_ts = i_q * Q_PER + o_ms // BLOCK_H
        o_hs = i_h * BLOCK_H + o_ms % BLOCK_H
        m_s = (o_ts < qlen) & (o_hs < H) & WRITE_LSE
        if n_split == 1:
            row = (q_start + o_to).to(gl.int64)
            p_o = out + gl.expand_dims(row * stride_o_t + o_ho * stride_o_h, 1) + o_v
            gl.store(p_o, b_o.to(out.dtype.element_ty), mask=m_o)
            gl.store(lse + (q_start + o_ts).to(gl.int64) * H + o_hs, b_lse, mask=m_s)
        else:
            part = (i_w.to(gl.int64) * MAX_QLEN + o_to) * H + o_ho
            gl.store(o_part + gl.expand_dims(part * 512, 1) + o_v, b_o, mask=m_o)
            gl.store(lse_part + (i_w.to(gl.int64) * MAX_QLEN + o_ts) * H + o_hs, b_lse, mask=m_s)
