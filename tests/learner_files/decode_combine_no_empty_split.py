"""A learner's answer to chapter 7's combine with a mistake: the weights exp(L_s - m) are
taken against the max m of the row's L_s without a case for a row whose every piece is
empty (m = -inf, an empty cache), so exp(-inf - (-inf)) = NaN reaches O and L."""
CHAPTER = "decode"

import math  # noqa: E402

from numba import cuda, float32  # noqa: E402


def make_combine(D, RT, THREADS):
    @cuda.jit
    def combine(o_part, l_part, o, lse, splits, d):
        tile = cuda.blockIdx.x
        h = cuda.blockIdx.y
        first = (h * cuda.gridDim.x + tile) * splits
        for e in range(cuda.threadIdx.x, RT * D, THREADS):
            r = e // D
            c = e % D
            row = tile * RT + r
            if row < o.shape[1] and c < d:
                m = float32(-math.inf)
                for s in range(splits):
                    m = max(m, l_part[first + s, r])
                total = float32(0.0)
                acc = float32(0.0)
                for s in range(splits):
                    w = math.exp(l_part[first + s, r] - m)
                    total += w
                    acc += w * o_part[first + s, r, c]
                o[h, row, c] = acc / total
                if c == 0:
                    lse[h, row] = m + math.log(total)
    return combine
