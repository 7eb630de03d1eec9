"""Hopper (sm90) tier of sparse MLA for narrow head counts (H <= 32): both products computed transposed.

The 64-head kernel (:mod:`openmla.ops.gluon.sparse`) puts the heads on the wgmma's M, which is 64 rows whatever H
is: at 16 heads three quarters of its tensor work is padding, and a 64-key tile costs about the same 4.25 us at 16
heads as at 128 (docs/sparse_mla.md). Here the heads are the N of both products, which wgmma takes from 8 up:

* ``S^T = K Q^T``: M = the tile's 64 keys, N = HB heads (8, 16 or 32), K = the row width (9 or 8 chunks of 64);
  A = the bf16 key tile (K-major, as the ring holds it), B = Q^T (Q ``[HB, 64]`` chunks, K-major);
* ``O^T = V^T P^T``: M = the 512 output columns (8 repeats of 64), N = HB, K = the 64 keys; A = the same tile seen
  transposed (MN-major), B = P^T (P ``[HB, 64]``, K-major).

So the MMA work scales with HB and the accumulator ``O^T [512, HB]`` is 32-128 fp32 registers a thread: one
consumer warpgroup holds it. The producers are the 64-head kernel's (``_producer``: bf16 rows by ``cp.async``,
``fp8_ds_mla`` and ``fp8_v4`` rows loaded and dequantised into the bf16 ring), two warpgroups, each filling one of
the two stages (tiles 0, 2, 4, ... and 1, 3, 5, ...), issuing a whole fp8 tile's loads before it waits for its
stage, with the tile's slots loaded while the previous tile was in flight (``AHEAD``): at narrow heads the gather's
latency, not the MMA, is a tile's cost (docs/sparse_mla.md, "Narrow heads"). With fp8_v4 rows at HB <= 16 ("ring",
the default in one split) each producer instead has a raw stage: it copies its next tile's rows there by cp.async
while it dequantises the tile before from registers (``_gather_v4_ring``), so a tile is in flight during the
conversion.

One program per (query row, split of its key list); the contract, split rule, validity rules, epilogue and outputs
are the 64-head kernel's (one split writes ``out`` and the sink-free natural-log ``lse``, several write the fp32
partials the Triton merge kernel combines). The softmax runs over the keys, i.e. down the columns of ``S^T``: the
column max goes across the warpgroup's 4 warps through the compiler's shared-memory reduction; the column sums stay
per key row until the epilogue.

Shared memory (V3.2, HB 32): Q 36,864 + 2 stages x (65,536 + 8,192) + P 4,096 (+ barriers / reduction scratch);
"ring" (V4, HB 16) adds 2 raw stages of 37,376 bytes (7 e4m3 groups, the bf16 rope, the exponent words): 225,592 in
all of the 232,448.
"""

from __future__ import annotations

import triton

from openmla.ops.gluon._lang import (
    GLUON_AVAILABLE,
    async_copy,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
)
from openmla.ops.gluon.decode import SMEM_LIMIT
from openmla.ops.gluon.sparse import NARROW_MAX_H

__all__ = ["NARROW_MAX_H", "launch_narrow", "narrow_block_h"]

BLOCK_N = 64  # keys per tile: the M of S^T
STAGES = 2  # bf16 tiles in the ring
NUM_WARPS = 4  # the consumer warpgroup (the default partition)
# registers of a producer thread (setmaxnreg) by cache format: each of the two producer warpgroups loads a whole fp8
# tile into registers before dequantising it (FP8_PASSES 1); the consumer warpgroup gets the rest of the file
PRODUCER_REGS = {0: 56, 1: 136, 2: 128}  # sm90 offline: no spill in either partition (at 136 fp8_v4 spills; at
# 128 fp8_ds_mla with its slots a tile ahead spills 16 bytes)
FP8_PASSES = 1  # row blocks of a tile the fp8 producers load and dequantise in turn


def narrow_block_h(H: int) -> int:
    """The N of the program's products: H rounded up to 8, 16 or 32 (wgmma N; the rows past H are masked)."""
    return max(8, triton.next_power_of_2(H))


# "ring": a raw stage per producer: fp8_v4 (D 512) 7 e4m3 groups [64, 64], the bf16 rope [64, 64], 2 exponent words a
# row; fp8_ds_mla (D 576) half a tile: e4m3 [32, 512], the bf16 rope [32, 64], 4 fp32 scales a row
RING_STAGE_BYTES = {512: 7 * BLOCK_N * 64 + BLOCK_N * 64 * 2 + 2 * BLOCK_N * 4,
                    576: BLOCK_N // 2 * (512 + 64 * 2 + 4 * 4)}  # fmt: skip


def _smem_bytes(d_qk: int, hb: int, ring: bool = False) -> int:
    """Shared memory of one program (an upper bound): Q + the bf16 ring + P + barriers / reduction scratch (+ the raw
    stages of "ring")."""
    raw = STAGES * RING_STAGE_BYTES[d_qk] if ring else 0
    return hb * d_qk * 2 + STAGES * BLOCK_N * d_qk * 2 + hb * BLOCK_N * 2 + 4096 + raw


if GLUON_AVAILABLE:
    from openmla.ops.gluon.sparse import (
        _dequant,
        _producer,
        _q_to_smem,
        _row_offsets,
        _row_split,
        _sink_factor,
        _tile_ok,
        _tile_slots,
        _v4_raw_load,
        _v4_ring_issue,
        _v4_store_rows,
    )
    from openmla.ops.gluon.transposed import _finish_t, _scores_t, _softmax_pv_t

    @gluon.jit
    def _lane_xor4(x):
        """Each value of a thread swapped with the same value of the lane 4 apart (``shfl.sync.bfly``): in the
        wgmma accumulator layout that lane holds the same column of the row of the other parity."""
        return gl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 4, 0x1f, -1;", "=r,r", [x], dtype=gl.float32,
                                         is_pure=True, pack=1)  # fmt: skip

    @gluon.jit
    def _inverse_rope_t(x, o_v, rope_pos, i_t, cos_sin, stride_cs, num_pos, ROPE: gl.constexpr):
        """fp32 ``O^T [512, HB]`` (wgmma accumulator layout, ``o_v [512, 1]`` its row numbers) with the last ROPE
        rows' interleaved pairs rotated by minus the token's angle, ``(a, b) -> (a c + b s, b c - a s)`` (SPEC §7.8,
        the 64-head kernel's ``_inverse_rope`` on O): a pair's two rows sit in lanes 4 apart, so each thread takes
        its partner's value by a lane shuffle and computes its own row; a position outside ``[0, num_pos)`` gets cos
        1, sin 0."""
        R0: gl.constexpr = x.shape[0] - ROPE
        pos = gl.load(rope_pos + i_t).to(gl.int64)
        in_rope = o_v >= R0
        o_k = gl.where(in_rope, (o_v - R0) // 2, 0)
        m_k = in_rope & (pos >= 0) & (pos < num_pos)
        p_cs = cos_sin + pos * stride_cs + o_k
        b_cos = gl.load(p_cs, mask=m_k, other=1.0).to(gl.float32)
        b_sin = gl.load(p_cs + ROPE // 2, mask=m_k, other=0.0).to(gl.float32)
        b_sin = gl.where(o_v % 2 == 0, b_sin, -b_sin)  # even row a: a c + b s; odd row b: b c - a s
        return gl.where(in_rope, x * b_cos + _lane_xor4(x) * b_sin, x)

    @gluon.jit
    def _gather_v4_ring(kv, kv_f32, kv_b16, ekv, ekv_f32, ekv_b16, p_idx, p_eidx, lat, ready, empty, raw8, ex8, rope8,
                        raw_ready, lo, hi, n1, n_tiles, stride_kv_b, stride_ekv_b, num_slots, e_num_slots,
                        PAGE: gl.constexpr, E_PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                        HAS_EXTRA: gl.constexpr, J0: gl.constexpr):  # fmt: skip
        """Producer ``J0`` of fp8_v4 rows with a raw ring ("ring"): its tiles ``J0, J0 + STAGES, ...`` go by cp.async
        into its own raw stage; it reads tile j's raw rows into registers, hands the raw stage to tile j + STAGES'
        copies at once, then dequantises tile j (``_dequant_pow2``) into its bf16 stage. So a producer has a tile
        in flight while it converts the one before (the plain producer loads a tile only after storing the last)."""
        NW: gl.constexpr = gl.num_warps()
        B64: gl.constexpr = gl.BlockedLayout([1, 32], [16, 2], [NW, 1], [1, 0])  # e4m3 bytes [64, 64], 32 a thread
        R16: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
        if J0 < n_tiles:
            _v4_ring_issue(kv, kv_f32, kv_b16, ekv, ekv_f32, ekv_b16, p_idx, p_eidx, raw8, ex8, rope8, raw_ready, J0,
                           lo + J0 * BLOCK_N, hi, n1, stride_kv_b, stride_ekv_b, num_slots, e_num_slots, PAGE, E_PAGE,
                           HAS_EXTRA)  # fmt: skip
        for j in range(J0, n_tiles, STAGES):
            mbarrier.wait(raw_ready.index(J0), ((j - J0) // STAGES) & 1)
            raw = _v4_raw_load(raw8, ex8, rope8, J0, B64, R16)
            gl.thread_barrier()  # every warp has read the raw stage: the next tile's copies may land there
            if j + STAGES < n_tiles:
                _v4_ring_issue(kv, kv_f32, kv_b16, ekv, ekv_f32, ekv_b16, p_idx, p_eidx, raw8, ex8, rope8, raw_ready,
                               J0, lo + (j + STAGES) * BLOCK_N, hi, n1, stride_kv_b, stride_ekv_b, num_slots,
                               e_num_slots, PAGE, E_PAGE, HAS_EXTRA)  # fmt: skip
            mbarrier.wait(empty.index(J0), ((j // STAGES) & 1) ^ 1)
            _v4_store_rows(lat.index(J0), raw)
            fence_async_shared()  # generic-proxy stores before the consumer's wgmma reads
            gl.thread_barrier()  # the producer warps' stores are all done
            mbarrier.arrive(ready.index(J0), count=1)

    @gluon.jit
    def _ring_issue_ds(kv, kv_f32, kv_b16, p_idx, raw8, sc8, rope8, raw_ready, r, n0, hi, num_slots, stride_kv_b,
                       stride_kv_p, PAGE: gl.constexpr):  # fmt: skip
        """cp.async of the fp8_ds_mla rows of entries ``[n0, n0 + 32)`` (invalid rows zero-filled) into raw half-stage
        ``r``: the 4 e4m3 chunks of 128 (16 bytes a copy), the 4 fp32 scales (scale-major rows ``4 r + g`` of
        ``sc8``: 4 bytes a copy), the bf16 rope; each thread's copies complete ``raw_ready[r]`` (noinc arrive)."""
        NW: gl.constexpr = gl.num_warps()
        CP: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NW, 1], [1, 0])  # e4m3 bytes [32, 128], 16 a copy
        R16: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])  # rope bf16 [32, 64]
        SCL: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [NW, 1], [1, 0])  # scales [4, 32]: one a thread
        o_b = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, CP)), 0)
        o_r = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, R16)), 0)
        o_g = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(1, SCL)), 1)
        slot, ok = _tile_slots(p_idx, n0, hi, num_slots, 32, gl.SliceLayout(1, CP))
        p_b = gl.expand_dims(kv + _row_offsets(slot, stride_kv_b, stride_kv_p, PAGE), 1) + o_b
        slot_r, ok_r = _tile_slots(p_idx, n0, hi, num_slots, 32, gl.SliceLayout(1, R16))
        row_r = _row_offsets(slot_r, stride_kv_b, stride_kv_p, PAGE)  # bytes
        p_r = gl.expand_dims(kv_b16 + row_r // 2 + 264, 1) + o_r  # 64 bf16 at byte 528
        slot_s, ok_s = _tile_slots(p_idx, n0, hi, num_slots, 32, gl.SliceLayout(0, SCL))
        row_s = _row_offsets(slot_s, stride_kv_b, stride_kv_p, PAGE)
        p_s = gl.expand_dims(kv_f32 + row_s // 4 + 128, 0) + o_g  # 4 fp32 at byte 512
        for c in gl.static_range(4):
            async_copy.async_copy_global_to_shared(raw8.index(r * 4 + c), p_b + c * 128, mask=gl.expand_dims(ok, 1))
        async_copy.async_copy_global_to_shared(rope8.index(r), p_r, mask=gl.expand_dims(ok_r, 1))
        sc8_3 = sc8._reinterpret(gl.float32, [2, 4, 32], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        async_copy.async_copy_global_to_shared(sc8_3.index(r), p_s, mask=gl.expand_dims(ok_s, 0) & (o_g < 4))
        async_copy.mbarrier_arrive(raw_ready.index(r), increment_count=False)

    @gluon.jit
    def _gather_ds_ring(kv, kv_f32, kv_b16, p_idx, lat, rope, ready, empty, raw8, sc8, rope8, raw_ready, lo, hi,
                        n_tiles, stride_kv_b, stride_kv_p, num_slots, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                        STAGES: gl.constexpr, NANPACK: gl.constexpr, J0: gl.constexpr):  # fmt: skip
        """Producer ``J0`` of fp8_ds_mla rows with a raw ring ("ring"): ``_gather_v4_ring`` in half tiles of 32 rows
        (a tile's raw rows, 42 KB, fit only once beside V3.2's bf16 ring): each half's copies are issued before the
        half before is dequantised (``_dequant``: fp32 products, as the plain producer)."""
        NW: gl.constexpr = gl.num_warps()
        B8: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NW, 1], [1, 0])  # e4m3 bytes [32, 128]
        R16: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
        ROW: gl.constexpr = gl.SliceLayout(1, B8)
        if J0 < n_tiles:
            _ring_issue_ds(kv, kv_f32, kv_b16, p_idx, raw8, sc8, rope8, raw_ready, J0, lo + J0 * BLOCK_N, hi,
                           num_slots, stride_kv_b, stride_kv_p, PAGE)  # fmt: skip
        for j in range(J0, n_tiles, STAGES):
            for h in gl.static_range(2):
                mbarrier.wait(raw_ready.index(J0), h)  # two completions a tile: phases 0 then 1
                q0 = raw8.index(J0 * 4 + 0).load(B8)
                q1 = raw8.index(J0 * 4 + 1).load(B8)
                q2 = raw8.index(J0 * 4 + 2).load(B8)
                q3 = raw8.index(J0 * 4 + 3).load(B8)
                s0 = sc8.index(J0 * 4 + 0).load(ROW)
                s1 = sc8.index(J0 * 4 + 1).load(ROW)
                s2 = sc8.index(J0 * 4 + 2).load(ROW)
                s3 = sc8.index(J0 * 4 + 3).load(ROW)
                b_r = rope8.index(J0).load(R16)
                gl.thread_barrier()  # every warp has read the half-stage: the next half's copies may land there
                if h == 0:
                    _ring_issue_ds(kv, kv_f32, kv_b16, p_idx, raw8, sc8, rope8, raw_ready, J0, lo + j * BLOCK_N + 32,
                                   hi, num_slots, stride_kv_b, stride_kv_p, PAGE)  # fmt: skip
                    mbarrier.wait(empty.index(J0), ((j // STAGES) & 1) ^ 1)
                elif j + STAGES < n_tiles:
                    _ring_issue_ds(kv, kv_f32, kv_b16, p_idx, raw8, sc8, rope8, raw_ready, J0,
                                   lo + (j + STAGES) * BLOCK_N, hi, num_slots, stride_kv_b, stride_kv_p,
                                   PAGE)  # fmt: skip
                part = lat.index(J0).slice(h * 32, 32, dim=0)
                part.slice(0, 128, dim=1).store(_dequant(q0, s0, NANPACK))
                part.slice(128, 128, dim=1).store(_dequant(q1, s1, NANPACK))
                part.slice(256, 128, dim=1).store(_dequant(q2, s2, NANPACK))
                part.slice(384, 128, dim=1).store(_dequant(q3, s3, NANPACK))
                rope.index(J0).slice(h * 32, 32, dim=0).store(gl.where(b_r != b_r, 0.0, b_r))
            fence_async_shared()  # generic-proxy stores before the consumer's wgmma reads
            gl.thread_barrier()  # the producer warps' stores are all done
            mbarrier.arrive(ready.index(J0), count=1)

    @gluon.jit
    def _narrow_consumer(q, q_smem, lat, rope, p_smem, ready, empty, p_idx, p_eidx, sink, out, lse, o_part, lse_part,
                         rope_pos, cos_sin, scale_log2, stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_l_t,
                         stride_cs, num_pos, T, H, i_t, i_s, lo, hi, n1, n_tiles, num_slots, e_num_slots,
                         D_QK: gl.constexpr, HB: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                         NUM_SPLITS: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_SINK: gl.constexpr,
                         HAS_ROPE: gl.constexpr, ROPE: gl.constexpr, FENCE: gl.constexpr):  # fmt: skip
        """The consumer warpgroup: Q to shared memory, the online softmax over the ring's tiles (transposed
        products), the epilogue."""
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, HB, 16])  # fmt: skip
        KEY: gl.constexpr = gl.SliceLayout(1, S_L)
        HEAD_S: gl.constexpr = gl.SliceLayout(0, S_L)
        HEAD_O: gl.constexpr = gl.SliceLayout(0, S_L)  # O^T [512, HB] takes the same layout (8 repeats of M)
        DIM_O: gl.constexpr = gl.SliceLayout(1, S_L)

        _q_to_smem(q, q_smem, i_t, 0, H, stride_q_t, stride_q_h, HB, D_QK)

        b_m = gl.full([HB], float("-inf"), gl.float32, HEAD_S)
        b_lv = gl.zeros([BLOCK_N, HB], gl.float32, S_L)  # column sums per key row until the epilogue
        acc = gl.zeros([512, HB], gl.float32, S_L)
        s_zero = gl.zeros([BLOCK_N, HB], gl.float32, S_L)
        for j in range(n_tiles):
            stage = j % STAGES
            ok = _tile_ok(p_idx, p_eidx, lo + j * BLOCK_N, hi, n1, num_slots, e_num_slots, BLOCK_N, KEY, HAS_EXTRA)
            mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
            if FENCE:  # cp.async wrote the stage (generic proxy): order it before the wgmma reads
                fence_async_shared()
            k_lat = lat.index(stage)
            b_s = _scores_t(k_lat, rope.index(stage), q_smem, s_zero, D_QK > 512)
            b_s = gl.where(gl.expand_dims(ok, 1), b_s * scale_log2, float("-inf"))
            b_m, b_lv, acc = _softmax_pv_t(b_s, b_m, b_lv, acc, k_lat, p_smem)
            mbarrier.arrive(empty.index(stage), count=1)  # the producers may refill it

        # epilogue: natural-log LSE of the scaled scores (sink-free), -inf and zeros for a head with no key
        empty_h, b_lse, b_r = _finish_t(b_lv, b_m, 1.0)
        o_hs = gl.arange(0, HB, layout=HEAD_S)
        m_hs = o_hs < H
        o_ho = gl.arange(0, HB, layout=HEAD_O)
        m_o = gl.expand_dims(o_ho < H, 0)
        o_v = gl.expand_dims(gl.arange(0, 512, layout=DIM_O), 1)
        if NUM_SPLITS == 1:
            if HAS_SINK:
                b_r = _sink_factor(b_r, b_lse, empty_h, sink, o_hs, m_hs)
            gl.store(lse + i_t * stride_l_t + o_hs, b_lse, mask=m_hs)
            b_o = acc * gl.expand_dims(gl.convert_layout(b_r, HEAD_O), 0)
            if HAS_ROPE:  # after normalisation and sink (a rotation commutes with the per-head scaling)
                b_o = _inverse_rope_t(b_o, o_v, rope_pos, i_t, cos_sin, stride_cs, num_pos, ROPE)
            p_o = out + i_t * stride_o_t + gl.expand_dims(o_ho.to(gl.int64) * stride_o_h, 0) + o_v
            gl.store(p_o, b_o.to(out.dtype.element_ty), mask=m_o)
        else:  # the merge kernel applies the sink and the inverse RoPE
            gl.store(lse_part + (i_s * T + i_t) * H + o_hs, b_lse, mask=m_hs)
            b_o = acc * gl.expand_dims(gl.convert_layout(b_r, HEAD_O), 0)
            part = ((i_s * T + i_t) * H + o_ho.to(gl.int64)) * 512
            gl.store(o_part + gl.expand_dims(part, 0) + o_v, b_o, mask=m_o)

    @gluon.jit
    def _sparse_mla_gluon_narrow_kernel(
        q,  # [T, H, D_QK] bf16
        kv,  # [num_blocks, PAGE, D_QK] bf16 (FMT 0), uint8 [num_blocks, PAGE, 656] (FMT 1) or fp8_v4 bytes (FMT 2)
        kv_f32,  # FMT 1: the same memory as fp32
        kv_b16,  # FMT 1, 2: the same memory as bf16
        idx,  # [T, K] int32 global slots
        lens,  # [T] int32 (HAS_LEN)
        ekv,  # the extra source, like kv (HAS_EXTRA)
        ekv_f32,
        ekv_b16,
        eidx,  # [T, EK] int32 (HAS_EXTRA)
        elens,  # [T] int32 (E_HAS_LEN)
        sink,  # [H] fp32 (HAS_SINK)
        out,  # [T, H, 512] bf16
        lse,  # [T, H] fp32
        o_part,  # [NUM_SPLITS, T, H, 512] fp32 (NUM_SPLITS > 1)
        lse_part,  # [NUM_SPLITS, T, H] fp32
        rope_pos,  # [T] int (HAS_ROPE)
        cos_sin,  # [P, ROPE] float (HAS_ROPE): [cos | sin] per position
        scale_log2,  # sm_scale * log2(e)
        stride_q_t,
        stride_q_h,
        stride_kv_b,
        stride_kv_p,
        stride_ekv_b,
        stride_ekv_p,
        stride_i_t,
        stride_ei_t,
        stride_o_t,
        stride_o_h,
        stride_l_t,
        stride_cs,
        num_pos,
        T,
        H,
        K,
        EK,
        num_slots,
        e_num_slots,
        PAGE: gl.constexpr,
        E_PAGE: gl.constexpr,
        FMT: gl.constexpr,
        D_QK: gl.constexpr,
        HB: gl.constexpr,
        NUM_SPLITS: gl.constexpr,
        HAS_LEN: gl.constexpr,
        HAS_EXTRA: gl.constexpr,
        E_HAS_LEN: gl.constexpr,
        HAS_SINK: gl.constexpr,
        HAS_ROPE: gl.constexpr,
        ROPE: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        FP8_PASSES: gl.constexpr,
        PRODUCER_REGS: gl.constexpr,
        num_warps: gl.constexpr,
        NANPACK: gl.constexpr = False,
        RING: gl.constexpr = False,
    ):
        """One program per (row, split); see the module docstring."""
        gl.static_assert(num_warps == 4, "one consumer warpgroup in the default partition")
        gl.static_assert(HB == 8 or HB == 16 or HB == 32, "N of the transposed products: 8, 16 or 32 heads")
        gl.static_assert((D_QK == 576 and FMT != 2) or (D_QK == 512 and FMT != 1), "V3.2 rows or V4 rows")
        i_t = gl.program_id(0).to(gl.int64)
        i_s = gl.program_id(1)
        p_idx, p_eidx, n1, lo, hi, n_tiles = _row_split(idx, lens, eidx, elens, i_t, i_s, stride_i_t, stride_ei_t, K,
                                                        EK, HAS_LEN, HAS_EXTRA, E_HAS_LEN, NUM_SPLITS,
                                                        BLOCK_N)  # fmt: skip

        SW: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [D_QK // 64, HB, 64], SW)
        lat = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 512], SW)
        if D_QK > 512:
            rope = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], SW)
        else:
            rope = lat  # no rope columns (V4): never read
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [HB, BLOCK_N], SW)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            # bf16: one noinc cp.async arrive per thread of its producer; fp8: one arrive after the partition barrier
            mbarrier.init(ready.index(st), count=4 * 32 if FMT == 0 else 1)
            mbarrier.init(empty.index(st), count=1)
        if RING and FMT == 1:  # fp8_ds_mla rows at HB <= 16: a raw half-stage per producer (e4m3, scales, rope)
            RAW1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
            raw8 = gl.allocate_shared_memory(gl.uint8, [STAGES * 4, BLOCK_N // 2, 128], RAW1)
            rope8 = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N // 2, 64], RAW1)
            sc8 = gl.allocate_shared_memory(gl.float32, [STAGES * 4, BLOCK_N // 2],
                                            gl.SwizzledSharedLayout(1, 1, 1, order=[0]))  # fmt: skip
            raw_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for st in gl.static_range(STAGES):
                mbarrier.init(raw_ready.index(st), count=4 * 32)  # one noinc cp.async arrive per producer thread
        if RING and FMT == 2:  # fp8_v4 rows at HB <= 16: a raw stage per producer (e4m3 groups, rope, exponent words)
            RAW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
            raw8 = gl.allocate_shared_memory(gl.uint8, [STAGES * 7, BLOCK_N, 64], RAW)
            rope8 = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], RAW)
            ex8 = gl.allocate_shared_memory(gl.float32, [STAGES * 2, BLOCK_N],
                                            gl.SwizzledSharedLayout(1, 1, 1, order=[0]))  # fmt: skip
            raw_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for st in gl.static_range(STAGES):
                mbarrier.init(raw_ready.index(st), count=4 * 32)  # one noinc cp.async arrive per producer thread
        fence_async_shared()  # barrier inits visible to the async proxy and the other partitions
        OPTS: gl.constexpr = 1 if NANPACK else 0
        # two producer warpgroups, each filling one stage: tiles 0, 2, 4, ... and 1, 3, 5, ... (each issues a
        # tile's loads before it waits for its stage, so two tiles' rows are in flight beside the consumer's work)
        if RING and FMT == 1:
            gl.static_assert(STAGES == 2 and BLOCK_N == 64, "one raw half-stage a producer")
            gl.warp_specialize([
                (_narrow_consumer, (q, q_smem, lat, rope, p_smem, ready, empty, p_idx, p_eidx, sink, out, lse,
                                    o_part, lse_part, rope_pos, cos_sin, scale_log2, stride_q_t, stride_q_h,
                                    stride_o_t, stride_o_h, stride_l_t, stride_cs, num_pos, T, H, i_t, i_s, lo, hi,
                                    n1, n_tiles, num_slots, e_num_slots, D_QK, HB, BLOCK_N, STAGES, NUM_SPLITS,
                                    HAS_EXTRA, HAS_SINK, HAS_ROPE, ROPE, FMT == 0)),
                (_gather_ds_ring, (kv, kv_f32, kv_b16, p_idx, lat, rope, ready, empty, raw8, sc8, rope8, raw_ready, lo,
                                   hi, n_tiles, stride_kv_b, stride_kv_p, num_slots, PAGE, BLOCK_N, STAGES, NANPACK,
                                   0)),
                (_gather_ds_ring, (kv, kv_f32, kv_b16, p_idx, lat, rope, ready, empty, raw8, sc8, rope8, raw_ready, lo,
                                   hi, n_tiles, stride_kv_b, stride_kv_p, num_slots, PAGE, BLOCK_N, STAGES, NANPACK,
                                   1)),
            ], [4, 4], [PRODUCER_REGS, PRODUCER_REGS])  # fmt: skip
            for st in gl.static_range(STAGES):
                mbarrier.invalidate(raw_ready.index(st))
        elif RING:
            gl.static_assert(FMT == 2 and STAGES == 2, "the raw ring takes fp8_v4 rows, one stage a producer")
            gl.warp_specialize([
                (_narrow_consumer, (q, q_smem, lat, rope, p_smem, ready, empty, p_idx, p_eidx, sink, out, lse,
                                       o_part, lse_part, rope_pos, cos_sin, scale_log2, stride_q_t, stride_q_h,
                                       stride_o_t, stride_o_h, stride_l_t, stride_cs, num_pos, T, H, i_t, i_s, lo, hi,
                                       n1, n_tiles, num_slots, e_num_slots, D_QK, HB, BLOCK_N, STAGES, NUM_SPLITS,
                                       HAS_EXTRA, HAS_SINK, HAS_ROPE, ROPE, FMT == 0)),
                (_gather_v4_ring, (kv, kv_f32, kv_b16, ekv, ekv_f32, ekv_b16, p_idx, p_eidx, lat, ready, empty, raw8,
                                   ex8, rope8, raw_ready, lo, hi, n1, n_tiles, stride_kv_b, stride_ekv_b, num_slots,
                                   e_num_slots, PAGE, E_PAGE, BLOCK_N, STAGES, HAS_EXTRA, 0)),
                (_gather_v4_ring, (kv, kv_f32, kv_b16, ekv, ekv_f32, ekv_b16, p_idx, p_eidx, lat, ready, empty, raw8,
                                   ex8, rope8, raw_ready, lo, hi, n1, n_tiles, stride_kv_b, stride_ekv_b, num_slots,
                                   e_num_slots, PAGE, E_PAGE, BLOCK_N, STAGES, HAS_EXTRA, 1)),
            ], [4, 4], [PRODUCER_REGS, PRODUCER_REGS])  # fmt: skip
            for st in gl.static_range(STAGES):
                mbarrier.invalidate(raw_ready.index(st))
        else:
            gl.warp_specialize([
                (_narrow_consumer, (q, q_smem, lat, rope, p_smem, ready, empty, p_idx, p_eidx, sink, out, lse,
                                       o_part, lse_part, rope_pos, cos_sin, scale_log2, stride_q_t, stride_q_h,
                                       stride_o_t, stride_o_h, stride_l_t, stride_cs, num_pos, T, H, i_t, i_s, lo, hi,
                                       n1, n_tiles, num_slots, e_num_slots, D_QK, HB, BLOCK_N, STAGES, NUM_SPLITS,
                                       HAS_EXTRA, HAS_SINK, HAS_ROPE, ROPE, FMT == 0)),
                (_producer, (kv, kv_f32, kv_b16, ekv, ekv_f32, ekv_b16, p_idx, p_eidx, lat, rope, ready, empty, lo, hi,
                             n1, n_tiles, stride_kv_b, stride_kv_p, stride_ekv_b, stride_ekv_p, num_slots,
                             e_num_slots, PAGE, E_PAGE, FMT, BLOCK_N, STAGES, FP8_PASSES, D_QK > 512, HAS_EXTRA, OPTS,
                             0, STAGES, True)),
                (_producer, (kv, kv_f32, kv_b16, ekv, ekv_f32, ekv_b16, p_idx, p_eidx, lat, rope, ready, empty, lo, hi,
                             n1, n_tiles, stride_kv_b, stride_kv_p, stride_ekv_b, stride_ekv_p, num_slots,
                             e_num_slots, PAGE, E_PAGE, FMT, BLOCK_N, STAGES, FP8_PASSES, D_QK > 512, HAS_EXTRA, OPTS,
                             1, STAGES, True)),
            ], [4, 4], [PRODUCER_REGS, PRODUCER_REGS])  # fmt: skip

        for st in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(st))
            mbarrier.invalidate(empty.index(st))


def launch_narrow(
    args: tuple, T: int, H: int, num_splits: int, fmt: int, nanpack: bool, ring: bool = False, **constexprs
) -> None:
    """Launch the narrow kernel over ``T x num_splits`` programs: ``args`` are the 64-head kernel's positional
    arguments and ``constexprs`` its shared ones, as :func:`openmla.ops.gluon.sparse.sparse_mla_fwd_gluon` prepared
    them for a validated call with ``H <= NARROW_MAX_H``."""
    if H > NARROW_MAX_H:  # pragma: no cover - the caller's rule
        raise ValueError(f"the narrow sparse kernel takes H <= {NARROW_MAX_H}; got {H}")
    d_qk = constexprs["D_QK"]
    if _smem_bytes(d_qk, narrow_block_h(H), ring) > SMEM_LIMIT:  # pragma: no cover - the callers' rules
        raise ValueError(f"the narrow sparse kernel needs {_smem_bytes(d_qk, narrow_block_h(H), ring)} B of shared "
                         f"memory at H = {H} (> {SMEM_LIMIT})")  # fmt: skip
    _sparse_mla_gluon_narrow_kernel[(T, num_splits)](
        *args, HB=narrow_block_h(H), BLOCK_N=BLOCK_N, STAGES=STAGES, FP8_PASSES=FP8_PASSES,
        PRODUCER_REGS=PRODUCER_REGS[fmt], num_warps=NUM_WARPS, NANPACK=nanpack, **({"RING": True} if ring else {}),
        **constexprs,
    )  # fmt: skip
