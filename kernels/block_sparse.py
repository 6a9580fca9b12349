"""Chapter 6: block-sparse FlashAttention, forward pass.

Chapter 4's forward walks every key tile for each query tile. A block mask says, tile by
tile, which (query tile, key tile) pairs may attend at all; a tile whose flag is off
contributes nothing, so the kernel need not even load it. What this chapter adds is only
that: the launcher turns the flags into a compact list of kept key tiles per query tile
(CSR: row offsets plus column indices, built on the host with NumPy), and the kernel walks
that list instead of every tile. Everything a block does with a tile (S = Q K^T, the
online softmax, O += P V, the epilogue) is chapter 4's ``make_attend_query_tile``, called
with ``listed_tile`` in place of ``every_tile``: with every tile kept this kernel is chapter
4's, by construction. Time and HBM traffic scale with the fraction rho of kept tiles:
2Nd + N + 2Nd * ceil(N / Br) * rho elements per head (``kernels/base/io_model.py``).

The mask: ``BlockMask(flags, block_q, block_k)`` (``kernels.base.masks``, also exported by
the oracle); ``flags`` is (Tq, Tk) shared by every head, (H, Tq, Tk) per head, or
(B, H, Tq, Tk), with Tq = ceil(Nq / block_q) and Tk = ceil(Nk / block_k). The kernel tile
(Br, Bc) must divide the mask block (block_q, block_k): then each kernel tile lies inside
one mask block and its flag is that block's flag. The launcher takes chapter 4's tiles and
shrinks Br and Bc to the largest powers of two that divide the mask's blocks; explicit
``tiles`` that do not divide them are refused.

Causal (bottom-right: query i sees key j iff j <= i + Nk - Nq) combines with the mask:
tiles wholly above the diagonal are dropped from the lists on the host, and the tiles the
diagonal crosses are masked element by element in the kernel. A query row with no kept
key gives O = 0 and L = -inf (its list is empty, or every score in it is masked).

Query tiles are launched longest list first (``row_order``): with uneven rows (global
tokens) the heavy blocks start early and the last wave is short.

The first versions (the notebook's kernel exercises, at the end): the same lists built on
the GPU, one thread a query tile (``first_tile_lists``), and a forward with one thread a
query row that skips the dropped key blocks, reading Q, K, V straight from HBM
(``first_block_sparse_attention``).
"""

from __future__ import annotations

import functools
import math
from collections import namedtuple
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, uint64

from kernels.base.fused import FASTMATH, MAX_GRID_Y, Tiles, check_tiles_type, nan_max, padded_head_dim
from kernels.base.inlined import inlined
from kernels.base.io_model import block_sparse_forward_bytes
from kernels.base.masks import BlockMask
from kernels.base.runtime import (ArrayKind, cdiv, check_array, check_flag, check_int, check_out, check_qkv,
                                  check_scale, device_empty, is_device_array, launch_stream, on_simulator,
                                  to_device)
from kernels.base.shared_memory import allow_dynamic_shared_memory
from kernels.flash_forward import check_tiles, default_tiles, gpu_tiles, make_attend_query_tile, shared_bytes

__all__ = ["block_sparse_attention", "make_block_sparse_forward", "listed_tile", "forward_tiles", "TileLists",
           "tile_lists", "lists_for", "fit_to_mask", "check_tiles_fit_mask", "mask_groups", "io_model_bytes",
           "make_first_tile_lists", "first_tile_lists", "make_first_block_sparse_forward",
           "first_block_sparse_attention", "first_threads", "ptx_targets"]


# --------------------------------------------------------------------------- tiles that fit the mask

def _largest_pow2_divisor(block: int, cap: int) -> int:
    """The largest power of two that divides ``block`` and is at most ``cap``."""
    return min(block & -block, 1 << (int(cap).bit_length() - 1))


def _check_block_mask_type(block_mask):
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask: expected a kernels.base.masks.BlockMask, got {type(block_mask).__name__}")


def fit_to_mask(block_mask, Br: int, Bc: int) -> tuple[int, int]:
    """The kernel tile (Br', Bc') for this mask from a preferred (Br, Bc): the largest power
    of two <= Br that divides the mask's block_q, likewise Bc and block_k. A kernel tile then
    lies inside one mask block, and its flag is that block's flag."""
    _check_block_mask_type(block_mask)
    return (_largest_pow2_divisor(int(block_mask.block_q), Br),
            _largest_pow2_divisor(int(block_mask.block_k), Bc))


def check_tiles_fit_mask(block_mask, Br: int, Bc: int, name: str = "tiles"):
    """ValueError naming block_mask unless the kernel tile Br x Bc divides the mask's blocks."""
    _check_block_mask_type(block_mask)
    bq, bk = int(block_mask.block_q), int(block_mask.block_k)
    if bq % Br or bk % Bc:
        raise ValueError(f"block_mask: its blocks {bq} x {bk} are not multiples of the kernel tile "
                         f"Br x Bc = {Br} x {Bc} ({name}); use tiles that divide the mask's blocks")


def forward_tiles(d: int, block_mask, tiles=None) -> tuple[Tiles, int]:
    """The forward's tiles and padded head dim D for head dim ``d`` and this mask.

    ``tiles`` None: chapter 4's tiles for d, Br and Bc shrunk to divide the mask's blocks
    (TM and TX shrunk with them, keeping whole warps where the tile allows). Given: they must divide the
    mask's blocks and pass chapter 4's checks."""
    if tiles is None:
        t = default_tiles(d)
        Br, Bc = fit_to_mask(block_mask, t.Br, t.Bc)
        TM, TX = min(t.TM, Br), min(t.TX, Bc)
        while not on_simulator() and (Br // TM) * TX < 32 and TM > 1:
            TM //= 2                              # more threads along the rows: whole warps
        tiles = Tiles(Br, Bc, TM, TX)            # (tiny mask blocks: fewer than 32 threads, one partial warp)
    else:
        check_tiles_type(tiles)
        check_tiles_fit_mask(block_mask, tiles.Br, tiles.Bc)
    D = padded_head_dim(d, tiles.TX)
    return check_tiles(tiles, D), D


# --------------------------------------------------------------------------- the compact lists

@dataclass
class TileLists:
    """Kept kernel tiles, per query tile (CSR) and per key tile (CSC), for every mask group.

    groups G is 1 (one mask for all heads), H (per head) or B*H; head bh = b*H + h uses
    group bh % G. Forward: the key tiles of query tile r in group g are
    ``col_idx[row_ptr[g*Tr + r] : row_ptr[g*Tr + r + 1]]``. Backward (dK, dV): the query
    tiles of key tile c are ``row_idx[col_ptr[g*Tc + c] : col_ptr[g*Tc + c + 1]]``.
    """

    Br: int
    Bc: int
    nq: int
    nk: int
    causal: bool
    groups: int
    kept: np.ndarray      # (G, Tr, Tc) bool: kernel tile kept (mask flag and not above the diagonal)
    row_ptr: np.ndarray   # (G*Tr + 1,) int32
    col_idx: np.ndarray   # (nnz,) int32
    col_ptr: np.ndarray   # (G*Tc + 1,) int32
    row_idx: np.ndarray   # (nnz,) int32
    row_order: np.ndarray  # (G*Tr,) int32: per group, the query tiles by decreasing list length
    col_order: np.ndarray  # (G*Tc,) int32: per group, the key tiles by decreasing list length

    @property
    def kept_fraction(self) -> float:
        """rho: the fraction of (query tile, key tile) pairs the kernels visit."""
        return float(self.kept.mean()) if self.kept.size else 0.0

    def device(self) -> "DeviceLists":
        """The index arrays on the device (copied once, then cached)."""
        if getattr(self, "_dev", None) is None:
            pad = lambda a: a if a.size else np.zeros(1, np.int32)  # noqa: E731  (no empty device arrays)
            self._dev = DeviceLists(*(cuda.to_device(pad(getattr(self, name))) for name in DeviceLists._fields))
        return self._dev


DeviceLists = namedtuple("DeviceLists", "row_ptr col_idx row_order col_ptr row_idx col_order")


def mask_groups(block_mask: BlockMask, b: int, h: int, nq: int, nk: int) -> np.ndarray:
    """The mask flags as (G, Tq, Tk), checked against the shapes of q and k."""
    _check_block_mask_type(block_mask)
    flags = block_mask.flags
    tq, tk = block_mask.tiles_for(nq, nk)
    if flags.shape[-2:] != (tq, tk):
        raise ValueError(
            f"block_mask: expected flags of {tq} x {tk} tiles (ceil(Nq/block_q) x ceil(Nk/block_k) for "
            f"Nq={nq}, Nk={nk}, blocks {block_mask.block_q} x {block_mask.block_k}), got shape {flags.shape}")
    if flags.ndim == 3 and flags.shape[0] != h:
        raise ValueError(f"block_mask: expected per-head flags (H={h}, {tq}, {tk}), got shape {flags.shape}")
    if flags.ndim == 4 and flags.shape[:2] != (b, h):
        raise ValueError(f"block_mask: expected flags (B={b}, H={h}, {tq}, {tk}), got shape {flags.shape}")
    groups = 1 if flags.ndim == 2 else (h if flags.ndim == 3 else b * h)
    return flags.reshape(groups, tq, tk)


def tile_lists(block_mask: BlockMask, nq: int, nk: int, *, Br: int, Bc: int, causal=False,
               batch: int = 1, heads: int = 1) -> TileLists:
    """Build the compact lists of kept (Br x Bc) kernel tiles from the mask's flags (NumPy).

    Br must divide block_q and Bc block_k, so kernel tile (r, c) lies inside mask block
    (r*Br // block_q, c*Bc // block_k). With ``causal``, tiles wholly above the
    bottom-right diagonal (first key > last query + Nk - Nq) are dropped.
    """
    if block_mask.block_q % Br or block_mask.block_k % Bc:
        raise ValueError(f"block_mask: blocks {block_mask.block_q} x {block_mask.block_k} are not multiples "
                         f"of the kernel tiles {Br} x {Bc}")
    flags = mask_groups(block_mask, batch, heads, nq, nk)
    tr, tc = cdiv(nq, Br), cdiv(nk, Bc)
    rows = (np.arange(tr) * Br) // block_mask.block_q
    cols = (np.arange(tc) * Bc) // block_mask.block_k
    kept = flags[:, rows[:, None], cols[None, :]].astype(bool)
    if causal:
        last_q = np.minimum((np.arange(tr) + 1) * Br, nq) - 1   # last query row of each tile
        first_k = np.arange(tc) * Bc
        kept = kept & (first_k[None, :] <= last_q[:, None] + (nk - nq))[None]
    g = kept.shape[0]
    row_ptr = np.zeros(g * tr + 1, np.int32)
    np.cumsum(kept.sum(axis=2).ravel(), out=row_ptr[1:])
    col_idx = np.nonzero(kept)[2].astype(np.int32)
    kept_t = kept.transpose(0, 2, 1)
    col_ptr = np.zeros(g * tc + 1, np.int32)
    np.cumsum(kept_t.sum(axis=2).ravel(), out=col_ptr[1:])
    row_idx = np.nonzero(kept_t)[2].astype(np.int32)
    # Launch order: the tiles with the most work first (a stable sort keeps ties in order).
    row_order = np.argsort(-kept.sum(axis=2), axis=1, kind="stable").astype(np.int32).ravel()
    col_order = np.argsort(-kept.sum(axis=1), axis=1, kind="stable").astype(np.int32).ravel()
    return TileLists(Br, Bc, nq, nk, bool(causal), g, kept, row_ptr, col_idx, col_ptr, row_idx, row_order,
                     col_order)


def lists_for(block_mask, lists, b, h, nq, nk, causal, Br, Bc):
    """Use precomputed ``lists`` after checking they fit this call, or build them."""
    if lists is None:
        return tile_lists(block_mask, nq, nk, Br=Br, Bc=Bc, causal=causal, batch=b, heads=h)
    if not isinstance(lists, TileLists):
        raise TypeError(f"lists: expected a TileLists from tile_lists(), got {type(lists).__name__}")
    mask_groups(block_mask, b, h, nq, nk)
    got = (lists.Br, lists.Bc, lists.nq, lists.nk, lists.causal)
    want = (Br, Bc, nq, nk, causal)
    if got != want or lists.groups not in (1, h, b * h):
        raise ValueError(f"lists: built for (Br, Bc, Nq, Nk, causal) = {got}, this call needs {want}")
    return lists


# --------------------------------------------------------------------------- the kernel: the list walk

@inlined
def listed_tile(col_idx, t):
    """The t-th kept K/V tile of a query tile: entry t of the compact list."""
    return col_idx[t]


@functools.lru_cache(maxsize=None)
def make_block_sparse_forward(Br: int, Bc: int, D: int, TM: int, TX: int, prefetch: bool = False):
    """The block-sparse forward kernel: chapter 4's query-tile forward over a list of tiles.

    Launch: grid (Tr, B*H), (Br / TM) * TX threads, ``shared_bytes(Tiles(...), D)`` bytes
    of dynamic shared memory. Arguments: q (B*H, Nq, d), k, v (B*H, Nk, d) float32 or
    float16; o (B*H, Nq, d), lse (B*H, Nq) float32; the lists' row_ptr, col_idx, row_order
    (int32); groups (int32: heads bh use mask group bh % groups), d (int32), scale
    (float32), causal (int32 0/1)."""
    attend = make_attend_query_tile(Br, Bc, D, TM, TX, prefetch, listed_tile)

    @cuda.jit(fastmath=FASTMATH)
    def block_sparse_forward(q, k, v, o, lse, row_ptr, col_idx, row_order, groups, d, scale, causal):
        bh = uint64(cuda.blockIdx.y)              # (batch, head)
        tr = int32(cuda.gridDim.x)
        g = int32(bh) % groups                    # which mask this head uses
        i = row_order[g * tr + int32(cuda.blockIdx.x)]   # query tile i: the longest lists first
        first = row_ptr[g * tr + i]               # its kept K/V tiles: col_idx[first : first + count]
        count = row_ptr[g * tr + i + 1] - first
        attend(q[bh], k[bh], v[bh], o[bh], lse[bh], i * Br, d, scale, causal, col_idx, first, count)

    return block_sparse_forward


def io_model_bytes(b, h, nq, nk, d, *, Br, rho, in_bytes=4):
    """HBM bytes of the forward by the IO model (``kernels/base/io_model.py``): per head, Q
    read and O written once (2 Nq d), L written (Nq), and K, V read once for every kept
    tile: 2 Nk d ceil(Nq/Br) rho, where rho is the kept fraction of the Tr x Tc tiles."""
    return block_sparse_forward_bytes(b, h, nq, nk, d, Br=Br, rho=rho, itemsize=in_bytes)


# --------------------------------------------------------------------------- the launcher

def block_sparse_attention(q, k, v, block_mask, *, causal=False, scale=None, tiles: Tiles | None = None,
                           lists=None):
    """Block-sparse attention forward: (O, L) with O = softmax(scale Q K^T + mask) V.

    q: (B, H, Nq, d), k, v: (B, H, Nk, d), float32 or float16, d <= 128; block_mask: a
    ``BlockMask`` with flags (Tq, Tk), (H, Tq, Tk) or (B, H, Tq, Tk). ``tiles`` overrides
    the kernel tiles (chapter 4's ``Tiles``; Br and Bc must divide the mask's blocks);
    ``lists`` reuses the ``tile_lists(...)`` of an earlier call with the same mask, shapes,
    causal and tiles. Returns O (B, H, Nq, d) and L (B, H, Nq) float32; a row with no kept
    key gets O = 0 and L = -inf. NumPy in, NumPy out; device arrays in, device arrays out.
    """
    b, h, nq, nk, d, _ = check_qkv(q, k, v, dtypes=(np.float32, np.float16), max_head_dim=128)
    causal = check_flag(causal, "causal")
    scale = check_scale(scale, d)
    tiles, D = forward_tiles(d, block_mask, tiles)
    tl = lists_for(block_mask, lists, b, h, nq, nk, causal, tiles.Br, tiles.Bc)
    if b * h > MAX_GRID_Y:
        raise ValueError(f"q: expected B*H <= {MAX_GRID_Y} (one grid row a head), got B={b}, H={h}")
    kind = ArrayKind(q)
    o = kind.empty((b, h, nq, d))                      # the caller's allocator where it has one
    lse = kind.empty((b, h, nq))
    if b * h * nq == 0:
        return kind.give_back(o), kind.give_back(lse)
    qd, kd, vd = (to_device(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    dev = tl.device()
    kernel = make_block_sparse_forward(tiles.Br, tiles.Bc, D, tiles.TM, tiles.TX)
    nbytes = shared_bytes(tiles, D)
    args = (qd.reshape(b * h, nq, d), kd.reshape(b * h, nk, d), vd.reshape(b * h, nk, d),
            o.reshape(b * h, nq, d), lse.reshape(b * h, nq), dev.row_ptr, dev.col_idx, dev.row_order,
            np.int32(tl.groups), np.int32(d), np.float32(scale), np.int32(causal))
    allow_dynamic_shared_memory(kernel, args, nbytes)
    kernel[(cdiv(nq, tiles.Br), b * h), tiles.threads, launch_stream(), nbytes](*args)
    return kind.give_back(o), kind.give_back(lse)


# --------------------------------------------------------------------------- the first versions
# The notebook's two kernel exercises (their solutions, not printed there): the kept-tile
# lists built on the GPU, one thread a query tile, and a first block-sparse forward, one
# thread a query row. A learner's factory of the same name replaces them
# (``kernels.base.learner``) and tests/test_block_sparse.py grades it; the launchers look
# the factories up at every call. Both are correct and simple, not fast: the forward reads
# Q, K, V from HBM with no tile on chip (d loads of K and d of V a kept score) and keeps
# its running O in HBM too.

EXERCISES = {"make_first_tile_lists": "first_tile_lists", "make_first_block_sparse_forward": "first_forward"}


def first_threads() -> int:
    """Threads a block of the first versions' launches (thread t of the grid is thread
    t % first_threads() of block t // first_threads())."""
    return 32 if on_simulator() else 128


@functools.lru_cache(maxsize=None)
def make_first_tile_lists():
    """Kernel (flags, col_idx, count, Br, Bc, block_q, block_k, nq, nk, causal): the kept
    tiles of every query tile, one thread a (mask group g, query tile r) pair: thread
    t = g*Tr + r of the grid. flags (G, Tq, Tk) uint8, the mask's flags (1 = kept); col_idx
    (G, Tr, Tc) and count (G, Tr) int32, Tr = ceil(Nq/Br), Tc = ceil(Nk/Bc). The thread
    writes the kept key tiles of query tile r, in increasing order, to col_idx[g, r, :n] and
    n to count[g, r] (entries past n are not read): kernel tile (r, c) is kept when the
    flag of its mask block (r*Br // block_q, c*Bc // block_k) is on and, with causal (0/1),
    its first key c*Bc is not past the diagonal of its last query, min((r+1) Br, Nq) - 1 +
    Nk - Nq. Exactly ``tile_lists``'s rows, one padded row a query tile."""

    @cuda.jit
    def first_tile_lists_kernel(flags, col_idx, count, Br, Bc, block_q, block_k, nq, nk, causal):
        t = cuda.grid(1)
        groups, tr, tc = col_idx.shape
        if t >= groups * tr:
            return
        g, r = t // tr, t % tr
        mask_row = r * Br // block_q                  # the mask block row this query tile lies in
        last_q = min((r + 1) * Br, nq) - 1             # its last query row (the last tile may be short)
        n = 0
        for c in range(tc):
            if causal and c * Bc > last_q + nk - nq:
                break                                  # this key tile and all after it: above the diagonal
            if flags[g, mask_row, c * Bc // block_k]:
                col_idx[g, r, n] = c                   # compact: the n-th kept tile of the row
                n += 1
        count[g, r] = n

    return first_tile_lists_kernel


def _check_int32_out(out, name, shape):
    """``out``: None, or a C-contiguous int32 device array of ``shape`` (as ``check_out``
    for float32)."""
    if out is None:
        return None
    if not is_device_array(out):
        raise TypeError(f"{name}: expected a device array (or None), got {type(out).__name__}")
    got, _ = check_array(out, name, ndim=len(shape), dtypes=(np.int32,))
    if tuple(got) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(got)}")
    return to_device(out, name)


def _flags_on_device(flags):
    """The (G, Tq, Tk) flags as uint8 on the device (1 = kept)."""
    return cuda.to_device(np.ascontiguousarray(flags, dtype=np.uint8))


def first_tile_lists(block_mask, nq, nk, *, Br, Bc, causal=False, batch=1, heads=1, out=None, count_out=None):
    """The kept-tile lists by ``make_first_tile_lists``'s kernel, one thread a query tile:
    (col_idx (G, Tr, Tc), count (G, Tr)), int32, where col_idx[g, r, :count[g, r]] is what
    ``tile_lists(...)`` lists for query tile r of mask group g (G = 1, H or B*H, as the
    mask's flags). ``out``/``count_out``: int32 device arrays of those shapes to write into
    (returned as given); otherwise NumPy arrays (entries past a row's count are undefined)."""
    nq, nk = check_int(nq, "nq", 0, 2**31 - 1), check_int(nk, "nk", 0, 2**31 - 1)
    Br, Bc = check_int(Br, "Br", 1, 2**20), check_int(Bc, "Bc", 1, 2**20)
    batch, heads = check_int(batch, "batch", 1, 2**31 - 1), check_int(heads, "heads", 1, 2**31 - 1)
    causal = check_flag(causal, "causal")
    flags = mask_groups(block_mask, batch, heads, nq, nk)
    check_tiles_fit_mask(block_mask, Br, Bc, name="Br, Bc")
    g, tr, tc = flags.shape[0], cdiv(nq, Br), cdiv(nk, Bc)
    col_idx, count = _check_int32_out(out, "out", (g, tr, tc)), _check_int32_out(count_out, "count_out", (g, tr))
    col_idx = device_empty((g, tr, tc), np.int32) if col_idx is None else col_idx
    count = device_empty((g, tr), np.int32) if count is None else count
    if g * tr:
        threads = first_threads()
        make_first_tile_lists()[cdiv(g * tr, threads), threads](
            _flags_on_device(flags), col_idx, count, np.int32(Br), np.int32(Bc), np.int32(block_mask.block_q),
            np.int32(block_mask.block_k), np.int32(nq), np.int32(nk), np.int32(causal))
    return (out if out is not None else col_idx.copy_to_host(),
            count_out if count_out is not None else count.copy_to_host())


_NEG_INF = float32(-math.inf)


@functools.lru_cache(maxsize=None)
def make_first_block_sparse_forward():
    """Kernel (q, k, v, o, lse, flags, block_q, block_k, scale, causal) on (B*H, N, d)
    float32 views of Q, K, V, O, the (B*H, Nq) view of L and the mask's (G, Tq, Tk) uint8
    flags (head z uses group z % G): one thread a query row, thread t = z*Nq + i of the
    grid. It walks the key blocks of its row, skips every block whose flag is off (and,
    with causal, stops at the first key past i + Nk - Nq), and runs the online softmax over
    the keys it keeps: m = max so far, l = sum exp(s - m), O rescaled like l. Q, K, V are
    read from HBM and the running O lives in its output row. A row with no kept key gets
    O = 0 and L = -inf; else O = O / l and L = m + log l."""

    @cuda.jit(fastmath=FASTMATH)
    def first_block_sparse_forward_kernel(q, k, v, o, lse, flags, block_q, block_k, scale, causal):
        t = cuda.grid(1)
        bh, nq, d = q.shape
        nk = k.shape[1]
        if t >= bh * nq:
            return
        z, i = t // nq, t % nq
        g = z % flags.shape[0]                          # the mask group of head z
        last = i + nk - nq                              # causal: the last key query i may see
        for c in range(d):
            o[z, i, c] = float32(0.0)                   # O = 0: the running sum starts empty
        m = _NEG_INF
        l = float32(0.0)
        for kb in range(flags.shape[2]):                # key block kb: keys kb*block_k ...
            start = kb * block_k
            if causal and start > last:
                break                                   # every later key is masked too
            if not flags[g, i // block_q, kb]:
                continue                                # the mask drops the whole block: no loads
            stop = min(start + block_k, nk)
            if causal:
                stop = min(stop, last + 1)
            for j in range(start, stop):
                s = float32(0.0)                        # S_ij = scale q_i . k_j
                for c in range(d):
                    s += q[z, i, c] * k[z, j, c]
                s *= scale
                m_new = nan_max(m, s)
                alpha = math.exp(m - m_new)             # rescales what was summed at the old max
                p = math.exp(s - m_new)
                l = l * alpha + p
                for c in range(d):
                    o[z, i, c] = o[z, i, c] * alpha + p * v[z, j, c]
                m = m_new
        if l == float32(0.0):                           # nothing kept: O stays 0, L = log 0
            lse[z, i] = _NEG_INF
            return
        inv = float32(1.0) / l
        for c in range(d):
            o[z, i, c] *= inv
        lse[z, i] = m + math.log(l)

    return first_block_sparse_forward_kernel


def first_block_sparse_attention(q, k, v, block_mask, *, causal=False, scale=None, out=None, lse_out=None):
    """Block-sparse attention by ``make_first_block_sparse_forward``'s kernel, one thread a
    query row: (O, L) as ``block_sparse_attention`` gives them (float32 inputs). ``out``/
    ``lse_out``: float32 device arrays (B, H, Nq, d) and (B, H, Nq) to write into (returned
    as given)."""
    b, h, nq, nk, d, _ = check_qkv(q, k, v, max_head_dim=128)
    causal = check_flag(causal, "causal")
    scale = check_scale(scale, d)
    flags = mask_groups(block_mask, b, h, nq, nk)
    kind = ArrayKind(q)
    o, lse = check_out(out, "out", (b, h, nq, d)), check_out(lse_out, "lse_out", (b, h, nq))
    o = device_empty((b, h, nq, d)) if o is None else o
    lse = device_empty((b, h, nq)) if lse is None else lse
    rows = b * h * nq
    if rows:
        threads = first_threads()
        qd, kd, vd = (to_device(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
        make_first_block_sparse_forward()[cdiv(rows, threads), threads](
            qd.reshape(b * h, nq, d), kd.reshape(b * h, nk, d), vd.reshape(b * h, nk, d), o.reshape(b * h, nq, d),
            lse.reshape(b * h, nq), _flags_on_device(flags), np.int32(block_mask.block_q),
            np.int32(block_mask.block_k), np.float32(scale), np.int32(causal))
    return (out if out is not None else kind.give_back(o),
            lse_out if lse_out is not None else kind.give_back(lse))


# --------------------------------------------------------------------------- PTX check

def _sig(dtype):
    a3 = f"{dtype}[:, :, ::1]"
    return (f"void({a3}, {a3}, {a3}, float32[:, :, ::1], float32[:, ::1], int32[::1], int32[::1], int32[::1], "
            f"int32, int32, float32, int32)")


def ptx_targets(every_shape: bool = False):
    """The forward kernel at the tiles the launcher picks for 128 x 128 mask blocks, d = 64
    and 128 (``every_shape``: and 32; fp32, fp16 inputs at d = 64), and the two first
    versions (the exercises' kernels), for the sm_90 PTX check."""
    out = []
    for d in (32, 64, 128) if every_shape else (64, 128):
        t0 = gpu_tiles(d)
        t = Tiles(min(t0.Br, 128), min(t0.Bc, 128), t0.TM, t0.TX)
        D = max(padded_head_dim(d, t.TX), 16)
        kern = make_block_sparse_forward(t.Br, t.Bc, D, t.TM, t.TX)
        for dt in (("float32", "float16") if d == 64 else ("float32",)):
            out.append((f"block-sparse fwd {dt} {t} D={D}", kern, _sig(dt)))
    a3 = "float32[:, :, ::1]"
    out.append(("first tile lists (one thread a query tile)", make_first_tile_lists(),
                "void(uint8[:, :, ::1], int32[:, :, ::1], int32[:, ::1], int32, int32, int32, int32, int32, int32, "
                "int32)"))
    out.append(("first block-sparse fwd fp32 (one thread a query row)", make_first_block_sparse_forward(),
                f"void({a3}, {a3}, {a3}, {a3}, float32[:, ::1], uint8[:, :, ::1], int32, int32, float32, int32)"))
    return out
