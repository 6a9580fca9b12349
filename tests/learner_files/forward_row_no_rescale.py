"""A learner's answer to chapter 4's first rung with a mistake: when the running max grows,
l is rescaled but the output row O_i is not, so keys seen before the new max keep too
much weight."""
CHAPTER = "flash_forward"

import math  # noqa: E402

from numba import cuda, float32  # noqa: E402


def make_row_per_thread_forward(D):
    @cuda.jit
    def row_per_thread_forward(q, k, v, o, lse, scale, causal):
        bh = cuda.blockIdx.y
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        n_q, n_k, d = q.shape[1], k.shape[1], q.shape[2]
        if i >= n_q:
            return
        kv_end = min(n_k, i + 1 + n_k - n_q) if causal else n_k
        o_i = cuda.local.array(D, float32)
        for c in range(d):
            o_i[c] = float32(0.0)
        m = -math.inf
        l = float32(0.0)
        for j in range(max(kv_end, 0)):
            s = float32(0.0)
            for c in range(d):
                s += float32(q[bh, i, c]) * float32(k[bh, j, c])
            s *= scale
            m_new = max(m, s)
            alpha = math.exp(m - m_new)
            p = math.exp(s - m_new)
            l = l * alpha + p
            for c in range(d):
                o_i[c] = o_i[c] + p * float32(v[bh, j, c])      # the mistake: O_i not multiplied by alpha
            m = m_new
        for c in range(d):
            o[bh, i, c] = o_i[c] / l if l > 0 else float32(0.0)
        lse[bh, i] = m + math.log(l) if l > 0 else -math.inf
    return row_per_thread_forward
