"""dQ's float32 atomic adds, as the tensor-core backwards make them (chapters 11 and 12).

A block of keys adds its share of dQ_i = scale dS K_j into dQ, which every key block of the
head adds into too: float32 atomic adds (FlashAttention-2's dQ accumulator; the sum's last
bits vary from run to run). An accumulator fragment holds two neighbouring columns of a
row, so one ``red.global.add.v2.f32`` adds both where the pair lies inside d and the rows
are aligned; elsewhere each column is added alone.

A warp adds whole tiles of 16 rows (``make_tile_adds``). Where its 16 rows lie below Nq, its
columns below d and the rows are aligned (one test for the warp, not one a pair), every pair
goes straight to ``red.global.add.v2.f32`` with unsigned indices: no bounds test, and no
negative-index arithmetic (Numba's for a signed index), which had cost about 25
instructions a pair, more than the products that made them.
"""

from __future__ import annotations

import functools

from numba import cuda, uint32

from kernels.base.inlined import inlined
from kernels.base.mma import red_add_pair

__all__ = ["add_pair_to_dq", "make_tile_adds"]


@inlined
def add_pair_to_dq(dqh, row, col, x0, x1, n_q, d, aligned):
    """dqh[row, col] += x0 and dqh[row, col + 1] += x1, for a row below n_q and the columns
    below d; ``aligned`` (0/1): rows 16-byte aligned and d even, so a whole pair goes at once."""
    if row < n_q:
        if aligned != 0 and col + 2 <= d:
            red_add_pair(dqh, row, col, x0, x1)
        else:
            if col < d:
                cuda.atomic.add(dqh, (row, col), x0)
            if col + 1 < d:
                cuda.atomic.add(dqh, (row, col + 1), x1)


@functools.lru_cache(maxsize=None)
def make_tile_adds(T: int):
    """Device function ``add_tiles(dqh, acc, row0, col0, g, t, scale, n_q, d, aligned)``: a warp's
    T accumulator tiles (16 rows x 8 columns each, side by side from column col0; ``acc[j, e]``
    the lane's element e of tile j, as mma.sync leaves it) times ``scale`` added into dqh: the
    lane (group g, t) adds rows row0 + g and row0 + g + 8, columns col0 + 8 j + 2 t and the next.
    One test for the whole warp picks the unchecked path (rows, columns inside, aligned)."""

    @inlined
    def add_tiles(dqh, acc, row0, col0, g, t, scale, n_q, d, aligned):
        if aligned != 0 and row0 + 16 <= n_q and col0 + 8 * T <= d:
            r = uint32(row0 + g)
            c = uint32(col0 + 2 * t)
            for j in range(T):
                for h in range(2):
                    red_add_pair(dqh, r + uint32(8 * h), c + uint32(8 * j), acc[j, 2 * h] * scale,
                                 acc[j, 2 * h + 1] * scale)
        else:
            for j in range(T):
                for h in range(2):
                    add_pair_to_dq(dqh, row0 + g + 8 * h, col0 + 8 * j + 2 * t, acc[j, 2 * h] * scale,
                                   acc[j, 2 * h + 1] * scale, n_q, d, aligned)

    return add_tiles
