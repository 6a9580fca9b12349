"""fp32 attention's backward on tensor cores: chapter 12's kernel with 3xTF32 products.

Chapter 5's algebra (P recomputed from Q, K and the saved L; D = rowsum(dO o O)) with its
five products on ``mma.sync.m16n8k8.tf32``, each fp32 product as three TF32 products
(``kernels.base.tf32_product``: a b ~ a_lo b_hi + a_hi b_lo + a_hi b_hi). The loops are
chapter 12's, K/V tiles outer (FlashAttention-2's backward):

    one block        key tile j: Bc = 16 W keys of one (batch, KV head), W warps; K_j, V_j
                     in shared memory (fp32, rows padded by 4 words); dK_j, dV_j in the
                     warps' accumulators
    one warp         16 keys: its rows of K_j and V_j are A fragments, its 16 rows of dK_j
                     and dV_j D/8 accumulator tiles each
    for each query head of the KV head's group (GQA), each query tile i (Br rows: Q_i, dO_i,
    L_i, D_i in shared memory, the next tile's copy flying during this one's work), each
    chunk of QN tiles c of 8 queries (a tile c is an m16n8k8 k-step of the products that sum
    over queries):
        S^T   = K_w Q_c^T          16 keys x 8 queries: one accumulator tile, D/8 k-steps;
                                   a k-step splits K_w's A fragment once for the chunk's QN
                                   tiles (``tf32_backward_chunk``)
        dP^T  = V_w dO_c^T         the same shape, V_w's fragment split once a chunk
      then, for each tile c of the chunk:
        P^T   = exp2(S^T scale log2 e - L log2 e)          0 where masked
        dS^T  = P^T o (dP^T - D)
        dV_w += P^T dO_c           P^T's accumulator tile is the A fragment once its 8
                                   queries are renumbered (chapter 11's P V: the lane
                                   holding queries 2t and 2t + 1 takes them as k = t and
                                   t + 4, and reads dO's rows 2t and 2t + 1)
        dK_w += dS^T Q_c           the same, dS^T and Q_c
        dS^T -> shared memory (fp32)
    then dQ_i += scale dS K_j      dS read back from the stored dS^T as A fragments, K_j as
                                   B, the keys renumbered as above (every fragment load in
                                   32 distinct banks); the block's sums go to dQ by float32
                                   atomic adds (dQ's last bits vary from run to run)
    dK_j = scale dK_w and dV_j written once.

Every operand is split into TF32 hi and lo parts where it is used (``split_tf32_at``: a
load from a 32-bit shared address and the split): the fp32 tiles in shared memory are
each read as A and as B in different layouts, and split copies would double the shared
memory the tiles take. The price, measured with Nsight Compute on the H100 (d = 64) when
the split rounded with cvt.rna (four SASS instructions): 15.7 instructions issued per mma,
most of them the splits' roundings; the tensor pipe busy 24% of the time, the warps (two a
scheduler) mostly waiting on those dependent instructions. With cvt.rn (one instruction,
sm_90: ``kernels.base.mma.split_ties``) the kernel runs 1.26-1.30x faster (B=4 H=16
N=4096: 27.6 -> 21.9 ms at d = 64, 52.1 -> 40.4 at d = 128). (Tiles stored as split pairs,
read with one 64-bit load an element, measured no faster with cvt.rna: 28.3 against 30.0
ms at the same tiles.) Splitting K_w's and V_w's fragments once for QN = 2 or 4 query
tiles, not for each, and (at d = 64) launch bounds that let ptxas keep more mma in flight:
20.9 -> 15.8 ms at d = 64 and 37.8 -> 35.8 at d = 128 on the H200 (B=4 H=16 N=4096, bare
launches; ``tf32_backward_chunk``). The split's rounding of lo buys nothing: x - hi is at
most 2^12 of x's float32 ulps, so tf32's 11 significant bits drop at most its last bit, and
one dropped bit is 0 or a tie: a rounded lo misses x by exactly what the mma's own
truncation of an unrounded one does (``kernels.tf32_error.split_tf32``). ``lo="truncated"``
leaves x - hi as it is (``split_tf32_at``: a load, one cvt.rn and one subtraction): at d =
128, S^T and dP^T's loop then takes 6.4 instructions an mma where it takes 7.4, dQ's 6.1
where 7.1 (SASS for sm_90). Under 255 registers ptxas then pads between dependent mma;
``rounds=True`` issues S^T's and dP^T's products round by round so that 8 mma stand between
them. Both are the launchers' defaults (``DEFAULT_LO``, ``DEFAULT_ROUNDS``): on the H200 at
d = 128 (bare, the three variants taking turns) 1.12-1.14x the rounded split's speed (B=32
H=16 N=1024: 18.04 -> 15.82 ms, plain PyTorch's backward 15.82, SDPA memory-efficient 19.09),
lo truncated alone 1.05-1.06x. ``passes=1`` multiplies hi by hi alone (plain TF32), to show what that
loses.

Before it, chapter 5's pre-pass D = rowsum(dO o O) (zeroing dQ for the atomic adds).
Inputs float32 (q, do (B, H, Nq, d); k, v (B, Hkv, Nk, d): grouped-query attention), o and
lse as the forward returns them; gradients float32.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint32

from kernels.base.backward_args import check_grouped_args, run_grouped_backward
from kernels.base.gradient_adds import add_pair_to_dq, make_tile_adds
from kernels.base.fused import FASTMATH, LOG2E
from kernels.base.inlined import inlined
from kernels.base.runtime import ArrayKind, BoundLaunches, LaunchCache, cdiv, check_flag, check_scale, \
    launch_stream, on_simulator
from kernels.base.key_block_walk import next_pair, pair_at, query_pairs
from kernels.base.query_split import add_zero_gradients, query_splits_for
from kernels.base.tf32_product import PASSES, make_tf32_product, make_tf32_product_pairs
from kernels.base.tile_copy import make_async_tile_copy

__all__ = ["flash_attention_backward_tf32", "launch_backward", "make_backward_tf32", "tf32_backward_tiles",
           "tf32_backward_min_blocks", "tf32_backward_chunk", "tf32_backward_tile_adds",
           "shared_words", "ptx_targets", "accumulator_as_a", "check_accumulator_as_a", "check_accumulator_as_a_case"]

# The base-2 logsumexp of a dead row (past Nq, or L = -inf): exp2(S - DEAD) = 0.
DEAD = float32(1.0e30)
DEFAULT_LO = "truncated"        # the launchers': 1.13x "rounded" with DEFAULT_ROUNDS (H200, d = 128)
DEFAULT_ROUNDS = True          # the launchers': S^T's products round by round (see the variant bench)


def tf32_backward_tiles(d: int) -> tuple[int, int, int]:
    """(Br, W, D): Br query rows a tile, W warps (Bc = 16 W keys a block), D = d rounded up
    to a multiple of 8 (an m16n8k8 k-step). On a GPU 8 warps (128 keys: dQ's atomic adds,
    Br D a block and query tile, come once per 128 keys of work) and 64 query rows at D <=
    64, 32 at D = 128 (K_j, V_j, two buffers of Q_i and dO_i and dS^T in fp32: 174 KB and
    221 KB of shared memory). Measured on the H100 at B=4 H=16 N=4096, bare launches: d =
    64, 26.9 ms against 30.1 with 32 rows and 30.3 with (32 rows, 4 warps); d = 128, 51.5
    against 58.1 with 16 rows and 77.2 with 4 warps. In the simulator 16 rows and one warp
    (its Python threads are slow)."""
    D = 8 * cdiv(max(int(d), 1), 8)
    if on_simulator():
        return 16, 1, D
    return (64, 8, D) if D <= 64 else (32, 8, D)


def tf32_backward_min_blocks(D: int) -> int | None:
    """The blocks an SM must hold at once, told to the compiler with the block's size (launch
    bounds), or None (nothing told). At D <= 64 one block (its 174 KB of shared memory allow
    no second): ptxas may then spend up to 255 registers a thread, and keeps the products'
    mma in flight instead of padding between them. At D = 128 the kernel takes 255 registers
    told nothing. (Measured with the chunks: ``tf32_backward_chunk``.)"""
    return 1 if D <= 64 else None


def tf32_backward_chunk(Br: int, D: int) -> int:
    """8-query tiles a chunk of S^T and dP^T (QN): each k-step splits K_w's and V_w's A
    fragments once for the chunk's QN tiles, not once a tile. Measured on the H200, B=4 H=16
    N=4096, bare launches (``workbook/results/tf32_backward_ab.csv``): d = 64, QN = 2 with
    launch bounds 15.8 ms (the kernel before chunks: 20.9; QN = 1, nothing shared: 21.6; QN =
    4 with launch bounds 16.4, registers spilled); d = 128, QN = 4 35.8 ms (before: 37.8; QN =
    2 spills)."""
    return min(2 if D <= 64 else 4, Br // 8)


def tf32_backward_tile_adds(D: int) -> bool:
    """Whether a warp adds its dQ tiles with one bounds test for the whole warp
    (``kernels.base.gradient_adds.make_tile_adds``, chapter 12's way) rather than one a pair:
    at D = 128 a warp's 8 pairs took about 580 instructions a query tile the pair way (SASS for
    sm_90), a third of its dQ products' loop; one test a warp takes 76. On the H100 the time did
    not follow (``workbook/results/TUNING.md``, chapter 11): within 1% either way at D = 128, so
    those instructions did not bound it. Kept at D > 64 for the shared building block and the
    fewer instructions; at D <= 64 the kernel stays as it was measured (the tile adds 3% slower
    there before the chunks, 1.6% faster after, within the spread)."""
    return D > 64


def shared_words(Br: int, W: int, D: int) -> int:
    """32-bit words of shared memory a block: K_j and V_j (Bc rows), Q_i and dO_i twice (the
    next tile's copy flies), dS^T (Bc x Br); rows padded by 4 words (fragment loads in 32
    distinct banks)."""
    Bc, SD = 16 * W, D + 4
    return 2 * Bc * SD + 4 * Br * SD + Bc * (Br + 4)


@functools.lru_cache(maxsize=None)
def make_backward_tf32(Br: int, W: int, D: int, passes: int = 3, dynamic: bool = False, split: bool = False,
                       min_blocks: int | None = None, chunk: int | None = None, tile_adds: bool | None = None,
                       lo: str = DEFAULT_LO, rounds: bool = DEFAULT_ROUNDS):
    """The dK/dV/dQ kernel for Br query rows a tile, W warps (Bc = 16 W keys), head dim D (a
    multiple of 8), ``passes`` TF32 products a product (3 or 1); ``dynamic``: its shared
    memory (``shared_words``) is dynamic; ``split``: the (query head, query tile) pairs split
    among gridDim.z blocks a key tile, each adding its dK_j, dV_j into zeroed dk, dv
    (``kernels.base.query_split``); ``min_blocks``: launch bounds (``tf32_backward_min_blocks``);
    ``chunk``: QN, the 8-query tiles a chunk of S^T and dP^T (a divisor of Br / 8; by default
    ``tf32_backward_chunk``); ``tile_adds``: dQ added a warp's tiles at a time with one bounds
    test (by default ``tf32_backward_tile_adds``); ``lo``: how a fragment load's split leaves
    lo = x - hi (``SPLIT_LO``, by default ``DEFAULT_LO``): "rounded" to tf32
    (``split_tf32_at_rounded``), or "truncated": its float32 bits as they are, which the mma
    truncates (``split_tf32_at``); ``rounds``: S^T's and dP^T's 2 QN products of a k-step
    issued round by round (``make_tf32_product_pairs``: 2 QN mma between dependent ones), or
    product by product (ptxas then interleaves a few; at D = 128, under 255 registers, it pads
    between dependent mma). The same sums either way, bit for bit.

    Launch: grid (ceil(Nk / Bc), B * Hkv[, S]), 32 W threads. Arguments: q, do (B*H, Nq, d) and
    k, v (B*Hkv, Nk, d) float32; lse and delta (B*H, Nq) float32 (L, natural log, and D from
    the pre-pass); dq (B*H, Nq, d) float32, zeroed; dk, dv (B*Hkv, Nk, d) float32; scale
    (float32), causal (int32 0/1), group (int32: H / Hkv), aligned (int32: rows of q, k, v,
    dO and dQ 16-byte aligned and d % 4 == 0: cp.async copies, and dQ's adds in pairs)."""
    from kernels.base.mma import (cp_async_commit, cp_async_wait_all,
                                  shared_address, splits_for)
    from kernels.base.query_split import make_block_steps, make_gradient_store
    from kernels.base.shared_memory import shared_view

    if passes not in PASSES:
        raise ValueError(f"passes: expected one of {PASSES}, got {passes!r}")
    _, split_at = splits_for(lo)
    if D % 8 or Br % 16 or W < 1:
        raise ValueError(f"tiles: expected D a multiple of 8, Br of 16 and W >= 1, got Br={Br}, W={W}, D={D}")
    split4, split2, product = make_tf32_product(passes)
    ROUNDS = bool(rounds)
    Bc = 16 * W
    THREADS = 32 * W
    KS, ND, QC, KC = D // 8, D // 8, Br // 8, Bc // 8    # k-steps over d; tiles of d; 8-query tiles; 8-key steps
    QN = int(chunk) if chunk else tf32_backward_chunk(Br, D)     # 8-query tiles a chunk of S^T and dP^T
    if QC % QN:
        raise ValueError(f"chunk: expected a divisor of Br / 8 = {QC}, got {chunk}")
    pairs = make_tf32_product_pairs(passes, QN)   # (ROUNDS) S^T's and dP^T's QN products each, round by round
    TILE_ADDS = tf32_backward_tile_adds(D) if tile_adds is None else bool(tile_adds)
    RG = Br // 16                                 # dQ_i's row groups of 16 queries
    # dQ_i's pieces: a row group and NC column tiles of 8 (the row group's dS fragments split
    # once for the NC tiles); as few pieces as there are warps, where D allows
    NC = ND
    while NC > 1 and (RG * (ND // NC) < W or ND % NC):
        NC -= 1
    ITEMS = RG * (ND // NC)
    add_tiles = make_tile_adds(NC)                # (used where TILE_ADDS)
    SD, SB = D + 4, Br + 4                        # shared row strides (words)
    TILE, QTILE = Bc * SD, Br * SD
    QBASE = 2 * TILE + Bc * SB                    # Q_i and dO_i's two buffers start here
    SHARED = 0 if dynamic else shared_words(Br, W, D)
    # unsigned loop counters on the GPU (chapter 12: Numba's range() loop control and signed
    # 64-bit index arithmetic cost instructions); plain ints in the simulator
    U = int if on_simulator() else uint32
    block_steps = make_block_steps(bool(split))           # all the walk, or a split's share
    store_gradients = make_gradient_store(bool(split))   # stored, or added (a split)

    # byte offsets in shared memory: 8 rows of a K/Q tile, of dS^T; one row of each
    ROWS8, SROWS8, ROW, SROW = 32 * SD, 32 * SB, 4 * SD, 4 * SB

    @inlined
    def a_at(addr, o1, o2):
        """An A fragment's hi and lo parts from shared memory: a0 at addr, a1 at addr + o1,
        a2 at addr + o2, a3 at addr + o1 + o2 (byte offsets)."""
        h0, l0 = split_at(addr)
        h1, l1 = split_at(addr + o1)
        h2, l2 = split_at(addr + o2)
        h3, l3 = split_at(addr + o1 + o2)
        return (h0, h1, h2, h3), (l0, l1, l2, l3)

    @inlined
    def b_at(addr, o1):
        """A B fragment's hi and lo parts: b0 at addr, b1 at addr + o1."""
        h0, l0 = split_at(addr)
        h1, l1 = split_at(addr + o1)
        return (h0, h1), (l0, l1)

    stage_keys = make_async_tile_copy(Bc, D, THREADS, 4, float32)      # K_j, V_j: Bc rows
    stage_queries = make_async_tile_copy(Br, D, THREADS, 4, float32)   # Q_i, dO_i: Br rows

    @inlined
    def stage_pair(q, do, lse, delta, smem, Ls, Ds, buf, bh, q0, n_q, d, tid, aligned):
        """Query tile q0 of head bh (Q_i, dO_i, L_i in base 2, D_i) into buffer ``buf``."""
        at = QBASE + 2 * buf * QTILE
        stage_queries(q[bh], shared_view(smem, at, (Br, SD)), n_q, q0, d, tid, aligned)
        stage_queries(do[bh], shared_view(smem, at + QTILE, (Br, SD)), n_q, q0, d, tid, aligned)
        for r in range(tid, Br, THREADS):
            row = q0 + r
            L = lse[bh, row] if row < n_q else -math.inf
            Ls[buf, r] = DEAD if L == -math.inf else L * float32(LOG2E)
            Ds[buf, r] = delta[bh, row] if row < n_q else float32(0.0)

    caps = {} if on_simulator() or min_blocks is None else {"launch_bounds": (THREADS, int(min_blocks))}

    @cuda.jit(fastmath=FASTMATH, **caps)
    def backward_tf32(q, k, v, do, lse, delta, dq, dk, dv, scale, causal, group, aligned):
        bkv = int32(cuda.blockIdx.y)
        tid = int32(cuda.threadIdx.x)
        warp = tid // 32
        lane = tid % 32
        g = U(lane // 4)
        t = U(lane % 4)
        k0 = int32(cuda.blockIdx.x) * Bc
        n_q, n_k, d = int32(q.shape[1]), int32(k.shape[1]), int32(q.shape[2])
        smem = cuda.shared.array(SHARED, float32, alignment=16)
        Ks = shared_view(smem, 0, (Bc, SD))
        Vs = shared_view(smem, TILE, (Bc, SD))
        dSs = shared_view(smem, 2 * TILE, (Bc, SB))   # dS^T: keys x queries
        Ls = cuda.shared.array((2, Br), float32)       # L (base 2) and D of the staged rows
        Ds = cuda.shared.array((2, Br), float32)
        kw = U(warp * 16)                             # this warp's keys: k0 + kw .. + 15
        diag = n_k - n_q

        stage_keys(k[bkv], Ks, n_k, k0, d, tid, aligned)
        stage_keys(v[bkv], Vs, n_k, k0, d, tid, aligned)
        cp_async_commit()
        # 32-bit shared addresses of each lane's first fragment element, made once: a k-step
        # adds a constant (indexing an array costs 64-bit arithmetic at every load)
        ka = shared_address(Ks, kw + g, t)            # K_w, V_w as A of S^T, dP^T
        va = shared_address(Vs, kw + g, t)
        kb = shared_address(Ks, U(2) * t, g)          # K_j as B of dQ (keys 2t, 2t + 1)
        sa = shared_address(dSs, U(2) * t, g)         # dS as A of dQ, from dS^T

        dka = cuda.local.array((ND, 4), float32)       # dK_w, dV_w: D/8 accumulator tiles each
        dva = cuda.local.array((ND, 4), float32)
        for j in range(ND):
            for e in range(4):
                dka[j, e] = float32(0.0)
                dva[j, e] = float32(0.0)
        scale2 = float32(scale * LOG2E)
        # (query head, query tile) pairs that see these keys, in order (causal: from `first` on)
        first, n_tiles, steps = query_pairs(k0, diag, causal, n_q, Br, group)
        s0, s1 = block_steps(steps)                 # this block's pairs: all, or its split's share

        bh, q0 = int32(0), int32(0)
        if s1 > s0:                                   # the first pair's copies
            bh, q0 = pair_at(s0, bkv, group, first, n_tiles, Br)
            stage_pair(q, do, lse, delta, smem, Ls, Ds, 0, bh, q0, n_q, d, tid, aligned)
        cp_async_commit()
        for i in range(s1 - s0):
            step = s0 + i
            buf = i % 2
            cp_async_wait_all()                       # this pair's Q_i and dO_i (and K_j, V_j), the groups
            cuda.syncthreads()                        # in flight, have landed for every warp; every warp is
            nbh, nq0 = next_pair(bh, q0, first, n_tiles, Br)
            if step + 1 < s1:                         # done with the other buffer and dS. The next pair's
                nb = 1 - buf
                stage_pair(q, do, lse, delta, smem, Ls, Ds, nb, nbh, nq0, n_q, d, tid, aligned)
            cp_async_commit()                         # copies fly during this one

            ubuf = U(buf)
            Qv = shared_view(smem, QBASE + 2 * buf * QTILE, (Br, SD))
            dOv = shared_view(smem, QBASE + (2 * buf + 1) * QTILE, (Br, SD))
            qb = shared_address(Qv, g, t)             # Q_c, dO_c as B of S^T, dP^T
            ob = shared_address(dOv, g, t)
            qt = shared_address(Qv, U(2) * t, g)      # Q_c, dO_c as B of dK, dV (queries 2t, 2t + 1)
            ot = shared_address(dOv, U(2) * t, g)
            c = U(0)
            while c < U(QC // QN):
                cq = c * U(8 * QN)                    # the chunk's first row in the tile
                cb = c * U(QN * ROWS8)                # ... in bytes
                # ---- S^T = K_w Q_c^T, dP^T = V_w dO_c^T, QN tiles of 8 queries: K_w's and V_w's A fragments
                # split once a k-step for the QN tiles. A[g, t] = K[kw + g, 8 s + t], B[t, g] = Q[cq + 8 n + g, 8 s + t]
                s = cuda.local.array((QN, 4), float32)
                p = cuda.local.array((QN, 4), float32)
                bq = cuda.local.array((QN, 4), uint32)   # (ROUNDS) a k-step's B fragments (hi, hi, lo, lo): Q_c's
                bo = cuda.local.array((QN, 4), uint32)   # dO_c's
                s_step = cuda.local.array((QN, 4), float32)   # the k-step's products
                p_step = cuda.local.array((QN, 4), float32)
                for n in range(QN):
                    for e in range(4):
                        s[n, e] = float32(0.0)
                        p[n, e] = float32(0.0)
                for s_ in range(KS):
                    k_hi, k_lo = a_at(ka + U(32 * s_), U(ROWS8), U(16))
                    v_hi, v_lo = a_at(va + U(32 * s_), U(ROWS8), U(16))
                    if ROUNDS:                        # the 2 QN products round by round (bit for bit the same)
                        for n in range(QN):
                            at = cb + U(n * ROWS8 + 32 * s_)      # the tile's fragment, in bytes
                            b_hi, b_lo = b_at(qb + at, U(16))
                            f_hi, f_lo = b_at(ob + at, U(16))
                            bq[n, 0], bq[n, 1], bq[n, 2], bq[n, 3] = b_hi[0], b_hi[1], b_lo[0], b_lo[1]
                            bo[n, 0], bo[n, 1], bo[n, 2], bo[n, 3] = f_hi[0], f_hi[1], f_lo[0], f_lo[1]
                        pairs(k_hi, k_lo, bq, s_step, v_hi, v_lo, bo, p_step)
                        for n in range(QN):
                            for e in range(4):
                                s[n, e] += s_step[n, e]
                                p[n, e] += p_step[n, e]
                    else:
                        for n in range(QN):
                            b_hi, b_lo = b_at(qb + cb + U(n * ROWS8 + 32 * s_), U(16))
                            x = product(k_hi, k_lo, b_hi, b_lo)
                            b_hi, b_lo = b_at(ob + cb + U(n * ROWS8 + 32 * s_), U(16))
                            y = product(v_hi, v_lo, b_hi, b_lo)
                            for e in range(4):
                                s[n, e] += x[e]
                                p[n, e] += y[e]
                # ---- P^T and dS^T, a tile at a time: element e is key kw + g + 8 (e // 2), query qc + 2 t + e % 2;
                # their A fragments for dV and dK, queries 2t, 2t + 1 renumbered as k = t, t + 4
                p_hi = cuda.local.array((QN, 4), uint32)
                p_lo = cuda.local.array((QN, 4), uint32)
                d_hi = cuda.local.array((QN, 4), uint32)
                d_lo = cuda.local.array((QN, 4), uint32)
                for n in range(QN):
                    qc = cq + U(8 * n)                # this tile's first row
                    pt = cuda.local.array(4, float32)
                    dst = cuda.local.array(4, float32)
                    for e in range(4):
                        col = qc + U(2) * t + U(e % 2)
                        pe = math.exp2(s[n, e] * scale2 - Ls[ubuf, col])
                        pt[e] = pe
                        dst[e] = pe * (p[n, e] - Ds[ubuf, col])
                    qa = q0 + int32(qc)               # the tile's first query
                    if k0 + int32(kw) + 15 >= n_k or (causal != 0 and k0 + int32(kw) + 15 > qa + diag):
                        for e in range(4):            # only tiles that cross n_k or the diagonal
                            key = k0 + int32(kw + g) + 8 * (e // 2)
                            query = qa + int32(U(2) * t) + e % 2
                            if key >= n_k or (causal != 0 and key > query + diag):
                                pt[e] = float32(0.0)
                                dst[e] = float32(0.0)
                    hi, lo = split4(pt[0], pt[2], pt[1], pt[3])
                    for e in range(4):
                        p_hi[n, e] = hi[e]
                        p_lo[n, e] = lo[e]
                    hi, lo = split4(dst[0], dst[2], dst[1], dst[3])
                    for e in range(4):
                        d_hi[n, e] = hi[e]
                        d_lo[n, e] = lo[e]
                    for e in range(4):                # dS^T to shared memory
                        dSs[kw + g + U(8 * (e // 2)), qc + U(2) * t + U(e % 2)] = dst[e]
                # ---- dV_w += P^T dO_c, dK_w += dS^T Q_c: each tile one k-step. The fragments above sit in registers
                # where the compiler unrolls the loop over n, in local memory where it does not (d = 128: 16 loads a
                # tile); the dt loop is unrolled, so dK_w and dV_w stay in registers.
                # B[t, g] = dO[qc + 2t, 8 dt + g], B[t + 4, g] = dO[qc + 2t + 1, 8 dt + g]
                for n in range(QN):
                    ph = (p_hi[n, 0], p_hi[n, 1], p_hi[n, 2], p_hi[n, 3])
                    pl = (p_lo[n, 0], p_lo[n, 1], p_lo[n, 2], p_lo[n, 3])
                    dh = (d_hi[n, 0], d_hi[n, 1], d_hi[n, 2], d_hi[n, 3])
                    dl = (d_lo[n, 0], d_lo[n, 1], d_lo[n, 2], d_lo[n, 3])
                    nb = cb + U(n * ROWS8)            # the tile's first row, in bytes
                    for dt in range(ND):
                        b_hi, b_lo = b_at(ot + nb + U(32 * dt), U(ROW))
                        x = product(ph, pl, b_hi, b_lo)
                        b_hi, b_lo = b_at(qt + nb + U(32 * dt), U(ROW))
                        y = product(dh, dl, b_hi, b_lo)
                        for e in range(4):
                            dva[dt, e] += x[e]
                            dka[dt, e] += y[e]
                c += U(1)
            cuda.syncthreads()                        # dS^T is whole

            # ---- dQ_i += scale dS K_j: a warp takes row group rg (16 queries) and NC column
            # tiles; keys 8 kk + 2t, 8 kk + 2t + 1 as k = t, t + 4:
            # A[g, t] = dS[16 rg + g, key] = dS^T[key, 16 rg + g], B[t, g] = K[key, 8 n + g]
            dqh = dq[bh]
            item = U(warp)
            while item < U(ITEMS):
                rg = item // U(ND // NC)
                n0 = (item % U(ND // NC)) * U(NC)
                acc = cuda.local.array((NC, 4), float32)
                for u in range(NC):
                    for e in range(4):
                        acc[u, e] = float32(0.0)
                kk = U(0)
                while kk < U(KC):
                    a_hi, a_lo = a_at(sa + kk * U(SROWS8) + rg * U(64), U(32), U(SROW))
                    for u in range(NC):
                        b_hi, b_lo = b_at(kb + kk * U(ROWS8) + (n0 + U(u)) * U(32), U(ROW))
                        x = product(a_hi, a_lo, b_hi, b_lo)
                        for e in range(4):
                            acc[u, e] += x[e]
                    kk += U(1)
                if TILE_ADDS:                         # one bounds test for the warp's 16 rows and NC tiles
                    add_tiles(dqh, acc, q0 + int32(rg * U(16)), int32(n0 * U(8)), g, t, scale, n_q, d, aligned)
                else:
                    for u in range(NC):
                        for h in range(2):
                            row = q0 + int32(rg * U(16) + g) + 8 * h
                            col = int32((n0 + U(u)) * U(8) + U(2) * t)
                            x0 = acc[u, 2 * h] * scale
                            x1 = acc[u, 2 * h + 1] * scale
                            add_pair_to_dq(dqh, row, col, x0, x1, n_q, d, aligned)
                item += U(W)
            bh, q0 = nbh, nq0

        cp_async_wait_all()                           # (the last, empty, group)

        # ---- dK_j = scale dK_w, dV_j: the warp's 16 rows (split: added to the other splits')
        if split and s1 <= s0:
            return
        for j in range(ND):
            for e in range(4):
                key = k0 + int32(kw + g) + 8 * (e // 2)
                col = j * 8 + int32(U(2) * t) + e % 2
                if key < n_k and col < d:
                    store_gradients(dk, dv, bkv, key, col, dka[j, e] * scale, dva[j, e])

    backward_tf32.threads = THREADS
    backward_tf32.keys = Bc
    return backward_tf32


# --------------------------------------------------------------------------- the launcher

def _two_launches(views: dict, delta, scale, causal, passes, aligned, tiles=None, splits=1, chunk=None,
                  tile_adds=None, lo=DEFAULT_LO, rounds=DEFAULT_ROUNDS):
    """The two launches on these views, as (kernel, grid, threads, args, dynamic shared bytes)
    each: chapter 5's pre-pass (D, and dQ = 0), then the dK/dV/dQ kernel (its shared-memory
    limit raised where it needs more than 48 KB). ``tiles``: (Br, W), by default
    ``tf32_backward_tiles``; ``splits``: S blocks a key tile (``kernels.base.query_split``;
    the caller zeroes dk and dv first when S > 1); ``chunk``: 8-query tiles a chunk, by
    default ``tf32_backward_chunk``; ``tile_adds``: dQ's adds (``tf32_backward_tile_adds``);
    ``lo``: the splits' lo (``SPLIT_LO``); ``rounds``: S^T's and dP^T's products round by round."""
    from kernels.base.shared_memory import STATIC_LIMIT_BYTES, allow_dynamic_shared_memory
    from kernels.flash_backward import make_delta

    bh, n_q, d = views["q"].shape
    bkv, n_k = views["k"].shape[0], views["k"].shape[1]
    Br, W, D = tf32_backward_tiles(d)
    if tiles is not None:
        Br, W = tiles
    delta_kernel, threads = make_delta(D, 4, True)
    pre = (delta_kernel, (cdiv(n_q, threads // 32), bh), threads,
           (views["o"], views["do"], delta, views["dq"], np.int32(n_q)), 0)
    nbytes = 4 * shared_words(Br, W, D)
    dynamic = nbytes > STATIC_LIMIT_BYTES and not on_simulator()
    kernel = make_backward_tf32(Br, W, D, int(passes), dynamic, splits > 1, tf32_backward_min_blocks(D),
                                int(chunk) if chunk else tf32_backward_chunk(Br, D), tile_adds, lo=lo,
                                rounds=rounds)
    args = (views["q"], views["k"], views["v"], views["do"], views["lse"], delta, views["dq"], views["dk"],
            views["dv"], np.float32(scale), np.int32(causal), np.int32(bh // bkv), np.int32(aligned))
    if dynamic:
        allow_dynamic_shared_memory(kernel, args, nbytes)
    grid = (cdiv(n_k, 16 * W), bkv) if splits == 1 else (cdiv(n_k, 16 * W), bkv, splits)
    return pre, (kernel, grid, kernel.threads, args, nbytes if dynamic else 0)


def _aligned(d, arrays) -> int:
    """1 where whole 16-byte chunks may go by cp.async and dQ's adds go in pairs."""
    if on_simulator():
        return int(d % 4 == 0)
    return int(d % 4 == 0 and all(x.__cuda_array_interface__["data"][0] % 16 == 0 for x in arrays))


def launch_backward(qd, kd, vd, od, lsed, dod, delta, dq, dk, dv, scale, causal, passes=3, tiles=None, splits=1,
                    chunk=None, tile_adds=None, lo=DEFAULT_LO, rounds=DEFAULT_ROUNDS):
    """The two kernels on device views: qd, od, dod (B*H, Nq, d), kd, vd (B*Hkv, Nk, d),
    lsed (B*H, Nq), float32; into the buffers delta (B*H, Nq) and dq, dk, dv, launched as
    Numba launches them (the bench's bare launch). ``tiles``: (Br, W); ``splits``: S blocks a
    key tile (dK and dV zeroed first); ``chunk``: 8-query tiles a chunk (``tf32_backward_chunk``);
    ``tile_adds``: dQ's adds a warp's tiles at a time (``tf32_backward_tile_adds``); ``lo``: the
    splits' lo (``SPLIT_LO``); ``rounds``: S^T's and dP^T's products round by round."""
    views = dict(q=qd, k=kd, v=vd, o=od, lse=lsed, do=dod, dq=dq, dk=dk, dv=dv)
    aligned = _aligned(qd.shape[2], (qd, kd, vd, dod, dq))
    launches = list(_two_launches(views, delta, scale, causal, passes, aligned, tiles, splits, chunk, tile_adds, lo,
                                  rounds))
    add_zero_gradients(launches, [None, None], views, splits)
    for kernel, grid, threads, args, nbytes in launches:
        kernel[grid, threads, launch_stream(), nbytes](*args)


class BackwardLaunches(BoundLaunches):
    """The two launches of one call shape, bound once (``BoundLaunches``); a call passes the
    row buffer D (allocated each call) with the arrays. With S > 1 splits, dK and dV's
    zeroing first."""

    DELTA_SLOTS = dict(o=0, do=1, delta=2, dq=3)
    MAIN_SLOTS = dict(q=0, k=1, v=2, do=3, lse=4, delta=5, dq=6, dk=7, dv=8)

    def __init__(self, views: dict, scale: float, causal: bool, passes: int, aligned: int, tiles=None, splits=1):
        launches = list(_two_launches(views, views["delta"], scale, causal, passes, aligned, tiles, splits))
        slots = [self.DELTA_SLOTS, self.MAIN_SLOTS]
        add_zero_gradients(launches, slots, views, splits)
        super().__init__(launches, slots)


_launches = LaunchCache()


def flash_attention_backward_tf32(q, k, v, o, lse, do, *, causal=False, scale=None, passes=3):
    """Gradients (dq, dk, dv) of attention for float32 inputs, on tensor cores (3xTF32).

    q, o and do (B, H, Nq, d), k and v (B, Hkv, Nk, d) with H a multiple of Hkv
    (grouped-query attention: query head h reads KV head h // (H / Hkv)), d <= 128, lse
    (B, H, Nq) (natural log, -inf on rows that see nothing): float32, the o and lse the
    forward returned. ``causal`` masks bottom-right aligned; ``scale`` defaults to
    1/sqrt(d); ``passes`` = 3 (3xTF32, about fp32's accuracy) or 1 (plain TF32). Returns
    float32 dq (B, H, Nq, d), dk and dv (B, Hkv, Nk, d); dq's last bits vary from run to
    run (atomic adds). NumPy in, NumPy out; device arrays in, device arrays out."""
    if isinstance(passes, bool) or passes not in PASSES:
        raise ValueError(f"passes: expected 3 (3xTF32) or 1 (plain TF32), got {passes!r}")
    B, H, hkv, n_q, n_k, d = check_grouped_args(q, k, v, o, lse, do, np.float32, (np.float32,))
    causal = check_flag(causal, "causal")
    scale = check_scale(scale, d)
    return backward_checked(ArrayKind(q), q, k, v, o, lse, do, causal=causal, scale=scale, passes=passes)


def backward_checked(kind, q, k, v, o, lse, do, *, causal, scale, passes=3, out=None, splits=None):
    """What ``flash_attention_backward_tf32`` runs once its checks pass, for callers that
    made them (chapter 13's drop-in checks its tensors once): the arrays as the launcher
    takes them (C-contiguous float32), ``scale`` a float. (dq, dk, dv) float32 from
    ``kind``'s allocator (an ``ArrayKind``), or written into ``out``'s three arrays.
    ``splits``: the query tiles split among that many blocks a key tile
    (``kernels.base.query_split``); None: split only where the grid would not fill the GPU."""
    B, H, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    if splits is None:
        splits = query_splits_for(B, H, hkv, n_q, n_k, *tf32_backward_tiles(d)[:2])
    splits = int(splits)
    arrays = dict(q=q, k=k, v=v, o=o, lse=lse, do=do)
    return run_grouped_backward(kind, arrays, (B, H, hkv, n_q, n_k, d), (B, H, hkv, n_q, n_k, d, causal, scale,
                                int(passes), splits), _launches,
                                lambda views, aligned: BackwardLaunches(views, scale, causal, passes, aligned,
                                                                        splits=splits),
                                words=4, out=out)


# --------------------------------------------------------------------------- PTX check

def ptx_targets(every_shape: bool = False):
    """The kernel at the GPU tiles, d = 64 and 128, 3xTF32 (``every_shape``: plain TF32 too)."""
    sig = ("void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, ::1], "
           "float32[:, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32, int32, int32, "
           "int32)")
    out = []
    for D in (64, 128):
        for passes in (3, 1) if every_shape else (3,):
            Br, W = (64, 8) if D <= 64 else (32, 8)   # tf32_backward_tiles on a GPU
            dynamic = 4 * shared_words(Br, W, D) > 48 * 1024
            out.append((f"backward 3xTF32 passes={passes} Br={Br} Bc={16 * W} D={D}",
                        make_backward_tf32(Br, W, D, passes, dynamic, min_blocks=tf32_backward_min_blocks(D)), sig))
        if every_shape:                               # the query split (chapter 13)
            out.append((f"backward 3xTF32 split Br={Br} Bc={16 * W} D={D}",
                        make_backward_tf32(Br, W, D, 3, dynamic, split=True, min_blocks=tf32_backward_min_blocks(D)),
                        sig))
    return out


# --------------------------------------------------------------------------- the exercise
# dV_w += P^T dO_c takes P^T's accumulator tile (16 keys x 8 queries, fp32 in the lanes'
# registers as the mma left it) as the A operand of the next m16n8k8 product, without a
# shuffle or a trip through shared memory: the lane that holds queries 2t and 2t + 1 of a
# key row passes them as k = t and k = t + 4, and reads dO_c's rows 2t and 2t + 1 for b0 and
# b1. The exercise asks for that renumbering, checked on the host against the fragment
# tables of kernels.base.mma (no GPU, no simulator).

def accumulator_as_a(c):
    """The course's answer. c (32, 4): lane l's four accumulator elements of a 16 x 8 tile T
    (``c_position``). Returns (a, rows): a (32, 4), lane l's A fragment (``a_position_tf32``)
    of T as the A operand of T @ X for an 8 x 8 X, the k index renumbered; rows (32, 2), the
    rows of X that lane l passes as b0 and b1 (``b_position_tf32``'s k = t and t + 4)."""
    c = np.asarray(c)
    t = np.arange(32) % 4
    return c[:, [0, 2, 1, 3]], np.stack([2 * t, 2 * t + 1], axis=1)


def check_accumulator_as_a_case(fn, seed):
    """The property: with a and rows from ``fn(c)``, the m16n8k8 product the tensor core
    computes (A from a by ``a_position_tf32``, B's element (k, n) from X's row rows[lane, i]
    by ``b_position_tf32``) is T @ X."""
    from kernels.base.mma import a_position_tf32, b_position_tf32, c_position

    rng = np.random.default_rng(seed)
    tile, x = rng.standard_normal((16, 8)), rng.standard_normal((8, 8))
    c = np.zeros((32, 4))
    for lane in range(32):
        for i in range(4):
            c[lane, i] = tile[c_position(lane, i)]
    out = fn(c.copy())
    assert isinstance(out, tuple) and len(out) == 2, f"expected a pair (a, rows), got {type(out).__name__}"
    a, rows = np.asarray(out[0], np.float64), np.asarray(out[1])
    assert a.shape == (32, 4), f"a: shape {a.shape}, expected (32, 4)"
    assert rows.shape == (32, 2), f"rows: shape {rows.shape}, expected (32, 2)"
    assert np.issubdtype(rows.dtype, np.integer) and ((rows >= 0) & (rows < 8)).all(), \
        f"rows: expected integers in 0..7, got {rows.tolist()}"
    A = np.zeros((16, 8))
    for lane in range(32):
        for i in range(4):
            A[a_position_tf32(lane, i)] = a[lane, i]
    B = np.zeros((8, 8))
    for lane in range(32):
        for i in range(2):
            k, n = b_position_tf32(lane, i)
            B[k, n] = x[rows[lane, i], n]
    got, want = A @ B, tile @ x
    bad = np.argwhere(~np.isclose(got, want, rtol=1e-12, atol=1e-12))
    assert not bad.size, (f"the tensor core's A B differs from T X at {len(bad)} of 128 elements, first at "
                          f"row {bad[0][0]}, col {bad[0][1]}: {got[tuple(bad[0])]:.6g}, expected {want[tuple(bad[0])]:.6g}")


def check_accumulator_as_a(fn, max_examples=None):
    """Exercise: write ``fn(c) -> (a, rows)`` (see ``accumulator_as_a``). Prints "passed" or
    the smallest failing case."""
    from hypothesis import strategies as st

    from kernels.base.testing import check_exercise

    return check_exercise(lambda seed: check_accumulator_as_a_case(fn, seed), st.integers(0, 2**32 - 1), host=True,
                          max_examples=max_examples)
