"""Splitting the queries of a backward among blocks, when its grid is too small (chapter 13).

The tensor-core backwards (chapters 11 and 12) give a block one key tile of one KV head:
it keeps dK_j and dV_j in registers while it walks every (query head, query tile) pair
that sees those keys. With few heads (B*Hkv = 1, N = 4096, Bc = 128: 32 blocks on an
H100's 132 SMs) most SMs idle while each block walks 4096 queries. Then the walk is split:
grid (key tiles, B*Hkv, S), block z walking its share of the pairs (``make_block_steps``), and
each block adds its dK_j and dV_j into zeroed gradients with float32 atomic adds (dQ
already comes by atomic adds), S blocks a key tile. No merge kernel is needed, only the
zeroing (``make_zero_pair``) before; the price is dK's and dV's last bits, which vary from
run to run as dQ's do.
"""

from __future__ import annotations

import functools

from numba import cuda, float32, int32

from kernels.base.inlined import inlined
from kernels.base.key_split import block_share, multiprocessors
from kernels.base.runtime import cdiv

__all__ = ["make_block_steps", "make_gradient_store", "make_zero_pair", "choose_query_splits", "query_splits_for",
           "add_zero_gradients", "MAX_SPLITS"]

MAX_SPLITS = 16           # each split adds a key tile's dK_j and dV_j once more
ZERO_ROWS = 4             # rows a zeroing block (one warp each)


@functools.lru_cache(maxsize=None)
def make_block_steps(split: bool):
    """Device function (steps) -> (s0, s1): the steps s0 .. s1 - 1 of a key tile's walk of
    ``steps`` (query head, query tile) pairs that this block takes: all of them, or with
    ``split`` block z's share (``kernels.base.key_split.block_share``)."""

    @inlined
    def block_steps(steps):
        if split:
            return block_share(steps)
        return 0, steps

    return block_steps


@functools.lru_cache(maxsize=None)
def make_gradient_store(split: bool):
    """Device function (dk, dv, bkv, key, col, xk, xv) that puts a block's dK_j and dV_j
    element where it goes: stored, or with ``split`` added atomically (the other splits of the
    key tile add theirs)."""

    @inlined
    def store(dk, dv, bkv, key, col, xk, xv):
        if split:
            cuda.atomic.add(dk, (bkv, key, col), xk)
            cuda.atomic.add(dv, (bkv, key, col), xv)
        else:
            dk[bkv, key, col] = xk
            dv[bkv, key, col] = xv

    return store


@functools.lru_cache(maxsize=None)
def make_zero_pair():
    """Kernel (a, b): two (X, R, C) float32 arrays of one shape set to zero. Grid
    (ceil(R / 4), X), 128 threads: a warp a row, its lanes over C."""

    @cuda.jit
    def zero_pair(a, b):
        x = int32(cuda.blockIdx.y)
        row = int32(cuda.blockIdx.x) * ZERO_ROWS + int32(cuda.threadIdx.x) // 32
        lane = int32(cuda.threadIdx.x) % 32
        if row < a.shape[1]:
            for c in range(lane, a.shape[2], 32):
                a[x, row, c] = float32(0.0)
                b[x, row, c] = float32(0.0)

    zero_pair.threads = 32 * ZERO_ROWS
    return zero_pair


def choose_query_splits(blocks: int, pairs: int, Br: int, sms: int | None = None) -> int:
    """S: 1 while the unsplit grid's ``blocks`` fill the SMs once; else as many as fit in
    one wave (``sms`` // blocks: a block of these kernels takes a whole SM's shared memory),
    each split walking at least two query tiles of Br rows (of ``pairs`` query rows in all:
    the heads of a KV group times Nq), at most ``MAX_SPLITS``."""
    sms = multiprocessors() if sms is None else sms
    if blocks <= 0 or 2 * blocks > sms:
        return 1
    return max(1, min(sms // blocks, cdiv(pairs, 2 * Br), MAX_SPLITS))


def query_splits_for(B: int, H: int, hkv: int, n_q: int, n_k: int, Br: int, W: int) -> int:
    """``choose_query_splits`` for a backward's call: B x Hkv KV heads of Nk keys, a block a
    key tile of 16 W keys, walking the H / Hkv query heads' Nq rows in tiles of Br."""
    return choose_query_splits(cdiv(n_k, 16 * W) * B * hkv, (H // max(hkv, 1)) * n_q, Br)


ZERO_SLOTS = {"dk": 0, "dv": 1}


def add_zero_gradients(launches: list, slots: list, views: dict, splits: int) -> None:
    """With S > 1, the zeroing of dK and dV put first among a ``BoundLaunches``' launches
    and slots (``views``' dk and dv, (B*Hkv, Nk, d))."""
    if splits == 1:
        return
    zero = make_zero_pair()
    bkv, n_k = views["dk"].shape[:2]
    launches.insert(0, (zero, (cdiv(n_k, ZERO_ROWS), bkv), zero.threads, (views["dk"], views["dv"]), 0))
    slots.insert(0, ZERO_SLOTS)
