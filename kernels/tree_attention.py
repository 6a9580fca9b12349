"""Chapter 9, on one GPU: P shards of the KV cache as P devices, and their partials reduced as a tree.

Tree Attention (Shyam et al., arXiv 2408.04093) spreads a long sequence over p devices:
device s holds a contiguous shard of the keys and values, attends to it alone, and keeps
a partial (O_s, L_s): O_s = softmax(S[:, shard]) V[shard], L_s = logsumexp(S[:, shard]).
Because L = logsumexp over all keys is the logsumexp of the L_s, the partials reduce to
the exact answer (their Algorithm 3):

    m = allreduce_max(L_s)
    O = allreduce_sum(exp(L_s - m) O_s) / allreduce_sum(exp(L_s - m)),    L = m + log(that sum)

and an all-reduce takes log2(p) rounds of pairwise exchanges (a tree), whatever p is.

Here the devices are pieces of one GPU, so the idea can be seen and timed on one card:

    shard s          split-K's split s of the decode chapter (``kernels.decode``): keys
                     [s c, (s+1) c) of each sequence, c = ceil(n / P); shards past the
                     end of a short cache are empty (O_s = 0, L_s = -inf).
    the partials     ``kernels.decode.make_split_k``'s kernel, grid (P, row tiles,
                     B*Hkv): block (s, ...) is device s.
    flat reduction   ``kernels.decode.make_combine``: one block a (row tile, KV head)
                     folds the P partials one after the other: P - 1 merges in a chain.
    tree reduction   ``make_tree_reduce`` (below): ceil(log2 P) levels of pairwise merges.

The tree. Slot s holds device s's state: chapter 3's (m, l) = (L_s, 1) (l = 0 for an
empty shard) and the unnormalised Õ = l O_s. At level k (stride 2^k) every slot
i = 0, 2^(k+1), 2 2^(k+1), ... takes slot j = i + 2^k in, as two devices of a tree
all-reduce would exchange and merge:

    (m, l) = merge((m_i, l_i), (m_j, l_j))                      chapter 3's merge_state
    Õ_i    = exp(m_i - m) Õ_i + exp(m_j - m) Õ_j

When P is not a power of two a slot may find no partner (j >= P): it is carried to the
next level unchanged (the odd one out of that level). After ceil(log2 P) levels slot 0
holds everything: O = Õ / l, L = m + log l (O = 0, L = -inf if l = 0: no key seen). This
is the reduce half of an all-reduce; on one GPU nobody needs the broadcast back.

How the kernel is organised. One block a (query row, KV head, chunk of DC columns of O)
loads the P partials' columns into shared memory once, then runs every level in place,
with one barrier a level. Why not one launch a level: a launch costs microseconds on the
host and the GPU, 6 of them for P = 64, about the whole budget a reduction may add to a
128k-token decode step (5% of about 0.23 ms on an H100); a barrier costs tens of
nanoseconds, and the partials are read from HBM (L2) once. The (m, l) states are kept
twice, for this level and the next (``sm``/``sl`` [level parity, slot]): a level reads one
copy and writes the other, so the threads of a slot's columns all read the old state
before anyone writes the new one, with the single barrier a level. DC is chosen so that
PMAX x DC floats fit in 16 KB (PMAX: P rounded up to a power of two, compile time).

The launcher is ``tree_decode_attention(q, k_cache, v_cache, shards=P, reduce="tree" |
"flat", cache_lengths=..., causal=..., scale=...)``, returning (o, lse) like
``decode_attention``; ``prepare_tree_decode`` plans it once and runs the partials and
the reduction separately (what the bench times); ``tree_reduce_partials`` runs either
reduction on partials you give it; ``tree_levels`` and ``tree_reduce_numpy`` are the tree
in Python (the schedule and its float64 twin).
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict

import numpy as np
from numba import cuda, float32, int32, uint64

from kernels import decode
from kernels.base.fused import FASTMATH, MAX_GRID_Y, MINUS_INF, padded_head_dim
from kernels.base.runtime import (
    ArrayKind,
    LaunchTemplate,
    cdiv,
    check_array,
    check_int,
    device_empty,
    device_pointer,
    is_device_array,
    on_simulator,
    to_device,
)
from kernels.decode import split_ranges
from kernels.online_softmax import merge_state

__all__ = ["tree_decode_attention", "prepare_tree_decode", "PreparedTreeDecode", "tree_reduce_partials",
           "tree_levels", "tree_reduce_numpy", "shard_ranges", "make_tree_reduce", "tree_plan", "partial_bytes",
           "tree_threads", "REDUCTIONS", "MAX_SHARDS", "ptx_targets"]

REDUCTIONS = ("tree", "flat")
MAX_SHARDS = 1024                 # split-K's limit on splits
SHARED_FLOATS = 4096              # PMAX x DC floats of O a block keeps in shared memory (16 KB)
MAX_DC = 32                       # columns a block (more blocks, each with less to do)


# --------------------------------------------------------------------------- the tree in Python

def shard_ranges(n_keys: int, shards: int) -> list[tuple[int, int]]:
    """The key ranges [start, end) of the ``shards`` devices for a sequence of n_keys keys:
    split-K's cut (``kernels.decode.split_ranges``), contiguous, the last ones shorter or empty."""
    return split_ranges(n_keys, shards)


def tree_levels(shards: int) -> list[list[tuple[int, int | None]]]:
    """The tree's schedule: for each level k (stride 2^k), the live slots i (multiples of
    2^(k+1)) with the slot j = i + 2^k each takes in, or None where j >= shards (the slot
    is carried over unchanged). ceil(log2(shards)) levels; slot 0 ends with everything.

    >>> tree_levels(5)
    [[(0, 1), (2, 3), (4, None)], [(0, 2), (4, None)], [(0, 4)]]"""
    shards = check_int(shards, "shards", 1, MAX_SHARDS)
    levels, stride = [], 1
    while stride < shards:
        levels.append([(i, i + stride if i + stride < shards else None) for i in range(0, shards, 2 * stride)])
        stride *= 2
    return levels


def tree_reduce_numpy(o_parts, l_parts):
    """The tree in float64 NumPy, level by level as ``tree_levels`` orders it, with the
    kernel's state ((m, l) and the unnormalised Õ a slot). o_parts (P, ..., d), l_parts
    (P, ...): partial s's normalised O_s and L_s (an empty piece: L_s = -inf). Returns
    (O, L); equal to ``kernels.decode.merge_partials_numpy`` (any order: the merge is
    associative)."""
    o_parts, l_parts = np.asarray(o_parts, np.float64), np.asarray(l_parts, np.float64)
    P = l_parts.shape[0]
    m = l_parts.copy()
    l = np.where(l_parts == -np.inf, 0.0, 1.0)
    o = np.where(l[..., None] > 0, o_parts, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        for level in tree_levels(P):
            for i, j in level:
                if j is None:                        # the odd one out: carried over
                    continue
                mx = np.maximum(m[i], m[j])          # (NaN if either is)
                base = np.where(mx == -np.inf, 0.0, mx)
                wi, wj = np.exp(m[i] - base), np.exp(m[j] - base)
                o[i] = wi[..., None] * o[i] + wj[..., None] * o[j]
                l[i] = wi * l[i] + wj * l[j]
                m[i] = mx
        seen = l[0] > 0
        out = np.where(seen[..., None], o[0] / np.where(seen, l[0], 1.0)[..., None], 0.0)
        lse = np.where(seen, m[0] + np.log(np.where(seen, l[0], 1.0)), -np.inf)
    nan = np.isnan(l[0])
    return np.where(nan[..., None], np.nan, out), np.where(nan, np.nan, lse)


# --------------------------------------------------------------------------- the tree kernel

def tree_plan(shards: int, D: int) -> tuple[int, int]:
    """(DC, PMAX): columns of O a block reduces, and the slots its shared memory holds
    (``shards`` rounded up to a power of two), with PMAX x DC <= SHARED_FLOATS."""
    pmax = 1 << max(0, int(shards) - 1).bit_length()
    return max(1, min(D, MAX_DC, SHARED_FLOATS // pmax)), pmax


@functools.lru_cache(maxsize=None)
def make_tree_reduce(DC: int, PMAX: int, THREADS: int):
    """The tree reduction. Grid (rows, B*Hkv, ceil(d / DC)), THREADS threads.

    o_part (slots, RT, d) and l_part (slots, RT) float32, as ``make_split_k`` writes them:
    partial s of row ``row`` of KV head bk in slot (bk * tiles + row // RT) * shards + s,
    row row % RT of it (tiles = ceil(rows / RT)). Block (row, bk, z) reduces columns
    z DC .. z DC + DC - 1 of that row's ``shards`` (<= PMAX) partials and writes them to
    o (B*Hkv, rows, d); block z = 0 writes L to lse (B*Hkv, rows)."""

    @cuda.jit(fastmath=FASTMATH)
    def tree_reduce(o_part, l_part, o, lse, shards, d):
        row = int32(cuda.blockIdx.x)
        bk = int32(cuda.blockIdx.y)
        c0 = int32(cuda.blockIdx.z) * DC          # this block's first column of O
        tid = int32(cuda.threadIdx.x)
        rt = int32(o_part.shape[1])
        tiles = (int32(o.shape[1]) + rt - 1) // rt
        first = (bk * tiles + row // rt) * shards  # device 0's slot
        r = row % rt
        so = cuda.shared.array((PMAX, DC), float32)   # Õ of each slot (device): DC columns
        sm = cuda.shared.array((2, PMAX), float32)    # (m, l) of each slot, this level's and the next
        sl = cuda.shared.array((2, PMAX), float32)

        # ---- each device's partial: Õ_s = O_s (l_s = 1), or nothing (l_s = 0) if L_s = -inf
        for e in range(tid, shards * DC, THREADS):
            s = e // DC
            c = e % DC
            x = float32(0.0)
            if c0 + c < d:
                x = o_part[uint64(first + s), uint64(r), uint64(c0 + c)]
            so[s, c] = x
        for s in range(tid, shards, THREADS):
            l_s = l_part[uint64(first + s), uint64(r)]
            sm[0, s] = l_s
            sl[0, s] = float32(0.0) if l_s == MINUS_INF else float32(1.0)
        cuda.syncthreads()

        # ---- level by level: slot i takes slot j = i + stride in; one barrier a level
        cur = int32(0)
        stride = int32(1)
        while stride < shards:
            live = (shards + 2 * stride - 1) // (2 * stride)     # slots i = 0, 2 stride, ... < shards
            for e in range(tid, live * DC, THREADS):
                i = (e // DC) * 2 * stride
                c = e % DC
                j = i + stride
                m_i = sm[cur, i]
                m = m_i
                l = sl[cur, i]
                if j < shards:                    # (else: the odd one out, carried over)
                    m_j = sm[cur, j]
                    m, l = merge_state(m_i, l, m_j, sl[cur, j])  # chapter 3
                    if m != MINUS_INF:            # Õ_i = exp(m_i - m) Õ_i + exp(m_j - m) Õ_j
                        so[i, c] = so[i, c] * math.exp(m_i - m) + so[j, c] * math.exp(m_j - m)
                if c == 0:                        # the state of the next level, in the other copy
                    sm[1 - cur, i] = m
                    sl[1 - cur, i] = l
            cuda.syncthreads()
            cur = 1 - cur
            stride = stride * int32(2)

        # ---- slot 0 holds every shard: O = Õ / l, L = m + log l
        m = sm[cur, 0]
        l = sl[cur, 0]
        for c in range(tid, DC, THREADS):
            if c0 + c < d:
                x = float32(0.0)
                if l != float32(0.0):             # (l = 0: no key seen, O = 0; a NaN stays NaN)
                    x = so[0, c] / l
                o[uint64(bk), uint64(row), uint64(c0 + c)] = x
        if tid == 0 and c0 == 0:
            lse[uint64(bk), uint64(row)] = MINUS_INF if l == float32(0.0) else m + math.log(l)

    return tree_reduce


# --------------------------------------------------------------------------- the launches

def _check(shards, reduce):
    shards = check_int(shards, "shards", 1, MAX_SHARDS)
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce: expected 'tree' or 'flat', got {reduce!r}")
    return shards


def tree_threads() -> int:
    """A tree block's threads: 128 on the GPU; 8 in the simulator (every simulated thread
    is a Python thread, and the tree has no warp-wide step that needs 32)."""
    return 8 if on_simulator() else decode.GPU_THREADS


class _TreeLaunches:
    """The launches of one call, made once: the P devices' partials (split-K's first
    kernel with P splits) and both reductions of them (``reduction["tree"]``, and
    ``reduction["flat"]``: split-K's combine), which write O and L. With P = 1 the one
    device's partial is the answer: split-K writes O and L itself, nothing is reduced."""

    def __init__(self, call, shards: int, views: dict):
        c = self.call = call
        self.shards = shards
        p = self.p = decode.plan(c.d, c.rows, c.kv_itemsize, wide=c.wide, q_itemsize=c.q_itemsize,
                                 tensor_cores=c.tensor_cores)
        tiles = cdiv(c.rows, p.RT)
        lengths = cuda.to_device(np.asarray(c.lengths, np.int32))
        common = (np.int32(c.n_q), np.int32(c.d), np.float32(c.scale), np.int32(c.causal))
        slots = c.BK * tiles * shards if shards > 1 else 1
        self.o_part = device_empty((slots, p.RT, c.d))        # the devices' partials (O_s, L_s)
        self.l_part = device_empty((slots, p.RT))
        args = (views["q"], views["k"], views["v"], self.o_part, self.l_part, views["o"], views["lse"], lengths,
                *common)
        self.partials = [LaunchTemplate(decode.make_split_k(*p.key), (shards, tiles, c.BK), p.threads, args,
                                        dict(q=0, k=1, v=2, o=5, lse=6))]
        self.reduction = {"tree": [], "flat": []}
        if shards == 1:
            return
        red_args = (self.o_part, self.l_part, views["o"], views["lse"], np.int32(shards), np.int32(c.d))
        self.reduction["flat"] = [LaunchTemplate(decode.make_combine(p.D, p.RT, p.threads), (tiles, c.BK),
                                                 p.threads, red_args, dict(o=2, lse=3))]
        DC, PMAX = tree_plan(shards, p.D)
        threads = tree_threads()
        self.reduction["tree"] = [LaunchTemplate(make_tree_reduce(DC, PMAX, threads), (c.rows, c.BK, cdiv(c.d, DC)),
                                                 threads, red_args, dict(o=2, lse=3))]

    def operands(self, q, k, v, o, lse) -> dict:
        if on_simulator():
            return _views(self.call, q, k, v, o, lse)
        return dict(q=device_pointer(q, "q"), k=device_pointer(k, "k_cache"), v=device_pointer(v, "v_cache"),
                    o=device_pointer(o, "o"), lse=device_pointer(lse, "lse"))


def _views(c, q, k, v, o, lse) -> dict:
    """Numba device views in the kernels' shapes: q (B*Hkv, g*Nq, d), k and v (B*Hkv, Nmax, d), ..."""
    return dict(q=to_device(q, "q").reshape(c.BK, c.rows, c.d),
                k=to_device(k, "k_cache").reshape(c.BK, c.n_max, c.d),
                v=to_device(v, "v_cache").reshape(c.BK, c.n_max, c.d),
                o=to_device(o, "o").reshape(c.BK, c.rows, c.d), lse=to_device(lse, "lse").reshape(c.BK, c.rows))


_launches: OrderedDict = OrderedDict()
MAX_CACHED_CALLS = 16


def _launches_for(call, shards, q, k, v, o, lse) -> _TreeLaunches:
    """The launches of a call, cached (the last MAX_CACHED_CALLS): the key holds the
    combine's factory, so that a learner's ``make_combine`` is planned anew."""
    key = (call, shards, decode.make_combine)
    launches = _launches.get(key)
    if launches is None:
        launches = _launches[key] = _TreeLaunches(call, shards, _views(call, q, k, v, o, lse))
        if len(_launches) > MAX_CACHED_CALLS:
            _launches.popitem(last=False)
    else:
        _launches.move_to_end(key)
    return launches


class PreparedTreeDecode:
    """A tree decode planned once (``prepare_tree_decode``); calling it runs the P devices'
    partials and their reduction and returns (o, lse) (on the device: the same arrays every
    call). The steps one by one (what the bench times): ``run_partials()``;
    ``run_reduction(reduce=None)``: "tree" or "flat" (None: the one it was prepared with)
    on the partials of the last ``run_partials`` (nothing for P = 1); ``result()``: (o, lse)
    as they are now. ``partials()``: the partials of the last run on the host, (O_s (P, B,
    Hq, Nq, d), L_s (P, B, Hq, Nq)) (P = 1: the answer itself)."""

    def __init__(self, launches, operands, reduce, give_back):
        self.launches, self._operands, self.reduce, self.result = launches, operands, reduce, give_back
        self.shards = launches.shards if launches is not None else None

    def run_partials(self):
        if self.launches is not None:
            for launch in self.launches.partials:
                launch(**self._operands)

    def run_reduction(self, reduce=None):
        reduce = self.reduce if reduce is None else reduce
        if reduce not in REDUCTIONS:
            raise ValueError(f"reduce: expected 'tree' or 'flat', got {reduce!r}")
        if self.launches is not None:
            for launch in self.launches.reduction[reduce]:
                launch(**self._operands)

    def __call__(self):
        self.run_partials()
        self.run_reduction()
        return self.result()

    def partials(self):
        L = self.launches
        if L is None:
            raise ValueError("partials: this call has no work (no rows or no KV heads)")
        c, P = L.call, L.shards
        if P == 1:
            o, lse = (_host(x) for x in self.result())
            return o[None].astype(np.float32), lse[None].astype(np.float32)
        tiles = cdiv(c.rows, L.p.RT)
        # slot (bk * tiles + tile) * P + s holds rows tile * RT .. of head bk's group, device s
        po = L.o_part.copy_to_host().reshape(c.BK, tiles, P, L.p.RT, c.d).transpose(2, 0, 1, 3, 4)
        pl = L.l_part.copy_to_host().reshape(c.BK, tiles, P, L.p.RT).transpose(2, 0, 1, 3)
        po = po.reshape(P, c.BK, tiles * L.p.RT, c.d)[:, :, :c.rows]
        pl = pl.reshape(P, c.BK, tiles * L.p.RT)[:, :, :c.rows]
        return (np.ascontiguousarray(po.reshape(P, c.B, c.hq, c.n_q, c.d)),
                np.ascontiguousarray(pl.reshape(P, c.B, c.hq, c.n_q)))


def _host(x) -> np.ndarray:
    """A result on the host: NumPy as it is, a PyTorch tensor through .cpu(), else copied."""
    if not is_device_array(x):
        return np.asarray(x)
    return x.cpu().numpy() if hasattr(x, "cpu") else to_device(x, "result").copy_to_host()


def _plan_call(q, k_cache, v_cache, shards, reduce, cache_lengths, causal, scale, tensor_cores):
    shards = _check(shards, reduce)
    # the decode chapter's checks (naming q, k_cache, v_cache, cache_lengths, causal, scale)
    call = decode._check_call(q, k_cache, v_cache, cache_lengths, causal, scale, "split-k", shards, None,
                              tensor_cores)
    if call.BK > MAX_GRID_Y:
        raise ValueError(f"k_cache: expected B * Hkv <= {MAX_GRID_Y} (one grid row a KV head), got {call.BK}")
    return shards, call


def prepare_tree_decode(q, k_cache, v_cache, *, shards, reduce="tree", cache_lengths=None, causal=False,
                        scale=None, tensor_cores=True) -> PreparedTreeDecode:
    """``tree_decode_attention``'s plan, made once (the arguments are the same); see
    ``PreparedTreeDecode`` for what it runs."""
    shards, call = _plan_call(q, k_cache, v_cache, shards, reduce, cache_lengths, causal, scale, tensor_cores)
    kind = ArrayKind(q)
    o = kind.new((call.B, call.hq, call.n_q, call.d))
    lse = kind.new((call.B, call.hq, call.n_q))
    held = tuple(x if is_device_array(x) else to_device(x, name)
                 for x, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")))
    launches = operands = None
    if call.BK and call.rows:
        launches = _launches_for(call, shards, *held, o, lse)
        operands = launches.operands(*held, o, lse)
    if kind.on_device:
        give_back = lambda: (o, lse)              # noqa: E731  (the arrays that ``held`` keeps alive)
    else:
        give_back = lambda: (o.copy_to_host(), lse.copy_to_host())  # noqa: E731
    run = PreparedTreeDecode(launches, operands, reduce, give_back)
    run._held = held                              # q, k, v on the device, for as long as the plan lives
    return run


def tree_decode_attention(q, k_cache, v_cache, *, shards, reduce="tree", cache_lengths=None, causal=False,
                          scale=None, tensor_cores=True):
    """Decode attention with the KV cache cut into ``shards`` devices' shards, reduced as a tree.

    The arguments are ``kernels.decode.decode_attention``'s: q (B, Hq, Nq, d), k_cache and
    v_cache (B, Hkv, Nmax, d) float32 or float16, ``cache_lengths``, ``causal``, ``scale``,
    ``tensor_cores``. ``shards`` (1..1024): P; each sequence's keys are cut into P
    contiguous shards (``shard_ranges``; more shards than keys is allowed: the extra
    shards are empty and weigh nothing); each shard's partial is computed as a device
    would (split-K's split s). ``reduce``: "tree" (``make_tree_reduce``: ceil(log2 P)
    levels of pairwise merges) or "flat" (``kernels.decode.make_combine``: one chain of
    P - 1 merges). Returns (o, lse) like ``decode_attention``: o (B, Hq, Nq, d) and lse
    (B, Hq, Nq) float32, of the kind of array q is."""
    run = prepare_tree_decode(q, k_cache, v_cache, shards=shards, reduce=reduce, cache_lengths=cache_lengths,
                              causal=causal, scale=scale, tensor_cores=tensor_cores)
    return run()


def tree_reduce_partials(o_parts, l_parts, *, reduce="tree"):
    """The reduction alone, on partials you give it: o_parts (P, H, rows, d) and l_parts
    (P, H, rows) float32 (partial s of row r of head h: O_s normalised, L_s natural log;
    an empty piece O_s = 0, L_s = -inf). "tree": ``make_tree_reduce``; "flat": the decode
    chapter's combine (``kernels.decode.combine_partials``). Returns (O (H, rows, d), L
    (H, rows)) float32 on the host."""
    (P, H, rows, d), _ = check_array(o_parts, "o_parts", ndim=4)
    l_shape, _ = check_array(l_parts, "l_parts", ndim=3)
    if l_shape != (P, H, rows):
        raise ValueError(f"l_parts: expected shape {(P, H, rows)} like o_parts' first three, got {l_shape}")
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce: expected 'tree' or 'flat', got {reduce!r}")
    if not 1 <= P <= MAX_SHARDS:
        raise ValueError(f"o_parts: expected 1..{MAX_SHARDS} partials, got {P}")
    if not 1 <= d <= 128:
        raise ValueError(f"o_parts: expected head dim d in 1..128, got {d}")
    if H > MAX_GRID_Y:
        raise ValueError(f"o_parts: expected at most {MAX_GRID_Y} heads, got {H}")
    if reduce == "flat":
        o, lse = decode.combine_partials(o_parts, l_parts)
        return (o.copy_to_host() if is_device_array(o) else o), (lse.copy_to_host() if is_device_array(lse) else lse)
    o = device_empty((H, rows, d))
    lse = device_empty((H, rows))
    if H and rows:
        host = [x.copy_to_host() if is_device_array(x) else np.asarray(x, np.float32) for x in (o_parts, l_parts)]
        # one row a slot group (RT = 1): row r of head h, device s in slot (h * rows + r) * P + s
        po = np.ascontiguousarray(host[0].transpose(1, 2, 0, 3).reshape(H * rows * P, 1, d))
        pl = np.ascontiguousarray(host[1].transpose(1, 2, 0).reshape(H * rows * P, 1))
        DC, PMAX = tree_plan(P, padded_head_dim(d))
        threads = tree_threads()
        make_tree_reduce(DC, PMAX, threads)[(rows, H, cdiv(d, DC)), threads](
            cuda.to_device(po), cuda.to_device(pl), o, lse, np.int32(P), np.int32(d))
    return o.copy_to_host(), lse.copy_to_host()


# --------------------------------------------------------------------------- bytes

def partial_bytes(B: int, hq: int, n_q: int, d: int, shards: int) -> int:
    """Bytes the partials add to a decode step: each of the P devices' (O_s, L_s) for each
    of the B*Hq*Nq query rows, written once and read once by the reduction (float32); none
    for P = 1. The tree's exchanges between levels stay in shared memory."""
    return 0 if shards == 1 else 2 * shards * B * hq * n_q * (d + 1) * 4


# --------------------------------------------------------------------------- sm_90 PTX check

def ptx_targets():
    """The tree reduction at d = 128 for P = 8 and 64 (DC = 32), and P = 1024 (DC = 4)."""
    from numba import types

    f32_3, f32_2 = types.float32[:, :, ::1], types.float32[:, ::1]
    sig = (f32_3, f32_2, f32_3, f32_2, types.int32, types.int32)
    out = []
    for shards in (8, 64, 1024):
        DC, PMAX = tree_plan(shards, 128)
        out.append((f"tree reduce, P <= {PMAX}, DC = {DC}", make_tree_reduce(DC, PMAX, decode.GPU_THREADS), sig))
    return out

