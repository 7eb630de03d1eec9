"""Gluon helpers of the kernels that compute both attention products transposed, ``S^T = K Q^T`` and
``O^T = V^T P^T``, so that a program's rows are the wgmma's N (:mod:`openmla.ops.gluon.sparse_narrow`,
:mod:`openmla.ops.gluon.decode_narrow`): a tile's scores, one step of the online softmax down the columns of ``S^T``
with its ``P V``, and the per-row values of the epilogue (``_finish_rows`` also serves the 64-head sparse kernel)."""

from __future__ import annotations

from openmla.ops.gluon._lang import GLUON_AVAILABLE, fence_async_shared, gl, gluon, warpgroup_mma, warpgroup_mma_wait

if GLUON_AVAILABLE:

    @gluon.jit
    def _scores_t(k_lat, rope, q_smem, s_zero, HAS_ROPE: gl.constexpr):
        """``S^T [64, HB]`` of one tile: the 8 latent chunks of ``k_lat [64, 512]`` (+ ``rope [64, 64]``) against the
        Q chunks of ``q_smem [9 or 8, HB, 64]``, chained async wgmmas, waited."""
        b_s = warpgroup_mma(k_lat.slice(0, 64, dim=1), q_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                            is_async=True)  # fmt: skip
        for c in gl.static_range(1, 8):
            b_s = warpgroup_mma(k_lat.slice(c * 64, 64, dim=1), q_smem.index(c).permute((1, 0)), b_s, is_async=True)
        if HAS_ROPE:
            b_s = warpgroup_mma(rope, q_smem.index(8).permute((1, 0)), b_s, is_async=True)
        return warpgroup_mma_wait(0, deps=(b_s,))

    @gluon.jit
    def _softmax_pv_t(b_s, b_m, b_lv, acc, k_lat, p_smem):
        """One tile of the online softmax down the columns of the masked, scaled scores ``b_s [64, HB]`` (base 2;
        ``b_m`` the running column max, ``b_lv`` the column sums kept per key row) and ``O^T += V^T P^T`` with V the
        tile's 512 columns (``k_lat`` seen MN-major), P through ``p_smem [HB, 64]`` (K-major B). Returns the new
        ``(b_m, b_lv, acc)``; every warp of the warpgroup is then done with the tile and with P."""
        b_m_new = gl.maximum(b_m, gl.max(b_s, axis=0))
        b_m_use = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = gl.exp2(b_m - b_m_use)
        b_p = gl.exp2(b_s - gl.expand_dims(b_m_use, 0))
        b_lv = b_lv * gl.expand_dims(b_alpha, 0) + b_p
        p_smem.store(gl.permute(b_p.to(p_smem.dtype), (1, 0)))
        fence_async_shared()
        gl.thread_barrier()  # all of P is written

        acc = acc * gl.expand_dims(b_alpha, 0)
        acc = warpgroup_mma(k_lat.permute((1, 0)), p_smem.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        gl.thread_barrier()
        return b_m_new, b_lv, acc

    @gluon.jit
    def _finish_rows(b_l, b_m, scale):
        """Per row, from its sum ``b_l`` and base-2 max ``b_m`` (any kernel's rows): whether it saw no key, its
        natural-log LSE of the scaled scores (-inf if none) and its output factor ``scale / row sum`` (0 if none)."""
        empty = b_l == 0.0
        b_lse = gl.where(empty, float("-inf"), (b_m + gl.log2(gl.where(empty, 1.0, b_l))) * 0.6931471805599453)
        return empty, b_lse, gl.where(empty, 0.0, scale / gl.where(empty, 1.0, b_l))

    @gluon.jit
    def _finish_t(b_lv, b_m, scale):
        """``_finish_rows`` of the rows of ``S^T`` (its columns), their sums kept per key row in ``b_lv``."""
        return _finish_rows(gl.sum(b_lv, axis=0), b_m, scale)
