"""Chapter 5: the recomputing FlashAttention backward.

The forward saved only O and the row logsumexp L. The backward never stores the N x N
matrices S or P: it recomputes them, one tile at a time, from Q, K and L:

    S  = scale * Q K^T                     (recomputed)
    P  = exp(S - L)                        (recomputed; 0 where masked, 0 on rows with L = -inf)
    dV = P^T dO
    dP = dO V^T
    D  = rowsum(dO * O)                    (= rowsum(P * dP): the softmax Jacobian's diagonal term)
    dS = P * (dP - D)
    dQ = scale * dS K
    dK = scale * dS^T Q

Three kernels (two with atomic dQ, the default), launched in this order:

1. ``delta``: the pre-pass D = rowsum(dO * O), one float per query row.
2. ``dkdv``: K/V tiles outer. One block owns Bc key rows: it keeps K_j and V_j in shared
   memory and the accumulators dK_j and dV_j in registers (two-level: partial sums over
   ACC_ROWS query rows in registers, running sums in shared memory), and streams the
   query side (Q_i, dO_i, L_i, D_i) tile by tile (Tr tiles of Br rows). dK_j and dV_j are
   each written once, by the one block that owns them: no atomics for them.
3. ``dq``: Q tiles outer. One block owns Br query rows: it keeps Q_i, dO_i in shared
   memory and the accumulator dQ_i in registers, streams K_j, V_j, and recomputes S, P,
   dP and dS a second time. Every element of dQ is summed by one thread in a fixed order,
   so the result is bitwise identical from run to run (deterministic). The price: S and
   dP are computed twice, 14 N^2 d FLOPs in place of 10 N^2 d.

   The other design, atomics, adds each block's partial dQ_i += scale * dS K_j into dQ
   with float32 atomic adds from the dkdv kernel: no recomputation, but the order of the
   additions depends on which block gets there first, so dQ changes in its last bits
   from run to run. It is the default (``dq_mode="atomic"``, as in FlashAttention-2),
   because it measured faster on the H100; ``dq_mode="separate"`` buys determinism.

Each thread owns a register micro-tile of every product ("register tiling"): for a
product with an R x C result and NT threads, thread t owns TM x TN entries. Operands are
read from shared memory four floats at a time (one 16-byte load): shared rows are d + 4
(or Bc + 4) floats apart, which keeps every row 16-byte aligned and sends the 8 threads
of a load phase to 8 different bank groups.

Tile sizes are compile-time constants: each kernel comes from a cached factory
(``make_dkdv``, ``make_dq``, ``make_delta``) that closes over them. Above 48 KB of shared
memory a block, the kernels use dynamic shared memory with the per-kernel limit raised
(``kernels.base.shared_memory`` when it is available).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, uint64

from kernels.base.runtime import (
    ArrayKind,
    cdiv,
    check_array,
    check_flag,
    check_qkv,
    check_scale,
    device_empty,
    on_simulator,
    to_device,
)

try:  # dynamic shared memory above 48 KB (chapter 4's helper)
    from kernels.base import shared_memory as _shared_memory
except ImportError:  # pragma: no cover
    _shared_memory = None

__all__ = [
    "flash_attention_backward",
    "flash_backward_numpy",
    "recompute_p",
    "ds_tile",
    "Tiles",
    "default_tiles",
    "make_delta",
    "make_dkdv",
    "make_dq",
    "head_dim_bucket",
    "shared_bytes",
    "ptx_targets",
    "DQ_MODES",
    "allocate_outputs",
    "io_model_bytes",
    "standard_backward_bytes",
]

STATIC_SHARED_LIMIT = 48 * 1024
MAX_SHARED_H100 = 227 * 1024      # the most shared memory one block may opt in to
MAX_GRID_Y = 65535
ALIGN = None if on_simulator() else 16   # shared rows start 16-byte aligned (the simulator refuses the option)
HEAD_DIM_BUCKETS = (8, 16, 32, 64, 128)
DQ_MODES = ("separate", "atomic")

# A dead row (padding past Nq, or L = -inf) gets this "logsumexp": exp(S - BIG) is 0 for
# any finite S, and no infinity ever enters the fast-math kernel.
_DEAD_ROW_L = 1.0e30

# Two-level sums in the dK/dV kernel: each thread sums about ACC_ROWS query rows of
# dV_j += P^T dO_i and dK_j += dS^T Q_i in registers, then adds that partial to a running
# sum it keeps in shared memory. One long float32 sum over all N rows (a register that grows
# to O(1) while each step adds a small term) rounds at every one of its N additions; at
# N = 4096, causal (the first keys: P >= 0, nothing cancels), its dV error was 4x NumPy's
# blocked sums and broke the tolerance rule. Summed in blocks of ACC_ROWS rows, the long
# sum has N / ACC_ROWS additions (measured: 0.7x NumPy's error there).
# The dQ kernel does the same over the keys. (Atomic dQ is two-level by construction: each
# block adds a partial over its Bc keys.)
ACC_ROWS = 64


def head_dim_bucket(d: int) -> int:
    """The compile-time head dim D a kernel is built for: the smallest bucket >= d (zero padded)."""
    for bucket in HEAD_DIM_BUCKETS:
        if d <= bucket:
            return bucket
    raise ValueError(f"q: expected head dim d <= {HEAD_DIM_BUCKETS[-1]}, got {d}")


def _split(rows: int, cols: int, threads: int):
    """A register micro-tile (TM, TN) for an rows x cols result over ``threads`` threads.

    Each thread owns TM x TN entries; the threads form a (rows/TM) x (cols/TN) grid.
    Prefers the squarest micro-tile (fewest shared-memory loads per multiply-add).
    Returns None when the shapes do not divide.
    """
    if (rows * cols) % threads:
        return None
    per_thread = rows * cols // threads
    best = None
    for tm in range(1, per_thread + 1):
        if per_thread % tm or rows % tm:
            continue
        tn = per_thread // tm
        if cols % tn:
            continue
        key = (tm + tn, tm)
        if best is None or key < best[0]:
            best = (key, (tm, tn))
    return None if best is None else best[1]


def _warp_split(rows: int, cols: int, threads: int):
    """A two-level split of an rows x cols result: warps, then lanes, then micro-tiles.

    Returns (TM, TN, LR, LC, WC): each thread owns TM x TN entries; the 32 lanes of a warp
    form an LR x LC grid and together cover an (LR*TM) x (LC*TN) block; the warps tile the
    result, WC of them across the columns. Thread t = 32*w + lane owns rows
    (w // WC)*LR*TM + lane // LC + LR*a and columns (w % WC)*LC*TN + lane % LC + LC*b.
    Chosen so that a warp's block is as square as possible: it reads LR*TM + LC*TN rows of
    the two operands from shared memory per step, the fewer the better. None if nothing
    divides.
    """
    if threads % 32 and threads > 32:
        return None
    lanes = min(32, threads)
    warps = threads // lanes
    if (rows * cols) % threads:
        return None
    per_thread = rows * cols // threads
    best = None
    for tm in range(1, per_thread + 1):
        if per_thread % tm:
            continue
        tn = per_thread // tm
        for lr in range(1, lanes + 1):
            if lanes % lr:
                continue
            lc = lanes // lr
            if rows % (lr * tm) or cols % (lc * tn):
                continue
            wr, wc = rows // (lr * tm), cols // (lc * tn)
            if wr * wc != warps:
                continue
            key = (lr * tm + lc * tn, tm + tn, tm)
            if best is None or key < best[0]:
                best = (key, (tm, tn, lr, lc, wc))
    return None if best is None else best[1]


def _need_warp_split(rows, cols, threads, what):
    split = _warp_split(rows, cols, threads)
    if split is None:
        raise ValueError(f"tiles: {what} ({rows} x {cols}) does not split evenly over {threads} threads "
                         f"(warps of 32)")
    return split


def _need_split(rows, cols, threads, what):
    split = _split(rows, cols, threads)
    if split is None:
        raise ValueError(f"tiles: {what} ({rows} x {cols}) does not split evenly over {threads} threads")
    return split


# --------------------------------------------------------------------------- shared memory


def _strides(BC, D):
    """Row strides (floats) of the shared tiles: d + 4 for Q, dO, K, V and Bc + 4 for P, dS.

    Multiples of 4, so that every row starts 16-byte aligned (vector loads), and 4 banks
    apart, so that the 8 threads of a 16-byte load phase reading 8 rows hit 8 bank groups.
    """
    return D + 4, BC + 4


def _dkdv_layout(BC, BR, D, merged=False):
    """Offsets (in floats) of the dkdv kernel's shared tiles: K_j, V_j, Q_i, dO_i, P, dS, L_i, D_i,
    and the running sums of dV_j and dK_j (Bc x D each, every thread its own slots).

    ``merged``: P and dS share one buffer (P first, then dS), which saves Br x Bc floats
    for two more barriers a step.
    """
    LD, LP = _strides(BC, D)
    o_k = 0
    o_v = o_k + BC * LD
    o_q = o_v + BC * LD
    o_do = o_q + BR * LD
    o_p = o_do + BR * LD
    o_ds = o_p if merged else o_p + BR * LP
    o_l = o_ds + BR * LP
    o_d = o_l + BR
    o_sv = -(-(o_d + BR) // 4) * 4                  # running sums of dV_j, dK_j (16-byte aligned)
    o_sk = o_sv + BC * D
    return (o_k, o_v, o_q, o_do, o_p, o_ds, o_l, o_d, o_sv, o_sk), o_sk + BC * D


def _dkdv_merged(BC, BR, D) -> bool:
    """Merge the P and dS buffers when that is what keeps the block within 48 KB of static
    shared memory, or within the 227 KB a block may have at all (H100); otherwise keep two
    buffers (two fewer barriers a step)."""
    two = 4 * _dkdv_layout(BC, BR, D, False)[1]
    one = 4 * _dkdv_layout(BC, BR, D, True)[1]
    return two > STATIC_SHARED_LIMIT >= one or two > MAX_SHARED_H100 >= one


def _dq_layout(BR, BC, D):
    """Offsets (in floats) of the dq kernel's shared tiles: Q_i, dO_i, K_j, V_j, dS, L_i, D_i,
    and the running sum of dQ_i (Br x D, every thread its own slots)."""
    LD, LP = _strides(BC, D)
    o_q = 0
    o_do = o_q + BR * LD
    o_k = o_do + BR * LD
    o_v = o_k + BC * LD
    o_ds = o_v + BC * LD
    o_l = o_ds + BR * LP
    o_d = o_l + BR
    o_sq = -(-(o_d + BR) // 4) * 4
    return (o_q, o_do, o_k, o_v, o_ds, o_l, o_d, o_sq), o_sq + BR * D


def _raise_dynamic_limit(kernel, signature: str, args, nbytes: int):
    """Let ``kernel`` (compiled for ``signature``) use ``nbytes`` of dynamic shared memory.

    numba-cuda has no public API for the per-kernel limit (numba-cuda#94); its driver layer
    does it. A no-op in the simulator and at or below 48 KB.
    """
    if on_simulator() or nbytes <= STATIC_SHARED_LIMIT:
        return
    if _shared_memory is not None:
        _shared_memory.allow_dynamic_shared_memory(kernel, args, nbytes)
        return
    key = (id(kernel), signature, int(nbytes))
    if key in _RAISED:
        return
    from cuda.bindings import driver as binding
    from numba.cuda.cudadrv.driver import driver

    compiled = kernel.compile(signature)
    cufunc = compiled._codelibrary.get_cufunc()
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, int(nbytes), cufunc.handle, cufunc.device.id)
    _RAISED.add(key)


_RAISED: set = set()


# --------------------------------------------------------------------------- tiles


@dataclass(frozen=True)
class Tiles:
    """Tile sizes of the two main kernels (compile-time constants of their factories).

    dkdv kernel: ``block_k`` = Bc key rows a block owns, ``block_q`` = Br query rows per
    step, ``threads`` per block. dq kernel: ``dq_block_q`` = Br query rows a block owns,
    ``dq_block_k`` = Bc key rows per step, ``dq_threads``.
    """

    block_k: int = 128
    block_q: int = 64
    threads: int = 256
    dq_block_q: int = 128
    dq_block_k: int = 64
    dq_threads: int = 256
    merged: bool | None = None      # P and dS in one shared buffer; None: only when needed

    def label(self) -> str:
        merged = "" if self.merged is None else f" merged={self.merged}"
        return (f"dkdv Bc={self.block_k} Br={self.block_q} t={self.threads}{merged} | "
                f"dq Br={self.dq_block_q} Bc={self.dq_block_k} t={self.dq_threads}")

    def dkdv_merged(self, D: int) -> bool:
        return _dkdv_merged(self.block_k, self.block_q, D) if self.merged is None else bool(self.merged)


def shared_bytes(tiles: Tiles, D: int):
    """(dkdv bytes, dq bytes) of shared memory a block needs at head dim bucket D."""
    _, dkdv = _dkdv_layout(tiles.block_k, tiles.block_q, D, tiles.dkdv_merged(D))
    _, dq = _dq_layout(tiles.dq_block_q, tiles.dq_block_k, D)
    return 4 * dkdv, 4 * dq


def _check_tiles(tiles, D: int, dq_mode: str):
    if not isinstance(tiles, Tiles):
        raise TypeError(f"tiles: expected a flash_backward.Tiles or None, got {type(tiles).__name__}")
    for name in ("block_k", "block_q", "threads", "dq_block_q", "dq_block_k", "dq_threads"):
        value = getattr(tiles, name)
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"tiles: expected {name} a positive int, got {value!r}")
    if tiles.merged is not None and not isinstance(tiles.merged, (bool, np.bool_)):
        raise TypeError(f"tiles: expected merged True, False or None, got {tiles.merged!r}")
    for name in ("threads", "dq_threads"):
        if getattr(tiles, name) > 1024:
            raise ValueError(f"tiles: expected {name} <= 1024, got {getattr(tiles, name)}")
    _need_warp_split(tiles.block_q, tiles.block_k, tiles.threads, "dkdv S tile Br x Bc")
    if (tiles.block_q * D) % tiles.threads or tiles.block_q > tiles.threads:
        raise ValueError(f"tiles: the dkdv kernel's {tiles.threads} threads must evenly share a Q tile "
                         f"{tiles.block_q} x {D} and be at least block_q = {tiles.block_q}")
    _need_split(tiles.block_k, D, tiles.threads, "dkdv dK/dV tile Bc x d")
    if dq_mode == "atomic":
        _need_split(tiles.block_q, D, tiles.threads, "dkdv atomic dQ tile Br x d")
    else:
        _need_warp_split(tiles.dq_block_q, tiles.dq_block_k, tiles.dq_threads, "dq S tile Br x Bc")
        if (tiles.dq_block_k * D) % tiles.dq_threads:
            raise ValueError(f"tiles: the dq kernel's {tiles.dq_threads} threads must evenly share a K tile "
                             f"{tiles.dq_block_k} x {D}")
        _need_split(tiles.dq_block_q, D, tiles.dq_threads, "dq dQ tile Br x d")
    limit = _max_shared_bytes()
    for what, nbytes in zip(("dkdv", "dq"), shared_bytes(tiles, D)):
        if what == "dq" and dq_mode == "atomic":
            continue
        if nbytes > limit:
            raise ValueError(f"tiles: the {what} kernel needs {nbytes} bytes of shared memory at d <= {D}, "
                             f"more than the {limit} this device allows")


def _max_shared_bytes() -> int:
    if on_simulator():
        return 227 * 1024
    if _shared_memory is not None:
        return _shared_memory.max_dynamic_shared_bytes()
    try:
        dev = cuda.get_current_device()
        return int(dev.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
    except Exception:
        return STATIC_SHARED_LIMIT


# Production tiles by head-dim bucket (GPU), from the sweeps on the H100 (B=4 H=16 N=4096,
# fp32; ``kernels/bench/flash_backward.py`` sweeps d = 64). d = 64: dK/dV Bc=128 Br=64 with
# 256 threads (8 x 4 S micro-tiles, 199 KB: one block an SM) was the fastest dK/dV kernel by
# far, with atomic dQ and with the separate one; the separate dQ kernel's best was Br=128
# Bc=64 with 256 threads. d = 32 and d = 128: dK/dV candidates timed with atomic dQ (the
# dQ-kernel tiles there are not swept). d <= 16: not measured.
_GPU_TILES = {
    8: Tiles(64, 64, 128, 64, 64, 128),
    16: Tiles(64, 64, 128, 64, 64, 128),
    32: Tiles(128, 64, 256, 64, 32, 128, merged=True),
    64: Tiles(128, 64, 256, 128, 64, 256),
    128: Tiles(64, 32, 256, 32, 8, 128, merged=True),
}
# The simulator runs every thread in Python: small blocks.
_SIM_TILES = Tiles(8, 8, 16, 8, 8, 16)


def default_tiles(d: int) -> Tiles:
    """The tiles the launcher uses for head dim d when none are given."""
    return _SIM_TILES if on_simulator() else _GPU_TILES[head_dim_bucket(d)]


# --------------------------------------------------------------------------- NumPy version


def recompute_p(s, lse):
    """P = exp(S - L) for one tile of scaled scores S (-inf where masked) and the rows' L.

    0 where S = -inf (masked) and on rows with L = -inf (they saw nothing); never NaN.
    """
    s = np.asarray(s)
    lse = np.asarray(lse)[..., None]
    live = np.isfinite(s) & np.isfinite(lse)
    with np.errstate(invalid="ignore"):
        return np.where(live, np.exp(np.where(live, s - lse, 0.0)), 0.0).astype(s.dtype)


def ds_tile(p, dp, delta):
    """dS = P * (dP - D) for one tile: P and dP (Br x Bc), D the tile's rows of rowsum(dO * O)."""
    return p * (dp - np.asarray(delta)[..., None])


def flash_backward_numpy(q, k, v, o, lse, do, *, causal=False, scale=None, block_q=16, block_k=16):
    """The recomputing backward in NumPy, in the kernels' loop order (one (batch, head) or many).

    K/V tiles outer for dK, dV; Q tiles outer for dQ; no N x N array is ever formed.
    """
    q, k, v, o, lse, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, o, lse, do))
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    delta = np.sum(do * o, axis=-1)                                 # D, one number a query row
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)

    def p_and_ds(rows, cols):
        s = scale * q[..., rows, :] @ np.swapaxes(k[..., cols, :], -1, -2)
        if causal:
            visible = cols[None, :] <= rows[:, None] + (nk - nq)
            s = np.where(visible, s, -np.inf)
        p = recompute_p(s, lse[..., rows])                          # P rebuilt from Q, K and L
        dp = do[..., rows, :] @ np.swapaxes(v[..., cols, :], -1, -2)
        return p, ds_tile(p, dp, delta[..., rows])

    for c0 in range(0, nk, block_k):                                # K/V tiles outer: dK_j, dV_j
        cols = np.arange(c0, min(c0 + block_k, nk))
        for r0 in range(0, nq, block_q):
            rows = np.arange(r0, min(r0 + block_q, nq))
            p, ds = p_and_ds(rows, cols)
            dv[..., cols, :] += np.swapaxes(p, -1, -2) @ do[..., rows, :]
            dk[..., cols, :] += scale * np.swapaxes(ds, -1, -2) @ q[..., rows, :]
    for r0 in range(0, nq, block_q):                                # Q tiles outer: dQ_i
        rows = np.arange(r0, min(r0 + block_q, nq))
        for c0 in range(0, nk, block_k):
            cols = np.arange(c0, min(c0 + block_k, nk))
            _, ds = p_and_ds(rows, cols)
            dq[..., rows, :] += scale * ds @ k[..., cols, :]
    return dq, dk, dv


# --------------------------------------------------------------------------- kernel 1: D


@functools.lru_cache(maxsize=None)
def make_delta(D: int, rows: int = 4, zero_dq: bool = False):
    """D = rowsum(dO * O): 32 threads a query row, ``rows`` rows a block.

    Grid: (ceil(Nq / rows), B*H). Lanes read consecutive columns (coalesced), then a tree
    reduction in shared memory adds the 32 partial sums. With ``zero_dq`` the same
    threads also clear dQ (the atomic variant accumulates into it).
    """
    LANES = 32
    NT = LANES * rows

    @cuda.jit(fastmath=True)
    def delta(o, do, out, dq, nq):
        part = cuda.shared.array(NT, float32)
        t = int32(cuda.threadIdx.x)
        lane = t % int32(LANES)
        r = t // int32(LANES)
        bh = int32(cuda.blockIdx.y)
        row = int32(cuda.blockIdx.x) * int32(rows) + r
        d = int32(o.shape[2])
        acc = float32(0.0)
        if row < nq:
            for e in range(lane, d, LANES):
                acc += o[bh, row, e] * do[bh, row, e]
                if zero_dq:
                    dq[bh, row, e] = float32(0.0)
        part[t] = acc
        cuda.syncthreads()
        width = LANES // 2
        while width > 0:
            if lane < width:
                part[t] += part[t + width]
            cuda.syncthreads()
            width //= 2
        if lane == 0 and row < nq:
            out[bh, row] = part[t]

    return delta, NT


# --------------------------------------------------------------------------- kernel 2: dK, dV


def _vec(n: int) -> int:
    """The run length a thread reads with one vector load: 4 floats (16 bytes) when n allows."""
    return 4 if n % 4 == 0 else (2 if n % 2 == 0 else 1)


@functools.lru_cache(maxsize=None)
def make_dkdv(BC: int, BR: int, D: int, NT: int, dynamic: bool = False, atomic_dq: bool = False,
              merged: bool = False):
    """The K/V-tile-outer kernel: grid (Tc = ceil(Nk / Bc), B*H), NT threads a block.

    Block j keeps K_j, V_j (Bc x D) in shared memory and dK_j, dV_j in registers, and for
    each query tile i (Br rows) recomputes S and P, then accumulates dV_j += P^T dO_i and
    dK_j += dS^T Q_i. With ``atomic_dq`` it also adds scale * dS K_j into dQ_i atomically.

    Micro-tiles. S and dP (Br x Bc): thread (ty, tx) owns rows ty + RA*a and columns
    tx + CA*b; their inner loop runs over d four at a time, so that each operand row is read
    with one 16-byte load (rows are D + 4 floats apart: aligned, and the 8 threads of a
    load phase hit 8 different bank groups). dV and dK (Bc x D): thread (ty, tx) owns runs
    of VM consecutive keys and VN consecutive columns, read as vectors from P, dS, dO, Q.
    Two-level sums: the registers hold dV_j and dK_j summed over the last ACC_ROWS query
    rows; every ACC_ROWS rows each thread adds them to its own running sums in shared memory.
    Shared-memory offsets are unsigned (uint64): Numba adds a negative-index wraparound to
    every signed index, which costs integer instructions and hides the alignment.
    """
    AM, AN, RA, CA, WCA = _need_warp_split(BR, BC, NT, "S tile Br x Bc")   # S, dP: Br x Bc
    WRA_ROWS, WCA_COLS = RA * AM, CA * AN                   # the block of S one warp covers
    BM, BN = _need_split(BC, D, NT, "dK/dV tile Bc x d")    # dV, dK: Bc x D
    RB, CB = BC // BM, D // BN
    VM, VN = _vec(BM), _vec(BN)                             # runs of keys / columns a thread owns
    LQ = BR * D // NT                                       # Q (and dO) elements a thread prefetches
    if atomic_dq:
        QM, QN = _need_split(BR, D, NT, "dQ tile Br x d")   # dQ_i partial: Br x D
    else:
        QM, QN = 1, 1
    RQ, CQ = BR // QM, D // QN
    VQ = _vec(QN)
    UC = _vec(BC)
    LD, LP = _strides(BC, D)
    (O_K, O_V, O_Q, O_DO, O_P, O_DS, O_L, O_D, O_SV, O_SK), TOTAL = _dkdv_layout(BC, BR, D, merged)
    FLUSH = max(1, ACC_ROWS // BR)                          # query tiles summed in registers per flush
    SHARED = 0 if dynamic else TOTAL
    DEAD = float32(_DEAD_ROW_L)
    ALIVE = float32(-1.0e30)

    @cuda.jit(fastmath=True)
    def dkdv(q, k, v, do, lse, delta, dq, dk, dv, nq, nk, scale, causal):
        sm = cuda.shared.array(SHARED, float32, alignment=ALIGN)
        t = int32(cuda.threadIdx.x)
        j = int32(cuda.blockIdx.x)
        bh = int32(cuda.blockIdx.y)
        d = int32(q.shape[2])
        c0 = j * int32(BC)
        off = nk - nq                                   # causal: key c visible to row r iff c <= r + off

        # K_j and V_j: loaded once, zero padded past Nk and past d.
        for idx in range(t, BC * D, NT):
            c = int32(idx) // int32(D)
            e = int32(idx) - c * int32(D)
            kv = float32(0.0)
            vv = float32(0.0)
            if c0 + c < nk and e < d:
                kv = k[bh, c0 + c, e]
                vv = v[bh, c0 + c, e]
            sm[uint64(O_K + c * LD + e)] = kv
            sm[uint64(O_V + c * LD + e)] = vv

        # dV_j, dK_j: partial sums in registers (acc_*), running sums in shared memory; the
        # thread's slot for entry (a, b) is (a * BN + b) * NT + t (consecutive threads,
        # consecutive words: no bank conflicts, and no other thread touches it).
        acc_dv = cuda.local.array((BM, BN), float32)
        acc_dk = cuda.local.array((BM, BN), float32)
        for a in range(BM):
            for b in range(BN):
                acc_dv[a, b] = float32(0.0)
                acc_dk[a, b] = float32(0.0)
                sm[uint64(O_SV + (a * BN + b) * NT + t)] = float32(0.0)
                sm[uint64(O_SK + (a * BN + b) * NT + t)] = float32(0.0)
        since_flush = int32(0)
        s = cuda.local.array((AM, AN), float32)
        dp = cuda.local.array((AM, AN), float32)
        qa = cuda.local.array((AM, 4), float32)
        da = cuda.local.array((AM, 4), float32)
        kb = cuda.local.array((AN, 4), float32)
        vb = cuda.local.array((AN, 4), float32)
        pv = cuda.local.array(BM, float32)
        sv = cuda.local.array(BM, float32)
        ov = cuda.local.array(BN, float32)
        xv = cuda.local.array(BN, float32)
        qacc = cuda.local.array((QM, QN), float32)
        sq = cuda.local.array((QM, UC), float32)
        kq = cuda.local.array(QN, float32)

        # S and dP: warp w covers a WRA_ROWS x WCA_COLS block; lane (ly, lx) in it owns rows
        # ty_a + RA*a and columns tx_a + CA*b.
        w_a = t // int32(32)
        lane_a = t - w_a * int32(32)
        ty_a = (w_a // int32(WCA)) * int32(WRA_ROWS) + lane_a // int32(CA)
        tx_a = (w_a % int32(WCA)) * int32(WCA_COLS) + lane_a % int32(CA)
        ty_b = t // int32(CB)
        tx_b = t - ty_b * int32(CB)
        ty_q = t // int32(CQ)
        tx_q = t - ty_q * int32(CQ)
        # This thread's first element in each shared tile it reads (unsigned offsets).
        u_qa = uint64(O_Q + ty_a * LD)                  # Q_i row ty_a             (S)
        u_da = uint64(O_DO + ty_a * LD)                 # dO_i row ty_a            (dP)
        u_kb = uint64(O_K + tx_a * LD)                  # K_j row tx_a             (S)
        u_vb = uint64(O_V + tx_a * LD)                  # V_j row tx_a             (dP)
        u_pb = uint64(O_P + ty_b * VM)                  # P, its first key run     (dV)
        u_sb = uint64(O_DS + ty_b * VM)                 # dS, its first key run    (dK)
        u_ob = uint64(O_DO + tx_b * VN)                 # dO_i, its first column run (dV)
        u_xb = uint64(O_Q + tx_b * VN)                  # Q_i, its first column run  (dK)
        u_sq = uint64(O_DS + ty_q * LP)                 # dS row ty_q              (dQ)
        u_kq = uint64(O_K + tx_q * VQ)                  # K_j, its first column run (dQ)

        # Causal tile skipping: query tiles entirely above this key tile see none of it.
        i_start = int32(0)
        if causal != 0:
            first_row = c0 - off
            if first_row > 0:
                i_start = first_row // int32(BR)
        tr = (nq + int32(BR - 1)) // int32(BR)

        # Prefetch: the next query tile (Q, dO, L, D) travels from HBM into registers while
        # the block computes on the current one; thread t holds elements t + NT*m.
        pq = cuda.local.array(LQ, float32)
        pg = cuda.local.array(LQ, float32)
        pl = DEAD
        pd = float32(0.0)
        if i_start < tr:
            r0 = i_start * int32(BR)
            for m in range(LQ):
                idx = t + int32(m * NT)
                r = idx // int32(D)
                e = idx - r * int32(D)
                pq[m] = float32(0.0)
                pg[m] = float32(0.0)
                if r0 + r < nq and e < d:
                    pq[m] = q[bh, r0 + r, e]
                    pg[m] = do[bh, r0 + r, e]
            if t < BR and r0 + t < nq:
                lrow = lse[bh, r0 + t]
                if lrow > ALIVE:                        # L = -inf: the row sees nothing, P = 0
                    pl = lrow
                pd = delta[bh, r0 + t]

        for i in range(i_start, tr):
            r0 = int32(i) * int32(BR)
            cuda.syncthreads()                          # the previous step is done with Q_i, dO_i
            for m in range(LQ):
                idx = t + int32(m * NT)
                r = idx // int32(D)
                e = idx - r * int32(D)
                sm[uint64(O_Q + r * LD + e)] = pq[m]
                sm[uint64(O_DO + r * LD + e)] = pg[m]
            if t < BR:
                sm[uint64(O_L + t)] = pl
                sm[uint64(O_D + t)] = pd
            cuda.syncthreads()
            if i + 1 < tr:                              # start loading tile i + 1
                n0 = r0 + int32(BR)
                for m in range(LQ):
                    idx = t + int32(m * NT)
                    r = idx // int32(D)
                    e = idx - r * int32(D)
                    pq[m] = float32(0.0)
                    pg[m] = float32(0.0)
                    if n0 + r < nq and e < d:
                        pq[m] = q[bh, n0 + r, e]
                        pg[m] = do[bh, n0 + r, e]
                pl = DEAD
                pd = float32(0.0)
                if t < BR and n0 + t < nq:
                    lrow = lse[bh, n0 + t]
                    if lrow > ALIVE:
                        pl = lrow
                    pd = delta[bh, n0 + t]

            # S = Q_i K_j^T and dP = dO_i V_j^T, each thread an AM x AN micro-tile,
            # four steps of d per 16-byte load.
            for a in range(AM):
                for b in range(AN):
                    s[a, b] = float32(0.0)
                    dp[a, b] = float32(0.0)
            for e4 in range(D // 4):
                ue = uint64(e4) * uint64(4)
                for a in range(AM):
                    for u in range(4):
                        qa[a, u] = sm[u_qa + uint64(a * RA * LD) + ue + uint64(u)]
                        da[a, u] = sm[u_da + uint64(a * RA * LD) + ue + uint64(u)]
                for b in range(AN):
                    for u in range(4):
                        kb[b, u] = sm[u_kb + uint64(b * CA * LD) + ue + uint64(u)]
                        vb[b, u] = sm[u_vb + uint64(b * CA * LD) + ue + uint64(u)]
                for u in range(4):
                    for a in range(AM):
                        for b in range(AN):
                            s[a, b] += qa[a, u] * kb[b, u]
                            dp[a, b] += da[a, u] * vb[b, u]

            # P = exp(scale * S - L) (0 where masked), dS = P * (dP - D), kept in s and dp.
            for a in range(AM):
                r = ty_a + int32(a * RA)
                row = r0 + r
                lrow = sm[uint64(O_L + r)]
                drow = sm[uint64(O_D + r)]
                for b in range(AN):
                    c = tx_a + int32(b * CA)
                    col = c0 + c
                    p = float32(0.0)
                    if col < nk and (causal == 0 or col <= row + off):
                        p = math.exp(s[a, b] * scale - lrow)
                    s[a, b] = p
                    dp[a, b] = p * (dp[a, b] - drow)
                    sm[uint64(O_P + r * LP + c)] = p
                    if not merged:
                        sm[uint64(O_DS + r * LP + c)] = dp[a, b]
            cuda.syncthreads()

            if merged:
                # dV_j += P^T dO_i; then dS replaces P in the same buffer; dK_j += dS^T Q_i.
                r = int32(0)
                rp = uint64(r)                          # r * (row stride), kept by additions
                rd = uint64(r)
                while r < int32(BR):                # a while loop: leaner counting than range()
                    for a in range(BM):
                        pv[a] = sm[u_pb + rp + uint64((a % VM) + (a // VM) * RB * VM)]
                    for b in range(BN):
                        ov[b] = sm[u_ob + rd + uint64((b % VN) + (b // VN) * CB * VN)]
                    for a in range(BM):
                        for b in range(BN):
                            acc_dv[a, b] += pv[a] * ov[b]
                    r += int32(1)
                    rp += uint64(LP)
                    rd += uint64(LD)
                cuda.syncthreads()
                for a in range(AM):
                    for b in range(AN):
                        sm[uint64(O_DS + (ty_a + a * RA) * LP + tx_a + b * CA)] = dp[a, b]
                cuda.syncthreads()
                r = int32(0)
                rp = uint64(r)                          # r * (row stride), kept by additions
                rd = uint64(r)
                while r < int32(BR):                # a while loop: leaner counting than range()
                    for a in range(BM):
                        sv[a] = sm[u_sb + rp + uint64((a % VM) + (a // VM) * RB * VM)]
                    for b in range(BN):
                        xv[b] = sm[u_xb + rd + uint64((b % VN) + (b // VN) * CB * VN)]
                    for a in range(BM):
                        for b in range(BN):
                            acc_dk[a, b] += sv[a] * xv[b]
                    r += int32(1)
                    rp += uint64(LP)
                    rd += uint64(LD)
            else:
                # dV_j += P^T dO_i and dK_j += dS^T Q_i, each thread a BM x BN micro-tile.
                r = int32(0)
                rp = uint64(r)                          # r * (row stride), kept by additions
                rd = uint64(r)
                while r < int32(BR):                # a while loop: leaner counting than range()
                    for a in range(BM):
                        pv[a] = sm[u_pb + rp + uint64((a % VM) + (a // VM) * RB * VM)]
                        sv[a] = sm[u_sb + rp + uint64((a % VM) + (a // VM) * RB * VM)]
                    for b in range(BN):
                        ov[b] = sm[u_ob + rd + uint64((b % VN) + (b // VN) * CB * VN)]
                        xv[b] = sm[u_xb + rd + uint64((b % VN) + (b // VN) * CB * VN)]
                    for a in range(BM):
                        for b in range(BN):
                            acc_dv[a, b] += pv[a] * ov[b]
                            acc_dk[a, b] += sv[a] * xv[b]
                    r += int32(1)
                    rp += uint64(LP)
                    rd += uint64(LD)

            since_flush += int32(1)
            if since_flush == int32(FLUSH):             # partial sums into the running sums
                since_flush = int32(0)
                for a in range(BM):
                    for b in range(BN):
                        sm[uint64(O_SV + (a * BN + b) * NT + t)] += acc_dv[a, b]
                        sm[uint64(O_SK + (a * BN + b) * NT + t)] += acc_dk[a, b]
                        acc_dv[a, b] = float32(0.0)
                        acc_dk[a, b] = float32(0.0)

            if atomic_dq:
                # dQ_i += scale * dS K_j, added atomically: other key blocks add to the same rows.
                for a in range(QM):
                    for b in range(QN):
                        qacc[a, b] = float32(0.0)
                for c4 in range(BC // UC):
                    uc = uint64(c4) * uint64(UC)
                    for a in range(QM):
                        for u in range(UC):
                            sq[a, u] = sm[u_sq + uint64(a * RQ * LP) + uc + uint64(u)]
                    for u in range(UC):
                        for b in range(QN):
                            kq[b] = sm[u_kq + (uc + uint64(u)) * uint64(LD) + uint64((b % VQ) + (b // VQ) * CQ * VQ)]
                        for a in range(QM):
                            for b in range(QN):
                                qacc[a, b] += sq[a, u] * kq[b]
                for a in range(QM):
                    row = r0 + ty_q + int32(a * RQ)
                    if row < nq:
                        for b in range(QN):
                            e = tx_q * int32(VQ) + int32((b % VQ) + (b // VQ) * CQ * VQ)
                            if e < d:
                                cuda.atomic.add(dq, (bh, row, e), qacc[a, b] * scale)

        for a in range(BM):
            c = c0 + ty_b * int32(VM) + int32((a % VM) + (a // VM) * RB * VM)
            if c < nk:
                for b in range(BN):
                    e = tx_b * int32(VN) + int32((b % VN) + (b // VN) * CB * VN)
                    if e < d:
                        dv[bh, c, e] = sm[uint64(O_SV + (a * BN + b) * NT + t)] + acc_dv[a, b]
                        dk[bh, c, e] = (sm[uint64(O_SK + (a * BN + b) * NT + t)] + acc_dk[a, b]) * scale

    return dkdv


# --------------------------------------------------------------------------- kernel 3: dQ


@functools.lru_cache(maxsize=None)
def make_dq(BR: int, BC: int, D: int, NT: int, dynamic: bool = False):
    """The Q-tile-outer kernel: grid (Tr = ceil(Nq / Br), B*H), NT threads a block.

    Block i keeps Q_i, dO_i (Br x D), L_i and D_i in shared memory and dQ_i in registers;
    for each key tile j it recomputes S, P, dP and dS and accumulates dQ_i += dS K_j.
    Each dQ entry is summed by one thread in a fixed order: bitwise reproducible. Two-level
    sums as in ``make_dkdv``: about ACC_ROWS keys in registers, then into a running sum in
    shared memory.
    Micro-tiles and vector loads as in ``make_dkdv``; dQ_i += dS K_j runs over the keys
    four at a time (one 16-byte load of a dS row per four keys).
    """
    AM, AN, RA, CA, WCA = _need_warp_split(BR, BC, NT, "S tile Br x Bc")   # S, dP: Br x Bc
    WRA_ROWS, WCA_COLS = RA * AM, CA * AN                   # the block of S one warp covers
    QM, QN = _need_split(BR, D, NT, "dQ tile Br x d")       # dQ: Br x D
    RQ, CQ = BR // QM, D // QN
    VQ = _vec(QN)
    UC = _vec(BC)
    LK = BC * D // NT                                       # K (and V) elements a thread prefetches
    LD, LP = _strides(BC, D)
    (O_Q, O_DO, O_K, O_V, O_DS, O_L, O_D, O_SQ), TOTAL = _dq_layout(BR, BC, D)
    FLUSH = max(1, ACC_ROWS // BC)                          # key tiles summed in registers per flush
    SHARED = 0 if dynamic else TOTAL
    DEAD = float32(_DEAD_ROW_L)
    ALIVE = float32(-1.0e30)

    @cuda.jit(fastmath=True)
    def dq_kernel(q, k, v, do, lse, delta, dq, nq, nk, scale, causal):
        sm = cuda.shared.array(SHARED, float32, alignment=ALIGN)
        t = int32(cuda.threadIdx.x)
        # The last query tiles see the most keys under causal masking: start them first.
        i = int32(cuda.gridDim.x) - int32(1) - int32(cuda.blockIdx.x)
        bh = int32(cuda.blockIdx.y)
        d = int32(q.shape[2])
        r0 = i * int32(BR)
        off = nk - nq

        for idx in range(t, BR * D, NT):
            r = int32(idx) // int32(D)
            e = int32(idx) - r * int32(D)
            qv = float32(0.0)
            gv = float32(0.0)
            if r0 + r < nq and e < d:
                qv = q[bh, r0 + r, e]
                gv = do[bh, r0 + r, e]
            sm[uint64(O_Q + r * LD + e)] = qv
            sm[uint64(O_DO + r * LD + e)] = gv
        for r in range(t, BR, NT):
            lv = DEAD
            dv_ = float32(0.0)
            if r0 + r < nq:
                lrow = lse[bh, r0 + r]
                if lrow > ALIVE:
                    lv = lrow
                dv_ = delta[bh, r0 + r]
            sm[uint64(O_L + r)] = lv
            sm[uint64(O_D + r)] = dv_

        # dQ_i: partial sums in registers, running sums in shared memory (two-level, as dK/dV).
        acc = cuda.local.array((QM, QN), float32)
        for a in range(QM):
            for b in range(QN):
                acc[a, b] = float32(0.0)
                sm[uint64(O_SQ + (a * QN + b) * NT + t)] = float32(0.0)
        since_flush = int32(0)
        s = cuda.local.array((AM, AN), float32)
        dp = cuda.local.array((AM, AN), float32)
        qa = cuda.local.array((AM, 4), float32)
        da = cuda.local.array((AM, 4), float32)
        kb = cuda.local.array((AN, 4), float32)
        vb = cuda.local.array((AN, 4), float32)
        sq = cuda.local.array((QM, UC), float32)
        kq = cuda.local.array(QN, float32)

        # S and dP: warp w covers a WRA_ROWS x WCA_COLS block; lane (ly, lx) in it owns rows
        # ty_a + RA*a and columns tx_a + CA*b.
        w_a = t // int32(32)
        lane_a = t - w_a * int32(32)
        ty_a = (w_a // int32(WCA)) * int32(WRA_ROWS) + lane_a // int32(CA)
        tx_a = (w_a % int32(WCA)) * int32(WCA_COLS) + lane_a % int32(CA)
        ty_q = t // int32(CQ)
        tx_q = t - ty_q * int32(CQ)
        u_qa = uint64(O_Q + ty_a * LD)
        u_da = uint64(O_DO + ty_a * LD)
        u_kb = uint64(O_K + tx_a * LD)
        u_vb = uint64(O_V + tx_a * LD)
        u_sq = uint64(O_DS + ty_q * LP)
        u_kq = uint64(O_K + tx_q * VQ)

        # Causal tile skipping: key tiles entirely right of this query tile's last row.
        last_col = nk - int32(1)
        if causal != 0:
            last_col = min(last_col, r0 + int32(BR - 1) + off)
        tc = int32(0)
        if last_col >= 0:
            tc = last_col // int32(BC) + int32(1)

        # Prefetch: the next K/V tile travels from HBM into registers during the compute.
        pk = cuda.local.array(LK, float32)
        pv_ = cuda.local.array(LK, float32)
        for m in range(LK):
            idx = t + int32(m * NT)
            c = idx // int32(D)
            e = idx - c * int32(D)
            pk[m] = float32(0.0)
            pv_[m] = float32(0.0)
            if tc > 0 and c < nk and e < d:
                pk[m] = k[bh, c, e]
                pv_[m] = v[bh, c, e]

        for j in range(tc):
            c0 = int32(j) * int32(BC)
            cuda.syncthreads()                          # the previous step is done with K_j, V_j
            for m in range(LK):
                idx = t + int32(m * NT)
                c = idx // int32(D)
                e = idx - c * int32(D)
                sm[uint64(O_K + c * LD + e)] = pk[m]
                sm[uint64(O_V + c * LD + e)] = pv_[m]
            cuda.syncthreads()
            if j + 1 < tc:                              # start loading tile j + 1
                n0 = c0 + int32(BC)
                for m in range(LK):
                    idx = t + int32(m * NT)
                    c = idx // int32(D)
                    e = idx - c * int32(D)
                    pk[m] = float32(0.0)
                    pv_[m] = float32(0.0)
                    if n0 + c < nk and e < d:
                        pk[m] = k[bh, n0 + c, e]
                        pv_[m] = v[bh, n0 + c, e]

            for a in range(AM):
                for b in range(AN):
                    s[a, b] = float32(0.0)
                    dp[a, b] = float32(0.0)
            for e4 in range(D // 4):
                ue = uint64(e4) * uint64(4)
                for a in range(AM):
                    for u in range(4):
                        qa[a, u] = sm[u_qa + uint64(a * RA * LD) + ue + uint64(u)]
                        da[a, u] = sm[u_da + uint64(a * RA * LD) + ue + uint64(u)]
                for b in range(AN):
                    for u in range(4):
                        kb[b, u] = sm[u_kb + uint64(b * CA * LD) + ue + uint64(u)]
                        vb[b, u] = sm[u_vb + uint64(b * CA * LD) + ue + uint64(u)]
                for u in range(4):
                    for a in range(AM):
                        for b in range(AN):
                            s[a, b] += qa[a, u] * kb[b, u]
                            dp[a, b] += da[a, u] * vb[b, u]

            for a in range(AM):
                r = ty_a + int32(a * RA)
                row = r0 + r
                lrow = sm[uint64(O_L + r)]
                drow = sm[uint64(O_D + r)]
                for b in range(AN):
                    c = tx_a + int32(b * CA)
                    col = c0 + c
                    p = float32(0.0)
                    if col < nk and (causal == 0 or col <= row + off):
                        p = math.exp(s[a, b] * scale - lrow)
                    sm[uint64(O_DS + r * LP + c)] = p * (dp[a, b] - drow)
            cuda.syncthreads()

            # dQ_i += dS K_j, each thread a QM x QN micro-tile, four keys a step.
            for c4 in range(BC // UC):
                uc = uint64(c4) * uint64(UC)
                for a in range(QM):
                    for u in range(UC):
                        sq[a, u] = sm[u_sq + uint64(a * RQ * LP) + uc + uint64(u)]
                for u in range(UC):
                    for b in range(QN):
                        kq[b] = sm[u_kq + (uc + uint64(u)) * uint64(LD) + uint64((b % VQ) + (b // VQ) * CQ * VQ)]
                    for a in range(QM):
                        for b in range(QN):
                            acc[a, b] += sq[a, u] * kq[b]
            since_flush += int32(1)
            if since_flush == int32(FLUSH):
                since_flush = int32(0)
                for a in range(QM):
                    for b in range(QN):
                        sm[uint64(O_SQ + (a * QN + b) * NT + t)] += acc[a, b]
                        acc[a, b] = float32(0.0)

        for a in range(QM):
            row = r0 + ty_q + int32(a * RQ)
            if row < nq:
                for b in range(QN):
                    e = tx_q * int32(VQ) + int32((b % VQ) + (b // VQ) * CQ * VQ)
                    if e < d:
                        dq[bh, row, e] = (sm[uint64(O_SQ + (a * QN + b) * NT + t)] + acc[a, b]) * scale

    return dq_kernel


# --------------------------------------------------------------------------- the launcher


def _check_like(x, name, shape, what):
    got, _ = check_array(x, name, ndim=len(shape), dtypes=(np.float32,))
    if tuple(got) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} ({what}), got {tuple(got)}")


def flash_attention_backward(q, k, v, o, lse, do, *, causal=False, scale=None, tiles=None,
                             dq_mode="atomic"):
    """Gradients (dq, dk, dv) of attention for the upstream gradient ``do``.

    q: (B, H, Nq, d), k and v: (B, H, Nk, d), o and do: (B, H, Nq, d), lse: (B, H, Nq)
    (natural log, -inf on rows that see nothing), all float32, the o and lse that the
    forward (``kernels.flash_forward.flash_attention``) returned. ``causal`` masks
    bottom-right aligned; ``scale`` defaults to 1/sqrt(d). ``tiles`` overrides the tile
    sizes (a ``Tiles``). ``dq_mode``: "atomic" (the default: float32 atomic adds from the
    K/V-tile-outer kernel; no recomputation, run-to-run differences in dQ's last bits) or
    "separate" (a second, Q-tile-outer kernel that recomputes S and dP; bitwise
    deterministic, slower).

    NumPy in, NumPy out; device arrays in, device arrays out.
    """
    B, H, nq, nk, d, _ = check_qkv(q, k, v)
    _check_like(o, "o", (B, H, nq, d), "the forward output, like q")
    _check_like(lse, "lse", (B, H, nq), "the forward logsumexp, (B, H, Nq)")
    _check_like(do, "do", (B, H, nq, d), "the gradient of o, like q")
    causal = check_flag(causal, "causal")
    scale = check_scale(scale, d)
    if not isinstance(dq_mode, str) or dq_mode not in DQ_MODES:
        raise ValueError(f"dq_mode: expected one of {DQ_MODES}, got {dq_mode!r}")
    D = head_dim_bucket(d)
    tiles = default_tiles(d) if tiles is None else tiles
    _check_tiles(tiles, D, dq_mode)

    kind = ArrayKind(q)
    bh = B * H
    if bh > MAX_GRID_Y:
        raise ValueError(f"q: expected B*H <= {MAX_GRID_Y} (one grid row a head), got B={B}, H={H}")
    if bh == 0 or nq == 0 or nk == 0:
        # Nothing to attend: every gradient is zero (or empty).
        shapes = ((B, H, nq, d), (B, H, nk, d), (B, H, nk, d))
        if not kind.on_device:
            return tuple(np.zeros(s, np.float32) for s in shapes)
        outs = []
        for s in shapes:
            host = np.zeros(s, np.float32)
            outs.append(kind.give_back(cuda.to_device(host)) if host.size else kind.give_back(device_empty(s)))
        return tuple(outs)

    dq_, dk_, dv_ = _launch(
        to_device(q, "q").reshape(bh, nq, d), to_device(k, "k").reshape(bh, nk, d),
        to_device(v, "v").reshape(bh, nk, d), to_device(o, "o").reshape(bh, nq, d),
        to_device(lse, "lse").reshape(bh, nq), to_device(do, "do").reshape(bh, nq, d),
        nq, nk, D, causal, scale, tiles, dq_mode)
    return tuple(kind.give_back(x.reshape(B, H, x.shape[1], d)) for x in (dq_, dk_, dv_))


def allocate_outputs(bh: int, nq: int, nk: int, d: int):
    """Device buffers (delta, dq, dk, dv) for ``_launch`` on (B*H, N, d) views."""
    return (device_empty((bh, nq)), device_empty((bh, nq, d)), device_empty((bh, nk, d)),
            device_empty((bh, nk, d)))


def _launch(q, k, v, o, lse, do, nq, nk, D, causal, scale, tiles, dq_mode, out=None):
    """Launch the three kernels on (B*H, N, d) device arrays; returns device (dq, dk, dv).

    ``out``: preallocated (delta, dq, dk, dv) from ``allocate_outputs`` (the bench times
    the kernels alone that way); allocated here when None.
    """
    bh, d = q.shape[0], q.shape[2]
    delta, dq, dk, dv = allocate_outputs(bh, nq, nk, d) if out is None else out
    atomic = dq_mode == "atomic"
    n_q, n_k = np.int32(nq), np.int32(nk)
    sc, ca = np.float32(scale), np.int32(1 if causal else 0)

    kern, rows_nt = make_delta(D, 4, atomic)
    kern[(cdiv(nq, rows_nt // 32), bh), rows_nt](o, do, delta, dq, n_q)

    dkdv_bytes, dq_bytes = shared_bytes(tiles, D)
    dyn = dkdv_bytes > STATIC_SHARED_LIMIT and not on_simulator()
    kern = make_dkdv(tiles.block_k, tiles.block_q, D, tiles.threads, dyn, atomic, tiles.dkdv_merged(D))
    args = (q, k, v, do, lse, delta, dq, dk, dv, n_q, n_k, sc, ca)
    if dyn:
        _raise_dynamic_limit(kern, DKDV_SIG, args, dkdv_bytes)
    kern[(cdiv(nk, tiles.block_k), bh), tiles.threads, 0, dkdv_bytes if dyn else 0](*args)

    if not atomic:
        dyn = dq_bytes > STATIC_SHARED_LIMIT and not on_simulator()
        kern = make_dq(tiles.dq_block_q, tiles.dq_block_k, D, tiles.dq_threads, dyn)
        args = (q, k, v, do, lse, delta, dq, n_q, n_k, sc, ca)
        if dyn:
            _raise_dynamic_limit(kern, DQ_SIG, args, dq_bytes)
        kern[(cdiv(nq, tiles.dq_block_q), bh), tiles.dq_threads, 0, dq_bytes if dyn else 0](*args)
    return dq, dk, dv


def io_model_bytes(B, H, nq, nk, d, tiles=None, dq_mode="atomic", causal=False, itemsize=4):
    """HBM bytes the three kernels move, by the IO model (no reuse through L2).

    delta: reads O, dO, writes D: 2 Nq d + Nq. dkdv: reads K, V once and writes dK, dV
    (4 Nk d); each of its Tc blocks streams Q, dO, L, D (2 Nq d + 2 Nq). dq (separate):
    reads Q, dO, L, D once and writes dQ (3 Nq d + 2 Nq); each of its Tr blocks streams
    K, V (2 Nk d). Atomic instead: each dkdv block reads and writes dQ (2 Nq d more a key
    tile), and the pre-pass clears dQ (Nq d). With Nq = Nk = N and Bc = Br this is PERF.md's
    6Nd + N + ceil(N/Bc)(4Nd + 2N) plus the terms it leaves out. Causal halves the streams.
    """
    tiles = tiles or default_tiles(d)
    tc = cdiv(nk, tiles.block_k)
    tr = cdiv(nq, tiles.dq_block_q)
    half = 0.5 if causal else 1.0
    elems = 2 * nq * d + nq + 4 * nk * d + half * tc * (2 * nq * d + 2 * nq)
    if dq_mode == "atomic":
        elems += nq * d + half * tc * 2 * nq * d
    else:
        elems += 3 * nq * d + 2 * nq + half * tr * 2 * nk * d
    return float(elems) * B * H * itemsize


def standard_backward_bytes(B, H, n, d, itemsize=4):
    """PERF.md's standard (unfused) backward: 7 N^2 + 10 N d + N elements a head."""
    return float(7 * n * n + 10 * n * d + n) * B * H * itemsize


# --------------------------------------------------------------------------- PTX targets

_A3 = "float32[:, :, ::1]"
_A2 = "float32[:, ::1]"
DELTA_SIG = f"void({_A3}, {_A3}, {_A2}, {_A3}, int32)"
DKDV_SIG = f"void({_A3}, {_A3}, {_A3}, {_A3}, {_A2}, {_A2}, {_A3}, {_A3}, {_A3}, int32, int32, float32, int32)"
DQ_SIG = f"void({_A3}, {_A3}, {_A3}, {_A3}, {_A2}, {_A2}, {_A3}, int32, int32, float32, int32)"


def ptx_targets():
    """(label, dispatcher, signature) for every kernel at its production tiles, d = 16..128."""
    targets = []
    for D in (16, 32, 64, 128):
        t = _GPU_TILES[D]
        dkdv_b, dq_b = shared_bytes(t, D)
        targets.append((f"flash bwd delta fp32 d={D}", make_delta(D)[0], DELTA_SIG))
        targets.append((f"flash bwd dkdv fp32 Bc={t.block_k} Br={t.block_q} t={t.threads} d={D}",
                        make_dkdv(t.block_k, t.block_q, D, t.threads, dkdv_b > STATIC_SHARED_LIMIT, False,
                                  t.dkdv_merged(D)), DKDV_SIG))
        targets.append((f"flash bwd dq fp32 Br={t.dq_block_q} Bc={t.dq_block_k} t={t.dq_threads} d={D}",
                        make_dq(t.dq_block_q, t.dq_block_k, D, t.dq_threads, dq_b > STATIC_SHARED_LIMIT), DQ_SIG))
    t = _GPU_TILES[64]
    dkdv_b = shared_bytes(t, 64)[0]
    targets.append(("flash bwd delta + clear dQ fp32 d=64", make_delta(64, 4, True)[0], DELTA_SIG))
    targets.append((f"flash bwd dkdv+atomic dQ fp32 Bc={t.block_k} Br={t.block_q} t={t.threads} d=64",
                    make_dkdv(t.block_k, t.block_q, 64, t.threads, dkdv_b > STATIC_SHARED_LIMIT, True,
                              t.dkdv_merged(64)), DKDV_SIG))
    return targets
