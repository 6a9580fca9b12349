"""A learner's answer to chapter 5's second rung (the dK/dV kernel) with a mistake: every
query row of every tile is summed into dK_j and dV_j, also the rows that, causally, do not
see key j (their P_ij is not zero when recomputed as exp(S_ij - L_i))."""
CHAPTER = "flash_backward"

import math  # noqa: E402

from numba import cuda, float32  # noqa: E402


def make_shared_tile_dkdv(Br, Bc, D):
    @cuda.jit
    def shared_tile_dkdv(q, k, v, do, lse, delta, dk, dv, scale, causal):
        Q_i = cuda.shared.array((Br, D), float32)
        dO_i = cuda.shared.array((Br, D), float32)
        bh, t = cuda.blockIdx.y, cuda.threadIdx.x
        j = cuda.blockIdx.x * Bc + t
        n_q, n_k, d = q.shape[1], k.shape[1], q.shape[2]
        dk_j = cuda.local.array(D, float32)
        dv_j = cuda.local.array(D, float32)
        for c in range(d):
            dk_j[c] = float32(0.0)
            dv_j[c] = float32(0.0)
        for q0 in range(0, n_q, Br):
            for e in range(t, Br * D, Bc):
                r, c = e // D, e % D
                inside = q0 + r < n_q and c < d
                Q_i[r, c] = q[bh, q0 + r, c] if inside else float32(0.0)
                dO_i[r, c] = do[bh, q0 + r, c] if inside else float32(0.0)
            cuda.syncthreads()
            if j < n_k:
                for r in range(min(Br, n_q - q0)):            # the mistake: causal ignored
                    L = lse[bh, q0 + r]
                    if L == -math.inf:
                        continue
                    s = float32(0.0)
                    dp = float32(0.0)
                    for c in range(d):
                        s += Q_i[r, c] * k[bh, j, c]
                        dp += dO_i[r, c] * v[bh, j, c]
                    p = math.exp(scale * s - L)
                    ds = p * (dp - delta[bh, q0 + r])
                    for c in range(d):
                        dv_j[c] += p * dO_i[r, c]
                        dk_j[c] += scale * ds * Q_i[r, c]
            cuda.syncthreads()
        if j < n_k:
            for c in range(d):
                dk[bh, j, c] = dk_j[c]
                dv[bh, j, c] = dv_j[c]
    return shared_tile_dkdv
