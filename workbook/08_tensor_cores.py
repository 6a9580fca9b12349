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
# # 8. Tensor cores: the FlashAttention-2 forward on mma.sync
#
# Chapters 1 to 6 ran every product on the fp32 FMA units, whose ceiling on the H100 is the
# 51 TFLOP/s cuBLAS reaches with TF32 off (chapter 0). With fp16 inputs, what people use
# (PyTorch's SDPA flash, cuDNN) runs on the **tensor cores**, several times faster. Numba
# has no tensor-core API; `kernels/base/mma.py` reaches the instruction, `mma.sync`,
# through a small `@intrinsic` that emits it as inline PTX, and emulates it in the
# simulator (chapter 2's rung 4 and chapter 7's grouped decode already use it). This
# chapter moves chapter 4's forward onto it:
#
# 1. the fragments: which lane holds which element of a 16 x 16 by 16 x 8 product;
# 2. the kernel: S by mma, the online softmax on the accumulator fragments, P repacked in
#    registers and fed to P V's mma;
# 3. the check against the oracle, in fp16 and bf16;
# 4. the H100 results against SDPA flash, cuDNN and chapter 4's kernel;
# 5. exercises, two of them kernels: Q's fragments by the mapping, and P's repacking, both
#    inside this chapter's production kernel.
#
# **Sources** (numbered as in the README's list): [4] FlashAttention-2, Algorithm 1 and
# Section 3.3 (a warp's rows; P kept in registers); [14] the PTX ISA, "Matrix Fragments
# for mma.m16n8k16" and "ldmatrix"; [6] FlashAttention-3 (wgmma, the instruction cuDNN
# uses).

# %%
import inspect

import matplotlib.pyplot as plt
import numpy as np

import kernels  # noqa: F401  (GPU or simulator, chosen before Numba is imported)
from kernels import reference as ref
from kernels.base import mma as tc
from kernels.base.notebook import show_source
from kernels.base.runtime import device_name, on_simulator
from kernels.flash_tensor_cores import flash_attention_tc, make_flash_forward_mma_from, tc_tiles

print("running on:", device_name())

# %% tags=["parameters"]
# Tiny sizes in the simulator (every GPU thread is a Python thread there), real ones on a GPU.
if on_simulator():
    B, H, NQ, NK, D_HEAD = 1, 1, 17, 20, 24
else:
    B, H, NQ, NK, D_HEAD = 2, 8, 1000, 1100, 64

# %% [markdown]
# ## 1. Fragments
#
# `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32` computes D = A B + C for A 16 x 16
# (fp16 or bf16), B 16 x 8 and C, D 16 x 8 in fp32: 4096 FLOPs in one instruction of a
# warp. No lane holds a whole operand; each holds a **fragment**, at positions the PTX ISA
# fixes. Drawn from the module's own position table (the one its emulation and tests use):

# %%
from kernels.base.notebook import draw_fragments

draw_fragments()
plt.show()

# %% [markdown]
# Two facts the kernel is built on:
#
# * Lanes 4g .. 4g + 3 (a **quad**) hold rows g and g + 8 of an accumulator tile. A row's
#   maximum over a tile is a max over the 4 lanes of a quad: two warp shuffles.
# * Two neighbouring accumulator tiles (keys 0-7 and 8-15) hold exactly the elements an
#   A fragment of 16 x 16 needs, in the same lanes: c[0, 1] of the first tile are a[0, 1],
#   c[2, 3] are a[2, 3], the second tile's are a[4..7]. So P, computed in the accumulators
#   of S, becomes P V's A operand by a conversion to fp16 in registers: no shared memory.

# %%
for lane in (0, 5, 31):
    from_c = [tc.c_position(lane, i) for i in range(4)] + [(r, c + 8) for r, c in
                                                           (tc.c_position(lane, i) for i in range(4))]
    from_a = [tc.a_position(lane, i) for i in (0, 1, 2, 3, 4, 5, 6, 7)]
    print(f"lane {lane:2d}: S tiles' (row, key) {from_c}")
    print(f"         P V's A fragment wants  {from_a}")
    assert from_c == from_a

# %% [markdown]
# ## 2. The kernel
#
# Chapter 4's loop order (the query tile outer, K/V tiles inner) with a **warp** as the
# unit: each warp owns 16 query rows, a block 128 rows (8 warps) on a GPU. The block
# stages each K/V tile of 64 keys in shared memory with `cp.async`, ahead of its use: K_j
# is copied while the warps compute P V_{j-1}, V_j while they compute S_j, so the copies
# hide behind the mma (one buffer each for K and V, three barriers a tile). Each warp then:
#
# | step | how |
# |---|---|
# | Q_i | staged once; each warp loads its A fragments (`load_a_fragment`: one `ldmatrix`; exercise 4) and keeps them in registers |
# | S = Q_i K_jᵀ | 8 accumulator tiles of 16 x 8 (64 keys), D/16 mma each; K's B fragments by `ldmatrix` (K is row-major, so Kᵀ is "col" as mma wants) |
# | m', P, l | on the fragments: scale to base 2, mask (only a tile that crosses the end of K or the warp's diagonal), row max over the quad, `P = 2^(S - m')` |
# | O += P V_j | P packed to fp16 (or bf16) in registers as above (`p_to_a`, exercise 5); V's B fragments by `ldmatrix.trans` |
# | end | the quad adds its 4 partial row sums; O / l and L = m + log l |
#
# The pieces, from `kernels/flash_tensor_cores.py`: the copies first (the V_j copy starts,
# then the wait for K_j; after the softmax the wait for V_j and the K_{j+1} copy), then the
# products. The steps between the two products (scale and mask, the online softmax, and at
# the end O / l) live in `kernels/base/fragment_softmax.py`, shared with chapter 11's fp32
# kernel, whose accumulator tiles have the same layout.

# %%
show_source(make_flash_forward_mma_from, "# ---- the copies overlap", "cp_async_wait_prior()", more=1)

# %%
show_source(make_flash_forward_mma_from, "# ---- S = Q_i K_j^T", "online_softmax(sc, acc, m, l)")

# %%
from kernels.base.fragment_softmax import make_fragment_softmax

show_source(make_fragment_softmax, "def online_softmax(sc, acc, m, l):", "sc[nt, 2 * h + e] = p")

# %%
show_source(make_flash_forward_mma_from, "# V_j has landed", "acc[2 * dt + 1, e] = c1[e]")

# %% [markdown]
# Precision: S and O accumulate in fp32; P is rounded to the input type before P V, as in
# FlashAttention-2 (fp16: a relative error of 2^-11 a weight, bf16: 2^-8). The tests hold
# the kernel to twice the error of a float32 reference that rounds P the same way.
#
# Grouped-query attention (k and v with Hkv heads, H a multiple of Hkv, as Llama-style models
# keep their KV cache small) costs the kernel one line: the block of query head row
# bh = b H + h reads KV row bh // (H / Hkv) = b Hkv + h // (H / Hkv), the same K and V tiles for
# every query head of a group, with no copy. The division is 32-bit and unsigned (Numba's
# `//` on int32 is a signed 64-bit division, a call of about a hundred instructions), once
# a block, and compiled in only where Hkv < H (`grouped=`), so the MHA kernel is unchanged:

# %%
show_source(make_flash_forward_mma_from, "kvh = bh", "qh, kh, vh = q[bh], k[kvh], v[kvh]")

# %%
rng_gqa = np.random.default_rng(80)
q_g = rng_gqa.standard_normal((1, 4, NQ, D_HEAD)).astype(np.float16)                            # 4 query heads
k_g, v_g = (rng_gqa.standard_normal((1, 2, NK, D_HEAD)).astype(np.float16) for _ in range(2))   # on 2 KV heads
o_g, _ = flash_attention_tc(q_g, k_g, v_g, causal=True)
exact_g, _ = ref.attention(q_g.astype(np.float64), *(np.repeat(x, 2, axis=1).astype(np.float64) for x in (k_g, v_g)),
                           causal=True)
print(f"GQA 4 query heads on 2 KV heads: max |O - oracle (K, V repeated)| = {np.abs(o_g - exact_g).max():.1e}")

# %% [markdown]
# On the GPU (`workbook/results/flash_tensor_cores_gqa.csv`, an H200: 16 query heads on 4 KV
# heads, B = 4, N = 4096, d = 64) reading K and V in place is level with repeating them first
# (1.49 against 1.48 ms in fp16) and a little faster with the causal mask (1.03 against 1.12):
# the copy is cheap next to attention. What it saves is memory: the repeated K and V, 2 B H Nk d
# elements a call, are never made.

# %% [markdown]
# ## 3. Check against the oracle
#
# The oracle runs on the inputs as rounded to fp16 (or bf16: NumPy has no bf16, so the
# kernel takes its bit patterns as uint16 with `bf16=True`; PyTorch bf16 tensors are taken
# as they are, with `bf16=True`).

# %%
rng = np.random.default_rng(8)
q, k, v = (rng.standard_normal((B, H, n, D_HEAD)).astype(np.float16) for n in (NQ, NK, NK))
print("tiles (Br, Bc, D):", tc_tiles(D_HEAD))
for causal in (False, True):
    o, lse = flash_attention_tc(q, k, v, causal=causal)
    exact, exact_l = ref.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=causal)
    seen = np.isfinite(exact_l)
    print(f"fp16 causal={causal}: max |O - oracle| = {np.abs(o - exact).max():.1e}, "
          f"max |L - oracle| = {np.abs(lse[seen] - exact_l[seen]).max():.1e}")

bits = [tc.bf16_bits(x.astype(np.float32)).astype(np.uint16) for x in (q, k, v)]
values = [(b_.astype(np.uint32) << 16).view(np.float32).astype(np.float64) for b_ in bits]
o, lse = flash_attention_tc(*bits, causal=True, bf16=True)
exact, _ = ref.attention(*values, causal=True)
print(f"bf16 causal=True: max |O - oracle| = {np.abs(o - exact).max():.1e}")

# %% [markdown]
# The property tests (`tests/test_flash_tensor_cores.py`) draw shapes (one or two query
# heads a KV head), scales and logit spreads, pin the awkward cases (N = 1, ragged tiles,
# rows that see no key, Nq = 0, Nk = 0, large logits, three query heads a KV head), and
# compare O and L with the tolerance rule; planted bugs (O not rescaled, P's two tiles
# swapped, the causal diagonal shifted, L in base 2, KV heads interleaved) fail them
# (`tests/mutants.py`).
#
# ## 4. Results on the H100
#
# `python -m kernels --chapters 8`: N from 512 to 16384 at B N = 16k tokens, H = 16,
# d = 64 and 128, fp16, causal and not, against SDPA flash and cuDNN at every N; at N = 4096
# (B = 4) also bf16, SDPA memory-efficient, FlexAttention (`torch.compile`) and chapter 4's
# kernel. First the bench measures the **mma.sync ceiling**: a loop of independent
# m16n8k16 per warp, registers only (`kernels/bench/mma_ceiling.py`); every row says what
# share of it it reaches. Peers in the same run on the same inputs.

# %%
from kernels.bench.harness import show_results

rows_ = show_results("flash_tensor_cores", ("kernel", "config", "median_ms", "tflops"))

# %% [markdown]
# In the committed run (2026-11-25, H100, bare launches, N = 4096): fp16 **162 TFLOP/s at
# d = 64 and 170 at d = 128**, 26% and 28% of the mma.sync ceiling (612 TFLOP/s);
# **5.2x and 6.1x chapter 4's fp32 FMA kernel** on the same fp16 inputs (31.1 and 27.8);
# **0.55x and 0.49x SDPA flash** (292 and 348, 48% and 57% of the ceiling); a little faster
# than SDPA memory-efficient (129 and 164); FlexAttention 346 and 445; cuDNN 446 and 579
# (it uses Hopper's `wgmma`, which `mma.sync` cannot reach). bf16: 159 and 171 (0.54x and
# 0.51x SDPA flash, 295 and 338). The error against float64 is 0.87x to 1.25x that of a
# float32 reference that rounds P to the input type as the kernel does (the tests' yardstick;
# `note` column). Causal masking saves 1.62x (d = 64) and 1.69x (d = 128) of the time, short
# of the 2x the FLOPs allow (the diagonal tiles are computed in full, then masked; SDPA flash
# saves 1.65x and 1.67x here). Against N, the ratio to SDPA flash grows with the sequence:
# at d = 128 0.41x at N = 512, 0.55x at N = 16384 (fewer, longer rows: the per-block start,
# loading Q and the final O / l, weigh less).
#
# How it got here (`workbook/results/TUNING.md`, each step measured): the copies moved
# ahead of their use (d = 128: 150 to 157 TFLOP/s), the mask only on crossing tiles (165),
# `max.f32` in place of a NaN-propagating compare for the row max (173), and at d = 64 a
# cap of 128 registers a thread so that two blocks of 8 warps share an SM (135 to 162).
#
# The launcher (`flash_attention_tc`) takes longer than the bare kernel: 2.23 ms against
# 1.70 at d = 64 given Numba device arrays (O and L allocated by `cudaMalloc` each call),
# 1.97 given PyTorch tensors (PyTorch's caching allocator); the rest is Python: checking
# the arguments, viewing the arrays, Numba's dispatch.
#
# Where the rest is: a warp's 16 rows re-read K and V fragments from shared memory for each
# 16 rows, where FlashAttention-2 gives a warp more rows (more mma per `ldmatrix`; with Q
# in registers that needs more than 255 registers at d = 128); the diagonal tiles run in
# full (a warp whose rows all precede a tile could skip it on a GPU, but the simulator's
# mma needs every thread of the block); and Hopper's `wgmma` (cuDNN, FlashAttention-3),
# which no `mma.sync` kernel reaches.
#
# ## 5. Exercises
#
# 1. (On paper.) At d = 128 a block of 8 warps computes 128 x 64 scores a tile: how many
#    mma is that for S, and for P V? How many bytes of K and V does it stage, and how many
#    FLOPs does each byte feed? Compare with chapter 4's Br = 128 FMA kernel.
# 2. Change `tc_tiles` to 64 rows at d = 128 and time it on a GPU
#    (`python -m kernels --chapters 8`): the tuning runs measured 131 against 174 TFLOP/s
#    (`workbook/results/TUNING.md`). At d = 64, 64 rows were faster until the kernel was
#    capped at 128 registers: why? (Count registers x threads against the SM's 65536.)
# 3. Why can the kernel write `P = exp2(S - m')` straight into S's registers, while
#    chapter 4's FMA kernel writes P to shared memory? (Hint: which thread holds P[r, j],
#    and which thread needs it for O[r, :] += P[r, j] V[j, :].)

# %% [markdown]
# ### Exercises 4 and 5 (kernels): who holds what
#
# The kernel has two steps where a lane must know exactly which elements it holds, and
# each is a hook you can fill: the kernel looks the two factories up in
# `kernels/flash_tensor_cores.py` when it is built, so yours run inside the production
# forward (the one timed in section 4). Write each in your own file (the cells below make
# them from templates the first time: `workbook/mine/my_tc_a_fragment.py` and
# `workbook/mine/my_tc_p_to_a.py`); `grade` runs this chapter's tests on yours in place of
# the course's: first your device function alone, one warp, every lane's registers against
# the PTX mapping (a wrong register half is named: its lane, register, the element it
# holds and the one the mapping wants there), then the forward's pinned cases in fp16 and
# bf16. The mapping is the figure of section 1 (A's panel), drawn from `a_position`:
#
#     lane = 4 group + t:  element i is A[group + 8 ((i // 2) % 2), 2t + i % 2 + 8 (i // 4)]
#                          register j holds elements 2j (low 16 bits) and 2j + 1 (high)
#
# **Exercise 4: Q's A fragments, by the mapping.** Write `make_load_a_fragment()`,
# returning a device function `load_a_fragment(s, row0, col0, lane)`: `s` is a shared
# uint16 array (the fp16 or bf16 bit patterns of the staged Q tile), A = `s[row0:row0 +
# 16, col0:col0 + 16]` (16 query rows of a warp, 16 columns of d: one k-step), `lane` is
# the lane in its warp; it returns the 4 uint32 registers `(a0, a1, a2, a3)` that lane
# holds of A, read element by element (no `ldmatrix`). The kernel calls it once per k-step
# when it loads Q_i, before the K/V loop.
#
# **Exercise 5: P stays in registers.** Write `make_p_to_a(bf16)`, returning a device
# function `p_to_a(c0, c1)`: `c0` and `c1` are a lane's 4 floats of P's two accumulator
# tiles of 16 x 8 (keys 0-7 and 8-15 of a 16-key step; `c[i] = P[group + 8 (i // 2), 2t +
# i % 2]`, the C panel of the figure); it returns the 4 uint32 registers of P V's A
# operand, each two floats rounded to fp16 (bf16 when `bf16`) and packed. This is
# FlashAttention-2's "P stays in registers": section 1 checked that every element is
# already in the lane that needs it.
#
# <details><summary>Hint 1 (exercise 4)</summary>
#
# `group, t = lane // 4, lane % 4`. Register a0 holds A[group, 2t] and A[group, 2t + 1];
# a1 the same columns of row group + 8; a2 and a3 the same two rows, columns 2t + 8 and
# 2t + 9. In `s` that is row `row0 + ...`, column `col0 + ...`.
# </details>
#
# <details><summary>Hint 2 (exercise 4)</summary>
#
# A register from two halves: `uint32(s[r, c]) | (uint32(s[r, c + 1]) << uint32(16))`.
# `s` holds bit patterns: move the bits, never convert the values.
# </details>
#
# <details><summary>Hint 3 (exercise 5)</summary>
#
# Compare the C panel with the A panel: c0's c[0], c[1] (row group, keys 2t, 2t + 1) are
# A's elements 0, 1; c0's c[2], c[3] (row group + 8) are elements 2, 3; c1's are elements
# 4 to 7 (keys 8 + 2t, 8 + 2t + 1).
# </details>
#
# <details><summary>Hint 4 (exercise 5)</summary>
#
# `pack_f16(lo, hi)` and `pack_bf16(lo, hi)` (`kernels.base.mma`) round two floats and put
# `lo` in the low 16 bits; pick one by `bf16` in the factory, outside the device function.
# Return a tuple of 4.
# </details>

# %%
from kernels.base.learner import grade, my_file

TEMPLATE_A = '''"""My Q fragments for chapter 8 (tests/test_flash_tensor_cores.py -k test_load_a_fragment)."""
CHAPTER = "flash_tensor_cores"

from numba import cuda, uint32


def make_load_a_fragment():
    @cuda.jit(device=True, inline=True)
    def load_a_fragment(s, row0, col0, lane):
        raise NotImplementedError       # your code: (a0, a1, a2, a3) of A = s[row0:row0 + 16, col0:col0 + 16]

    return load_a_fragment
'''

mine_a = my_file("my_tc_a_fragment.py", TEMPLATE_A)

# %%
a_passed = grade(mine_a)

# %% [markdown]
# The course's version, `make_load_a_fragment` in `kernels/flash_tensor_cores.py`, prints
# here once yours passes.

# %%
from kernels import flash_tensor_cores as tensor_cores_module

if a_passed:
    print(inspect.getsource(tensor_cores_module.make_load_a_fragment))
    print("ldmatrix .x4: lane 8 j + r points at row r of matrix j; each lane receives (matrix, row, col):")
    for lane in (0, 5):
        print(f"  lane {lane}:", [tc.ldmatrix_position(lane, i) for i in range(8)])
else:
    print("(shown once your function passes; stuck? read make_load_a_fragment in kernels/flash_tensor_cores.py)")

# %% [markdown]
# The course's answer is one instruction: `ldmatrix .x4` loads four 8 x 8 matrices, each
# lane receiving row `group`, columns `2t, 2t + 1` of each (printed above); with the
# matrices at A's four quarters, that is the A mapping, done by the hardware with one
# shared-memory load a lane. Yours takes 8 loads of 16 bits a k-step; it runs once a block
# (Q stays in registers), so the kernel's time hardly changes.

# %%
TEMPLATE_P = '''"""My P repacking for chapter 8 (tests/test_flash_tensor_cores.py -k test_p_to_a)."""
CHAPTER = "flash_tensor_cores"

from numba import cuda

from kernels.base.mma import pack_bf16, pack_f16


def make_p_to_a(bf16=False):
    @cuda.jit(device=True, inline=True)
    def p_to_a(c0, c1):
        raise NotImplementedError       # your code: P V's (a0, a1, a2, a3) from P's two 16 x 8 tiles

    return p_to_a
'''

mine_p = my_file("my_tc_p_to_a.py", TEMPLATE_P)

# %%
p_passed = grade(mine_p)

# %% [markdown]
# The course's version, `make_p_to_a`, prints here once yours passes.

# %%
if p_passed:
    print(inspect.getsource(tensor_cores_module.make_p_to_a))
else:
    print("(shown once your function passes; stuck? read make_p_to_a in kernels/flash_tensor_cores.py)")
