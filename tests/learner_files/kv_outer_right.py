"""A learner's answer to chapter 10's exercise, right, and written differently from the
course's: P~ V_j summed in its own accumulator, O_i taken back at the end of the step, the
tile copied with one element a thread per loop step."""
CHAPTER = "kv_outer_forward"

import math  # noqa: E402

from numba import cuda, float32  # noqa: E402

NEG_INF = -math.inf


def make_kv_outer_forward(Br, Bc, D):
    @cuda.jit
    def kv_outer_forward(q, k, v, o, l, m, lse, scale, causal):
        K_j = cuda.shared.array((Bc, D), float32)
        V_j = cuda.shared.array((Bc, D), float32)
        bh = cuda.blockIdx.x
        t = cuda.threadIdx.x
        n_q, n_k, d = q.shape[1], k.shape[1], q.shape[2]
        acc = cuda.local.array(D, float32)
        q_i = cuda.local.array(D, float32)
        for i in range(t, n_q, Br):                      # O = 0, l = 0, m = -inf in HBM
            for c in range(d):
                o[bh, i, c] = float32(0.0)
            l[bh, i] = float32(0.0)
            m[bh, i] = NEG_INF
        for k0 in range(0, n_k, Bc):
            cuda.syncthreads()
            for r in range(Bc):                          # each thread copies whole columns of the tile
                for c in range(t, D, Br):
                    keep = k0 + r < n_k and c < d
                    K_j[r, c] = k[bh, k0 + r, c] if keep else float32(0.0)
                    V_j[r, c] = v[bh, k0 + r, c] if keep else float32(0.0)
            cuda.syncthreads()
            for i in range(t, n_q, Br):                  # query tile i // Br, this thread's row
                last = min(n_k, k0 + Bc)
                if causal:
                    last = min(last, i + 1 + n_k - n_q)
                for c in range(d):                       # Q_i read once a step, as Algorithm 1 loads it
                    q_i[c] = q[bh, i, c]
                l_i = l[bh, i]
                m_i = m[bh, i]
                m_t = NEG_INF
                for r in range(max(last - k0, 0)):
                    s = float32(0.0)
                    for c in range(d):
                        s += q_i[c] * K_j[r, c]
                    s *= scale
                    if s > m_t or s != s:
                        m_t = s
                m_new = m_t if (m_t > m_i or m_t != m_t) else m_i
                if m_new == NEG_INF:
                    continue
                for c in range(D):
                    acc[c] = float32(0.0)
                l_t = float32(0.0)
                for r in range(max(last - k0, 0)):
                    s = float32(0.0)
                    for c in range(d):
                        s += q_i[c] * K_j[r, c]
                    p = math.exp(s * scale - m_t)
                    l_t += p
                    for c in range(d):
                        acc[c] += p * V_j[r, c]
                w_old = math.exp(m_i - m_new) if m_i != NEG_INF else float32(0.0)
                w_new = math.exp(m_t - m_new) if m_t != NEG_INF else float32(0.0)
                l_new = w_old * l_i + w_new * l_t
                for c in range(d):
                    o[bh, i, c] = (l_i * w_old * o[bh, i, c] + w_new * acc[c]) / l_new
                l[bh, i] = l_new
                m[bh, i] = m_new
        cuda.syncthreads()
        for i in range(t, n_q, Br):
            li = l[bh, i]
            lse[bh, i] = m[bh, i] + math.log(li) if li > float32(0.0) or li != li else NEG_INF

    return kv_outer_forward
