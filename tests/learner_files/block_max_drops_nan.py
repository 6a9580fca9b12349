"""A learner's answer to chapter 0's block-max exercise with a mistake: ``max(a, b)``, which
on the GPU is fmaxf and returns the number when the other is NaN, so a NaN is lost."""
CHAPTER = "gpu_basics"

import math  # noqa: E402

from numba import cuda, float32, int32  # noqa: E402


def make_block_max(threads):
    THREADS = threads

    @cuda.jit
    def block_max_kernel(x, maxes):
        buf = cuda.shared.array(THREADS, float32)
        t = cuda.threadIdx.x
        i = cuda.blockIdx.x * THREADS + t
        buf[t] = x[i] if i < x.shape[0] else float32(-math.inf)
        cuda.syncthreads()
        half = int32(THREADS // 2)
        while half > 0:
            if t < half:
                a, b = buf[t], buf[t + half]
                buf[t] = a if a > b else b      # (a NaN on either side: the comparison is False)
            cuda.syncthreads()
            half //= int32(2)
        if t == 0:
            maxes[cuda.blockIdx.x] = buf[0]
    return block_max_kernel
