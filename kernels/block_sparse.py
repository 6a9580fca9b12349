"""Chapter 6: block-sparse FlashAttention, forward pass.

The fused forward of chapter 4 walks every key tile for each query tile. A block mask
says, tile by tile, which (query tile, key tile) pairs may attend at all; a tile whose
flag is off contributes nothing, so the kernel need not even load it. Here the launcher
turns the flags into a compact list of kept key tiles per query tile (CSR: row offsets
plus column indices, built on the host with NumPy), and the kernel's inner loop walks
that list instead of ``range(Tc)``. Time and HBM traffic then scale with the fraction rho
of kept tiles: 2Nd + N + 2Nd * ceil(N / Br) * rho elements per head.

The mask: ``kernels.reference.BlockMask(flags, block_q, block_k)``; ``flags`` is (Tq, Tk)
shared by every head, (H, Tq, Tk) per head, or (B, H, Tq, Tk), with Tq = ceil(Nq /
block_q) and Tk = ceil(Nk / block_k). The kernel tile (Br, Bc) must divide the mask block
(block_q, block_k): then each kernel tile lies inside one mask block and its flag is that
block's flag. The launcher picks the largest power-of-two tile not above the production
tile that divides the mask block; explicit tiles that do not divide it are refused.

Causal (bottom-right: query i sees key j iff j <= i + Nk - Nq) combines with the mask:
tiles wholly above the diagonal are dropped from the lists on the host, and the tiles the
diagonal crosses are masked element by element in the kernel. A query row with no kept
key gives O = 0 and L = -inf (its list is empty, or every score in it is masked).

The kernel is chapter 4's FlashAttention-2 loop order (Q tile outer, O accumulated in
registers), register-tiled:

* a block of (Br / RM) x TC threads owns a Br-row query tile; thread (ty, tx) owns rows
  ty*RM .. ty*RM + RM - 1 and, of S, columns tx, tx + TC, ...; of O, the same RM rows
  and head-dim columns tx, tx + TC, ... (RM x Bc/TC scores and RM x D/TC outputs);
* the tiles live in one dynamic shared buffer (99 KB at Br=128, Bc=64, d=64; above 48 KB
  through kernels/shared_memory.py): Qt, Kt and Pt transposed, their rows padded by one
  float; a thread's RM rows of Qt and Pt are adjacent words, its columns of Kt and V are
  TC apart: every shared load of the hot loops is conflict-free or a broadcast;
* the scale multiplies the finished dot products (S = scale * Q K^T, rounded like the
  float32 NumPy it is measured against);
* the row maximum m is combined across the TC threads of a row with warp shuffles (in the
  simulator, which has none, through shared memory); the row sum l only once, at the end;
* query tiles are launched longest list first (``row_order``): with uneven rows (global
  tokens) the heavy blocks start early and the last wave is short;
* masked scores are set to a large negative number instead of -inf (fastmath may assume
  no infinities), m starts at -1e30, so exp(masked - m) is exactly 0 and never NaN;
* per-thread arrays are ``cuda.local.array`` indexed only by unrolled constant loop
  indices, so they live in registers (the PTX check warns on any ``.local``).
"""

from __future__ import annotations

import functools
import math
from collections import namedtuple
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, uint64

from kernels.reference import BlockMask
from kernels.runtime import (ArrayKind, cdiv, check_flag, check_qkv, check_scale, device_empty,
                             on_simulator, to_device)
from kernels.shared_memory import allow_dynamic_shared_memory

__all__ = ["block_sparse_attention", "block_sparse_attention_backward", "make_forward", "TileLists",
           "tile_lists", "forward_config", "FORWARD_CONFIGS", "io_model_bytes", "ptx_targets"]

# Scores outside the mask become MASKED, a finite sentinel (fastmath lets the compiler
# assume there are no infinities); the running max starts there too, and a row whose max is
# still MASKED has seen no key (its P is 0 by a branch, never exp(0) of two sentinels).
MASKED = float32(-1.0e30)
NEG_INF = float32(-math.inf)
SHARED_LIMIT = 48 * 1024  # static shared memory a block may declare

# Production tiles for the H100, by padded head dim D: (Br, Bc, RM, TC), the same tiles
# as chapter 4's dense kernel. threads = Br / RM * TC; each thread owns RM x Bc/TC scores
# and RM x D/TC outputs. Shared memory (floats, one dynamic buffer, see forward_layout):
# Qt D x (Br + 1), Kt D x (Bc + 1), V Bc x D, Pt Bc x (Br + 1).
FORWARD_CONFIGS = {
    32: (128, 64, 8, 8),    # 66 KB, 128 threads, 8x8 scores, 8x4 outputs
    64: (128, 64, 8, 8),    # 99 KB, 128 threads, 8x8 scores, 8x8 outputs
    128: (64, 32, 4, 8),    # 74 KB, 128 threads, 4x4 scores, 4x16 outputs
}
# The simulator runs each thread in Python: small tiles, 16 threads.
SIM_CONFIG = (8, 8, 2, 4)


def forward_layout(Br, Bc, D, TC):
    """Offsets (floats) of Qt, Kt, V, Pt in the dynamic shared buffer, the row strides of
    Qt, Kt and Pt, and the total. The transposed tiles' rows are padded (Qt, Kt by one
    float, Pt by 32/TC), so that the transposing stores hit different banks."""
    QS, KS, PS = Br + 1, Bc + 1, Br + 32 // TC
    q_off = 0
    k_off = q_off + D * QS
    v_off = k_off + D * KS
    p_off = v_off + Bc * D
    return q_off, k_off, v_off, p_off, QS, KS, PS, p_off + Bc * PS


def shared_bytes_forward(Br, Bc, D, RM, TC) -> int:
    return 4 * forward_layout(Br, Bc, D, TC)[-1]


def _pow2_at_most(n: int) -> int:
    return 1 << (int(n).bit_length() - 1)


def _largest_pow2_divisor(block: int, cap: int) -> int:
    """The largest power of two that divides ``block`` and is at most ``cap``."""
    t = block & -block  # largest power of two dividing block
    return min(t, _pow2_at_most(cap))


def padded_head_dim(d: int, tc: int) -> int:
    """D: the head dim the kernel is compiled for, the next power of two >= d (and >= TC,
    >= 16 on a GPU); zeros fill the rest. A power of two, so that the tile copies split the
    block's threads evenly over the columns."""
    D = 1 << (max(d, 1) - 1).bit_length()
    return max(D, tc) if on_simulator() else max(D, tc, 16)


@dataclass(frozen=True)
class KernelConfig:
    Br: int
    Bc: int
    RM: int
    TC: int
    D: int


def _check_block_mask_type(block_mask):
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask: expected a kernels.reference.BlockMask, got {type(block_mask).__name__}")


def fit_tiles(block_mask, Br, Bc, RM, TC, block_m, block_n):
    """Kernel tiles that divide the mask's blocks.

    ``block_m``/``block_n`` given: they must divide block_q/block_k (ValueError naming
    block_mask otherwise). Not given: the largest power of two <= the production tile
    that divides the mask block. RM and TC shrink with the tile when they must.
    """
    _check_block_mask_type(block_mask)
    bq, bk = int(block_mask.block_q), int(block_mask.block_k)
    if block_m is None:
        Br = _largest_pow2_divisor(bq, Br)
    else:
        if not isinstance(block_m, (int, np.integer)) or block_m < 1 or block_m & (block_m - 1):
            raise ValueError(f"block_m: expected a power of two, got {block_m!r}")
        if bq % block_m:
            raise ValueError(f"block_mask: its block_q = {bq} is not a multiple of the kernel's query tile "
                             f"block_m = {block_m}; use a block_m that divides block_q")
        Br = int(block_m)
    if block_n is None:
        Bc = _largest_pow2_divisor(bk, Bc)
    else:
        if not isinstance(block_n, (int, np.integer)) or block_n < 1 or block_n & (block_n - 1):
            raise ValueError(f"block_n: expected a power of two, got {block_n!r}")
        if bk % block_n:
            raise ValueError(f"block_mask: its block_k = {bk} is not a multiple of the kernel's key tile "
                             f"block_n = {block_n}; use a block_n that divides block_k")
        Bc = int(block_n)
    RM = min(RM, Br)
    TC = min(TC, Bc)
    return Br, Bc, RM, TC


def forward_config(d, block_mask, block_m=None, block_n=None) -> KernelConfig:
    """The forward kernel's tiles for head dim ``d`` and this mask."""
    if on_simulator():
        Br, Bc, RM, TC = SIM_CONFIG
    else:
        D0 = 32 if d <= 32 else (64 if d <= 64 else 128)
        Br, Bc, RM, TC = FORWARD_CONFIGS[D0]
    Br, Bc, RM, TC = fit_tiles(block_mask, Br, Bc, RM, TC, block_m, block_n)
    return KernelConfig(Br, Bc, RM, TC, padded_head_dim(d, TC))


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


def _lists_for(block_mask, lists, b, h, nq, nk, causal, Br, Bc):
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


# --------------------------------------------------------------------------- the kernel

def _make_row_reductions(TC: int, NT: int):
    """row_max(x), row_sum(x) over the TC neighbouring threads that share a row.

    On a GPU: log2(TC) warp shuffles (``shfl_xor``), no shared memory, no barrier (the TC
    threads of a row are consecutive lanes of one warp). The simulator has no shuffles:
    there the threads swap values through shared memory between barriers (every thread
    calls these together, as the lanes of a warp would)."""
    if not on_simulator():
        MASK = 0xFFFFFFFF if NT >= 32 else (1 << NT) - 1   # the lanes that exist

        @cuda.jit(device=True, inline=True)
        def row_max(x):
            lane = TC // 2
            while lane > 0:
                x = max(x, cuda.shfl_xor_sync(MASK, x, lane))
                lane //= 2
            return x

        @cuda.jit(device=True, inline=True)
        def row_sum(x):
            lane = TC // 2
            while lane > 0:
                x += cuda.shfl_xor_sync(MASK, x, lane)
                lane //= 2
            return x
        return row_max, row_sum

    def exchange(x):
        swap = cuda.shared.array(NT, float32)
        tid = cuda.threadIdx.x
        cuda.syncthreads()
        swap[tid] = x
        cuda.syncthreads()
        return swap[tid - tid % TC: tid - tid % TC + TC]

    @cuda.jit(device=True)
    def row_max(x):
        return max(exchange(x))

    @cuda.jit(device=True)
    def row_sum(x):
        total = float32(0.0)
        for t in exchange(x):   # in lane order, like the shuffle tree's pairs would not be
            total += t
        return total
    return row_max, row_sum


@functools.lru_cache(maxsize=None)
def make_forward(Br: int, Bc: int, D: int, RM: int, TC: int):
    """The block-sparse forward kernel for query tile Br, key tile Bc, padded head dim D,
    RM rows per thread and TC threads across a row (all powers of two).

    Launch: grid (Tr, B*H), (Br/RM)*TC threads, ``shared_bytes_forward(Br, Bc, D, RM, TC)``
    bytes of dynamic shared memory (raised above 48 KB by kernels.shared_memory)."""
    for name, x in (("Br", Br), ("Bc", Bc), ("D", D), ("RM", RM), ("TC", TC)):
        if x < 1 or x & (x - 1):
            raise ValueError(f"make_forward: expected {name} a power of two, got {x}")
    if RM > Br or TC > Bc or TC > D or TC > 32:
        raise ValueError(f"make_forward: need RM <= Br, TC <= Bc, TC <= D and TC <= 32; got Br={Br} Bc={Bc} "
                         f"D={D} RM={RM} TC={TC}")
    TR = Br // RM          # thread rows: thread (ty, tx) owns the rows ty + TR*i, i < RM
    NT = TR * TC           # threads a block
    CN = Bc // TC          # score columns a thread owns: tx + TC*j
    DN = D // TC           # output columns a thread owns: tx + TC*j
    LOAD_COLS = min(D, NT)            # tile copies: a pass copies LOAD_ROWS rows of LOAD_COLS columns
    LOAD_ROWS = NT // LOAD_COLS
    Q_PASSES, KV_PASSES = cdiv(Br, LOAD_ROWS), cdiv(Bc, LOAD_ROWS)
    ROWS_EXACT = Br % LOAD_ROWS == 0 and Bc % LOAD_ROWS == 0   # no pass runs past the tile
    Q_OFF, K_OFF, V_OFF, P_OFF, QS, KS, PS, _ = forward_layout(Br, Bc, D, TC)
    row_max, row_sum = _make_row_reductions(TC, NT)

    @cuda.jit(fastmath=True)
    def block_sparse_forward(q, k, v, o, lse, row_ptr, col_idx, row_order, nq, nk, d, groups, scale, causal):
        smem = cuda.shared.array(0, float32)       # Qt | Kt | V | Pt, see forward_layout
        tid = int32(cuda.threadIdx.x)
        ty = tid // TC
        tx = tid - ty * TC
        bh = int32(cuda.blockIdx.y)
        tr = int32(cuda.gridDim.x)
        g = bh % groups                            # which mask this head uses
        # Query tiles with the longest lists first, so that the last wave of blocks is short.
        rt = row_order[g * tr + int32(cuda.blockIdx.x)]
        q0 = rt * Br
        shift = nk - nq                            # causal: key j <= query i + shift
        # Shared-memory offsets in the hot loops are unsigned: Numba adds a negative-index
        # wraparound to signed indices, which costs integer instructions per load.
        utx = uint64(tx)
        uty = uint64(ty)
        qh = q[uint64(bh)]                         # this head's Q, K, V: (N, d) views
        kh = k[uint64(bh)]
        vh = v[uint64(bh)]

        # Tile copies, HBM -> shared memory: thread tid copies column lc of the rows lr,
        # lr + LOAD_ROWS, ... (consecutive threads, consecutive columns: coalesced). Every
        # load reads a valid address (row and column clamped) and is zeroed afterwards if it
        # lies outside the matrix: no branch around a load, so they are all in flight at once.
        lc = tid % LOAD_COLS
        lr = tid // LOAD_COLS

        # Q tile, transposed (Qt[dd, r], rows padded to QS), zeros past Nq and past d.
        for rr in range(Q_PASSES):
            r = lr + LOAD_ROWS * rr
            row = uint64(min(q0 + r, nq - 1))
            for cc in range(D // LOAD_COLS):
                c = lc + LOAD_COLS * cc
                x = qh[row, uint64(min(c, d - 1))]
                if q0 + r >= nq or c >= d:
                    x = float32(0.0)
                if ROWS_EXACT or r < Br:
                    smem[uint64(Q_OFF + c * QS + r)] = x

        m = cuda.local.array(RM, float32)          # running row max of the raw scores
        l = cuda.local.array(RM, float32)          # running row sum (this thread's columns)
        acc = cuda.local.array((RM, DN), float32)  # O, unnormalised
        s = cuda.local.array((RM, CN), float32)    # S tile, then P
        a = cuda.local.array(RM, float32)
        b = cuda.local.array(CN, float32)
        w = cuda.local.array(DN, float32)
        for i in range(RM):
            m[i] = MASKED
            l[i] = float32(0.0)
            for j in range(DN):
                acc[i, j] = float32(0.0)

        # The inner loop walks the kept key tiles of this query tile only. The next tile's
        # column index is read one step ahead, so that its load is not on the critical path
        # of the next K/V copy.
        start = row_ptr[g * tr + rt]
        end = row_ptr[g * tr + rt + 1]
        nxt = col_idx[min(start, end - 1)] if end > start else int32(0)
        for it in range(start, end):
            k0 = nxt * Bc
            nxt = col_idx[min(it + 1, end - 1)]
            cuda.syncthreads()                     # everyone is done with the previous Kt, V, P
            for rr in range(KV_PASSES):
                r = lr + LOAD_ROWS * rr
                row = uint64(min(k0 + r, nk - 1))
                for cc in range(D // LOAD_COLS):
                    c = lc + LOAD_COLS * cc
                    col = uint64(min(c, d - 1))
                    kx = kh[row, col]
                    vx = vh[row, col]
                    if k0 + r >= nk or c >= d:
                        kx = float32(0.0)
                        vx = float32(0.0)
                    if ROWS_EXACT or r < Bc:
                        smem[uint64(K_OFF + c * KS + r)] = kx
                        smem[uint64(V_OFF + r * D + c)] = vx
            cuda.syncthreads()

            # S = Q K^T (raw dot products) for this thread's RM x CN scores.
            for i in range(RM):
                for j in range(CN):
                    s[i, j] = float32(0.0)
            qa = uint64(Q_OFF) + uty               # walks down Qt[dd, ty + TR*i]
            kb = uint64(K_OFF) + utx               # walks down Kt[dd, tx + TC*j]
            for dd in range(D):
                for i in range(RM):
                    a[i] = smem[qa + uint64(TR * i)]
                for j in range(CN):
                    b[j] = smem[kb + uint64(TC * j)]
                for i in range(RM):
                    for j in range(CN):
                        s[i, j] += a[i] * b[j]
                qa += uint64(QS)
                kb += uint64(KS)

            # Mask, only in the tiles the ragged end of K or the causal diagonal crosses.
            if k0 + Bc > nk or (causal and k0 + Bc - 1 > q0 + shift):
                for i in range(RM):
                    qi = q0 + ty + TR * i
                    for j in range(CN):
                        kj = k0 + tx + TC * j
                        if kj >= nk or (causal and kj > qi + shift):
                            s[i, j] = MASKED

            # Online softmax: the row max over the row's TC threads, P = exp(scale (S - m'))
            # into Pt, rescale l and O by exp(scale (m - m')).
            pt = uint64(P_OFF) + utx * uint64(PS) + uty     # Pt[tx, ty]
            for i in range(RM):
                mx = m[i]
                for j in range(CN):
                    mx = max(mx, s[i, j])
                mx = row_max(mx)
                live = mx > MASKED                 # has this row seen a key yet?
                alpha = math.exp((m[i] - mx) * scale)
                m[i] = mx
                l[i] *= alpha
                for j in range(DN):
                    acc[i, j] *= alpha
                for j in range(CN):
                    p = math.exp((s[i, j] - mx) * scale) if live else float32(0.0)
                    l[i] += p
                    smem[pt + uint64(TC * j * PS + TR * i)] = p
            cuda.syncthreads()

            # O += P V for this thread's RM x DN outputs.
            pa = uint64(P_OFF) + uty               # walks down Pt[c, ty + TR*i]
            vb = uint64(V_OFF) + utx               # walks down V[c, tx + TC*j]
            for c in range(Bc):
                for i in range(RM):
                    a[i] = smem[pa + uint64(TR * i)]
                for j in range(DN):
                    w[j] = smem[vb + uint64(TC * j)]
                for i in range(RM):
                    for j in range(DN):
                        acc[i, j] += a[i] * w[j]
                pa += uint64(PS)
                vb += uint64(D)

        # l: the sum over the row's TC threads; O = acc / l, L = scale m + log(l); a row
        # that saw no key (l = 0: empty list, or every score masked): O = 0, L = -inf.
        oh = o[uint64(bh)]
        for i in range(RM):
            qi = q0 + ty + TR * i
            total = row_sum(l[i])
            if qi < nq:
                if total > float32(0.0):
                    inv = float32(1.0) / total
                    lse_row = m[i] * scale + math.log(total)
                else:
                    inv = float32(0.0)
                    lse_row = NEG_INF
                for j in range(DN):
                    dd = tx + TC * j
                    if dd < d:
                        oh[uint64(qi), uint64(dd)] = acc[i, j] * inv
                if tx == 0:
                    lse[bh, qi] = lse_row

    return block_sparse_forward


FORWARD_SIG = ("void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], "
               "float32[:, ::1], int32[::1], int32[::1], int32[::1], int32, int32, int32, int32, float32, int32)")


def io_model_bytes(b, h, nq, nk, d, *, Br, rho, in_bytes=4):
    """HBM bytes of the forward by the IO model (PERF.md): per head, Q read and O written
    once (2 Nq d), L written (Nq), and K, V read once for every kept tile: 2 Nk d ceil(Nq/Br)
    rho, where rho is the kept fraction of the Tr x Tc tiles."""
    return float(b * h * in_bytes * (2 * nq * d + nq + 2 * nk * d * cdiv(nq, Br) * rho))


# --------------------------------------------------------------------------- the launcher

def block_sparse_attention(q, k, v, block_mask, *, causal=False, scale=None, block_m=None, block_n=None,
                           lists=None):
    """Block-sparse attention forward: (O, L) with O = softmax(scale Q K^T + mask) V.

    q: (B, H, Nq, d), k, v: (B, H, Nk, d), float32, d <= 128; block_mask: a
    ``kernels.reference.BlockMask`` with flags (Tq, Tk), (H, Tq, Tk) or (B, H, Tq, Tk).
    ``block_m``/``block_n`` override the kernel tiles (powers of two dividing the mask's
    blocks); ``lists`` reuses the ``tile_lists(...)`` of an earlier call with the same
    mask, shapes, causal and tiles. Returns O (B, H, Nq, d) and L (B, H, Nq); a row with no
    kept key gets O = 0 and L = -inf. NumPy in, NumPy out; device arrays in, device out.
    """
    b, h, nq, nk, d, _ = check_qkv(q, k, v)
    causal = check_flag(causal, "causal")
    scale = check_scale(scale, d)
    cfg = forward_config(d, block_mask, block_m, block_n)
    tl = _lists_for(block_mask, lists, b, h, nq, nk, causal, cfg.Br, cfg.Bc)
    kind = ArrayKind(q)
    o = device_empty((b, h, nq, d))
    lse = device_empty((b, h, nq))
    if b * h * nq == 0:
        return kind.give_back(o), kind.give_back(lse)
    qd, kd, vd = (to_device(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    dev = tl.device()
    kernel = make_forward(cfg.Br, cfg.Bc, cfg.D, cfg.RM, cfg.TC)
    grid = (cdiv(nq, cfg.Br), b * h)
    threads = (cfg.Br // cfg.RM) * cfg.TC
    nbytes = shared_bytes_forward(cfg.Br, cfg.Bc, cfg.D, cfg.RM, cfg.TC)
    args = (qd.reshape(b * h, nq, d), kd.reshape(b * h, nk, d), vd.reshape(b * h, nk, d),
            o.reshape(b * h, nq, d), lse.reshape(b * h, nq), dev.row_ptr, dev.col_idx, dev.row_order,
            np.int32(nq), np.int32(nk), np.int32(d), np.int32(tl.groups), np.float32(scale), np.int32(causal))
    allow_dynamic_shared_memory(kernel, args, nbytes)
    kernel[grid, threads, 0, nbytes](*args)
    return kind.give_back(o), kind.give_back(lse)


def __getattr__(name):
    # The backward lives in its own module; ``from kernels.block_sparse import
    # block_sparse_attention_backward`` still works.
    if name == "block_sparse_attention_backward":
        from kernels.block_sparse_backward import block_sparse_attention_backward

        return block_sparse_attention_backward
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def ptx_targets():
    """The forward kernel at its production tiles, for the sm_90 PTX check."""
    out = []
    for D0, (Br, Bc, RM, TC) in FORWARD_CONFIGS.items():
        for D in sorted({D0 // 2, D0}) if D0 == 32 else (D0,):
            label = f"block-sparse fwd fp32 Br={Br} Bc={Bc} D={D} RM={RM} TC={TC}"
            out.append((label, make_forward(Br, Bc, D, RM, TC), FORWARD_SIG))
    return out
