"""Hopper (sm90) tier of the dense MLA decode: a Gluon split-KV kernel with TMA, mbarriers and wgmma.

Same contract as the portable kernel of :mod:`openmla.ops.decode` (``_mla_decode_split``): one program
owns one work item of a :class:`~openmla.ops.plan.DecodePlan` (one KV split of one request) and one
block of 64 rows (``BLOCK_H`` heads x ``Q_PER`` query tokens folded, row ``m`` -> token
``i_q * Q_PER + m // BLOCK_H``, head ``i_h * BLOCK_H + m % BLOCK_H``). A single-split request gets its
final rows in ``out``/``lse``; the others get a normalised fp32 partial and its natural-log LSE in
``plan.o_part``/``plan.lse_part``, merged afterwards by the existing reduce kernel (not run here).

Four kernels (``variant=``; the design and the measurements behind it: ``docs/kernels.md``); ``"narrow"`` (fp8 caches
at heads x qlen <= 32) lives in :mod:`openmla.ops.gluon.decode_narrow`, the other three here:

* ``"ws"``: ``_mla_decode_gluon_ws_kernel`` (warp-specialised), 12 warps in two partitions, ``mla_decode``'s
  kernel for fp8 caches above 32 rows. A 1-warp producer (32 registers) does the page lookups and issues every TMA
  load into a ring of ``STAGES`` buffers, waiting on per-stage "empty" mbarriers; the two consumer warpgroups (232
  registers after ``setmaxnreg``) wait on per-stage "ready" mbarriers, compute, and release a stage with one
  ``mbarrier.arrive`` after its P V. CTA-wide barriers per 64-key tile: 5 (loop top, row max x 2, P, after P V).
* ``Q [64, 576]`` is loaded once (masked ``gl.load``, so any head count / query length / stride works)
  into shared memory as 9 chunks ``[64, 64]`` with the 128-byte-swizzled NVMMA layout.
* KV tiles of ``BLOCK_N`` (64, or 32) tokens arrive by TMA over a 2-D view ``[num_blocks * PAGE, 576]``
  of the cache, 32 keys at a time (the plan's split granularity, so a box never crosses a page; a
  64-key tile is two 32-key loads with their own page lookups): a ``[32, 512]`` latent load (eight
  128-byte-swizzled ``[32, 64]`` TMA messages) + a ``[32, 64]`` rope load per 32 keys, each stage
  ``[BLOCK_N, 512]`` (latent = V, the first 512 columns of K) + ``[BLOCK_N, 64]`` (rope). A box whose
  keys all lie past the split or whose block id is out of range (< 0 or >= num_blocks) is aimed at row
  ``num_blocks * PAGE``, wholly outside the descriptor: TMA fills it with zeros and reads nothing; its
  keys are masked to -inf.
* Scores ``S = Q K^T`` [64, BLOCK_N] by ``warpgroup_mma`` (9 chained async MMAs over the 64-column
  chunks), layout ``NVMMADistributedLayout([3, 0], warps_per_cta=[4, 2])``: the two warpgroups take
  half of the tile's keys each (no duplicated QK^T). Online softmax in base 2 in registers; the row max
  across the warpgroups goes through shared memory, the row sum is kept per key column and reduced once
  at the end.
* ``P`` (bf16) to shared memory, then ``O += P V`` with ``V`` = the latent buffer of the same stage,
  the ``[64, 512]`` fp32 accumulator split by columns over the warpgroups (128 registers a thread).
* Launch order: one grid axis of ``work items x head blocks x query blocks`` with the head blocks (then
  query blocks) of a work item adjacent, so the programs that read the same KV tiles run together and all
  but the first read them from L2. Every kernel uses it.
* ``"seesaw"`` (``_mla_decode_gluon_seesaw_kernel`` in :mod:`openmla.ops.gluon.decode_seesaw`, bf16 caches):
  two 4-warp partitions that own alternate 64-key tiles (full-width scores, P over the tile's rope columns, both
  add every tile's P V to their output half; each stage refilled in two TMA groups); see the comment above
  ``_seesaw_wg``. ``mla_decode``'s kernel for bf16 caches where ``"pair"`` does not apply.
* ``"pair"`` (the same kernel with ``PAIR=True``, bf16 caches): the two partitions in FlashMLA's seesaw order
  over pairs of tiles, each P published at its own warpgroup's row max, the block ids looked up a pair ahead, the
  scale folded into the exponent and a lazy row max that lets each warp skip the O rescale; see the comment
  above ``_pair_wg0``. With ``spans`` it runs the request-spanning schedule of :mod:`openmla.ops.plan_spans`
  (one program per SM looping over whole requests or pieces of them, cut requests merged in the kernel from
  partials copied by TMA, final rows sent by TMA). ``mla_decode``'s kernel where 2+ programs read each KV tile
  (h128, h64 with 2+ query tokens) and the batch fills the SMs.
* Both seesaw kernels copy one 64-row TMA box per 64-key tile where pages and splits allow (``box_rows``).
* fp8 cache (``kv_cache_dtype="fp8"``, float8_e4m3fn, selected by the cache dtype; 64-key tiles,
  ``FP8=True``): the producer TMAs e4m3 tiles (half the bytes: latent boxes ``[32, 128]`` with the
  128-byte swizzle, four per 32 keys, and a ``[32, 64]`` rope box with the 64-byte swizzle) into a ring of
  2 fp8 stages; after the "ready" wait the consumers widen the stage (``cvt.rn.f16x2.e4m3x2``, exact)
  into one fp16 tile ``[64, 576]`` in shared memory, zeroing keys >= L (the cache's NaN bytes), fence,
  release the fp8 stage at once, and run the same MMAs in fp16 (q rounded to fp16 when loaded, P in fp16;
  the portable kernel also computes fp8 caches in fp16). ``kv_scale`` is folded into ``scale_log2`` and
  ``v_scale`` by the caller. Shared memory: Q 73,728 + fp16 tile 73,728 + 2 x 36,864 + P 8,192 (+ 1,024
  static) = 230,948 B.
* Keys past the sequence end inside a valid page hold anything (stale data, NaN in the tests): the
  tile that holds the sequence end has those rows of its latent buffer zeroed in shared memory before
  the MMAs (a NaN there would survive ``P = 0`` in ``P V``); their scores are masked to -inf anyway.

Shared memory: Q 73,728 B + STAGES x BLOCK_N x 1,152 B + P 64 x BLOCK_N x 2 B (+ barriers and
reduction scratch): 64 x 2 stages = 229,924 B, 32 x 3 = 188,988 B (limit 232,448). No spill (sm90
offline compile; ``tests/test_decode_gluon.py`` checks every kernel).

Limits: bf16 q; a bf16 cache or an e4m3 cache (per-tensor scale), d_qk = 576 = 512 + 64, page size a multiple of 32,
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
    from openmla.ops.plan_spans import DecodeSpans

__all__ = ["GLUON_AVAILABLE", "VARIANTS", "gluon_decode_config", "gluon_decode_supported", "mla_decode_split_gluon"]

from openmla.ops.gluon._lang import (
    GLUON_AVAILABLE,
    TensorDescriptor,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from openmla.ops.gluon.decode_narrow import NARROW_MAX_ROWS, launch_decode_narrow

D_V = 512
D_R = 64
D_QK = D_V + D_R
BLOCK_M = 64  # rows per program: one wgmma M of 64 per warpgroup
SUB_N = 32  # keys per TMA box: the plan's split granularity, so a box never crosses a page
NUM_WARPS = 8
SMEM_LIMIT = 232448  # bytes of shared memory a block may use on sm90
# registers of the 1-warp producer partition of the warp-specialised kernel: 24 spills a few bytes (its
# arguments arrive through shared memory); 32 leaves the two consumer warpgroups 232 (no spill)
WS_PRODUCER_REGS = 32
# registers of the second warpgroup (the worker partition) of the seesaw kernels
SEESAW_WG_REGS = 240
# the kernels: "ws" (fp8 caches of 64-row tiles), "narrow" (fp8 caches, heads x query rows <= 32:
# :mod:`openmla.ops.gluon.decode_narrow`), "seesaw" (hides HBM latency better), "pair" (the faster schedule once the
# KV tiles come from L2; the only one that runs the request-spanning schedule)
VARIANTS = ("ws", "narrow", "seesaw", "pair")


if GLUON_AVAILABLE:
    from openmla.ops.gluon.decode_seesaw import _mla_decode_gluon_seesaw_kernel
    from openmla.ops.gluon.decode_tiles import (
        _box_ok,
        _issue_kv,
        _key_limit,
        _kv_rows,
        _q_to_smem,
        _row_count,
        _store_result,
        _zero_tail,
    )

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
    def _widen_part(src, dst, n0, L, MASK: gl.constexpr, layout: gl.constexpr, NCOL: gl.constexpr,
                    BLOCK_N: gl.constexpr):  # fmt: skip
        """fp8 (e4m3) shared ``src [BLOCK_N, k * NCOL]`` -> fp16 shared ``dst``, NCOL columns at a time;
        rows whose key is >= L become zeros when ``MASK`` (NaN bytes there must not reach the MMAs)."""
        if MASK:
            o_r = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
            keep = gl.expand_dims(o_r < L, 1)
        for c in gl.static_range(src.shape[1] // NCOL):
            x = src.slice(c * NCOL, NCOL, dim=1).load(layout).to(gl.float16)
            if MASK:
                x = gl.where(keep, x, gl.zeros_like(x))
            dst.slice(c * NCOL, NCOL, dim=1).store(x)

    @gluon.jit
    def _widen_tile(lat8, rope8, lat, rope, n0, L, BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
        """Widen one landed fp8 KV tile into the fp16 tile the MMAs read (exact: every e4m3 value is an
        fp16 value; the per-tensor scale is applied outside). Keys >= L are zeroed. Ends with a fence and
        a CTA barrier: the tile is ready for wgmma and the fp8 stage may be released."""
        gl.static_assert(num_warps == 8, "two warpgroups")
        # 16 fp8 bytes a thread (one 16-byte shared load), a warp 8 rows x 64 columns, warps [4, 2]
        LAT_W: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 2], [1, 0])
        ROPE_W: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 2], [1, 0])
        if n0 + BLOCK_N > L:
            _widen_part(lat8, lat, n0, L, True, LAT_W, 128, BLOCK_N)
            _widen_part(rope8, rope, n0, L, True, ROPE_W, 64, BLOCK_N)
        else:
            _widen_part(lat8, lat, n0, L, False, LAT_W, 128, BLOCK_N)
            _widen_part(rope8, rope, n0, L, False, ROPE_W, 64, BLOCK_N)
        fence_async_shared()  # generic-proxy writes before the async-proxy (wgmma) reads
        gl.thread_barrier()

    @gluon.jit
    def _ws_producer(lat_desc, rope_desc, lat_smem, rope_smem, ready, empty, p_bt, kv_lo, kv_hi, n_tiles,
                     max_blocks, num_blocks, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr, ELEM_BYTES: gl.constexpr):  # fmt: skip
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
            _issue_kv(lat_desc, rope_desc, lat_smem, rope_smem, ready, stage, r0, r1, NSUB, ELEM_BYTES)

    @gluon.jit
    def _ws_consumer(q, q_smem, lat_smem, rope_smem, lat8_smem, rope8_smem, p_smem, ready, empty, p_bt, block_table,
                     query_start_loc,
                     num_splits, out, lse, o_part, lse_part, scale_log2, v_scale, stride_q_t, stride_q_h,
                     stride_o_t, stride_o_h, H, num_blocks, max_blocks, i_w, i_h, i_q, i_b, q_start, qlen, L,
                     kv_lo, kv_hi, n_tiles, PAGE: gl.constexpr, MAX_QLEN: gl.constexpr,
                     BLOCK_H: gl.constexpr, Q_PER: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     CAUSAL: gl.constexpr, FP8: gl.constexpr):  # fmt: skip
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

        # ---- Q rows -> shared memory while the producer starts the first tiles
        _q_to_smem(q, q_smem, q_start, qlen, i_h, i_q, H, stride_q_t, stride_q_h, BLOCK_H, Q_PER, NW)
        limit = gl.expand_dims(_key_limit(i_q, qlen, L, kv_hi, ROW_S, BLOCK_M, Q_PER, CAUSAL), 1)
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

            mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
            if FP8:  # widen the fp8 stage into the one fp16 tile, then hand the stage back to the producer
                lat = lat_smem.index(0)
                rope = rope_smem.index(0)
                _widen_tile(lat8_smem.index(stage), rope8_smem.index(stage), lat, rope, n0, L, BLOCK_N, NW)
                mbarrier.arrive(empty.index(stage), count=1)
            else:
                lat = lat_smem.index(stage)
                rope = rope_smem.index(stage)
                if n0 + BLOCK_N > L:
                    _zero_tail(lat, n0, L, BLOCK_N, NW)
            b_s = _qk(q_smem, lat, rope, s_zero)
            b_s = warpgroup_mma_wait(0, deps=(b_s,))

            b_s = gl.where(m_n, b_s * scale_log2, float("-inf"))
            b_m_new = gl.maximum(b_m, gl.max(b_s, axis=1))
            b_m_use = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)
            b_alpha = gl.exp2(b_m - b_m_use)
            b_p = gl.exp2(b_s - gl.expand_dims(b_m_use, 1))
            b_lv = b_lv * gl.expand_dims(b_alpha, 1) + b_p
            b_m = b_m_new
            p_smem.store(b_p.to(p_smem.dtype))
            fence_async_shared()
            gl.thread_barrier()  # each warpgroup reads all of P

            acc = acc * gl.expand_dims(gl.convert_layout(b_alpha, ROW_O), 1)
            acc = warpgroup_mma(p_smem, lat, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            gl.thread_barrier()  # both warpgroups are done with this stage (or the fp16 tile) and with P
            if not FP8:
                mbarrier.arrive(empty.index(stage), count=1)  # the producer may refill it

        _store_result(acc, gl.sum(b_lv, axis=1), b_m, v_scale, num_splits, out, lse, o_part, lse_part, stride_o_t,
                      stride_o_h, H, i_w, i_h, i_q, i_b, q_start, qlen, MAX_QLEN, BLOCK_H, Q_PER, 0, True)  # fmt: skip

    @gluon.jit(do_not_specialize=["num_tokens"])
    def _mla_decode_gluon_ws_kernel(
        q, lat_desc, rope_desc, block_table, seq_lens, query_start_loc, work_req, work_split, num_splits,
        split_len, out, lse, o_part, lse_part, scale_log2, v_scale, stride_q_t, stride_q_h, stride_bt_b,
        stride_o_t, stride_o_h, H, num_blocks, max_blocks, num_tokens,
        PAGE: gl.constexpr, MAX_QLEN: gl.constexpr, BLOCK_H: gl.constexpr, Q_PER: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, PRODUCER_REGS: gl.constexpr,
        FP8: gl.constexpr, N_HB: gl.constexpr, N_QB: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """The warp-specialised kernel (see the module docstring): one program per work item and 64-row block.

        Grid: one axis of ``capacity * N_HB * N_QB`` programs, the ``N_HB`` head blocks x ``N_QB`` query blocks
        of one work item next to each other, so the programs that read the same KV tiles run at the same
        time and all but the first find them in L2 (h128: 2 head blocks; in work-item-major order each
        tile came from HBM twice).

        ``FP8``: the descriptors are over an e4m3 cache; the ring holds fp8 tiles, the consumers widen each
        to fp16 (one fp16 tile) and run the MMAs in fp16 (q rounded to fp16, P in fp16)."""
        BLOCK_M: gl.constexpr = BLOCK_H * Q_PER
        gl.static_assert(BLOCK_M == 64, "64 rows per program (one wgmma M per warpgroup)")
        gl.static_assert(num_warps == 8, "two consumer warpgroups in the default partition")
        gl.static_assert(BLOCK_N == 32 or BLOCK_N == 64, "BLOCK_N is 32 or 64")
        Q_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        P_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.bfloat16)

        pid = gl.program_id(0)
        i_w = pid // (N_HB * N_QB)
        i_h = pid % N_HB
        i_q = (pid // N_HB) % N_QB
        i_b = gl.load(work_req + i_w)
        if i_b < 0:
            return
        i_b = i_b.to(gl.int64)
        q_start, qlen = _row_count(query_start_loc, i_b, num_tokens, MAX_QLEN)
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

        if FP8:
            CDT: gl.constexpr = gl.float16
            KV16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
            P16: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.float16)
            q_smem = gl.allocate_shared_memory(CDT, [9, BLOCK_M, 64], Q_SMEM)
            ring_lat = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, 512], lat_desc.layout)
            ring_rope = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, 64], rope_desc.layout)
            lat_smem = gl.allocate_shared_memory(CDT, [1, BLOCK_N, 512], KV16)
            rope_smem = gl.allocate_shared_memory(CDT, [1, BLOCK_N, 64], KV16)
            p_smem = gl.allocate_shared_memory(CDT, [BLOCK_M, BLOCK_N], P16)
        else:
            q_smem = gl.allocate_shared_memory(gl.bfloat16, [9, BLOCK_M, 64], Q_SMEM)
            lat_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 512], lat_desc.layout)
            rope_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], rope_desc.layout)
            p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_N], P_SMEM)
            ring_lat = lat_smem
            ring_rope = rope_smem
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(ready.index(st), count=1)
            mbarrier.init(empty.index(st), count=1)
        fence_async_shared()  # barrier inits visible to the async proxy and the other partitions

        gl.warp_specialize([
            (_ws_consumer, (q, q_smem, lat_smem, rope_smem, ring_lat, ring_rope, p_smem, ready, empty, p_bt,
                            block_table,
                            query_start_loc, num_splits, out, lse, o_part, lse_part, scale_log2, v_scale,
                            stride_q_t, stride_q_h, stride_o_t, stride_o_h, H, num_blocks, max_blocks, i_w, i_h,
                            i_q, i_b, q_start, qlen, L, kv_lo, kv_hi, n_tiles, PAGE, MAX_QLEN, BLOCK_H, Q_PER,
                            BLOCK_N, STAGES, CAUSAL, FP8)),
            (_ws_producer, (lat_desc, rope_desc, ring_lat, ring_rope, ready, empty, p_bt, kv_lo, kv_hi, n_tiles,
                            max_blocks, num_blocks, PAGE, BLOCK_N, STAGES, 1 if FP8 else 2)),
        ], [1], [PRODUCER_REGS])  # fmt: skip

        for st in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(st))
            mbarrier.invalidate(empty.index(st))


def gluon_decode_config(num_heads: int, max_query_len: int) -> tuple[int, int]:
    """``(BLOCK_H, Q_PER)`` of the Gluon kernel: 64 rows = heads x query tokens, heads first."""
    block_h = min(triton.next_power_of_2(max(1, num_heads)), BLOCK_M)
    return block_h, BLOCK_M // block_h


def _kv_layout(fp8: bool = False, inner: int = D_V):
    if fp8:  # e4m3: the latent box is 512 bytes wide (four 128-byte swizzle atoms), the rope box 64 bytes
        return gl.NVMMASharedLayout(swizzle_byte_width=min(128, inner), element_bitwidth=8, rank=2)
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


def _out_desc(out: torch.Tensor, block_h: int):
    """A TMA descriptor over a bf16 ``out [T, H, 512]`` as ``[T * H, 512]`` with ``[block_h, 256]`` boxes (the final
    rows of the pair kernel on the spanning schedule), or None where its rows are not evenly strided (token stride !=
    H x head stride) or not 16-byte aligned (then the kernel stores them staged)."""
    T, H, D = out.shape
    st, sh, sd = out.stride()
    if out.dtype != torch.bfloat16 or D != D_V or sd != 1 or st != H * sh or sh % 8 or out.data_ptr() % 16:
        return None
    out2d = out.as_strided((T * H, D), (sh, 1))
    return TensorDescriptor(out2d, [T * H, D], [sh, 1], [block_h, 256], _kv_layout())


def _smem_bytes(block_n: int, stages: int, fp8: bool) -> int:
    """Shared memory of one program: Q + KV ring (+ the fp16 tile of the fp8 path) + P + barriers/scratch."""
    if fp8:
        return 64 * D_QK * 2 + block_n * D_QK * 2 + stages * block_n * D_QK + 64 * block_n * 2 + 1024
    return 64 * D_QK * 2 + stages * block_n * D_QK * 2 + 64 * block_n * 2 + 1024


def gluon_decode_supported(q: torch.Tensor, kv_cache: torch.Tensor, plan: DecodePlan,
                           kv_cache_dtype: str = "auto") -> bool:  # fmt: skip
    """Whether :func:`mla_decode_split_gluon` handles this call.

    True on an sm90 CUDA device with Gluon available, bf16 q and either a bf16 cache
    (``kv_cache_dtype="auto"``) or a float8_e4m3fn cache (``kv_cache_dtype="fp8"``: the warp-specialised
    kernel widens each tile to fp16 in shared memory; q is rounded to fp16), d_qk 576 (512 + 64), a page
    size that is a multiple of 32, a plan whose split lengths are
    multiples of 32 (``plan.tiling.block_n % 32 == 0``) and a cache whose pages are evenly strided
    rows (a 2-D view ``[num_blocks * page, 576]`` with 16-byte-aligned rows). Any head count and
    query length (rows are padded to 64: heads x query tokens).
    """
    if not GLUON_AVAILABLE or kv_cache_dtype not in ("auto", "fp8"):
        return False
    if q.device.type != "cuda" or kv_cache.device != q.device:
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    cache_dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.bfloat16
    if q.dtype != torch.bfloat16 or kv_cache.dtype != cache_dtype:
        return False
    if q.dim() != 3 or kv_cache.dim() != 3 or q.shape[2] != D_QK or kv_cache.shape[2] != D_QK:
        return False
    if not _q_copyable(q):
        return False
    if plan.d_v != D_V:
        return False
    page = kv_cache.shape[1]
    if page % SUB_N or plan.tiling.block_n % SUB_N:
        return False
    s0, s1, s2 = kv_cache.stride()
    if s2 != 1 or s0 != page * s1 or (s1 * kv_cache.element_size()) % 16 or kv_cache.data_ptr() % 16:
        return False
    return kv_cache.shape[0] * page < 2**31  # int32 TMA row coordinates


def _q_copyable(q: torch.Tensor) -> bool:
    """Whether the kernels' 16-byte copies of q's rows apply: last dim contiguous, token and head strides multiples
    of 16 elements (what the JIT specialises on), 16-byte-aligned base."""
    return q.stride(2) == 1 and q.stride(0) % 16 == 0 and q.stride(1) % 16 == 0 and q.data_ptr() % 16 == 0


def mla_decode_split_gluon(q, kv_cache, block_table, seq_lens, query_start_loc, plan: DecodePlan, out, lse,
                           scale_log2: float, v_scale: float, causal: bool, d_v: int, *, block_n: int = 64,
                           stages: int | None = None, variant: str = "ws",
                           box_rows: int | None = None, spans: DecodeSpans | None = None) -> None:  # fmt: skip
    r"""Launch the Gluon split-KV kernel (same meaning as ``_mla_decode_split`` in ``ops/decode.py``).

    Writes the final rows of single-split requests into ``out``/``lse`` and the normalised fp32
    partials of the others into ``plan.o_part``/``plan.lse_part``; the caller runs the reduce.

    Args:
        q (torch.Tensor): `[T, H, 576]` bf16.
        kv_cache (torch.Tensor): `[num_blocks, page, 576]` bf16, or float8_e4m3fn (page a multiple of 32):
            the fp8 path (64-key tiles) loads e4m3 tiles by TMA, widens each to an fp16
            tile in shared memory (exact) and runs the same MMAs in fp16 (q rounded to fp16, like the
            portable kernel); the caller folds ``kv_scale`` into ``scale_log2`` and passes it as ``v_scale``.
        block_table (torch.Tensor): `[B, W]` int32. seq_lens: `[B]` int32. query_start_loc: `[B + 1]` int32.
        plan (DecodePlan): from :func:`openmla.plan_decode` for this batch.
        out (torch.Tensor): `[T, H, 512]` bf16. lse: `[T, H]` fp32, contiguous.
        scale_log2 (float): ``sm_scale * log2(e)`` (times the q/kv scales).
        v_scale (float): multiplies the output (1.0 for a bf16 cache).
        causal (bool): query t of a request with qlen L sees keys ``[0, seq_len - L + t]``.
        d_v (int): must be 512.
        block_n (int): keys per KV tile, 64 or 32 (keyword-only tuning knob; 64 measured faster).
        stages (int | None): KV ring depth (default: 2 for 64-key tiles, 3 for 32). The fp8 path needs
            64-key tiles and fits 2 fp8 stages next to its fp16 tile.
        variant (str): ``"ws"`` (``_mla_decode_gluon_ws_kernel``), ``"narrow"`` (fp8 cache, heads x
            ``plan.max_query_len`` <= 32: :mod:`openmla.ops.gluon.decode_narrow`, default tiles), ``"seesaw"`` or
            ``"pair"`` (``_mla_decode_gluon_seesaw_kernel``: bf16 cache, 64-key tiles, 2 stages; ``block_n``/``stages``
            must keep their defaults); see the module docstring.
        box_rows (int | None): seesaw kernels: rows of a TMA box, 32 or 64 (one box per 64-key tile: needs a page
            size and split lengths that are multiples of 64, so a tile never crosses a page; half the copies).
            None: 64 where it applies, else 32.
        spans (DecodeSpans | None): ``plan.spans`` (``variant="pair"``): run the request-spanning schedule
            instead of the plan's work items: ``spans.num_groups`` x ``spans.readers`` programs, each looping over
            its group's items. The kernel merges the pieces of cut requests itself (through ``plan.o_part`` /
            ``plan.lse_part`` and ``spans.flags``) and writes every row of ``out`` / ``lse``: no reduce follows.
    """
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}; got {variant!r}")
    if variant == "narrow" and (not fp8 or q.shape[1] * plan.max_query_len > NARROW_MAX_ROWS or block_n != 64
                                or stages is not None):  # fmt: skip
        raise ValueError(f"variant='narrow' takes an fp8 cache, heads x max_query_len <= {NARROW_MAX_ROWS} and the "
                         f"default tiles; got {kv_cache.dtype}, {q.shape[1]} x {plan.max_query_len}, "
                         f"block_n={block_n}, stages={stages}")  # fmt: skip
    seesaw = variant in ("seesaw", "pair")
    if seesaw and not _q_copyable(q):
        raise ValueError(f"the seesaw kernels copy q's rows 16 bytes at a time: q needs a contiguous last dim, token "
                         f"and head strides that are multiples of 16 and a 16-byte-aligned base; got strides "
                         f"{tuple(q.stride())}")  # fmt: skip
    if spans is not None and variant != "pair":
        raise ValueError(f"spans needs variant='pair'; got {variant!r}")
    if seesaw and (fp8 or block_n != 64 or stages not in (None, 2)):
        raise ValueError(f"variant={variant!r} takes a bf16 cache, 64-key tiles and 2 stages; got "
                         f"{kv_cache.dtype}, block_n={block_n}, stages={stages}")  # fmt: skip
    if box_rows is None:  # one box per tile where a tile never crosses a page
        box_rows = 64 if seesaw and kv_cache.shape[1] % 64 == 0 and plan.tiling.block_n % 64 == 0 else SUB_N
    if box_rows not in (SUB_N, 64) or (box_rows != SUB_N and not seesaw):
        raise ValueError(f"box_rows must be {SUB_N}, or 64 with a seesaw kernel; got {box_rows} ({variant!r})")
    if box_rows == 64 and kv_cache.shape[1] % 64:
        raise ValueError(f"box_rows=64 needs a page size that is a multiple of 64; got {kv_cache.shape[1]}")
    if box_rows == 64 and plan.tiling.block_n % 64:
        raise ValueError(f"box_rows=64 needs split lengths that are multiples of 64; got plan.tiling.block_n "
                         f"{plan.tiling.block_n}")  # fmt: skip
    if fp8 and block_n != 64:
        # 32-key fp8 tiles compile with a few spilled scalars in the consumers (sm90, 240 registers)
        raise ValueError(f"an fp8 cache runs with 64-key tiles only; got block_n={block_n}")
    if d_v != D_V:
        raise ValueError(f"the Gluon decode kernel needs d_v = {D_V}; got {d_v}")
    if block_n not in (32, 64):
        raise ValueError(f"block_n must be 32 or 64; got {block_n}")
    if stages is None:
        stages = 2 if block_n == 64 else 3
    smem = _smem_bytes(block_n, stages, fp8)
    if smem > SMEM_LIMIT:
        raise ValueError(f"block_n={block_n} x stages={stages} needs {smem} B of shared memory (> {SMEM_LIMIT})")
    H = q.shape[1]
    num_blocks, page, _ = kv_cache.shape
    block_h, q_per = gluon_decode_config(H, plan.max_query_len)
    kv2d = kv_cache.as_strided((num_blocks * page, D_QK), (kv_cache.stride(1), 1))
    shape, strides = [num_blocks * page, D_QK], [kv_cache.stride(1), 1]
    lat_desc = TensorDescriptor(kv2d, shape, strides, [SUB_N, D_V], _kv_layout(fp8, D_V))
    rope_desc = TensorDescriptor(kv2d, shape, strides, [SUB_N, D_R], _kv_layout(fp8, D_R))
    n_hb, n_qb = triton.cdiv(H, block_h), triton.cdiv(plan.max_query_len, q_per)
    grid = (plan.capacity * n_hb * n_qb,)
    if spans is not None:
        if spans.readers != n_hb * n_qb or spans.num_splits.shape[0] != plan.batch_size:
            raise ValueError(
                f"spans were planned for {spans.readers} programs a group and batch "
                f"{spans.num_splits.shape[0]}; this call has {n_hb * n_qb} and {plan.batch_size}"
            )
        grid = (spans.num_groups * n_hb * n_qb,)
    args = (q, lat_desc, rope_desc, block_table, seq_lens, query_start_loc, plan.work_req, plan.work_split,
            plan.num_splits, plan.split_len, out, lse, plan.o_part, plan.lse_part, scale_log2, v_scale,
            q.stride(0), q.stride(1), block_table.stride(0), out.stride(0), out.stride(1),
            H, num_blocks, block_table.shape[1], q.shape[0])  # fmt: skip
    if seesaw:
        half_desc = TensorDescriptor(kv2d, shape, strides, [box_rows, 256], _kv_layout())  # half a latent row a copy
        rope_desc = TensorDescriptor(kv2d, shape, strides, [box_rows, D_R], _kv_layout(fp8, D_R))
        kw = {
            "PAGE": page,
            "MAX_QLEN": plan.max_query_len,
            "BLOCK_H": block_h,
            "Q_PER": q_per,
            "CAUSAL": causal,
            "WG_REGS": SEESAW_WG_REGS,
            "N_HB": n_hb,
            "N_QB": n_qb,
            "num_warps": 4,
        }
        if spans is not None:  # the items' requests, key ranges and pieces per request (for the merge)
            args = args[:6] + (spans.work_req, spans.work_lo, spans.num_splits, spans.work_hi) + args[10:]
        # (unused without spans)
        sp = (spans.group_indptr, spans.work_indptr, spans.flags) if spans is not None else (plan.work_indptr,) * 3
        out_desc = _out_desc(out, block_h) if spans is not None else None
        part_desc = None  # the cut requests' fp32 partials, copied by TMA for the merge
        if spans is not None:
            part_desc = TensorDescriptor(plan.o_part.view(-1, D_V), [plan.o_part.numel() // D_V, D_V], [D_V, 1],
                                         [block_h, 256], gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                                              element_bitwidth=32, rank=2))  # fmt: skip
        _mla_decode_gluon_seesaw_kernel[grid](q, half_desc, rope_desc, *args[3:], group_indptr=sp[0],
                                              span_indptr=sp[1], span_flags=sp[2], out_desc=out_desc,
                                              part_desc=part_desc, MERGE_TMA=part_desc is not None,
                                              PAIR=variant == "pair", SPANS=spans is not None,
                                              OUT_TMA=out_desc is not None, **kw)  # fmt: skip
        return
    if variant == "narrow":
        launch_decode_narrow(args, plan.capacity, page, plan.max_query_len, H, causal)
        return
    _mla_decode_gluon_ws_kernel[grid](
        *args, PAGE=page, MAX_QLEN=plan.max_query_len, BLOCK_H=block_h, Q_PER=q_per, BLOCK_N=block_n,
        STAGES=stages, CAUSAL=causal, PRODUCER_REGS=WS_PRODUCER_REGS, FP8=fp8, N_HB=n_hb, N_QB=n_qb,
        num_warps=NUM_WARPS,
    )  # fmt: skip
