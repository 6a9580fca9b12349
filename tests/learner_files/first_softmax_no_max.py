"""A learner's answer to chapter 1's first row softmax with a mistake: the max is not
subtracted, so exp overflows for large logits (and L with it)."""
CHAPTER = "naive_attention"

import math  # noqa: E402

from numba import cuda, float32  # noqa: E402


def make_first_row_softmax():
    @cuda.jit
    def first_row_softmax_kernel(s, p, lse):
        r = cuda.grid(1)
        nq, nk = s.shape[1], s.shape[2]
        if r >= s.shape[0] * nq:
            return
        z, i = r // nq, r % nq
        total = float32(0.0)
        for j in range(nk):
            total += math.exp(s[z, i, j])
        for j in range(nk):
            p[z, i, j] = math.exp(s[z, i, j]) / total if total > 0 else float32(0.0)
        lse[z, i] = math.log(total) if total > 0 else -math.inf
    return first_row_softmax_kernel
