"""A learner's answer to chapter 4's second rung with a mistake: each thread sweeps all Bc
keys of every tile, so in the last, ragged tile the zero rows past Nk count as keys with
score 0 (and, with causal masking, keys past the diagonal count too)."""
CHAPTER = "flash_forward"

import math  # noqa: E402

from numba import cuda, float32  # noqa: E402


def make_query_tile_forward(Br, Bc, D):
    @cuda.jit
    def query_tile_forward(q, k, v, o, lse, scale, causal):
        K_j = cuda.shared.array((Bc, D), float32)
        V_j = cuda.shared.array((Bc, D), float32)
        bh, t = cuda.blockIdx.y, cuda.threadIdx.x
        i = cuda.blockIdx.x * Br + t
        n_q, n_k, d = q.shape[1], k.shape[1], q.shape[2]
        o_i = cuda.local.array(D, float32)
        for c in range(d):
            o_i[c] = float32(0.0)
        m = -math.inf
        l = float32(0.0)
        for k0 in range(0, n_k, Bc):
            for e in range(t, Bc * D, Br):
                r, c = e // D, e % D
                inside = k0 + r < n_k and c < d
                K_j[r, c] = k[bh, k0 + r, c] if inside else float32(0.0)
                V_j[r, c] = v[bh, k0 + r, c] if inside else float32(0.0)
            cuda.syncthreads()
            if i < n_q:
                for r in range(Bc):                              # the mistake: every row of the tile
                    s = float32(0.0)
                    for c in range(d):
                        s += float32(q[bh, i, c]) * K_j[r, c]
                    s *= scale
                    m_new = max(m, s)
                    alpha = math.exp(m - m_new)
                    p = math.exp(s - m_new)
                    l = l * alpha + p
                    for c in range(d):
                        o_i[c] = o_i[c] * alpha + p * V_j[r, c]
                    m = m_new
            cuda.syncthreads()
        if i < n_q:
            for c in range(d):
                o[bh, i, c] = o_i[c] / l if l > 0 else float32(0.0)
            lse[bh, i] = m + math.log(l) if l > 0 else -math.inf
    return query_tile_forward
