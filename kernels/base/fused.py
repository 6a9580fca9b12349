"""What the fused kernels (chapters 4, 5, 6 and the chapters after them) share.

Not an algorithm: the vocabulary the chapters' kernels are written in.

    Tiles            one tile configuration: Br query rows, Bc key rows, TM rows a thread,
                     TX threads sharing a row
    run_length(n)    a thread's rows (columns) come in runs this long: 4 floats are one
                     16-byte shared-memory load
    padded_head_dim  D, the compile-time head dim a kernel is built for
    make_row_reductions(TX, threads)
                     row_max / row_sum over the TX neighbouring threads of a row
    nan_max(a, b)    the larger of a and b, NaN if either is NaN
    load_kv_or_zero  one K and one V element, zero past the keys or the head dim
    FASTMATH         the fast-math flags the kernels use: everything but "no NaN" and
                     "no Inf", so that a NaN in an input row reaches its output row
    MASKED           the finite score of a masked key (the kernels never compute with -inf)

Names follow the FlashAttention papers: S scores, P probabilities, m the running row
maximum, l the running row sum, O the output, L the row logsumexp, D = rowsum(dO * O)
(only ever that: the padded head dimension is ``Dh`` where a kernel needs a name for it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, uint64

from kernels.base.inlined import FASTMATH, inlined
from kernels.base.runtime import on_simulator

__all__ = ["Tiles", "run_length", "padded_head_dim", "make_row_reductions", "nan_max", "FASTMATH", "MASKED",
           "MINUS_INF", "LOG2E", "ALIGN", "MAX_GRID_Y", "check_tiles_type"]


MASKED = np.float32(-1e30)        # a masked score: finite, so "no key yet" is a comparison
MINUS_INF = np.float32(-np.inf)   # only ever stored, as L of a row that sees no key
LOG2E = 1.4426950408889634        # exp(x) = exp2(x log2 e): one FMA and one ex2 instruction
MAX_GRID_Y = 65535                # one grid row a (batch, head)
# Shared rows start 16-byte aligned (vector loads); the simulator refuses the option.
ALIGN = None if on_simulator() else 16


@dataclass(frozen=True)
class Tiles:
    """A tile configuration: Br query rows a block, Bc key rows a K/V tile, TM rows of a
    thread's micro-tile, TX threads sharing a row (a power of two <= 32)."""

    Br: int
    Bc: int
    TM: int
    TX: int

    @property
    def threads(self) -> int:
        return (self.Br // self.TM) * self.TX

    def __str__(self):
        return f"Br={self.Br} Bc={self.Bc} TM={self.TM} TX={self.TX}"


def check_tiles_type(tiles, name: str = "tiles") -> Tiles:
    """TypeError/ValueError naming ``name`` unless ``tiles`` is a Tiles of positive ints."""
    if not isinstance(tiles, Tiles):
        raise TypeError(f"{name}: expected a Tiles(Br, Bc, TM, TX) or None, got {type(tiles).__name__}")
    for field in ("Br", "Bc", "TM", "TX"):
        value = getattr(tiles, field)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}: expected {field} a positive int, got {value!r}")
    return tiles


def run_length(n: int) -> int:
    """How many consecutive rows (columns) of a micro-tile a thread owns: 4 floats make one
    16-byte shared load; fewer when n is not a multiple of 4."""
    return 4 if n % 4 == 0 else (2 if n % 2 == 0 else 1)


def padded_head_dim(d: int, TX: int = 1) -> int:
    """D, the compile-time head dim: the next power of two >= d (and >= TX, >= 16 on a GPU);
    zeros fill the rest. A power of two, so that tile copies split the threads evenly."""
    D = 1 << max(0, int(d) - 1).bit_length()
    return max(D, TX, 1 if on_simulator() else 16)


@inlined
def nan_max(a, b):
    """max(a, b) that propagates NaN (Python's and Numba's max drop a NaN argument)."""
    if b > a or b != b:       # b != b: b is NaN (a NaN a falls through and is returned)
        return b
    return a


@inlined
def _plain_max(a, b):
    return max(a, b)         # max.f32: one instruction (a NaN operand gives the other one)


def make_kv_tile_copy(Bc: int, D: int, threads: int):
    """Device function ``copy_kv_tile(k, v, K_j, V_j, bh, k0, n_k, d, t)``: rows k0 .. k0 + Bc
    of head bh of K and V into the shared tiles K_j, V_j (Bc x D, float32), zeros past n_k
    and d; thread t of ``threads`` copies elements t, t + threads, ... The loop chapter 4's
    query-tile rung writes out (``make_query_tile_forward``), for the rungs built on it."""

    @inlined
    def copy_kv_tile(k, v, K_j, V_j, bh, k0, n_k, d, t):
        for e in range(t, Bc * D, threads):
            r, c = e // D, e % D
            inside = k0 + r < n_k and c < d
            K_j[r, c] = float32(k[bh, k0 + r, c]) if inside else float32(0.0)
            V_j[r, c] = float32(v[bh, k0 + r, c]) if inside else float32(0.0)

    return copy_kv_tile


@inlined
def load_kv_or_zero(kh, vh, r, c, n, d):
    """K[r, c] and V[r, c] as float32 (an fp16 cache widens on the way), 0 past the n rows
    or d columns: the address is clamped inside the arrays, so the load itself never
    faults, and the value is replaced after (no branch around the load)."""
    row = uint64(min(r, n - 1))
    col = uint64(min(c, d - 1))
    kx = float32(kh[row, col])
    vx = float32(vh[row, col])
    if r >= n or c >= d:
        kx = float32(0.0)
        vx = float32(0.0)
    return kx, vx


def make_row_reductions(TX: int, threads: int, propagate_nan: bool = True):
    """row_max(x), row_sum(x): reduce x over the TX neighbouring threads that share a row.

    On a GPU: a butterfly of log2(TX) warp shuffles (``shfl_xor``), no shared memory, no
    barrier (the TX threads of a row are consecutive lanes of one warp). The simulator has
    no shuffles: there the threads swap values through shared memory between barriers
    (every thread calls these together, as the lanes of a warp would). row_max propagates
    NaN; with ``propagate_nan=False``, on a GPU, it is one ``max.f32`` a step, which returns
    the other operand of a NaN (for a kernel where a NaN reaches the output another way)."""
    if not on_simulator():
        lanes = 0xFFFFFFFF if threads >= 32 else (1 << threads) - 1   # the lanes that exist
        pick = nan_max if propagate_nan else _plain_max

        @inlined
        def row_max(x):
            lane_mask = TX // 2
            while lane_mask > 0:
                x = pick(x, cuda.shfl_xor_sync(lanes, x, lane_mask))
                lane_mask //= 2
            return x

        @inlined
        def row_sum(x):
            lane_mask = TX // 2
            while lane_mask > 0:
                x += cuda.shfl_xor_sync(lanes, x, lane_mask)
                lane_mask //= 2
            return x
        return row_max, row_sum

    def exchange(x):
        swap = cuda.shared.array(threads, float32)
        tid = cuda.threadIdx.x
        cuda.syncthreads()
        swap[tid] = x
        cuda.syncthreads()
        return swap[tid - tid % TX: tid - tid % TX + TX]

    @cuda.jit(device=True)
    def row_max(x):
        out = x
        for y in exchange(x):
            out = nan_max(out, y)
        return out

    @cuda.jit(device=True)
    def row_sum(x):
        total = float32(0.0)
        for y in exchange(x):     # in lane order
            total += y
        return float32(total)
    return row_max, row_sum
