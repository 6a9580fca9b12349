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
# # 3. Online softmax
#
# Attention is `O = softmax(S) V`, and the softmax is the piece that seems to forbid tiling:
#
# $$p_j = \frac{e^{x_j}}{\sum_k e^{x_k}}$$
#
# The denominator is a sum over the **whole row**. Before the last score of a row is known,
# not a single $p_j$ can be written. Chapter 1 paid for this by writing the full N x N matrix
# S to HBM, reading it back to take the softmax, and writing P. This chapter removes that
# obstacle. By the end you will have:
#
# 1. **safe softmax**: subtract the row max so that `exp` never overflows;
# 2. **the ladder** 3 passes -> 2 passes -> 1 pass over the row, keeping a running max `m` and
#    a running sum `l` that is *rescaled* whenever the max grows;
# 3. **the merge** of two `(m, l)` states, an associative operator: a row can be cut into
#    pieces, the pieces processed by anyone in any order, and their states combined along
#    any tree;
# 4. **a CUDA kernel** for row softmax that reads each row once, keeps it in registers, and
#    combines the threads' states with a tree reduction in shared memory.
#
# The same `(m, l)` bookkeeping is the heart of FlashAttention's forward pass (chapter 4).
#
# **Sources** (numbered as in the README's list): [3] Online normalizer calculation for
# softmax (Milakov and Gimelshein), Algorithms 2 (safe softmax) and 3 (the online
# normalizer); [1] FlashAttention, Section 3.1 (the (m, ℓ) merge).

# %%
import inspect
import os

import numpy as np

import kernels  # noqa: F401  (GPU or simulator, chosen before Numba is imported)
from kernels import reference as ref
from kernels.online_softmax import (
    IDENTITY,
    attend_1pass,
    check_merge_tree,
    chunk_state,
    eval_tree,
    make_row_softmax,
    merge,
    merge_tree_cases,
    online_state,
    softmax,
    softmax_2pass,
    softmax_3pass,
)
from kernels.base.runtime import device_name, on_simulator
from kernels.base.testing import assert_close, check_exercise

print("running on:", device_name())

# %% tags=["parameters"]
# Tiny sizes in the simulator (every GPU thread is a Python thread there), real ones on a GPU.
if on_simulator():
    ROWS, N = 6, 70          # the kernel check
    TIME_ROWS, TIME_N = 0, 0  # no timing in the simulator
else:
    ROWS, N = 512, 3000
    TIME_ROWS, TIME_N = 16384, 4096

# %% [markdown]
# ## 1. Safe softmax
#
# `exp` overflows float32 above about 88.7. Logits of a few hundred are common (large
# activations, a forgotten scale), and masked logits are `-inf`. The textbook formula breaks:

# %%
x = np.array([1000.0, 999.0, 998.0], dtype=np.float32)
with np.errstate(over="ignore", invalid="ignore"):
    naive = np.exp(x) / np.exp(x).sum()
print("naive   :", naive)

# %% [markdown]
# Softmax does not change when the same constant is subtracted from every element
# ($e^{x_j - c} / \sum_k e^{x_k - c}$ is the same fraction). Choose $c = m = \max_k x_k$:
# every exponent is $\le 0$, every `exp` is in $(0, 1]$, and the largest term is exactly 1,
# so the sum is at least 1. That is **safe softmax**, three passes over the row:

# %%
print(inspect.getsource(softmax_3pass))
print("safe    :", softmax_3pass(x))
print("oracle  :", ref.softmax(x))

# %% [markdown]
# One detail decides whether masked rows work: if the whole row is `-inf`, then `m = -inf`
# and `x - m` is `-inf - (-inf) = NaN`. The helper `_safe(m)` subtracts 0 instead of `-inf`
# in that case, so `exp(x - 0) = exp(-inf) = 0` and the row's output is all zeros (the
# convention of the whole course: a row that can attend to nothing gives 0, never NaN).

# %%
print(softmax_3pass(np.full((1, 4), -np.inf, np.float32)))

# %% [markdown]
# ## 2. Fewer passes: the running max and the rescaled sum
#
# Three passes read the row three times. On a GPU the row lives in HBM, and every pass costs
# `4 n` bytes of traffic; for softmax, which does a few operations per element, those bytes
# *are* the running time.
#
# Can the max and the sum come out of **one** pass? Keep, after `j` elements,
#
# * `m_j` = the max of the first `j` elements,
# * `l_j` = $\sum_{k \le j} e^{x_k - m_j}$, the sum relative to the *current* max.
#
# When element `j+1` arrives and the max grows from `m_j` to `m_{j+1}`, every term already in
# `l_j` was taken relative to the old max: multiplying by $e^{m_j - m_{j+1}}$ moves them all
# to the new one at once:
#
# $$m_{j+1} = \max(m_j, x_{j+1}), \qquad l_{j+1} = l_j\, e^{m_j - m_{j+1}} + e^{x_{j+1} - m_{j+1}}$$

# %%
print(inspect.getsource(online_state))

# %% [markdown]
# Watch it run over one row: `m` jumps whenever a new max appears, and at that moment `l`
# is scaled down (the old terms shrink relative to the new max) before the new term, 1, is
# added. At the end, `m + log(l)` is the row's logsumexp.

# %%
import matplotlib.pyplot as plt

rng = np.random.default_rng(3)
row = rng.standard_normal(24) * 2
ms, ls = [], []
m_run, l_run = IDENTITY
for v in row:                       # the update of online_state, one element at a time
    m_new = max(m_run, v)
    l_run = l_run * np.exp(m_run - m_new) + np.exp(v - m_new)
    m_run = m_new
    ms.append(m_run)
    ls.append(l_run)

fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 4.5), sharex=True)
ax1.bar(range(len(row)), row, color="0.75", label="x_j")
ax1.step(range(len(row)), ms, where="mid", color="C3", label="running max m")
ax1.legend(fontsize=8)
ax2.plot(range(len(row)), ls, "o-", color="C0", label="running sum l (relative to the current m)")
for j in range(1, len(row)):
    if ms[j] > ms[j - 1]:
        ax2.axvline(j, color="C3", alpha=0.25)
ax2.set_xlabel("element j (red lines: the max grew, l was rescaled)")
ax2.legend(fontsize=8)
plt.tight_layout()
plt.show()
print("m + log l =", ms[-1] + np.log(ls[-1]), "  oracle logsumexp =", ref.logsumexp(row))

# %% [markdown]
# With `(m, l)` from one pass, a second pass writes `p = exp(x - m) / l`: **online softmax**,
# two passes instead of three.

# %%
print(inspect.getsource(softmax_2pass))
xs = (rng.standard_normal((3, 10)) * 30).astype(np.float32)
xs[1] = -np.inf
assert_close(softmax_2pass(xs), ref.softmax(xs), ref.softmax(xs, dtype=np.float32), name="2-pass")
assert_close(softmax_3pass(xs), ref.softmax(xs), ref.softmax(xs, dtype=np.float32), name="3-pass")
print("3-pass and 2-pass agree with the oracle (including a row of all -inf)")

# %% [markdown]
# ### And one pass
#
# The second pass exists only to *write* `p`. Attention never needs `p` itself, only
# `o = p @ v`. Then `o` can be rescaled exactly like `l`: keep the unnormalised running output,
# multiply it by $e^{m_{old} - m_{new}}$ when the max grows, add $e^{x_j - m} v_j$, and divide
# by `l` once at the end. **One pass, and `p` is never stored.** This is the inner loop of
# FlashAttention, one score at a time (chapter 4 does it a tile at a time):

# %%
print(inspect.getsource(attend_1pass))
v = rng.standard_normal((10, 4)).astype(np.float32)
o, L = attend_1pass(xs, v)
assert_close(o, ref.softmax(xs) @ v, ref.softmax(xs, dtype=np.float32) @ v, name="o")
print("one-pass softmax(x) @ v agrees with the oracle; L =", L)

# %% [markdown]
# The ladder, counted in memory passes over a row of `n` float32 (4 bytes each):
#
# | rung | reads of x | writes | HBM bytes per element |
# |---|---|---|---|
# | 3-pass safe softmax | 3 (max, sum, normalise) | p | 16 |
# | 2-pass online softmax | 2 (online (m, l), normalise) | p | 12 |
# | online, row kept on chip (this chapter's kernel, n <= TPR*K) | 1 | p | **8 = compulsory** |
# | 1-pass attention `o = softmax(x) v` | 1 | o only, never p | p never touches HBM |
#
# Our kernel sits on the third rung: the online pass loads the row into registers, so the
# "second pass" reads registers, not HBM.

# %% [markdown]
# ## 3. The merge: an associative operator
#
# Now cut a row into two pieces A and B, and suppose someone computed `(m_A, l_A)` and
# `(m_B, l_B)` separately. The state of the whole row follows, by the same rescaling:
#
# $$m = \max(m_A, m_B), \qquad l = l_A\, e^{m_A - m} + l_B\, e^{m_B - m}$$
#
# The per-element update of section 2 is this merge with `B` a single element, `(x_j, 1)`.
# The empty piece has state `(-inf, 0)`: it is the **identity**, `merge((-inf, 0), s) = s`.
# Merging two empty (or all `-inf`) pieces must give `(-inf, 0)` without ever forming
# `exp(-inf - (-inf))`, which is NaN: again subtract 0 when `m = -inf`.

# %%
print(inspect.getsource(merge))
with np.errstate(invalid="raise"):      # any exp(-inf - (-inf)) would raise here
    print("merge(identity, identity) =", merge(IDENTITY, IDENTITY))
    print("merge(identity, (2.0, 1.5)) =", merge(IDENTITY, (2.0, 1.5)))

# %% [markdown]
# `merge` is **associative** (`merge(merge(a, b), c) = merge(a, merge(b, c))`) and
# **commutative**: `m` exactly (max is exact), `l` up to float rounding. So the pieces can be
# combined in *any order, along any tree*:
#
# ```
#   row:  [ x0 x1 x2 | x3 x4 | x5 | x6 x7 x8 x9 ]      cut into chunks 0..3
#            s0          s1    s2       s3           s_i = (m_i, l_i), computed anywhere
#
#   left fold (one thread walking the row)      a balanced tree (threads in parallel)
#          merge                                         merge
#         /     \                                      /       \
#      merge     s3                                merge       merge
#     /     \                                     /     \     /     \
#   merge    s2                                  s0     s1   s2     s3
#   /   \
#  s0    s1
# ```
#
# Both give the same `(m, l)`. This one property is what every fast softmax and attention
# kernel relies on:
#
# * **inside a kernel**: threads each take a slice of a row, and a tree reduction combines
#   their states (this chapter's kernel);
# * **the fused forward (chapter 4)**: a block walks the keys tile by tile; each tile's
#   `(m, l, O)` is merged into the running one: a left fold;
# * **split-K decoding** (Flash-Decoding): one query against a very long KV cache; the keys
#   are split across many blocks, each computes a partial `(m, l, O)`, and a final step merges
#   them;
# * **tree attention / ring attention**: the sequence spread across GPUs, partial states
#   merged across devices along a tree or ring.
#
# The tests check the property directly. Hypothesis draws a row (with `-inf` entries and
# logits up to 1e4), cuts it into random chunks (some of them empty), takes a random
# permutation of the chunks and a random binary tree over them, merges along the tree, and
# compares with the whole row's state:

# %%
print(inspect.getsource(check_merge_tree))
from kernels.online_softmax import MergeTreeCase

row = np.array([0.3, -np.inf, 2.5, 1.0, -1.2, 4.0, 0.0, -np.inf, 3.1, 2.2])
case = MergeTreeCase(row, cuts=[3, 5, 5, 6], tree=((4, (0, 2)), (3, 1)))   # chunk 2 is empty
print(case, "\nchunks:", case.chunks())
print("merged along the tree:", eval_tree(case.tree, [chunk_state(c) for c in case.chunks()], merge))
print("whole row:            ", chunk_state(case.x))
_ = check_exercise(lambda c: check_merge_tree(merge, c), merge_tree_cases(), host=True)

# %% [markdown]
# ## 4. The kernel
#
# One row of `n` floats is handled by `TPR` threads (a warp for short rows, up to 1024
# threads for long ones); a block holds `RPB` rows. Three phases:
#
# ```
#  row (n floats)  | t0 t1 t2 ... tTPR-1 | t0 t1 ... | t0 t1 ...        thread t reads t, t+TPR, t+2TPR, ...
#                  \______ chunk of TPR*K: K floats a thread, in registers ______/
#
#  1. online pass   each thread: chunk max mc, lc = sum exp(x - max(m, mc)),
#                   then (m, l) = merge((m, l), (mc, lc))      -> one (m, l) a thread
#  2. tree          shared memory, log2(TPR) steps:  s = TPR/2, TPR/4, ..., 1
#                   barrier; thread t < s: state[t] = merge(state[t], state[t + s])
#                   (a block barrier while s >= 32, a warp barrier for the last 5 steps)
#  3. write pass    p = exp(x - m) / l  from the registers (row read from HBM once)
#                   thread 0 of the row also writes L = m + log l
# ```
#
# * **Coalesced loads**: for a fixed `i`, the 32 threads of a warp read 32 consecutive floats
#   (128 bytes, one transaction); each thread has `K` such loads in flight before it uses any
#   of them, which is what keeps HBM busy.
# * **Registers**: `xr = cuda.local.array(K, float32)` indexed only by the unrolled loop
#   counter `i` becomes `K` registers (the PTX has no `.local` memory: check it with
#   `numba.cuda.compile_ptx`). A row with `n <= TPR * K` is one chunk, and the write pass
#   reuses the registers: **8 bytes an element, the compulsory traffic**. A longer row is
#   swept chunk by chunk (the online update across chunks is exactly the merge) and read a
#   second time for the write pass.
# * **-inf without NaN**: the state stays `(-inf, 0)` until a finite element appears; an all
#   `-inf` row ends with `l = 0` and writes zeros and `L = -inf`. The kernel is compiled with
#   fast math *except* the "no infinities / no NaNs" assumptions, since `-inf` is a real input.
# * **Tiles are compile-time constants**: `make_row_softmax(TPR, RPB, K)` is a cached factory.

# %%
print(inspect.getsource(make_row_softmax))

# %% [markdown]
# The launcher `softmax(x, *, return_lse=False, ...)` takes any-rank float32 input, treats
# every index of the leading axes as a row, picks the tiles (`default_tiles(n)`), and returns
# NumPy for NumPy input and device arrays for device input.
#
# ## 5. Check it against the oracle

# %%
rng = np.random.default_rng(0)
x = (rng.standard_normal((ROWS, N)) * 4).astype(np.float32)
x[1] = -np.inf                       # a fully masked row
x[2, ::3] = -np.inf                  # a partly masked row
x[3] *= 2500                         # logits around 1e4
p, L = softmax(x, return_lse=True)
assert_close(p, ref.softmax(x), ref.softmax(x, dtype=np.float32), name="p")
assert_close(L, ref.logsumexp(x), ref.logsumexp(x, dtype=np.float32), name="L")
print("p and L agree with the oracle; row 1 (all -inf):", p[1, :4], L[1])

# odd shapes: rank 3, a row of length 1, rows of length 0, one past the block (33 with 32 threads)
for shape, tiles in [((2, 3, 5), {}), ((4, 1), {}), ((3, 0), {}),
                     ((3, 33), dict(threads_per_row=32, per_thread=1))]:
    xx = (rng.standard_normal(shape) * 3).astype(np.float32)
    assert_close(softmax(xx, **tiles), ref.softmax(xx), ref.softmax(xx, dtype=np.float32), name=str(shape))
print("odd shapes agree too")

# %%
from numba import cuda

d = cuda.to_device(x)
pd = softmax(d)                      # device in -> device out, no copy back
print(type(pd).__name__, pd.shape)

# %% [markdown]
# ## 6. Bytes and FLOPs
#
# Per element the kernel does about 5 floating-point operations (subtract, `exp`, max, add,
# multiply) and must move 8 bytes (read `x`, write `p`): about **0.6 FLOP per byte**, against
# an H100 ridge of about 17 fp32 FLOP per byte. Softmax is **bound by memory** by a factor
# of about 30, so the figure of merit is bandwidth, measured against a plain copy of the same
# bytes (2.95 TB/s on the course's H100, measured in chapter 0).

# %%
from kernels.base.io_model import ceilings

copy_tbs = ceilings().hbm_tbs   # cudaMemcpy, chapter 0's committed results
for rows, n in [(16384, 4096), (65536, 4096), (16384, 16384)]:
    nbytes = 8 * rows * n
    print(f"rows={rows:6d} n={n:6d}: {nbytes / 2**30:5.2f} GiB compulsory -> "
          f">= {nbytes / (copy_tbs * 1e12) * 1e3:6.3f} ms at copy speed;"
          f" a 3-pass version moves 2x as much")

# %%
if TIME_ROWS:
    from kernels.base.runtime import cdiv, time_fn
    from kernels.online_softmax import default_tiles

    xt = cuda.to_device((rng.standard_normal((TIME_ROWS, TIME_N)) * 4).astype(np.float32))
    pt = cuda.device_array_like(xt)
    lt = cuda.device_array(TIME_ROWS, np.float32)
    tpr, rpb, k = default_tiles(TIME_N)
    kern = make_row_softmax(tpr, rpb, k)
    t = time_fn(lambda a: kern[cdiv(TIME_ROWS, rpb), tpr * rpb](a, pt, lt), [(xt,)])
    print(f"rows={TIME_ROWS} n={TIME_N}: {t.median_ms:.3f} ms, "
          f"{8 * TIME_ROWS * TIME_N / t.median_ms / 1e6:.0f} GB/s against the compulsory bytes")
else:
    print("timing skipped in the simulator: its timings say nothing about a GPU")

# %% [markdown]
# ## 7. Results on the H100
#
# `python -m kernels --chapters 3` measures the kernel at rows of 1024 to 65536 floats, next
# to a device-to-device copy of the same bytes, `torch.softmax` (fp32) and a CuPy softmax
# expression, all in the same run. The committed results:

# %%
from kernels.bench.harness import show_results

rows_ = show_results("online_softmax", ("kernel", "config", "median_ms", "gbps"))

# %% [markdown]
# ## 8. Exercises
#
# ### Exercise 1: the merge
#
# Write `my_merge(a, b)` for states `a = (m1, l1)` and `b = (m2, l2)` (plain Python floats or
# NumPy scalars). It must return the state of both pieces, handle the identity `(-inf, 0)`,
# and never compute `exp(-inf - (-inf))`. The checker runs the chapter's property on it:
# random rows (with `-inf` and large logits), random chunks, any order, any tree.

# %%
def my_merge(a, b):
    (m1, l1), (m2, l2) = a, b
    # your code here: return (m, l)
    raise NotImplementedError


# %%
_ = check_exercise(lambda c: check_merge_tree(my_merge, c), merge_tree_cases(), host=True)

# %% [markdown]
# The same checker on the module's `merge`:

# %%
_ = check_exercise(lambda c: check_merge_tree(merge, c), merge_tree_cases(), host=True)

# %% [markdown]
# ### Exercise 2: one element at a time
#
# Write `my_update(state, xj)`: the state of a row after one more element `xj` (section 2).
# Folding it over a row from `(-inf, 0)` must give the row's `(m, l)`. Hint: it is `merge`
# with a one-element piece, but try writing it directly.

# %%
def my_update(state, xj):
    m, l = state
    # your code here: return (m_new, l_new)
    raise NotImplementedError


def fold_prop(update):
    """The property: folding ``update`` over a row from (-inf, 0) gives the row's (m, l)."""
    def prop(case):
        state = IDENTITY
        with np.errstate(invalid="raise"):
            for xj in case.x:
                state = update(state, float(xj))
        m_true, l_true = chunk_state(case.x)
        m, l = float(state[0]), float(state[1])
        assert m == m_true and abs(l - l_true) <= 1e-12 * len(case.x) * max(l_true, 1.0), \
            f"got (m, l) = ({m}, {l}), expected ({m_true}, {l_true})"
    return prop


_ = check_exercise(fold_prop(my_update), merge_tree_cases(), host=True)

# %% [markdown]
# The checker on a solution (merge with the one-element state `(xj, 1)`):

# %%
_ = check_exercise(fold_prop(lambda state, xj: merge(state, (xj, 1.0))), merge_tree_cases(), host=True)

# %% [markdown]
# ### Exercise 3 (on paper, then in code)
#
# The kernel reads a long row (n > TPR * K) twice. How many HBM bytes per element does it
# move then, and how large can `n` be on an H100 before one block's row no longer fits in
# the 64K registers of an SM? (Hint: at 32 floats a thread and 512 threads, a row of 16384
# floats is 64 KB of registers.) Try `softmax(x, threads_per_row=32, per_thread=1)` on a row
# of 100 elements: how many chunks does each thread sweep?

# %% [markdown]
# ### Exercises 4 and 5 (kernels): the merge on the device, and a first online softmax
#
# Write both in your own file (the next cell makes it from a template the first time:
# `workbook/mine/my_online_softmax.py`); `grade` runs this chapter's tests on them and
# prints the smallest case that fails.
#
# * **Exercise 4.** `merge_state(m1, l1, m2, l2)`, a device function
#   (`@cuda.jit(device=True)`) returning `(m, l)`: exercise 1's merge on the GPU. It goes
#   into the production kernel above in place of the course's, at every step of its tree
#   of merges, so `test_softmax_matches_oracle` and the NaN/Inf test grade it through
#   `softmax`. Two pieces that are both empty (m = -inf) must merge to `(-inf, 0)` without
#   forming `exp(-inf - (-inf))`, and a NaN must survive.
# * **Exercise 5.** `make_first_online_softmax()` returns a kernel `(x, p, lse)` on `(rows,
#   n)` arrays, launched with one thread a row (`cuda.grid(1)` is the row): one sweep keeps
#   the running `(m, l)` of section 2, a second writes `p = exp(x - m) / l`, and
#   `lse = m + log(l)`; a row of all `-inf` gets zeros and `-inf`, a NaN makes its row NaN.
#   `test_first_softmax_matches_oracle` grades it.
#
# <details><summary>Hint 1 (exercise 4)</summary>
#
# `m = nan_max(m1, m2)` (from `kernels.base.fused`: Numba's `max` drops a NaN); if `m` is
# `-inf` return `(m, 0)`; else `l1 * exp(m1 - m) + l2 * exp(m2 - m)`.
# </details>
#
# <details><summary>Hint 2 (exercise 5)</summary>
#
# For each element `v`: `m_new = nan_max(m, v)`; unless `m_new` is `-inf`,
# `l = l * exp(m - m_new) + exp(v - m_new)` and `m = m_new`. Keep `l` in a `float64`: a
# float32 running sum over a long row errs far more than the pairwise sums the tolerance is
# set by.
# </details>

# %%
from kernels.base.learner import grade, my_file

TEMPLATE = '''"""My kernels for chapter 3 (graded by tests/test_online_softmax.py)."""
CHAPTER = "online_softmax"

import math

from numba import cuda, float32, float64

from kernels.base.fused import nan_max


@cuda.jit(device=True)
def merge_state(m1, l1, m2, l2):
    raise NotImplementedError       # your code: return (m, l)


def make_first_online_softmax():
    @cuda.jit
    def first_online_softmax(x, p, lse):
        raise NotImplementedError   # your code: row cuda.grid(1) of p, and its lse

    return first_online_softmax
'''

mine = my_file("my_online_softmax.py", TEMPLATE)

# %%
_ = grade(mine)

# %% [markdown]
# The course's answers: `kernels.online_softmax.merge_state` and
# `make_first_online_softmax` (read them after yours pass).
