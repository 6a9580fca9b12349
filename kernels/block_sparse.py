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
registers), register-tiled, with chapter 4's tiles and per-tile code; only the loop differs:

* a block of (Br / RM) x TC threads owns a Br-row query tile; thread (ty, tx) owns RM rows
  and, of S, Bc/TC columns, of O, D/TC columns, in runs of 4 adjacent rows or columns
  (one 16-byte shared-memory load each);
* the tiles live in one dynamic shared buffer (103 KB at Br=128, Bc=64, d=64; above 48 KB
  through kernels/base/shared_memory.py): Qt, Kt and Pt transposed; row strides are multiples
  of 4 floats (16-byte aligned rows) padded so that the tile copies' stores hit 32 banks;
* tile copies: every thread copies fixed columns of fixed rows, its loads clamped to valid
  addresses and zeroed afterwards (no branch around a load: all of them in flight at
  once); the next kept K/V tile is loaded into registers while the current one is computed
  (its column index read one step ahead);
* S stays the raw dot products; P = exp2((S - m) * scale * log2(e)), the difference first
  (exact when S is close to m), so a large scale * S is never rounded on its own;
* masking (the ragged last key tile, the causal diagonal) happens only in the tiles those
  cross; masked scores are the finite MASKED (fastmath may assume no infinities) and a row
  whose max is still MASKED has P = 0 by a branch, never exp(0) of two sentinels;
* the row maximum m is combined across the TC threads of a row with warp shuffles (in the
  simulator, which has none, through shared memory); the row sum l only once, at the end;
* query tiles are launched longest list first (``row_order``): with uneven rows (global
  tokens) the heavy blocks start early and the last wave is short;
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

from kernels.base.masks import BlockMask
from kernels.base.runtime import (ArrayKind, cdiv, check_flag, check_qkv, check_scale, device_empty,
                             on_simulator, to_device)
from kernels.base.shared_memory import allow_dynamic_shared_memory

__all__ = ["block_sparse_attention", "block_sparse_attention_backward", "make_forward", "TileLists",
           "tile_lists", "forward_config", "FORWARD_CONFIGS", "io_model_bytes", "ptx_targets"]

# Scores outside the mask become MASKED, a finite sentinel (fastmath lets the compiler
# assume there are no infinities); the running max starts there too, and a row whose max is
# still MASKED has seen no key (its P is 0 by a branch, never exp(0) of two sentinels).
MASKED = float32(-1.0e30)
NEG_INF = float32(-math.inf)
LOG2E = 1.4426950408889634        # exp(x) = exp2(x log2(e)): the hardware's ex2
# Shared rows start 16-byte aligned (vector loads); the simulator refuses the option.
ALIGN = None if on_simulator() else 16
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


def forward_layout(Br, Bc, D):
    """Offsets (floats) of Qt, Kt, V, Pt in the dynamic shared buffer, their row strides,
    and the total. Strides are multiples of 4 floats (every row starts 16-byte aligned, for
    vector loads), padded so that the tile copies' stores spread over all 32 banks."""
    QS, KS, VS, PS = Br + 4, Bc + 4, D + 8, Br + 4
    q_off = 0
    k_off = q_off + D * QS
    v_off = k_off + D * KS
    p_off = v_off + Bc * VS
    return q_off, k_off, v_off, p_off, QS, KS, VS, PS, p_off + Bc * PS


def shared_bytes_forward(Br, Bc, D, RM=None, TC=None) -> int:
    return 4 * forward_layout(Br, Bc, D)[-1]


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


def _run(n: int) -> int:
    """How many consecutive rows (columns) of a micro-tile a thread owns: a run of 4 floats
    is one 16-byte shared load; shorter when n is not a multiple of 4."""
    return 4 if n % 4 == 0 else (2 if n % 2 == 0 else 1)


@functools.lru_cache(maxsize=None)
def make_forward(Br: int, Bc: int, D: int, RM: int, TC: int, prefetch: bool = True):
    """The block-sparse forward kernel for query tile Br, key tile Bc, padded head dim D,
    RM rows per thread and TC threads across a row (all powers of two). ``prefetch``: load
    the next kept K/V tile into registers while the current one is computed (False: load
    each tile when it is needed, fewer registers).

    Launch: grid (Tr, B*H), (Br/RM)*TC threads, ``shared_bytes_forward(Br, Bc, D, RM, TC)``
    bytes of dynamic shared memory (raised above 48 KB by kernels.base.shared_memory)."""
    for name, x in (("Br", Br), ("Bc", Bc), ("D", D), ("RM", RM), ("TC", TC)):
        if x < 1 or x & (x - 1):
            raise ValueError(f"make_forward: expected {name} a power of two, got {x}")
    if RM > Br or TC > Bc or TC > D or TC > 32:
        raise ValueError(f"make_forward: need RM <= Br, TC <= Bc, TC <= D and TC <= 32; got Br={Br} Bc={Bc} "
                         f"D={D} RM={RM} TC={TC}")
    TR = Br // RM          # thread rows
    NT = TR * TC           # threads a block
    CN = Bc // TC          # score columns a thread owns
    DN = D // TC           # output columns a thread owns
    VM, VN, VD = _run(RM), _run(CN), _run(DN)   # a thread's rows / S columns / O columns come in runs
    Q_OFF, K_OFF, V_OFF, P_OFF, QS, KS, VS, PS, _ = forward_layout(Br, Bc, D)
    CW = min(8, D, NT)     # tile copies: a pass copies LR rows of CW columns (a warp: 8 x 4)
    LR = NT // CW
    Q_PASSES, KV_PASSES = cdiv(Br, LR), cdiv(Bc, LR)      # row passes; D // CW column passes each
    ROWS_EXACT = Br % LR == 0 and Bc % LR == 0            # no pass runs past the tile
    KV_REGS = KV_PASSES * (D // CW)
    row_max, row_sum = _make_row_reductions(TC, NT)

    # Thread (ty, tx) owns the rows ty*VM + (i // VM)*TR*VM + i % VM (i < RM) of S and O,
    # the columns tx*VN + (j // VN)*TC*VN + j % VN (j < CN) of S, and likewise (VD) of O:
    # runs of 4 adjacent rows or columns, one 16-byte shared load each.
    @cuda.jit(device=True, inline=True)
    def load_kv(kh, vh, kr, vr, k0, nk, d, tid):
        """This thread's part of the K and V tile starting at key k0: HBM -> registers.
        Thread tid copies column tid % CW + CW*cc of the rows tid // CW + LR*rr. Every
        load reads a valid address (clamped) and is zeroed afterwards if it lies outside
        the matrix: no branch around a load, so they are all in flight at once."""
        lr = tid // CW
        lc = tid % CW
        for rr in range(KV_PASSES):
            r = k0 + lr + LR * rr
            row = uint64(min(r, nk - 1))
            for cc in range(D // CW):
                c = lc + CW * cc
                kx = kh[row, uint64(min(c, d - 1))]
                vx = vh[row, uint64(min(c, d - 1))]
                if r >= nk or c >= d:
                    kx = float32(0.0)
                    vx = float32(0.0)
                kr[rr * (D // CW) + cc] = kx
                vr[rr * (D // CW) + cc] = vx

    @cuda.jit(fastmath=True)
    def block_sparse_forward(q, k, v, o, lse, row_ptr, col_idx, row_order, nq, nk, d, groups, scale, causal):
        smem = cuda.shared.array(0, float32, alignment=ALIGN)   # Qt | Kt | V | Pt, see forward_layout
        tid = int32(cuda.threadIdx.x)
        ty = tid // TC
        tx = tid % TC
        bh = int32(cuda.blockIdx.y)
        tr = int32(cuda.gridDim.x)
        g = bh % groups                            # which mask this head uses
        # Query tiles with the longest lists first, so that the last wave of blocks is short.
        rt = row_order[g * tr + int32(cuda.blockIdx.x)]
        q0 = rt * Br
        shift = nk - nq                            # causal: key j <= query i + shift
        scale_log2e = scale * float32(LOG2E)       # exp(scale x) = exp2(scale log2(e) x)
        # Shared-memory offsets in the hot loops are unsigned: Numba adds a negative-index
        # wraparound to signed indices, which costs integer instructions per load (and hides
        # from the compiler that a thread's 4-float runs are contiguous: LDS.128).
        row_u = uint64(ty * VM)                    # first row of this thread's first row run
        col_u = uint64(tx * VN)                    # first column of its first S-column run
        out_u = uint64(tx * VD)                    # first column of its first O-column run
        qh = q[uint64(bh)]                         # this head's Q, K, V: (N, d) views
        kh = k[uint64(bh)]
        vh = v[uint64(bh)]

        # Q tile, transposed (Qt[c, r]), zeros past Nq and past d, in load_kv's order: a
        # warp reads 8 consecutive columns of 4 rows (32-byte pieces of HBM rows) and its
        # stores to the padded rows (4 floats apart in the bank order) hit 32 banks.
        lr = tid // CW
        lc = tid % CW
        for rr in range(Q_PASSES):
            r = lr + LR * rr
            row = uint64(min(q0 + r, nq - 1))
            for cc in range(D // CW):
                c = lc + CW * cc
                x = qh[row, uint64(min(c, d - 1))]
                if q0 + r >= nq or c >= d:
                    x = float32(0.0)
                if ROWS_EXACT or r < Br:
                    smem[uint64(Q_OFF + c * QS + r)] = x

        m = cuda.local.array(RM, float32)          # running row max of the raw scores
        l = cuda.local.array(RM, float32)          # running row sum (this thread's columns)
        acc = cuda.local.array((RM, DN), float32)  # O, unnormalised
        s = cuda.local.array((RM, CN), float32)    # S tile
        a = cuda.local.array(RM, float32)
        b = cuda.local.array(CN, float32)
        w = cuda.local.array(DN, float32)
        kr = cuda.local.array(KV_REGS, float32)    # this thread's part of the next K, V tile
        vr = cuda.local.array(KV_REGS, float32)
        for i in range(RM):
            m[i] = MASKED
            l[i] = float32(0.0)
            for j in range(DN):
                acc[i, j] = float32(0.0)

        # The inner loop walks the kept key tiles of this query tile only. The next tile is
        # loaded into registers while this one is computed on (its column index read first).
        start = row_ptr[g * tr + rt]
        end = row_ptr[g * tr + rt + 1]
        k_next = int32(0)
        if end > start:
            k_next = col_idx[start] * Bc
            if prefetch:
                load_kv(kh, vh, kr, vr, k_next, nk, d, tid)
        for it in range(start, end):
            k0 = k_next
            k_next = col_idx[min(it + 1, end - 1)] * Bc
            if not prefetch:
                load_kv(kh, vh, kr, vr, k0, nk, d, tid)
            cuda.syncthreads()                     # everyone is done with the previous Kt, V, P
            for rr in range(KV_PASSES):            # K (transposed) and V: registers -> shared
                r = lr + LR * rr
                for cc in range(D // CW):
                    c = lc + CW * cc
                    if ROWS_EXACT or r < Bc:
                        smem[uint64(K_OFF + c * KS + r)] = kr[rr * (D // CW) + cc]
                        smem[uint64(V_OFF + r * VS + c)] = vr[rr * (D // CW) + cc]
            cuda.syncthreads()
            if prefetch and it + 1 < end:          # the next tile: in flight during this one
                load_kv(kh, vh, kr, vr, k_next, nk, d, tid)

            # S = Q K^T (raw dot products) for this thread's RM x CN scores.
            for i in range(RM):
                for j in range(CN):
                    s[i, j] = float32(0.0)
            qa = uint64(Q_OFF) + row_u             # walks down Qt[dd, rows of this thread]
            kb = uint64(K_OFF) + col_u             # walks down Kt[dd, columns of this thread]
            for dd in range(D):
                for i in range(RM):
                    a[i] = smem[qa + uint64((i // VM) * TR * VM + i % VM)]
                for j in range(CN):
                    b[j] = smem[kb + uint64((j // VN) * TC * VN + j % VN)]
                for i in range(RM):
                    for j in range(CN):
                        s[i, j] += a[i] * b[j]
                qa += uint64(QS)
                kb += uint64(KS)

            # Mask, only in the tiles the ragged end of K or the causal diagonal crosses.
            if k0 + Bc > nk or (causal and k0 + Bc - 1 > q0 + shift):
                for i in range(RM):
                    qi = q0 + ty * VM + (i // VM) * TR * VM + i % VM
                    for j in range(CN):
                        kj = k0 + tx * VN + (j // VN) * TC * VN + j % VN
                        if kj >= nk or (causal and kj > qi + shift):
                            s[i, j] = MASKED

            # Online softmax: the row max over the row's TC threads, P = exp(scale (S - m'))
            # into Pt, rescale l and O by exp(scale (m - m')). S - m' first (exact when
            # close), then one multiply: no rounding of a large scale * S.
            pt = uint64(P_OFF) + col_u * uint64(PS) + row_u    # Pt[this thread's first column, first row]
            for i in range(RM):
                mx = m[i]
                for j in range(CN):
                    mx = max(mx, s[i, j])
                mx = row_max(mx)
                live = mx > MASKED                 # has this row seen a key yet?
                alpha = math.exp2((m[i] - mx) * scale_log2e)
                m[i] = mx
                l[i] *= alpha
                for j in range(DN):
                    acc[i, j] *= alpha
                for j in range(CN):
                    p = math.exp2((s[i, j] - mx) * scale_log2e) if live else float32(0.0)
                    l[i] += p
                    smem[pt + uint64(((j // VN) * TC * VN + j % VN) * PS + (i // VM) * TR * VM + i % VM)] = p
            cuda.syncthreads()

            # O += P V for this thread's RM x DN outputs.
            pa = uint64(P_OFF) + row_u             # walks down Pt[c, rows of this thread]
            vb = uint64(V_OFF) + out_u             # walks down V[c, O columns of this thread]
            for c in range(Bc):
                for i in range(RM):
                    a[i] = smem[pa + uint64((i // VM) * TR * VM + i % VM)]
                for j in range(DN):
                    w[j] = smem[vb + uint64((j // VD) * TC * VD + j % VD)]
                for i in range(RM):
                    for j in range(DN):
                        acc[i, j] += a[i] * w[j]
                pa += uint64(PS)
                vb += uint64(VS)

        # l: the sum over the row's TC threads; O = acc / l, L = scale m + log(l); a row
        # that saw no key (l = 0: empty list, or every score masked): O = 0, L = -inf.
        oh = o[uint64(bh)]
        for i in range(RM):
            qi = q0 + ty * VM + (i // VM) * TR * VM + i % VM
            total = row_sum(l[i])
            if qi < nq:
                if total > float32(0.0):
                    inv = float32(1.0) / total
                    lse_row = m[i] * scale + math.log(total)
                else:
                    inv = float32(0.0)
                    lse_row = NEG_INF
                for j in range(DN):
                    dd = tx * VD + (j // VD) * TC * VD + j % VD
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
    tl = lists_for(block_mask, lists, b, h, nq, nk, causal, cfg.Br, cfg.Bc)
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
