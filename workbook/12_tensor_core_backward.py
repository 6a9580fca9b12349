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
# # 12. The backward on tensor cores
#
# Chapter 5 wrote the recomputing backward on the fp32 FMA units; chapter 8 put the forward
# on the tensor cores (`mma.sync`, fp16 or bf16 in, fp32 accumulate). This chapter does the
# same for the backward: chapter 5's algebra, all five of its products on `mma.sync`, in
# FlashAttention-2's loop order (K/V tiles outer). One idea is new, and it is about
# fragments: the warp computes the scores **transposed**, S^T = K Q^T, because then the
# accumulators of S^T and dP^T are already, register for register, the A operands of the
# two products that sum over queries (dV and dK). Only dQ needs a trip through shared
# memory.
#
# 1. what the backward computes: five products, 2.5x the forward's FLOPs;
# 2. K/V tiles outer: dK and dV stay in a block's registers, dQ is summed by atomic adds;
# 3. the fragments: which operand comes from where, checked lane by lane;
# 4. the kernel, `kernels/tensor_core_backward.py`;
# 5. precision (P and dS rounded to fp16 / bf16) and the check against the oracle;
# 6. grouped-query attention: dK and dV summed over the group inside the block;
# 7. the GPU results against PyTorch's backwards;
# 8. exercises, two of them checked here.
#
# **Sources** (numbered as in the README's list): [4] FlashAttention-2, Algorithm 2 (the
# backward: K/V tiles outer, dQ_i updated from every key tile) and Section 3.2 (one thread
# block a key tile, dQ summed with atomic adds); [1] FlashAttention, Appendix B (the
# gradients, P recomputed from L); [14] the PTX ISA, "Matrix Fragments for mma.m16n8k16",
# `ldmatrix` (and its `.trans`), `red` (the atomic adds).

# %%
import inspect
import math

import matplotlib.pyplot as plt
import numpy as np

import kernels  # noqa: F401  (GPU or simulator, chosen before Numba is imported)
from kernels import reference as ref
from kernels import tensor_core_backward as tcb
from kernels.base import mma as tc
from kernels.base.runtime import device_name, on_simulator
from kernels.tensor_core_backward import (
    flash_attention_backward_tc,
    make_backward_tc,
    rounded_backward_numpy,
    shared_halves,
    tc_backward_tiles,
)

print("running on:", device_name())

# %% tags=["parameters"]
# Tiny sizes in the simulator (every GPU thread is a Python thread there), real ones on a GPU.
# The check of section 5: B, H query heads on HKV KV heads (GQA), NQ queries, NK keys, d.
if on_simulator():
    B, H, HKV, NQ, NK, D_HEAD = 1, 2, 1, 20, 24, 16
else:
    B, H, HKV, NQ, NK, D_HEAD = 2, 8, 2, 1000, 1100, 64


# %% [markdown]
# ## 1. What the backward computes
#
# Chapter 5's derivation, for one head with scale $\tau$: the forward saved O and the row
# logsumexp L; the backward gets dO and rebuilds everything else tile by tile,
#
# $$S = \tau\,QK^\top,\quad P = e^{S - L},\quad dV = P^\top dO,\quad dP = dO\,V^\top,\quad
# D = \mathrm{rowsum}(dO \circ O),$$
# $$dS = P \circ (dP - D),\quad dQ = \tau\, dS\,K,\quad dK = \tau\, dS^\top Q .$$
#
# Five of these are matrix products, each $2 N_q N_k d$ FLOPs: S, dP, dV, dQ and dK. The
# forward has two (S and P V), so the backward is **2.5x the forward's FLOPs**: $10 N_q N_k d$
# a head against $4 N_q N_k d$ (both halved by a causal mask). D is a row sum of d products, a
# small pre-pass (`make_delta_tc`, which also zeroes dQ for the atomic adds of section 2).
#
# On the tensor cores every one of the five products becomes `mma.sync.m16n8k16`: fp16 or
# bf16 operands, fp32 accumulators. Two of the operands are not inputs but results of the
# products before them, P and dS: how they get from one product to the next is what this
# chapter is about.

# %%
def flops(b, h, n_q, n_k, d, causal=False):
    """(forward, backward) FLOPs: 2 and 5 products of 2 Nq Nk d a head."""
    one = 2.0 * b * h * n_q * n_k * d / (2 if causal else 1)
    return 2 * one, 5 * one


fwd, bwd = flops(4, 16, 4096, 4096, 64)
print(f"B=4 H=16 N=4096 d=64: forward {fwd / 1e12:.2f} TFLOP, backward {bwd / 1e12:.2f} TFLOP "
      f"({bwd / fwd:.1f}x)")

# %% [markdown]
# ## 2. K/V tiles outer: dK and dV in registers, dQ by atomic adds
#
# dK_j and dV_j sum over **queries**; dQ_i sums over **keys**. One loop order can keep only
# one kind on chip (chapter 5, section 3). FlashAttention-2's backward (Algorithm 2) puts the
# K/V tiles outside: one thread block owns key tile j, keeps K_j and V_j in shared memory and
# dK_j, dV_j in its warps' registers for the whole walk over the query tiles, and writes them
# once at the end. dQ_i gets a contribution $\tau\,dS_{ij} K_j$ from every key tile, that is
# from every block: the blocks add them into dQ in HBM with **float32 atomic adds**
# (FlashAttention-2, Section 3.2).
#
# Here is that loop order in NumPy, float64, in the kernel's orientation: the block of key
# tile j takes the queries 16 at a time (a **chunk** c), and computes the scores transposed,
# keys as rows (section 3 says why):

# %%
def backward_kv_outer(q, k, v, o, lse, do, causal=False, Bc=32, chunk=16):
    """dq, dk, dv of one head (q, o, do: Nq x d; k, v: Nk x d; lse: Nq), float64, in the
    kernel's loop order: key tiles outer (one block each), chunks of 16 queries inner."""
    n_q, d = q.shape
    n_k = k.shape[0]
    tau = 1 / math.sqrt(d)
    big_d = (do * o).sum(-1)                                   # D = rowsum(dO o O), the pre-pass
    live = np.isfinite(lse)                                    # L = -inf: a row that sees no key
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for k0 in range(0, n_k, Bc):                               # a block: key tile j
        kj, vj = k[k0:k0 + Bc], v[k0:k0 + Bc]
        dkj, dvj = np.zeros_like(kj), np.zeros_like(vj)        # on chip for the whole walk
        for c0 in range(0, n_q, chunk):                        # a chunk c of 16 queries
            qc, doc = q[c0:c0 + chunk], do[c0:c0 + chunk]
            keys, queries = np.arange(k0, k0 + len(kj))[:, None], np.arange(c0, c0 + len(qc))[None, :]
            seen = live[c0:c0 + chunk][None, :] & ((not causal) | (keys <= queries + n_k - n_q))
            st = tau * kj @ qc.T                               # S^T = tau K_j Q_c^T (keys x queries)
            pt = np.where(seen, np.exp(st - np.where(seen, lse[c0:c0 + chunk], 0)), 0)   # P^T
            dpt = vj @ doc.T                                   # dP^T = V_j dO_c^T
            dst = pt * (dpt - big_d[c0:c0 + chunk])            # dS^T = P^T o (dP^T - D)
            dvj += pt @ doc                                    # dV_j += P^T dO_c
            dkj += tau * dst @ qc                              # dK_j += tau dS^T Q_c
            dq[c0:c0 + chunk] += tau * dst.T @ kj              # dQ_c += tau dS K_j: the atomic adds
        dk[k0:k0 + Bc], dv[k0:k0 + Bc] = dkj, dvj              # written once
    return dq, dk, dv


rng = np.random.default_rng(12)
q1, k1, v1, do1 = (rng.standard_normal((n, 24)) for n in (40, 70, 70, 40))
for causal in (False, True):
    o1, l1 = ref.attention(q1[None, None], k1[None, None], v1[None, None], causal=causal)
    exact = ref.attention_backward(q1[None, None], k1[None, None], v1[None, None], o1, l1, do1[None, None],
                                   causal=causal)
    got = backward_kv_outer(q1, k1, v1, o1[0, 0], l1[0, 0], do1, causal=causal)
    worst = max(np.abs(g - e[0, 0]).max() for g, e in zip(got, exact))
    print(f"causal={causal}: the K/V-outer loop against the oracle, max difference {worst:.1e}")
    assert worst < 1e-12

# %% [markdown]
# **Atomic adds make dQ's last bits vary.** Float32 addition is not associative, and the
# blocks' adds into dQ land in whatever order the blocks happen to finish. The same
# contributions, summed in two orders:

# %%
n, d, Bc = 256, 64, 32
qa, ka, va, doa = (rng.standard_normal((n, d)) for _ in range(4))
oa, la = ref.attention(qa[None, None], ka[None, None], va[None, None])
tau = 1 / math.sqrt(d)
pa = np.exp(tau * qa @ ka.T - la[0, 0][:, None])
dsa = pa * (doa @ va.T - (doa * oa[0, 0]).sum(-1, keepdims=True))
pieces = [(tau * dsa[:, j:j + Bc] @ ka[j:j + Bc]).astype(np.float32) for j in range(0, n, Bc)]   # a block each
in_order, reversed_order = np.zeros((n, d), np.float32), np.zeros((n, d), np.float32)
for piece in pieces:
    in_order += piece
for piece in pieces[::-1]:
    reversed_order += piece
differ = in_order != reversed_order
print(f"{len(pieces)} key tiles: {differ.mean():.0%} of dQ's elements differ between the two orders, "
      f"by at most {np.abs(in_order - reversed_order).max():.1e} (max |dQ| {np.abs(in_order).max():.1f})")

# %% [markdown]
# A few float32 ulps, different from one run to the next: what FlashAttention-2 and PyTorch's
# flash backward accept too. The deterministic alternative is chapter 5's separate dQ kernel
# (query tiles outer), which recomputes S and dP a second time (exercise 5).
#
# ## 3. The fragments: where each operand comes from
#
# A warp of the block owns 16 keys of the tile (K_w, V_w, and its 16 rows of dK_j and dV_j).
# For each chunk of 16 queries it computes, with chapter 8's instruction (A 16 x 16, B 16 x 8,
# C and D 16 x 8 in fp32):
#
# ![the five products of the backward and where each operand comes from](../slides/img/12_operands.png)
#
# (`slides/img/make_12_figures.py`.) The first two products put **keys in the rows**:
# S^T = K_w Q_c^T is 16 keys x 16 queries, two accumulator tiles (queries 0-7 and 8-15 of
# the chunk). Now look at the next product, dV_w += P^T dO_c: its A operand is P^T, 16 keys
# x 16 queries, and its k-dimension (the sum) runs over the 16 queries of the chunk: one
# k-step. Chapter 8 found that two neighbouring accumulator tiles hold, lane for lane,
# exactly the elements of a 16 x 16 A fragment. So P^T, computed in the accumulators of
# S^T, *is* the A fragment of P^T dO_c once each pair of floats is packed to fp16 (or bf16)
# in its own register: no shuffle, no shared memory. The same holds for dS^T, computed in
# the accumulators of dP^T, and dK_w += dS^T Q_c. Element by element, with the position
# functions of `kernels/base/mma.py` (the ones its emulation and tests use):

# %%
def st_position(lane, n, e):
    """(key, query) of S^T = K_w Q_c^T that ``lane`` holds as element e of accumulator tile
    n (tile n: the chunk's queries 8n .. 8n + 7)."""
    key, query = tc.c_position(lane, e)
    return key, query + 8 * n


for lane in range(32):
    for i in range(8):                          # A's element i is tile i // 4's element i % 4
        assert st_position(lane, i // 4, i % 4) == tc.a_position(lane, i), (lane, i)
print("every lane's 8 accumulator elements of S^T sit where the A fragment of P^T needs them")
for lane in (0, 5, 31):
    print(f"  lane {lane:2d} holds (key, query) {[st_position(lane, i // 4, i % 4) for i in range(8)]}")

# %% [markdown]
# Had the warp computed S = Q_c K_w^T, as chapter 8's forward does (queries in the rows), a
# lane would hold P's elements at the transposed positions. How many of the 8 elements of
# P^T's A fragment would each lane already hold?

# %%
def held_by_chapter_8(lane):
    """(key, query) of P^T that ``lane`` holds after S = Q_c K_w^T (tile n: keys 8n .. 8n + 7)."""
    out = set()
    for n in range(2):
        for e in range(4):
            query, key = tc.c_position(lane, e)
            out.add((key + 8 * n, query))
    return out


in_place = [len(held_by_chapter_8(lane) & {tc.a_position(lane, i) for i in range(8)}) for lane in range(32)]
print("elements in place, lane by lane:", in_place)
print(f"{sum(in_place)} of 256: the rest would have to move between lanes (shuffles) or through shared memory")

# %% [markdown]
# ![lane 5's accumulator elements against the A fragment of P^T, in both orientations](../slides/img/12_fragments.png)
#
# The B operands come from shared memory, where the block stages Q_i and dO_i (row-major,
# queries x d). A B fragment holds pairs along its k-dimension: in S^T = K_w Q_c^T, k runs
# over d, along a row of Q_i, so a plain `ldmatrix` reads it (as chapter 8 reads K for S).
# In dV += P^T dO_c and dK += dS^T Q_c, k runs over the chunk's queries, down a column of
# dO_i and Q_i: `ldmatrix.trans` reads it, transposing 8 x 8 tiles on the way (as chapter 8
# reads V for P V).
#
# **dQ is the exception.** dQ_i += τ dS K_j sums over the block's keys, which are spread
# over all its warps (16 each), and its A operand is dS, queries x keys: the transpose of what
# each warp holds. So every warp writes its dS^T (16-bit, as the products use it) to shared
# memory; after a barrier the warps split dQ_i into pieces of 16 query rows and read dS back
# as A fragments with `ldmatrix.trans` of the stored dS^T (exercise 4 asks for the
# addresses), K_j as B with `ldmatrix.trans` too, and add their pieces to dQ with atomic
# adds: `red.global.add.v2.f32`, two neighbouring columns an instruction.

# %% [markdown]
# ## 4. The kernel
#
# `kernels/tensor_core_backward.py`. Its module docstring is the algorithm, in the notation
# above (w: the warp's 16 keys; c: a chunk of 16 queries; i: a query tile of Br rows):

# %%
print(tcb.__doc__)


# %% [markdown]
# The tiles: a block of W warps owns Bc = 16 W keys; the query tiles have Br rows, staged
# with `cp.async` into two buffers so that the next tile's Q_i and dO_i fly while the warps
# work on this one. On the H100 (the numbers behind the choice are in the docstring):

# %%
print(inspect.getdoc(tc_backward_tiles))
print()
for d_gpu, (br, w) in ((64, (128, 8)), (128, (64, 8))):
    print(f"d = {d_gpu}: Br = {br}, W = {w} (Bc = {16 * w} keys), "
          f"{2 * shared_halves(br, w, d_gpu) / 1024:.0f} KiB of shared memory a block (dynamic: above 48 KiB)")
print("here:", tc_backward_tiles(D_HEAD))


# %% [markdown]
# The steps of the query loop, from the kernel's source. A step takes two chunks of 16
# queries (`CC = 2`): each S^T and dP^T accumulator tile is a chain of D/16 products, each
# waiting for the one before it, and with two chunks a warp has 8 independent chains in
# flight instead of 4 (measured on an H200: 5-6% at d = 128, 1% at d = 64). First S^T and
# dP^T; K_w's and V_w's A fragments were loaded once a block, before the walk over the query
# tiles (at d = 128 they would take a thread past 255 registers, so there they are read from
# shared memory each time):

# %%
def show_step(fn, first, stop):
    """Print ``fn``'s source from the line containing ``first`` up to the line containing
    ``stop`` (not included)."""
    lines = inspect.getsource(fn).splitlines()
    i = next(n for n, line in enumerate(lines) if first in line)
    j = next(n for n, line in enumerate(lines[i + 1:], i + 1) if stop in line)
    print("\n".join(lines[i:j]))


show_step(make_backward_tc, "# ---- S^T = K_w Q_c^T", "# ---- P^T and dS^T")

# %% [markdown]
# P^T and dS^T on the accumulator elements, in base 2 (`exp2`, L already multiplied by
# log2 e by the pre-pass), with the mask applied only on steps that cross the end of the
# keys or the causal diagonal:

# %%
show_step(make_backward_tc, "# ---- P^T and dS^T", "# ---- dV_w += P^T dO_c")

# %% [markdown]
# The section 3 idea, in code: `ap` and `ad` are P^T's and dS^T's two accumulator tiles
# packed pairwise into 4 registers each, and they go straight into the mma as A:

# %%
show_step(make_backward_tc, "# ---- dV_w += P^T dO_c", "# ---- dS^T to shared memory")

# %% [markdown]
# Then dS^T to shared memory (the same packed registers, a 32-bit word each), and, once the
# block has all its query tile's chunks, dQ_i += τ dS K_j by the warps together, and the
# atomic adds (`add_tiles`, from `kernels.base.gradient_adds.make_tile_adds`: where the
# warp's 16 rows lie below Nq and its columns below d, one test for the warp sends every
# pair straight to `red.global.add.v2.f32` with unsigned indices; elsewhere each pair is
# checked):

# %%
show_step(make_backward_tc, "# ---- dS^T to shared memory", "# ---- dK_j = scale dK_w")

# %% [markdown]
# ## 5. Precision, and the check against the oracle
#
# The accumulators are fp32, but P^T and dS^T are **rounded to the input type** (fp16:
# a relative error up to $2^{-11}$; bf16: $2^{-8}$) when they are packed as A operands, as
# FlashAttention-2 does; dQ reads the same rounded dS from shared memory. So the kernel
# cannot be as accurate as a float32 backward, and the tests do not ask it to be: their
# yardstick is `rounded_backward_numpy`, a float32 NumPy backward that rounds P and dS to
# the input type before the products that use them, exactly where the kernel does. Each
# gradient must be within 2x the yardstick's error of the float64 oracle, plus chapter 5's
# gradient floors (`tests/test_tensor_core_backward.py`).
#
# A small case with a causal mask and GQA (two query heads on one KV head), in fp16 and
# bf16 (NumPy has no bf16: the kernel takes its bit patterns as uint16 with `bf16=True`;
# PyTorch bf16 tensors are taken as they are). The oracle and the yardstick see the inputs
# as rounded to the 16-bit type:

# %%
from kernels.base.testing import Floor, assert_close, gradient_floor_scales


def to_16bit(x, bf16):
    """(the kernel's input, its values in float64): fp16, or bf16 bit patterns as uint16."""
    if bf16:
        bits = tc.bf16_bits(x).astype(np.uint16)
        return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    h = np.asarray(x, np.float32).astype(np.float16)
    return h, h.astype(np.float64)


def over_group(x, hkv):
    """(B, H, Nk, d) per query head -> (B, Hkv, Nk, d): the sum over each group of heads."""
    b, h, n, d = x.shape
    return x.reshape(b, hkv, h // hkv, n, d).sum(axis=2)


group = H // HKV
rng = np.random.default_rng(1200)
raw = [rng.standard_normal(shape) for shape in ((B, H, NQ, D_HEAD), (B, HKV, NK, D_HEAD), (B, HKV, NK, D_HEAD),
                                                 (B, H, NQ, D_HEAD))]
checked = {}
for bf16 in (False, True):
    kind = "bf16" if bf16 else "fp16"
    (q, qx), (k, kx), (v, vx), (do, dox) = (to_16bit(x, bf16) for x in raw)
    kr, vr = (np.repeat(x, group, axis=1) for x in (kx, vx))      # K, V as each query head sees them
    o64, lse64 = ref.attention(qx, kr, vr, causal=True)
    o, lse = o64.astype(np.float32), lse64.astype(np.float32)      # what a forward hands the backward
    got = flash_attention_backward_tc(q, k, v, o, lse, do, causal=True, bf16=bf16)
    dq, dk_heads, dv_heads = ref.attention_backward(qx, kr, vr, o, lse, dox, causal=True)
    exact = (dq, over_group(dk_heads, HKV), over_group(dv_heads, HKV))
    yard = rounded_backward_numpy(qx, kx, vx, o, lse, dox, causal=True, bf16=bf16)
    fq, fk, fv = gradient_floor_scales(qx, kr, vr, o, lse, dox, causal=True)
    floors = (fq, Floor(over_group(fk.value, HKV), fk.why), Floor(over_group(fv.value, HKV), fv.why))
    checked[kind] = (got, exact, dk_heads, dv_heads)
    for name, g, e, y, f in zip(("dQ", "dK", "dV"), got, exact, yard, floors):
        err, yard_err = np.abs(g - e).max(), np.abs(y - e).max()
        assert_close(g, e, y, name=f"{name} ({kind})", floor_scale=f)       # the tests' rule
        print(f"{kind} {name}: max |kernel - oracle| = {err:.2e}, the yardstick's {yard_err:.2e} "
              f"({err / yard_err:.2f}x), max |{name}| = {np.abs(e).max():.2f}")

# %% [markdown]
# The kernel's error is the yardstick's, to within rounding: what it loses, it loses by
# rounding P and dS, as intended (exercise 6 asks how bf16 compares with fp16). In the
# simulator its `mma` adds exactly and rounds once, so the two agree almost to the bit; on
# the H100 the tensor core's own additions differ a little (the bench reports the ratio for
# every configuration it runs: section 7).
#
# The property tests draw shapes, scales and logit spreads (ragged Nq != Nk, N = 0, d not a
# multiple of 8, GQA groups of 1 and 2) and pin the awkward cases: N = 1, rows that see no
# key, large logits, one past a query tile and a key tile.
#
# ## 6. Grouped-query attention
#
# With GQA, H query heads share Hkv < H KV heads: query head h reads KV head h // (H / Hkv).
# K and V are used by every head of the group, so their gradients are sums over the group:
# $dK = \sum_{h \in \text{group}} \tau\, dS_h^\top Q_h$, and the same for dV. The kernel does
# the sum where it is free. Its grid has one block a key tile and **KV** head, and the block
# walks over the (query head, query tile) pairs of the whole group: dK_w and dV_w keep
# accumulating in the same registers, and K_j, V_j are staged once for the group instead of
# once a head. dQ needs no change: each query head's rows get their own adds.
#
# In the check above (H = 2 query heads on 1 KV head), the per-head gradients of dK and
# their sum:

# %%
got, exact, dk_heads, dv_heads = checked["fp16"]
for h in range(H if H <= 4 else 2):
    print(f"query head {h} (KV head {h // group}): max |dK_h| = {np.abs(dk_heads[:, h]).max():.3f}")
print(f"max |kernel dK - sum over the group| = {np.abs(got[1] - exact[1]).max():.1e}, "
      f"max |kernel dK - head 0's alone| = {np.abs(got[1][:, 0] - dk_heads[:, 0]).max():.2f}")

# %% [markdown]
# ## 7. Results on the GPU
#
# `python -m kernels --chapters 12` (`kernels/bench/tensor_core_backward.py`): H = 16,
# d = 64 and 128, B N = 16k tokens, N from 1024 to 16384, fp16, causal and not; at N = 4096
# bf16 too, and chapter 5's fp32 backward on the FMA units. O and L come from chapter 8's
# forward on the same inputs. "Bare" is the D pre-pass and the kernel on preallocated
# buffers; the launcher row is `flash_attention_backward_tc` called as a user calls it (it
# checks its arguments and allocates the gradients). The peers run the backward alone
# (`torch.autograd.grad` after one forward outside the timed region): SDPA's flash,
# memory-efficient and cuDNN backends and plain PyTorch. FLOPs are the five products,
# 10 B H N² d (halved for causal), for every row. The committed run is on an NVIDIA H200
# (the H100's chip with 1.4x its memory bandwidth; the chapter's earlier runs were on an
# H100): the cell prints the device.

# %%
from kernels.bench.harness import committed_results


def row_label(r):
    """A short name for a row of the bench."""
    kernel = r["kernel"]
    if r["is_peer"]:
        return kernel.removeprefix("peer: ").removesuffix(" bwd")
    if "(bare)" in kernel:
        return "ours, bare"
    if kernel.startswith("flash_attention_backward_tc("):
        return "ours, launcher"
    if "chapter 5" in kernel:
        return "chapter 5 (fp32, FMA units)"
    return kernel


def row_extra(r):
    """The row's ``extra`` column as a dict of strings (N, B, H, d, causal, dtype, errors)."""
    return dict(item.split("=", 1) for item in (r.get("extra") or "").split(";") if "=" in item)


env, rows = committed_results("tensor_core_backward", chapter=12)
for r in rows:
    r["label"], r["x"] = row_label(r), row_extra(r)
if rows:
    print("device:", env.get("device"), "| driver:", env.get("driver"), "| date:", env.get("date (UTC)"))
    ns = sorted({int(r["x"]["N"]) for r in rows if "N" in r["x"]})
    n_ref = 4096 if 4096 in ns else ns[len(ns) // 2]
    order = ["ours, bare", "ours, launcher", "SDPA flash", "SDPA memory-efficient", "SDPA cuDNN", "plain PyTorch",
             "chapter 5 (fp32, FMA units)"]
    for d_ in sorted({r["x"].get("d") for r in rows}, key=int):
        for kind in ("fp16", "bf16"):
            these = [r for r in rows if r["x"].get("d") == d_ and r["x"].get("dtype") == kind
                     and r["x"].get("N") == str(n_ref)]
            if not these:
                continue
            print(f"\nN = {n_ref}, d = {d_}, {kind}, B = {these[0]['x'].get('B')}, H = {these[0]['x'].get('H')}")
            print(f"  {'':<42s}{'not causal':>22s}{'causal':>22s}")
            labels = sorted({r["label"] for r in these}, key=lambda s: order.index(s) if s in order else len(order))
            for label in labels:
                cells = []
                for causal in ("False", "True"):
                    r = next((r for r in these if r["label"] == label and r["x"].get("causal") == causal), None)
                    cells.append(f"{r['median_ms']:8.2f} ms {r['tflops']:6.1f} TF/s" if r else f"{'-':>22s}")
                print(f"  {label:<42s}" + "".join(f"{c:>22s}" for c in cells))
            for causal in ("False", "True"):
                ms = {r["label"]: r["median_ms"] for r in these if r["x"].get("causal") == causal}
                bare = next((r for r in these if r["label"] == "ours, bare" and r["x"].get("causal") == causal), None)
                ratios = [f"{ms[p] / ms['ours, bare']:.2f}x {p}'s" for p in order[2:6] if p in ms and "ours, bare" in ms]
                if ratios:
                    print(f"  causal={causal}: the speed of ours (bare) is " + ", ".join(ratios))
                if bare is not None and "dq_error_vs_rounded" in bare["x"]:
                    print(f"  causal={causal}: error against float64, over the yardstick's: " + ", ".join(
                        f"{g} {float(bare['x'][g.lower() + '_error_vs_rounded']):.2f}x" for g in ("dQ", "dK", "dV")))

# %%
if rows:
    peers = ("ours, bare", "SDPA flash", "SDPA memory-efficient", "SDPA cuDNN", "plain PyTorch")
    dims = sorted({r["x"].get("d") for r in rows}, key=int)
    fig, axes = plt.subplots(1, len(dims), figsize=(6 * len(dims), 4.2), sharey=True, squeeze=False)
    for ax, d_ in zip(axes[0], dims):
        for colour, label in enumerate(peers):
            for causal, style in (("False", "-"), ("True", "--")):
                pts = sorted((int(r["x"]["N"]), r["tflops"]) for r in rows
                             if r["label"] == label and r["x"].get("d") == d_ and r["x"].get("dtype") == "fp16"
                             and r["x"].get("causal") == causal)
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", color=f"C{colour}",
                            label=label + (", causal" if causal == "True" else ""))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N (B N = 16k tokens)")
        ax.set_title(f"backward, fp16, d = {d_}")
    axes[0][0].set_ylabel("TFLOP/s (10 B H N² d, halved if causal)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# ### Where the time goes, and what is left
#
# At N = 4096 the kernel runs at 0.77x to 0.93x of SDPA flash's backward (FlashAttention-2)
# and beats SDPA memory-efficient; cuDNN's backward (Hopper's wgmma, not mma.sync) is 1.5x
# to 2.4x faster than ours. On the H200 plain PyTorch's fp16 backward, bound by memory, is
# level with ours at d = 128 without the mask (its time over ours: 0.94 to 1.08).
# Nsight Compute on an earlier version of the kernel
# (`workbook/results/tensor_core_backward_ncu.txt`, H100, d = 64, at 5.0-5.3 ms) says
# why:
#
# - **Few warps.** dK and dV of a warp's 16 keys stay in its registers for the whole run
#   (D/2 floats each a lane) and the thread needs about 200 registers: one block of 8 warps
#   an SM, 2 warps a scheduler. A scheduler issued in 49% of cycles; the most common stall
#   waits on the previous instruction's fixed latency, which more warps would hide.
# - **Too many instructions a product.** 2.07 G instructions for 168 M `mma`s: about 12
#   each, where the products and their `ldmatrix`es alone need 2. Most were 64-bit index
#   arithmetic that Numba emits for every array index (signed, with a wraparound for
#   negative indices) and its `range()` loop control. Three changes, each measured, took
#   d = 64 from 5.1 ms to 4.2 ms: views of each chunk's rows, `while` loops on unsigned
#   counters, and `ldmatrix` at 32-bit shared addresses made once a lane
#   (`kernels.base.mma.shared_address`, `ldmatrix_at`), which also freed 11 registers at
#   d = 64 and the spill at d = 128.
# - **dQ's adds, and the walk.** Read in the compiled code (ptxas for sm_90, no GPU needed),
#   the 8 atomic adds of a warp's piece of dQ_i took about 250 instructions (bounds tests and
#   64-bit index arithmetic a pair), more than the 32 products that made them; with one
#   test a warp and unsigned indices they take about 45. With the two chunks a step, on an
#   H200, old against new: 4.22 to 3.92 ms at d = 64, 9.06 to 8.15 ms at d = 128. The
#   walk's (head, query tile) in 32-bit arithmetic (`pair_at`: Python's `//` on int64 is a
#   call to a 64-bit signed division) took another 1-4%
#   (`workbook/results/tensor_core_backward_ab.csv`).
# - **The staging of each query tile.** Q_i's and dO_i's copies (`kernels.base.tile_copy`)
#   took about 50 instructions for each 16-byte `cp.async` (a bounds test and 64-bit index
#   arithmetic a chunk), 8 a thread a tile at d = 64: about 400 instructions against about
#   1,600 for the tile's products. Where a block's threads are a multiple of a row's chunks,
#   a thread's chunks lie in one column, a fixed number of rows apart: the copy makes its
#   two addresses once (`global_address`, `shared_address`) and adds a constant a chunk, and
#   the chunks past the rows or past d copy 0 bytes, which `cp.async` fills with zeros
#   (`cp_async_at`, its source size): no test a chunk. With one barrier a step where two
#   were (wait for the pair's copies, then one `syncthreads` says both that they landed and
#   that the other buffer and dS are free), old against new on the H200: 3.89 to 3.31 ms at
#   d = 64, 8.30 to 6.79 ms at d = 128 (causal 2.19 to 1.94 and 4.39 to 3.78), 0.73x-0.88x
#   of SDPA flash's backward in the same processes (`tensor_core_backward_ab.csv`, run r5).
# - **Waiting at the start of a step.** Nsight Compute's source counters say where each
#   warp waits, instruction by instruction; `python -m kernels.bench.ncu_source` sums them
#   by the kernel's loops (`workbook/results/tensor_core_backward_ncu_h200.txt`, d = 128,
#   H200, and the cell below): the query loop
#   held 80% of the products and 48% of the stall samples, dQ's loop 20% and 23%, and the
#   rest of a step, with no products at all, 25%. There, 6.6% were warps waiting at a
#   barrier: the first two warps loaded the tile's L and D from global memory, waited for
#   them, and reached the barrier after dS^T late; and 5.4% were the walk's two 32-bit
#   divisions a pair, which all eight warps compute at once right after the step's barrier,
#   so no warp has other work to hide their chain. Now L and D go by `cp.async` with Q_i
#   and dO_i (`make_async_word_copy`: 4 bytes each, zeros past Nq) and the next pair is the
#   current one plus a comparison (`next_pair`): 3.31 to 3.22 ms at d = 64, 6.88 to 6.57 at
#   d = 128 (run r6).
# - **A loop the compiler kept.** The profile's top instruction (below, 0x0c360) was the
#   first product of each k-step of S^T and dP^T, waiting for that k-step's `ldmatrix`: at
#   D = 128 the compiler left the `range()` loop rolled, so no load could run ahead of the
#   products before it. Written as a `while` loop on an unsigned counter it is unrolled
#   whole (250 registers, no spills): 1-5% at d = 128 in the mean of three runs each (runs
#   r7, r8), about the size of the noise between one process and the next. The table and
#   plot above are this kernel.
# - **The launcher** binds its two launches once a call shape (chapter 7's
#   `LaunchTemplate`) and passes data pointers: about 0.3 ms of Python a call, hidden
#   behind the GPU's work; before, Numba's typing of a dozen arguments cost 0.9 ms.
#
# What would help next: the query loop itself (3.8 instructions an mma, its stalls the
# products' own latency and the `ldmatrix` results'), and, beyond `mma.sync`, Hopper's
# `wgmma` with the operands in shared memory, as cuDNN and FlashAttention-3 do. More warps
# by smaller blocks did not help: two blocks of 4 warps an SM measured 4-14% slower than
# one of 8 (`python -m kernels.bench.tensor_core_backward --tiles`,
# `workbook/results/TUNING.md`).

# %% [markdown]
# The profile itself, summed by loop from the page Nsight Compute recorded (no GPU needed to
# read it): each loop's share of the instructions, the mmas and the stall samples, and the
# instructions the warps were most often found waiting at. `short_sb` waits for a shared-memory
# result (`ldmatrix`), `wait` for an arithmetic one, `barrier` at a `syncthreads`, `long_sb` for
# global memory. At the top, 0x0c360: the first product of each k-step, waiting for its
# `ldmatrix`es (the k-step loop, 0x0c230, was still a loop at d = 128 when this page was
# recorded; it is unrolled now).

# %%
from pathlib import Path

from kernels.bench import ncu_source

recorded = Path(ncu_source.__file__).resolve().parents[2] / "tests" / "ncu_recorded" / \
    "source_backward_tc_d128_h200.csv.gz"
print(ncu_source.summarize(ncu_source.read_source_csv(recorded), top=6))

# %% [markdown]
# You can read the compiled code yourself, with no GPU: `kernels.base.sass` compiles a
# chapter's kernels to PTX, assembles them for sm_90 with the driver's own assembler (in
# nvJitLink, which comes with PyTorch's CUDA libraries) and disassembles them (nvdisasm,
# which comes with PyTorch's Triton). It prints ptxas's registers and spills, the instructions, the
# tensor-core instructions (HMMA) and the calls to a 64-bit division, and each loop's
# instructions an mma. The code is counted, not run: a loop's body once, both sides of its
# branches (dQ's loop holds the checked adds too, which run only at the edges of Nq and d).

# %%
import os
import subprocess
import sys

env = dict(os.environ, WORKBOOK_DEVICE="gpu")             # compile for the GPU even in the simulator
env.pop("NUMBA_ENABLE_CUDASIM", None)
sass_report = subprocess.run([sys.executable, "-m", "kernels.base.sass", "tensor_core_backward", "fp16 Br=128"],
                             env=env, capture_output=True, text=True, timeout=600)
print(sass_report.stdout or sass_report.stderr[-2000:])

# %% [markdown]
# ## 8. Exercises
#
# 1. (On paper.) Why do dK and dV need no shared memory, while dQ does? Say which warp holds
#    dS[i, j] for a key j of warp w, and which warps contribute to dQ[i, :]. What would
#    change if a warp owned 16 *queries* instead of 16 keys (chapter 8's forward)?
# 2. (On paper.) Causal masking. A block of key tile j (keys k0 .. k0 + Bc - 1) skips the
#    query tiles before `first = max(k0 - (Nk - Nq), 0) // Br`. Why is that right, and which
#    chunks of the tiles it does walk still need the mask? The grid launches the key tiles
#    in order, the first ones first: why is that the better order under a causal mask?
# 3. (Checked below.) Count the additions into dQ that each block makes.
# 4. (Checked below.) The addresses for `ldmatrix.trans` that read dS's A fragment from the
#    stored dS^T.
# 5. (On paper.) Chapter 5 offers a deterministic dQ: a second kernel, query tiles outer,
#    which recomputes what it needs. How many of the products of section 1 does it repeat,
#    and what is the backward's FLOP count then, against the forward's? When would you pay it?
# 6. (With section 5's numbers.) Predict the ratio of the bf16 errors to the fp16 errors
#    from the rounding of P and dS alone, and compare with what the check printed.
#
# ### Exercise 3: the atomic adds
#
# Write `my_dq_adds(n_q, n_k, d, group, causal, Br, Bc)`: for one KV head (B = 1) with
# `group` query heads, the number of float32 values each block adds into dQ, as a list
# (block j = key tile j: keys j Bc .. j Bc + Bc - 1). The cell below runs the kernel in the
# simulator traced (`kernels.base.trace`: every write of every thread into every array,
# counted) on a causal case with two query tiles and two key tiles, and compares; call
# `traced_dq_adds` on other cases (a GQA group, Nq != Nk, d not a multiple of 8) to test
# the rest of your formula.
#
# <details><summary>Hint 1</summary>
#
# A block adds its piece of dQ_i once per (query head, query tile) pair it walks, after all
# the tile's chunks, for every column of d. Does it add the rows past Nq? The rows whose
# scores are all masked?
# </details>
#
# <details><summary>Hint 2</summary>
#
# Without the mask, every block walks every query tile. With it, exercise 2's `first`.
# </details>

# %%
def my_dq_adds(n_q, n_k, d, group, causal, Br, Bc):
    return None          # your code: a list, one count a block


# %%
from kernels.base.trace import tracing

# One case (a traced launch takes seconds in the simulator); try your own with traced_dq_adds(...).
DQ_CASES = [dict(n_q=40, n_k=40, d=16, group=1, causal=True)]


def traced_dq_adds(n_q, n_k, d, group, causal):
    """The writes into dQ of each block of the kernel, counted by a traced run in the simulator."""
    rng = np.random.default_rng(3)
    q, do = (rng.standard_normal((1, group, n_q, d)).astype(np.float16) for _ in range(2))
    k, v = (rng.standard_normal((1, 1, n_k, d)).astype(np.float16) for _ in range(2))
    kr, vr = (np.repeat(x, group, axis=1).astype(np.float64) for x in (k, v))
    o, lse = ref.attention(q.astype(np.float64), kr, vr, causal=causal)
    with tracing() as launches:
        flash_attention_backward_tc(q, k, v, o.astype(np.float32), lse.astype(np.float32), do, causal=causal)
    launch = next(t for t in launches if t.kernel == "backward_tc")
    per_block = {}
    for (block, _), counts in launch["dq"].by_thread.items():
        j = block if isinstance(block, int) else block[0]       # the key tile (grid x)
        per_block[j] = per_block.get(j, 0) + counts.writes
    return [per_block.get(j, 0) for j in range(launch.grid_dim[0])]


if on_simulator():
    for case in DQ_CASES:
        Br, W, _ = tc_backward_tiles(case["d"])
        traced = traced_dq_adds(**case)
        yours = my_dq_adds(**case, Br=Br, Bc=16 * W)
        verdict = "not written yet" if yours is None else ("right" if list(yours) == traced else "wrong")
        print(f"{case}, Br={Br}, Bc={16 * W}: traced {traced}, yours {yours}: {verdict}")
else:
    print("the traced run needs the simulator's mma emulation: run this notebook with WORKBOOK_DEVICE=sim")

# %% [markdown]
# ### Exercise 4: dS's A fragment from dS^T, by `ldmatrix.trans`
#
# dQ_i += τ dS K_j needs dS (16 queries x 16 keys, one k-step) as an A fragment, but shared
# memory holds dS^T (keys x queries, row-major). `ldmatrix.x4.trans` loads four 8 x 8
# matrices: lane 8 m + r gives the address of row r of matrix m (8 consecutive 16-bit
# values), and lane L receives, as its element i (`tc.ldmatrix_position(L, i)` = (m, r, c)),
# the element at row c, column r of matrix m (rows and columns swapped: `.trans`).
#
# Write `my_ds_address(lane)`: the (row, column) in a 16 x 16 block of the stored dS^T where
# the 8 values that `lane` points at start. The checker emulates the load for every lane and
# compares what each lane receives with the A fragment of dS (`tc.a_position`).
#
# <details><summary>Hint 1</summary>
#
# A's element i of lane L is dS[a_position(L, i)] = dS^T[col, row]. Elements 0, 1 are the
# top-left 8 x 8 quarter of A, then bottom-left, top-right, bottom-right: that is the order
# of the four matrices m = 0 .. 3 (register m holds elements 2m, 2m + 1).
# </details>
#
# <details><summary>Hint 2</summary>
#
# The bottom-left quarter of dS (queries 8-15, keys 0-7) is, in dS^T, keys 0-7 (rows) and
# queries 8-15 (columns): the rows of matrix 1 start at column 8 of dS^T, not at row 8.
# </details>

# %%
def my_ds_address(lane):
    return 0, 0          # your code: (row, column) in the stored dS^T


# %%
def check_ds_address(address, quiet=False):
    """Emulate ldmatrix.x4.trans of a 16 x 16 block of dS^T from the lanes' addresses; True
    when every lane receives its A fragment of dS, else print the first wrong element."""
    dst = np.arange(256).reshape(16, 16)                 # dS^T: keys x queries, distinct values
    ds = dst.T
    for lane in range(32):
        for i in range(8):
            m, r, c = tc.ldmatrix_position(lane, i)
            row, col = address(8 * m + c)                # .trans: lane receives column r of row c
            got = dst[row, col + r] if 0 <= row < 16 and 0 <= col + r < 16 else None
            want = ds[tc.a_position(lane, i)]
            if got != want:
                if not quiet:
                    where = "outside the block" if got is None else f"dS^T[{got // 16}, {got % 16}]"
                    print(f"wrong: lane {lane}'s element {i} should be dS{tc.a_position(lane, i)} = "
                          f"dS^T[{want // 16}, {want % 16}], it receives {where} "
                          f"(from lane {8 * m + c}'s address {address(8 * m + c)})")
                return False
    if not quiet:
        print("right: every lane receives its A fragment of dS")
    return True


ds_passed = check_ds_address(my_ds_address)

# %% [markdown]
# The checker bites: two near misses fail it, the address pattern of an A fragment read
# without `.trans` (what the kernel uses for K_w) and the rows and columns swapped.

# %%
assert not check_ds_address(lambda lane: ((lane // 8) % 2 * 8 + lane % 8, (lane // 16) * 8), quiet=True)
assert not check_ds_address(lambda lane: ((lane // 8) % 2 * 8, (lane // 16) * 8 + lane % 8), quiet=True)
print("both near misses are caught")

# %% [markdown]
# The course's answer, `br` and `bc` in `make_backward_tc` (lane L's address is row `br`,
# column `bc` of the 16 x 16 block of dS^T that holds dS's k-step), prints here once yours
# passes.

# %%
if ds_passed:
    show_step(make_backward_tc, "br = (lane // 16)", "kw = warp * 16")
else:
    print("(shown once your function passes; stuck? read br and bc in make_backward_tc)")
