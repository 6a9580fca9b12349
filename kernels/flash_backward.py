"""Chapter 5: the recomputing FlashAttention backward.

The forward saved only O and the row logsumexp L. The backward never stores the N x N
matrices S or P: it recomputes them, one Br x Bc tile at a time (Br query rows, Bc key
rows; Tr = ceil(Nq / Br), Tc = ceil(Nk / Bc)), from Q, K and L:

    S  = scale * Q K^T                     (recomputed)
    P  = exp(S - L)                        (recomputed; 0 where masked, 0 on rows with L = -inf)
    dV = P^T dO
    dP = dO V^T
    D  = rowsum(dO * O)                    (= rowsum(P * dP): the softmax Jacobian's diagonal term)
    dS = P * (dP - D)
    dQ = scale * dS K
    dK = scale * dS^T Q

The kernels, in launch order:

1. ``delta``: the pre-pass D = rowsum(dO * O), one float a query row.
2. ``dkdv``: K/V tiles outer, grid (Tc, B*H). A block owns key tile j: K_j, V_j stay in
   shared memory, dK_j, dV_j in registers (two-level sums, see ACC_ROWS), while the query
   side Q_i, dO_i, L_i, D_i streams by. With atomic dQ (the default, as in FlashAttention-2:
   it measured faster) the block also adds its piece scale * dS K_j of each dQ_i to dQ with
   float32 atomic adds, whose order, so dQ's last bits, varies from run to run.
3. ``dq`` (``dq_mode="separate"``): Q tiles outer, grid (Tr, B*H): S, P, dP, dS recomputed
   a second time against the streaming K_j, V_j, each dQ entry summed by one thread in a
   fixed order: bitwise identical run to run, for 14 N^2 d FLOPs a head in place of 10.

How it is built. Tile sizes are compile-time constants (``kernels.base.backward_tiles``), so all
the code comes from cached factories that close over them. The device building blocks are
written once, here, as device functions inlined into the kernels (per-thread arrays of
constant shape, indexed by unrolled loops, stay in registers): tile copies with a register
prefetch, L and D of a query row, the S and dP micro-tiles, P and dS, dV += P^T dO and
dK += dS^T Q, dQ += dS K, the two-level sums. Two bodies compose them (``make_dkdv_body``,
``make_dq_body``) and walk their tiles as chapter 4's forward does: tile ``tile_of(walk, t)``
for t = first .. first + count - 1, with chapter 4's ``every_tile`` (tile t) here; chapter 6
passes ``listed_tile``, which reads its lists of kept tiles, and the rest of its kernels is
this code. (Triton's fused attention shares bodies through a compile-time flag; a device
function handed to a factory is the Numba way.) Threads read shared memory 16 bytes at a
time (rows Dh + 4 or Bc + 4 floats apart) at unsigned offsets (Numba adds a negative-index
wraparound to signed ones: instructions, and the alignment hidden).

NaN and Inf follow IEEE arithmetic (``FASTMATH`` keeps the no-NaN/no-Inf assumptions out): a
NaN in Q, K, V, dO, O or L reaches every gradient it touches. L = -inf (a row that sees
nothing) is the one non-finite value with a meaning: P = 0 on that row. Masked and padded
scores contribute exactly nothing (P = 0 and dS = 0, as a skipped tile does).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint64

from kernels.base.backward_args import DQ_MODES, allocate_outputs, check_backward_args, device_views, zero_gradients
from kernels.base.backward_tiles import (GPU_TILES, BackwardTiles, Grid, check_tiles, default_tiles, dkdv_layout,
                                    dq_layout, head_dim_bucket, need, shared_bytes, warp_split)
from kernels.base import io_model as io
from kernels.base.fused import ALIGN, FASTMATH, MINUS_INF, make_kv_tile_copy, make_row_reductions, padded_head_dim, \
    run_length
from kernels.base.inlined import inlined
from kernels.base.runtime import ArrayKind, cdiv, check_flag, check_out, check_products, check_scale, device_empty, \
    launch_stream, on_simulator
from kernels.base.shared_memory import STATIC_LIMIT_BYTES, launch_with_shared
from kernels.flash_forward import every_tile

__all__ = ["flash_attention_backward", "flash_backward_numpy", "recompute_p", "ds_tile", "BackwardTiles",
           "default_tiles", "make_delta", "make_dkdv_body", "make_dq_body", "make_dkdv", "make_dq",
           "launch", "ptx_targets", "DQ_MODES", "allocate_outputs", "io_model_bytes", "standard_backward_bytes",
           "row_per_thread_backward", "shared_tile_backward", "make_row_per_thread_dkdv", "make_row_per_thread_dq",
           "make_shared_tile_dkdv", "make_shared_tile_dq", "EXERCISES"]

# Two-level sums: a thread sums about ACC_ROWS rows of dV_j += P^T dO_i and dK_j += dS^T Q_i in
# registers, then adds that partial to a running sum of its own in shared memory. One float32
# register summing all N rows rounds at each of N additions: at N = 4096, causal (the first
# keys: P >= 0, nothing cancels), its dV error was 4x NumPy's and broke the tolerance rule; in
# blocks of ACC_ROWS rows, 0.7x. The dQ kernel does the same over the keys.
ACC_ROWS = 64
# The "logsumexp" of a dead row (past Nq, or L = -inf): exp(S - DEAD) = 0 for any finite S.
# A NaN L is not dead: it stays NaN, and so does its row of P.
DEAD = float32(1.0e30)


# --------------------------------------------------------------------------- NumPy version

def recompute_p(s, lse):
    """P = exp(S - L) for one tile of scaled scores S (-inf where masked) and the rows' L:
    0 where S = -inf (masked) and on rows with L = -inf (they saw nothing), no NaN there."""
    s, lse = np.asarray(s), np.asarray(lse)[..., None]
    live = np.isfinite(s) & np.isfinite(lse)
    with np.errstate(invalid="ignore"):
        return np.where(live, np.exp(np.where(live, s - lse, 0.0)), 0.0).astype(s.dtype)


def ds_tile(p, dp, delta):
    """dS = P * (dP - D) for one tile: P and dP (Br x Bc), D the tile's rows of rowsum(dO * O)."""
    return p * (dp - np.asarray(delta)[..., None])


def flash_backward_numpy(q, k, v, o, lse, do, *, causal=False, scale=None, Br=16, Bc=16):
    """The recomputing backward in NumPy, in the kernels' loop order (one (batch, head) or
    many): K/V tiles outer for dK, dV; Q tiles outer for dQ; no N x N array is ever formed."""
    q, k, v, o, lse, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, o, lse, do))
    nq, nk = q.shape[-2], k.shape[-2]
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    delta = np.sum(do * o, axis=-1)                                 # D, one number a query row
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)

    def p_and_ds(rows, cols):
        s = scale * q[..., rows, :] @ np.swapaxes(k[..., cols, :], -1, -2)
        if causal:
            s = np.where(cols[None, :] <= rows[:, None] + (nk - nq), s, -np.inf)
        p = recompute_p(s, lse[..., rows])                          # P rebuilt from Q, K and L
        dp = do[..., rows, :] @ np.swapaxes(v[..., cols, :], -1, -2)
        return p, ds_tile(p, dp, delta[..., rows])

    tiles = lambda n, b: [np.arange(i, min(i + b, n)) for i in range(0, n, b)]  # noqa: E731
    for cols in tiles(nk, Bc):                                      # K/V tiles outer: dK_j, dV_j
        for rows in tiles(nq, Br):
            p, ds = p_and_ds(rows, cols)
            dv[..., cols, :] += np.swapaxes(p, -1, -2) @ do[..., rows, :]
            dk[..., cols, :] += scale * np.swapaxes(ds, -1, -2) @ q[..., rows, :]
    for rows in tiles(nq, Br):                                      # Q tiles outer: dQ_i
        for cols in tiles(nk, Bc):
            dq[..., rows, :] += scale * p_and_ds(rows, cols)[1] @ k[..., cols, :]
    return dq, dk, dv


# --------------------------------------------------------------------------- kernel 1: D

@functools.lru_cache(maxsize=None)
def make_delta(Dh: int, rows: int = 4, zero_dq: bool = False):
    """D = rowsum(dO * O), grid (ceil(Nq / rows), B*H), one warp a row: lanes read
    consecutive columns (coalesced), then the warp adds their partial sums with chapter 4's
    row reduction (``kernels.base.fused.make_row_reductions``: five shuffles, no shared
    memory, no barrier). ``zero_dq``: the same threads also clear dQ (atomic dQ adds into
    it). Returns (kernel, threads)."""
    LANES, NT = 32, 32 * rows
    _, row_sum = make_row_reductions(LANES, NT)

    @cuda.jit(fastmath=FASTMATH)
    def delta(o, do, out, dq, nq):
        t = int32(cuda.threadIdx.x)
        lane = t % int32(LANES)
        bh = int32(cuda.blockIdx.y)
        row = int32(cuda.blockIdx.x) * int32(rows) + t // int32(LANES)
        acc = float32(0.0)
        if row < nq:
            for e in range(lane, int32(o.shape[2]), LANES):
                acc += o[bh, row, e] * do[bh, row, e]
                if zero_dq:
                    dq[bh, row, e] = float32(0.0)
        total = row_sum(acc)                  # every lane of the warp takes part
        if lane == 0 and row < nq:
            out[bh, row] = total

    return delta, NT


# --------------------------------------------------------------------------- building blocks

@inlined
def row_stats(lse, delta, bh, row, nq):
    """(L, D) of a query row: (DEAD, 0) past Nq, DEAD for L = -inf (P = 0 there); NaN stays."""
    L, D = DEAD, float32(0.0)
    if row < nq:
        L, D = lse[bh, row], delta[bh, row]
        if L == MINUS_INF:
            L = DEAD
    return L, D


@functools.lru_cache(maxsize=None)
def _copies(R: int, Dh: int, NT: int):
    """R rows (from row r0) of two (N, d) arrays x, y (Q and dO, or K and V) to shared tiles
    at offsets ox, oy (rows Dh + 4 apart), zeros past N and d: ``load`` them; or ``fetch``
    them into registers xr, yr (thread t: elements t + NT*m) and ``put`` them later, so that
    the next tile travels from HBM while the current one is computed. Returns (load, fetch,
    put, R*Dh/NT)."""
    LD, LR = Dh + 4, R * Dh // NT

    @inlined
    def load(sm, ox, oy, x, y, bh, r0, n, d, t):
        for idx in range(t, R * Dh, NT):
            r = int32(idx) // int32(Dh)
            e = int32(idx) - r * int32(Dh)
            xv, yv = float32(0.0), float32(0.0)
            if r0 + r < n and e < d:
                xv, yv = x[bh, r0 + r, e], y[bh, r0 + r, e]
            sm[uint64(ox + r * LD + e)] = xv
            sm[uint64(oy + r * LD + e)] = yv

    @inlined
    def fetch(x, y, bh, r0, n, d, t, xr, yr):
        for m in range(LR):
            r = (t + int32(m * NT)) // int32(Dh)
            e = t + int32(m * NT) - r * int32(Dh)
            xr[m], yr[m] = float32(0.0), float32(0.0)
            if r0 + r < n and e < d:
                xr[m], yr[m] = x[bh, r0 + r, e], y[bh, r0 + r, e]

    @inlined
    def put(sm, ox, oy, t, xr, yr):
        for m in range(LR):
            r = (t + int32(m * NT)) // int32(Dh)
            e = t + int32(m * NT) - r * int32(Dh)
            sm[uint64(ox + r * LD + e)] = xr[m]
            sm[uint64(oy + r * LD + e)] = yr[m]

    return load, fetch, put, LR


@functools.lru_cache(maxsize=None)
def _scores(Br: int, Bc: int, Dh: int, NT: int, store_p: bool = False, store_ds: bool = False):
    """The Br x Bc tiles S, dP, P, dS. ``where(t)``: (ty, tx), thread t's first row and
    column; it owns rows ty + RA*a, columns tx + CA*b (a warp covers a nearly square block).
    ``s_dp``: S = Q_i K_j^T, dP = dO_i V_j^T (raw dot products, 4 steps of d a vector load;
    u_*: the thread's first row of Q_i, dO_i, K_j, V_j). ``p_ds``: P = exp(scale S - L) and
    dS = P (dP - D) in place of S and dP, both exactly 0 where masked (causal: key c visible
    to row r iff c <= r + Nk - Nq) or past Nq, Nk; each also stored to its shared tile at
    o_p (``store_p``), o_ds (``store_ds``) as it is made. ``store``: a micro-tile to the
    shared tile at offset o (rows Bc + 4 apart). Returns (where, s_dp, p_ds, store, (AM, AN))."""
    AM, AN, RA, CA, WC = need(warp_split, Br, Bc, NT, "S tile Br x Bc")
    LD, LP = Dh + 4, Bc + 4

    @inlined
    def where(t):
        w = t // int32(32)
        lane = t - w * int32(32)
        return ((w // int32(WC)) * int32(RA * AM) + lane // int32(CA),
                (w % int32(WC)) * int32(CA * AN) + lane % int32(CA))

    @inlined
    def s_dp(sm, u_q, u_do, u_k, u_v, s, dp):
        qa, da = cuda.local.array((AM, 4), float32), cuda.local.array((AM, 4), float32)
        kb, vb = cuda.local.array((AN, 4), float32), cuda.local.array((AN, 4), float32)
        for a in range(AM):
            for b in range(AN):
                s[a, b] = float32(0.0)
                dp[a, b] = float32(0.0)
        for e4 in range(Dh // 4):
            ue = uint64(e4) * uint64(4)
            for a in range(AM):
                for u in range(4):
                    qa[a, u] = sm[u_q + uint64(a * RA * LD) + ue + uint64(u)]
                    da[a, u] = sm[u_do + uint64(a * RA * LD) + ue + uint64(u)]
            for b in range(AN):
                for u in range(4):
                    kb[b, u] = sm[u_k + uint64(b * CA * LD) + ue + uint64(u)]
                    vb[b, u] = sm[u_v + uint64(b * CA * LD) + ue + uint64(u)]
            for u in range(4):
                for a in range(AM):
                    for b in range(AN):
                        s[a, b] += qa[a, u] * kb[b, u]
                        dp[a, b] += da[a, u] * vb[b, u]

    @inlined
    def p_ds(sm, o_l, o_d, ty, tx, r0, c0, nq, nk, causal, scale, s, dp, o_p, o_ds):
        for a in range(AM):
            r = ty + int32(a * RA)
            lrow = sm[uint64(o_l + r)]
            drow = sm[uint64(o_d + r)]
            cols = nk                                   # row r0 + r sees the keys col < cols
            if causal != 0:
                cols = min(cols, r0 + r + (nk - nq) + int32(1))
            if r0 + r >= nq:
                cols = int32(0)
            for b in range(AN):
                p, ds = float32(0.0), float32(0.0)
                if c0 + tx + int32(b * CA) < cols:
                    p = math.exp(s[a, b] * scale - lrow)
                    ds = p * (dp[a, b] - drow)
                s[a, b] = p
                dp[a, b] = ds
                if store_p:
                    sm[uint64(o_p + r * LP + tx + b * CA)] = p
                if store_ds:
                    sm[uint64(o_ds + r * LP + tx + b * CA)] = ds

    @inlined
    def store(sm, o, ty, tx, x):
        for a in range(AM):
            for b in range(AN):
                sm[uint64(o + (ty + a * RA) * LP + tx + b * CA)] = x[a, b]

    return where, s_dp, p_ds, store, (AM, AN)


@functools.lru_cache(maxsize=None)
def _runs(g: Grid):
    """row(a), col(b): the offset of a thread's entry (a, b) of grid g from its first row
    ty * VR and first column tx * VC (a and b are unrolled loop indices: constants)."""
    VR, VC, TRV, TCV = g.VR, g.VC, g.TR * g.VR, g.TC * g.VC
    return inlined(lambda a: (a % VR) + (a // VR) * TRV), inlined(lambda b: (b % VC) + (b // VC) * TCV)


@functools.lru_cache(maxsize=None)
def _sums(g: Grid, NT: int, atomic: bool = False):
    """A thread's M x N accumulator of an output tile (grid g), two-level: ``clear``; ``flush``
    the registers into the thread's running sums in shared memory (entry (a, b) of thread t at
    o + (a*N + b)*NT + t: consecutive threads, consecutive words); ``write`` running sum +
    registers, times ``factor``, to out[bh, row0 + ..., ...] within n rows and d columns
    (``atomic``: add the registers alone, atomically: atomic dQ)."""
    M, N, VR, VC = g.M, g.N, g.VR, g.VC
    row_of, col_of = _runs(g)

    @inlined
    def clear(sm, o, t, acc):
        for a in range(M):
            for b in range(N):
                acc[a, b] = float32(0.0)
                sm[uint64(o + (a * N + b) * NT + t)] = float32(0.0)

    @inlined
    def flush(sm, o, t, acc):
        for a in range(M):
            for b in range(N):
                sm[uint64(o + (a * N + b) * NT + t)] += acc[a, b]
                acc[a, b] = float32(0.0)

    @inlined
    def write(out, sm, o, t, acc, bh, row0, n, d, ty, tx, factor):
        for a in range(M):
            row = row0 + ty * int32(VR) + int32(row_of(a))
            if row < n:
                for b in range(N):
                    e = tx * int32(VC) + int32(col_of(b))
                    if e < d:
                        if atomic:
                            cuda.atomic.add(out, (bh, row, e), acc[a, b] * factor)
                        else:
                            out[bh, row, e] = (sm[uint64(o + (a * N + b) * NT + t)] + acc[a, b]) * factor

    return clear, flush, write


@functools.lru_cache(maxsize=None)
def _transposed(g: Grid, R: int, LP: int, LD: int, two: bool):
    """acc1 += X1^T Y1 (and acc2 += X2^T Y2 if ``two``) over the R rows of shared tiles X (R x
    Bc, rows LP apart) and Y (R x Dh, rows LD apart): dV_j += P^T dO_i and dK_j += dS^T Q_i.
    u_x*, u_y*: the thread's first key run in X and first column run in Y."""
    M, N = g.M, g.N
    row_of, col_of = _runs(g)

    @inlined
    def products(sm, u_x1, u_y1, acc1, u_x2, u_y2, acc2):
        x1, x2 = cuda.local.array(M, float32), cuda.local.array(M, float32)
        y1, y2 = cuda.local.array(N, float32), cuda.local.array(N, float32)
        r = int32(0)
        rp = uint64(r)                          # r * (row stride), kept by additions
        rd = uint64(r)
        while r < int32(R):                     # a while loop: leaner counting than range()
            for a in range(M):
                x1[a] = sm[u_x1 + rp + uint64(row_of(a))]
                if two:
                    x2[a] = sm[u_x2 + rp + uint64(row_of(a))]
            for b in range(N):
                y1[b] = sm[u_y1 + rd + uint64(col_of(b))]
                if two:
                    y2[b] = sm[u_y2 + rd + uint64(col_of(b))]
            for a in range(M):
                for b in range(N):
                    acc1[a, b] += x1[a] * y1[b]
                    if two:
                        acc2[a, b] += x2[a] * y2[b]
            r += int32(1)
            rp += uint64(LP)
            rd += uint64(LD)

    return products


@functools.lru_cache(maxsize=None)
def _ds_k(g: Grid, Bc: int, LP: int, LD: int):
    """acc += dS K_j for a Br x Dh tile of dQ_i (grid g, a thread's rows TR apart), over the
    keys UC at a time (one vector load of a dS row). u_ds: the thread's first dS row; u_k:
    its first column run of K_j."""
    M, N, TR, UC = g.M, g.N, g.TR, run_length(Bc)
    col_of = _runs(g)[1]

    @inlined
    def ds_k(sm, u_ds, u_k, acc):
        sq = cuda.local.array((M, UC), float32)
        kq = cuda.local.array(N, float32)
        for c4 in range(Bc // UC):
            uc = uint64(c4) * uint64(UC)
            for a in range(M):
                for u in range(UC):
                    sq[a, u] = sm[u_ds + uint64(a * TR * LP) + uc + uint64(u)]
            for u in range(UC):
                for b in range(N):
                    kq[b] = sm[u_k + (uc + uint64(u)) * uint64(LD) + uint64(col_of(b))]
                for a in range(M):
                    for b in range(N):
                        acc[a, b] += sq[a, u] * kq[b]

    return ds_k


# --------------------------------------------------------------------------- kernel 2: dK, dV

@functools.lru_cache(maxsize=None)
def make_dkdv_body(Br: int, Bc: int, Dh: int, NT: int, atomic_dq: bool = False, merged: bool = False,
                   tile_of=every_tile):
    """dkdv_body(sm, q, k, v, do, lse, delta, dq, dk, dv, nq, nk, scale, causal, bh, j, walk,
    first, count): dK_j and dV_j of key tile j (and with ``atomic_dq`` its pieces of dQ),
    walking the query tiles ``tile_of(walk, t)``, t = first .. first + count - 1; ``sm``: the block's shared
    memory (``dkdv_layout``), arrays (B*H, N, d), NT threads. The next tile's index is read
    before the barriers, its Q_i, dO_i, L_i, D_i travel into registers during the compute."""
    LD, LP = Dh + 4, Bc + 4
    (O_K, O_V, O_Q, O_DO, O_P, O_DS, O_L, O_D, O_SV, O_SK), _ = dkdv_layout(Br, Bc, Dh, merged)
    where, s_dp, p_ds, store, (AM, AN) = _scores(Br, Bc, Dh, NT, True, not merged)   # P (and dS) stored
    load_kv = _copies(Bc, Dh, NT)[0]
    _, fetch_q, put_q, LQ = _copies(Br, Dh, NT)
    gkv = Grid.of(Bc, Dh, NT, "dK/dV tile Bc x d")                 # dV_j, dK_j: runs of keys
    gq = Grid.of(Br, Dh, NT, "dQ tile Br x d", row_runs=False) if atomic_dq else gkv
    clear, flush, write = _sums(gkv, NT)
    add_dq = _sums(gq, NT, True)[2]
    sum_t = _transposed(gkv, Br, LP, LD, not merged)
    ds_k = _ds_k(gq, Bc, LP, LD)
    FLUSH = max(1, ACC_ROWS // Br)                                  # query tiles a partial sum holds
    KM, KN, KTC, KVR, KVC, QM, QN, QTC, QVC = gkv.M, gkv.N, gkv.TC, gkv.VR, gkv.VC, gq.M, gq.N, gq.TC, gq.VC

    @inlined
    def dkdv_body(sm, q, k, v, do, lse, delta, dq, dk, dv, nq, nk, scale, causal, bh, j, walk, first, count):
        t = int32(cuda.threadIdx.x)
        d = int32(q.shape[2])
        c0 = j * int32(Bc)
        load_kv(sm, O_K, O_V, k, v, bh, c0, nk, d, t)               # K_j, V_j: once
        acc_dv = cuda.local.array((KM, KN), float32)
        acc_dk = cuda.local.array((KM, KN), float32)
        clear(sm, O_SV, t, acc_dv)
        clear(sm, O_SK, t, acc_dk)
        s = cuda.local.array((AM, AN), float32)
        dp = cuda.local.array((AM, AN), float32)
        acc_dq = cuda.local.array((QM, QN), float32)
        ty, tx = where(t)                                           # S, dP, P, dS
        ty_b = t // int32(KTC)                                      # dV, dK
        tx_b = t - ty_b * int32(KTC)
        ty_q = t // int32(QTC)                                      # dQ
        tx_q = t - ty_q * int32(QTC)
        # This thread's first element in each shared tile it reads (unsigned offsets).
        u_q, u_do = uint64(O_Q + ty * LD), uint64(O_DO + ty * LD)               # S, dP: rows
        u_k, u_v = uint64(O_K + tx * LD), uint64(O_V + tx * LD)
        u_p, u_ds = uint64(O_P + ty_b * KVR), uint64(O_DS + ty_b * KVR)         # dV, dK: key runs
        u_dob, u_qb = uint64(O_DO + tx_b * KVC), uint64(O_Q + tx_b * KVC)       # and column runs
        u_dsq, u_kq = uint64(O_DS + ty_q * LP), uint64(O_K + tx_q * QVC)        # dQ

        pq = cuda.local.array(LQ, float32)                          # the next Q_i, dO_i, L_i, D_i
        pg = cuda.local.array(LQ, float32)
        pl, pd = DEAD, float32(0.0)
        nxt = int32(0)
        if count > 0:
            nxt = int32(tile_of(walk, first))
            fetch_q(q, do, bh, nxt * int32(Br), nq, d, t, pq, pg)
            if t < Br:
                pl, pd = row_stats(lse, delta, bh, nxt * int32(Br) + t, nq)
        since_flush = int32(0)
        for n in range(count):
            r0 = nxt * int32(Br)
            if n + 1 < count:
                nxt = int32(tile_of(walk, first + n + 1))
            cuda.syncthreads()                                      # the last step is done with Q_i, dO_i
            put_q(sm, O_Q, O_DO, t, pq, pg)
            if t < Br:
                sm[uint64(O_L + t)] = pl
                sm[uint64(O_D + t)] = pd
            cuda.syncthreads()
            if n + 1 < count:                                       # start loading the next tile
                fetch_q(q, do, bh, nxt * int32(Br), nq, d, t, pq, pg)
                if t < Br:
                    pl, pd = row_stats(lse, delta, bh, nxt * int32(Br) + t, nq)

            s_dp(sm, u_q, u_do, u_k, u_v, s, dp)                    # S = Q_i K_j^T, dP = dO_i V_j^T
            p_ds(sm, O_L, O_D, ty, tx, r0, c0, nq, nk, causal, scale, s, dp, O_P, O_DS)   # P, dS to shared
            cuda.syncthreads()
            if merged:                                              # P, then dS in the same buffer
                sum_t(sm, u_p, u_dob, acc_dv, u_p, u_dob, acc_dv)   # dV_j += P^T dO_i
                cuda.syncthreads()
                store(sm, O_DS, ty, tx, dp)
                cuda.syncthreads()
                sum_t(sm, u_ds, u_qb, acc_dk, u_ds, u_qb, acc_dk)   # dK_j += dS^T Q_i
            else:
                sum_t(sm, u_p, u_dob, acc_dv, u_ds, u_qb, acc_dk)   # both at once
            since_flush += int32(1)
            if since_flush == int32(FLUSH):                         # partial sums into the running sums
                since_flush = int32(0)
                flush(sm, O_SV, t, acc_dv)
                flush(sm, O_SK, t, acc_dk)
            if atomic_dq:                                           # dQ_i += scale dS K_j, atomically
                for a in range(QM):
                    for b in range(QN):
                        acc_dq[a, b] = float32(0.0)
                ds_k(sm, u_dsq, u_kq, acc_dq)
                add_dq(dq, sm, 0, t, acc_dq, bh, r0, nq, d, ty_q, tx_q, scale)

        write(dv, sm, O_SV, t, acc_dv, bh, c0, nk, d, ty_b, tx_b, float32(1.0))
        write(dk, sm, O_SK, t, acc_dk, bh, c0, nk, d, ty_b, tx_b, scale)

    return dkdv_body


@functools.lru_cache(maxsize=None)
def make_dkdv(Br: int, Bc: int, Dh: int, NT: int, dynamic: bool = False, atomic_dq: bool = False,
              merged: bool = False):
    """The dK/dV kernel: grid (Tc, B*H), NT threads; key tile j = blockIdx.x walks the query
    tiles that see it (causal: those not entirely above it)."""
    body = make_dkdv_body(Br, Bc, Dh, NT, atomic_dq, merged)
    SHARED = 0 if dynamic else dkdv_layout(Br, Bc, Dh, merged)[1]

    @cuda.jit(fastmath=FASTMATH)
    def dkdv(q, k, v, do, lse, delta, dq, dk, dv, nq, nk, scale, causal):
        sm = cuda.shared.array(SHARED, float32, alignment=ALIGN)
        j = int32(cuda.blockIdx.x)
        first = int32(0)
        if causal != 0 and j * int32(Bc) - (nk - nq) > 0:          # the first row that sees key tile j
            first = (j * int32(Bc) - (nk - nq)) // int32(Br)
        count = (nq + int32(Br - 1)) // int32(Br) - first
        body(sm, q, k, v, do, lse, delta, dq, dk, dv, nq, nk, scale, causal, int32(cuda.blockIdx.y), j, lse,
             first, count)

    return dkdv


# --------------------------------------------------------------------------- kernel 3: dQ

@functools.lru_cache(maxsize=None)
def make_dq_body(Br: int, Bc: int, Dh: int, NT: int, tile_of=every_tile):
    """dq_body(sm, q, k, v, do, lse, delta, dq, nq, nk, scale, causal, bh, i, walk, first,
    count): dQ_i of query tile i, walking the key tiles ``tile_of(walk, t)``, t = first ..
    first + count - 1.
    Q_i, dO_i, L_i, D_i stay in shared memory (``dq_layout``); the next K_j, V_j travel into
    registers during the compute. Each dQ entry is summed by one thread in a fixed order."""
    LD, LP = Dh + 4, Bc + 4
    (O_Q, O_DO, O_K, O_V, O_DS, O_L, O_D, O_SQ), _ = dq_layout(Br, Bc, Dh)
    where, s_dp, p_ds, _, (AM, AN) = _scores(Br, Bc, Dh, NT, False, True)      # dS stored
    load_q = _copies(Br, Dh, NT)[0]
    _, fetch_kv, put_kv, LK = _copies(Bc, Dh, NT)
    gq = Grid.of(Br, Dh, NT, "dQ tile Br x d", row_runs=False)
    clear, flush, write = _sums(gq, NT)
    ds_k = _ds_k(gq, Bc, LP, LD)
    FLUSH = max(1, ACC_ROWS // Bc)                                  # key tiles a partial sum holds
    QM, QN, QTC, QVC = gq.M, gq.N, gq.TC, gq.VC

    @inlined
    def dq_body(sm, q, k, v, do, lse, delta, dq, nq, nk, scale, causal, bh, i, walk, first, count):
        t = int32(cuda.threadIdx.x)
        d = int32(q.shape[2])
        r0 = i * int32(Br)
        load_q(sm, O_Q, O_DO, q, do, bh, r0, nq, d, t)              # Q_i, dO_i, L_i, D_i: once
        for r in range(t, Br, NT):
            lrow, drow = row_stats(lse, delta, bh, r0 + r, nq)
            sm[uint64(O_L + r)] = lrow
            sm[uint64(O_D + r)] = drow
        acc = cuda.local.array((QM, QN), float32)
        clear(sm, O_SQ, t, acc)
        ty, tx = where(t)
        ty_q = t // int32(QTC)
        tx_q = t - ty_q * int32(QTC)
        u_q, u_do = uint64(O_Q + ty * LD), uint64(O_DO + ty * LD)
        u_k, u_v = uint64(O_K + tx * LD), uint64(O_V + tx * LD)
        u_dsq, u_kq = uint64(O_DS + ty_q * LP), uint64(O_K + tx_q * QVC)
        s = cuda.local.array((AM, AN), float32)
        dp = cuda.local.array((AM, AN), float32)

        pk = cuda.local.array(LK, float32)                          # the next K_j, V_j
        pv = cuda.local.array(LK, float32)
        nxt = int32(0)
        if count > 0:
            nxt = int32(tile_of(walk, first))
            fetch_kv(k, v, bh, nxt * int32(Bc), nk, d, t, pk, pv)
        since_flush = int32(0)
        for n in range(count):
            c0 = nxt * int32(Bc)
            if n + 1 < count:
                nxt = int32(tile_of(walk, first + n + 1))
            cuda.syncthreads()                                      # the last step is done with K_j, V_j
            put_kv(sm, O_K, O_V, t, pk, pv)
            cuda.syncthreads()
            if n + 1 < count:                                       # start loading the next tile
                fetch_kv(k, v, bh, nxt * int32(Bc), nk, d, t, pk, pv)
            s_dp(sm, u_q, u_do, u_k, u_v, s, dp)                    # S = Q_i K_j^T, dP = dO_i V_j^T
            p_ds(sm, O_L, O_D, ty, tx, r0, c0, nq, nk, causal, scale, s, dp, 0, O_DS)     # P, dS; dS to shared
            cuda.syncthreads()
            ds_k(sm, u_dsq, u_kq, acc)                              # dQ_i += dS K_j
            since_flush += int32(1)
            if since_flush == int32(FLUSH):
                since_flush = int32(0)
                flush(sm, O_SQ, t, acc)

        write(dq, sm, O_SQ, t, acc, bh, r0, nq, d, ty_q, tx_q, scale)

    return dq_body


@functools.lru_cache(maxsize=None)
def make_dq(Br: int, Bc: int, Dh: int, NT: int, dynamic: bool = False):
    """The separate dQ kernel: grid (Tr, B*H), NT threads, the last query tiles first (causal:
    they see the most keys); key tiles right of the tile's last row are skipped."""
    body = make_dq_body(Br, Bc, Dh, NT)
    SHARED = 0 if dynamic else dq_layout(Br, Bc, Dh)[1]

    @cuda.jit(fastmath=FASTMATH)
    def dq_kernel(q, k, v, do, lse, delta, dq, nq, nk, scale, causal):
        sm = cuda.shared.array(SHARED, float32, alignment=ALIGN)
        i = int32(cuda.gridDim.x) - int32(1) - int32(cuda.blockIdx.x)
        last_col = nk - int32(1)
        if causal != 0:
            last_col = min(last_col, i * int32(Br) + int32(Br - 1) + (nk - nq))
        count = int32(0)
        if last_col >= 0:
            count = last_col // int32(Bc) + int32(1)
        body(sm, q, k, v, do, lse, delta, dq, nq, nk, scale, causal, int32(cuda.blockIdx.y), i, lse, int32(0),
             count)

    return dq_kernel


# --------------------------------------------------------------------------- the launcher

def flash_attention_backward(q, k, v, o, lse, do, *, causal=False, scale=None, tiles=None, dq_mode="atomic",
                             products="auto"):
    """Gradients (dq, dk, dv) of attention for the upstream gradient ``do``.

    q: (B, H, Nq, d), k and v: (B, H, Nk, d), o and do: (B, H, Nq, d), lse: (B, H, Nq)
    (natural log, -inf on rows that see nothing), all float32: the o and lse the forward
    (``kernels.flash_forward.flash_attention``) returned. ``causal`` masks bottom-right
    aligned; ``scale`` defaults to 1/sqrt(d); ``tiles``: a ``BackwardTiles``. ``dq_mode``:
    "atomic" (the default: float32 atomic adds from the dK/dV kernel; dQ's last bits vary
    from run to run) or "separate" (a second kernel recomputes S and dP: bitwise
    deterministic, slower). NumPy in, NumPy out; device arrays in, device arrays out.

    ``products``: "fma" runs this chapter's kernels (fp32 math on the FMA units); "3xtf32"
    runs chapter 11's backward (tensor cores, three TF32 products a product, about fp32's
    accuracy, faster; dQ by atomic adds); "auto", the default, takes "3xtf32" on a GPU
    with TF32 tensor cores when neither ``tiles`` nor dq_mode="separate" is given, else "fma".
    """
    B, H, nq, nk, d = check_backward_args(q, k, v, o, lse, do, dq_mode)
    causal, scale = check_flag(causal, "causal"), check_scale(scale, d)
    fma_only = "tiles" if tiles is not None else "dq_mode" if dq_mode != "atomic" else None
    if check_products(products, float32=True, fma_only=fma_only) == "3xtf32":
        from kernels.tf32_backward import flash_attention_backward_tf32

        return flash_attention_backward_tf32(q, k, v, o, lse, do, causal=causal, scale=scale)
    Dh = head_dim_bucket(d)
    tiles = check_tiles(default_tiles(d) if tiles is None else tiles, Dh, dq_mode)
    kind = ArrayKind(q)
    if B * H == 0 or nq == 0 or nk == 0:
        return zero_gradients(kind, (B, H, nq, d), (B, H, nk, d))
    grads = launch(*device_views(q, k, v, o, lse, do), nq, nk, Dh, causal, scale, tiles, dq_mode,
                   out=allocate_outputs(B * H, nq, nk, d, kind))
    return tuple(kind.give_back(x.reshape(B, H, x.shape[1], d)) for x in grads)


def launch_delta(o, do, delta, dq, nq, Dh, atomic):
    """The pre-pass D = rowsum(dO * O) (and dQ = 0 before atomic adds) on (B*H, Nq, d) views."""
    kernel, threads = make_delta(Dh, 4, atomic)
    kernel[(cdiv(nq, threads // 32), o.shape[0]), threads, launch_stream()](o, do, delta, dq, np.int32(nq))


def launch(q, k, v, o, lse, do, nq, nk, Dh, causal, scale, tiles, dq_mode, out=None):
    """The kernels on (B*H, N, d) device arrays; returns device (dq, dk, dv). ``out``:
    (delta, dq, dk, dv) from ``allocate_outputs`` (the bench times the kernels alone so)."""
    bh, d = q.shape[0], q.shape[2]
    delta, dq, dk, dv = allocate_outputs(bh, nq, nk, d) if out is None else out
    atomic = dq_mode == "atomic"
    n_q, n_k, sc, ca = np.int32(nq), np.int32(nk), np.float32(scale), np.int32(1 if causal else 0)
    launch_delta(o, do, delta, dq, nq, Dh, atomic)
    dkdv_bytes, dq_bytes = shared_bytes(tiles, Dh)
    merged = tiles.merged_at(Dh)
    launch_with_shared(lambda dyn: make_dkdv(tiles.Br, tiles.Bc, Dh, tiles.threads, dyn, atomic, merged),
                       dkdv_bytes, (cdiv(nk, tiles.Bc), bh), tiles.threads,
                       (q, k, v, do, lse, delta, dq, dk, dv, n_q, n_k, sc, ca))
    if not atomic:
        launch_with_shared(lambda dyn: make_dq(tiles.dq_Br, tiles.dq_Bc, Dh, tiles.dq_threads, dyn),
                           dq_bytes, (cdiv(nq, tiles.dq_Br), bh), tiles.dq_threads,
                           (q, k, v, do, lse, delta, dq, n_q, n_k, sc, ca))
    return dq, dk, dv


def io_model_bytes(B, H, nq, nk, d, tiles=None, dq_mode="atomic", causal=False, itemsize=4, kept=None):
    """HBM bytes the kernels move by the IO model of ``kernels.base.io_model`` (no reuse through
    L2): the dK/dV kernel streams Q, dO, L, D (and with atomic dQ, dQ) once a key tile of Bc
    rows, the separate dQ kernel streams K, V once a query tile of its Br rows. ``kept``: the
    fraction of the tiles the walks visit (default: 1/2 causal, else 1; chapter 6: the mask's)."""
    tiles = tiles or default_tiles(d)
    return io.fused_backward_bytes(B, H, nq, nk, d, Bc=tiles.Bc, Br=tiles.dq_Br, dq_mode=dq_mode, causal=causal,
                                   itemsize=itemsize, kept=kept)


def standard_backward_bytes(B, H, n, d, itemsize=4):
    """The standard backward (S, P, dP, dS through HBM): 7 N^2 + 10 N d + N elements a head."""
    return io.standard_backward_bytes(B, H, n, d, itemsize=itemsize)


# --------------------------------------------------------------------------- the ladder's first rungs
# The notebook's kernel exercises (their solutions, not printed there): the steps from the
# formulas above to the kernels 2 and 3, one gradient formula at a time.
#
#   rung 1  one thread a row: a thread per key row j sums dK_j and dV_j over the query rows
#           that see it; a thread per query row i sums dQ_i over its keys. Every thread
#           recomputes its S and P entries from Q, K and L; K, V, Q, dO from global memory
#   rung 2  the same threads in blocks that share tiles: a block of Bc key rows loads each
#           tile of Br query rows (Q_i, dO_i, L_i, D_i) into shared memory once for all its
#           threads; a block of Br query rows loads each K/V tile of Bc rows
#   rung 3  kernels 2 and 3 above: micro-tiles of S, dP, dS a thread, two-level sums, and dQ
#           by atomic adds from the dK/dV kernel
#
# Plain ``@cuda.jit`` kernels (IEEE exp, as a learner's are); rung 2's loops over a row run
# to the compile-time D over zero-padded tiles, so its rows stay in registers (rung 1's, to
# the run-time d, in local memory).
# Both rungs take D = rowsum(dO * O) from a pre-pass, one thread a row (``row_delta``: kernel 1
# with a thread, not a warp, a row; the launcher runs it first). A thread
# sums a gradient row over up to N rows in one float32 register: within the tolerance rule
# up to a couple of hundred rows (the tests draw N <= 160), not beyond: the reason rung 3
# sums in two levels (ACC_ROWS).
# A learner's factories replace these through ``kernels.base.learner``;
# tests/test_flash_backward.py grades them through ``row_per_thread_backward`` and
# ``shared_tile_backward``.

EXERCISES = {"make_row_per_thread_dkdv": "row_per_thread", "make_row_per_thread_dq": "row_per_thread",
             "make_shared_tile_dkdv": "shared_tile", "make_shared_tile_dq": "shared_tile"}
ROW_THREADS = 128                 # rung 1's threads a block


@cuda.jit
def row_delta(o, do, delta):
    """D_i = rowsum(dO_i * O_i) on (B*H, Nq, d) views, grid (ceil(Nq / threads), B*H)."""
    bh = cuda.blockIdx.y
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < o.shape[1]:
        acc = float32(0.0)
        for c in range(o.shape[2]):
            acc += do[bh, i, c] * o[bh, i, c]
        delta[bh, i] = acc


@inlined
def _first_query(j, n_q, n_k, causal):
    """The first query row that sees key j (causal, bottom-right: i >= j + Nq - Nk)."""
    return max(0, j + n_q - n_k) if causal else 0


@functools.lru_cache(maxsize=None)
def make_row_per_thread_dkdv(D: int):
    """Rung 1, keys. Kernel (q, k, v, do, lse, delta, dk, dv, scale, causal) on (B*H, N, d)
    views (lse, delta: (B*H, Nq)), d <= D; grid (ceil(Nk / threads), B*H): thread j of the
    grid's x takes key row j of head ``blockIdx.y``. For every query row i that sees key j:
    s = scale q_i . k_j, P_ij = exp(s - L_i), dV_j += P_ij dO_i, dP_ij = dO_i . v_j,
    dS_ij = P_ij (dP_ij - D_i), dK_j += scale dS_ij q_i."""

    @cuda.jit
    def row_per_thread_dkdv(q, k, v, do, lse, delta, dk, dv, scale, causal):
        bh = cuda.blockIdx.y
        j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        n_q, n_k, d = q.shape[1], k.shape[1], q.shape[2]
        if j >= n_k:
            return
        k_j = cuda.local.array(D, float32)
        v_j = cuda.local.array(D, float32)
        dk_j = cuda.local.array(D, float32)
        dv_j = cuda.local.array(D, float32)
        for c in range(d):
            k_j[c], v_j[c] = k[bh, j, c], v[bh, j, c]
            dk_j[c], dv_j[c] = float32(0.0), float32(0.0)
        for i in range(_first_query(j, n_q, n_k, causal), n_q):
            L = lse[bh, i]
            if L == MINUS_INF:                        # a row that sees nothing: P = 0
                continue
            s = float32(0.0)
            dp = float32(0.0)
            for c in range(d):
                s += q[bh, i, c] * k_j[c]             # S_ij / scale
                dp += do[bh, i, c] * v_j[c]           # dP_ij = dO_i . v_j
            p = math.exp(float32(scale) * s - L)      # P_ij, recomputed
            ds = p * (dp - delta[bh, i])              # dS_ij = P_ij (dP_ij - D_i)
            for c in range(d):
                dv_j[c] += p * do[bh, i, c]
                dk_j[c] += float32(scale) * ds * q[bh, i, c]
        for c in range(d):
            dk[bh, j, c], dv[bh, j, c] = dk_j[c], dv_j[c]

    return row_per_thread_dkdv


@functools.lru_cache(maxsize=None)
def make_row_per_thread_dq(D: int):
    """Rung 1, queries. Kernel (q, k, v, do, lse, delta, dq, scale, causal), grid
    (ceil(Nq / threads), B*H): thread i takes query row i. For every key j row i sees:
    P_ij and dS_ij as in ``make_row_per_thread_dkdv``, dQ_i += scale dS_ij k_j."""

    @cuda.jit
    def row_per_thread_dq(q, k, v, do, lse, delta, dq, scale, causal):
        bh = cuda.blockIdx.y
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        n_q, n_k, d = q.shape[1], k.shape[1], q.shape[2]
        if i >= n_q:
            return
        kv_end = min(n_k, i + 1 + n_k - n_q) if causal else n_k
        q_i = cuda.local.array(D, float32)
        do_i = cuda.local.array(D, float32)
        dq_i = cuda.local.array(D, float32)
        for c in range(d):
            q_i[c], do_i[c], dq_i[c] = q[bh, i, c], do[bh, i, c], float32(0.0)
        L, D_i = lse[bh, i], delta[bh, i]
        if L == MINUS_INF:                            # sees nothing: dQ_i = 0
            kv_end = 0
        for j in range(max(kv_end, 0)):
            s = float32(0.0)
            dp = float32(0.0)
            for c in range(d):
                s += q_i[c] * k[bh, j, c]
                dp += do_i[c] * v[bh, j, c]
            p = math.exp(float32(scale) * s - L)
            ds = p * (dp - D_i)
            for c in range(d):
                dq_i[c] += float32(scale) * ds * k[bh, j, c]
        for c in range(d):
            dq[bh, i, c] = dq_i[c]

    return row_per_thread_dq


@functools.lru_cache(maxsize=None)
def make_shared_tile_dkdv(Br: int, Bc: int, D: int):
    """Rung 2, keys. ``make_row_per_thread_dkdv``'s kernel (same arguments) with Bc threads a
    block: block x takes key rows Bc x .. Bc x + Bc - 1, thread t key row Bc x + t. The query
    side comes in tiles of Br rows: the threads copy Q_i, dO_i (zeros past Nq or d), L_i and
    D_i into shared memory, a barrier, each sweeps the rows that see its key, a barrier."""

    @cuda.jit
    def shared_tile_dkdv(q, k, v, do, lse, delta, dk, dv, scale, causal):
        Q_i = cuda.shared.array((Br, D), float32)
        dO_i = cuda.shared.array((Br, D), float32)
        L_i = cuda.shared.array(Br, float32)
        D_i = cuda.shared.array(Br, float32)
        bh = cuda.blockIdx.y
        t = cuda.threadIdx.x
        j = cuda.blockIdx.x * Bc + t
        n_q, n_k, d = q.shape[1], k.shape[1], q.shape[2]
        key = j < n_k
        k_j = cuda.local.array(D, float32)
        v_j = cuda.local.array(D, float32)
        dk_j = cuda.local.array(D, float32)
        dv_j = cuda.local.array(D, float32)
        for c in range(D):                            # to the compile-time D, zeros past d: in registers
            k_j[c] = k[bh, j, c] if key and c < d else float32(0.0)
            v_j[c] = v[bh, j, c] if key and c < d else float32(0.0)
            dk_j[c], dv_j[c] = float32(0.0), float32(0.0)
        first = _first_query(j, n_q, n_k, causal)                       # this thread's first row
        block_first = _first_query(cuda.blockIdx.x * Bc, n_q, n_k, causal)   # the block's
        for q0 in range(block_first, n_q, Br):
            for e in range(t, Br * D, Bc):            # the tile copy: thread t takes every Bc-th element
                r, c = e // D, e % D
                inside = q0 + r < n_q and c < d
                Q_i[r, c] = q[bh, q0 + r, c] if inside else float32(0.0)
                dO_i[r, c] = do[bh, q0 + r, c] if inside else float32(0.0)
            for r in range(t, Br, Bc):
                inside = q0 + r < n_q
                L_i[r] = lse[bh, q0 + r] if inside else MINUS_INF
                D_i[r] = delta[bh, q0 + r] if inside else float32(0.0)
            cuda.syncthreads()                        # the query tile is in shared memory
            if key:
                for r in range(max(first - q0, 0), min(Br, n_q - q0)):
                    if L_i[r] == MINUS_INF:
                        continue
                    s = float32(0.0)
                    dp = float32(0.0)
                    for c in range(D):
                        s += Q_i[r, c] * k_j[c]       # every thread reads the same Q_i[r, c]: a broadcast
                        dp += dO_i[r, c] * v_j[c]
                    p = math.exp(float32(scale) * s - L_i[r])
                    ds = p * (dp - D_i[r])
                    for c in range(D):
                        dv_j[c] += p * dO_i[r, c]
                        dk_j[c] += float32(scale) * ds * Q_i[r, c]
            cuda.syncthreads()                        # all have read it before the next copy
        if key:
            for c in range(D):
                if c < d:
                    dk[bh, j, c], dv[bh, j, c] = dk_j[c], dv_j[c]

    return shared_tile_dkdv


@functools.lru_cache(maxsize=None)
def make_shared_tile_dq(Br: int, Bc: int, D: int):
    """Rung 2, queries. ``make_row_per_thread_dq``'s kernel (same arguments) with Br threads a
    block: thread t takes query row Br x + t; K and V come in tiles of Bc rows through shared
    memory, as in chapter 4's second rung."""

    copy_kv_tile = make_kv_tile_copy(Bc, D, Br)

    @cuda.jit
    def shared_tile_dq(q, k, v, do, lse, delta, dq, scale, causal):
        K_j = cuda.shared.array((Bc, D), float32)
        V_j = cuda.shared.array((Bc, D), float32)
        bh = cuda.blockIdx.y
        t = cuda.threadIdx.x
        q0 = cuda.blockIdx.x * Br
        i = q0 + t
        n_q, n_k, d = q.shape[1], k.shape[1], q.shape[2]
        row = i < n_q
        kv_end = min(n_k, i + 1 + n_k - n_q) if causal else n_k
        block_end = min(n_k, q0 + Br + n_k - n_q) if causal else n_k
        q_i = cuda.local.array(D, float32)
        do_i = cuda.local.array(D, float32)
        dq_i = cuda.local.array(D, float32)
        for c in range(D):
            q_i[c] = q[bh, i, c] if row and c < d else float32(0.0)
            do_i[c] = do[bh, i, c] if row and c < d else float32(0.0)
            dq_i[c] = float32(0.0)
        L = lse[bh, i] if row else MINUS_INF
        D_i = delta[bh, i] if row else float32(0.0)
        if L == MINUS_INF:                            # past Nq, or sees nothing: no keys
            kv_end = 0
        for k0 in range(0, max(block_end, 0), Bc):
            copy_kv_tile(k, v, K_j, V_j, bh, k0, n_k, d, t)
            cuda.syncthreads()
            for r in range(min(Bc, kv_end - k0)):
                s = float32(0.0)
                dp = float32(0.0)
                for c in range(D):
                    s += q_i[c] * K_j[r, c]
                    dp += do_i[c] * V_j[r, c]
                p = math.exp(float32(scale) * s - L)
                ds = p * (dp - D_i)
                for c in range(D):
                    dq_i[c] += float32(scale) * ds * K_j[r, c]
            cuda.syncthreads()
        if row:
            for c in range(D):
                if c < d:
                    dq[bh, i, c] = dq_i[c]

    return shared_tile_dq


def _ladder_call(q, k, v, o, lse, do, causal, scale, out):
    """The rungs' shared launcher half: checks, device views, D = rowsum(dO * O) (``row_delta``),
    and the gradients' buffers (``out``: a tuple of device arrays (dq, dk, dv), or None)."""
    B, H, nq, nk, d = check_backward_args(q, k, v, o, lse, do, "separate")
    causal, scale = check_flag(causal, "causal"), check_scale(scale, d)
    shapes = ((B, H, nq, d), (B, H, nk, d), (B, H, nk, d))
    if out is not None:
        if not isinstance(out, tuple) or len(out) != 3:
            raise TypeError(f"out: expected a tuple of three device arrays (dq, dk, dv), got {type(out).__name__}")
        grads = tuple(check_out(x, f"out ({name})", shape) for x, name, shape in zip(out, ("dq", "dk", "dv"), shapes))
    else:
        grads = tuple(device_empty(shape) for shape in shapes)
    qv, kv, vv, ov, lv, dov = device_views(q, k, v, o, lse, do)
    BH = B * H
    dq, dk, dv = (g.reshape(BH, g.shape[2], d) for g in grads)
    delta = device_empty((BH, nq))
    if BH and nq:
        threads = 32 if on_simulator() else ROW_THREADS
        row_delta[(cdiv(nq, threads), BH), threads](ov, dov, delta)
    sc, ca = np.float32(scale), np.int32(causal)
    return ArrayKind(q), grads, (BH, nq, nk, d), (qv, kv, vv, dov, lv, delta), (dq, dk, dv), (sc, ca)


def _ladder_result(kind, out, grads):
    return out if out is not None else tuple(kind.give_back(g) for g in grads)


def row_per_thread_backward(q, k, v, o, lse, do, *, causal=False, scale=None, out=None):
    """Rung 1 (``make_row_per_thread_dkdv``, ``make_row_per_thread_dq``): (dq, dk, dv) like
    ``flash_attention_backward``, one thread a key row and one thread a query row.
    ``out``: device arrays (dq, dk, dv) to write into (returned as given)."""
    kind, grads, (BH, nq, nk, d), inputs, (dq, dk, dv), (sc, ca) = _ladder_call(q, k, v, o, lse, do, causal, scale, out)
    threads = 32 if on_simulator() else ROW_THREADS
    D = padded_head_dim(d)
    if BH and nk:
        make_row_per_thread_dkdv(D)[(cdiv(nk, threads), BH), threads](*inputs, dk, dv, sc, ca)
    if BH and nq:
        make_row_per_thread_dq(D)[(cdiv(nq, threads), BH), threads](*inputs, dq, sc, ca)
    return _ladder_result(kind, out, grads)


def shared_tile_backward(q, k, v, o, lse, do, *, causal=False, scale=None, tiles=None, out=None):
    """Rung 2 (``make_shared_tile_dkdv``, ``make_shared_tile_dq``): (dq, dk, dv), the key rows'
    blocks sharing query tiles of Br rows and the query rows' blocks sharing K/V tiles of Bc
    rows. ``tiles``: (Br, Bc) (both kernels' tiles within 48 KB of static shared memory);
    ``out`` as for ``row_per_thread_backward``."""
    kind, grads, (BH, nq, nk, d), inputs, (dq, dk, dv), (sc, ca) = _ladder_call(q, k, v, o, lse, do, causal, scale, out)
    D = padded_head_dim(d)
    Br, Bc = check_shared_tiles(tiles, D)
    if BH and nk:
        make_shared_tile_dkdv(Br, Bc, D)[(cdiv(nk, Bc), BH), Bc](*inputs, dk, dv, sc, ca)
    if BH and nq:
        make_shared_tile_dq(Br, Bc, D)[(cdiv(nq, Br), BH), Br](*inputs, dq, sc, ca)
    return _ladder_result(kind, out, grads)


def check_shared_tiles(tiles, D: int) -> tuple[int, int]:
    """Rung 2's (Br, Bc): by default min(64, 4096 / D) on a GPU (32 KB of shared tiles), (8, 4)
    in the simulator; or ``tiles`` checked."""
    if tiles is None:
        return (8, 4) if on_simulator() else (min(64, 4096 // D),) * 2
    if not (isinstance(tiles, tuple) and len(tiles) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                                  for x in tiles)):
        raise TypeError(f"tiles: expected a tuple (Br, Bc) of ints, got {tiles!r}")
    Br, Bc = tiles
    if not (1 <= Br <= 1024 and 1 <= Bc <= 1024 and (2 * D + 2) * Br * 4 <= 48 * 1024 and 2 * Bc * D * 4 <= 48 * 1024):
        raise ValueError(f"tiles: expected Br, Bc in 1..1024 with 2 Br D and 2 Bc D floats <= 48 KB (D = {D}), got {tiles}")
    return Br, Bc


# --------------------------------------------------------------------------- PTX targets

_A3, _A2 = "float32[:, :, ::1]", "float32[:, ::1]"
DELTA_SIG = f"void({_A3}, {_A3}, {_A2}, {_A3}, int32)"
DKDV_SIG = f"void({_A3}, {_A3}, {_A3}, {_A3}, {_A2}, {_A2}, {_A3}, {_A3}, {_A3}, int32, int32, float32, int32)"
DQ_SIG = f"void({_A3}, {_A3}, {_A3}, {_A3}, {_A2}, {_A2}, {_A3}, int32, int32, float32, int32)"


def ptx_targets(every_shape: bool = False):
    """(label, dispatcher, signature) of every production kernel, both dQ modes, d = 64 and
    128 (``every_shape``: d = 16..128)."""
    targets = []
    for Dh in (16, 32, 64, 128) if every_shape else (64, 128):
        t = GPU_TILES[Dh]
        big = [n > STATIC_LIMIT_BYTES for n in shared_bytes(t, Dh)]
        for atomic in (False, True):
            targets.append((f"flash bwd delta{' + clear dQ' if atomic else ''} fp32 d={Dh}",
                            make_delta(Dh, 4, atomic)[0], DELTA_SIG))
            targets.append((f"flash bwd dkdv{' + atomic dQ' if atomic else ''} fp32 Br={t.Br} Bc={t.Bc} "
                            f"t={t.threads} d={Dh}",
                            make_dkdv(t.Br, t.Bc, Dh, t.threads, big[0], atomic, t.merged_at(Dh)), DKDV_SIG))
        targets.append((f"flash bwd dq fp32 Br={t.dq_Br} Bc={t.dq_Bc} t={t.dq_threads} d={Dh}",
                        make_dq(t.dq_Br, t.dq_Bc, Dh, t.dq_threads, big[1]), DQ_SIG))
    rung_dkdv = f"void({_A3}, {_A3}, {_A3}, {_A3}, {_A2}, {_A2}, {_A3}, {_A3}, float32, int32)"
    rung_dq = f"void({_A3}, {_A3}, {_A3}, {_A3}, {_A2}, {_A2}, {_A3}, float32, int32)"
    targets.append(("rung 1-2 row_delta fp32", row_delta, f"void({_A3}, {_A3}, {_A2})"))
    for D in (64, 128):                               # the ladder's first rungs, as the bench runs them
        Br, Bc = (min(64, 4096 // D),) * 2
        targets.append((f"rung 1 dkdv fp32 D={D}", make_row_per_thread_dkdv(D), rung_dkdv))
        targets.append((f"rung 1 dq fp32 D={D}", make_row_per_thread_dq(D), rung_dq))
        targets.append((f"rung 2 dkdv fp32 ({Br}, {Bc}) D={D}", make_shared_tile_dkdv(Br, Bc, D), rung_dkdv))
        targets.append((f"rung 2 dq fp32 ({Br}, {Bc}) D={D}", make_shared_tile_dq(Br, Bc, D), rung_dq))
    return targets
