"""How fast one SM can pull KV bytes into shared memory, by TMA, by cp.async, and by both at once (H200 experiment).

seesaw-pair-el's refills take 1,900-2,400 cycles to land (32-40 KB groups, RESULTS.md run 64), and its scores often
wait for them. Run 69 (``tma_throughput.py``) measured 36 B a cycle a SM with every SM copying: that is the chip's
L2 bandwidth shared by 132 SMs, not what one SM's copy path can take. This measures the per-SM side: programs on
1 to 132 SMs stream 32 KB groups (the rows of a random 64-row page, latent columns 0-255) from a cache-shaped pool
into a ring of ``STAGES`` slots, refilling each slot as soon as it landed, by

- ``tma``: one ``[64, 256]`` TMA box a group (as the seesaw kernels' refills);
- ``cpa``: cp.async, 16 bytes a thread and instruction, four ``[64, 64]`` chunks a group, by 4 warps;
- ``both``: the two rings side by side in one loop (a TMA group and a cp.async group an iteration).

If one SM alone gets well over 36 B a cycle by TMA, a refill's latency in the kernel is the chip's L2 bandwidth and
queueing; if ``both`` adds to ``tma``, part of a refill could go by cp.async (a copy warp's LSU path).

    PYTHONPATH=$PWD python3 benchmarks/experiments/copy_paths.py     # COPY_GRIDS="1,8,33,66,132" COPY_STAGES=3
"""

from __future__ import annotations

import os
import sys

import torch

from openmla.ops._gluon import (
    GLUON_AVAILABLE,
    TensorDescriptor,
    async_copy,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    tma,
)

GROUP = 64 * 256 * 2  # bytes a group: one latent half of a 64-key tile
GROUP_BYTES = gl.constexpr(GROUP) if GLUON_AVAILABLE else GROUP
MODES = {"tma": 0, "cpa": 1, "both": 2}

if GLUON_AVAILABLE:

    @gluon.jit
    def _clock(pid):
        return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [pid], dtype=gl.int64, is_pure=False,
                                         pack=1)  # fmt: skip

    @gluon.jit
    def _issue(desc, pool, offs, tma_smem, cpa_smem, bars, slot, row, MODE: gl.constexpr):
        """Start group ``slot`` of each ring this mode has, from the page at ``row``."""
        if MODE != 1:
            mbarrier.expect(bars.index(slot), GROUP_BYTES)
            tma.async_copy_global_to_shared(desc, [row, 0], bars.index(slot), tma_smem.index(slot))
        if MODE != 0:
            base = pool + row.to(gl.int64) * 576
            for c in gl.static_range(4):
                async_copy.async_copy_global_to_shared(cpa_smem.index(slot * 4 + c), base + (c * 64 + offs))
            async_copy.commit_group()

    @gluon.jit
    def _copy_stream(desc, pool, rows, n_rows, iters, cycles, STAGES: gl.constexpr, MODE: gl.constexpr):
        """Program p streams the pages at ``rows[(p * iters + i) % n_rows]``, i < iters, through its rings; stores
        its cycle count (first copy issued to last group landed) in ``cycles[p]``."""
        pid = gl.program_id(0)
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        CHUNK: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        o_r = gl.arange(0, 64, layout=gl.SliceLayout(1, LD))
        o_c = gl.arange(0, 64, layout=gl.SliceLayout(0, LD))
        offs = gl.expand_dims(o_r * 576, 1) + gl.expand_dims(o_c, 0)
        tma_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES if MODE != 1 else 1, 64, 256], desc.layout)
        cpa_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES * 4 if MODE != 0 else 1, 64, 64], CHUNK)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        fence_async_shared()
        t0 = _clock(pid)
        for s in gl.static_range(STAGES):
            _issue(desc, pool, offs, tma_smem, cpa_smem, bars, s, gl.load(rows + (pid * iters + s) % n_rows), MODE)
        for i in range(iters):
            slot = i % STAGES
            if MODE != 1:
                mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
            if MODE != 0:
                async_copy.wait_group(STAGES - 1)
            if i + STAGES < iters:
                row = gl.load(rows + (pid * iters + i + STAGES) % n_rows)
                _issue(desc, pool, offs, tma_smem, cpa_smem, bars, slot, row, MODE)
            elif MODE != 0:
                async_copy.commit_group()  # an empty group keeps wait_group's count
        t1 = _clock(pid)
        gl.store(cycles + pid, t1 - t0)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))


def measure(pool, rows, desc, grid: int, mode: str, stages: int, iters: int) -> str:
    """Stream on ``grid`` SMs; returns one line: the chip's GB/s and the median bytes a cycle a program."""
    cycles = torch.zeros(grid, dtype=torch.int64, device="cuda")

    def launch():
        _copy_stream[(grid,)](desc, pool, rows, rows.numel(), iters, cycles, STAGES=stages, MODE=MODES[mode],
                              num_warps=4)  # fmt: skip

    launch()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    groups = 2 if mode == "both" else 1
    moved = iters * GROUP * groups
    per_cycle = moved / cycles.double()
    t = min(times)
    return (f"{mode:>4} stages {stages} on {grid:>3} SMs: {grid * moved / t / 1e9:7.0f} GB/s, "
            f"{per_cycle.median().item():6.1f} B/cycle a SM (min {per_cycle.min().item():.1f}, "
            f"max {per_cycle.max().item():.1f}), {moved / (t * 1e9):6.1f} GB/s a SM")  # fmt: skip


def main() -> int:
    if not GLUON_AVAILABLE or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("copy_paths: needs Gluon and an sm90 GPU")
        return 0
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grids = [int(g) for g in os.environ.get("COPY_GRIDS", f"1,8,33,66,{sms}").split(",")]
    stages = int(os.environ.get("COPY_STAGES", "3"))
    iters = int(os.environ.get("COPY_ITERS", "2000"))
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    for pool_bytes in (24 << 20, 2 << 30):
        n = pool_bytes // (576 * 2) // 64 * 64
        pool = torch.randn(n, 576, device="cuda").to(torch.bfloat16)
        pages = n // 64
        rows = (torch.randperm(pages, device="cuda")[: min(pages, 1 << 20)] * 64).to(torch.int32)
        rows = rows.repeat((sms * iters) // rows.numel() + 1)[: sms * iters].contiguous()
        desc = TensorDescriptor(pool, list(pool.shape), list(pool.stride()), [64, 256], layout)
        print(f"# pool {pool_bytes / 2**20:.0f} MiB ({'L2' if pool_bytes < (40 << 20) else 'HBM'})", flush=True)
        for mode in MODES:
            for grid in grids:
                print(measure(pool, rows, desc, grid, mode, stages, iters), flush=True)
        del desc, pool
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
