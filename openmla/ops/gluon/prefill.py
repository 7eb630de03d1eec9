"""Hopper (sm90) tier of the MLA prefill: a warp-specialised Gluon flash-attention forward kernel (bf16).

Same contract as :func:`openmla.ops.prefill.flash_attn_varlen` for bf16 inputs with ``d_qk = 192``
(128 + 64) and ``d_v = 128``: a ragged batch packed by ``cu_seqlens``, bottom-right causal masking
(query ``i`` of a request with ``Lq`` queries and ``Lk`` keys sees keys ``j <= i + Lk - Lq``), GQA
(query head ``h`` reads key/value head ``h // (h_q // h_kv)``), the normalised bf16 output and the
natural-log fp32 LSE; rows that see no key get out 0 and lse -inf (never NaN).

Why a Gluon kernel: Triton keeps the two warpgroups of an 8-warp program in lockstep (CTA-wide
barriers every iteration), so both softmaxes run while the tensor cores idle. Here the warpgroups are
separate partitions of ``gl.warp_specialize`` and only meet through mbarriers.

Design (FA3-style; a work item is one 128-query-row block of one request and one query head; persistent
programs, one an SM, walk the items):

* Partitions: ``_consumer`` twice (the default partition, warpgroup 0, query rows 0-63 of the block;
  a 4-warp worker, warpgroup 1, rows 64-127) and ``_producer`` (a 1-warp worker, few registers after
  ``setmaxnreg``). The consumers' register budget is raised by ``setmaxnreg`` (``CONSUMER_REGS``).
* Producer: for each item, Q ``[128, 192]`` as six TMA boxes ``[64, 64]`` (one 128-byte swizzle atom wide)
  over ``q`` viewed as a 2-D ``[Tq, (H - 1) * stride_h + 192]`` tensor, each warpgroup's 64 rows on their own
  ready / empty barriers (warpgroup 0's as soon as its last scores of the item before are done, warpgroup 1's
  after the item's first K tile); then for every key tile ``j``
  K ``[BLOCK_N, 192]`` (TMA splits the box into three 64-column messages) and V ``[BLOCK_N, 128]``
  into a ``STAGES``-deep ring. K and V have their own ready/empty mbarriers (the scores can start
  before V lands); an empty barrier needs one arrival per consumer warpgroup (count 2).
* Consumer loop (per warpgroup, 64 rows): ``S_j = Q K_j^T`` as three chained async wgmmas (k = 64
  each, B = the K tile's 64-column slice, permuted), then the PV of the previous tile ``O += P_{j-1}
  V_{j-1}`` as one async wgmma with ``P`` in registers (``DotOperandLayout`` of the output's MMA
  layout: the accumulator layout of S converts to it without data movement). ``wgmma.wait_group 1``
  gives ``S_j`` while the PV still runs; the online softmax of ``S_j`` (base 2, the scale folded into
  ``exp2(s * scale - m)`` when ``sm_scale > 0``) overlaps it; ``wait_group 0`` then rescales ``O`` by
  ``alpha_j``. K_j is released right after the scores, V_{j-1} after the PV.
* Ping-pong (``PINGPONG``): the two warpgroups take turns issuing their wgmmas, through two
  count-1 mbarriers (``turn``): warpgroup ``w`` waits for its turn before issuing and passes the turn
  right after, so the tensor cores run one warpgroup's GEMMs while the other one is in its softmax.
  It only orders the issue, never the results. Both warpgroups take the same number of turns
  (``n_tiles + 1``: the scores of tile 0, one per loop step, the last PV).
* Barriers: no CTA-wide barrier after the partitions start. Triton puts a warpgroup-local named
  barrier (``bar.sync id, 128``) before each ``mbarrier.arrive`` (one thread of the warpgroup arrives),
  i.e. three per key tile and consumer; the two consumers never wait for each other except through
  ``turn`` (PINGPONG) and the shared ring stages.
* Masks: a key tile that every row of the warpgroup sees entirely (inside the request and, when
  causal, left of the warpgroup's diagonal) runs unmasked; the others (the diagonal tiles, the last
  tile of a request) set the hidden scores to -inf (a uniform runtime branch per tile). Rows with no
  visible key so far keep ``m = -inf`` and shift by 0, so ``p = 0``, never NaN.
* Varlen: a TMA box may cross into the next request's rows (masked keys: scores -inf, so P is exactly
  0) or past the tensor (TMA fills zeros). The V rows of the last tile past the request are zeroed in
  shared memory by each consumer before its last PV (stale or NaN rows past ``cu_seqlens_k[-1]`` must
  not reach ``0 * NaN``); both warpgroups write the same zeros. Rows past the request's queries are
  computed (on finite or zero Q rows) and not stored. Output and LSE are written by masked pointer
  stores, the output's from the 16-byte store layout (``openmla/ops/gluon/stores.py``: 4-byte stores
  straight from the MMA layout cost 2-11% more).
* Schedule: items run request by request; inside a request, by default one head's row blocks after the
  other, the last (heaviest, when causal) first. The programs in flight then read the K / V of one or two
  heads, which stay in L2; with every head's heaviest block first (``HEAD_BLOCK = H``) each program
  streamed its head's K / V from HBM. The number of key tiles of an item is that of its 128-row block for
  both warpgroups (so their turns match); warpgroup 0 may run a fully masked tile (p = 0) on the diagonal.
* Persistent walk: program ``p`` takes item ``p``, then ``num_programs + atomic_add(counter, 1)`` until
  the items run out, in the order in which the hardware's block scheduler handed out one program an item
  before (each then paid its launch, Q load and first tiles with the tensor cores idle). The producer
  fetches an item's successor before the item's copies and publishes it through a 2-slot shared-memory ring
  (``id_ready`` / ``id_empty``) once they are issued; the consumers read it, and load its lengths, before
  their epilogue (the loads' latency hides behind the stores). The ring positions, the Q barrier phases and
  the turns run on across items, so the next item's Q and first tiles land
  during the current item's last P V and epilogue. Items past a short request's rows are skipped by every
  partition alike.

* fp8 (``FP8``): e4m3 Q and K (two wgmmas of k = 128 and 64 on the fp8 tensor cores, the descales folded
  into the scale); V is widened to bf16 before the launch (``_widen_e4m3``, exact) and P V runs in bf16.

Shared memory (BLOCK_N 128, 2 stages): Q 49,152 + 2 x (K 49,152 + V 32,768) = 212,992 B + barriers
(limit 232,448). BLOCK_N 64 with 3-4 stages (and fp8 with BLOCK_N 128 and 3 stages) also fit.

Limits: sm90, bf16 (or e4m3) q/k/v, ``d_qk = 192``, ``d_v = 128``, last dim contiguous, token strides and the
head strides with 16-byte-aligned bases (TMA), ``h_q`` a multiple of ``h_kv``. Gluon needs
``triton.experimental.gluon`` (Triton >= 3.5); without it :func:`gluon_prefill_supported` is False and
importing this module still works.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

__all__ = ["GLUON_AVAILABLE", "flash_attn_varlen_gluon", "gluon_prefill_supported"]

from openmla.ops.gluon._lang import (
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
from openmla.ops.gluon.stores import row_store_layout

D_QK = 192
D_V = 128
BLOCK_M = 128  # query rows per program: 64 per consumer warpgroup
SMEM_LIMIT = 232448  # bytes of shared memory a block may use on sm90
#: registers of the 1-warp producer partition and of the consumer warpgroups (setmaxnreg)
PRODUCER_REGS = 24
CONSUMER_REGS = 240
#: default tile: keys per tile and ring depth
BLOCK_N_DEFAULT, STAGES_DEFAULT = 128, 2
#: Q buffers where they fit in shared memory (fp8's e4m3 Q): the next item's Q lands during the current item
Q_BUFS_MAX = 2
#: take turns issuing the wgmmas of the two consumer warpgroups (see the module docstring)
PINGPONG: bool = True
# launch order (see flash_attn_varlen_gluon's head_block): 1 keeps the programs in flight on few heads
HEAD_BLOCK: int = 1
_WIDEN_ROWS = 64  # rows of D values per program of _widen_e4m3_kernel (the fp8 path's V widening)


def _smem_bytes(block_n: int, stages: int, fp8: bool = False, q_bufs: int = 1) -> int:
    """Q (``q_bufs`` buffers) + the K / V ring + barriers (fp8: e4m3 Q and K, bf16 V)."""
    qk = 1 if fp8 else 2
    return q_bufs * BLOCK_M * D_QK * qk + stages * block_n * (D_QK * qk + D_V * 2) + 1024


if GLUON_AVAILABLE:
    _O_STORE = gl.constexpr(row_store_layout(D_V))  # an epilogue's [64, 128] rows, 16 bytes a thread a store

    @gluon.jit
    def _item(k, cu_seqlens_q, cu_seqlens_k, n_rb, H, HEAD_BLOCK: gl.constexpr, CAUSAL: gl.constexpr,
              BLOCK_N: gl.constexpr):  # fmt: skip
        """Work item ``k`` -> ``(i_h, bos_q, len_q, start_m, bos_k, len_k, n_tiles)``. Items run request by request;
        inside a request, HEAD_BLOCK heads' row blocks interleaved, the last (heaviest when causal) first. An item
        with ``start_m >= len_q`` (a row block past a shorter request) is skipped by every partition."""
        per_b = n_rb * H
        i_b = k // per_b
        r = k % per_b
        x = r % (n_rb * HEAD_BLOCK)
        i_h = (r // (n_rb * HEAD_BLOCK)) * HEAD_BLOCK + x % HEAD_BLOCK
        i_m = x // HEAD_BLOCK
        if CAUSAL:
            i_m = n_rb - 1 - i_m
        bos_q = gl.load(cu_seqlens_q + i_b).to(gl.int32)  # int32 TMA coordinates (Tq < 2**31)
        len_q = gl.load(cu_seqlens_q + i_b + 1).to(gl.int32) - bos_q
        bos_k = gl.load(cu_seqlens_k + i_b).to(gl.int32)
        len_k = gl.load(cu_seqlens_k + i_b + 1).to(gl.int32) - bos_k
        start_m = i_m * 128
        if CAUSAL:
            n_end = gl.maximum(gl.minimum(len_k, gl.minimum(start_m + 128, len_q) + len_k - len_q), 0)
        else:
            n_end = len_k
        return i_h, bos_q, len_q, start_m, bos_k, len_k, gl.cdiv(n_end, BLOCK_N)

    @gluon.jit
    def _load_q_half(q_desc, q2_desc, q_smem, q2_smem, q_ready, q_empty, row_q, col_q, n_q, WG: gl.constexpr,
                     FP8: gl.constexpr, Q_BUFS: gl.constexpr):  # fmt: skip
        """Warpgroup WG's 64 Q rows of the ``n_q``-th item into Q buffer ``n_q % Q_BUFS``, once that warpgroup's last
        scores of the item that used the buffer before are done (fresh barriers pass parity 1 at once). FP8: a
        [64, 128] and a [64, 64] e4m3 box (one 128- / 64-byte swizzle atom wide); else three [64, 64] bf16 boxes."""
        qi = (n_q % Q_BUFS) * 2 + WG
        mbarrier.wait(q_empty.index(qi), ((n_q // Q_BUFS) & 1) ^ 1)
        row = row_q + WG * 64
        if FP8:
            mbarrier.expect(q_ready.index(qi), 64 * 192)
            tma.async_copy_global_to_shared(q_desc, [row, col_q], q_ready.index(qi), q_smem.index(qi))
            tma.async_copy_global_to_shared(q2_desc, [row, col_q + 128], q_ready.index(qi), q2_smem.index(qi))
        else:
            mbarrier.expect(q_ready.index(qi), 3 * 64 * 64 * 2)
            for c in gl.static_range(3):
                tma.async_copy_global_to_shared(q_desc, [row, col_q + c * 64], q_ready.index(qi),
                                                q_smem.index(qi * 3 + c))  # fmt: skip

    @gluon.jit
    def _producer(q_desc, q2_desc, k1_desc, k2_desc, v_desc, q_smem, q2_smem, k1_smem, k2_smem, v_smem, q_ready,
                  q_empty, k_ready, k_empty, v_ready, v_empty, id_smem, id_ready, id_empty, counter, n_items, n_rb, H,
                  cu_seqlens_q, cu_seqlens_k, stride_qh, stride_kh, stride_vh, GROUP: gl.constexpr,
                  HEAD_BLOCK: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  FP8: gl.constexpr, Q_BUFS: gl.constexpr):  # fmt: skip
        """1 warp, item after item: warpgroup 0's Q rows, then the K and V tiles of the ring (each waits for its
        stage to be released; the ring runs on across items), warpgroup 1's Q rows after the first K tile. FP8: Q
        and K are e4m3. Each item's successor comes from ``counter`` (``num_programs + atomic_add``, issued
        before the item's copies and read after them) and is published to the consumers through ``id_smem``."""
        LANE: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        lane = gl.arange(0, 32, layout=LANE)
        n_prog = gl.num_programs(0)
        cur = gl.program_id(0)
        t = 0  # tiles issued (the ring position)
        n_q = 0  # Q loads issued
        i = 0  # items walked (the id ring position)
        while cur < n_items:
            got = gl.atomic_add(counter + lane * 0, gl.where(lane == 0, 1, 0), mask=lane == 0)
            i_h, bos_q, len_q, start_m, bos_k, len_k, n_tiles = _item(cur, cu_seqlens_q, cu_seqlens_k, n_rb, H,
                                                                     HEAD_BLOCK, CAUSAL, BLOCK_N)  # fmt: skip
            if start_m < len_q:
                row_q = bos_q + start_m
                col_q = i_h * stride_qh
                # warpgroup 0's rows first: its Q may land while warpgroup 1 still scores the previous item
                _load_q_half(q_desc, q2_desc, q_smem, q2_smem, q_ready, q_empty, row_q, col_q, n_q, 0, FP8, Q_BUFS)
                col_k = (i_h // GROUP) * stride_kh
                col_v = (i_h // GROUP) * stride_vh
                for j in range(n_tiles):
                    st = (t + j) % STAGES
                    ph = (((t + j) // STAGES) & 1) ^ 1
                    row = bos_k + j * BLOCK_N
                    mbarrier.wait(k_empty.index(st), ph)
                    mbarrier.expect(k_ready.index(st), BLOCK_N * 192 * (1 if FP8 else 2))
                    tma.async_copy_global_to_shared(k1_desc, [row, col_k], k_ready.index(st), k1_smem.index(st))
                    tma.async_copy_global_to_shared(k2_desc, [row, col_k + 128], k_ready.index(st),
                                                    k2_smem.index(st))  # fmt: skip
                    if j == 0:
                        _load_q_half(
                            q_desc, q2_desc, q_smem, q2_smem, q_ready, q_empty, row_q, col_q, n_q, 1, FP8, Q_BUFS
                        )
                    mbarrier.wait(v_empty.index(st), ph)
                    mbarrier.expect(v_ready.index(st), BLOCK_N * 128 * 2)
                    tma.async_copy_global_to_shared(v_desc, [row, col_v], v_ready.index(st), v_smem.index(st))
                if n_tiles == 0:
                    _load_q_half(q_desc, q2_desc, q_smem, q2_smem, q_ready, q_empty, row_q, col_q, n_q, 1, FP8, Q_BUFS)
                t += n_tiles
                n_q += 1
            nxt = n_prog + gl.sum(gl.where(lane == 0, got, 0), axis=0)
            slot = i % 2
            mbarrier.wait(id_empty.index(slot), ((i // 2) & 1) ^ 1)
            id_smem.index(slot).store(gl.full([1], nxt, gl.int32, LANE))
            mbarrier.arrive(id_ready.index(slot), count=1)
            cur = nxt
            i += 1

    @gluon.jit
    def _turn_wait(turn, k, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """Wait until warpgroup WG may issue its ``k``-th batch of wgmmas (warpgroup 0 goes first)."""
        if PINGPONG:
            if WG == 0:
                mbarrier.wait(turn.index(0), (k & 1) ^ 1)
            else:
                mbarrier.wait(turn.index(1), k & 1)

    @gluon.jit
    def _turn_pass(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - WG), count=1)

    @gluon.jit
    def _qk(q_smem, q2_smem, k1_tile, k2_tile, s_init, qi, FP8: gl.constexpr):
        """Start ``S = Q K^T`` (k = 192 as three chained async wgmmas over 64-column slices; FP8: two, over the
        e4m3 columns 0:128 and 128:192)."""
        if FP8:
            s = warpgroup_mma(q_smem.index(qi), k1_tile.permute((1, 0)), s_init, use_acc=False, is_async=True)
            s = warpgroup_mma(q2_smem.index(qi), k2_tile.permute((1, 0)), s, is_async=True)
        else:
            s = warpgroup_mma(q_smem.index(qi * 3), k1_tile.slice(0, 64, dim=1).permute((1, 0)), s_init,
                              use_acc=False, is_async=True)  # fmt: skip
            s = warpgroup_mma(q_smem.index(qi * 3 + 1), k1_tile.slice(64, 64, dim=1).permute((1, 0)), s,
                              is_async=True)  # fmt: skip
            s = warpgroup_mma(q_smem.index(qi * 3 + 2), k2_tile.permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _mask(s, n0, row0, len_k, delta, CAUSAL: gl.constexpr, S_LAYOUT: gl.constexpr, BLOCK_N: gl.constexpr):
        """Scores of hidden keys (past the request; right of the row's diagonal when causal) -> -inf."""
        o_n = gl.expand_dims(n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT)), 0)
        keep = o_n < len_k
        if CAUSAL:
            o_r = gl.expand_dims(row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, S_LAYOUT)), 1)
            keep = keep & (o_n <= o_r + delta)
        return gl.where(keep, s, float("-inf"))

    @gluon.jit
    def _softmax(s, m_i, l_i, qk_scale, SCALE_POS: gl.constexpr):
        """Online softmax step (base 2): ``(p, m_new, l_new, alpha)``. ``m`` is in scaled base-2 units.
        With ``SCALE_POS`` (scale > 0) ``s`` holds raw scores: the row max is taken on them and the scale
        rides in the exponent (one FMA per score); otherwise ``s`` is already scaled (and masked)."""
        if SCALE_POS:
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        else:
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: shift by 0, p = 0
        alpha = gl.exp2(m_i - m_use)
        if SCALE_POS:
            p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
        else:
            p = gl.exp2(s - gl.expand_dims(m_use, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _zero_v_tail(v_tile, n_valid, BLOCK_N: gl.constexpr):
        """Zero the rows ``>= n_valid`` of a landed V tile (keys past the request), then fence and sync
        this warpgroup: the wgmma that follows reads the zeros."""
        Z_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        keep = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, Z_LAYOUT)) < n_valid, 1)
        for c in gl.static_range(2):
            buf = v_tile.slice(c * 64, 64, dim=1)
            x = buf.load(Z_LAYOUT)
            buf.store(gl.where(keep, x, gl.zeros_like(x)))
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _consume_item(q_smem, q2_smem, k1_smem, k2_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                      turn, bos_q, len_q, len_k, start_m, n_tiles, qk_scale, t, n_q, n_turn, WG: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, SCALE_POS: gl.constexpr,
                      PINGPONG: gl.constexpr, FP8: gl.constexpr, Q_BUFS: gl.constexpr):  # fmt: skip
        """One consumer warpgroup's main loop over one item: rows ``start_m + WG * 64 + [0, 64)`` of the block;
        returns the unnormalised ``(acc, m, l)``. ``t``, ``n_q``, ``n_turn``: the ring position, the Q loads and
        the wgmma turns of the items before (the barriers' phases run on across items)."""
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 32 if FP8 else 16])  # fmt: skip
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 128, 16])  # fmt: skip
        P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)

        row0 = start_m + WG * 64  # first query row (request-local) of this warpgroup
        delta = len_k - len_q
        # keys [0, n_full) are seen by every row of this warpgroup: tiles ending there need no mask
        if CAUSAL:
            n_full = gl.maximum(gl.minimum(len_k, row0 + delta + 1), 0)
        else:
            n_full = len_k

        m_i = gl.full([64], float("-inf"), gl.float32, ROW_S)
        l_i = gl.full([64], 0.0, gl.float32, ROW_S)
        acc = gl.zeros([64, 128], gl.float32, O_LAYOUT)
        s_zero = gl.zeros([64, BLOCK_N], gl.float32, S_LAYOUT)

        qi = (n_q % Q_BUFS) * 2 + WG  # this item's Q buffer, this warpgroup's rows
        mbarrier.wait(q_ready.index(qi), (n_q // Q_BUFS) & 1)
        if n_tiles > 0:
            # ---- tile 0: scores and softmax (no PV yet)
            st0 = t % STAGES
            mbarrier.wait(k_ready.index(st0), (t // STAGES) & 1)
            _turn_wait(turn, n_turn, WG, PINGPONG)
            s_tok = _qk(q_smem, q2_smem, k1_smem.index(st0), k2_smem.index(st0), s_zero, qi, FP8)
            _turn_pass(turn, WG, PINGPONG)
            s = warpgroup_mma_wait(0, deps=(s_tok,))
            mbarrier.arrive(k_empty.index(st0), count=1)
            if not SCALE_POS:  # scale <= 0: scale before masking (-inf * 0 would be NaN)
                s = s * qk_scale
            if BLOCK_N > n_full:
                s = _mask(s, 0, row0, len_k, delta, CAUSAL, S_LAYOUT, BLOCK_N)
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, SCALE_POS)
            p_op = gl.convert_layout(p.to(gl.bfloat16), P_LAYOUT)

            # ---- steady state: scores of tile j, PV of tile j - 1 (in flight during the softmax of j)
            for j in range(1, n_tiles):
                st = (t + j) % STAGES
                pst = (t + j - 1) % STAGES
                mbarrier.wait(k_ready.index(st), ((t + j) // STAGES) & 1)
                mbarrier.wait(v_ready.index(pst), ((t + j - 1) // STAGES) & 1)
                _turn_wait(turn, n_turn + j, WG, PINGPONG)
                s_tok = _qk(q_smem, q2_smem, k1_smem.index(st), k2_smem.index(st), s_zero, qi, FP8)
                o_tok = warpgroup_mma(p_op, v_smem.index(pst), acc, is_async=True)
                _turn_pass(turn, WG, PINGPONG)
                s = warpgroup_mma_wait(1, deps=(s_tok,))  # the scores; the PV may still run
                mbarrier.arrive(k_empty.index(st), count=1)
                n0 = j * BLOCK_N
                if not SCALE_POS:
                    s = s * qk_scale
                if n0 + BLOCK_N > n_full:
                    s = _mask(s, n0, row0, len_k, delta, CAUSAL, S_LAYOUT, BLOCK_N)
                p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, SCALE_POS)
                acc, p_old = warpgroup_mma_wait(0, deps=(o_tok, p_op))
                mbarrier.arrive(v_empty.index(pst), count=1)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
                p_op = gl.convert_layout(p.to(gl.bfloat16), P_LAYOUT)

            mbarrier.arrive(q_empty.index(qi), count=1)  # last scores done: the buffer may take a later item's Q

            # ---- PV of the last tile
            lst = (t + n_tiles - 1) % STAGES
            mbarrier.wait(v_ready.index(lst), ((t + n_tiles - 1) // STAGES) & 1)
            n_last = (n_tiles - 1) * BLOCK_N
            if n_last + BLOCK_N > len_k:  # rows past the request (another request's, or stale data)
                _zero_v_tail(v_smem.index(lst), len_k - n_last, BLOCK_N)
            _turn_wait(turn, n_turn + n_tiles, WG, PINGPONG)
            o_tok = warpgroup_mma(p_op, v_smem.index(lst), acc, is_async=True)
            _turn_pass(turn, WG, PINGPONG)
            acc, _p_old = warpgroup_mma_wait(0, deps=(o_tok, p_op))
            mbarrier.arrive(v_empty.index(lst), count=1)
        else:
            mbarrier.arrive(q_empty.index(qi), count=1)

        return acc, m_i, l_i

    @gluon.jit
    def _store_rows(acc, m_i, l_i, o, lse, stride_ot, stride_oh, stride_lt, stride_lh, bos_q, len_q, start_m, i_h,
                    v_scale, WG: gl.constexpr, BLOCK_N: gl.constexpr, STORE_LSE: gl.constexpr,
                    FP8: gl.constexpr):  # fmt: skip
        """Epilogue of one warpgroup's 64 rows: normalise, store the rows inside the request (out 0 / lse -inf where
        l = 0); the bf16 rows through the 16-byte store layout (``row_store_layout``)."""
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 32 if FP8 else 16])  # fmt: skip
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 128, 16])  # fmt: skip
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
        row0 = start_m + WG * 64
        empty = l_i == 0.0
        inv = gl.where(empty, 0.0, v_scale / gl.where(empty, 1.0, l_i))
        b_o = gl.convert_layout((acc * gl.expand_dims(gl.convert_layout(inv, ROW_O), 1)).to(gl.bfloat16), _O_STORE)
        o_r = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, _O_STORE))
        rows = (bos_q + o_r).to(gl.int64)
        # int64 head offsets: `out` / `lse` may have any strides (a head-major out: i_h * stride_oh >= 2**31)
        p_o = o + gl.expand_dims(rows * stride_ot + i_h.to(gl.int64) * stride_oh, 1)
        p_o = p_o + gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, _O_STORE)), 0)
        gl.store(p_o, b_o, mask=gl.expand_dims(o_r < len_q, 1))
        if STORE_LSE:
            b_lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
            o_rs = row0 + gl.arange(0, 64, layout=ROW_S)
            p_l = lse + (bos_q + o_rs).to(gl.int64) * stride_lt + i_h.to(gl.int64) * stride_lh
            gl.store(p_l, b_lse, mask=o_rs < len_q)

    @gluon.jit
    def _next_item(id_smem, id_ready, id_empty, i, WARPS: gl.constexpr):
        """The successor of the ``i``-th item walked, from the producer's id ring (then handed back); WARPS: the
        partition's warps."""
        ONE: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        slot = i % 2
        mbarrier.wait(id_ready.index(slot), (i // 2) & 1)
        nxt = gl.max(id_smem.index(slot).load(ONE), axis=0)
        mbarrier.arrive(id_empty.index(slot), count=1)
        return nxt

    @gluon.jit
    def _consumer(q_smem, q2_smem, k1_smem, k2_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn,
                  id_smem, id_ready, id_empty, o, lse, stride_ot, stride_oh, stride_lt, stride_lh, cu_seqlens_q,
                  cu_seqlens_k, n_items, n_rb, H, qk_scale, v_scale, WG: gl.constexpr, HEAD_BLOCK: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, SCALE_POS: gl.constexpr,
                  PINGPONG: gl.constexpr, STORE_LSE: gl.constexpr, FP8: gl.constexpr,
                  Q_BUFS: gl.constexpr):  # fmt: skip
        """One consumer warpgroup, item after item (the producer publishes each item's successor). The successor is
        read and its lengths loaded before the epilogue, so that their latency hides behind the stores."""
        cur = gl.program_id(0)
        i_h, bos_q, len_q, start_m, _bk, len_k, n_tiles = _item(cur, cu_seqlens_q, cu_seqlens_k, n_rb, H, HEAD_BLOCK,
                                                                CAUSAL, BLOCK_N)  # fmt: skip
        t = 0
        n_q = 0
        n_turn = 0
        i = 0
        while cur < n_items:
            if start_m < len_q:
                acc, m_i, l_i = _consume_item(q_smem, q2_smem, k1_smem, k2_smem, v_smem, q_ready, q_empty, k_ready,
                                              k_empty, v_ready, v_empty, turn, bos_q, len_q, len_k, start_m,
                                              n_tiles, qk_scale, t, n_q, n_turn, WG, BLOCK_N, STAGES, CAUSAL,
                                              SCALE_POS, PINGPONG, FP8, Q_BUFS)  # fmt: skip
                t += n_tiles
                n_q += 1
                n_turn += gl.where(n_tiles > 0, n_tiles + 1, 0)
                nxt = _next_item(id_smem, id_ready, id_empty, i, 4)
                # past the last item: decode a valid one (the loop ends; its loads must stay in bounds)
                h2, bq2, lq2, sm2, _bk, lk2, nt2 = _item(gl.minimum(nxt, n_items - 1), cu_seqlens_q, cu_seqlens_k,
                                                         n_rb, H, HEAD_BLOCK, CAUSAL, BLOCK_N)  # fmt: skip
                _store_rows(acc, m_i, l_i, o, lse, stride_ot, stride_oh, stride_lt, stride_lh, bos_q, len_q, start_m,
                            i_h, v_scale, WG, BLOCK_N, STORE_LSE, FP8)  # fmt: skip
            else:
                nxt = _next_item(id_smem, id_ready, id_empty, i, 4)
                h2, bq2, lq2, sm2, _bk, lk2, nt2 = _item(gl.minimum(nxt, n_items - 1), cu_seqlens_q, cu_seqlens_k,
                                                         n_rb, H, HEAD_BLOCK, CAUSAL, BLOCK_N)  # fmt: skip
            cur = nxt
            i_h = h2
            bos_q = bq2
            len_q = lq2
            start_m = sm2
            len_k = lk2
            n_tiles = nt2
            i += 1

    @gluon.jit
    def _flash_attn_varlen_gluon_kernel(
        q_desc,  # q as [Tq, (H - 1) * stride_qh + 192] bf16, block [64, 64]
        k1_desc,  # k as [Tk, (H_KV - 1) * stride_kh + 192], block [BLOCK_N, 128] (columns 0:128 of a head)
        k2_desc,  # the same view, block [BLOCK_N, 64] (columns 128:192)
        v_desc,  # v as [Tk, (H_KV - 1) * stride_vh + 128], block [BLOCK_N, 128] (bf16, FP8 too)
        q2_desc,  # FP8: q's columns 128:192, block [64, 64] (q_desc's block then [64, 128]); else q_desc
        q_ds,  # [1] fp32 descales (FP8)
        k_ds,
        v_ds,
        o,  # [Tq, H, 128] bf16
        lse,  # [Tq, H] fp32 (STORE_LSE)
        cu_seqlens_q,  # [B + 1]
        cu_seqlens_k,  # [B + 1]
        counter,  # [1] int32, 0 at the launch: the work items handed out after each program's first
        n_items,  # B * n_rb * H
        n_rb,  # row blocks a request: cdiv(max_seqlen_q, 128)
        H,  # query heads
        qk_scale,  # sm_scale * log2(e)
        stride_qh,
        stride_kh,
        stride_vh,
        stride_ot,
        stride_oh,
        stride_lt,
        stride_lh,
        GROUP: gl.constexpr,  # H_Q // H_KV
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        CAUSAL: gl.constexpr,
        SCALE_POS: gl.constexpr,  # sm_scale > 0
        PINGPONG: gl.constexpr,
        HEAD_BLOCK: gl.constexpr,  # heads whose row blocks are interleaved in launch order (divides h_q)
        STORE_LSE: gl.constexpr,
        PRODUCER_REGS: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
        num_warps: gl.constexpr,
        FP8: gl.constexpr = False,  # e4m3 q / k with descales (the scores on fp8 tensor cores); V is bf16
        Q_BUFS: gl.constexpr = 1,  # Q buffers: 2 lets the next item's Q land during the current item
    ):
        gl.static_assert(num_warps == 4, "the default partition is consumer warpgroup 0")
        gl.static_assert(BLOCK_N == 64 or BLOCK_N == 128, "BLOCK_N is 64 or 128")
        # persistent: program p runs item p, then the items `counter` hands out in order (see _item)
        if FP8:
            q_smem = gl.allocate_shared_memory(gl.float8e4nv, [2 * Q_BUFS, 64, 128], q_desc.layout)
            q2_smem = gl.allocate_shared_memory(gl.float8e4nv, [2 * Q_BUFS, 64, 64], q2_desc.layout)
            k1_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, 128], k1_desc.layout)
            k2_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, 64], k2_desc.layout)
            qk_scale = qk_scale * gl.load(q_ds) * gl.load(k_ds)
            v_scale = gl.load(v_ds)
        else:
            Q_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
            q_smem = gl.allocate_shared_memory(gl.bfloat16, [6 * Q_BUFS, 64, 64], Q_SMEM)
            q2_smem = q_smem  # unused
            k1_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 128], k1_desc.layout)
            k2_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], k2_desc.layout)
            v_scale = 1.0
        v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 128], v_desc.layout)
        # one a warpgroup and Q buffer
        q_ready = gl.allocate_shared_memory(gl.int64, [2 * Q_BUFS, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2 * Q_BUFS, 1], mbarrier.MBarrierLayout())
        id_smem = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        id_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        id_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for w in gl.static_range(2 * Q_BUFS):
            mbarrier.init(q_ready.index(w), count=1)
            mbarrier.init(q_empty.index(w), count=1)
        for sl in gl.static_range(2):
            mbarrier.init(id_ready.index(sl), count=1)
            mbarrier.init(id_empty.index(sl), count=2)  # one arrival per consumer warpgroup
        for st in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(st), count=1)
            mbarrier.init(v_ready.index(st), count=1)
            mbarrier.init(k_empty.index(st), count=2)  # one arrival per consumer warpgroup
            mbarrier.init(v_empty.index(st), count=2)
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        fence_async_shared()  # barrier inits visible to the async proxy and the other partitions

        gl.warp_specialize([
            (_consumer, (q_smem, q2_smem, k1_smem, k2_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                         v_empty, turn, id_smem, id_ready, id_empty, o, lse, stride_ot, stride_oh, stride_lt,
                         stride_lh, cu_seqlens_q, cu_seqlens_k, n_items, n_rb, H, qk_scale, v_scale, 0,
                         HEAD_BLOCK, BLOCK_N, STAGES, CAUSAL, SCALE_POS, PINGPONG, STORE_LSE, FP8, Q_BUFS)),
            (_consumer, (q_smem, q2_smem, k1_smem, k2_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                         v_empty, turn, id_smem, id_ready, id_empty, o, lse, stride_ot, stride_oh, stride_lt,
                         stride_lh, cu_seqlens_q, cu_seqlens_k, n_items, n_rb, H, qk_scale, v_scale, 1,
                         HEAD_BLOCK, BLOCK_N, STAGES, CAUSAL, SCALE_POS, PINGPONG, STORE_LSE, FP8, Q_BUFS)),
            (_producer, (q_desc, q2_desc, k1_desc, k2_desc, v_desc, q_smem, q2_smem, k1_smem, k2_smem, v_smem,
                         q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, id_smem, id_ready, id_empty,
                         counter, n_items, n_rb, H, cu_seqlens_q, cu_seqlens_k, stride_qh, stride_kh, stride_vh,
                         GROUP, HEAD_BLOCK, CAUSAL, BLOCK_N, STAGES, FP8, Q_BUFS)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip

        for w in gl.static_range(2 * Q_BUFS):
            mbarrier.invalidate(q_ready.index(w))
            mbarrier.invalidate(q_empty.index(w))
        for sl in gl.static_range(2):
            mbarrier.invalidate(id_ready.index(sl))
            mbarrier.invalidate(id_empty.index(sl))
        for st in gl.static_range(STAGES):
            mbarrier.invalidate(k_ready.index(st))
            mbarrier.invalidate(v_ready.index(st))
            mbarrier.invalidate(k_empty.index(st))
            mbarrier.invalidate(v_empty.index(st))
        mbarrier.invalidate(turn.index(0))
        mbarrier.invalidate(turn.index(1))


@triton.jit
def _widen_e4m3_kernel(src, dst, n_rows, H, stride_t, stride_h, BLOCK_R: tl.constexpr, D: tl.constexpr):
    """Rows ``(t, h)`` of a strided e4m3 ``[T, H, D]`` tensor into a contiguous bf16 one (exact)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    keep = rows < n_rows
    src_off = (rows // H).to(tl.int64) * stride_t + (rows % H).to(tl.int64) * stride_h
    cols = tl.arange(0, D)
    x = tl.load(src + src_off[:, None] + cols[None, :], mask=keep[:, None])
    tl.store(dst + rows.to(tl.int64)[:, None] * D + cols[None, :], x.to(tl.bfloat16), mask=keep[:, None])


def _widen_e4m3(v: torch.Tensor) -> torch.Tensor:
    """``v.to(torch.bfloat16)`` for a ``[T, H, D]`` e4m3 tensor (last dim contiguous, D a power of two) at the
    copy's bandwidth: on the H200 torch's cast of a 16k x 128 x 128 tensor took 782 us (~1 TB/s)."""
    T, H, D = v.shape
    out = torch.empty(T, H, D, dtype=torch.bfloat16, device=v.device)
    if T * H:
        grid = (triton.cdiv(T * H, _WIDEN_ROWS),)
        _widen_e4m3_kernel[grid](v, out, T * H, H, v.stride(0), v.stride(1), BLOCK_R=_WIDEN_ROWS, D=D, num_warps=4)
    return out


@functools.cache
def _nvmma_layout(width: int, fp8: bool = False):
    """bf16 boxes: 128-byte swizzle; e4m3 boxes: the swizzle of their row width (128 or 64 bytes). Cached: building
    a layout object costs ~3 us of host time, four of them a call."""
    if fp8:
        return gl.NVMMASharedLayout(swizzle_byte_width=min(128, width), element_bitwidth=8, rank=2)
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


def _tma_ok(t: torch.Tensor, d: int) -> bool:
    """A ``[T, H, d]`` bf16 tensor readable as the 2-D TMA view ``[T, (H - 1) * stride_h + d]``."""
    T, H, _ = t.shape
    s0, s1, s2 = t.stride()
    es = t.element_size()
    if s2 != 1 or t.data_ptr() % 16 or (s0 * es) % 16:
        return False
    if H > 1 and (s1 < d or (s1 * es) % 16):  # heads overlap, or a head's first column is not 16-byte aligned
        return False
    width = (H - 1) * s1 + d
    return T < 2**31 and width < 2**31 and (T <= 1 or s0 >= width)


def gluon_prefill_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, fp8: bool = False,
                            **kwargs) -> bool:  # fmt: skip
    """Whether :func:`flash_attn_varlen_gluon` handles these inputs: Gluon available, an sm90 CUDA device,
    bf16 q/k/v (``fp8``: float8_e4m3fn q/k/v, with descales), ``d_qk = 192``, ``d_v = 128``, ``h_q`` a multiple of
    ``h_kv``, last dims contiguous and token strides / base pointers 16-byte aligned (the 2-D TMA views). Extra
    arguments (``cu_seqlens``, lengths, ``sm_scale``, ...) are accepted and ignored; descales need ``fp8``."""
    if not GLUON_AVAILABLE:
        return False
    if not fp8 and any(kwargs.get(n) is not None for n in ("q_descale", "k_descale", "v_descale")):
        return False
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return False
    if q.device.type != "cuda" or k.device != q.device or v.device != q.device:
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    if any(t.dtype != (torch.float8_e4m3fn if fp8 else torch.bfloat16) or t.dim() != 3 for t in (q, k, v)):
        return False
    if q.shape[2] != D_QK or k.shape[2] != D_QK or v.shape[2] != D_V:
        return False
    H, H_KV = q.shape[1], k.shape[1]
    if H_KV == 0 or H % H_KV or v.shape[:2] != k.shape[:2]:
        return False
    return _tma_ok(q, D_QK) and _tma_ok(k, D_QK) and _tma_ok(v, D_V)


def _desc(t: torch.Tensor, d: int, block: list[int]):
    T, H, _ = t.shape
    width = (H - 1) * t.stride(1) + d
    fp8 = t.dtype == torch.float8_e4m3fn
    return TensorDescriptor(t, [T, width], [t.stride(0), 1], block, _nvmma_layout(block[1], fp8))


def flash_attn_varlen_gluon(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    sm_scale: float,
    *,
    causal: bool = True,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    block_n: int | None = None,
    stages: int | None = None,
    pingpong: bool | None = None,
    head_block: int | None = None,
    descales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    programs: int | None = None,
    q_bufs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""bf16 varlen flash attention on sm90 (Gluon); the semantics of :func:`openmla.flash_attn_varlen`.

    Args:
        q: `[Tq, h_q, 192]` bf16. k: `[Tk, h_kv, 192]` bf16. v: `[Tk, h_kv, 128]` bf16 (see
            :func:`gluon_prefill_supported` for the layouts accepted). With ``descales``: float8_e4m3fn q / k / v;
            the scores run on the fp8 tensor cores, V is widened to bf16 first (exact) and P V runs in bf16, as
            in the portable kernel.
        descales: ``(q_descale, k_descale, v_descale)``, `[1]` fp32 each, positive (validated by the caller), for
            fp8 inputs: scores ``sm_scale * q_descale * k_descale * q . k``, output times ``v_descale``.
        cu_seqlens_q, cu_seqlens_k: `[B + 1]` int32 (or int64), starting at 0, non-decreasing.
        max_seqlen_q (int): an upper bound of the query lengths (sizes the grid).
        max_seqlen_k (int): unused (API parity).
        sm_scale (float): softmax scale.
        causal (bool): bottom-right aligned causal mask.
        out: optional `[Tq, h_q, 128]` bf16 buffer (any strides, last dim contiguous).
        lse: optional `[Tq, h_q]` fp32 buffer.
        block_n, stages, pingpong: tuning variants for tests (keys per tile 64 / 128, ring depth, warpgroup
            turns); None: the module constants.
        head_block: work order: the row blocks of this many heads (reduced to a divisor of h_q) are
            interleaved, heaviest first when causal; 1 = one head's row blocks after the other (the
            programs in flight share that head's K / V in L2), h_q = every head's heaviest block first.
        programs: persistent programs launched (for tests: few programs walk many items); None: one an SM.
        q_bufs: Q buffers (1 or 2, a variant for tests); None: ``Q_BUFS_MAX`` where the shared memory holds them.

    Returns:
        ``(out, lse)``: out `[Tq, h_q, 128]` bf16 (0 for rows that see no key), lse `[Tq, h_q]` fp32
        natural-log LSE of ``sm_scale * q . k`` (-inf for rows that see no key). Rows past
        ``cu_seqlens_q[-1]`` are not written.
    """
    fp8 = descales is not None
    if not gluon_prefill_supported(q, k, v, fp8=fp8):
        raise ValueError("flash_attn_varlen_gluon needs sm90, bf16 q/k/v (float8_e4m3fn with descales) with d_qk 192, "
                         "d_v 128, h_q % h_kv == 0 and TMA-compatible strides; got q "
                         f"{tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, v {tuple(v.shape)}")  # fmt: skip
    if not math.isfinite(float(sm_scale)):
        raise ValueError(f"sm_scale must be finite; got {sm_scale!r}")
    Tq, H, _ = q.shape
    Tk, H_KV, _ = k.shape
    B = cu_seqlens_q.shape[0] - 1
    if cu_seqlens_k.shape[0] != B + 1:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        # the kernel reads them as integers on q's device (a float / host tensor would be read as garbage)
        if cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64) or cu.device != q.device:
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor on {q.device}; got {cu.dtype} on {cu.device}")
    if out is None:
        out = torch.empty(Tq, H, D_V, dtype=torch.bfloat16, device=q.device)
    elif out.shape != (Tq, H, D_V) or out.dtype != torch.bfloat16 or out.stride(2) != 1:
        raise ValueError(f"out must be [Tq, H, 128] bf16 with a contiguous last dim; got {tuple(out.shape)} "
                         f"{out.dtype}")  # fmt: skip
    if lse is None:
        lse = torch.empty(Tq, H, dtype=torch.float32, device=q.device)
    elif lse.shape != (Tq, H) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be [Tq, H] fp32; got {tuple(lse.shape)} {lse.dtype}")
    if B <= 0 or Tq == 0 or max_seqlen_q == 0 or H == 0:
        return out, lse
    block_n = BLOCK_N_DEFAULT if block_n is None else block_n
    if stages is None:
        stages = STAGES_DEFAULT if block_n == BLOCK_N_DEFAULT else (3 if block_n == 64 else 2)
    if block_n not in (64, 128):
        raise ValueError(f"block_n must be 64 or 128; got {block_n}")
    if int(stages) != stages or stages < 1:  # stages 0: `j % STAGES` in the kernel
        raise ValueError(f"stages must be a positive int; got {stages!r}")
    stages = int(stages)
    if _smem_bytes(block_n, stages, fp8) > SMEM_LIMIT:
        raise ValueError(f"block_n={block_n} x stages={stages} needs {_smem_bytes(block_n, stages, fp8)} B of "
                         "shared memory")  # fmt: skip
    if q_bufs is None:
        q_bufs = Q_BUFS_MAX if _smem_bytes(block_n, stages, fp8, Q_BUFS_MAX) <= SMEM_LIMIT else 1
    elif q_bufs not in (1, 2) or _smem_bytes(block_n, stages, fp8, q_bufs) > SMEM_LIMIT:
        raise ValueError(f"q_bufs must be 1 or 2 and fit the shared memory with block_n={block_n}, stages={stages}; "
                         f"got {q_bufs!r}")  # fmt: skip
    pingpong = PINGPONG if pingpong is None else pingpong
    if Tk == 0:  # no key anywhere (every len_k is 0): a 1-row dummy keeps the descriptors valid, never read
        k = torch.zeros(1, H_KV, D_QK, dtype=k.dtype, device=k.device)
        v = torch.zeros(1, H_KV, D_V, dtype=v.dtype, device=v.device)
    if fp8:
        v = _widen_e4m3(v)  # e4m3 -> bf16 is exact; P V runs in bf16 (V is 40% of the FLOPs)
        q_desc, q2_desc = _desc(q, D_QK, [64, 128]), _desc(q, D_QK, [64, 64])
        q_ds, k_ds, v_ds = descales
    else:
        q_desc = q2_desc = _desc(q, D_QK, [64, 64])
        q_ds = k_ds = v_ds = lse  # unused
    k1_desc = _desc(k, D_QK, [block_n, 128])
    k2_desc = _desc(k, D_QK, [block_n, 64])
    v_desc = _desc(v, D_V, [block_n, D_V])
    head_block = HEAD_BLOCK if head_block is None else head_block
    if not isinstance(head_block, int) or head_block < 1:
        raise ValueError(f"head_block must be a positive int; got {head_block!r}")
    head_block = math.gcd(head_block, H)  # a divisor of h_q: every item has a head
    n_rb = triton.cdiv(max_seqlen_q, BLOCK_M)
    n_items = B * n_rb * H
    if n_items >= 2**31:
        raise ValueError(f"{B} requests x {n_rb} row blocks x {H} heads exceed 2**31 work items")
    if programs is None:
        from openmla.ops.sparse import _num_sms  # the cached SM count (imported here: openmla.ops imports this module)

        programs = _num_sms(q.device)
    elif not isinstance(programs, int) or programs < 1:
        raise ValueError(f"programs must be a positive int; got {programs!r}")
    counter = torch.zeros(1, dtype=torch.int32, device=q.device)  # a fresh 0 each call (graph-capturable)
    _flash_attn_varlen_gluon_kernel[(min(programs, n_items),)](
        q_desc, k1_desc, k2_desc, v_desc, q2_desc, q_ds, k_ds, v_ds, out, lse, cu_seqlens_q, cu_seqlens_k, counter,
        n_items, n_rb, H, float(sm_scale) * 1.4426950408889634,
        q.stride(1), k.stride(1), v.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        GROUP=H // H_KV, BLOCK_N=block_n, STAGES=stages, CAUSAL=bool(causal), SCALE_POS=float(sm_scale) > 0,
        PINGPONG=bool(pingpong), HEAD_BLOCK=head_block, STORE_LSE=True, PRODUCER_REGS=PRODUCER_REGS,
        CONSUMER_REGS=CONSUMER_REGS, num_warps=4, Q_BUFS=q_bufs, **({"FP8": True} if fp8 else {}),
    )  # fmt: skip
    return out, lse
