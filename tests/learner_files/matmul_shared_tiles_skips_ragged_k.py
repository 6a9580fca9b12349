"""A learner's answer to chapter 2's shared-tile kernel with a mistake: the loop over the
k-tiles runs K // T times, so the last, partial k-tile (K not a multiple of T) is never
loaded and its products are missing from C."""
CHAPTER = "tiled_matmul"

import functools  # noqa: E402

from numba import cuda, float32  # noqa: E402


@functools.lru_cache(maxsize=None)
def make_shared_tiles(T=16):
    @cuda.jit
    def shared_kernel(a, b, c):
        As = cuda.shared.array((T, T), float32)
        Bs = cuda.shared.array((T, T), float32)
        M, N, K = c.shape[0], c.shape[1], a.shape[1]
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        col, row = cuda.grid(2)
        acc = float32(0.0)
        for t in range(K // T):
            k0 = t * T
            As[ty, tx] = a[row, k0 + tx] if row < M else float32(0.0)
            Bs[ty, tx] = b[k0 + ty, col] if col < N else float32(0.0)
            cuda.syncthreads()
            for kk in range(T):
                acc += As[ty, kk] * Bs[kk, tx]
            cuda.syncthreads()
        if row < M and col < N:
            c[row, col] = acc
    return shared_kernel
