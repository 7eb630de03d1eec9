"""Hopper (sm90) dense decode over an fp8 (e4m3) cache for narrow tiles (heads x query rows <= 32).

The ``ws`` kernel (:mod:`openmla.ops.gluon.decode`) puts 64 rows on the wgmma's M whatever the head count, widens
each fp8 tile to fp16 in its consumer warpgroups and only then runs the products: at 16 heads three quarters of its
tensor work is padding and the widening sits in series with the MMAs, so h16 b128 s8k took 432 us against the bf16
kernel's 287 although it reads half the bytes (docs/kernels.md, "The fp8 cache at 16 heads"). Here:

* the products are transposed so the ``HB`` rows (8, 16 or 32: ``BLOCK_H`` heads x ``Q_PER`` query tokens, heads
  first) are the N: ``S^T = K Q^T`` (M = the tile's 64 keys; A = the fp16 key tile, K-major; B = Q^T) and
  ``O^T = V^T P^T`` (M = the 512 output columns in 8 repeats; A = the same tile seen MN-major; B = P^T);
* three partitions: a TMA warp (page lookups, 32-key e4m3 boxes into a ring of ``RAW`` raw stages), a widening
  warpgroup (a raw stage widened to fp16 registers by ``cvt.rn.f16x2.e4m3x2`` (exact), keys >= the sequence length
  zeroed in the stage that holds them (their bytes may be NaN), the stage fenced and handed back, the values stored
  into one of two fp16 tiles) and the consumer warpgroup (the products, the online softmax down the columns of
  ``S^T``, the epilogue). Widening tile j+1 overlaps the products of tile j.

Contract: ``_mla_decode_gluon_ws_kernel``'s (one program per plan work item and query block, the final rows of a
single-split request in ``out``/``lse``, else the normalised fp32 partial and its natural-log LSE for the reduce;
q rounded to fp16, P in fp16, ``kv_scale`` folded into ``scale_log2`` and ``v_scale`` by the caller).

Shared memory (HB 32): Q 36,864 + 2 fp16 tiles x 73,728 + 2 raw stages x 18,432 + P 4,096 (+ barriers and the
column-max scratch); HB <= 16 has room for 3 raw stages.
"""

from __future__ import annotations

import triton

from openmla.ops.gluon._lang import GLUON_AVAILABLE, fence_async_shared, gl, gluon, mbarrier

__all__ = ["NARROW_MAX_ROWS", "launch_decode_narrow", "narrow_config", "raw_stages"]

NARROW_MAX_ROWS = 32  # heads x query rows up to this take the narrow fp8 kernel (the N of its products)
BLOCK_N = 64  # keys per tile: the M of S^T
SUB_N = 32  # keys per raw stage (one TMA box pair: a box never crosses a page)
STAGES = 2  # fp16 tiles
NUM_WARPS = 4  # the consumer warpgroup (the default partition)
WIDEN_REGS = 128  # registers of a widening thread (setmaxnreg): a widened raw stage is 72 of them
TMA_REGS = 32  # the TMA warp's
SMEM_LIMIT = 232448
_SCRATCH = 2048  # barriers and the compiler's column-max scratch (an upper bound)


def narrow_config(num_heads: int, max_query_len: int) -> tuple[int, int]:
    """``(BLOCK_H, Q_PER)``: ``HB = BLOCK_H * Q_PER`` rows, heads first, HB the rows rounded up to 8, 16 or 32."""
    rows = min(num_heads * max_query_len, NARROW_MAX_ROWS)
    hb = max(8, triton.next_power_of_2(rows))
    block_h = min(triton.next_power_of_2(num_heads), hb)
    return block_h, hb // block_h


def raw_stages(hb: int) -> int:
    """Raw 32-key stages that fit beside Q, the two fp16 tiles and P (3 at HB <= 16, 2 at 32)."""
    free = SMEM_LIMIT - hb * 576 * 2 - STAGES * BLOCK_N * 576 * 2 - hb * BLOCK_N * 2 - _SCRATCH
    return min(4, free // (SUB_N * 576))


if GLUON_AVAILABLE:
    from openmla.ops.gluon.decode_tiles import _box_ok, _issue_kv, _key_limit, _kv_rows, _q_to_smem, _row_count
    from openmla.ops.gluon.transposed import _finish_t, _scores_t, _softmax_pv_t

    _BLOCK_N = gl.constexpr(BLOCK_N)
    _SUB_N = gl.constexpr(SUB_N)
    _STAGES = gl.constexpr(STAGES)

    @gluon.jit
    def _narrow_tma(lat_desc, rope_desc, raw_lat, raw_rope, raw_ready, raw_empty, p_bt, kv_lo, kv_hi, n_tiles,
                    max_blocks, num_blocks, PAGE: gl.constexpr, RAW: gl.constexpr):  # fmt: skip
        """The TMA warp: each 32-key box pair of the split into the raw ring (a box past the split or on an invalid
        block id is aimed outside the descriptor: zeros, nothing read)."""
        row = _kv_rows(p_bt, kv_lo, kv_hi, max_blocks, num_blocks, PAGE, 0)
        for u in range(2 * n_tiles):
            r = u % RAW
            mbarrier.wait(raw_empty.index(r), ((u // RAW) & 1) ^ 1)  # fresh barriers pass parity 1 at once
            _issue_kv(lat_desc, rope_desc, raw_lat, raw_rope, raw_ready, r, row, row, 1, 1)
            # the next box's page lookup, in flight while this warp waits for its stage
            row = _kv_rows(p_bt, kv_lo + (u + 1) * _SUB_N, kv_hi, max_blocks, num_blocks, PAGE, 0)

    @gluon.jit
    def _narrow_widen(raw_lat, raw_rope, lat16, rope16, raw_ready, raw_empty, ready, empty, kv_lo, L, n_tiles,
                      RAW: gl.constexpr):  # fmt: skip
        """The widening warpgroup: raw stage -> registers -> the stage handed back -> fp16 tile (keys >= L zeroed)."""
        LAT_W: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # 16 bytes a load, 32 x 64 a pass
        ROPE_W: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        o_rl = gl.expand_dims(gl.arange(0, _SUB_N, layout=gl.SliceLayout(1, LAT_W)), 1)
        o_rr = gl.expand_dims(gl.arange(0, _SUB_N, layout=gl.SliceLayout(1, ROPE_W)), 1)
        for j in range(n_tiles):
            stage = j % _STAGES
            n0 = kv_lo + j * _BLOCK_N
            for h in gl.static_range(2):
                x0, x1, x2, x3, xr = _widen_half(raw_lat, raw_rope, raw_ready, raw_empty, 2 * j + h, n0 + h * _SUB_N,
                                                 L, o_rl, o_rr, LAT_W, ROPE_W, RAW)  # fmt: skip
                if h == 0:  # the consumer is done with this fp16 tile (fresh barriers pass parity 1 at once)
                    mbarrier.wait(empty.index(stage), ((j // _STAGES) & 1) ^ 1)
                _store_half(lat16.index(stage), rope16.index(stage), h * _SUB_N, x0, x1, x2, x3, xr)
            fence_async_shared()  # generic-proxy stores before the consumer's wgmma reads
            gl.thread_barrier()  # the whole tile is written
            mbarrier.arrive(ready.index(stage), count=1)

    @gluon.jit
    def _widen_half(raw_lat, raw_rope, raw_ready, raw_empty, u, n0, L, o_rl, o_rr, LAT_W: gl.constexpr,
                    ROPE_W: gl.constexpr, RAW: gl.constexpr):  # fmt: skip
        """Raw stage ``u % RAW`` (keys from ``n0``) widened to fp16 registers, keys >= L zeroed (their bytes may be
        NaN), and the stage handed back to the TMA warp."""
        r = u % RAW
        mbarrier.wait(raw_ready.index(r), (u // RAW) & 1)
        src = raw_lat.index(r)
        x0 = src.slice(0, 128, dim=1).load(LAT_W).to(gl.float16)
        x1 = src.slice(128, 128, dim=1).load(LAT_W).to(gl.float16)
        x2 = src.slice(256, 128, dim=1).load(LAT_W).to(gl.float16)
        x3 = src.slice(384, 128, dim=1).load(LAT_W).to(gl.float16)
        xr = raw_rope.index(r).load(ROPE_W).to(gl.float16)
        if n0 + _SUB_N > L:  # the stage holds the sequence end: rows past it are zeros (only there, selects cost)
            keep = (n0 + o_rl) < L
            x0 = gl.where(keep, x0, 0.0)
            x1 = gl.where(keep, x1, 0.0)
            x2 = gl.where(keep, x2, 0.0)
            x3 = gl.where(keep, x3, 0.0)
            xr = gl.where((n0 + o_rr) < L, xr, 0.0)
        # the widened values depend on the loads, so they have landed; the fence orders these generic reads before
        # the TMA warp's next (async-proxy) copy into the stage
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(raw_empty.index(r), count=1)
        return x0, x1, x2, x3, xr

    @gluon.jit
    def _store_half(lat, rope, ROW0: gl.constexpr, x0, x1, x2, x3, xr):
        """Rows ``[ROW0, ROW0 + 32)`` of an fp16 tile from one widened raw stage."""
        dst = lat.slice(ROW0, _SUB_N, dim=0)
        dst.slice(0, 128, dim=1).store(x0)
        dst.slice(128, 128, dim=1).store(x1)
        dst.slice(256, 128, dim=1).store(x2)
        dst.slice(384, 128, dim=1).store(x3)
        rope.slice(ROW0, _SUB_N, dim=0).store(xr)

    @gluon.jit
    def _narrow_consumer(q, q_smem, lat16, rope16, p_smem, ready, empty, p_bt, num_splits, out, lse, o_part, lse_part,
                         scale_log2, v_scale, stride_q_t, stride_q_h, stride_o_t, stride_o_h, H, num_blocks,
                         max_blocks, i_w, i_h, i_q, i_b, q_start, qlen, L, kv_lo, kv_hi, n_tiles, PAGE: gl.constexpr,
                         MAX_QLEN: gl.constexpr, BLOCK_H: gl.constexpr, Q_PER: gl.constexpr,
                         CAUSAL: gl.constexpr):  # fmt: skip
        """The consumer warpgroup: Q to shared memory (fp16), the online softmax over the fp16 tiles (transposed
        products), the epilogue."""
        HB: gl.constexpr = BLOCK_H * Q_PER
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, HB, 16])  # fmt: skip
        KEY: gl.constexpr = gl.SliceLayout(1, S_L)
        ROW: gl.constexpr = gl.SliceLayout(0, S_L)  # a column of S^T / O^T: one (token, head) row of the output
        DIM: gl.constexpr = gl.SliceLayout(1, S_L)

        # Q [HB, 576] -> 9 swizzled fp16 chunks (rows past the request's tokens or H are zeros, never stored)
        _q_to_smem(q, q_smem, q_start, qlen, i_h, i_q, H, stride_q_t, stride_q_h, BLOCK_H, Q_PER, 4)
        limit = gl.expand_dims(_key_limit(i_q, qlen, L, kv_hi, ROW, HB, Q_PER, CAUSAL), 0)
        o_n = gl.arange(0, _BLOCK_N, layout=KEY)
        b_m = gl.full([HB], float("-inf"), gl.float32, ROW)
        b_lv = gl.zeros([_BLOCK_N, HB], gl.float32, S_L)  # column sums per key row until the epilogue
        acc = gl.zeros([512, HB], gl.float32, S_L)
        s_zero = gl.zeros([_BLOCK_N, HB], gl.float32, S_L)
        ok0 = _box_ok(p_bt, kv_lo, kv_hi, max_blocks, num_blocks, PAGE)
        ok1 = _box_ok(p_bt, kv_lo + _SUB_N, kv_hi, max_blocks, num_blocks, PAGE)
        for j in range(n_tiles):
            stage = j % _STAGES
            n0 = kv_lo + j * _BLOCK_N
            m_n = gl.expand_dims(gl.where(o_n < _SUB_N, ok0, ok1), 1) & (gl.expand_dims(n0 + o_n, 1) < limit)
            # the next tile's page lookups, in flight during this tile's products
            ok0 = _box_ok(p_bt, n0 + _BLOCK_N, kv_hi, max_blocks, num_blocks, PAGE)
            ok1 = _box_ok(p_bt, n0 + _BLOCK_N + _SUB_N, kv_hi, max_blocks, num_blocks, PAGE)
            mbarrier.wait(ready.index(stage), (j // _STAGES) & 1)
            k_lat = lat16.index(stage)
            b_s = _scores_t(k_lat, rope16.index(stage), q_smem, s_zero, True)
            b_s = gl.where(m_n, b_s * scale_log2, float("-inf"))
            b_m, b_lv, acc = _softmax_pv_t(b_s, b_m, b_lv, acc, k_lat, p_smem)
            mbarrier.arrive(empty.index(stage), count=1)  # the widening warpgroup may refill this fp16 tile

        # epilogue: natural-log LSE (base-2 running max), -inf and zeros for a row that saw no key
        _, b_lse, b_r = _finish_t(b_lv, b_m, v_scale)
        b_o = acc * gl.expand_dims(b_r, 0)
        o_ms = gl.arange(0, HB, layout=ROW)
        o_ts = i_q * Q_PER + o_ms // BLOCK_H
        o_hs = i_h * BLOCK_H + o_ms % BLOCK_H
        m_s = (o_ts < qlen) & (o_hs < H)
        m_o = gl.expand_dims(m_s, 0)
        o_v = gl.expand_dims(gl.arange(0, 512, layout=DIM), 1)
        if gl.load(num_splits + i_b) == 1:
            row = (q_start + o_ts).to(gl.int64)
            p_o = out + gl.expand_dims(row * stride_o_t + o_hs * stride_o_h, 0) + o_v
            gl.store(p_o, b_o.to(out.dtype.element_ty), mask=m_o)
            gl.store(lse + row * H + o_hs, b_lse, mask=m_s)
        else:
            part = (i_w.to(gl.int64) * MAX_QLEN + o_ts) * H + o_hs
            gl.store(o_part + gl.expand_dims(part * 512, 0) + o_v, b_o, mask=m_o)
            gl.store(lse_part + part, b_lse, mask=m_s)

    @gluon.jit(do_not_specialize=["num_tokens"])
    def _mla_decode_gluon_narrow_kernel(
        q, lat_desc, rope_desc, block_table, seq_lens, query_start_loc, work_req, work_split, num_splits,
        split_len, out, lse, o_part, lse_part, scale_log2, v_scale, stride_q_t, stride_q_h, stride_bt_b,
        stride_o_t, stride_o_h, H, num_blocks, max_blocks, num_tokens,
        PAGE: gl.constexpr, MAX_QLEN: gl.constexpr, BLOCK_H: gl.constexpr, Q_PER: gl.constexpr,
        CAUSAL: gl.constexpr, RAW: gl.constexpr, WIDEN_REGS: gl.constexpr, TMA_REGS: gl.constexpr,
        N_QB: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """One program per work item and query block (the ``N_QB`` query blocks of an item adjacent); see the
        module docstring."""
        HB: gl.constexpr = BLOCK_H * Q_PER
        gl.static_assert(HB == 8 or HB == 16 or HB == 32, "N of the transposed products: 8, 16 or 32 rows")
        gl.static_assert(num_warps == 4, "one consumer warpgroup in the default partition")
        pid = gl.program_id(0)
        i_w = pid // N_QB
        i_q = pid % N_QB
        i_h = 0  # BLOCK_H covers every head (H <= 32)
        i_b = gl.load(work_req + i_w)
        if i_b < 0:
            return
        i_b = i_b.to(gl.int64)
        q_start, qlen = _row_count(query_start_loc, i_b, num_tokens, MAX_QLEN)
        if i_q * Q_PER >= qlen:
            return
        L = gl.load(seq_lens + i_b)
        chunk = gl.load(split_len + i_b)
        kv_lo = gl.load(work_split + i_w) * chunk
        kv_hi = gl.minimum(L, kv_lo + chunk)
        if CAUSAL:
            kv_hi = gl.minimum(kv_hi, L - qlen + gl.minimum(i_q * Q_PER + Q_PER, qlen))
        n_tiles = gl.cdiv(gl.maximum(kv_hi - kv_lo, 0), _BLOCK_N)
        p_bt = block_table + i_b * stride_bt_b

        SW: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        q_smem = gl.allocate_shared_memory(gl.float16, [9, HB, 64], SW)
        lat16 = gl.allocate_shared_memory(gl.float16, [_STAGES, _BLOCK_N, 512], SW)
        rope16 = gl.allocate_shared_memory(gl.float16, [_STAGES, _BLOCK_N, 64], SW)
        p_smem = gl.allocate_shared_memory(gl.float16, [HB, _BLOCK_N], SW)
        raw_lat = gl.allocate_shared_memory(gl.float8e4nv, [RAW, _SUB_N, 512], lat_desc.layout)
        raw_rope = gl.allocate_shared_memory(gl.float8e4nv, [RAW, _SUB_N, 64], rope_desc.layout)
        raw_ready = gl.allocate_shared_memory(gl.int64, [RAW, 1], mbarrier.MBarrierLayout())
        raw_empty = gl.allocate_shared_memory(gl.int64, [RAW, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [_STAGES, 1], mbarrier.MBarrierLayout())
        for r in gl.static_range(RAW):
            mbarrier.init(raw_ready.index(r), count=1)
            mbarrier.init(raw_empty.index(r), count=1)
        for st in gl.static_range(_STAGES):
            mbarrier.init(ready.index(st), count=1)
            mbarrier.init(empty.index(st), count=1)
        fence_async_shared()  # barrier inits visible to the async proxy and the other partitions

        gl.warp_specialize([
            (_narrow_consumer, (q, q_smem, lat16, rope16, p_smem, ready, empty, p_bt, num_splits, out, lse, o_part,
                                lse_part, scale_log2, v_scale, stride_q_t, stride_q_h, stride_o_t, stride_o_h, H,
                                num_blocks, max_blocks, i_w, i_h, i_q, i_b, q_start, qlen, L, kv_lo, kv_hi, n_tiles,
                                PAGE, MAX_QLEN, BLOCK_H, Q_PER, CAUSAL)),
            (_narrow_widen, (raw_lat, raw_rope, lat16, rope16, raw_ready, raw_empty, ready, empty, kv_lo, L, n_tiles,
                             RAW)),
            (_narrow_tma, (lat_desc, rope_desc, raw_lat, raw_rope, raw_ready, raw_empty, p_bt, kv_lo, kv_hi, n_tiles,
                           max_blocks, num_blocks, PAGE, RAW)),
        ], [4, 1], [WIDEN_REGS, TMA_REGS])  # fmt: skip

        for r in gl.static_range(RAW):
            mbarrier.invalidate(raw_ready.index(r))
            mbarrier.invalidate(raw_empty.index(r))
        for st in gl.static_range(_STAGES):
            mbarrier.invalidate(ready.index(st))
            mbarrier.invalidate(empty.index(st))


def launch_decode_narrow(args: tuple, grid_items: int, page: int, max_query_len: int, num_heads: int,
                         causal: bool) -> None:  # fmt: skip
    """Launch the narrow fp8 kernel over ``grid_items`` work items: ``args`` are the ws kernel's positional
    arguments (descriptors over the e4m3 cache with 32-key boxes), as
    :func:`openmla.ops.gluon.decode.mla_decode_split_gluon` prepared them."""
    block_h, q_per = narrow_config(num_heads, max_query_len)
    n_qb = triton.cdiv(max_query_len, q_per)
    _mla_decode_gluon_narrow_kernel[(grid_items * n_qb,)](
        *args, PAGE=page, MAX_QLEN=max_query_len, BLOCK_H=block_h, Q_PER=q_per, CAUSAL=causal,
        RAW=raw_stages(block_h * q_per), WIDEN_REGS=WIDEN_REGS, TMA_REGS=TMA_REGS, N_QB=n_qb, num_warps=NUM_WARPS,
    )  # fmt: skip
