"""Chapter 2: tiled matmul, C = A @ B, float32, row-major, as a ladder of three kernels.

Every rung computes the same thing; what changes is where the operands live while the
FMAs happen, and so how many bytes each FLOP costs.

rung 1  one thread per output element, both operands read from global memory (HBM/L2):
        2 loads (8 bytes) per FMA (2 FLOPs): 0.25 FLOP per byte loaded.
rung 2  a block of T x T threads stages a T x T tile of A and of B in shared memory;
        each element fetched from global memory is used T times: T/4 FLOP per global
        byte; every FMA still reads 2 operands from shared memory.
rung 3  a block computes a BM x BN tile of C; each of its threads keeps a TM x TN
        micro-tile of C in registers. Per k-step a thread reads TM + TN values from shared
        memory and does TM * TN FMAs from registers: 128x128 tiles with 8x8 per thread
        use each global element 128 times and each shared value 8 times.

Ragged sizes (M, N, K not multiples of the tiles, any of them 0 or 1): loads outside the
matrix fill 0 (a zero adds nothing to the dot product), stores outside are skipped.

Rung 3 is written for the H100 (see the module's ``ptx_targets`` and its timings in
workbook/results/tiled_matmul.csv):

* A is stored transposed in shared memory (As[k, m]) so that the TM values a thread needs
  at one k-step are contiguous, like the TN values of B (Bs[k, n]).
* A thread's TM rows are VEC-wide runs ``ty * VEC + v`` repeated every ``BM / (TM / VEC)``
  rows (the same for columns): a warp's 16 threads along n read 16 consecutive float4s,
  so the shared loads are conflict-free and can be issued as 128-bit loads.
* As rows are padded by 4 floats, so the transposed stores of the A tile do not collide.
* Two shared buffers: while the block computes on one k-tile, each thread has already
  loaded its part of the next k-tile into registers; one barrier per k-tile.
* Offsets into the flat arrays are unsigned (uint64): Numba adds a negative-index
  wraparound to every signed index, which costs instructions in the inner loop and hides
  the contiguity of a thread's shared loads from the compiler.
* Interior block tiles load without masks; only the blocks on a ragged edge pay for them.
* Two k-steps per loop trip: fewer loop instructions per FMA.
* Accumulators and fragments are ``cuda.local.array`` of constant size indexed only by
  unrolled constant loop indices, so they live in registers (no .local in the PTX).

What the compiler makes of it (sm_90, ``ptxas -v`` and the SASS of the production tilings):
per k-step 4 ``LDS.128`` feed 64 ``FFMA`` (8 x 8 a thread), no local memory, no spills.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, uint16, uint32, uint64
from numba import types as numba_types

from kernels.base.inlined import inlined
from kernels.base.runtime import (ArrayKind, cdiv, check_array, check_flag, check_out, device_empty, on_simulator,
                                 to_device)

__all__ = ["EXERCISES", "matmul", "matmul_tensor_cores", "make_mma_tiles", "MMA_TILES_GPU", "MMA_TILES_SIM", "make_naive", "make_shared_tiles", "make_register_tiles", "RUNG3_CONFIGS",
           "RUNG3_DEFAULT", "default_tiles", "global_bytes", "load_tile", "tiled_matmul_numpy",
           "TileCase", "tile_cases", "check_tile_load", "ptx_targets"]

SIG = "void(float32[:, ::1], float32[:, ::1], float32[:, ::1])"
SIG3 = "void(float32[::1], float32[::1], float32[::1], int32, int32, int32)"

# 16-byte aligned shared tiles let the compiler use 128-bit shared loads; the simulator
# does not support the alignment argument (and has no use for it).
ALIGN = None if on_simulator() else 16


# --------------------------------------------------------------------------- rung 1

@functools.lru_cache(maxsize=None)
def make_naive(BX: int = 16, BY: int = 16):
    """Rung 1: thread (row, col) computes C[row, col] = sum_k A[row, k] * B[k, col].

    Kernel (a, b, c) on 2-D float32 arrays A (M, K), B (K, N), C (M, N), launched by
    ``matmul`` on a grid of (cdiv(N, BX), cdiv(M, BY)) blocks of (BX, BY) threads: x runs
    along the columns of C, y along its rows. Threads along x take consecutive columns,
    so a warp's loads of B are coalesced and its loads of A are one broadcast address.
    """

    @cuda.jit
    def naive_kernel(a, b, c):
        M = int32(c.shape[0])
        N = int32(c.shape[1])
        K = int32(a.shape[1])
        col = int32(cuda.blockIdx.x) * int32(BX) + int32(cuda.threadIdx.x)
        row = int32(cuda.blockIdx.y) * int32(BY) + int32(cuda.threadIdx.y)
        if row < M and col < N:
            acc = float32(0.0)
            for k in range(K):
                acc += a[row, k] * b[k, col]
            c[row, col] = acc

    return naive_kernel


# --------------------------------------------------------------------------- rung 2

@functools.lru_cache(maxsize=None)
def make_shared_tiles(T: int = 16):
    """Rung 2: a T x T block loads a T x T tile of A and of B into shared memory per k-tile.

    Kernel (a, b, c), as rung 1's, launched on a grid of (cdiv(N, T), cdiv(M, T)) blocks of
    (T, T) threads. Thread (ty, tx) loads A[row, k0 + tx] and B[k0 + ty, col] (0 outside
    the matrix), the block waits, then each thread runs T FMAs out of shared memory, and
    the block waits again before the next k-tile overwrites the tiles.
    """

    @cuda.jit
    def shared_kernel(a, b, c):
        As = cuda.shared.array((T, T), float32)
        Bs = cuda.shared.array((T, T), float32)
        M = int32(c.shape[0])
        N = int32(c.shape[1])
        K = int32(a.shape[1])
        tx = int32(cuda.threadIdx.x)
        ty = int32(cuda.threadIdx.y)
        col = int32(cuda.blockIdx.x) * int32(T) + tx
        row = int32(cuda.blockIdx.y) * int32(T) + ty
        acc = float32(0.0)
        for k0 in range(int32(0), K, int32(T)):
            ka = k0 + tx
            kb = k0 + ty
            As[ty, tx] = a[row, ka] if (row < M and ka < K) else float32(0.0)
            Bs[ty, tx] = b[kb, col] if (kb < K and col < N) else float32(0.0)
            cuda.syncthreads()
            for kk in range(T):
                acc += As[ty, kk] * Bs[kk, tx]
            cuda.syncthreads()
        if row < M and col < N:
            c[row, col] = acc

    return shared_kernel


# --------------------------------------------------------------------------- rung 3

@functools.lru_cache(maxsize=None)
def make_register_tiles(BM: int = 128, BN: int = 128, BK: int = 8, TM: int = 8, TN: int = 8):
    """Rung 3: a block of (BM/TM)*(BN/TN) threads computes a BM x BN tile of C; each thread
    holds a TM x TN micro-tile of C in registers.

    Per k-step a thread loads TM values of A (a column of the A tile, contiguous because As
    is stored transposed) and TN values of B into registers, then does TM*TN FMAs.
    """
    if BM % TM or BN % TN:
        raise ValueError(f"tiles: TM={TM} must divide BM={BM} and TN={TN} must divide BN={BN}")
    THREADS_N = BN // TN                  # threads along n (columns of C)
    THREADS_M = BM // TM                  # threads along m
    NT = THREADS_M * THREADS_N            # threads a block
    if (BM * BK) % NT or (BK * BN) % NT:
        raise ValueError(f"tiles: the {NT} threads must evenly share the A tile {BM}x{BK} and B tile {BK}x{BN}")
    LA = BM * BK // NT                    # elements of the A tile each thread loads
    LB = BK * BN // NT                    # elements of the B tile each thread loads
    VM = min(4, TM)                       # contiguous run of a thread's rows
    VN = min(4, TN)
    if TM % VM or TN % VN:
        raise ValueError(f"tiles: TM={TM} and TN={TN} must be multiples of 4 (or at most 4)")
    STEP_M = THREADS_M * VM               # distance between a thread's row runs
    STEP_N = THREADS_N * VN
    PAD = 4                               # As row padding (floats): conflict-free transposed stores
    BMP = BM + PAD

    A_BUF = BK * BMP                      # floats in one As buffer
    B_BUF = BK * BN
    A_SMEM = 2 * A_BUF                    # shapes must be compile-time constants
    B_SMEM = 2 * B_BUF

    @inlined
    def k_step(As, Bs, ao, bo, fa, fb, acc):
        """One k-step: TM + TN shared loads into registers, then TM * TN FMAs from registers.
        ``ao``, ``bo``: where this thread's A column and B row start in As, Bs."""
        for i in range(TM):
            fa[i] = As[ao + uint64((i // VM) * STEP_M + i % VM)]
        for j in range(TN):
            fb[j] = Bs[bo + uint64((j // VN) * STEP_N + j % VN)]
        for i in range(TM):
            for j in range(TN):
                acc[i, j] += fa[i] * fb[j]

    @cuda.jit
    def register_tile_kernel(a, b, c, M, N, K):
        # a, b, c are the matrices flattened (row-major): A[m, k] = a[m * K + k]. Flat
        # unsigned (uint64) offsets, because Numba adds a negative-index wraparound to every
        # signed index, which costs instructions and hides from the compiler that a thread's
        # shared loads are contiguous (it then cannot issue them as 128-bit loads).
        #
        # Two buffers each: As[buf * A_BUF + k * BMP + m] = A[m0 + m, k0 + k] (transposed),
        # Bs[buf * B_BUF + k * BN + n] = B[k0 + k, n0 + n].
        As = cuda.shared.array(A_SMEM, float32, alignment=ALIGN)
        Bs = cuda.shared.array(B_SMEM, float32, alignment=ALIGN)
        acc = cuda.local.array((TM, TN), float32)   # the thread's TM x TN micro-tile of C
        fa = cuda.local.array(TM, float32)          # A[its rows, k] for one k-step
        fb = cuda.local.array(TN, float32)          # B[k, its columns] for one k-step
        ra = cuda.local.array(LA, float32)          # next k-tile of A, on its way to shared memory
        rb = cuda.local.array(LB, float32)

        tid = int32(cuda.threadIdx.x)
        tx = tid % int32(THREADS_N)
        ty = tid // int32(THREADS_N)
        m0 = int32(cuda.blockIdx.y) * int32(BM)
        n0 = int32(cuda.blockIdx.x) * int32(BN)
        ua = uint64(ty * int32(VM))                 # first of this thread's rows in the tile
        ub = uint64(tx * int32(VN))                 # first of its columns
        uK = uint64(K)
        uN = uint64(N)
        rows_inside = m0 + int32(BM) <= M           # the whole block tile lies inside A / B
        cols_inside = n0 + int32(BN) <= N

        for i in range(TM):
            for j in range(TN):
                acc[i, j] = float32(0.0)

        # Where this thread's elements of the A and B tiles sit in a and b at k0 = 0
        # (unsigned: no wraparound code; 32 bits, one register each: the launcher checks
        # that every matrix has < 2**31 elements); per k-tile a load then costs one add.
        a_off = cuda.local.array(LA, uint32)
        b_off = cuda.local.array(LB, uint32)
        for r in range(LA):
            e = tid + int32(r * NT)                 # element e of the BM x BK tile, row-major
            a_off[r] = uint32(uint64(m0 + e // int32(BK)) * uK + uint64(e % int32(BK)))
        for r in range(LB):
            e = tid + int32(r * NT)                 # element e of the BK x BN tile, row-major
            b_off[r] = uint32(uint64(e // int32(BN)) * uN + uint64(n0 + e % int32(BN)))

        tiles = (K + int32(BK - 1)) // int32(BK)
        for t in range(-1, tiles):
            # Fetch k-tile t + 1 into registers (0 outside the matrix); the loads are in
            # flight while the block computes on k-tile t below.
            k_next = (int32(t) + int32(1)) * int32(BK)
            more = k_next < K or t < 0
            if more:
                k_inside = k_next + int32(BK) <= K
                if rows_inside and k_inside:        # interior tile: no masks
                    for r in range(LA):
                        ra[r] = a[uint64(a_off[r]) + uint64(k_next)]
                else:
                    for r in range(LA):
                        e = tid + int32(r * NT)
                        gm = m0 + e // int32(BK)
                        gk = k_next + e % int32(BK)
                        ra[r] = a[uint64(gm * K + gk)] if (gm < M and gk < K) else float32(0.0)
                if cols_inside and k_inside:
                    k_rows = uint64(k_next) * uN
                    for r in range(LB):
                        rb[r] = b[uint64(b_off[r]) + k_rows]
                else:
                    for r in range(LB):
                        e = tid + int32(r * NT)
                        gk = k_next + e // int32(BN)
                        gn = n0 + e % int32(BN)
                        rb[r] = b[uint64(gk * N + gn)] if (gk < K and gn < N) else float32(0.0)
            if t >= 0:
                cur = uint64(t & 1)
                a_k = cur * uint64(A_BUF) + ua
                b_k = cur * uint64(B_BUF) + ub
                # The BK k-steps of this tile, two per trip (fewer loop instructions, and the
                # second step's shared loads can overlap the first step's FMAs).
                kk = uint64(0)
                while kk + uint64(1) < uint64(BK):
                    k_step(As, Bs, a_k + kk * uint64(BMP), b_k + kk * uint64(BN), fa, fb, acc)
                    k_step(As, Bs, a_k + (kk + uint64(1)) * uint64(BMP), b_k + (kk + uint64(1)) * uint64(BN),
                           fa, fb, acc)
                    kk += uint64(2)
                if BK % 2 == 1:
                    k_step(As, Bs, a_k + uint64((BK - 1) * BMP), b_k + uint64((BK - 1) * BN), fa, fb, acc)
            if more:
                # Buffer (t + 1) & 1 was last read in step t - 1, before the last barrier.
                nxt = uint64((t + 1) & 1)
                for r in range(LA):
                    e = tid + int32(r * NT)
                    As[nxt * uint64(A_BUF) + uint64((e % int32(BK)) * int32(BMP) + e // int32(BK))] = ra[r]
                for r in range(LB):
                    e = tid + int32(r * NT)
                    Bs[nxt * uint64(B_BUF) + uint64(e)] = rb[r]
            cuda.syncthreads()

        for i in range(TM):
            gm = m0 + int32((i // VM) * STEP_M) + ty * int32(VM) + int32(i % VM)
            if gm < M:
                for j in range(TN):
                    gn = n0 + int32((j // VN) * STEP_N) + tx * int32(VN) + int32(j % VN)
                    if gn < N:
                        c[uint64(gm) * uN + uint64(gn)] = acc[i, j]

    register_tile_kernel.threads = NT
    return register_tile_kernel


# Candidate rung-3 tilings for the H100, (BM, BN, BK, TM, TN): the bench sweeps them all.
RUNG3_CONFIGS = {
    "128x128x8 8x8": (128, 128, 8, 8, 8),
    "128x128x16 8x8": (128, 128, 16, 8, 8),
    "128x64x16 8x4": (128, 64, 16, 8, 4),
}
RUNG3_DEFAULT = "128x128x16 8x8"

# Small tiles for the simulator (every thread is a Python thread there).
_SIM_TILES = {1: dict(block=(8, 8)), 2: dict(tile=8), 3: dict(register_tiles=(16, 16, 4, 4, 4))}
_GPU_TILES = {1: dict(block=(16, 16)), 2: dict(tile=32), 3: dict(register_tiles=RUNG3_CONFIGS[RUNG3_DEFAULT])}


def default_tiles(rung: int) -> dict:
    """The tile keywords ``matmul`` uses for ``rung`` when none are given."""
    return dict((_SIM_TILES if on_simulator() else _GPU_TILES)[rung])


# --------------------------------------------------------------------------- launcher

def _check_tiles(rung, block, tile, register_tiles):
    if rung == 1:
        if (not isinstance(block, tuple) or len(block) != 2
                or not all(isinstance(x, (int, np.integer)) and x >= 1 for x in block)
                or block[0] * block[1] > 1024):
            raise ValueError(f"block: expected (BX, BY) positive ints with BX*BY <= 1024, got {block!r}")
    elif rung == 2:
        if not isinstance(tile, (int, np.integer)) or isinstance(tile, bool) or not 1 <= tile <= 32:
            raise ValueError(f"tile: expected an int T in 1..32 (T*T threads a block), got {tile!r}")
    else:
        if (not isinstance(register_tiles, tuple) or len(register_tiles) != 5
                or not all(isinstance(x, (int, np.integer)) and x >= 1 for x in register_tiles)):
            raise ValueError(f"register_tiles: expected (BM, BN, BK, TM, TN) positive ints, got {register_tiles!r}")
        BM, BN, BK, TM, TN = register_tiles
        nt = (BM // TM) * (BN // TN)
        if 2 * 4 * BK * (BM + 4 + BN) > 48 * 1024:
            raise ValueError(f"register_tiles: expected at most 48 KB of shared memory "
                             f"(2 * 4 * BK * (BM + 4 + BN) bytes), got {register_tiles}")
        if (BM % TM or BN % TN or nt > 1024 or (BM * BK) % nt or (BK * BN) % nt
                or (TM > 4 and TM % 4) or (TN > 4 and TN % 4)):
            raise ValueError(
                "register_tiles: expected TM | BM, TN | BN, (BM/TM)*(BN/TN) <= 1024 threads that evenly "
                f"share the BM*BK and BK*BN tile loads, TM and TN at most 4 or multiples of 4; got {register_tiles}")


def _check_operands(a, b, out, dtype):
    """(M, N, K) of C = A @ B, after checking A (M, K) and B (K, N) of ``dtype``, int32
    indexing, and ``out`` (None, or a float32 (M, N) device array); errors name the argument."""
    (M, K), _ = check_array(a, "a", ndim=2, dtypes=(dtype,))
    (K2, N), _ = check_array(b, "b", ndim=2, dtypes=(dtype,))
    if K2 != K:
        raise ValueError(f"b: expected {K} rows (the inner dimension, a.shape[1]), got shape {(K2, N)}")
    for name, size in (("a", M * K), ("b", K * N), ("c", M * N)):
        if size >= 2**31:
            raise ValueError(f"{name}: expected fewer than 2**31 elements (int32 indexing), got {size}")
    check_out(out, "out", (M, N))
    return M, N, K


# The notebook's kernel exercises: a learner's factory of the same name and signature
# replaces the course's (``kernels.base.learner``); ``matmul`` looks each factory up by name
# at every call, so the tests of that rung (``pytest -k``) then run the learner's kernel.
EXERCISES = {"make_naive": "rung1", "make_shared_tiles": "rung2"}


def matmul(a, b, *, rung: int = 3, out=None, block=None, tile=None, register_tiles=None):
    """C = A @ B for float32 row-major 2-D A (M, K) and B (K, N), on the GPU.

    ``rung`` picks the ladder step (1: global memory, 2: shared-memory tiles, 3: register
    micro-tiles). Tile sizes (``block`` for rung 1, ``tile`` for rung 2, ``register_tiles``
    = (BM, BN, BK, TM, TN) for rung 3) default to production sizes on a GPU and small ones
    in the simulator. NumPy in, NumPy out; device arrays in, device array out (``out``, a
    C-contiguous float32 (M, N) device array, may be given to avoid an allocation).
    """
    if isinstance(rung, bool) or rung not in (1, 2, 3):
        raise ValueError(f"rung: expected 1, 2 or 3, got {rung!r}")
    M, N, K = _check_operands(a, b, out, np.float32)
    defaults = default_tiles(rung)
    block = defaults.get("block") if block is None else tuple(block)
    tile = defaults.get("tile") if tile is None else tile
    register_tiles = defaults.get("register_tiles") if register_tiles is None else tuple(register_tiles)
    _check_tiles(rung, block, tile, register_tiles)

    kind = ArrayKind(a)
    da = to_device(a, "a")
    db = to_device(b, "b")
    dc = device_empty((M, N)) if out is None else to_device(out, "out")
    if M == 0 or N == 0:
        return kind.give_back(dc) if out is None else out
    if rung == 1:
        BX, BY = block
        make_naive(int(BX), int(BY))[(cdiv(N, BX), cdiv(M, BY)), (BX, BY)](da, db, dc)
    elif rung == 2:
        T = int(tile)
        make_shared_tiles(T)[(cdiv(N, T), cdiv(M, T)), (T, T)](da, db, dc)
    else:
        BM, BN, BK, TM, TN = (int(x) for x in register_tiles)
        kern = make_register_tiles(BM, BN, BK, TM, TN)
        kern[(cdiv(N, BN), cdiv(M, BM)), kern.threads](
            da.reshape(M * K), db.reshape(K * N), dc.reshape(M * N), M, N, K)
    return kind.give_back(dc) if out is None else out


# --------------------------------------------------------------------------- rung 4: tensor cores

# (BM, BN, BK, WM, WN, STAGES): a block's C tile, its K step, each warp's C tile, and how many
# K steps are in shared memory at once (cp.async fills STAGES - 1 ahead of the one in use).
MMA_TILES_GPU = (128, 128, 64, 64, 32, 4)     # 8 warps of 64 x 32: 4 x 4 mma tiles a warp; 140 KB shared
MMA_TILES_SIM = (32, 32, 16, 16, 16, 2)       # 4 warps (every thread is a Python thread)
GROUP_M = 8                                   # block order: GROUP_M block rows sweep N together (L2 reuse)


def mma_shared_bytes(BM: int, BN: int, BK: int, STAGES: int) -> int:
    """Shared memory of ``make_mma_tiles``: STAGES stages of A (BM x BK) and B (BK x BN),
    16-bit elements, rows padded by 8 elements."""
    return 2 * STAGES * (BM * (BK + 8) + BK * (BN + 8))


@functools.lru_cache(maxsize=None)
def make_mma_tiles(BM: int, BN: int, BK: int, WM: int, WN: int, STAGES: int = 2, *, bf16: bool = False,
                   dynamic: bool = False, group_m: int = GROUP_M):
    """Rung 4: C (M, N) float32 = A (M, K) @ B (K, N), A and B fp16 (or bf16), on tensor cores.

    Kernel (a, b, c, aligned): a, b the inputs' 16-bit patterns (uint16), c float32, on a
    1-D grid of cdiv(M, BM) cdiv(N, BN) blocks of ``threads`` threads. Block p computes the C
    tile the ``group_m`` order gives it: blocks run in order of p, and GROUP_M consecutive
    block rows share each B column tile while it is in L2 (p goes down a group's rows first).

    Rung 3's structure with mma.sync (``kernels.base.mma``) in place of each thread's FMAs.
    The block keeps STAGES K steps (BM x BK of A, BK x BN of B) in shared memory: cp.async
    fills the stage STAGES - 1 steps ahead while the warps compute on the current one, and
    one barrier a step both publishes the arrived stage and frees the one just used. Each
    warp owns a WM x WN tile of C as (WM/16) x (WN/8) accumulator fragments; per 16 of K it
    loads its A fragments with ldmatrix and its B fragments with ldmatrix.trans (B is
    row-major: k runs down), then runs (WM/16)(WN/8) mma into the step's partial sums, which
    are then added to C's in float32 (two-level sums: the tensor core's own float32
    additions are not rounded to nearest, and over K = 4096 in one chain of mma their error
    measured 13 times NumPy's float32 matmul on the H100; a step's first mma starts from 0,
    so the partial sums cost one add an element a step). Shared rows are padded by 8
    elements (16 bytes), so that the 8 row addresses of an ldmatrix fall in different banks.
    Each thread copies the same columns of every stage (its 16-byte chunks are a fixed
    column, rows THREADS / (BK / 8) apart). Block tiles inside the matrices copy without
    checks; on a ragged edge, chunks that reach past the matrix are copied element by element
    with zeros beyond it (as are all chunks when ``aligned`` is 0: rows not 16-byte aligned).

    ``dynamic``: the stages in dynamic shared memory (``cuda.shared.array(0, ...)``, above
    48 KB; ``kernels.base.shared_memory.launch_with_shared`` raises the kernel's limit)."""
    from kernels.base.mma import (cp_async, cp_async_commit, cp_async_wait_all, cp_async_wait_prior,
                                  cp_async_wait_prior2, ldmatrix, ldmatrix_trans, mma_bf16, mma_f16)

    from kernels.base.shared_memory import shared_view

    mma = mma_bf16 if bf16 else mma_f16
    wait_stage = {2: cp_async_wait_all, 3: cp_async_wait_prior, 4: cp_async_wait_prior2}[STAGES]
    WARPS_N = BN // WN
    THREADS = 32 * (BM // WM) * WARPS_N
    MT, NT, KS = WM // 16, WN // 8, BK // 16
    SA, SB = BK + 8, BN + 8                               # padded shared row lengths
    A_ROW_CHUNKS, B_ROW_CHUNKS = BK // 8, BN // 8         # 16-byte chunks (8 elements) a row
    A_STEP, B_STEP = THREADS // A_ROW_CHUNKS, THREADS // B_ROW_CHUNKS   # rows between a thread's chunks
    A_COPIES, B_COPIES = cdiv(BM, A_STEP), cdiv(BK, B_STEP)            # a thread's chunks a stage
    A_SIZE, B_SIZE = STAGES * BM * SA, STAGES * BK * SB

    @inlined
    def copy_ragged(dst, src, r0, c0, rows, cols, first_row, col, step, tile_rows, aligned):
        """The ragged edge's copy of a tile's chunks src[r0 + r, c0 + col:c0 + col + 8] ->
        dst[r, col:col + 8] for r = first_row, first_row + step, ... < tile_rows: cp.async
        where the 8 lie inside src (rows 16-byte aligned), else element by element, 0 outside."""
        for r in range(first_row, tile_rows, step):   # (a loop at run time: few registers)
            row = r0 + r
            if aligned != 0 and row < rows and c0 + col + 8 <= cols:
                cp_async(dst, r, col, src, row, c0 + col)
            else:
                for e in range(8):
                    x = uint16(0)
                    if row < rows and c0 + col + e < cols:
                        x = src[row, c0 + col + e]
                    dst[r, col + e] = x

    @inlined
    def stage_in(a, b, As, Bs, m0, n0, k0, M, N, K, ar, ac, br, bc, aligned):
        """Step k0's A (BM x BK) and B (BK x BN) tiles into one stage; this thread's chunks
        start at row ar, column ac of A's tile and row br, column bc of B's, and repeat
        A_STEP (B_STEP) rows down."""
        if aligned != 0 and m0 + BM <= M and k0 + BK <= K:
            for i in range(A_COPIES):              # inside the matrix: no checks
                r = ar + i * A_STEP
                if BM % A_STEP == 0 or r < BM:
                    cp_async(As, r, ac, a, m0 + r, k0 + ac)
        else:
            copy_ragged(As, a, m0, k0, M, K, ar, ac, A_STEP, BM, aligned)
        if aligned != 0 and k0 + BK <= K and n0 + BN <= N:
            for i in range(B_COPIES):
                r = br + i * B_STEP
                if BK % B_STEP == 0 or r < BK:
                    cp_async(Bs, r, bc, b, k0 + r, n0 + bc)
        else:
            copy_ragged(Bs, b, k0, n0, K, N, br, bc, B_STEP, BK, aligned)

    @inlined
    def k_step(As, Bs, ks, wm, wn, lr, lc, part):
        """16 of K: the warp's A fragments by ldmatrix, its B fragments by ldmatrix.trans,
        then MT x NT mma into ``part`` (from 0 at the step's first k-step)."""
        af = cuda.local.array((MT, 4), uint32)
        bf = cuda.local.array((NT, 2), uint32)
        for i in range(MT):
            x = ldmatrix(As, wm + i * 16 + lr, ks * 16 + lc)
            for e in range(4):
                af[i, e] = x[e]
        for j in range(NT // 2):
            x = ldmatrix_trans(Bs, ks * 16 + lr, wn + j * 16 + lc)
            bf[2 * j, 0] = x[0]
            bf[2 * j, 1] = x[1]
            bf[2 * j + 1, 0] = x[2]
            bf[2 * j + 1, 1] = x[3]
        for i in range(MT):
            for j in range(NT):
                if ks == 0:
                    d = mma((af[i, 0], af[i, 1], af[i, 2], af[i, 3]), (bf[j, 0], bf[j, 1]),
                            (float32(0.0), float32(0.0), float32(0.0), float32(0.0)))
                else:
                    d = mma((af[i, 0], af[i, 1], af[i, 2], af[i, 3]), (bf[j, 0], bf[j, 1]),
                            (part[i, j, 0], part[i, j, 1], part[i, j, 2], part[i, j, 3]))
                for e in range(4):
                    part[i, j, e] = d[e]

    @cuda.jit(fastmath=True)
    def mma_tile_kernel(a, b, c, aligned):
        M, K = a.shape
        N = b.shape[1]
        M, N, K = int32(M), int32(N), int32(K)
        # This block's C tile: block rows in groups of group_m, a group's blocks down its rows first.
        tiles_m = (M + int32(BM - 1)) // int32(BM)
        tiles_n = (N + int32(BN - 1)) // int32(BN)
        p = int32(cuda.blockIdx.x)
        first = p // int32(group_m * tiles_n) * int32(group_m)
        rows_here = min(tiles_m - first, int32(group_m))
        q = p % int32(group_m * tiles_n)
        m0 = (first + q % rows_here) * int32(BM)
        n0 = q // rows_here * int32(BN)

        tid = int32(cuda.threadIdx.x)
        warp = tid // 32
        lane = tid % 32
        wm = (warp // WARPS_N) * WM                # this warp's C tile, inside the block's
        wn = (warp % WARPS_N) * WN
        if dynamic:
            smem = cuda.shared.array(0, uint16, alignment=16)
            As = shared_view(smem, 0, (STAGES, BM, SA))
            Bs = shared_view(smem, A_SIZE, (STAGES, BK, SB))
        else:
            As = cuda.shared.array((STAGES, BM, SA), uint16, alignment=16)
            Bs = cuda.shared.array((STAGES, BK, SB), uint16, alignment=16)
        acc = cuda.local.array((MT, NT, 4), float32)
        for i in range(MT):
            for j in range(NT):
                for e in range(4):
                    acc[i, j, e] = float32(0.0)
        part = cuda.local.array((MT, NT, 4), float32)   # this step's sums (BK of K)
        # ldmatrix: lane 8 q + r gives row r of 8 x 8 matrix q (q: rows +0/+8, columns +0/+8)
        lr = (lane // 8) % 2 * 8 + lane % 8
        lc = (lane // 16) * 8
        ar, ac = tid // A_ROW_CHUNKS, tid % A_ROW_CHUNKS * 8      # this thread's chunks of a stage
        br, bc = tid // B_ROW_CHUNKS, tid % B_ROW_CHUNKS * 8

        n_k = (K + int32(BK - 1)) // int32(BK)
        for s in range(STAGES - 1):                # the first STAGES - 1 steps on their way
            if s < n_k:
                stage_in(a, b, As[s], Bs[s], m0, n0, int32(s * BK), M, N, K, ar, ac, br, bc, aligned)
            cp_async_commit()                      # (a group a step, empty or not: the count stays right)
        for kt in range(n_k):
            wait_stage()                           # step kt's copies are done (STAGES - 2 still flying) ...
            cuda.syncthreads()                     # ... every thread's; and step kt - 1's stage is free
            ahead = kt + int32(STAGES - 1)
            if ahead < n_k:
                st = ahead % int32(STAGES)
                stage_in(a, b, As[st], Bs[st], m0, n0, ahead * int32(BK), M, N, K, ar, ac, br, bc, aligned)
            cp_async_commit()
            st = kt % int32(STAGES)
            # The step's KS k-steps, written out (BK <= 64): constant k-steps keep every fragment
            # in registers and let the compiler load a k-step's fragments while earlier mma run.
            k_step(As[st], Bs[st], 0, wm, wn, lr, lc, part)
            if KS > 1:
                k_step(As[st], Bs[st], 1, wm, wn, lr, lc, part)
            if KS > 2:
                k_step(As[st], Bs[st], 2, wm, wn, lr, lc, part)
            if KS > 3:
                k_step(As[st], Bs[st], 3, wm, wn, lr, lc, part)
            for i in range(MT):                    # the step's partial sums into C's, rounded to
                for j in range(NT):                # nearest: the tensor core's own float32 sums
                    for e in range(4):             # truncate, and over all of K that error adds up
                        acc[i, j, e] += part[i, j, e]
        cp_async_wait_all()
        # C from the accumulator fragments: element e of tile (i, j) is row group + 8 (e // 2),
        # column 2 t + e % 2 of the tile
        group = lane // 4
        t = lane % 4
        for i in range(MT):
            for j in range(NT):
                for e in range(4):
                    row = m0 + wm + i * 16 + group + 8 * (e // 2)
                    col = n0 + wn + j * 8 + 2 * t + e % 2
                    if row < M and col < N:
                        c[row, col] = acc[i, j, e]

    mma_tile_kernel.threads = THREADS
    mma_tile_kernel.shared_bytes = mma_shared_bytes(BM, BN, BK, STAGES)
    return mma_tile_kernel


MMA_SIG = (numba_types.uint16[:, ::1], numba_types.uint16[:, ::1], numba_types.float32[:, ::1], numba_types.int32)


def _check_mma_tiles(tiles):
    if (not isinstance(tiles, tuple) or len(tiles) not in (5, 6)
            or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 1 for x in tiles)):
        raise ValueError(f"tiles: expected (BM, BN, BK, WM, WN[, STAGES]) positive ints, got {tiles!r}")
    BM, BN, BK, WM, WN, STAGES = tiles if len(tiles) == 6 else tiles + (2,)
    threads = 32 * (BM // WM) * (BN // WN)
    if (BM % WM or BN % WN or WM % 16 or WN % 16 or BK % 16 or BK > 64 or not 32 <= threads <= 1024
            or threads % (BK // 8) or threads % (BN // 8) or STAGES not in (2, 3, 4)):
        raise ValueError("tiles: expected WM | BM, WN | BN, WM, WN and BK multiples of 16, BK <= 64, 1 to 32 warps, "
                         f"BK / 8 and BN / 8 dividing the threads, 2 to 4 stages; got {tiles!r}")
    limit = 227 * 1024
    if mma_shared_bytes(BM, BN, BK, STAGES) > limit:
        raise ValueError(f"tiles: {tiles!r} needs {mma_shared_bytes(BM, BN, BK, STAGES)} bytes of shared memory "
                         f"(2 STAGES (BM (BK + 8) + BK (BN + 8))), more than the {limit} a block may have")
    return int(BM), int(BN), int(BK), int(WM), int(WN), int(STAGES)


def _bits16(x, name):
    """A device view of ``x`` as uint16 bits (float16 or uint16 arrays; uint16 holds bf16)."""
    dev = to_device(x, name)
    return dev.view(np.uint16) if dev.dtype == np.float16 else dev


def launch_mma_tiles(da, db, dc, tiles, *, bf16=False, aligned=None, group_m=GROUP_M):
    """Launch ``make_mma_tiles`` on device arrays: da (M, K), db (K, N) uint16 bits, dc
    (M, N) float32; ``tiles`` as ``matmul_tensor_cores`` takes them (checked). ``aligned``:
    None to find out (every row 16-byte aligned: cp.async may copy it)."""
    from kernels.base.shared_memory import launch_with_shared
    from kernels.base.wide_loads import is_aligned

    BM, BN, BK, WM, WN, STAGES = _check_mma_tiles(tuple(tiles))
    (M, K), N = da.shape, db.shape[1]
    if aligned is None:
        aligned = is_aligned(da, K, 2) and is_aligned(db, N, 2)
    nbytes = mma_shared_bytes(BM, BN, BK, STAGES)
    launch_with_shared(lambda dynamic: make_mma_tiles(BM, BN, BK, WM, WN, STAGES, bf16=bool(bf16),
                                                      dynamic=dynamic, group_m=group_m),
                       nbytes, cdiv(M, BM) * cdiv(N, BN), 32 * (BM // WM) * (BN // WN),
                       (da, db, dc, np.int32(bool(aligned))))


def matmul_tensor_cores(a, b, *, out=None, tiles=None, bf16=False):
    """C = A @ B on tensor cores: A (M, K) and B (K, N) row-major, float16 arrays, or uint16
    arrays of bf16 bit patterns with ``bf16=True`` (NumPy has no bf16; a PyTorch bf16 tensor
    is passed as its bits, ``t.view(torch.uint16)``); C float32.

    Rung 4 of the ladder (``make_mma_tiles``): fp16 (bf16) products, exact in float32, summed
    in float32 by the tensor cores. ``tiles`` = (BM, BN, BK, WM, WN[, STAGES]) (2 stages if
    left out), by default ``MMA_TILES_GPU`` on a GPU and ``MMA_TILES_SIM`` in the simulator.
    NumPy in, NumPy out; device arrays in, device array out (``out``: a float32 (M, N)
    device array)."""
    bf16 = check_flag(bf16, "bf16")
    M, N, K = _check_operands(a, b, out, np.uint16 if bf16 else np.float16)
    tiles = (MMA_TILES_SIM if on_simulator() else MMA_TILES_GPU) if tiles is None else tuple(tiles)
    _check_mma_tiles(tiles)
    kind = ArrayKind(a)
    da, db = _bits16(a, "a"), _bits16(b, "b")
    dc = device_empty((M, N)) if out is None else to_device(out, "out")
    if M == 0 or N == 0:
        return kind.give_back(dc) if out is None else out
    if K == 0:
        dc[:, :] = 0
        return kind.give_back(dc) if out is None else out
    launch_mma_tiles(da, db, dc, tiles, bf16=bf16)
    return kind.give_back(dc) if out is None else out


# --------------------------------------------------------------------------- counting

def global_bytes(m: int, n: int, k: int, *, rung: int, tile: int = 32, bm: int = 128, bn: int = 128) -> int:
    """Bytes the kernel's threads request from global memory by its tiling (float32, no
    cache reuse counted): what each rung is about.

    rung 1: every FMA loads one element of A and one of B: 4 (2 M N K + M N).
    rung 2: each T x T block loads its A rows and B columns once per k-tile, so A is read
            ceil(N/T) times and B ceil(M/T) times: 4 (M K ceil(N/T) + K N ceil(M/T) + M N).
    rung 3: the same with BM x BN block tiles.
    The compulsory traffic (each matrix once) is 4 (M K + K N + M N).
    """
    if rung == 1:
        return 4 * (2 * m * n * k + m * n)
    if rung == 2:
        return 4 * (m * k * cdiv(n, tile) + k * n * cdiv(m, tile) + m * n)
    if rung == 3:
        return 4 * (m * k * cdiv(n, bn) + k * n * cdiv(m, bm) + m * n)
    return 4 * (m * k + k * n + m * n)


# --------------------------------------------------------------------------- the idea in NumPy

def load_tile(x, r0: int, c0: int, rows: int, cols: int):
    """The (rows, cols) tile of ``x`` whose top-left corner is (r0, c0), with 0 wherever the
    tile hangs over the edge of ``x``: the masked load every rung does."""
    tile = np.zeros((rows, cols), dtype=np.float32)
    r1, c1 = min(r0 + rows, x.shape[0]), min(c0 + cols, x.shape[1])
    if r1 > r0 and c1 > c0:
        tile[: r1 - r0, : c1 - c0] = x[r0:r1, c0:c1]
    return tile


def tiled_matmul_numpy(a, b, bm: int, bn: int, bk: int, load=load_tile):
    """C = A @ B tile by tile, as the kernels do it: for each BM x BN tile of C, walk K in
    steps of BK, load an A tile and a B tile (with ``load``: 0 outside), accumulate their
    product in float32, and store only the part of the C tile that lies inside C."""
    m, k = a.shape
    n = b.shape[1]
    c = np.empty((m, n), dtype=np.float32)
    for m0 in range(0, m, bm):
        for n0 in range(0, n, bn):
            acc = np.zeros((bm, bn), dtype=np.float32)
            for k0 in range(0, k, bk):
                a_tile = np.asarray(load(a, m0, k0, bm, bk), dtype=np.float32)
                b_tile = np.asarray(load(b, k0, n0, bk, bn), dtype=np.float32)
                assert a_tile.shape == (bm, bk) and b_tile.shape == (bk, bn), (
                    f"load returned tiles of shape {a_tile.shape} and {b_tile.shape}, "
                    f"expected {(bm, bk)} and {(bk, bn)}")
                acc += a_tile @ b_tile
            c[m0:m0 + bm, n0:n0 + bn] = acc[: min(bm, m - m0), : min(bn, n - n0)]
    return c


@dataclass
class TileCase:
    a: np.ndarray
    b: np.ndarray
    bm: int
    bn: int
    bk: int

    def __repr__(self):
        return f"TileCase(a={self.a.shape}, b={self.b.shape}, BM={self.bm}, BN={self.bn}, BK={self.bk})"


def tile_cases(max_dim: int = 24):
    """Hypothesis strategy for ``TileCase``: ragged M, N, K (0 and 1 included) and tiles."""
    from hypothesis import strategies as st

    @st.composite
    def cases(draw):
        m, n, k = (draw(st.integers(0, max_dim)) for _ in range(3))
        bm, bn, bk = (draw(st.sampled_from([1, 2, 3, 4, 8])) for _ in range(3))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        return TileCase(a, b, bm, bn, bk)

    return cases()


def check_tile_load(load, case):
    """The property: the tiled product built with ``load`` matches the float64 oracle, and
    ``load`` gives 0 outside the matrix and the matrix inside."""
    from kernels import reference as ref
    from kernels.base.testing import assert_close

    a, b = case.a, case.b
    edge = load(a, max(a.shape[0] - 1, 0), max(a.shape[1] - 1, 0), case.bm, case.bk)
    expected = load_tile(a, max(a.shape[0] - 1, 0), max(a.shape[1] - 1, 0), case.bm, case.bk)
    assert np.array_equal(np.asarray(edge), expected), (
        f"tile at the bottom-right corner of a: got\n{np.asarray(edge)}\nexpected\n{expected}")
    got = tiled_matmul_numpy(a, b, case.bm, case.bn, case.bk, load)
    assert_close(got, ref.matmul(a, b), ref.matmul(a, b, dtype=np.float32), name="C")


# --------------------------------------------------------------------------- PTX targets

def ptx_targets(every_shape: bool = False):
    """(label, dispatcher, signature) for every kernel at its production tiles (rung 4 fp16;
    ``every_shape``: bf16 too, whose code differs in the mma instruction's name only)."""
    targets = [
        ("matmul rung 1 fp32 16x16", make_naive(16, 16), SIG),
        ("matmul rung 2 fp32 T=32", make_shared_tiles(32), SIG),
    ]
    for name, cfg in RUNG3_CONFIGS.items():
        targets.append((f"matmul rung 3 fp32 {name}", make_register_tiles(*cfg), SIG3))
    BM, BN, BK, WM, WN, STAGES = MMA_TILES_GPU
    dynamic = mma_shared_bytes(BM, BN, BK, STAGES) > 48 * 1024
    for bf16 in (False, True) if every_shape else (False,):
        targets.append((f"matmul rung 4 {'bf16' if bf16 else 'fp16'} tensor cores {MMA_TILES_GPU}",
                        make_mma_tiles(*MMA_TILES_GPU, bf16=bf16, dynamic=dynamic), MMA_SIG))
    return targets
