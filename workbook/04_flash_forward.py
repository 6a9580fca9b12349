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
# # 4. The fused FlashAttention forward
#
# Chapter 1 computed attention in three kernels and paid for it in HBM traffic: the N x N
# scores S went out to HBM, came back for the softmax, went out again as P, and came back
# once more for `P V`. Chapter 3 showed that a softmax does not need its whole row at once:
# a running max `m` and a running sum `l`, rescaled whenever the max grows, give the same
# answer in one pass. This chapter puts the two together into **one kernel** that never
# writes S or P anywhere but on chip:
#
# 1. tile the naive computation, and find the one place where it needs a whole row;
# 2. fix that place with the rescaling trick, applied to the output as well;
# 3. decide what lives in shared memory and what in registers, and lay out the threads;
# 4. skip whole tiles for causal attention, handle any N, save the logsumexp L for the
#    backward pass (chapter 5);
# 5. count the bytes (the IO model) and the memory, and read the H100 results.
#
# The loop order is FlashAttention-2's: **the query tile is the outer loop** (one block of
# the grid per tile of Br query rows), K and V stream past it in tiles of Bc rows.
#
# ![one block of the fused forward: Q_i read once, K_j and V_j streamed through shared memory, S in registers, P in shared memory, only O_i and L_i written to HBM](../slides/img/04_dataflow.png)
#
# One block of the forward at d = 64 (Br = 256, Bc = 64), drawn by
# `slides/img/make_04_figures.py` from the kernel's sizes: per K/V tile j,
# `S = Q_i K_j^T -> m' = max(m, rowmax S) -> P = exp(S - m')`,
# `l = e^(m - m') l + rowsum P`, `O = e^(m - m') O + P V_j`; at the end `O_i / l` and
# `L_i = m + log l` go to HBM.
#
# **Sources** (numbered as in the README's list): [1] FlashAttention, Algorithm 1 (the
# forward), Theorem 1 (O(N²d) FLOPs, O(N) extra memory) and Theorem 2 (Θ(N²d²M⁻¹) HBM
# accesses); [4] FlashAttention-2, Algorithm 1 (the loop order used here: Q tile outer);
# [5] Saha and Ye (Theorem 2's bound is optimal for M ≥ d²).

# %%
import inspect
import math
from pathlib import Path

import numpy as np

import kernels  # noqa: F401  (GPU or simulator, chosen before Numba is imported)
from kernels import reference as ref
from kernels.flash_forward import (
    SWEEP_D64,
    SWEEP_D128,
    Tiles,
    check_tile_update,
    default_tiles,
    flash_attention,
    flash_forward_numpy,
    io_model_bytes,
    make_attend_query_tile,
    make_flash_forward,
    shared_bytes,
    tile_update,
    tile_update_cases,
)
from kernels.base.fused import padded_head_dim
from kernels.base.runtime import device_name, on_simulator
from kernels.base.testing import assert_close, case_with, check_exercise

print("running on:", device_name())

# %% tags=["parameters"]
# Tiny sizes in the simulator (every GPU thread is a Python thread there), real ones on a GPU.
if on_simulator():
    B, H, NQ, NK, D_HEAD = 1, 2, 19, 23, 16   # the kernel checks
    TIME = None                                # no timing in the simulator
else:
    B, H, NQ, NK, D_HEAD = 2, 4, 1000, 1100, 64
    TIME = (4, 16, 4096, 64)                   # the reference configuration

# %% [markdown]
# ## 1. Tile the naive computation
#
# For one head, with `S = scale * Q K^T`:
#
# $$O = \mathrm{softmax}(S)\,V,\qquad O_{r} = \frac{\sum_j e^{S_{rj}} V_j}{\sum_j e^{S_{rj}}}$$
#
# Cut Q into tiles of Br rows and K, V into tiles of Bc rows. A tile of scores
# `S_ij = scale * Q_i K_j^T` needs only `Q_i` and `K_j`: matmuls tile (chapter 2). The
# product `P V` also tiles: `O_i = sum_j P_ij V_j`. The one obstacle is the softmax between
# them: `P_ij = exp(S_ij) / l_i` divides by the sum `l_i` over **every** tile j of the row, so
# no `P_ij` is known before the last `S_ij` has been computed. The naive path waits by
# writing all of S to HBM.
#
# Chapter 3's answer: keep the unnormalised sum and a running max, and rescale. It works for
# `O` too, because `O` is linear in the weights `exp(S - m)`: when the max moves from `m` to
# `m'`, everything summed so far is multiplied by the same `exp(m - m')`, in `l` and in every
# column of `O`. Divide by `l` once, at the very end.
#
# Here is that update for one K/V tile, in NumPy (the module's `tile_update`):

# %%
print(inspect.getsource(tile_update))

# %% [markdown]
# Folding it over the K/V tiles of every query tile is the whole algorithm. The NumPy version
# below has exactly the loops of the kernel (including the causal loop bound of section 4);
# at no time does it hold more than a Br x Bc piece of S:

# %%
print(inspect.getsource(flash_forward_numpy))

# %%
rng = np.random.default_rng(0)
q1, k1, v1 = (rng.standard_normal((n, 8)) for n in (37, 29, 29))
for causal in (False, True):
    o_np, l_np = flash_forward_numpy(q1, k1, v1, causal=causal, Br=8, Bc=5)
    o_ex, l_ex = ref.attention(q1, k1, v1, causal=causal)
    fin = np.isfinite(l_ex)
    print(f"causal={causal}: max |O - oracle| = {np.abs(o_np - o_ex).max():.2e}, "
          f"max |L - oracle| = {np.abs(l_np[fin] - l_ex[fin]).max():.2e}, "
          f"rows with no key: {int((~fin).sum())} (O = 0, L = -inf)")

# %% [markdown]
# Two details that matter later:
#
# * **-inf.** A masked score is `-inf`. A row whose keys are all masked *so far* has
#   `m = -inf`, and `exp(m - m')` would be `exp(-inf - -inf) = NaN`. `tile_update` subtracts a
#   finite stand-in instead; such a row keeps `l = 0` and `O = 0`, and if it never sees a key
#   (causal with Nq > Nk, or Nk = 0) the result is `O = 0`, `L = -inf`, never NaN.
# * **L.** `L = m + log l` is the row's logsumexp. Chapter 5's backward rebuilds any tile of
#   P as `exp(S - L)` from it, so the forward saves these Nq numbers and nothing else.

# %% [markdown]
# ## A ladder to the kernel: you write rungs 1 and 2
#
# Between `flash_forward_numpy` and the production kernel of section 3 (micro-tiles,
# registers, runs of 4, warp shuffles) there are two kernels you can write in a few lines
# each, as chapter 2 climbed from one thread an element to register tiles:
#
# | rung | a thread | a block | K and V come from | you |
# |---|---|---|---|---|
# | 1 | one query row: chapter 3's online softmax over every key, `O_i` in the thread's own memory | any 128 rows | global memory, every row reads all of K and V | write it |
# | 2 | one query row, as rung 1 | the Br rows of a query tile | **shared memory**: the block copies each tile of Bc keys once, all Br rows read it | write it |
# | 3 | a TM x RN micro-tile of S and TM x RD of O | Br rows, TY x TX threads | shared memory, transposed, read 16 bytes at a time | read it (section 3) |
#
# * **Exercise 1 (rung 1).** `make_row_per_thread_forward(D)` returns a kernel
#   `(q, k, v, o, lse, scale, causal)` on `(B*H, N, d)` arrays (`lse`: `(B*H, Nq)`),
#   launched with grid `(ceil(Nq / threads), B*H)`: thread `i = blockIdx.x * blockDim.x +
#   threadIdx.x` takes query row `i` of head `blockIdx.y`. For each key `j` the row sees
#   (causal: `j <= i + Nk - Nq`): `s = scale q_i . k_j`, `m' = max(m, s)`,
#   `l = e^(m - m') l + e^(s - m')`, `O_i = e^(m - m') O_i + e^(s - m') v_j`. At the end
#   `O_i / l` and `L_i = m + log l`; a row that sees no key gets `O_i = 0`, `L_i = -inf`.
#   `D` (a power of two >= d) is the compile-time size of a per-thread array
#   (`cuda.local.array(D, float32)`). Graded by `test_row_per_thread_rung_matches_oracle`.
# * **Exercise 2 (rung 2).** `make_query_tile_forward(Br, Bc, D)`: the same kernel
#   arguments, grid `(ceil(Nq / Br), B*H)`, Br threads a block, thread `t` takes row
#   `Br * blockIdx.x + t`. For each tile of Bc keys the block copies `K_j` and `V_j` into
#   `cuda.shared.array((Bc, D), float32)` arrays (zeros past Nk and past d), waits at a
#   barrier, each thread sweeps the keys of the tile its row sees, and the block waits again
#   before the next copy. Threads whose row is past Nq still copy and wait. Graded by
#   `test_query_tile_rung_matches_oracle`.
#
# <details><summary>Hint 1 (both): the row's state</summary>
#
# Three things per row: `m` (start at `-inf`), `l` (0) and the `O_i` array (zeros). Take the
# max with `nan_max` (from `kernels.base.fused`) so a NaN survives, and skip the update while
# `m'` is still `-inf` (a row that has seen only masked keys): `exp(-inf - (-inf))` is NaN.
# </details>
#
# <details><summary>Hint 2 (rung 2): who copies what</summary>
#
# `for e in range(t, Bc * D, Br)`: thread `t` copies elements `t, t + Br, ...` of the tile,
# `r, c = e // D, e % D`. Then `cuda.syncthreads()`, the sweep over
# `range(min(Bc, kv_end - k0))` (this row's last key, not the tile's), and
# `cuda.syncthreads()` again. A `return` before a barrier would leave the block waiting.
# </details>
#
# <details><summary>Hint 3 (rung 2): the causal bound of the block</summary>
#
# The block loads tiles up to the last key its **last** row sees,
# `min(Nk, q0 + Br + Nk - Nq)`; each row stops at its own `min(Nk, i + 1 + Nk - Nq)`.
# </details>

# %%
from kernels.base.learner import grade, my_file

TEMPLATE = '''"""My kernels for chapter 4's ladder (graded by tests/test_flash_forward.py)."""
CHAPTER = "flash_forward"

import math

from numba import cuda, float32

from kernels.base.fused import nan_max


def make_row_per_thread_forward(D):
    @cuda.jit
    def row_per_thread_forward(q, k, v, o, lse, scale, causal):
        raise NotImplementedError   # your code: query row i of head blockIdx.y

    return row_per_thread_forward


def make_query_tile_forward(Br, Bc, D):
    @cuda.jit
    def query_tile_forward(q, k, v, o, lse, scale, causal):
        raise NotImplementedError   # your code: K/V tiles in shared memory, one thread a row

    return query_tile_forward
'''

mine = my_file("my_flash_forward.py", TEMPLATE)

# %%
_ = grade(mine)

# %% [markdown]
# The course's answers: `kernels.flash_forward.make_row_per_thread_forward` and
# `make_query_tile_forward` (read them after yours pass); their launchers
# `row_per_thread_attention` and `query_tile_attention` are the ones the tests call.
# The three rungs on the H100, through their launchers (`python -m kernels.bench.flash_forward
# --ladder`, `results/flash_forward_ladder.csv`):

# %%
from kernels.base.notebook import show_ladder

show_ladder("results/flash_forward_ladder.csv")

# %% [markdown]
# What the block shares, traced (`kernels.base.trace`, chapter 0): one head, 8 queries and
# 8 keys, d = 4, tiles of Br = 8 rows and Bc = 4 keys. Rung 1's 8 threads each read all of K
# and V from global memory; rung 2's read each K/V element once a block, then from shared
# memory.

# %%
from kernels.base.trace import tracing
from kernels.flash_forward import query_tile_attention, row_per_thread_attention

rng_t = np.random.default_rng(4)
q_t, k_t, v_t = (rng_t.standard_normal((1, 1, 8, 4)).astype(np.float32) for _ in range(3))
for name, launch, kw in (("rung 1", row_per_thread_attention, {}), ("rung 2", query_tile_attention, {"tiles": (8, 4)})):
    with tracing() as launches:
        launch(q_t, k_t, v_t, **kw)
    counts = launches[0].counts
    shared = sum(c.reads for n, c in counts.items() if n not in ("q", "k", "v", "o", "lse"))
    print(f"{name}: K read {counts['k'].reads} times and V {counts['v'].reads} from global memory, "
          f"shared-memory reads {shared}")
launches[0].draw(["k", "K_j"], highlight=(0, 3),
                 title="rung 2: each key element read once from global memory, then by all 8 rows from shared memory")

# %% [markdown]
# At B = 1, H = 16, N = 4096, d = 64 fp32 (one run, 2026-11-24), rung 1 took 58.4 ms, rung 2
# 11.3 ms and the production kernel 3.3 ms (causal: 46.4, 7.6, 2.8 ms). Rung 2 changes two
# things at once: a block reads each K/V tile from HBM once for its Br rows, and its loops
# run to the compile-time D over zero-padded tiles, so `q_i` and `O_i` stay in registers
# instead of the thread's local memory (an earlier version of rung 2 with rung 1's loops to
# the run-time d measured *slower* than rung 1: 106 against 77 ms, the H100's L1 already
# serving a warp's 32 identical reads of `k[j, c]` as one). Rung 3's 3.4x over rung 2 is
# section 3: each thread a TM x RN micro-tile, so each value read from shared memory feeds
# TM or RN multiply-adds instead of one.

# %% [markdown]
# ## 2. What lives where
#
# A block owns Br query rows for the whole sweep over K and V. Per tile it computes a
# Br x Bc piece of S, and it keeps `m`, `l` and the Br x d output accumulator across tiles.
# The H100 gives a block up to 227 KB of shared memory and each thread up to 255 registers.
#
# | what | size (floats) | where | why |
# |---|---|---|---|
# | `Q_i` | Br x d | shared, **transposed** (`Qt`, d x (Br+4)) | read d times per tile; a thread's rows are contiguous |
# | `K_j` | Bc x d | shared, **transposed** (`Kt`, d x (Bc+4)) | read along the columns of S; a thread's columns are contiguous |
# | `V_j` | Bc x d | shared, as in HBM (`V`, Bc x (d+8)) | read along the rows of O |
# | `S_ij` | Br x Bc | **registers**, a TM x RN piece a thread | produced and consumed by the same thread |
# | `P_ij` | Br x Bc | shared, transposed (`Pt`) | written by the thread that owns a score, read by the threads that own the output columns |
# | `m`, `l` | Br each | registers, TM a thread | the running statistics |
# | `O_i` | Br x d | **registers**, a TM x RD piece a thread | the accumulator: rescaled and added to every tile |
#
# **Threads.** A block has TY x TX threads, TY = Br / TM. Thread (ty, tx) owns TM rows and
# RN = Bc / TX columns of S, and the same rows and RD = d / TX columns of O, in **runs of
# 4**, as in chapter 2: rows `4 ty + 4 TY a + i` (i < 4), columns `4 tx + 4 TX b + j`.
# Both products are register-tiled matmuls: per step of the inner dimension a thread reads
# TM values of one operand and RN (or RD) of the other from shared memory and does TM x RN
# (TM x RD) fused multiply-adds. A run of 4 floats that starts 16-byte aligned is one
# 128-bit load (`LDS.128`), so with TM = RN = 8 that is 64 FMAs for 4 shared-memory loads
# (16 with scalar loads). Row strides are multiples of 4 floats (every row aligned), and the
# 8 threads of a warp that read neighbouring runs read 128 consecutive bytes: one
# shared-memory wavefront, no bank conflicts. The padding (+4, +8) spreads the stores of the
# tile copies over all 32 banks.
#
# **Reductions.** The TX threads of a row are neighbours in one warp. The row max needs all
# of them: a butterfly of log2(TX) warp shuffles (`shfl_xor`), no shared memory, no barrier.
# The row sum does not: each thread keeps the sum of its own columns (the rescale factor is
# the same for the whole row) and the TX partial sums are added once, at the end.
#
# **exp.** The kernel keeps raw scores `s = q . k` and applies the scale inside the
# exponent: `exp(scale (s - m)) = exp2(s c - m c)` with `c = scale log2 e`, one FMA and the
# hardware's `ex2.approx` per probability (`m c` is computed once a row). Because fastmath lets the compiler assume there are no infinities,
# the kernel never computes with `-inf`: a masked score is the finite sentinel `-1e30`, and
# a row that has seen no key yet contributes nothing.

# %% [markdown]
# ### The budget for the chosen tiles
#
# Shared memory is one dynamic buffer (`Qt | Kt | V | Pt`). Above 48 KB a block needs
# dynamic shared memory *and* a raised per-kernel limit; `kernels/base/shared_memory.py` does that
# through numba-cuda's driver layer (`cuKernelSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)`),
# and does nothing in the simulator. Registers are counted by `ptxas` (sm_90) on the PTX
# that Numba produces; the estimate below counts only the arrays a thread keeps.

# %%
def budget(tiles, D):
    TY = tiles.Br // tiles.TM
    RN, RD = tiles.Bc // tiles.TX, D // tiles.TX
    smem = shared_bytes(tiles, D)
    regs = tiles.TM * RN + tiles.TM * RD + 3 * tiles.TM + max(RN, RD)   # S, O, m/l/a, b
    per_sm = min(228 * 1024 // (smem + 1024), 2048 // tiles.threads)
    return (f"{str(tiles):<26} D={D:<4} threads={tiles.threads:<4} micro-tiles S {tiles.TM}x{RN}, "
            f"O {tiles.TM}x{RD}   smem {smem / 1024:6.1f} KB   arrays {regs:3d} regs/thread   "
            f"blocks/SM by smem <= {per_sm}")


for t in SWEEP_D64:
    print(budget(t, 64))
for t in SWEEP_D128:
    print(budget(t, 128))

# %% [markdown]
# Registers as the H100's driver compiled this module when it was written
# (`kernel.get_regs_per_thread()` after a launch): the d = 64 default `Br=256 Bc=64 TM=8 TX=8`
# uses 251 registers a thread and no local memory: its 256 threads fill the SM's 64K
# registers, one block (8 warps) an SM, which its 165 KB of shared memory allows too.
# `Br=128 Bc=64 TM=8 TX=8` (128 threads, two blocks an SM) hits the 255 cap and spills
# 24 bytes; `Br=128 Bc=64 TM=4 TX=8` uses about 150, `Br=256 Bc=32 TM=8 TX=8` about 170.
# The d = 128 default `Br=128 Bc=32 TM=4 TX=8` uses about 170 (one 256-thread block an SM,
# 117.5 KB of shared memory). Loading the next K/V tile into registers while computing the
# current one (`make_flash_forward(..., prefetch=True)`, which the bench measures) needs
# `2 Bc d / threads` registers more: at these tiles it either spills or costs occupancy,
# and it measured no faster. Every production configuration is compiled to PTX in CI
# (`python -m kernels.base.ptx_check flash_forward`), which also warns if any uses local memory.

# %% [markdown]
# ## 3. The kernel, piece by piece
#
# Everything a block does for its query tile `Q_i` is one device function, `attend`, built by
# a cached factory, `make_attend_query_tile(Br, Bc, D, TM, TX)`, so that every size is a
# compile-time constant: the per-thread arrays have constant sizes and their loops unroll,
# which is what lets the compiler keep them in registers. D is the head dimension rounded up
# to a power of two (d = 1..128 all work; the padding columns are loaded as zeros and never
# stored). The kernel itself, `make_flash_forward`, only decides which block takes which
# query tile and how many K/V tiles it visits. Chapter 6 reuses `attend` unchanged with a
# list of kept tiles. We print it one section at a time.
#
# Which thread owns which entries of S and O, from the kernel's own index formulas
# (`slides/img/make_04_figures.py`; every entry has exactly one owner): a small block with
# the production structure, then the d = 64 default.
#
# ![thread to micro-tile map, small block](../slides/img/04_thread_map_small.png)
#
# ![thread to micro-tile map, d = 64](../slides/img/04_thread_map_d64.png)

# %%
SOURCE = (inspect.getsource(make_attend_query_tile) + inspect.getsource(make_flash_forward)).splitlines()


def show(start, stop=None):
    """Print the source from the line containing ``start`` up to (not including) the next
    line containing ``stop`` (or the next section comment)."""
    i = next(n for n, line in enumerate(SOURCE) if start in line)
    j = i + 1
    while j < len(SOURCE):
        line = SOURCE[j].strip()
        if (stop and stop in SOURCE[j]) or (stop is None and line.startswith("# --")):
            break
        j += 1
    print("\n".join(SOURCE[i:j]))


show("def make_flash_forward")

# %% [markdown]
# **The grid.** Block (x, y) takes the query tile `Tr - 1 - x` of head y (the heaviest causal
# tiles first). With causal masking (bottom-right: query r sees key c iff c <= r + Nk - Nq),
# the last row of the tile sees keys up to `q0 + Br - 1 + Nk - Nq`; tiles past that are never
# loaded, so the loop runs over `n_tiles` tiles, `every_tile` of them in order. (A trap when
# comparing with PyTorch: `scaled_dot_product_attention(..., is_causal=True)` aligns the
# mask top-left, query r sees key c iff c <= r, which differs from ours when Nq != Nk; with
# Nq = Nk, as in every bench of this course, the two agree. FlashAttention >= 2.1 aligns
# bottom-right, as we do.)
#
# **Setup and the Q tile.** The factory's constants and `load_kv`, then the start of
# `attend`: it copies `Q_i` into shared memory once, transposed, zero-padded past Nq and past
# d. Indices into shared memory are unsigned: Numba checks every *signed* index for a
# negative value (Python's `a[-1]`), which costs several integer instructions per load in the
# hot loops.

# %%
show("def make_attend_query_tile", "def attend(")
show("def attend(", "# ---- on-chip state")
show("# ---- on-chip state")

# %% [markdown]
# **The loop over K/V tiles.** Per tile: `load_kv` brings this thread's part of `K_j` and
# `V_j` into registers, and the block stores them to shared memory, `K_j` transposed,
# between two barriers.

# %%
show("# ---- the K/V tiles")
show("# -- K_j (transposed) and V_j")

# %% [markdown]
# **S = Q K^T** in registers, then the mask, which only tiles crossing the diagonal or the
# ragged end of K pay for:

# %%
show("# -- S = Q_i K_j^T")
show("# -- mask")

# %% [markdown]
# **The online softmax**: the row max across the TX threads (shuffles), the rescale factor
# `alpha = exp(scale (m - m'))` applied to `l` and to every accumulator, and `P` written to
# shared memory for the second product. A row that has seen no key yet takes its exponents
# against 0, so a masked score gives exactly 0 without a branch, and a NaN score (a NaN in
# the inputs) gives a NaN P that reaches the output row, as it does in PyTorch:

# %%
show("# -- online softmax")

# %% [markdown]
# **O += P V** in registers, then, after the last tile, the epilogue: the row sums across
# the TX threads, `O / l`, and `L = scale * m + log l` (m holds raw scores, so the scale
# enters here).

# %%
show("# -- O += P V_j")
show("# ---- epilogue")

# %% [markdown]
# ## 4. Causal: which tiles run
#
# Whole tiles above the diagonal are skipped by the loop bound; only tiles that the
# diagonal crosses are masked element by element. For Nq = Nk about half the tiles run;
# with Nq > Nk the first rows see nothing at all.

# %%
def tile_map(nq, nk, Br, Bc):
    """0 = skipped, 1 = run without mask, 2 = run with the element mask (causal)."""
    tr, tc = -(-nq // Br), -(-nk // Bc)
    grid = np.zeros((tr, tc), int)
    for i in range(tr):
        q0 = i * Br
        kv_end = min(nk, q0 + Br + nk - nq)
        for j in range(-(-max(kv_end, 0) // Bc)):
            k0 = j * Bc
            masked = k0 + Bc > nk or k0 + Bc - 1 > q0 + nk - nq
            grid[i, j] = 2 if masked else 1
    return grid


import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402

fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
for ax, (nq, nk) in zip(axes, [(512, 512), (384, 640), (640, 384)]):
    g = tile_map(nq, nk, 64, 64)
    ax.imshow(g, cmap=ListedColormap(["#f0f0f0", "#4c72b0", "#dd8452"]), vmin=0, vmax=2)
    ax.set_title(f"Nq={nq}, Nk={nk}: {100 * (g > 0).mean():.0f}% of tiles run")
    ax.set_xlabel("K/V tile j")
    ax.set_ylabel("query tile i")
fig.suptitle("causal, Br = Bc = 64: blue runs unmasked, orange is masked, grey is skipped")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 5. Check against the oracle
#
# The tests (`tests/test_flash_forward.py`) draw shapes, tiles, scales and logit magnitudes;
# here a few cases by hand: ragged Nq != Nk, causal with fully masked rows, large logits,
# float16 inputs, and a non-default tile configuration. The tolerance rule: the kernel's
# error against the float64 oracle must be at most twice the error of plain float32 NumPy.

# %%
def check(case, tiles=None):
    o, lse = flash_attention(case.q, case.k, case.v, causal=case.causal, scale=case.scale, tiles=tiles)
    exact_o, exact_l = ref.attention(case.q, case.k, case.v, causal=case.causal, scale=case.scale)
    base_o, base_l = ref.attention(case.q, case.k, case.v, causal=case.causal, scale=case.scale, dtype=np.float32)
    assert_close(o, exact_o, base_o, name="O")
    assert_close(lse, exact_l, base_l, name="L")
    err = np.abs(o - exact_o).max() if o.size else 0.0
    print(f"{case!r}: max |O - oracle| = {err:.2e}  OK")
    return o, lse


_ = check(case_with((B, H, NQ, D_HEAD), (B, H, NK, D_HEAD)))
o, lse = check(case_with((B, H, NK, D_HEAD), (B, H, NQ, D_HEAD), causal=True))     # Nq > Nk
print("rows with no key:", int(np.isneginf(lse[0, 0]).sum()), "-> O there is", np.abs(o[0, 0][np.isneginf(lse[0, 0])]).max(initial=0))
_ = check(case_with((1, 1, 12, 16), (1, 1, 12, 16), magnitude=100.0))             # logits ~ 1e4
_ = check(case_with((B, H, NQ, D_HEAD), (B, H, NK, D_HEAD), dtype=np.float16, causal=True))
_ = check(case_with((1, 1, NQ, 5), (1, 1, NK, 5), causal=True), Tiles(Br=4, Bc=8, TM=2, TX=4))

# %% [markdown]
# Device arrays in give device arrays out (no copy back), as with every chapter.

# %%
from numba import cuda  # noqa: E402

case = case_with((B, H, NQ, D_HEAD), (B, H, NK, D_HEAD), causal=True)
o_dev, lse_dev = flash_attention(*(cuda.to_device(x) for x in (case.q, case.k, case.v)), causal=True)
print(type(o_dev).__name__, o_dev.shape, lse_dev.shape)

# %% [markdown]
# ## 6. Bytes: the IO model
#
# Per head, in elements (`kernels/base/io_model.py`):
#
# * **naive** (chapter 1): read Q and K, write S (N^2); read S, write P (2 N^2) and L; read
#   P and V, write O: `4 N d + 4 N^2 + N`.
# * **fused**, query tile outer: Q read once, O and L written once, and every one of the
#   ceil(N / Br) query tiles reads all of K and V: `2 N d + N + 2 N d ceil(N / Br)`.
# * **compulsory**: every input read once, every output written once: `4 N d + N`.
#
# The fused kernel still reads K and V ceil(N / Br) times, but that `2 N^2 d / Br` is
# smaller than the naive `4 N^2` by a factor `2 Br / d` (8x at the default Br = 256, d = 64), and
# `Br` is ours to choose. More telling is the arithmetic intensity: each K/V element a block
# loads feeds `2 Br` FLOPs (`4 Br d` FLOPs per K/V row of `2 d` elements), 32 FLOP/byte in
# fp32 at Br = 64, above the H100's fp32 ridge (51 TFLOP/s / 3 TB/s = 17 FLOP/B). The fused
# kernel is bound by arithmetic (and shared-memory traffic), the naive one by HBM.
#
# The model counts the bytes that must travel **into and out of the SMs' on-chip memory**
# (shared memory and registers), and calls all of it HBM traffic: it assumes nothing in
# between keeps a copy. The H100 has a 50 MB L2 cache in between; section 8 measures both
# levels and finds where the re-reads of K and V actually land.

# %%
def naive_bytes(n, d, bh=1):
    return 4 * bh * (4 * n * d + 4 * n * n + n)


def compulsory_bytes(n, d, bh=1):
    return 4 * bh * (4 * n * d + n)


d = 64
ns = [512, 1024, 2048, 4096, 8192, 16384]
print(f"{'N':>6} {'naive MB':>10} {'fused Br=32':>12} {'Br=64':>9} {'Br=128':>9} {'compulsory':>11}   naive/fused(128)")
for n in ns:
    f = {br: io_model_bytes(1, 1, n, n, d, Br=br) for br in (32, 64, 128)}
    print(f"{n:>6} {naive_bytes(n, d) / 1e6:>10.1f} {f[32] / 1e6:>12.1f} {f[64] / 1e6:>9.1f} {f[128] / 1e6:>9.1f} "
          f"{compulsory_bytes(n, d) / 1e6:>11.2f}   {naive_bytes(n, d) / f[128]:>8.1f}x")

fig, ax = plt.subplots(figsize=(6.5, 4))
ax.loglog(ns, [naive_bytes(n, d) for n in ns], "o-", label="naive (S, P in HBM)")
for br in (32, 64, 128):
    ax.loglog(ns, [io_model_bytes(1, 1, n, n, d, Br=br) for n in ns], "s-", label=f"fused, Br={br}")
ax.loglog(ns, [compulsory_bytes(n, d) for n in ns], "k--", label="compulsory")
ax.set_xlabel("N (= Nq = Nk), d = 64, one head, fp32")
ax.set_ylabel("HBM bytes (model)")
ax.legend()
ax.set_title("IO model: bytes per head")
plt.tight_layout()
plt.show()

# %% [markdown]
# FLOPs: `4 B H Nq Nk d` (two matmuls of `2 Nq Nk d` each; the exp and the rescaling are
# lower order), halved for causal. At the reference configuration (B=4, H=16, N=4096, d=64)
# that is 275 GFLOP: 5.4 ms at the 51 TFLOP/s cuBLAS reaches in fp32, while the fused
# kernel's 2.3 GB (the default Br = 256; 4.4 GB at Br = 128) take under 1 ms at 3 TB/s.
# The naive path moves about 17 GB, mostly S and P: at least 5.9 ms at copy speed, more
# than all the arithmetic.

# %%
b, h, n, d = 4, 16, 4096, 64
flops = 4 * b * h * n * n * d
print(f"FLOPs {flops / 1e9:.0f} G -> {flops / 51.2e12 * 1e3:.2f} ms at 51.2 TFLOP/s")
for label, nbytes in [("naive", naive_bytes(n, d, b * h)), ("fused Br=64", io_model_bytes(b, h, n, n, d, Br=64)),
                      ("fused Br=128", io_model_bytes(b, h, n, n, d, Br=128)),
                      ("fused Br=256", io_model_bytes(b, h, n, n, d, Br=256)),
                      ("compulsory", compulsory_bytes(n, d, b * h))]:
    print(f"{label:<13} {nbytes / 1e9:6.2f} GB -> {nbytes / 2.97e12 * 1e3:6.2f} ms at 2.97 TB/s, "
          f"intensity {flops / nbytes:6.1f} FLOP/B")

# %% [markdown]
# ## 7. Memory
#
# The naive path allocates S and P: `B H N^2` floats each. The fused path allocates only its
# output O and L: `O(B H N d)`. With one head and N = 131072 in fp32, S alone is 64 GiB: the
# naive path cannot run on an 80 GB card (it needs S *and* P, 2 x 64 GiB); the fused kernel
# needs 34 MB for O (and 0.5 MB for L) on top of its 101 MB of inputs.

# %%
print(f"{'N':>7} {'inputs+O MB':>12} {'naive extra (S, P) GiB':>24} {'fused extra (O, L) MB':>22}")
for n in [4096, 16384, 32768, 65536, 131072]:
    io = 4 * 4 * n * 64 / 1e6
    print(f"{n:>7} {io:>12.1f} {2 * 4 * n * n / 2**30:>24.1f} {4 * (n * 64 + n) / 1e6:>22.2f}")

# %% [markdown]
# `python -m kernels.bench.flash_forward --memory` runs this on the GPU (B = H = 1,
# N = 131072, d = 64): the fused launcher, timed, with the device memory its call takes at
# its peak; chapter 1's naive path on the same inputs; SDPA memory-efficient (fp32) as a
# peer. On the H100 the committed run says: the fused launcher ran in about 124 ms
# (35.5 TFLOP/s, as fast per FLOP as at N = 4096) with a peak of 33.6 MB, the size of its
# output; the naive path stopped at its first allocation with
# `CUDA_ERROR_OUT_OF_MEMORY` (it asks for 2 x 64 GiB, 137 GB, for S and P); SDPA
# memory-efficient took about 131 ms with the same 33.6 MB peak. The rows, and a summary
# read from them:

# %%
RESULTS = Path("results") if Path("results").is_dir() else Path("workbook/results")


def show_csv(name, columns=("kernel", "config", "median_ms", "tflops", "gbps", "peak_mem_mb", "note")):
    from kernels.bench.harness import read_csv

    path = RESULTS / name
    if not path.exists():
        print(f"GPU results are not committed yet ({path}).")
        return None
    try:
        env, rows = read_csv(path)
    except (KeyError, ValueError):           # not the bench's format: show it as it is
        print(path.read_text()[:3000])
        return None
    print("device:", env.get("device"), "| driver:", env.get("driver"), "| numba-cuda:", env.get("numba-cuda"))
    for r in rows:
        print("  ".join(f"{r.get(c):.4g}" if isinstance(r.get(c), float) else str(r.get(c, ""))[:90]
                        for c in columns))
    return rows


memory_rows = show_csv("flash_forward_memory.csv")
if memory_rows:
    for r in memory_rows:
        if r["kernel"].startswith("naive"):
            print(f"\n{r['kernel']}: needs {r['peak_mem_mb'] / 1e3:.0f} GB for S and P; "
                  f"{r['note'].split('; ', 1)[-1]}")
        else:
            print(f"{r['kernel']}: {r['median_ms']:.1f} ms, {r['tflops']:.1f} TFLOP/s, "
                  f"peak {r['peak_mem_mb']:.1f} MB")

# %% [markdown]
# ## 8. Results on the H100
#
# `python -m kernels --chapters 4` measures, in one run: the kernel at the reference
# configuration (B=4, H=16, N=4096, d=64, fp32; non-causal and causal) with plain PyTorch,
# SDPA math and SDPA memory-efficient as peers; the tile sweep; N from 512 to 16384 at
# d = 64 and 128; and float16 inputs next to SDPA's tensor-core backends. The bars to clear,
# from `results/flash_forward.csv`: plain PyTorch fp32 about 20 TFLOP/s, SDPA memory-efficient fp32
# about 34. (No tensor cores in Numba: our kernel runs on the fp32 FMA units even for fp16
# inputs, so the fp16 peers are context, not competition. The fp32 memory-efficient peer
# does use the tensor cores: see "What the fp32 peer executes" below.)

# %%
rows = show_csv("flash_forward.csv", ("kernel", "config", "median_ms", "tflops", "pct_fma_ceiling", "gbps"))
png = RESULTS / "flash_forward.png"
if png.exists():
    from IPython.display import Image, display

    display(Image(str(png)))

# %% [markdown]
# ### What the fp32 peer executes
#
# `python -m kernels.bench.peer_pipes`, run under Nsight Compute, calls SDPA's
# memory-efficient forward and backward once on fp32 inputs (B=4 H=16 N=4096, d = 64 and
# 128) and counts, for each of its kernels, the instructions the tensor-core pipe and the
# FMA pipe executed and the cycles each pipe was busy. Measured: every one of these kernels
# (`fmha_cutlassF_f32_aligned_64x64_rf_sm80` and the others) executes tensor-core `mma`
# instructions, and their count times 2048 FLOPs (one TF32 `mma.sync` m16n8k8:
# 2 x 16 x 8 x 8) is **3.00x the FLOPs the attention needs**, forward and backward, d = 64
# and 128, with about as many FMA-pipe cycles as tensor-pipe cycles.
#
# Our reading of the counters: the kernel computes each fp32 product as three TF32
# tensor-core products. It splits each operand into a large TF32 part and a small TF32
# remainder, `a = a_big + a_small`, and sums `a_big b_big + a_big b_small + a_small b_big`
# (the "3xTF32" trick, which keeps about fp32 accuracy); the FMA-pipe work is the splitting
# and the softmax. What that means here:
#
# * Every product in our kernel runs on the fp32 FMA units (Numba exposes no tensor-core
#   API; chapter 8 reaches the instruction through inline PTX). At d = 64 the fused
#   forward comes close to the memory-efficient kernel, and how close depends on what is
#   timed: the bare kernel (a launch on preallocated outputs) against SDPA's whole call,
#   32.8 against 34.1 TFLOP/s, is 0.96x; through our launcher, as a user calls it
#   (arguments checked, O and L allocated), 30.1: **0.88x**. Causal: 0.87x bare, 0.76x
#   through the launcher (27.5 and 24.0 against 31.5). At d = 128: 0.62x bare (28.8
#   against 46.2). A kernel on the FMA units alone gets near a tensor-core kernel that
#   spends three TF32 products per fp32 product, at d = 64, and not past it.
# * At d = 128 that peer reaches 46.2 TFLOP/s, about 0.9x of cuBLAS's fp32 matmul with TF32
#   off (50.9 TFLOP/s, chapter 0), the practical ceiling of the FMA units. An attention
#   kernel, with its softmax and rescaling on the same units, cannot get that close on the
#   FMA units alone; the peer does because its products run on the tensor cores. Our
#   kernel's 28.8 TFLOP/s at d = 128 is what the FMA units give it.
# * Plain PyTorch fp32 attention is the FMA-only peer: `torch.backends.cuda.matmul.allow_tf32`
#   is False there (the bench sets it so), so its two matmuls are cuBLAS's fp32 FMA kernels.
#   At the reference size our forward beats it (32.8 against 20.7 TFLOP/s); at d = 128 it
#   is 5% ahead of ours (30.1 against 28.8). Chapter 5's backward goal is SDPA's
#   memory-efficient backward, the same kind of tensor-core kernel.
#
# The counters, per kernel (`ms` is the one profiled call):

# %%
def show_pipes():
    """SDPA memory-efficient kernels under Nsight Compute, from results/sdpa_pipes.csv."""
    from kernels.bench.harness import read_csv

    path = RESULTS / "sdpa_pipes.csv"
    if not path.exists():
        print(f"The Nsight Compute result is not committed ({path}): run "
              "`python -m kernels.bench.peer_pipes` under ncu on a GPU (see its docstring).")
        return None
    env, rows = read_csv(path)
    print("device:", env.get("device"), "| driver:", env.get("driver"))
    print(f"{'kernel':<42} {'part':<9} {'d':>4} {'ms':>7} {'tf32_flops_over_attention_flops':>32} "
          f"{'tensor pipe cycles':>19} {'FMA pipe cycles':>16}")
    for r in rows:
        ex = dict(kv.split("=", 1) for kv in r["extra"].split(";") if "=" in kv)
        name = r["kernel"].split("(")[-1].rstrip(")")
        print(f"{name:<42} {ex['part']:<9} {ex['d']:>4} {r['median_ms']:>7.2f} "
              f"{float(ex['tf32_flops_over_attention_flops']):>32.2f} "
              f"{float(ex['tensor_cycles']):>19.3g} {float(ex['fma_cycles']):>16.3g}")
    return rows


_ = show_pipes()

# %% [markdown]
# ### Where the bytes go: a Br sweep under Nsight Compute
#
# The IO model says the fused kernel's traffic is dominated by `2 N^2 d / Br` K/V re-reads,
# so Br should matter. `.ci/gpu-check ncu` profiles the reference configuration (B=4,
# H=16, N=4096, d=64, fp32) at Br = 16, 32, 64, 128, 256 (Bc = 64) and counts two levels of
# the memory hierarchy: the **DRAM bytes** (`dram__bytes_read.sum` + `dram__bytes_write.sum`,
# what reaches HBM) and the **bytes the SMs read from L2**
# (`lts__t_sectors_srcunit_tex_op_read.sum` x 32 B, what arrives at the SM's on-chip
# memory). `python -m kernels.bench.flash_forward --dram` tabulates them next to the IO
# model and times the same tiles without the profiler. The table and the figure below are
# read from `results/flash_forward_dram.csv`:

# %%
def extra_of(row):
    """The bench's ``extra`` column (``key=value;...``) as a dict."""
    return dict(kv.split("=", 1) for kv in row["extra"].split(";") if "=" in kv)


def br_sweep(name="flash_forward_dram.csv"):
    """(env, rows) of the Br sweep, bytes in GB, or None when the file is not committed."""
    from kernels.bench.harness import read_csv

    path = RESULTS / name
    if not path.exists():
        return None
    env, rows = read_csv(path)
    sweep = []
    for r in rows:
        ex = extra_of(r)
        if "l2_read_bytes" not in ex:
            continue
        sweep.append({"Br": int(ex["Br"]), "tiles": ex.get("tiles", ""),
                      "l2_read": float(ex["l2_read_bytes"]) / 1e9,
                      "write": float(ex["dram_write_bytes"]) / 1e9,
                      "dram": float(ex["dram_total_bytes"]) / 1e9,
                      "model": float(ex["model_bytes"]) / 1e9,
                      "compulsory": float(ex["compulsory_bytes"]) / 1e9,
                      "ms": r["median_ms"], "tflops": r["tflops"]})
    return env, sorted(sweep, key=lambda row: row["Br"])


sweep = br_sweep()
if sweep and sweep[1]:
    env, sweep = sweep
    print("device:", env.get("device"), "| driver:", env.get("driver"), "| numba-cuda:", env.get("numba-cuda"))
    print(f"{'Br':>5} {'tiles':>11} {'L2->SM GB':>10} {'model GB':>9} {'(L2->SM + writes) / model':>26} "
          f"{'DRAM GB':>8} {'DRAM / compulsory':>18} {'ms':>7} {'TFLOP/s':>8}")
    for r in sweep:
        print(f"{r['Br']:>5} {r['tiles']:>11} {r['l2_read']:>10.2f} {r['model']:>9.2f} "
              f"{(r['l2_read'] + r['write']) / r['model']:>26.2f} {r['dram']:>8.3f} "
              f"{r['dram'] / r['compulsory']:>18.2f} {r['ms']:>7.2f} {r['tflops']:>8.1f}")

    brs = [r["Br"] for r in sweep]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    ax1.plot(brs, [r["model"] for r in sweep], "o--", color="gray", label="IO model (no cache between HBM and SM)")
    ax1.plot(brs, [r["l2_read"] + r["write"] for r in sweep], "s-", label="measured: SM reads from L2 (+ writes)")
    ax1.plot(brs, [r["dram"] for r in sweep], "^-", label="measured: DRAM (HBM) read + write")
    ax1.axhline(sweep[0]["compulsory"], color="k", linestyle=":", label="compulsory (each input once)")
    naive = None
    naive_path = RESULTS / "naive_attention_dram.csv"
    if naive_path.exists():
        from kernels.bench.harness import read_csv

        naive = next((float(extra_of(r)["dram_total_bytes"]) / 1e9 for r in read_csv(naive_path)[1]
                      if r["kernel"].startswith("naive attention")), None)
    if naive:
        ax1.axhline(naive, color="C3", linestyle="-.", label="naive path (chapter 1), DRAM")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xticks(brs, [str(b_) for b_ in brs])
    ax1.set_xlabel("Br (query tile rows), Bc = 64")
    ax1.set_ylabel("GB per call")
    ax1.set_title("bytes at each level")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0.0, 0.08))
    ax2.plot(brs, [r["ms"] for r in sweep], "o-", color="C4")
    for r in sweep:
        ax2.annotate(f"{r['tflops']:.1f} TFLOP/s", (r["Br"], r["ms"]), textcoords="offset points",
                     xytext=(0, 8), ha="center", fontsize=7)
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(brs, [str(b_) for b_ in brs])
    ax2.set_ylim(0, None)
    ax2.set_xlabel("Br (query tile rows), Bc = 64")
    ax2.set_ylabel("median ms (without the profiler)")
    ax2.set_title("time of the same tiles")
    ax2.grid(True, alpha=0.3)
    fig.suptitle(f"fused forward, B=4 H=16 N=4096 d=64 fp32, {env.get('device')}")
    plt.tight_layout()
    plt.show()
else:
    print("GPU results are not committed yet (workbook/results/flash_forward_dram.csv): "
          "run `.ci/gpu-check ncu` on a GPU.")

# %% [markdown]
# What the sweep says (H100, rounded):
#
# * **DRAM stays at the compulsory bytes.** About 0.27 GB at every Br from 16 to 256: each
#   input read once, O and L written once. The K/V re-reads never reach HBM: the blocks in
#   flight work on a few heads at a time, and those heads' K and V (2 MB a head) stay in the
#   50 MB L2 while every query tile of the head streams them (exercise 3).
# * **The traffic into the SMs follows the model.** The bytes the SMs read from L2 fall
#   from 33.0 GB at Br = 16 to 9.8, 5.8, 3.7 and 2.0 GB at Br = 256, close to the model's
#   `N^2 d / Br` term: 0.96, 0.57, 0.67, 0.86 and 0.92 x the model with the writes. At
#   Br = 32 and 64 they are below it: those blocks are small, several share an SM, and a
#   K/V tile one block has just loaded can be served from that SM's L1 to the next, a level
#   the model leaves out (we did not count L1 hits directly).
# * **Time falls with it**: 25.0, 15.5, 10.3, 8.3 and 8.1 ms. Part of that is the bytes,
#   part is that the small-Br tiles also have small micro-tiles (TM = 1, 2, 4 rows a thread
#   against 8), so each shared-memory load feeds fewer FMAs. From Br = 128 to 256 the
#   traffic halves once more and the time barely moves: there the kernel is limited by its
#   arithmetic and shared-memory work (33 to 34 TFLOP/s), not by these bytes.
#
# So the paper's IO argument holds at the level it describes: the traffic between on-chip
# memory and the memory behind it scales as `N^2 d / Br`, and the time follows. On the
# H100 at this size, that memory behind is mostly L2, which shields HBM from the re-reads.
# The naive path has no such luck: S and P (4.3 GB each) are far larger than L2, so every
# byte of them goes to HBM and back.
#
# ### The paper's claim in HBM bytes
#
# The same configuration through chapter 1's three naive kernels and through the fused
# kernel, HBM bytes read + written as Nsight Compute counts them:

# %%
def measured_dram_gb(name):
    from kernels.bench.harness import read_csv

    path = RESULTS / name
    if not path.exists():
        return None
    _, rows = read_csv(path)
    return {r["kernel"]: float(extra_of(r)["dram_total_bytes"]) / 1e9 for r in rows}


naive_gb, fused_gb = measured_dram_gb("naive_attention_dram.csv"), measured_dram_gb("flash_forward_dram.csv")
if naive_gb and fused_gb:
    total_naive = next(v for k, v in naive_gb.items() if k.startswith("naive attention"))
    for kernel, gb in {**naive_gb, **fused_gb}.items():
        print(f"{kernel:<50} {gb:8.3f} GB")
    print(f"\nthe fused kernel moves {total_naive / max(fused_gb.values()):.0f}x to "
          f"{total_naive / min(fused_gb.values()):.0f}x fewer HBM bytes than the naive path, whatever its Br")
else:
    print("Nsight Compute results are not committed yet (workbook/results/*_dram.csv).")

# %% [markdown]
# The naive path's 17.4 GB is its IO model to within 1%: nothing of S or P survives in a
# cache. The fused kernel's bytes are the compulsory ones, 63x to 66x fewer.

# %%
if TIME:
    from numba import cuda

    from kernels.bench.flash_forward import bare_launch
    from kernels.base.runtime import time_fn

    b, h, n, d = TIME
    qkv = [cuda.to_device(np.random.default_rng(i).standard_normal((b, h, n, d)).astype(np.float32))
           for i in range(3)]
    for causal in (False, True):
        fn, _, _ = bare_launch(default_tiles(d), b, h, n, n, d, causal=causal)
        t = time_fn(fn, [tuple(qkv)])
        fl = 4 * b * h * n * n * d / (2 if causal else 1)
        print(f"causal={causal}: {t.median_ms:.3f} ms, {fl / t.median_ms / 1e9:.1f} TFLOP/s")
else:
    print("timing skipped in the simulator: its timings say nothing about a GPU")

# %% [markdown]
# ## 9. Exercises
#
# ### Exercise 1: the rescaling update
#
# Write `my_tile_update(m, l, o, s, v)`: the state of a block of rows after one more K/V
# tile, in NumPy. `m` (Br,) is the running max, `l` (Br,) the running sum of `exp(s - m)`,
# `o` (Br, d) the running sum of `exp(s - m) v` (not divided by `l`); `s` (Br, Bc) are the
# tile's scaled scores (`-inf` where masked; a tile may be empty for some rows, a row may
# have seen nothing so far) and `v` (Bc, d). Never compute `exp(-inf - -inf)`. The checker
# folds your function over the tiles of random rows (large logits and masks included) and
# compares `o / l` and `m + log l` with the oracle.

# %%
def my_tile_update(m, l, o, s, v):
    # your code here: return m_new, l_new, o_new
    raise NotImplementedError


# %%
_ = check_exercise(lambda c: check_tile_update(my_tile_update, c), tile_update_cases(), host=True)

# %% [markdown]
# The same checker on the module's `tile_update`:

# %%
_ = check_exercise(lambda c: check_tile_update(tile_update, c), tile_update_cases(), host=True)

# %% [markdown]
# ### Exercise 2: tiles for d = 128
#
# At d = 128 the Q tile alone takes `128 x (Br + 4)` floats of shared memory, and the
# accumulator `TM x 128/TX` registers a thread. Using `budget` above, find a configuration
# with at least 2 blocks an SM and at most 64 accumulator registers a thread. Which one did
# the module choose (`default_tiles(128)`), and what does the IO model say about its Br?

# %%
print("module default at d=128:", default_tiles(128) if not on_simulator() else "(simulator tiles)",
      "| D for d=100:", padded_head_dim(100, 8))
for t in [Tiles(64, 32, 4, 8), Tiles(64, 64, 4, 8), Tiles(128, 32, 4, 8), Tiles(128, 64, 8, 8)]:
    print(budget(t, 128))

# %% [markdown]
# ### Exercise 3 (on paper)
#
# The kernel reads K and V once per query tile. If two blocks working on the same head run
# at the same time, the second one's K/V reads may hit L2 instead of HBM. With 132 SMs,
# two blocks an SM and grid (Tr, B*H) launched x-fastest, how many query tiles of the same
# head are in flight together at N = 4096, Br = 128, and how many megabytes of K and V do
# the heads in flight hold, against the 50 MB L2? What does that predict for Nsight
# Compute's DRAM bytes against the IO model's "no L2 reuse" figure, and for the bytes the
# SMs read from L2? Check your answer against the Br sweep of section 8.
