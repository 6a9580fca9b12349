"""Chapter 6: block-sparse FlashAttention, backward pass.

Chapter 5's recomputing backward, walking kept tiles only. With P = exp(S - L) rebuilt
from Q, K and the saved logsumexp L, and D = rowsum(dO * O):

    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D),   dQ = scale dS K,   dK = scale dS^T Q

Two ways to get dQ, as in chapter 5 (``dq_mode``):

* ``"atomic"`` (the default): a pre-pass (chapter 5's ``make_delta``) computes
  D = rowsum(dO * O) and clears dQ; then one kernel, K/V tile outer (grid Tc x B*H): a block
  owns Bc keys, walks the kept query tiles of its column (the CSC lists: the transposed
  mask), accumulates its Bc x d slices of dK and dV in registers, and adds each tile's
  contribution scale * dS K_j to dQ_i with float32 atomic adds. P is computed once a tile;
  the order of the additions into dQ depends on which block gets there first, so dQ varies
  in its last bits from run to run.
* ``"separate"``: deterministic (bit for bit, run to run), no atomics. First a dQ kernel,
  Q tile outer (grid Tr x B*H): a block owns Br query rows, walks the kept key tiles of its
  row (the forward's CSR lists), accumulates its Br x d slice of dQ in registers; it also
  computes D for its rows and writes it out. Then the same dK/dV kernel without the dQ
  additions. P and dP are computed twice (once per kernel), the price of determinism.

Tiles
wholly above the causal diagonal are not in the lists; the diagonal's tiles, the ragged
last tiles, and rows that see nothing are masked per element (P = 0 there by a branch,
never exp(S - (-inf))). The lists and the tile choice are the forward's (kernels.block_sparse).

Register tiling as in the forward: thread (ty, tx) owns R consecutive rows (query rows
in the dQ kernel, key rows in the dK/dV kernel) and the columns tx, tx + TC, ...; every
tile lives transposed in one dynamic shared buffer with its rows padded by one float, so
the same buffer serves, conflict-free, both as the transposed operand of the scores
(S = Q K^T reads Kt[dd, c] along c) and as the plain operand of the accumulations
(dQ += dS K reads K[c, dd] = Kt[dd, c] along dd: rows Bc + 1 apart, different banks);
dS (and P) are stored transposed too, so a thread's R rows are adjacent words.

Tile copies are branch-free (``_make_tile_copy``: loads clamped to valid addresses, zeroed
afterwards, all of a thread's loads in flight at once). P is rebuilt as exp of one fma,
scale * S - L rounded once: with large logits a separately rounded scale * S would carry
an error of a few ulps of |scale * S| into the small difference.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint64

from kernels.block_sparse import KernelConfig, lists_for, fit_tiles, padded_head_dim
from kernels.flash_backward import make_delta
from kernels.base.runtime import (ArrayKind, cdiv, check_array, check_flag, check_qkv, check_scale, device_empty,
                             on_simulator, to_device)
from kernels.base.shared_memory import allow_dynamic_shared_memory

__all__ = ["block_sparse_attention_backward", "make_backward_dq", "make_backward_dkdv", "backward_config",
           "BACKWARD_CONFIGS", "DQ_MODES", "io_model_bytes", "ptx_targets"]

DQ_MODES = ("atomic", "separate")

# Production tiles for the H100 by padded head dim: (Br, Bc, R, TC), used by both kernels
# (so that one set of lists serves both). dQ kernel: (Br/R) x TC threads, R query rows
# a thread; dK/dV kernel: (Bc/R) x TC threads, R key rows a thread. Shared memory: one
# dynamic buffer a kernel (see dq_layout, dkdv_layout), above 48 KB through
# kernels/base/shared_memory.py.
BACKWARD_CONFIGS = {
    32: (64, 64, 4, 16),   # dQ 50 KB / dK dV 67 KB at D=32; 256 threads each
    64: (64, 64, 4, 16),   # dQ 83 KB / dK dV 100 KB; 256 threads each: 4x4 scores, 4x4 outputs
    128: (64, 32, 4, 16),  # dQ 108 KB / dK dV 118 KB; 256 / 128 threads
}
SIM_CONFIG = (8, 8, 2, 4)
DKDV_MAX_REGISTERS = 128   # the dK/dV kernel's register cap for D <= 64 (see make_backward_dkdv)


def dq_layout(Br, Bc, D):
    """dQ kernel, offsets (floats) in its shared buffer: Qt, dOt D x (Br+1); Kt, Vt D x (Bc+1);
    dSt Bc x (Br+1). Returns the offsets, the strides QS, KS and the total."""
    QS, KS = Br + 1, Bc + 1
    q_off = 0
    do_off = q_off + D * QS
    k_off = do_off + D * QS
    v_off = k_off + D * KS
    ds_off = v_off + D * KS
    return q_off, do_off, k_off, v_off, ds_off, QS, KS, ds_off + Bc * QS


def dkdv_layout(Br, Bc, D):
    """dK/dV kernel: Kt, Vt D x (Bc+1); Qt, dOt D x (Br+1); Pt, dSt Br x (Bc+1); L, D Br each."""
    QS, KS = Br + 1, Bc + 1
    k_off = 0
    v_off = k_off + D * KS
    q_off = v_off + D * KS
    do_off = q_off + D * QS
    p_off = do_off + D * QS
    ds_off = p_off + Br * KS
    l_off = ds_off + Br * KS
    dl_off = l_off + Br
    return k_off, v_off, q_off, do_off, p_off, ds_off, l_off, dl_off, QS, KS, dl_off + Br


def shared_bytes_dq(Br, Bc, D):
    return 4 * dq_layout(Br, Bc, D)[-1]


def shared_bytes_dkdv(Br, Bc, D):
    return 4 * dkdv_layout(Br, Bc, D)[-1]


def backward_config(d, block_mask, block_m=None, block_n=None) -> KernelConfig:
    """The backward kernels' tiles for head dim ``d`` and this mask (R is RM for dQ, RN for dK/dV)."""
    if on_simulator():
        Br, Bc, R, TC = SIM_CONFIG
    else:
        Br, Bc, R, TC = BACKWARD_CONFIGS[32 if d <= 32 else (64 if d <= 64 else 128)]
    Br, Bc, R, TC = fit_tiles(block_mask, Br, Bc, R, TC, block_m, block_n)
    R = min(R, Br, Bc)
    TC = min(TC, Br, Bc)
    return KernelConfig(Br, Bc, R, TC, padded_head_dim(d, TC))


def _make_tile_copy(R: int, D: int, NT: int, S: int):
    """copy(x, y, r0, n, d, smem, x_off, y_off, tid): rows r0 .. r0 + R - 1 of two (N, d)
    matrices x and y (Q and dO, or K and V) into shared memory, transposed: element (r, c)
    to ``off + c * S + r``; zeros past N and past d. A pass of the NT threads copies
    NT // LC rows of LC columns, consecutive threads reading consecutive columns (coalesced)
    and storing to rows S = R + 1 apart (different banks). Every load reads a valid address
    (row and column clamped) and is zeroed afterwards if it lies outside the matrix: no
    branch around a load, so all of a thread's loads are in flight at once."""
    LC = min(D, NT)
    LR = NT // LC
    PASSES = cdiv(R, LR)
    EXACT = R % LR == 0

    @cuda.jit(device=True, inline=True)
    def copy(x, y, r0, n, d, smem, x_off, y_off, tid):
        lc = tid % LC
        lr = tid // LC
        for rr in range(PASSES):
            r = lr + LR * rr
            row = uint64(min(r0 + r, n - 1))
            for cc in range(D // LC):
                c = lc + LC * cc
                col = uint64(min(c, d - 1))
                xv = x[row, col]
                yv = y[row, col]
                if r0 + r >= n or c >= d:
                    xv = float32(0.0)
                    yv = float32(0.0)
                if EXACT or r < R:
                    smem[uint64(x_off + c * S + r)] = xv
                    smem[uint64(y_off + c * S + r)] = yv
    return copy


# --------------------------------------------------------------------------- dQ (and D)

@functools.lru_cache(maxsize=None)
def make_backward_dq(Br: int, Bc: int, D: int, RM: int, TC: int):
    """dQ kernel: grid (Tr, B*H), (Br/RM)*TC threads, ``shared_bytes_dq`` bytes of dynamic
    shared memory; also writes D = rowsum(dO * O)."""
    if Br % RM or Bc % TC or D % TC:
        raise ValueError(f"make_backward_dq: need RM | Br, TC | Bc and TC | D; got Br={Br} Bc={Bc} D={D} "
                         f"RM={RM} TC={TC}")
    TR = Br // RM
    NT = TR * TC
    CN = Bc // TC
    DN = D // TC
    Q_OFF, DO_OFF, K_OFF, V_OFF, DS_OFF, QS, KS, _ = dq_layout(Br, Bc, D)
    copy_q = _make_tile_copy(Br, D, NT, QS)
    copy_k = _make_tile_copy(Bc, D, NT, KS)

    @cuda.jit(fastmath=True)
    def block_sparse_backward_dq(q, k, v, o, lse, do, dq, delta, row_ptr, col_idx, row_order, nq, nk, d,
                                 groups, scale, causal):
        smem = cuda.shared.array(0, float32)       # Qt | dOt | Kt | Vt | dSt, see dq_layout
        tid = int32(cuda.threadIdx.x)
        ty = tid // TC
        tx = tid - ty * TC
        bh = int32(cuda.blockIdx.y)
        tr = int32(cuda.gridDim.x)
        g = bh % groups
        rt = row_order[g * tr + int32(cuda.blockIdx.x)]   # longest lists first
        q0 = rt * Br
        shift = nk - nq
        r0 = ty * RM
        utx = uint64(tx)
        ur0 = uint64(r0)
        kh = k[uint64(bh)]                         # this head's K, V: (Nk, d) views
        vh = v[uint64(bh)]

        copy_q(q[uint64(bh)], do[uint64(bh)], q0, nq, d, smem, Q_OFF, DO_OFF, tid)

        Lr = cuda.local.array(RM, float32)
        Dr = cuda.local.array(RM, float32)
        acc = cuda.local.array((RM, DN), float32)
        s = cuda.local.array((RM, CN), float32)
        dp = cuda.local.array((RM, CN), float32)
        a = cuda.local.array(RM, float32)
        a2 = cuda.local.array(RM, float32)
        b = cuda.local.array(CN, float32)
        b2 = cuda.local.array(CN, float32)
        w = cuda.local.array(DN, float32)

        # D = rowsum(dO * O), summed over dd in the same order as the dot products of dP
        # below, so that dP - D is exactly 0 where it should be (e.g. a row that sees a
        # single key, where O = V and P = 1).
        cuda.syncthreads()                         # Qt and dOt are in shared memory
        for i in range(RM):
            qi = q0 + r0 + i
            total = float32(0.0)
            Lr[i] = float32(0.0)
            if qi < nq:
                Lr[i] = lse[bh, qi]
                for dd in range(d):
                    total += smem[DO_OFF + dd * QS + r0 + i] * o[bh, qi, dd]
            Dr[i] = total
            if tx == 0 and qi < nq:
                delta[bh, qi] = total
            for j in range(DN):
                acc[i, j] = float32(0.0)

        start = row_ptr[g * tr + rt]
        end = row_ptr[g * tr + rt + 1]
        for it in range(start, end):
            k0 = col_idx[it] * Bc
            cuda.syncthreads()                     # done with the previous Kt, Vt, dSt
            copy_k(kh, vh, k0, nk, d, smem, K_OFF, V_OFF, tid)
            cuda.syncthreads()

            # S = Q K^T (raw dot products) and dP = dO V^T, RM x CN each.
            for i in range(RM):
                for j in range(CN):
                    s[i, j] = float32(0.0)
                    dp[i, j] = float32(0.0)
            qa = ur0
            kb = utx
            for dd in range(D):
                for i in range(RM):
                    a[i] = smem[uint64(Q_OFF) + qa + uint64(i)]
                    a2[i] = smem[uint64(DO_OFF) + qa + uint64(i)]
                for j in range(CN):
                    b[j] = smem[uint64(K_OFF) + kb + uint64(j * TC)]
                    b2[j] = smem[uint64(V_OFF) + kb + uint64(j * TC)]
                for i in range(RM):
                    for j in range(CN):
                        s[i, j] += a[i] * b[j]
                        dp[i, j] += a2[i] * b2[j]
                qa += uint64(QS)
                kb += uint64(KS)

            # P = exp(scale S - L) where allowed, 0 elsewhere; dS = P * (dP - D), into dSt[c, r].
            # The exponent is one fma: scale S - L rounded once. (Rounding scale S first, or
            # scaling both by log2(e) first, would each add an error of a few ulps of |scale S|,
            # large next to the small difference when the logits are large.)
            for i in range(RM):
                qi = q0 + r0 + i
                for j in range(CN):
                    kj = k0 + tx + j * TC
                    val = float32(0.0)
                    if qi < nq and kj < nk and (causal == 0 or kj <= qi + shift):
                        val = math.exp(cuda.fma(s[i, j], scale, -Lr[i])) * (dp[i, j] - Dr[i])
                    smem[uint64(DS_OFF + (tx + j * TC) * QS) + ur0 + uint64(i)] = val
            cuda.syncthreads()

            # dQ += dS K, with K[c, dd] read from Kt[dd, c].
            pa = uint64(DS_OFF) + ur0              # dSt[c, r0]
            kc = uint64(K_OFF) + utx * uint64(KS)  # Kt[tx, c]
            for c in range(Bc):
                for i in range(RM):
                    a[i] = smem[pa + uint64(i)]
                for j in range(DN):
                    w[j] = smem[kc + uint64(j * TC * KS)]
                for i in range(RM):
                    for j in range(DN):
                        acc[i, j] += a[i] * w[j]
                pa += uint64(QS)
                kc += uint64(1)

        for i in range(RM):
            qi = q0 + r0 + i
            if qi < nq:
                for j in range(DN):
                    dd = tx + j * TC
                    if dd < d:
                        dq[bh, qi, dd] = acc[i, j] * scale

    return block_sparse_backward_dq


# --------------------------------------------------------------------------- dK, dV

@functools.lru_cache(maxsize=None)
def make_backward_dkdv(Br: int, Bc: int, D: int, RN: int, TC: int, atomic_dq: bool = False):
    """dK/dV kernel: grid (Tc, B*H), (Bc/RN)*TC threads, ``shared_bytes_dkdv`` bytes of
    dynamic shared memory. With ``atomic_dq`` it also adds scale * dS K_j into dQ (which
    must hold zeros, and D must be computed, before it runs)."""
    if Bc % RN or Br % TC or D % TC:
        raise ValueError(f"make_backward_dkdv: need RN | Bc, TC | Br and TC | D; got Br={Br} Bc={Bc} D={D} "
                         f"RN={RN} TC={TC}")
    TY = Bc // RN
    NT = TY * TC
    QN = Br // TC          # query columns of S^T a thread owns
    DN = D // TC
    QR = cdiv(Br, TY)      # dQ_i partial (Br x D): query rows ty, ty + TY, ... a thread
    K_OFF, V_OFF, Q_OFF, DO_OFF, P_OFF, DS_OFF, L_OFF, DL_OFF, QS, KS, _ = dkdv_layout(Br, Bc, D)
    copy_q = _make_tile_copy(Br, D, NT, QS)
    copy_k = _make_tile_copy(Bc, D, NT, KS)
    # Two blocks an SM (100 KB of shared memory each at D = 64) also need <= 128 registers
    # a thread: 2 x 256 threads x 128 fill the 64 K register file. Left alone, ptxas takes
    # about 178 (one block an SM); capped at 128 it fits without spilling for D <= 64.
    # (D = 128: 118 KB of shared memory, one block an SM anyway.) The simulator has no cap.
    opts = {} if on_simulator() or D > 64 or not DKDV_MAX_REGISTERS else {"max_registers": DKDV_MAX_REGISTERS}

    @cuda.jit(fastmath=True, **opts)
    def block_sparse_backward_dkdv(q, k, v, lse, do, delta, dq, dk, dv, col_ptr, row_idx, col_order, nq, nk,
                                   d, groups, scale, causal):
        smem = cuda.shared.array(0, float32)       # Kt | Vt | Qt | dOt | Pt | dSt | L | D
        tid = int32(cuda.threadIdx.x)
        ty = tid // TC
        tx = tid - ty * TC
        bh = int32(cuda.blockIdx.y)
        tcn = int32(cuda.gridDim.x)
        g = bh % groups
        ct = col_order[g * tcn + int32(cuda.blockIdx.x)]  # longest lists first
        k0 = ct * Bc
        shift = nk - nq
        c0 = ty * RN
        utx = uint64(tx)
        uc0 = uint64(c0)
        qh = q[uint64(bh)]                         # this head's Q, dO: (Nq, d) views
        doh = do[uint64(bh)]

        copy_k(k[uint64(bh)], v[uint64(bh)], k0, nk, d, smem, K_OFF, V_OFF, tid)

        dka = cuda.local.array((RN, DN), float32)
        dva = cuda.local.array((RN, DN), float32)
        st = cuda.local.array((RN, QN), float32)
        dpt = cuda.local.array((RN, QN), float32)
        a = cuda.local.array(RN, float32)
        a2 = cuda.local.array(RN, float32)
        b = cuda.local.array(QN, float32)
        b2 = cuda.local.array(QN, float32)
        w = cuda.local.array(DN, float32)
        w2 = cuda.local.array(DN, float32)
        dqa = cuda.local.array((QR, DN), float32)
        dsr = cuda.local.array(QR, float32)
        for i in range(RN):
            for j in range(DN):
                dka[i, j] = float32(0.0)
                dva[i, j] = float32(0.0)

        start = col_ptr[g * tcn + ct]
        end = col_ptr[g * tcn + ct + 1]
        for it in range(start, end):
            q0 = row_idx[it] * Br
            cuda.syncthreads()                     # done with the previous Q, dO, P, dS
            copy_q(qh, doh, q0, nq, d, smem, Q_OFF, DO_OFF, tid)
            for r in range(tid, Br, NT):
                lv = float32(0.0)
                dlv = float32(0.0)
                if q0 + r < nq:
                    lv = lse[bh, q0 + r]
                    dlv = delta[bh, q0 + r]
                smem[L_OFF + r] = lv
                smem[DL_OFF + r] = dlv
            cuda.syncthreads()

            # S^T = K Q^T (raw dot products) and dP^T = V dO^T, RN x QN each.
            for i in range(RN):
                for j in range(QN):
                    st[i, j] = float32(0.0)
                    dpt[i, j] = float32(0.0)
            ka = uc0
            qb = utx
            for dd in range(D):
                for i in range(RN):
                    a[i] = smem[uint64(K_OFF) + ka + uint64(i)]
                    a2[i] = smem[uint64(V_OFF) + ka + uint64(i)]
                for j in range(QN):
                    b[j] = smem[uint64(Q_OFF) + qb + uint64(j * TC)]
                    b2[j] = smem[uint64(DO_OFF) + qb + uint64(j * TC)]
                for i in range(RN):
                    for j in range(QN):
                        st[i, j] += a[i] * b[j]
                        dpt[i, j] += a2[i] * b2[j]
                ka += uint64(KS)
                qb += uint64(QS)

            # P^T = exp(scale S^T - L) (one fma, as in the dQ kernel), dS^T = P^T * (dP^T - D),
            # 0 where not allowed; stored as
            # Pt[r, c] and dSt[r, c] (query-major) so the accumulation reads adjacent words.
            for i in range(RN):
                kj = k0 + c0 + i
                for j in range(QN):
                    r = tx + j * TC
                    qi = q0 + r
                    p = float32(0.0)
                    dsv = float32(0.0)
                    if qi < nq and kj < nk and (causal == 0 or kj <= qi + shift):
                        p = math.exp(cuda.fma(st[i, j], scale, -smem[L_OFF + r]))
                        dsv = p * (dpt[i, j] - smem[DL_OFF + r])
                    at = uint64(r * KS) + uc0 + uint64(i)
                    smem[uint64(P_OFF) + at] = p
                    smem[uint64(DS_OFF) + at] = dsv
            cuda.syncthreads()

            # dV += P^T dO, dK += dS^T Q; dO[r, dd] and Q[r, dd] read from dOt, Qt[dd, r].
            pa = uc0                               # Pt[r, c0]
            qc = utx * uint64(QS)                  # Qt[tx, r]
            for r in range(Br):
                for i in range(RN):
                    a[i] = smem[uint64(P_OFF) + pa + uint64(i)]
                    a2[i] = smem[uint64(DS_OFF) + pa + uint64(i)]
                for j in range(DN):
                    w[j] = smem[uint64(DO_OFF) + qc + uint64(j * TC * QS)]
                    w2[j] = smem[uint64(Q_OFF) + qc + uint64(j * TC * QS)]
                for i in range(RN):
                    for j in range(DN):
                        dva[i, j] += a[i] * w[j]
                        dka[i, j] += a2[i] * w2[j]
                pa += uint64(KS)
                qc += uint64(1)

            if atomic_dq:
                # dQ_i += scale dS K_j: dS[r, c] from dSt (row r, stride KS), K[c, dd] from
                # Kt[dd, c]; thread (ty, tx) owns rows ty + TY m and columns tx + TC j.
                for m in range(QR):
                    for j in range(DN):
                        dqa[m, j] = float32(0.0)
                for c in range(Bc):
                    for m in range(QR):
                        r = ty + m * TY
                        dsr[m] = smem[uint64(DS_OFF + min(r, Br - 1) * KS + c)]
                    for j in range(DN):
                        w[j] = smem[uint64(K_OFF + (tx + j * TC) * KS + c)]
                    for m in range(QR):
                        for j in range(DN):
                            dqa[m, j] += dsr[m] * w[j]
                for m in range(QR):
                    r = ty + m * TY
                    qi = q0 + r
                    if r < Br and qi < nq:
                        for j in range(DN):
                            dd = tx + j * TC
                            if dd < d:
                                cuda.atomic.add(dq, (bh, qi, dd), dqa[m, j] * scale)

        for i in range(RN):
            kj = k0 + c0 + i
            if kj < nk:
                for j in range(DN):
                    dd = tx + j * TC
                    if dd < d:
                        dk[bh, kj, dd] = dka[i, j] * scale
                        dv[bh, kj, dd] = dva[i, j]

    return block_sparse_backward_dkdv


DQ_SIG = ("void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], "
          "float32[:, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, ::1], int32[::1], int32[::1], "
          "int32[::1], int32, int32, int32, int32, float32, int32)")
DKDV_SIG = ("void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, ::1], "
            "float32[:, :, ::1], float32[:, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], int32[::1], "
            "int32[::1], int32[::1], int32, int32, int32, int32, float32, int32)")


def io_model_bytes(b, h, nq, nk, d, *, Br, Bc, rho, in_bytes=4, dq_mode="atomic"):
    """HBM bytes of the backward kernels by the IO model, per head:
    dK/dV kernel: K, V read, dK, dV written (4 Nk d), Q, dO, L, D read for each kept tile
    ((2 Nq d + 2 Nq) ceil(Nk/Bc) rho);
    atomic: the pre-pass reads O, dO, writes D and clears dQ (3 Nq d + Nq), and each kept
    tile reads and writes its dQ_i (2 Nq d ceil(Nk/Bc) rho);
    separate: the dQ kernel reads Q, dO, O, writes dQ (4 Nq d), reads L and writes D (2 Nq),
    and reads K and V for each kept tile (2 Nk d ceil(Nq/Br) rho)."""
    dkdv = 4 * nk * d + (2 * nq * d + 2 * nq) * cdiv(nk, Bc) * rho
    if dq_mode == "atomic":
        dq = 3 * nq * d + nq + 2 * nq * d * cdiv(nk, Bc) * rho
    else:
        dq = 4 * nq * d + 2 * nq + 2 * nk * d * cdiv(nq, Br) * rho
    return float(b * h * in_bytes * (dq + dkdv))


# --------------------------------------------------------------------------- the launcher

def block_sparse_attention_backward(q, k, v, o, lse, do, block_mask, *, causal=False, scale=None,
                                    block_m=None, block_n=None, lists=None, dq_mode="atomic"):
    """Gradients (dQ, dK, dV) of block-sparse attention for the upstream gradient dO.

    q: (B, H, Nq, d); k, v: (B, H, Nk, d); o, do: (B, H, Nq, d); lse: (B, H, Nq), the
    forward's O and L for the same ``block_mask``, ``causal`` and ``scale``. Rows that see
    nothing (L = -inf) and keys no query sees get zero gradients. ``block_m``/``block_n``
    override the tiles (powers of two dividing the mask's blocks); ``lists`` reuses a
    ``tile_lists(...)`` built for these tiles. ``dq_mode``: ``"atomic"`` (one pass over the
    kept tiles, dQ added with atomics: its last bits vary from run to run) or ``"separate"``
    (a second pass for dQ, no atomics: bitwise reproducible, slower).
    """
    b, h, nq, nk, d, _ = check_qkv(q, k, v)
    for x, name in ((o, "o"), (do, "do")):
        shape, _ = check_array(x, name, ndim=4)
        if shape != (b, h, nq, d):
            raise ValueError(f"{name}: expected shape {(b, h, nq, d)} like q, got {shape}")
    shape, _ = check_array(lse, "lse", ndim=3)
    if shape != (b, h, nq):
        raise ValueError(f"lse: expected shape {(b, h, nq)}, got {shape}")
    causal = check_flag(causal, "causal")
    scale = check_scale(scale, d)
    if dq_mode not in DQ_MODES:
        raise ValueError(f"dq_mode: expected one of {DQ_MODES}, got {dq_mode!r}")
    cfg = backward_config(d, block_mask, block_m, block_n)
    tl = lists_for(block_mask, lists, b, h, nq, nk, causal, cfg.Br, cfg.Bc)
    kind = ArrayKind(q)
    dq = device_empty((b, h, nq, d))
    dk = device_empty((b, h, nk, d))
    dv = device_empty((b, h, nk, d))
    if b * h * nq == 0 and b * h * nk > 0:   # no queries: nothing flows back to the keys
        zeros = np.zeros((b, h, nk, d), np.float32)
        return kind.give_back(dq), kind.give_back(cuda.to_device(zeros)), kind.give_back(cuda.to_device(zeros))
    if b * h * nq == 0:
        return kind.give_back(dq), kind.give_back(dk), kind.give_back(dv)
    names = ("q", "k", "v", "o", "lse", "do")
    qd, kd, vd, od, ld, dod = (to_device(x, n) for x, n in zip((q, k, v, o, lse, do), names))
    delta = device_empty((b * h, nq))
    dev = tl.device()
    row_ptr, col_idx, col_ptr, row_idx = dev.row_ptr, dev.col_idx, dev.col_ptr, dev.row_idx
    bhn = b * h
    args3 = dict(q=qd.reshape(bhn, nq, d), k=kd.reshape(bhn, nk, d), v=vd.reshape(bhn, nk, d))
    common = (np.int32(nq), np.int32(nk), np.int32(d), np.int32(tl.groups), np.float32(scale), np.int32(causal))
    o3, do3, dq3, l2 = od.reshape(bhn, nq, d), dod.reshape(bhn, nq, d), dq.reshape(bhn, nq, d), ld.reshape(bhn, nq)
    atomic = dq_mode == "atomic"
    if atomic:   # D = rowsum(dO * O) and dQ = 0, before the dK/dV kernel adds into dQ
        kern_delta, rows_nt = make_delta(cfg.D, 4, True)
        kern_delta[(cdiv(nq, rows_nt // 32), bhn), rows_nt](o3, do3, delta, dq3, np.int32(nq))
    else:        # dQ (and D) by its own pass over the row lists
        kern_dq = make_backward_dq(cfg.Br, cfg.Bc, cfg.D, cfg.RM, cfg.TC)
        args = (args3["q"], args3["k"], args3["v"], o3, l2, do3, dq3, delta, row_ptr, col_idx, dev.row_order,
                *common)
        nbytes = shared_bytes_dq(cfg.Br, cfg.Bc, cfg.D)
        allow_dynamic_shared_memory(kern_dq, args, nbytes)
        kern_dq[(cdiv(nq, cfg.Br), bhn), (cfg.Br // cfg.RM) * cfg.TC, 0, nbytes](*args)
    if nk > 0:
        kern_kv = make_backward_dkdv(cfg.Br, cfg.Bc, cfg.D, cfg.RM, cfg.TC, atomic)
        args = (args3["q"], args3["k"], args3["v"], l2, do3, delta, dq3,
                dk.reshape(bhn, nk, d), dv.reshape(bhn, nk, d), col_ptr, row_idx, dev.col_order, *common)
        nbytes = shared_bytes_dkdv(cfg.Br, cfg.Bc, cfg.D)
        allow_dynamic_shared_memory(kern_kv, args, nbytes)
        kern_kv[(cdiv(nk, cfg.Bc), bhn), (cfg.Bc // cfg.RM) * cfg.TC, 0, nbytes](*args)
    return kind.give_back(dq), kind.give_back(dk), kind.give_back(dv)


def ptx_targets():
    """Both backward kernels at their production tiles, for the sm_90 PTX check."""
    out = []
    for D0, (Br, Bc, R, TC) in BACKWARD_CONFIGS.items():
        for D in sorted({D0 // 2, D0}) if D0 == 32 else (D0,):
            tag = f"fp32 Br={Br} Bc={Bc} D={D} R={R} TC={TC}"
            out.append((f"block-sparse bwd dQ {tag}", make_backward_dq(Br, Bc, D, R, TC), DQ_SIG))
            out.append((f"block-sparse bwd dK dV {tag}", make_backward_dkdv(Br, Bc, D, R, TC), DKDV_SIG))
            out.append((f"block-sparse bwd dK dV + atomic dQ {tag}", make_backward_dkdv(Br, Bc, D, R, TC, True),
                        DKDV_SIG))
    return out
