"""Chapter 3: online softmax.

softmax(x)_j = exp(x_j) / sum_k exp(x_k) needs the whole row before it can write a single
output: the denominator is a sum over every element. This module climbs the ladder that
turns that into something a tiled kernel can do, first in NumPy, then as a CUDA kernel.

The ladder (NumPy, over the last axis; memory passes over the row in brackets)

    softmax_3pass      m = max x [read], l = sum exp(x - m) [read], p = exp(x - m) / l [read, write]
    softmax_2pass      one read keeps a running (m, l); when the max grows from m_old to m_new
                       the sum so far is rescaled: l = l * exp(m_old - m_new) + exp(x - m_new);
                       then p = exp(x - m) / l [read, write]
    merge              the (m, l) state of two pieces of a row combines into the state of both:
                       merge((m1, l1), (m2, l2)) = (m, l1 exp(m1 - m) + l2 exp(m2 - m)), m = max(m1, m2).
                       It is associative (and commutative), with identity (-inf, 0): the pieces
                       may be combined in any order and any tree shape.
    attend_1pass       when the softmax is only needed to weight a sum (attention: o = p @ v),
                       even the second pass goes: the running output is rescaled like l.
                       This is the loop of the fused forward of chapter 4.

The kernel (``make_row_softmax``)

    A block holds RPB rows, a row has TPR threads. Thread t of a row reads the elements
    t, t + TPR, t + 2 TPR, ... (a warp reads 32 consecutive floats: coalesced) in chunks of
    K elements kept in registers. For each chunk it takes the chunk max, then merges the
    chunk's (m, l) into its own running state (online softmax, chunk by chunk). The TPR
    states of a row then meet in a tree reduction in shared memory (log2 TPR steps of
    merge), and a second sweep writes p = exp(x - m) / l. When the row fits in registers
    (n <= TPR * K, one chunk) the second sweep reuses the registers: x is read from HBM
    once and p written once, the compulsory 8 bytes an element. Longer rows are read twice
    (the second read mostly from L2). The logsumexp L = m + log l comes out of the same
    pass for free; the flash chapters save exactly this L.

-inf is a legal input (a masked logit). The state (-inf, 0) means "nothing seen yet", and
no exp(-inf - (-inf)) is ever formed: a row of all -inf gives p = 0 and L = -inf. A NaN or
+inf is not: it makes its row's p and L NaN (+inf - +inf is NaN), and only its row, as
PyTorch's softmax does (``kernels.reference``). Every max propagates NaN (``nan_max`` on
the device; NumPy's ``max``/``maximum`` do), and a row is empty when l == 0, not when
"not l > 0" (that would call a NaN row empty).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, float64, int32

from kernels.base.fused import FASTMATH, nan_max
from kernels.base.inlined import inlined
from kernels.base.runtime import (ArrayKind, cdiv, check_array, check_flag, check_int, check_out, device_empty,
                                   on_simulator, to_device)

__all__ = [
    "softmax",
    "softmax_3pass",
    "softmax_2pass",
    "online_state",
    "merge",
    "IDENTITY",
    "attend_1pass",
    "make_row_softmax",
    "merge_state",
    "make_first_online_softmax",
    "first_softmax",
    "ptx_targets",
]


# =========================================================================== the NumPy ladder
# Every function works on the last axis of an array of any rank (a "row" is x[..., :]).

def _safe(m):
    """The max to subtract: m itself, or 0 where m = -inf (an all -inf row, or no elements),
    so that x - m is -inf (exp gives 0), never -inf - (-inf) = NaN."""
    return np.where(m == -np.inf, 0.0, m)


def softmax_3pass(x):
    """Safe softmax in three passes over each row: max, sum, normalise."""
    x = np.asarray(x)
    if x.shape[-1] == 0:
        return x.copy()
    m = np.max(x, axis=-1, keepdims=True)            # pass 1: read x
    e = np.exp(x - _safe(m))
    l = np.sum(e, axis=-1, keepdims=True)            # pass 2: read x (e is recomputed on a GPU)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(l != 0, np.exp(x - _safe(m)) / l, 0.0).astype(x.dtype)  # pass 3: read x, write p


def online_state(x):
    """The (m, l) of each row in ONE pass: m = max so far, l = sum of exp(x - m) so far.

    When a new element raises the max from m_old to m_new, every term already in l was
    taken relative to m_old: multiplying by exp(m_old - m_new) moves them to m_new.
    """
    x = np.asarray(x)
    m = np.full(x.shape[:-1], -np.inf, dtype=x.dtype)
    l = np.zeros(x.shape[:-1], dtype=x.dtype)
    for j in range(x.shape[-1]):                     # one read of x, element by element
        xj = x[..., j]
        m_new = np.maximum(m, xj)
        s = _safe(m_new)
        l = l * np.exp(m - s) + np.exp(xj - s)       # rescale the old sum, add the new term
        m = m_new
    return m, l


def softmax_2pass(x):
    """Online softmax: one pass for (m, l), one pass to write p = exp(x - m) / l."""
    x = np.asarray(x)
    m, l = online_state(x)                           # pass 1: read x
    m, l = m[..., None], l[..., None]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(l != 0, np.exp(x - _safe(m)) / l, 0.0).astype(x.dtype)  # pass 2: read x, write p


IDENTITY = (-np.inf, 0.0)
"""The state of an empty piece of a row: merge(IDENTITY, s) == s for every state s."""


def merge(a, b):
    """Combine the (m, l) states of two disjoint pieces of a row into the state of both.

        m = max(m1, m2),   l = l1 * exp(m1 - m) + l2 * exp(m2 - m)

    Associative and commutative, identity (-inf, 0). Works on scalars or arrays of rows.
    When both maxima are -inf, m is -inf and l is 0: exp(m1 - m) is never -inf - (-inf).
    """
    (m1, l1), (m2, l2) = a, b
    m = np.maximum(m1, m2)
    s = _safe(m)
    return m, l1 * np.exp(m1 - s) + l2 * np.exp(m2 - s)


def logsumexp_of(state):
    """L = m + log l, -inf for the empty state."""
    m, l = state
    with np.errstate(divide="ignore"):
        return np.where(l != 0, _safe(m) + np.log(np.where(l != 0, l, 1.0)), -np.inf)


def attend_1pass(x, v):
    """o = softmax(x) @ v in ONE pass over the row, never writing p.

    x: (..., n) scores, v: (n, d) values. The running output o is rescaled exactly like l;
    dividing by l happens once at the end. This is FlashAttention's inner loop (chapter 4)
    with one score at a time instead of a tile. Returns (o, L).
    """
    x, v = np.asarray(x), np.asarray(v)
    m = np.full(x.shape[:-1], -np.inf, dtype=x.dtype)
    l = np.zeros(x.shape[:-1], dtype=x.dtype)
    o = np.zeros(x.shape[:-1] + v.shape[-1:], dtype=np.result_type(x, v))
    for j in range(x.shape[-1]):
        xj = x[..., j]
        m_new = np.maximum(m, xj)
        s = _safe(m_new)
        alpha, pj = np.exp(m - s), np.exp(xj - s)
        l = l * alpha + pj
        o = o * alpha[..., None] + pj[..., None] * v[j]
        m = m_new
    with np.errstate(invalid="ignore", divide="ignore"):
        o = np.where(l[..., None] != 0, o / np.where(l != 0, l, 1.0)[..., None], 0.0)
    return o, logsumexp_of((m, l))


# =========================================================================== the kernel

_NEG_INF = float32(-math.inf)
# The last five steps of the tree only exchange data inside one warp, where a warp barrier
# (cheap) is enough. The simulator has no cuda.syncwarp: there a block barrier stands in
# (every thread of the block runs the same steps, so it is reached by all).
if on_simulator():
    @cuda.jit(device=True)
    def _syncwarp():
        cuda.syncthreads()
else:
    @inlined
    def _syncwarp():
        cuda.syncwarp()
# FASTMATH has no nnan/ninf: -inf is a real input here (masked logits) and a NaN must reach
# its row, so the compiler may not assume them away. "afn" still gives the fast exp
# (ex2.approx), the rest the usual fast-math freedoms. Every max is ``nan_max``: Numba's
# ``max`` drops a NaN argument, and a NaN row would come out finite.


@inlined
def merge_state(m1, l1, m2, l2):
    """merge((m1, l1), (m2, l2)) on the device: the same operator as ``merge``."""
    m = nan_max(m1, m2)
    if m == _NEG_INF:                                # both pieces empty (or all -inf)
        return m, float32(0.0)
    return m, l1 * math.exp(m1 - m) + l2 * math.exp(m2 - m)


@functools.lru_cache(maxsize=None)
def make_row_softmax(tpr: int, rpb: int, k: int):
    """The row-softmax kernel for TPR threads a row, RPB rows a block, K floats a thread
    in registers. Launch with ``cdiv(rows, RPB)`` blocks of ``TPR * RPB`` threads:
    ``kernel[blocks, TPR * RPB](x, p, lse)`` with x, p: (rows, n) float32, lse: (rows,).
    """
    TPR, RPB, K = tpr, rpb, k
    NT = TPR * RPB                                   # threads a block
    CHUNK = int32(TPR * K)                           # elements a row-sweep step covers

    @cuda.jit(fastmath=FASTMATH)
    def row_softmax(x, p, lse):
        sm_m = cuda.shared.array(NT, float32)        # one (m, l) state a thread, for the tree
        sm_l = cuda.shared.array(NT, float32)
        xr = cuda.local.array(K, float32)            # this thread's chunk: registers

        rows = x.shape[0]
        n = int32(x.shape[1])
        tid = int32(cuda.threadIdx.x)
        rib = tid // TPR                             # row in block
        t = tid - rib * TPR                          # thread within the row
        row = cuda.blockIdx.x * RPB + rib
        valid = row < rows
        r = row if valid else 0                      # threads past the last row still join barriers

        # ---- pass 1: online (m, l) over this thread's strided slice, chunk by chunk
        m = _NEG_INF
        l = float32(0.0)
        base = int32(0)
        while base < n:
            mc = _NEG_INF
            for i in range(K):                       # K independent coalesced loads in flight
                j = base + t + int32(i * TPR)
                v = x[r, j] if (valid and j < n) else _NEG_INF
                xr[i] = v
                mc = nan_max(mc, v)
            m_new = nan_max(m, mc)
            if m_new != _NEG_INF:                    # else: nothing but -inf so far, state stays (-inf, 0)
                lc = float32(0.0)
                for i in range(K):
                    lc += math.exp(xr[i] - m_new)
                l = l * math.exp(m - m_new) + lc     # = merge((m, l), (mc, lc)) with the chunk's state
                m = m_new
            base += CHUNK

        # ---- tree reduction of the row's TPR states in shared memory: log2(TPR) merge steps
        sm_m[tid] = m
        sm_l[tid] = l
        s = TPR // 2
        while s > 0:
            if s >= 32:
                cuda.syncthreads()                   # partners in other warps: a block barrier
            else:
                _syncwarp()                          # partners in the same warp: a warp barrier is enough
            if t < s:
                mm, ll = merge_state(sm_m[tid], sm_l[tid], sm_m[tid + s], sm_l[tid + s])
                sm_m[tid] = mm
                sm_l[tid] = ll
            s //= 2
        cuda.syncthreads()
        m = sm_m[rib * TPR]
        l = sm_l[rib * TPR]

        # ---- pass 2: p = exp(x - m) / l (a row of all -inf has l = 0: p = 0; a row with a
        # NaN or +inf has l = NaN: p = NaN, L = NaN)
        empty = l == float32(0.0)
        if empty:
            inv_l = float32(0.0)
            m = float32(0.0)                          # x - m stays -inf, never NaN
        else:
            inv_l = float32(1.0) / l
        if valid:
            if t == 0:
                lse[r] = _NEG_INF if empty else m + math.log(l)
            one_chunk = n <= CHUNK
            base = int32(0)
            while base < n:
                for i in range(K):
                    j = base + t + int32(i * TPR)
                    if j < n:
                        v = xr[i] if one_chunk else x[r, j]   # the row on chip: no second read
                        p[r, j] = math.exp(v - m) * inv_l
                base += CHUNK

    return row_softmax


# =========================================================================== the launcher

_POW2_THREADS = (32, 64, 128, 256, 512, 1024)


def default_tiles(n: int) -> tuple[int, int, int]:
    """(threads a row, rows a block, floats a thread) for rows of n elements.

    GPU: enough threads that a row fits in registers at <= 32 floats a thread (n <= 16384),
    at least 4 warps a block (short rows share a block, a warp each).
    Simulator: one or two warps a block, a few floats a thread.
    """
    if on_simulator():
        return 32, 2, max(1, min(4, cdiv(n, 32)))
    return _gpu_tiles(n)


def softmax(x, *, return_lse=False, threads_per_row=None, rows_per_block=None, per_thread=None):
    """Softmax over the last axis of a float32 array of any rank >= 1, on the GPU.

    x: NumPy array (result is NumPy) or device array (CuPy, PyTorch CUDA, Numba: the result
    stays on the device). Rows of any length n >= 0; a row of all -inf gives zeros.
    return_lse: also return L = logsumexp over the last axis (shape x.shape[:-1]; -inf for
    an all -inf or empty row), computed in the same pass.
    threads_per_row (32..1024, a power of two), rows_per_block (threads_per_row *
    rows_per_block <= 1024), per_thread (1..32 floats a thread keeps in registers): the
    tiles; defaults from ``default_tiles``. Rows longer than threads_per_row * per_thread
    are swept in chunks and read twice.
    """
    shape, _ = check_array(x, "x", dtypes=(np.float32,))
    if len(shape) < 1:
        raise ValueError(f"x: expected at least 1 dimension (softmax runs over the last axis), got shape {shape}")
    return_lse = check_flag(return_lse, "return_lse")
    n = shape[-1]
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    tpr, rpb, k = default_tiles(n)
    if threads_per_row is not None:
        tpr = check_int(threads_per_row, "threads_per_row", 32, 1024, choices=_POW2_THREADS)
        if rows_per_block is None:
            rpb = max(1, 128 // tpr)
    if rows_per_block is not None:
        rpb = check_int(rows_per_block, "rows_per_block", 1, 32)
    if per_thread is not None:
        k = check_int(per_thread, "per_thread", 1, 32)
    if tpr * rpb > 1024:
        raise ValueError(f"rows_per_block: threads_per_row * rows_per_block must be <= 1024, got {tpr} * {rpb}")

    if n >= 2**31:
        raise ValueError(f"x: expected rows shorter than 2**31 elements, got {n}")

    kind = ArrayKind(x)
    empty = rows == 0 or n == 0
    # A host array is copied over; a device array is viewed (and refused if not C-contiguous).
    xd = to_device(x, "x") if (kind.on_device or not empty) else None
    if empty:                                        # nothing to launch: empty p, L = log(0) = -inf
        p = np.empty(shape, np.float32)
        lse = np.full(shape[:-1], -np.inf, dtype=np.float32)
        if kind.on_device:
            p, lse = device_empty(shape), cuda.to_device(lse)
        else:
            return (p, lse) if return_lse else p
    else:
        x2 = xd.reshape(rows, n)
        p2 = device_empty((rows, n))
        lse1 = device_empty((rows,))
        make_row_softmax(tpr, rpb, k)[cdiv(rows, rpb), tpr * rpb](x2, p2, lse1)
        p, lse = p2.reshape(shape), lse1.reshape(shape[:-1])
    if return_lse:
        return kind.give_back(p), kind.give_back(lse)
    return kind.give_back(p)


# =========================================================================== the exercises' kernels
# The notebook's two kernel exercises (their solutions, not printed there). A learner's
# versions replace them through ``kernels.base.learner``; tests/test_online_softmax.py
# grades them: ``merge_state`` through the production kernel's tree of merges (the
# launcher ``softmax``), the first online softmax through ``first_softmax``.

EXERCISES = {"merge_state": "test_softmax_matches_oracle or test_nan_or_inf",
             "make_first_online_softmax": "first_softmax"}


@functools.lru_cache(maxsize=None)
def make_first_online_softmax():
    """Kernel (x, p, lse) on (rows, n) float32 arrays, one thread a row (thread r of the
    grid takes row r): one sweep keeps the running (m, l), rescaling l when m grows, a
    second writes p = exp(x - m) / l; lse = m + log l. A row of all -inf (or empty) gets
    p = 0 and L = -inf; a NaN anywhere in a row makes the row NaN."""

    @cuda.jit(fastmath=FASTMATH)
    def first_online_softmax(x, p, lse):
        r = cuda.grid(1)
        if r >= x.shape[0]:
            return
        m = _NEG_INF
        l = float64(0.0)                              # one running sum over the row: float64
        for j in range(x.shape[1]):
            v = x[r, j]
            m_new = nan_max(m, v)
            if m_new != _NEG_INF:
                l = l * math.exp(m - m_new) + math.exp(v - m_new)
                m = m_new
        if l == 0.0:                                  # nothing but -inf: zeros, L = -inf
            for j in range(x.shape[1]):
                p[r, j] = float32(0.0)
            lse[r] = _NEG_INF
            return
        inv = float32(1.0 / l)
        for j in range(x.shape[1]):
            p[r, j] = math.exp(x[r, j] - m) * inv
        lse[r] = float32(float64(m) + math.log(l))

    return first_online_softmax


def first_softmax(x, *, out=None, lse_out=None):
    """Softmax over the last axis of a 2-D float32 array (rows, n) by
    ``make_first_online_softmax``'s kernel, one thread a row: (p, lse). ``out``/``lse_out``:
    device arrays of shapes (rows, n) and (rows,) to write into (returned as given)."""
    shape, _ = check_array(x, "x", ndim=2, dtypes=(np.float32,))
    rows, n = shape
    kind = ArrayKind(x)
    p, lse = check_out(out, "out", shape), check_out(lse_out, "lse_out", (rows,))
    p = device_empty(shape) if p is None else p
    lse = device_empty((rows,)) if lse is None else lse
    if rows:
        threads = 32 if on_simulator() else 128
        make_first_online_softmax()[cdiv(rows, threads), threads](to_device(x, "x"), p, lse)
    return (out if out is not None else kind.give_back(p),
            lse_out if lse_out is not None else kind.give_back(lse))


# =========================================================================== PTX targets (CI)

def ptx_targets():
    """Every kernel at its production tiles, for ``numba.cuda.compile_ptx`` on sm_90."""
    sig = "void(float32[:, ::1], float32[:, ::1], float32[::1])"
    out = []
    for n in (128, 1024, 4096, 16384):               # longer rows use the n=16384 kernel, in chunks
        tpr, rpb, k = _gpu_tiles(n)
        out.append((f"row softmax fp32 n={n} TPR={tpr} RPB={rpb} K={k}", make_row_softmax(tpr, rpb, k), sig))
    out.append(("row softmax fp32 TPR=1024 RPB=1 K=16", make_row_softmax(1024, 1, 16), sig))
    out.append(("first online softmax fp32 (one thread a row)", make_first_online_softmax(), sig))
    return out


def _gpu_tiles(n):
    """Production tiles: TPR doubles until 16 floats a thread cover the row (at most 512),
    then K doubles until TPR * K covers it (at most 32 floats a thread in registers)."""
    tpr = 32
    while tpr < 512 and tpr * 16 < n:
        tpr *= 2
    k = 1
    while k < 32 and tpr * k < n:
        k *= 2
    return tpr, max(1, 128 // tpr), k


# =========================================================================== the merge property
# Shared by the tests and the notebook's exercise checker: split a row into chunks (some
# possibly empty), take each chunk's (m, l), combine them with ``merge_fn`` in a random
# order along a random binary tree, and compare with the (m, l) of the whole row.

class MergeTreeCase:
    """A row, the cut points that split it into chunks, and a tree over the chunks."""

    def __init__(self, x, cuts, tree):
        self.x, self.cuts, self.tree = x, cuts, tree

    def chunks(self):
        edges = [0, *self.cuts, len(self.x)]
        return [self.x[a:b] for a, b in zip(edges[:-1], edges[1:])]

    def __repr__(self):
        return f"MergeTreeCase(x={np.array2string(self.x, precision=3)}, cuts={self.cuts}, tree={self.tree})"


def chunk_state(chunk):
    """(m, l) of one chunk, computed directly (float64); (-inf, 0) for no finite element."""
    chunk = np.asarray(chunk, dtype=np.float64)
    if chunk.size == 0 or np.max(chunk) == -np.inf:
        return -np.inf, 0.0
    m = float(np.max(chunk))
    return m, float(np.sum(np.exp(chunk - m)))


def eval_tree(tree, states, merge_fn):
    """Merge the leaf states along ``tree`` (an int is a leaf, a pair is a merge)."""
    if isinstance(tree, int):
        return states[tree]
    left, right = tree
    return merge_fn(eval_tree(left, states, merge_fn), eval_tree(right, states, merge_fn))


def merge_tree_cases(max_n=48, max_chunks=8):
    """Hypothesis strategy for ``MergeTreeCase``: rows with -inf entries and large logits,
    empty chunks, any permutation of the chunks and any binary tree shape."""
    from hypothesis import strategies as st

    @st.composite
    def cases(draw):
        n = draw(st.integers(1, max_n))
        magnitude = draw(st.sampled_from([0.1, 1.0, 30.0, 1e4]))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        x = rng.standard_normal(n) * magnitude
        masked = draw(st.sampled_from(["none", "some", "all"]))
        if masked == "some":
            x[rng.random(n) < 0.5] = -np.inf
        elif masked == "all":
            x[:] = -np.inf
        n_chunks = draw(st.integers(1, max_chunks))
        cuts = sorted(draw(st.lists(st.integers(0, n), min_size=n_chunks - 1, max_size=n_chunks - 1)))
        leaves = draw(st.permutations(list(range(n_chunks))))

        def build(items):
            if len(items) == 1:
                return items[0]
            k = draw(st.integers(1, len(items) - 1))
            return (build(items[:k]), build(items[k:]))

        return MergeTreeCase(x, cuts, build(list(leaves)))

    return cases()


def check_merge_tree(merge_fn, case, *, rtol=1e-12):
    """The property: any order, any tree of ``merge_fn`` over the chunk states gives the
    whole row's (m, l): m exactly, l within float64 rounding, never NaN."""
    states = [chunk_state(c) for c in case.chunks()]
    with np.errstate(invalid="raise"):               # exp(-inf - (-inf)) would raise here
        m, l = eval_tree(case.tree, states, merge_fn)
    m_true, l_true = chunk_state(case.x)
    m, l = float(np.asarray(m)), float(np.asarray(l))
    assert not math.isnan(m) and not math.isnan(l), f"merge gave NaN: (m, l) = ({m}, {l})"
    assert m == m_true, f"m = {m}, expected the row max {m_true} exactly"
    assert abs(l - l_true) <= rtol * len(case.x) * max(l_true, 1.0), f"l = {l!r}, expected {l_true!r}"
