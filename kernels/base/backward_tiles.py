"""The backward's tiles (chapters 5 and 6): the tile type, how each product splits over a
block's threads, the shared-memory layouts, the checks, and the production table.

Vocabulary as in ``kernels.flash_backward``: Br query rows, Bc key rows; Dh the padded head
dim a kernel is compiled for (``D`` is only ever rowsum(dO * O)).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from kernels.base.fused import run_length
from kernels.base.runtime import on_simulator
from kernels.base.shared_memory import STATIC_LIMIT_BYTES, max_dynamic_shared_bytes

__all__ = ["BackwardTiles", "default_tiles", "check_tiles", "fits", "shared_bytes", "head_dim_bucket", "Grid",
           "split", "warp_split", "dkdv_layout", "dq_layout"]

HEAD_DIM_BUCKETS = (8, 16, 32, 64, 128)
MAX_SHARED_H100 = 227 * 1024      # the most shared memory one block may opt in to (tile choices)


def head_dim_bucket(d: int) -> int:
    """Dh, the compile-time head dim a kernel is built for: the smallest bucket >= d (zero padded)."""
    for bucket in HEAD_DIM_BUCKETS:
        if d <= bucket:
            return bucket
    raise ValueError(f"q: expected head dim d <= {HEAD_DIM_BUCKETS[-1]}, got {d}")


# --------------------------------------------------------------------------- splits over threads

def split(rows: int, cols: int, threads: int):
    """(TM, TN): each of ``threads`` threads owns TM x TN entries of a rows x cols result
    (the squarest that divides: fewest shared loads per FMA), or None."""
    if (rows * cols) % threads:
        return None
    per = rows * cols // threads
    options = [(tm + per // tm, tm) for tm in range(1, per + 1)
               if per % tm == 0 and rows % tm == 0 and cols % (per // tm) == 0]
    return None if not options else (min(options)[1], per // min(options)[1])


def warp_split(rows: int, cols: int, threads: int):
    """(TM, TN, LR, LC, WC): a warp's 32 lanes form an LR x LC grid covering (LR*TM) x
    (LC*TN) of the result, WC warps across its columns; lane (ly, lx) of warp w owns rows
    (w // WC)*LR*TM + ly + LR*a and columns (w % WC)*LC*TN + lx + LC*b. A warp's block is
    as square as possible (it reads LR*TM + LC*TN operand rows a step). None if nothing divides."""
    lanes = min(32, threads)
    if threads % lanes or (rows * cols) % threads:
        return None
    per, options = rows * cols // threads, []
    for tm in (tm for tm in range(1, per + 1) if per % tm == 0):
        tn = per // tm
        for lr in (lr for lr in range(1, lanes + 1) if lanes % lr == 0):
            lc = lanes // lr
            if rows % (lr * tm) == 0 and cols % (lc * tn) == 0 and \
                    (rows // (lr * tm)) * (cols // (lc * tn)) == threads // lanes:
                options.append(((lr * tm + lc * tn, tm + tn, tm), (tm, tn, lr, lc, cols // (lc * tn))))
    return min(options)[1] if options else None


def need(how, rows, cols, threads, what):
    """``how(rows, cols, threads)`` (``split`` or ``warp_split``), or ValueError naming tiles."""
    got = how(rows, cols, threads)
    if got is None:
        raise ValueError(f"tiles: {what} ({rows} x {cols}) does not split evenly over {threads} threads")
    return got


@dataclass(frozen=True)
class Grid:
    """An R x C result over NT threads: thread (ty, tx) owns M x N entries, its rows in runs
    of VR (run k of a thread starts at row (k*TR + ty)*VR), its columns in runs of VC (a run of
    4 floats is one 16-byte shared-memory load)."""
    M: int
    N: int
    TR: int      # threads down (R / M)
    TC: int      # threads across (C / N)
    VR: int
    VC: int

    @classmethod
    def of(cls, R, C, NT, what, row_runs=True):
        M, N = need(split, R, C, NT, what)
        return cls(M, N, R // M, C // N, run_length(M) if row_runs else 1, run_length(N))


# --------------------------------------------------------------------------- shared memory

def dkdv_layout(Br, Bc, Dh, merged=False):
    """Offsets (floats) of the dK/dV kernel's shared tiles K_j, V_j, Q_i, dO_i, P, dS, L_i, D_i
    and the running sums of dV_j, dK_j (Bc x Dh each), and the total. Row strides Dh + 4 and
    Bc + 4: every row 16-byte aligned, and the 8 threads of a 16-byte load phase reading 8
    rows hit 8 bank groups. ``merged``: P and dS share one buffer (two more barriers a step)."""
    LD, LP = Dh + 4, Bc + 4
    o_k, o_v = 0, Bc * LD
    o_q = o_v + Bc * LD
    o_do = o_q + Br * LD
    o_p = o_do + Br * LD
    o_ds = o_p if merged else o_p + Br * LP
    o_l = o_ds + Br * LP
    o_d = o_l + Br
    o_sv = -(-(o_d + Br) // 4) * 4                      # 16-byte aligned
    o_sk = o_sv + Bc * Dh
    return (o_k, o_v, o_q, o_do, o_p, o_ds, o_l, o_d, o_sv, o_sk), o_sk + Bc * Dh


def dq_layout(Br, Bc, Dh):
    """Offsets of the dQ kernel's shared tiles Q_i, dO_i, K_j, V_j, dS, L_i, D_i and the
    running sum of dQ_i (Br x Dh), and the total."""
    LD, LP = Dh + 4, Bc + 4
    o_q, o_do = 0, Br * LD
    o_k = o_do + Br * LD
    o_v = o_k + Bc * LD
    o_ds = o_v + Bc * LD
    o_l = o_ds + Br * LP
    o_d = o_l + Br
    o_sq = -(-(o_d + Br) // 4) * 4
    return (o_q, o_do, o_k, o_v, o_ds, o_l, o_d, o_sq), o_sq + Br * Dh


# --------------------------------------------------------------------------- the tile type

@dataclass(frozen=True)
class BackwardTiles:
    """The backward's tiles (compile-time constants of its kernels).

    dK/dV kernel: a block owns ``Bc`` key rows and steps over ``Br`` query rows at a time,
    ``threads`` threads. Separate dQ kernel: a block owns ``dq_Br`` query rows and steps over
    ``dq_Bc`` key rows, ``dq_threads`` threads. ``merged``: P and dS in one shared buffer
    (None: only where the block would not fit otherwise). The defaults are the d = 64 tiles.
    """

    Br: int = 64
    Bc: int = 128
    threads: int = 256
    dq_Br: int = 128
    dq_Bc: int = 64
    dq_threads: int = 256
    merged: bool | None = None

    def __str__(self):
        merged = "" if self.merged is None else f" merged={self.merged}"
        return (f"dkdv Br={self.Br} Bc={self.Bc} t={self.threads}{merged} | "
                f"dq Br={self.dq_Br} Bc={self.dq_Bc} t={self.dq_threads}")

    def merged_at(self, Dh: int) -> bool:
        """P and dS share a buffer: as asked, or (None) when that is what keeps the block
        within 48 KB of static shared memory, or within what an H100 block may have at all."""
        if self.merged is not None:
            return bool(self.merged)
        two, one = (4 * dkdv_layout(self.Br, self.Bc, Dh, m)[1] for m in (False, True))
        return two > STATIC_LIMIT_BYTES >= one or two > MAX_SHARED_H100 >= one


def shared_bytes(tiles: BackwardTiles, Dh: int):
    """(dK/dV kernel bytes, dQ kernel bytes) of shared memory a block needs at padded head dim Dh."""
    return (4 * dkdv_layout(tiles.Br, tiles.Bc, Dh, tiles.merged_at(Dh))[1],
            4 * dq_layout(tiles.dq_Br, tiles.dq_Bc, Dh)[1])


def check_tiles(tiles, Dh: int, dq_mode: str = "atomic") -> BackwardTiles:
    """The tiles, if every kernel that ``dq_mode`` runs splits evenly at Dh and fits in
    shared memory; TypeError/ValueError naming ``tiles`` otherwise."""
    if not isinstance(tiles, BackwardTiles):
        raise TypeError(f"tiles: expected a BackwardTiles or None, got {type(tiles).__name__}")
    for f in fields(tiles)[:6]:
        value = getattr(tiles, f.name)
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"tiles: expected {f.name} a positive int, got {value!r}")
    if tiles.merged is not None and not isinstance(tiles.merged, (bool, np.bool_)):
        raise TypeError(f"tiles: expected merged True, False or None, got {tiles.merged!r}")
    for kernel in ("dK/dV", "dQ") if dq_mode == "separate" else ("dK/dV",):
        _check_kernel(tiles, Dh, kernel, dq_mode)
    return tiles


def fits(tiles: BackwardTiles, Dh: int, kernel: str, dq_mode: str = "atomic") -> bool:
    """Whether ``kernel`` ("dK/dV" or "dQ") splits evenly over its threads and fits."""
    try:
        _check_kernel(tiles, Dh, kernel, dq_mode)
    except ValueError:
        return False
    return True


def _check_kernel(tiles, Dh, kernel, dq_mode):
    dkdv = kernel == "dK/dV"
    Br, Bc, NT = (tiles.Br, tiles.Bc, tiles.threads) if dkdv else (tiles.dq_Br, tiles.dq_Bc, tiles.dq_threads)
    streamed = Br if dkdv else Bc                   # the rows of the tiles the kernel streams
    if NT > 1024 or (streamed * Dh) % NT or Br > NT:
        raise ValueError(f"tiles: the {kernel} kernel's {NT} threads must be <= 1024, >= its Br = {Br}, "
                         f"and evenly share the {streamed} x {Dh} tiles it streams")
    need(warp_split, Br, Bc, NT, f"{kernel} S tile Br x Bc")
    if dkdv:
        Grid.of(Bc, Dh, NT, "dK/dV tile Bc x d")
    if not dkdv or dq_mode == "atomic":
        Grid.of(Br, Dh, NT, "dQ tile Br x d")
    nbytes, limit = shared_bytes(tiles, Dh)[0 if dkdv else 1], max_dynamic_shared_bytes()
    if nbytes > limit:
        raise ValueError(f"tiles: the {kernel} kernel needs {nbytes} bytes of shared memory at d <= {Dh}, "
                         f"more than the {limit} this device allows")


# Production tiles by head-dim bucket (GPU), from the sweeps on the H100 (B=4 H=16 N=4096,
# fp32; ``kernels/bench/flash_backward.py``). d = 64: dK/dV Br=64 Bc=128 with 256 threads
# (4 x 8 S micro-tiles, 199 KB: one block an SM) was the fastest dK/dV kernel by far, with
# atomic dQ and with the separate one; the separate dQ kernel's best was Br=128 Bc=64 with
# 256 threads. d = 32 and 128: dK/dV candidates timed with atomic dQ. d <= 16: not measured.
GPU_TILES = {
    8: BackwardTiles(64, 64, 128, 64, 64, 128),
    16: BackwardTiles(64, 64, 128, 64, 64, 128),
    32: BackwardTiles(64, 128, 256, 64, 32, 128, merged=True),
    64: BackwardTiles(64, 128, 256, 128, 64, 256),
    128: BackwardTiles(32, 64, 256, 32, 8, 128, merged=True),
}
SIM_TILES = BackwardTiles(8, 8, 16, 8, 8, 16)     # the simulator runs every thread in Python


def default_tiles(d: int) -> BackwardTiles:
    """The tiles the launchers use for head dim d when none are given."""
    return SIM_TILES if on_simulator() else GPU_TILES[head_dim_bucket(d)]
