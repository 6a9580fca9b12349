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
# # 7. Decode: split-K and stream-K (Lean Attention)
#
# Chapters 4 to 6 attended N queries against N keys: lots of arithmetic for every byte.
# A served language model spends most of its life doing something else. Every step of
# generation asks, for the $N_q$ newest tokens of each sequence ($N_q = 1$, or up to 16 when
# speculative decoding drafts several tokens at once): attend over **everything cached so
# far**, a KV cache of thousands to hundreds of thousands of keys.
#
# ```
#   q (1 x d)     K^T (d x N, the cache)                           O = softmax(q K^T / sqrt(d)) V
#   [ q ]  x  [ k_0 k_1 k_2 ............................ k_{N-1} ]  ->  [ o ]
#              each cached key and value read once, used once
# ```
#
# The arithmetic per cached element is tiny, so the running time is **bytes**: reading K
# and V once is the floor. This chapter builds two kernels that get there by cutting the
# **key** range instead of the query range, and merging the pieces:
#
# 1. **split-K** (Flash-Decoding, Dao, Haziza, Massa and Sizov 2023): each head's keys cut
#    into slices, one block a slice, a second kernel merges the partial results;
# 2. **stream-K** (Lean Attention, Sanovar et al. 2024, after Stream-K for GEMM, Osama et
#    al. 2023): a persistent grid, the whole batch's work laid end to end and cut into
#    equal ranges, the last block to finish a head merges it, in one launch.
#
# The merge is chapter 3's. The inside of a block is new: at $N_q = 1$ there is no matrix
# to tile, only a matrix-**vector** product. And real decode inputs bring their own
# details: cache lengths that differ per sequence, grouped KV heads (GQA/MQA), a causal
# diagonal at the end of the cache, and fp16 caches.
#
# **Sources** (numbered as in the README's list): [7] Flash-Decoding (Dao, Haziza, Massa
# and Sizov 2023: split-K); [8] Lean Attention (Sanovar et al. 2024: stream-K decode); [9]
# Stream-K (Osama et al. 2023).

# %%
import functools
import inspect
from dataclasses import dataclass, replace

import matplotlib.pyplot as plt
import numpy as np

import kernels  # noqa: F401  (GPU or simulator, chosen before Numba is imported)
from kernels import reference as ref
from kernels.decode import (
    StreamKSchedule,
    check_schedule,
    decode_attention,
    decode_numpy,
    io_model_bytes,
    key_tile,
    make_attend_key_range,
    make_attend_key_range_mma,
    make_stream_k,
    merge_partials_numpy,
    plan,
    split_count,
    split_ranges,
    stream_k_schedule,
    wave_efficiency,
)
from kernels.online_softmax import logsumexp_of, merge
from kernels.base.runtime import device_name, on_simulator
from kernels.base.notebook import show_source
from kernels.base.testing import assert_close, check_exercise, random_array

print("running on:", device_name())

# %% tags=["parameters"]
# Tiny sizes in the simulator (every GPU thread is a Python thread there), real ones on a GPU.
if on_simulator():
    B, HQ, HKV, NQ, N_MAX, D_HEAD = 4, 4, 2, 2, 40, 8   # the kernel checks
    BLOCKS = 3                                          # stream-K's persistent grid, forced small
else:
    B, HQ, HKV, NQ, N_MAX, D_HEAD = 4, 32, 8, 4, 4096, 128
    BLOCKS = None                                       # the launcher's choice: SMs x blocks an SM
LENGTHS = np.array([N_MAX - 3, 0, 1, N_MAX // 2])      # ragged caches: an empty one, one key

# The H100 numbers the arithmetic below uses: 132 SMs, about 2.95 TB/s for a device copy
# (cudaMemcpy, measured in chapter 0) and about 51 TFLOP/s of fp32 FMAs (cuBLAS, chapter 0).
SMS, HBM_TBS, FP32_TFLOPS = 132, 2.95, 51.0

# %% [markdown]
# ## 1. The idea: decode is bytes, and chapter 4's grid starves
#
# Per sequence and head, decode reads the K and V cache once: $2 N d$ elements for a cache
# of $N$ keys. The floor is
#
# $$t \;\ge\; \frac{\text{bytes of } K + \text{bytes of } V}{\text{HBM read bandwidth}}$$
#
# `io_model_bytes(B, Hq, Hkv, Nq, n_keys, d, kv_itemsize=...)` counts the compulsory bytes:
# K and V once per KV head, plus Q read and O, L written once (negligible at small $N_q$).
# A model with 32 heads of d = 128 (B = 1, MHA), one new token, a cache of 32768 keys:

# %%
n_ctx = 32768
for name, itemsize in (("fp32", 4), ("fp16", 2)):
    nbytes = io_model_bytes(1, 32, 32, 1, n_ctx, 128, kv_itemsize=itemsize)
    print(f"{name} KV cache: {nbytes / 1e6:7.1f} MB -> t >= {nbytes / (HBM_TBS * 1e12) * 1e6:6.1f} us "
          f"at {HBM_TBS} TB/s")

# %% [markdown]
# Reaching that floor needs **every SM** pulling bytes. Chapter 4's grid has one block per
# (query tile, head). At $N_q = 1$ there is one query tile, so the grid is $B \cdot H$
# blocks: 32 here, on a GPU of 132 SMs. 100 SMs sit idle, and each of the 32 busy ones
# walks a whole 32768-key cache alone. HBM runs at full speed only when enough requests
# are in flight at once, and here at most 32 of 132 SMs are making them.
#
# Split-K fixes it by cutting each head's keys into $s$ slices, one block each: $32 s$
# blocks. Below, each SM is a column of 4 block slots (an SM runs several small blocks at
# once; 4 is an assumption of the picture, the launcher asks the compiled kernel how many
# really fit), the blocks are dealt out to the SMs in order, and a colour is a head. Top:
# chapter 4's grid; bottom: split-K with the split count this chapter's rule picks
# (section 4), 15.

# %%
def occupancy(n_heads, splits, sms=SMS, slots_per_sm=4):
    """The first wave of a launch of n_heads * splits blocks (split fastest), dealt to SMs
    round-robin: a (slots, SMs) grid holding each slot's head, NaN where idle."""
    grid = np.full((slots_per_sm, sms), np.nan)
    for b in range(min(n_heads * splits, sms * slots_per_sm)):
        grid[b // sms, b % sms] = b // splits
    return grid


fig, axes = plt.subplots(2, 1, figsize=(13, 3.2), sharex=True)
cmap = plt.get_cmap("turbo").copy()
cmap.set_bad("0.92")
for ax, splits, title in ((axes[0], 1, "chapter 4's grid at Nq = 1: one block per head, 32 blocks"),
                          (axes[1], 15, "split-K: 15 slices per head, 480 blocks")):
    grid = occupancy(32, splits)
    ax.pcolormesh(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=32, edgecolors="white", linewidth=0.3)
    busy = np.isfinite(grid).sum()
    ax.set_title(f"{title}: {busy} of {grid.size} block slots busy", fontsize=10)
    ax.set_yticks([])
    ax.set_ylabel("slots", fontsize=8)
axes[1].set_xlabel("SM (132 on an H100); colour = head, grey = idle")
fig.tight_layout()
plt.show()

# %% [markdown]
# More slices are not free: every slice writes a partial result, $(O_s, L_s)$, $d + 1$
# floats a query row, and the merge reads them back. At $N_q = 1$ that is small against
# the cache:

# %%
partials = 2 * 32 * 15 * (128 + 1) * 4          # written, then read back by the merge
cache = io_model_bytes(1, 32, 32, 1, n_ctx, 128, kv_itemsize=2)
print(f"15 slices x 32 heads: {partials / 1e3:.0f} KB of partials against {cache / 1e6:.0f} MB of fp16 cache "
      f"({100 * partials / cache:.2f}%)")

# %% [markdown]
# ## 2. The decode roofline in numbers
#
# For each cached key $j$ and each query row, decode computes $S_j = q \cdot k_j$ ($d$
# multiply-adds, $2d$ FLOPs) and adds $P_j v_j$ to the output ($2d$ FLOPs): $4d$ FLOPs
# for the $2d$ elements of $k_j$ and $v_j$, 4 FLOPs per (K, V) element pair and query
# row. With $r$ query rows sharing a KV head ($r = g N_q$, section 7) and elements of
# $b$ bytes, the arithmetic intensity is
#
# $$I = \frac{4 r d N}{2 N d\, b} = \frac{2r}{b} \text{ FLOP per byte}$$
#
# against the H100's fp32 ridge of about 51 TFLOP/s / 2.95 TB/s = 17 FLOP per byte:

# %%
ridge = FP32_TFLOPS / HBM_TBS
print(f"ridge: {ridge:.1f} FLOP/byte")
print(f"{'rows r':>7}{'fp32 KV I':>11}{'fp16 KV I':>11}   (FLOP per byte)")
for r in (1, 2, 4, 8, 16):
    print(f"{r:>7}{2 * r / 4:>11.1f}{2 * r / 2:>11.1f}")

# %% [markdown]
# At one query row, fp32 decode does 0.5 FLOP per byte: 34 times below the ridge. Every
# decode configuration of this chapter (at most 16 rows a block) is bound by memory. So the
# time floor is simply bytes over bandwidth, and it grows linearly with the context:

# %%
ctx = 2 ** np.arange(10, 18)
fig, ax = plt.subplots(figsize=(7, 3.8))
for name, itemsize in (("fp32 KV", 4), ("fp16 KV", 2)):
    floor_us = [io_model_bytes(1, 32, 32, 1, int(n), 128, kv_itemsize=itemsize) / (HBM_TBS * 1e12) * 1e6
                for n in ctx]
    ax.plot(ctx, floor_us, "o-", label=f"{name}: bytes / {HBM_TBS} TB/s")
flops_us = 4 * 32 * ctx * 128 / (FP32_TFLOPS * 1e12) * 1e6
ax.plot(ctx, flops_us, "k--", label=f"FLOPs / {FP32_TFLOPS:.0f} TFLOP/s (fp32)")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("context length N (keys in the cache)")
ax.set_ylabel("time floor (us)")
ax.set_title("B = 1, H = 32, d = 128, Nq = 1", fontsize=10)
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 3. The merge as a reduction
#
# Cut a head's keys into slices. A **partial** is chapter 4 on one slice of the keys:
#
# $$O_s = \mathrm{softmax}(S_{:,\,\text{slice } s})\, V_{\text{slice } s}, \qquad
#   L_s = \mathrm{logsumexp}(S_{:,\,\text{slice } s})$$
#
# Two partials merge into the partial of both slices:
#
# $$L = \log\left(e^{L_1} + e^{L_2}\right), \qquad O = e^{L_1 - L} O_1 + e^{L_2 - L} O_2$$
#
# ($e^{L_s - L}$ is the share of the softmax's mass that lies in slice $s$.) The empty
# slice is $(O = 0, L = -\infty)$, and it changes nothing. `merge_partials_numpy` merges
# any number of partials at once, subtracting the largest $L_s$ first so that no `exp`
# overflows:

# %%
print(inspect.getsource(merge_partials_numpy))

# %% [markdown]
# `decode_numpy(..., splits=s)` is split-K in NumPy: each sequence's keys cut by
# `split_ranges` into $s$ slices, a partial from each (the oracle on the slice), then the
# merge. However the keys are cut, it must equal the oracle, `ref.decode_attention`. With
# ragged caches (one empty, one of a single key), GQA and the causal diagonal, and more
# slices than keys (empty slices):

# %%
rng = np.random.default_rng(0)
q = rng.standard_normal((B, HQ, NQ, D_HEAD))
k = rng.standard_normal((B, HKV, N_MAX, D_HEAD))
v = rng.standard_normal((B, HKV, N_MAX, D_HEAD))
o_ref, lse_ref = ref.decode_attention(q, k, v, LENGTHS, causal=True)
for s in (1, 2, 3, 7, 64):
    o_s, lse_s = decode_numpy(q, k, v, cache_lengths=LENGTHS, causal=True, splits=s)
    np.testing.assert_allclose(o_s, o_ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse_s, lse_ref, rtol=0, atol=1e-12)
    print(f"splits = {s:3d}: equals the oracle (max |dO| = {np.abs(o_s - o_ref).max():.1e})")

# %% [markdown]
# ### It is chapter 3's merge
#
# Chapter 3 merged the softmax states $(m, l)$ of two pieces of a row:
# $m = \max(m_1, m_2)$, $l = l_1 e^{m_1 - m} + l_2 e^{m_2 - m}$. A partial's $L_s$ is the
# state $(m, l) = (L_s, 1)$: its whole mass is $e^{L_s} = 1 \cdot e^{L_s}$. Folding those
# states with chapter 3's `merge` gives the merged $L$ (`logsumexp_of`), and $O$ rides
# along with the same weights $e^{L_s - m}$ that the merge gives to the $l$'s. The kernels
# use the device twin of `merge`, `merge_state`, exactly this way (`make_merge_partials`).

# %%
S_, rows_, d_ = 4, 3, 5
l_parts = rng.standard_normal((S_, rows_)) * 3
l_parts[1, 0] = -np.inf                    # an empty piece for row 0
o_parts = rng.standard_normal((S_, rows_, d_))
o_parts[1, 0] = 0.0

m, l = functools.reduce(merge, [(l_parts[s], np.ones(rows_)) for s in range(S_)])
L3 = logsumexp_of((m, l))
w = np.exp(l_parts - m)                    # each piece's weight relative to the merged max
O3 = np.einsum("sr,srd->rd", w, o_parts) / l[:, None]
o_m, lse_m = merge_partials_numpy(o_parts, l_parts)
print("L, chapter 3's merge:      ", L3)
print("L, merge_partials_numpy:   ", lse_m)
np.testing.assert_allclose(L3, lse_m, rtol=1e-14)
np.testing.assert_allclose(O3, o_m, rtol=1e-12, atol=1e-14)
print("O agrees too")

# %% [markdown]
# Because the merge is associative (chapter 3), **any** cut of the keys and **any** merge
# order give the same answer, up to float rounding. The kernels exploit both freedoms:
# split-K cuts each head into equal slices, stream-K cuts the batch's work wherever a
# block's share ends, and inside a block the threads' own partials are merged too.
#
# ## 4. Split-K
#
# Grid `(splits, row tiles, B*Hkv)`. Block $s$ takes keys $[s c, (s + 1) c)$ with
# $c = \lceil n / \text{splits} \rceil$ for a cache of $n$ keys, writes its partial
# $(O_s, L_s)$ to a scratch slot, and a second kernel (`make_combine`, grid `(row tiles,
# B*Hkv)`) merges each head's partials in order. The last slices may be short or empty
# (an empty slice writes $O = 0$, $L = -\infty$):

# %%
print("n = 10, 4 splits:", split_ranges(10, 4))
print("n = 10, 8 splits:", split_ranges(10, 8))
print("n = 0,  3 splits:", split_ranges(0, 3))

# %% [markdown]
# ### How many splits: the wave-efficiency rule
#
# A GPU runs a launch in **waves**: `slots` = SMs x blocks per SM run at once, then the
# next `slots`, and so on. A launch of `blocks` blocks keeps a fraction
#
# $$\text{wave efficiency} = \frac{\text{blocks}}{\lceil \text{blocks} / \text{slots} \rceil \cdot \text{slots}}$$
#
# of the slots busy over its waves: 1 when the last wave is full, low when a last wave
# holds a few stragglers. `split_count(items, n_keys, slots)` is FlashAttention's rule
# (`num_splits_heuristic`): compute the efficiency of every split count up to what leaves
# at least `min_keys` = 256 keys a slice, and take the **smallest** count within 85% of
# the best (fewer splits: fewer partials to write and merge).

# %%
print(inspect.getsource(wave_efficiency))
print(inspect.getsource(split_count))

# %% [markdown]
# For 32 heads (B = 1, H = 32, $N_q = 1$: `items` = 32) on an H100 with 4 decode blocks an
# SM (`slots` = 132 x 4 = 528) and a cache of 32768 keys (up to 128 splits):

# %%
items, slots = 32, SMS * 4
chosen = split_count(items, 32768, slots)
counts = np.arange(1, 129)
eff = [wave_efficiency(items * s, slots) for s in counts]
fig, ax = plt.subplots(figsize=(9, 3.4))
ax.plot(counts, eff, ".-", lw=0.8)
ax.axhline(0.85 * max(eff), color="0.5", ls=":", label="85% of the best")
ax.plot([chosen], [wave_efficiency(items * chosen, slots)], "ro", ms=9,
        label=f"split_count = {chosen}: {items * chosen} blocks")
ax.set_xlabel("splits per head")
ax.set_ylabel("wave efficiency")
ax.set_title(f"items = {items}, slots = {slots}", fontsize=10)
ax.legend(fontsize=8)
ax.grid(alpha=0.3)
fig.tight_layout()
plt.show()
print("short caches get fewer splits (256 keys a slice at least):",
      {n: split_count(items, n, slots) for n in (256, 1024, 4096, 32768)})

# %% [markdown]
# The saw-tooth: 16 splits are 512 blocks, 97% of one wave; 17 splits are 544, one full
# wave and 16 blocks in a second one (52%). At 33 splits the two waves are exactly full;
# the rule still takes 15 (480 blocks, 91%), the fewest within 85% of that.
#
# ### Check against the oracle
#
# In the simulator the rule would pick 1 split here (the caches are shorter than 512
# keys: two slices of 256), so the call asks for 3 (`splits=3`) to run both kernels. The tolerance rule of
# the course: the error against the float64 oracle within twice that of float32 NumPy,
# plus a small floor.

# %%
q32 = q.astype(np.float32)
k16, v16 = k.astype(np.float16), v.astype(np.float16)
exact = ref.decode_attention(q32, k16, v16, LENGTHS, causal=True)
baseline = ref.decode_attention(q32, k16, v16, LENGTHS, causal=True, dtype=np.float32)
o_split, lse_split = decode_attention(q32, k16, v16, cache_lengths=LENGTHS, causal=True, schedule="split-k",
                                      splits=3 if on_simulator() else None)
assert_close(o_split, exact[0], baseline[0], name="O")
assert_close(lse_split, exact[1], baseline[1], name="L")
print("split-K: O and L agree with the oracle;", int(np.isinf(lse_split).sum()), "rows see no key (L = -inf)")

# %% [markdown]
# ## 5. Inside a block: streams, one key row at a time
#
# At $N_q = 1$ a block has one query row. Chapter 4's register tiles (64 query rows of
# FMAs for every key) would waste 63 of every 64 FMAs: decode is a matrix-vector product,
# $S = K q$. So the block is organised around **key rows**:
#
# ```
#   block of THREADS threads = NS streams of LK consecutive lanes     (GPU: 128 threads)
#
#   stream st = 0:  lanes 0 .. LK-1     reads key rows j0, j0+1, ... j0+U-1
#   stream st = 1:  lanes LK .. 2LK-1   reads the next U key rows
#   ...
#   one key row k_j (d = D columns): lane ln holds CPL = D / LK of its columns, VEC
#                                    consecutive columns a load, the LK lanes' loads side by
#                                    side: columns ln*VEC .. ln*VEC + VEC-1, then LK*VEC on, ...
#
#   S_rj = q_r . k_j:   each lane: its CPL products   ->  summed across the LK lanes
#                       (a butterfly of log2(LK) warp shuffles, shfl_xor; no shared memory)
#   then every lane of the stream holds S_rj, updates the stream's own (m, l) and its
#   CPL columns of O with P V_j (chapter 3's online softmax, U keys at a time)
#
#   a step: the block consumes NS * U keys; at the end of the range the NS streams'
#   (m, l, O), each a split of the range, are merged in a fixed order in shared memory
# ```
#
# The **U** key rows a stream loads before it uses any of them are its loads in flight:
# in a memory-bound kernel, the bytes requested at once are what keeps HBM busy. The
# scores are kept in base 2 (`exp2`, $q' = q \cdot \text{scale} \cdot \log_2 e$), as in
# chapter 4.
#
# **VEC**, the elements one load reads, is the other half of the speed. Loaded one element
# at a time, an fp16 cache costs a load instruction, its address arithmetic and its bounds
# check for every 2 bytes: at 3 TB/s that is 1.5 T elements a second, and the SMs run out
# of instruction issue before HBM runs out of bytes (these kernels reached 2.15 to 2.20
# TB/s on fp16 caches that way, 72 to 74% of the read bandwidth). A 16-byte load
# (`ld.global.v4`) reads 8 fp16 or 4 fp32 elements with one address and one bounds check.
# Numba has no vector loads; `kernels/base/wide_loads.py` adds one as a small `@intrinsic`
# that emits an aligned LLVM vector load (in the simulator: the same elements one by one).
# It needs every row to start on a 16-byte boundary (d * itemsize a multiple of 16 and an
# aligned base), which the launcher checks; other rows take VEC = 1. The loop over the
# keys, from `make_attend_key_range`:

# %%
show_source(make_attend_key_range, "# ---- the keys, STEP at a time", "s[u, r] = x")

# %% [markdown]
# ### The plan
#
# `plan(d, rows, itemsize, wide)` fixes these shapes at compile time, as a `DecodePlan`:
#
# * `D`: the head dim padded to a power of two (at least 16 on a GPU);
# * `RT`: query rows a block, the group's $g N_q$ rows padded to a power of two, at most 16
#   (more rows: several row tiles, each re-reading K and V, from L2);
# * `LK`: lanes a stream. 8, so that the stream's lanes load 8 consecutive elements of a
#   key row at once; 16 for fp32 keys and one query row (measured best on the H100); and
#   at least $RT \cdot D / 64$, so that a thread's share of O, $RT \cdot D / LK$
#   registers, stays at most 64;
# * `VEC`: with 16-byte-aligned rows (`wide`), as many elements as 16 bytes hold (8 fp16,
#   4 fp32), at most a lane's share of the row; else 1;
# * `U`: key rows in flight a stream: 4 with one query row (fp16 keys, or 16-byte loads),
#   else 2;
# * `MMA`: 0, or, for fp16 caches with several rows, d = 64 or 128 and 16-byte rows, the
#   tensor-core partial of the next section (1: fp16 queries, 2: float32 queries in two
#   fp16 parts).
#
# In the simulator a block has 32 threads (one warp), on a GPU 128; below each plan, the
# same plan with 128 threads: its streams and keys a step.

# %%
for args, what in (((128, 1, 4, True), "fp32 KV, Nq = 1, MHA"), ((128, 1, 2, True), "fp16 KV, Nq = 1, MHA"),
                   ((128, 4, 4, True), "fp32 KV, 4 rows (e.g. GQA g = 4)"), ((128, 16, 4, True), "fp32 KV, 16 rows"),
                   ((100, 1, 2, False), "fp16 KV, d = 100: 200-byte rows, VEC = 1"),
                   ((128, 4, 2, True), "fp16 KV, 4 rows: tensor cores (below)")):
    p = plan(*args)
    gpu = replace(p, threads=128)
    print(f"plan{args}: {p}  | {what}")
    if p.MMA:
        print(f"{'':>16}128 threads: 4 warps of {p.U} keys a step, {p.D // 8 * 4} O registers a thread "
              f"({p.D // 8} accumulator tiles of 16 x 8)")
    else:
        print(f"{'':>16}128 threads: {gpu.streams} streams of {gpu.LK} lanes, {gpu.keys_per_step} keys a step, "
              f"{p.RT * p.D // p.LK} O registers a thread")

# %% [markdown]
# ### Grouped rows on tensor cores
#
# With $g$ query rows a KV head (GQA, or $N_q > 1$), every K and V element a lane loads
# feeds $g$ rows' FMAs for S and $g$ more for O, plus the row sums across lanes. With fp16
# caches at 3 TB/s that is more arithmetic than the FMA units issue: the kernel above
# reaches about half the bandwidth there (section 8). A **tensor core** multiplies a
# 16 x 16 fp16 tile by a 16 x 8 one, accumulating in fp32, in one warp-wide instruction
# (`mma.sync.m16n8k16`, 4096 FLOPs). Numba has no tensor-core API;
# `kernels/base/mma.py` reaches the instruction through a small `@intrinsic` that emits it
# as inline PTX, and runs an emulation of it in the simulator. No lane holds a whole
# operand: each holds a **fragment**, at positions the PTX ISA fixes. The picture is drawn
# from the module's own position table (the one its emulation and tests use):

# %%
from kernels.base import mma as tc

from kernels.base.notebook import draw_fragments

draw_fragments()
plt.show()

# %% [markdown]
# Lanes 4g .. 4g + 3 (a **quad**) hold rows g and g + 8 of the accumulator: a row max is a
# max over 4 lanes (2 shuffles). The tensor-core partial (`make_attend_key_range_mma`)
# gives each warp 16 keys a step:
#
# * **S = q K^T**: two 16 x 8 tiles (keys 0-7 and 8-15), D / 16 mma each. The block's RT
#   rows fill the 16 rows of A (zeros past them: 12 of 16 rows are idle at g = 4, and the
#   tensor cores still have room to spare).
# * **The order inside a dot product is free**, so the kernel chooses it: lane (g, t) of a
#   quad reads **consecutive** head-dim elements, d = t·D/4 + 4s + (0..3) in k-step s, for
#   both q and K. Every K load is a 16-byte load, as in the FMA kernel.
# * **Softmax on the fragments**: scale to base 2, mask, row max over the quad, rescale O
#   and l, P = $2^{S - m}$, all on the 4 scores a lane holds per row.
# * **O += P V**: the two S tiles' accumulators sit exactly where the A operand of the next
#   mma (16 x 16, keys as k) needs them, so P goes from fp32 to fp16 registers and into
#   the mma without shared memory. V is the B operand (keys x d); the order of O's columns
#   is free too, as long as they are written back right: lane group g reads d = g·D/8 + j
#   for its 16 output tiles j, again 16-byte loads, and two keys' halves are paired into
#   one register with a shift and a mask.
# * **Accuracy: two fp16 parts.** K and V are exact in fp16; float32 queries and the
#   weights P are not. FlashAttention rounds P to fp16 (relative error $2^{-12}$); this
#   kernel writes $x = x_{hi} + x_{lo}$, both fp16, and runs two mma: the result meets the
#   same float32 tolerance as the FMA kernel (the tests hold it to that: a planted bug
#   that keeps only $P_{hi}$ fails them).

# %%
show_source(make_attend_key_range_mma, "# ---- S = q K^T on the tensor cores", "sc[nt, i] = x")

# %% [markdown]
# Against the oracle, in whatever runs this notebook (GPU or simulator): GQA 8/2 with an
# fp16 cache of d = 64 and ragged lengths, float32 queries.

# %%
q_tc = random_array(np.random.default_rng(1), (2, 8, 1, 64), 0.3)
k_tc = random_array(np.random.default_rng(2), (2, 2, 40, 64), 0.3, np.float16)
v_tc = random_array(np.random.default_rng(3), (2, 2, 40, 64), 1.0, np.float16)
print("plan:", plan(64, 4, 2, True))
o_tc, lse_tc = decode_attention(q_tc, k_tc, v_tc, cache_lengths=[40, 17])
exact_tc = ref.decode_attention(q_tc, k_tc, v_tc, [40, 17])
base_tc = ref.decode_attention(q_tc, k_tc, v_tc, [40, 17], dtype=np.float32)
assert_close(o_tc, exact_tc[0], base_tc[0], name="O")
assert_close(lse_tc, exact_tc[1], base_tc[1], name="L")
print("tensor-core partial: O and L within the float32 tolerance of the oracle")

# %% [markdown]
# ## 6. Stream-K (Lean Attention)
#
# Split-K cuts every head into the same number of slices. That is right when the heads
# are alike, and wasteful when they are not: in a batch with caches of very different
# lengths (the usual case when serving), a long sequence's slices take longer than a short
# one's, and the short ones' blocks finish early and idle.
#
# Stream-K starts from the **work**: every (item, key tile) pair, where an item is a
# (batch, KV head, row tile) and a key tile is `key_tile(plan)` keys, is laid end to end:
# $W$ units in all. A **persistent** grid of `blocks` = SMs x blocks an SM (one wave, no
# more) cuts them into equal contiguous ranges: block $c$ takes units
# $[\lfloor cW/\text{blocks} \rfloor, \lfloor (c+1)W/\text{blocks} \rfloor)$. A range may
# end inside one item and continue into the next: the block then gets a **segment** of
# each. `stream_k_schedule(tiles_per_item, blocks)` makes that cut:

# %%
sched = stream_k_schedule([10, 10, 10, 10], 6)
print(sched)


# %%
def draw_schedule(ax, tiles, blocks, title):
    """The work laid end to end (colour = item), the blocks' ranges (vertical lines, ids above)."""
    sched = stream_k_schedule(tiles, blocks)
    starts = np.concatenate([[0], np.cumsum(tiles)])
    for g in range(len(sched.seg_item)):
        item = int(sched.seg_item[g])
        a, b = starts[item] + sched.seg_tile_start[g], starts[item] + sched.seg_tile_end[g]
        ax.barh(0, b - a, left=a, height=0.6, color=f"C{item % 10}", edgecolor="white")
    for item, n in enumerate(tiles):
        if n:
            ax.text(starts[item] + n / 2, -0.45, f"head {item}", ha="center", va="top", fontsize=8)
    for c in range(blocks):
        segs = range(sched.cta_first[c], sched.cta_first[c + 1])
        if not len(segs):
            continue
        lo = starts[sched.seg_item[segs[0]]] + sched.seg_tile_start[segs[0]]
        hi = starts[sched.seg_item[segs[-1]]] + sched.seg_tile_end[segs[-1]]
        ax.axvline(lo, color="k", lw=1.2)
        ax.text((lo + hi) / 2, 0.42, f"block {c}\n{hi - lo} units, {len(segs)} seg.", ha="center",
                va="bottom", fontsize=8)
    ax.axvline(starts[-1], color="k", lw=1.2)
    ax.set_ylim(-0.9, 1.1)
    ax.set_yticks([])
    ax.set_xlim(0, starts[-1])
    ax.set_title(title, fontsize=10)


fig, axes = plt.subplots(2, 1, figsize=(11, 4.2))
draw_schedule(axes[0], [10, 10, 10, 10], 6, "uniform: 4 heads x 10 tiles on 6 blocks")
draw_schedule(axes[1], [40, 3, 3, 3], 6, "ragged: tiles [40, 3, 3, 3] on 6 blocks")
axes[1].set_xlabel("work units (key tiles), every head's laid end to end")
fig.tight_layout()
plt.show()

# %% [markdown]
# Uniform: 40 units on 6 blocks, 6 or 7 each; every head is split between two blocks, and
# blocks 1 and 4 each finish one head and start the next. Ragged: with one block per head
# (chapter 4's grid), head 0's block would walk 40 tiles while three others walk 3 and
# idle; split-K would cut every head into the same number of slices. Stream-K gives every
# block $\lceil 49 / 6 \rceil = 9$ units at most: head 0's 40 tiles go to blocks 0 to 4,
# and block 5 takes the three short heads whole.
#
# `check_schedule(schedule, tiles, blocks)` states what a valid cut is (every tile of
# every item in exactly one segment, in order; an empty item in one empty segment; blocks
# balanced to within one unit of $W$ / blocks): the checker of exercise 2.
#
# ### Who merges? The last one to arrive
#
# An item done in one segment is written straight to O and L. An item cut into several
# segments needs a merge, and its segments run on different blocks at unknown times. A
# block that has written its partial does this:
#
# ```
#   write partial (O_g, L_g) to slot g
#   threadfence()                              the partial is visible to every block
#   old = atomic.add(counters[item], 1)        count myself in
#   if old == count - 1:                       I am the LAST of the item's segments
#       threadfence()
#       merge slots item_first .. item_first + count - 1, in that order; write O, L
#       counters[item] = 0                     ready for the next launch
#   (otherwise: go on to my next segment, or exit)
# ```
#
# **No block ever waits for another.** The one that completes the count does the merge;
# the others simply move on. A design where the item's first block spins until the others
# are done would be fragile: on a GPU it holds an SM while it spins, and it deadlocks
# whenever the blocks it waits for cannot be resident at the same time. The simulator runs
# one block at a time, so a spinning block would wait forever there. And because the merge
# folds the partials **in segment order**, not in order of arrival, the result is the same
# bits whichever block happens to be last: stream-K is **bitwise reproducible**. The
# kernel's loop over its block's segments (`make_stream_k`):

# %%
show_source(make_stream_k, "for g in range(cta_first[c]", "`last` is rewritten")

# %% [markdown]
# ### Check against the oracle
#
# Ragged caches (lengths including 0 and 1), GQA (4 query heads on 2 KV heads), two new
# queries a sequence, causal, fp16 caches, on a persistent grid of 3 blocks in the
# simulator. The schedule the launcher builds: the items are (sequence, KV head, row
# tile), each with $\lceil n / \text{key tile} \rceil$ tiles (here one row tile a KV head):

# %%
rows = (HQ // HKV) * NQ                      # a KV head's query rows
p = plan(D_HEAD, rows, 2)                    # fp16 keys: 2 bytes
unit = key_tile(p)
row_tiles = -(-rows // p.RT)
tiles = np.repeat(np.repeat(-(-LENGTHS // unit), HKV), row_tiles)   # items: (sequence, KV head, row tile)
print(f"{p}; key tile = {unit} keys; tiles per item = {tiles.tolist()}")
if BLOCKS is not None:
    s7 = stream_k_schedule(tiles, BLOCKS)
    for c in range(BLOCKS):
        segs = range(s7.cta_first[c], s7.cta_first[c + 1])
        print(f"block {c}: " + ", ".join(f"item {s7.seg_item[g]} tiles [{s7.seg_tile_start[g]}, "
                                         f"{s7.seg_tile_end[g]})" for g in segs))

# %% [markdown]
# In the simulator's schedule above, items 2 and 3 (sequence 1, an empty cache) get one
# empty segment each, so that their rows are still written (O = 0, L = $-\infty$), and
# item 1 is cut between blocks 0 and 1: whichever of the two finishes its segment second
# merges it. The launch:

# %%
o_stream, lse_stream = decode_attention(q32, k16, v16, cache_lengths=LENGTHS, causal=True, schedule="stream-k",
                                        blocks=BLOCKS)
assert_close(o_stream, exact[0], baseline[0], name="O")
assert_close(lse_stream, exact[1], baseline[1], name="L")
print("stream-K: O and L agree with the oracle")

again = decode_attention(q32, k16, v16, cache_lengths=LENGTHS, causal=True, schedule="stream-k", blocks=BLOCKS)
same = np.array_equal(o_stream, again[0]) and np.array_equal(lse_stream, again[1])
print("a second call, bit for bit the same:", same)
print("split-K vs stream-K: max |dO| =", float(np.abs(o_split - o_stream).max()),
      "| same -inf rows:", np.array_equal(np.isinf(lse_split), np.isinf(lse_stream)))

# %% [markdown]
# Split-K and stream-K cut the keys differently, so they agree to float32 rounding, not
# bit for bit; each is reproducible on its own.
#
# ## 7. Real decode inputs
#
# ### GQA and MQA
#
# Grouped-query attention keeps $H_{kv}$ KV heads for $H_q = g H_{kv}$ query heads: query
# heads $g\,kv, \dots, g\,kv + g - 1$ all read KV head $kv$ (MQA is $H_{kv} = 1$). The
# cache is $g$ times smaller, and, better for a kernel, those $g$ heads' $N_q$ rows each
# are **consecutive in memory**: `q.reshape(B * Hkv, g * Nq, d)` makes them the rows of one
# KV head, and one block takes them together. K and V are read once for the whole group,
# and the block has $g N_q$ query rows to share each key row among (section 5's `RT`).

# %%
g, nq_demo, hkv_demo = 4, 2, 2
print(f"Hq = {g * hkv_demo}, Hkv = {hkv_demo}, Nq = {nq_demo}: row r of KV head kv is (query head, query)")
for kv in range(hkv_demo):
    print(f"  KV head {kv}:", [(kv * g + r // nq_demo, r % nq_demo) for r in range(g * nq_demo)])

# %% [markdown]
# MQA (every query head on one KV head), through the stream-K launcher, against the oracle:

# %%
k_mqa, v_mqa = np.ascontiguousarray(k16[:, :1]), np.ascontiguousarray(v16[:, :1])
o_mqa, lse_mqa = decode_attention(q32, k_mqa, v_mqa, cache_lengths=LENGTHS, blocks=BLOCKS)
exact_mqa = ref.decode_attention(q32, k_mqa, v_mqa, LENGTHS)
base_mqa = ref.decode_attention(q32, k_mqa, v_mqa, LENGTHS, dtype=np.float32)
assert_close(o_mqa, exact_mqa[0], base_mqa[0], name="O")
assert_close(lse_mqa, exact_mqa[1], base_mqa[1], name="L")
print(f"MQA: {HQ} query heads on 1 KV head agree with the oracle")

# %% [markdown]
# ### Cache lengths
#
# A batch's sequences have different lengths; the cache is allocated at `Nmax` rows, and
# sequence $b$'s keys are its first `cache_lengths[b]` rows. What lies beyond is whatever
# the allocator left there, so it must **never be read into the result**: not even
# multiplied by 0, since $0 \cdot \text{NaN} = \text{NaN}$. The kernel clamps every key
# index into the range and zeroes what lies past it. Fill everything beyond the lengths
# with NaN:

# %%
k_nan, v_nan = k16.copy(), v16.copy()
for b_, n_ in enumerate(LENGTHS):
    k_nan[b_, :, n_:] = np.nan
    v_nan[b_, :, n_:] = np.nan
o_nan, lse_nan = decode_attention(q32, k_nan, v_nan, cache_lengths=LENGTHS, causal=True, blocks=BLOCKS)
print("NaN in the cache beyond the lengths; any NaN in O?", bool(np.isnan(o_nan).any()),
      "| same as without the garbage:", np.array_equal(o_nan, o_stream) and np.array_equal(lse_nan, lse_stream))

# %% [markdown]
# (A cache length of 0 is allowed: the sequence's rows see no key, O = 0 and L = $-\infty$.)
#
# ### Causal, relative to the end of the cache
#
# The $N_q$ new tokens are the **last** $N_q$ of their sequence, already written into the
# cache at rows $n - N_q, \dots, n - 1$ (for a cache length $n$). Query $i$ of $N_q$ sees key
# $j$ iff $j \le i + n - N_q$: the bottom-right aligned diagonal of chapter 1's
# `causal_mask`. With $N_q = 3$ and $n = 6$:

# %%
print(ref.causal_mask(3, 6).astype(int))
print("with n = 1 and Nq = 2 (sequence 2 above), query 0 sees no key:", ref.causal_mask(2, 1).astype(int).tolist())

# %% [markdown]
# ### fp16 caches
#
# K and V stored in float16 halve the bytes and so the floor; the FMA kernel converts each
# element to float32 as it loads it, and computes in float32 (grouped rows take the tensor
# cores, section 5, with float32 accumulation). The launcher takes fp32 or fp16 caches
# (one dtype for both); Q may be either.

# %%
for itemsize, name in ((4, "fp32"), (2, "fp16")):
    nbytes = io_model_bytes(8, 32, 8, 1, [32768] * 8, 128, kv_itemsize=itemsize)
    print(f"B=8, Hq=32, Hkv=8, d=128, 32768 keys each, {name} KV: {nbytes / 1e9:.3f} GB -> "
          f">= {nbytes / (HBM_TBS * 1e12) * 1e3:.3f} ms")

# %% [markdown]
# ## 8. Results from the GPU
#
# `python -m kernels --chapters 7` measures the decode kernels on the GPU and writes
# `workbook/results/decode.csv` and a plot, `decode.png`. The bench runs one new token
# ($N_q = 1$), 32 query heads of d = 128 (MHA, and GQA with 8 KV heads), fp32 and fp16
# caches, uniform batches from 1 x 4k to 1 x 512k keys and a ragged batch, both schedules,
# and in the same run: the card's read bandwidth (a sum over 4 GiB), SDPA, plain PyTorch
# and chapter 4's `flash_attention`. Its `gbps` column is the compulsory bytes
# (`io_model_bytes`) over the time, and `extra` holds `pct_read_bw`, that bandwidth as a
# percentage of the measured read bandwidth: how close a kernel comes to the floor.
#
# Each launcher is timed two ways: **one call** of `decode_attention` (checks, outputs and
# launches, timed as one call's latency; its plan is cached by the warm-up calls of the same
# shape, as the layers of a model share one in a decode step) and **prepared**: a
# `prepare_decode` plan made once and called again (the launches alone, as a serving loop
# runs a step). The table below gives TB/s (`gbps` / 1000) per configuration; "best SDPA"
# is SDPA flash for fp16 caches and the better of SDPA memory-efficient and math for fp32;
# on the ragged batch the peers run on the batch padded to 128k keys (SDPA takes no cache
# lengths) and are credited only the cached bytes; "FMA units" is the GQA fp16 rows'
# stream-K plan with `tensor_cores=False`; `-`: not measured.

# %%
import csv
from pathlib import Path

results_dir = Path("results") if Path("results").is_dir() else Path("workbook/results")
csv_path, png_path = results_dir / "decode.csv", results_dir / "decode.png"


def extra_of(row):
    return dict(kv.split("=", 1) for kv in row.get("extra", "").split(";") if "=" in kv)


if csv_path.exists():
    with open(csv_path, newline="") as fh:
        lines = fh.read().splitlines()
    for line in lines:
        if line.startswith("# "):                       # the run's environment: device, driver, date
            print(line[2:])
    table = list(csv.DictReader(line for line in lines if line and not line.startswith("#")))
    by_key = {(r["config"], r["kernel"]): r for r in table}
    read_bw = next((float(r["gbps"]) / 1e3 for r in table if r["kernel"].startswith("peer: read bandwidth")), None)
    if read_bw is not None:
        print(f"\nread bandwidth in the same run (torch.sum over 4 GiB fp32): {read_bw:.2f} TB/s")

    def tbps(config, kernel):
        r = by_key.get((config, kernel))
        return None if r is None else float(r["gbps"]) / 1e3

    def best_sdpa(config, kv):
        if kv == "fp16":
            candidates = [("flash", tbps(config, "peer: SDPA flash"))]
        else:
            candidates = [("efficient", tbps(config, "peer: SDPA efficient")),
                          ("math", tbps(config, "peer: SDPA math"))]
        candidates = [(v, name) for name, v in candidates if v is not None]
        return max(candidates) if candidates else (None, "")

    selection = [                                       # (config prefix, label)
        ("B=1 Hq=32 Hkv=32 N=4k", "B=1, N=4k"), ("B=1 Hq=32 Hkv=32 N=16k", "B=1, N=16k"),
        ("B=1 Hq=32 Hkv=32 N=64k", "B=1, N=64k"), ("B=1 Hq=32 Hkv=32 N=128k", "B=1, N=128k"),
        ("B=1 Hq=32 Hkv=32 N=512k", "B=1, N=512k"), ("B=4 Hq=32 Hkv=32 N=128k", "B=4, N=128k"),
        ("B=16 Hq=32 Hkv=32 N=64k", "B=16, N=64k"), ("B=64 Hq=32 Hkv=32 N=16k", "B=64, N=16k"),
        ("B=1 Hq=32 Hkv=8 N=128k", "GQA 32/8, B=1, N=128k"), ("B=16 Hq=32 Hkv=8 N=64k", "GQA 32/8, B=16, N=64k"),
        ("B=1 Hq=40 Hkv=40 N=128k", "H=40, B=1, N=128k"),
        ("B=4 Hq=32 Hkv=8 N=128k+8k+8k+8k", "ragged GQA, 128k+8k+8k+8k"),
    ]
    columns = [("split-K prep", "prepare_decode split-k (run)"), ("stream-K prep", "prepare_decode stream-k (run)"),
               ("split-K 1 call", "decode_attention split-k"), ("stream-K 1 call", "decode_attention stream-k"),
               ("FMA units prep", "prepare_decode stream-k, FMA units (run)")]
    cell = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
    print("\nTB/s, Nq = 1, d = 128, 32 query heads (MHA) unless stated")
    print(f"{'config':<27}{'KV':<6}" + "".join(f"{name:>16}" for name, _ in columns)
          + f"{'best SDPA':>19}{'plain PyTorch':>15}{'chapter 4':>11}")
    for prefix, label in selection:
        for kv in ("fp32", "fp16"):
            config = f"{prefix} d=128 {kv} KV"
            if not any(c == config for c, _ in by_key):
                continue
            sdpa, sdpa_name = best_sdpa(config, kv)
            print(f"{label:<27}{kv:<6}" + "".join(f"{cell(tbps(config, k)):>16}" for _, k in columns)
                  + f"{(cell(sdpa) + (f' ({sdpa_name})' if sdpa is not None else '')):>19}"
                  + f"{cell(tbps(config, 'peer: plain PyTorch')):>15}"
                  + f"{cell(tbps(config, 'chapter 4: flash_attention')):>11}")
else:
    print("GPU results are not committed yet (workbook/results/decode.csv): "
          "`python -m kernels --chapters 7` on a GPU produces them.")

# %% [markdown]
# The same rows as a picture: TB/s against the context length at B = 1 (MHA, 32 heads),
# peers dashed, the measured read bandwidth dotted. Below it, the bench's own plot
# (`decode.png`): TB/s against context length (fp32 and fp16 caches; decode is judged by
# bandwidth, not FLOPs), and every batch shape as split-K / stream-K / best PyTorch bars.

# %%
if csv_path.exists():
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    sizes = [("4k", 4), ("16k", 16), ("64k", 64), ("128k", 128), ("512k", 512)]
    for ax, kv in zip(axes, ("fp32", "fp16")):
        kernels_ = ["prepare_decode split-k (run)", "prepare_decode stream-k (run)", "decode_attention split-k",
                    "peer: SDPA flash" if kv == "fp16" else "peer: SDPA math", "peer: plain PyTorch"]
        for kernel in kernels_:
            pts = [(n, tbps(f"B=1 Hq=32 Hkv=32 N={name} d=128 {kv} KV", kernel)) for name, n in sizes]
            pts = [(n, v) for n, v in pts if v is not None]
            if pts:
                ax.plot([n for n, _ in pts], [v for _, v in pts], marker="o",
                        linestyle="--" if kernel.startswith("peer") else "-", label=kernel.replace("peer: ", ""))
        if read_bw is not None:
            ax.axhline(read_bw, color="grey", linestyle=":", label=f"read bandwidth {read_bw:.2f} TB/s")
        ax.set_xscale("log", base=2)
        ax.set_xticks([n for _, n in sizes], [name for name, _ in sizes])
        ax.set_xlabel("keys in the cache (B = 1, H = 32, d = 128)")
        ax.set_title(f"{kv} cache")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("TB/s (compulsory bytes / time)")
    for ax in axes:
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    fig.tight_layout()
    plt.show()
    if png_path.exists():
        from IPython.display import Image, display

        display(Image(str(png_path)))

# %% [markdown]
# What the H100 says (one run; every number is in the CSV; "prepared" is `prepare_decode`
# run again, one call is `decode_attention`; the read bandwidth of the same run is 2.96 TB/s,
# other runs measured up to 3.06):
#
# * **MHA at the bandwidth, fp32 and fp16.** From B·N = 64k keys up, the prepared kernels
#   stream 2.68 to 3.09 TB/s, 90 to 104% of the read bandwidth (a sum over 4 GiB is a
#   reference, not a ceiling), with either cache dtype: B = 1 at 128k 3.01 (fp32) and 2.84
#   (fp16) TB/s, at 512k 3.05 and 3.04.
# * **fp16 caches: level with SDPA flash or ahead** (with the better of the two
#   schedules): 1.38 against 0.74 TB/s at B = 1, 4k; 2.35 against 1.91 at 16k; 2.84
#   against 2.69 at 128k; 3.04 against 3.04 at 512k; 3.06 against 2.48 at B = 16, 64k; 2.95
#   against 2.94 at H = 40. GQA 32/8: 2.34 against 2.36 at B = 1, 128k and 2.90 against
#   2.99 at B = 16, 64k, 1 and 3% behind in this run (2 and 3% ahead in the run before).
# * **fp32 caches: 2.2 to 2.4x the best SDPA fp32 backend** on MHA (memory-efficient or
#   math): 1.75 against 0.80 TB/s at B = 1, 4k; 3.01 against 1.26 at 128k; 3.09 against
#   1.40 at B = 64, 16k; 16 to 18x on GQA, where SDPA runs its math backend. Plain PyTorch,
#   which reads K and V as two matrix products, is the nearest fp32 peer (1.55 to 2.31 TB/s
#   on MHA).
# * **One call plans once a shape.** `decode_attention` keeps the plan of each call shape
#   (shapes, cache lengths, options: `DecodeLaunches`, built in 1 to 5 ms of host work), so
#   the next call of that shape (the next layer of the model, in the same decode step) only
#   passes its arrays' pointers to launches bound once (`kernels.base.runtime.LaunchTemplate`
#   does Numba's per-launch work, typing the arguments, finding the compiled kernel,
#   flattening each array into pointer, shape and strides, once). Such a call costs 0.1 to
#   0.2 ms more than the prepared run (at B = 1, 128k: 0.90 against 0.76 ms with fp16
#   caches); before the plan was kept, every call spent 1.1 to 1.6 ms on it. Below 64k keys
#   that leftover host work still shows: SDPA flash's one call takes 0.09 ms at B = 1, 4k,
#   fp16, ours 0.15, and the prepared call 0.05. A serving loop prepares once.
# * **Stream-K wins where the work is uneven.** On the ragged GQA batch {128k, 8k, 8k, 8k}
#   it takes 0.50 ms against split-K's 1.29 (fp32) and 0.28 against 0.56 (fp16): 1.16x and
#   1.30x the floor of the bytes actually cached. On uniform batches it is ahead or level
#   in most configurations, by up to 14% (B = 16, 64k, fp16 MHA and GQA; H = 40, fp16);
#   split-K is ahead by 6% at B = 1, 4k, fp32.
# * **GQA with fp16 caches runs on tensor cores.** With 4 query rows a KV head every K and
#   V element feeds 8 FMAs plus per-row sums and softmax: on the FMA units the same plan
#   reaches 1.49 TB/s (B = 1, 128k) and 1.70 (B = 16, 64k), bound by instruction issue. On
#   tensor cores (section 5) the group's rows take 2.34 and 2.90 TB/s: 1.6 and 1.7x. Two
#   gaps remain: at B = 1, 128k we reach 79% of the read bandwidth and SDPA flash 80%
#   (the fixed costs of a 0.23 ms pass; Nsight Compute shows our kernel at 254 registers a
#   thread, two blocks an SM, DRAM 74% busy while it runs), and the fp32 GQA rows, which
#   stay on the FMA units, reach 2.42 (82%) and 2.84 TB/s (96%).
# * **A trick that did not pay here.** Rescaling l and O only when a row's max grows (the
#   factor is otherwise $2^0 = 1$) skips RT·CPL multiplies a step, and measured slower in a
#   separate run: GQA 32/8 fp32 at B = 16, 64k from 3.06 to 3.49 ms, the ragged batch from
#   0.50 to 0.57 ms, MHA unchanged. The branch for each row costs more than the multiplies
#   it skips, so the kernel rescales every step.
# * **Against chapter 4** at B = 1, H = 32, N = 128k, fp32: 1.43 ms (prepared stream-K)
#   against 38.25 ms for `flash_attention`, whose grid starves at $N_q = 1$: 26.8x less time.
#
# Every row of the CSV, with the fraction of the read bandwidth and the floor (K and V bytes
# over the read bandwidth):

# %%
if csv_path.exists():
    print(f"{'kernel':<44}{'config':<46}{'ms':>10}{'GB/s':>9}{'% read bw':>11}{'floor ms':>10}")
    for r in table:
        extra = extra_of(r)
        cells = []
        for key, fmt in (("median_ms", "10.4g"), ("gbps", "9.4g")):
            try:
                cells.append(format(float(r[key]), fmt))
            except ValueError:
                cells.append(format(r[key], ">" + fmt.split(".")[0]))
        for key, width in (("pct_read_bw", 11), ("floor_ms", 10)):
            try:
                cells.append(format(float(extra[key]), f"{width}.3g"))
            except (KeyError, ValueError):
                cells.append(" " * (width - 1) + "-")
        print(f"{r['kernel']:<44.44}{r['config']:<46.46}" + "".join(cells))

# %% [markdown]
# ## 9. Exercises
#
# ### Exercise 1: the combine, in NumPy
#
# Write `my_merge_partials(o_parts, l_parts)`: `o_parts` (S, rows, d) and `l_parts`
# (S, rows) are S partials; return `(O, L)`, O (rows, d) and L (rows,), the partial of all
# S slices together. Empty pieces have $L_s = -\infty$ (and $O_s = 0$); a row whose pieces
# are all empty gives $O = 0$, $L = -\infty$; no `exp` may overflow.
#
# The checker draws rows of scores (with $-\infty$ entries) and values, cuts the keys into
# S slices (some empty), makes each slice's partial with the oracle, and compares your merge
# with the oracle on the **whole** row. The starter below returns the first partial: right
# for S = 1 only.

# %%
def my_merge_partials(o_parts, l_parts):
    # your code here: return (O, L)
    return o_parts[0], l_parts[0]


# %%
from hypothesis import strategies as st


@dataclass
class PartialCase:
    """S partials (o_parts (S, rows, d), l_parts (S, rows)) of a block of rows whose keys
    were cut into S slices, and the oracle's (O, L) over all the keys."""
    o_parts: np.ndarray
    l_parts: np.ndarray
    o_want: np.ndarray
    l_want: np.ndarray

    def __repr__(self):
        S, rows, d = self.o_parts.shape
        return f"PartialCase(S={S}, rows={rows}, d={d}, L_s={np.round(self.l_parts, 3).tolist()})"


@st.composite
def partial_cases(draw, max_slices=5, max_rows=4, max_d=6, max_keys=12):
    """A PartialCase: scores with -inf entries, cut into S slices (some empty)."""
    S = draw(st.integers(1, max_slices))
    rows, d, n = draw(st.integers(1, max_rows)), draw(st.integers(1, max_d)), draw(st.integers(0, max_keys))
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=S - 1, max_size=S - 1)))
    masked = draw(st.sampled_from([0.0, 0.3, 1.0]))
    magnitude = draw(st.sampled_from([1.0, 10.0, 300.0]))
    gen = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = gen.standard_normal((rows, n)) * magnitude
    x[gen.random((rows, n)) < masked] = -np.inf
    vals = gen.standard_normal((n, d))
    bounds = [0, *cuts, n]
    o_parts, l_parts = np.zeros((S, rows, d)), np.zeros((S, rows))
    for s in range(S):
        a, b = bounds[s], bounds[s + 1]
        o_parts[s] = ref.softmax(x[:, a:b]) @ vals[a:b] if b > a else 0.0
        l_parts[s] = ref.logsumexp(x[:, a:b])
    return PartialCase(o_parts, l_parts, ref.softmax(x) @ vals if n else np.zeros((rows, d)), ref.logsumexp(x))


def merge_prop(solution, rtol=1e-10, atol=1e-12):
    def prop(case):
        o_want, l_want = case.o_want, case.l_want
        with np.errstate(over="raise"):
            o, lse = solution(case.o_parts.copy(), case.l_parts.copy())
        o, lse = np.asarray(o, np.float64), np.asarray(lse, np.float64)
        assert o.shape == o_want.shape and lse.shape == l_want.shape, \
            f"shapes {o.shape}, {lse.shape}; expected {o_want.shape}, {l_want.shape}"
        np.testing.assert_allclose(lse, l_want, rtol=rtol, atol=atol, err_msg="L")
        np.testing.assert_allclose(o, o_want, rtol=rtol, atol=atol, err_msg="O")
    return prop


_ = check_exercise(merge_prop(my_merge_partials), partial_cases(), host=True)

# %% [markdown]
# The checker on the module's `merge_partials_numpy`:

# %%
_ = check_exercise(merge_prop(merge_partials_numpy), partial_cases(), host=True)

# %% [markdown]
# ### Exercise 2: the stream-K schedule
#
# Write `my_stream_k_schedule(tiles_per_item, blocks)` returning a `StreamKSchedule`:
#
# * `cta_first` (blocks + 1,): block c runs segments `cta_first[c] .. cta_first[c+1] - 1`;
# * `seg_item`, `seg_tile_start`, `seg_tile_end` (segments,): segment g is tiles
#   `[seg_tile_start[g], seg_tile_end[g])` of item `seg_item[g]`, segments in the order of
#   the work laid end to end;
# * `item_first`, `item_count` (items,): item i's segments are
#   `item_first[i] .. item_first[i] + item_count[i] - 1`.
#
# Blocks take contiguous ranges of the work, at most $\lceil W / \text{blocks} \rceil$ units
# each; an item with no tiles still gets one empty segment `[0, 0)` (so that its O = 0,
# L = $-\infty$ are written). The checker draws tile lists (with zeros) and block counts
# (more blocks than units too) and runs `check_schedule` on your result.
#
# Hint: block c's range is
# $[\lfloor cW/\text{blocks} \rfloor, \lfloor (c+1)W/\text{blocks} \rfloor)$; walk the
# items, and for each, the blocks whose range overlaps it. `np.searchsorted` finds a block
# from a position.

# %%
def my_stream_k_schedule(tiles_per_item, blocks):
    # your code here: return StreamKSchedule(cta_first=..., seg_item=..., seg_tile_start=...,
    #                                        seg_tile_end=..., item_first=..., item_count=...)
    raise NotImplementedError


# %%
schedule_cases = st.tuples(st.lists(st.integers(0, 12), min_size=0, max_size=8), st.integers(1, 10))


def schedule_prop(solution):
    def prop(case):
        tiles, blocks = case
        sched = solution(list(tiles), blocks)
        assert isinstance(sched, StreamKSchedule), f"expected a StreamKSchedule, got {type(sched).__name__}"
        check_schedule(sched, tiles, blocks)
    return prop


_ = check_exercise(schedule_prop(my_stream_k_schedule), schedule_cases, host=True)

# %% [markdown]
# The checker on the module's `stream_k_schedule`:

# %%
_ = check_exercise(schedule_prop(stream_k_schedule), schedule_cases, host=True)

# %% [markdown]
# ### Exercises 3 and 4 (kernels): split-K's combine, and a first partial
#
# Write each in your own file (the cells below make them from templates the first time:
# `workbook/mine/my_decode_combine.py` and `workbook/mine/my_first_partial.py`); `grade`
# runs this chapter's tests on your kernel in place of the course's and prints the smallest
# case that fails, naming the block and thread that own the worst element. The tests fill
# every output with NaN first, so an element no thread writes shows.
#
# **Exercise 3: split-K's combine.** Write `make_combine(D, RT, THREADS)`, the course's own
# factory: your kernel replaces it inside `decode_attention(..., schedule="split-k")` (its
# plan looks the factory up when it is made) and in `combine_partials`, which runs it on
# partials the test draws. It returns a kernel `combine(o_part, l_part, o, lse, splits, d)`,
# launched on grid `(row tiles, H)` with `THREADS` threads a block:
#
# * block `(t, h)` takes rows `t*RT .. t*RT + RT - 1` of head `h`, those below `o.shape[1]`
#   (the last tile may be short);
# * its partials are the slots `first .. first + splits - 1`, with
#   `first = (h * cuda.gridDim.x + t) * splits`: split `s` of row `t*RT + r` left
#   $O_s$ (normalised) in `o_part[first + s, r, :]` and $L_s$ in `l_part[first + s, r]`;
# * it writes `o[h, row, c]` for the columns `c < d`, and `lse[h, row]`. `D >= d` is the
#   padded head dim: a block's `RT * D` elements are shared among its `THREADS` threads.
#
# An empty piece has $L_s = -\infty$ (and $O_s = 0$); a row whose pieces are all empty (an
# empty cache) gives $O = 0$, $L = -\infty$, never NaN. Graded by
# `test_combine_of_drawn_partials_matches_the_merge` (drawn partials, some empty, logits up
# to 300, a ragged last tile) and `test_combine_inside_split_k_decode`.
#
# **Exercise 4: a first split-K partial.** Write `make_first_partial()`, returning a kernel
# `first_partial(q, k, v, lengths, o_part, l_part, scale, causal)`: q `(B, Hq, Nq, d)`; k
# and v `(B, Hkv, Nmax, d)`, float32 or float16 (convert what you read with `float32(...)`:
# the arithmetic is float32); lengths `(B,)` int32; o_part `(R, splits, d)` and l_part
# `(R, splits)`, R = B·Hq·Nq query rows, row = (b·Hq + h)·Nq + i. Launch: grid
# `(R, splits)`, **one block a (query row, split)**, **d threads, one a column of O**.
# Block `(row, s)`:
#
# * reads sequence b's keys only: its first n = `lengths[b]` rows (the test fills the rows
#   past n with NaN);
# * reads KV head h // (Hq / Hkv) (GQA);
# * takes split s of them, keys $[s c, \min((s + 1) c, n))$ with $c = \lceil n / \text{splits}
#   \rceil$, as `split_ranges` cuts them (maybe empty);
# * if `causal`, lets query i see key j only if $j \le i + n - N_q$;
# * writes $O_s = \mathrm{softmax}(S_{\text{slice}}) V_{\text{slice}}$ (normalised) to
#   `o_part[row, s, :]` and $L_s = \mathrm{logsumexp}(S_{\text{slice}})$ to `l_part[row, s]`:
#   $O_s = 0$, $L_s = -\infty$ where the row sees no key of its slice.
#
# `first_split_k(q, k, v, cache_lengths=..., causal=..., splits=...)` launches it, then the
# course's combine, and `test_first_split_k_matches_the_oracle` compares the result with
# `ref.decode_attention` (ragged lengths with 0 and 1, more splits than keys, GQA, causal
# with a length below Nq, fp16 caches, logits around 1e4).
#
# <details><summary>Hint 1 (exercise 3)</summary>
#
# `for e in range(cuda.threadIdx.x, RT * D, THREADS):` with `r, c = e // D, e % D` gives
# each thread its elements; skip `t*RT + r >= o.shape[1]` and `c >= d`. `splits` is small:
# each thread folds its row's splits alone, no shared memory.
# </details>
#
# <details><summary>Hint 2 (exercise 3)</summary>
#
# The fold is chapter 3's merge of the states $(L_s, 1)$, with O carried along: start
# $m = -\infty$, $l = 0$, $O = 0$; for each split, $m' = \max(m, L_s)$; if $m' = -\infty$
# nothing is seen yet, so skip it (no `exp(-inf - (-inf))`); else
# $l \leftarrow l e^{m - m'} + e^{L_s - m'}$, $O \leftarrow O e^{m - m'} + O_s e^{L_s - m'}$,
# $m \leftarrow m'$. At the end $O / l$ and $L = m + \log l$, or $(0, -\infty)$ when
# $l = 0$; the thread with `c == 0` writes `lse`.
# </details>
#
# <details><summary>Hint 3 (exercise 4)</summary>
#
# `row, s, c = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x`; then b, h and i from
# row, `n = lengths[b]`, `chunk = (n + splits - 1) // splits`, `start = min(s * chunk, n)`,
# `end = min(start + chunk, n)`. Every thread of the block computes the same
# $S_{ij} = \text{scale} \sum_t q_{it} k_{jt}$ on its own (d loads a key: the cost of a
# first version).
# </details>
#
# <details><summary>Hint 4 (exercise 4)</summary>
#
# Then chapter 3's online softmax over the slice, key by key: $m' = \max(m, S_{ij})$,
# $\alpha = e^{m - m'}$ (0 while $m = -\infty$), $p = e^{S_{ij} - m'}$,
# $l \leftarrow l \alpha + p$, and this thread's column $O_c \leftarrow O_c \alpha + p\,v_{jc}$.
# Keys come in order, so a causal row can `break` at its first masked key. At the end
# write $O_c / l$ and $m + \log l$, or 0 and $-\infty$ when $l = 0$.
# </details>

# %%
from kernels.base.learner import grade, my_file

TEMPLATE_COMBINE = '''"""My split-K combine for chapter 7 (graded by tests/test_decode.py -k test_combine)."""
CHAPTER = "decode"

import functools
import math

from numba import cuda, float32

from kernels.online_softmax import merge_state


@functools.lru_cache(maxsize=None)      # one kernel per (D, RT, THREADS): compiled once on a GPU
def make_combine(D, RT, THREADS):
    @cuda.jit
    def combine(o_part, l_part, o, lse, splits, d):
        raise NotImplementedError       # your code: rows t*RT .. of head h, from their splits' partials

    return combine
'''

mine_combine = my_file("my_decode_combine.py", TEMPLATE_COMBINE)

# %%
combine_passed = grade(mine_combine)

# %% [markdown]
# The course's version, `make_combine` with its device function `make_merge_partials` in
# `kernels/decode.py`, prints here once yours passes: stream-K's last block runs the same
# device function.

# %%
if combine_passed:
    from kernels import decode as decode_module

    print(inspect.getsource(decode_module.make_merge_partials))
    print(inspect.getsource(decode_module.make_combine))
else:
    print("(shown once your kernel passes; stuck? read make_merge_partials and make_combine in kernels/decode.py)")

# %%
TEMPLATE_PARTIAL = '''"""My first split-K partial for chapter 7 (tests/test_decode.py -k test_first_split_k)."""
CHAPTER = "decode"

import functools
import math

from numba import cuda, float32


@functools.lru_cache(maxsize=None)      # compiled once on a GPU
def make_first_partial():
    @cuda.jit
    def first_partial(q, k, v, lengths, o_part, l_part, scale, causal):
        raise NotImplementedError       # your code: (O_s, L_s) of block (row, split), thread c: column c

    return first_partial
'''

mine_partial = my_file("my_first_partial.py", TEMPLATE_PARTIAL)

# %%
partial_passed = grade(mine_partial)

# %% [markdown]
# The course's version, `make_first_partial` in `kernels/decode.py`, prints here once yours
# passes.

# %%
if partial_passed:
    from kernels import decode as decode_module

    print(inspect.getsource(decode_module.make_first_partial))
else:
    print("(shown once your kernel passes; stuck? read make_first_partial in kernels/decode.py)")

# %% [markdown]
# Counting: for each key of its slice, each of the block's d threads reads the whole key
# row (d loads, the same addresses for every thread) and one element of V. And a block has
# one query row: in a GQA group of g query heads, or with Nq > 1, every key and value is
# read once for each of the group's g·Nq rows. Section 5's partial reads each K and V
# element once for the whole group, one load a lane (16 bytes where rows are aligned), and
# adds its dot products across the lanes with shuffles.
