"""A learner's answer to chapter 0's copy exercise with a mistake: the loop stops one
element short of the end."""
CHAPTER = "gpu_basics"

from numba import cuda  # noqa: E402


def make_copy(items=1):
    @cuda.jit
    def copy_kernel(src, dst):
        i = cuda.grid(1)
        while i < src.shape[0] - 1:
            dst[i] = src[i]
            i += cuda.gridsize(1)
    return copy_kernel
