"""Splitting the keys of a forward among blocks, when its grid is too small (chapter 13).

The fused forwards (chapters 8 and 11) give a block one query tile of one head and let it
walk every key tile in turn. With few heads and few query tiles (B*H = 1, N = 4096: 32
blocks on an H100's 132 SMs) most of the GPU idles while each block walks 4096 keys. Then
the keys are split: grid (query tiles, B*H, S), block z walking its share of the key tiles
(``split_range``) and writing a partial (O_z normalised by its own l_z, and L_z) to slot
z * B*H + bh of (S*B*H, Nq, ...) buffers; a second kernel (``make_combine_splits``) merges
the S partials of each row, as split-K decode does (chapter 7):

    L = log sum_z exp(L_z),   O = sum_z exp(L_z - L) O_z

A split that sees no key of a row (the causal mask, or fewer key tiles than splits) leaves
O_z = 0 and L_z = -inf, whose weight is 0; a row no split sees gets O = 0, L = -inf, as the
unsplit kernel gives it.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, int32

import numpy as np

from kernels.base.inlined import inlined
from kernels.base.runtime import cdiv, on_simulator, to_device

__all__ = ["block_share", "split_range", "make_combine_splits", "choose_splits", "partials", "partial_views", "output_names",
           "add_combine", "multiprocessors", "COMBINE_ROWS"]

COMBINE_ROWS = 4          # rows a combine block (one warp each: lanes over d)
MINUS_INF = float32(-math.inf)


@inlined
def block_share(n):
    """(first, end): block z's items first .. end - 1 of a walk of ``n`` (S = gridDim.z
    near-equal shares, the last ones shorter or empty; with S = 1 the whole walk). The
    forwards split their key tiles so, the backwards their (query head, query tile) pairs
    (``kernels.base.query_split``)."""
    z = int32(cuda.blockIdx.z)
    splits = int32(cuda.gridDim.z)
    share = (n + splits - 1) // splits
    first = min(z * share, n)
    return first, min(first + share, n)


@inlined
def split_range(n_tiles, bh):
    """(first, end, slot): block z's key tiles first .. end - 1 of the ``n_tiles`` its query
    tile sees (``block_share``), and its partial's row in the (S*B*H, ...) buffers. With
    S = 1: (0, n_tiles, bh), the whole walk."""
    first, end = block_share(n_tiles)
    return first, end, int32(cuda.blockIdx.z) * int32(cuda.gridDim.y) + bh


@functools.lru_cache(maxsize=None)
def make_combine_splits(o_type: str | None = None):
    """The merge: grid (ceil(Nq / COMBINE_ROWS), B*H), 32 * COMBINE_ROWS threads, a warp a
    row, its lanes over d. Arguments: o_part (S*B*H, Nq, d), l_part (S*B*H, Nq) float32 (slot
    z * B*H + bh), o (B*H, Nq, d) float32 (or with ``o_type`` "f16" / "bf16" their 16-bit
    patterns, rounded once here), lse (B*H, Nq) float32. A NaN L_z makes the row NaN."""
    from kernels.base.mma import make_output_store

    store = make_output_store(o_type)

    @cuda.jit(fastmath=False)
    def combine_splits(o_part, l_part, o, lse):
        bh = int32(cuda.blockIdx.y)
        heads = int32(cuda.gridDim.y)
        lane = int32(cuda.threadIdx.x) % 32
        row = int32(cuda.blockIdx.x) * COMBINE_ROWS + int32(cuda.threadIdx.x) // 32
        n_q, d = int32(o.shape[1]), int32(o.shape[2])
        splits = int32(l_part.shape[0]) // heads
        if row >= n_q:
            return
        top = MINUS_INF
        for z in range(splits):
            lz = l_part[z * heads + bh, row]
            if lz > top or lz != lz:                 # (a NaN wins, and stays)
                top = lz
            if top != top:
                break
        if top == MINUS_INF:                         # no split saw a key of this row
            for c in range(lane, d, 32):
                store(o, bh, row, c, float32(0.0))
            if lane == 0:
                lse[bh, row] = MINUS_INF
            return
        total = float32(0.0)
        for z in range(splits):
            total += math.exp(l_part[z * heads + bh, row] - top)
        for c in range(lane, d, 32):
            acc = float32(0.0)
            for z in range(splits):                  # (an empty split: O_z = 0, weight 0)
                slot = z * heads + bh
                acc += math.exp(l_part[slot, row] - top) * o_part[slot, row, c]
            store(o, bh, row, c, acc / total)
        if lane == 0:
            lse[bh, row] = top + math.log(total)

    combine_splits.threads = 32 * COMBINE_ROWS
    return combine_splits


COMBINE_SLOTS = {"o_part": 0, "l_part": 1, "o": 2, "lse": 3}     # a bound merge's arguments, by name


# What a forward's launcher does with S (``splits``): one split is the plain forward into o and
# lse; more, the forward into the partials and a merge into o and lse.

def partials(kind, splits: int, BH: int, n_q: int, d: int) -> dict:
    """The call's partial buffers by name, from ``kind``'s allocator: none for one split, else
    o_part (S*B*H, Nq, d) and l_part (S*B*H, Nq) float32."""
    if splits == 1:
        return {}
    return dict(o_part=kind.new((splits * BH, n_q, d), np.float32), l_part=kind.new((splits * BH, n_q), np.float32))


def partial_views(arrays: dict) -> dict:
    """Numba views of the partials among a call's ``arrays`` (none if it has none)."""
    return {name: to_device(arrays[name], name) for name in ("o_part", "l_part") if name in arrays}


def output_names(splits: int) -> tuple:
    """The forward kernel's two outputs: o and lse, or with S > 1 the partials."""
    return ("o", "lse") if splits == 1 else ("o_part", "l_part")


def add_combine(launches: list, slots: list, views: dict, splits: int, o_type: str | None = None) -> None:
    """With S > 1, the merge appended to a ``BoundLaunches``' launches and slots, on ``views``'
    o_part, l_part, o (B*H, Nq, d; float32, or 16-bit patterns of ``o_type``) and lse."""
    if splits == 1:
        return
    combine = make_combine_splits(o_type)
    BH, n_q = views["o"].shape[:2]
    launches.append((combine, (cdiv(n_q, COMBINE_ROWS), BH), combine.threads,
                     tuple(views[name] for name in COMBINE_SLOTS), 0))
    slots.append(COMBINE_SLOTS)


@functools.lru_cache(maxsize=None)
def multiprocessors() -> int:
    """The current GPU's SM count (1 in the simulator, where no split is chosen)."""
    return 1 if on_simulator() else int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def choose_splits(blocks: int, n_k: int, Bc: int, sms: int | None = None, whole_waves: bool = False) -> int:
    """S: 1 while the ``blocks`` of the unsplit grid fill the SMs once; else as many as it
    takes to (``sms`` blocks in all), each split walking at least two key tiles of Bc, at
    most 16 (each split costs a partial's write and read). ``whole_waves``: as many as fit in
    one wave instead (S blocks <= ``sms``, the blocks the GPU holds at once), for a kernel
    whose blocks run one an SM: one block past a wave would cost a second wave."""
    sms = multiprocessors() if sms is None else sms
    if blocks <= 0 or blocks >= sms:
        return 1
    most = sms // blocks if whole_waves else cdiv(sms, blocks)
    return max(1, min(most, cdiv(n_k, 2 * Bc) if n_k > 2 * Bc else 1, 16))
