"""What the tensor-core work of the h128 decode kernel costs in energy alone (H200 experiment; not part of openmla).

One program per SM, two warpgroups, each looping over ``warpgroup_mma`` chains on operands that never leave shared
memory (random bf16 written once; no global traffic in the loop): the shapes the seesaw-pair kernels issue, and the
ones a different schedule could. Each case runs about ``SECONDS`` seconds back to back while ``nvidia-smi`` samples
the clock and power (``common.sustained_load``), and prints TFLOPS, the SM clock, the power and pJ a FLOP, after a
burst timing (``bench_us``) as the benchmarks time it. At the 700 W cap a kernel's speed is its energy a FLOP
(RESULTS.md runs 104-106), so these figures bound what the decode kernel can reach at each MMA shape.

    PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/experiments/mma_energy.py
    MMA_CASES="64,0;256,1,2000;256,0,0,8" ...   # N (keys or columns of one MMA), A from registers (1) or shared
        # memory (0), ns every warp sleeps after each chain (default 0), KV tiles copied from L2 a chain (default 0)

Cases (default): ``N=64`` shared A / B is the scores of one 64-key tile (Q x K^T, m64n64k16); ``N=128`` the scores of
a pair of tiles in one MMA; ``N=256`` the P V of a warpgroup's half of the output columns (m64n256k16), from shared
memory or (``RS``) with P in registers. With a sleep after each chain (``nanosleep``, the tensor pipe idle while
the SMs stay clocked) the same MMAs show what the cycles without tensor work cost: the decode kernel keeps the tensor
pipe busy about three quarters of its cycles. With KV tiles copied by TMA from an L2-resident pool during each chain
(72 KB a tile, into a stage nothing reads) they show what the copies cost: a chain is 67 MFLOP, as much as 7.5 tiles
of the decode kernel at h128 (each 64-row program copies one tile per 8.9 MFLOP, at q1 and q2 alike).
"""

from __future__ import annotations

import os
import sys
import time

from triton.experimental.gluon import language as gl

SECONDS = float(os.environ.get("MMA_SECONDS", "3"))
CASES = [(64, 0, 0, 0), (128, 0, 0, 0), (256, 0, 0, 0), (256, 1, 0, 0), (256, 0, 2000, 0), (256, 0, 4000, 0),
         (256, 0, 0, 4), (256, 0, 0, 8), (256, 0, 0, 16)]
if os.environ.get("MMA_CASES"):
    CASES = [tuple(int(x) for x in (c + ",0,0").split(",")[:4]) for c in os.environ["MMA_CASES"].split(";")]
TILES = 16  # the copies' pool: 16 KV tiles of 64 rows (1.2 MB, L2-resident)
# (mode, tiles a chain, cluster size) of the inline-PTX copies: "ptx" each CTA copies every tile for itself, "mc"
# each CTA of a 2-CTA cluster copies half of every tile's boxes, multicast into both
PTX_CASES = [("ptx", 8, 1), ("ptx", 8, 2), ("mc", 8, 2), ("ptx", 16, 2), ("mc", 16, 2)]
# (box keys, stages, pool tiles, WS) of the ring (``mma_ring``): 16 pool tiles stay in L2, 32768 (2.4 GB) come
# from HBM
RING_CASES = [(64, 2, 16, 0), (64, 2, 16, 1), (32, 4, 16, 0), (32, 4, 16, 1), (64, 2, 32768, 0), (64, 2, 32768, 1),
              (32, 4, 32768, 0), (32, 4, 32768, 1)]
if os.environ.get("MMA_RING_CASES") is not None:
    RING_CASES = [tuple(int(x) for x in c.split(",")) for c in os.environ["MMA_RING_CASES"].split(";") if c]
# tiles a chain copied from a 1-warp partition (``mma_loop_ws``)
WS_CASES = [0, 8, 16]
if os.environ.get("MMA_WS_CASES") is not None:
    WS_CASES = [int(c) for c in os.environ["MMA_WS_CASES"].split(",") if c]
if os.environ.get("MMA_PTX_CASES") is not None:
    PTX_CASES = [(f[0], int(f[1]), int(f[2]))
                 for f in (c.split(",") for c in os.environ["MMA_PTX_CASES"].split(";") if c)]
CHUNKS = 4  # 64-column chunks of A and B in shared memory (the loop cycles over them)
CHAIN = 16  # MMAs (each K = 64) issued between waits
PEAK_PER_GHZ = 132 * 4 * 1024 * 1e-3  # dense bf16 TFLOPS per GHz of the H200's 132 SMs (4 x 1024 FLOP a clock each)


from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@gluon.jit
def _fill_operands(x, a_s, b_s, A_CHUNKS: gl.constexpr, B_CHUNKS: gl.constexpr, num_warps: gl.constexpr):
    """Write the loops' MMA operands once: ``A_CHUNKS`` chunks ``[M, 64]`` of ``a_s`` and ``B_CHUNKS`` chunks
    ``[256, 64]`` of ``b_s`` from ``x`` (random bf16), visible to the MMAs when it returns."""
    M: gl.constexpr = a_s.shape[1]
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    o_k = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, LD)), 0)
    o_m = gl.expand_dims(gl.arange(0, M, layout=gl.SliceLayout(1, LD)), 1)
    o_n = gl.expand_dims(gl.arange(0, 256, layout=gl.SliceLayout(1, LD)), 1)
    for c in gl.static_range(A_CHUNKS):
        a_s.index(c).store(gl.load(x + (c * M + o_m) * 64 + o_k))
    for c in gl.static_range(B_CHUNKS):
        b_s.index(c).store(gl.load(x + (A_CHUNKS * M + c * 256 + o_n) * 64 + o_k))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _copy_tiles(half_desc, rope_desc, lat_s, rope_s, bar, n_done, n_copy, TILES: gl.constexpr):
    """Copy ``n_copy`` KV tiles (72 KB each: two [64, 256] latent boxes and the [64, 64] rope) from the pool into
    ``lat_s`` / ``rope_s`` (nothing reads them), two in flight on the two mbarriers ``bar``: copy ``n`` (counted
    from ``n_done``, the copies issued before) waits for copy ``n - 2``."""
    for t in range(n_copy):
        n = n_done + t
        if n >= 2:
            mbarrier.wait(bar.index(n % 2), ((n - 2) // 2) & 1)
        row = ((gl.program_id(0) * 7 + n) % TILES) * 64
        mbarrier.expect(bar.index(n % 2), 64 * 576 * 2)
        tma.async_copy_global_to_shared(half_desc, [row, 0], bar.index(n % 2), lat_s.index(0))
        tma.async_copy_global_to_shared(half_desc, [row, 256], bar.index(n % 2), lat_s.index(1))
        tma.async_copy_global_to_shared(rope_desc, [row, 512], bar.index(n % 2), rope_s)


@gluon.jit
def mma_loop(x, out, iters, gap_ns, n_copy, half_desc, rope_desc, N: gl.constexpr, RS: gl.constexpr,
             CHUNKS: gl.constexpr, CHAIN: gl.constexpr, TILES: gl.constexpr, num_warps: gl.constexpr):
    M: gl.constexpr = 16 * num_warps  # 64 rows a warpgroup
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, N, 16])  # fmt: skip
    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    a_s = gl.allocate_shared_memory(gl.bfloat16, [CHUNKS, M, 64], SMEM)
    # always 256 rows of B and a KV stage, so that every case holds one program per SM (200 KB)
    b_s = gl.allocate_shared_memory(gl.bfloat16, [CHUNKS // 2, 256, 64], SMEM)
    # the copies' destination (as a decode stage: two [64, 256] latent halves and the [64, 64] rope; nothing
    # reads it) and one mbarrier per copy slot
    lat_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 256], half_desc.layout)
    rope_s = gl.allocate_shared_memory(gl.bfloat16, [64, 64], rope_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(2):
        mbarrier.init(bar.index(j), count=1)
    _fill_operands(x, a_s, b_s, CHUNKS, CHUNKS // 2, num_warps)
    acc = gl.zeros([M, N], gl.float32, ACC)
    a_r = a_s.index(0).load(gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2))
    gap = gl.full([32 * num_warps], gap_ns, gl.int32, gl.BlockedLayout([1], [32], [num_warps], [0]))
    n_done = iters * 0  # copies issued so far (slot n % 2, its phase (n // 2) & 1)
    for _ in range(iters):
        for c in gl.static_range(CHAIN):
            b = b_s.index(c % (CHUNKS // 2)).slice(0, N, dim=0).permute((1, 0))
            if RS:
                acc = warpgroup_mma(a_r, b, acc, is_async=True)
            else:
                acc = warpgroup_mma(a_s.index(c % CHUNKS), b, acc, is_async=True)
        # n_copy KV tiles (72 KB each) from an L2-resident pool while the chain runs, two in flight
        _copy_tiles(half_desc, rope_desc, lat_s, rope_s, bar, n_done, n_copy, TILES)
        n_done += n_copy
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        if gap_ns > 0:
            gap = gl.inline_asm_elementwise("nanosleep.u32 $1; mov.u32 $0, $1;", "=r,r", [gap], dtype=gl.int32,
                                            is_pure=False, pack=1)
    for n in range(gl.maximum(n_done - 2, 0), n_done):  # the copies still in flight
        mbarrier.wait(bar.index(n % 2), (n // 2) & 1)
    gl.store(out + gl.program_id(0), gl.sum(gl.sum(acc, axis=1), axis=0) + gl.sum(gap, axis=0).to(gl.float32))


# ``mma_loop`` with the copies issued by a 1-warp partition of their own (``gl.warp_specialize``), so that the
# warpgroups issuing the MMAs never wait on a copy: at the start of chain k they wait only until the copy warp is done
# with chain k - 1's tiles, and the copy warp waits for chain k to start before it copies chain k's tiles (two in
# flight). What is left of the slowdown is the copies' own interference with the MMAs.
@gluon.jit
def _mma_part(a_s, b_s, go, done, out, iters, N: gl.constexpr, CHUNKS: gl.constexpr, CHAIN: gl.constexpr,
              NW: gl.constexpr):
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, N, 16])
    acc = gl.zeros([16 * NW, N], gl.float32, ACC)
    for it in range(iters):
        if it > 0:
            mbarrier.wait(done, (it - 1) & 1)
        mbarrier.arrive(go, count=1)
        for c in gl.static_range(CHAIN):
            b = b_s.index(c % (CHUNKS // 2)).slice(0, N, dim=0).permute((1, 0))
            acc = warpgroup_mma(a_s.index(c % CHUNKS), b, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    gl.store(out + gl.program_id(0), gl.sum(gl.sum(acc, axis=1), axis=0))

@gluon.jit
def _copy_part(half_desc, rope_desc, lat_s, rope_s, bar, go, done, iters, n_copy, TILES: gl.constexpr):
    n_done = iters * 0
    for it in range(iters):
        mbarrier.wait(go, it & 1)
        _copy_tiles(half_desc, rope_desc, lat_s, rope_s, bar, n_done, n_copy, TILES)
        n_done += n_copy
        for n in range(gl.maximum(n_done - 2, 0), n_done):
            mbarrier.wait(bar.index(n % 2), (n // 2) & 1)
        mbarrier.arrive(done, count=1)

@gluon.jit
def mma_loop_ws(x, out, iters, n_copy, half_desc, rope_desc, N: gl.constexpr, CHUNKS: gl.constexpr,
                CHAIN: gl.constexpr, TILES: gl.constexpr, num_warps: gl.constexpr):
    M: gl.constexpr = 16 * num_warps
    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    a_s = gl.allocate_shared_memory(gl.bfloat16, [CHUNKS, M, 64], SMEM)
    b_s = gl.allocate_shared_memory(gl.bfloat16, [CHUNKS // 2, 256, 64], SMEM)
    lat_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 256], half_desc.layout)
    rope_s = gl.allocate_shared_memory(gl.bfloat16, [64, 64], rope_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    go = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(2):
        mbarrier.init(bar.index(j), count=1)
    mbarrier.init(go.index(0), count=1)
    mbarrier.init(done.index(0), count=1)
    _fill_operands(x, a_s, b_s, CHUNKS, CHUNKS // 2, num_warps)
    gl.warp_specialize([
        (_mma_part, (a_s, b_s, go.index(0), done.index(0), out, iters, N, CHUNKS, CHAIN, num_warps)),
        (_copy_part, (half_desc, rope_desc, lat_s, rope_s, bar, go.index(0), done.index(0), iters, n_copy,
                      TILES)),
    ], [1], [48])  # fmt: skip


# MMAs fed through a ring of KV stages, as the decode kernel is: tile t's MMAs wait until its stage has landed
# (``ready``), and a stage is refilled with tile t + STAGES once tile t's MMAs have completed (``empty``). The MMAs read
# the program's own operands (the same energy as reading the stage, runs 109-110), so a tile is only a dependency:
# ``MMAS`` m128n256k64 MMAs (8.4 MFLOP for a 64-key tile, the kernel's 8.9) per ``BOX``-key tile (``BOX`` x 576 bf16).
# ``WS``: the refills come from a 1-warp partition of their own; else the MMA warps issue each refill themselves right
# after the tile's MMAs completed (the decode kernel's way).
@gluon.jit
def _refill(half_desc, rope_desc, lat_s, rope_s, ready, t, TILES: gl.constexpr, STAGES: gl.constexpr,
            BOX: gl.constexpr):
    s = t % STAGES
    row = ((gl.program_id(0) * 7919 + t * 13) % TILES) * BOX
    mbarrier.expect(ready.index(s), BOX * 576 * 2)
    tma.async_copy_global_to_shared(half_desc, [row, 0], ready.index(s), lat_s.index(2 * s))
    tma.async_copy_global_to_shared(half_desc, [row, 256], ready.index(s), lat_s.index(2 * s + 1))
    tma.async_copy_global_to_shared(rope_desc, [row, 512], ready.index(s), rope_s.index(s))

@gluon.jit
def _ring_mma(a_s, b_s, half_desc, rope_desc, lat_s, rope_s, ready, empty, out, n_tiles, MMAS: gl.constexpr,
              STAGES: gl.constexpr, BOX: gl.constexpr, TILES: gl.constexpr, WS: gl.constexpr, NW: gl.constexpr):
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                  instr_shape=[16, 256, 16])  # fmt: skip
    acc = gl.zeros([16 * NW, 256], gl.float32, ACC)
    if not WS:
        for t in gl.static_range(STAGES):
            _refill(half_desc, rope_desc, lat_s, rope_s, ready, t, TILES, STAGES, BOX)
    for t in range(n_tiles):
        mbarrier.wait(ready.index(t % STAGES), (t // STAGES) & 1)
        for c in gl.static_range(MMAS):
            acc = warpgroup_mma(a_s.index(c % 2), b_s.index(0).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=MMAS, deps=[acc])  # tile t - 1's MMAs completed
        if t > 0:
            if WS:
                mbarrier.arrive(empty.index((t - 1) % STAGES), count=1)
            elif t - 1 + STAGES < n_tiles:
                _refill(half_desc, rope_desc, lat_s, rope_s, ready, t - 1 + STAGES, TILES, STAGES, BOX)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    gl.store(out + gl.program_id(0), gl.sum(gl.sum(acc, axis=1), axis=0))

@gluon.jit
def _ring_copy(half_desc, rope_desc, lat_s, rope_s, ready, empty, n_tiles, STAGES: gl.constexpr,
               BOX: gl.constexpr, TILES: gl.constexpr):
    for t in range(n_tiles):
        if t >= STAGES:
            mbarrier.wait(empty.index(t % STAGES), ((t - STAGES) // STAGES) & 1)
        _refill(half_desc, rope_desc, lat_s, rope_s, ready, t, TILES, STAGES, BOX)

@gluon.jit
def mma_ring(x, out, n_tiles, half_desc, rope_desc, MMAS: gl.constexpr, STAGES: gl.constexpr, BOX: gl.constexpr,
             TILES: gl.constexpr, WS: gl.constexpr, num_warps: gl.constexpr):
    M: gl.constexpr = 16 * num_warps
    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    a_s = gl.allocate_shared_memory(gl.bfloat16, [2, M, 64], SMEM)
    b_s = gl.allocate_shared_memory(gl.bfloat16, [1, 256, 64], SMEM)
    lat_s = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, BOX, 256], half_desc.layout)
    rope_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BOX, 64], rope_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=1)
    _fill_operands(x, a_s, b_s, 2, 1, num_warps)
    if WS:
        gl.warp_specialize([
            (_ring_mma, (a_s, b_s, half_desc, rope_desc, lat_s, rope_s, ready, empty, out, n_tiles, MMAS, STAGES,
                         BOX, TILES, WS, num_warps)),
            (_ring_copy, (half_desc, rope_desc, lat_s, rope_s, ready, empty, n_tiles, STAGES, BOX, TILES)),
        ], [1], [48])  # fmt: skip
    else:
        _ring_mma(a_s, b_s, half_desc, rope_desc, lat_s, rope_s, ready, empty, out, n_tiles, MMAS, STAGES, BOX,
                  TILES, WS, num_warps)  # fmt: skip


def _ptx_copy_asm(mc: bool) -> str:
    """Thread 0 arms the tile's mbarrier ($2: its byte offset from ``global_smem``) for 72 KB and copies the tile at
    row $5 as nine [64, 64] boxes (8 latent chunks and the rope) through the tensor map at $4 into the 72 KB at
    offset $3. ``mc``: each CTA of a 2-CTA cluster copies the boxes of its parity (rank 0: even, rank 1: odd),
    multicast into both CTAs at the same offsets."""
    body = ["{ .reg .pred q, p; .reg .b32 s, b, d, k, c; .reg .b16 m; setp.eq.s32 q, $1, 0; mov.b32 s, global_smem; "
            "add.s32 b, s, $2; mov.u32 k, %cluster_ctarank; mov.b16 m, 3; "
            "@q mbarrier.arrive.expect_tx.shared::cta.b64 _, [b], 73728; "]
    for i in range(9):
        body.append(f"add.s32 d, s, $3; add.s32 d, d, {i * 8192}; mov.b32 c, {i * 64}; ")
        if mc:
            body.append(f"setp.eq.and.s32 p, k, {i % 2}, q; @p cp.async.bulk.tensor.2d.shared::cluster.global"
                        ".mbarrier::complete_tx::bytes.multicast::cluster [d], [$4, {c, $5}], [b], m; ")
        else:
            body.append("@q cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
                        "[d], [$4, {c, $5}], [b]; ")
    body.append("mov.b32 $0, 0; }")
    return "".join(body)


PTX_COPY_ASM = gl.constexpr(_ptx_copy_asm(False))
PTX_MC_ASM = gl.constexpr(_ptx_copy_asm(True))
# every thread waits for phase $2 of the mbarrier at byte offset $1
PTX_WAIT_ASM = gl.constexpr("{ .reg .pred P1; .reg .b32 s, b; mov.b32 s, global_smem; add.s32 b, s, $1; waitLoop: "
                            "mbarrier.try_wait.parity.shared::cta.b64 P1, [b], $2; @!P1 bra waitLoop; mov.b32 $0, 0; }")
# the cluster barrier (every thread of both CTAs); with ``fence.mbarrier_init`` first at the start
PTX_CLUSTER_SYNC = gl.constexpr("barrier.cluster.arrive.release; barrier.cluster.wait.acquire; mov.b32 $0, $1;")
PTX_INIT_SYNC = gl.constexpr("fence.mbarrier_init.release.cluster; barrier.cluster.arrive.release; "
                             "barrier.cluster.wait.acquire; mov.b32 $0, $1;")


# ``mma_loop`` with the tiles copied by inline PTX (``cp.async.bulk.tensor`` from one thread, nine [64, 64] boxes a
# tile, each tile on its own mbarrier, a cluster barrier before each chain), so that the same copies can be multicast
# (``MC``) in 2-CTA clusters: each SM still receives every tile, but the L2 serves each tile once per cluster.
# ``DST_OFF`` / ``BAR_OFF``: the byte offsets Triton gives the destination and the 16 mbarriers (read from a first
# compile's TTGIR, ``_alloc_offsets``).
@gluon.jit
def mma_loop_ptx(x, out, iters, n_copy, tmap, N: gl.constexpr, CHUNKS: gl.constexpr, CHAIN: gl.constexpr,
                 TILES: gl.constexpr, MC: gl.constexpr, CLUSTER: gl.constexpr, DST_OFF: gl.constexpr,
                 BAR_OFF: gl.constexpr, num_warps: gl.constexpr):
    M: gl.constexpr = 16 * num_warps
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, N, 16])  # fmt: skip
    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    VEC: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    a_s = gl.allocate_shared_memory(gl.bfloat16, [CHUNKS, M, 64], SMEM)
    b_s = gl.allocate_shared_memory(gl.bfloat16, [CHUNKS // 2, 256, 64], SMEM)
    dst = gl.allocate_shared_memory(gl.bfloat16, [9, 64, 64], SMEM)  # a tile: 8 latent chunks and the rope
    bar = gl.allocate_shared_memory(gl.int64, [16, 1], mbarrier.MBarrierLayout())  # one per tile of a chain
    for j in gl.static_range(16):
        mbarrier.init(bar.index(j), count=1)
    _fill_operands(x, a_s, b_s, CHUNKS, CHUNKS // 2, num_warps)
    tid = gl.arange(0, 32 * num_warps, layout=VEC)
    zero = tid * 0
    tok = gl.inline_asm_elementwise("{ .reg .pred p; setp.eq.s32 p, $1, 0; @p fence.proxy.tensormap::generic"
                                    ".acquire.gpu [$2], 128; mov.b32 $0, 0; }", "=r,r,l",
                                    [tid, zero.to(gl.int64) + tmap], dtype=gl.int32, is_pure=False, pack=1)
    tok = gl.inline_asm_elementwise(PTX_INIT_SYNC, "=r,r", [tok], dtype=gl.int32, is_pure=False, pack=1)
    # the tiles of a cluster (both CTAs copy the same rows; without MC as well, for the same addresses)
    row0 = (gl.program_id(0) // CLUSTER) * 7
    acc = gl.zeros([M, N], gl.float32, ACC)
    for it in range(iters):
        # the peer waited for all of its previous chain's tiles
        tok = gl.inline_asm_elementwise(PTX_CLUSTER_SYNC, "=r,r", [tok], dtype=gl.int32, is_pure=False, pack=1)
        for c in gl.static_range(CHAIN):
            b = b_s.index(c % (CHUNKS // 2)).slice(0, N, dim=0).permute((1, 0))
            acc = warpgroup_mma(a_s.index(c % CHUNKS), b, acc, is_async=True)
        for t in range(n_copy):  # two tiles in flight
            if t >= 2:
                prev = [zero + BAR_OFF + (t - 2) * 8, zero + (it & 1)]
                tok = gl.inline_asm_elementwise(PTX_WAIT_ASM, "=r,r,r", prev, dtype=gl.int32, is_pure=False,
                                                pack=1)  # fmt: skip
            row = zero + ((row0 + t) % TILES) * 64
            args = [tid, zero + BAR_OFF + t * 8, zero + DST_OFF, zero.to(gl.int64) + tmap, row]
            if MC:
                tok = gl.inline_asm_elementwise(PTX_MC_ASM, "=r,r,r,r,l,r", args, dtype=gl.int32, is_pure=False,
                                                pack=1)  # fmt: skip
            else:
                tok = gl.inline_asm_elementwise(PTX_COPY_ASM, "=r,r,r,r,l,r", args, dtype=gl.int32, is_pure=False,
                                                pack=1)  # fmt: skip
        for t in range(gl.maximum(n_copy - 2, 0), n_copy):
            tok = gl.inline_asm_elementwise(PTX_WAIT_ASM, "=r,r,r", [zero + BAR_OFF + t * 8, zero + (it & 1)],
                                            dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    # no multicast lands in a CTA that has exited
    tok = gl.inline_asm_elementwise(PTX_CLUSTER_SYNC, "=r,r", [tok], dtype=gl.int32, is_pure=False, pack=1)
    last = gl.sum(gl.sum(dst.index(0).load(LD).to(gl.float32), axis=1), axis=0)  # (keeps dst allocated)
    gl.store(out + gl.program_id(0), gl.sum(gl.sum(acc, axis=1), axis=0) + gl.sum(tok, axis=0).to(gl.float32)
             + last)


def _alloc_offsets(ttgir: str) -> tuple[int, int]:
    """The byte offsets of ``mma_loop_ptx``'s ``dst`` and ``bar`` (``openmla.utils.sm90_report.alloc_offsets``)."""
    from openmla.utils.sm90_report import alloc_offsets

    found = alloc_offsets(ttgir)
    return found["dst"], found["bar"]


def _tensor_map(pool) -> int:
    """The global address of a CUtensorMap over ``pool`` (``[rows, 576]`` bf16) with ``[64, 64]`` boxes and the
    128-byte swizzle, for ``mma_loop_ptx`` (a uint8 CUDA tensor holding it stays referenced in ``_MAPS``)."""
    import ctypes

    import torch
    import triton

    fill = triton.runtime.driver.active.utils.fill_tma_descriptor
    desc = fill(pool.data_ptr(), 3, 2, 9, [64, 64], list(pool.shape), [pool.stride(0), 1], 0)
    raw = ctypes.string_at(id(desc) + 128, 128)  # PyCUtensorMapObject: the 128-byte-aligned map after the head
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(pool.device)
    _MAPS.append((buf, pool))
    return buf.data_ptr()


_MAPS: list = []


def _report(name, flops, burst, load, copy_bytes):
    if load["power"] is None:
        print(f"{name}: burst {flops / burst / 1e6:.1f} TF; no busy sample ({load['rows']})", flush=True)
        return
    tf = flops / load["us"] / 1e6
    ghz = load["clock"] * 1e-3
    print(f"{name}: burst {flops / burst / 1e6:.1f} TF; sustained {tf:.1f} TF, SM clock {load['clock']:.0f} MHz, "
          f"{load['power']:.0f} W, {load['power'] / tf:.3f} pJ a FLOP, {tf / ghz:.1f} TF per GHz "
          f"({tf / ghz / PEAK_PER_GHZ:.0%} of the tensor pipe), copies into the SMs "
          f"{copy_bytes / load['us'] / 1e6:.2f} TB/s, throttle {load['reasons']}", flush=True)  # fmt: skip


def main() -> int:
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("mma_energy: needs an sm90 GPU")
        return 0
    from common import bench_us, env_line, sustained_load

    from openmla.ops._gluon import TensorDescriptor

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    num_warps = 8
    m = 16 * num_warps
    x = (torch.randn(CHUNKS * (m + 256) * 64, device="cuda") * 0.5).to(torch.bfloat16)
    out = torch.empty(sms, device="cuda")
    pool = torch.randn(TILES * 64, 576, device="cuda").to(torch.bfloat16)
    swz = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    half_desc = TensorDescriptor(pool, list(pool.shape), [576, 1], [64, 256], swz)
    rope_desc = TensorDescriptor(pool, list(pool.shape), [576, 1], [64, 64], swz)
    print(env_line(), f"| {sms} programs x {num_warps} warps, chains of {CHAIN} MMAs (K = 64 each)")

    def measure(name, run, flops, copy_bytes):
        run()
        torch.cuda.synchronize()
        time.sleep(1.0)
        _report(name, flops, bench_us(run, rep=50), sustained_load(run, SECONDS), copy_bytes)

    for n, rs, gap, n_copy in CASES:
        iters = 3000 * 64 // n  # about 10 ms a launch (without a gap)

        def run(n=n, rs=rs, iters=iters, gap=gap, n_copy=n_copy):
            mma_loop[(sms,)](x, out, iters, gap, n_copy, half_desc, rope_desc, N=n, RS=bool(rs), CHUNKS=CHUNKS,
                             CHAIN=CHAIN, TILES=TILES, num_warps=num_warps)  # fmt: skip

        name = f"m64n{n}k16 {'A in registers' if rs else 'A in shared memory'}"
        name += f", {gap} ns sleep a chain" if gap else ""
        name += f", {n_copy} tiles copied a chain" if n_copy else ""
        measure(name, run, 2.0 * sms * iters * CHAIN * m * n * 64, sms * iters * n_copy * 64 * 576 * 2)

    # MMAs fed through a ring of stages (the decode kernel's data flow), refilled by the MMA warps or by a copy warp
    big = torch.randn(max(t for _, _, t, _ in RING_CASES) * 64, 576, device="cuda").to(torch.bfloat16) if RING_CASES \
        else pool  # fmt: skip
    for box, stages, tiles, ws in RING_CASES:
        src = big if tiles * 64 > pool.shape[0] else pool
        descs = (TensorDescriptor(src, list(src.shape), [576, 1], [box, 256], swz),
                 TensorDescriptor(src, list(src.shape), [576, 1], [box, 64], swz))
        mmas = box // 32
        n_tiles = 7700 * 2 // mmas

        def run(n_tiles=n_tiles, descs=descs, mmas=mmas, stages=stages, box=box, tiles=tiles, ws=ws):
            mma_ring[(sms,)](x, out, n_tiles, *descs, MMAS=mmas, STAGES=stages, BOX=box, TILES=tiles, WS=bool(ws),
                             num_warps=num_warps)  # fmt: skip

        name = (f"ring of {stages} x {box}-key stages from {'L2' if tiles <= 64 else 'HBM'}, refills by "
                f"{'a copy warp' if ws else 'the MMA warps'}")
        measure(name, run, 2.0 * sms * n_tiles * mmas * m * 256 * 64, sms * n_tiles * box * 576 * 2)
    big = None

    # the copies from a warp of their own (the MMAs never wait on a copy's issue)
    for n_copy in WS_CASES:
        iters = 3000 * 64 // 256

        def run(iters=iters, n_copy=n_copy):
            mma_loop_ws[(sms,)](x, out, iters, n_copy, half_desc, rope_desc, N=256, CHUNKS=CHUNKS, CHAIN=CHAIN,
                                TILES=TILES, num_warps=num_warps)  # fmt: skip

        measure(f"m64n256k16, {n_copy} tiles a chain from a copy warp", run, 2.0 * sms * iters * CHAIN * m * 256 * 64,
                sms * iters * n_copy * 64 * 576 * 2)  # fmt: skip

    # the same copies by inline PTX: alone, in 2-CTA clusters, and multicast in them
    tmap = _tensor_map(pool)
    for mode, n_copy, cluster in PTX_CASES:
        iters = 3000 * 64 // 256
        kw = dict(N=256, CHUNKS=CHUNKS, CHAIN=CHAIN, TILES=TILES, MC=mode == "mc", CLUSTER=cluster,
                  num_warps=num_warps)  # fmt: skip
        args = (x, out, iters, n_copy, tmap)
        first = mma_loop_ptx.warmup(*args, grid=(sms,), DST_OFF=0, BAR_OFF=0, **kw)
        dst_off, bar_off = _alloc_offsets(first.asm["ttgir"])
        kw.update(DST_OFF=dst_off, BAR_OFF=bar_off)
        k = mma_loop_ptx.warmup(*args, grid=(sms,), **kw)
        if cluster > 1:  # compiled for one CTA; Triton's launcher multiplies the grid by the metadata's cluster size
            k.packed_metadata = (k.packed_metadata[0], cluster) + tuple(k.packed_metadata[2:])

        def run(args=args, kw=kw, cluster=cluster):
            mma_loop_ptx[(sms // cluster,)](*args, **kw)

        name = f"m64n256k16, {n_copy} tiles a chain by PTX" + (f", clusters of {cluster}" if cluster > 1 else "")
        name += ", multicast" if mode == "mc" else ""
        measure(name, run, 2.0 * sms * iters * CHAIN * m * 256 * 64, sms * iters * n_copy * 64 * 576 * 2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
