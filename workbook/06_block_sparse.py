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
# # 6. Block-sparse FlashAttention, forward and backward
#
# Chapter 4's fused forward visits every (query tile, key tile) pair: Tr x Tc tiles, each
# costing 4 Br Bc d FLOPs and a load of a K and a V tile. Many attention patterns used in
# practice (local windows, global tokens, strided and butterfly patterns) say in advance
# that most of those pairs contribute nothing. A **block mask** records that decision tile
# by tile, and the kernel simply **skips the tiles that are off**:
#
# ```
#          key tiles  c = 0 1 2 3 4 5 6 7          what the kernel does for query tile r = 3
#  query   r = 0      [x x . . . . . . ]
#  tiles   r = 1      [x x x . . . . . ]           for c in kept[3] = [2, 3, 4]:   (not range(8))
#          r = 2      [. x x x . . . . ]               load K_c, V_c
#          r = 3      [. . x x x . . . ]  <--          S = Q_r K_c^T, online softmax, O += P V_c
#          r = 4      [. . . x x x . . ]
#          ...                                   3 tiles of 8: 3/8 of the FLOPs and K/V bytes
# ```
#
# Everything of chapters 4 and 5 carries over: the online softmax does not care *which* key
# tiles it sees, only that it sees every tile that matters. What is new:
#
# 1. the **mask** (`BlockMask`): one flag per (query block, key block), with its block size;
# 2. the **patterns** that produce masks, as pictures;
# 3. the **compact lists**: per query tile the kept key tiles (CSR), per key tile the kept
#    query tiles (for the backward), so that a kernel's loop runs over kept tiles only;
# 4. **empty rows**: a query whose row has no kept tile gets O = 0, L = -inf, zero gradients;
# 5. the **IO model** with the kept fraction rho, and measured time against rho;
# 6. what sparsity costs in **accuracy** on an input with local structure.
#
# **Sources** (numbered as in the README's list): [1] FlashAttention, Section 3.3 (block-
# sparse FlashAttention) and Proposition 4 (Θ(Nd + N²d²M⁻¹s) HBM accesses for a fraction s
# of kept blocks).

# %%
import inspect

import numpy as np

import kernels  # noqa: F401  (GPU or simulator, chosen before Numba is imported)
from kernels import reference as ref
from kernels import sparsity_patterns as sp
from kernels.block_sparse import (block_sparse_attention, forward_tiles, io_model_bytes, listed_tile,
                                  make_block_sparse_forward, tile_lists)
from kernels.block_sparse_backward import block_sparse_attention_backward, make_listed_dkdv
from kernels.base.runtime import device_name, on_simulator
from kernels.base.notebook import show_source
from kernels.base.testing import assert_close, check_exercise

print("running on:", device_name())

# %% tags=["parameters"]
# Tiny sizes in the simulator (every GPU thread is a Python thread there), real ones on a GPU.
if on_simulator():
    B, H, N, D_HEAD, BLOCK = 1, 1, 33, 6, 8      # kernel checks
else:
    B, H, N, D_HEAD, BLOCK = 2, 4, 1000, 64, 64
N_STUDY = 512                                    # the accuracy study (NumPy only)

# %% [markdown]
# ## 1. The mask
#
# `BlockMask(flags, block_q, block_k)`: `flags[r, c]` keeps the tile of queries
# `[r*block_q, (r+1)*block_q)` and keys `[c*block_k, (c+1)*block_k)`. The flags are
# (Tq, Tk) for a mask shared by every head, (H, Tq, Tk) per head, or (B, H, Tq, Tk), with
# Tq = ceil(Nq / block_q), Tk = ceil(Nk / block_k): the last block may be partial. The
# oracle expands the flags to one boolean per score and masks with -inf:

# %%
flags = np.array([[1, 0, 1],
                  [0, 1, 0]], dtype=bool)
mask = ref.BlockMask(flags, 4, 3)
print("tiles for Nq=7, Nk=8:", mask.tiles_for(7, 8), " density:", round(mask.density, 3))
print(ref.expand_block_mask(mask, 7, 8).astype(int))

# %% [markdown]
# ### The NumPy version
#
# The block-sparse forward in NumPy is chapter 4's tiled loop with one change: the inner
# loop walks the kept key tiles of the row, not all of them. Rows with no kept tile keep
# l = 0 and give O = 0, L = -inf.

# %%
def block_sparse_numpy(q, k, v, mask, causal=False, scale=None):
    """One head: q (Nq, d), k and v (Nk, d), mask flags (Tq, Tk). float64."""
    nq, nk, d = q.shape[0], k.shape[0], q.shape[1]
    scale = 1 / np.sqrt(d) if scale is None else scale
    bq, bk = mask.block_q, mask.block_k
    o, lse = np.zeros((nq, d)), np.full(nq, -np.inf)
    for r in range(-(-nq // bq)):
        rows = slice(r * bq, min((r + 1) * bq, nq))
        qi = np.arange(nq)[rows]
        m = np.full(len(qi), -np.inf)
        l = np.zeros(len(qi))
        acc = np.zeros((len(qi), d))
        for c in np.flatnonzero(mask.flags[r]):          # the kept key tiles only
            cols = slice(c * bk, min((c + 1) * bk, nk))
            kj = np.arange(nk)[cols]
            s = scale * q[rows] @ k[cols].T
            if causal:
                s = np.where(kj[None, :] <= qi[:, None] + (nk - nq), s, -np.inf)
            m_new = np.maximum(m, s.max(axis=1))
            safe = np.where(np.isfinite(m_new), m_new, 0.0)
            p = np.exp(s - safe[:, None])
            alpha = np.exp(np.where(np.isfinite(m), m - safe, -np.inf))
            l = alpha * l + p.sum(axis=1)
            acc = alpha[:, None] * acc + p @ v[cols]
            m = m_new
        seen = l > 0
        o[qi[seen]] = acc[seen] / l[seen, None]
        lse[qi[seen]] = m[seen] + np.log(l[seen])
    return o, lse


rng = np.random.default_rng(0)
q1, k1, v1 = (rng.standard_normal((n, 5)) for n in (7, 8, 8))
o_np, lse_np = block_sparse_numpy(q1, k1, v1, mask, causal=True)
o_ref, lse_ref = ref.attention(q1, k1, v1, causal=True, block_mask=mask)
print("max |O - oracle| =", np.abs(o_np - o_ref).max(), "| L:", lse_np.round(3))

# %% [markdown]
# ## 2. The patterns
#
# `kernels/sparsity_patterns.py` builds the usual ones; each returns a `BlockMask`. On a
# 1024 x 1024 score matrix with 64 x 64 blocks (16 x 16 tiles):
#
# * **sliding window**: each query tile sees the key tiles within `window` of its diagonal
#   (Longformer's local attention);
# * **global + local**: the band plus global tiles: the first tile rows see everything and
#   every row sees the first tile columns (Longformer/BigBird global tokens);
# * **strided**: every `stride`-th tile diagonal (Sparse Transformer's strided pattern);
# * **butterfly**: tile (r, c) kept when r XOR c is 0 or a power of two. This is the support
#   of a product of butterfly factor matrices (the "flat block butterfly" of Pixelated
#   Butterfly, Chen, Dao et al. 2022), the fixed pattern the FlashAttention paper uses in
#   its block-sparse experiments: log2(T) + 1 tiles a row, so rho = (log2 T + 1) / T;
# * **random**: each tile kept with probability `density` (seeded), the diagonal kept.

# %%
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, len(sp.PATTERNS), figsize=(3.1 * len(sp.PATTERNS), 3.3))
for ax, (name, make) in zip(axes, sp.PATTERNS.items()):
    m = make(1024, 1024, 64)
    ax.imshow(m.flags, cmap="Blues", vmin=0, vmax=1.3, interpolation="nearest")
    ax.set_title(f"{name}\nrho = {m.density:.2f}", fontsize=10)
    ax.set_xlabel("key tile c")
    ax.set_xticks([])
    ax.set_yticks([])
axes[0].set_ylabel("query tile r")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 3. The compact lists
#
# The kernel must not test Tc flags per query tile (at N = 16384 and 64-wide tiles that is
# 256 flags per row, most of them off); it should jump from kept tile to kept tile. The
# launcher builds, once per call and on the host with NumPy, a CSR structure:
#
# * `row_ptr[g*Tr + r] : row_ptr[g*Tr + r + 1]` is the slice of `col_idx` holding the kept
#   key tiles of query tile r (for mask group g: 0 for a shared mask, h or b*H + h otherwise);
# * for the backward, the transpose (CSC): `col_ptr` and `row_idx`, the kept query tiles of
#   each key tile, for the kernel that owns a K/V tile.
#
# With `causal`, tiles wholly above the diagonal (their first key after the last query of
# the tile, bottom-right aligned) are dropped from the lists here, once, and the kernel
# masks element by element only in the tiles that the diagonal crosses.
#
# The kernel tiles (Br, Bc) must divide the mask's blocks: then each kernel tile lies in
# one mask block and takes its flag. The launcher picks the largest power of two (up to its
# production tile) that divides the mask block; explicit `tiles` (chapter 4's `Tiles`) that
# do not divide it are refused with a `ValueError` naming `block_mask`.

# %%
m = sp.sliding_window(16, 16, block=4, window=1)
lists = tile_lists(m, 16, 16, Br=4, Bc=4, causal=True)
print(m.flags.astype(int))
print("row_ptr:", lists.row_ptr, " col_idx:", lists.col_idx, " (causal: the upper tiles are gone)")
print("col_ptr:", lists.col_ptr, " row_idx:", lists.row_idx)
print("kept fraction rho =", lists.kept_fraction)
# The same mask seen by 2 x 4 kernel tiles: each mask block row becomes two kernel rows.
print("Br=2:", tile_lists(m, 16, 16, Br=2, Bc=4).row_ptr)

# %% [markdown]
# ## 4. The forward kernel
#
# Nothing of chapter 4's per-tile work is written again. Chapter 4 wrote everything a block
# does for its query tile as one device function, `attend` (from
# `make_attend_query_tile(Br, Bc, D, TM, TX, prefetch, tile_of)`): load `Q_i`, then for each
# K/V tile load `K_j`, `V_j`, compute `S`, mask, update (m, l, O), add `P V_j`, and finally
# write `O / l` and `L`. Which K/V tiles it visits is its last parameter, `tile_of(walk, t)`:
# chapter 4 passes `every_tile` (tile t is tile t), this chapter passes `listed_tile` (tile
# t is entry t of the compact list). So the new kernel is only the walk: a block finds its
# query tile (longest list first, `row_order`) and the slice of `col_idx` that lists its
# kept K/V tiles, and hands both to chapter 4's `attend`:

# %%
print(inspect.getsource(listed_tile))
show_source(make_block_sparse_forward, "attend = make_attend_query_tile", "return block_sparse_forward")

# %% [markdown]
# With every tile kept and the same tiles, the result is chapter 4's bit for bit (a test
# checks it); with a fraction rho of the tiles kept, a block does rho of the work. The tiles
# are chapter 4's, shrunk to divide the mask's blocks: at d = 64 and 128 x 128 mask blocks,
# Br = 128, Bc = 64, 8 x 8 micro-tiles, 128 threads (chapter 4's default Br = 256 would
# straddle two mask blocks). fp16 inputs work as in chapter 4.

# %%
# (tiles, padded head dim) the launcher picks for d = 64 and 128 x 128 blocks (the simulator's tiles are tiny)
print(forward_tiles(64, sp.dense(256, 256, block=128)))

# %% [markdown]
# ### Check against the oracle
#
# Per-head random masks, causal, ragged N (not a multiple of the block), Nq != Nk:

# %%
rng = np.random.default_rng(1)
nq, nk = N, N + 7
q = rng.standard_normal((B, H, nq, D_HEAD)).astype(np.float32)
k = rng.standard_normal((B, H, nk, D_HEAD)).astype(np.float32)
v = rng.standard_normal((B, H, nk, D_HEAD)).astype(np.float32)
tq, tk = -(-nq // BLOCK), -(-nk // BLOCK)
mask = ref.BlockMask(rng.random((H, tq, tk)) < 0.5, BLOCK, BLOCK)
for causal in (False, True):
    o, lse = block_sparse_attention(q, k, v, mask, causal=causal)
    exact = ref.attention(q, k, v, causal=causal, block_mask=mask)
    f32 = ref.attention(q, k, v, causal=causal, block_mask=mask, dtype=np.float32)
    assert_close(o, exact[0], f32[0], name="O")
    assert_close(lse, exact[1], f32[1], name="L")
    empty = int(np.isinf(lse).sum())
    print(f"causal={causal}: O and L agree with the oracle; {empty} rows see nothing (O = 0, L = -inf)")

# %% [markdown]
# A mask with every tile kept is dense attention, and must give chapter 4's answer:

# %%
dense_mask = sp.dense(nq, nk, block=BLOCK)
o_bs, lse_bs = block_sparse_attention(q, k, v, dense_mask, causal=True)
try:
    from kernels.flash_forward import flash_attention

    o_fa, lse_fa = flash_attention(q, k, v, causal=True)
    print("max |block-sparse(dense mask) - flash_attention| =", float(np.abs(o_bs - o_fa).max()))
except ImportError:
    o_fa, _ = ref.attention(q, k, v, causal=True)
    print("max |block-sparse(dense mask) - oracle| =", float(np.abs(o_bs - o_fa).max()))

# %% [markdown]
# ## 5. The backward
#
# Chapter 5's recomputing backward, over kept tiles. Every kept tile (i, j) rebuilds
# P = exp(scale S - L) and dS = P * (dP - D) and contributes to three sums: dV_j and dK_j
# (summed over the kept query tiles of column j) and dQ_i (summed over the kept key tiles of
# row i). So the backward is chapter 5's kernels, unchanged, walking lists: chapter 5's
# kernel bodies visit the tiles `tile_of(walk, t)`, t = first .. first + count - 1, and
# here `tile_of` is the forward's `listed_tile`:
#
# * **dK, dV** (both modes), K/V tile outer: the block of key tile j walks the *column*
#   lists, the transposed mask (CSC): `row_idx[col_ptr[g*Tc + j] : col_ptr[g*Tc + j + 1]]`
#   in place of chapter 5's range of query tiles; with atomic dQ it also adds its Br x d
#   piece of dQ_i for every kept tile.
# * **dQ** (separate mode), Q tile outer: the block of query tile i walks the *row* lists
#   (CSR, the forward's): `col_idx[row_ptr[g*Tr + i] : row_ptr[g*Tr + i + 1]]`.
#
# Everything else is chapter 5's: the D pre-pass, the tiles (fitted to the mask's blocks),
# the register prefetch of the next tile (its index read before the barriers), the
# two-level sums, and the choice of `dq_mode`:
#
# | | **float32 atomics** (`dq_mode="atomic"`, the default) | **separate dQ kernel** (`dq_mode="separate"`) |
# |---|---|---|
# | kernels | D pre-pass (it also clears dQ), then **one** dK/dV kernel | D pre-pass, the dK/dV kernel, then the dQ kernel |
# | walks | the column lists (CSC) only | the column lists, then the row lists (CSR) |
# | dQ | each kept tile adds scale dS K_j into dQ_i with `cuda.atomic.add` | Q tile outer: dQ_i summed in registers, written once |
# | P, dP | computed once per kept tile | computed twice per kept tile (once per kernel) |
# | result | dK, dV bitwise reproducible; dQ's last bits vary run to run (the order of the atomic adds), within the tolerance every run | **bitwise identical run to run** |
#
# The whole of chapter 6's dK/dV kernel: which key tile a block owns (the longest lists
# first) and where its list starts; the body is chapter 5's.

# %%
print(inspect.getsource(make_listed_dkdv))

# %% [markdown]
# ### Check against the oracle
#
# Both modes against the float64 oracle (per-head random masks, ragged N, Nq != Nk), and
# the separate mode's promise: two runs, bit for bit the same.

# %%
do = rng.standard_normal(q.shape).astype(np.float32)
for causal, dq_mode in ((False, "atomic"), (True, "atomic"), (True, "separate")):
    o64, lse64 = ref.attention(q, k, v, causal=causal, block_mask=mask)
    o32, lse32 = o64.astype(np.float32), lse64.astype(np.float32)
    got = block_sparse_attention_backward(q, k, v, o32, lse32, do, mask, causal=causal, dq_mode=dq_mode)
    exact = ref.attention_backward(q, k, v, o32, lse32, do, causal=causal, block_mask=mask)
    f32 = ref.attention_backward(q, k, v, o32, lse32, do, causal=causal, block_mask=mask, dtype=np.float32)
    for g, e, b_, name in zip(got, exact, f32, ("dQ", "dK", "dV")):
        assert_close(g, e, b_, name=name)
    print(f"causal={causal}, dq_mode={dq_mode!r}: dQ, dK, dV agree with the oracle")
again = block_sparse_attention_backward(q, k, v, o32, lse32, do, mask, causal=True, dq_mode="separate")
print("separate dQ, a second run is bit-identical:", all(np.array_equal(a, b_) for a, b_ in zip(got, again)))

# %% [markdown]
# On a GPU, two atomic runs give the same dK and dV and a dQ that differs in its last bits
# (in the simulator the blocks run in a fixed order, so there the atomic runs usually
# agree too); the tests check every atomic run against the tolerance rule.

# %% [markdown]
# ## 6. Bytes and FLOPs
#
# With a fraction rho of the Tr x Tc tiles kept, the forward does rho of the dense FLOPs
# (4 N^2 d rho per head) and reads K and V only for kept tiles. The IO model (`kernels/base/io_model.py`),
# elements per head:
#
# $$\text{HBM}_{\text{fwd}} = 2Nd + N + 2Nd \left\lceil \tfrac{N}{B_r} \right\rceil \rho$$
#
# Q is read and O written once whatever rho is; the K/V stream, the big term, shrinks with
# rho. The backward (10 N^2 d rho FLOPs a head, 14 N^2 d rho with the separate dQ kernel)
# is chapter 5's model with the per-tile terms scaled by rho. With atomic dQ: the pre-pass
# reads O and dO, writes D and clears dQ; the dK/dV kernel reads K, V and writes dK, dV
# once, and per kept tile reads Q_i, dO_i, L_i, D_i and reads and writes dQ_i (the atomic
# adds):
#
# $$\text{HBM}_{\text{bwd, atomic}} = 7Nd + N + \left\lceil \tfrac{N}{B_c} \right\rceil \rho\,(4Nd + 2N)$$
#
# The separate dQ kernel streams K_j and V_j per kept tile instead of dQ_i's round trip:
# 9Nd + 3N + rho (ceil(N/Br) 2Nd + ceil(N/Bc)(2Nd + 2N)). The time should shrink with rho
# too, as long as the kept tiles keep every SM busy: rows of very different lengths (global
# tokens) make some blocks run much longer.

# %%
from kernels.block_sparse_backward import io_model_bytes as backward_model_bytes

n, d, Br = 4096, 64, 128   # the forward's production query tile at d = 64
bBr, bBc = 128, 128        # the backward's production tiles at d = 64: dQ kernel Br, dK/dV kernel Bc
print(f"B=4 H=16 N={n} d={d} fp32; forward Br={Br}, backward: dK/dV Bc={bBc}, dQ Br={bBr}")
print(f"{'rho':>8}{'fwd GFLOP':>11}{'fwd model MB':>14}{'bwd GFLOP':>11}{'bwd atomic MB':>15}{'bwd separate MB':>17}")
for rho in (1.0, 0.5, 0.25, 0.125, 0.0625):
    fwd_mb = io_model_bytes(4, 16, n, n, d, Br=Br, rho=rho) / 1e6
    bwd_mb = {mode: backward_model_bytes(4, 16, n, n, d, Br=bBr, Bc=bBc, rho=rho, dq_mode=mode) / 1e6
              for mode in ("atomic", "separate")}
    print(f"{rho:>8}{4 * 64 * n * n * d * rho / 1e9:>11.1f}{fwd_mb:>14.1f}{10 * 64 * n * n * d * rho / 1e9:>11.1f}"
          f"{bwd_mb['atomic']:>15.1f}{bwd_mb['separate']:>17.1f}")

# %% [markdown]
# ### What the H100 moves, measured
#
# The IO model assumes nothing between the SMs' on-chip memory and HBM. The H100 has a
# 50 MB L2 in between, so Nsight Compute counts two things for each kernel: the bytes the
# SMs read from L2 (what the model's re-reads become) and the bytes that cross to DRAM
# (HBM). The compulsory bytes are each input read and each output written once. B=4, H=16,
# N=4096, d=64, random masks with 128 x 128 blocks; times from the bench run (section 8):

# %%
from pathlib import Path

from kernels.bench.harness import read_csv

results_dir = Path("results") if Path("results").is_dir() else Path("workbook/results")


def extra_of(r):
    return dict(kv.split("=", 1) for kv in r["extra"].split(";") if "=" in kv)


dram_path = results_dir / "block_sparse_dram.csv"
if dram_path.exists():
    _, traffic = read_csv(dram_path)
    times = {}
    if (results_dir / "block_sparse.csv").exists():
        for r in read_csv(results_dir / "block_sparse.csv")[1]:
            ex = extra_of(r)
            if r["kernel"] in ("block-sparse forward", "block-sparse backward") and ex.get("N") == "4096" \
                    and " random " in r["config"]:
                part = {"forward": "fwd", "backward": "bwd"}[ex["part"]]
                times[part, float(r["config"].split(" random ")[-1])] = r["median_ms"]
    print(f"{'kernel':<22}{'density':>8}{'model GB':>10}{'L2->SM GB':>11}{'L2->SM/model':>14}"
          f"{'+writes/model':>15}{'DRAM GB':>9}{'compulsory GB':>15}{'ms':>8}")
    for r in sorted(traffic, key=lambda r: (r["kernel"].split(",")[0], -float(extra_of(r)["case"].split("-")[-1]))):
        ex = extra_of(r)
        part, density = ex["case"].split("-")[1], float(ex["case"].split("-")[-1])
        model, l2, dram = float(ex["model_bytes"]), float(ex["l2_read_bytes"]), float(ex["dram_total_bytes"])
        writes = float(ex["dram_write_bytes"])
        print(f"{r['kernel'].split(',')[0]:<22.22}{density:>8g}{model / 1e9:>10.2f}{l2 / 1e9:>11.2f}"
              f"{l2 / model:>14.2f}{(l2 + writes) / model:>15.2f}{dram / 1e9:>9.3f}"
              f"{float(ex['compulsory_bytes']) / 1e9:>15.3f}{times.get((part, density), float('nan')):>8.2f}")
else:
    print("Nsight Compute results are not committed yet (workbook/results/block_sparse_dram.csv).")

# %% [markdown]
# What scales with rho, and what does not, at this size:
#
# * **L2 -> SM traffic and time scale with rho.** The forward's SMs read 5.2, 1.4 and
#   0.76 GB from L2 at densities 1, 1/4 and 1/8, and its time falls with them. That is the
#   model's K/V stream: with the writes added, the model times 1.19 to 1.30, so the kernel
#   reads somewhat more than the model counts (not yet explained). The backward's SMs read
#   7.8 GB at density 1 and 1.3 GB at 1/8, 0.45 to 0.6 of the model with the writes: the
#   model counts dQ's atomic read-modify-writes as bytes moved, but atomics are executed
#   in L2, not read into the SMs.
# * **DRAM traffic does not.** The forward moves 0.27 to 0.28 GB at every density, the
#   compulsory bytes: Q read and O written once, and K and V read once, because their
#   re-reads by the other query tiles stay in the 50 MB L2 (K and V of one head are 2 MB).
#   The backward moves 0.72 to 0.73 GB at densities 1 and 1/8, about 1.35x its compulsory
#   bytes, the same at both. So at N = 4096 a kept tile costs L2 bandwidth and FMAs, not
#   HBM bandwidth; skipping tiles saves time because it saves those.

# %% [markdown]
# ## 7. What sparsity costs in accuracy
#
# Block sparsity changes the answer: the skipped scores are treated as -inf. How much that
# matters depends on where the attention mass is. On real sequences it is often **local**:
# positional encodings and slowly drifting content make nearby tokens score high. A toy
# model of that: half of each q and k vector is content (a slow random walk along the
# sequence, projected), half a sinusoidal position code whose dot product
# sum_f cos(w_f (i - j)) peaks at i = j; a little noise on top. For each pattern we compare
# the output with dense attention (NumPy, float64): the relative error
# ||O_pattern - O_dense|| / ||O_dense|| against the kept fraction, and the same on plain
# noise inputs, which have no locality.

# %%
def local_structure_inputs(n, d=32, pos_gain=2.0, smoothness=0.95, seed=0):
    rng = np.random.default_rng(seed)
    half = d // 2
    x = np.zeros((n, half))
    for t in range(1, n):  # content: an AR(1) walk, drifting slowly along the sequence
        x[t] = smoothness * x[t - 1] + np.sqrt(1 - smoothness**2) * rng.standard_normal(half)
    content = x @ (rng.standard_normal((half, half)) / np.sqrt(half))
    freqs = np.pi / np.geomspace(4, n, half // 2)      # position code: periods 8 .. 2n
    angles = np.arange(n)[:, None] * freqs[None, :]
    pos = pos_gain * np.concatenate([np.cos(angles), np.sin(angles)], axis=1)
    q = np.concatenate([content, pos], axis=1) + 0.1 * rng.standard_normal((n, d))
    k = np.concatenate([content, pos], axis=1) + 0.1 * rng.standard_normal((n, d))
    return q, k, rng.standard_normal((n, d))


block = N_STUDY // 16
study = {
    "sliding window w=1": sp.sliding_window(N_STUDY, N_STUDY, block=block, window=1),
    "sliding window w=2": sp.sliding_window(N_STUDY, N_STUDY, block=block, window=2),
    "global + local": sp.global_local(N_STUDY, N_STUDY, block=block, window=1, n_global=1),
    "strided 4": sp.strided(N_STUDY, N_STUDY, block=block, stride=4),
    "butterfly": sp.butterfly(N_STUDY, N_STUDY, block=block),
    "random 25%": sp.random_blocks(N_STUDY, N_STUDY, block=block, density=0.25, seed=0),
    "random 50%": sp.random_blocks(N_STUDY, N_STUDY, block=block, density=0.5, seed=0),
}
inputs = {"local structure": local_structure_inputs(N_STUDY),
          "plain noise": tuple(np.random.default_rng(3).standard_normal((3, N_STUDY, 32)))}
errors = {}
for kind, (qs, ks, vs) in inputs.items():
    o_dense, _ = ref.attention(qs, ks, vs)
    for name, m in study.items():
        o_sparse, _ = ref.attention(qs, ks, vs, block_mask=m)
        errors[kind, name] = np.linalg.norm(o_sparse - o_dense) / np.linalg.norm(o_dense)
print(f"N={N_STUDY}, {N_STUDY // block} x {N_STUDY // block} tiles of {block}")
print(f"{'pattern':<22}{'rho':>7}{'error, local':>15}{'error, noise':>15}")
for name, m in sorted(study.items(), key=lambda item: item[1].density):
    print(f"{name:<22}{m.density:>7.3f}{errors['local structure', name]:>15.3g}{errors['plain noise', name]:>15.3g}")

fig, ax = plt.subplots(figsize=(6.5, 3.8))
for kind, marker in (("local structure", "o"), ("plain noise", "x")):
    xs = [study[name].density for name in study]
    ys = [errors[kind, name] for name in study]
    ax.scatter(xs, ys, marker=marker, s=45, label=kind)
    if kind == "local structure":
        for name, x_, y_ in zip(study, xs, ys):
            ax.annotate(name, (x_, y_), textcoords="offset points", xytext=(5, 2), fontsize=7)
ax.set_xlabel("kept fraction rho")
ax.set_ylabel("||O - O_dense|| / ||O_dense||")
ax.set_yscale("log")
ax.grid(True, alpha=0.3)
ax.legend(fontsize=8)
ax.set_title("accuracy against sparsity")
plt.show()

# %% [markdown]
# With local structure, the patterns that keep the tiles near the diagonal (sliding window,
# global + local) land about 10% from the dense answer at a fifth to a quarter of the work;
# strided, butterfly and random masks, at the same or higher rho, drop nearby tiles where
# the mass is and do two to three times worse. On plain noise there is nothing to exploit:
# dense attention averages many random values to a small output, a sparse mask averages
# fewer, and every pattern's error exceeds the size of the answer itself, the more so the
# fewer tiles it keeps. The pattern must match the data.

# %% [markdown]
# ## 8. Results on the H100
#
# `python -m kernels --chapters 6` measures the forward and the backward at N = 4096
# (B=4, H=16, d=64, fp32) and N = 16384 (B=1, H=8), 128 x 128 mask blocks, random masks at
# densities 1 to 1/16 and the causal sliding window (the backward with atomic dQ at every
# density, with the separate dQ kernel at density 1 and on the sliding window); in the same
# run chapter 4's dense fused forward, chapter 5's dense backward, PyTorch FlexAttention
# (fp32, torch.compile, the same block mask) and SDPA memory-efficient (dense fp32). The
# committed results:

# %%
csv_path, png_path = results_dir / "block_sparse.csv", results_dir / "block_sparse.png"
if csv_path.exists():
    env, rows_ = read_csv(csv_path)
    print("device:", env.get("device"), "| driver:", env.get("driver"))
    print(f"{'kernel':<40}{'config':<50}{'ms':>9}{'TFLOP/s':>9}{'GB/s':>8}  extra")
    for r in rows_:
        print(f"{r['kernel']:<40.40}{r['config']:<50.50}{r['median_ms']:>9.4g}{r['tflops']:>9.3g}"
              f"{r['gbps']:>8.4g}  {r['extra']}")
    # the speed-up over the dense fused kernels of chapters 4 and 5, per N and pass
    dense_ms = {(extra_of(r).get("N"), extra_of(r).get("part")): r["median_ms"] for r in rows_
                if r["kernel"].startswith("dense") and extra_of(r).get("density") == "1.0"}
    print(f"\n{'kernel':<36}{'N':>7}{'rho':>8}{'ms':>10}{'x faster than dense':>22}")
    for r in rows_:
        ex = extra_of(r)
        base = dense_ms.get((ex.get("N"), ex.get("part")))
        if r["kernel"].startswith("block-sparse") and "pattern" not in ex and base:
            print(f"{r['kernel']:<36}{ex['N']:>7}{float(ex['rho']):>8.3f}{r['median_ms']:>10.3f}"
                  f"{base / r['median_ms']:>22.2f}")
    # time against rho, per N and pass
    fig, ax = plt.subplots(figsize=(7, 4))
    for part in ("forward", "backward"):
        pts = {}
        for r in rows_:
            ex = dict(kv.split("=", 1) for kv in r["extra"].split(";") if "=" in kv)
            if ex.get("part") != part or "pattern" in ex or "rho" not in ex:
                continue
            if r["kernel"].startswith("block-sparse") or r["kernel"].startswith("peer: FlexAttention"):
                pts.setdefault((r["kernel"], ex.get("N")), []).append((float(ex["rho"]), r["median_ms"]))
        for (kernel, n_), xy in sorted(pts.items()):
            xy.sort()
            ax.plot([a for a, _ in xy], [b_ for _, b_ in xy], marker="o",
                    linestyle="--" if "peer" in kernel else "-", label=f"{kernel} N={n_}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("kept fraction rho")
    ax.set_ylabel("median ms")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    plt.show()
    if png_path.exists():
        from IPython.display import Image, display

        display(Image(str(png_path)))
else:
    print("GPU results are not committed yet (workbook/results/block_sparse.csv).")

# %% [markdown]
# ### The forward, read from the table
#
# The forward rows alone, per N: the block-sparse kernel at each mask density against
# chapter 4's dense fused forward (same N, every tile), and FlexAttention with the same
# block mask. The "density" column is the mask's nominal density; rho is the fraction of
# tiles the random mask actually kept.

# %%
if csv_path.exists():
    def nominal(config):
        return config.split(" random ")[-1] if " random " in config else config.split("causal=True ")[-1]

    def n_of(r):
        return int(extra_of(r)["N"]) if "N" in extra_of(r) else int(r["config"].split("N=")[1].split()[0])

    fwd = [r for r in rows_ if extra_of(r).get("part") == "forward"]
    dense_by_config = {r["config"]: r["median_ms"] for r in fwd if r["kernel"].startswith("dense fused")}
    dense_by_n = {n_of(r): r["median_ms"] for r in fwd
                  if r["kernel"].startswith("dense fused") and r["config"].endswith("random 1")}
    sdpa_by_n = {n_of(r): r["median_ms"] for r in fwd
                 if r["kernel"].startswith("peer: SDPA") and r["config"].endswith("random 1")}
    flex_by_config = {r["config"]: r["median_ms"] for r in fwd if r["kernel"] == "peer: FlexAttention fp32"}
    for n_ in sorted(dense_by_n):
        shape = next(r["config"].split(" d=")[0] for r in fwd if n_of(r) == n_)
        print(f"\n{shape} d=64 fp32: dense fused forward {dense_by_n[n_]:.2f} ms, "
              f"SDPA memory-efficient (dense) {sdpa_by_n.get(n_, float('nan')):.2f} ms")
        print(f"{'density':>22}{'rho':>8}{'block-sparse ms':>17}{'x vs dense':>12}{'FlexAttention ms':>18}"
              f"{'Flex / ours':>13}")
        for r in fwd:
            if r["kernel"] != "block-sparse forward" or n_of(r) != n_:
                continue
            dense = dense_by_config.get(r["config"], dense_by_n[n_])
            flex = flex_by_config.get(r["config"], float("nan"))
            print(f"{nominal(r['config']):>22}{float(extra_of(r)['rho']):>8.3f}{r['median_ms']:>17.2f}"
                  f"{dense / r['median_ms']:>12.1f}{flex:>18.2f}{flex / r['median_ms']:>13.2f}")
else:
    print("GPU results are not committed yet (workbook/results/block_sparse.csv).")

# %% [markdown]
# What the H100 says about the forward (rounded; the causal sliding window is compared
# with the causal dense forward; run of 2026-11-24):
#
# * **Time tracks the kept fraction, at both sizes.** At N = 4096 (B=4, H=16) densities
#   1, 1/2, 1/4, 1/8 and 1/16 take 8.58, 4.58, 2.32, 1.51 and 0.92 ms; chapter 4's dense
#   kernel takes 8.20 ms, so 1/8 of the tiles is 5.4x faster than dense attention and 1/16
#   is 8.9x. At N = 16384 (B=1, H=8): 16.6, 8.52, 4.70, 2.69 and 1.54 ms against 16.1 ms
#   dense, 6.0x at 1/8 and 10.4x at 1/16. SDPA memory-efficient, dense, takes 8.16 and
#   16.8 ms. The causal sliding window (1.6% to 6% of the tiles kept) takes 0.84 ms against
#   4.96 ms for causal dense attention at N = 4096, and 0.55 against 9.91 ms at N = 16384.
# * **Every tile kept costs 3 to 5% more than the dense kernel** (8.58 against 8.20 ms,
#   16.6 against 16.1): it is chapter 4's kernel, walking a list, at Br = 128 (a tile
#   must not straddle two 128-row mask blocks) where the dense one uses Br = 256. At
#   density 1/2 it is already 1.8x faster than dense.
# * **FlexAttention** (PyTorch, fp32, the same block mask) tracks the kept fraction too,
#   1.3x to 1.9x slower than this kernel at every random density (1.7x and 1.4x on the
#   sliding window at N = 4096 and 16384): 15.0, 7.63, 3.94, 2.27 and 1.24 ms at N = 4096,
#   29.6, 15.7, 8.19, 4.56 and 2.49 ms at N = 16384. It runs through `torch.compile`: the
#   bench makes one `torch.compile(flex_attention, dynamic=False)` for the whole run, with
#   dynamo's recompile limit raised so that every shape gets its own static compilation
#   (`_compiled_flex` in `kernels/bench/block_sparse.py`). Compiled per configuration with
#   the defaults, dynamo had hit that limit and fallen back to the unfused path, and
#   N = 16384 had measured about 1 TFLOP/s: a measurement of the fallback, not of
#   FlexAttention. Its fp32 backward is in the next table.

# %% [markdown]
# ### The backward, read from the table
#
# The backward rows per N: the block-sparse backward with atomic dQ at every density and
# with the separate dQ kernel where the bench measured it (every tile kept, the sliding
# window), against chapter 5's dense backward (same N; causal for the sliding window),
# FlexAttention's backward on the same mask, and SDPA memory-efficient (dense). "Per kept
# tile" divides the time by rho and by the dense time (random masks, where the dense run
# visits every tile): 1 would mean a kept tile costs what one of chapter 5's tiles costs.

# %%
if csv_path.exists():
    bwd = [r for r in rows_ if extra_of(r).get("part") == "backward"]
    dense_bwd = {r["config"]: r["median_ms"] for r in bwd if r["kernel"].startswith("dense backward")}
    separate_bwd = {r["config"]: r["median_ms"] for r in bwd if r["kernel"] == "block-sparse backward (separate dQ)"}
    flex_bwd = {r["config"]: r["median_ms"] for r in bwd if r["kernel"] == "peer: FlexAttention fp32 backward"}
    dense_bwd_by_n = {n_of(r): r["median_ms"] for r in bwd
                      if r["kernel"].startswith("dense backward") and r["config"].endswith("random 1")}
    sdpa_bwd_by_n = {n_of(r): r["median_ms"] for r in bwd
                     if r["kernel"].startswith("peer: SDPA") and r["config"].endswith("random 1")}
    for n_ in sorted(dense_bwd_by_n):
        shape = next(r["config"].split(" d=")[0] for r in bwd if n_of(r) == n_)
        print(f"\n{shape} d=64 fp32: chapter 5 dense backward {dense_bwd_by_n[n_]:.2f} ms, "
              f"SDPA memory-efficient backward (dense) {sdpa_bwd_by_n.get(n_, float('nan')):.2f} ms")
        print(f"{'density':>22}{'rho':>8}{'atomic ms':>11}{'TFLOP/s':>9}{'x vs dense':>12}{'per kept tile':>15}"
              f"{'separate ms':>13}{'Flex ms':>10}{'Flex / ours':>13}")
        for r in bwd:
            if r["kernel"] != "block-sparse backward" or n_of(r) != n_:
                continue
            rho = float(extra_of(r)["rho"])
            dense = dense_bwd.get(r["config"], dense_bwd_by_n[n_])
            flex = flex_bwd.get(r["config"], float("nan"))
            # per kept tile only against a dense run over every tile (not the causal one)
            per_tile = "-" if "pattern" in extra_of(r) else f"{r['median_ms'] / (rho * dense):.2f}"
            print(f"{nominal(r['config']):>22}{rho:>8.3f}{r['median_ms']:>11.2f}{r['tflops']:>9.1f}"
                  f"{dense / r['median_ms']:>12.1f}{per_tile:>15}"
                  f"{separate_bwd.get(r['config'], float('nan')):>13.2f}{flex:>10.1f}{flex / r['median_ms']:>13.2f}")
else:
    print("GPU results are not committed yet (workbook/results/block_sparse.csv).")

# %% [markdown]
# What the H100 says about the backward (rounded; run of 2026-11-24):
#
# * **Time tracks the kept fraction.** At N = 4096 densities 1, 1/2, 1/4, 1/8 and 1/16 take
#   26.1, 14.0, 8.2, 5.6 and 4.2 ms (atomic dQ; the launcher with the lists built once);
#   chapter 5's dense backward takes 25.6 ms, so half the tiles is 1.8x faster than dense,
#   1/8 is 4.6x and 1/16 is 6.1x. At N = 16384: 48.1, 24.7, 13.8, 8.1 and 5.5 ms against
#   47.1 ms dense (5.8x at 1/8, 8.6x at 1/16). The causal sliding window takes 3.88 ms
#   against 15.0 ms for chapter 5's causal backward at N = 4096, and 2.95 against 25.0 ms at
#   N = 16384.
# * **With every tile kept it is chapter 5's backward**: 26.1 against 25.6 ms and 48.1
#   against 47.1 ms (2%), the same kernels walking a list (two-level sums, 128-bit shared
#   loads and chapter 5's tiles included). SDPA's memory-efficient backward (dense) is
#   faster still at 20.1 and 39.9 ms (tensor-core TF32, see chapter 4). At low density the
#   time per kept tile grows (1.7x the dense figure at 1/8 and 2.6x at 1/16 for N = 4096):
#   each key column then holds only a few kept tiles, so the per-block work that does not
#   shrink with rho (loading K_j and V_j, writing dK_j and dV_j) and columns of uneven length
#   weigh more.
# * **Atomic or separate dQ.** The one-pass atomic path is 1.3x faster than the
#   deterministic two-kernel path with every tile kept (26.1 against 33.8 ms at N = 4096,
#   48.1 against 63.1 at N = 16384) and 1.2x on the sliding window (3.88 against 4.75,
#   2.95 against 3.48 ms): the separate path computes P and dP twice per kept tile. Its dK
#   and dV are bitwise reproducible; dQ varies in its last bits from run to run and meets
#   the tolerance rule every run. Pass `dq_mode="separate"` when reproducible gradients
#   matter, as in chapter 5.
# * **FlexAttention's fp32 backward** runs at about 4 TFLOP/s at every size and density, as
#   measured: 169 ms at N = 4096 with every tile kept (6.5x this backward), 21.6 ms at 1/8
#   (3.9x), 12.0 ms at 1/16 (2.9x), 11.4 ms on the sliding window (2.9x).
#
# The backward takes chapter 5's tiles, shrunk where they would straddle a mask block
# (`backward_tiles`). On the sliding window, few kept tiles a key column, smaller dK/dV
# tiles were faster in a separate sweep (Br = 32, Bc = 64, 128 threads: 2.89 against
# 3.03 ms), and slower at every random density; the default stays chapter 5's.

# %% [markdown]
# ## 9. Exercises
#
# ### Exercise 1: the sliding-window mask
#
# Write `my_sliding_window(nq, nk, block, window)` returning a `ref.BlockMask` whose flags
# (Tq, Tk) keep tile (r, c) when it is within `window` tiles of the bottom-right aligned
# diagonal: shift the shorter side so the diagonals line up (key tile c is on query tile
# r's diagonal when c - r == Tk - Tq). The checker compares it with the module's pattern
# on drawn sizes, blocks and windows.

# %%
def my_sliding_window(nq, nk, block, window):
    # your code here: return ref.BlockMask(flags, block, block)
    raise NotImplementedError


# %%
from hypothesis import strategies as st

window_cases = st.tuples(st.integers(0, 200), st.integers(0, 200), st.sampled_from([1, 3, 16, 64]),
                         st.integers(0, 4))


def window_prop(solution):
    def prop(case):
        nq, nk, block, window = case
        got = solution(nq, nk, block, window)
        want = sp.sliding_window(nq, nk, block=block, window=window)
        assert isinstance(got, ref.BlockMask), f"expected a BlockMask, got {type(got).__name__}"
        assert (got.block_q, got.block_k) == (block, block), "the mask must carry its block size"
        assert np.array_equal(got.flags, want.flags), f"flags differ:\n{got.flags.astype(int)}\n!=\n{want.flags.astype(int)}"
    return prop


_ = check_exercise(window_prop(my_sliding_window), window_cases, host=True)

# %% [markdown]
# The same checker on the module's solution:

# %%
_ = check_exercise(window_prop(lambda nq, nk, block, window: sp.sliding_window(nq, nk, block=block, window=window)),
                   window_cases, host=True)

# %% [markdown]
# ### Exercise 2: the compact lists
#
# Write `my_row_lists(flags)` for flags of shape (Tr, Tc) (kernel tiles equal to the mask
# blocks, no causal): return `(row_ptr, col_idx)`, int32 arrays with
# `col_idx[row_ptr[r]:row_ptr[r+1]]` the kept key tiles of row r in increasing order.
# Rows with nothing kept have an empty slice.
#
# <details><summary>Hint 1</summary>
#
# Row r holds `flags[r].sum()` kept tiles; `row_ptr` is 0 followed by the running sum of
# those counts.
# </details>
#
# <details><summary>Hint 2</summary>
#
# `np.nonzero(flags)` walks the flags row by row, left to right: the column indices it
# returns, in that order, are `col_idx`.
# </details>

# %%
def my_row_lists(flags):
    # your code here: return row_ptr, col_idx
    raise NotImplementedError


# %%
flag_cases = st.tuples(st.integers(0, 12), st.integers(0, 12), st.floats(0, 1), st.integers(0, 2**16))


def lists_prop(solution):
    def prop(case):
        tr, tc, density, seed = case
        flags = np.random.default_rng(seed).random((tr, tc)) < density
        row_ptr, col_idx = solution(flags)
        want = tile_lists(ref.BlockMask(flags, 4, 4), 4 * tr, 4 * tc, Br=4, Bc=4)
        assert np.array_equal(np.asarray(row_ptr), want.row_ptr), f"row_ptr {row_ptr} != {want.row_ptr}"
        assert np.array_equal(np.asarray(col_idx), want.col_idx), f"col_idx {col_idx} != {want.col_idx}"
    return prop


_ = check_exercise(lists_prop(my_row_lists), flag_cases, host=True)

# %% [markdown]
# The course's answer is the first lines of `tile_lists` in `kernels/block_sparse.py` (a
# `cumsum` of the row counts and a `nonzero`); read it once yours passes.

# %% [markdown]
# ### Exercises 3 and 4 (kernels): the lists on the GPU, and a first block-sparse forward
#
# Write both in your own file (the next cell makes it from a template the first time:
# `workbook/mine/my_block_sparse.py`); `grade` runs this chapter's tests on them and prints
# the smallest case that fails, with the block and thread that own the wrong element.
#
# * **Exercise 3.** `make_first_tile_lists()` returns a kernel `(flags, col_idx, count, Br,
#   Bc, block_q, block_k, nq, nk, causal)`, one thread a (mask group g, query tile r):
#   thread `t = cuda.grid(1)` takes `g, r = t // Tr, t % Tr`. `flags` is the mask's
#   (G, Tq, Tk) flags as uint8; `col_idx` (G, Tr, Tc) and `count` (G, Tr) are int32 (read
#   G, Tr, Tc from `col_idx.shape`; skip threads with `t >= G * Tr`). Write the kept key
#   tiles of query tile r, in increasing order, to `col_idx[g, r, 0]`, `col_idx[g, r, 1]`,
#   ... and their number to `count[g, r]`: what `tile_lists` lists for that tile (section
#   3). Kernel tile (r, c) lies in mask block `(r*Br // block_q, c*Bc // block_k)`; with
#   `causal` (0 or 1), drop the tiles wholly above the diagonal: first key `c*Bc` past
#   `min((r+1)*Br, nq) - 1 + nk - nq`, the last query row of the tile and its diagonal.
#   `test_first_tile_lists_match_the_host_lists` grades it against `tile_lists`.
# * **Exercise 4.** `make_first_block_sparse_forward()` returns a kernel `(q, k, v, o, lse,
#   flags, block_q, block_k, scale, causal)` on (B*H, N, d) float32 views of Q, K, V, O
#   and the (B*H, Nq) view of L, one thread a query row: `t = cuda.grid(1)`,
#   `z, i = t // Nq, t % Nq`, mask group `g = z % G`. Skip every key whose block flag
#   `flags[g, i // block_q, j // block_k]` is off, and with `causal` every key
#   `j > i + Nk - Nq`; over the keys kept run the online softmax one score at a time
#   (`s = scale * q_i . k_j`, a running m, l and O). There is no tile on chip in this
#   first version: read Q, K, V from global memory and keep the running O in its output
#   row `o[z, i, :]` (set it to 0 first). A row with nothing kept must give O = 0 and
#   L = -inf, never 0 / 0. `test_first_forward_matches_the_oracle` grades it against the
#   float64 oracle by the chapter's tolerance rule.
#
# <details><summary>Hint 1 (exercise 3)</summary>
#
# A counter `n = 0`; for each key tile `c` in `range(Tc)` whose flag is on:
# `col_idx[g, r, n] = c` and `n += 1`. At the end `count[g, r] = n`. Entries past `n` are
# never read: leave them.
# </details>
#
# <details><summary>Hint 2 (exercise 3)</summary>
#
# Causal: with `last_q = min((r + 1) * Br, nq) - 1`, once `c * Bc > last_q + nk - nq` this
# tile and every later one are above the diagonal: `break`. The first query row of the tile
# is not enough when Br != Bc or Nk - Nq is not a multiple of the tiles.
# </details>
#
# <details><summary>Hint 1 (exercise 4)</summary>
#
# Per kept key: `m_new = nan_max(m, s)`, `alpha = math.exp(m - m_new)`,
# `p = math.exp(s - m_new)`, `l = l * alpha + p`, and for each column c
# `o[z, i, c] = o[z, i, c] * alpha + p * v[z, j, c]`; then `m = m_new`. Start from
# `m = -inf`, `l = 0`: the first key gets `alpha = exp(-inf) = 0`, no special case.
# </details>
#
# <details><summary>Hint 2 (exercise 4)</summary>
#
# At the end, `l == 0` means the row kept no key: leave O at 0 and write `L = -inf`.
# Otherwise divide the row of O by `l` and write `L = m + log(l)`.
# </details>
#
# <details><summary>Hint 3 (exercise 4)</summary>
#
# Skip whole blocks, not key by key: `for kb in range(flags.shape[2])`,
# `if not flags[g, i // block_q, kb]: continue`; the keys of block kb are
# `kb * block_k` up to `min((kb + 1) * block_k, nk)`, and with causal the walk can stop at
# the first block that starts past `i + nk - nq`.
# </details>

# %%
from kernels.base.learner import grade, my_file

TEMPLATE = '''"""My kernels for chapter 6 (graded by tests/test_block_sparse.py)."""
CHAPTER = "block_sparse"

import math

from numba import cuda, float32

from kernels.base.fused import nan_max


def make_first_tile_lists():
    @cuda.jit
    def first_tile_lists_kernel(flags, col_idx, count, Br, Bc, block_q, block_k, nq, nk, causal):
        raise NotImplementedError   # your code: the kept key tiles of query tile (g, r), and their count

    return first_tile_lists_kernel


def make_first_block_sparse_forward():
    @cuda.jit
    def first_block_sparse_forward_kernel(q, k, v, o, lse, flags, block_q, block_k, scale, causal):
        raise NotImplementedError   # your code: row cuda.grid(1) of O, and its L

    return first_block_sparse_forward_kernel
'''

mine = my_file("my_block_sparse.py", TEMPLATE)

# %%
_ = grade(mine)

# %% [markdown]
# The course's answers: `make_first_tile_lists` and `make_first_block_sparse_forward` in
# `kernels/block_sparse.py` (read them after yours pass). Below, they run through their
# launchers. Each row of the GPU's `col_idx` is padded to Tc entries; a prefix sum of the
# counts gives `row_ptr`, and the rows packed one after the other give the CSR `col_idx`
# that the forward kernel walks. The first forward gives the tiled kernel's answer, but
# each query row reads every kept K and V row itself (2 Nk d rho loads a row), where the
# tiled kernel loads a K/V tile once for the Br rows of its query tile.

# %%
from kernels.block_sparse import first_block_sparse_attention, first_tile_lists

m6 = sp.sliding_window(16, 16, block=4, window=1)
col_gpu, count_gpu = first_tile_lists(m6, 16, 16, Br=4, Bc=4, causal=True)
host = tile_lists(m6, 16, 16, Br=4, Bc=4, causal=True)
row_ptr_gpu = np.concatenate([[0], np.cumsum(count_gpu.ravel())]).astype(np.int32)
col_idx_gpu = np.concatenate([col_gpu[0, r, :n] for r, n in enumerate(count_gpu[0])]).astype(np.int32)
print("counts:", count_gpu.ravel(), " row_ptr:", row_ptr_gpu, " col_idx:", col_idx_gpu)
print("the host's lists, the same:", np.array_equal(row_ptr_gpu, host.row_ptr)
      and np.array_equal(col_idx_gpu, host.col_idx))

# the inputs and per-head random mask of section 4
o_first, lse_first = first_block_sparse_attention(q, k, v, mask, causal=True)
o_tiled, lse_tiled = block_sparse_attention(q, k, v, mask, causal=True)
print("max |first - tiled| O:", float(np.abs(o_first - o_tiled).max()),
      " L equal where -inf:", bool(np.array_equal(np.isinf(lse_first), np.isinf(lse_tiled))))
