"""A learner's answer to chapter 0's scaled-sum exercise: one thread an element, striding
by the whole grid."""
CHAPTER = "gpu_basics"

from numba import cuda  # noqa: E402


def make_scale_add(threads):
    @cuda.jit
    def scale_add_kernel(a, x, y, out):
        start = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        for i in range(start, x.shape[0], cuda.gridDim.x * cuda.blockDim.x):
            out[i] = a * x[i] + y[i]
    return scale_add_kernel
