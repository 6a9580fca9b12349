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
# # 5. The recomputing backward
#
# Chapter 4's forward never wrote the N x N matrices S and P to HBM. Training needs the
# gradients too, and the textbook backward of attention *reads P back*: it was saved by the
# forward. If we had to store P for the backward, the forward's savings would be gone.
#
# FlashAttention's answer: save only the output O and one number per query row, the
# logsumexp L, and **recompute** S and P tile by tile during the backward. Recomputing costs
# FLOPs: the backward's four products (dV = P^T dO, dP = dO V^T, dS K, dS^T Q) are 8 N^2 d,
# and S = Q K^T once more adds 2 N^2 d, **+25%**; chapter 4 showed our kernels are bound by
# the FMA units, so those 25% are paid in time. Storing P costs N^2 memory and HBM traffic,
# which at long N does not fit at all (section 6). By the end of this chapter you will have:
#
# 1. the gradients dV, dP, dS, dQ, dK derived from the forward, and why
#    D = rowsum(dO * O) replaces a row sum over the whole N x N matrix;
# 2. P rebuilt exactly from Q, K and L: P = exp(S - L);
# 3. the kernels: a pre-pass for D, a K/V-tile-outer kernel for dK and dV that also adds
#    dQ with atomics (the default: faster, not bitwise reproducible) -- or a Q-tile-outer
#    kernel for dQ (deterministic); and two-level sums, which keep long float32 sums as
#    accurate as NumPy's;
# 4. the IO and memory budget of the backward, against the standard one.
#
# **Sources** (numbered as in the README's list): [1] FlashAttention, Section 3.1 and
# Appendix B (the backward: recompute S and P from Q, K and L), Theorem 5 (its Θ(N²d²M⁻¹)
# HBM accesses); [4] FlashAttention-2, Algorithm 2 (the backward's loop order, D =
# rowsum(dO ∘ O)).

# %%
import inspect
import math

import numpy as np

import kernels  # noqa: F401  (GPU or simulator, chosen before Numba is imported)
from kernels import reference as ref
import kernels.flash_backward as fb
from kernels.flash_backward import (
    BackwardTiles,
    default_tiles,
    ds_tile,
    flash_attention_backward,
    flash_backward_numpy,
    io_model_bytes,
    make_delta,
    make_dkdv,
    make_dkdv_body,
    make_dq_body,
    recompute_p,
    shared_bytes,
    standard_backward_bytes,
)
from kernels.flash_forward import flash_attention
from kernels.base.runtime import device_name, on_simulator
from kernels.base.testing import assert_close, attention_cases, check_exercise, random_array

print("running on:", device_name())

# %% tags=["parameters"]
# Tiny sizes in the simulator (every GPU thread is a Python thread there), real ones on a GPU.
if on_simulator():
    B, H, NQ, NK, D_HEAD = 1, 2, 19, 23, 8      # the kernel check
    TIME = None                                  # no timing in the simulator
else:
    B, H, NQ, NK, D_HEAD = 2, 4, 700, 900, 64
    TIME = (4, 16, 4096, 64)                     # the reference configuration of the bench

# %% [markdown]
# ## 1. The forward, and what it saves
#
# For one (batch, head), with scale $\tau = 1/\sqrt{d}$:
#
# $$S = \tau\, Q K^\top, \qquad P = \mathrm{softmax}_{\text{row}}(S), \qquad O = P V,
# \qquad L_i = \log \sum_j e^{S_{ij}}.$$
#
# The standard implementation keeps S or P (N x N) for the backward. The fused forward of
# chapter 4 keeps only **O** (N x d) and **L** (N numbers). Everything below is rebuilt
# from Q, K, V, O, L and the incoming gradient dO = dLoss/dO.
#
# ## 2. Deriving the gradients
#
# **dV.** $O = PV$ is a matrix product, so $dV = P^\top dO$.
#
# **dP.** Likewise $dP = dO\, V^\top$ (N x N, but we only ever need one tile of it).
#
# **dS: the softmax Jacobian.** Row by row, $p = \mathrm{softmax}(s)$ has Jacobian
# $\partial p_j / \partial s_k = p_j(\delta_{jk} - p_k)$, i.e.
# $J = \mathrm{diag}(p) - p p^\top$. So
#
# $$ds = J^\top dp = p \circ dp - p\,(p^\top dp) = p \circ (dp - p^\top dp).$$
#
# The scalar $p^\top dp = \sum_j P_{ij} dP_{ij}$ is a sum over the **whole row** of N keys:
# a tile cannot compute it alone. The trick: since $dP = dO\,V^\top$ and $O = PV$,
#
# $$D_i := \sum_j P_{ij}\, dP_{ij} = \sum_j P_{ij} \sum_c dO_{ic} V_{jc}
#        = \sum_c dO_{ic} \sum_j P_{ij} V_{jc} = \sum_c dO_{ic}\, O_{ic}.$$
#
# **D = rowsum(dO * O)**: d multiplications a row from arrays we have (a tiny pre-pass),
# instead of N from arrays we do not. Then, for every tile,
#
# $$dS = P \circ (dP - D).$$
#
# **dQ and dK.** $S = \tau Q K^\top$ gives $dQ = \tau\, dS\, K$ and $dK = \tau\, dS^\top Q$.
#
# **Recomputing P.** $P_{ij} = e^{S_{ij}} / \sum_k e^{S_{ik}} = e^{S_{ij} - L_i}$. With L
# saved, one tile of P needs only its tile of Q and K: no running max, no second pass, and
# the *same* P the forward used (to float32 rounding). Masked entries (S = -inf) give 0; a
# row that saw nothing has L = -inf and P = 0 (and dQ = 0 there, never NaN).
#
# | saved by the forward | recomputed in the backward | never stored |
# |---|---|---|
# | O (N x d), L (N) | S, P, dP, dS (one Br x Bc tile at a time, on chip) | any N x N matrix |
#
# Check the derivation numerically against the oracle, which implements exactly these
# closed forms (and is itself tested against finite differences):

# %%
rng = np.random.default_rng(0)
q, k, v = (random_array(rng, (B, H, n, D_HEAD)) for n in (NQ, NK, NK))
do = random_array(rng, (B, H, NQ, D_HEAD))
o64, lse64 = ref.attention(q, k, v, causal=True)
o, lse = o64.astype(np.float32), lse64.astype(np.float32)

# D two ways: over the whole N x N row, and from O and dO alone.
s = (q.astype(np.float64) @ np.swapaxes(k, -1, -2)) / math.sqrt(D_HEAD)
s = np.where(ref.causal_mask(NQ, NK), s, -np.inf)
p = recompute_p(s, lse64)
dp = do.astype(np.float64) @ np.swapaxes(v, -1, -2)
print("max |rowsum(P*dP) - rowsum(dO*O)| =", np.abs((p * dp).sum(-1) - (do * o64).sum(-1)).max())
print("max |P rebuilt from L - softmax(S)| =", np.abs(p - ref.softmax(s)).max())

# %% [markdown]
# ## 3. The NumPy version, in the kernels' loop order
#
# Two loop nests, and no N x N array anywhere:
#
# ![the backward's loop orders: dK, dV down a column of tiles on chip; dQ across a row, by atomics or a second kernel](../slides/img/05_loops.png)
#
# ```
#   dK, dV: K/V tiles outer                      dQ: Q tiles outer
#   for each key tile j (Bc rows):               for each query tile i (Br rows):
#       keep K_j, V_j; dK_j = dV_j = 0               keep Q_i, dO_i, L_i, D_i; dQ_i = 0
#       for each query tile i (Br rows):             for each key tile j (Bc rows):
#           S  = tau Q_i K_j^T                           S, P, dP, dS as on the left
#           P  = exp(S - L_i)      (recomputed)          dQ_i += tau dS K_j
#           dV_j += P^T dO_i                         write dQ_i once
#           dP = dO_i V_j^T
#           dS = P * (dP - D_i)
#           dK_j += tau dS^T Q_i
#       write dK_j, dV_j once
# ```
#
# Why two nests? dK_j and dV_j sum over *query* tiles, dQ_i over *key* tiles. One loop order
# can keep only one of them on chip. With K/V tiles outer, each block owns dK_j and dV_j and
# writes them once; dQ_i receives a contribution from every key tile, i.e. from every block.

# %%
print(inspect.getsource(recompute_p))
print(inspect.getsource(ds_tile))
print(inspect.getsource(flash_backward_numpy))

# %%
got = flash_backward_numpy(q, k, v, o, lse, do, causal=True, Br=4, Bc=8)
exact = ref.attention_backward(q, k, v, o, lse, do, causal=True)
baseline = ref.attention_backward(q, k, v, o, lse, do, causal=True, dtype=np.float32)
for name, g, e, b in zip(("dq", "dk", "dv"), got, exact, baseline):
    assert_close(g, e, b, name=name)
print("the tiled NumPy backward matches the oracle")

# %% [markdown]
# ## A ladder to the kernels: you write rungs 1 and 2
#
# The two loop nests above, one **row** at a time instead of one tile, are two small kernels
# each. Write them before reading the production kernels of section 5:
#
# | rung | dK, dV | dQ | operands come from | you |
# |---|---|---|---|---|
# | 1 | a thread a key row j: loops over the query rows that see it | a thread a query row i: loops over its keys | global memory, every thread reads all of the other side | write it |
# | 2 | a block of Bc key rows shares each **query tile** (Q_i, dO_i, L_i, D_i) in shared memory | a block of Br query rows shares each **K/V tile** | shared memory, copied once a block | write it |
# | 3 | section 5: micro-tiles, two-level sums, dQ by atomics | the same, or a second kernel | shared memory, 16-byte loads | read it |
#
# Every rung takes `D = rowsum(dO * O)` from a pre-pass the launcher runs first, and
# recomputes each `P_ij = exp(scale q_i . k_j - L_i)` it needs.
#
# * **Exercise 1 (rung 1).** `make_row_per_thread_dkdv(D)` returns a kernel
#   `(q, k, v, do, lse, delta, dk, dv, scale, causal)` on `(B*H, N, d)` arrays (`lse`,
#   `delta`: `(B*H, Nq)`), grid `(ceil(Nk / threads), B*H)`: thread `j` sums, over every
#   query row `i` that sees key `j` (causal: `i >= j + Nq - Nk`), `dV_j += P_ij dO_i` and
#   `dK_j += scale dS_ij q_i` with `dS_ij = P_ij (dO_i . v_j - D_i)`.
#   `make_row_per_thread_dq(D)` returns `(q, k, v, do, lse, delta, dq, scale, causal)`:
#   thread `i` sums `dQ_i += scale dS_ij k_j` over its keys. A row with `L_i = -inf` saw
#   nothing: its P is 0. Graded by `test_row_per_thread_backward_rung_matches_oracle`.
# * **Exercise 2 (rung 2).** `make_shared_tile_dkdv(Br, Bc, D)` (Bc threads a block, thread
#   `t` takes key `Bc * blockIdx.x + t`, query tiles of Br rows through shared memory) and
#   `make_shared_tile_dq(Br, Bc, D)` (Br threads a block, K/V tiles of Bc rows), same
#   arguments as rung 1. Graded by `test_shared_tile_backward_rung_matches_oracle`.
#
# <details><summary>Hint 1: one pair (i, j)</summary>
#
# `s = q_i . k_j` and `dp = dO_i . v_j` in one loop over the head dim; then
# `p = exp(scale * s - L_i)`, `ds = p * (dp - D_i)`; then dV_j, dK_j (or dQ_i) in a second
# loop. Keep your own row (k_j, v_j and the two sums; or q_i, dO_i and dQ_i) in
# `cuda.local.array(D, float32)` arrays.
# </details>
#
# <details><summary>Hint 2: the causal bounds</summary>
#
# Key j is seen by query rows `i >= j + Nq - Nk` (and `i >= 0`); query row i sees keys
# `j < min(Nk, i + 1 + Nk - Nq)`. In rung 2 the dK/dV block starts at the first row its
# first key is seen by; each thread skips the rows before its own.
# </details>
#
# <details><summary>Hint 3 (rung 2): the barriers</summary>
#
# Copy with `for e in range(t, rows * D, threads)`, zeros past N and past d (and `L = -inf`
# past Nq); `cuda.syncthreads()`; sweep; `cuda.syncthreads()` before the next copy. Every
# thread copies and waits, also those whose own row is past N.
# </details>

# %%
from kernels.base.learner import grade, my_file

TEMPLATE = '''"""My kernels for chapter 5's ladder (graded by tests/test_flash_backward.py)."""
CHAPTER = "flash_backward"

import math

from numba import cuda, float32


def make_row_per_thread_dkdv(D):
    @cuda.jit
    def row_per_thread_dkdv(q, k, v, do, lse, delta, dk, dv, scale, causal):
        raise NotImplementedError   # your code: key row j, summed over the query rows that see it

    return row_per_thread_dkdv


def make_row_per_thread_dq(D):
    @cuda.jit
    def row_per_thread_dq(q, k, v, do, lse, delta, dq, scale, causal):
        raise NotImplementedError   # your code: query row i, summed over its keys

    return row_per_thread_dq


def make_shared_tile_dkdv(Br, Bc, D):
    @cuda.jit
    def shared_tile_dkdv(q, k, v, do, lse, delta, dk, dv, scale, causal):
        raise NotImplementedError   # your code: query tiles through shared memory

    return shared_tile_dkdv


def make_shared_tile_dq(Br, Bc, D):
    @cuda.jit
    def shared_tile_dq(q, k, v, do, lse, delta, dq, scale, causal):
        raise NotImplementedError   # your code: K/V tiles through shared memory

    return shared_tile_dq
'''

mine = my_file("my_flash_backward.py", TEMPLATE)

# %%
_ = grade(mine)

# %% [markdown]
# The course's answers: `kernels.flash_backward.make_row_per_thread_dkdv`,
# `make_row_per_thread_dq`, `make_shared_tile_dkdv`, `make_shared_tile_dq` (read them after
# yours pass); the tests call them through `row_per_thread_backward` and
# `shared_tile_backward`. The three rungs on the H100, through their launchers
# (`python -m kernels.bench.flash_backward --ladder`, `results/flash_backward_ladder.csv`):

# %%
from kernels.base.notebook import show_ladder

show_ladder("results/flash_backward_ladder.csv")

# %% [markdown]
# At B = 1, H = 16, N = 4096, d = 64 fp32 (one run, 2026-11-25): rung 1 313 ms, rung 2
# 27.0 ms, the production kernels 7.5 ms (causal: 325, 21.3, 5.5 ms). Rung 1 pays for
# every thread reading the whole other side from global memory with its rows in local
# memory; rung 2 reads each tile once a block and keeps its rows in registers (its loops run
# to the compile-time D over zero-padded tiles). One limit the tests draw around: rungs 1
# and 2 sum each gradient row over up to N rows in one float32 register, and past a couple
# of hundred rows that sum's error grows beyond the tolerance rule's (a drawn case at
# N = 300 reached 1.04x the bound); the tests grade them at N <= 160. Section 5's two-level
# sums are the fix.

# %% [markdown]
# ## 4. dQ: a second kernel, or atomics?
#
# Every key-tile block produces a piece $\tau\, dS\, K_j$ of each dQ_i. Two ways to sum them:
#
# | | **separate dQ kernel** (`dq_mode="separate"`) | **float32 atomics** (our default, and FlashAttention-2's) |
# |---|---|---|
# | how | a Q-tile-outer kernel recomputes S, P, dP, dS and sums dQ_i in registers | the dK/dV kernel adds its piece with `cuda.atomic.add` |
# | FLOPs a head | 14 N^2 d (S and dP computed twice) | 10 N^2 d |
# | HBM | + K, V streamed once per query tile | + dQ read and written once per key tile (atomics in L2) |
# | result | **bitwise identical run to run** | summation order depends on block timing: last bits differ |
#
# Floating-point addition is not associative, so the order of the additions changes the
# rounding. For debugging training runs, reproducibility is worth a lot; but the separate
# kernel's extra 4 N^2 d FLOPs cost time on the H100 (section 7 has the measured price). So
# the launcher does what FlashAttention-2 does: atomics by default, and
# `dq_mode="separate"` when bitwise reproducible gradients matter. The tests check what each
# promises: the separate path bitwise identical across runs, the atomic path within the
# tolerance rule on every run.
#
# ## 5. The kernels
#
# **Pre-pass, D = rowsum(dO * O).** One warp a row: its 32 lanes read consecutive columns
# (coalesced), then add their partial sums with chapter 4's row reduction (five warp
# shuffles; no shared memory, no barrier).

# %%
print(inspect.getsource(make_delta))

# %% [markdown]
# **dK and dV (K/V tiles outer).** Grid (Tc, B*H). One block owns Bc keys: K_j and V_j stay
# in shared memory, dK_j and dV_j in registers (and running sums, below), for the whole loop over query tiles.
# Each thread owns a *micro-tile* of every product (register tiling): for S and dP
# (Br x Bc) an AM x AN piece, for dK and dV (Bc x d) a BM x BN piece. The inner loops
# read a column of one operand and a row of the other from shared memory and do AM x AN
# fused multiply-adds into registers. Operands are read 4 floats at a time with one
# 16-byte load (`ld.shared.v4.f32` in the PTX): rows start 16-byte aligned, offsets are
# unsigned (Numba adds a negative-index wraparound to signed ones, which hides the
# alignment from the compiler). The threads of one warp share a nearly square block of S
# (32 x 32 at the d = 64 tiles: 8 x 4 lanes of 4 x 8 each), so that a step reads few distinct rows of Q and K: shared
# memory bandwidth, not the FMA units, is what a careless thread layout runs out of. And
# the next Q/dO tile is loaded from HBM into registers while the current one is being
# computed (a register prefetch), so the block rarely waits for memory. P and dS pass
# through shared memory because the
# products that consume them (P^T dO, dS^T Q) need a different thread-to-element map.
#
# **Two-level sums.** dV_j sums N products P_ij dO_i over every query row i. Summed in one
# float32 register, that is N additions into a number that grows to O(1) while each term is
# small, and every addition rounds. NumPy's matmul sums in blocks, so its error grows far
# more slowly. At N = 4096, causal, the first keys (seen by every row, P >= 0, nothing
# cancels) had a dV error 4 times float32 NumPy's, and the tolerance rule caught it. The fix
# costs no FLOPs: each thread sums about 64 query rows in registers, then adds that partial
# to a running sum it keeps in shared memory (its own slots: no barrier, no conflict). The
# long sum now has N / 64 additions; the same error measured 0.7 times NumPy's. The dQ kernel
# does the same over the keys (its error at N = 4096 went from 2.6 to 0.9 times NumPy's).
#
# ```
#   shared memory of one dkdv block (floats; rows padded by 4: 16-byte aligned, conflict-free)
#   K_j   Bc x (d+4)     loaded once
#   V_j   Bc x (d+4)     loaded once
#   Q_i   Br x (d+4)     reloaded every query tile
#   dO_i  Br x (d+4)     reloaded every query tile
#   P     Br x (Bc+4)    written by the S/dP threads, read by the dV threads
#   dS    Br x (Bc+4)    (or sharing P's buffer when 48 KB is tight: two more barriers)
#   L_i, D_i  Br each
#   running sums of dV_j, dK_j   Bc x d each (two-level sums)
# ```
#
# Causal masking (bottom-right: query i sees key j iff j <= i + Nk - Nq) skips every query
# tile that lies entirely above the key tile; fully visible and ragged tiles are masked
# element by element (P = 0 and dS = 0). A NaN or Inf in an input follows IEEE arithmetic
# into every gradient it touches (no fast-math flag that assumes finite values); only
# L = -inf has a meaning of its own: the row saw nothing, its P is 0.
#
# **Building blocks.** Both kernels do the same steps on a tile, so each step is written
# once, as a device function that a cached factory builds for the tile sizes and that the
# compiler inlines into the kernel (`@inlined`, `kernels/base/inlined.py`: its per-thread arrays
# stay registers). The S and dP micro-tiles, and P and dS from them:

# %%
print(inspect.getsource(fb._scores))

# %% [markdown]
# The dK/dV kernel's body composes the blocks: load K_j, V_j once; then, for each query tile
# of its walk, store the prefetched Q_i, dO_i, L_i, D_i, start fetching the next ones,
# compute S and dP, P and dS, accumulate dV_j and dK_j (and with atomic dQ add its piece of
# dQ_i). It walks its query tiles as chapter 4's forward walks key tiles: tile
# `tile_of(walk, t)` for t = first .. first + count - 1:

# %%
print(inspect.getsource(make_dkdv_body))

# %% [markdown]
# The kernel itself only decides which key tile a block owns and which query tiles it walks:
# with chapter 4's `every_tile` (tile t is tile t), the tiles first, first + 1, ... (causal:
# from the first tile that sees the key tile). Chapter 6 hands the same body `listed_tile`,
# which reads a list of kept tiles.

# %%
print(inspect.getsource(make_dkdv))

# %% [markdown]
# **dQ (Q tiles outer).** Grid (Tr, B*H), the heaviest causal tiles first. The same S, P,
# dP, dS recomputation, then dQ_i += dS K_j in registers, written once: every dQ entry is
# summed by one thread in a fixed order.

# %%
print(inspect.getsource(make_dq_body))

# %%
tiles = default_tiles(D_HEAD)
print("tiles here:", tiles)
from kernels.flash_backward import head_dim_bucket

print("shared memory a block (dkdv, dq), bytes:", shared_bytes(tiles, head_dim_bucket(D_HEAD)))
dq, dk, dv = flash_attention_backward(q, k, v, o, lse, do, causal=True)
for name, g, e, b in zip(("dq", "dk", "dv"), (dq, dk, dv), exact, baseline):
    assert_close(g, e, b, name=name)
print("kernel gradients match the oracle (causal, Nq != Nk, ragged tiles)")

# %% [markdown]
# ### With chapter 4's forward
#
# In training the backward consumes the O and L that the fused forward produced:

# %%
o_f, lse_f = flash_attention(q, k, v, causal=True)
got = flash_attention_backward(q, k, v, o_f, lse_f, do, causal=True)
exact_f = ref.attention_backward(q, k, v, o_f, lse_f, do, causal=True)
baseline_f = ref.attention_backward(q, k, v, o_f, lse_f, do, causal=True, dtype=np.float32)
for name, g, e, b in zip(("dq", "dk", "dv"), got, exact_f, baseline_f):
    assert_close(g, e, b, name=name)
print("forward (ch 4) + backward (ch 5) match the oracle;",
      "rows that see nothing:", int(np.isneginf(lse_f).sum()))

# %% [markdown]
# ### Determinism, checked
#
# The separate dQ kernel gives bitwise identical results; the atomic one may not (in the
# simulator the blocks run in a fixed order, so there it usually does; on a GPU it does not).

# %%
runs = [flash_attention_backward(q, k, v, o, lse, do, causal=True, dq_mode="separate")[0] for _ in range(2)]
print("separate dQ, two runs bitwise equal:", np.array_equal(*runs))
runs = [flash_attention_backward(q, k, v, o, lse, do, causal=True, dq_mode="atomic")[0] for _ in range(2)]
print("atomic dQ, two runs: max |difference| =", float(np.abs(runs[0] - runs[1]).max()))

# %% [markdown]
# ## 6. Bytes and FLOPs
#
# **FLOPs.** The backward does four N x N x d products (S, dP, dV, dK) plus dQ: 10 N^2 d a
# head, the usual 2.5 x the forward's 4 N^2 d. Our separate dQ kernel recomputes S and dP
# once more: 14 N^2 d. The bench reports TFLOP/s against the 2.5 x convention (like
# every peer), so the recomputation shows up as time, not as extra credit.
#
# **HBM traffic** (elements a head, the IO model of `kernels/base/io_model.py`):
#
# | backward | HBM elements |
# |---|---|
# | standard (S, P, dP, dS through HBM) | 7 N^2 + 10 N d + N |
# | fused, K/V tile outer (+ atomic dQ) | 6 N d + N + ceil(N/Bc) (4 N d + 2 N) |
# | fused, compulsory (each input once) | 8 N d + 3 N |
# | ours, atomic dQ (the default) | 7 N d + N + ceil(N/Bc)(4 N d + 2 N) |
# | ours, separate dQ | 9 N d + 3 N + ceil(N/Bc)(2 N d + 2 N) + ceil(N/Br) 2 N d |

# %%
d = 64
gpu_tiles = BackwardTiles()     # the d = 64 production tiles (Bc = 128 for dK/dV, Br = 128 for dQ)
print("MB a head, fp32, d = 64")
print(f"{'N':>6} {'standard':>10} {'fused (table)':>13} {'ours':>8} {'compulsory':>11} {'standard/ours':>14}")
for n in (1024, 2048, 4096, 8192, 16384):
    std = standard_backward_bytes(1, 1, n, d) / 1e6
    perf = 4 * (6 * n * d + n + math.ceil(n / gpu_tiles.Bc) * (4 * n * d + 2 * n)) / 1e6
    ours = io_model_bytes(1, 1, n, n, d, gpu_tiles) / 1e6
    compulsory = 4 * (8 * n * d + 3 * n) / 1e6
    print(f"{n:>6} {std:>10.1f} {perf:>13.1f} {ours:>8.1f} {compulsory:>11.2f} {std / ours:>14.2f}")

# %% [markdown]
# The fused backward still streams the query side (Q, dO, L, D) once per key tile, so by
# this model its traffic grows like N^2 too: 4 N^2 d / Bc against the standard 7 N^2, only
# 3.5 x less at d = 64, Bc = 128. Two things make the difference in practice. The blocks of one
# head that run at the same time stream the *same* Q and dO tiles, so most of that stream
# is served by L2, and the HBM traffic falls toward the compulsory 8 N d + 3 N (measured
# below). And nothing N x N is ever *stored*: the memory table after that is where the
# standard backward loses for good.
#
# ### Measured bytes
#
# `python -m kernels.bench.traffic` (see its docstring) runs one call of
# `flash_attention_backward` at B=4 H=16 N=4096 d=64, fp32, non-causal, under Nsight
# Compute and counts two levels of the memory hierarchy, as chapter 4 did for the forward:
# the **DRAM bytes** (`dram__bytes_read.sum` + `dram__bytes_write.sum`, what reaches HBM)
# and the **bytes the SMs read from L2** (`lts__t_sectors_srcunit_tex_op_read.sum` x 32 B).
# The IO model assumes nothing between on-chip memory and HBM, so it is a prediction of
# the second, not the first. The committed H100 numbers, from
# `results/flash_backward_dram.csv`:

# %%
def measured_bytes(name="flash_backward_dram.csv"):
    """Rows of the Nsight Compute traffic table, bytes in GB, or None when not committed."""
    from kernels.bench.harness import RESULTS_DIR, read_csv

    path = RESULTS_DIR / name
    if not path.exists():
        return None
    env, rows = read_csv(path)
    table = []
    for r in rows:
        ex = dict(kv.split("=", 1) for kv in r["extra"].split(";") if "=" in kv)
        if "l2_read_bytes" not in ex:
            continue
        table.append({"mode": ex.get("case", r["kernel"]).removeprefix("bwd-"),
                      "model": r["model_bytes"] / 1e9,
                      "l2_read": float(ex["l2_read_bytes"]) / 1e9,
                      "dram": float(ex["dram_total_bytes"]) / 1e9,
                      "compulsory": float(ex["compulsory_bytes"]) / 1e9,
                      "kernels": ex.get("kernels_dram_GB/l2_GB", "")})
    return env, table


traffic = measured_bytes()
if traffic and traffic[1]:
    env, table = traffic
    print("device:", env.get("device"), "| driver:", env.get("driver"), "| numba-cuda:", env.get("numba-cuda"))
    print(f"{'dQ mode':>9} {'IO model GB':>12} {'L2->SM GB':>10} {'DRAM GB':>8} {'compulsory GB':>14}")
    for r in table:
        print(f"{r['mode']:>9} {r['model']:>12.2f} {r['l2_read']:>10.2f} {r['dram']:>8.3f} {r['compulsory']:>14.3f}")
    for r in table:
        kernels_ = ", ".join(part.replace(":", " ") for part in r["kernels"].split(","))
        print(f"  {r['mode']}, per kernel (DRAM GB / L2->SM GB): {kernels_}")
    # The model's streaming term: every key tile re-reads Q, dO, L and D of its head.
    b_, h_, n_, d_ = 4, 16, 4096, 64
    tc = math.ceil(n_ / gpu_tiles.Bc)
    stream = tc * (2 * n_ * d_ + 2 * n_) * b_ * h_ * 4 / 1e9
    print(f"the model's Q, dO, L, D stream (Tc = {tc} key tiles): {stream:.2f} GB")
else:
    print("GPU results are not committed yet (workbook/results/flash_backward_dram.csv): "
          "run `python -m kernels.bench.traffic` under Nsight Compute on a GPU.")

# %% [markdown]
# What the table says (H100, rounded):
#
# * **DRAM sits near the compulsory bytes.** 0.74 GB (atomic dQ) and 0.88 GB (separate)
#   against 0.54 GB compulsory (Q, K, V, O, dO read once; dQ, dK, dV written once; L and
#   D), and against 9.1 GB in the IO model. The re-streamed Q and dO tiles come from the
#   50 MB L2, and the atomic adds to dQ happen in L2 too: almost none of the model's
#   N^2 terms reach HBM.
# * **The bytes the SMs read from L2 follow the model's streaming term.** With atomic dQ,
#   Tc = 32 key tiles each stream Q, dO, L and D of their head: 32 x (2 N d + 2 N) x 64
#   heads x 4 B = 4.36 GB predicted, 4.32 GB measured (0.13 GB of it is the D pre-pass
#   reading O and dO, 4.18 GB the dK/dV kernel).
# * **Why the whole model (9.1 GB) sits above that.** It also counts a read and a write of
#   dQ per key tile (4.3 GB). On the GPU those are `atomicAdd`s that the L2 executes
#   itself: the SM sends the value, it does not read dQ, so they are not in the L2 -> SM
#   column.
# * **Separate dQ** adds the dQ kernel's own streams of K and V (one per query tile):
#   7.39 GB from L2 in all, 3.62 GB for the dK/dV kernel and 3.64 GB for the dQ kernel;
#   its DRAM bytes rise to 0.88 GB.
#
# So, as for the forward, the IO argument holds between on-chip memory and what lies
# behind it; on the H100 at this size that is mostly L2, which keeps the re-reads off HBM.
#
# ### Peak memory
#
# Peak memory of forward + backward at B = 4, H = 16, d = 64, fp32, beyond the inputs
# q, k, v and dO: the fused path keeps O, L, then allocates dQ, dK, dV and D; the standard
# path keeps P (N x N) from the forward and needs dP and dS (N x N each) in the backward.

# %%
b_, h_ = 4, 16
print(f"{'N':>6} {'fused GB':>9} {'standard (P, dP, dS) GB':>24}")
for n in (1024, 4096, 16384, 65536):
    fused = 4 * b_ * h_ * (n * d + n + 3 * n * d + n) / 1e9
    standard = 4 * b_ * h_ * (n * d + 3 * n * n + 3 * n * d) / 1e9
    print(f"{n:>6} {fused:>9.3f} {standard:>24.1f}")

# Measured on the H100 at N = 4096 (the bench's peak_mem_mb: device memory one call allocates).
from kernels.bench.harness import RESULTS_DIR, read_csv

if (RESULTS_DIR / "flash_backward.csv").exists():
    for r in read_csv(RESULTS_DIR / "flash_backward.csv")[1]:
        if ("forward + backward" in r["kernel"] and "N=4096" in r["config"]
                and "causal=False" in r["config"] and r["peak_mem_mb"] == r["peak_mem_mb"]):
            print(f"measured, N = 4096: {r['kernel']:<45} {r['peak_mem_mb'] / 1e3:8.3f} GB")
else:
    print("GPU results are not committed yet (workbook/results/flash_backward.csv)")

# %% [markdown]
# At N = 16384 the standard path needs about 207 GB: it cannot run on an 80 GB card; the fused
# path needs about 1.1 GB. The measured peaks at N = 4096 agree: 0.268 GB for chapter 4's
# forward + this backward (the table: 0.271 GB), and 17.3 GB for plain PyTorch through
# autograd (17.4 GB for SDPA's math backend). That is more than the table's 13.2 GB: it is as
# many bytes as four N x N float32 matrices (17.2 GB) plus two N x d arrays, one N x N
# matrix more than the three the table counts. SDPA's memory-efficient backend, which
# recomputes like ours, peaks at 0.41 GB.
#
# ## 7. Results on the H100
#
# `python -m kernels --chapters 5` measures, in one run: the backward alone (atomic and
# separate dQ, causal and not), forward + backward with chapter 4's kernel, the backward of
# plain PyTorch fp32 and of SDPA's math and memory-efficient backends through autograd,
# an N sweep and a tile sweep. The committed results:

# %%
from kernels.bench.harness import show_results

rows_ = show_results("flash_backward", ("kernel", "config", "median_ms", "tflops", "peak_mem_mb"))

# %% [markdown]
# The same run as a picture (`results/flash_backward.png`): the backward's time against N
# beside PyTorch's backends, its time over the best of them, and what causal masking saves.
#
# ![chapter 5 results on the H100](results/flash_backward.png)

# %% [markdown]
# ### What the fp32 peer executes
#
# Nsight Compute on SDPA's memory-efficient kernels with fp32 inputs
# (`python -m kernels.bench.peer_pipes`, B=4 H=16 N=4096; chapter 4 shows the forward's
# rows): the backward kernels (`fmha_cutlassB_f32_aligned_64x64_k64_sm80` at d = 64,
# `fmha_cutlassB_f32_aligned_128x64_k128_sm80` at d = 128) execute tensor-core `mma`
# instructions, and their count times 2048 FLOPs (one TF32 `mma.sync` m16n8k8) is **3.00x
# the FLOPs the backward needs** (2.5 x 4 B H N^2 d), measured, with about as many FMA-pipe
# cycles as tensor-pipe cycles. Our reading of the counters: each fp32 product is computed
# as three TF32 tensor-core products (the "3xTF32" split of each operand into a large and a
# small TF32 part, which keeps about fp32 accuracy), and the FMA pipe does the splitting
# and the elementwise work (P rebuilt from L, dS).
#
# So the goal this chapter measures itself against, SDPA's memory-efficient backward at
# 19.6 to 20.1 ms against our 22.9 to 23.5 ms at the reference size, is set by a kernel whose
# products run on the tensor cores, while ours runs every product on the fp32 FMA units
# (Numba exposes no tensor-core instruction). Two peers are FMA-only: plain PyTorch's
# autograd with TF32 off (`torch.backends.cuda.matmul.allow_tf32` is False there), which our
# backward beats as a bare kernel (23.5 against 24.6 ms in the run of 2026-11-24; through
# the launcher, 25.4 ms: 1.03x slower), and SDPA's unfused math backend, whose backward
# (21.7 ms) beats ours either way. What ours wins is memory (0.27 GB against 17 GB for
# forward + backward) and the forward + backward together (33.1 ms against 37.5 and 37.9). The counters, per kernel (`ms` is the one profiled call):

# %%
def show_pipes():
    """SDPA memory-efficient kernels under Nsight Compute, from results/sdpa_pipes.csv."""
    from kernels.bench.harness import RESULTS_DIR, read_csv

    path = RESULTS_DIR / "sdpa_pipes.csv"
    if not path.exists():
        print("The Nsight Compute result is not committed (workbook/results/sdpa_pipes.csv): run "
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
# **Why this speed.** Nsight Compute on the dK/dV kernel (atomic dQ) at the reference
# configuration B=4 H=16 N=4096 d=64, on the same H100:
#
# | | dK/dV kernel (this chapter) | forward (chapter 4, d = 64) |
# |---|---|---|
# | time under the profiler | 22.7 ms | |
# | registers a thread | 254 (no local-memory spills) | 251 |
# | dynamic shared memory a block | 204 KB | 169 KB |
# | blocks an SM | 1 of 8 warps (12.5% occupancy) | |
# | issue slots busy | 64% | 72% |
# | instructions issued that are FFMA | ~70% | |
# | L2 hit rate; DRAM throughput | 97%; 0.7% of peak | |
#
# About 70% of 64% of the issue slots are FFMAs: the FMA pipe runs at about 45% of its
# peak. Memory is not the limit (DRAM throughput under 1%, L2 hits 97%). With one block of
# 8 warps an SM, each of the 4 schedulers has two warps to choose from: when both wait on
# a shared-memory load or a barrier, the slot goes unused. The kernel is bound by latency
# and instruction issue, not by memory; the registers (254) and the shared memory (204 KB)
# that the large tiles need are what leave no room for a second block.

# %% [markdown]
# On a GPU, a quick timing of your own (the bench does it properly):

# %%
if TIME is not None:
    from numba import cuda

    from kernels.base.runtime import time_fn

    b_, h_, n_, d_ = TIME
    rng = np.random.default_rng(1)
    qd, kd, vd, dod = (cuda.to_device(random_array(rng, (b_, h_, n_, d_))) for _ in range(4))
    od, lsed = flash_attention(qd, kd, vd)
    flops = 2.5 * 4 * b_ * h_ * n_ * n_ * d_
    for mode in ("atomic", "separate"):
        # products="fma": this chapter's kernels (on this GPU the default is chapter 11's 3xTF32 backward)
        t = time_fn(lambda: flash_attention_backward(qd, kd, vd, od, lsed, dod, dq_mode=mode, products="fma"), [()])
        print(f"{mode:>9} dQ: {t.median_ms:.2f} ms, {flops / t.median_ms / 1e9:.1f} TFLOP/s")
else:
    print("no timing in the simulator")

# %% [markdown]
# ## 8. Exercises
#
# ### Exercise 1: dS for one tile
#
# Write `my_ds(p, dp, delta)`: given one tile of P and dP (Br x Bc, any leading batch axes)
# and the tile's rows of D = rowsum(dO * O) (Br), return dS. The checker draws attention
# problems (ragged, causal, Nq != Nk, big logits), builds the tiles from the oracle and
# compares your dS with the closed form.

# %%
def my_ds(p, dp, delta):
    # your code here: return dS (same shape as p)
    raise NotImplementedError


# %%
def ds_prop(fn):
    """The property: fn(P, dP, D) is the oracle's dS = P * (dP - rowsum(dO * O))."""
    def prop(case):
        nq, nk = case.q.shape[-2], case.k.shape[-2]
        o_, lse_ = ref.attention(case.q, case.k, case.v, causal=case.causal, scale=case.scale)
        do_ = random_array(np.random.default_rng(nq * 31 + nk), o_.shape).astype(np.float64)
        sc = 1 / math.sqrt(case.q.shape[-1]) if case.scale is None else case.scale
        s_ = sc * case.q.astype(np.float64) @ np.swapaxes(case.k, -1, -2)
        if case.causal:
            s_ = np.where(ref.causal_mask(nq, nk), s_, -np.inf)
        p_ = recompute_p(s_, lse_)
        dp_ = do_ @ np.swapaxes(case.v, -1, -2)
        delta_ = np.sum(do_ * o_, axis=-1)
        got_ = np.asarray(fn(p_, dp_, delta_), dtype=np.float64)
        want = p_ * (dp_ - np.sum(p_ * dp_, axis=-1, keepdims=True))
        assert got_.shape == want.shape, f"shape {got_.shape}, expected {want.shape}"
        if want.size:
            assert np.allclose(got_, want, rtol=1e-9, atol=1e-9 * max(1.0, np.abs(want).max())), \
                f"max error {np.abs(got_ - want).max():.3g}"
    return prop


_ = check_exercise(ds_prop(my_ds), attention_cases(max_n=12, max_d=6), host=True)

# %% [markdown]
# The checker on the module's `ds_tile`:

# %%
_ = check_exercise(ds_prop(ds_tile), attention_cases(max_n=12, max_d=6), host=True)

# %% [markdown]
# ### Exercise 2: rebuild P from L
#
# Write `my_p(s, lse)`: one tile of scaled scores S (with -inf where masked) and the rows'
# L (-inf for a row that saw nothing). Return P = exp(S - L), with 0 where masked and on
# empty rows, and no NaN or warning anywhere.

# %%
def my_p(s, lse):
    # your code here
    raise NotImplementedError


# %%
def p_prop(fn):
    """The property: fn(S, L) is softmax(S) row by row (0 rows where nothing is visible)."""
    def prop(case):
        nq, nk = case.q.shape[-2], case.k.shape[-2]
        _, lse_ = ref.attention(case.q, case.k, case.v, causal=case.causal, scale=case.scale)
        sc = 1 / math.sqrt(case.q.shape[-1]) if case.scale is None else case.scale
        s_ = sc * case.q.astype(np.float64) @ np.swapaxes(case.k, -1, -2)
        if case.causal:
            s_ = np.where(ref.causal_mask(nq, nk), s_, -np.inf)
        with np.errstate(divide="raise", invalid="raise"):
            got_ = np.asarray(fn(s_, lse_), dtype=np.float64)
        want = ref.softmax(s_)
        assert got_.shape == want.shape, f"shape {got_.shape}, expected {want.shape}"
        assert not np.isnan(got_).any(), "NaN in P"
        if want.size:
            assert np.allclose(got_, want, rtol=1e-9, atol=1e-12), f"max error {np.abs(got_ - want).max():.3g}"
    return prop


_ = check_exercise(p_prop(my_p), attention_cases(max_n=12, max_d=6), host=True)

# %% [markdown]
# The checker on the module's `recompute_p`:

# %%
_ = check_exercise(p_prop(recompute_p), attention_cases(max_n=12, max_d=6), host=True)

# %% [markdown]
# ### Exercise 3 (on paper)
#
# 1. The dK/dV kernel holds dK_j and dV_j (Bc x d each) in registers. At Bc = 64, d = 64 and
#    128 threads, how many float registers a thread is that? What does it leave for S and dP?
# 2. With atomics, each dK/dV block adds Br x d partial dQ values per query tile. How many
#    atomic adds does one backward at B=4, H=16, N=4096, d=64, Bc=64 issue?
# 3. Why does the dQ kernel start with the *last* query tiles under causal masking?
