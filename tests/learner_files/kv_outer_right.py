"""A learner's answer to chapter 10's exercise: FlashAttention's Algorithm 1, right."""
CHAPTER = "kv_outer_forward"

import math  # noqa: E402

from numba import cuda, float32  # noqa: E402

from kernels.base.fused import MINUS_INF, nan_max  # noqa: E402


def make_kv_outer_forward(Br: int, Bc: int, D: int):
    """Kernel (q, k, v, o, l, m, lse, scale, causal) on (B*H, N, d) views, d <= D: grid
    (B*H,), Br threads. o (B*H, Nq, d), l and m (B*H, Nq) float32 are the state in HBM,
    initialised by the kernel (O = 0, l = 0, m = -inf) and left as Algorithm 1 leaves them:
    O normalised, l the row sums, m the row maxima (scores times scale); lse (B*H, Nq)
    gets L = m + log l (-inf where l = 0)."""

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
            for e in range(t, Bc * D, Br):
                r, c = e // D, e % D
                inside = k0 + r < n_k and c < d
                K_j[r, c] = k[bh, k0 + r, c] if inside else float32(0.0)
                V_j[r, c] = v[bh, k0 + r, c] if inside else float32(0.0)
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
