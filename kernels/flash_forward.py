"""Chapter 4: the fused FlashAttention forward (FlashAttention-2 loop order).

    O = softmax(scale * Q K^T + mask) V,    L = rowwise logsumexp(scale * Q K^T + mask)

computed without ever writing the N x N matrices S and P to HBM. One block owns a tile of
Br query rows of one (batch, head). It streams K and V through shared memory in tiles of
Bc rows (j = 0 .. Tc-1) and keeps, for each of its rows, on chip:

    m   the running maximum of the raw scores seen so far          (registers)
    l   the running sum of exp(scale * (s - m))                    (registers)
    O   the running, not yet normalised output row                 (registers)

For every K/V tile:                                   (Algorithm 1 of FlashAttention-2)

    S    = Q_i K_j^T                      Br x Bc scores, each thread a TM x RN piece
    m'   = max(m, rowmax(S))              warp shuffles across the TX threads of a row
    P    = exp(scale * (S - m'))          unnormalised probabilities, to shared memory
    l    = exp(scale * (m - m')) l + rowsum(P)
    O    = exp(scale * (m - m')) O + P V_j
    m    = m'

and at the end O / l and L = scale * m + log(l) (natural log; the backward of chapter 5
rebuilds P = exp(scale * S - L) from it). A row that may attend to no key (Nk = 0, or a
causal row above the diagonal when Nq > Nk) gets O = 0 and L = -inf.

Threads and micro-tiles. A block has TY x TX threads (TY = Br / TM). Thread (ty, tx) owns
TM score rows and RN = Bc/TX score columns, and the same rows of O with RD = D/TX of its
columns. They come in runs of 4 (fewer when TM, RN or RD is not a multiple of 4):

    rows      4 ty + 4 TY a + i     (a < TM/4, i < 4)     e.g. TM = 8: 4ty..4ty+3 and 4ty+4TY..
    columns   4 tx + 4 TX b + j     (b < RN/4, j < 4)     (of S; of O the same with RD)

Each product is a register-tiled matmul (chapter 2): per step of the inner dimension a
thread reads its TM values of one operand and its RN (RD) values of the other from shared
memory and does TM*RN (TM*RD) fused multiply-adds into registers. A run of 4 floats that
starts 16-byte aligned is one 128-bit shared load (LDS.128): 8x8 micro-tiles need 4 loads
per 64 FMAs instead of 16. The 8 threads of a warp that read neighbouring runs read 128
consecutive bytes: no bank conflicts. The TX threads of a row are neighbours in one warp,
so the row maximum needs log2(TX) shuffles; the row sum is kept per thread and reduced
once at the end (the rescaling factor is the same for every thread of a row).

Shared memory (float32, one dynamic buffer; > 48 KB is allowed through
kernels/base/shared_memory.py):

    Qt   D  x (Br + 4)       Q tile, transposed: a thread's rows are contiguous runs
    Kt   D  x (Bc + 4)       K tile, transposed: a thread's columns of S are contiguous runs
    V    Bc x (D + 8)        V tile, as in HBM
    Pt   Bc x (Br + 4)       P tile, transposed: written once, read along the rows of O

Row strides are multiples of 4 floats (every row 16-byte aligned); the padding spreads the
stores of the tile copies over all 32 banks.

exp and the scale: exp(scale (s - m)) = exp2(s * scale log2(e) - m * scale log2(e)): one
FMA and one ex2 instruction a probability. Computing s - m first and then scaling would be
exact for large logits close to the max, but costs an instruction more a probability and
measured 3% slower on the H100; the FMA form errs by about an ulp of |scale m| in the
exponent, which the tests' tolerance accounts for (kernels.base.testing.exponent_scale).

Registers decide the tiles: a thread holds its TM x RN scores and TM x RD outputs. At d=64
the 8x8 micro-tiles of the default need 251 registers a thread (H100 driver), so an SM
keeps one 256-thread block (8 warps); Br = 256 rather than 128 halves the K/V traffic and
the barriers per FMA. Loading the next K/V tile into registers while computing the current
one (``prefetch=True``) costs 2 Bc D / threads more registers and measured no faster.

Causal (bottom-right): query i sees key j iff j <= i + (Nk - Nq). K/V tiles entirely to
the right of the diagonal are never loaded (the loop bound); only tiles the diagonal (or
the ragged end of K) crosses are masked.

Precision: q, k, v float32 or float16 (converted on load); all arithmetic in float32;
O and L float32. Fast math (kernels.base.fused.FASTMATH: the hardware's fast exp2 and
log, fused multiply-adds) but not the flags that assume finite values: a NaN or Inf in a
query row gives NaN in that output row (and one in a key or value row, in every row that
attends to it), as in PyTorch. Masked scores are the finite sentinel MASKED (-1e30), so a
row that has seen no key yet is a comparison, never -inf - (-inf). Scores below -1e30
(inputs around 1e15) are not supported.

Reading order: tiles and their budget; the algorithm in NumPy (``tile_update``,
``flash_forward_numpy``: the same loops, for the notebook and its exercise); one query
tile's forward as a device function (``make_attend_query_tile``: everything above, written
once; chapter 6 reuses it with a list of kept tiles in place of ``every_tile``); the kernel
(``make_flash_forward``: which block takes which query tile); the launcher
(``flash_attention``); the IO model; the PTX targets.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, uint64

from kernels.base.fused import (
    ALIGN,
    FASTMATH,
    LOG2E,
    MASKED,
    MAX_GRID_Y,
    MINUS_INF,
    Tiles,
    check_tiles_type,
    load_kv_or_zero,
    make_row_reductions,
    nan_max,
    padded_head_dim,
    run_length,
)
from kernels.base.inlined import inlined
from kernels.base.io_model import fused_forward_bytes
from kernels.base.runtime import (
    ArrayKind,
    launch_stream,
    cdiv,
    check_flag,
    check_products,
    check_qkv,
    check_out,
    check_scale,
    device_empty,
    on_simulator,
    to_device,
)
from kernels.base.shared_memory import allow_dynamic_shared_memory, max_dynamic_shared_bytes

__all__ = ["flash_attention", "Tiles", "default_tiles", "make_flash_forward", "make_attend_query_tile",
           "every_tile", "gpu_tiles", "shared_bytes", "check_tiles", "io_model_bytes", "tile_update", "flash_forward_numpy",
           "check_tile_update", "tile_update_cases", "ptx_targets", "row_per_thread_attention",
           "query_tile_attention", "make_row_per_thread_forward", "make_query_tile_forward", "EXERCISES"]


# --------------------------------------------------------------------------- tiles

def gpu_tiles(d: int) -> Tiles:
    """The production tiles on an H100 (the bench sweeps the alternatives)."""
    if d <= 64:
        return Tiles(Br=256, Bc=64, TM=8, TX=8)   # 256 threads, 8x8 micro-tiles, 165 KB smem
    return Tiles(Br=128, Bc=32, TM=4, TX=8)       # d=128: 256 threads, 4x4 S and 4x16 O micro-tiles, 117.5 KB


def default_tiles(d: int) -> Tiles:
    """The launcher's tiles: production tiles on a GPU, tiny ones in the simulator."""
    return Tiles(Br=8, Bc=8, TM=2, TX=4) if on_simulator() else gpu_tiles(d)


def _layout(Br, Bc, D):
    """Offsets (in floats) of Qt, Kt, V, Pt in the dynamic buffer, their row strides, total.

    Row strides are multiples of 4 floats (every row starts 16-byte aligned, for vector
    loads) padded so that the tile copies' stores spread over all 32 banks."""
    q_stride, k_stride, v_stride, p_stride = Br + 4, Bc + 4, D + 8, Br + 4
    q_off = 0
    k_off = q_off + D * q_stride
    v_off = k_off + D * k_stride
    p_off = v_off + Bc * v_stride
    total = p_off + Bc * p_stride
    return q_off, k_off, v_off, p_off, q_stride, k_stride, v_stride, p_stride, total


def shared_bytes(tiles: Tiles, D: int) -> int:
    """Bytes of shared memory one block of these tiles uses at head dim D."""
    return 4 * _layout(tiles.Br, tiles.Bc, D)[-1]


def check_tiles(tiles, D: int, name: str = "tiles") -> Tiles:
    """Validate a tile configuration for head dim D (errors name ``name``)."""
    check_tiles_type(tiles, name)
    Br, Bc, TM, TX = tiles.Br, tiles.Bc, tiles.TM, tiles.TX
    if TX > 32 or TX & (TX - 1):
        raise ValueError(f"{name}: expected TX a power of two <= 32 (threads of a row share a warp), got {TX}")
    if Br % TM:
        raise ValueError(f"{name}: expected TM to divide Br, got Br={Br}, TM={TM}")
    if (Br // TM) & (Br // TM - 1):
        raise ValueError(f"{name}: expected Br / TM (threads along the rows) a power of two, got {Br // TM}")
    if Bc % TX or D % TX:
        raise ValueError(f"{name}: expected TX to divide Bc={Bc} and D={D}, got TX={TX}")
    limit = 256 if on_simulator() else 1024
    if tiles.threads > limit:
        raise ValueError(f"{name}: {tiles} needs {tiles.threads} threads a block, at most {limit} here")
    if not on_simulator() and tiles.threads > 32 and tiles.threads % 32:
        raise ValueError(f"{name}: {tiles} gives {tiles.threads} threads, expected a multiple of 32 (whole warps) "
                         f"or one warp's worth at most")
    nbytes = shared_bytes(tiles, D)
    if nbytes > max_dynamic_shared_bytes():
        raise ValueError(f"{name}: {tiles} at D={D} needs {nbytes} bytes of shared memory, "
                         f"the device allows {max_dynamic_shared_bytes()}")
    return tiles


# --------------------------------------------------------------------------- the algorithm in NumPy

def tile_update(m, l, o, s, v):
    """One K/V tile of the forward for a block of rows, in NumPy (the notebook's exercise).

    State of each row before the tile: m (Br,) the max so far, l (Br,) the sum of
    exp(s - m) so far, o (Br, d) the sum of exp(s - m) v so far (not yet divided by l).
    The tile: s (Br, Bc) scaled scores (-inf where masked), v (Bc, d). Returns the state
    after the tile. A row whose max is still -inf stays (-inf, 0, 0): exp(-inf - -inf) is
    never taken.
    """
    m_new = np.maximum(m, s.max(axis=1, initial=-np.inf))
    base = np.where(np.isfinite(m_new), m_new, 0.0)     # a row with no key yet: anything finite
    alpha = np.exp(m - base)                            # rescales what was summed against m
    p = np.exp(s - base[:, None])                       # P tile, unnormalised
    return m_new, alpha * l + p.sum(axis=1), alpha[:, None] * o + p @ v


def flash_forward_numpy(q, k, v, *, causal=False, scale=None, Br=64, Bc=64, dtype=np.float64):
    """The fused forward with NumPy tiles, for one head: q (Nq, d), k and v (Nk, d).

    The same loops as the kernel: query tiles outside, K/V tiles inside (stopping at the
    diagonal when causal), only Br x Bc scores alive at any time. Returns (O, L).
    """
    q, k, v = (np.asarray(x, dtype=dtype) for x in (q, k, v))
    n_q, d = q.shape
    n_k = k.shape[0]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    o = np.zeros((n_q, d), dtype)
    lse = np.full(n_q, -np.inf, dtype)
    for q0 in range(0, n_q, Br):                       # one block of the grid
        rows = np.arange(q0, min(q0 + Br, n_q))
        m = np.full(len(rows), -np.inf, dtype)
        l = np.zeros(len(rows), dtype)
        acc = np.zeros((len(rows), d), dtype)
        kv_end = min(n_k, q0 + Br + n_k - n_q) if causal else n_k
        for k0 in range(0, max(kv_end, 0), Bc):        # the K/V tiles this block needs
            cols = np.arange(k0, min(k0 + Bc, n_k))
            s = scale * (q[rows] @ k[cols].T)
            if causal:
                s = np.where(cols[None, :] <= rows[:, None] + (n_k - n_q), s, -np.inf)
            m, l, acc = tile_update(m, l, acc, s, v[cols])
        seen = l > 0
        o[rows[seen]] = acc[seen] / l[seen, None]
        lse[rows[seen]] = m[seen] + np.log(l[seen])
    return o, lse


@dataclass
class TileUpdateCase:
    s: np.ndarray      # (rows, n) scaled scores, -inf where masked
    v: np.ndarray      # (n, d)
    bc: int            # tile width

    def __repr__(self):
        finite = self.s[np.isfinite(self.s)]
        return (f"TileUpdateCase(s={self.s.shape}, d={self.v.shape[1]}, Bc={self.bc}, "
                f"masked={int((~np.isfinite(self.s)).sum())}, |s|max={np.abs(finite).max() if finite.size else 0:.3g})")


def tile_update_cases():
    """Hypothesis strategy: score rows (some fully or partly masked, logits up to 1e4), V, Bc."""
    from hypothesis import strategies as st

    @st.composite
    def cases(draw):
        rows, n, d = draw(st.integers(1, 6)), draw(st.integers(1, 40)), draw(st.integers(1, 8))
        bc = draw(st.integers(1, 16))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        magnitude = draw(st.sampled_from([0.1, 1.0, 30.0, 1e4]))
        s = rng.standard_normal((rows, n)) * magnitude
        masked = rng.random((rows, n)) < draw(st.sampled_from([0.0, 0.3, 0.9]))
        if draw(st.booleans()):
            masked[0] = True                          # a row that sees nothing
        if draw(st.booleans()):
            masked[:, : n // 2] = True                # leading tiles fully masked
        s[masked] = -np.inf
        return TileUpdateCase(s, rng.standard_normal((n, d)), bc)
    return cases()


def check_tile_update(update, case):
    """The property: folding ``update`` over the tiles of a row block, from (-inf, 0, 0),
    gives softmax(s) v and logsumexp(s) (the float64 oracle); rows that see nothing give
    l = 0 and O = 0; no NaN anywhere."""
    from kernels import reference as ref

    rows, n = case.s.shape
    d = case.v.shape[1]
    m, l, o = np.full(rows, -np.inf), np.zeros(rows), np.zeros((rows, d))
    with np.errstate(invalid="raise"):                # -inf - -inf must not happen
        for k0 in range(0, n, case.bc):
            m, l, o = update(m, l, o, case.s[:, k0:k0 + case.bc], case.v[k0:k0 + case.bc])
    m, l, o = (np.asarray(x, dtype=np.float64) for x in (m, l, o))
    assert m.shape == (rows,) and l.shape == (rows,) and o.shape == (rows, d), "state shapes changed"
    assert not (np.isnan(m).any() or np.isnan(l).any() or np.isnan(o).any()), "NaN in the state"
    want_p = ref.softmax(case.s)
    want_l = ref.logsumexp(case.s)
    seen = np.isfinite(want_l)
    assert np.all(l[~seen] == 0) and np.all(o[~seen] == 0), "a row with no visible key must keep l = 0, O = 0"
    got_o = o[seen] / l[seen, None]
    np.testing.assert_allclose(got_o, (want_p @ case.v)[seen], rtol=1e-9, atol=1e-9, err_msg="O = (P V) / l")
    np.testing.assert_allclose(m[seen] + np.log(l[seen]), want_l[seen], rtol=1e-12, atol=1e-9,
                               err_msg="L = m + log l")


# --------------------------------------------------------------------------- the kernel

def _copy_plan(Br, Bc, D, threads):
    """How the block copies a tile from HBM (see ``attend_query_tile``): pieces of PIECE
    threads copy CW columns x RQ rows; W pieces a pass, G pieces across a row of the tile."""
    PIECE = min(32, threads)      # a warp (threads and D are powers of two)
    CW = min(8, D, PIECE)         # columns of a piece
    RQ = PIECE // CW              # rows of a piece
    G = D // CW                   # pieces across a row of the tile
    W = threads // PIECE          # pieces the block copies at once (one pass)
    Q_PASSES, KV_PASSES = cdiv(cdiv(Br, RQ) * G, W), cdiv(cdiv(Bc, RQ) * G, W)
    Q_EXACT = Br % RQ == 0 and (Br // RQ * G) % W == 0       # no pass runs past the tile
    KV_EXACT = Bc % RQ == 0 and (Bc // RQ * G) % W == 0
    return PIECE, CW, RQ, G, W, Q_PASSES, KV_PASSES, Q_EXACT, KV_EXACT


@inlined
def every_tile(walk, t):
    """The dense walk: the t-th K/V tile of a query tile is tile t (``walk`` is unused)."""
    return t


@functools.lru_cache(maxsize=None)
def make_attend_query_tile(Br: int, Bc: int, D: int, TM: int, TX: int, prefetch: bool = False,
                           tile_of=every_tile):
    """The forward for one query tile Q_i, as a device function: everything a block does.

    ``attend(qh, kh, vh, oh, lh, q0, d, scale, causal, walk, first, count)``: qh (Nq, d),
    kh and vh (Nk, d) are one head's Q, K, V; oh (Nq, d) and lh (Nq,) its O and L; q0 the
    first query row of the tile. The block visits the K/V tiles ``tile_of(walk, t)`` for
    t = first .. first + count - 1 (every tile in order for chapter 4's dense walk; chapter 6
    passes its list of kept tiles). ``prefetch``: load the next K/V tile into registers
    while the current one is computed.
    """
    TY = Br // TM                 # threads along the rows of the tile
    THREADS = TY * TX
    RN = Bc // TX                 # columns of S a thread owns
    RD = D // TX                  # columns of O a thread owns
    RB = max(RN, RD)
    VM, VN, VD = run_length(TM), run_length(RN), run_length(RD)   # rows / S columns / O columns: runs this long
    Q_OFF, K_OFF, V_OFF, P_OFF, Q_STRIDE, K_STRIDE, V_STRIDE, P_STRIDE, _ = _layout(Br, Bc, D)
    PIECE, CW, RQ, G, W, Q_PASSES, KV_PASSES, Q_EXACT, KV_EXACT = _copy_plan(Br, Bc, D, THREADS)
    row_max, row_sum = make_row_reductions(TX, THREADS)

    @inlined
    def load_kv(kh, vh, kr, vr, k0, n_k, d, ld_r, ld_c):
        """This thread's part of the K and V tile starting at key k0, HBM -> registers."""
        for p in range(KV_PASSES):
            r = k0 + ld_r + RQ * ((p * W) // G)
            c = ld_c + CW * ((p * W) % G)
            kr[p], vr[p] = load_kv_or_zero(kh, vh, r, c, n_k, d)

    @inlined
    def attend(qh, kh, vh, oh, lh, q0, d, scale, causal, walk, first, count):
        smem = cuda.shared.array(0, float32, alignment=ALIGN)   # Qt | Kt | V | Pt  (module doc)
        n_q = int32(qh.shape[0])
        n_k = int32(kh.shape[0])
        tid = int32(cuda.threadIdx.x)
        tx = tid % TX                             # which of the TX threads of a row
        ty = tid // TX                            # which group of rows
        diag = n_k - n_q                          # causal: row r sees key c iff c <= r + diag
        # exp(scale * (s - m)) = exp2(s * scale_log2e - m * scale_log2e): one FMA and one ex2
        scale_log2e = scale * float32(LOG2E)
        # Shared-memory indices in the hot loops are unsigned: Numba checks every signed
        # index for a negative value (Python's a[-1]); an unsigned one skips that check
        # and lets the compiler see that a thread's 4-float runs are contiguous (LDS.128).
        row_u = uint64(ty * VM)                   # first row of this thread's first row run
        col_u = uint64(tx * VN)                   # first column of its first S-column run
        out_u = uint64(tx * VD)                   # first column of its first O-column run

        # Tile copies HBM -> shared memory. A warp copies a piece of 8 consecutive columns of
        # 4 rows (32-byte pieces of HBM rows); its stores to the padded shared rows then hit
        # 32 different banks, transposed (Qt, Kt) or not (V). The W warps of the block copy W
        # pieces a pass, pieces numbered along the rows of the tile first: this thread copies
        # (ld_r + RQ*((p W) // G), ld_c + CW*((p W) % G)) in pass p, a constant step from its
        # first element. Every load reads a valid address (row and column clamped) and is
        # zeroed afterwards if it lies outside the matrix: no branches around the loads, so
        # they can all be in flight at once.
        piece = tid // PIECE
        lane = tid % PIECE
        ld_r = (piece // G) * RQ + lane // CW     # the first row this thread copies
        ld_c = (piece % G) * CW + lane % CW       # and its column

        # ---- Q_i: Br x d from HBM, once, into shared memory (transposed, zero-padded)
        for p in range(Q_PASSES):
            r = ld_r + RQ * ((p * W) // G)
            c = ld_c + CW * ((p * W) % G)
            x = float32(qh[uint64(min(q0 + r, n_q - 1)), uint64(min(c, d - 1))])
            if q0 + r >= n_q or c >= d:
                x = float32(0.0)
            if Q_EXACT or r < Br:
                smem[uint64(Q_OFF + c * Q_STRIDE + r)] = x

        # ---- on-chip state of this thread's TM rows (registers: every index is a constant)
        m = cuda.local.array(TM, float32)         # running max (raw scores)
        l = cuda.local.array(TM, float32)         # running sum (this thread's columns)
        acc = cuda.local.array((TM, RD), float32)  # running output O (unnormalised)
        s = cuda.local.array((TM, RN), float32)   # this tile's scores S
        a = cuda.local.array(TM, float32)         # operand registers
        b = cuda.local.array(RB, float32)
        kr = cuda.local.array(KV_PASSES, float32)  # this thread's part of the next K/V tile
        vr = cuda.local.array(KV_PASSES, float32)
        for i in range(TM):
            m[i] = MASKED
            l[i] = float32(0.0)
            for c in range(RD):
                acc[i, c] = float32(0.0)

        # ---- the K/V tiles j of this query tile, in the walk's order
        end = first + count
        k_next = int32(0)
        if count > 0:
            k_next = tile_of(walk, first) * Bc
            if prefetch:
                load_kv(kh, vh, kr, vr, k_next, n_k, d, ld_r, ld_c)
        for t in range(first, end):
            k0 = k_next                           # first key of tile j
            k_next = tile_of(walk, min(t + 1, end - 1)) * Bc
            if not prefetch:
                load_kv(kh, vh, kr, vr, k0, n_k, d, ld_r, ld_c)
            # -- K_j (transposed) and V_j: registers -> shared memory
            cuda.syncthreads()                    # everyone is done with the last tile
            for p in range(KV_PASSES):
                r = ld_r + RQ * ((p * W) // G)
                c = ld_c + CW * ((p * W) % G)
                if KV_EXACT or r < Bc:
                    smem[uint64(K_OFF + c * K_STRIDE + r)] = kr[p]
                    smem[uint64(V_OFF + r * V_STRIDE + c)] = vr[p]
            cuda.syncthreads()
            if prefetch and t + 1 < end:          # the next tile: in flight while we compute on j
                load_kv(kh, vh, kr, vr, k_next, n_k, d, ld_r, ld_c)

            # -- S = Q_i K_j^T: a TM x RN register tile a thread
            for i in range(TM):
                for jj in range(RN):
                    s[i, jj] = float32(0.0)
            q_c = uint64(Q_OFF) + row_u           # walks down Qt[c, rows of this thread]
            k_c = uint64(K_OFF) + col_u           # walks down Kt[c, columns of this thread]
            for c in range(D):
                for i in range(TM):
                    a[i] = smem[q_c + uint64((i // VM) * TY * VM + i % VM)]
                for jj in range(RN):
                    b[jj] = smem[k_c + uint64((jj // VN) * TX * VN + jj % VN)]
                for i in range(TM):
                    for jj in range(RN):
                        s[i, jj] += a[i] * b[jj]
                q_c += uint64(Q_STRIDE)
                k_c += uint64(K_STRIDE)

            # -- mask: only the tiles the ragged end of K or the causal diagonal crosses
            if k0 + Bc > n_k or (causal and k0 + Bc - 1 > q0 + diag):
                for i in range(TM):
                    row = q0 + ty * VM + (i // VM) * TY * VM + i % VM
                    for jj in range(RN):
                        col = k0 + tx * VN + (jj // VN) * TX * VN + jj % VN
                        if col >= n_k or (causal and col > row + diag):
                            s[i, jj] = MASKED

            # -- online softmax: m' = max(m, rowmax(S)); l and O rescaled by exp(scale (m - m'));
            #    P = exp(scale (S - m')). A row that has seen no key yet (m' = MASKED) takes
            #    its exponents against 0 instead: exp of a MASKED score is then exactly 0 (no
            #    branch), and a NaN score still gives a NaN P (it must reach the output).
            for i in range(TM):
                mx = m[i]
                for jj in range(RN):
                    mx = max(mx, s[i, jj])
                mx = row_max(mx)                  # across the TX threads of the row
                alpha = math.exp2((m[i] - mx) * scale_log2e)
                m[i] = mx
                l[i] *= alpha
                for c in range(RD):
                    acc[i, c] *= alpha
                base = (mx if mx > MASKED else float32(0.0)) * scale_log2e
                p_t = uint64(P_OFF + (i // VM) * TY * VM + i % VM) + row_u    # Pt[., this row]
                for jj in range(RN):
                    p = math.exp2(s[i, jj] * scale_log2e - base)
                    l[i] += p
                    smem[p_t + (col_u + uint64((jj // VN) * TX * VN + jj % VN)) * uint64(P_STRIDE)] = p
            cuda.syncthreads()                    # P_ij complete in shared memory

            # -- O += P V_j: a TM x RD register tile a thread
            p_r = uint64(P_OFF) + row_u           # walks down Pt[r, rows of this thread], r < Bc
            v_r = uint64(V_OFF) + out_u           # walks down V[r, O columns of this thread]
            for r in range(Bc):
                for i in range(TM):
                    a[i] = smem[p_r + uint64((i // VM) * TY * VM + i % VM)]
                for c in range(RD):
                    b[c] = smem[v_r + uint64((c // VD) * TX * VD + c % VD)]
                for i in range(TM):
                    for c in range(RD):
                        acc[i, c] += a[i] * b[c]
                p_r += uint64(P_STRIDE)
                v_r += uint64(V_STRIDE)

        # ---- epilogue: l across the row's threads, O = acc / l, L = scale m + log l
        for i in range(TM):
            total = row_sum(l[i])
            row = q0 + ty * VM + (i // VM) * TY * VM + i % VM
            if row < n_q:
                if total == float32(0.0):         # no key visible: O = 0, L = -inf
                    inv = float32(0.0)
                    lse_row = MINUS_INF
                else:                             # (a NaN l, from a NaN score, stays NaN)
                    inv = float32(1.0) / total
                    lse_row = m[i] * scale + math.log(total)
                for c in range(RD):
                    col = tx * VD + (c // VD) * TX * VD + c % VD
                    if col < d:
                        oh[uint64(row), uint64(col)] = acc[i, c] * inv
                if tx == 0:
                    lh[uint64(row)] = lse_row

    return attend


@functools.lru_cache(maxsize=None)
def make_flash_forward(Br: int, Bc: int, D: int, TM: int, TX: int, prefetch: bool = False,
                       max_registers: int | None = None):
    """The forward kernel for one tile configuration (all sizes are compile-time constants).

    Launch: grid (Tr = ceil(Nq / Br), B*H), block (Br / TM) * TX threads, dynamic shared
    memory ``shared_bytes(Tiles(Br, Bc, TM, TX), D)``. Arguments: q (B*H, Nq, d), k and v
    (B*H, Nk, d) float32 or float16; o (B*H, Nq, d) and lse (B*H, Nq) float32; d (int32,
    <= D), scale (float32), causal (int32 0/1). ``prefetch``: load the next K/V tile into
    registers while the current one is computed (False: load it when it is needed).
    ``max_registers``: cap the registers a thread (more blocks fit on an SM; the excess
    spills to local memory).
    """
    attend = make_attend_query_tile(Br, Bc, D, TM, TX, prefetch)
    caps = {} if max_registers is None else {"max_registers": max_registers}   # (not in the simulator)

    @cuda.jit(fastmath=FASTMATH, **caps)
    def flash_forward(q, k, v, o, lse, d, scale, causal):
        bh = uint64(cuda.blockIdx.y)              # (batch, head)
        # Query tile i, the heaviest first: with causal masking the last tiles see the most
        # keys, and starting them first keeps the last wave of blocks short.
        q0 = (int32(cuda.gridDim.x) - 1 - int32(cuda.blockIdx.x)) * Br
        n_q = int32(q.shape[1])
        n_k = int32(k.shape[1])
        kv_end = n_k                              # causal: stop at the last key the last row sees
        if causal:
            kv_end = min(n_k, q0 + Br + n_k - n_q)
        n_tiles = (max(kv_end, 0) + Bc - 1) // Bc
        attend(q[bh], k[bh], v[bh], o[bh], lse[bh], q0, d, scale, causal, None, int32(0), n_tiles)

    return flash_forward


# --------------------------------------------------------------------------- the launcher

def flash_attention(q, k, v, *, causal=False, scale=None, tiles: Tiles | None = None, products="auto"):
    """Fused attention forward. q (B, H, Nq, d), k and v (B, H, Nk, d), float32 or float16.

    Returns (o, lse): o (B, H, Nq, d) float32 and the row logsumexp lse (B, H, Nq) float32
    (natural log; -inf for rows that see no key). NumPy in, NumPy out; device arrays in,
    device arrays out. ``tiles`` overrides the tile configuration (see ``Tiles``).

    ``products``: "fma" runs this chapter's kernel (fp32 math on the FMA units); "3xtf32"
    runs chapter 11's (float32 inputs on tensor cores, three TF32 products a product, about
    fp32's accuracy, faster); "auto", the default, takes "3xtf32" for float32 inputs on a
    GPU with TF32 tensor cores when no ``tiles`` are given, else "fma".
    """
    B, H, n_q, n_k, d, dtype = check_qkv(q, k, v, dtypes=(np.float32, np.float16), max_head_dim=128)
    causal = check_flag(causal, "causal")
    scale = check_scale(scale, d)
    how = check_products(products, float32=dtype == np.float32, fma_only=None if tiles is None else "tiles")
    if how == "3xtf32":
        from kernels.flash_tf32 import flash_attention_tf32

        return flash_attention_tf32(q, k, v, causal=causal, scale=scale)
    tiles = check_tiles_type(default_tiles(d) if tiles is None else tiles)
    D = padded_head_dim(d, tiles.TX)
    check_tiles(tiles, D)
    BH = B * H
    if BH > MAX_GRID_Y:
        raise ValueError(f"q: expected B*H <= {MAX_GRID_Y} (one grid row a head), got B={B}, H={H}")
    kind = ArrayKind(q)

    o = kind.empty((BH, n_q, d), np.float32)          # the caller's allocator where it has one
    lse = kind.empty((BH, n_q), np.float32)
    if BH > 0 and n_q > 0:
        if n_k == 0:   # nothing to attend to: O = 0, L = -inf (no kernel needed)
            o = cuda.to_device(np.zeros((BH, n_q, d), np.float32))
            lse = cuda.to_device(np.full((BH, n_q), -np.inf, np.float32))
        else:
            qd = to_device(q, "q").reshape(BH, n_q, d)
            kd = to_device(k, "k").reshape(BH, n_k, d)
            vd = to_device(v, "v").reshape(BH, n_k, d)
            kernel = make_flash_forward(tiles.Br, tiles.Bc, D, tiles.TM, tiles.TX)
            nbytes = shared_bytes(tiles, D)
            args = (qd, kd, vd, o, lse, np.int32(d), np.float32(scale), np.int32(causal))
            allow_dynamic_shared_memory(kernel, args, nbytes)
            kernel[(cdiv(n_q, tiles.Br), BH), tiles.threads, launch_stream(), nbytes](*args)
    return kind.give_back(o.reshape(B, H, n_q, d)), kind.give_back(lse.reshape(B, H, n_q))


# --------------------------------------------------------------------------- the ladder's first rungs
# The notebook's kernel exercises (their solutions, not printed there): the two steps from
# chapter 3's one-thread-a-row softmax to the production kernel above.
#
#   rung 1  one thread a query row: the online softmax of chapter 3 over every key, with
#           the output row O_i in the thread's own (local) memory; K and V read from global
#           memory by every row, Nq times over
#   rung 2  one block a query tile of Br rows, still one thread a row, but the block loads
#           each K/V tile (Bc rows) into shared memory once and all its Br threads read it:
#           K and V come from HBM ceil(Nq / Br) times, not Nq times
#   rung 3  the production kernel: the same loops, each thread a TM x RN micro-tile of S
#           (registers, runs of 4, warp-shuffle row maxima)
#
# Both rungs are plain ``@cuda.jit`` kernels (IEEE exp and division, as a learner's are).
# Rung 2's loops over a row run to the compile-time D over zero-padded tiles: unrolled, they
# keep q_i and O_i in registers, where rung 1's loops to the run-time d keep them in local
# memory (so rung 2 changes two things; the notebook measures both together).
# A learner's ``make_row_per_thread_forward`` / ``make_query_tile_forward`` replace these
# through ``kernels.base.learner``; tests/test_flash_forward.py grades them through the
# launchers ``row_per_thread_attention`` and ``query_tile_attention``.

EXERCISES = {"make_row_per_thread_forward": "row_per_thread",
             "make_query_tile_forward": "query_tile"}
ROW_THREADS = 128                 # rung 1's threads a block (each a query row)
QUERY_TILE_GPU = (64, 32)         # rung 2's (Br, Bc) on a GPU: 64 threads, 2 x 32 x D floats shared
QUERY_TILE_SIM = (8, 4)


@functools.lru_cache(maxsize=None)
def make_row_per_thread_forward(D: int):
    """Rung 1. Kernel (q, k, v, o, lse, scale, causal) on (B*H, N, d) views, d <= D (the
    compile-time size of a row in local memory); grid (ceil(Nq / threads), B*H): thread i of
    the grid's x takes query row i of head ``blockIdx.y``. For each key j it sees:
    s = scale q_i . k_j; m' = max(m, s); l = exp(m - m') l + exp(s - m');
    O_i = exp(m - m') O_i + exp(s - m') v_j. Then O_i / l and L_i = m + log l; a row that
    sees no key gets O_i = 0 and L_i = -inf."""

    @cuda.jit
    def row_per_thread_forward(q, k, v, o, lse, scale, causal):
        bh = cuda.blockIdx.y
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        n_q, n_k, d = q.shape[1], k.shape[1], q.shape[2]
        if i >= n_q:
            return
        kv_end = n_k                                  # causal: keys j <= i + Nk - Nq
        if causal:
            kv_end = min(n_k, i + 1 + n_k - n_q)
        q_i = cuda.local.array(D, float32)            # scale q_i, once
        o_i = cuda.local.array(D, float32)
        for c in range(d):
            q_i[c] = float32(scale) * float32(q[bh, i, c])
            o_i[c] = float32(0.0)
        m = MINUS_INF
        l = float32(0.0)
        for j in range(max(kv_end, 0)):
            s = float32(0.0)                          # s = scale q_i . k_j
            for c in range(d):
                s += q_i[c] * float32(k[bh, j, c])
            m_new = nan_max(m, s)                     # m' = max(m, s), NaN kept
            if m_new == MINUS_INF:                    # nothing but -inf yet: no update
                continue
            alpha = math.exp(m - m_new)               # rescales what was summed with the old m
            p = math.exp(s - m_new)
            l = l * alpha + p
            for c in range(d):
                o_i[c] = o_i[c] * alpha + p * float32(v[bh, j, c])
            m = m_new
        if l == float32(0.0):                         # no key: O = 0, L = -inf
            for c in range(d):
                o[bh, i, c] = float32(0.0)
            lse[bh, i] = MINUS_INF
            return
        inv_l = float32(1.0) / l
        for c in range(d):
            o[bh, i, c] = o_i[c] * inv_l
        lse[bh, i] = m + math.log(l)

    return row_per_thread_forward


@functools.lru_cache(maxsize=None)
def make_query_tile_forward(Br: int, Bc: int, D: int):
    """Rung 2. Kernel (q, k, v, o, lse, scale, causal) on (B*H, N, d) views, d <= D; grid
    (ceil(Nq / Br), B*H), Br threads a block: block x takes query rows Br x .. Br x + Br - 1,
    thread t row Br x + t (rung 1's loop over keys, per thread). K and V come in tiles of Bc
    rows: every thread copies a share of the tile into shared memory (zeros past Nk or d),
    a barrier, every thread sweeps the Bc keys its row sees, a barrier before the next tile
    overwrites them. Threads whose row is past Nq still copy and wait at the barriers."""

    @cuda.jit
    def query_tile_forward(q, k, v, o, lse, scale, causal):
        K_j = cuda.shared.array((Bc, D), float32)
        V_j = cuda.shared.array((Bc, D), float32)
        bh = cuda.blockIdx.y
        t = cuda.threadIdx.x
        q0 = cuda.blockIdx.x * Br
        i = q0 + t
        n_q, n_k, d = q.shape[1], k.shape[1], q.shape[2]
        row = i < n_q
        kv_end = n_k                                  # this row's keys: j < kv_end
        block_end = n_k                               # the block's: its last row's
        if causal:
            kv_end = min(n_k, i + 1 + n_k - n_q)
            block_end = min(n_k, q0 + Br + n_k - n_q)
        q_i = cuda.local.array(D, float32)            # loops over the compile-time D (zeros past d)
        o_i = cuda.local.array(D, float32)            # unroll: q_i and o_i stay in registers
        for c in range(D):
            q_i[c] = float32(scale) * float32(q[bh, i, c]) if row and c < d else float32(0.0)
            o_i[c] = float32(0.0)
        m = MINUS_INF
        l = float32(0.0)
        for k0 in range(0, max(block_end, 0), Bc):
            for e in range(t, Bc * D, Br):            # the tile copy: thread t takes every Br-th element
                r, c = e // D, e % D
                inside = k0 + r < n_k and c < d
                K_j[r, c] = float32(k[bh, k0 + r, c]) if inside else float32(0.0)
                V_j[r, c] = float32(v[bh, k0 + r, c]) if inside else float32(0.0)
            cuda.syncthreads()                        # the tile is in shared memory
            for r in range(min(Bc, kv_end - k0)):     # the keys this row sees (none past Nq)
                s = float32(0.0)
                for c in range(D):
                    s += q_i[c] * K_j[r, c]           # every thread reads the same K_j[r, c]: a broadcast
                m_new = nan_max(m, s)
                if m_new == MINUS_INF:
                    continue
                alpha = math.exp(m - m_new)
                p = math.exp(s - m_new)
                l = l * alpha + p
                for c in range(D):
                    o_i[c] = o_i[c] * alpha + p * V_j[r, c]
                m = m_new
            cuda.syncthreads()                        # all have read the tile before it is overwritten
        if not row:
            return
        if l == float32(0.0):
            for c in range(d):
                o[bh, i, c] = float32(0.0)
            lse[bh, i] = MINUS_INF
            return
        inv_l = float32(1.0) / l
        for c in range(D):
            if c < d:
                o[bh, i, c] = o_i[c] * inv_l
        lse[bh, i] = m + math.log(l)

    return query_tile_forward


def _ladder_call(q, k, v, causal, scale, out, lse_out):
    """The rungs' shared launcher half: checks, then device views and the outputs."""
    B, H, n_q, n_k, d, _ = check_qkv(q, k, v, dtypes=(np.float32, np.float16), max_head_dim=128)
    causal = check_flag(causal, "causal")
    scale = check_scale(scale, d)
    if B * H > MAX_GRID_Y:
        raise ValueError(f"q: expected B*H <= {MAX_GRID_Y} (one grid row a head), got B={B}, H={H}")
    o = check_out(out, "out", (B, H, n_q, d))
    lse = check_out(lse_out, "lse_out", (B, H, n_q))
    o = device_empty((B, H, n_q, d), np.float32) if o is None else o
    lse = device_empty((B, H, n_q), np.float32) if lse is None else lse
    BH = B * H
    views = tuple(to_device(x, name).reshape(BH, x.shape[2], d) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    args = (*views, o.reshape(BH, n_q, d), lse.reshape(BH, n_q), np.float32(scale), np.int32(causal))
    return ArrayKind(q), (B, H, n_q, d), args, (o, lse)


def _ladder_result(kind, out, lse_out, o, lse):
    return (out if out is not None else kind.give_back(o),
            lse_out if lse_out is not None else kind.give_back(lse))


def row_per_thread_attention(q, k, v, *, causal=False, scale=None, out=None, lse_out=None):
    """Rung 1 (``make_row_per_thread_forward``): (o, lse) like ``flash_attention``, one thread
    a query row. ``out``/``lse_out``: device arrays (B, H, Nq, d) and (B, H, Nq) to write
    into (returned as given)."""
    kind, (B, H, n_q, d), args, (o, lse) = _ladder_call(q, k, v, causal, scale, out, lse_out)
    if B * H and n_q:
        threads = 32 if on_simulator() else ROW_THREADS
        make_row_per_thread_forward(padded_head_dim(d))[(cdiv(n_q, threads), B * H), threads](*args)
    return _ladder_result(kind, out, lse_out, o, lse)


def query_tile_attention(q, k, v, *, causal=False, scale=None, tiles=None, out=None, lse_out=None):
    """Rung 2 (``make_query_tile_forward``): (o, lse) like ``flash_attention``, a block of Br
    threads a query tile, K/V tiles of Bc rows in shared memory. ``tiles``: (Br, Bc), Br
    in 1..1024, 2 Bc D floats within 48 KB of static shared memory. ``out``/``lse_out`` as
    for ``row_per_thread_attention``."""
    kind, (B, H, n_q, d), args, (o, lse) = _ladder_call(q, k, v, causal, scale, out, lse_out)
    D = padded_head_dim(d)
    Br, Bc = check_query_tile(tiles, D)
    if B * H and n_q:
        make_query_tile_forward(Br, Bc, D)[(cdiv(n_q, Br), B * H), Br](*args)
    return _ladder_result(kind, out, lse_out, o, lse)


def check_query_tile(tiles, D: int) -> tuple[int, int]:
    """Rung 2's (Br, Bc): the default for the device, or ``tiles`` checked."""
    if tiles is None:
        Br, Bc = QUERY_TILE_SIM if on_simulator() else QUERY_TILE_GPU
        return Br, Bc
    if not (isinstance(tiles, tuple) and len(tiles) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                                  for x in tiles)):
        raise TypeError(f"tiles: expected a tuple (Br, Bc) of ints, got {tiles!r}")
    Br, Bc = tiles
    if not (1 <= Br <= 1024 and Bc >= 1 and 2 * Bc * D * 4 <= 48 * 1024):
        raise ValueError(f"tiles: expected 1 <= Br <= 1024 and 2 Bc D floats <= 48 KB (D = {D}), got {tiles}")
    return Br, Bc


# --------------------------------------------------------------------------- the IO model

def io_model_bytes(B: int, H: int, n_q: int, n_k: int, d: int, *, Br: int, Bc: int = 64,
                   causal: bool = False, in_bytes: int = 4) -> int:
    """HBM bytes the fused forward moves with no L2 reuse (Q tile outer): the course's IO
    model, ``kernels.base.io_model.fused_forward_bytes``.

    A head reads Q once (Nq d), writes O (Nq d, float32) and L (Nq, float32), and every one
    of its ceil(Nq / Br) query tiles reads the K and V rows it needs: 2 Nk d each without
    causal masking, so 2 Nq d + Nq + 2 Nk d ceil(Nq / Br) elements. Inputs are ``in_bytes``
    an element (4 for float32, 2 for float16), the outputs float32.
    """
    return fused_forward_bytes(B, H, n_q, n_k, d, Br=Br, Bc=Bc, causal=causal, itemsize=in_bytes)


# --------------------------------------------------------------------------- PTX check

# The sweep the bench runs at d=64 and at d=128 (first is the default).
SWEEP_D64 = (Tiles(256, 64, 8, 8), Tiles(128, 64, 8, 8), Tiles(256, 32, 8, 8), Tiles(128, 64, 4, 8), Tiles(128, 32, 4, 8))
SWEEP_D128 = (Tiles(128, 32, 4, 8), Tiles(128, 64, 4, 8), Tiles(64, 32, 4, 8), Tiles(128, 64, 8, 16))


def ptx_targets(every_shape: bool = False):
    """The production kernel at d = 64 and 128, fp32 and fp16 inputs, and the ladder's rungs
    (``every_shape``: the prefetching variant, the bench's whole tile sweeps, d = 16 and 32)."""
    targets = []

    def sig(t):
        return (f"void({t}[:, :, ::1], {t}[:, :, ::1], {t}[:, :, ::1], float32[:, :, ::1], "
                f"float32[:, ::1], int32, float32, int32)")

    for D, sweep in ((64, SWEEP_D64), (128, SWEEP_D128)):
        for n, t in enumerate(sweep if every_shape else sweep[:1]):
            kern = make_flash_forward(t.Br, t.Bc, D, t.TM, t.TX)
            for dt in (("float32", "float16") if n == 0 else ("float32",)):
                targets.append((f"flash fwd {dt[:1]}p{dt[5:]} {t} D={D}", kern, sig(dt)))
        if every_shape:                           # the prefetching variant the bench compares
            t = sweep[0]
            kern = make_flash_forward(t.Br, t.Bc, D, t.TM, t.TX, prefetch=True)
            targets.append((f"flash fwd fp32 {t} D={D} prefetch", kern, sig("float32")))
    ladder = "void({0}[:, :, ::1], {0}[:, :, ::1], {0}[:, :, ::1], float32[:, :, ::1], float32[:, ::1], float32, int32)"
    for D in (64, 128):                           # the ladder's first rungs, as the bench runs them
        for dt in ("float32", "float16"):
            targets.append((f"rung 1 {dt} D={D}", make_row_per_thread_forward(D), ladder.format(dt)))
            targets.append((f"rung 2 {dt} {QUERY_TILE_GPU} D={D}", make_query_tile_forward(*QUERY_TILE_GPU, D),
                            ladder.format(dt)))
    for D in (16, 32) if every_shape else ():
        t = SWEEP_D64[0]
        targets.append((f"flash fwd fp32 {t} D={D}", make_flash_forward(t.Br, t.Bc, D, t.TM, t.TX), sig("float32")))
    return targets
