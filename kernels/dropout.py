"""Chapter 10: attention dropout with no mask stored (FlashAttention's Algorithm 2 [1]).

    P = softmax(scale * Q K^T + mask),   L = rowwise logsumexp(scale * Q K^T + mask)
    O = (P o Z / (1 - p)) V              Z_ij = 1 (kept, probability 1 - p) or 0 (dropped)

The dropout acts after the softmax's normalisation, as in [1]'s Algorithm 2 (the forward;
Algorithm 4 is its backward) and PyTorch: the row sums l count every P_ij, kept or not,
and L is the logsumexp of the undropped S. ([1] rescales O by 1/l at every K/V tile; these
kernels divide once at the end, FlashAttention-2's order [4], as chapter 4 does.)
A dropped element adds nothing to O; the kept ones are scaled by 1 / (1 - p), so that
E[O] is attention's O.

No mask is stored. A mask of N^2 bits a head is what the fused kernels exist to avoid
(at N = 16k, 32 MB a head, read back by the backward). Z comes instead from a
*counter-based* generator: a pure function of (seed, counter) that any thread can evaluate
for any element, in any order, in the forward and again in the backward:

    x(b, h, i, j) = Philox4x32-10(key = seed, counter = (b H + h, i, floor(j / 4), 0))[j mod 4]
    Z_ij = 1  iff  u_ij = x / 2^32 >= p      (an integer compare: x >= ceil(p 2^32))

Philox4x32-10 (Salmon, Moraes, Dror, Shaw, SC 2011; the generator of cuRAND's and
PyTorch's CUDA dropout): a 128-bit counter (c0, c1, c2, c3) and a 64-bit key (k0, k1),
ten rounds of

    (hi0, lo0) = M0 c0   (hi1, lo1) = M1 c2          32 x 32 -> 64-bit products
    c = (hi1 ^ c1 ^ k0,  lo1,  hi0 ^ c3 ^ k1,  lo0)
    k = (k0 + W0, k1 + W1)                            (mod 2^32; Weyl sequence)

with M0 = 0xD2511F53, M1 = 0xCD9E8D57, W0 = 0x9E3779B9, W1 = 0xBB67AE85. One call gives
four 32-bit numbers: the four keys j = 4c2 .. 4c2 + 3 of row i. ``philox4x32`` is the
device function, ``philox4x32_numpy`` its NumPy twin (bit-identical; the tests check both
against Random123's published known-answer vectors).

The kernels (teaching kernels, plain ``@cuda.jit``, IEEE exp):

    forward     chapter 4's rung 2 (``make_query_tile_forward``): a block a query tile, a
                thread a query row, K/V tiles in shared memory. For each key j:
                    m' = max(m, s);  alpha = exp(m - m');  e = exp(s - m')
                    l  = alpha l + e                  (every e, kept or not)
                    O  = alpha O + Z_ij e v_j         (only the kept)
                and at the end O / (l (1 - p)), L = m + log l. A thread's keys come in
                order, so one Philox call serves four keys.
    backward    chapter 5's rung 2 (``make_shared_tile_dkdv`` / ``make_shared_tile_dq``),
                with the same Z regenerated from the same counters:
                    P   = exp(scale S - L)            (the undropped P)
                    dV  = (P o Z / (1 - p))^T dO
                    dP  = (dO V^T) o Z / (1 - p)
                    D   = rowsum(dO o O)              (O the dropped output: D = rowsum(P o dP))
                    dS  = P o (dP - D)
                    dQ  = scale dS K,   dK = scale dS^T Q
                The dK/dV kernel's thread owns a key j and walks the rows i: it evaluates
                one Philox call an element (4x the forward's); the dQ kernel walks keys in
                order, one call per four.

``dropout_attention`` and ``dropout_attention_backward`` are the launchers;
``dropout_attention_oracle`` and ``dropout_attention_backward_oracle`` the float64 oracle
(built on ``kernels.reference``'s pieces, with the same generator); ``ptx_targets`` the
kernels at d = 64.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, uint32, uint64

from kernels import reference as ref
from kernels.base.backward_args import check_backward_args, device_views
from kernels.base.fused import MAX_GRID_Y, MINUS_INF, make_kv_tile_copy, nan_max, padded_head_dim
from kernels.base.inlined import inlined
from kernels.base.runtime import (ArrayKind, cdiv, check_flag, check_qkv, check_scale, device_empty, on_simulator,
                                  to_device)
from kernels.flash_backward import check_shared_tiles, row_delta
from kernels.flash_forward import check_query_tile

__all__ = ["philox4x32", "philox4x32_numpy", "seed_key", "keep_threshold", "dropout_bits", "keep_mask",
           "make_dropout_forward", "make_dropout_dkdv", "make_dropout_dq", "dropout_attention",
           "dropout_attention_backward", "dropout_attention_oracle", "dropout_attention_backward_oracle",
           "ptx_targets"]


# --------------------------------------------------------------------------- Philox4x32-10

PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57      # round multipliers
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85      # key increments (golden ratio, sqrt(3) - 1)
ROUNDS = 10

# Typed constants for the device function: a Python int would make Numba mix int64 and
# uint64 (which it types as float64); the simulator would compute with Python ints.
_M0, _M1 = uint64(PHILOX_M0), uint64(PHILOX_M1)
_W0, _W1 = uint64(PHILOX_W0), uint64(PHILOX_W1)
_LOW32 = uint64(0xFFFFFFFF)
_SHIFT32 = uint64(32)


@inlined
def philox4x32(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of counter (c0, c1, c2, c3) under key (k0, k1), all uint32: four uint32.
    mulhi/mullo through one 64-bit product each (mul.wide.u32 on the GPU)."""
    x0, x1, x2, x3 = uint32(c0), uint32(c1), uint32(c2), uint32(c3)
    y0, y1 = uint64(k0), uint64(k1)
    for _ in range(ROUNDS):
        p0 = _M0 * uint64(x0)
        p1 = _M1 * uint64(x2)
        hi0, lo0 = uint32(p0 >> _SHIFT32), uint32(p0 & _LOW32)
        hi1, lo1 = uint32(p1 >> _SHIFT32), uint32(p1 & _LOW32)
        # Numba types uint32 ^ uint32 as uint64: each result is cast back, so that the
        # state stays 32-bit and the products stay 32 x 32 -> 64 (mul.wide.u32)
        x0, x1, x2, x3 = uint32(hi1 ^ x1 ^ uint32(y0)), lo1, uint32(hi0 ^ x3 ^ uint32(y1)), lo0
        y0 = (y0 + _W0) & _LOW32                   # the key schedule, mod 2^32
        y1 = (y1 + _W1) & _LOW32
    return x0, x1, x2, x3


def philox4x32_numpy(counter, key):
    """The NumPy twin of ``philox4x32``: ``counter`` (..., 4) and ``key`` (..., 2) of uint32
    (broadcast against each other) -> (..., 4) uint32, bit for bit the device function's."""
    counter = np.asarray(counter, dtype=np.uint32)
    key = np.asarray(key, dtype=np.uint32)
    c = [counter[..., n].astype(np.uint64) for n in range(4)]
    k0, k1 = key[..., 0].astype(np.uint64), key[..., 1].astype(np.uint64)
    low = np.uint64(0xFFFFFFFF)
    for _ in range(ROUNDS):
        p0 = np.uint64(PHILOX_M0) * c[0]
        p1 = np.uint64(PHILOX_M1) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & low, (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & low]
        k0 = (k0 + np.uint64(PHILOX_W0)) & low
        k1 = (k1 + np.uint64(PHILOX_W1)) & low
    return np.stack(np.broadcast_arrays(*c), axis=-1).astype(np.uint32)


def seed_key(seed) -> tuple[int, int]:
    """The Philox key (k0, k1) of a seed in [0, 2^64): its low and high 32 bits."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed: expected an int in [0, 2^64), got {type(seed).__name__}")
    seed = int(seed)
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed: expected an int in [0, 2^64), got {seed}")
    return seed & 0xFFFFFFFF, seed >> 32


def keep_threshold(p) -> int:
    """The integer t with  u = x / 2^32 >= p  iff  x >= t  for 32-bit x: t = ceil(p 2^32).
    p must lie in [0, 1 - 2^-32] (closer to 1, no 32-bit number would be kept)."""
    if isinstance(p, bool) or not isinstance(p, (int, float, np.integer, np.floating)):
        raise TypeError(f"p: expected a number in [0, 1), got {type(p).__name__}")
    p = float(p)
    if not (0.0 <= p < 1.0):
        raise ValueError(f"p: expected a dropout probability in [0, 1), got {p}")
    t = math.ceil(p * 2.0**32)                     # exact: p 2^32 is p with its exponent moved
    if t >= 2**32:
        raise ValueError(f"p: expected p <= 1 - 2^-32 (else nothing is kept), got {p!r}")
    return t


def dropout_bits(bh: int, n_q: int, n_k: int, seed) -> np.ndarray:
    """The 32-bit random numbers x(bh, i, j) of every element, (BH, Nq, Nk) uint32, from the
    counters (bh, i, j // 4, 0), lane j % 4 (what the kernels evaluate, never store)."""
    k0, k1 = seed_key(seed)
    g = cdiv(n_k, 4)
    c = np.zeros((bh, n_q, g, 4), np.uint32)
    c[..., 0] = np.arange(bh, dtype=np.uint32)[:, None, None]
    c[..., 1] = np.arange(n_q, dtype=np.uint32)[None, :, None]
    c[..., 2] = np.arange(g, dtype=np.uint32)[None, None, :]
    x = philox4x32_numpy(c, np.array([k0, k1], np.uint32))
    return x.reshape(bh, n_q, 4 * g)[:, :, :n_k]


def keep_mask(B: int, H: int, n_q: int, n_k: int, *, p, seed) -> np.ndarray:
    """Z as booleans (B, H, Nq, Nk): True where kept (x >= ceil(p 2^32))."""
    t = keep_threshold(p)
    return (dropout_bits(B * H, n_q, n_k, seed) >= np.uint32(t) if t else
            np.ones((B * H, n_q, n_k), bool)).reshape(B, H, n_q, n_k)


@inlined
def _lane(x0, x1, x2, x3, j):
    """Lane j mod 4 of one Philox output."""
    r = j & 3
    if r == 0:
        return x0
    if r == 1:
        return x1
    if r == 2:
        return x2
    return x3


# --------------------------------------------------------------------------- the forward (rung 2 + Z)

@functools.lru_cache(maxsize=None)
def make_dropout_forward(Br: int, Bc: int, D: int):
    """Kernel (q, k, v, o, lse, scale, causal, k0, k1, threshold, inv_keep) on (B*H, N, d)
    views, d <= D; grid (ceil(Nq / Br), B*H), Br threads a block, thread t query row
    Br x + t (chapter 4's ``make_query_tile_forward``). Z_ij = x(bh, i, j) >= threshold;
    inv_keep = 1 / (1 - p)."""

    copy_kv_tile = make_kv_tile_copy(Bc, D, Br)

    @cuda.jit
    def dropout_forward(q, k, v, o, lse, scale, causal, k0, k1, threshold, inv_keep):
        K_j = cuda.shared.array((Bc, D), float32)
        V_j = cuda.shared.array((Bc, D), float32)
        bh = cuda.blockIdx.y
        t = cuda.threadIdx.x
        q0 = cuda.blockIdx.x * Br
        i = q0 + t
        n_q, n_k, d = q.shape[1], k.shape[1], q.shape[2]
        row = i < n_q
        kv_end = n_k
        block_end = n_k
        if causal:
            kv_end = min(n_k, i + 1 + n_k - n_q)
            block_end = min(n_k, q0 + Br + n_k - n_q)
        q_i = cuda.local.array(D, float32)
        o_i = cuda.local.array(D, float32)
        for c in range(D):
            q_i[c] = float32(scale) * float32(q[bh, i, c]) if row and c < d else float32(0.0)
            o_i[c] = float32(0.0)
        m = MINUS_INF
        l = float32(0.0)
        x0 = x1 = x2 = x3 = uint32(0)                 # this row's Philox output for keys 4g .. 4g + 3
        for k0_ in range(0, max(block_end, 0), Bc):
            copy_kv_tile(k, v, K_j, V_j, bh, k0_, n_k, d, t)      # the tile copy, as in chapter 4
            cuda.syncthreads()
            for r in range(min(Bc, kv_end - k0_)):
                j = k0_ + r
                if j & 3 == 0:                        # keys come in order: one call a group of four
                    x0, x1, x2, x3 = philox4x32(bh, i, j >> 2, 0, k0, k1)
                kept = _lane(x0, x1, x2, x3, j) >= threshold      # Z_ij
                s = float32(0.0)
                for c in range(D):
                    s += q_i[c] * K_j[r, c]
                m_new = nan_max(m, s)                 # m' = max(m, s)
                if m_new == MINUS_INF:
                    continue
                alpha = math.exp(m - m_new)
                e_ij = math.exp(s - m_new)
                l = l * alpha + e_ij                  # l counts every P_ij, kept or dropped
                w = e_ij if kept else float32(0.0)    # O gets only the kept ones
                for c in range(D):
                    o_i[c] = o_i[c] * alpha + w * V_j[r, c]
                m = m_new
            cuda.syncthreads()
        if not row:
            return
        if l == float32(0.0):                         # no key: O = 0, L = -inf
            for c in range(d):
                o[bh, i, c] = float32(0.0)
            lse[bh, i] = MINUS_INF
            return
        inv_l = inv_keep / l                          # O = sum Z e v / (l (1 - p))
        for c in range(D):
            if c < d:
                o[bh, i, c] = o_i[c] * inv_l
        lse[bh, i] = m + math.log(l)

    return dropout_forward


# --------------------------------------------------------------------------- the backward (rung 2 + Z)

@functools.lru_cache(maxsize=None)
def make_dropout_dkdv(Br: int, Bc: int, D: int):
    """Kernel (q, k, v, do, lse, delta, dk, dv, scale, causal, k0, k1, threshold, inv_keep),
    Bc threads a block, thread t key row Bc x + t (chapter 5's ``make_shared_tile_dkdv``);
    query tiles of Br rows in shared memory. For each row i that sees key j: P_ij =
    exp(scale s - L_i), Z_ij regenerated, dV_j += Z P_ij / (1 - p) dO_i, dP_ij = Z dO_i . v_j
    / (1 - p), dS_ij = P_ij (dP_ij - D_i), dK_j += scale dS_ij q_i."""

    @cuda.jit
    def dropout_dkdv(q, k, v, do, lse, delta, dk, dv, scale, causal, k0, k1, threshold, inv_keep):
        Q_i = cuda.shared.array((Br, D), float32)
        dO_i = cuda.shared.array((Br, D), float32)
        L_i = cuda.shared.array(Br, float32)
        D_i = cuda.shared.array(Br, float32)
        bh = cuda.blockIdx.y
        t = cuda.threadIdx.x
        j = cuda.blockIdx.x * Bc + t
        n_q, n_k, d = q.shape[1], k.shape[1], q.shape[2]
        key = j < n_k
        k_j = cuda.local.array(D, float32)
        v_j = cuda.local.array(D, float32)
        dk_j = cuda.local.array(D, float32)
        dv_j = cuda.local.array(D, float32)
        for c in range(D):
            k_j[c] = k[bh, j, c] if key and c < d else float32(0.0)
            v_j[c] = v[bh, j, c] if key and c < d else float32(0.0)
            dk_j[c], dv_j[c] = float32(0.0), float32(0.0)
        first = max(0, j + n_q - n_k) if causal else 0                     # this thread's first row
        block_first = max(0, cuda.blockIdx.x * Bc + n_q - n_k) if causal else 0
        for q0 in range(block_first, n_q, Br):
            for e in range(t, Br * D, Bc):
                r, c = e // D, e % D
                inside = q0 + r < n_q and c < d
                Q_i[r, c] = q[bh, q0 + r, c] if inside else float32(0.0)
                dO_i[r, c] = do[bh, q0 + r, c] if inside else float32(0.0)
            for r in range(t, Br, Bc):
                inside = q0 + r < n_q
                L_i[r] = lse[bh, q0 + r] if inside else MINUS_INF
                D_i[r] = delta[bh, q0 + r] if inside else float32(0.0)
            cuda.syncthreads()
            if key:
                for r in range(max(first - q0, 0), min(Br, n_q - q0)):
                    if L_i[r] == MINUS_INF:
                        continue
                    i = q0 + r
                    x0, x1, x2, x3 = philox4x32(bh, i, j >> 2, 0, k0, k1)   # one call an element here
                    kept = _lane(x0, x1, x2, x3, j) >= threshold
                    s = float32(0.0)
                    dp = float32(0.0)
                    for c in range(D):
                        s += Q_i[r, c] * k_j[c]
                        dp += dO_i[r, c] * v_j[c]
                    p = math.exp(float32(scale) * s - L_i[r])             # P_ij, undropped
                    z = inv_keep if kept else float32(0.0)               # Z_ij / (1 - p)
                    ds = p * (dp * z - D_i[r])                           # dS = P (dP o Z / (1-p) - D)
                    w = p * z
                    for c in range(D):
                        dv_j[c] += w * dO_i[r, c]
                        dk_j[c] += float32(scale) * ds * Q_i[r, c]
            cuda.syncthreads()
        if key:
            for c in range(D):
                if c < d:
                    dk[bh, j, c], dv[bh, j, c] = dk_j[c], dv_j[c]

    return dropout_dkdv


@functools.lru_cache(maxsize=None)
def make_dropout_dq(Br: int, Bc: int, D: int):
    """Kernel (q, k, v, do, lse, delta, dq, scale, causal, k0, k1, threshold, inv_keep), Br
    threads a block, thread t query row Br x + t (chapter 5's ``make_shared_tile_dq``);
    K/V tiles of Bc rows in shared memory; dQ_i += scale dS_ij k_j with dS as in the dK/dV
    kernel. Keys come in order: one Philox call a group of four."""

    copy_kv_tile = make_kv_tile_copy(Bc, D, Br)

    @cuda.jit
    def dropout_dq(q, k, v, do, lse, delta, dq, scale, causal, k0, k1, threshold, inv_keep):
        K_j = cuda.shared.array((Bc, D), float32)
        V_j = cuda.shared.array((Bc, D), float32)
        bh = cuda.blockIdx.y
        t = cuda.threadIdx.x
        q0 = cuda.blockIdx.x * Br
        i = q0 + t
        n_q, n_k, d = q.shape[1], k.shape[1], q.shape[2]
        row = i < n_q
        kv_end = min(n_k, i + 1 + n_k - n_q) if causal else n_k
        block_end = min(n_k, q0 + Br + n_k - n_q) if causal else n_k
        q_i = cuda.local.array(D, float32)
        do_i = cuda.local.array(D, float32)
        dq_i = cuda.local.array(D, float32)
        for c in range(D):
            q_i[c] = q[bh, i, c] if row and c < d else float32(0.0)
            do_i[c] = do[bh, i, c] if row and c < d else float32(0.0)
            dq_i[c] = float32(0.0)
        L = lse[bh, i] if row else MINUS_INF
        Dl = delta[bh, i] if row else float32(0.0)
        if L == MINUS_INF:
            kv_end = 0
        x0 = x1 = x2 = x3 = uint32(0)
        for k0_ in range(0, max(block_end, 0), Bc):
            copy_kv_tile(k, v, K_j, V_j, bh, k0_, n_k, d, t)
            cuda.syncthreads()
            for r in range(min(Bc, kv_end - k0_)):
                j = k0_ + r
                if j & 3 == 0:
                    x0, x1, x2, x3 = philox4x32(bh, i, j >> 2, 0, k0, k1)
                kept = _lane(x0, x1, x2, x3, j) >= threshold
                s = float32(0.0)
                dp = float32(0.0)
                for c in range(D):
                    s += q_i[c] * K_j[r, c]
                    dp += do_i[c] * V_j[r, c]
                p = math.exp(float32(scale) * s - L)
                z = inv_keep if kept else float32(0.0)
                ds = p * (dp * z - Dl)
                for c in range(D):
                    dq_i[c] += float32(scale) * ds * K_j[r, c]
            cuda.syncthreads()
        if row:
            for c in range(D):
                if c < d:
                    dq[bh, i, c] = dq_i[c]

    return dropout_dq


# --------------------------------------------------------------------------- launchers

def _dropout_args(p, seed):
    """(k0, k1, threshold, inv_keep) as the kernels take them, after checking p and seed."""
    t = keep_threshold(p)
    k0, k1 = seed_key(seed)
    return np.uint32(k0), np.uint32(k1), np.uint32(t), np.float32(1.0 / (1.0 - float(p)))


def dropout_attention(q, k, v, *, p, seed, causal=False, scale=None, tiles=None):
    """(o, lse) of attention with dropout after the softmax: O = (P o Z / (1 - p)) V, L the
    logsumexp of the undropped scores. ``p`` in [0, 1): the probability an element is
    dropped; ``seed`` an int in [0, 2^64) (the Philox key): the same seed gives the same Z,
    in the forward and in ``dropout_attention_backward``. q, k, v float32 or float16
    (B, H, N, d); ``tiles`` (Br, Bc) as for chapter 4's ``query_tile_attention``."""
    B, H, n_q, n_k, d, _ = check_qkv(q, k, v, dtypes=(np.float32, np.float16), max_head_dim=128)
    causal = check_flag(causal, "causal")
    scale = check_scale(scale, d)
    drop = _dropout_args(p, seed)
    if B * H > MAX_GRID_Y:
        raise ValueError(f"q: expected B*H <= {MAX_GRID_Y} (one grid row a head), got B={B}, H={H}")
    D = padded_head_dim(d)
    Br, Bc = check_query_tile(tiles, D)
    kind, BH = ArrayKind(q), B * H
    o = device_empty((BH, n_q, d))
    lse = device_empty((BH, n_q))
    if BH and n_q:
        views = tuple(to_device(x, name).reshape(BH, x.shape[2], d) for x, name in ((q, "q"), (k, "k"), (v, "v")))
        make_dropout_forward(Br, Bc, D)[(cdiv(n_q, Br), BH), Br](
            *views, o, lse, np.float32(scale), np.int32(causal), *drop)
    return kind.give_back(o.reshape(B, H, n_q, d)), kind.give_back(lse.reshape(B, H, n_q))


def dropout_attention_backward(q, k, v, o, lse, do, *, p, seed, causal=False, scale=None, tiles=None):
    """(dq, dk, dv) of ``dropout_attention`` for an upstream gradient ``do``, Z regenerated
    from (``p``, ``seed``): they must be the forward's. o and lse are the forward's outputs
    (float32), do float32 like o; ``tiles`` (Br, Bc) as for chapter 5's
    ``shared_tile_backward``."""
    B, H, nq, nk, d = check_backward_args(q, k, v, o, lse, do, "separate")
    causal, scale = check_flag(causal, "causal"), check_scale(scale, d)
    drop = _dropout_args(p, seed)
    D = padded_head_dim(d)
    Br, Bc = check_shared_tiles(tiles, D)
    kind, BH = ArrayKind(q), B * H
    qv, kv, vv, ov, lv, dov = device_views(q, k, v, o, lse, do)
    dq, dk, dv = device_empty((BH, nq, d)), device_empty((BH, nk, d)), device_empty((BH, nk, d))
    delta = device_empty((BH, nq))
    sc, ca = np.float32(scale), np.int32(causal)
    if BH and nq:
        threads = 32 if on_simulator() else 128
        row_delta[(cdiv(nq, threads), BH), threads](ov, dov, delta)      # D = rowsum(dO o O)
        make_dropout_dq(Br, Bc, D)[(cdiv(nq, Br), BH), Br](qv, kv, vv, dov, lv, delta, dq, sc, ca, *drop)
    if BH and nk:
        make_dropout_dkdv(Br, Bc, D)[(cdiv(nk, Bc), BH), Bc](qv, kv, vv, dov, lv, delta, dk, dv, sc, ca, *drop)
    return tuple(kind.give_back(g.reshape(B, H, g.shape[1], d)) for g in (dq, dk, dv))


# --------------------------------------------------------------------------- the oracle (float64 NumPy)
# The float64 oracle of dropout attention: kernels.reference's mask, softmax and logsumexp,
# the same Z (``keep_mask``, the NumPy twin of the kernels' generator). ``dtype=np.float32``
# computes the same plainly in float32: the tolerance rule's yardstick.

def _scores(q, k, scale, causal, dtype):
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = (1.0 / np.sqrt(d) if d > 0 else 1.0) if scale is None else scale
    s = np.asarray(scale, dtype) * (q @ np.swapaxes(k, -1, -2))
    mask = ref.attention_mask(nq, nk, causal=causal)
    return (s if mask is None else np.where(mask, s, -np.inf)), scale, mask


def dropout_attention_oracle(q, k, v, *, p, seed, causal=False, scale=None, dtype=np.float64):
    """(O, L): O = (softmax(S) o Z / (1 - p)) V, L = logsumexp(S), in ``dtype``."""
    q, k, v = (np.asarray(x, dtype) for x in (q, k, v))
    B, H, nq, _ = q.shape
    nk = k.shape[-2]
    s, _, _ = _scores(q, k, scale, causal, dtype)
    z = keep_mask(B, H, nq, nk, p=p, seed=seed)
    P = ref.softmax(s, dtype=dtype)
    w = np.where(z, P * np.asarray(1.0 / (1.0 - p), dtype), 0)
    return w @ v, ref.logsumexp(s, dtype=dtype)


def dropout_attention_backward_oracle(q, k, v, o, lse, do, *, p, seed, causal=False, scale=None, dtype=np.float64):
    """(dQ, dK, dV) in closed form, P rebuilt from L as ``ref.attention_backward`` does:
    dV = (P o Z/(1-p))^T dO, dP = (dO V^T) o Z/(1-p), D = rowsum(dO o O), dS = P o (dP - D),
    dQ = scale dS K, dK = scale dS^T Q."""
    q, k, v, o, lse, do = (np.asarray(x, dtype) for x in (q, k, v, o, lse, do))
    B, H, nq, _ = q.shape
    nk = k.shape[-2]
    s, scale, mask = _scores(q, k, scale, causal, dtype)
    visible = np.ones(s.shape, bool) if mask is None else np.broadcast_to(mask, s.shape)
    live = visible & (lse != -np.inf)[..., None]
    with np.errstate(invalid="ignore", over="ignore"):
        P = np.where(live, np.exp(np.where(live, s - lse[..., None], 0)), 0)
    zs = np.where(keep_mask(B, H, nq, nk, p=p, seed=seed), np.asarray(1.0 / (1.0 - p), dtype), 0).astype(dtype)
    dv = np.swapaxes(P * zs, -1, -2) @ do
    dp = (do @ np.swapaxes(v, -1, -2)) * zs
    Dr = np.sum(do * o, axis=-1, keepdims=True)
    ds = P * (dp - Dr)
    sc = np.asarray(scale, dtype)
    return sc * (ds @ k), sc * (np.swapaxes(ds, -1, -2) @ q), dv


# --------------------------------------------------------------------------- PTX targets

_A3, _A2 = "float32[:, :, ::1]", "float32[:, ::1]"
_DROP = "uint32, uint32, uint32, float32"


def ptx_targets(every_shape: bool = False):
    """The forward and the two backward kernels at d = 64 (and 128), with their GPU tiles."""
    targets = []
    for D in (64, 128) if every_shape else (64,):
        Br, Bc = 64, 32                              # chapter 4's rung 2 on a GPU
        bBr = bBc = min(64, 4096 // D)               # chapter 5's rung 2 on a GPU
        targets.append((f"dropout fwd fp32 ({Br}, {Bc}) D={D}", make_dropout_forward(Br, Bc, D),
                        f"void({_A3}, {_A3}, {_A3}, {_A3}, {_A2}, float32, int32, {_DROP})"))
        targets.append((f"dropout dkdv fp32 ({bBr}, {bBc}) D={D}", make_dropout_dkdv(bBr, bBc, D),
                        f"void({_A3}, {_A3}, {_A3}, {_A3}, {_A2}, {_A2}, {_A3}, {_A3}, float32, int32, {_DROP})"))
        targets.append((f"dropout dq fp32 ({bBr}, {bBc}) D={D}", make_dropout_dq(bBr, bBc, D),
                        f"void({_A3}, {_A3}, {_A3}, {_A3}, {_A2}, {_A2}, {_A3}, float32, int32, {_DROP})"))
    return targets
