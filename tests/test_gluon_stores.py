"""The 16-byte store layout of the Gluon epilogues (openmla/ops/gluon/stores.py): a bijection onto the tile, 8
consecutive columns a thread, the wgmma accumulator's rows in each warp."""

import itertools

import pytest

from openmla.ops.gluon import stores

pytestmark = pytest.mark.skipif(not stores.GLUON_AVAILABLE, reason="triton.experimental.gluon is not installed")


def _coords(bases, index):
    r = c = 0
    for bit, (dr, dc) in enumerate(bases):
        if index >> bit & 1:
            r ^= dr
            c ^= dc
    return r, c


@pytest.mark.parametrize("cols, warps_n", [(128, 1), (256, 1), (512, 2)])
def test_row_store_layout_covers_the_tile(cols, warps_n):
    lay = stores.row_store_layout(cols, warps_n)
    assert lay.shape == [64, cols] and lay.block_bases == []
    regs, lanes, warps = lay.reg_bases, lay.lane_bases, lay.warp_bases
    assert len(lanes) == 5 and len(warps) == 2 + (warps_n == 2)
    seen = set()
    span = cols // warps_n
    for w, ln in itertools.product(range(1 << len(warps)), range(32)):
        owned = [_coords(regs, i) for i in range(1 << len(regs))]
        base = (_coords(lanes, ln)[0] ^ _coords(warps, w)[0], _coords(lanes, ln)[1] ^ _coords(warps, w)[1])
        cells = [(base[0] ^ r, base[1] ^ c) for r, c in owned]
        # the first 8 registers: 8 consecutive columns of one row (16 bytes of bf16)
        assert cells[:8] == [(cells[0][0], cells[0][1] + k) for k in range(8)] and cells[0][1] % 8 == 0
        # the wgmma accumulator's rows: warp w % 4 holds rows [16 (w % 4), 16 (w % 4) + 16), its column block w // 4
        assert all(16 * (w % 4) <= r < 16 * (w % 4) + 16 and c // span == w // 4 for r, c in cells)
        seen.update(cells)
    assert seen == {(r, c) for r in range(64) for c in range(cols)}


def test_row_store_layout_refuses_other_shapes():
    for args in [(96, 1), (32, 1), (512, 4), (256, 8)]:
        with pytest.raises(ValueError, match="row_store_layout"):
            stores.row_store_layout(*args)
