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
# # 10. IO theory: on-chip memory, lower bounds, and a napkin
#
# Chapters 1 to 9 counted bytes and measured them. This chapter states what the papers prove
# about those bytes and checks it against what the course measured on the H100:
#
# 1. FlashAttention's **two loop orders**: Algorithm 1 [1] (K/V outer, the state written back
#    to HBM every step) against FlashAttention-2's [4] (chapter 4's), as kernels, their HBM
#    traffic counted element by element;
# 2. **Theorem 2** [1] with the on-chip memory $M$: the tiles chosen from $M$, the exact counts;
# 3. the **lower bounds**: Proposition 3 [1] and Saha and Ye [5], whose bound is tight for
#    $M \ge d^2$ and who give a better algorithm for $M < d^2$, a regime the H100 has (d = 256
#    in fp32);
# 4. the $M < d^2$ algorithm as GPU kernels, its traffic counted;
# 5. **Theorem 5** and **Proposition 4** [1] beside the bytes Nsight Compute measured for
#    chapters 5 and 6, and chapter 4's $B_r$ sweep re-read as an $M$ sweep;
# 6. **FlashAttention on a napkin** [12]: attention drawn, a per-level performance model of
#    the H100 predicting every chapter's time beside its measurement, and what fp16 and fp8
#    data would change;
# 7. **dropout** ([1] Algorithm 2) with no mask stored: Philox regenerated in the backward;
# 8. what is still to come, and exercises.
#
# Sources (numbered as in the README's list): [1] FlashAttention, Algorithms 1, 2 and 4,
# Theorems 2 and 5, Propositions 3 and 4; [4] FlashAttention-2, Algorithm 1; [5] Saha and
# Ye; [12] FlashAttention on a Napkin; [17] Philox (Salmon et al.).

# %%
import math

import matplotlib.pyplot as plt
import numpy as np

import kernels  # noqa: F401  (GPU or simulator, chosen before Numba is imported)
from kernels import io_theory as th
from kernels import napkin_model as nm
from kernels import reference as ref
from kernels.base.runtime import device_name

print("running on:", device_name())

# %% [markdown]
# ## 1. Two loop orders: FlashAttention's Algorithm 1 and FlashAttention-2's
#
# FlashAttention [1] Algorithm 1 puts the **K/V tiles in the outer loop** and the query tiles
# inside. A query tile then meets K/V tile 1, leaves, and comes back for tile 2 much later:
# its running state ($O_i$, $\ell_i$, $m_i$) cannot stay on chip, so every step reads it from
# HBM and writes it back:
#
# $$\text{for } j = 1..T_c:\ \text{load } K_j, V_j;\ \text{for } i = 1..T_r:\ \text{load } Q_i, O_i, \ell_i, m_i;\
#   \ldots;\ O_i \leftarrow \mathrm{diag}(\ell^{new})^{-1}\big(\mathrm{diag}(\ell_i)e^{m_i - m^{new}}O_i +
#   e^{\tilde m - m^{new}}\tilde P V_j\big);\ \text{write } O_i, \ell_i, m_i.$$
#
# FlashAttention-2 [4] swaps the loops (chapter 4's order): a block keeps its query tile and
# its state on chip over every K/V tile and writes $O$ once; $K$ and $V$ are read once per
# query tile instead. `kernels/kv_outer_forward.py` is Algorithm 1 as a teaching kernel (one
# block a head, a thread a query row, as chapter 4's rung 2), and `hbm_elements` counts both
# orders' HBM traffic in closed form:
#
# | | reads | writes |
# |---|---|---|
# | Algorithm 1 | $2N_kd + T_c(2N_qd + 2N_q)$ | $N_qd + 2N_q + T_c(N_qd + 2N_q)$ |
# | FlashAttention-2 | $N_qd + T_r\,2N_kd$ | $N_qd + N_q$ |
#
# (plus, for Algorithm 1 here, $2N_q$ reads and $N_q$ writes to turn $m, \ell$ into $L$ at the end).

# %%
from kernels.base.trace import tracing
from kernels.flash_forward import query_tile_attention
from kernels.kv_outer_forward import hbm_elements, kv_outer_attention

rng = np.random.default_rng(10)
n_q, n_k, d, Br, Bc = 10, 13, 5, 4, 3
q, k, v = (rng.standard_normal((1, 1, n, d)).astype(np.float32) for n in (n_q, n_k, n_k))
exact_o, _ = ref.attention(q, k, v)
for order, run in (("kv-outer", lambda: kv_outer_attention(q, k, v, tiles=(Br, Bc))),
                   ("q-outer", lambda: query_tile_attention(q, k, v, tiles=(Br, Bc)))):
    with tracing() as launches:
        o, _ = run()
    glob = [a for a in launches[0].arrays if a.memory == "global"]
    print(f"{order:9s} max |O - oracle| = {np.abs(o - exact_o).max():.1e};  counted in the simulator: "
          f"{sum(a.n_reads for a in glob)} read, {sum(a.n_writes for a in glob)} written;  closed form: "
          f"{hbm_elements(n_q, n_k, d, Br, Bc, order)}")
    print("           by array:", {a.name: (a.n_reads, a.n_writes) for a in glob})

# %% [markdown]
# Every element access, counted by the simulator's trace (`kernels.base.trace`), equals the
# closed form, for both orders (the tests check several shapes). At the course's reference
# size ($N = 4096$, $d = 64$, $B_r = B_c = 64$) Algorithm 1 moves $Q$, $O$, $\ell$ and $m$
# through HBM $T_c = 64$ times:

# %%
for order in ("kv-outer", "q-outer"):
    c = hbm_elements(4096, 4096, 64, 64, 64, order)
    print(f"{order:9s} {4 * (c['read'] + c['written']) / 1e6:8.1f} MB a head (fp32), "
          f"of which written {4 * c['written'] / 1e6:7.1f} MB")

# %% [markdown]
# Both are $\Theta(N^2 d^2 / M)$ (Theorem 2, section 2): with $B_c \approx M / 4d$ the number of
# passes $T_c = N/B_c$ is $4Nd/M$, and each moves $\Theta(Nd)$. The difference is what
# moves: Algorithm 1 writes, FlashAttention-2 only reads $K$ and $V$ again, which the 50 MB
# L2 of an H100 serves without reaching HBM (chapter 4's Nsight Compute runs: the HBM bytes
# stay compulsory at every $B_r$), and its query tiles are independent blocks, where
# Algorithm 1's inner loop visits them in turn.
#
# **What the H100 measured** (`python -m kernels --chapters 10`, B = 1, H = 16, d = 64,
# fp32, both at $B_r = B_c = 64$ through their launchers; Nsight Compute's bytes at
# N = 4096 from `python -m kernels.bench.traffic profile order-kv-outer order-q-outer`):

# %%
try:
    timed = th.chapter_rows()
    dram = {r["kernel"].replace(" (Nsight Compute)", ""): r for r in th.read_dram("io_theory_dram.csv")}
except FileNotFoundError as missing:
    timed, dram = [], {}
    print(missing)
for r in timed:
    if r["kernel"].startswith(("Algorithm 1", "FlashAttention-2", "chapter 4 production")):
        line = f"N = {r['N']:5d}  {r['kernel']:38s} {r['ms']:8.2f} ms"
        if r["N"] == 4096 and r["kernel"] in dram:
            m = dram[r["kernel"]]
            line += (f"   model {m['model'] / 1e9:5.2f} GB, SMs read from L2 {m['l2_read'] / 1e9:5.2f} GB, "
                     f"DRAM {m['dram'] / 1e9:5.3f} GB (written {m['dram_write'] / 1e9:5.3f})")
        print(line)

# %% [markdown]
# * **Algorithm 1 is 25 times slower** at N = 4096 (297 ms against 11.7; 9.5 times at N = 1024),
#   and the bytes are not the main reason. Its kernel gives each head one block, which walks
#   the query tiles in turn: 16 blocks of 64 threads on 132 SMs, where FlashAttention-2's order
#   has 1,024 independent blocks. That is the change [4] made (its section 3.2:
#   FlashAttention-1 parallelised over batch and heads only); the swapped loops are what
#   made it possible.
# * **The write-backs do reach HBM.** Algorithm 1 moved 1.11 GB of DRAM, 16 times the compulsory
#   67 MB, and 0.49 GB of that is writes: 43% of its 1.12 GB of $O$, $\ell$, $m$ write-backs, though
#   the state of the 16 heads (17 MB) would fit in the 50 MB L2. FlashAttention-2's order moved
#   0.055 GB, below the compulsory bytes: part of the inputs were still in L2 from the warm-up
#   call, and the output's dirty lines had not all left L2 when the kernel ended.
# * **Into the SMs**, Algorithm 1's reads from L2 plus its DRAM writes come to 0.91 of its closed
#   form, as its count says. FlashAttention-2's rung read 0.59 GB from L2, only 0.27 of the 2.2 GB
#   its model counts for re-reading $K$ and $V$ once a query tile. We have not explained this.
#   One guess, not checked: L1 hits when blocks of one head that sit on one SM copy the same
#   tile. Nsight Compute's L1 hit rate would tell.

# %% [markdown]
# ## 2. IO complexity in terms of the on-chip memory $M$
#
# Until now we counted the bytes of *our* kernels (`kernels/base/io_model.py`). The papers
# count something more abstract: the number of elements an algorithm reads from or writes to
# HBM when the chip can hold $M$ elements, as a function of $N$, $d$ and $M$. This section
# follows them top to bottom in their notation ($T_r = \lceil N/B_r\rceil$,
# $T_c = \lceil N/B_c\rceil$, $\ell$ and $m$ the running row sum and max) with
# `kernels/io_theory.py`, and then holds them against what Nsight Compute measured on the H100.
#
# **Algorithm 1 of [1] picks its tiles from $M$** (line 1):
#
# $$B_c = \left\lceil \frac{M}{4d} \right\rceil, \qquad B_r = \min\left(\left\lceil \frac{M}{4d} \right\rceil, d\right).$$
#
# $K_j, V_j, Q_i, O_i$ then take $2B_cd + 2B_rd \approx M$, and $B_r \le d$ keeps the tile
# $S_{ij}$ ($B_r \times B_c$) within $M/4$: everything on chip is $O(M)$.
#
# **The loop order decides who is re-read.** [1] loops over the K/V tiles *outside* and the
# query tiles inside; a query tile meets each K/V tile at a different time, so its $O_i$,
# $\ell_i$, $m_i$ go back to HBM after every step. Counting every access of the algorithm as
# written (one head; exact for any $N$):
#
# | | reads | writes |
# |---|---|---|
# | [1] Alg. 1 (K/V outer) | $2Nd + T_c(2Nd + 2N)$ | $Nd + 2N + T_c(Nd + 2N)$ |
# | [4] Alg. 1 (Q outer) | $Nd + 2Nd\,T_r$ | $Nd + N$ |
#
# [1] makes $T_c$ passes over $Q$ and $O$ and writes $O$ $T_c + 1$ times (with the
# initialisation); FlashAttention-2 [4] makes $T_r$ passes over $K$ and $V$ and writes $O$
# once. With $T_c \approx 4Nd/M$ the first is $\approx 12N^2d^2/M$: **Theorem 2 of [1]**,
# $\Theta(N^2d^2M^{-1})$ for $d \le M \le Nd$, against $\Theta(Nd + N^2)$ for standard attention.
# The second, with the large tile given to the queries ($B_r = \lceil M/4d\rceil$, the mirror
# of line 1: our choice, [4] fixes its tiles by hand), is $\approx 8N^2d^2/M$.

# %%



n, d = 4096, 64
M = th.h100_regime(d, 4)["M"]                        # 227 KB of shared memory, fp32 elements
fa1_tiles, fa2_tiles = th.tiles_from_m(d, M), th.fa2_tiles_from_m(d, M)
print(f"N = {n}, d = {d}, M = {M} fp32 elements: Algorithm 1's tiles (Br, Bc) = {fa1_tiles}")
rows = [("[1] Alg. 1, its tiles", th.fa1_forward_accesses(n, d, Br=fa1_tiles[0], Bc=fa1_tiles[1])),
        ("[4] order, the mirrored tiles", th.fa2_forward_accesses(n, d, Br=fa2_tiles[0], Bc=fa2_tiles[1])),
        ("[4] order, Alg. 1's tiles", th.fa2_forward_accesses(n, d, Br=fa1_tiles[0], Bc=fa1_tiles[1]))]
order = th.theorem2_order(n, d, M)
print(f"{'':<30} {'passes':>6} {'reads':>11} {'writes':>11} {'O written':>10} {'/ N^2d^2/M':>10}")
for name, c in rows:
    print(f"{name:<30} {c['passes']:>6} {c['reads']:>11,} {c['writes']:>11,} {c['O_writes'] // (n * d):>9}x "
          f"{c['total'] / order:>10.1f}")
print(f"standard attention, Theta(Nd + N^2): {th.standard_order(n, d):,.0f}; N^2 d^2 / M = {order:,.0f}")

# %% [markdown]
# Both loops write the same attention; only the traffic differs. The tiles matter as much as
# the order: Algorithm 1's tiles ($B_r \le d$, $B_c$ large) suit its own loop, and FlashAttention-2's
# loop with them would pay $T_r = 64$ passes over $K$ and $V$.
#
# **Counted, not trusted.** `simulate_fa1_forward` and `simulate_fa2_forward` run the two
# algorithms line by line in NumPy, every tile load and store going through an `HBM` object
# that counts elements; the output must be attention (the float64 oracle) and the counts
# must equal the closed forms exactly, ragged tiles included. `tests/test_io_theory.py` does
# this for several shapes, for the backward (Algorithm 4 of [1]) and for the small-cache
# algorithm below; a count of Algorithm 1 with $O$ written once fails it.

# %%
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((37, 8)) for _ in range(3))
o_ref, _ = ref.attention(q[None, None], k[None, None], v[None, None])
o1, _, _, hbm1 = th.simulate_fa1_forward(q, k, v, Br=5, Bc=7)
o2, _, hbm2 = th.simulate_fa2_forward(q, k, v, Br=5, Bc=7)
for name, o, hbm, formula in (("[1] Alg. 1", o1, hbm1, th.fa1_forward_accesses(37, 8, Br=5, Bc=7)),
                              ("[4] Alg. 1", o2, hbm2, th.fa2_forward_accesses(37, 8, Br=5, Bc=7))):
    got = hbm.counts()
    print(f"{name}: |O - oracle| = {np.abs(o - o_ref[0, 0]).max():.1e}; counted {got['reads']} reads, "
          f"{got['writes']} writes; closed form {formula['reads']}, {formula['writes']}; "
          f"O written {hbm.writes['O']} elements")

# %% [markdown]
# ## 3. The lower bounds
#
# **[1] Proposition 3.** There is no exact attention algorithm with $o(N^2d^2M^{-1})$ HBM accesses
# *for all* $M \in [d, Nd]$. The proof looks only at $M = \Theta(Nd)$, where the bound is
# $\Theta(Nd)$: the inputs must be read. It says nothing about a smaller $M$.
#
# **Saha and Ye [5]** settle every $M$. For $M \ge d^2$ the lower bound is $\Omega(N^2d^2/M)$:
# FlashAttention is optimal (even against fast matrix multiplication). For $M < d^2$ the optimum
# is lower,
#
# $$\Theta\!\left(\frac{N^2 d}{\sqrt{M}}\right),$$
#
# the IO of the product $QK^\top$ itself: an $(n \times k)(k \times m)$ product with $M$ words on
# chip needs $\Theta(nkm/\sqrt{M})$ accesses (Hong and Kung, 1981), here $n = m = N$, $k = d$. The
# algorithm this chapter counts for that regime (after [5]; the details of this version are
# ours) does **not** fuse: it computes $S = QK^\top$ and $PV$ as tiled matrix products, $\sqrt{M} \times \sqrt{M}$ blocks with the inner dimension in chunks, and writes $S$
# to HBM, which costs $N^2 \le N^2d/\sqrt{M}$ once $\sqrt{M} < d$. Our version
# (`small_cache_accesses`: blocks of side $b$, the largest with $3b^2 + b \le M$) counts
# $2NdT + N^2(2 + T_d) + NdT + \dots \approx 3N^2d/b + N^2 d/b + 2N^2$, $T = \lceil N/b \rceil$.
#
# At $M = d^2$ the two orders meet: $N^2d^2/d^2 = N^2d/d = N^2$; below it $N^2d/\sqrt{M}$ is the
# smaller by the factor $d/\sqrt{M}$, above it $N^2d^2/M$ is. The optimum is
# $\max(Nd, \min(N^2d^2/M, N^2d/\sqrt{M}))$, continuous at the crossover.
#
# **On the H100** a block may have 227 KB of shared memory: $M = 58{,}112$ fp32 elements. At
# $d = 256$, $d^2 = 65{,}536 > M$: the small-cache regime exists on real hardware. In fp16
# ($M = 116{,}224$) it does not.

# %%
for dd in (64, 128, 256):
    for itemsize in (4, 2):
        r = th.h100_regime(dd, itemsize)
        print(f"d = {dd:>3} {'fp32' if itemsize == 4 else 'fp16'}: M = {r['M']:>7,}, d^2 = {r['d2']:>6,}  "
              f"{r['regime']:<34} d / sqrt(M) = {r['gain']:.2f}")
dd, Mh = 256, th.h100_regime(256, 4)["M"]
exact = {"[1] Alg. 1": th.fa1_forward_accesses(n, dd, **dict(zip(("Br", "Bc"), th.tiles_from_m(dd, Mh))))["total"],
         "[4] order": th.fa2_forward_accesses(n, dd, **dict(zip(("Br", "Bc"), th.fa2_tiles_from_m(dd, Mh))))["total"],
         "small-cache [5]": th.small_cache_accesses(n, dd, Mh)["total"]}
print(f"\nN = {n}, d = 256, fp32 on the H100 (M = {Mh}): exact counts, millions of elements a head:",
      ", ".join(f"{k} {v / 1e6:.0f}" for k, v in exact.items()))

fig, ax = plt.subplots(figsize=(7, 4.5))
Ms = np.geomspace(4 * dd, n * dd, 100)
ax.loglog(Ms, [th.theorem2_order(n, dd, m_) for m_ in Ms], label=r"$N^2d^2/M$")
ax.loglog(Ms, [th.small_cache_order(n, dd, m_) for m_ in Ms], label=r"$N^2d/\sqrt{M}$")
ax.loglog(Ms, [th.optimal_order(n, dd, m_) for m_ in Ms], "k", lw=4, alpha=0.25, label="optimal [5]")
ax.axvline(dd * dd, color="gray", ls="-.", label=r"$M = d^2$")
ax.axvline(Mh, color="C2", ls=":", label="H100, fp32")
ax.set_xlabel("M (elements)")
ax.set_ylabel("HBM accesses, one head")
ax.set_title(f"N = {n}, d = {dd}")
ax.legend()
plt.show()

# %% [markdown]
# The regime is real but thin: $d/\sqrt{M} = 1.06$ at $d = 256$ fp32, and the constants decide.
# In exact counts, with the tiles above, FlashAttention-2's order (153 M elements a head) beats
# both Algorithm 1 (231 M, it pays $O$'s write-backs) and the small-cache algorithm (163 M).
# The orders hide a factor of 8 to 12 for the fused loops and about 9 for ours at the crossover.

# %% [markdown]
# ## 4. The M < d² algorithm as kernels
#
# Section 3 counted Saha and Ye's algorithm [5] for on-chip memory $M < d^2$ in NumPy. Here it
# runs as GPU kernels (`kernels/small_cache_attention.py`), three launches, no fusion:
#
# 1. $S = \text{scale}\,QK^\top$ in $b \times b$ output blocks, the sum over $d$ in chunks of $b$:
#    a block of $Q$ and one of $K$ in shared memory with the $S$ block, $3b^2 \le M$ elements;
#    **$S$ goes to an HBM workspace**, $N \times N$ a head.
# 2. Chapter 3's row softmax, in place: $S$ read once, $P$ written over it, $L = m + \log \ell$.
# 3. $O = PV$ in $b \times b$ output blocks, the sum over $N$ in chunks of $b$.
#
# $b$ is the largest side with $3b^2 + b \le M$ (`io_theory.small_cache_tile`). Writing $S$ costs
# $N^2$ accesses; the products cost $\Theta(N^2 d / b) = \Theta(N^2 d / \sqrt{M})$, so once
# $\sqrt{M} < d$ materialising $S$ is no longer the expensive part (Hong and Kung's bound for the
# products is what remains).

# %%
from kernels import io_theory
from kernels.base.trace import tracing
from kernels.small_cache_attention import hbm_elements as small_cache_elements
from kernels.small_cache_attention import small_cache_attention

rng = np.random.default_rng(10)
n, d, M = 10, 7, 30                          # b = 3: four row blocks, three chunks of d
b = io_theory.small_cache_tile(M)
q, k, v = (rng.standard_normal((1, 1, n, d)).astype(np.float32) for _ in range(3))
with tracing() as launches:
    o, lse = small_cache_attention(q, k, v, tile=b)
exact_o, exact_l = ref.attention(q, k, v)
print(f"b = {b}: max |O - oracle| = {np.abs(o - exact_o).max():.1e}, max |L - oracle| = {np.abs(lse - exact_l).max():.1e}")
model = small_cache_elements(n, n, d, b)
for t, step in zip(launches, ("scores", "softmax", "pv")):
    glob = [a for a in t.arrays if a.memory == "global"]
    counted = (sum(a.n_reads for a in glob), sum(a.n_writes for a in glob))
    print(f"{step:8s} counted (read, written) = {counted}, hbm_elements = {model[step]};",
          {a.name: (a.n_reads, a.n_writes) for a in glob})
formula = io_theory.small_cache_accesses(n, d, M)
td = -(-d // b)
print(f"in all: read {model['read']} = io_theory {formula['reads']} - N Td ({n * td}); "
      f"written {model['written']} = io_theory {formula['writes']} + N^2 ({n * n})")

# %% [markdown]
# Every element access the simulator counts equals the closed form, launch by launch. Against
# `io_theory.small_cache_accesses` the difference is exact and comes from one choice: the
# softmax is chapter 3's kernel, which writes $P$ over $S$ ($+N^2$ writes), so the $PV$ product
# reads $P$ and never reads $L$ ($-N\,T_d$ reads, $T_d = \lceil d/b \rceil$), where section 3's
# loop computes only $L$ and forms $e^{S - L}$ inside the product.
#
# **Where the H100 sits.** A block's shared memory is 58,112 fp32 elements: $b = 139$, and
# $d = 256$ has $d^2 = 65{,}536 > M$. Per score ($N^2$), at $N = 4096$:

# %%
N = 4096
rows = []
for d_, M_ in ((128, 58112), (256, 58112), (256, 116224)):
    b_ = io_theory.small_cache_tile(M_)
    ours = small_cache_elements(N, N, d_, b_)
    f1 = io_theory.fa1_forward_accesses(N, d_, **dict(zip(("Br", "Bc"), io_theory.tiles_from_m(d_, M_))))
    f2 = io_theory.fa2_forward_accesses(N, d_, **dict(zip(("Br", "Bc"), io_theory.fa2_tiles_from_m(d_, M_))))
    print(f"d={d_:3d} M={M_:6d} (b={b_}, {io_theory.regime(d_, M_)}): this kernel "
          f"{(ours['read'] + ours['written']) / N**2:5.2f}, section 3 {io_theory.small_cache_accesses(N, d_, M_)['total'] / N**2:5.2f}, "
          f"FA-1 Alg. 1 {f1['total'] / N**2:5.2f}, FA-2 order {f2['total'] / N**2:5.2f} | orders: "
          f"N^2 d/sqrt(M) {io_theory.small_cache_order(N, d_, M_) / N**2:.2f}, N^2 d^2/M {io_theory.theorem2_order(N, d_, M_) / N**2:.2f}")

# %%

d_, Ms = 256, np.unique(np.geomspace(2_000, 400_000, 40).astype(int))
fig, ax = plt.subplots(figsize=(6.4, 3.4))
per = lambda c: np.array(c) / N**2
ax.plot(Ms, per([sum(small_cache_elements(N, N, d_, io_theory.small_cache_tile(m))[x] for x in ("read", "written"))
                 for m in Ms]), label="this kernel (counted form)")
ax.plot(Ms, per([io_theory.fa1_forward_accesses(N, d_, **dict(zip(("Br", "Bc"), io_theory.tiles_from_m(d_, m))))["total"]
                 for m in Ms]), label="FA-1 Algorithm 1, tiles from M")
ax.plot(Ms, per([io_theory.fa2_forward_accesses(N, d_, **dict(zip(("Br", "Bc"), io_theory.fa2_tiles_from_m(d_, m))))["total"]
                 for m in Ms]), label="FA-2 order, tiles from M")
ax.plot(Ms, per([io_theory.small_cache_order(N, d_, m) for m in Ms]), "k--", lw=1, label=r"$N^2 d/\sqrt{M}$")
ax.plot(Ms, per([io_theory.theorem2_order(N, d_, m) for m in Ms]), "k:", lw=1, label=r"$N^2 d^2/M$")
ax.axvline(d_ * d_, color="grey", lw=0.8)
ax.axvline(58112, color="tab:red", lw=0.8)
ax.text(58112, 0.05, "H100 fp32 ", color="tab:red", fontsize=8, ha="right", transform=ax.get_xaxis_transform())
ax.text(d_ * d_, 0.05, " M = d²", color="grey", fontsize=8, transform=ax.get_xaxis_transform())
ax.set(xscale="log", yscale="log", xlabel="M (elements on chip)", ylabel="HBM accesses / N²",
       title=f"d = {d_}, N = {N}: exact counts and orders")
ax.legend(fontsize=7)
fig.tight_layout()

# %% [markdown]
# The H100 is *just* past the crossover: $d / \sqrt{M} = 1.06$, so the order the small-cache
# algorithm saves is 6%, and the constants decide. This kernel moves about 10.7 accesses per
# score ($3d/b + T_d + 3$), section 3's count 9.7; FlashAttention-1's Algorithm 1 with its tiles
# from $M$ ($B_c = B_r = 57$) moves 13.8, while FlashAttention-2's order with the same $M$
# moves 9.1 (the curves cross near $M \approx 41{,}000$, 47,000 for section 3's count: below that the unfused algorithm moves
# fewer elements than either fused order). In fp16 ($M = 116{,}224 > d^2$) the question does not arise.
#
# **What the H100 measured** (`small_cache_rows` in the chapter's bench: $B = 1$, $H = 16$,
# $N = 4096$, fp32, $d = 256$ and $128$, $b = 139$, beside chapter 4's `flash_attention` at
# $d = 128$, which takes $d \le 128$; Nsight Compute's bytes from
# `python -m kernels.bench.traffic profile small-cache-256 small-cache-128`):

# %%
for r in timed:
    if r["kernel"].startswith(("small-cache", "chapter 4 flash_attention")):
        print(f"d = {r['d']:3d}  {r['kernel'][:40]:40s} {r['ms']:7.2f} ms  {r['tflops']:5.2f} TFLOP/s  "
              f"model {r['model'] / 1e9:6.2f} GB")
for name, m in dram.items():
    if name.startswith("small-cache"):
        print(f"{name}: DRAM {m['dram'] / 1e9:.2f} GB (written {m['dram_write'] / 1e9:.2f}), "
              f"SMs read from L2 {m['l2_read'] / 1e9:.2f} GB; reads + DRAM writes = "
              f"{(m['l2_read'] + m['dram_write']) / m['model']:.2f} x the count")

# %% [markdown]
# * **The count is right at the level it describes.** The bytes the SMs read from L2 plus the
#   DRAM writes are 0.98 ($d = 256$) and 0.99 ($d = 128$) of `hbm_elements`. That traffic crosses between the
#   $M$-sized shared memory and the next level, which is what the theorem counts.
# * **HBM sees mostly $S$.** 4.5 GB of DRAM at $d = 256$ (4.4 at 128), 0.40 (0.60) of the model.
#   That is the four passes over the 1.07 GB workspace (written, read and written back by the
#   softmax, read by $PV$). The re-reads of $Q$, $K$ and $V$ stay in L2.
# * **The time is not the bytes.** 143 ms at $d = 256$ (74 ms at $d = 128$), 1.9 TFLOP/s; 4.5 GB at
#   3 TB/s is 1.5 ms. Before the run we estimated ~35 ms from the shared-memory reads (two
#   operands a multiply-add), and the kernel is four times slower than that. Each thread sums
#   its elements in one dependent chain, two shared loads a multiply-add. One 1,024-thread
#   block fills an SM, and nothing overlaps the copy of a chunk with the products. So it is
#   bound by latency, not by a bandwidth (not profiled further). At $d = 128$ chapter 4's fused
#   kernel takes 6.0 ms, 12 times less.
#
# So on the H100 the lower bound is about the traffic between shared memory and L2, and
# there the algorithm does what its count says. Its time, though, is set by how the products
# are computed, which is what chapters 2 and 8 are about. A register-tiled product (chapter
# 2's rung 3) would be the next step. The counts would not change.
#
# ## 5. The backward, block sparsity, and what the H100 measured
#
# **[1] Theorem 5:** the backward (Algorithm 4, K/V outer, $dQ_i$ read and written every pass)
# also makes $\Theta(N^2d^2M^{-1})$ accesses; exactly $7Nd + T_c(5Nd + 2N)$ (`fa1_backward_accesses`).
# **[1] Proposition 4:** with a fraction $s$ of the blocks kept, block-sparse FlashAttention makes
# $\Theta(Nd + N^2d^2M^{-1}s)$.
#
# The course profiled its kernels under Nsight Compute (B = 4, H = 16, N = 4096, d = 64, fp32),
# counting two levels: DRAM bytes (what reaches HBM) and the bytes the SMs read from L2 (what
# arrives at shared memory), next to `io_model`'s count for the same tiles (no cache between HBM
# and the SM) and the compulsory bytes (each input read once, each output written once):

# %%
table = th.measured_vs_model()                           # files not committed are left out
if table:
    print(f"{'':<14} {'case':<52} {'DRAM GB':>8} {'/compuls.':>9} {'L2->SM GB':>9} {'model GB':>9} {'L2/model':>8}")
    for r in table:
        print(f"{r['result']:<14} {r['kernel']:<52} {r['dram'] / 1e9:>8.3f} {r['dram'] / r['compulsory']:>9.2f} "
              f"{r['l2'] / 1e9:>9.2f} {r['model'] / 1e9:>9.2f} {r['l2'] / r['model']:>8.2f}")
else:
    print("Nsight Compute results are not committed (workbook/results/*_dram.csv): run `.ci/gpu-check ncu` on a GPU.")

# %% [markdown]
# (L2 → SM here counts the SMs' reads from L2 plus the DRAM writes, as chapter 4 compared them.)
#
# * **HBM bytes stay compulsory.** The forward moves 0.26-0.28 GB at every $B_r$, 0.98-1.02x the
#   compulsory 0.27 GB; the backward 0.74 GB (atomic dQ) and 0.88 GB (separate dQ), 1.4x and
#   1.6x its compulsory 0.54 GB; block-sparse the same at every density. The re-reads the
#   theorems count never reach HBM: the heads in flight keep their K and V (2 MB a head) in the
#   50 MB L2.
# * **The traffic into the SMs follows the theorems.** It falls with $B_r$ as $N^2d/B_r$ and, for
#   block-sparse, with $s$: 0.82, 1.49 and 5.26 GB at $s$ = 0.125, 0.25 and 1 (forward), the
#   $N^2d^2M^{-1}s$ term of Proposition 4 (the forward reads 1.2-1.3x its model, not yet
#   explained, chapter 6). The backward's 0.45-0.82x of its model: the model counts dQ's atomic
#   read-modify-writes, which L2 executes without sending them to the SMs (chapters 5 and 6).
#
# So the "$M$" of the theorems is two different memories on a GPU: **for HBM traffic it is the
# L2** (50 MB: $N^2d^2/M$ with $M$ in the tens of millions of elements is below the compulsory
# bytes, so only the compulsory bytes remain), **for L2 traffic it is the shared memory** of a
# block (its tiles).
#
# ### The $B_r$ sweep re-read as an $M$ sweep
#
# Each $B_r$ of chapter 4's sweep uses `flash_forward.shared_bytes` of shared memory: $Q^\top_i$,
# $K^\top_j$, $V_j$, $P^\top$ with their padding, $M = d(B_r+4) + d(B_c+4) + B_c(d+8) + B_c(B_r+4)$
# fp32 elements ($= 128B_r + 9472$ at $d = B_c = 64$). Plot the measured L2 → SM bytes against that $M$:

# %%
try:
    sweep = th.m_sweep()
except FileNotFoundError as e:
    sweep = None
    print(e)
if sweep:
    print(f"{'Br':>4} {'M':>7} {'L2->SM GB':>10} {'2N^2d/Br GB':>12} {'N^2d^2/M GB':>12} {'L2 / (N^2d^2/M)':>16} {'DRAM GB':>8}")
    for r in sweep:
        print(f"{r['Br']:>4} {r['M']:>7} {r['l2_read'] / 1e9:>10.2f} {r['kv_stream'] / 1e9:>12.2f} "
              f"{r['theorem2'] / 1e9:>12.2f} {r['l2_read'] / r['theorem2']:>16.1f} {r['dram'] / 1e9:>8.3f}")
    Ms = np.array([r["M"] for r in sweep], float)
    grid = np.geomspace(Ms.min() / 1.3, Ms.max() * 1.3, 50)
    per = sweep[-1]["theorem2"] * sweep[-1]["M"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.loglog(Ms, [r["l2_read"] / 1e9 for r in sweep], "s-", label="measured: SMs read from L2")
    ax.loglog(Ms, [r["kv_stream"] / 1e9 for r in sweep], "o--", color="gray", label=r"$2N^2d/B_r$ (IO model)")
    ax.loglog(grid, 4 * per / grid / 1e9, label=r"$4N^2d^2/M$")
    ax.loglog(Ms, [r["dram"] / 1e9 for r in sweep], "^-", label="measured: DRAM")
    ax.axhline(sweep[0]["compulsory"] / 1e9, color="k", ls=":", label="compulsory")
    ax.set_xlabel("M = shared memory of the tiles (fp32 elements)")
    ax.set_ylabel("GB per call")
    ax.legend(fontsize=8)
    plt.show()

# %% [markdown]
# From $B_r = 64$ to $256$ the measured bytes track $N^2d^2/M$ with a nearly constant factor (5.8,
# 5.5, 4.9; $\to 4$ as $M \approx 2dB_r$ when the query tiles dominate). Below, the points fall
# *faster* than $1/M$ (21.6x at $B_r = 16$): with $B_c = 64$ fixed, 9,472 elements of $M$ are
# K, V and the padding, which buy nothing against the $T_r$ passes. A tile shape chosen as
# Theorem 2's proof chooses it (every tile growing with $M$) would sit on the line. And however
# $M$ is spent here, HBM sees the compulsory 0.27 GB: the L2 is the memory of Theorem 2 for that level.

# %% [markdown]
# ## 6. Attention on a napkin
#
# Abbott and Zardini's *FlashAttention on a Napkin* [12] draws an algorithm as a diagram of
# its arrays and the operations between them, and reads its cost off the diagram: every
# array lives at a level of the memory hierarchy, every arrow that crosses a level moves
# bytes, and the level that must move the most bytes for its bandwidth sets the time.
# Here is standard attention (chapter 1) drawn that way, for one head at N = 4096, d = 64,
# float32: every box is an array with its shape and size, every arrow a transfer between
# HBM and the chip labelled with its bytes.

# %%


fig, ax = plt.subplots(figsize=(12, 3.9))
nm.draw_standard(ax, n=4096, d=64)
plt.show()

# %% [markdown]
# The two N×N arrays carry 256 of the 260 MiB. FlashAttention (chapter 4) keeps them on
# the chip: a block holds one query tile $Q_i$ in shared memory, streams the key and value
# tiles $K_j, V_j$ past it, keeps the scores $S_{ij}$, the running state $(m, \ell)$ and
# the output accumulator $O_i$ in registers, and writes $O_i$ and $L_i$ once. The
# $\lceil N / B_r \rceil$ query tiles are independent: they run as parallel blocks, each
# streaming all of K and V. The stream is the one term that grows as $N^2$.

# %%
fig, ax = plt.subplots(figsize=(12, 4.8))
nm.draw_streamed(ax, n=4096, d=64, Br=256, Bc=64)
plt.show()

# %% [markdown]
# ### The levels of the H100, and where each figure comes from
#
# The napkin needs a bandwidth for every level the bytes cross and a FLOP rate for the
# registers, where the arithmetic happens. The course measured the HBM and FLOP figures
# (chapters 0, 7 and 8); it did not measure L2 or shared memory, so those two are a
# nominal and a derived figure, said as such:

# %%
machine = nm.h100()
for key in ("HBM copy", "HBM read", "L2", "shared memory"):
    kind, text = machine.sources[key]
    print(f"{key:14} {machine.bandwidth[key] / 1e12:6.2f} TB/s     {kind:8}  {text}")
for key in ("fp32 FMA", "fp16 mma.sync", "fp8 mma.sync"):
    kind, text = machine.sources[key]
    print(f"{key:14} {machine.flop_rate[key] / 1e12:6.1f} TFLOP/s  {kind:8}  {text}")

# %% [markdown]
# ### Every chapter's main kernel on the napkin
#
# For each kernel at its reference shape, the bytes at each level are the course's own:
# HBM bytes measured by Nsight Compute where they are committed (chapters 1, 4, 5, 6) and
# the IO model's otherwise; L2→SM bytes measured by Nsight, or the IO model without reuse
# (which is what the SMs ask of L2: the fused forward measured 0.92× it); shared-memory
# bytes from the register micro-tiles (a $T_M \times T_N$ tile reads $T_M + T_N$ operands
# for $T_M T_N$ multiply-adds). The prediction is
#
# $$t = \max\Big(\tfrac{\text{bytes}_\text{HBM}}{BW_\text{HBM}},\ \tfrac{\text{bytes}_\text{L2}}{BW_\text{L2}},\
#       \tfrac{\text{bytes}_\text{smem}}{BW_\text{smem}},\ \tfrac{\text{FLOPs}}{\text{rate}}\Big),$$
#
# summed over the kernels of a chain (chapter 1 launches three), and the level that
# attains the max is the bound. Beside it, the time the H100 measured, from the committed
# CSVs, and their ratio.

# %%
table = nm.prediction_table(machine)
print(f"{'ch':>2}  {'kernel':33} {'shape':24} {'napkin ms':>10}  {'bound':20} {'measured ms':>11} {'ratio':>6}")
for r in table:
    print(f"{r['chapter']:>2}  {r['kernel']:33} {r['shape']:24} {r['predicted_ms']:10.4f}  {r['bound']:20} "
          f"{r['measured_ms']:11.4f} {r['ratio']:6.2f}")

# %%
fig, ax = plt.subplots(figsize=(11, 5.2))
nm.draw_predictions(ax, table)
plt.show()

# %% [markdown]
# ### Reading the misses
#
# A napkin is a lower bound: a ratio near 1 says the kernel does what its bytes allow, a
# ratio well above 1 says something the four divisions do not see sets the pace. One
# sentence a kernel:

# %%
for r in table:
    print(f"ch{r['chapter']} {r['kernel']} ({r['ratio']:.2f}x): {r['miss']}\n")

# %% [markdown]
# Three groups. The **streaming** kernels (the row softmax, decode, chapter 1's softmax
# kernel) reach their HBM bound: their napkin is their time. The **fused fp32** kernels
# (chapters 2-6) sit 1.4-1.8× above a bound where shared memory and the FMA units tie:
# they are issue-bound, the softmax and the rescaling of O sharing the pipe with the
# multiply-adds. The **tensor-core** kernels (chapter 2's rung 4, chapter 8) and the
# **tiny** one (chapter 9's tree of 150 kB) are further away, for reasons the napkin names
# but does not count: pipelines to fill, the softmax between two matrix products, a launch.
# This chapter's two kernels miss by the most, 220× and 6×. The napkin assumes every SM is
# busy and its latency hidden. Algorithm 1's 16 blocks use an eighth of the SMs, and the
# small-cache products are one dependent chain a thread. A bound that divides by the whole
# machine's rates says nothing about a kernel that cannot fill the machine.

# %% [markdown]
# ### Smaller numbers: fp16 and fp8 on the napkin
#
# Store the data in 2 bytes (fp16) or 1 byte (fp8) and every byte of the napkin halves or
# quarters; the FLOP rate moves only if the arithmetic moves to the tensor cores. On the
# H100 there is no native fp8 `mma.sync`: the `m16n8k32.e4m3` instruction (made for
# sm_89) compiles for sm_90 but is converted to fp16 and run on the fp16 tensor cores
# (NVIDIA/cutlass#1986); native fp8 is `wgmma` only, which this course does not reach from
# Numba. So fp8 through `mma.sync` gets at most the fp16 rate, 612 TFLOP/s measured.

# %%
print(f"{'ch':>2}  {'kernel':33} {'fp32 ms':>8} {'fp16 ms':>8} {'gain':>5} {'fp8 ms':>8} {'gain':>5}  bound (fp16)")
for r in nm.quantization_table(machine):
    print(f"{r['chapter']:>2}  {r['kernel']:33} {r['fp32_ms']:8.3f} {r['fp16_ms']:8.3f} {r['fp16_gain']:5.2f} "
          f"{r['fp8_ms']:8.3f} {r['fp8_gain']:5.2f}  {r['fp16_bound']}")

# %% [markdown]
# The bandwidth-bound kernels gain all of it: 2× in fp16 and 4× in fp8 for the copy, the
# softmax and decode. The fused fp32 kernels gain nothing: their bound is the FMA units,
# and fp16 data with fp32 math leaves the FLOP rate where it was (chapter 1's products
# gain because their shared-memory reads halve, then stop at the FMA units). The FLOP-bound
# kernels gain only by moving the arithmetic to the tensor cores. Against what the course
# measured:

# %%
for c in nm.quantization_checks(machine):
    print(f"{c['what']:55} napkin {c['predicted_gain']:5.2f}x   measured {c['measured_gain']:5.2f}x")

# %% [markdown]
# Decode's fp16 cache gains 1.88× of the napkin's 2×; chapter 4 fed fp16 gains nothing, as
# the napkin says; moving the forward to the tensor cores (chapter 8) gains 4.9× of the
# napkin's 7.2×, the rest being the softmax that chapter 8 does not overlap with its
# products (the miss above).

# %% [markdown]
# ## 7. Dropout without a stored mask
#
# Training a transformer drops attention probabilities at random: each $P_{ij}$ is kept
# with probability $1 - p$ and scaled by $1/(1-p)$, so that the expected output is
# attention's. FlashAttention [1] fuses it into the kernel (its Algorithm 2 is the forward
# with dropout, Algorithm 4 the backward). The dropout acts **after** the softmax's
# normalisation, as in [1] and PyTorch: the row sums count every probability, kept or not,
# and $L$ is the logsumexp of the undropped scores:
#
# $$O = \Big(P \circ \frac{Z}{1-p}\Big) V, \qquad P = \mathrm{softmax}(S), \qquad
#   Z_{ij} \in \{0, 1\},\ \Pr[Z_{ij} = 1] = 1 - p.$$
#
# The backward needs the same $Z$. PyTorch's unfused attention stores it; a fused kernel
# cannot afford to: $Z$ is an $N \times N$ array a head, the very array the fused kernels
# were built to keep out of HBM. At one bit an element it is $N^2/8$ bytes a head against
# the $\approx 16Nd$ of $Q, K, V, O$ in float32: larger from $N = 128\,d$ (8192 at d = 64),
# written by the forward and read back by the backward; as PyTorch's `bool` tensor, 8 times that:

# %%
from kernels.base.io_model import compulsory_forward_bytes

B, H, d = 4, 16, 64
print(f"B = {B}, H = {H}, d = {d}")
print(f"{'N':>7} {'Z, 1 bit':>10} {'Z, 1 byte (bool)':>17} {'Q, K, V, O, L (fp32)':>21}")
for n in (1024, 4096, 16384, 65536):
    z_bits = B * H * n * n / 8
    print(f"{n:7d} {z_bits / 2**20:8.0f} MiB {8 * z_bits / 2**20:13.0f} MiB "
          f"{compulsory_forward_bytes(B, H, n, n, d) / 2**20:17.0f} MiB")

# %% [markdown]
# So the kernels **regenerate** $Z$ instead of storing it. That needs a random generator
# with no state to carry from element to element: a *counter-based* generator, a pure
# function $x = f_{\text{seed}}(\text{counter})$ that any thread can evaluate for any element,
# in any order, in the forward and again in the backward. The course uses the one cuRAND and
# PyTorch's CUDA dropout use, **Philox4x32-10** (Salmon, Moraes, Dror and Shaw, *Parallel
# random numbers: as easy as 1, 2, 3*, SC 2011): a 128-bit counter, a 64-bit key (the seed),
# ten rounds of two 32×32→64-bit products and some xors:
#
# ```
# for round in range(10):
#     hi0, lo0 = mulhilo(0xD2511F53, c0)
#     hi1, lo1 = mulhilo(0xCD9E8D57, c2)
#     c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
#     k0, k1 = k0 + 0x9E3779B9, k1 + 0xBB67AE85        # mod 2^32
# ```
#
# One call gives four 32-bit numbers. Element $(b, h, i, j)$ takes lane $j \bmod 4$ of the
# call with counter $(bH + h,\ i,\ \lfloor j/4 \rfloor,\ 0)$, and is kept iff
# $u = x / 2^{32} \ge p$ (an integer compare, $x \ge \lceil p\,2^{32} \rceil$).
# `kernels/dropout.py` has it as a device function (`philox4x32`) and a NumPy twin
# (`philox4x32_numpy`); both give Random123's published answers bit for bit (the tests check
# the device function too):

# %%
from kernels import dropout as dr

for counter, key in (((0, 0, 0, 0), (0, 0)), ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0))):
    print([f"{c:08x}" for c in counter], [f"{k:08x}" for k in key], "->",
          " ".join(f"{x:08x}" for x in dr.philox4x32_numpy(counter, key)))
# Random123's kat_vectors: 6627e8d5 e169c58d bc57ac4c 9b00dbd8 and d16cfe09 94fdcceb 5001e420 24126ea1

z = dr.keep_mask(2, 4, 128, 128, p=0.1, seed=2024)
n = z.size
print(f"kept {z.mean():.5f} of {n} elements at p = 0.1 "
      f"(1 - p = 0.9; one binomial standard deviation is {np.sqrt(0.09 / n):.5f})")

# %% [markdown]
# ### The kernels
#
# The forward is chapter 4's second rung (a block a query tile, a thread a query row, K/V
# tiles in shared memory) with one change in the inner loop. For each key $j$ the thread
# still rescales by the running max and adds **every** probability to $\ell$, but adds only
# the kept ones to $O$:
#
# $$m' = \max(m, s_{ij}),\quad e = e^{s_{ij} - m'},\quad \ell \leftarrow e^{m - m'}\ell + e,\quad
#   O_i \leftarrow e^{m - m'} O_i + Z_{ij}\, e\, v_j,$$
#
# and at the end $O_i / (\ell (1 - p))$, $L_i = m + \log \ell$. A thread walks its keys in
# order, so one Philox call serves four keys. The backward is chapter 5's second rung, with
# $Z$ regenerated from the same counters: $dV = (P \circ Z/(1-p))^T dO$,
# $dP = (dO\,V^T) \circ Z/(1-p)$, $D = \mathrm{rowsum}(dO \circ O)$ (which is still
# $\mathrm{rowsum}(P \circ dP)$), $dS = P \circ (dP - D)$. Both against the float64 oracle
# (same generator, `kernels.reference`'s softmax and mask), in the simulator. The errors
# are a few float32 ulps, about what plain float32 NumPy makes on the same case;
# `tests/test_dropout.py` holds them to the course's tolerance rule, with floors derived as
# chapter 4's and 5's are (the kernel rounds steps NumPy does not), and shows that a
# backward with another seed, or without the $1/(1-p)$, fails it:

# %%
from kernels.base.testing import case_with, random_array

case = case_with((1, 2, 10, 8), (1, 2, 12, 8), causal=True, logit_std=1.0)
kw = dict(p=0.2, seed=7, causal=True)
o, lse = dr.dropout_attention(case.q, case.k, case.v, **kw)
exact_o, exact_l = dr.dropout_attention_oracle(case.q, case.k, case.v, **kw)
base_o, _ = dr.dropout_attention_oracle(case.q, case.k, case.v, dtype=np.float32, **kw)
print(f"O: kernel error {np.abs(o - exact_o).max():.2e}, float32 NumPy's {np.abs(base_o - exact_o).max():.2e}; "
      f"L: kernel error {np.abs(lse - exact_l).max():.2e}")

do = random_array(np.random.default_rng(1), o.shape)
grads = dr.dropout_attention_backward(case.q, case.k, case.v, o, lse, do, **kw)
exact = dr.dropout_attention_backward_oracle(case.q, case.k, case.v, o, lse, do, **kw)
base = dr.dropout_attention_backward_oracle(case.q, case.k, case.v, o, lse, do, dtype=np.float32, **kw)
for name, g, e, b in zip(("dQ", "dK", "dV"), grads, exact, base):
    print(f"{name}: kernel error {np.abs(g - e).max():.2e}, float32 NumPy's {np.abs(b - e).max():.2e}")
wrong = dr.dropout_attention_backward(case.q, case.k, case.v, o, lse, do, p=0.2, seed=8, causal=True)
print(f"the backward with seed 8 instead of 7: dV off by {np.abs(wrong[2] - exact[2]).max():.2e}")

# %% [markdown]
# Dropout is unbiased: averaged over seeds, $O$ tends to attention's $O$, its error shrinking
# like $1/\sqrt{\text{seeds}}$ (the oracle, in NumPy):

# %%

want, _ = ref.attention(case.q, case.k, case.v, causal=True)
total = np.zeros_like(want)
for s in range(1, 257):
    total += dr.dropout_attention_oracle(case.q, case.k, case.v, p=0.2, seed=s, causal=True)[0]
    if s in (1, 4, 16, 64, 256):
        print(f"{s:4d} seeds: max |mean O - O| = {np.abs(total / s - want).max():.4f}")

# %% [markdown]
# ### What it costs
#
# Nothing in HBM: the mask is never written or read, the forward moves the same bytes as
# chapter 4's rung 2 and the backward as chapter 5's. The cost is arithmetic. A Philox call
# compiles to 143 PTX instructions (20 `mul.wide.u32`, 20 `mul.lo`, 43 xors, 18 key adds and
# the 64-bit halves' moves). Per element, against the multiply-adds the teaching kernels
# already do at d = 64:
#
# | kernel | Philox calls an element | FMAs an element (d = 64) | PTX instructions added |
# |---|---|---|---|
# | forward (a thread walks a row's keys) | 1/4 | S and PV: 2d = 128 | ~36, +28% |
# | dQ (a row's keys, in order) | 1/4 | S, dP, dQ: 3d = 192 | ~36, +19% |
# | dK/dV (a key's rows: one call each) | 1 | S, dP, dV, dK: 4d = 256 | ~143, +56% |
#
# That is an upper bound from the PTX: FMA-bound fp32 kernels would slow by at most that much,
# and less where the Philox work overlaps the FMAs. The dK/dV kernel pays four times the
# others because its thread owns a key and walks the rows, while a call covers four keys of
# one row. A layout in which a thread owns a 1×4 (or larger) micro-tile of $S$, as chapter 4's
# rung 3 does, would use the whole call.
#
# **What the H100 measured** (the chapter's bench, B = 1, H = 16, N = 4096, d = 64, fp32, the
# launchers; p = 0 runs the same code as p = 0.1, every element kept):

# %%
for r in timed:
    if "dropout" in r["kernel"]:
        print(f"{r['kernel']:42s} {r['ms']:7.2f} ms")

# %% [markdown]
# * **The forward costs nothing measurable:** 11.1 ms at p = 0.1 against 11.1 for chapter 4's
#   rung 2 (a second run: 11.3 against 11.2). Its 1/4 call an element hides behind the
#   multiply-adds and the exponentials.
# * **The backward costs a third:** 36.1 ms against chapter 5's rung 2 at 27.1 (+33%; the second
#   run +37%), at p = 0 as at 0.1. The bound said at most +19% for dQ and +56% for dK/dV, and
#   the measurement lands between them. The bench times the two kernels together.
# * **SASS** (`inspect_sass` on the H100, instructions in the compiled kernel, not executed):
#   the forward has 1,928 against rung 2's 1,760, dQ 1,784 against 1,648, dK/dV 2,760 against
#   2,480. So a call is about 130-170 SASS instructions: ptxas keeps nearly all of the 143 PTX
#   instructions. dK/dV's spills grow from 104 to 186 local stores (`STL`). At ~130 instructions a
#   call, the dK/dV kernel (one call an element, 256 multiply-adds an element) adds half its
#   arithmetic again. The forward and dQ (a quarter of a call an element) add an eighth.

# %% [markdown]
# ## 8. Still to come, and exercises
#
# Still to come: a register-tiled version of section 4's products (the counts stay, the time
# should fall several times), and dropout's dK/dV kernel with a micro-tile of $S$ a thread, so
# that a Philox call serves four elements there too.
#
# Exercises:
#
# 1. From the closed forms of section 1: at which $N$ (with $d = 64$, $B_r = B_c = 64$, fp32)
#    does Algorithm 1's traffic exceed the 50 MB L2 of an H100, so that its write-backs must
#    reach HBM? Compare with FlashAttention-2's re-reads of K and V. Section 1 measured 43% of
#    the write-backs in HBM at N = 4096, where the state fits: what about the L2 might
#    explain it?
# 2. Theorem 2 says $\Theta(N^2d^2/M)$ for both orders. Where does the constant differ, and
#    which of the two can spend its $M$ on more query rows?
# 3. The napkin (section 6) predicts chapter 8's forward at 0.76 ms and it runs in 1.70: name
#    the work the model leaves out, and estimate its time from chapter 8's instruction counts.

# %% [markdown]
# ### Exercise 4 (a kernel): write Algorithm 1
#
# Write `make_kv_outer_forward(Br, Bc, D)`, returning the kernel
# `kv_outer_forward(q, k, v, o, l, m, lse, scale, causal)` of section 1: views (B·H, N, d),
# grid (B·H,), Br threads, thread t owning query row t of the current query tile; `o`, `l`
# and `m` are the state in HBM (initialise them: O = 0, ℓ = 0, m = −∞), `lse` gets
# $L = m + \log \ell$ at the end (−∞ where ℓ = 0). Loop over the K/V tiles **outside**,
# load $K_j, V_j$ into shared memory, and for every query tile read $Q_i, O_i, \ell_i, m_i$
# from HBM, update them as Algorithm 1 does, and write $O_i, \ell_i, m_i$ back. `grade`
# runs this chapter's tests on yours: the answer against the float64 oracle, and its HBM
# traffic, counted in the simulator, against the closed form of Algorithm 1 as written.
#
# <details><summary>Hint 1</summary>
#
# Start from chapter 4's rung 2 (`make_query_tile_forward` in `kernels/flash_forward.py`):
# the same tile copy and the same thread a row; swap the loops, and move $O_i$, $\ell_i$,
# $m_i$ from registers to `o`, `l`, `m`.
# </details>
#
# <details><summary>Hint 2</summary>
#
# Algorithm 1 stores $O_i$ normalised: to add a tile, take it back as
# $\ell_i e^{m_i - m^{new}} O_i$, add $e^{\tilde m - m^{new}} \tilde P V_j$, divide by
# $\ell^{new}$. A row that has seen no key yet ($m^{new} = -\infty$) keeps its state.
# </details>
#
# <details><summary>Hint 3</summary>
#
# The traffic test counts every element read and written: read each of $Q_i, O_i$ ($d$
# elements), $\ell_i$ and $m_i$ once per (K/V tile, query tile) step, write $O_i, \ell_i,
# m_i$ once per step, and $K$, $V$ once each.
# </details>

# %%
from kernels.base.learner import grade, my_file

TEMPLATE = '''"""My FlashAttention Algorithm 1 (chapter 10: tests/test_kv_outer_forward.py)."""
CHAPTER = "kv_outer_forward"

import math

from numba import cuda, float32

from kernels.base.fused import MINUS_INF, nan_max


def make_kv_outer_forward(Br, Bc, D):
    @cuda.jit
    def kv_outer_forward(q, k, v, o, l, m, lse, scale, causal):
        raise NotImplementedError       # your code: [1] Algorithm 1, the state in HBM

    return kv_outer_forward
'''

mine = my_file("my_kv_outer_forward.py", TEMPLATE)

# %%
passed = grade(mine)

# %% [markdown]
# The course's version, `make_kv_outer_forward` in `kernels/kv_outer_forward.py`, prints here
# once yours passes.

# %%
import inspect

from kernels import kv_outer_forward as kv_outer_module

if passed:
    print(inspect.getsource(kv_outer_module.make_kv_outer_forward))
else:
    print("(shown once your kernel passes; stuck? read make_kv_outer_forward in kernels/kv_outer_forward.py)")
