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
# # 11. Tensor cores, part two: fp32 inputs through 3xTF32
#
# Chapter 8 put the FlashAttention-2 forward on the tensor cores, for fp16 and bf16 inputs.
# With float32 inputs the course has so far used the fp32 FMA units (chapter 4), whose
# ceiling on the H100 is a fraction of the tensor cores'. The tensor cores do take 32-bit
# registers, as **TF32**: float32's 8 exponent bits, but only 10 of its 23 mantissa bits.
# One TF32 product is therefore not an fp32 product. Three are, nearly: split each operand
# as a = a_hi + a_lo, both TF32 values, and
#
# $$a\,b \approx a_{hi} b_{hi} + a_{hi} b_{lo} + a_{lo} b_{hi},$$
#
# which drops only $a_{lo} b_{lo}$, about $2^{-22}$ of $|a||b|$, below what accumulating in
# float32 costs anyway. This is **3xTF32**, the scheme of CUTLASS's "fast accurate" fp32
# GEMMs. This chapter:
#
# 1. TF32, and why one product is not fp32 (numbers);
# 2. three products: the error terms, drawn;
# 3. the exercise: write `split_tf32`;
# 4. the kernel: chapter 8's forward on `mma.sync.m16n8k8.tf32`, three products a step;
# 5. the check against the oracle;
# 6. the H100 results;
# 7. exercises.
#
# Sections 1 to 3 need no GPU: `kernels/tf32_error.py` models the tensor core's arithmetic
# in NumPy (float64 standing for exact products).
#
# **Sources** (numbered as in the README's list): [4] FlashAttention-2, Algorithm 1 (the
# forward, as in chapter 8); [14] the PTX ISA, `cvt.rna.tf32.f32` and "Matrix Fragments
# for mma.m16n8k8" (tf32); [16] CUTLASS (the 3xTF32 GEMMs); Ootomo and Yokota, *Recovering
# single precision accuracy from Tensor Cores while surpassing the FP32 theoretical peak
# performance* (2022), the error analysis of the split and of the tensor cores' rounding.

# %%
import matplotlib.pyplot as plt
import numpy as np

import kernels  # noqa: F401  (GPU or simulator, chosen before Numba is imported)
from kernels import reference as ref
from kernels import tf32_error as te
from kernels.base.runtime import device_name, on_simulator
from kernels.base.testing import case_with

print("running on:", device_name())

# %% tags=["parameters"]
# Sections 1 to 3 are NumPy, the same everywhere; the kernel's sizes (section 5) are tiny
# in the simulator (every GPU thread is a Python thread there) and real on a GPU.
if on_simulator():
    B, H, NQ, NK, D_HEAD = 1, 1, 17, 20, 24
else:
    B, H, NQ, NK, D_HEAD = 2, 8, 1000, 1100, 64
D_DOT = 64          # the dot products of sections 1 and 2 (a head dimension)

# %% [markdown]
# ## 1. TF32, and why one product is not fp32
#
# A float32 has 1 sign bit, 8 exponent bits and 23 mantissa bits: 24 significant bits with
# the implicit leading one. TF32 keeps the sign and the exponent and **10** mantissa bits;
# in a register it is a float32 whose low 13 bits are zero. The PTX instruction
# `cvt.rna.tf32.f32` rounds a float32 to it: to nearest, ties **away** from zero.
# (`kernels.base.mma.tf32_bits` does it on the bit pattern: add $2^{12}$, half a TF32
# spacing, to the magnitude, clear the low 13 bits; `te.to_tf32` views the result as
# float32.)
#
# For $x \in [2^e, 2^{e+1})$ the TF32 values are $2^{e-10}$ apart, so rounding moves $x$ by at
# most $2^{e-11} \le 2^{-11}|x|$. Then a product of two rounded operands errs by up to
#
# $$|a b - a_{hi} b_{hi}| = |(a - a_{hi})\,b + a_{hi}(b - b_{hi})| \le (2^{-11} + 2^{-11})\,|a||b| ,$$
#
# $2^{14}$ times float32's $2^{-24}$. The tensor core multiplies TF32 values exactly (11 x 11
# significant bits fit in float32's 24) and adds in fp32: all of 1xTF32's loss is in the
# rounding of the inputs.

# %%
x = np.array([1.0, 1 + 2.0 ** -10, 1 + 4095 * 2.0 ** -23, 1 + 4096 * 2.0 ** -23, -(1 + 4096 * 2.0 ** -23),
              np.pi, 1e-30, 3e38], np.float32)
for xi, hi in zip(x, te.to_tf32(x)):
    print(f"x = {xi!r:>16}  bits {int(np.float32(xi).view(np.uint32)):#010x}   tf32(x) = {hi!r:>14}  "
          f"bits {int(hi.view(np.uint32)):#010x}   relative change {abs(float(xi) - float(hi)) / abs(float(xi)):.2e}")

# %% [markdown]
# The third and fourth values sit one float32 ulp either side of the midpoint between 1 and
# the next TF32 value $1 + 2^{-10}$; the fourth *is* the midpoint, and goes away from zero
# (the fifth, its negative, too).
#
# How much that costs a dot product of length 64 (a head dimension), against float64, on
# normal inputs: the error relative to $\sum_k |a_k||b_k|$ (`te.dot_errors`; the model of the
# tensor core's accumulation is in `kernels/tf32_error.py`: per k-step of 8 the products
# exact, the accumulator rounded to float32 once per `mma`, as `mma.sync.m16n8k8` does it).

# %%
errors = te.dot_errors(D_DOT, trials=4000)
for name, e in errors.items():
    print(f"{name:>7}: median 2^{np.log2(np.median(e)):6.1f}   max 2^{np.log2(e.max()):6.1f}")

# %% [markdown]
# 1xTF32 errs about $2^{12}$ times more than float32 on the same dot products. In attention
# that is the difference between meeting the course's tolerance rule (every kernel's error
# at most twice that of a float32 NumPy computation, plus floors derived from its own
# rounding steps; chapter 4) and missing it by two orders of magnitude. `te.attention_check`
# runs attention with $S = QK^\top$ and $PV$ both through the model, the softmax in float32,
# and applies the rule as chapter 4's tests apply it to the kernel (`ratio`: error / bound at
# the worst element; at most 1 passes):

# %%
case = case_with((1, 2, 64, D_DOT), (1, 2, 80, D_DOT), logit_std=3.0, seed=1)
for passes in ("fp32", 1, 2, 3):
    o_rec, l_rec = te.attention_check(case.q, case.k, case.v, passes)
    print(f"passes={passes!s:>4}: max |O - O_exact| = {o_rec.max_error:.2e}   O error/bound = {o_rec.ratio:8.3g}   "
          f"L error/bound = {l_rec.ratio:8.3g}   {'meets' if o_rec.passed and l_rec.passed else 'misses'} the rule")

# %% [markdown]
# So the course does not use 1xTF32 by default: it would be the one chapter whose float32
# kernel fails the rule every other chapter's kernel meets, by 100x or more, and its output
# would differ from the fp32 FMA kernels' in the fourth significant digit. PyTorch leaves
# TF32 off for float32 matmuls by default for the same reason
# (`torch.backends.cuda.matmul.allow_tf32`). The kernel of section 4 keeps `passes=1` as an
# option, to measure what the two extra products cost.
#
# ## 2. Three products: the error terms
#
# Split each operand twice: $a_{hi} = \mathrm{tf32}(a)$, and the remainder $a - a_{hi}$ (exact
# in float32: at most 12 significant bits, in units of $a$'s ulp) rounded again,
# $a_{lo} = \mathrm{tf32}(a - a_{hi})$. What is left, $\delta a = a - a_{hi} - a_{lo}$, is at most
# one float32 ulp of $a$: $|\delta a| \le 2^{-23}|a|$ (and the bound is attained: the tests
# pin an input that reaches it). Expand the product:
#
# | term | size relative to $\lvert a\rvert\lvert b\rvert$ | 1xTF32 | 3xTF32 |
# |---|---|---|---|
# | $a_{hi} b_{hi}$ | about 1 | kept | kept |
# | $a_{hi} b_{lo}$, $a_{lo} b_{hi}$ | up to $2^{-11}$ each | **dropped** | kept |
# | $a_{lo} b_{lo}$ | up to $2^{-22}$ | dropped | dropped |
# | $\delta a\, b + (a - \delta a)\,\delta b$ (the split's own error) | up to $2^{-23}$ each | dropped | dropped |
#
# 3xTF32 drops at most $2^{-22} + 2^{-23} + 2^{-23} = 2^{-21}$ of $|a||b|$ per product, and
# the accumulator then rounds once per `mma`, $2^{-24}$ of the running sum each time: the
# dropped terms are at the level of float32's own rounding, so three products keep
# float32's accuracy, where two ($a_{hi} b_{hi} + a_{hi} b_{lo}$) still drop a $2^{-11}$ term and
# gain almost nothing. The measured sizes of the terms, on 20000 products of normal numbers:

# %%
fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
te.draw_error_terms(axes[0])
te.draw_dot_errors(axes[1], d=D_DOT)
fig.tight_layout()
plt.show()

# %% [markdown]
# Left: each term of $(a_{hi} + a_{lo})(b_{hi} + b_{lo})$ relative to $|a||b|$. The two cross
# terms spread below $2^{-11}$, $a_{lo} b_{lo}$ below $2^{-22}$, and what the split misses below
# $2^{-23}$ (zero for more than half of the products: both remainders fit in TF32). Right: the dot
# products of section 1. 3xTF32's errors sit on float32's; 1x and 2x sit $2^{12}$ higher.
#
# The bound, summed over a dot product of length $K$ with $R = 3\lceil K/8\rceil$ roundings of
# the accumulator, is `te.product_bound`:
#
# $$|c - a\cdot b| \le \left(2^{-21} + R\,2^{-24}\right)(1 + 2^{-8}) \sum_k |a_k||b_k| ,$$
#
# smaller than float32's own worst case ($K\,2^{-24}$, one rounding an addition) since a
# tensor core rounds once per 8 products. The tests check every 3xTF32 product against it,
# and check that 1xTF32 and 2xTF32 exceed it by more than 4x (14x or more, measured) on
# ordinary inputs: the bound bites.
#
# **What the model assumes.** Each `mma` rounds its sum to nearest. Measurements of earlier
# tensor cores (Ootomo and Yokota 2022) found the accumulator truncated (rounded toward
# zero), which costs up to a whole ulp a rounding, always in the same direction, so the
# errors add up instead of averaging out; `accumulate="rz"` models that. Ootomo and Yokota
# avoid it by accumulating the small terms outside the tensor core; the course's kernel keeps
# all three in one accumulator (small ones first); the model says what that would risk:

# %%
for acc in ("rn", "rz"):
    o_rec, l_rec = te.attention_check(case.q, case.k, case.v, 3, accumulate=acc)
    print(f"3xTF32, accumulator rounded {'to nearest ' if acc == 'rn' else 'toward zero'}: "
          f"O error/bound = {o_rec.ratio:.3g}, L error/bound = {l_rec.ratio:.3g}")

# %% [markdown]
# Toward zero the margin shrinks several times, but the rule still holds on this case (and
# on the others tried while writing the chapter, d = 64 and 128, N = 128, logit spreads 0.3
# to 8, causal or not: error/bound up to 0.96 in the simulator's floors). The model cannot
# say how the H100's adder rounds; the kernel's own tests there (section 5) can.
#
# ## 3. Exercise: the split
#
# Write `my_split_tf32(x)`: `x` is a float32 array of any shape; return `(hi, lo)`, two
# float32 arrays of its shape with
#
# * `hi` the TF32 value nearest to `x`, ties away from zero (what `cvt.rna.tf32.f32` gives);
# * `lo` the TF32 value nearest to `x - hi`.
#
# Both must be TF32 values (low 13 bits zero): that is all a tensor core multiplies. Work on
# the bits (`x.view(np.uint32)`, NumPy integer operations, `.view(np.float32)` back), without
# `te.to_tf32` or `kernels.base.mma`. The checker draws hundreds of arrays (every exponent
# from $2^{-100}$ to $2^{100}$, the low 13 bits often exactly at a tie or one either side) and
# prints "passed" or the smallest case it found wrong.
#
# <details><summary>Hint 1</summary>
#
# In a float32's bit pattern the low 13 bits are the 13 mantissa bits TF32 drops. The
# magnitude of a float32 grows with its bit pattern (sign apart), so rounding the magnitude
# to a multiple of $2^{13}$ in the integers rounds the value; a carry out of the mantissa
# moves into the exponent, which is what you want.
# </details>
#
# <details><summary>Hint 2</summary>
#
# Half a TF32 spacing is $2^{12}$ = `0x1000` in the bit pattern. Adding it and then clearing
# the low 13 bits (`& 0xFFFFE000`) rounds to nearest with ties going up in magnitude: away
# from zero, for either sign (the sign bit is untouched unless the number overflows). Do the
# addition in a wider integer type (`np.uint64`), or mind the overflow.
# </details>
#
# <details><summary>Hint 3</summary>
#
# `x - hi` is exact in float32 (compute it in float32); round it with the same function.
# Clearing the low bits without adding `0x1000` first truncates: the checker names the
# first value where that differs.
# </details>

# %%
def my_split_tf32(x):
    # your code: hi = x rounded to tf32 (ties away from zero), lo = (x - hi) rounded to tf32
    hi = x.copy()
    lo = np.zeros_like(x)
    return hi, lo


_ = te.check_split_tf32(my_split_tf32)

# %% [markdown]
# The checker bites: the course's answer passes; truncating instead of rounding, and
# forgetting to round `lo`, do not.

# %%
def truncated(x):
    hi = (x.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)
    return hi, te.to_tf32(x - hi)


_ = te.check_split_tf32(te.split_tf32)
_ = te.check_split_tf32(truncated)
_ = te.check_split_tf32(lambda x: (te.to_tf32(x), x - te.to_tf32(x)))

# %% [markdown]
# ## 4. The kernel
#
# *To be written:* `kernels/flash_tf32.py`, chapter 8's FlashAttention-2 forward on
# `mma.sync.m16n8k8.tf32`: the m16n8k8 fragments, each operand split in registers by
# `split_tf32` (`kernels/base/mma.py`), three `mma` a k-step (small products first), P's
# accumulator tile reused as the A operand of P V; `flash_attention_tf32(q, k, v, *,
# causal=False, scale=None, passes=3)`.

# %% [markdown]
# ## 5. Check against the oracle
#
# *To be written:* the kernel (3xTF32 and 1xTF32) against the float64 oracle with the
# tolerance rule, beside this chapter's NumPy model of the same arithmetic, on the
# `parameters` cell's sizes; the tests and planted bugs of `tests/test_flash_tf32.py`.

# %% [markdown]
# ## 6. Results on the H100
#
# *To be written:* `python -m kernels --chapters 11`: 3xTF32 and 1xTF32 against chapter 4's
# fp32 FMA kernel, chapter 8's fp16 kernel and PyTorch's fp32 attention, with the errors
# measured beside the times.

# %% [markdown]
# ## 7. Exercises
#
# 1. (On paper.) A TF32 value has 11 significant bits. Why is the product of two of them
#    exact in float32, and why would the product of two *bf16* values (8 significant bits)
#    be exact too? How many bf16 pieces would an fp32 operand need to keep about 22 bits, and
#    how many products would the scheme then cost?
# 2. (On paper.) Why is $a - a_{hi}$ exact in float32? Show that it has at most 12
#    significant bits, and find an $a$ for which $a_{lo}$ cannot represent it (so that
#    $|a - a_{hi} - a_{lo}|$ reaches $2^{-23}|a|$, as section 2 claims).
# 3. Below $|a| \approx 2^{-103}$ the split loses accuracy. Find where with `te.split_tf32`
#    (try $a = 1.1 \cdot 2^{-110}$), and explain it from the spacing of TF32's subnormal
#    numbers. Ootomo and Yokota scale $a_{lo}$ by $2^{11}$ before rounding it: why does that
#    help, and what must the kernel undo afterwards?
# 4. With `te.product(a, b, passes, accumulate=...)`, measure 3xTF32's error for K = 8 ..
#    4096 with both roundings of the accumulator, and compare with `product_bound`. Which
#    grows like $\sqrt{K}$ and which like $K$? Why does rounding toward zero change that?
# 5. The kernel issues the three products small first: $a_{lo} b_{hi}$, $a_{hi} b_{lo}$, then
#    $a_{hi} b_{hi}$. Change the order in `PASS_TERMS` (a copy of it) so that $a_{hi} b_{hi}$ goes
#    first, and measure the dot-product errors again. When does the order matter, and why?
