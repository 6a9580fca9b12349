"""FlashAttention-1's loop order: K/V tiles outer, query tiles inner, the state in HBM.

FlashAttention [1] Algorithm 1 walks the K/V tiles in the OUTER loop and the query tiles
in the inner one. A query tile meets every K/V tile at a different time, so its running
state cannot stay on chip: after each (K/V tile, query tile) step it goes back to HBM.

    initialise in HBM: O = 0 (N x d), l = 0 (N), m = -inf (N)
    for j = 1 .. Tc:                         load K_j, V_j (Bc x d) into shared memory
        for i = 1 .. Tr:
            load Q_i, O_i, l_i, m_i from HBM (Br rows)
            S_ij = Q_i K_j^T;  m~ = rowmax(S_ij);  P~ = exp(S_ij - m~);  l~ = rowsum(P~)
            m_new = max(m_i, m~);  l_new = e^(m_i - m_new) l_i + e^(m~ - m_new) l~
            O_i = diag(l_new)^-1 (diag(l_i) e^(m_i - m_new) O_i + e^(m~ - m_new) P~ V_j)
            write O_i, l_i = l_new, m_i = m_new back to HBM

Chapter 4's kernel (FlashAttention-2's order [4], Algorithm 1 there) swaps the loops: a
block keeps its query tile, and its O, l and m, on chip over every K/V tile, and writes O
once. The HBM traffic of the two, in elements (Tc = ceil(Nk / Bc), Tr = ceil(Nq / Br)):

    Algorithm 1 (this kernel)   reads  2 Nk d (K, V once) + Tc (2 Nq d + 2 Nq) (Q, O, l, m)
                                writes Nq d + 2 Nq (initialise) + Tc (Nq d + 2 Nq)
                                (and L = m + log l at the end: 2 Nq reads, Nq writes)
    FlashAttention-2 order      reads  Nq d + Tr 2 Nk d (Q once, K and V once a query tile)
                                writes Nq d + Nq (O and L once)

so Algorithm 1 moves Q, O, l and m through HBM Tc times: with M the on-chip memory and
Bc ~ M / 4d, that is the N^2 d^2 / M of Theorem 2 [1], where FlashAttention-2's order pays
it on K and V instead (Tr passes over them). ``hbm_elements`` gives both counts; the tests
count every element this kernel reads and writes in the simulator
(``kernels.base.trace``) and find exactly these numbers.

A teaching kernel, not a fast one: one block a (batch, head), Br threads, thread t owns
query row t of the current tile (a row's S, P and O in registers, as chapter 4's ladder
rung 2), so B*H blocks is all the parallelism. Causal masking (bottom-right, as the
course) and ragged N as everywhere in the course; a row that sees no key: O = 0, L = -inf.
After the last K/V tile each thread writes L = m + log l of its rows into ``lse``.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from kernels.base.fused import MAX_GRID_Y, MINUS_INF, make_kv_tile_copy, nan_max
from kernels.base.runtime import ArrayKind, cdiv, check_flag, check_qkv, check_scale, device_empty, on_simulator, \
    to_device

__all__ = ["kv_outer_attention", "make_kv_outer_forward", "hbm_elements", "TILES_GPU", "TILES_SIM", "ptx_targets",
           "EXERCISES"]

# The chapter's kernel exercise (``kernels.base.learner``): write Algorithm 1 yourself; the
# launcher looks the factory up at every call, and these tests grade it: the answer against
# the oracle, and its HBM traffic against the closed form (Algorithm 1 as written: the state
# goes back to HBM after every step).
EXERCISES = {"make_kv_outer_forward": "test_matches_oracle or test_hbm_traffic_is_the_closed_form"}

TILES_GPU = (64, 64)          # (Br, Bc): a block's query rows (its threads) and a K/V tile's keys
TILES_SIM = (8, 8)            # the simulator: every GPU thread is a Python thread


def hbm_elements(n_q: int, n_k: int, d: int, Br: int, Bc: int, order: str = "kv-outer") -> dict:
    """Elements read from and written to HBM by one (batch, head) of attention without a
    mask: ``order`` "kv-outer" (FlashAttention's Algorithm 1, this module's kernel) or
    "q-outer" (FlashAttention-2's order, chapter 4). Returns {"read": .., "written": ..}."""
    Tc, Tr = cdiv(n_k, Bc), cdiv(n_q, Br)
    if order == "kv-outer":
        return {"read": 2 * n_k * d + Tc * (2 * n_q * d + 2 * n_q) + 2 * n_q,
                "written": n_q * d + 2 * n_q + Tc * (n_q * d + 2 * n_q) + n_q}
    if order == "q-outer":
        return {"read": n_q * d + Tr * 2 * n_k * d, "written": n_q * d + n_q}
    raise ValueError(f"order: expected 'kv-outer' or 'q-outer', got {order!r}")


@functools.lru_cache(maxsize=None)
def make_kv_outer_forward(Br: int, Bc: int, D: int):
    """Kernel (q, k, v, o, l, m, lse, scale, causal) on (B*H, N, d) views, d <= D: grid
    (B*H,), Br threads. o (B*H, Nq, d), l and m (B*H, Nq) float32 are the state in HBM,
    initialised by the kernel (O = 0, l = 0, m = -inf) and left as Algorithm 1 leaves them:
    O normalised, l the row sums, m the row maxima (scores times scale); lse (B*H, Nq)
    gets L = m + log l (-inf where l = 0)."""
    copy_kv_tile = make_kv_tile_copy(Bc, D, Br)

    @cuda.jit
    def kv_outer_forward(q, k, v, o, l, m, lse, scale, causal):
        K_j = cuda.shared.array((Bc, D), float32)
        V_j = cuda.shared.array((Bc, D), float32)
        bh = cuda.blockIdx.x
        t = cuda.threadIdx.x
        n_q, n_k, d = q.shape[1], k.shape[1], q.shape[2]
        q_i = cuda.local.array(D, float32)
        o_i = cuda.local.array(D, float32)
        # ---- initialise the state in HBM: O = 0, l = 0, m = -inf
        for i in range(t, n_q, Br):
            for c in range(d):
                o[bh, i, c] = float32(0.0)
            l[bh, i] = float32(0.0)
            m[bh, i] = MINUS_INF
        for k0 in range(0, n_k, Bc):                  # ---- j: the K/V tiles, outer
            cuda.syncthreads()                        # the last tile is read (and the state written)
            copy_kv_tile(k, v, K_j, V_j, bh, k0, n_k, d, t)
            cuda.syncthreads()
            for q0 in range(0, n_q, Br):              # ---- i: the query tiles, inner
                i = q0 + t
                if i < n_q:
                    kv_end = min(n_k, k0 + Bc)        # the keys of this tile this row sees
                    if causal:
                        kv_end = min(kv_end, i + 1 + n_k - n_q)
                    # load Q_i, O_i, l_i, m_i from HBM
                    for c in range(D):
                        q_i[c] = float32(scale) * q[bh, i, c] if c < d else float32(0.0)
                        o_i[c] = o[bh, i, c] if c < d else float32(0.0)
                    l_i = l[bh, i]
                    m_i = m[bh, i]
                    # m~ = rowmax(S_ij)
                    m_t = MINUS_INF
                    for r in range(max(kv_end - k0, 0)):
                        s = float32(0.0)
                        for c in range(D):
                            s += q_i[c] * K_j[r, c]
                        m_t = nan_max(m_t, s)
                    m_new = nan_max(m_i, m_t)
                    if m_new != MINUS_INF:           # (a row that has seen no key keeps its state)
                        a_old = math.exp(m_i - m_new) if m_i != MINUS_INF else float32(0.0)
                        a_new = math.exp(m_t - m_new) if m_t != MINUS_INF else float32(0.0)
                        # O_i = diag(l_new)^-1 (diag(l_i) e^(m_i - m_new) O_i + e^(m~ - m_new) P~ V_j),
                        # P~ = exp(S_ij - m~) and l~ = rowsum(P~) on the way
                        for c in range(D):
                            o_i[c] *= l_i * a_old
                        l_t = float32(0.0)
                        for r in range(max(kv_end - k0, 0)):
                            s = float32(0.0)
                            for c in range(D):
                                s += q_i[c] * K_j[r, c]
                            p = math.exp(s - m_t)
                            l_t += p
                            for c in range(D):
                                o_i[c] += a_new * p * V_j[r, c]
                        l_new = a_old * l_i + a_new * l_t
                        for c in range(D):
                            if c < d:
                                o[bh, i, c] = o_i[c] / l_new
                        l[bh, i] = l_new
                        m[bh, i] = m_new
        cuda.syncthreads()                            # ---- L = m + log l, once
        for i in range(t, n_q, Br):
            l_i = l[bh, i]
            m_i = m[bh, i]
            lse[bh, i] = m_i + math.log(l_i) if l_i > float32(0.0) or l_i != l_i else MINUS_INF

    return kv_outer_forward


def kv_outer_attention(q, k, v, *, causal=False, scale=None, tiles=None):
    """Attention forward in FlashAttention-1's loop order (Algorithm 1). q (B, H, Nq, d), k
    and v (B, H, Nk, d) float32, d <= 128. Returns (o, lse) like chapter 4's
    ``flash_attention``: o (B, H, Nq, d), lse (B, H, Nq) float32 (natural log; a row that
    sees no key: O = 0, L = -inf). ``tiles`` = (Br, Bc). NumPy in, NumPy out; device arrays
    in, device arrays out."""
    B, H, n_q, n_k, d, _ = check_qkv(q, k, v, dtypes=(np.float32,), max_head_dim=128)
    causal = check_flag(causal, "causal")
    scale = check_scale(scale, d)
    Br, Bc = (TILES_SIM if on_simulator() else TILES_GPU) if tiles is None else tiles
    if not (isinstance(Br, int) and isinstance(Bc, int) and 1 <= Br <= 1024 and 1 <= Bc):
        raise ValueError(f"tiles: expected (Br, Bc) with 1 <= Br <= 1024 and Bc >= 1, got {tiles!r}")
    BH = B * H
    if BH > MAX_GRID_Y:
        raise ValueError(f"q: expected B*H <= {MAX_GRID_Y}, got B={B}, H={H}")
    kind = ArrayKind(q)
    o = device_empty((BH, n_q, d))
    lse = device_empty((BH, n_q))
    if BH and n_q:
        D = 16 * cdiv(d, 16)
        views = [to_device(x, name).reshape(BH, x.shape[2], d) for x, name in ((q, "q"), (k, "k"), (v, "v"))]
        state = device_empty((2, BH, n_q))              # l and m: Algorithm 1's state in HBM
        kernel = make_kv_outer_forward(Br, Bc, D)
        kernel[BH, Br](*views, o, state[0], state[1], lse, np.float32(scale), np.int32(causal))
    return kind.give_back(o.reshape(B, H, n_q, d)), kind.give_back(lse.reshape(B, H, n_q))


def ptx_targets(every_shape: bool = False):
    """The kernel at d = 64 (at d = 128 a thread's two rows of 128 floats exceed what the
    compiler keeps in registers: local memory, as the teaching kernel may)."""
    sig = ("void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, ::1], "
           "float32[:, ::1], float32[:, ::1], float32, int32)")
    return [(f"kv-outer forward (FlashAttention-1 order) Br={TILES_GPU[0]} Bc={TILES_GPU[1]} D={D}",
             make_kv_outer_forward(*TILES_GPU, D), sig) for D in (64,)]
