"""The 16-byte store layout for a wgmma accumulator's rows (the Gluon kernels' output epilogues).

A wgmma accumulator gives each thread 2 consecutive columns of a row, so a store straight from it writes 4 bytes
of bf16 a thread and a warp covers 16 bytes of each of 8 rows. :func:`row_store_layout` keeps the rows in the
same warps but gives each thread 8 consecutive columns (16 bytes; the 4 threads of a quad hold 64 bytes of one
row), so the stores are 16-byte ones. The conversion only changes which thread of a warp holds a value; the
compiler still routes it through a ~4 KB shared-memory scratch with partition barriers. On the H200 (stop 51) it
took 2-11% off the dense prefill and 9-15% off V4's sparse prefill, whose epilogues write 32-64 KB an item.
"""

from __future__ import annotations

from openmla.ops.gluon._lang import GLUON_AVAILABLE, gl

__all__ = ["row_store_layout"]


def row_store_layout(cols: int, warps_n: int = 1):
    """The store layout of a ``[64, cols]`` accumulator of ``4 * warps_n`` warps (a wgmma layout with
    ``warps_per_cta=[4, warps_n]``: 16 rows a warp, ``cols / warps_n`` columns a warp column): registers hold 8
    consecutive columns and row + 8, lanes 4 column groups of 8 and 8 rows."""
    if not GLUON_AVAILABLE:  # pragma: no cover - depends on the installed triton
        raise RuntimeError("row_store_layout needs triton's Gluon")
    span = cols // warps_n
    if warps_n not in (1, 2) or span < 64 or span & (span - 1):
        raise ValueError(f"row_store_layout: want warps_n 1 or 2 and a power-of-two span >= 64; got {cols}, {warps_n}")
    reg = [[0, 1], [0, 2], [0, 4], [8, 0]] + [[0, c] for c in (32, 64, 128, 256) if c < span]
    lane = [[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]]
    warp = [[16, 0], [32, 0]] + ([[0, span]] if warps_n == 2 else [])
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=warp, block_bases=[],
                                      shape=[64, cols])  # fmt: skip
