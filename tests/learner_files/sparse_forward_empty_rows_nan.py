"""A learner's answer to chapter 6's first block-sparse forward with a mistake: a row whose
every key block is dropped still divides by l = 0, so its O is 0 / 0 = NaN (L = m + log 0
happens to come out -inf)."""
CHAPTER = "block_sparse"

import math  # noqa: E402

from numba import cuda, float32  # noqa: E402

from kernels.base.fused import nan_max  # noqa: E402


def make_first_block_sparse_forward():
    @cuda.jit
    def first_block_sparse_forward_kernel(q, k, v, o, lse, flags, block_q, block_k, scale, causal):
        t = cuda.grid(1)
        bh, nq, d = q.shape
        nk = k.shape[1]
        if t >= bh * nq:
            return
        z, i = t // nq, t % nq
        g = z % flags.shape[0]
        for c in range(d):
            o[z, i, c] = float32(0.0)
        m = float32(-math.inf)
        l = float32(0.0)
        for j in range(nk):
            if not flags[g, i // block_q, j // block_k]:
                continue
            if causal and j > i + nk - nq:
                break
            s = float32(0.0)
            for c in range(d):
                s += q[z, i, c] * k[z, j, c]
            s *= scale
            m_new = nan_max(m, s)
            alpha = math.exp(m - m_new)
            p = math.exp(s - m_new)
            l = l * alpha + p
            for c in range(d):
                o[z, i, c] = o[z, i, c] * alpha + p * v[z, j, c]
            m = m_new
        for c in range(d):
            o[z, i, c] = o[z, i, c] / l          # l = 0 on a row that kept nothing: 0 / 0
        lse[z, i] = m + math.log(l) if l > 0 else m
    return first_block_sparse_forward_kernel
