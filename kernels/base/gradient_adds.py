"""dQ's float32 atomic adds, as the tensor-core backwards make them (chapters 11 and 12).

A block of keys adds its share of dQ_i = scale dS K_j into dQ, which every key block of the
head adds into too: float32 atomic adds (FlashAttention-2's dQ accumulator; the sum's last
bits vary from run to run). An accumulator fragment holds two neighbouring columns of a
row, so one ``red.global.add.v2.f32`` adds both where the pair lies inside d and the rows
are aligned; elsewhere each column is added alone.
"""

from __future__ import annotations

from numba import cuda

from kernels.base.mma import red_add_pair

__all__ = ["add_pair_to_dq"]


@cuda.jit(device=True, inline=True)
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
