"""Seesaw Gluon decode kernel: GPU experiments for its H200 failure (standalone; not part of openmla).

The "seesaw" variant of the Hopper decode kernel (commit 9469e91, ``_mla_decode_gluon_seesaw_kernel``) gave
NaN / wrong output on an H200 and was deleted from the package. ``docs/gluon_decode_plan.md`` ("The seesaw
variant: H200 failure and diagnosis (offline)") ranks the hypotheses and lists experiments (i)-(iv). This
script holds a copy of that kernel with constexpr knobs for them and runs every experiment in one command:

    PYTHONPATH=$PWD python3 benchmarks/experiments/seesaw_debug.py             # correctness matrix (< 5 min)
    PYTHONPATH=$PWD python3 benchmarks/experiments/seesaw_debug.py --bench     # time the passing combos vs ws
    python benchmarks/experiments/seesaw_debug.py --compile-only               # offline sm90 compile (CPU ok)
    ... --knobs sep,arrive,fence,regs=240,maxnreg=240                          # add a custom combination
    ... --only original,all                                                    # a subset (names or indices)

Knobs (defaults = the 9469e91 kernel, so the "original" row reproduces the failure):

* ``SEPARATE_P`` (iii): P_j goes to its own [64, 64] bf16 buffer instead of over stage j's rope columns.
  Only ONE buffer fits: original 223,812 B + 8,192 B + 16 B (pfree barriers) = 232,020 B <= 232,448 B (the
  compiled total), while one per stage would need 240,212 B. With one buffer the owner of tile j waits,
  before writing P_j, on a new "pfree" mbarrier that the owner of tile j-1 arrives on after its own
  P_{j-1} V_{j-1} (the other reader of P_{j-1}, the writer itself, is ordered by program order).
* ``ARRIVE_ALL`` (ii, writer side): the cross-warpgroup mbarriers (pready, empty, pfree; Q-ready and
  row-sum exchange: count 2 -> 256) are initialised with count 128 per warpgroup and EVERY thread of the
  arriving warpgroup runs ``fence_async_shared()`` and then its own ``mbarrier.arrive`` (inline PTX:
  Gluon's ``mbarrier.arrive`` is always one elected thread after a partition ``bar.sync``). The inline PTX
  needs each barrier's byte offset in shared memory: it is read from the allocation pass (Triton's own
  ``allocate_shared_memory_nv`` run on the kernel's TTGIR) in a first compile, passed as constexprs to a
  second compile, and checked to be unchanged there.
* ``READER_FENCE`` (ii, reader side): the reading warpgroup runs ``fence_async_shared()`` after its mbarrier
  waits (Q-ready, pready + ready) and before the wgmma that reads the other warpgroup's data.
* ``WG_REGS`` (iv): registers of the worker partition (warpgroup 1) passed to ``gl.warp_specialize``
  (256 as in 9469e91, where ptxas warned "Too many maxnreg" and used 255; or 240 / 232). Triton still emits
  ``.maxnreg 256`` (ignored by ptxas, the warning stays) unless the launch option ``maxnreg`` (knob
  ``maxnreg``, e.g. 240: no warning, a few bytes of spill) is given.

Combinations (COMBOS): ws (the package's kernel: a control row that validates the harness), original, each
knob alone (sep_p, arrive_all, reader_fence, regs240, regs232, maxnreg240), all (sep_p + arrive_all +
reader_fence + regs 232) and all_256 (the same with 256 registers). Problems: (a) one request of 64 / 33
keys, h16, qlen 1, one split; (b) the failing test's batch, h128, qlen 1, NaN in unused cache rows; (c) the
same with zeros there (experiment i). ``out``, ``lse`` and the split partials are NaN-filled before each run.

Experiment (i) is a problem, not a knob: the failing batch with zeros instead of NaN in unused cache rows.
Every knob combination runs in its own subprocess (an illegal memory access poisons the CUDA context), each
problem under a 30 s hang guard; a child that dies is restarted at the next problem.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _REPO not in sys.path:  # import openmla from this checkout without PYTHONPATH too
    sys.path.insert(0, _REPO)
os.environ.setdefault("TRITON_INTERPRET", "0")
if os.environ["TRITON_INTERPRET"] not in ("", "0"):  # Gluon kernels cannot be compiled under the interpreter
    os.environ["TRITON_INTERPRET"] = "0"

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
    warpgroup_mma,
    warpgroup_mma_wait,
)
from openmla.utils.sm90_report import alloc_offsets

SEESAW_WG_REGS = 256  # 9469e91: registers of the worker partition (warpgroup 1)
SCALE = 576**-0.5
LOG2E = 1.4426950408889634
HANG_S = 5 if os.environ.get("SEESAW_DEBUG_SELFTEST") == "1" else 30  # hang guard per launch + synchronize
COMPILE_S = 180  # guard of a problem's set-up and compiles (before its launch)


# --------------------------------------------------------------------------------------------------
# knob combinations


@dataclasses.dataclass(frozen=True)
class Knobs:
    name: str
    separate_p: bool = False
    arrive_all: bool = False
    reader_fence: bool = False
    regs: int = SEESAW_WG_REGS
    maxnreg: int | None = None  # Triton's ``maxnreg`` option (PTX ``.maxnreg``); None: Triton's 256, ignored by ptxas
    ws: bool = False  # the package's ws kernel (control row: validates the harness)
    owner_shift: int = 0  # probe: tile j belongs to warpgroup (j + owner_shift) % 2 (1 swaps the roles)
    lse_wg: int = -1  # probe: only this warpgroup writes the LSE (-1: both, as in 9469e91)
    const_stage: bool = False  # run 22: each branch indexes its stage with a constexpr (owner WG, reader 1 - WG)

    def label(self) -> str:
        if self.ws:
            return "ws kernel (control)"
        on = [n for n, v in (("sep_p", self.separate_p), ("arrive_all", self.arrive_all),
                             ("reader_fence", self.reader_fence)) if v]  # fmt: skip
        mx = f" maxnreg={self.maxnreg}" if self.maxnreg else ""
        mx += " swap" if self.owner_shift else ""
        mx += " const_stage" if self.const_stage else ""
        mx += f" lse_wg={self.lse_wg}" if self.lse_wg >= 0 else ""
        return f"{self.name}: {'+'.join(on) or 'none'} regs={self.regs}{mx}"


COMBOS = [
    Knobs("ws", ws=True),
    Knobs("original"),  # 9469e91 as it was: must reproduce the failure
    Knobs("sep_p", separate_p=True),  # (iii)
    Knobs("arrive_all", arrive_all=True),  # (ii) writer side
    Knobs("reader_fence", reader_fence=True),  # (ii) reader side
    Knobs("regs240", regs=240),  # (iv)
    Knobs("regs232", regs=232),  # (iv) the ws consumers' count
    Knobs("maxnreg240", regs=240, maxnreg=240),  # (iv) with .maxnreg <= 255: no ptxas warning (16 B spill)
    Knobs("all", separate_p=True, arrive_all=True, reader_fence=True, regs=232),
    Knobs("all_256", separate_p=True, arrive_all=True, reader_fence=True),  # all but (iv)
]


def parse_knobs(spec: str) -> Knobs:
    """``--knobs sep,arrive,fence,regs=240`` -> a custom combination."""
    kw = {}
    for tok in filter(None, (t.strip() for t in spec.split(","))):
        if tok in ("sep", "sep_p", "separate_p"):
            kw["separate_p"] = True
        elif tok in ("arrive", "arrive_all"):
            kw["arrive_all"] = True
        elif tok in ("fence", "reader_fence"):
            kw["reader_fence"] = True
        elif tok.startswith("regs="):
            kw["regs"] = int(tok[5:])
        elif tok in ("const", "const_stage"):
            kw["const_stage"] = True
        elif tok == "swap":
            kw["owner_shift"] = 1
        elif tok.startswith("lse_wg="):
            kw["lse_wg"] = int(tok[7:])
        elif tok.startswith("maxnreg="):
            kw["maxnreg"] = int(tok[8:])
        else:
            raise SystemExit(f"--knobs: unknown token {tok!r} (sep, arrive, fence, regs=N, maxnreg=N)")
    return Knobs("custom", **kw)


# --------------------------------------------------------------------------------------------------
# the kernel (9469e91's _seesaw_consumer / _mla_decode_gluon_seesaw_kernel + knobs). Shared helpers come
# from the package, where they are unchanged since 9469e91.

if GLUON_AVAILABLE:
    from openmla.ops.decode_gluon import _box_ok, _issue_kv, _kv_rows, _qk, _zero_tail

    @gluon.jit
    def _arrive_each(off):
        """Every thread of the calling 4-warp partition arrives once (count 1, release.cta) on the mbarrier at
        byte ``off`` of the kernel's shared memory (``global_smem``), after its own prior writes."""
        ONE: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])  # one element per thread of 128
        a = gl.full([128], 0, gl.int32, ONE) + off
        gl.inline_asm_elementwise(
            "{ .reg .b32 mbaddr; mov.b32 mbaddr, global_smem; add.s32 mbaddr, mbaddr, $1; "
            "mbarrier.arrive.shared::cta.b64 _, [mbaddr]; mov.b32 $0, 0; }",
            "=r,r", [a], dtype=gl.int32, is_pure=False, pack=1,
        )  # fmt: skip

    @gluon.jit
    def _arrive_all(off):
        """``ARRIVE_ALL``'s hand-off arrive: every thread fences its own generic-proxy shared writes against the
        async proxy, then arrives itself (the barrier has count 128 per arriving warpgroup)."""
        fence_async_shared()
        _arrive_each(off)

    # 9469e91's comment: the two warpgroups are separate 4-warp partitions (warpgroup 0 the default one,
    # warpgroup 1 a worker), 256 registers each: there is no producer partition. 64-key tiles, 2 stages;
    # tile j lives in stage j % 2 and belongs to warpgroup j % 2, which
    # * issues its TMA loads (tiles 0/1 at the start, tile j + 2 once the other warpgroup released stage j),
    # * computes its scores alone (the full 64 keys: m64n64 wgmmas) and its online softmax, with the row max
    #   M_{j-1} it already holds,
    # * writes P_j over the rope columns of the stage (SEPARATE_P: into p_smem) and M_j, arrives on "pready".
    # Both warpgroups then rescale their half of the output (columns 256 * wg ...) by exp2(M_{j-1} - M_j) and
    # add P_j V_j; the other warpgroup waits on "pready" for P_j / M_j and releases the stage ("empty") after
    # its P V. Row sums are per warpgroup (its own tiles) and added at the end.

    @gluon.jit
    def _seesaw_consumer(q, lat_desc, rope_desc, q_smem, lat_smem, rope_smem, p_smem, m_smem, l_smem, ready, empty,
                         pready, pfree, qbar, lbar, block_table, seq_lens, query_start_loc, work_req, work_split,
                         num_splits, split_len, out, lse, o_part, lse_part, scale_log2, v_scale, stride_q_t,
                         stride_q_h, stride_bt_b, stride_o_t, stride_o_h, H, num_blocks, max_blocks,
                         PAGE: gl.constexpr, MAX_QLEN: gl.constexpr, BLOCK_H: gl.constexpr, Q_PER: gl.constexpr,
                         STAGES: gl.constexpr, CAUSAL: gl.constexpr, WG: gl.constexpr, SEPARATE_P: gl.constexpr,
                         ARRIVE_ALL: gl.constexpr, READER_FENCE: gl.constexpr, EMPTY_OFF: gl.constexpr,
                         PREADY_OFF: gl.constexpr, PFREE_OFF: gl.constexpr, SYNC_OFF: gl.constexpr,
                         OWNER_SHIFT: gl.constexpr, LSE_WG: gl.constexpr, CONST_STAGE: gl.constexpr):  # fmt: skip
        BLOCK_M: gl.constexpr = BLOCK_H * Q_PER
        BLOCK_N: gl.constexpr = 64
        HALF: gl.constexpr = 256  # output columns of this warpgroup
        NW: gl.constexpr = 4
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

        # the work item's scalars are read here (not passed in registers from the parent, which made the
        # default partition spill) and again in the epilogue rather than kept across the loop
        i_h = gl.program_id(1)
        i_q = gl.program_id(2)
        i_b = gl.load(work_req + gl.program_id(0)).to(gl.int64)
        q_start = gl.load(query_start_loc + i_b)
        qlen = gl.load(query_start_loc + i_b + 1) - q_start
        L = gl.load(seq_lens + i_b)
        chunk = gl.load(split_len + i_b)
        kv_lo = gl.load(work_split + gl.program_id(0)) * chunk
        kv_hi = gl.minimum(L, kv_lo + chunk)
        if CAUSAL:
            kv_hi = gl.minimum(kv_hi, L - qlen + gl.minimum(i_q * Q_PER + Q_PER, qlen))
        n_tiles = gl.cdiv(gl.maximum(kv_hi - kv_lo, 0), BLOCK_N)
        p_bt = block_table + i_b * stride_bt_b
        gl.static_assert(STAGES == 2, "tile j lives in stage j % 2 and belongs to warpgroup j % 2")

        # ---- this warpgroup's first tile (tile WG, stage WG) in flight while Q loads
        T0: gl.constexpr = (WG + OWNER_SHIFT) % 2  # this warpgroup's first tile (and its stage)
        OWN_STAGE: gl.constexpr = T0  # the stage of every tile this warpgroup owns
        if T0 < n_tiles:
            n0 = kv_lo + T0 * BLOCK_N
            r0 = _kv_rows(p_bt, n0, kv_hi, max_blocks, num_blocks, PAGE, 0)
            r1 = _kv_rows(p_bt, n0, kv_hi, max_blocks, num_blocks, PAGE, 1)
            _issue_kv(lat_desc, rope_desc, lat_smem, rope_smem, ready, T0, r0, r1, 2, 2)

        # ---- Q rows -> shared memory: each warpgroup stores every other 64-column chunk, then both wait
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
        if ARRIVE_ALL:
            _arrive_all(SYNC_OFF)
        else:
            mbarrier.arrive(qbar, count=1)
        mbarrier.wait(qbar, 0)
        if READER_FENCE:  # the other warpgroup's Q chunks are read by this warpgroup's wgmmas
            fence_async_shared()

        o_ms = gl.arange(0, BLOCK_M, layout=ROW_S)
        o_ts = i_q * Q_PER + o_ms // BLOCK_H
        if CAUSAL:
            limit = L - qlen + o_ts + 1
        else:
            limit = gl.full([BLOCK_M], 0, gl.int32, ROW_S) + L
        limit = gl.expand_dims(gl.minimum(limit, kv_hi), 1)
        m_prev = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW_S)  # M_{j-1}, the same in both warpgroups
        b_l = gl.zeros([BLOCK_M], gl.float32, ROW_S)  # row sum of this warpgroup's tiles
        acc = gl.zeros([BLOCK_M, HALF], gl.float32, O_LAYOUT)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT)

        for j in range(n_tiles):
            stage = j % STAGES
            ph = (j // STAGES) & 1
            lat = lat_smem.index(stage)
            rope = rope_smem.index(stage)
            if SEPARATE_P:
                pv = p_smem  # one [64, 64] buffer for every tile (two do not fit)
            else:
                pv = rope  # the tile's rope columns, then its P (same [64, 64] 128B-swizzled shape)
            if (j + OWNER_SHIFT) % 2 == WG:  # this warpgroup's tile: scores, softmax, P
                if CONST_STAGE:  # the stage as a compile-time constant (tile j of this branch is always in it)
                    st = OWN_STAGE
                else:
                    st = stage
                lat = lat_smem.index(st)
                rope = rope_smem.index(st)
                if SEPARATE_P:
                    pv = p_smem
                else:
                    pv = rope
                n0 = kv_lo + j * BLOCK_N
                ok0 = _box_ok(p_bt, n0, kv_hi, max_blocks, num_blocks, PAGE)
                ok1 = _box_ok(p_bt, n0 + 32, kv_hi, max_blocks, num_blocks, PAGE)
                mbarrier.wait(ready.index(st), ph)
                if n0 + BLOCK_N > L:
                    _zero_tail(lat, n0, L, BLOCK_N, NW)
                b_s = _qk(q_smem, lat, rope, s_zero)
                b_s = warpgroup_mma_wait(0, deps=(b_s,))
                # the key mask after the MMAs, as a key range [lo, hi) per row (a box with an invalid block id
                # can only be the first or the second half)
                lo = gl.where(ok0, n0, n0 + 32)
                hi = gl.minimum(limit, gl.where(ok1, n0 + BLOCK_N, n0 + 32))
                key = gl.expand_dims(gl.arange(0, BLOCK_N, layout=COL_S) + n0, 0)
                b_s = gl.where((key >= lo) & (key < hi), b_s * scale_log2, float("-inf"))
                m_new = gl.maximum(m_prev, gl.max(b_s, axis=1))
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
                b_alpha = gl.exp2(m_prev - m_use)
                b_p = gl.exp2(b_s - gl.expand_dims(m_use, 1))
                b_l = b_l * b_alpha + gl.sum(b_p, axis=1)
                if SEPARATE_P:  # noqa: SIM102 - a compile-time branch around a runtime one
                    if j >= 1:  # the owner of tile j-1 (the other warpgroup) is done reading P_{j-1}
                        mbarrier.wait(pfree.index(1 - st), ((j - 1) // STAGES) & 1)
                pv.store(b_p.to(gl.bfloat16))  # (not SEPARATE_P: the scores MMAs are done with the rope columns)
                m_smem.index(st).store(m_new)
                fence_async_shared()
                if ARRIVE_ALL:
                    _arrive_all(PREADY_OFF + st * 8)
                    gl.thread_barrier()  # this warpgroup's own P V reads all of P
                else:
                    gl.thread_barrier()
                    mbarrier.arrive(pready.index(st), count=1)
                m_prev = m_new
                # page rows of tile j + 2 (this warpgroup's next tile, same st): loads in flight during P V
                r0 = _kv_rows(p_bt, n0 + 2 * BLOCK_N, kv_hi, max_blocks, num_blocks, PAGE, 0)
                r1 = _kv_rows(p_bt, n0 + 2 * BLOCK_N, kv_hi, max_blocks, num_blocks, PAGE, 1)
                acc = acc * gl.expand_dims(gl.convert_layout(b_alpha, ROW_O), 1)
                acc = warpgroup_mma(pv, lat.slice(WG * HALF, HALF, dim=1), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc,))
                gl.thread_barrier()  # this warpgroup is done with the st
                if SEPARATE_P:  # ... and with P_j: the other warpgroup may write P_{j+1}
                    if ARRIVE_ALL:
                        _arrive_all(PFREE_OFF + st * 8)
                    else:
                        mbarrier.arrive(pfree.index(st), count=1)
                if j + 2 < n_tiles:  # refill the st once the other warpgroup's P V is done too
                    mbarrier.wait(empty.index(st), ph)
                    _issue_kv(lat_desc, rope_desc, lat_smem, rope_smem, ready, st, r0, r1, 2, 2)
            else:  # the other warpgroup's tile: its P and row max
                if CONST_STAGE:  # the stage as a compile-time constant (tile j of this branch is always in it)
                    st = 1 - OWN_STAGE
                else:
                    st = stage
                lat = lat_smem.index(st)
                rope = rope_smem.index(st)
                if SEPARATE_P:
                    pv = p_smem
                else:
                    pv = rope
                mbarrier.wait(pready.index(st), ph)
                # the st's TMA data is read here too: wait on its own barrier (already complete) rather
                # than rely on visibility carried through the owner's wait and arrive
                mbarrier.wait(ready.index(st), ph)
                if READER_FENCE:  # P_j (and zeroed tail rows of V_j) were written by the other warpgroup
                    fence_async_shared()
                m_new = m_smem.index(st).load(ROW_S)
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
                b_alpha = gl.exp2(m_prev - m_use)
                b_l = b_l * b_alpha
                m_prev = m_new
                acc = acc * gl.expand_dims(gl.convert_layout(b_alpha, ROW_O), 1)
                acc = warpgroup_mma(pv, lat.slice(WG * HALF, HALF, dim=1), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc,))
                gl.thread_barrier()  # this warpgroup is done with the st
                if ARRIVE_ALL:
                    _arrive_all(EMPTY_OFF + st * 8)
                else:
                    mbarrier.arrive(empty.index(st), count=1)  # the owner may refill it

        # ---- row sums of both warpgroups (exchanged in a plain 1-D layout: its addresses are not those of
        # the loop's row-max exchange, which the register allocator otherwise keeps alive across the loop)
        VEC: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        l_smem.index(WG).store(gl.convert_layout(b_l, VEC))
        if ARRIVE_ALL:
            _arrive_all(SYNC_OFF + 8)
        else:
            gl.thread_barrier()
            mbarrier.arrive(lbar, count=1)
        mbarrier.wait(lbar, 0)
        b_l = b_l + gl.convert_layout(l_smem.index(1 - WG).load(VEC), ROW_S)

        # volatile: re-read rather than merged with the loads before the loop (kept live, they spill)
        i_w = gl.program_id(0)
        i_h = gl.program_id(1)
        i_q = gl.program_id(2)
        i_b = gl.load(work_req + i_w, volatile=True).to(gl.int64)
        q_start = gl.load(query_start_loc + i_b, volatile=True)
        qlen = gl.load(query_start_loc + i_b + 1, volatile=True) - q_start
        o_ms = gl.arange(0, BLOCK_M, layout=ROW_S)
        o_ts = i_q * Q_PER + o_ms // BLOCK_H
        n_split = gl.load(num_splits + i_b, volatile=True)
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
        m_s = (o_ts < qlen) & (o_hs < H)  # both warpgroups write the (same) LSE
        if LSE_WG >= 0:  # probe: only warpgroup LSE_WG writes it
            m_s = m_s & (WG == LSE_WG)
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
    def _seesaw_kernel(
        q, lat_desc, rope_desc, block_table, seq_lens, query_start_loc, work_req, work_split, num_splits,
        split_len, out, lse, o_part, lse_part, scale_log2, v_scale, stride_q_t, stride_q_h, stride_bt_b,
        stride_o_t, stride_o_h, H, num_blocks, max_blocks,
        PAGE: gl.constexpr, MAX_QLEN: gl.constexpr, BLOCK_H: gl.constexpr, Q_PER: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, WG_REGS: gl.constexpr,
        SEPARATE_P: gl.constexpr, ARRIVE_ALL: gl.constexpr, READER_FENCE: gl.constexpr,
        EMPTY_OFF: gl.constexpr, PREADY_OFF: gl.constexpr, PFREE_OFF: gl.constexpr, SYNC_OFF: gl.constexpr,
        OWNER_SHIFT: gl.constexpr, LSE_WG: gl.constexpr, CONST_STAGE: gl.constexpr,
        num_warps: gl.constexpr,
    ):  # fmt: skip
        """9469e91's ``_mla_decode_gluon_seesaw_kernel`` (same arguments and results as the ws kernel) plus the
        experiment knobs. ``*_OFF``: byte offsets of the empty / pready / pfree / (qbar, lbar) mbarriers in
        shared memory, used only by ``ARRIVE_ALL`` (see ``barrier_offsets``)."""
        BLOCK_M: gl.constexpr = BLOCK_H * Q_PER
        gl.static_assert(BLOCK_M == 64, "64 rows per program (one wgmma M per warpgroup)")
        gl.static_assert(num_warps == 4, "warpgroup 0 is the default partition")
        gl.static_assert(BLOCK_N == 64, "64-key tiles (P is a [64, 64] tile)")
        Q_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        VEC_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        # cross-warpgroup barriers: one arrive (one elected thread), or 128 (every thread of one warpgroup)
        HAND: gl.constexpr = 128 if ARRIVE_ALL else 1

        i_w = gl.program_id(0)
        i_q = gl.program_id(2)
        i_b = gl.load(work_req + i_w)
        if i_b < 0:
            return
        i_b = i_b.to(gl.int64)
        q_start = gl.load(query_start_loc + i_b)
        qlen = gl.load(query_start_loc + i_b + 1) - q_start
        if i_q * Q_PER >= qlen:
            return

        q_smem = gl.allocate_shared_memory(gl.bfloat16, [9, BLOCK_M, 64], Q_SMEM)
        lat_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 512], lat_desc.layout)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], rope_desc.layout)
        m_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], VEC_SMEM)
        l_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], VEC_SMEM)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        pready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        sync = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        if SEPARATE_P:
            # one P buffer: 223,812 + 8,192 (+16 B pfree) = 232,020 B <= 232,448; two would be 240,212 B
            p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_N], rope_desc.layout)
            pfree = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        else:
            p_smem = rope_smem.index(0)  # unused
            pfree = empty  # unused
        for st in gl.static_range(STAGES):
            mbarrier.init(ready.index(st), count=1)
            mbarrier.init(empty.index(st), count=HAND)  # the warpgroup that does not own the stage's tiles
            mbarrier.init(pready.index(st), count=HAND)  # the owner: P_j and M_j stored
            if SEPARATE_P:
                mbarrier.init(pfree.index(st), count=HAND)  # the owner of tile j: done reading P_j
        mbarrier.init(sync.index(0), count=2 * HAND)  # Q stored (both halves)
        mbarrier.init(sync.index(1), count=2 * HAND)  # row sums stored
        fence_async_shared()

        gl.warp_specialize([
            (_seesaw_consumer, (q, lat_desc, rope_desc, q_smem, lat_smem, rope_smem, p_smem, m_smem, l_smem, ready,
                                empty, pready, pfree, sync.index(0), sync.index(1), block_table, seq_lens,
                                query_start_loc, work_req, work_split, num_splits, split_len, out, lse, o_part,
                                lse_part, scale_log2, v_scale, stride_q_t, stride_q_h, stride_bt_b, stride_o_t,
                                stride_o_h, H, num_blocks, max_blocks, PAGE, MAX_QLEN, BLOCK_H, Q_PER, STAGES,
                                CAUSAL, 0, SEPARATE_P, ARRIVE_ALL, READER_FENCE, EMPTY_OFF, PREADY_OFF, PFREE_OFF,
                                SYNC_OFF, OWNER_SHIFT, LSE_WG, CONST_STAGE)),
            (_seesaw_consumer, (q, lat_desc, rope_desc, q_smem, lat_smem, rope_smem, p_smem, m_smem, l_smem, ready,
                                empty, pready, pfree, sync.index(0), sync.index(1), block_table, seq_lens,
                                query_start_loc, work_req, work_split, num_splits, split_len, out, lse, o_part,
                                lse_part, scale_log2, v_scale, stride_q_t, stride_q_h, stride_bt_b, stride_o_t,
                                stride_o_h, H, num_blocks, max_blocks, PAGE, MAX_QLEN, BLOCK_H, Q_PER, STAGES,
                                CAUSAL, 1, SEPARATE_P, ARRIVE_ALL, READER_FENCE, EMPTY_OFF, PREADY_OFF, PFREE_OFF,
                                SYNC_OFF, OWNER_SHIFT, LSE_WG, CONST_STAGE)),
        ], [4], [WG_REGS])  # fmt: skip

        for st in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(st))
            mbarrier.invalidate(empty.index(st))
            mbarrier.invalidate(pready.index(st))
            if SEPARATE_P:
                mbarrier.invalidate(pfree.index(st))
        mbarrier.invalidate(sync.index(0))
        mbarrier.invalidate(sync.index(1))


# --------------------------------------------------------------------------------------------------
# shared-memory offsets of the barriers (for ARRIVE_ALL's inline PTX)

_BAR_NAMES = {"empty": "EMPTY_OFF", "pready": "PREADY_OFF", "pfree": "PFREE_OFF", "sync": "SYNC_OFF"}




def barrier_offsets(ttgir: str) -> dict[str, int]:
    """The ``*_OFF`` constexprs of ``_seesaw_kernel`` read from a compile of it (PFREE_OFF 0 without SEPARATE_P)."""
    found = alloc_offsets(ttgir)
    offs = {}
    for name, key in _BAR_NAMES.items():
        hits = [v for k, v in found.items() if re.fullmatch(rf"{name}(_\d+)?", k)]
        if len(hits) > 1:
            raise RuntimeError(f"several allocations named {name}: {found}")
        if not hits and name != "pfree":
            raise RuntimeError(f"barrier allocation {name!r} not found: {found}")
        offs[key] = hits[0] if hits else 0
    return offs


def _constexprs(k: Knobs, block_h: int, q_per: int, causal: bool, max_qlen: int, page: int, offs=None) -> dict:
    cons = {
        "PAGE": page, "MAX_QLEN": max_qlen, "BLOCK_H": block_h, "Q_PER": q_per, "BLOCK_N": 64, "STAGES": 2,
        "CAUSAL": causal, "WG_REGS": k.regs, "SEPARATE_P": k.separate_p, "ARRIVE_ALL": k.arrive_all,
        "READER_FENCE": k.reader_fence, "OWNER_SHIFT": k.owner_shift, "LSE_WG": k.lse_wg, "CONST_STAGE": k.const_stage, "EMPTY_OFF": 0, "PREADY_OFF": 0, "PFREE_OFF": 0, "SYNC_OFF": 0, "num_warps": 4,
    }  # fmt: skip
    cons.update(offs or {})
    return cons


def check_arrive_all_ptx(ptx: str, offs: dict) -> tuple[int, int]:
    """``ARRIVE_ALL`` cross-check in the PTX: every barrier initialised with count 128/256 sits at one of the
    offsets handed to the per-thread arrives, and those arrives exist. Returns (arrive sites, such inits)."""
    sites = len(re.findall(r"mbarrier\.arrive\.shared::cta\.b64 _, \[mbaddr\]", ptx))
    want = {o + 8 * i for key, o in offs.items() if o for i in (0, 1)}
    inits = re.findall(r"mbarrier\.init\.shared::cta\.b64 \[(%r\d+)\], (128|256);", ptx)
    for reg, _ in inits:
        m = re.search(rf"add\.s32\s+{re.escape(reg)}, %r\d+, (\d+);", ptx)
        if not m or int(m.group(1)) not in want:
            raise RuntimeError(
                f"ARRIVE_ALL: a count-128/256 barrier at {m.group(1) if m else '?'} is not in {sorted(want)}"
            )
    if not sites or not inits:
        raise RuntimeError(f"ARRIVE_ALL: {sites} per-thread arrive sites, {len(inits)} count-128/256 inits")
    return sites, len(inits)


def ptxas_info(ptx: str) -> dict:
    """Run Triton's ptxas -v on the PTX (sm_90a): registers, spill bytes, warnings (e.g. "Too many maxnreg")."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True, check=False)  # fmt: skip
    log = r.stdout + r.stderr
    info = {"warnings": [w.split(":", 1)[1].split(" for entry")[0].strip() for w in log.splitlines()
                         if w.startswith("ptxas warning")]}  # fmt: skip
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    info["spill"] = (int(m.group(1)), int(m.group(2))) if m else None
    m = re.search(r"Used (\d+) registers", log)
    info["regs"] = int(m.group(1)) if m else None
    return info


# --------------------------------------------------------------------------------------------------
# launcher (the old mla_decode_split_gluon(..., variant="seesaw") path)

_OFFS_CACHE: dict = {}


def seesaw_split(q, kv_cache, block_table, seq_lens, query_start_loc, plan, out, lse, scale_log2, v_scale, causal,
                 k: Knobs, warm_only: bool = False) -> None:  # fmt: skip
    """Launch the seesaw split kernel with knobs ``k`` (bf16 cache, 64-key tiles, 2 stages); the caller runs the
    reduce. With ``ARRIVE_ALL`` the kernel is compiled twice (barrier offsets, then the real kernel) and the
    offsets are checked to be unchanged in the second compile. ``warm_only``: compile, do not launch."""
    if kv_cache.dtype != torch.bfloat16:
        raise ValueError("the seesaw kernel takes a bf16 cache")
    H = q.shape[1]
    num_blocks, page, _ = kv_cache.shape
    block_h, q_per = dg.gluon_decode_config(H, plan.max_query_len)
    kv2d = kv_cache.as_strided((num_blocks * page, dg.D_QK), (kv_cache.stride(1), 1))
    shape, strides = [num_blocks * page, dg.D_QK], [kv_cache.stride(1), 1]
    lat_desc = TensorDescriptor(kv2d, shape, strides, [dg.SUB_N, dg.D_V], dg._kv_layout(False, dg.D_V))
    rope_desc = TensorDescriptor(kv2d, shape, strides, [dg.SUB_N, dg.D_R], dg._kv_layout(False, dg.D_R))
    grid = (plan.capacity, triton.cdiv(H, block_h), triton.cdiv(plan.max_query_len, q_per))
    args = (q, lat_desc, rope_desc, block_table, seq_lens, query_start_loc, plan.work_req, plan.work_split,
            plan.num_splits, plan.split_len, out, lse, plan.o_part, plan.lse_part, scale_log2, v_scale,
            q.stride(0), q.stride(1), block_table.stride(0), out.stride(0), out.stride(1),
            H, num_blocks, block_table.shape[1])  # fmt: skip
    cons = _constexprs(k, block_h, q_per, causal, plan.max_query_len, page)
    if k.maxnreg:
        cons["maxnreg"] = k.maxnreg
    if k.arrive_all:
        key = (k, block_h, q_per, causal, plan.max_query_len, page)
        if key not in _OFFS_CACHE:
            first = _seesaw_kernel.warmup(*args, grid=grid, **cons)
            offs = barrier_offsets(first.asm["ttgir"])
            second = _seesaw_kernel.warmup(*args, grid=grid, **{**cons, **offs})
            again = barrier_offsets(second.asm["ttgir"])
            if again != offs:
                raise RuntimeError(f"ARRIVE_ALL: barrier offsets moved between compiles: {offs} -> {again}")
            _OFFS_CACHE[key] = offs
        cons.update(_OFFS_CACHE[key])
    if warm_only:
        _seesaw_kernel.warmup(*args, grid=grid, **cons)
        return
    _seesaw_kernel[grid](*args, **cons)


def run_decode(kind: Knobs, q, cache, bt, sl, qsl, causal, plan=None, out=None, lse=None, fill=True):
    """Split kernel (seesaw with knobs, or the package's ws kernel) + the package's reduce. With ``fill``,
    ``out``, ``lse`` and the plan's partials are NaN-filled first, so rows a kernel never writes show up as NaN."""
    import openmla
    from openmla.ops.decode import _mla_decode_reduce

    T, H, _ = q.shape
    if plan is None:
        plan = openmla.plan_decode(sl, qsl, H)
    if out is None:
        out = torch.empty((T, H, 512), dtype=q.dtype, device=q.device)
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if fill:
        plan.o_part.fill_(float("nan"))
        plan.lse_part.fill_(float("nan"))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
    if kind.ws:
        dg.mla_decode_split_gluon(q, cache, bt, sl, qsl, plan, out, lse, SCALE * LOG2E, 1.0, causal, 512)
    else:
        seesaw_split(q, cache, bt, sl, qsl, plan, out, lse, SCALE * LOG2E, 1.0, causal, kind)
    _mla_decode_reduce(qsl, plan, out, lse, 512)
    return out, lse, plan


# --------------------------------------------------------------------------------------------------
# problems


def make_batch(device, heads, qlens, lens, page=64, fill=float("nan"), seed=0):
    """tests/test_decode_gluon.py's ``_batch`` (bf16): random rows for the requests, ``fill`` (NaN, or 0 for
    experiment (i)) in every unused row of the cache."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B = len(lens)
    W = max(1, -(-max(lens) // page)) + 1  # one spare column: entries past a request's pages
    num_blocks = B * W + 3
    cache = torch.randn(num_blocks, page, 576, generator=g).to(device=device, dtype=torch.bfloat16)
    block_table = torch.randperm(num_blocks, generator=g)[: B * W].view(B, W).int().to(device)
    flat = cache.view(-1, 576)
    used = torch.zeros(num_blocks * page, dtype=torch.bool, device=device)
    for b, n in enumerate(lens):
        pos = torch.arange(n, device=device)
        used[block_table[b, pos // page].long() * page + pos % page] = True
    flat[~used] = fill
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    qsl = torch.tensor([0] + list(itertools.accumulate(qlens)), dtype=torch.int32, device=device)
    q = torch.randn(int(qsl[-1]), heads, 576, generator=g).to(device=device, dtype=torch.bfloat16)
    return q, cache, block_table, seq_lens, qsl


FAIL_LENS = [4096, 0, 3, 8191, 1000, 33, 2048, 17]  # the failing test's batch (test_gluon_decode)

# name -> (heads, qlens, lens, fill, causal)
PROBLEMS = {
    "a:len64 h16": (16, [1], [64], float("nan"), True),
    "a:len33 h16": (16, [1], [33], float("nan"), True),
    "b:batch h128 NaN-rows": (128, [1] * 8, FAIL_LENS, float("nan"), False),
    "c:batch h128 zero-rows (i)": (128, [1] * 8, FAIL_LENS, 0.0, False),
}


def compare(out, lse, ref_out, ref_lse, qsl) -> dict:
    """NaN count, max abs error per column half, wrong-element counts, LSE error, PASS/FAIL (the tests' check)."""
    from openmla.utils.testing import TOLERANCES, assert_close

    atol, rtol, cos = TOLERANCES[torch.bfloat16]
    o = out.float()
    r = ref_out.float()
    nan = torch.isnan(o)
    err = (o - r).abs()
    bad = nan | ~(err <= atol + rtol * r.abs())  # NaN compares False: counted as wrong
    err = torch.where(torch.isfinite(r) & ~nan, err, torch.zeros_like(err))
    res = {
        "nan": int(nan.sum()), "nan_lo": int(nan[..., :256].sum()), "nan_hi": int(nan[..., 256:].sum()),
        "err_lo": float(err[..., :256].max()) if err.numel() else 0.0,
        "err_hi": float(err[..., 256:].max()) if err.numel() else 0.0,
        "wrong_lo": int(bad[..., :256].sum()), "wrong_hi": int(bad[..., 256:].sum()),
    }  # fmt: skip
    fin = torch.isfinite(ref_lse)
    lse_nan = torch.isnan(lse)
    res["lse_nan"] = int(lse_nan.sum())
    res["lse_inf_mismatch"] = int((torch.isneginf(ref_lse) != torch.isneginf(lse)).sum())
    d = (lse - ref_lse).abs()[fin & ~lse_nan]
    res["lse_err"] = float(d.max()) if d.numel() else 0.0
    # requests with any wrong element (rows of request b: qsl[b]..qsl[b+1])
    tok_bad = bad.flatten(1).any(1).cpu()
    bounds = qsl.tolist()
    res["bad_reqs"] = [b for b in range(len(bounds) - 1) if bool(tok_bad[bounds[b] : bounds[b + 1]].any())]
    if bad.any():
        res["first_bad"] = [int(x) for x in bad.nonzero()[0].tolist()]  # (token, head, col)
    why = ""
    try:
        if res["nan"] or res["lse_nan"]:
            raise AssertionError(f"NaN in out ({res['nan']}) or lse ({res['lse_nan']})")
        assert_close("out", ref_out, out, atol, rtol, cos)
        assert_close("lse", ref_lse, lse, 1e-3, 1e-3, 1e-6)
    except AssertionError as exc:
        why = str(exc).splitlines()[0][:160]
    res["pass"] = not why
    res["why"] = why
    return res


def fmt_row(label: str, prob: str, res: dict) -> str:
    if "error" in res:
        return f"{label:<46} | {prob:<27} | {res['error']}"
    line = (f"{label:<46} | {prob:<27} | nan {res['nan']:>7} (c<256 {res['nan_lo']}, c>=256 {res['nan_hi']}) "
            f"| maxerr c0-255 {res['err_lo']:.2e} c256-511 {res['err_hi']:.2e} "
            f"| wrong {res['wrong_lo']}/{res['wrong_hi']} | lse err {res['lse_err']:.1e} nan {res['lse_nan']} "
            f"-inf mism {res['lse_inf_mismatch']} | splits {res.get('splits_max', '?')} "
            f"| {'PASS' if res['pass'] else 'FAIL'}")  # fmt: skip
    if not res["pass"]:
        line += f" | bad reqs {res['bad_reqs']} first bad (t,h,c) {res.get('first_bad')} | {res['why']}"
    return line


# --------------------------------------------------------------------------------------------------
# child: one knob combination, problems [start:]


def _cuda_fatal(exc: BaseException) -> bool:
    s = str(exc).lower()
    return any(w in s for w in ("illegal", "cuda error", "misaligned", "unspecified launch", "device-side"))


# --selftest (CPU): the parent/child harness with a fake kernel = the reference, with faults injected per
# combination: NaN (original), a hang (sep_p, problem 2), a "CUDA" error (arrive_all, problem 1), an abort
# (reader_fence, problem 0), wrong columns 256-511 (regs240)
SELFTEST = os.environ.get("SEESAW_DEBUG_SELFTEST") == "1"


def _fake_decode(k: Knobs, pi: int, q, cache, bt, sl, qsl, causal):
    from openmla.reference import mla_decode_ref

    out, lse = mla_decode_ref(q, cache, bt, sl, qsl, SCALE, causal=causal)
    out = out.to(torch.bfloat16)
    if k.name == "original":
        out[min(4, out.shape[0] - 1), 0, :5] = float("nan")
    elif k.name == "sep_p" and pi == 2:
        time.sleep(1000)
    elif k.name == "arrive_all" and pi == 1:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (fake)")
    elif k.name == "reader_fence" and pi == 0:
        os.abort()
    elif k.name == "regs240":
        out[..., 256:] += 1.0
    return out, lse


def child(k: Knobs, idx: int, start: int) -> int:
    from openmla.reference import mla_decode_ref

    dev = torch.device("cpu" if SELFTEST else "cuda")
    names = list(PROBLEMS)
    for pi in range(start, len(names)):
        name = names[pi]
        heads, qlens, lens, fill, causal = PROBLEMS[name]
        faulthandler.dump_traceback_later(COMPILE_S, exit=True)  # data, plan and compiles (no kernel of ours yet)
        try:
            q, cache, bt, sl, qsl = make_batch(dev, heads, qlens, lens, fill=fill, seed=1234 + pi)
            if SELFTEST:
                faulthandler.dump_traceback_later(HANG_S, exit=True)
                out, lse = _fake_decode(k, pi, q, cache, bt, sl, qsl, causal)
                splits = 1
            else:
                import openmla

                plan = openmla.plan_decode(sl, qsl, heads)
                if not k.ws:
                    o_w = torch.empty((q.shape[0], heads, 512), dtype=q.dtype, device=dev)
                    l_w = torch.empty((q.shape[0], heads), dtype=torch.float32, device=dev)
                    seesaw_split(q, cache, bt, sl, qsl, plan, o_w, l_w, SCALE * LOG2E, 1.0, causal, k, warm_only=True)
                torch.cuda.synchronize()
                faulthandler.dump_traceback_later(HANG_S, exit=True)  # a barrier bug hangs: dump stacks and exit
                out, lse, plan = run_decode(k, q, cache, bt, sl, qsl, causal, plan)
                torch.cuda.synchronize()
                splits = int(plan.num_splits.max())
            faulthandler.cancel_dump_traceback_later()
            ref_out, ref_lse = mla_decode_ref(q, cache, bt, sl, qsl, SCALE, causal=causal)
            res = compare(out, lse, ref_out, ref_lse, qsl)
            res["splits_max"] = splits
        except Exception as exc:  # noqa: BLE001 - one crash must not stop the other rows
            faulthandler.cancel_dump_traceback_later()
            res = {"error": f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}",
                   "pass": False}  # fmt: skip
            print("ROW " + json.dumps({"combo": idx, "problem": pi, "res": res}), flush=True)
            if _cuda_fatal(exc):
                return 3  # the CUDA context is poisoned: the parent restarts at the next problem
            continue
        print("ROW " + json.dumps({"combo": idx, "problem": pi, "res": res}), flush=True)
    return 0


# --------------------------------------------------------------------------------------------------
# parent: one subprocess per combination


def _spawn(argv: list[str], timeout: float):
    """Run this script with ``argv``; yield its ``ROW``/``BENCH`` JSON lines as they come; then ('rc', rc, stderr).
    The child is killed after ``timeout`` seconds (its own hang guard should end it long before)."""
    import threading

    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = _REPO + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], stdout=subprocess.PIPE,
                             stderr=err, text=True, env=env)  # fmt: skip
        timer = threading.Timer(timeout, p.kill)
        timer.start()
        try:
            for line in p.stdout:
                if line.startswith(("ROW ", "BENCH ")):
                    yield json.loads(line.split(" ", 1)[1])
                elif line.strip():
                    print("    | " + line.rstrip(), flush=True)
            rc = p.wait()
        finally:
            timer.cancel()
            if p.poll() is None:
                p.kill()
                p.wait()
        err.seek(0)
        tail = err.read()
        if rc == -9:
            tail += f"\nkilled by the parent after {timeout:.0f} s"
    yield ("rc", rc, tail)


def _tail_reason(rc: int, tail: str) -> str:
    m = re.search(r"Timeout \((\d+:\d+:\d+)\)!", tail)
    if m:  # faulthandler.dump_traceback_later fired: the launch / synchronize did not return
        return f"HANG (no return within {m.group(1)}; faulthandler ended the child)"
    lines = [x for x in tail.strip().splitlines() if x.strip() and "ptxas warning" not in x]
    return f"child exit {rc}: " + (lines[-1][:200] if lines else "(no stderr)")


def _run_combo(idx: int, k: Knobs, deadline: float, emit) -> list:
    """All problems of one combination in child processes (restarted after a crash / hang at the next
    problem). Returns [(problem index, line, passed)]."""
    names = list(PROBLEMS)
    rows = []
    start = 0
    while start < len(names):
        left = deadline - time.time()
        if left < 15:
            msg = f"{k.label():<46} | {names[start]:<27} | SKIPPED: time budget spent (problems {names[start:]})"
            rows.append((start, msg, False))
            emit(rows[-1][1])
            break
        argv = ["--one", str(idx), "--from", str(start)]
        if idx < 0:
            argv = ["--one-knobs", json.dumps(dataclasses.asdict(k)), "--from", str(start)]
        seen = []
        rc, tail = 0, ""
        for item in _spawn(argv, timeout=min(left, 90 + 40 * (len(names) - start))):
            if isinstance(item, tuple):
                _, rc, tail = item
                continue
            pi = item["problem"]
            seen.append(pi)
            rows.append((pi, fmt_row(k.label(), names[pi], item["res"]), bool(item["res"].get("pass"))))
            emit(rows[-1][1])
        done = max(seen) + 1 if seen else start
        if done >= len(names):
            break
        if rc != 0 and (not seen or rc != 3):
            # the child died inside problem `done` without printing its row (hang guard, abort, timeout)
            rows.append((done, f"{k.label():<46} | {names[done]:<27} | {_tail_reason(rc, tail)}", False))
            emit(rows[-1][1])
            done += 1
        elif rc == 0:
            rows.append((done, f"{k.label():<46} | {names[done]:<27} | child ended early: {_tail_reason(rc, tail)}",
                         False))  # fmt: skip
            emit(rows[-1][1])
            break
        start = done
    return rows


def run_matrix(combos: list[tuple[int, Knobs]], budget_s: float, jobs: int) -> int:
    import threading
    from concurrent.futures import ThreadPoolExecutor

    names = list(PROBLEMS)
    t0 = time.time()
    lock = threading.Lock()

    def emit(line):
        with lock:
            print(f"[{time.time() - t0:5.0f} s] {line}", flush=True)

    print(
        f"# {len(combos)} knob combinations x {len(names)} problems, {jobs} child processes at a time (one per "
        f"combination; kernels of different processes never overlap on the GPU), budget {budget_s:.0f} s"
    )
    print(
        "# row: knobs | problem | NaN count in out (cols 0-255, 256-511) | max abs err of the non-NaN values per "
        "column half | wrong elements (cols 0-255 / 256-511; NaN counts as wrong) | LSE max err, NaN count, -inf "
        "mismatches | PASS/FAIL with tests/test_decode_gluon.py's check (out TOLERANCES[bf16], lse 1e-3, no NaN)"
    )
    deadline = t0 + budget_s
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futs = [(idx, k, pool.submit(_run_combo, idx, k, deadline, emit)) for idx, k in combos]
        results = [(idx, k, f.result()) for idx, k, f in futs]
    print(f"\n# results ({time.time() - t0:.0f} s), by combination:")
    for idx, k, rows in results:
        for _, line, _ in sorted(rows, key=lambda r: r[0]):
            print(line)
    print("\n# summary:")
    for idx, k, rows in results:
        got = {pi: ok for pi, _, ok in rows}
        n = sum(got.get(pi, False) for pi in range(len(names)))
        state = "ALL PASS" if n == len(names) else f"{n}/{len(names)} pass"
        print(f"#   {k.label():<46} {state}")
    return 0


# --------------------------------------------------------------------------------------------------
# benchmark: h128, batch 128, seq 8192, qlen 1


def bench_child(k: Knobs) -> int:
    import openmla
    from openmla.reference import mla_decode_ref
    from openmla.utils.testing import TOLERANCES, assert_close

    dev = torch.device("cuda")
    faulthandler.dump_traceback_later(4 * HANG_S, exit=True)
    # gate: the failing batch must pass first
    heads, qlens, lens, fill, causal = PROBLEMS["b:batch h128 NaN-rows"]
    q, cache, bt, sl, qsl = make_batch(dev, heads, qlens, lens, fill=fill, seed=99)
    out, lse, _ = run_decode(k, q, cache, bt, sl, qsl, causal)
    ref_out, ref_lse = mla_decode_ref(q, cache, bt, sl, qsl, SCALE, causal=causal)
    res = compare(out, lse, ref_out, ref_lse, qsl)
    if not res["pass"]:
        print("BENCH " + json.dumps({"label": k.label(), "skip": "fails problem (b): " + res["why"]}), flush=True)
        return 0
    B, H, S = 128, 128, 8192
    g = torch.Generator(device=dev).manual_seed(7)
    page = 64
    nb = B * S // page
    cache = torch.randn(nb, page, 576, device=dev, generator=g, dtype=torch.bfloat16)
    bt = torch.randperm(nb, device=dev, generator=g).view(B, S // page).int()
    sl = torch.full((B,), S, dtype=torch.int32, device=dev)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=dev)
    q = torch.randn(B, H, 576, device=dev, generator=g, dtype=torch.bfloat16)
    plan = openmla.plan_decode(sl, qsl, H, max_query_len=1, max_seq_len=S)
    ws = Knobs("ws", ws=True)
    o_ws, l_ws, _ = run_decode(ws, q, cache, bt, sl, qsl, True, plan)
    o_k, l_k, _ = run_decode(k, q, cache, bt, sl, qsl, True, plan)
    torch.cuda.synchronize()
    atol, rtol, cos = TOLERANCES[torch.bfloat16]
    try:
        assert_close("out vs ws", o_ws, o_k, atol, rtol, cos)
        assert_close("lse vs ws", l_ws, l_k, 1e-3, 1e-3, 1e-6)
        agree = "agrees with ws"
    except AssertionError as exc:
        agree = "DIFFERS from ws: " + str(exc).splitlines()[0][:120]
    faulthandler.cancel_dump_traceback_later()
    flops = 2 * B * 1 * H * S * (576 + 512)
    times = {}
    for name, kk in (("ws", ws), (k.name, k)):
        o_b, l_b = torch.empty_like(o_ws), torch.empty_like(l_ws)

        def fn(kk=kk, o_b=o_b, l_b=l_b):
            run_decode(kk, q, cache, bt, sl, qsl, True, plan, o_b, l_b, fill=False)

        fn()
        faulthandler.dump_traceback_later(4 * HANG_S, exit=True)
        times[name] = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
        faulthandler.cancel_dump_traceback_later()
    row = {"label": k.label(), "us": times[k.name], "tflops": flops / times[k.name] / 1e6, "ws_us": times["ws"],
           "ws_tflops": flops / times["ws"] / 1e6, "agree": agree}  # fmt: skip
    print("BENCH " + json.dumps(row), flush=True)
    return 0


def run_bench(combos: list[tuple[int, Knobs]]) -> int:
    print(
        "# h128, batch 128, seq 8192, qlen 1, bf16 cache (split kernel + reduce, CUDA graph, median); "
        "TFLOPS = 2*T*H*seq*(576+512) / t. The ws kernel is re-timed in every child next to the combination."
    )
    for idx, k in combos:
        if k.ws:
            continue
        argv = ["--bench-one", str(idx)] if idx >= 0 else ["--bench-one-knobs", json.dumps(dataclasses.asdict(k))]
        got = False
        for item in _spawn(argv, timeout=240):
            if isinstance(item, tuple):
                _, rc, tail = item
                if not got:
                    print(f"{k.label():<46} | {_tail_reason(rc, tail)}")
                continue
            got = True
            if "skip" in item:
                print(f"{item['label']:<46} | skipped: {item['skip']}")
            else:
                mine = f"{item['us']:8.1f} us {item['tflops']:6.1f} TFLOPS"
                ws = f"ws {item['ws_us']:8.1f} us {item['ws_tflops']:6.1f} TFLOPS"
                print(f"{item['label']:<46} | {mine} | {ws} | {item['agree']}", flush=True)
    return 0


# --------------------------------------------------------------------------------------------------
# offline sm90 compile (no GPU): every combination, the two specialisations the matrix runs


def _nvmma(swizzle, bits):
    return (
        f"NVMMASharedLayout(swizzle_byte_width={swizzle}, element_bitwidth={bits}, rank=2, transposed=False, "
        "fp4_padded=False, cga_layout=[])"
    )


_PTR = {"q": "*bf16", "block_table": "*i32", "seq_lens": "*i32", "query_start_loc": "*i32", "work_req": "*i32",
        "work_split": "*i32", "num_splits": "*i32", "split_len": "*i32", "out": "*bf16", "lse": "*fp32",
        "o_part": "*fp32", "lse_part": "*fp32"}  # fmt: skip


def compile_sm90(fn, cons: dict, maxnreg: int | None = None):
    """``triton.compile`` of a Gluon kernel for sm90 without a GPU (as tests/test_decode_gluon.py does)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in cons:
            sig[name] = "constexpr"
        elif name == "lat_desc":
            sig[name] = f"tensordesc<bf16[32, 512],{_nvmma(128, 16)}>"
        elif name == "rope_desc":
            sig[name] = f"tensordesc<bf16[32, 64],{_nvmma(128, 16)}>"
        elif name in _PTR:
            sig[name] = _PTR[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("scale_log2", "v_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    opts = {"num_warps": cons["num_warps"]}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(
        GluonASTSource(fn, sig, constexprs=cons, attrs=attrs), target=GPUTarget("cuda", 90, 32), options=opts
    )


def compile_only(combos: list[tuple[int, Knobs]]) -> int:
    from openmla.utils.sm90_report import resource_report

    specs = [(16, 4, True), (64, 1, False)]  # problem (a): h16 (BLOCK_H 16 x 4 rows); (b)/(c): h128
    ok = True
    print(f"# offline sm90 compile (triton {triton.__version__}); shared = dynamic + static (limit {dg.SMEM_LIMIT}); "
          "spill = ptxas -v spill store/load bytes; setmaxnreg = the partitions' register counts")  # fmt: skip
    for idx, k in combos:
        for block_h, q_per, causal in specs:
            tag = f"{k.label():<46} | BLOCK_H {block_h:>2} CAUSAL {int(causal)}"
            try:
                extra = ""
                if k.ws:
                    cons = {
                        "PAGE": 64,
                        "MAX_QLEN": 4 if block_h == 16 else 1,
                        "BLOCK_H": block_h,
                        "Q_PER": q_per,
                        "BLOCK_N": 64,
                        "STAGES": 2,
                        "CAUSAL": causal,
                        "PRODUCER_REGS": dg.WS_PRODUCER_REGS,
                        "FP8": False,
                        "N_HB": 1,
                        "N_QB": 1,
                        "num_warps": 8,
                    }
                    kern = compile_sm90(dg._mla_decode_gluon_ws_kernel, cons)  # fmt: skip
                else:
                    cons = _constexprs(k, block_h, q_per, causal, 1, 64)
                    kern = compile_sm90(_seesaw_kernel, cons, k.maxnreg)
                    if k.arrive_all:
                        offs = barrier_offsets(kern.asm["ttgir"])
                        kern = compile_sm90(_seesaw_kernel, {**cons, **offs}, k.maxnreg)
                        again = barrier_offsets(kern.asm["ttgir"])
                        if again != offs:
                            raise RuntimeError(f"ARRIVE_ALL: barrier offsets moved between compiles: {offs} -> {again}")
                        sites, inits = check_arrive_all_ptx(kern.asm["ptx"], offs)
                        where = ", ".join(f"{a[:-4].lower()} {b}" for a, b in offs.items() if b)
                        extra = (f" | barrier offsets {where} (same in both compiles); {sites} per-thread arrive "
                                 f"sites, {inits} count-128/256 inits")  # fmt: skip
                r = resource_report(kern)
                px = ptxas_info(kern.asm["ptx"])
                maxnreg = sorted(set(re.findall(r"\.maxnreg\s+(\d+)", kern.asm["ptx"])))
                smem = r["shared"] + r["static_shared"]
                spill = px["spill"] or (-1, -1)
                warn = f" | ptxas warning: {'; '.join(px['warnings'])}" if px["warnings"] else ""
                regs = f"setmaxnreg {'/'.join(r['setmaxnreg'])} .maxnreg {'/'.join(maxnreg) or '-'}"
                line = (f"{tag} | regs {r['regs']} | spill {spill[0]}/{spill[1]} B (stack {r['stack']}) "
                        f"| shared {smem} B | {regs}"
                        f" | wgmma {r['wgmma']} tma {r['tma']}{warn}{extra}")  # fmt: skip
                if not (r["wgmma"] > 0 and r["tma"] > 0 and r["regs"] <= 255 and smem <= dg.SMEM_LIMIT):
                    line += " | FAIL"
                    ok = False
                print(line, flush=True)
            except Exception as exc:  # noqa: BLE001
                ok = False
                print(f"{tag} | COMPILE FAILED: {type(exc).__name__}: {str(exc)[-600:]}", flush=True)
    print("# compile-only: " + ("every combination compiles for sm90 (spills are allowed here: they are reported)"
                                if ok else "FAILURES above"))  # fmt: skip
    return 0 if ok else 1


# --------------------------------------------------------------------------------------------------


def _select(args) -> list[tuple[int, Knobs]]:
    combos = list(enumerate(COMBOS))
    if args.only:
        want = set(args.only.split(","))
        combos = [(i, k) for i, k in combos if k.name in want or str(i) in want]
    if args.knobs:
        combos.append((-1, parse_knobs(args.knobs)))
    return combos


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", action="store_true", help="time the combinations that pass problem (b) vs ws")
    ap.add_argument("--compile-only", action="store_true", help="offline sm90 compile of every combination (CPU)")
    ap.add_argument("--only", default="", help="comma-separated combination names or indices (default: all)")
    ap.add_argument("--knobs", default="", help="add a custom combination, e.g. sep,arrive,fence,regs=240")
    ap.add_argument("--budget", type=float, default=250.0, help="seconds for the whole matrix (default 250)")
    ap.add_argument("--jobs", type=int, default=3, help="combinations run at a time (child processes; default 3)")
    ap.add_argument("--selftest", action="store_true", help="check the parent/child harness on the CPU (fake kernel)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--one-knobs", help=argparse.SUPPRESS)
    ap.add_argument("--from", dest="start", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--bench-one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--bench-one-knobs", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if not GLUON_AVAILABLE:
        print("seesaw_debug: triton.experimental.gluon is not available (triton >= 3.5 needed); nothing to do.")
        return 0
    if args.compile_only:
        return compile_only(_select(args))
    if args.one is not None:
        return child(COMBOS[args.one], args.one, args.start)
    if args.one_knobs is not None:
        return child(Knobs(**json.loads(args.one_knobs)), -1, args.start)
    if args.bench_one is not None:
        return bench_child(COMBOS[args.bench_one])
    if args.bench_one_knobs is not None:
        return bench_child(Knobs(**json.loads(args.bench_one_knobs)))

    if args.selftest:
        os.environ["SEESAW_DEBUG_SELFTEST"] = "1"  # inherited by the children
        return run_matrix(_select(args), args.budget, args.jobs)
    gpu = _probe_gpu()
    if not gpu.get("cuda") or gpu.get("cap", [0])[0] != 9:
        what = gpu.get("name") or "no CUDA GPU"
        print(f"seesaw_debug: needs an sm90 (Hopper) GPU; found {what}. Nothing run. "
              "(Offline check without a GPU: --compile-only.)")  # fmt: skip
        return 0
    jobs = args.jobs
    if "exclusive" in gpu.get("compute_mode", "").lower() and jobs > 1:
        print(f"# GPU compute mode {gpu['compute_mode']}: one child process at a time")
        jobs = 1
    print(f"# {gpu['name']} | torch {torch.__version__} | triton {triton.__version__} | git {_git_sha()}")
    combos = _select(args)
    return run_bench(combos) if args.bench else run_matrix(combos, args.budget, jobs)


def _probe_gpu() -> dict:
    """The GPU, queried in a short-lived subprocess: the parent never holds a CUDA context (children must be able
    to open theirs, even in an exclusive compute mode)."""
    code = ("import json, torch\n"
            "d = {'cuda': torch.cuda.is_available()}\n"
            "if d['cuda']:\n"
            "    d['cap'] = list(torch.cuda.get_device_capability()); d['name'] = torch.cuda.get_device_name()\n"
            "print('PROBE' + json.dumps(d))\n")  # fmt: skip
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
        line = next(x for x in r.stdout.splitlines() if x.startswith("PROBE"))
        info = json.loads(line[5:])
    except (StopIteration, subprocess.TimeoutExpired, OSError, ValueError):
        return {"cuda": False}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
        info["compute_mode"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


def _git_sha() -> str:
    try:
        r = subprocess.run(["git", "-C", _REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           check=False)  # fmt: skip
        return r.stdout.strip() or "?"
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
