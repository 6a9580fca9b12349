"""The backward on tensor cores: chapter 5's recomputing backward with its five products on mma.sync.

Chapter 5's algebra (P recomputed from Q, K and the saved L; D = rowsum(dO o O)) with the
products of chapter 8's instruction (``kernels.base.mma``: m16n8k16, fp16 or bf16 in, fp32
accumulate). K/V tiles outer, as FlashAttention-2's backward:

    one block        key tile j: Bc = 16 W keys of one (batch, KV head), W warps; K_j, V_j
                     in shared memory; dK_j, dV_j in the warps' accumulators
    one warp         16 keys: its rows of K_j and V_j as A fragments (kept in registers up
                     to D = 64), its 16 rows of dK_j and dV_j as D/8 accumulator tiles each
    for each query head of the KV head's group (GQA), each query tile i (Br rows: Q_i, dO_i,
    L_i, D_i staged in shared memory, the next tile's copy flying during this one's work),
    each chunk c of 16 queries (the k-step of the two products that sum over queries):
        S^T   = K_w Q_c^T          16 keys x 16 queries: 2 accumulator tiles, D/16 k-steps
        P^T   = exp2(S^T scale log2 e - L log2 e)   masked: 0 (L = -inf: a row that sees
                                   nothing; L = NaN stays NaN)
        dP^T  = V_w dO_c^T         the same shape, V's fragments and dO's rows
        dS^T  = P^T o (dP^T - D)   0 where masked
        dV_w += P^T dO_c           P^T's accumulator tiles ARE the A fragment (chapter 8's
                                   P to A: packed in registers); dO_c by ldmatrix.trans
        dK_w += dS^T Q_c           the same, dS^T and Q_c
        dS^T -> shared memory (16-bit, as the products use it)
    then dQ_i += scale dS K_j      dS (Br x Bc) read back as A fragments (ldmatrix.trans of
                                   the stored dS^T), K_j as B (ldmatrix.trans); the warps
                                   share its pieces of 16 rows x 32 columns; the block's
                                   sums go to dQ by float32 atomic adds (FlashAttention-2's
                                   dQ accumulator: dQ's last bits vary from run to run)
    dK_j = scale dK_w and dV_j written once, float32.

The products that sum over queries (dV, dK) take their k-steps straight from the
accumulators of S and dP: a chunk of 16 queries is one k-step, so P^T and dS^T never leave
the registers for them. Only dQ, which sums over the block's keys across warps, needs dS
in shared memory. The loop takes two chunks a step (``CC``): each S^T and dP^T tile is a
chain of D/16 dependent products, and two chunks give a warp 8 independent chains in flight
instead of 4. dQ's adds go unchecked where a warp's 16 rows and its columns lie inside
(``kernels.base.gradient_adds.make_tile_adds``).

A kernel ``make_delta_tc`` runs first: D = rowsum(dO o O) a query row, and dQ = 0.

What Numba makes costly, and the kernel avoids (each step measured on the H100, see the
comments): indexing an array costs signed 64-bit arithmetic, so each lane's ldmatrix rows
are 32-bit shared-memory addresses made once (``shared_address``) to which a k-step adds
a constant (``ldmatrix_at``); ``range()`` loops cost their control, so the long loops are
``while`` loops on unsigned counters. The launcher binds its two launches once a call
shape (``BackwardLaunches``).

Inputs fp16, or bf16 (``bf16=True``; PyTorch bf16 tensors or uint16 bit patterns); O
float32 (what chapter 8's forward returns) or the inputs' 16-bit type; L float32.
Gradients float32. Precision: P and dS are rounded to the input type before the products
that use them, as FlashAttention-2 does; the tests hold each gradient to 2x the error of a
float32 NumPy backward that rounds them the same way (``rounded_backward_numpy``).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint16, uint32

from kernels.base.backward_args import check_grouped_args, run_grouped_backward
from kernels.base.gradient_adds import make_tile_adds
from kernels.base.fused import FASTMATH, LOG2E, make_row_reductions
from kernels.base.inlined import inlined
from kernels.base.key_block_walk import next_pair, pair_at, query_pairs
from kernels.base.query_split import add_zero_gradients, query_splits_for
from kernels.base.tile_copy import make_async_tile_copy, make_async_word_copy
from kernels.base.runtime import ArrayKind, Bf16Bits, BoundLaunches, LaunchCache, cdiv, check_flag, \
    array_dtype, check_scale, is_bf16_array, launch_stream, on_simulator

__all__ = ["flash_attention_backward_tc", "BackwardLaunches", "launch_backward", "make_backward_tc", "make_delta_tc",
           "rounded_backward_numpy", "tc_backward_tiles", "shared_halves", "ptx_targets"]

# The "logsumexp" (base 2) of a row that sees no key (L = -inf): exp2(S - DEAD) = 0.
DEAD = float32(1.0e30)


def tc_backward_tiles(d: int) -> tuple[int, int, int]:
    """(Br, W, D): Br query rows a tile, W warps (Bc = 16 W keys a block), D = d rounded
    up to a multiple of 16. On a GPU 8 warps (128 keys: dQ's atomic adds, Br D a block and
    query tile, come once per Bc keys of work) and 128 query rows at D <= 64, 64 at D = 128
    (where two buffers of 128 rows of Q and dO would not fit in shared memory). Measured on
    the H100 at B=4 H=16 N=4096 fp16, bare launches: d = 64, 5.2 ms against 6.0 ms with 64
    rows and 5.9 ms with 4 warps; d = 128, 10.8 against 11.4 ms with 4 warps. In the
    simulator 32 rows and 2 warps."""
    D = 16 * cdiv(max(int(d), 1), 16)
    if on_simulator():
        return 32, 2, D
    return (128 if D <= 64 else 64), 8, D


def shared_halves(Br: int, W: int, D: int) -> int:
    """16-bit words of shared memory a block: K_j, V_j (Bc rows), Q_i and dO_i twice (the
    next tile's copy flies), dS^T (Bc x Br); rows padded by 8 halves (ldmatrix rows in
    distinct banks)."""
    Bc, SD = 16 * W, D + 8
    return 2 * Bc * SD + 4 * Br * SD + Bc * (Br + 8)


# --------------------------------------------------------------------------- D = rowsum(dO o O)

@functools.lru_cache(maxsize=None)
def make_delta_tc(bf16: bool, o_bits: bool):
    """Kernel (o, do, lse, delta, l2, dq): one warp a query row (4 a block): D = rowsum(dO o O)
    in float32, the row's L in base 2 (DEAD for L = -inf, so that P = 0 there), and dQ's row
    zeroed for the atomic adds. do (and o if ``o_bits``) 16-bit patterns (bf16 if ``bf16``)."""
    from kernels.base.mma import unpack_bf16, unpack_f16

    unpack = unpack_bf16 if bf16 else unpack_f16

    @inlined
    def wide(x):
        return unpack(int32(x))[0]

    _, row_sum = make_row_reductions(32, 128)

    @cuda.jit(fastmath=FASTMATH)
    def delta_kernel(o, do, lse, delta, l2, dq):
        bh = int32(cuda.blockIdx.y)
        row = int32(cuda.blockIdx.x) * 4 + int32(cuda.threadIdx.x) // 32
        lane = int32(cuda.threadIdx.x) % 32
        n_q, d = int32(do.shape[1]), int32(do.shape[2])
        acc = float32(0.0)
        if row < n_q:
            for c in range(lane, d, 32):
                x = o[bh, row, c]
                acc += wide(do[bh, row, c]) * (wide(x) if o_bits else x)
                dq[bh, row, c] = float32(0.0)
        acc = row_sum(acc)                            # every lane calls it (the simulator's barrier)
        if row < n_q and lane == 0:
            delta[bh, row] = acc
            L = lse[bh, row]
            l2[bh, row] = DEAD if L == -math.inf else L * float32(LOG2E)

    return delta_kernel


# --------------------------------------------------------------------------- the kernel

@functools.lru_cache(maxsize=None)
def make_backward_tc(Br: int, W: int, D: int, bf16: bool = False, dynamic: bool = False, CP: int = 0,
                     split: bool = False, CC: int = 0):
    """The dK/dV/dQ kernel for Br query rows a tile, W warps (Bc = 16 W keys), head dim D
    (a multiple of 16); ``dynamic``: its shared memory (``shared_halves``) is dynamic;
    ``split``: the (query head, query tile) pairs split among gridDim.z blocks a key tile,
    each adding its dK_j, dV_j into zeroed dk, dv (``kernels.base.query_split``).

    Launch: grid (ceil(Nk / Bc), B * Hkv[, S]), 32 W threads. Arguments: q, do (B*H, Nq, d) and
    k, v (B*Hkv, Nk, d) uint16 (fp16 or bf16 bits); l2 and delta (B*H, Nq) float32 (L in
    base 2 and D, from ``make_delta_tc``); dq (B*H, Nq, d) float32, zeroed; dk, dv (B*Hkv,
    Nk, d) float32; scale (float32), causal (int32 0/1), group (int32: H / Hkv), aligned
    (int32: rows of q, k, v, dO and dQ 16-byte aligned, d % 8 == 0: cp.async copies, and
    dQ's adds in pairs). ``CP``: dQ's 16-column pairs a warp takes at once (0: up to 2);
    ``CC``: 16-query chunks a step of the query loop takes (0: 2 where Br / 16 is even)."""
    from kernels.base.mma import (cp_async_commit, cp_async_wait_all,
                                  ldmatrix_at, ldmatrix_trans_at, mma_bf16, mma_f16, pack_bf16, pack_f16,
                                  shared_address, store_word)
    from kernels.base.query_split import make_block_steps, make_gradient_store
    from kernels.base.shared_memory import shared_view

    if D % 16 or Br % 16 or W < 1:
        raise ValueError(f"tiles: expected D and Br multiples of 16 and W >= 1, got Br={Br}, W={W}, D={D}")
    mma = mma_bf16 if bf16 else mma_f16
    pack = pack_bf16 if bf16 else pack_f16
    Bc = 16 * W
    THREADS = 32 * W
    KS, ND, QC = D // 16, D // 8, Br // 16       # k-steps over d; tiles of d; 16-query chunks
    SD, SB = D + 8, Br + 8                        # shared row strides (halves)
    if CP == 0:                                   # dQ_i's column pairs a warp: one piece a warp if it fits
        CP = 2 if (ND // 2) % 2 == 0 and QC * (ND // 2) >= 2 * W else 1
    if (ND // 2) % CP:
        raise ValueError(f"CP: expected a divisor of D / 16 = {ND // 2}, got {CP}")
    ITEMS = QC * (ND // (2 * CP))                 # dQ_i's pieces of 16 x 16 CP, shared by the warps
    if CC == 0:                                   # two chunks a step: twice the products in flight
        CC = 2 if QC % 2 == 0 else 1
    if QC % CC:
        raise ValueError(f"CC: expected a divisor of Br / 16 = {QC}, got {CC}")
    TILE, QTILE = Bc * SD, Br * SD
    # K_w's and V_w's A fragments kept in registers (D / 2 of them) up to D = 64; at D = 128
    # they would take the thread past 255 registers, so they are read from shared memory.
    KEEP = D <= 64
    # Unsigned loop counters and indices on the GPU (see below); plain ints in the simulator,
    # where every index sum is Python and NumPy scalars would make it several times slower.
    U = int if on_simulator() else uint32
    block_steps = make_block_steps(bool(split))           # all the walk, or a split's share
    store_gradients = make_gradient_store(bool(split))   # stored, or added (a split)
    HALVES = shared_halves(Br, W, D)
    SHARED = 0 if dynamic else HALVES

    DQT = 2 * CP                                            # a warp's piece of dQ_i: DQT tiles of 8 columns
    add_tiles = make_tile_adds(DQT)                         # added into dQ
    stage_keys = make_async_tile_copy(Bc, D, THREADS)       # K_j, V_j: Bc rows
    stage_queries = make_async_tile_copy(Br, D, THREADS)     # Q_i, dO_i: Br rows
    stage_rows = make_async_word_copy(Br, THREADS)           # L_i, D_i: Br words

    @cuda.jit(fastmath=FASTMATH)
    def backward_tc(q, k, v, do, l2, delta, dq, dk, dv, scale, causal, group, aligned):
        bkv = int32(cuda.blockIdx.y)
        tid = int32(cuda.threadIdx.x)
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        k0 = int32(cuda.blockIdx.x) * Bc              # the first key tiles see the most queries: first
        n_q, n_k, d = int32(q.shape[1]), int32(k.shape[1]), int32(q.shape[2])
        smem = cuda.shared.array(SHARED, uint16, alignment=16)
        Ks = shared_view(smem, 0, (Bc, SD))
        Vs = shared_view(smem, TILE, (Bc, SD))
        dSs = shared_view(smem, 2 * TILE, (Bc, SB))   # dS^T: keys x queries
        Ls = cuda.shared.array((2, Br), float32)       # L (base 2) and D of the staged rows
        Ds = cuda.shared.array((2, Br), float32)
        # ldmatrix .x4: lane 8 j + r names row r of 8x8 matrix j
        ar = (lane // 8) % 2 * 8 + lane % 8           # A (and B by .trans): rows +0/+8, then cols +0/+8
        ac = (lane // 16) * 8
        br = (lane // 16) * 8 + lane % 8              # B = X^T from X's rows: rows +0/+8, cols +0/+8 first
        bc = (lane // 8) % 2 * 8
        kw = warp * 16                                # this warp's keys: k0 + kw .. + 15
        diag = n_k - n_q

        # ---- K_j, V_j in shared memory; the warp's rows as A fragments
        stage_keys(k[bkv], Ks, n_k, k0, d, tid, aligned)
        stage_keys(v[bkv], Vs, n_k, k0, d, tid, aligned)
        cp_async_commit()
        cp_async_wait_all()
        cuda.syncthreads()
        # 32-bit shared addresses of each lane's ldmatrix row, made once: a k-step adds a
        # constant (indexing an array would cost 64-bit arithmetic at every load)
        ka = shared_address(Ks, kw + ar, ac)          # K_w, V_w as A
        va = shared_address(Vs, kw + ar, ac)
        kt = shared_address(Ks, ar, ac)               # K_j as B of dQ (.trans)
        sa = shared_address(dSs, br, bc)              # dS as A of dQ (.trans of dS^T)
        kf = cuda.local.array((KS, 4), uint32)
        vf = cuda.local.array((KS, 4), uint32)
        if KEEP:
            for s_ in range(KS):
                x = ldmatrix_at(ka + s_ * 32)
                y = ldmatrix_at(va + s_ * 32)
                for e in range(4):
                    kf[s_, e] = x[e]
                    vf[s_, e] = y[e]

        dka = cuda.local.array((ND, 4), float32)       # dK_w, dV_w: D/8 accumulator tiles each
        dva = cuda.local.array((ND, 4), float32)
        for j in range(ND):
            for e in range(4):
                dka[j, e] = float32(0.0)
                dva[j, e] = float32(0.0)
        scale2 = float32(scale * LOG2E)
        # (query head, query tile) pairs that see these keys, in order (causal: from `first` on)
        first, n_tiles, steps = query_pairs(k0, diag, causal, n_q, Br, group)
        s_first, s_end = block_steps(steps)         # this block's pairs: all, or its split's share

        # Each pair's Q_i, dO_i, L_i and D_i go by cp.async, zeros past n_q: such a query row
        # adds nothing (Q_i's zero row makes S = 0 and P = 1 there, but dO_i's zero row makes
        # dP = 0, dS = 0 and P^T dO = 0; dQ is not written past n_q)
        bh, q0 = int32(0), int32(0)
        if s_end > s_first:                           # the first pair's copies
            bh, q0 = pair_at(s_first, bkv, group, first, n_tiles, Br)
            stage_queries(q[bh], shared_view(smem, 2 * TILE + Bc * SB, (Br, SD)), n_q, q0, d, tid, aligned)
            stage_queries(do[bh], shared_view(smem, 2 * TILE + Bc * SB + QTILE, (Br, SD)), n_q, q0, d, tid,
                          aligned)
            stage_rows(l2, bh, Ls, 0, n_q, q0, tid)
            stage_rows(delta, bh, Ds, 0, n_q, q0, tid)
        cp_async_commit()
        for i in range(s_end - s_first):
            step = s_first + i
            buf = i % 2
            cp_async_wait_all()                       # this pair's Q_i and dO_i (the one group in flight)
            cuda.syncthreads()                        # have landed for every warp; every warp is done with
            nbh, nq0 = next_pair(bh, q0, first, n_tiles, Br)     # the other buffer and dS. The next
            if step + 1 < s_end:                      # pair's copies fly during this one
                nb = 1 - buf
                stage_queries(q[nbh], shared_view(smem, 2 * TILE + Bc * SB + 2 * nb * QTILE, (Br, SD)), n_q, nq0,
                              d, tid, aligned)
                stage_queries(do[nbh], shared_view(smem, 2 * TILE + Bc * SB + (2 * nb + 1) * QTILE, (Br, SD)), n_q,
                              nq0, d, tid, aligned)
                stage_rows(l2, nbh, Ls, nb, n_q, nq0, tid)
                stage_rows(delta, nbh, Ds, nb, n_q, nq0, tid)
            cp_async_commit()

            ubuf = U(buf)                             # unsigned indices: no negative-index wraparound
            ut2 = U(2 * t)
            qoff = 2 * TILE + Bc * SB + 2 * buf * QTILE      # Q_i's rows in this buffer, then dO_i's
            Qv = shared_view(smem, qoff, (Br, SD))
            dOv = shared_view(smem, qoff + QTILE, (Br, SD))
            qb, qt = shared_address(Qv, br, bc), shared_address(Qv, ar, ac)       # as B, and as B by .trans
            ob, ot = shared_address(dOv, br, bc), shared_address(dOv, ar, ac)
            c = U(0)                                  # (while loops: see dQ's k-steps below)
            while c < U(QC):
                qa = q0 + c * 16                      # the first query of the step's first chunk
                cb = c * (32 * SD)                    # the chunk's 16 rows, in bytes
                # ---- S^T = K_w Q_c^T and dP^T = V_w dO_c^T for CC chunks at once: 16 keys x 16
                # queries, 2 tiles each; the 4 CC accumulator chains are independent, so a warp
                # has that many products in flight while each waits for the one before it
                sp = cuda.local.array((CC, 4, 4), float32)     # chunk u: S^T tiles 0, 1, dP^T 0, 1
                for u in range(CC):
                    for j in range(4):
                        for e in range(4):
                            sp[u, j, e] = float32(0.0)
                # (a while loop: the compiler unrolls it whole, so that each k-step's ldmatrix
                # goes ahead of the products before it; as range() at D = 128 it stayed a loop,
                # and each k-step's first product waited for its loads: at d = 128 Nsight
                # Compute found 7% of the kernel's stall samples on that one instruction)
                s_ = U(0)
                while s_ < U(KS):
                    if KEEP:
                        a = (kf[s_, 0], kf[s_, 1], kf[s_, 2], kf[s_, 3])
                    else:
                        a = ldmatrix_at(ka + s_ * 32)
                    for u in range(CC):
                        x = ldmatrix_at(qb + cb + u * (32 * SD) + s_ * 32)
                        y0 = mma(a, (x[0], x[1]), (sp[u, 0, 0], sp[u, 0, 1], sp[u, 0, 2], sp[u, 0, 3]))
                        y1 = mma(a, (x[2], x[3]), (sp[u, 1, 0], sp[u, 1, 1], sp[u, 1, 2], sp[u, 1, 3]))
                        for e in range(4):
                            sp[u, 0, e] = y0[e]
                            sp[u, 1, e] = y1[e]
                    if KEEP:
                        a = (vf[s_, 0], vf[s_, 1], vf[s_, 2], vf[s_, 3])
                    else:
                        a = ldmatrix_at(va + s_ * 32)
                    for u in range(CC):
                        x = ldmatrix_at(ob + cb + u * (32 * SD) + s_ * 32)
                        y0 = mma(a, (x[0], x[1]), (sp[u, 2, 0], sp[u, 2, 1], sp[u, 2, 2], sp[u, 2, 3]))
                        y1 = mma(a, (x[2], x[3]), (sp[u, 3, 0], sp[u, 3, 1], sp[u, 3, 2], sp[u, 3, 3]))
                        for e in range(4):
                            sp[u, 2, e] = y0[e]
                            sp[u, 3, e] = y1[e]
                    s_ += U(1)
                # ---- P^T and dS^T: element e of tile n is key g + 8 (e // 2), query 8 n + 2 t + e % 2
                # (masked: the step's chunks cross n_k or the diagonal; its first chunk sees the fewest keys)
                masked = k0 + kw + 15 >= n_k or (causal != 0 and k0 + kw + 15 > qa + diag)
                pt = cuda.local.array((CC, 2, 4), float32)
                dst = cuda.local.array((CC, 2, 4), float32)
                for u in range(CC):
                    for n in range(2):
                        for i in range(2):            # the lane's two queries of tile n
                            col = U(c * 16 + u * 16 + n * 8 + i) + ut2
                            lq, dq_ = Ls[ubuf, col], Ds[ubuf, col]
                            for h in range(2):        # keys g and g + 8
                                e = 2 * h + i
                                p = math.exp2(sp[u, n, e] * scale2 - lq)
                                pt[u, n, e] = p
                                dst[u, n, e] = p * (sp[u, 2 + n, e] - dq_)
                if masked:                            # only steps that cross n_k or the diagonal
                    for u in range(CC):
                        for n in range(2):
                            for e in range(4):
                                key = k0 + kw + g + 8 * (e // 2)
                                query = qa + u * 16 + n * 8 + 2 * t + e % 2
                                if key >= n_k or (causal != 0 and key > query + diag):
                                    pt[u, n, e] = float32(0.0)
                                    dst[u, n, e] = float32(0.0)
                # ---- dV_w += P^T dO_c and dK_w += dS^T Q_c: each chunk is one k-step
                for u in range(CC):
                    ap = (pack(pt[u, 0, 0], pt[u, 0, 1]), pack(pt[u, 0, 2], pt[u, 0, 3]),
                          pack(pt[u, 1, 0], pt[u, 1, 1]), pack(pt[u, 1, 2], pt[u, 1, 3]))
                    ad = (pack(dst[u, 0, 0], dst[u, 0, 1]), pack(dst[u, 0, 2], dst[u, 0, 3]),
                          pack(dst[u, 1, 0], dst[u, 1, 1]), pack(dst[u, 1, 2], dst[u, 1, 3]))
                    cu = cb + u * (32 * SD)
                    for dt in range(ND // 2):
                        x = ldmatrix_trans_at(ot + cu + dt * 32)
                        y0 = mma(ap, (x[0], x[1]), (dva[2 * dt, 0], dva[2 * dt, 1], dva[2 * dt, 2], dva[2 * dt, 3]))
                        y1 = mma(ap, (x[2], x[3]),
                                 (dva[2 * dt + 1, 0], dva[2 * dt + 1, 1], dva[2 * dt + 1, 2], dva[2 * dt + 1, 3]))
                        x = ldmatrix_trans_at(qt + cu + dt * 32)
                        z0 = mma(ad, (x[0], x[1]), (dka[2 * dt, 0], dka[2 * dt, 1], dka[2 * dt, 2], dka[2 * dt, 3]))
                        z1 = mma(ad, (x[2], x[3]),
                                 (dka[2 * dt + 1, 0], dka[2 * dt + 1, 1], dka[2 * dt + 1, 2], dka[2 * dt + 1, 3]))
                        for e in range(4):
                            dva[2 * dt, e] = y0[e]
                            dva[2 * dt + 1, e] = y1[e]
                            dka[2 * dt, e] = z0[e]
                            dka[2 * dt + 1, e] = z1[e]
                    # ---- dS^T to shared memory, as the products use it (16-bit)
                    for n in range(2):
                        for h in range(2):
                            store_word(dSs, kw + g + 8 * h, c * 16 + u * 16 + n * 8 + 2 * t, ad[2 * n + h])
                c += U(CC)
            cuda.syncthreads()                        # dS^T is whole

            # ---- dQ_i += scale dS K_j: a warp takes row group rg (16 queries) and CP column
            # pairs (16 CP columns of d); dS's A fragment is read once for the CP pairs
            dqh = dq[bh]
            item = U(warp)
            while item < U(ITEMS):
                rg = item // (ND // (2 * CP))
                cp0 = (item % (ND // (2 * CP))) * CP
                acc = cuda.local.array((DQT, 4), float32)      # tile 2 u + n: columns 16 (cp0 + u) + 8 n
                for u in range(DQT):
                    for e in range(4):
                        acc[u, e] = float32(0.0)
                # Bc / 16 k-steps over the block's keys. A while loop on an unsigned counter: Numba's
                # range() loop control costs as many instructions as the step's two products
                # (measured, with the chunk and piece loops as while loops too: 4.6 against 5.1 ms
                # at d = 64 on the H100; the 32-bit addresses then 4.2 ms)
                kk = U(0)
                while kk < U(W):
                    a = ldmatrix_trans_at(sa + kk * (32 * SB) + rg * 32)          # A = dS from dS^T
                    for u in range(CP):
                        x = ldmatrix_trans_at(kt + kk * (32 * SD) + (cp0 + u) * 32)   # B = K_j
                        y0 = mma(a, (x[0], x[1]), (acc[2 * u, 0], acc[2 * u, 1], acc[2 * u, 2], acc[2 * u, 3]))
                        y1 = mma(a, (x[2], x[3]),
                                 (acc[2 * u + 1, 0], acc[2 * u + 1, 1], acc[2 * u + 1, 2], acc[2 * u + 1, 3]))
                        for e in range(4):
                            acc[2 * u, e] = y0[e]
                            acc[2 * u + 1, e] = y1[e]
                    kk += U(1)
                add_tiles(dqh, acc, q0 + int32(rg * U(16)), int32(cp0 * U(16)), g, t, scale, n_q, d, aligned)
                item += U(W)
            bh, q0 = nbh, nq0

        cp_async_wait_all()                           # (the last, empty, group)

        # ---- dK_j = scale dK_w, dV_j: the warp's 16 rows (split: added to the other splits')
        if split and s_end <= s_first:
            return
        for j in range(ND):
            for e in range(4):
                key = k0 + kw + g + 8 * (e // 2)
                col = j * 8 + 2 * t + e % 2
                if key < n_k and col < d:
                    store_gradients(dk, dv, bkv, key, col, dka[j, e] * scale, dva[j, e])

    backward_tc.threads = THREADS
    backward_tc.keys = Bc
    return backward_tc


# --------------------------------------------------------------------------- the launcher

def _two_launches(views: dict, delta, l2, scale, causal, bf16, aligned, tiles=None, splits=1):
    """The two launches on these views, as (kernel, grid, threads, args, dynamic shared bytes)
    each: the pre-pass, then the dK/dV/dQ kernel (its shared-memory limit raised where it
    needs more than 48 KB). ``tiles``: (Br, W), (Br, W, CP) or (Br, W, CP, CC), by default
    ``tc_backward_tiles`` (CP, CC: 0, the kernel's choice);
    ``splits``: S blocks a key tile (``kernels.base.query_split``; the caller zeroes dk and
    dv first when S > 1)."""
    from kernels.base.shared_memory import STATIC_LIMIT_BYTES, allow_dynamic_shared_memory

    bh, n_q, d = views["q"].shape
    bkv, n_k = views["k"].shape[0], views["k"].shape[1]
    Br, W, D = tc_backward_tiles(d)
    CP = CC = 0
    if tiles is not None:
        Br, W, *rest = tiles
        CP, CC = (list(rest) + [0, 0])[:2]
    delta_kernel = make_delta_tc(bool(bf16), views["o"].dtype == np.uint16)
    pre = (delta_kernel, (cdiv(n_q, 4), bh), 128, (views["o"], views["do"], views["lse"], delta, l2, views["dq"]), 0)
    nbytes = 2 * shared_halves(Br, W, D)
    dynamic = nbytes > STATIC_LIMIT_BYTES and not on_simulator()
    kernel = make_backward_tc(Br, W, D, bool(bf16), dynamic, CP, splits > 1, CC)
    args = (views["q"], views["k"], views["v"], views["do"], l2, delta, views["dq"], views["dk"], views["dv"],
            np.float32(scale), np.int32(causal), np.int32(bh // bkv), np.int32(aligned))
    if dynamic:
        allow_dynamic_shared_memory(kernel, args, nbytes)
    grid = (cdiv(n_k, 16 * W), bkv) if splits == 1 else (cdiv(n_k, 16 * W), bkv, splits)
    return pre, (kernel, grid, kernel.threads, args, nbytes if dynamic else 0)


def launch_backward(qd, kd, vd, od, lsed, dod, delta, l2, dq, dk, dv, scale, causal, bf16, tiles=None, splits=1):
    """The two kernels on device views: qd, dod (B*H, Nq, d), kd, vd (B*Hkv, Nk, d) uint16;
    od (B*H, Nq, d) float32 or uint16; lsed (B*H, Nq) float32; into the buffers delta, l2
    (B*H, Nq) and dq, dk, dv float32, launched as Numba launches them (the bench's bare
    launch). ``tiles``: (Br, W) or (Br, W, CP), by default ``tc_backward_tiles``; ``splits``:
    S blocks a key tile (dK and dV zeroed first)."""
    d = qd.shape[2]
    aligned = int(d % 8 == 0 and all(x.__cuda_array_interface__["data"][0] % 16 == 0 for x in (qd, kd, vd, dod, dq))) \
        if not on_simulator() else int(d % 8 == 0)
    views = dict(q=qd, k=kd, v=vd, o=od, lse=lsed, do=dod, dq=dq, dk=dk, dv=dv)
    launches = list(_two_launches(views, delta, l2, scale, causal, bf16, aligned, tiles, splits))
    add_zero_gradients(launches, [None, None], views, splits)
    for kernel, grid, threads, args, nbytes in launches:
        kernel[grid, threads, launch_stream(), nbytes](*args)


class BackwardLaunches(BoundLaunches):
    """The two launches of one call shape, bound once (``BoundLaunches``): Numba's typing
    of a dozen arguments and its device views cost about 0.9 ms of Python a call, longer
    than the kernels take at N = 1024. A call passes q, k, v, o, lse, do, dq, dk, dv and the
    row buffers D and L2 (allocated each call): views in the simulator, data pointers on a GPU."""

    DELTA_SLOTS = dict(o=0, do=1, lse=2, delta=3, l2=4, dq=5)
    MAIN_SLOTS = dict(q=0, k=1, v=2, do=3, l2=4, delta=5, dq=6, dk=7, dv=8)

    def __init__(self, views: dict, scale: float, causal: bool, bf16: bool, aligned: int, tiles=None, splits=1):
        launches = list(_two_launches(views, views["delta"], views["l2"], scale, causal, bf16, aligned, tiles, splits))
        slots = [self.DELTA_SLOTS, self.MAIN_SLOTS]
        add_zero_gradients(launches, slots, views, splits)       # (S > 1: dK and dV zeroed first)
        super().__init__(launches, slots)


_launches = LaunchCache()


def flash_attention_backward_tc(q, k, v, o, lse, do, *, causal=False, scale=None, bf16=False):
    """Gradients (dq, dk, dv) of attention on tensor cores, for the upstream gradient ``do``.

    q and do (B, H, Nq, d), k and v (B, Hkv, Nk, d) with H a multiple of Hkv (grouped-query
    attention: query head h reads KV head h // (H / Hkv)), d <= 128: float16 arrays, or
    with ``bf16=True`` bfloat16 device arrays (PyTorch bf16 CUDA tensors) or uint16 arrays
    of bf16 bit patterns. o (B, H, Nq, d): float32 (what ``flash_attention_tc`` returns) or
    the inputs' 16-bit type; lse (B, H, Nq) float32, natural log. ``causal`` masks
    bottom-right aligned; ``scale`` defaults to 1/sqrt(d). Returns float32 dq (B, H, Nq, d),
    dk and dv (B, Hkv, Nk, d); dq's last bits vary from run to run (atomic adds). NumPy in,
    NumPy out; device arrays in, device arrays out."""
    bf16 = check_flag(bf16, "bf16")
    want = np.uint16 if bf16 else np.float16
    kind = ArrayKind(q)
    named = dict(zip(("q", "k", "v", "o", "do"), (q, k, v, o, do)))
    for name, x in named.items():
        if is_bf16_array(x) and not bf16:
            raise TypeError(f"{name}: a bfloat16 array: pass bf16=True (or fp16 inputs)")
    q, k, v, o, do = (Bf16Bits(x) if is_bf16_array(x) else x for x in named.values())
    B, H, hkv, n_q, n_k, d = check_grouped_args(q, k, v, o, lse, do, want, (np.float32, want))
    causal = check_flag(causal, "causal")
    scale = check_scale(scale, d)
    return backward_checked(kind, q, k, v, o, lse, do, causal=causal, scale=scale, bf16=bf16)


def backward_checked(kind, q, k, v, o, lse, do, *, causal, scale, bf16, out=None, splits=None):
    """What ``flash_attention_backward_tc`` runs once its checks pass, for callers that made
    them (chapter 13's drop-in checks its tensors once): the arrays as the launcher takes
    them (PyTorch fp16/bf16 tensors as they are, C-contiguous), ``scale`` a float.
    (dq, dk, dv) float32 from ``kind``'s allocator (an ``ArrayKind``), or written into
    ``out``'s three arrays. ``splits``: the query tiles split among that many blocks a key
    tile (``kernels.base.query_split``); None: split only where the grid would not fill the GPU."""
    B, H, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    if splits is None:
        splits = query_splits_for(B, H, hkv, n_q, n_k, *tc_backward_tiles(d)[:2])
    splits = int(splits)
    arrays = dict(q=q, k=k, v=v, o=o, lse=lse, do=do)
    key = (B, H, hkv, n_q, n_k, d, bf16, array_dtype(o) != np.float32, causal, scale, splits)
    return run_grouped_backward(kind, arrays, (B, H, hkv, n_q, n_k, d), key, _launches,
                                lambda views, aligned: BackwardLaunches(views, scale, causal, bf16, aligned,
                                                                        splits=splits),
                                words=8, scratch=("delta", "l2"), out=out)


# --------------------------------------------------------------------------- the float32 yardstick

def _round(x, bf16):
    """float32 values rounded to fp16 or bf16 (nearest even) and back."""
    from kernels.base.mma import bf16_bits

    x = np.asarray(x, np.float32)
    if bf16:
        return (bf16_bits(x).astype(np.uint32) << 16).view(np.float32).reshape(x.shape)
    return x.astype(np.float16).astype(np.float32)


def rounded_backward_numpy(q, k, v, o, lse, do, *, causal=False, scale=None, bf16=False):
    """The backward in float32 NumPy with P rounded to the input type before dV = P^T dO and
    dS before dK = scale dS^T Q and dQ = scale dS K, as the kernel does (the tests'
    yardstick). Inputs as float arrays (the 16-bit values), k, v with Hkv heads; returns
    float32 (dq, dk, dv)."""
    q, k, v, o, do = (np.asarray(x, np.float32) for x in (q, k, v, o, do))
    lse = np.asarray(lse, np.float32)
    H, hkv = q.shape[1], k.shape[1]
    k, v = (np.repeat(x, H // hkv, axis=1) for x in (k, v))
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = np.float32(1 / math.sqrt(d) if scale is None else scale)
    s = scale * (q @ np.swapaxes(k, -1, -2))
    allowed = np.ones((n_q, n_k), bool)
    if causal:
        allowed = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + (n_k - n_q)
    live = np.isfinite(lse)[..., None] | np.isnan(lse)[..., None]
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.where(allowed & live, np.exp(s - np.where(live, lse[..., None], 0)), 0).astype(np.float32)
        dp = do @ np.swapaxes(v, -1, -2)
        big_d = np.sum(do * o, axis=-1, keepdims=True, dtype=np.float32)
        ds = np.where(allowed & live, p * (dp - big_d), 0).astype(np.float32)
        pr, dsr = _round(p, bf16), _round(ds, bf16)
        dv = np.swapaxes(pr, -1, -2) @ do
        dk = scale * (np.swapaxes(dsr, -1, -2) @ q)
        dq = scale * (dsr @ k)
    B = q.shape[0]
    dk = dk.reshape(B, hkv, H // hkv, n_k, d).sum(axis=2, dtype=np.float32)
    dv = dv.reshape(B, hkv, H // hkv, n_k, d).sum(axis=2, dtype=np.float32)
    return dq.astype(np.float32), dk, dv


# --------------------------------------------------------------------------- PTX check

def ptx_targets(every_shape: bool = False):
    """The kernel at the GPU tiles, d = 64 and 128, fp16 (``every_shape``: bf16 too)."""
    sig = ("void(uint16[:, :, ::1], uint16[:, :, ::1], uint16[:, :, ::1], uint16[:, :, ::1], float32[:, ::1], "
           "float32[:, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32, int32, int32, "
           "int32)")
    out = []
    for D in (64, 128):
        for bf16 in (False, True) if every_shape else (False,):
            Br, W = (128 if D <= 64 else 64), 8       # tc_backward_tiles on a GPU
            dynamic = 2 * shared_halves(Br, W, D) > 48 * 1024
            out.append((f"backward tensor cores {'bf16' if bf16 else 'fp16'} Br={Br} Bc={16 * W} D={D}",
                        make_backward_tc(Br, W, D, bf16, dynamic), sig))
        if every_shape:                               # the query split (chapter 13)
            out.append((f"backward tensor cores fp16 split Br={Br} Bc={16 * W} D={D}",
                        make_backward_tc(Br, W, D, False, dynamic, split=True), sig))
    return out
