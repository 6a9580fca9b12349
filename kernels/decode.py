"""Chapter 7: decode. A few new queries against a long KV cache, at the HBM limit.

Every step of a served language model asks, for the Nq newest tokens of each sequence
(Nq = 1, or up to 16 with speculative decoding): attend over everything cached so far.
The arithmetic is tiny, 4d FLOPs per cached key and query row (2 per K or V element
read), so the time is bytes. Reading K and V once is the floor:

    time >= (bytes of K + bytes of V) / HBM read bandwidth

Chapter 4's grid has one block per (query tile, head): at Nq = 1 that is B*H blocks, 32
for B = 1, H = 32, on a GPU of 132 SMs, each block walking the whole cache alone. This
chapter cuts the KEY range instead, and merges the pieces:

    split-K (Flash-Decoding)  grid (splits, row tiles, B*Hkv): block s attends over its
                              slice of the keys and writes a partial (O_s, L_s); a second
                              kernel merges each head's partials.
    stream-K (Lean Attention) a persistent grid of (SMs x blocks per SM) blocks; the work,
                              every (head, key tile) pair laid end to end, is cut into equal
                              contiguous ranges that may cross from one head into the next;
                              the last block to finish a piece of a head merges that head,
                              in the same launch.

A partial is chapter 4 on a slice of the keys: O_s = softmax(S[:, slice]) V[slice] and
L_s = logsumexp(S[:, slice]). Two partials merge as

    L = log(exp L_1 + exp L_2),    O = exp(L_1 - L) O_1 + exp(L_2 - L) O_2

which is chapter 3's (m, l) merge (``kernels.online_softmax.merge_state``) of the states
(m, l) = (L_1, 1) and (L_2, 1), with O carried along; it is associative, so any split and
any order give the same answer, and (O = 0, L = -inf) is the empty piece.

Inside a block. At Nq = 1 a block has one query row, so chapter 4's register tiles (Br =
128 or 256 rows of FMAs per key) would waste all but one. Decode is a matrix-VECTOR product: the
block's 128 threads form streams of LK consecutive lanes; a stream reads one key row at a
time, each lane VEC consecutive elements a load (16 bytes where rows are 16-byte aligned:
8 float16 or 4 float32, ``kernels.base.wide_loads``; else 1), adds its dot product across
the LK lanes with warp shuffles, and keeps its own online-softmax state (m, l, O) for the
block's rows. The block's streams are
splits too: at the end they are merged, in a fixed order, in shared memory.

Real decode inputs:
  cache_lengths   sequence b's keys are its first cache_lengths[b] rows (0 allowed; what
                  lies beyond is never read into the result, NaN garbage included)
  GQA / MQA       Hkv KV heads, Hq = g Hkv query heads; query heads g kv .. g kv + g - 1
                  read KV head kv. Their g*Nq query rows are consecutive in memory, so one
                  block takes them together as its rows: K and V are read once for the group.
  causal          query i of Nq sees key j iff j <= i + cache_lengths[b] - Nq (the new
                  tokens are the last Nq of the sequence)
  fp16 caches     K and V in float16 (half the bytes); arithmetic in float32

The launcher is ``decode_attention(q, k_cache, v_cache, cache_lengths=..., causal=...,
schedule="stream-k" | "split-k")``; ``split_count`` is split-K's wave-efficiency rule and
``stream_k_schedule`` stream-K's cut of the work (an exercise of the chapter). The kernel
exercises (``EXERCISES``): split-K's combine, ``make_combine``, and a first partial, one
block a (query row, split), ``make_first_partial`` (launched by ``first_split_k``).
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from kernels.base.fused import (FASTMATH, LOG2E, MASKED, MAX_GRID_Y, MINUS_INF, make_row_reductions,
                                nan_max, padded_head_dim)
from kernels.base.inlined import inlined
from kernels.base.runtime import (
    ArrayKind,
    LaunchTemplate,
    cdiv,
    check_array,
    check_flag,
    check_int,
    check_out,
    check_scale,
    device_empty,
    device_pointer,
    is_device_array,
    on_simulator,
    to_device,
)
from kernels.base.wide_loads import WIDE_BYTES, is_aligned, make_load
from kernels.online_softmax import merge_state

__all__ = ["decode_attention", "prepare_decode", "PreparedDecode", "DecodeCall", "DecodeLaunches", "DecodePlan", "plan", "make_attend_key_range_mma", "split_count", "wave_efficiency", "stream_k_schedule",
           "StreamKSchedule", "check_schedule", "gpu_slots", "key_tile", "split_ranges", "merge_partials_numpy", "decode_numpy", "make_split_k",
           "make_combine", "make_stream_k", "io_model_bytes", "ptx_targets", "MAX_QUERIES", "EXERCISES",
           "make_first_partial", "first_split_k", "combine_partials"]

MAX_QUERIES = 16                  # new tokens a sequence (speculative decoding drafts up to 16)
GPU_THREADS = 128                 # a block on the GPU: 4 warps (the simulator: one warp)
MAX_ROWS = 16                     # query rows a block (more: several row tiles, K/V re-read from L2)
LN2 = math.log(2.0)


# --------------------------------------------------------------------------- the algorithm in NumPy

def split_ranges(n_keys: int, splits: int) -> list[tuple[int, int]]:
    """The key ranges [start, end) of split-K's ``splits`` slices of n_keys keys: slices of
    ceil(n_keys / splits) keys, the last ones shorter or empty (as the kernel cuts them)."""
    chunk = cdiv(n_keys, splits) if n_keys else 0
    return [(min(s * chunk, n_keys), min((s + 1) * chunk, n_keys)) for s in range(splits)]


def merge_partials_numpy(o_parts, l_parts):
    """Merge partials (O_s, L_s), s along the first axis, into (O, L): chapter 3's merge.

    o_parts (S, ..., d), l_parts (S, ...). An empty piece has L_s = -inf (its O_s is ignored)."""
    o_parts, l_parts = np.asarray(o_parts, np.float64), np.asarray(l_parts, np.float64)
    m = np.max(l_parts, axis=0)
    base = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(l_parts - base)                           # exp(L_s - m): 0 for an empty piece
    l = w.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        o = np.where(l[..., None] > 0, np.einsum("s...,s...d->...d", w, np.where(w[..., None] > 0, o_parts, 0))
                     / np.where(l > 0, l, 1.0)[..., None], 0.0)
        lse = np.where(l > 0, base + np.log(np.where(l > 0, l, 1.0)), -np.inf)
    return o, lse


def decode_numpy(q, k, v, *, cache_lengths=None, causal=False, scale=None, splits=4):
    """Split-K in NumPy: each sequence's keys cut into ``splits`` slices, a partial (O_s, L_s)
    from each (the oracle on the slice), then the merge. Equals ``reference.decode_attention``."""
    from kernels import reference as ref

    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    B, hq, nq, d = q.shape
    group = hq // k.shape[1]
    lengths = np.full(B, k.shape[2]) if cache_lengths is None else np.asarray(cache_lengths)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    o, lse = np.zeros(q.shape), np.full((B, hq, nq), -np.inf)
    for b in range(B):
        n = int(lengths[b])
        kb, vb = np.repeat(k[b, :, :n], group, axis=0), np.repeat(v[b, :, :n], group, axis=0)
        s = scale * q[b] @ np.swapaxes(kb, -1, -2)       # (Hq, Nq, n)
        if causal:
            s = np.where(ref.causal_mask(nq, n), s, -np.inf)
        parts = []
        for start, end in split_ranges(n, splits):
            with np.errstate(invalid="ignore"):
                l_s = ref.logsumexp(s[..., start:end])
                p = np.nan_to_num(ref.softmax(s[..., start:end])) if end > start else s[..., :0]
            parts.append((p @ vb[:, start:end], l_s))
        o[b], lse[b] = merge_partials_numpy([p[0] for p in parts], [p[1] for p in parts])
    return o, lse


# --------------------------------------------------------------------------- the shape of a launch

@dataclass(frozen=True)
class DecodePlan:
    """Compile-time shape of the decode kernels for one problem.

    D   the padded head dim; RT query rows a block (the group's g*Nq rows, padded to a power
    of two, at most MAX_ROWS); LK lanes a stream (a stream reads one key row at a time, LK
    lanes together); VEC elements one load of a lane reads (8 float16 or 4 float32 in one
    16-byte load when rows are 16-byte aligned, else 1); U key rows a stream loads before
    it uses them (its loads in flight at once). NS = THREADS / LK streams a block walk the
    keys KEYS_PER_STEP at a time. MMA: 0 for the FMA kernel; else the tensor-core one
    (``make_attend_key_range_mma``), whose streams are warps (LK = 32) taking U = 16 keys a
    step, with q in MMA fp16 parts (1 for float16 queries, 2 for float32).
    """

    D: int
    RT: int
    LK: int
    U: int
    threads: int
    VEC: int = 1
    MMA: int = 0

    @property
    def streams(self) -> int:
        return self.threads // self.LK

    @property
    def key(self) -> tuple:
        """The kernel factories' arguments."""
        return (self.D, self.RT, self.LK, self.U, self.threads, self.VEC, self.MMA)

    @property
    def keys_per_step(self) -> int:
        return self.streams * self.U


def plan(d: int, rows: int, itemsize: int = 4, wide: bool = False, q_itemsize: int = 4,
         tensor_cores: bool = True) -> DecodePlan:
    """The decode kernels' shape for head dim d, ``rows`` = g*Nq query rows a KV head, K/V
    elements of ``itemsize`` bytes, and ``wide``: whether every K/V row starts on a 16-byte
    boundary, so that a lane can read 16 bytes in one load (measured on the H100 at d = 128;
    see the chapter).

    LK: 8 lanes a stream, 16 for float32 keys with one query row (the fastest of LK = 8,
    16, 32 there), and enough lanes that a thread keeps at most 64 output registers
    (RT * D / LK <= 64).
    VEC: as many elements as fit 16 bytes (8 float16, 4 float32) if ``wide``, but no more
    than a lane's share of the padded row (D / LK); else 1.
    U: keys a stream loads before it uses them (its loads in flight at once): 4 with one
    query row (float16 keys, or 16-byte loads), else 2.
    Tensor cores (MMA) for float16 keys with several rows (GQA, or Nq > 1), d in {64, 128}
    and 16-byte rows: there the FMA kernel is bound by its arithmetic, not by HBM
    (``tensor_cores=False``: the FMA kernel everywhere)."""
    threads = 32 if on_simulator() else GPU_THREADS
    if tensor_cores and itemsize == 2 and wide and d in (64, 128) and rows >= 2:
        return DecodePlan(D=d, RT=min(1 << max(0, int(rows) - 1).bit_length(), MAX_ROWS), LK=32, U=16,
                          threads=threads, VEC=8, MMA=1 if q_itemsize == 2 else 2)
    D = padded_head_dim(d)
    RT = min(1 << max(0, int(rows) - 1).bit_length(), MAX_ROWS)
    LK = 16 if (itemsize == 4 and RT == 1) else 8
    LK = min(max(LK, RT * D // 64), 32, D)
    VEC = min(WIDE_BYTES // itemsize, D // LK) if wide else 1
    U = 4 if (RT == 1 and (wide or itemsize == 2)) else 2
    return DecodePlan(D=D, RT=RT, LK=LK, U=U, threads=threads, VEC=VEC)


# --------------------------------------------------------------------------- the kernels

@functools.lru_cache(maxsize=None)
def make_merge_streams(D: int, RT: int, NS: int, THREADS: int):
    """The end of a partial: merge the block's NS streams (each a split of the key range),
    in stream order, and write O_s (normalised) and L_s.

    ``finish(sm, sl, so, og, lg, row0, out0, n_rows, d)``: stream z left its running max
    (base 2) in sm[z, r], its sum in sl[z, r] and its unnormalised O in so[z, r, :] (shared
    arrays, written before a barrier). Rows row0 + r < n_rows go to og[out0 + r] and
    lg[out0 + r] (natural log; -inf and O = 0 where no key was visible)."""

    @inlined
    def finish(sm, sl, so, og, lg, row0, out0, n_rows, d):
        tid = int32(cuda.threadIdx.x)
        for e in range(tid, RT * D, THREADS):
            r = e // D
            c = e % D
            mx = sm[0, r]
            for z in range(1, NS):
                mx = nan_max(mx, sm[z, r])
            base = mx if mx > MASKED else float32(0.0)
            total = float32(0.0)
            o = float32(0.0)
            for z in range(NS):                  # stream z's share, weighted 2^(m_z - m)
                w = math.exp2(sm[z, r] - base)
                total += sl[z, r] * w
                o += so[z, r, c] * w
            if row0 + r < n_rows and c < d:
                if total == float32(0.0):         # no key visible: O = 0, L = -inf
                    og[uint64(out0 + r), uint64(c)] = float32(0.0)
                    if c == 0:
                        lg[uint64(out0 + r)] = MINUS_INF
                else:                             # (a NaN stays NaN)
                    og[uint64(out0 + r), uint64(c)] = o / total
                    if c == 0:
                        lg[uint64(out0 + r)] = (mx + math.log2(total)) * float32(LN2)


    return finish


@functools.lru_cache(maxsize=None)
def make_attend_key_range(D: int, RT: int, LK: int, U: int, THREADS: int, VEC: int = 1):
    """A partial over one key range, as a device function: everything a block does for it.

    ``attend(qg, kh, vh, og, lg, row0, out0, n_q, k_start, k_end, n_keys, d, scale, causal)``:
    qg (g*Nq, d) the query rows of a KV head's group, kh and vh (Nmax, d) its cache; the
    block takes rows row0 .. row0 + RT - 1 of qg and keys [k_start, k_end) (n_keys: the
    sequence's cache length, for the causal diagonal). It writes O_s (normalised) to og[out0 + r]
    and L_s (natural log; -inf if the rows see no key) to lg[out0 + r].
    """
    NS = THREADS // LK            # streams a block
    CPL = D // LK                 # columns of a key row a lane holds
    CHUNKS = CPL // VEC           # ... in loads of VEC consecutive columns
    STEP = NS * U                 # keys the block consumes a step
    row_max, row_sum = make_row_reductions(LK, THREADS)
    load = make_load(VEC)
    finish = make_merge_streams(D, RT, NS, THREADS)
    # Lane ln's i-th element is column ((i // VEC) * LK + ln) * VEC + i % VEC of a row: its
    # loads are VEC consecutive columns, the LK lanes' loads side by side.

    @inlined
    def attend(qg, kh, vh, og, lg, row0, out0, n_q, k_start, k_end, n_keys, d, scale, causal):
        tid = int32(cuda.threadIdx.x)
        st = tid // LK                            # this thread's stream
        ln = tid % LK                             # its lane (its columns: the map above)
        n_rows = int32(qg.shape[0])
        diag = n_keys - n_q                       # causal: query i sees key j iff j <= i + diag
        # S in base 2: exp(scale (s - m)) = exp2(q' k - m') with q' = scale log2(e) q
        scale_log2e = float32(scale * LOG2E)

        q = cuda.local.array((RT, CPL), float32)      # this lane's columns of the rows' q'
        m = cuda.local.array(RT, float32)             # running max (base 2), a stream's
        l = cuda.local.array(RT, float32)             # running sum
        acc = cuda.local.array((RT, CPL), float32)    # running O (unnormalised), this lane's columns
        s = cuda.local.array((U, RT), float32)        # scores of the U keys in hand
        kr = cuda.local.array((U, CPL), float32)      # the U key rows: this lane's columns
        vr = cuda.local.array((U, CPL), float32)
        for r in range(RT):
            row = uint64(min(row0 + r, n_rows - 1))
            for t in range(CPL):
                c = ((t // VEC) * LK + ln) * VEC + t % VEC
                x = float32(qg[row, uint64(min(c, d - 1))]) * scale_log2e
                if row0 + r >= n_rows or c >= d:
                    x = float32(0.0)
                q[r, t] = x
            m[r] = MASKED
            l[r] = float32(0.0)
            for t in range(CPL):
                acc[r, t] = float32(0.0)

        # ---- the keys, STEP at a time: stream st takes keys j0 .. j0 + U - 1 of each step.
        # Every thread runs the same number of steps (the shuffles need every lane).
        n_steps = max(k_end - k_start + STEP - 1, 0) // STEP
        for step in range(n_steps):
            j0 = k_start + step * STEP + st * U
            # K_j, V_j: every load first (clamped to a valid row and column, zeroed past the
            # range or the head dim), so that all of them are in flight together
            for u in range(U):
                row = uint64(min(j0 + u, k_end - 1))
                for t in range(CHUNKS):
                    c = (t * LK + ln) * VEC
                    kx = load(kh, row, uint64(min(c, d - VEC)))
                    vx = load(vh, row, uint64(min(c, d - VEC)))
                    keep = j0 + u < k_end and c < d
                    for e in range(VEC):
                        kr[u, t * VEC + e] = kx[e] if keep else float32(0.0)
                        vr[u, t * VEC + e] = vx[e] if keep else float32(0.0)
            # S_rj = q'_r . k_j: this lane's CPL products, then the sum across the LK lanes
            for u in range(U):
                j = j0 + u
                for r in range(RT):
                    x = float32(0.0)
                    for t in range(CPL):
                        x += q[r, t] * kr[u, t]
                    x = row_sum(x)
                    i = (row0 + r) % n_q          # the row's query: rows are (head, query) pairs
                    if j >= k_end or (causal and j > i + diag):
                        x = MASKED
                    s[u, r] = x
            # online softmax over the U keys: m' = max(m, S); l, O rescaled by 2^(m - m');
            # P = 2^(S - m') (against 0 while the row has seen no key: 2^MASKED = 0)
            for r in range(RT):
                mx = m[r]
                for u in range(U):
                    mx = nan_max(mx, s[u, r])
                alpha = math.exp2(m[r] - mx)
                m[r] = mx
                l[r] *= alpha
                for t in range(CPL):
                    acc[r, t] *= alpha
                base = mx if mx > MASKED else float32(0.0)
                for u in range(U):
                    p = math.exp2(s[u, r] - base)
                    l[r] += p
                    for t in range(CPL):
                        acc[r, t] += p * vr[u, t]

        # ---- merge the block's NS streams (each a split of the range), in stream order
        sm = cuda.shared.array((NS, RT), float32)
        sl = cuda.shared.array((NS, RT), float32)
        so = cuda.shared.array((NS, RT, D), float32)
        cuda.syncthreads()                        # the last range's merge is done with these
        for r in range(RT):
            if ln == 0:
                sm[st, r] = m[r]
                sl[st, r] = l[r]
            for t in range(CPL):
                so[st, r, ((t // VEC) * LK + ln) * VEC + t % VEC] = acc[r, t]
        cuda.syncthreads()
        finish(sm, sl, so, og, lg, row0, out0, n_rows, d)

    return attend


@functools.lru_cache(maxsize=None)
def make_attend_key_range_mma(D: int, RT: int, THREADS: int, SPLIT_Q: bool = True, UK: int = 1):
    """The same partial as ``make_attend_key_range``, with the products on tensor cores:
    for float16 caches, D = d in {64, 128}, 16-byte aligned rows (``plan(...).MMA``).

    Why: with g query rows a KV head (GQA, or Nq > 1) every K and V element read feeds g
    rows' FMAs, and at g = 4 the FMA units, not HBM, set the pace. A tensor core takes a
    whole 16-row tile at once (``kernels.base.mma``): S = Q K^T and O += P V as mma.sync
    m16n8k16 (fp16 in, fp32 accumulate), the block's RT <= 16 rows padded with zeros.

    A warp takes 16 keys a step (the block's THREADS / 32 warps are its streams):
      S (16 x 16 keys)  two n8 tiles, D / 16 k-steps each. K's elements are exact in fp16;
                        q is not (float32 queries), so q = q_hi + q_lo, two fp16 parts,
                        and S = q_hi K^T + q_lo K^T (twice the mma, about fp32 accuracy).
      softmax           on the accumulator fragments: a lane holds 4 scores of rows
                        group and group + 8; the row max is a max over the 4 lanes of a
                        quad (2 shuffles), the sums stay per lane until the end.
      O += P V          P's fp32 scores sit exactly where the A operand of P V needs them
                        (two n8 accumulator tiles = one 16 x 16 A tile): packed to fp16 in
                        registers, P = P_hi + P_lo as for q, no shared memory.
    The order of the head dim inside a dot product is free, and so is the order of O's
    columns as long as they are written back right: each lane reads runs of consecutive
    elements (16-byte loads) and the fragments name where they go:
      K, Q  lane (group, t), k-step s: d = t D/4 + 4 s + (0, 1 | 2, 3)
      V, O  lane (group, t), n8 tile j: B column group = d (group D/8 + j); so the
            accumulator column 2 t + e of tile j is d = (2 t + e) D/8 + j.
    """
    NW = THREADS // 32               # warps: the block's streams
    KS = D // 16                     # k-steps of S
    KW = D // 8                      # words (2 halves) of K a lane reads a key: D/4 halves
    NT = D // 8                      # n8 tiles of O
    VW = D // 16                     # words of V a lane reads a key: D/8 halves
    STEP = NW * 16 * UK              # keys a block a step: UK chunks of 16 a warp
    K_ROWS, V_ROWS = 2 * UK, 4 * UK  # key rows a lane reads a step, of K and of V
    row_max, row_sum = make_row_reductions(4, THREADS)
    finish = make_merge_streams(D, RT, NW, THREADS)
    from kernels.base.mma import load_words, mma_f16, pack_f16, unpack_f16

    @inlined
    def zero_unless(w, keep):
        return w if keep else uint32(0)

    @inlined
    def split_f16(x0, x1):
        # (x0, x1) = hi + lo, each packed as two fp16: hi rounded, lo what hi lost
        hi = pack_f16(x0, x1)
        h = unpack_f16(hi)
        return hi, pack_f16(x0 - h[0], x1 - h[1])

    @inlined
    def pair(x, y, upper):
        # (x's half, y's half) in one register: the low halves, or the high ones
        if upper:
            return (x >> uint32(16)) | (y & uint32(0xFFFF0000))
        return (x & uint32(0xFFFF)) | (y << uint32(16))

    @inlined
    def attend(qg, kh, vh, og, lg, row0, out0, n_q, k_start, k_end, n_keys, d, scale, causal):
        tid = int32(cuda.threadIdx.x)
        warp = tid // 32
        lane = tid % 32
        group = lane // 4
        t = lane % 4
        n_rows = int32(qg.shape[0])
        diag = n_keys - n_q
        scale_log2e = float32(scale * LOG2E)

        # ---- Q as A fragments (hi and lo parts), rows group and group + 8 (zero past the rows)
        q_hi = cuda.local.array((KS, 4), uint32)
        q_lo = cuda.local.array((KS, 4), uint32)
        for s_ in range(KS):
            for reg in range(4):
                r = group + 8 * (reg % 2)
                c = t * (D // 4) + 4 * s_ + 2 * (reg // 2)
                row = uint64(min(row0 + r, n_rows - 1))
                x0 = float32(qg[row, uint64(c)])
                x1 = float32(qg[row, uint64(c + 1)])
                if r >= RT or row0 + r >= n_rows:
                    x0 = float32(0.0)
                    x1 = float32(0.0)
                hi = pack_f16(x0, x1)
                q_hi[s_, reg] = hi
                if SPLIT_Q:                       # what fp16 lost of q: a second fp16 part
                    h = unpack_f16(hi)
                    q_lo[s_, reg] = pack_f16(x0 - h[0], x1 - h[1])
        m = cuda.local.array(2, float32)              # running max (base 2), rows group, group + 8
        l = cuda.local.array(2, float32)              # this lane's share of the running sums
        acc = cuda.local.array((NT, 4), float32)      # O, as NT accumulator fragments
        for h in range(2):
            m[h] = MASKED
            l[h] = float32(0.0)
        for j in range(NT):
            for i in range(4):
                acc[j, i] = float32(0.0)
        kw = cuda.local.array((K_ROWS, KW), uint32)   # this lane's K: keys group, group + 8 (a chunk)
        vw = cuda.local.array((V_ROWS, VW), uint32)   # its V: keys 2t, 2t + 1, 2t + 8, 2t + 9 (a chunk)
        sc = cuda.local.array((2, 4), float32)        # S, then P: two n8 tiles
        q_row = cuda.local.array(2, int32)            # the query of rows group, group + 8
        for h in range(2):
            q_row[h] = (row0 + group + 8 * h) % max(n_q, 1)

        n_steps = max(k_end - k_start + STEP - 1, 0) // STEP
        for step in range(n_steps):
            jw = k_start + step * STEP + warp * 16 * UK
            # ---- every load of the UK chunks first (clamped to a valid row, zeroed past the range)
            for ch in range(UK):
                for nt in range(2):
                    key = jw + 16 * ch + nt * 8 + group
                    row = uint64(min(key, k_end - 1))
                    for w4 in range(KW // 4):
                        x = load_words(kh, row, uint64(t * (D // 4) + 8 * w4))
                        for e in range(4):
                            kw[2 * ch + nt, 4 * w4 + e] = zero_unless(x[e], key < k_end)
                for kk in range(4):
                    key = jw + 16 * ch + 2 * t + (kk % 2) + 8 * (kk // 2)
                    row = uint64(min(key, k_end - 1))
                    for w4 in range(VW // 4):
                        x = load_words(vh, row, uint64(group * (D // 8) + 8 * w4))
                        for e in range(4):
                            vw[4 * ch + kk, 4 * w4 + e] = zero_unless(x[e], key < k_end)
            for ch in range(UK):
                j0 = jw + 16 * ch
                # ---- S = q K^T on the tensor cores, then scaled to base 2 and masked
                for nt in range(2):
                    c4 = (float32(0.0), float32(0.0), float32(0.0), float32(0.0))
                    for s_ in range(KS):
                        b = (kw[2 * ch + nt, 2 * s_], kw[2 * ch + nt, 2 * s_ + 1])
                        c4 = mma_f16((q_hi[s_, 0], q_hi[s_, 1], q_hi[s_, 2], q_hi[s_, 3]), b, c4)
                        if SPLIT_Q:
                            c4 = mma_f16((q_lo[s_, 0], q_lo[s_, 1], q_lo[s_, 2], q_lo[s_, 3]), b, c4)
                    for i in range(4):
                        key = j0 + nt * 8 + 2 * t + i % 2
                        x = c4[i] * scale_log2e
                        if key >= k_end or (causal and key > q_row[i // 2] + diag):
                            x = MASKED
                        sc[nt, i] = x
                # ---- online softmax, rows group (h = 0) and group + 8 (h = 1)
                for h in range(2):
                    mx = nan_max(nan_max(sc[0, 2 * h], sc[0, 2 * h + 1]), nan_max(sc[1, 2 * h], sc[1, 2 * h + 1]))
                    mx = nan_max(row_max(mx), m[h])           # the quad's max: one row's 16 keys
                    alpha = math.exp2(m[h] - mx)
                    m[h] = mx
                    l[h] *= alpha
                    for j in range(NT):
                        acc[j, 2 * h] *= alpha
                        acc[j, 2 * h + 1] *= alpha
                    base = mx if mx > MASKED else float32(0.0)
                    for nt in range(2):
                        for e in range(2):
                            p = math.exp2(sc[nt, 2 * h + e] - base)
                            l[h] += p
                            sc[nt, 2 * h + e] = p
                # ---- O += P V: P's registers are the A fragment (keys 2t, 2t+1 | 2t+8, 2t+9)
                p_hi0, p_lo0 = split_f16(sc[0, 0], sc[0, 1])
                p_hi1, p_lo1 = split_f16(sc[0, 2], sc[0, 3])
                p_hi2, p_lo2 = split_f16(sc[1, 0], sc[1, 1])
                p_hi3, p_lo3 = split_f16(sc[1, 2], sc[1, 3])
                for j in range(NT):
                    upper = j % 2 == 1
                    v0 = 4 * ch
                    b = (pair(vw[v0, j // 2], vw[v0 + 1, j // 2], upper),
                         pair(vw[v0 + 2, j // 2], vw[v0 + 3, j // 2], upper))
                    c4 = (acc[j, 0], acc[j, 1], acc[j, 2], acc[j, 3])
                    c4 = mma_f16((p_hi0, p_hi1, p_hi2, p_hi3), b, c4)
                    c4 = mma_f16((p_lo0, p_lo1, p_lo2, p_lo3), b, c4)
                    for i in range(4):
                        acc[j, i] = c4[i]

        # ---- the warps' states into shared memory, then merged as the streams are
        sm = cuda.shared.array((NW, RT), float32)
        sl = cuda.shared.array((NW, RT), float32)
        so = cuda.shared.array((NW, RT, D), float32)
        cuda.syncthreads()                        # the last range's merge is done with these
        for h in range(2):
            total = row_sum(l[h])                 # the quad's sum: the row's
            r = group + 8 * h
            if r < RT:
                if t == 0:
                    sm[warp, r] = m[h]
                    sl[warp, r] = total
                for j in range(NT):
                    for e in range(2):
                        so[warp, r, (2 * t + e) * (D // 8) + j] = acc[j, 2 * h + e]
        cuda.syncthreads()
        finish(sm, sl, so, og, lg, row0, out0, n_rows, d)

    return attend


def _attend(D, RT, LK, U, THREADS, VEC, MMA):
    """The plan's partial: on the tensor cores (MMA > 0) or on the FMA units."""
    if MMA:
        return make_attend_key_range_mma(D, RT, THREADS, SPLIT_Q=MMA == 2, UK=U // 16)
    return make_attend_key_range(D, RT, LK, U, THREADS, VEC)


@functools.lru_cache(maxsize=None)
def make_merge_partials(D: int, RT: int, THREADS: int):
    """Merge a head's partials, as a device function: ``merge(o_part, l_part, first, count,
    og, lg, row0, n_rows, d)`` folds partials first .. first + count - 1 (o_part (slots,
    RT, d), l_part (slots, RT)) in that order with chapter 3's merge (an empty partial holds
    O_s = 0, L_s = -inf, as the kernels write it) and writes O and L of
    rows row0 .. row0 + RT - 1 of og (n_rows, d) and lg (n_rows,). The order is fixed, so
    the result is the same bits whichever block runs it."""

    @inlined
    def merge(o_part, l_part, first, count, og, lg, row0, n_rows, d):
        for e in range(int32(cuda.threadIdx.x), RT * D, THREADS):
            r = e // D
            c = e % D
            if row0 + r < n_rows and c < d:
                m = MINUS_INF                     # the empty state (O = 0, L = -inf)
                l = float32(0.0)
                o = float32(0.0)
                for slot in range(first, first + count):
                    l_s = l_part[uint64(slot), uint64(r)]
                    m_new, l = merge_state(m, l, l_s, float32(1.0))     # chapter 3
                    if m_new != MINUS_INF:        # O carried along with the same weights
                        o = o * math.exp(m - m_new) + o_part[uint64(slot), uint64(r), uint64(c)] * math.exp(l_s - m_new)
                    m = m_new
                if l == float32(0.0):
                    og[uint64(row0 + r), uint64(c)] = float32(0.0)
                    if c == 0:
                        lg[uint64(row0 + r)] = MINUS_INF
                else:
                    og[uint64(row0 + r), uint64(c)] = o / l
                    if c == 0:
                        lg[uint64(row0 + r)] = m + math.log(l)

    return merge


@functools.lru_cache(maxsize=None)
def make_split_k(D: int, RT: int, LK: int, U: int, THREADS: int, VEC: int = 1, MMA: int = 0):
    """Split-K's first kernel. Grid (splits, row tiles, B*Hkv), THREADS threads.

    q (B*Hkv, g*Nq, d); k and v (B*Hkv, Nmax, d); o_part (slots, RT, d) and l_part (slots,
    RT) float32, slot = (bk * tiles + tile) * splits + s; lengths (B,) int32. With one split
    the block writes O and L themselves (o (B*Hkv, g*Nq, d), lse (B*Hkv, g*Nq)). Split s
    of a sequence of n keys takes keys [s c, (s+1) c), c = ceil(n / splits)."""
    attend = _attend(D, RT, LK, U, THREADS, VEC, MMA)

    @cuda.jit(fastmath=FASTMATH)
    def split_k(q, k, v, o_part, l_part, o, lse, lengths, n_q, d, scale, causal):
        s = int32(cuda.blockIdx.x)
        tile = int32(cuda.blockIdx.y)
        bk = int32(cuda.blockIdx.z)               # (batch, KV head)
        splits = int32(cuda.gridDim.x)
        n_keys = int32(lengths[bk // (int32(k.shape[0]) // int32(lengths.shape[0]))])
        chunk = (n_keys + splits - 1) // splits
        k_start = min(s * chunk, n_keys)
        k_end = min(k_start + chunk, n_keys)
        if splits == 1:
            attend(q[bk], k[bk], v[bk], o[bk], lse[bk], tile * RT, tile * RT, n_q, k_start, k_end, n_keys,
                   d, scale, causal)
        else:
            slot = (bk * int32(cuda.gridDim.y) + tile) * splits + s
            attend(q[bk], k[bk], v[bk], o_part[slot], l_part[slot], tile * RT, int32(0), n_q, k_start, k_end,
                   n_keys, d, scale, causal)

    return split_k


@functools.lru_cache(maxsize=None)
def make_combine(D: int, RT: int, THREADS: int):
    """Split-K's second kernel: grid (row tiles, B*Hkv), THREADS threads; merges the splits
    of each (head, row tile) into o and lse (the partials as ``make_split_k`` writes them)."""
    merge = make_merge_partials(D, RT, THREADS)

    @cuda.jit(fastmath=FASTMATH)
    def combine(o_part, l_part, o, lse, splits, d):
        tile = int32(cuda.blockIdx.x)
        bk = int32(cuda.blockIdx.y)
        first = (bk * int32(cuda.gridDim.x) + tile) * splits
        merge(o_part, l_part, first, splits, o[bk], lse[bk], tile * RT, int32(o.shape[1]), d)

    return combine


@functools.lru_cache(maxsize=None)
def make_stream_k(D: int, RT: int, LK: int, U: int, THREADS: int, VEC: int = 1, MMA: int = 0):
    """Stream-K (Lean Attention): one persistent launch. Grid: the schedule's blocks, THREADS threads.

    Block c runs segments cta_first[c] .. cta_first[c+1] - 1 of the schedule (see
    ``stream_k_schedule``); segment g is keys [seg_start[g], seg_end[g]) of work item
    seg_item[g] = (batch, KV head) * tiles + row tile. An item done in one segment is
    written straight to o and lse. Otherwise each segment writes its partial to slot g;
    then the block makes its writes visible (a fence), counts itself in (an atomic add on
    the item's counter), and the block that arrives LAST merges the item's partials, in
    segment order. No block ever waits for another: the simulator, which runs one block at
    a time, cannot deadlock, and on the GPU no block holds an SM while it spins. The last
    block resets the counter to 0 for the next launch (a launch that dies part way leaves
    counters set; so does the CUDA context, which then refuses every later launch)."""
    attend = _attend(D, RT, LK, U, THREADS, VEC, MMA)
    merge = make_merge_partials(D, RT, THREADS)

    @cuda.jit(fastmath=FASTMATH)
    def stream_k(q, k, v, o_part, l_part, o, lse, lengths, n_q, d, scale, causal, tiles,
                 cta_first, seg_item, seg_start, seg_end, item_first, item_count, counters):
        c = int32(cuda.blockIdx.x)
        tid = int32(cuda.threadIdx.x)
        last = cuda.shared.array(1, int32)
        heads_per_batch = int32(k.shape[0]) // int32(lengths.shape[0])
        for g in range(cta_first[c], cta_first[c + 1]):
            item = int32(seg_item[g])
            bk = item // tiles
            row0 = (item % tiles) * RT
            n_keys = int32(lengths[bk // heads_per_batch])
            count = int32(item_count[item])
            if count == 1:                        # the whole item in this segment
                attend(q[bk], k[bk], v[bk], o[bk], lse[bk], row0, row0, n_q, seg_start[g], seg_end[g],
                       n_keys, d, scale, causal)
            else:
                attend(q[bk], k[bk], v[bk], o_part[g], l_part[g], row0, int32(0), n_q, seg_start[g],
                       seg_end[g], n_keys, d, scale, causal)
                cuda.threadfence()                # this block's partial, visible to every block
                cuda.syncthreads()                # ... from all its threads
                if tid == 0:
                    last[0] = int32(cuda.atomic.add(counters, item, 1) == count - 1)
                cuda.syncthreads()
                if last[0] == 1:                  # every other piece of the item is written
                    cuda.threadfence()
                    merge(o_part, l_part, item_first[item], count, o[bk], lse[bk], row0, int32(o.shape[1]), d)
                    if tid == 0:
                        counters[item] = 0
                cuda.syncthreads()                # `last` is rewritten by the next segment

    return stream_k


# --------------------------------------------------------------------------- split-K: how many splits

def wave_efficiency(blocks: int, slots: int) -> float:
    """The fraction of the GPU's block slots busy over the waves of a launch of ``blocks``
    blocks on ``slots`` slots (SMs x blocks per SM): blocks / (ceil(blocks / slots) slots)."""
    return blocks / (cdiv(blocks, slots) * slots) if blocks else 0.0


def split_count(items: int, n_keys: int, slots: int, *, min_keys: int = 256, max_splits: int = 128) -> int:
    """Split-K's rule: how many slices to cut each of ``items`` (head, row tile) pieces' n_keys keys into.

    More splits fill more of the GPU's ``slots`` (SMs x blocks per SM), but each adds a
    partial to write and merge. FlashAttention's rule: take the wave efficiency of every
    split count s (``wave_efficiency(items * s, slots)``) up to what keeps at least
    ``min_keys`` keys a slice, and choose the smallest s within 85% of the best (the core
    of FlashAttention's ``num_splits_heuristic``, which also caps s at the SM count and
    skips counts that leave the slices unchanged)."""
    limit = max(1, min(max_splits, n_keys // max(min_keys, 1)))
    if items >= slots:                    # the heads alone fill the GPU
        return 1
    eff = [wave_efficiency(items * s, slots) for s in range(1, limit + 1)]
    best = max(eff)
    return next(s for s, e in enumerate(eff, start=1) if e >= 0.85 * best)


# --------------------------------------------------------------------------- stream-K: the schedule

@dataclass(frozen=True)
class StreamKSchedule:
    """Which block takes which work. Work item i (a (batch, KV head) and row tile) has
    tiles[i] key tiles; segments are (item, first tile, end tile), in the order of the
    work laid end to end; block c runs segments cta_first[c] .. cta_first[c+1] - 1; item
    i's segments are item_first[i] .. item_first[i] + item_count[i] - 1."""

    cta_first: np.ndarray     # (blocks + 1,)
    seg_item: np.ndarray      # (segments,)
    seg_tile_start: np.ndarray
    seg_tile_end: np.ndarray
    item_first: np.ndarray    # (items,)
    item_count: np.ndarray

    @property
    def blocks(self) -> int:
        return len(self.cta_first) - 1


def stream_k_schedule(tiles_per_item, blocks: int) -> StreamKSchedule:
    """Cut the work, every item's key tiles laid end to end, into ``blocks`` equal
    contiguous ranges (Lean Attention's schedule).

    Block c takes the work units [c W / blocks, (c+1) W / blocks) of the W in all; where its
    range covers the end of one item and the start of the next, it gets a segment of each.
    An item with no tiles (an empty cache) gets one empty segment, from the block whose
    range its position falls in, so that its outputs (O = 0, L = -inf) are still written."""
    tiles = np.asarray(tiles_per_item, np.int64)
    if blocks < 1:
        raise ValueError(f"blocks: expected at least 1, got {blocks}")
    total = int(tiles.sum())
    bounds = [c * total // blocks for c in range(blocks + 1)]
    seg_cta, seg_item, seg_a, seg_b = [], [], [], []
    start = 0
    for item, n in enumerate(tiles.tolist()):
        end = start + n
        if n == 0:
            cta = min(int(np.searchsorted(bounds, start, side="right")) - 1, blocks - 1)
            seg_cta.append(cta), seg_item.append(item), seg_a.append(0), seg_b.append(0)
        else:
            c = int(np.searchsorted(bounds, start, side="right")) - 1
            while c < blocks and bounds[c] < end:
                a, b = max(start, bounds[c]), min(end, bounds[c + 1])
                if b > a:
                    seg_cta.append(c), seg_item.append(item), seg_a.append(a - start), seg_b.append(b - start)
                c += 1
        start = end
    seg_cta = np.asarray(seg_cta, np.int64)
    seg_item = np.asarray(seg_item, np.int32)
    cta_first = np.searchsorted(seg_cta, np.arange(blocks + 1), side="left").astype(np.int32)
    item_count = np.bincount(seg_item, minlength=len(tiles)).astype(np.int32)
    item_first = (np.cumsum(item_count) - item_count).astype(np.int32)
    return StreamKSchedule(cta_first=cta_first, seg_item=seg_item, seg_tile_start=np.asarray(seg_a, np.int32),
                           seg_tile_end=np.asarray(seg_b, np.int32), item_first=item_first, item_count=item_count)


def check_schedule(schedule: StreamKSchedule, tiles_per_item, blocks: int):
    """AssertionError unless ``schedule`` is a valid stream-K cut of the work: every tile of
    every item in exactly one segment, in order; an empty item in one empty segment; blocks
    take contiguous, balanced ranges (at most ceil(W / blocks) units each)."""
    tiles = np.asarray(tiles_per_item, np.int64)
    s = schedule
    assert s.blocks == blocks, f"expected {blocks} blocks, got {s.blocks}"
    assert s.cta_first[0] == 0 and s.cta_first[-1] == len(s.seg_item), "cta_first must cover every segment"
    assert np.all(np.diff(s.cta_first) >= 0), "cta_first must not decrease"
    for item, n in enumerate(tiles):
        first, count = int(s.item_first[item]), int(s.item_count[item])
        segs = range(first, first + count)
        assert count >= 1, f"item {item}: no segment"
        assert all(s.seg_item[g] == item for g in segs), f"item {item}: its segments are not contiguous"
        covered = [(int(s.seg_tile_start[g]), int(s.seg_tile_end[g])) for g in segs]
        if n == 0:
            assert covered == [(0, 0)], f"item {item}: an empty item needs one empty segment, got {covered}"
        else:
            assert covered[0][0] == 0 and covered[-1][1] == n, f"item {item}: tiles 0..{n} not covered: {covered}"
            assert all(a < b for a, b in covered), f"item {item}: empty segment in {covered}"
            assert all(covered[i][1] == covered[i + 1][0] for i in range(len(covered) - 1)), \
                f"item {item}: segments not contiguous: {covered}"
    work = np.zeros(blocks, np.int64)
    for c in range(blocks):
        for g in range(s.cta_first[c], s.cta_first[c + 1]):
            work[c] += s.seg_tile_end[g] - s.seg_tile_start[g]
    total = int(tiles.sum())
    assert work.sum() == total
    assert work.max(initial=0) <= cdiv(total, blocks), f"unbalanced: {work.max()} units on one block, W/blocks = {total / blocks:.2f}"


# --------------------------------------------------------------------------- the launcher

def _host_lengths(cache_lengths, B: int, n_max: int) -> np.ndarray:
    """The cache lengths as a host int64 array, validated (naming ``cache_lengths``)."""
    if cache_lengths is None:
        return np.full(B, n_max, np.int64)
    if is_device_array(cache_lengths):
        check_array(cache_lengths, "cache_lengths", ndim=1, dtypes=None)
        host = to_device(cache_lengths, "cache_lengths").copy_to_host()
    else:
        try:
            host = np.asarray(cache_lengths)
        except Exception as exc:  # noqa: BLE001
            raise TypeError(f"cache_lengths: expected B integers, got {type(cache_lengths).__name__}") from exc
    if host.ndim != 1 or host.shape[0] != B:
        raise ValueError(f"cache_lengths: expected shape ({B},) (one length a sequence), got {host.shape}")
    if host.dtype.kind not in "iu":
        raise TypeError(f"cache_lengths: expected integers, got dtype {host.dtype}")
    host = host.astype(np.int64)
    bad = (host < 0) | (host > n_max)
    if bad.any():
        b = int(np.argmax(bad))
        raise ValueError(f"cache_lengths: expected 0 <= length <= {n_max} (the cache's rows), "
                         f"got {int(host[b])} for sequence {b}")
    return host


_workspaces: dict = {}


def _workspace(name: str, shape: tuple, dtype=np.float32, zero: bool = False):
    """A scratch device array kept between calls (partials, counters): one buffer a name,
    grown when a call needs more, so that a decode step does not allocate. Launches go to
    one stream, one after the other, so a call never finds the previous one still using
    it. ``zero``: zeros when (re)made (stream-K's counters, which its last blocks leave at
    zero again)."""
    size = max(int(np.prod(shape)), 1)
    key = (name, np.dtype(dtype).str, 0 if on_simulator() else cuda.get_current_device().id)
    buf, views = _workspaces.get(key, (None, {}))
    if buf is None or buf.shape[0] < size:
        buf = cuda.to_device(np.zeros(size, dtype)) if zero else device_empty((size,), dtype)
        views = {}
        _workspaces[key] = (buf, views)
    if shape not in views:                        # (a view is a Python object: made once)
        views[shape] = buf[:int(np.prod(shape))].reshape(shape)
    return views[shape]


_slots: dict = {}


def gpu_slots(kernel, args, threads: int = GPU_THREADS) -> int:
    """Blocks of ``kernel`` the whole GPU holds at once (SMs x blocks an SM, from the
    compiled kernel's occupancy) for a launch with these arguments; 4 in the simulator."""
    if on_simulator():
        return 4
    argtypes = tuple(kernel.typeof_pyval(a) for a in args)
    key = (id(kernel), argtypes, cuda.get_current_device().id)
    if key not in _slots:
        _slots[key] = int(kernel.compile(argtypes).max_cooperative_grid_blocks(threads))
    return _slots[key]


def _device_schedule(sched: StreamKSchedule, unit: int, lengths: tuple, hkv: int, tiles: int):
    """The stream-K schedule's arrays on the device, each segment's tile range in keys."""
    bk = sched.seg_item // tiles
    n_keys = np.asarray(lengths, np.int64)[bk // hkv]
    seg_start = np.minimum(sched.seg_tile_start.astype(np.int64) * unit, n_keys).astype(np.int32)
    seg_end = np.minimum(sched.seg_tile_end.astype(np.int64) * unit, n_keys).astype(np.int32)
    arrays = (sched.cta_first, sched.seg_item, seg_start, seg_end, sched.item_first, sched.item_count)
    return tuple(cuda.to_device(np.ascontiguousarray(a)) for a in arrays)


@dataclass(frozen=True)
class DecodeCall:
    """A decode call, validated: everything its launches depend on but the arrays' contents
    and addresses. Calls that compare equal share one ``DecodeLaunches`` (cached)."""

    B: int
    hq: int
    hkv: int
    n_q: int
    n_max: int
    d: int
    q_itemsize: int
    kv_itemsize: int
    lengths: tuple                                # the B cache lengths
    causal: bool
    scale: float
    schedule: str
    splits: int | None
    blocks: int | None
    tensor_cores: bool
    wide: bool                                    # every K and V row on a 16-byte boundary
    device: int

    @property
    def BK(self) -> int:                          # (batch, KV head) pairs
        return self.B * self.hkv

    @property
    def rows(self) -> int:                        # a KV head's query rows: (head of the group, query)
        return self.hq // self.hkv * self.n_q


def _check_call(q, k_cache, v_cache, cache_lengths, causal, scale, schedule, splits, blocks,
                tensor_cores) -> DecodeCall:
    """Every argument of ``decode_attention`` checked, before any launch, naming the argument."""
    qs, q_dtype = check_array(q, "q", ndim=4, dtypes=(np.float32, np.float16))
    ks, kv_dtype = check_array(k_cache, "k_cache", ndim=4, dtypes=(np.float32, np.float16))
    vs, v_dtype = check_array(v_cache, "v_cache", ndim=4, dtypes=(np.float32, np.float16))
    if v_dtype != kv_dtype:
        raise TypeError(f"v_cache: expected the dtype of k_cache ({kv_dtype}), got {v_dtype}")
    if vs != ks:
        raise ValueError(f"v_cache: expected the shape of k_cache {ks}, got {vs}")
    B, hq, n_q, d = qs
    _, hkv, n_max, dk = ks
    if ks[0] != B:
        raise ValueError(f"k_cache: expected batch B = {B} like q, got {ks[0]}")
    if dk != d:
        raise ValueError(f"k_cache: expected head dim d = {d} like q, got {dk}")
    if not 1 <= d <= 128:
        raise ValueError(f"q: expected head dim d in 1..128, got {d}")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"k_cache: expected KV heads dividing the {hq} query heads, got {hkv}")
    if n_q > MAX_QUERIES:
        raise ValueError(f"q: expected at most {MAX_QUERIES} new queries a sequence (decode), got Nq = {n_q}; "
                         f"use flash_attention for prefill")
    causal = check_flag(causal, "causal")
    tensor_cores = check_flag(tensor_cores, "tensor_cores")
    scale = check_scale(scale, d)
    if schedule not in ("split-k", "stream-k"):
        raise ValueError(f"schedule: expected 'split-k' or 'stream-k', got {schedule!r}")
    splits = None if splits is None else check_int(splits, "splits", 1, 1024)
    blocks = None if blocks is None else check_int(blocks, "blocks", 1, 1 << 20)
    if splits is not None and schedule != "split-k":
        raise ValueError("splits: only for schedule='split-k'")
    if blocks is not None and schedule != "stream-k":
        raise ValueError("blocks: only for schedule='stream-k'")
    lengths = tuple(_host_lengths(cache_lengths, B, n_max).tolist())
    itemsize = kv_dtype.itemsize
    # a host cache is copied into a fresh (aligned) device buffer; a device one is used where it is
    wide = all(is_aligned(x, d, itemsize) if is_device_array(x) else (d * itemsize) % WIDE_BYTES == 0
               for x in (k_cache, v_cache))
    device = 0 if on_simulator() else cuda.get_current_device().id
    return DecodeCall(B, hq, hkv, n_q, n_max, d, q_dtype.itemsize, itemsize, lengths, causal, scale, schedule,
                      splits, blocks, tensor_cores, wide, device)


def _views(c: DecodeCall, q, k, v, o, lse) -> dict:
    """Numba device views of a call's arrays in the kernels' shapes (q (B*Hkv, g*Nq, d), ...)."""
    return dict(q=to_device(q, "q").reshape(c.BK, c.rows, c.d),
                k=to_device(k, "k_cache").reshape(c.BK, c.n_max, c.d),
                v=to_device(v, "v_cache").reshape(c.BK, c.n_max, c.d),
                o=to_device(o, "o").reshape(c.BK, c.rows, c.d), lse=to_device(lse, "lse").reshape(c.BK, c.rows))


class DecodeLaunches:
    """The launches of one ``DecodeCall``, made once: tile shapes (``plan``), the split
    count or the stream-K schedule, the cache lengths and the schedule on the device,
    workspaces, and each kernel's ``LaunchTemplate``. A call passes only its arrays
    (q, k, v, o, lse). ``splits`` / ``blocks``: what was chosen (None where it does not apply)."""

    def __init__(self, call: DecodeCall, views: dict):
        self.call, self.splits, self.blocks = call, None, None
        c = call
        self.p = plan(c.d, c.rows, c.kv_itemsize, wide=c.wide, q_itemsize=c.q_itemsize,
                      tensor_cores=c.tensor_cores)
        self.tiles = cdiv(c.rows, self.p.RT)
        self.lengths = cuda.to_device(np.asarray(c.lengths, np.int32))
        self.common = (np.int32(c.n_q), np.int32(c.d), np.float32(c.scale), np.int32(c.causal))
        self.templates = self._split_k(views) if c.schedule == "split-k" else self._stream_k(views)

    def operands(self, q, k, v, o, lse) -> dict:
        """What a launch takes in the slots: the views in the simulator, their data
        pointers on the GPU (no Numba array is made: the template has shapes and strides)."""
        if on_simulator():
            return _views(self.call, q, k, v, o, lse)
        return dict(q=device_pointer(q, "q"), k=device_pointer(k, "k_cache"), v=device_pointer(v, "v_cache"),
                    o=device_pointer(o, "o"), lse=device_pointer(lse, "lse"))

    def __call__(self, operands: dict):
        for launch in self.templates:
            launch(**operands)

    def _split_k(self, views):
        p, c, d = self.p, self.call, self.call.d
        kernel = make_split_k(*p.key)
        slots = dict(q=0, k=1, v=2, o=5, lse=6)
        dummy = _workspace("one-partial", (1, p.RT, d))
        args = (views["q"], views["k"], views["v"], dummy, dummy[:, :, 0], views["o"], views["lse"], self.lengths,
                *self.common)
        splits = c.splits
        if splits is None:
            splits = split_count(c.BK * self.tiles, max(c.lengths, default=0), gpu_slots(kernel, args, p.threads))
        self.splits = splits
        if splits == 1:
            return [LaunchTemplate(kernel, (1, self.tiles, c.BK), p.threads, args, slots)]
        o_part = _workspace("o_part", (c.BK * self.tiles * splits, p.RT, d))
        l_part = _workspace("l_part", (c.BK * self.tiles * splits, p.RT))
        args = args[:3] + (o_part, l_part) + args[5:]
        combine = make_combine(p.D, p.RT, p.threads)
        return [LaunchTemplate(kernel, (splits, self.tiles, c.BK), p.threads, args, slots),
                LaunchTemplate(combine, (self.tiles, c.BK), p.threads,
                               (o_part, l_part, views["o"], views["lse"], np.int32(splits), self.common[1]),
                               dict(o=2, lse=3))]

    def _stream_k(self, views):
        p, c = self.p, self.call
        kernel = make_stream_k(*p.key)
        unit = key_tile(p)
        # work items: (batch, KV head, row tile), in that order; each has ceil(length / unit) tiles
        n_keys = np.repeat(np.asarray(c.lengths, np.int64), c.hkv)            # per (batch, KV head)
        tiles_per_item = np.repeat(-(-n_keys // unit), self.tiles)
        blocks = c.blocks
        if blocks is None:
            probe = _workspace("probe", (2,), np.int32)
            blocks = gpu_slots(kernel, (views["q"], views["k"], views["v"], views["o"], views["lse"], views["o"],
                                        views["lse"], self.lengths, *self.common, np.int32(self.tiles),
                                        probe, probe, probe, probe, probe, probe, probe), p.threads)
            blocks = max(1, min(blocks, int(tiles_per_item.sum()) or 1))
        self.blocks = blocks
        sched = stream_k_schedule(tiles_per_item, blocks)
        self.schedule = _device_schedule(sched, unit, c.lengths, c.hkv, self.tiles)
        n_seg = len(sched.seg_item)
        o_part = _workspace("o_part", (max(n_seg, 1), p.RT, c.d))
        l_part = _workspace("l_part", (max(n_seg, 1), p.RT))
        counters = _workspace("counters", (max(len(tiles_per_item), 1),), np.int32, zero=True)
        args = (views["q"], views["k"], views["v"], o_part, l_part, views["o"], views["lse"], self.lengths,
                *self.common, np.int32(self.tiles), *self.schedule, counters)
        return [LaunchTemplate(kernel, blocks, p.threads, args, dict(q=0, k=1, v=2, o=5, lse=6))]


_launches: OrderedDict = OrderedDict()
MAX_CACHED_CALLS = 64


def _launches_for(call: DecodeCall, q, k, v, o, lse) -> DecodeLaunches:
    """The launches of ``call``, from the cache (the most recent MAX_CACHED_CALLS calls) or
    made now with these arrays. They hold no array of the call's own. The key holds the
    combine's factory too: a learner's ``make_combine`` put in place of the course's
    (``EXERCISES``) is planned anew, never served the course's cached kernel."""
    key = (call, make_combine)
    launches = _launches.get(key)
    if launches is None:
        views = _views(call, q, k, v, o, lse)
        launches = _launches[key] = DecodeLaunches(call, views)
        if len(_launches) > MAX_CACHED_CALLS:
            _launches.popitem(last=False)
    else:
        _launches.move_to_end(key)
    return launches


def decode_attention(q, k_cache, v_cache, *, cache_lengths=None, causal=False, scale=None,
                     schedule="stream-k", splits=None, blocks=None, tensor_cores=True):
    """Decode attention: Nq (0..16) new queries a sequence against its KV cache.

    q (B, Hq, Nq, d) float32 or float16; k_cache and v_cache (B, Hkv, Nmax, d), float32 or
    float16 (one dtype for both), Hkv dividing Hq (query head h reads KV head h // (Hq/Hkv)).
    ``cache_lengths``: (B,) ints, sequence b's keys are its first cache_lengths[b] rows
    (None: all Nmax; a device array is copied to the host, which synchronises). ``causal``:
    query i sees key j iff j <= i + cache_lengths[b] - Nq. ``schedule``: "split-k" (two
    launches; ``splits`` overrides ``split_count``) or "stream-k" (one launch; ``blocks``
    overrides the persistent grid of SMs x blocks per SM). ``tensor_cores``: float16 caches
    with several query rows a KV head (GQA, or Nq > 1), d = 64 or 128, take the products on
    tensor cores (``plan``); False keeps them on the FMA units. There float32 queries are
    split into two fp16 parts, so their entries must stay within fp16's range (|q| < 65504;
    beyond it S overflows): for larger queries pass ``tensor_cores=False``.

    The launches of a call are planned once and kept (``DecodeLaunches``, the last 64 calls'
    shapes, cache lengths and options): the next call with the same ones (the next layer of
    the model in the same decode step) only launches. Results are new arrays every call.

    Returns (o, lse): o (B, Hq, Nq, d) and lse (B, Hq, Nq), float32, like ``flash_attention``.
    """
    call = _check_call(q, k_cache, v_cache, cache_lengths, causal, scale, schedule, splits, blocks, tensor_cores)
    kind = ArrayKind(q)
    o = kind.new((call.B, call.hq, call.n_q, call.d))
    lse = kind.new((call.B, call.hq, call.n_q))
    if call.BK and call.rows:
        q, k_cache, v_cache = (x if is_device_array(x) else to_device(x, name)
                               for x, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")))
        launches = _launches_for(call, q, k_cache, v_cache, o, lse)
        launches(launches.operands(q, k_cache, v_cache, o, lse))
    return kind.result(o), kind.result(lse)


class PreparedDecode:
    """A decode call planned once and run many times (``prepare_decode``).

    Each call launches the kernels again on the same q, k_cache and v_cache (a serving loop
    writes the new queries and keys into those buffers in place between steps) and returns
    (o, lse): on the device, the same two arrays every call. ``splits`` / ``blocks``: what
    the plan chose (None where it does not apply)."""

    def __init__(self, launches, operands, held, give_back):
        self.launches, self._operands, self._held, self._give_back = launches, operands, held, give_back
        self.splits = launches.splits if launches is not None else None
        self.blocks = launches.blocks if launches is not None else None

    def __call__(self):
        if self.launches is not None:
            self.launches(self._operands)
        return self._give_back()


def prepare_decode(q, k_cache, v_cache, *, cache_lengths=None, causal=False, scale=None,
                   schedule="stream-k", splits=None, blocks=None, tensor_cores=True) -> PreparedDecode:
    """``decode_attention``'s plan, made once: the arguments are the same; call the result
    to run it (as FlashInfer's plan/run: the per-call host work is then only the launches)."""
    call = _check_call(q, k_cache, v_cache, cache_lengths, causal, scale, schedule, splits, blocks, tensor_cores)
    kind = ArrayKind(q)
    o = kind.new((call.B, call.hq, call.n_q, call.d))
    lse = kind.new((call.B, call.hq, call.n_q))
    held = tuple(x if is_device_array(x) else to_device(x, name)
                 for x, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")))
    launches = operands = None
    if call.BK and call.rows:
        launches = _launches_for(call, *held, o, lse)
        operands = launches.operands(*held, o, lse)
    if kind.on_device:                            # the same device arrays every call
        give_back = lambda: (o, lse)              # noqa: E731
    else:                                         # NumPy in: a fresh host copy every call
        give_back = lambda: (o.copy_to_host(), lse.copy_to_host())  # noqa: E731
    return PreparedDecode(launches, operands, held + (o, lse), give_back)


def key_tile(p: DecodePlan) -> int:
    """Keys a stream-K work unit: two of the block's steps (fine enough to balance, long
    enough that a segment's fixed costs stay small)."""
    return 2 * p.keys_per_step


# --------------------------------------------------------------------------- the first versions
# The notebook's two kernel exercises (their solutions, not printed there). A learner's
# factory of the same name replaces the course's (``kernels.base.learner``) and
# tests/test_decode.py grades it:
#   make_combine        split-K's second kernel (above), the production one: graded on drawn
#                       partials (``combine_partials``) and inside ``decode_attention``'s
#                       split-K, whose plan looks the factory up when it is made.
#   make_first_partial  a first split-K partial, one block a (query row, split), one thread
#                       a column of O, everything from global memory; graded by
#                       ``first_split_k``, which runs it and then the combine.
# Correct, and slow: each thread of a first partial reads the whole of q and every key row
# of its range (d loads a key, the block's d threads all reading the same ones), and a
# block has one query row, so K and V are read once for every query row of a group.

EXERCISES = {"make_combine": "test_combine", "make_first_partial": "test_first_split_k"}


@functools.lru_cache(maxsize=None)
def make_first_partial():
    """Kernel (q, k, v, lengths, o_part, l_part, scale, causal): a first split-K partial.

    q (B, Hq, Nq, d); k and v (B, Hkv, Nmax, d) float32 or float16; lengths (B,) int32;
    o_part (R, splits, d) and l_part (R, splits) float32, R = B*Hq*Nq query rows, row
    ((b*Hq) + h)*Nq + i. Grid (R, splits), d threads: block (row, s) takes split s of the
    keys of its sequence b (n = lengths[b] keys, chunks of ceil(n / splits), as
    ``split_ranges``), of KV head h // (Hq/Hkv); thread c owns column c of O. It writes
    O_s = softmax(S[slice]) V[slice] (normalised) to o_part[row, s] and L_s =
    logsumexp(S[slice]) to l_part[row, s]; O_s = 0 and L_s = -inf where the row sees no key
    of the slice (an empty slice, or every key past its causal diagonal i + n - Nq)."""

    @cuda.jit(fastmath=FASTMATH)
    def first_partial(q, k, v, lengths, o_part, l_part, scale, causal):
        row = cuda.blockIdx.x
        s = cuda.blockIdx.y
        c = cuda.threadIdx.x                      # this thread's column of O
        hq, nq, d = q.shape[1], q.shape[2], q.shape[3]
        b = row // (hq * nq)
        h = (row // nq) % hq
        i = row % nq
        kv = h // (hq // k.shape[1])              # GQA: the group's KV head
        n = lengths[b]                            # the sequence's keys; rows past n are not its keys
        splits = cuda.gridDim.y
        chunk = (n + splits - 1) // splits
        start = min(s * chunk, n)
        end = min(start + chunk, n)
        m = MINUS_INF                             # running max, sum and O of the slice
        l = float32(0.0)
        o = float32(0.0)
        for j in range(start, end):
            if causal and j > i + n - nq:         # the new tokens are the last Nq of the sequence
                break
            x = float32(0.0)                      # S_ij = scale q_i . k_j (every thread: the same)
            for t in range(d):
                x += float32(q[b, h, i, t]) * float32(k[b, kv, j, t])
            x *= scale
            m_new = nan_max(m, x)
            alpha = math.exp(m - m_new) if m != MINUS_INF else float32(0.0)   # no exp(-inf - (-inf))
            p = math.exp(x - m_new)
            l = l * alpha + p
            o = o * alpha + p * float32(v[b, kv, j, c])
            m = m_new
        if l == float32(0.0):                     # no key visible: the empty piece
            o_part[row, s, c] = float32(0.0)
            if c == 0:
                l_part[row, s] = MINUS_INF
        else:                                     # (a NaN stays NaN)
            o_part[row, s, c] = o / l
            if c == 0:
                l_part[row, s] = m + math.log(l)

    return first_partial


def _block_threads() -> int:
    """A combine block's threads, as ``plan`` chooses them: one warp in the simulator."""
    return 32 if on_simulator() else GPU_THREADS


def first_split_k(q, k_cache, v_cache, *, cache_lengths=None, causal=False, scale=None, splits=4, out=None,
                  lse_out=None):
    """Split-K by the first versions: ``make_first_partial``'s kernel, then ``make_combine``'s
    (both looked up at the call, so a learner's replace them). The arguments are
    ``decode_attention``'s; ``splits`` (1..1024) slices each sequence's keys. Returns (o, lse)
    like it; ``out`` (B, Hq, Nq, d) and ``lse_out`` (B, Hq, Nq): float32 device arrays to
    write into (returned as given)."""
    if splits is None:
        raise TypeError("splits: expected an int, got NoneType")
    call = _check_call(q, k_cache, v_cache, cache_lengths, causal, scale, "split-k", splits, None, False)
    B, hq, n_q, d, splits = call.B, call.hq, call.n_q, call.d, call.splits
    kind = ArrayKind(q)
    o = check_out(out, "out", (B, hq, n_q, d))
    lse = check_out(lse_out, "lse_out", (B, hq, n_q))
    o = device_empty((B, hq, n_q, d)) if o is None else o
    lse = device_empty((B, hq, n_q)) if lse is None else lse
    rows = B * hq * n_q
    if rows:
        # the partials, NaN until written: a slot the partial kernel never writes shows in O
        o_part = cuda.to_device(np.full((rows, splits, d), np.nan, np.float32))
        l_part = cuda.to_device(np.full((rows, splits), np.nan, np.float32))
        lengths = cuda.to_device(np.asarray(call.lengths, np.int32))
        make_first_partial()[(rows, splits), d](to_device(q, "q"), to_device(k_cache, "k_cache"),
                                                to_device(v_cache, "v_cache"), lengths, o_part, l_part,
                                                np.float32(call.scale), call.causal)
        # the combine, one row a block (RT = 1): row r's partials are slots r*splits .. r*splits + splits - 1
        threads = _block_threads()
        make_combine(padded_head_dim(d), 1, threads)[(rows, 1), threads](
            o_part.reshape(rows * splits, 1, d), l_part.reshape(rows * splits, 1), o.reshape(1, rows, d),
            lse.reshape(1, rows), np.int32(splits), np.int32(d))
    return (out if out is not None else kind.give_back(o),
            lse_out if lse_out is not None else kind.give_back(lse))


def combine_partials(o_parts, l_parts, *, rows_per_block=None, out=None, lse_out=None):
    """Split-K's second kernel (``make_combine``, looked up at the call) on partials you give it.

    o_parts (S, H, rows, d) and l_parts (S, H, rows) float32: partial s of row r of head h
    (O_s normalised, L_s natural log; an empty piece O_s = 0, L_s = -inf). They are laid out
    as split-K leaves them (head h's row tile t of RT rows, split s: slot (h*tiles + t)*S + s;
    the rows past the last tile's end NaN) and the combine runs on grid (tiles, H), as in
    ``decode_attention``. ``rows_per_block``: RT, 1..16 (default: the plan's for ``rows``).
    Returns (O (H, rows, d), L (H, rows)) float32; ``out``/``lse_out``: device arrays of
    those shapes to write into (returned as given)."""
    (S, H, rows, d), _ = check_array(o_parts, "o_parts", ndim=4)
    l_shape, _ = check_array(l_parts, "l_parts", ndim=3)
    if l_shape != (S, H, rows):
        raise ValueError(f"l_parts: expected shape {(S, H, rows)} like o_parts' first three, got {l_shape}")
    if S < 1:
        raise ValueError("o_parts: expected at least one partial (S >= 1)")
    if not 1 <= d <= 128:
        raise ValueError(f"o_parts: expected head dim d in 1..128, got {d}")
    if H > MAX_GRID_Y:
        raise ValueError(f"o_parts: expected at most {MAX_GRID_Y} heads, got {H}")
    rt = plan(d, max(rows, 1)).RT if rows_per_block is None else check_int(rows_per_block, "rows_per_block", 1,
                                                                           MAX_ROWS)
    kind = ArrayKind(o_parts)
    o = check_out(out, "out", (H, rows, d))
    lse = check_out(lse_out, "lse_out", (H, rows))
    o = device_empty((H, rows, d)) if o is None else o
    lse = device_empty((H, rows)) if lse is None else lse
    if H and rows:
        host = [x.copy_to_host() if is_device_array(x) else np.asarray(x) for x in (o_parts, l_parts)]
        tiles = cdiv(rows, rt)
        po = np.full((S, H, tiles * rt, d), np.nan, np.float32)
        pl = np.full((S, H, tiles * rt), np.nan, np.float32)
        po[:, :, :rows], pl[:, :, :rows] = host
        # (S, H, tiles, RT, ...) -> slots (H, tiles, S): the order make_split_k writes them in
        po = po.reshape(S, H, tiles, rt, d).transpose(1, 2, 0, 3, 4).reshape(H * tiles * S, rt, d)
        pl = pl.reshape(S, H, tiles, rt).transpose(1, 2, 0, 3).reshape(H * tiles * S, rt)
        threads = _block_threads()
        make_combine(padded_head_dim(d), rt, threads)[(tiles, H), threads](
            cuda.to_device(np.ascontiguousarray(po)), cuda.to_device(np.ascontiguousarray(pl)), o, lse,
            np.int32(S), np.int32(d))
    return (out if out is not None else kind.give_back(o),
            lse_out if lse_out is not None else kind.give_back(lse))


# --------------------------------------------------------------------------- the IO model

def io_model_bytes(B: int, hq: int, hkv: int, n_q: int, n_keys, d: int, *, kv_itemsize: int = 4,
                   q_itemsize: int = 4) -> int:
    """Compulsory HBM bytes of decode: K and V once (each cached key of each KV head), Q
    read and O and L written once. ``n_keys``: an int or the B cache lengths."""
    keys = int(np.sum(np.broadcast_to(np.asarray(n_keys, np.int64), (B,))))
    return 2 * keys * hkv * d * kv_itemsize + B * hq * n_q * (d * q_itemsize + 4 * d + 4)


# --------------------------------------------------------------------------- sm_90 PTX check

def ptx_targets(every_shape: bool = False):
    """(kernel, signature) pairs for ``kernels.base.ptx_check``: stream-K on fp32 caches
    (16-byte and one-element loads, MHA and 16 grouped rows; ``every_shape``: also 4 rows at d = 64), on fp16 caches (MHA with 16-byte
    loads on the FMA units, grouped rows on tensor cores); split-K and its combine on the
    fp32 MHA shapes (split-K calls stream-K's device function: its other shapes are those)."""
    from numba import types

    f32_3, f16_3 = types.float32[:, :, ::1], types.float16[:, :, ::1]
    f32_2, i32_1 = types.float32[:, ::1], types.int32[::1]
    scalars = (types.int32, types.int32, types.float32, types.int32)
    out = []
    for kv in (f32_3, f16_3):
        # (fp16 caches with grouped rows go to tensor cores: their FMA plans only by request)
        shapes = (((128, 1, True), (128, 1, False), (128, 16, True)) + (((64, 4, True),) if every_shape else ())
                  if kv is f32_3 else ((128, 1, True),))
        for d, rows, wide in shapes:
            p = plan(d, rows, 2 if kv is f16_3 else 4, wide, tensor_cores=False)
            label = f"{'fp16' if kv is f16_3 else 'fp32'} KV, d={d}, {rows} rows ({p})"
            if (d, rows, wide) == (128, 1, True) and kv is f32_3:
                out.append((f"split_k {label}", make_split_k(*p.key),
                            (f32_3, kv, kv, f32_3, f32_2, f32_3, f32_2, i32_1, *scalars)))
            out.append((f"stream_k {label}", make_stream_k(*p.key),
                        (f32_3, kv, kv, f32_3, f32_2, f32_3, f32_2, i32_1, *scalars, types.int32,
                         i32_1, i32_1, i32_1, i32_1, i32_1, i32_1, i32_1)))
    p = plan(128, 4, 2, True, 4)                         # tensor cores: GQA 32/8 rows, fp16 cache
    out.append((f"stream_k tensor cores, fp16 KV, fp32 q, d=128, 4 rows ({p})", make_stream_k(*p.key),
                (f32_3, f16_3, f16_3, f32_3, f32_2, f32_3, f32_2, i32_1, *scalars, types.int32,
                 i32_1, i32_1, i32_1, i32_1, i32_1, i32_1, i32_1)))
    p = plan(128, 1)
    out.append(("combine", make_combine(p.D, p.RT, p.threads), (f32_3, f32_2, f32_3, f32_2, types.int32, types.int32)))
    f32_4, f16_4 = types.float32[:, :, :, ::1], types.float16[:, :, :, ::1]
    for kv in (f32_4, f16_4):                           # the first version (the exercise's kernel)
        out.append((f"first partial, {'fp16' if kv is f16_4 else 'fp32'} KV (a block a row and split)",
                    make_first_partial(), (f32_4, kv, kv, i32_1, f32_3, f32_2, types.float32, types.boolean)))
    return out
