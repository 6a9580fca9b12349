"""A learner's answer to chapter 7's first split-K partial with a mistake: the key range is
cut from the cache's rows (Nmax) instead of the sequence's length, so a shorter sequence
attends to the rows past its end (garbage; NaN in the tests)."""
CHAPTER = "decode"

import math  # noqa: E402

from numba import cuda, float32  # noqa: E402


def make_first_partial():
    @cuda.jit
    def first_partial(q, k, v, lengths, o_part, l_part, scale, causal):
        row = cuda.blockIdx.x
        s = cuda.blockIdx.y
        c = cuda.threadIdx.x
        hq, nq, d = q.shape[1], q.shape[2], q.shape[3]
        b = row // (hq * nq)
        h = (row // nq) % hq
        i = row % nq
        kv = h // (hq // k.shape[1])
        n = k.shape[2]
        chunk = (n + cuda.gridDim.y - 1) // cuda.gridDim.y
        start = min(s * chunk, n)
        end = min(start + chunk, n)
        m = float32(-math.inf)
        l = float32(0.0)
        acc = float32(0.0)
        for j in range(start, end):
            if causal and j > i + n - nq:
                break
            x = float32(0.0)
            for t in range(d):
                x += float32(q[b, h, i, t]) * float32(k[b, kv, j, t])
            x *= scale
            m_new = max(m, x)
            alpha = math.exp(m - m_new) if m > -math.inf else float32(0.0)
            p = math.exp(x - m_new)
            l = l * alpha + p
            acc = acc * alpha + p * float32(v[b, kv, j, c])
            m = m_new
        if l == 0.0:
            o_part[row, s, c] = 0.0
            if c == 0:
                l_part[row, s] = -math.inf
        else:
            o_part[row, s, c] = acc / l
            if c == 0:
                l_part[row, s] = m + math.log(l)
    return first_partial
