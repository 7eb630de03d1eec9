"""Gluon helpers shared by the Hopper decode kernels (:mod:`openmla.ops.decode_gluon`,
:mod:`openmla.ops.decode_gluon_seesaw`): page lookups of 32-key boxes for TMA, and zeroing the rows of a landed
tile that lie past the sequence end."""

from __future__ import annotations

from openmla.ops._gluon import GLUON_AVAILABLE, fence_async_shared, gl, gluon

if GLUON_AVAILABLE:

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
