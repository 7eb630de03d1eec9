"""Per-SM TMA read throughput on the H200, with no compute: what the seesaw-pair kernels' refills can get.

One program per SM streams ``[64, 256]`` bf16 boxes (32 KB: one latent half of a 64-key tile, the size of a
seesaw-pair refill group) by TMA from a cache-shaped ``[rows, 576]`` bf16 pool into a ring of ``STAGES``
shared-memory slots, refilling each slot as soon as its mbarrier says it landed. The boxes start at random
64-row pages of the pool: a small pool stays in L2, a large one (2 GiB) comes from HBM. Prints, per pool and ring
depth, the chip's GB/s and the bytes a program moved per SM cycle (its ``%clock64`` span over the loop).

    PYTHONPATH=$PWD python3 benchmarks/experiments/tma_throughput.py

The seesaw-pair-el kernel moves 147,456 bytes (two 64-key tiles) a pair: 28 bytes a cycle at its 5,224-5,297-cycle
pair period (RESULTS.md run 64), with two to four refill groups in flight.
"""

from __future__ import annotations

import sys

import torch

from openmla.ops._gluon import GLUON_AVAILABLE, TensorDescriptor, fence_async_shared, gl, gluon, mbarrier, tma

BOX = 64 * 256 * 2
BOX_BYTES = gl.constexpr(BOX) if GLUON_AVAILABLE else BOX

if GLUON_AVAILABLE:

    @gluon.jit
    def _tma_stream(desc, rows, n_rows, iters, cycles, STAGES: gl.constexpr):
        """Program p copies boxes at rows ``rows[(p * iters + i) % n_rows]``, i < iters, through a ring of
        ``STAGES`` slots; stores its cycle count (first copy issued to last copy landed) in ``cycles[p]``."""
        pid = gl.program_id(0)
        smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 64, 256], desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        fence_async_shared()
        t0 = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [pid], dtype=gl.int64, is_pure=False,
                                       pack=1)  # fmt: skip
        for s in gl.static_range(STAGES):
            row = gl.load(rows + (pid * iters + s) % n_rows)
            mbarrier.expect(bars.index(s), BOX_BYTES)
            tma.async_copy_global_to_shared(desc, [row, 0], bars.index(s), smem.index(s))
        for i in range(iters):
            slot = i % STAGES
            mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
            if i + STAGES < iters:
                row = gl.load(rows + (pid * iters + i + STAGES) % n_rows)
                mbarrier.expect(bars.index(slot), BOX_BYTES)
                tma.async_copy_global_to_shared(desc, [row, 0], bars.index(slot), smem.index(slot))
        t1 = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [pid], dtype=gl.int64, is_pure=False,
                                       pack=1)  # fmt: skip
        gl.store(cycles + pid, t1 - t0)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))


def make_stream(pool_bytes: int, iters: int):
    """A cache-shaped bf16 pool of about ``pool_bytes``, the random 64-row pages each of the SMs' programs copies
    (``iters`` each) and its descriptor; returns ``(launch(stages), cycles, sms, pool)`` (``launch`` runs
    ``_tma_stream`` once on every SM; keep ``pool`` alive while launching)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = pool_bytes // (576 * 2) // 64 * 64
    pool = torch.randn(n, 576, device="cuda").to(torch.bfloat16)
    pages = n // 64
    rows = (torch.randperm(pages, device="cuda")[: min(pages, 1 << 20)] * 64).to(torch.int32)
    rows = rows.repeat((sms * iters) // rows.numel() + 1)[: sms * iters].contiguous()
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    desc = TensorDescriptor(pool, list(pool.shape), list(pool.stride()), [64, 256], layout)
    cycles = torch.zeros(sms, dtype=torch.int64, device="cuda")

    def launch(stages: int):
        _tma_stream[(sms,)](desc, rows, rows.numel(), iters, cycles, STAGES=stages, num_warps=4)

    return launch, cycles, sms, pool


def measure(pool_bytes: int, stages: int, iters: int = 2000) -> str:
    launch, cycles, sms, pool = make_stream(pool_bytes, iters)
    launch(stages)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch(stages)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    t = min(times)
    total = sms * iters * BOX
    per_cycle = iters * BOX / cycles.double()
    del launch, pool  # (the launch holds the pool's descriptor)
    torch.cuda.empty_cache()
    return (f"pool {pool_bytes / 2**20:8.0f} MiB  stages {stages}: {total / t / 1e9:7.0f} GB/s over {sms} SMs, "
            f"{per_cycle.median().item():5.1f} B/cycle a SM (min {per_cycle.min().item():.1f}, max "
            f"{per_cycle.max().item():.1f}), {t * 1e6:.0f} us")  # fmt: skip


def main() -> int:
    if not GLUON_AVAILABLE or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("tma_throughput: needs Gluon and an sm90 GPU")
        return 0
    for pool in (24 << 20, 2 << 30):
        for stages in (1, 2, 4, 6):
            print(measure(pool, stages), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
