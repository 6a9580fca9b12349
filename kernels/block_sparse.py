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
* Q is stored transposed (Qt[dd, r] = Q[r, dd]) so the RM values a thread reads at one
  dd are adjacent words (no bank conflicts); the scale multiplies the finished dot
  products (S = scale * Q K^T, rounded like the float32 NumPy it is measured against);
* K is stored transposed, Kt[dd, c], with the column XOR-swizzled by dd
  (c ^ (dd mod 32)): the transposing stores and the row reads both hit 32 distinct banks;
* the row maximum m is combined across the TC threads of a row through a small shared
  scratch (the simulator has no warp shuffles), the row sum l only once at the end;
* masked scores are set to a large negative number instead of -inf (fastmath may assume
  no infinities), m starts at -1e30, so exp(masked - m) is exactly 0 and never NaN;
* per-thread arrays are ``cuda.local.array`` indexed only by unrolled constant loop
  indices, so they live in registers (the PTX check warns on any ``.local``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, uint64

from kernels.reference import BlockMask
from kernels.runtime import (ArrayKind, cdiv, check_flag, check_qkv, check_scale, device_empty,
                             on_simulator, to_device)

__all__ = ["block_sparse_attention", "block_sparse_attention_backward", "make_forward", "TileLists",
           "tile_lists", "forward_config", "FORWARD_CONFIGS", "io_model_bytes", "ptx_targets"]

# Scores outside the mask become MASKED; the running max starts at M_INIT > MASKED, so
# exp(MASKED - m) underflows to exactly 0 for every m the kernel can hold.
MASKED = float32(-3.0e38)
M_INIT = float32(-1.0e30)
NEG_INF = float32(-math.inf)
SHARED_LIMIT = 48 * 1024  # static shared memory a block may declare

# Production tiles for the H100, by padded head dim D: (Br, Bc, RM, TC).
#   threads = Br / RM * TC; each thread: RM x Bc/TC scores, RM x D/TC outputs.
# Shared memory (floats): Qt D*Br + Kt D*Bc + V Bc*D + P Br*Bc + scratch Br*TC <= 48 KB.
FORWARD_CONFIGS = {
    32: (64, 64, 4, 16),    # 8 + 8 + 8 + 16 + 4 KB = 44 KB, 256 threads, 4x4 scores, 4x2 outputs
    64: (64, 32, 4, 16),    # 16 + 8 + 8 + 8 + 4 KB = 44 KB, 256 threads, 4x2 scores, 4x4 outputs
    128: (32, 16, 4, 8),    # 16 + 8 + 8 + 2 + 1 KB = 35 KB, 64 threads, 4x2 scores, 4x16 outputs
}
# The simulator runs each thread in Python: small tiles, 16 threads.
SIM_CONFIG = (8, 8, 2, 4)


def shared_bytes_forward(Br, Bc, D, RM, TC) -> int:
    return 4 * (D * Br + D * Bc + Bc * D + Br * Bc + Br * TC)


def _pow2_at_most(n: int) -> int:
    return 1 << (int(n).bit_length() - 1)


def _largest_pow2_divisor(block: int, cap: int) -> int:
    """The largest power of two that divides ``block`` and is at most ``cap``."""
    t = block & -block  # largest power of two dividing block
    return min(t, _pow2_at_most(cap))


def padded_head_dim(d: int, tc: int) -> int:
    """D: the head dim the kernel is compiled for (a multiple of TC; zeros fill the rest)."""
    if on_simulator():
        return cdiv(max(d, 1), tc) * tc
    return max(tc, 16, 1 << (max(d, 1) - 1).bit_length())


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

    @property
    def kept_fraction(self) -> float:
        """rho: the fraction of (query tile, key tile) pairs the kernels visit."""
        return float(self.kept.mean()) if self.kept.size else 0.0

    def device(self):
        """The four index arrays on the device (copied once, then cached)."""
        if getattr(self, "_dev", None) is None:
            pad = lambda a: a if a.size else np.zeros(1, np.int32)  # noqa: E731  (no empty device arrays)
            self._dev = tuple(cuda.to_device(pad(a)) for a in (self.row_ptr, self.col_idx, self.col_ptr, self.row_idx))
        return self._dev


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
    return TileLists(Br, Bc, nq, nk, bool(causal), g, kept, row_ptr, col_idx, col_ptr, row_idx)


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

@functools.lru_cache(maxsize=None)
def make_forward(Br: int, Bc: int, D: int, RM: int, TC: int):
    """The block-sparse forward kernel for query tile Br, key tile Bc, padded head dim D,
    RM rows per thread and TC threads across a row. Grid (Tr, B*H), (Br/RM)*TC threads."""
    if Br % RM or Bc % TC or D % TC or Bc & (Bc - 1):
        raise ValueError(f"make_forward: need RM | Br, TC | Bc, TC | D and Bc a power of two; got "
                         f"Br={Br} Bc={Bc} D={D} RM={RM} TC={TC}")
    if shared_bytes_forward(Br, Bc, D, RM, TC) > SHARED_LIMIT:
        raise ValueError(f"make_forward: {shared_bytes_forward(Br, Bc, D, RM, TC)} bytes of shared memory > 48 KB")
    TR = Br // RM          # thread rows
    NT = TR * TC           # threads a block
    CN = Bc // TC          # score columns a thread owns
    DN = D // TC           # output columns a thread owns
    SWM = min(32, Bc) - 1  # swizzle: Kt[dd, c] is stored at column c ^ (dd & SWM)
    QT_SIZE, KT_SIZE, V_SIZE, P_SIZE, RED_SIZE = D * Br, D * Bc, Bc * D, Br * Bc, Br * TC

    @cuda.jit(fastmath=True)
    def block_sparse_forward(q, k, v, o, lse, row_ptr, col_idx, nq, nk, d, groups, scale, causal):
        qt = cuda.shared.array(QT_SIZE, float32)    # Q^T                [dd, r]
        kt = cuda.shared.array(KT_SIZE, float32)    # K^T, swizzled      [dd, c ^ (dd & SWM)]
        vs = cuda.shared.array(V_SIZE, float32)    # V                  [c, dd]
        ps = cuda.shared.array(P_SIZE, float32)   # P                  [r, c]
        red = cuda.shared.array(RED_SIZE, float32)  # row max / row sum partials [r, tx]

        tid = int32(cuda.threadIdx.x)
        ty = tid // TC
        tx = tid - ty * TC
        rt = int32(cuda.blockIdx.x)                # query tile index (of Tr)
        bh = int32(cuda.blockIdx.y)
        tr = int32(cuda.gridDim.x)
        q0 = rt * Br
        g = bh % groups                            # which mask this head uses
        shift = nk - nq                            # causal: key j <= query i + shift
        r0 = ty * RM                               # first of this thread's rows
        # Shared-memory offsets in the hot loops are unsigned: Numba adds a negative-index
        # wraparound to signed indices, which costs integer instructions per load.
        utx = uint64(tx)

        # Q tile, transposed, zeros past Nq and past d.
        for idx in range(tid, Br * D, NT):
            r = idx // D
            dd = idx - r * D
            val = float32(0.0)
            if q0 + r < nq and dd < d:
                val = q[bh, q0 + r, dd]
            qt[dd * Br + r] = val

        m = cuda.local.array(RM, float32)          # running row max
        l = cuda.local.array(RM, float32)          # running row sum (this thread's columns)
        acc = cuda.local.array((RM, DN), float32)  # O, unnormalised
        s = cuda.local.array((RM, CN), float32)    # S tile, then P
        a = cuda.local.array(RM, float32)
        b = cuda.local.array(CN, float32)
        w = cuda.local.array(DN, float32)
        for i in range(RM):
            m[i] = M_INIT
            l[i] = float32(0.0)
            for j in range(DN):
                acc[i, j] = float32(0.0)

        # The inner loop walks the kept key tiles of this query tile only.
        start = row_ptr[g * tr + rt]
        end = row_ptr[g * tr + rt + 1]
        for it in range(start, end):
            k0 = col_idx[it] * Bc
            cuda.syncthreads()                     # everyone is done with the previous Kt, V, P
            for idx in range(tid, Bc * D, NT):
                c = idx // D
                dd = idx - c * D
                kval = float32(0.0)
                vval = float32(0.0)
                if k0 + c < nk and dd < d:
                    kval = k[bh, k0 + c, dd]
                    vval = v[bh, k0 + c, dd]
                kt[dd * Bc + (c ^ (dd & SWM))] = kval
                vs[idx] = vval
            cuda.syncthreads()

            # S = scale * Q K^T for this thread's RM x CN scores.
            for i in range(RM):
                for j in range(CN):
                    s[i, j] = float32(0.0)
            qa = uint64(r0)                        # Qt[dd, r0]: dd * Br + r0
            kb = uint64(0)                         # Kt[dd, 0]:  dd * Bc
            for dd in range(D):
                sw = uint64(dd & SWM)
                for i in range(RM):
                    a[i] = qt[qa + uint64(i)]
                for j in range(CN):
                    b[j] = kt[kb + ((utx + uint64(j * TC)) ^ sw)]
                for i in range(RM):
                    for j in range(CN):
                        s[i, j] += a[i] * b[j]
                qa += uint64(Br)
                kb += uint64(Bc)
            for i in range(RM):
                for j in range(CN):
                    s[i, j] *= scale

            # Mask (ragged last key tile, causal diagonal), then this thread's row maxima.
            for i in range(RM):
                qi = q0 + r0 + i
                mx = m[i]
                for j in range(CN):
                    kj = k0 + tx + j * TC
                    if kj < nk and (causal == 0 or kj <= qi + shift):
                        mx = max(mx, s[i, j])
                    else:
                        s[i, j] = MASKED
                red[(r0 + i) * TC + tx] = mx
            cuda.syncthreads()

            # m_new = max over the row's TC threads; P = exp(S - m_new); rescale l and O.
            for i in range(RM):
                m_new = m[i]
                for t in range(TC):
                    m_new = max(m_new, red[(r0 + i) * TC + t])
                alpha = math.exp(m[i] - m_new)
                m[i] = m_new
                rowsum = float32(0.0)
                for j in range(CN):
                    p = math.exp(s[i, j] - m_new)
                    rowsum += p
                    ps[(r0 + i) * Bc + tx + j * TC] = p
                l[i] = l[i] * alpha + rowsum
                for j in range(DN):
                    acc[i, j] *= alpha
            cuda.syncthreads()

            # O += P V for this thread's RM x DN outputs.
            pa = uint64(r0 * Bc)                   # P[r0, c]
            vb = utx                               # V[c, tx]
            for c in range(Bc):
                for i in range(RM):
                    a[i] = ps[pa + uint64(i * Bc)]
                for j in range(DN):
                    w[j] = vs[vb + uint64(j * TC)]
                for i in range(RM):
                    for j in range(DN):
                        acc[i, j] += a[i] * w[j]
                pa += uint64(1)
                vb += uint64(D)

        # l: sum the row's TC partial sums; O = acc / l, L = m + log(l); empty rows: 0, -inf.
        cuda.syncthreads()
        for i in range(RM):
            red[(r0 + i) * TC + tx] = l[i]
        cuda.syncthreads()
        for i in range(RM):
            qi = q0 + r0 + i
            total = float32(0.0)
            for t in range(TC):
                total += red[(r0 + i) * TC + t]
            if qi < nq:
                if total > float32(0.0):
                    inv = float32(1.0) / total
                    for j in range(DN):
                        dd = tx + j * TC
                        if dd < d:
                            o[bh, qi, dd] = acc[i, j] * inv
                    if tx == 0:
                        lse[bh, qi] = m[i] + math.log(total)
                else:
                    for j in range(DN):
                        dd = tx + j * TC
                        if dd < d:
                            o[bh, qi, dd] = float32(0.0)
                    if tx == 0:
                        lse[bh, qi] = NEG_INF

    return block_sparse_forward


FORWARD_SIG = ("void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], "
               "float32[:, ::1], int32[::1], int32[::1], int32, int32, int32, int32, float32, int32)")


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
    row_ptr, col_idx, _, _ = tl.device()
    kernel = make_forward(cfg.Br, cfg.Bc, cfg.D, cfg.RM, cfg.TC)
    grid = (cdiv(nq, cfg.Br), b * h)
    threads = (cfg.Br // cfg.RM) * cfg.TC
    kernel[grid, threads](qd.reshape(b * h, nq, d), kd.reshape(b * h, nk, d), vd.reshape(b * h, nk, d),
                          o.reshape(b * h, nq, d), lse.reshape(b * h, nq), row_ptr, col_idx,
                          np.int32(nq), np.int32(nk), np.int32(d), np.int32(tl.groups),
                          np.float32(scale), np.int32(causal))
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
