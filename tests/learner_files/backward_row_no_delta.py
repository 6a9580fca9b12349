"""A learner's answer to chapter 5's first rung (the dQ kernel) with a mistake: dS = P dP,
the softmax Jacobian's diagonal term D_i forgotten (dS = P (dP - D_i))."""
CHAPTER = "flash_backward"

import math  # noqa: E402

from numba import cuda, float32  # noqa: E402


def make_row_per_thread_dq(D):
    @cuda.jit
    def row_per_thread_dq(q, k, v, do, lse, delta, dq, scale, causal):
        bh = cuda.blockIdx.y
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        n_q, n_k, d = q.shape[1], k.shape[1], q.shape[2]
        if i >= n_q:
            return
        kv_end = min(n_k, i + 1 + n_k - n_q) if causal else n_k
        dq_i = cuda.local.array(D, float32)
        for c in range(d):
            dq_i[c] = float32(0.0)
        L = lse[bh, i]
        if L != -math.inf:
            for j in range(max(kv_end, 0)):
                s = float32(0.0)
                dp = float32(0.0)
                for c in range(d):
                    s += q[bh, i, c] * k[bh, j, c]
                    dp += do[bh, i, c] * v[bh, j, c]
                p = math.exp(scale * s - L)
                ds = p * dp                                   # the mistake: - D_i missing
                for c in range(d):
                    dq_i[c] += scale * ds * k[bh, j, c]
        for c in range(d):
            dq[bh, i, c] = dq_i[c]
    return row_per_thread_dq
