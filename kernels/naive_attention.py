"""Chapter 1: naive attention, O = softmax(scale * Q K^T + mask) V, as three kernels.

    step 1  S = scale * Q K^T      (masked entries -inf)     scores kernel
    step 2  P = softmax(S) by row  (and L = logsumexp(S))     row-softmax kernel
    step 3  O = P V                                           weighted-sum kernel

S and P are (B, H, Nq, Nk) float32 arrays in global memory (HBM). That is the point of
the chapter: per head the three kernels move 4Nd + 4N^2 elements (Q and K read, S
written; S read, P written; P and V read, O written), and the 4N^2 dwarfs the 4Nd as
soon as N passes d. At B*H = 1, N = 131072, S alone is 64 GiB.

Conventions (the oracle's, ``kernels.reference``):

* q is (B, H, Nq, d), k and v are (B, H, Nk, d), float32, C-contiguous; d <= 128.
* scale defaults to 1/sqrt(d).
* causal: query i may attend key j iff j <= i + (Nk - Nq) (bottom-right aligned).
* a row with nothing to attend to (Nk = 0, or causal with Nq > Nk) gets P = 0, O = 0 and
  L = -inf, never NaN.

The kernels, written for the H100 but kept plain (chapter 2 makes matmuls fast):

* scores: a block computes a Br x Bc tile of S for one (batch, head); Q and K tiles of
  Bk columns of d are staged in shared memory, each thread keeps a TM x TN micro-tile of
  S in registers. Threads along a warp write consecutive columns of S: coalesced stores.
  With causal, a tile entirely above the diagonal is filled with -inf without any loads.
* row softmax: one block per row of S. The row is read once, in coalesced strides, into
  registers (up to 32 entries a thread: rows up to 4096 at 128 threads); the max m and
  the sum l = sum exp(S - m) are tree reductions in shared memory; P = exp(S - m) / l is
  written once. Longer rows are swept three times (max, sum, write), the re-reads served
  mostly by L2.
* weighted sum: a block computes a Br x Bd tile of O; P and V tiles of Bk keys staged in
  shared memory, TM x TN outputs a thread. With causal, key tiles entirely past the
  diagonal are skipped (P is 0 there).

Floating point: the kernels use ``fastmath=FASTMATH`` (``kernels.base.fused``): fast exp and
log, FMA contraction, reassociation, but not the two flags that let the compiler assume no
value is NaN or infinite. -inf is a real value here (a masked score), and a NaN or Inf in
an input must reach the outputs its arithmetic reaches, as PyTorch's math does
(``kernels.reference``): a NaN in row i of Q makes row i of S, P, O and L NaN and nothing
else; a NaN in row j of K every row that may attend key j; an Inf gives scores of +-inf,
and a row with a +inf score is NaN (inf - inf), while -inf scores are simply masked keys.
The row max is taken with ``nan_max`` (Numba's ``max`` drops a NaN argument); a row whose
max is -inf is a fully masked row: P = 0, L = -inf, and exp(-inf - m) is never formed with
m = -inf.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, float64, uint64

from kernels.base import io_model
from kernels.base.fused import FASTMATH, nan_max
from kernels.base.runtime import (
    ArrayKind,
    cdiv,
    check_array,
    check_flag,
    check_out,
    check_qkv,
    check_scale,
    device_empty,
    on_simulator,
    to_device,
)

__all__ = [
    "naive_attention",
    "scores",
    "row_softmax",
    "weighted_sum",
    "Tiles",
    "PRODUCTION_TILES",
    "SIMULATOR_TILES",
    "default_tiles",
    "io_model_elements",
    "io_model_bytes",
    "make_scores",
    "make_row_softmax",
    "softmax_regs",
    "make_weighted_sum",
    "make_first_scores",
    "make_first_row_softmax",
    "first_scores",
    "first_row_softmax",
    "ptx_targets",
]

MAX_HEAD_DIM = 128
NEG_INF = float32(-math.inf)
SHARED_LIMIT_BYTES = 48 * 1024


# --------------------------------------------------------------------------- tiles

@dataclass(frozen=True)
class Tiles:
    """Tile sizes, all compile-time constants of the kernels.

    br        Br: rows of S (queries) a block of the scores kernel computes; also rows of O
    bc        Bc: columns of S (keys) a block of the scores kernel computes
    bd        columns of O (head dim) a block of the weighted-sum kernel computes
    bk        the reduction chunk staged in shared memory: d for S, keys for O
    tm, tn    the micro-tile a thread keeps in registers (tm rows, tn columns)
    softmax_threads   T: threads a row of the softmax kernel (a power of two)
    softmax_regs      the most entries of a row a thread holds in registers (a power of
                      two); rows up to softmax_threads * softmax_regs are read once
    """

    br: int = 64
    bc: int = 64
    bd: int = 64
    bk: int = 32
    tm: int = 4
    tn: int = 4
    softmax_threads: int = 128
    softmax_regs: int = 32

    @property
    def scores_threads(self) -> int:
        return (self.br // self.tm) * (self.bc // self.tn)

    @property
    def weighted_sum_threads(self) -> int:
        return (self.br // self.tm) * (self.bd // self.tn)


PRODUCTION_TILES = Tiles()
# The simulator runs every thread in Python: few threads, small tiles.
SIMULATOR_TILES = Tiles(br=32, bc=32, bd=32, bk=16, tm=4, tn=4, softmax_threads=8, softmax_regs=4)


def default_tiles() -> Tiles:
    return SIMULATOR_TILES if on_simulator() else PRODUCTION_TILES


def check_tiles(tiles) -> Tiles:
    """``tiles``: None (the default for this device) or a valid ``Tiles``."""
    if tiles is None:
        return default_tiles()
    if not isinstance(tiles, Tiles):
        raise TypeError(f"tiles: expected a Tiles or None, got {type(tiles).__name__}")
    for name in ("br", "bc", "bd", "bk", "tm", "tn", "softmax_threads", "softmax_regs"):
        value = getattr(tiles, name)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"tiles.{name}: expected a positive int, got {value!r}")
    if tiles.br % tiles.tm:
        raise ValueError(f"tiles: expected br divisible by tm, got br={tiles.br}, tm={tiles.tm}")
    if tiles.bc % tiles.tn or tiles.bd % tiles.tn:
        raise ValueError(f"tiles: expected bc and bd divisible by tn, got bc={tiles.bc}, bd={tiles.bd}, tn={tiles.tn}")
    for label, threads in (("scores", tiles.scores_threads), ("weighted sum", tiles.weighted_sum_threads)):
        if threads > 1024:
            raise ValueError(f"tiles: the {label} kernel would need {threads} threads a block (at most 1024)")
    t = tiles.softmax_threads
    if t > 1024 or t & (t - 1):
        raise ValueError(f"tiles.softmax_threads: expected a power of two in 1..1024, got {t}")
    r = tiles.softmax_regs
    if r > 64 or r & (r - 1):
        raise ValueError(f"tiles.softmax_regs: expected a power of two in 1..64, got {r}")
    shared = 4 * max((tiles.br + tiles.bc) * (tiles.bk + 1), tiles.br * (tiles.bk + 1) + tiles.bk * tiles.bd)
    if shared > SHARED_LIMIT_BYTES:
        raise ValueError(f"tiles: the tiles need {shared} bytes of shared memory (at most {SHARED_LIMIT_BYTES})")
    return tiles


# --------------------------------------------------------------------------- the IO model

def io_model_elements(nq: int, nk: int, d: int) -> dict:
    """Elements each kernel reads + writes in HBM, per head (each input read once).

    With Nq = Nk = N the total is 4Nd + 4N^2, plus Nq for the logsumexp L: the course's IO
    model of the standard forward, ``kernels.base.io_model.standard_forward_elements``
    (tests/test_naive_attention.py counts the elements these kernels touch against it).
    """
    return io_model.standard_forward_elements(nq, nk, d)


def io_model_bytes(b: int, h: int, nq: int, nk: int, d: int, *, bytes_per_element: int = 4) -> dict:
    """HBM bytes of each kernel and their ``"total"`` for (B, H) heads."""
    per = {k: v * b * h * bytes_per_element for k, v in io_model_elements(nq, nk, d).items()}
    per["total"] = sum(per.values())
    return per


# --------------------------------------------------------------------------- step 1: S = scale * Q K^T

@functools.lru_cache(maxsize=None)
def make_scores(br: int, bc: int, bk: int, tm: int, tn: int):
    """The scores kernel for Br x Bc tiles of S, Bk-wide chunks of d, TM x TN a thread.

    Launch: grid (ceil(Nk / Bc), ceil(Nq / Br), B*H), block (Br/TM) * (Bc/TN) threads;
    arguments q (BH, Nq, d), k (BH, Nk, d), s (BH, Nq, Nk), scale (float32), causal (bool).
    """
    RS = br // tm          # thread rows: thread (ty, tx) owns rows ty + RS*r, r < TM
    CS = bc // tn          # thread columns: and columns tx + CS*c, c < TN
    NT = RS * CS
    BKP = bk + 1           # padded shared rows: a warp's reads hit distinct banks

    @cuda.jit(fastmath=FASTMATH)
    def scores_kernel(q, k, s, scale, causal):
        nq = s.shape[1]
        nk = s.shape[2]
        d = q.shape[2]
        bh = uint64(cuda.blockIdx.z)
        row0 = cuda.blockIdx.y * br
        col0 = cuda.blockIdx.x * bc
        tid = cuda.threadIdx.x
        ty = tid // CS
        tx = tid % CS
        uty, utx = uint64(ty), uint64(tx)
        shift = nk - nq                      # causal: key j allowed iff j <= i + shift

        if causal and col0 > row0 + (br - 1) + shift:
            # The whole tile lies above the diagonal: S = -inf, nothing to load.
            for r in range(tm):
                i = row0 + ty + RS * r
                for c in range(tn):
                    j = col0 + tx + CS * c
                    if i < nq and j < nk:
                        s[bh, uint64(i), uint64(j)] = NEG_INF
            return

        q_tile = cuda.shared.array((br, BKP), float32)
        k_tile = cuda.shared.array((bc, BKP), float32)
        acc = cuda.local.array((tm, tn), float32)
        a = cuda.local.array(tm, float32)
        b = cuda.local.array(tn, float32)
        for r in range(tm):
            for c in range(tn):
                acc[r, c] = float32(0)

        for k0 in range(0, d, bk):
            # Stage Q[row0:row0+Br, k0:k0+Bk] and K[col0:col0+Bc, k0:k0+Bk]; consecutive
            # threads read consecutive elements of a row (coalesced); zeros outside.
            for idx in range(tid, br * bk, NT):
                ii = idx // bk
                kk = idx % bk
                i = row0 + ii
                kd = k0 + kk
                q_tile[uint64(ii), uint64(kk)] = (q[bh, uint64(i), uint64(kd)] if (i < nq and kd < d)
                                                  else float32(0))
            for idx in range(tid, bc * bk, NT):
                jj = idx // bk
                kk = idx % bk
                j = col0 + jj
                kd = k0 + kk
                k_tile[uint64(jj), uint64(kk)] = (k[bh, uint64(j), uint64(kd)] if (j < nk and kd < d)
                                                  else float32(0))
            cuda.syncthreads()
            # Numba wraps negative (signed) indices around, which costs instructions in the
            # hottest loop; unsigned (uint64) indices into the tiles skip that.
            for kk in range(bk):
                ukk = uint64(kk)
                for r in range(tm):
                    a[r] = q_tile[uty + uint64(RS * r), ukk]
                for c in range(tn):
                    b[c] = k_tile[utx + uint64(CS * c), ukk]
                for r in range(tm):
                    for c in range(tn):
                        acc[r, c] += a[r] * b[c]
            cuda.syncthreads()

        for r in range(tm):
            i = row0 + ty + RS * r
            for c in range(tn):
                j = col0 + tx + CS * c
                if i < nq and j < nk:
                    if causal and j > i + shift:
                        s[bh, uint64(i), uint64(j)] = NEG_INF
                    else:
                        s[bh, uint64(i), uint64(j)] = scale * acc[r, c]

    return scores_kernel


# --------------------------------------------------------------------------- step 2: P = softmax(S)

@functools.lru_cache(maxsize=None)
def make_row_softmax(threads: int, regs: int):
    """The row-softmax kernel: one block of T = ``threads`` threads per row of S.

    Launch: grid (Nq, B*H), block T; arguments s (BH, Nq, Nk), p (BH, Nq, Nk), lse (BH, Nq).
    Writes P = exp(S - m) / l and L = m + log(l), with m the row max and l = sum exp(S - m);
    a row of all -inf gets P = 0 and L = -inf, a row with a NaN or +inf gets NaN.

    A row of at most R*T entries (R = ``regs``) is read once into registers (thread t
    holds entries t, t + T, ..., t + (R-1)T: each load is a coalesced sweep of the row), so
    S is read once and P written once, as the IO model counts. A longer row is swept three
    times (max, sum, write), the second and third reads served mostly by L2.
    """
    T = threads
    R = regs

    @cuda.jit(fastmath=FASTMATH)
    def row_softmax_kernel(s, p, lse):
        nk = s.shape[2]
        i = cuda.blockIdx.x
        bh = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        red_m = cuda.shared.array(T, float32)
        red_l = cuda.shared.array(T, float32)
        x = cuda.local.array(R, float32)
        in_registers = nk <= R * T             # the same for the whole block

        # m = max_j S[i, j]: a per-thread max, then a tree reduction in shared memory.
        # nan_max: a NaN in the row makes m NaN (and with it P and L), never drops out.
        m = NEG_INF
        if in_registers:
            for u in range(R):
                j = tid + u * T
                x[u] = s[bh, i, j] if j < nk else NEG_INF
                m = nan_max(m, x[u])
        else:
            for j in range(tid, nk, T):
                m = nan_max(m, s[bh, i, j])
        red_m[tid] = m
        cuda.syncthreads()
        stride = T // 2
        while stride > 0:
            if tid < stride:
                red_m[tid] = nan_max(red_m[tid], red_m[tid + stride])
            cuda.syncthreads()
            stride //= 2
        m = red_m[0]

        if m == NEG_INF:
            # Nothing to attend to (every entry -inf, or Nk = 0): P = 0, L = -inf.
            for j in range(tid, nk, T):
                p[bh, i, j] = float32(0)
            if tid == 0:
                lse[bh, i] = NEG_INF
            return

        # l = sum_j exp(S[i, j] - m)   (exp(-inf - m) = 0 for masked entries; l >= 1).
        l = float32(0)
        if in_registers:
            for u in range(R):
                e = float32(0)
                if tid + u * T < nk:
                    e = math.exp(x[u] - m)
                x[u] = e
                l += e
        else:
            for j in range(tid, nk, T):
                l += math.exp(s[bh, i, j] - m)
        red_l[tid] = l
        cuda.syncthreads()
        stride = T // 2
        while stride > 0:
            if tid < stride:
                red_l[tid] += red_l[tid + stride]
            cuda.syncthreads()
            stride //= 2
        l = red_l[0]

        # P[i, j] = exp(S[i, j] - m) / l.
        inv_l = float32(1) / l
        if in_registers:
            for u in range(R):
                j = tid + u * T
                if j < nk:
                    p[bh, i, j] = x[u] * inv_l
        else:
            for j in range(tid, nk, T):
                p[bh, i, j] = math.exp(s[bh, i, j] - m) * inv_l
        if tid == 0:
            lse[bh, i] = m + math.log(l)

    return row_softmax_kernel


def softmax_regs(nk: int, tiles: "Tiles") -> int:
    """R for a row of ``nk`` entries: the smallest power of two with R*T >= Nk, at most
    ``tiles.softmax_regs`` (longer rows take the three-sweep path)."""
    need = max(1, cdiv(nk, tiles.softmax_threads))
    r = 1
    while r < need and r < tiles.softmax_regs:
        r *= 2
    return r


# --------------------------------------------------------------------------- step 3: O = P V

@functools.lru_cache(maxsize=None)
def make_weighted_sum(br: int, bd: int, bk: int, tm: int, tn: int):
    """The weighted-sum kernel for Br x Bd tiles of O, Bk keys a step, TM x TN a thread.

    Launch: grid (ceil(d / Bd), ceil(Nq / Br), B*H), block (Br/TM) * (Bd/TN) threads;
    arguments p (BH, Nq, Nk), v (BH, Nk, d), o (BH, Nq, d), causal (bool). The blocks
    of one row tile are adjacent in x, so when d > Bd they read the same P tile from L2.
    """
    RS = br // tm
    CS = bd // tn
    NT = RS * CS
    BKP = bk + 1

    @cuda.jit(fastmath=FASTMATH)
    def weighted_sum_kernel(p, v, o, causal):
        nq = p.shape[1]
        nk = p.shape[2]
        d = v.shape[2]
        bh = uint64(cuda.blockIdx.z)
        row0 = cuda.blockIdx.y * br
        col0 = cuda.blockIdx.x * bd
        tid = cuda.threadIdx.x
        ty = tid // CS
        tx = tid % CS
        uty, utx = uint64(ty), uint64(tx)
        shift = nk - nq

        # Keys this row tile can see: all of them, or with causal j <= row0 + Br - 1 + shift.
        j_end = nk
        if causal:
            j_end = min(nk, row0 + br + shift)

        p_tile = cuda.shared.array((br, BKP), float32)
        v_tile = cuda.shared.array((bk, bd), float32)
        acc = cuda.local.array((tm, tn), float32)
        a = cuda.local.array(tm, float32)
        b = cuda.local.array(tn, float32)
        for r in range(tm):
            for c in range(tn):
                acc[r, c] = float32(0)

        for j0 in range(0, j_end, bk):
            # Stage P[row0:row0+Br, j0:j0+Bk] and V[j0:j0+Bk, col0:col0+Bd] (coalesced);
            # zeros outside the arrays and, with causal, past the diagonal.
            for idx in range(tid, br * bk, NT):
                ii = idx // bk
                jj = idx % bk
                i = row0 + ii
                j = j0 + jj
                ok = i < nq and j < nk
                if causal:
                    ok = ok and j <= i + shift
                p_tile[uint64(ii), uint64(jj)] = p[bh, uint64(i), uint64(j)] if ok else float32(0)
            for idx in range(tid, bk * bd, NT):
                jj = idx // bd
                cc = idx % bd
                j = j0 + jj
                c = col0 + cc
                v_tile[uint64(jj), uint64(cc)] = (v[bh, uint64(j), uint64(c)] if (j < nk and c < d)
                                                  else float32(0))
            cuda.syncthreads()
            for jj in range(bk):                 # unsigned tile indices: see the scores kernel
                ujj = uint64(jj)
                for r in range(tm):
                    a[r] = p_tile[uty + uint64(RS * r), ujj]
                for c in range(tn):
                    b[c] = v_tile[ujj, utx + uint64(CS * c)]
                for r in range(tm):
                    for c in range(tn):
                        acc[r, c] += a[r] * b[c]
            cuda.syncthreads()

        for r in range(tm):
            i = row0 + ty + RS * r
            for c in range(tn):
                cc = col0 + tx + CS * c
                if i < nq and cc < d:
                    o[bh, uint64(i), uint64(cc)] = acc[r, c]

    return weighted_sum_kernel


# --------------------------------------------------------------------------- launch helpers

MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z


def _check_grid(name, b, h, nq, tiles):
    """Sizes the launch grids can cover: B*H heads in grid z (and y), Nq / Br tiles in y."""
    if b * h > MAX_GRID_YZ:
        raise ValueError(f"{name}: expected B*H <= {MAX_GRID_YZ} (one grid dimension), got B={b}, H={h}")
    if cdiv(nq, tiles.br) > MAX_GRID_YZ:
        raise ValueError(f"{name}: expected Nq <= {MAX_GRID_YZ * tiles.br} with Br={tiles.br}, got {nq}")


def _as_heads(x, shape):
    """A (B*H, N, X) view of a C-contiguous (B, H, N, X) device array."""
    b, h, n, w = shape
    return x.reshape(b * h, n, w)


def _launch_scores(dq, dk, ds, shape_q, nk, scale, causal, tiles):
    b, h, nq, d = shape_q
    if b * h == 0 or nq == 0 or nk == 0:
        return
    kern = make_scores(tiles.br, tiles.bc, tiles.bk, tiles.tm, tiles.tn)
    grid = (cdiv(nk, tiles.bc), cdiv(nq, tiles.br), b * h)
    kern[grid, tiles.scores_threads](_as_heads(dq, shape_q), _as_heads(dk, (b, h, nk, d)),
                                     _as_heads(ds, (b, h, nq, nk)), np.float32(scale), bool(causal))


def _launch_row_softmax(ds, dp, dl, shape_s, tiles):
    b, h, nq, nk = shape_s
    if b * h == 0 or nq == 0:
        return
    kern = make_row_softmax(tiles.softmax_threads, softmax_regs(nk, tiles))
    kern[(nq, b * h), tiles.softmax_threads](_as_heads(ds, shape_s), _as_heads(dp, shape_s),
                                             dl.reshape(b * h, nq))


def _launch_weighted_sum(dp, dv, do, shape_p, d, causal, tiles):
    b, h, nq, nk = shape_p
    if b * h == 0 or nq == 0:
        return
    kern = make_weighted_sum(tiles.br, tiles.bd, tiles.bk, tiles.tm, tiles.tn)
    grid = (cdiv(d, tiles.bd), cdiv(nq, tiles.br), b * h)
    kern[grid, tiles.weighted_sum_threads](_as_heads(dp, shape_p), _as_heads(dv, (b, h, nk, d)),
                                           _as_heads(do, (b, h, nq, d)), bool(causal))


def scores(q, k, *, causal=False, scale=None, out=None, tiles=None):
    """Step 1: S = scale * Q K^T, (B, H, Nq, Nk), -inf where causal masks.

    ``out``: a float32 device array of that shape to write into (returned as given).
    """
    b, h, nq, nk, d, _ = check_qkv(q, k, k, max_head_dim=MAX_HEAD_DIM)
    causal = check_flag(causal, "causal")
    scale = check_scale(scale, d)
    tiles = check_tiles(tiles)
    _check_grid("q", b, h, nq, tiles)
    shape_s = (b, h, nq, nk)
    ds = check_out(out, "out", shape_s)
    kind = ArrayKind(q)
    dq, dk = to_device(q, "q"), to_device(k, "k")
    if ds is None:
        ds = device_empty(shape_s)
    _launch_scores(dq, dk, ds, (b, h, nq, d), nk, scale, causal, tiles)
    return out if out is not None else kind.give_back(ds)


def row_softmax(s, *, out=None, lse_out=None, tiles=None):
    """Step 2: P = softmax(S) along the last axis, and L = logsumexp(S): returns (P, L).

    S is (B, H, Nq, Nk) float32; P has its shape, L is (B, H, Nq). A row with no finite
    entry gets P = 0 and L = -inf. ``out``/``lse_out``: device arrays to write into.
    """
    shape_s, _ = check_array(s, "s", ndim=4)
    tiles = check_tiles(tiles)
    b, h, nq, nk = shape_s
    _check_grid("s", b, h, 0, tiles)
    dp = check_out(out, "out", shape_s)
    dl = check_out(lse_out, "lse_out", (b, h, nq))
    kind = ArrayKind(s)
    ds = to_device(s, "s")
    if dp is None:
        dp = device_empty(shape_s)
    if dl is None:
        dl = device_empty((b, h, nq))
    _launch_row_softmax(ds, dp, dl, shape_s, tiles)
    return (out if out is not None else kind.give_back(dp),
            lse_out if lse_out is not None else kind.give_back(dl))


def weighted_sum(p, v, *, causal=False, out=None, tiles=None):
    """Step 3: O = P V, (B, H, Nq, d). P is (B, H, Nq, Nk), V is (B, H, Nk, d).

    ``causal=True`` takes P as 0 wherever the causal mask forbids (j > i + Nk - Nq) and
    skips the key tiles that lie entirely there. ``out``: a device array to write into.
    """
    shape_p, _ = check_array(p, "p", ndim=4)
    shape_v, _ = check_array(v, "v", ndim=4)
    if shape_p[:2] != shape_v[:2]:
        raise ValueError(f"v: expected batch and heads (B, H) = {shape_p[:2]} like p, got {shape_v[:2]}")
    if shape_v[2] != shape_p[3]:
        raise ValueError(f"v: expected Nk = {shape_p[3]} rows (the columns of p), got {shape_v[2]}")
    d = shape_v[3]
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"v: expected head dim d in 1..{MAX_HEAD_DIM}, got {d}")
    causal = check_flag(causal, "causal")
    tiles = check_tiles(tiles)
    b, h, nq, nk = shape_p
    _check_grid("p", b, h, nq, tiles)
    do = check_out(out, "out", (b, h, nq, d))
    kind = ArrayKind(p)
    dp, dv = to_device(p, "p"), to_device(v, "v")
    if do is None:
        do = device_empty((b, h, nq, d))
    _launch_weighted_sum(dp, dv, do, shape_p, d, causal, tiles)
    return out if out is not None else kind.give_back(do)


def naive_attention(q, k, v, *, causal=False, scale=None, return_lse=False, tiles=None):
    """O = softmax(scale * Q K^T + mask) V by the three kernels, S and P through HBM.

    q: (B, H, Nq, d), k and v: (B, H, Nk, d), float32, d <= 128. Returns o (B, H, Nq, d),
    or (o, lse) with ``return_lse=True`` (lse: (B, H, Nq), natural log, -inf on rows with
    nothing to attend to). NumPy in, NumPy out; device arrays in, device arrays out.
    """
    b, h, nq, nk, d, _ = check_qkv(q, k, v, max_head_dim=MAX_HEAD_DIM)
    causal = check_flag(causal, "causal")
    scale = check_scale(scale, d)
    return_lse = check_flag(return_lse, "return_lse")
    tiles = check_tiles(tiles)
    _check_grid("q", b, h, nq, tiles)
    kind = ArrayKind(q)
    dq, dk, dv = to_device(q, "q"), to_device(k, "k"), to_device(v, "v")
    shape_s = (b, h, nq, nk)
    ds, dp = device_empty(shape_s), device_empty(shape_s)     # the N x N matrices in HBM
    dl, do = device_empty((b, h, nq)), device_empty((b, h, nq, d))
    _launch_scores(dq, dk, ds, (b, h, nq, d), nk, scale, causal, tiles)
    _launch_row_softmax(ds, dp, dl, shape_s, tiles)
    _launch_weighted_sum(dp, dv, do, shape_s, d, causal, tiles)
    o = kind.give_back(do)
    return (o, kind.give_back(dl)) if return_lse else o


# --------------------------------------------------------------------------- the first versions
# What a first attempt writes, and the notebook's two kernel exercises (their solutions,
# not printed there): one thread an element of S, one thread a row of the softmax. A
# learner's factory of the same name replaces them (``kernels.base.learner``) and
# tests/test_naive_attention.py grades it. Correct, and slow: each thread of the scores
# kernel reads its rows of Q and K from HBM (2d loads an element of S, against 2d/Bc and
# 2d/Br for the tiled kernel), and a row's softmax runs on one thread.

EXERCISES = {"make_first_scores": "first_scores", "make_first_row_softmax": "first_row_softmax"}
FIRST_THREADS = (16, 16)          # the first scores kernel's blocks: 16 x 16 elements of S


@functools.lru_cache(maxsize=None)
def make_first_scores():
    """Kernel (q, k, s, scale, causal) on (B*H, N, X) views: thread (x, y) of the grid, z =
    batch*head, writes S[z, y, x] = scale * q[z, y] . k[z, x], or -inf where causal masks
    (key x is after query y's position y + Nk - Nq)."""

    @cuda.jit(fastmath=FASTMATH)
    def first_scores_kernel(q, k, s, scale, causal):
        j, i = cuda.grid(2)
        z = cuda.blockIdx.z
        nq, nk = s.shape[1], s.shape[2]
        if i < nq and j < nk:
            if causal and j > i + nk - nq:
                s[z, i, j] = NEG_INF
            else:
                acc = float32(0.0)
                for c in range(q.shape[2]):
                    acc += q[z, i, c] * k[z, j, c]
                s[z, i, j] = scale * acc

    return first_scores_kernel


@functools.lru_cache(maxsize=None)
def make_first_row_softmax():
    """Kernel (s, p, lse) on (B*H, Nq, Nk) views of S and P and the (B*H, Nq) view of L:
    thread r of the grid takes row r (r = z * Nq + i) in three sweeps: the max m (NaN
    kept), l = sum exp(s - m), p = exp(s - m) / l and L = m + log l; a row whose max is
    -inf (nothing to attend to) gets P = 0 and L = -inf. The sum l runs in float64."""

    @cuda.jit(fastmath=FASTMATH)
    def first_row_softmax_kernel(s, p, lse):
        r = cuda.grid(1)
        nq, nk = s.shape[1], s.shape[2]
        if r >= s.shape[0] * nq:
            return
        z, i = r // nq, r % nq
        m = NEG_INF
        for j in range(nk):
            m = nan_max(m, s[z, i, j])
        if m == NEG_INF:
            for j in range(nk):
                p[z, i, j] = float32(0.0)
            lse[z, i] = NEG_INF
            return
        # One running sum over the whole row: in float64, since a float32 one errs ~Nk times
        # the rounding unit, far more than the pairwise sums the tolerance is set by.
        total = float64(0.0)
        for j in range(nk):
            total += float64(math.exp(s[z, i, j] - m))
        inv = float32(1.0 / total)
        for j in range(nk):
            p[z, i, j] = math.exp(s[z, i, j] - m) * inv
        lse[z, i] = float32(float64(m) + math.log(total))

    return first_row_softmax_kernel


def first_scores(q, k, *, causal=False, scale=None, out=None):
    """Step 1 by ``make_first_scores``'s kernel (one thread an element): S, (B, H, Nq, Nk).
    ``out``: a float32 device array of that shape to write into (returned as given)."""
    b, h, nq, nk, d, _ = check_qkv(q, k, k, max_head_dim=MAX_HEAD_DIM)
    causal = check_flag(causal, "causal")
    scale = check_scale(scale, d)
    if b * h > MAX_GRID_YZ:
        raise ValueError(f"q: expected at most {MAX_GRID_YZ} (batch, head) pairs, got {b * h}")
    kind = ArrayKind(q)
    ds = check_out(out, "out", (b, h, nq, nk))
    ds = device_empty((b, h, nq, nk)) if ds is None else ds
    if b * h and nq and nk:
        tx, ty = FIRST_THREADS
        make_first_scores()[(cdiv(nk, tx), cdiv(nq, ty), b * h), (tx, ty)](
            _as_heads(to_device(q, "q"), (b, h, nq, d)), _as_heads(to_device(k, "k"), (b, h, nk, d)),
            _as_heads(ds, (b, h, nq, nk)), np.float32(scale), causal)
    return out if out is not None else kind.give_back(ds)


def first_row_softmax(s, *, out=None, lse_out=None):
    """Step 2 by ``make_first_row_softmax``'s kernel (one thread a row): (P, L).
    ``out``/``lse_out``: device arrays to write into (returned as given)."""
    shape_s, _ = check_array(s, "s", ndim=4)
    b, h, nq, nk = shape_s
    kind = ArrayKind(s)
    dp, dl = check_out(out, "out", shape_s), check_out(lse_out, "lse_out", (b, h, nq))
    dp = device_empty(shape_s) if dp is None else dp
    dl = device_empty((b, h, nq)) if dl is None else dl
    rows = b * h * nq
    if rows:
        threads = 32 if on_simulator() else 128
        make_first_row_softmax()[cdiv(rows, threads), threads](_as_heads(to_device(s, "s"), shape_s),
                                                               _as_heads(dp, shape_s), dl.reshape(b * h, nq))
    return (out if out is not None else kind.give_back(dp),
            lse_out if lse_out is not None else kind.give_back(dl))


# --------------------------------------------------------------------------- the exercises' checkers
# The notebook's exercise cells and tests/test_exercise_checker.py run these through
# ``kernels.base.testing.check_exercise``. Each draw is built to expose the mistakes a
# first attempt makes: a mask wrong only when Nq > Nk, a softmax that does not subtract
# the max, a float64 result where float32 was asked.

def mask_cases(max_n: int = 12):
    """Hypothesis strategy: a pair (a, b) of sizes 0..max_n; ``check_mask`` checks the
    masks of both (Nq, Nk) = (a, b) and (b, a), so every draw with a != b has Nq > Nk."""
    from hypothesis import strategies as st

    return st.tuples(st.integers(0, max_n), st.integers(0, max_n))


def check_mask(allowed, case):
    """The property: ``allowed(i, j, nq, nk)`` over the whole (Nq, Nk) grid is the oracle's
    causal mask, for (Nq, Nk) = (a, b) and (b, a)."""
    from kernels import reference as ref

    a, b = case
    for nq, nk in ((a, b), (b, a)):
        got = np.array([[bool(allowed(i, j, nq, nk)) for j in range(nk)] for i in range(nq)],
                       dtype=bool).reshape(nq, nk)
        want = ref.causal_mask(nq, nk)
        assert np.array_equal(got, want), f"Nq={nq}, Nk={nk}: got\n{got.astype(int)}\nexpected\n{want.astype(int)}"


def softmax_row_cases(max_n: int = 40):
    """Hypothesis strategy: float32 rows of length 0..max_n, spread 1, 30 or 1e4 around a
    level of 0 or +-1000 (softmax does not see the level, exp does: without the max
    subtracted, exp(1000) overflows and exp(-1000) underflows to 0), none, some or all
    entries -inf."""
    from hypothesis import strategies as st

    @st.composite
    def rows(draw):
        n = draw(st.integers(0, max_n))
        spread = draw(st.sampled_from([1.0, 30.0, 1e4]))
        level = draw(st.sampled_from([0.0, 1e3, -1e3]))
        masked = draw(st.sampled_from([0.0, 0.3, 1.0]))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        x = level + rng.standard_normal(n) * spread
        x[rng.random(n) < masked] = -np.inf
        return x.astype(np.float32)
    return rows()


def check_softmax_row(fn, x):
    """The property: ``fn(x)`` is a float32 array of x's shape within the tolerance rule of
    the float64 oracle's softmax (zeros for a row with no finite entry, no NaN)."""
    from kernels import reference as ref
    from kernels.base.testing import assert_close

    with np.errstate(all="ignore"):
        got = np.asarray(fn(x.copy()))
    assert got.shape == x.shape, f"shape {got.shape}, expected {x.shape}"
    assert got.dtype == np.float32, f"dtype {got.dtype}, expected float32 (float32 in, float32 out)"
    assert_close(got, ref.softmax(x), ref.softmax(x, dtype=np.float32), name="softmax row")


# --------------------------------------------------------------------------- PTX targets

_A3 = "float32[:, :, ::1]"
_A2 = "float32[:, ::1]"


def ptx_targets(every_shape: bool = False):
    """Every kernel at its production tiles, for CI's compile-to-PTX check (``every_shape``:
    also the bench's other tiles)."""
    t = PRODUCTION_TILES
    regs = sorted({1, 8, t.softmax_regs})
    alt = Tiles(br=128, bc=128, bd=64, bk=32, tm=8, tn=8)   # measured by the bench as "other tiles"
    other = [
        (f"naive scores fp32 Br={alt.br} Bc={alt.bc} Bk={alt.bk} {alt.tm}x{alt.tn}",
         make_scores(alt.br, alt.bc, alt.bk, alt.tm, alt.tn), f"void({_A3}, {_A3}, {_A3}, float32, boolean)"),
        (f"naive weighted sum fp32 Br={alt.br} Bd={alt.bd} Bk={alt.bk} {alt.tm}x{alt.tn}",
         make_weighted_sum(alt.br, alt.bd, alt.bk, alt.tm, alt.tn), f"void({_A3}, {_A3}, {_A3}, boolean)"),
    ]
    return (other if every_shape else []) + [
        (f"naive scores fp32 Br={t.br} Bc={t.bc} Bk={t.bk} {t.tm}x{t.tn}",
         make_scores(t.br, t.bc, t.bk, t.tm, t.tn), f"void({_A3}, {_A3}, {_A3}, float32, boolean)"),
    ] + [
        ("naive first scores fp32 (one thread an element)", make_first_scores(),
         f"void({_A3}, {_A3}, {_A3}, float32, boolean)"),
        ("naive first row softmax fp32 (one thread a row)", make_first_row_softmax(), f"void({_A3}, {_A3}, {_A2})"),
    ] + [
        (f"naive row softmax fp32 threads={t.softmax_threads} regs={r}",
         make_row_softmax(t.softmax_threads, r), f"void({_A3}, {_A3}, {_A2})") for r in regs
    ] + [
        (f"naive weighted sum fp32 Br={t.br} Bd={t.bd} Bk={t.bk} {t.tm}x{t.tn}",
         make_weighted_sum(t.br, t.bd, t.bk, t.tm, t.tn), f"void({_A3}, {_A3}, {_A3}, boolean)"),
    ]
