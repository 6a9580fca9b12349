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
# # 9. Tree attention: attention as an energy gradient, reduced across devices
#
# Chapter 7 cut a decode step's keys into slices on one GPU and merged the partial results
# with chapter 3's merge. A model whose KV cache does not fit one GPU (millions of tokens)
# cuts it across **devices**, and then the merge is a conversation between them. Tree
# Attention (Shyam et al. 2024, arXiv 2408.04093) makes two points:
#
# * attention is the **gradient of a scalar energy**, $F(\zeta) = \log\sum_a \exp(q\cdot k_a +
#   \zeta\cdot v_a)$, with $\mathrm{softmax}(qK^\top)V = \partial F/\partial\zeta$ at $\zeta = 0$;
# * the energy of the whole sequence is the **logsumexp of the shards' energies**: a
#   reduction, associative, so it can run as a tree across devices (all-reduce MAX, then
#   SUM), moving a few numbers a query head instead of the keys themselves, where Ring
#   Attention passes the KV shards around the ring.
#
# This chapter:
#
# 1. the energy, its gradients and Hessian, checked by central differences in float64;
# 2. one GPU as P devices: P shards' partials and a log-depth **tree** reduction in Numba
#    beside chapter 7's flat one;
# 3. several processes through a real distributed engine, **MPI**: the reduction as a
#    ladder of collectives, and Ring Attention as the baseline, bytes counted;
# 4. a napkin model of a decode step on p GPUs, tree against ring, beside the paper's claims;
# 5. the H100 results;
# 6. exercises.
#
# **Sources** (numbered as in the README's list): [10] Tree Attention (Shyam et al. 2024),
# Algorithm 3 (the tree decode); [11] Ring Attention (Liu, Zaharia and Abbeel 2023), the
# baseline; [7] Flash-Decoding (the partials).

# %%
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

import kernels  # noqa: F401  (GPU or simulator, chosen before Numba is imported)
from kernels import reference as ref
from kernels.base.notebook import show_source
from kernels.base.runtime import device_name, on_simulator
from kernels.base.testing import random_array
from kernels.bench.harness import show_results
from kernels.decode import merge_partials_numpy
from kernels.tree_attention import (make_tree_reduce, prepare_tree_decode, shard_ranges, tree_decode_attention,
                                    tree_levels, tree_reduce_numpy)
from kernels.tree_distributed import reduce_allgather, reduce_packed, reduce_tree, ring_bytes, shard_bounds, tree_bytes

print("running on:", device_name())

# %% [markdown]
# ## 1. Attention is the gradient of an energy
#
# Take one query $q \in \mathbb{R}^d$, keys $K \in \mathbb{R}^{N\times d}$, values
# $V \in \mathbb{R}^{N\times d_v}$ and the scale $s$. Add a "source" $\zeta \in \mathbb{R}^{d_v}$
# and define the scalar
#
# $$F(\zeta, q) = \log \sum_{a=1}^{N} \exp\left(s\, q\cdot k_a + \zeta\cdot v_a\right).$$
#
# Write $x_a = s\,q\cdot k_a + \zeta\cdot v_a$ and $P_a = e^{x_a - F}$: the $P_a$ are a softmax
# ($P_a \ge 0$, $\sum_a P_a = 1$). Differentiate $\log\sum_a e^{x_a}$ once:
#
# $$\frac{\partial F}{\partial \zeta} = \frac{\sum_a e^{x_a} v_a}{\sum_b e^{x_b}} = \sum_a P_a v_a,
# \qquad \frac{\partial F}{\partial q} = s \sum_a P_a k_a .$$
#
# At $\zeta = 0$, $P = \mathrm{softmax}(s\,qK^\top)$, so $\partial F/\partial\zeta = \mathrm{softmax}(s\,qK^\top)V = O$:
# **attention's output is a gradient**, and $F(0, q) = \mathrm{logsumexp}(s\,qK^\top) = L$ is the very
# $L$ every flash kernel of this course saves. Differentiate once more ($\partial P_a/\partial\zeta = P_a(v_a - O)$):
#
# $$\frac{\partial^2 F}{\partial \zeta^2} = \sum_a P_a v_a v_a^\top - O O^\top = \mathrm{Cov}_P(v),$$
#
# a covariance: symmetric, positive semi-definite, so $F$ is convex in $\zeta$.
#
# **Why it matters for devices.** The sum over $a$ runs over the keys. Cut the keys into shards
# $S_1, \dots, S_p$ (any cut; empty shards allowed) and each shard has its own energy $F_s$. Then
#
# $$F = \log \sum_{s} e^{F_s}, \qquad O = \sum_s e^{F_s - F}\, O_s ,$$
#
# which is chapter 3's merge of the states $(m, \ell) = (F_s, 1)$, with $O$ carried along: the decode
# chapter's merge of partials. It is associative, so the shards can be combined in a tree of depth
# $\log_2 p$: that is Tree Attention (arXiv 2408.04093). An empty shard has $F_s = -\infty$, $O_s = 0$:
# the identity.

# %%
from kernels.attention_energy import (central_difference, energy, energy_grad_q, energy_grad_zeta,
                                      energy_hessian_zeta, cuts_to_ranges, shard_energy, merge_energies,
                                      merge_shards, grad_zeta_tolerance)
rng = np.random.default_rng(0)
N, d, dv = 24, 8, 6
q, K, V = rng.standard_normal(d), rng.standard_normal((N, d)), rng.standard_normal((N, dv))
s = 1 / np.sqrt(d)

o_ref, lse_ref = ref.attention(q[None, None, None], K[None, None], V[None, None], scale=s)
print("F(0)      =", energy(q, K, V), "   oracle L =", lse_ref[0, 0, 0])
print("dF/dzeta  =", energy_grad_zeta(q, K, V).round(6))
print("oracle O  =", o_ref[0, 0, 0].round(6))

# %% [markdown]
# Checked numerically: a central difference $(F(\zeta + h e_j) - F(\zeta - h e_j))/2h$ is off from the
# derivative by at most $h^2/6\,|F'''|$ (truncation) plus the rounding of two evaluations of $F$
# divided by $2h$ (about $\epsilon |F| / h$). Along $\zeta_j$ the third derivative is the third central
# moment of $v_j$ under $P$, at most $R^3/4$ for a range $R$ of $v_j$: that is the tolerance, derived, not
# picked.

# %%
h = 1e-5
zero = np.zeros(dv)
fd = central_difference(lambda z: energy(q, K, V, z, s), zero, h)
print("max |central difference - dF/dzeta| =", np.abs(fd - energy_grad_zeta(q, K, V, None, s)).max(),
      "  tolerance", grad_zeta_tolerance(q, K, V, zero, s, h))
fdq = central_difference(lambda x: energy(x, K, V, None, s), q, h)
print("max |central difference - dF/dq|    =", np.abs(fdq - energy_grad_q(q, K, V, None, s)).max())
hess = energy_hessian_zeta(q, K, V, None, s)
fdh = central_difference(lambda z: energy_grad_zeta(q, K, V, z, s), zero, h)
print("max |difference of gradients - Hessian| =", np.abs(fdh - hess).max(),
      "  smallest eigenvalue", np.linalg.eigvalsh(hess).min().round(6), "(PSD)")

# %% [markdown]
# Shards: cut the 24 keys anywhere (two cuts at 10 make an empty shard), let each "device" compute
# $(F_s, O_s)$ alone, and merge, in a tree or one after the other.

# %%
ranges = cuts_to_ranges([5, 10, 10, 17], N)
F_s, O_s = shard_energy(q, K, V, ranges, None, s)
print("shards", ranges)
print("F_s    ", F_s.round(4))
print("tree merge", merge_energies(F_s, order="tree"), " flat merge", merge_energies(F_s, order="flat"),
      " whole", energy(q, K, V, None, s))
o_m, f_m = merge_shards(O_s, F_s)
print("merged O == whole O:", np.allclose(o_m, energy_grad_zeta(q, K, V, None, s), rtol=1e-13, atol=0))
print("no key seen:", energy(q, K, V, None, s, mask=np.zeros(N, bool)),
      energy_grad_zeta(q, K, V, None, s, mask=np.zeros(N, bool))[:3])

# %% [markdown]
# ## 2. One GPU as P devices: shards, partials, and a tree
#
# Tree Attention runs across devices, but its arithmetic fits on one card. Cut the KV
# cache of every sequence into $P$ contiguous **shards**, and let each shard be a
# "device": it attends to its own keys only and keeps a **partial**
#
# $$O_s = \mathrm{softmax}(S_{:,\,\text{shard } s})\,V_{\text{shard } s}, \qquad
#   L_s = \mathrm{logsumexp}(S_{:,\,\text{shard } s}).$$
#
# That is exactly the decode chapter's split-K: shard $s$ is split $s$, and the kernel
# that computes the partials is `kernels.decode.make_split_k`'s, with one block a device.
# What is new is how the $P$ partials are **reduced**:
#
# * **flat**: the decode chapter's combine: one block folds partial 0, 1, 2, ... in a
#   chain of $P - 1$ merges;
# * **tree**: $\lceil \log_2 P \rceil$ levels of pairwise merges, as the devices of a tree
#   all-reduce exchange and merge their states: at level $k$ slot $i$ takes slot
#   $i + 2^k$ in.
#
# Both use chapter 3's merge, so both give the same answer as the oracle.

# %% tags=["parameters"]
if on_simulator():
    B9, HQ9, HKV9, NQ9, N9, D9, P9 = 1, 4, 2, 1, 10, 8, 5    # tiny: every GPU thread is a Python thread
else:
    B9, HQ9, HKV9, NQ9, N9, D9, P9 = 2, 32, 8, 1, 8192, 128, 16

# %% [markdown]
# ### Shards
#
# Each sequence's keys are cut into $P$ contiguous pieces of $\lceil N / P \rceil$ keys
# (the last ones shorter, or **empty** when $P > N$). An empty shard's partial is
# $(O_s, L_s) = (0, -\infty)$: it weighs nothing in the merge.

# %%
for n, P in ((10, 4), (10, 5), (3, 5)):
    print(f"N = {n:2d}, P = {P}:", shard_ranges(n, P))

# %% [markdown]
# ### The partials, one a device
#
# `prepare_tree_decode` plans the launches once; `run_partials()` runs the $P$ devices,
# `partials()` brings their $(O_s, L_s)$ back. Each is the oracle on its shard's keys alone.

# %%
rng = np.random.default_rng(9)
q9 = random_array(rng, (B9, HQ9, NQ9, D9), 1.0)
k9 = random_array(rng, (B9, HKV9, N9, D9), 1.0)
v9 = random_array(rng, (B9, HKV9, N9, D9), 1.0)
run9 = prepare_tree_decode(q9, k9, v9, shards=P9)
o9, l9 = run9()                                   # the partials, then the tree
o_s, l_s = run9.partials()                        # (P, B, Hq, Nq, d), (P, B, Hq, Nq)
print("L_s of query head 0, device by device:", np.round(l_s[:, 0, 0, 0], 3))
for s, (a, b) in enumerate(shard_ranges(N9, P9)):
    eo, el = ref.decode_attention(q9, k9[:, :, a:b], v9[:, :, a:b])
    print(f"device {s}: keys [{a}, {b})  max |O_s - oracle| = {np.abs(o_s[s] - eo).max():.1e}, "
          f"max |L_s - oracle| = {np.abs(l_s[s] - el).max():.1e}")

# %% [markdown]
# ### The tree
#
# Slot $s$ starts with device $s$'s state: chapter 3's $(m, \ell) = (L_s, 1)$ ($\ell = 0$ for
# an empty shard) and $\tilde O = O_s$. At level $k$ (stride $2^k$), every slot
# $i = 0, 2^{k+1}, 2 \cdot 2^{k+1}, \dots$ takes slot $j = i + 2^k$ in:
#
# $$(m, \ell) = \mathrm{merge}\big((m_i, \ell_i), (m_j, \ell_j)\big), \qquad
#   \tilde O_i = e^{m_i - m}\,\tilde O_i + e^{m_j - m}\,\tilde O_j .$$
#
# When $P$ is not a power of two, a slot can find no partner ($j \ge P$): it is carried to
# the next level unchanged. After $\lceil \log_2 P \rceil$ levels slot 0 holds every shard:
# $O = \tilde O / \ell$, $L = m + \log \ell$. The drawing is `tree_levels(6)`.

# %%
def draw_tree(P, ax):
    levels = tree_levels(P)
    for s in range(P):
        ax.annotate(f"{s}", (s, 0), ha="center", va="center", fontsize=9,
                    bbox=dict(boxstyle="circle", fc="#c6dbef"))
    for k, level in enumerate(levels, start=1):
        for i, j in level:
            if j is None:                      # carried over: no partner at this level
                ax.plot([i, i], [k - 1, k], color="0.6", lw=2, ls="--")
            else:                              # slot i keeps its state (blue) and takes slot j's in (orange)
                ax.plot([i, i], [k - 1, k], color="#1f77b4", lw=2)
                ax.plot([j, i], [k - 1, k], color="#ff7f0e", lw=2)
            ax.annotate(f"{i}", (i, k), ha="center", va="center", fontsize=9,
                        bbox=dict(boxstyle="circle", fc="#fdd0a2" if j is not None else "0.9"))
    ax.set_yticks(range(len(levels) + 1), ["devices"] + [f"after level {k} (stride {2 ** k})"
                                                        for k in range(len(levels))])
    ax.set_xticks([])
    ax.set_xlim(-0.7, P - 0.3)
    ax.set_title(f"P = {P}: {len(levels)} levels (flat: a chain of {P - 1} merges)", fontsize=9)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)


fig, axes = plt.subplots(1, 2, figsize=(11, 3))
draw_tree(6, axes[0])
draw_tree(8, axes[1])
plt.tight_layout()
plt.show()
print("tree_levels(6):", tree_levels(6))

# %% [markdown]
# The tree in NumPy (`tree_reduce_numpy`, level by level as drawn) gives the flat merge's
# answer (`merge_partials_numpy`): the merge is associative, so any order does.

# %%
t_o, t_l = tree_reduce_numpy(o_s, l_s)
f_o, f_l = merge_partials_numpy(o_s, l_s)
print("tree vs flat in float64:", np.abs(t_o - f_o).max(), np.abs(t_l - f_l).max())

# %% [markdown]
# ### The kernel
#
# One block a (query row, KV head, chunk of DC columns of $O$) loads the $P$ partials into
# shared memory once and runs every level there, with **one barrier a level**. The
# $(m, \ell)$ states are kept twice (`sm`, `sl`: this level's and the next): a level reads
# one copy and writes the other, so no thread overwrites a state another thread of the
# same slot has yet to read. Why not one launch a level: a launch costs microseconds, six
# of them ($P = 64$) would be most of what a reduction may add to a 128k-token decode
# step (5% of about 230 µs on an H100); a barrier costs tens of nanoseconds.

# %%
show_source(make_tree_reduce, "# ---- level by level", "stride = stride * int32(2)")

# %% [markdown]
# ### The check: tree = flat = oracle
#
# Both reductions run on the same partials (`run_reduction("tree")`, then `"flat"`), and a
# causal batch with an empty cache and more shards than keys goes through both.

# %%
exact_o, exact_l = ref.decode_attention(q9, k9, v9)
run9.run_partials()
for reduce in ("tree", "flat"):
    run9.run_reduction(reduce)
    o, lse = run9.result()
    print(f"{reduce}: max |O - oracle| = {np.abs(o - exact_o).max():.1e}, "
          f"max |L - oracle| = {np.abs(lse - exact_l).max():.1e}")

q2 = random_array(rng, (2, HQ9, 2, D9), 1.0)      # two sequences, two new queries each
k2, v2 = (random_array(rng, (2, HKV9, N9, D9), 1.0) for _ in range(2))
lengths = np.array([3, 0])                        # 3 keys for sequence 0 (P > 3: empty shards), none for 1
eo, el = ref.decode_attention(q2, k2, v2, lengths, True)
for reduce in ("tree", "flat"):
    o, lse = tree_decode_attention(q2, k2, v2, shards=P9, reduce=reduce, cache_lengths=lengths, causal=True)
    print(f"{reduce}, lengths {lengths.tolist()}, P = {P9}: max |O - oracle| = {np.abs(o - eo).max():.1e}; "
          f"L of the empty cache: {lse[1, 0, 0]}, its O: {o[1, 0, 0, :3]}...")

# %% [markdown]
# ## 3. Several processes: tree attention through MPI
#
# So far every shard lived on one GPU. Now each shard lives in its own **process**, one
# device each (rank $r$ uses GPU $r \bmod$ count; here, without a GPU, the simulator), and
# the processes talk through a real distributed engine: **MPI**, through `mpi4py`, with the
# MPICH wheel from PyPI (`pip install mpi4py mpich`: 13 MB, brings `mpiexec`). Why not
# `torch.distributed`? Its default wheel pulls ~2.5 GB of CUDA libraries, too heavy for a
# 2-core CPU CI. On GPUs the same calls would go through NCCL (CuPy's `cupy.cuda.nccl`): the
# collective layer is one small class, `MpiEngine`, and `NcclEngine` marks the seam.
#
# Rank $s$ holds keys $[\text{start}_s, \text{end}_s)$ of the cache and the whole $q$, as a
# decode step does, and computes its partial with the decode chapter's launcher:
#
# ```python
# o_s, l_s = local_partial(q, k_shard, v_shard, start, cache_lengths=..., causal=...)
#            # = decode_attention(q, K_s, V_s): (O_s, L_s); an empty shard: (0, -inf)
# ```
#
# (One care: `decode_attention`'s causal mask counts from the end of the keys it is given,
# which is right only for the shard holding the end of the sequence. `local_partial`
# decides causality in global positions: with $N_q > 1$ each query row $i$ sees the first
# $\text{length} - (N_q - 1 - i)$ keys of the cache.)
#
# A notebook cannot be an MPI job itself, so the cells below launch
# `mpiexec -n 4 python -m kernels.tree_distributed` as a subprocess and show what rank 0
# prints.

# %%
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")


def launch(*args, ranks=4):
    """mpiexec -n ranks python -m kernels.tree_distributed args...: rank 0's table."""
    env = {**os.environ, "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}   # waiting ranks sleep
    out = subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, "-m", "kernels.tree_distributed", *args],
                         capture_output=True, text=True, env=env, timeout=300)
    print(out.stdout if out.returncode == 0 else out.stdout + out.stderr)


# %% [markdown]
# ### The ladder of the reduction
#
# The $p$ partials meet in Algorithm 3 of the Tree Attention paper:
#
# $$m = \text{AllReduce}_{\max}(L_s),\quad
#   \text{num} = \text{AllReduce}_{\Sigma}\big(e^{L_s - m} O_s\big),\quad
#   \text{den} = \text{AllReduce}_{\Sigma}\big(e^{L_s - m}\big),\quad
#   O = \text{num}/\text{den},\; L = m + \log \text{den}.$$
#
# It is chapter 3's merge, with the max taken first over **all** shards so that each
# process can rescale its own piece before the sum. Three rungs, each returning the same
# $(O, L)$ on every rank:
#
# | rung | collectives | latency | bytes a rank sends |
# |---|---|---|---|
# | (a) `reduce_tree` | MAX, SUM, SUM | 3 | $\tfrac{2(p-1)}{p}(R d + 2R)$ |
# | (b) `reduce_packed` | MAX, one SUM of $[\text{num} \mid \text{den}]$ | 2 | the same |
# | (c) `reduce_allgather` | one all-gather of $[O_s \mid L_s]$, merge locally | 1 | $(p-1)\,R(d+1)$ |
#
# ($R = B H_q N_q$ query rows, 4 bytes an element.) Where does $2(p-1)/p$ come from? The
# bandwidth-optimal all-reduce of $n$ elements is a reduce-scatter (each rank ends with
# the sum of one $n/p$ chunk: $p-1$ steps of $n/p$) followed by an all-gather of the
# chunks (again $p-1$ steps of $n/p$): $2(p-1)/p \cdot n$ each way, less than $2n$ for
# any $p$. The paper writes it $2(p-1)/p\,(b\,d + 2\,b\,n_h)$ with $d = n_h d_h$ the model
# width: the numerator, and one max and one denominator a head. MPI chooses its own
# algorithm (MPICH: recursive doubling, $\log_2 p$ rounds of all $n$ elements, for short
# messages); `MpiEngine` counts the payload exactly and the traffic by the optimal model.
#
# A row that sees no key anywhere has $L_s = -\infty$ on every rank, so $m = -\infty$ and
# $e^{L_s - m} = e^{-\infty + \infty}$ = NaN. The weights take $0$ as the reference point
# there (`_weights`): every weight is $0$, den $= 0$, and $O = 0$, $L = -\infty$, exactly.

# %%
print(reduce_packed.__doc__)
for p in (2, 4, 8, 64):
    t, a = tree_bytes("tree", rows=32, d=128, p=p), tree_bytes("allgather", rows=32, d=128, p=p)
    print(f"p = {p:3d}: all-reduce {t['sent'] / 1e3:7.1f} kB a rank, all-gather {a['sent'] / 1e3:8.1f} kB "
          f"({a['sent'] / t['sent']:.1f}x)")

# %% [markdown]
# Four ranks, every method, on the simulator (a few seconds): the error against the float64
# oracle on the whole cache, the bytes counted by the code beside the formula, the time of a
# step (median of repeats, the slowest rank; simulator times say nothing about a GPU).

# %%
launch("--n", "16", "--repeats", "1")

# %% [markdown]
# ### The baseline: Ring Attention
#
# Ring Attention moves the **keys** instead of the partials: in $p - 1$ steps every rank
# sends the shard it holds to rank $r + 1$ and receives one from rank $r - 1$, overlapping
# the transfer with the partial of the shard it holds, and merges each partial into its
# running $(O, L)$. Here every rank keeps the whole $q$ (as the tree does), so every rank
# ends with the result and no final step, but every rank computes the partial of the
# whole cache: $p$ times the tree's compute. (Splitting the query heads among the ranks
# would cut that to $1/p$ at the price of a final all-gather of $O$; the KV bytes would be
# the same.)
#
# Rank $r$ sends every shard but rank $r+1$'s own and receives every shard but its own:
# $2\,B H_{kv} d\,(N - t_{r+1})$ elements, $2\,b\,t\,d\,(p - 1)$ for equal shards of $t$
# keys (the issue's $2\,b\,t\,d\,p$ counts a whole turn of the ring). It grows with $N$;
# the tree's does not.

# %%
for n in (4096, 131072, 1 << 20):
    ring = ring_bytes(shard_bounds(n, 8), 0, B=1, hkv=8, d=128, itemsize=2)["sent"]
    tree = tree_bytes("packed", rows=32, d=128, p=8)["sent"]
    print(f"N = {n:8d}, p = 8, Llama-3.1-8B's heads, fp16 cache: ring {ring / 1e6:8.2f} MB a rank, "
          f"tree {tree / 1e3:.1f} kB a rank ({ring / tree:,.0f}x)")

# %% [markdown]
# The tests (`tests/test_tree_distributed.py`) run the same ladder and the ring in one
# `mpiexec -n 4` job: p = 4, 3 (not a power of two) and 1, ragged and empty shards, causal
# with two new queries, GQA, fully masked rows, logits near 1e4, fp16 caches, every rank
# against the float64 oracle, the counted bytes against the formulas; four planted bugs fail.
#
# On GPUs: `mpiexec -n 8 python -m kernels.tree_distributed` (one rank a GPU; the defaults
# are Llama-3.1-8B's heads at N = 131072, fp16). The buffers go through the host there
# (the MPICH wheel is not CUDA-aware); NCCL is the next step.
# %% [markdown]
# ## 4. A decode step across p GPUs, on a napkin
#
# Context $N$, cut into $p$ shards of the KV cache, one a GPU; one new token per sequence (batch $b$,
# $n_h$ heads of $d_h$, KV in fp16).
#
# * **Tree** (Algorithm 3): each GPU reads its $N/p$ tokens of K and V from HBM (chapter 7: decode is
#   bytes), then three all-reduces: MAX of the $L$'s, SUM of $e^{L_s - m} O_s$, SUM of $e^{L_s-m}$:
#   $2\frac{p-1}{p}(b\,n_h d_h + 2 b\,n_h)$ elements a GPU, **independent of $N$**; latency $\lceil\log_2 p\rceil$
#   steps of $\alpha$ (NVLink inside a node, the network across nodes).
# * **Ring** (the paper's baseline): the query is on every GPU and the KV shards travel: $p$ attention
#   steps of $N/p$ tokens and $p-1$ hops of a whole shard, $2b\frac{N}{p}n_{kv}d_h$ elements, over the
#   ring's slowest link. Every GPU reads all $N$ tokens and receives $\frac{p-1}{p}$ of the cache: the
#   ring moves $2bNn_{kv}d_h\,(p-1)$ elements in all, the issue's $2btdp$.
#
# Figures: HBM 2.96 TB/s, the read bandwidth chapter 7 measured on this H100 (`torch.sum` over 4 GiB,
# `workbook/results/decode.csv`; nominal 3.35); NVLink 4 450 GB/s a direction a GPU; InfiniBand NDR
# 400 Gb/s = 50 GB/s a GPU; $\alpha$ = 3 µs in a node, 10 µs across nodes and 5 µs a kernel launch
# (assumptions of the napkin, not measurements).

# %%
from kernels.attention_energy import (LLAMA_31_8B, PAPER_SHAPE, decode_model, fixed_cost_for_ratio,
                                      napkin_table, plot_decode_model)

print("One layer, 16 heads x 128, fp16 (the reference code's shape):")
_ = napkin_table(PAPER_SHAPE, ps=(8, 128), ns=(131072, 5_120_000))
print("\nLlama-3.1-8B (32 layers, GQA 32/8, bf16, 16 GB of weights read by every GPU), 8 GPUs:")
_ = napkin_table(LLAMA_31_8B, ps=(8,), ns=(8192, 32768, 65536, 131072))

# %%
fig = plot_decode_model()

# %% [markdown]
# **Reading it.**
#
# * The tree step is the attention over $N/p$ tokens plus a few latencies: at $p = 128$ the three
#   all-reduces (~0.15 ms, 7 latency steps each) cost more than reading 5.12M/128 tokens (~0.12 ms).
#   Past that point more GPUs make the tree slower, not faster (panel 2, $N$ = 128k).
# * The ring step is the cache moved over links: 36.7 GB a GPU at $p = 8$, $N$ = 5.12M over NVLink
#   (~96 ms), 41.6 GB over InfiniBand at $p = 128$ (~0.85 s). Overlapping the hops with the
#   attention barely helps: the link, not HBM, is the bottleneck (dotted lines).
# * **Where the napkin disagrees with the paper.** At $p = 128$, $N$ = 5.12M the napkin says the
#   tree is ~3000× faster; the paper reports up to 8×. The napkin's tree step is ~0.26 ms, its ring
#   ~0.85 s; a cost of about 0.12 s paid by *both* (`fixed_cost_for_ratio`) would squeeze 3000× to 8×.
#   The reference code times one call of a freshly jitted JAX function with `time.time()` (compilation
#   and dispatch inside the timer), and its ring (`flash_attn_jax.ring_fwd`) runs $p$ steps in a
#   `lax.scan` whose own comment calls the overlap of transfer and kernel "unreliable"; whether the
#   paper's figures were taken that way we cannot tell from the code. The napkin also ignores the
#   ring's other costs (buffers, the p-th useless hop) and any congestion of the network.
# * **Where it agrees.** Llama-3.1-8B decode on 8 GPUs: with 16 GB of weights read every step by
#   every GPU the whole step is 1.5× (8k), 2.6× (32k), 4.0× (64k) faster with the tree: the paper's
#   2–4× sits in this range. The attention alone (dotted) would be 3–45×: the rest of the model
#   dilutes the gain, the point chapter 7 made about decode being bytes.

# %%
m = decode_model(PAPER_SHAPE, 5_120_000, 128)
print(f"tree {m['tree']['total_s'] * 1e3:.3f} ms, ring {m['ring']['total_s'] * 1e3:.1f} ms, napkin ratio {m['ratio']:.0f}x; "
      f"a shared cost of {fixed_cost_for_ratio(m['tree']['total_s'], m['ring']['total_s'], 8.0) * 1e3:.0f} ms gives 8x")

# %% [markdown]
# ## 5. Results on the H100
#
# `python -m kernels --chapters 9` on a GPU times, at the decode chapter's reference
# shape (B = 1, 32 query heads on 8 KV heads, d = 128, fp16 cache, N = 128k):
#
# * `decode: prepare_decode stream-k`: the decode chapter's best launch, the baseline;
# * `P=…: partials alone`: the $P$ devices' partials (split-K with $P$ splits): with few
#   shards the GPU is not full (8 KV heads x 8 shards = 64 blocks on 132 SMs);
# * `P=…: partials + tree` / `+ flat`: a whole step; `added_ms` is what the reduction adds;
# * `P=…: tree reduction alone` (one launch: launch and kernel) and `x20 (per launch)`
#   (20 back to back: the kernel's own time with the launches overlapped).
#
# `share_pct` divides each by the baseline decode time: the goal is that the tree of 8 to
# 64 shards adds at most 5%.

# %%
rows9 = show_results("tree_attention", ("kernel", "config", "median_ms"))

# %% [markdown]
# In the committed run (2026-11-25, H100, N = 128k) the decode chapter's prepared stream-K
# step takes 0.245 ms. The tree adds **0.007, 0.006, 0.009 and 0.013 ms** to the partials
# of 8, 16, 32 and 64 shards: **2.8%, 2.3%, 3.6% and 5.3%** of that step (the goal, at most
# 5%, holds up to 32 shards). The flat combine adds 0.012, 0.023, 0.047 and 0.135 ms (4.9%
# to 55%): its one block a row walks the P partials in a chain, the tree's block merges
# them in log2 P levels of parallel pairs. A by-product: 32 shards' partials plus the tree,
# 0.204 ms, beat the decode chapter's own split-K (29 splits and the flat combine, 0.249
# ms) and stream-K (0.245 ms) at this shape, because the combine was a sixth of split-K's
# time. With 8 shards the partials alone are slower than a whole decode step (0.350 ms): 8
# KV heads x 8 shards are 64 blocks for 132 SMs; one shard (P = 1) is 8 blocks, 2.3 ms.
#
# What one GPU cannot show: the time of the collectives between GPUs (section 4's napkin
# says what to expect; the run on several GPUs is the next chapter's issue).

# %% [markdown]
# ## 6. Exercises
#
# ### On the energy (no GPU: NumPy, checked against central differences in float64)
#
# 1. Write $\partial F/\partial\zeta$ at $\zeta = 0$: `my_grad_zeta(q, k, v, scale) -> (d_v,)`. Mind $N = 0$
#    (no key: return zeros) and logits up to 80.
# 2. Write the merge of two shards' energies: `my_merge(f1, f2) -> F` where either may be `-inf`
#    (an empty shard) and energies reach $\pm 1000$ (`exp(1000)` overflows even in float64).
# 3. (Optional) Write the Hessian $\partial^2F/\partial\zeta^2$ at $\zeta = 0$: `my_hessian(q, k, v, scale) -> (d_v, d_v)`.
#
# Each checker draws hundreds of cases and prints "passed" or the smallest case it found wrong.

# %%
from kernels.attention_energy import check_grad_zeta, check_hessian_zeta, check_merge


def my_grad_zeta(q, k, v, scale):
    # your code: P = softmax(scale * k @ q) (subtract the max), return P @ v; zeros when N = 0
    return np.zeros(v.shape[1])


def my_merge(f1, f2):
    # your code: log(exp(f1) + exp(f2)) without forming exp of a large number; -inf with -inf is -inf
    return max(f1, f2)


def my_hessian(q, k, v, scale):
    # your code: sum_a P_a v_a v_a^T - O O^T
    return np.zeros((v.shape[1], v.shape[1]))


_ = check_grad_zeta(my_grad_zeta)
_ = check_merge(my_merge)
_ = check_hessian_zeta(my_hessian)

# %% [markdown]
# The checkers bite: the course's answers pass, a gradient that forgets the scale and a merge that
# forms `exp(F)` do not.

# %%
_ = check_grad_zeta(lambda q, k, v, sc: energy_grad_zeta(q, k, v, None, sc))
_ = check_grad_zeta(lambda q, k, v, sc: energy_grad_zeta(q, k, v, None, 1.0))
_ = check_merge(lambda a, b: merge_energies([a, b]))
_ = check_merge(lambda a, b: float(np.log(np.exp(a) + np.exp(b))))

# %% [markdown]
# ### On paper
#
# 4. The packed rung (b) sends the numerator and denominator in one buffer. Why can the MAX
#    not be packed into the same all-reduce? (What would each rank have to know before it
#    rescales?) Find an associative operator on $(m, \ell, \tilde O)$ that would make one
#    all-reduce enough, and say why MPI's built-in MAX and SUM cannot be it.
# 5. The all-gather rung (c) has one collective, the packed rung two. With the napkin's
#    figures (section 4), at which p and which number of query rows does (c) win?
# 6. At N = 128k the tree kernel adds 0.006 to 0.013 ms and the flat one up to 0.135 ms
#    (section 5). Count the merges each performs on its critical path for P = 64, and the
#    bytes each reads; which of the two explains the gap?
