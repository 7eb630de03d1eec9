"""Hopper (sm90) tier of sparse MLA (V3.2 DSA) for 64-head blocks: a warp-specialised Gluon kernel.

Same contract as :func:`openmla.ops.sparse.sparse_mla`'s Triton kernel (``_sparse_mla_fwd_kernel``) for one source,
dense indices, q ``[T, H, 576]`` bf16, d_v 512 and a bf16 (``"auto"``) or ``"fp8_ds_mla"`` cache: one program owns
(query row, a block of 64 heads, one split of the row's key list), the grid is ``(T x head blocks, splits)`` with the
head blocks of a row adjacent (H = 128: the second reads the row's keys from L2). One split writes ``out`` and the
sink-free natural-log ``lse`` (sink applied to ``out``); several write the normalised fp32 partials and LSEs that
``_sparse_mla_merge_fwd_kernel`` merges (``o_part [S, T, H, 512]``, ``lse_part [S, T, H]``, -inf for no key).

Why (docs/sparse_mla.md "H200 figures"): Triton gives the scores dot warps ``[8, 1]`` at 64 rows, so both
warpgroups compute the whole score tile, and it overlaps nothing. Here:

* a 4-warp producer partition gathers each 64-key tile into a ring of ``STAGES`` bf16 tiles ``[64, 512]`` + ``[64,
  64]`` (128-byte swizzle, wgmma operands), waiting on per-stage "empty" mbarriers and signalling "ready" ones.
  bf16 rows: ``cp.async`` of 16 bytes (masked rows are zero-filled, never read), completion tracked by
  ``cp.async.mbarrier.arrive.noinc`` (ready count = producer threads). fp8_ds_mla rows: 16-byte loads of the e4m3
  bytes into registers, ``e4m3 x fp32 scale`` rounded to bf16 (NaN -> 0, as the Triton kernel), stored into the
  stage, fence, partition barrier, one arrive: the dequant runs beside the consumers' MMAs instead of before them.
* two consumer warpgroups (8 warps): ``S = Q K^T`` as 9 chained async wgmmas with
  ``NVMMADistributedLayout([3, 0], warps_per_cta=[4, 2])``, so each warpgroup scores half of the tile's keys
  (m64n32k16, no duplicated QK^T); online softmax in base 2 in registers (the row max across the warpgroups through
  the compiler's shared-memory reduction, row sums kept per key column until the epilogue); P (bf16) through shared
  memory; ``O += P V`` with each warpgroup owning 256 of the 512 output columns (128 fp32 registers a thread).
  The consumers recompute each key's validity from the index row (a slot < 0 or >= num_slots, or past the split,
  scores -inf; its zero-filled row adds nothing to P V).

Shared memory: Q 73,728 + 2 stages x 73,728 + P 8,192 (+ barriers / reduction scratch) < 232,448 B.
"""

from __future__ import annotations

import torch
import triton

from openmla.ops.gluon._lang import (
    GLUON_AVAILABLE,
    async_copy,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from openmla.ops.gluon.decode import SMEM_LIMIT

__all__ = ["BLOCK_H", "GLUON_AVAILABLE", "gluon_sparse_unsupported", "sparse_mla_fwd_gluon"]

D_QK, D_V, D_R = 576, 512, 64
BLOCK_H = 64  # heads per program: one wgmma M of 64 per warpgroup
BLOCK_N = 64  # keys per tile: each consumer warpgroup scores 32 of them
STAGES = 2  # bf16 tiles in the ring (73,728 B each)
NUM_WARPS = 8  # the two consumer warpgroups (the default partition)
# registers of a producer thread (setmaxnreg) by cache format; the consumers get the rest of the register file
PRODUCER_REGS = {0: 56, 1: 88}
FP8_PASSES = 2  # row blocks of a tile the fp8 producer loads and dequantises in turn (registers)
_FORMATS = {"auto": 0, "fp8_ds_mla": 1}


def _smem_bytes() -> int:
    """Shared memory of one program: Q + the bf16 ring + P + barriers / reduction scratch (an upper bound)."""
    return BLOCK_H * D_QK * 2 + STAGES * BLOCK_N * D_QK * 2 + BLOCK_H * BLOCK_N * 2 + 2048


if GLUON_AVAILABLE:

    @gluon.jit
    def _tile_slots(p_idx, n0, hi, num_slots, BLOCK_N: gl.constexpr, layout: gl.constexpr):
        """Entries ``[n0, n0 + BLOCK_N)`` of an index row (``layout``: a 1-D slice layout): the int32 slots (0
        where invalid) and which are valid (inside the split, ``0 <= slot < num_slots``)."""
        o_n = n0 + gl.arange(0, BLOCK_N, layout=layout)
        m_n = o_n < hi
        slot = gl.load(p_idx + o_n, mask=m_n, other=-1)
        ok = m_n & (slot >= 0) & (slot < num_slots)
        return gl.where(ok, slot, 0), ok

    @gluon.jit
    def _row_offsets(slot, stride_kv_b, stride_kv_p, PAGE: gl.constexpr):
        """int64 element offsets of cache rows from (checked, >= 0) slots: block and offset as uint32 (a shift and a
        mask for a power-of-two PAGE), then widened."""
        s = slot.to(gl.uint32, bitcast=True)
        return (s // PAGE).to(gl.int64) * stride_kv_b + (s % PAGE).to(gl.int64) * stride_kv_p

    @gluon.jit
    def _gather_bf16(kv, p_idx, lat, rope, ready, empty, lo, hi, n_tiles, stride_kv_b, stride_kv_p, num_slots,
                     PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
        """Producer, bf16 rows: cp.async every valid row of a tile into its stage (16 bytes a thread; invalid rows
        zero-filled, never read); each thread's copies complete the stage's ready barrier (noinc arrive)."""
        NW: gl.constexpr = gl.num_warps()
        LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])  # [16, 64] a pass
        ROW: gl.constexpr = gl.SliceLayout(1, LAYOUT)
        o_c = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, LAYOUT)), 0)
        for j in range(n_tiles):
            stage = j % STAGES
            slot, ok = _tile_slots(p_idx, lo + j * BLOCK_N, hi, num_slots, BLOCK_N, ROW)
            p_row = gl.expand_dims(kv + _row_offsets(slot, stride_kv_b, stride_kv_p, PAGE), 1)
            m2 = gl.expand_dims(ok, 1)
            mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)  # fresh barriers pass parity 1 at once
            dst = lat.index(stage)
            for c in gl.static_range(8):
                async_copy.async_copy_global_to_shared(dst.slice(c * 64, 64, dim=1), p_row + (c * 64 + o_c), mask=m2)
            async_copy.async_copy_global_to_shared(rope.index(stage), p_row + (512 + o_c), mask=m2)
            async_copy.mbarrier_arrive(ready.index(stage), increment_count=False)

    @gluon.jit
    def _dequant_group(b_q, b_s):
        """e4m3 bytes [N, 128] x the row's fp32 group scale [N] -> bf16 (fp32 product rounded to bf16, as the Triton
        kernel), NaN (byte or scale) -> 0; invalid rows were loaded as byte 0 and scale 0. (Clearing NaN in fp16
        before widening costs more here: byte permutes, sm90 offline SASS 1664 -> 1871 a tile.)"""
        b_v = b_q.to(gl.float8e4nv, bitcast=True).to(gl.float32) * gl.expand_dims(b_s, 1)
        return gl.where(b_v != b_v, 0.0, b_v).to(gl.bfloat16)

    @gluon.jit
    def _gather_fp8(kv, kv_f32, kv_b16, p_idx, lat, rope, ready, empty, lo, hi, n_tiles, stride_kv_b, stride_kv_p,
                    num_slots, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    PASSES: gl.constexpr):  # fmt: skip
        """Producer, fp8_ds_mla rows (656 bytes: 512 e4m3, 4 fp32 scales, 64 bf16): a tile in PASSES row blocks,
        each loaded (16 bytes a thread) then dequantised into the bf16 stage; then fence, partition barrier and one
        arrive on the stage's ready barrier."""
        NW: gl.constexpr = gl.num_warps()
        R: gl.constexpr = BLOCK_N // PASSES
        B8: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NW, 1], [1, 0])  # e4m3 bytes, [16, 128] a pass
        R16: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])  # rope bf16, [16, 64] a pass
        ROW8: gl.constexpr = gl.SliceLayout(1, B8)
        ROW16: gl.constexpr = gl.SliceLayout(1, R16)
        o_b = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, B8)), 0)
        o_r = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, R16)), 0)
        for j in range(n_tiles):
            stage = j % STAGES
            dst = lat.index(stage)
            for h in gl.static_range(PASSES):
                n0 = lo + j * BLOCK_N + h * R
                slot, ok = _tile_slots(p_idx, n0, hi, num_slots, R, ROW8)
                row = _row_offsets(slot, stride_kv_b, stride_kv_p, PAGE)  # bytes
                m2 = gl.expand_dims(ok, 1)
                p_b = gl.expand_dims(kv + row, 1) + o_b
                # every load of the pass first (one latency), then the conversions
                q0 = gl.load(p_b, mask=m2, other=0)
                q1 = gl.load(p_b + 128, mask=m2, other=0)
                q2 = gl.load(p_b + 256, mask=m2, other=0)
                q3 = gl.load(p_b + 384, mask=m2, other=0)
                p_s = kv_f32 + row // 4 + 128  # the 4 fp32 scales at byte 512
                s0 = gl.load(p_s, mask=ok, other=0.0)
                s1 = gl.load(p_s + 1, mask=ok, other=0.0)
                s2 = gl.load(p_s + 2, mask=ok, other=0.0)
                s3 = gl.load(p_s + 3, mask=ok, other=0.0)
                slot_r, ok_r = _tile_slots(p_idx, n0, hi, num_slots, R, ROW16)
                row_r = _row_offsets(slot_r, stride_kv_b, stride_kv_p, PAGE)
                p_r = gl.expand_dims(kv_b16 + row_r // 2 + 264, 1) + o_r  # 64 bf16 at byte 528
                b_r = gl.load(p_r, mask=gl.expand_dims(ok_r, 1), other=0.0)
                if h == 0:
                    mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)
                part = dst.slice(h * R, R, dim=0)
                part.slice(0, 128, dim=1).store(_dequant_group(q0, s0))
                part.slice(128, 128, dim=1).store(_dequant_group(q1, s1))
                part.slice(256, 128, dim=1).store(_dequant_group(q2, s2))
                part.slice(384, 128, dim=1).store(_dequant_group(q3, s3))
                rope.index(stage).slice(h * R, R, dim=0).store(gl.where(b_r != b_r, 0.0, b_r))
            fence_async_shared()  # generic-proxy stores before the consumers' wgmma reads
            gl.thread_barrier()  # the producer warps' stores are all done
            mbarrier.arrive(ready.index(stage), count=1)

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
    def _consumer(q, q_smem, lat, rope, p_smem, ready, empty, p_idx, sink, out, lse, o_part, lse_part, scale_log2,
                  stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_l_t, T, H, i_t, i_hb, i_s, lo, hi, n_tiles,
                  num_slots, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, NUM_SPLITS: gl.constexpr,
                  HAS_SINK: gl.constexpr, FENCE: gl.constexpr):  # fmt: skip
        """The two consumer warpgroups: Q to shared memory, the online softmax over the ring's tiles, the epilogue."""
        BLOCK_M: gl.constexpr = 64
        NW: gl.constexpr = gl.num_warps()
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, BLOCK_N // 2, 16])  # fmt: skip
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, 256, 16])  # fmt: skip
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        COL_S: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
        COL_O: gl.constexpr = gl.SliceLayout(0, O_LAYOUT)
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])

        # Q [64, 576] -> 9 swizzled chunks (rows past H are zeros: finite scores, never stored)
        o_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LD))
        o_h = i_hb * BLOCK_M + o_m
        m_ld = gl.expand_dims(o_h < H, 1)
        p_q = q + i_t * stride_q_t + gl.expand_dims(o_h.to(gl.int64) * stride_q_h, 1)
        o_c = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, LD)), 0)
        for c in gl.static_range(9):
            q_smem.index(c).store(gl.load(p_q + (c * 64 + o_c), mask=m_ld, other=0.0))
        fence_async_shared()
        gl.thread_barrier()

        b_m = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW_S)
        b_lv = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT)  # row sums per key column until the epilogue
        acc = gl.zeros([BLOCK_M, 512], gl.float32, O_LAYOUT)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT)
        for j in range(n_tiles):
            stage = j % STAGES
            _, ok = _tile_slots(p_idx, lo + j * BLOCK_N, hi, num_slots, BLOCK_N, COL_S)
            m_n = gl.expand_dims(ok, 0)
            mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
            if FENCE:  # cp.async wrote the stage (generic proxy): order it before the wgmma reads
                fence_async_shared()
            k_lat = lat.index(stage)
            b_s = _qk(q_smem, k_lat, rope.index(stage), s_zero)
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
            acc = warpgroup_mma(p_smem, k_lat, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            gl.thread_barrier()  # both warpgroups are done with this stage and with P
            mbarrier.arrive(empty.index(stage), count=1)  # the producer may refill it

        # epilogue: natural-log LSE of the scaled scores (sink-free), -inf and zeros for a row with no key
        b_l = gl.sum(b_lv, axis=1)
        empty_r = b_l == 0.0
        b_lse = gl.where(empty_r, float("-inf"), (b_m + gl.log2(gl.where(empty_r, 1.0, b_l))) * 0.6931471805599453)
        b_r = gl.where(empty_r, 0.0, 1.0 / gl.where(empty_r, 1.0, b_l))
        o_hs = i_hb * BLOCK_M + gl.arange(0, BLOCK_M, layout=ROW_S)
        m_hs = o_hs < H
        o_ho = i_hb * BLOCK_M + gl.arange(0, BLOCK_M, layout=ROW_O)
        m_o = gl.expand_dims(o_ho < H, 1)
        o_v = gl.expand_dims(gl.arange(0, 512, layout=COL_O), 0)
        if NUM_SPLITS == 1:
            if HAS_SINK:  # sigmoid(lse - sink), 0 for an empty row (as the Triton kernel's _sink_factor)
                b_sk = gl.load(sink + o_hs, mask=m_hs, other=float("-inf"))
                e = gl.exp2((b_sk - gl.where(empty_r, 0.0, b_lse)) * 1.4426950408889634)
                b_r = b_r * gl.where(empty_r, 0.0, 1.0 / (1.0 + e))
            gl.store(lse + i_t * stride_l_t + o_hs, b_lse, mask=m_hs)
            b_o = acc * gl.expand_dims(gl.convert_layout(b_r, ROW_O), 1)
            p_o = out + i_t * stride_o_t + gl.expand_dims(o_ho.to(gl.int64) * stride_o_h, 1) + o_v
            gl.store(p_o, b_o.to(out.dtype.element_ty), mask=m_o)
        else:
            gl.store(lse_part + (i_s * T + i_t) * H + o_hs, b_lse, mask=m_hs)
            b_o = acc * gl.expand_dims(gl.convert_layout(b_r, ROW_O), 1)
            part = ((i_s * T + i_t) * H + o_ho.to(gl.int64)) * 512
            gl.store(o_part + gl.expand_dims(part, 1) + o_v, b_o, mask=m_o)

    @gluon.jit
    def _sparse_mla_gluon_fwd_kernel(
        q,  # [T, H, 576] bf16
        kv,  # [num_blocks, PAGE, 576] bf16 (FMT 0) or uint8 [num_blocks, PAGE, 656] (FMT 1)
        kv_f32,  # FMT 1: the same memory as fp32
        kv_b16,  # FMT 1: the same memory as bf16
        idx,  # [T, K] int32 global slots
        lens,  # [T] int32 (HAS_LEN)
        sink,  # [H] fp32 (HAS_SINK)
        out,  # [T, H, 512] bf16
        lse,  # [T, H] fp32
        o_part,  # [NUM_SPLITS, T, H, 512] fp32 (NUM_SPLITS > 1)
        lse_part,  # [NUM_SPLITS, T, H] fp32
        scale_log2,  # sm_scale * log2(e)
        stride_q_t,
        stride_q_h,
        stride_kv_b,
        stride_kv_p,
        stride_i_t,
        stride_o_t,
        stride_o_h,
        stride_l_t,
        T,
        H,
        K,
        num_slots,
        PAGE: gl.constexpr,
        FMT: gl.constexpr,
        N_HB: gl.constexpr,
        NUM_SPLITS: gl.constexpr,
        HAS_LEN: gl.constexpr,
        HAS_SINK: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        FP8_PASSES: gl.constexpr,
        PRODUCER_REGS: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """One program per (row, 64-head block, split); see the module docstring."""
        gl.static_assert(num_warps == 8, "two consumer warpgroups in the default partition")
        gl.static_assert(BLOCK_N == 64, "64-key tiles: each consumer warpgroup scores 32 keys")
        i_hb = gl.program_id(0) % N_HB
        i_t = (gl.program_id(0) // N_HB).to(gl.int64)
        i_s = gl.program_id(1)
        p_idx = idx + i_t * stride_i_t
        n = K
        if HAS_LEN:
            n = gl.minimum(gl.maximum(gl.load(lens + i_t), 0), K)
        chunk = gl.cdiv(gl.cdiv(n, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = i_s * chunk
        hi = gl.minimum(lo + chunk, n)
        n_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)

        SW: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        P_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BLOCK_N], gl.bfloat16)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [9, 64, 64], SW)
        lat = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 512], SW)
        rope = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], SW)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [64, BLOCK_N], P_SMEM)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        PW: gl.constexpr = 4  # producer warps (one warpgroup)
        for st in gl.static_range(STAGES):
            # bf16: one noinc cp.async arrive per producer thread; fp8: one arrive after the partition barrier
            mbarrier.init(ready.index(st), count=PW * 32 if FMT == 0 else 1)
            mbarrier.init(empty.index(st), count=1)
        fence_async_shared()  # barrier inits visible to the async proxy and the other partitions

        if FMT == 0:
            gl.warp_specialize([
                (_consumer, (q, q_smem, lat, rope, p_smem, ready, empty, p_idx, sink, out, lse, o_part, lse_part,
                             scale_log2, stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_l_t, T, H, i_t, i_hb,
                             i_s, lo, hi, n_tiles, num_slots, BLOCK_N, STAGES, NUM_SPLITS, HAS_SINK, True)),
                (_gather_bf16, (kv, p_idx, lat, rope, ready, empty, lo, hi, n_tiles, stride_kv_b, stride_kv_p,
                                num_slots, PAGE, BLOCK_N, STAGES)),
            ], [PW], [PRODUCER_REGS])  # fmt: skip
        else:
            gl.warp_specialize([
                (_consumer, (q, q_smem, lat, rope, p_smem, ready, empty, p_idx, sink, out, lse, o_part, lse_part,
                             scale_log2, stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_l_t, T, H, i_t, i_hb,
                             i_s, lo, hi, n_tiles, num_slots, BLOCK_N, STAGES, NUM_SPLITS, HAS_SINK, False)),
                (_gather_fp8, (kv, kv_f32, kv_b16, p_idx, lat, rope, ready, empty, lo, hi, n_tiles, stride_kv_b,
                               stride_kv_p, num_slots, PAGE, BLOCK_N, STAGES, FP8_PASSES)),
            ], [PW], [PRODUCER_REGS])  # fmt: skip

        for st in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(st))
            mbarrier.invalidate(empty.index(st))


def gluon_sparse_unsupported(q: torch.Tensor, kv_cache: torch.Tensor, kv_cache_dtype: str, d_v: int, *,
                             ragged: bool = False, extra: bool = False,
                             inv_rope: bool = False) -> str | None:  # fmt: skip
    """Why the Gluon kernel cannot run this (already validated) call, or None when it can: it needs Gluon, an sm90
    CUDA device, bf16 q ``[T, H, 576]``, d_v 512, a bf16 ``"auto"`` or ``"fp8_ds_mla"`` cache, one source, dense
    indices and no inverse RoPE."""
    if not GLUON_AVAILABLE:
        return "triton.experimental.gluon is not installed"
    if q.device.type != "cuda":
        return f"it runs on CUDA devices only; q is on {q.device}"
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return f"it needs an sm90 (Hopper) GPU; got sm{''.join(map(str, torch.cuda.get_device_capability(q.device)))}"
    if kv_cache_dtype not in _FORMATS:
        return f"kv_cache_dtype must be one of {tuple(_FORMATS)}; got {kv_cache_dtype!r}"
    if q.dtype != torch.bfloat16 or q.shape[2] != D_QK:
        return f"q must be bf16 [T, H, {D_QK}]; got {q.dtype} {tuple(q.shape)}"
    if d_v != D_V:
        return f"d_v must be {D_V}; got {d_v}"
    if extra:
        return "a second source (extra_kv_cache) is not supported"
    if ragged:
        return "ragged indices are not supported (pass dense [T, K] indices with topk_length)"
    if inv_rope:
        return "the fused inverse RoPE (inv_rope_positions) is not supported"
    if kv_cache_dtype == "auto" and kv_cache.dtype != torch.bfloat16:
        return f"an 'auto' cache must be bf16; got {kv_cache.dtype}"
    if kv_cache.shape[0] * kv_cache.shape[1] >= 2**31:
        return "the cache has 2^31 slots or more (int32 slots)"
    return None


def sparse_mla_fwd_gluon(q, kv_cache, kv_cache_dtype: str, idx, lens, sink, out, lse, o_part, lse_part,
                         scale_log2: float, num_splits: int) -> None:  # fmt: skip
    """Launch the Gluon kernel over ``T x cdiv(H, 64)`` programs x ``num_splits`` (arguments as
    ``_sparse_mla_fwd_kernel``'s; validated by the caller and :func:`gluon_sparse_unsupported`). One split writes
    ``out`` / ``lse``; several write ``o_part`` / ``lse_part`` for ``_sparse_mla_merge_fwd_kernel``."""
    fmt = _FORMATS[kv_cache_dtype]
    if _smem_bytes() > SMEM_LIMIT:  # pragma: no cover - a constant check
        raise ValueError(f"the Gluon sparse kernel needs {_smem_bytes()} B of shared memory (> {SMEM_LIMIT})")
    T, H, _ = q.shape
    n_hb = triton.cdiv(H, BLOCK_H)
    views = [kv_cache] * 3 if fmt == 0 else [kv_cache, kv_cache.view(torch.float32), kv_cache.view(torch.bfloat16)]
    _sparse_mla_gluon_fwd_kernel[(T * n_hb, num_splits)](
        q, *views, idx, lens if lens is not None else idx, sink if sink is not None else lse, out, lse, o_part,
        lse_part, scale_log2, q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), idx.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), T, H, idx.shape[1], kv_cache.shape[0] * kv_cache.shape[1],
        PAGE=kv_cache.shape[1], FMT=fmt, N_HB=n_hb, NUM_SPLITS=num_splits, HAS_LEN=lens is not None,
        HAS_SINK=sink is not None, BLOCK_N=BLOCK_N, STAGES=STAGES, FP8_PASSES=FP8_PASSES,
        PRODUCER_REGS=PRODUCER_REGS[fmt], num_warps=NUM_WARPS,
    )  # fmt: skip
