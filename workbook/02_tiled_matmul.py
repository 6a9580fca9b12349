# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 2. Tiled matmul
#
# Attention is two matrix products around a softmax: `S = Q Kᵀ` and `O = P V`. Before we
# fuse anything (chapter 4), we need a matmul kernel that runs near the speed of the FMA
# units, and to understand *why* it does. This chapter climbs a ladder of three kernels for
#
# $$C = A B, \qquad A \in \mathbb{R}^{M \times K},\ B \in \mathbb{R}^{K \times N},\ C_{ij} = \sum_k A_{ik} B_{kj}$$
#
# (float32, row-major), each one moving the operands one level closer to the arithmetic:
#
# | rung | where the operands are when the FMA happens | global bytes per FLOP |
# |---|---|---|
# | 1 | global memory (HBM, through the caches) | 4 |
# | 2 | shared memory (a T x T tile staged by the block) | 4 / T |
# | 3 | registers (a TM x TN micro-tile of C per thread) | you count it (exercise 4) |
#
# By the end you will have written rungs 1 and 2 yourself (exercises 2 and 3, graded by
# the chapter's own tests), and you will know how to count the bytes each rung moves per
# FLOP, how ragged sizes (M, N, K that no tile divides) are handled with masked loads and
# stores, and how the register-tiled kernel compares with cuBLAS on an H100.
#
# **Sources** (numbered as in the README's list): [16] the CUTLASS / cuBLAS tiling
# hierarchy (global, shared memory, registers); [14] the PTX ISA, "Matrix Fragments for
# mma.m16n8k16" (rung 4).

# %%
import inspect

import numpy as np

import kernels  # noqa: F401  (GPU or simulator, chosen before Numba is imported)
from kernels import reference as ref
from kernels import tiled_matmul
from kernels.base.learner import grade, my_file
from kernels.base.runtime import device_name, on_simulator
from kernels.base.testing import assert_close, check_exercise, matmul_floor
from kernels.tiled_matmul import (
    RUNG3_CONFIGS,
    RUNG3_DEFAULT,
    check_tile_load,
    default_tiles,
    global_bytes,
    load_tile,
    make_register_tiles,
    matmul,
    tile_cases,
    tiled_matmul_numpy,
)

print("running on:", device_name())

# %% tags=["parameters"]
# Tiny sizes in the simulator (every GPU thread is a Python thread there), real ones on a GPU.
if on_simulator():
    M, N, K = 21, 19, 23            # ragged: no tile divides them
    TIME_SIZE = 0                   # no timing in the simulator
else:
    M, N, K = 1000, 1023, 1025
    TIME_SIZE = 4096

# %% [markdown]
# ## 1. The NumPy version, and the count
#
# Three nested loops: for every output `C[i, j]`, a dot product of row `i` of A with column
# `j` of B. That is `M N K` multiply-adds (FMAs), `2 M N K` FLOPs.

# %%
def matmul_loops(a, b):
    m, k = a.shape
    n = b.shape[1]
    c = np.zeros((m, n), dtype=np.float32)
    for i in range(m):
        for j in range(n):
            acc = np.float32(0)
            for kk in range(k):
                acc += a[i, kk] * b[kk, j]
            c[i, j] = acc
    return c


rng = np.random.default_rng(0)
a = rng.standard_normal((M, K)).astype(np.float32)
b = rng.standard_normal((K, N)).astype(np.float32)
small = matmul_loops(a[:5, :7], b[:7, :6])
assert_close(small, ref.matmul(a[:5, :7], b[:7, :6]), ref.matmul(a[:5, :7], b[:7, :6], dtype=np.float32))
print("loops agree with the oracle; FLOPs for the full problem:", 2 * M * N * K)

# %% [markdown]
# Every FMA needs one element of A and one of B. Read naively from memory, that is 8 bytes
# for 2 FLOPs: **0.25 FLOP per byte**. The H100 does about 51 TFLOP/s of fp32 FMAs (cuBLAS,
# chapter 0's `workbook/results/gpu_basics.csv`) and moves about 3 TB/s from HBM (same file;
# `kernels.base.io_model.ridge_point()` divides the two): a kernel needs about **17 FLOP per byte** of HBM
# traffic to keep the FMA units busy. The matrices themselves are only `4 (MK + KN + MN)`
# bytes, so the data *can* be reused: at 4096³ each element of A is used 4096 times. The
# whole chapter is about arranging that reuse close to the arithmetic.
#
# ## 2. Tiles
#
# Cut C into tiles. One block of threads owns one tile of C, and walks along K, loading a
# tile of A and a tile of B at a time:
#
# ```
#                      K                                 N
#          +-----+-----+-----+--+           +------+------+------+--+
#          |     |     |     |  |           |      |  B   |      |  |   B tile: BK x BN
#          +-----+-----+-----+--+           |      | tile |      |  |   (k0 .. k0+BK)
#   M      |  A tile --> k0    |  K        +------+------+------+--+
#          +-----+-----+-----+--+           |      |  |   |      |  |
#          |     |     |     |  |           |      |  v   |      |  |
#          +-----+-----+-----+--+           +------+------+------+--+
#                                                                        ragged: the last
#                        C tile (BM x BN) = sum over k0 of A tile @ B tile   row/column of
#                                                                        tiles hangs over
# ```
#
# Each element of an A tile is used by BN outputs, each element of a B tile by BM outputs.
# The tiles at the right and bottom edges hang over the matrix when BM, BN or BK does not
# divide M, N or K: loads outside the matrix give **0** (a zero adds nothing to a dot
# product), and stores outside are **skipped**. Here is that idea in NumPy, the tile walk
# first; the masked load it calls (`load`) is yours to write.

# %%
print(inspect.getsource(tiled_matmul_numpy))

# %% [markdown]
# ### Exercise 1: the masked tile load
#
# Write `my_load_tile(x, r0, c0, rows, cols)`: the `rows x cols` tile of `x` whose top-left
# corner is `(r0, c0)`, as a float32 array of exactly that shape, with **0** wherever the
# tile hangs over the edge of `x` (including when `x` has no rows or columns at all). This
# is what every thread's `if row < M and k < K ... else 0` does, one element at a time. The
# checker builds a whole tiled matmul with your function (ragged sizes, M, N, K from 0) and
# compares it with the float64 oracle.
#
# <details><summary>Hint 1</summary>
#
# Start from `np.zeros((rows, cols), np.float32)` and copy in only the part of `x` that
# exists.
# </details>
#
# <details><summary>Hint 2</summary>
#
# That part ends at `min(r0 + rows, x.shape[0])` and `min(c0 + cols, x.shape[1])`; copy
# nothing when it is empty (the tile starts past the edge).
# </details>

# %%
def my_load_tile(x, r0, c0, rows, cols):
    # your code here: return a (rows, cols) float32 array
    raise NotImplementedError


# %%
_ = check_exercise(lambda case: check_tile_load(my_load_tile, case), tile_cases(), host=True)

# %% [markdown]
# The course's answer is `load_tile` in `kernels/tiled_matmul.py`; it passes the same
# checker, and the tiled product below uses it:

# %%
_ = check_exercise(lambda case: check_tile_load(load_tile, case), tile_cases(), host=True)
c_tiles = tiled_matmul_numpy(a, b, 8, 8, 4)
assert_close(c_tiles, ref.matmul(a, b), ref.matmul(a, b, dtype=np.float32), name="tiled NumPy")
print(f"tiled NumPy matmul with 8x8x4 tiles agrees with the oracle on a {M}x{K} @ {K}x{N} product")

# %% [markdown]
# ## 3. Rung 1: one thread per output, straight from global memory
#
# Thread `(x, y)` of a 2-D grid computes `C[y, x]`: x runs along the columns of C, y along
# its rows. Threads along x take consecutive columns, so a warp's loads of B are coalesced
# (32 consecutive floats), and its loads of A are one address (a broadcast). The grid is rounded up to whole blocks, so it overhangs C
# when a block does not divide it: threads past the edge must do nothing. That bounds check
# is the whole ragged-edge story of this rung.
#
# ```
#          N columns of C                   thread (x, y) of the grid computes C[y, x]:
#   +--------+--------+-----+...+            x = blockIdx.x * BX + threadIdx.x   (a column)
#   | block  | block  |     |   :            y = blockIdx.y * BY + threadIdx.y   (a row)
#   | (0, 0) | (1, 0) |     |   :            C[y, x] = sum over k of A[y, k] B[k, x]
#   +--------+--------+-----+...+
#   | block  | block  |     |   :  M rows   the dotted part: threads of the last blocks
#   | (0, 1) | (1, 1) |     |   :           that lie outside C (no load, no store)
#   +--------+--------+-----+...+
#   :........:........:.....:...:
# ```
#
# ### Exercise 2 (kernel): rung 1
#
# A warm-up for rung 2, close to chapter 1's first scores kernel. Write `make_naive(BX, BY)`
# in your own file (the next cell makes it from a template the first time:
# `workbook/mine/my_naive_matmul.py`). It returns a kernel `(a, b, c)` on float32 arrays A
# (M, K), B (K, N) and C (M, N), which `matmul(a, b, rung=1)` launches on a grid of
# `(ceil(N/BX), ceil(M/BY))` blocks of `(BX, BY)` threads; thread `(x, y)` of the grid writes
# `C[y, x]`. Every element of C must be written, K = 0 (C = 0) included: the tests fill C
# with NaN first, so an element no thread writes shows. `grade` runs the chapter's rung-1
# tests (`pytest -k rung1`: drawn ragged sizes and block shapes such as 4 x 16 and 16 x 2,
# and pinned ones) and names the block and thread of the first wrong element.
#
# <details><summary>Hint 1</summary>
#
# `x, y = cuda.grid(2)` is the thread's column and row of C (blockIdx times blockDim plus
# threadIdx, in x and in y); M, N and K come from `c.shape` and `a.shape`.
# </details>
#
# <details><summary>Hint 2</summary>
#
# A thread with `y >= M` or `x >= N` lies outside C: it returns without a load or a store.
# The others sum `a[y, k] * b[k, x]` over `range(K)` in a float32 started at
# `float32(0.0)`, then store once (when K = 0 the loop runs zero times and the store writes 0).
# </details>

# %%
TEMPLATE_RUNG1 = '''"""My rung-1 kernel for chapter 2 (graded by tests/test_tiled_matmul.py -k rung1)."""
CHAPTER = "tiled_matmul"

import functools

from numba import cuda, float32


@functools.lru_cache(maxsize=None)      # one kernel per block shape: compiled once on a GPU
def make_naive(BX=16, BY=16):
    @cuda.jit
    def naive_kernel(a, b, c):
        raise NotImplementedError       # your code: C[y, x] for thread (x, y) of the grid

    return naive_kernel
'''

mine_rung1 = my_file("my_naive_matmul.py", TEMPLATE_RUNG1)

# %%
rung1_passed = grade(mine_rung1)

# %% [markdown]
# The course's version, `make_naive` in `kernels/tiled_matmul.py`, prints here once yours
# passes: compare the two.

# %%
if rung1_passed:
    print(inspect.getsource(tiled_matmul.make_naive))
else:
    print("(shown once your kernel passes; stuck? read make_naive in kernels/tiled_matmul.py)")

# %% [markdown]
# Counting per thread: `K` loads of A and `K` of B for `K` FMAs: 8 bytes per 2 FLOPs. The
# caches (L1, L2) catch much of this reuse on a real GPU, but every load is still an
# instruction and a trip through the memory pipeline.
#
# ## 4. Rung 2: shared-memory tiles
#
# A block of T x T threads owns a T x T tile of C. For each k-tile, each thread loads *one*
# element of A and *one* of B into shared memory (0 outside the matrix), the block waits at
# a barrier, then each thread runs T FMAs reading shared memory, and waits again before the
# tile is overwritten. Every element fetched from global memory now serves T FMAs.
#
# ```
#  k-tile k0 (K in steps of T):        thread (tx, ty) of block (bx, by), row = by*T + ty, col = bx*T + tx
#    As[ty, tx] = A[row, k0 + tx]      one element of the A tile each (0 outside A)
#    Bs[ty, tx] = B[k0 + ty, col]      one element of the B tile each (0 outside B)
#    -- barrier --                     the tiles are complete
#    acc += As[ty, kk] * Bs[kk, tx]    kk = 0 .. T-1: a row of As times a column of Bs
#    -- barrier --                     nobody still reads the tiles the next k-tile overwrites
#  then C[row, col] = acc, if (row, col) lies inside C
# ```
#
# ### Exercise 3 (kernel): rung 2
#
# Write `make_shared_tiles(T)` in your own file (`workbook/mine/my_shared_tiles.py`, made by
# the next cell). It returns a kernel `(a, b, c)`, the same arguments as rung 1's, which
# `matmul(a, b, rung=2, tile=T)` launches on a grid of `(ceil(N/T), ceil(M/T))` blocks of
# `(T, T)` threads, and which follows the schedule above with two `T x T` float32 arrays
# in shared memory. `grade` runs the chapter's rung-2 tests (`pytest -k rung2`: T = 4 and 8,
# K shorter than a tile, one past a tile, exact tiles, K = 0, drawn ragged sizes).
#
# <details><summary>Hint 1</summary>
#
# `As = cuda.shared.array((T, T), float32)` (T is a constant of the factory, as the shape
# must be). Walk `for k0 in range(0, K, T)`: the last k-tile may be partial, and its
# elements past K load as 0.
# </details>
#
# <details><summary>Hint 2</summary>
#
# A thread outside C (row >= M or col >= N) still loads its share of the tiles (0 where
# outside A or B) and still reaches every `cuda.syncthreads()`: its neighbours need the
# elements it loads, and a barrier that only some threads of a block reach is undefined on
# a GPU. Only the final store is guarded.
# </details>
#
# <details><summary>Hint 3</summary>
#
# Two barriers per k-tile: after the loads (before anyone reads the tiles) and after the
# FMAs (before anyone overwrites them with the next k-tile). Without the second, a fast
# thread's next loads land while its neighbours still read the current tiles.
# </details>

# %%
TEMPLATE_RUNG2 = '''"""My rung-2 kernel for chapter 2 (graded by tests/test_tiled_matmul.py -k rung2)."""
CHAPTER = "tiled_matmul"

import functools

from numba import cuda, float32


@functools.lru_cache(maxsize=None)      # one kernel per tile size: compiled once on a GPU
def make_shared_tiles(T=16):
    @cuda.jit
    def shared_kernel(a, b, c):
        raise NotImplementedError       # your code: the k-tile loop through shared memory

    return shared_kernel
'''

mine_rung2 = my_file("my_shared_tiles.py", TEMPLATE_RUNG2)

# %%
rung2_passed = grade(mine_rung2)

# %% [markdown]
# The course's version, `make_shared_tiles` in `kernels/tiled_matmul.py`, prints here once
# yours passes.

# %%
if rung2_passed:
    print(inspect.getsource(tiled_matmul.make_shared_tiles))
else:
    print("(shown once your kernel passes; stuck? read make_shared_tiles in kernels/tiled_matmul.py)")

# %% [markdown]
# ### Who reads what: rung 1 against rung 2, traced
#
# `kernels.base.trace` (chapter 0) runs a launch in the simulator and records which block
# and thread touched which element. The same 8 x 8 product, tiles of 4: rung 1's threads
# each read a whole row of A and column of B from global memory; rung 2's read one element
# of each a k-tile, and the rest from shared memory. Yours is traced instead of the course's
# once it passes.

# %%
from kernels.base.trace import tracing

a_small = np.arange(64, dtype=np.float32).reshape(8, 8) / 64
b_small = np.ones((8, 8), np.float32)
traces = {}
for rung in (1, 2):
    with tracing() as launches:
        matmul(a_small, b_small, rung=rung, **({"block": (4, 4)} if rung == 1 else {"tile": 4}))
    traces[rung] = launches[0]
    counts = traces[rung].counts
    print(f"rung {rung}: A read {counts['a'].reads} times from global memory "
          f"(64 elements), shared reads {sum(c.reads for n, c in counts.items() if n not in ('a', 'b', 'c'))}")

# %%
traces[1].draw(["a", "b"], highlight=((0, 0), (1, 2)), title="rung 1: thread (1, 2) of block (0, 0) reads a row of A and a column of B")

# %%
for phase, what in ((0, "loads one element of A and of B into the tiles"),
                    (1, "reads a row of As and a column of Bs")):
    traces[2].draw(["a", "As", "Bs"], highlight=((0, 0), (1, 2)), phase=phase,
                   title=f"rung 2, first k-tile: thread (1, 2) of block (0, 0) {what}")

# %%
if rung2_passed:                       # your kernel, traced the same way
    import importlib.util

    spec = importlib.util.spec_from_file_location("my_shared_tiles", mine_rung2)
    my_rung2 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(my_rung2)
    from kernels.base.trace import trace

    yours = trace(my_rung2.make_shared_tiles(4), (2, 2), (4, 4), a_small, b_small, np.zeros((8, 8), np.float32))
    print(yours.table())
else:
    print("(your rung 2 is traced here once it passes)")

# %% [markdown]
# Counting: per k-tile the block reads `2 T²` floats from global memory for `T³` FMAs:
# `T / 4` FLOP per global byte (8 at T = 32). But each FMA still reads **two** values from
# shared memory: 0.25 FLOP per shared byte. Shared memory is fast, but the H100 serves 128
# bytes a clock per SM while the SM does 128 FMAs a clock: with 2 shared loads per FMA,
# shared memory, not arithmetic, is the limit.
#
# ## 5. Rung 3: register micro-tiles
#
# The fix is the same idea one level down. Each thread computes a small **TM x TN block of
# C** held in registers (the accumulators `acc`). At each k-step it loads TM values of A (a
# column of the A tile) and TN values of B (a row of the B tile) into registers, and does
# all TM x TN FMAs from registers: an outer product.
#
# ```
#   k-step kk:   fa = As[kk, rows of this thread]      (TM values)
#                fb = Bs[kk, columns of this thread]   (TN values)
#                acc[i, j] += fa[i] * fb[j]            (TM*TN FMAs, all in registers)
# ```
#
# With 8 x 8 per thread: 64 FMAs per 16 shared loads, 8x fewer shared loads per FMA than
# rung 2. A 128 x 128 block tile (256 threads) reads `2 * 128 * BK` floats from global memory
# per `128 * 128 * BK` FMAs: **32 FLOP per global byte**, above the H100's ridge.
#
# The details that make it fast on a real GPU (read them in the source below):
#
# * **A is stored transposed** in shared memory (`As[k, m]`), so a thread's TM values of A at
#   one k-step are contiguous, like its TN values of B.
# * A thread's rows are **runs of 4** (`ty*4 .. ty*4+3`, then the same 64 rows further): the
#   16 threads of a half-warp read 16 consecutive float4s: no bank conflicts, and the
#   compiler can issue 128-bit shared loads (`ld.shared.v4.f32`).
# * **Unsigned flat offsets** (`uint64`): Numba adds a negative-index wraparound to every
#   signed index, which costs instructions and hides the contiguity from the compiler.
# * **Two shared buffers**: while the block computes on k-tile t, each thread has already
#   issued its loads of k-tile t + 1 into registers; one barrier per k-tile.
# * **Interior tiles skip the masks**: only blocks on the ragged edge pay for the bounds checks.
# * **Registers, not local memory**: `acc`, `fa`, `fb` are `cuda.local.array`s of constant
#   size indexed only by unrolled loop indices, so the compiler keeps them in registers.
#   The PTX of every kernel is checked for `.local` (`python -m kernels.base.ptx_check`).

# %% [markdown]
# Which thread owns which piece of C, drawn from the kernel's own index arithmetic
# (`slides/img/make_02_figures.py`): a small 32 x 32 block, then the production 128 x 128.
#
# ![register micro-tiles, small block](../slides/img/02_register_tiles_small.png)
#
# ![register micro-tiles, production](../slides/img/02_register_tiles_production.png)

# %%
print(inspect.getsource(make_register_tiles))

# %% [markdown]
# ## 6. The ladder against the oracle
#
# Every rung, on the ragged sizes of the parameters cell, through the public launcher
# `matmul(a, b, rung=...)` (NumPy in, NumPy out; device arrays in, device array out). The
# tolerance rule: the error against the float64 oracle must be at most twice that of plain
# float32 NumPy, plus a few ulps.

# %%
exact = ref.matmul(a, b)
baseline = ref.matmul(a, b, dtype=np.float32)
for rung in (1, 2, 3):
    c = matmul(a, b, rung=rung)
    assert_close(c, exact, baseline, name=f"rung {rung}")
    err = np.max(np.abs(c - exact))
    print(f"rung {rung} {default_tiles(rung)}: max error {err:.2e} "
          f"(float32 NumPy: {np.max(np.abs(baseline - exact)):.2e})")

# %% [markdown]
# Edge cases are part of the contract: an empty inner dimension gives zeros, a 1 x 1 works,
# and a tile configuration can be chosen by keyword (the tests draw many).

# %%
print(matmul(np.ones((2, 0), np.float32), np.ones((0, 3), np.float32)))
print(matmul(np.full((1, 1), 3, np.float32), np.full((1, 1), 2, np.float32), rung=3))
c = matmul(a, b, rung=3, register_tiles=(8, 16, 4, 4, 4))
assert_close(c, exact, baseline)
try:
    matmul(a, np.ones((K + 1, 3), np.float32))
except ValueError as exc:
    print("ValueError:", exc)

# %% [markdown]
# ## 7. Bytes and FLOPs, counted
#
# `global_bytes` counts what each rung's threads request from global memory (no cache
# reuse counted); the compulsory traffic reads each matrix once. At 4096³:

# %%
S = 4096
flops = 2 * S**3
rows_ = [("compulsory (each matrix once)", global_bytes(S, S, S, rung=0)),
         ("rung 1: one thread an output", global_bytes(S, S, S, rung=1)),
         ("rung 2: T = 32 shared tiles", global_bytes(S, S, S, rung=2, tile=32)),
         ("rung 3: 128 x 128 block tiles", global_bytes(S, S, S, rung=3, bm=128, bn=128))]
print(f"{'':34}{'GB':>10}{'FLOP/byte':>12}")
for name, nbytes in rows_:
    print(f"{name:34}{nbytes / 1e9:>10.2f}{flops / nbytes:>12.2f}")
print("\nshared-memory loads per FMA: rung 2: 2;  rung 3 (8x8 a thread): 16/64 = 0.25")
from kernels.base.io_model import ceilings, ridge_point

c_ = ceilings()
print(f"{c_.device} fp32 ridge: {c_.fp32_tflops:.1f} TFLOP/s / {c_.hbm_tbs:.2f} TB/s = "
      f"{ridge_point(c_):.1f} FLOP per HBM byte (measured, workbook/results/gpu_basics.csv)")

# %% [markdown]
# Rung 1 asks for 550 GB to do 137 GFLOP: even if L2 served most of it, the load
# instructions alone keep it far from the FMA ceiling. Rung 2 is above the HBM ridge but
# bound by shared-memory traffic. Rung 3 is above the ridge with 8x fewer shared loads per
# FMA: it is limited by how well the inner loop keeps the FMA units fed.

# %% [markdown]
# ### A fourth rung: tensor cores
#
# Rung 3's FMAs are the H100's fp32 units, whose ceiling (cuBLAS fp32) is about 51 TFLOP/s.
# Its tensor cores multiply fp16 tiles: one warp-wide `mma.sync.m16n8k16` is a 16 x 16 by
# 16 x 8 product, fp32 sums. Numba has no API for them; `kernels/base/mma.py` emits the
# instruction as inline PTX (and emulates it in the simulator). Rung 4
# (`matmul_tensor_cores`, `make_mma_tiles`) keeps rung 3's shape: a block stages BM x BK of
# A and BK x BN of B in shared memory (several stages, three by default: `cp.async` fills the
# ones ahead while one is used), each warp owns a WM x WN tile of C as accumulator fragments, loads its operand
# fragments with `ldmatrix`, and runs the mma. One thing is new: the tensor core's own
# float32 sums truncate, and over K = 4096 in one chain their error reached 13 times NumPy's
# float32 error on the H100, so each stage's sums start from zero and are added to C's in
# float32 (two-level sums, as chapter 5's backward does). fp16 inputs (or bf16, as bit
# patterns with `bf16=True`), float32 output, against the oracle on the fp16 inputs:

# %%
from kernels.tiled_matmul import matmul_tensor_cores

a16 = np.random.default_rng(4).standard_normal((37, 40)).astype(np.float16)
b16 = np.random.default_rng(5).standard_normal((40, 21)).astype(np.float16)
c16 = matmul_tensor_cores(a16, b16)
assert_close(c16, ref.matmul(a16, b16), ref.matmul(a16, b16, dtype=np.float32), name="C (rung 4)",
             floor=matmul_floor(a16, b16))
print("rung 4 (tensor cores): C within the float32 tolerance of the oracle, dtype", c16.dtype)

# %% [markdown]
# On the H100 (section 8's table) rung 4 reaches 188 TFLOP/s at 4096³ and 221 at 8192³ in
# fp16 (bf16: 167 and 223): more than 4x the fp32 FMA ceiling, and 0.27x and 0.31x cuBLAS
# fp16 (698 and 712 TFLOP/s in the same run, which uses Hopper's warpgroup `wgmma`, deeper
# pipelines and larger tiles). A sweep of tilings (`workbook/results/TUNING.md`) found the
# K step that counts: BK = 64 halves the barriers per FLOP (149 to 206 TFLOP/s in that
# run); more stages add little. Closing the rest of the distance is beyond this chapter.
#
# ## 8. Results on the H100
#
# `python -m kernels --chapters 2` measures all three rungs, every candidate rung-3 tiling
# (at 4096³) and the launcher against cuBLAS (CuPy) and `torch.matmul`, TF32 off, in the same
# run; and rung 4 (fp16 in) against cuBLAS fp16. The ratio to cuBLAS is computed from the
# rows of the same size and dtype ("% FMA" is against the fp32 FMA ceiling: rung 4 passes it):

# %%
from pathlib import Path

from kernels.bench.harness import read_csv

results_dir = Path("results") if Path("results").is_dir() else Path("workbook/results")
csv_path, png_path = results_dir / "tiled_matmul.csv", results_dir / "tiled_matmul.png"
if csv_path.exists():
    env, rows_ = read_csv(csv_path)
    print("device:", env.get("device"), "| driver:", env.get("driver"), "| date:", env.get("date (UTC)"))
    cublas = {r["config"]: r["median_ms"] for r in rows_ if r["kernel"].startswith("peer: cuBLAS")}
    print(f"{'kernel':<40}{'config':<28}{'ms':>9}{'TFLOP/s':>9}{'% FMA':>7}{'x cuBLAS':>10}")
    for r in rows_:
        ratio = cublas.get(r["config"], float("nan")) / r["median_ms"]
        print(f"{r['kernel']:<40.40}{r['config']:<28.28}{r['median_ms']:>9.4g}{r['tflops']:>9.3g}"
              f"{r['pct_fma_ceiling']:>7.3g}{ratio:>10.3f}")
    if png_path.exists():
        from IPython.display import Image, display

        display(Image(str(png_path)))
else:
    print("GPU results are not committed yet (workbook/results/tiled_matmul.csv).")

# %% [markdown]
# The candidate tilings the bench sweeps at 4096³ (the default is the one the measurements
# pick); FLOP per global byte from section 7's count, A and B only:

# %%
for name, cfg in RUNG3_CONFIGS.items():
    bm, bn, bk, tm, tn = cfg
    ab_bytes = global_bytes(S, S, S, rung=3, bm=bm, bn=bn) - 4 * S * S
    print(f"{name:18} {(bm // tm) * (bn // tn):4d} threads, shared {2 * 4 * bk * (bm + 4 + bn) / 1024:5.1f} KB, "
          f"{flops / ab_bytes:5.1f} FLOP per global byte"
          + ("   <- default" if name == RUNG3_DEFAULT else ""))

# %% [markdown]
# ## 9. Exercises
#
# Exercise 1 (the masked tile load) is in section 2, exercises 2 and 3 (the rung-1 and
# rung-2 kernels) in sections 3 and 4. Two more, on counting:
#
# ### Exercise 4: FLOPs per byte of a block tile
#
# A block computing a `BM x BN` tile of C reads, per k-step, BM values of A and BN values of
# B (float32) from global memory and does `BM * BN` FMAs. Write `my_intensity(bm, bn)`: the
# FLOPs per global byte. The checker compares it with the byte count of section 7 on large
# square matrices.
#
# <details><summary>Hint 1</summary>
#
# An FMA is 2 FLOPs; a float32 is 4 bytes. Section 5 worked one case: a 128 x 128 tile
# gives 32.
# </details>
#
# <details><summary>Hint 2 (the answer)</summary>
#
# Per k-step, `2 * bm * bn` FLOPs over `4 * (bm + bn)` bytes (the course's count is
# `global_bytes` in `kernels/tiled_matmul.py`).
# </details>

# %%
def my_intensity(bm, bn):
    # your code here
    raise NotImplementedError


def intensity_prop(case):
    bm, bn = case
    size = 64 * bm * bn                                # divisible: no partial tiles
    expected = 2 * size**3 / (global_bytes(size, size, size, rung=3, bm=bm, bn=bn) - 4 * size * size)
    got = my_intensity(bm, bn)
    assert abs(got - expected) <= 1e-9 * expected, f"my_intensity({bm}, {bn}) = {got}, expected {expected}"


from hypothesis import strategies as st  # noqa: E402

intensity_cases = st.tuples(st.sampled_from([1, 2, 4, 16, 32, 64, 128]), st.sampled_from([1, 4, 8, 64, 128]))
_ = check_exercise(intensity_prop, intensity_cases, host=True)

# %% [markdown]
# ### Exercise 5 (on paper, then on a GPU)
#
# Rung 3 with 8 x 8 per thread does 64 FMAs per 4 128-bit shared loads. What changes with
# 8 x 4 per thread (`"128x64x16 8x4"`)? Count the shared-memory bytes per FMA for both, and
# predict which candidate the bench measures fastest. On a GPU, check with
# `python -m kernels --chapters 2 --quick`.
