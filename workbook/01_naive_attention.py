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
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 1. Naive attention
#
# Attention, for one head, with queries $Q \in \mathbb{R}^{N_q \times d}$, keys and values
# $K, V \in \mathbb{R}^{N_k \times d}$:
#
# $$S = \tau\, Q K^\top \qquad P = \operatorname{softmax}_{\text{row}}(S) \qquad O = P V$$
#
# with the scale $\tau = 1/\sqrt{d}$ by default. Written the obvious way, that is three
# kernels, and the two matrices in the middle, $S$ and $P$, are $N_q \times N_k$: they go
# out to HBM and come back.
#
# ```
#            HBM                               the three kernels                          HBM
#   Q (N x d) ──┐
#               ├──► [1] S = τ Q Kᵀ ──► S (N x N) ──► [2] P = softmax(S) ──► P (N x N) ──┐
#   K (N x d) ──┘                                     (and L = logsumexp)                ├──► [3] O = P V ──► O (N x d)
#   V (N x d) ───────────────────────────────────────────────────────────────────────────┘
#
#   elements moved per head:   [1] 2Nd + N²     [2] 2N² (+N for L)     [3] N² + 2Nd     total 4Nd + 4N²
# ```
#
# By the end of this chapter you will have:
#
# 1. the algorithm in NumPy, and its two awkward corners: the causal mask when $N_q \ne N_k$,
#    and rows that may attend to nothing;
# 2. the three CUDA kernels, one at a time, each checked against the float64 oracle;
# 3. the **IO model**: the bytes each kernel moves, why the $4N^2$ term is the whole story
#    for long sequences, and the memory $S$ and $P$ need (64 GiB for $S$ alone at
#    $N = 131072$);
# 4. timings on an H100 next to plain PyTorch, CuPy and PyTorch's SDPA.
#
# The kernels live in `kernels/naive_attention.py`, the tests in
# `tests/test_naive_attention.py`, the bench in `kernels/bench/naive_attention.py`.
#
# **Sources** (numbered as in the README's list): [2] Attention Is All You Need (scaled
# dot-product attention, Section 3.2.1); [1] FlashAttention, Algorithm 0 (standard
# attention) and Theorem 2's first half (Θ(Nd + N²) HBM accesses).

# %%
import inspect
import math
from pathlib import Path

import numpy as np

import kernels  # noqa: F401  (GPU or simulator, chosen before Numba is imported)
from kernels import reference as ref
from kernels.naive_attention import (
    check_mask,
    check_softmax_row,
    default_tiles,
    io_model_bytes,
    make_row_softmax,
    make_scores,
    make_weighted_sum,
    mask_cases,
    naive_attention,
    row_softmax,
    scores,
    softmax_row_cases,
    weighted_sum,
)
from kernels.base.runtime import device_name, on_simulator, time_fn
from kernels.base.testing import assert_close, attention_cases, case_with, check_exercise

print("running on:", device_name())

# %% tags=["parameters"]
# Tiny sizes in the simulator (every GPU thread is a Python thread there), real ones on a GPU.
if on_simulator():
    B, H, NQ, NK, D = 1, 2, 24, 40, 8     # the kernels, step by step
    TIME_SIZES = []                       # no timing in the simulator
else:
    B, H, NQ, NK, D = 2, 4, 1000, 1500, 64
    TIME_SIZES = [(4, 16, 1024, 64), (4, 16, 4096, 64)]

# %% [markdown]
# ## 1. The algorithm in NumPy
#
# Shapes are (B, H, N, d), like PyTorch's `scaled_dot_product_attention`: a batch of B
# sequences, H heads each. Every head is independent; NumPy's `@` broadcasts over (B, H).

# %%
def attention_numpy(q, k, v, scale=None):
    """The three steps, in float32, nothing clever."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = np.float32(scale) * (q @ np.swapaxes(k, -1, -2))     # (B, H, Nq, Nk)
    m = s.max(axis=-1, keepdims=True)                        # the row max: exp never overflows
    e = np.exp(s - m)
    p = e / e.sum(axis=-1, keepdims=True)                    # (B, H, Nq, Nk)
    return p @ v                                             # (B, H, Nq, d)


rng = np.random.default_rng(0)
q = rng.standard_normal((B, H, NQ, D)).astype(np.float32)
k = rng.standard_normal((B, H, NK, D)).astype(np.float32)
v = rng.standard_normal((B, H, NK, D)).astype(np.float32)

o_exact, lse_exact = ref.attention(q, k, v)                           # the float64 oracle
o_f32, _ = ref.attention(q, k, v, dtype=np.float32)                   # plain float32 NumPy
assert_close(attention_numpy(q, k, v), o_exact, o_f32, name="O (NumPy)")
print("NumPy version agrees with the float64 oracle; max |error| =",
      f"{np.abs(attention_numpy(q, k, v) - o_exact).max():.2e}")

# %% [markdown]
# `assert_close` is the course's tolerance rule: the error against the float64 oracle may be
# at most twice the error of a plain float32 NumPy computation of the same thing (plus a tiny
# floor). A fixed `atol=1e-2` would hide real bugs.
#
# ### Subtracting the max
#
# `exp` overflows float32 above about 88.7. Logits of a few hundred are ordinary (large
# activations, a forgotten scale). Since $\operatorname{softmax}(x) = \operatorname{softmax}(x - c)$
# for any $c$, subtract the row max $m$: every exponent is then $\le 0$ and the largest term
# is exactly 1, so the sum $\ell \ge 1$ never underflows to 0 either.

# %%
x = np.array([1000.0, 999.0, 990.0], dtype=np.float32)
with np.errstate(over="ignore", invalid="ignore"):
    print("exp(x) / sum:      ", np.exp(x) / np.exp(x).sum())
print("exp(x - m) / sum:  ", np.exp(x - x.max()) / np.exp(x - x.max()).sum())

# %% [markdown]
# ### The causal mask, and rows with nothing to attend to
#
# With a causal mask, query $i$ may attend key $j$ iff $j \le i + (N_k - N_q)$: the mask is
# aligned to the **bottom-right** corner (as in FlashAttention $\ge$ 2.1). With $N_q = N_k$
# that is the usual lower triangle; with $N_q < N_k$ (decoding the last few tokens of a long
# prefix) every query sees the whole prefix. Masked scores are $-\infty$, so their
# $e^{s - m}$ is 0.
#
# With $N_q > N_k$ the first $N_q - N_k$ queries may attend to **nothing**: their row of
# $S$ is all $-\infty$, $m = -\infty$, and $e^{-\infty - (-\infty)}$ is NaN. The course's
# convention: such a row gets $P = 0$, $O = 0$ and $L = -\infty$, never NaN.

# %%
def show_mask(nq, nk):
    mask = ref.causal_mask(nq, nk)
    print(f"Nq={nq}, Nk={nk}   (# = may attend)")
    for i, row in enumerate(mask):
        note = "   <- nothing to attend to" if not row.any() else ""
        print("  ", "".join("#" if a else "." for a in row), note)


show_mask(4, 4)
show_mask(3, 6)
show_mask(6, 3)

# %% [markdown]
# ## 2. Kernel 1: the scores S = τ Q Kᵀ
#
# $S$ is a matrix product: $S_{ij} = \tau \sum_{c<d} Q_{ic} K_{jc}$. One block computes a
# $B_r \times B_c$ tile of $S$ for one (batch, head). The reduction over $d$ goes in chunks
# of $B_k$ columns:
#
# 1. the block's threads copy $Q[\text{rows}, \text{chunk}]$ and $K[\text{cols}, \text{chunk}]$
#    into shared memory, consecutive threads reading consecutive floats (**coalesced**);
#    anything outside the arrays (ragged $N$, $d$ not a multiple of $B_k$) is loaded as 0,
#    which adds nothing to a dot product;
# 2. a barrier; every thread accumulates a $T_M \times T_N$ **micro-tile** of $S$ in registers,
#    reading its operands from shared memory;
# 3. a barrier before the next chunk overwrites the tiles.
#
# Then each thread writes its micro-tile: $\tau \cdot$ acc, or $-\infty$ where the causal mask
# forbids. Threads next to each other in a warp own neighbouring columns, so the writes of
# $S$ (the bulk of this kernel's traffic) are coalesced too. With the causal mask a tile that
# lies entirely above the diagonal is filled with $-\infty$ without loading anything.
# Chapter 2 builds fast tiled matmuls properly; here a plain version is enough.

# %%
print(inspect.getsource(make_scores))

# %%
tiles = default_tiles()
print(tiles)
for causal in (False, True):
    s = scores(q, k, causal=causal)
    mask = ref.attention_mask(NQ, NK, causal=causal)
    s_exact = ref.matmul(q, np.swapaxes(k, -1, -2)) / math.sqrt(D)
    s_f32 = np.float32(1 / math.sqrt(D)) * (q @ np.swapaxes(k, -1, -2))
    if mask is not None:
        s_exact, s_f32 = np.where(mask, s_exact, -np.inf), np.where(mask, s_f32, -np.inf)
    assert_close(s, s_exact, s_f32, name=f"S causal={causal}")
    c0 = max(0, NK - NQ)  # the first rows' diagonal: query i sees keys j <= i + (Nk - Nq)
    print(f"causal={causal}: S {s.shape} agrees with the oracle; rows 0-3, keys {c0 - 2}..{c0 + 3}:")
    print(np.array2string(s[0, 0, :4, max(0, c0 - 2):c0 + 4], precision=2, suppress_small=True))

# %% [markdown]
# ## 3. Kernel 2: the row softmax P = softmax(S)
#
# One block per row of $S$, $T$ threads. Thread $t$ reads entries $t, t + T, t + 2T, \dots$
# (a warp reads 32 consecutive floats at a time: coalesced) and keeps them in registers, so
# $S$ is read **once** and $P$ written **once**, as the IO model counts. Two block-wide
# reductions in shared memory give the row max $m$ and the sum
# $\ell = \sum_j e^{S_{ij} - m}$; then $P_{ij} = e^{S_{ij} - m} / \ell$, and the logsumexp
# $L_i = m + \log \ell$ comes for free (chapter 4 saves it for the backward pass).
#
# The tree reduction: $T$ values in shared memory; at each step the first half of the threads
# combine their value with the one `stride` further on, and a barrier separates the steps:
#
# ```
# stride 4:  [a0 a1 a2 a3 | a4 a5 a6 a7]  ->  a0+a4  a1+a5  a2+a6  a3+a7
# stride 2:  [b0 b1 | b2 b3]              ->  b0+b2  b1+b3
# stride 1:  [c0 | c1]                    ->  c0+c1   (= the row's total, in slot 0)
# ```
#
# A row longer than $T$ times the registers a thread may hold (4096 entries with the
# production tiles) is swept three times instead (max, sum, write); the re-reads mostly hit L2.
#
# One subtlety: the kernels are compiled with fast math, which lets the compiler assume no
# value is infinite. So the kernel never *compares* with $-\infty$: the running max starts at
# the lowest finite float32, and a row whose max is still that value is a row with nothing to
# attend to ($P = 0$, $L = -\infty$ are written as constants).

# %%
print(inspect.getsource(make_row_softmax))

# %%
s_causal = scores(q, k, causal=True)
p, lse = row_softmax(s_causal)
assert_close(p, ref.softmax(s_causal), ref.softmax(s_causal, dtype=np.float32), name="P")
assert_close(lse, ref.logsumexp(s_causal), ref.logsumexp(s_causal, dtype=np.float32), name="L")
print("P agrees with the oracle; row sums of P:", np.round(p[0, 0].sum(axis=-1)[:8], 6))

# A fully masked row: Nq > Nk with the causal mask.
q6, k3 = q[:, :, :6], k[:, :, :3]
p6, lse6 = row_softmax(scores(q6, k3, causal=True))
print("Nq=6, Nk=3, causal: rows of P sum to", p6[0, 0].sum(axis=-1), " L =", lse6[0, 0])

# %% [markdown]
# ## 4. Kernel 3: the weighted sum O = P V
#
# Another matrix product, $O_{ic} = \sum_j P_{ij} V_{jc}$, organised like kernel 1: a block
# computes a $B_r \times B_d$ tile of $O$, and the reduction runs over the keys $j$ in chunks
# of $B_k$, staging a $B_r \times B_k$ tile of $P$ and a $B_k \times B_d$ tile of $V$ in
# shared memory. With the causal mask, key chunks entirely past the diagonal are skipped
# ($P$ is 0 there) and $P$ is taken as 0 past the diagonal inside a chunk.

# %%
print(inspect.getsource(make_weighted_sum))

# %%
o = weighted_sum(p, v, causal=True)
o_exact_c, lse_exact_c = ref.attention(q, k, v, causal=True)
o_f32_c, _ = ref.attention(q, k, v, causal=True, dtype=np.float32)
assert_close(o, o_exact_c, o_f32_c, name="O")
assert_close(lse, lse_exact_c, ref.attention(q, k, v, causal=True, dtype=np.float32)[1], name="L")
print("O = P V agrees with the oracle (causal, Nq =", NQ, ", Nk =", NK, ")")

# %% [markdown]
# ## 5. The launcher
#
# `naive_attention(q, k, v, *, causal=False, scale=None)` validates its inputs (rank, shapes,
# float32, $d \le 128$, the scale, the flags), allocates $S$, $P$, $L$ and $O$ on the device,
# runs the three kernels, and gives back NumPy for NumPy input, device arrays for device
# input. Every $N \ge 0$ works, $N_q \ne N_k$ too. A few drawn cases against the oracle (the
# tests in `tests/test_naive_attention.py` draw many more, including logits around $10^4$):

# %%
from hypothesis import HealthCheck, given, settings


@settings(max_examples=4 if on_simulator() else 30, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(attention_cases(max_n=24 if on_simulator() else 300, max_d=8 if on_simulator() else 128))
def launcher_agrees(case):
    o, lse = naive_attention(case.q, case.k, case.v, causal=case.causal, scale=case.scale, return_lse=True)
    o_exact, lse_exact = ref.attention(case.q, case.k, case.v, causal=case.causal, scale=case.scale)
    o_f32, lse_f32 = ref.attention(case.q, case.k, case.v, causal=case.causal, scale=case.scale,
                                   dtype=np.float32)
    assert_close(o, o_exact, o_f32, name="O")
    assert_close(lse, lse_exact, lse_f32, name="L")


launcher_agrees()
print("naive_attention agrees with the oracle on the drawn cases")

try:
    naive_attention(q.astype(np.float64), k, v)
except TypeError as exc:
    print("bad input is refused before any launch:", exc)

# %% [markdown]
# ## 6. The bytes: the IO model
#
# Count the elements each kernel reads from and writes to HBM, per head, taking every input
# as read once ($N_q = N_k = N$):
#
# | kernel | reads | writes | elements |
# |---|---|---|---|
# | 1. $S = \tau Q K^\top$ | $Q$, $K$: $2Nd$ | $S$: $N^2$ | $2Nd + N^2$ |
# | 2. $P = \operatorname{softmax}(S)$ | $S$: $N^2$ | $P$: $N^2$, $L$: $N$ | $2N^2 + N$ |
# | 3. $O = P V$ | $P$: $N^2$, $V$: $Nd$ | $O$: $Nd$ | $N^2 + 2Nd$ |
# | total | | | $4Nd + 4N^2$ (+ $N$) |
#
# Every extra elementwise pass over $S$ (a separate scale, a separate mask, a dropout) adds
# another $2N^2$. The inputs and the output are $4Nd$; once $N > d$ the $4N^2$ dominates,
# and at $N = 4096$, $d = 64$ it is 98% of the traffic. The *compulsory* traffic, reading
# Q, K, V once and writing O once, is only $4Nd$: that is what a fused kernel (chapter 4)
# gets close to.
#
# The FLOPs: kernels 1 and 3 each do $2N^2d$ (a multiply and an add per term), so
# $4N^2d$ in all; the softmax does a handful per element. Kernel 1 thus does $2d$ FLOPs
# per 4-byte element of $S$ it writes, $d/2$ FLOP per byte: 32 at $d = 64$, above the H100's
# fp32 ridge point (51 TFLOP/s / 3 TB/s $\approx$ 17 FLOP/B, the ceilings chapter 0 measured).
# On the FMA units the two matrix products are bound by arithmetic, the softmax purely by HBM.
# The course's IO models and measured ceilings are written down in `kernels/base/io_model.py`
# (`standard_forward_bytes` is this count; `ceilings()` quotes the committed measurements).

# %%
def gib(nbytes):
    return nbytes / 2**30


from kernels.base.io_model import ceilings

hbm = ceilings().memcpy_gbps * 1e9   # bytes a second, the copy bandwidth measured in chapter 0
b_, h_, d_ = 4, 16, 64
print(f"B={b_} H={h_} d={d_} fp32; time at {hbm / 1e12:.2f} TB/s is the least the bytes can take")
print(f"{'N':>7} {'4Nd (GiB)':>10} {'4N^2 (GiB)':>11} {'total GiB':>10} {'N^2 share':>10} "
      f"{'ms at HBM':>11} {'S+P memory GiB':>15} {'4N^2 d GFLOP':>13}")
for n in (512, 1024, 2048, 4096, 8192, 16384):
    per = io_model_bytes(b_, h_, n, n, d_)
    io_nd = 4 * 4 * n * d_ * b_ * h_
    io_n2 = 4 * 4 * n * n * b_ * h_
    mem = 2 * 4 * n * n * b_ * h_
    print(f"{n:>7} {gib(io_nd):>10.3f} {gib(io_n2):>11.2f} {gib(per['total']):>10.2f} "
          f"{io_n2 / per['total']:>10.1%} {per['total'] / hbm * 1e3:>11.2f} {gib(mem):>15.1f} "
          f"{4 * b_ * h_ * n * n * d_ / 1e9:>13.0f}")

n = 131072
print(f"\nB*H = 1, N = {n}: S alone is {gib(4 * n * n):.0f} GiB of float32; S and P {gib(8 * n * n):.0f} GiB "
      "(an H100 has 80 GB). The fused kernel of chapter 4 needs O(N d) memory instead.")

# %% [markdown]
# The same numbers as a picture: bytes per head against $N$ for the naive path
# ($4Nd + 4N^2$) and for the compulsory traffic of a fused kernel ($4Nd + N$).

# %%
import matplotlib.pyplot as plt

ns = np.array([2**i for i in range(7, 18)], dtype=np.float64)
fig, ax = plt.subplots(figsize=(7, 4))
ax.loglog(ns, 4 * (4 * ns * 64 + 4 * ns**2), "o-", label="naive: 4Nd + 4N²  (S and P through HBM)")
ax.loglog(ns, 4 * (4 * ns * 64 + ns), "s--", label="fused, compulsory: 4Nd + N")
ax.axhline(80e9, color="red", linestyle=":", linewidth=1)
ax.annotate("80 GB: an H100's whole memory", xy=(ns[0], 80e9), xytext=(0, 4), textcoords="offset points",
            color="red", fontsize=8)
ax.set_xlabel("N (sequence length), d = 64, one head")
ax.set_ylabel("HBM bytes (fp32)")
ax.set_title("The N x N matrices are the cost")
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# ## 7. Timing it
#
# On a GPU, time the three kernels at the parameter cell's sizes (CUDA events, median of
# repeated runs) and turn the times into GB/s against the IO model. The bench
# (`python -m kernels --chapters 1`) does this properly, with peers, in one run.

# %%
if TIME_SIZES:
    from numba import cuda

    for b_, h_, n_, d_ in TIME_SIZES:
        rng_t = np.random.default_rng(1)
        dq, dk, dv = (cuda.to_device(rng_t.standard_normal((b_, h_, n_, d_)).astype(np.float32)) for _ in range(3))
        ds = cuda.device_array((b_, h_, n_, n_), np.float32)
        dp = cuda.device_array((b_, h_, n_, n_), np.float32)
        dl = cuda.device_array((b_, h_, n_), np.float32)
        do = cuda.device_array((b_, h_, n_, d_), np.float32)
        per = io_model_bytes(b_, h_, n_, n_, d_)
        steps = {
            "scores": lambda: scores(dq, dk, out=ds),
            "row_softmax": lambda: row_softmax(ds, out=dp, lse_out=dl),
            "weighted_sum": lambda: weighted_sum(dp, dv, out=do),
        }
        print(f"B={b_} H={h_} N={n_} d={d_}")
        total = 0.0
        for name, fn in steps.items():
            t = time_fn(lambda _: fn(), [(None,)])
            total += t.median_ms
            print(f"  {name:<13} {t.median_ms:8.3f} ms  {per[name] / t.median_ms / 1e6:7.0f} GB/s")
        print(f"  {'all three':<13} {total:8.3f} ms  {per['total'] / total / 1e6:7.0f} GB/s, "
              f"{4 * b_ * h_ * n_ * n_ * d_ / total / 1e9:.1f} TFLOP/s")
        del ds, dp, dl, do, dq, dk, dv
else:
    print("timing skipped in the simulator: its timings say nothing about a GPU")

# %% [markdown]
# ## 8. Results on the H100
#
# `python -m kernels --chapters 1` measures, at B = 4, H = 16, d = 64, fp32, N = 1024 to 4096:
# each kernel alone (with its own byte count), the three together, the `naive_attention`
# launcher (which allocates S and P each call: see its peak memory), and in the same run
# plain PyTorch attention (fp32, TF32 off), the same in CuPy, and PyTorch SDPA's math and
# memory-efficient backends. The committed results:

# %%
from kernels.bench.harness import show_results

rows_ = show_results("naive_attention", ("kernel", "config", "median_ms", "gbps", "tflops", "peak_mem_mb"))

# %% [markdown]
# Things to look for: the softmax kernel's GB/s against the ~3 TB/s copy bandwidth (it does
# almost no arithmetic, so bandwidth is all it can use); the S and PV kernels' TFLOP/s
# against the fp32 FMA ceiling (about 51 TFLOP/s); the launcher's peak memory, which is
# $S$ and $P$; and how far SDPA's fused backend, which never writes $S$ or $P$, runs ahead.

# %% [markdown]
# ## 9. Exercises
#
# ### Exercise 1: the causal mask
#
# Write `my_allowed(i, j, nq, nk)`: True when query `i` may attend key `j` under the
# bottom-right causal convention, for any `nq`, `nk` (either may be 0, and `nq` may exceed
# `nk`). The checker draws pairs of sizes and compares your whole mask with the oracle's
# for both `(nq, nk)` and `(nk, nq)`, so every draw with unequal sizes also has `nq > nk`:

# %%
def my_allowed(i, j, nq, nk):
    # your code here
    raise NotImplementedError


# %%
print(inspect.getsource(check_mask))
_ = check_exercise(lambda case: check_mask(my_allowed, case), mask_cases(), host=True)

# %% [markdown]
# The checker on the condition the scores kernel uses (`j > i + shift` masks, with
# `shift = nk - nq`):

# %%
_ = check_exercise(lambda case: check_mask(lambda i, j, nq, nk: not (j > i + (nk - nq)), case), mask_cases(),
                   host=True)

# %% [markdown]
# ### Exercise 2: the safe softmax of one row
#
# Write `my_softmax_row(x)` for a float32 row `x` (length 0 or more) that may hold `-inf`
# entries, or be all `-inf`: return float32 probabilities (a float64 result fails),
# zeros for a row with no finite entry, never NaN, and no overflow or underflow for logits
# around $\pm 10^3$ or spread over $\pm 10^4$. The checker uses the tolerance rule against
# the float64 oracle. Both exercises here are NumPy or plain Python, so their checkers draw
# 300 cases (the mask's has only 169 size pairs, and runs them all); a checker that
# launches a kernel draws ten in the simulator, a hundred on a GPU.

# %%
def my_softmax_row(x):
    # your code here
    raise NotImplementedError


# %%
print(inspect.getsource(softmax_row_cases))
print(inspect.getsource(check_softmax_row))
_ = check_exercise(lambda x: check_softmax_row(my_softmax_row, x), softmax_row_cases(), host=True)

# %% [markdown]
# The checker on the chapter's kernel (a row is a (1, 1, 1, n) score matrix; a kernel
# launch, so a few cases in the simulator):

# %%
_ = check_exercise(lambda x: check_softmax_row(lambda r: row_softmax(r.reshape(1, 1, 1, -1))[0].reshape(-1), x),
                   softmax_row_cases())

# %% [markdown]
# ### Exercises 4 and 5 (kernels): the first versions
#
# Before the tiles of sections 2 and 3, the version anyone writes first: one thread an
# element of $S$, one thread a row of the softmax. Write both in your own file (the next
# cell makes it from a template the first time: `workbook/mine/my_naive_attention.py`);
# `grade` runs the chapter's tests `test_first_scores_match_the_oracle` and
# `test_first_row_softmax_matches_the_oracle` on them, against the float64 oracle with the
# same tolerance as the tiled kernels, and prints the smallest failing case.
#
# * **Exercise 4.** `make_first_scores()` returns a kernel `(q, k, s, scale, causal)` on
#   `(B*H, N, d)` views of Q and K and the `(B*H, Nq, Nk)` view of S, launched on a grid of
#   16 x 16 blocks: `(ceil(Nk/16), ceil(Nq/16), B*H)`. Thread `(x, y)` of the grid (from
#   `cuda.grid(2)`), with `z = cuda.blockIdx.z`, writes `s[z, y, x]` =
#   `scale * (q[z, y, :] . k[z, x, :])`, or `-inf` where the causal mask forbids key `x`
#   for query `y`.
# * **Exercise 5.** `make_first_row_softmax()` returns a kernel `(s, p, lse)`, launched with
#   one thread for each of the B·H·Nq rows: row `r` is `s[r // Nq, r % Nq, :]`. It writes
#   that row of `p` and `lse[r // Nq, r % Nq]`, with the conventions of section 3: a row with
#   nothing to attend to gets P = 0 and L = -inf, and a NaN in a row makes that row NaN.
#
# <details><summary>Hint 1 (exercise 4)</summary>
#
# `j, i = cuda.grid(2)` gives the column and the row; check `i < s.shape[1] and j < s.shape[2]`
# (the last blocks overhang). The causal rule is exercise 1's, with Nq and Nk from `s.shape`.
# Sum the products in a `float32` accumulator.
# </details>
#
# <details><summary>Hint 2 (exercise 5)</summary>
#
# Three sweeps over the row: the max `m`; the sum `l` of `exp(s - m)`; then `p = exp(s - m) /
# l` and `L = m + log(l)`. If `m` is `-inf` nothing may be attended to: write zeros and
# `-inf` without forming `exp(-inf - (-inf))`. Keep `l` in a `float64`: one float32 running
# sum over a row of thousands errs far more than NumPy's pairwise sums, which set the
# tolerance (on a GPU the tests draw rows that long).
# </details>
#
# <details><summary>Hint 3 (exercise 5, NaN)</summary>
#
# Numba's `max(a, b)` drops a NaN argument; `kernels.base.fused.nan_max` keeps it.
# </details>

# %%
from kernels.base.learner import grade, my_file

TEMPLATE = '''"""My kernels for chapter 1 (graded by tests/test_naive_attention.py)."""
CHAPTER = "naive_attention"

import math

from numba import cuda, float32, float64

from kernels.base.fused import nan_max


def make_first_scores():
    @cuda.jit
    def first_scores_kernel(q, k, s, scale, causal):
        raise NotImplementedError   # your code: s[z, y, x] for thread (x, y) of block z

    return first_scores_kernel


def make_first_row_softmax():
    @cuda.jit
    def first_row_softmax_kernel(s, p, lse):
        raise NotImplementedError   # your code: row r of p and its lse

    return first_row_softmax_kernel
'''

mine = my_file("my_naive_attention.py", TEMPLATE)

# %%
_ = grade(mine)

# %% [markdown]
# The course's answers: `kernels.naive_attention.make_first_scores` and
# `make_first_row_softmax`. On the H100 (one run of `python -m kernels --chapters 1`,
# 2026-11-24, `workbook/results/naive_attention_first_versions.csv`; B = 4, H = 16, d = 64,
# fp32) the first versions are correct and slow: at N = 4096 the first scores kernel takes
# 149 ms against the tiled kernel's 12.0 (0.92 against 11.5 TFLOP/s: each thread reads its
# 2d floats of Q and K for one element of S), and the first row softmax 77.6 ms against 3.0
# (a warp's 32 threads read 32 rows, Nk floats apart: no load is coalesced). Sections 2
# and 3 are what closes those gaps; time yours with section 7's `time_fn` on a GPU.

# %% [markdown]
# ### Exercise 3 (on paper first)
#
# 1. At B = 1, H = 32, d = 128, how large may N be before $S$ and $P$ together fill 80 GB?
# 2. A model applies a separate scale kernel and a separate mask kernel before the softmax.
#    How many bytes per head does that add at N = 8192 (fp32)?
# 3. At N = 4096, d = 64 on an H100 (3 TB/s, 51 fp32 TFLOP/s), which is larger: the time the
#    naive path's bytes take, or the time its FLOPs take at the cuBLAS ceiling?
#
# Check your answers:

# %%
n_fit = int(math.sqrt(80e9 / (2 * 4 * 32)))
print(f"1. 2 * 4 * 32 * N^2 <= 80e9  ->  N <= {n_fit}")
print(f"2. two extra passes, 2 * 2 N^2 elements: {2 * 2 * 8192**2 * 4 / 2**30:.2f} GiB a head")
per = io_model_bytes(4, 16, 4096, 4096, 64)
print(f"3. bytes {per['total'] / 3e12 * 1e3:.2f} ms vs FLOPs {4 * 4 * 16 * 4096**2 * 64 / 51e12 * 1e3:.2f} ms "
      "at B=4, H=16: about even. A Numba kernel without tensor cores reaches a fraction of the "
      "FMA ceiling, so the matmul kernels are slower than their bytes, and the softmax kernel "
      "is pure traffic.")
