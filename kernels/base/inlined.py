"""``@inlined``: a building block the CUDA compiler copies into every kernel that calls it.

The kernels are written as small device functions (a tile load, a row reduction, a
tensor-core product) composed in a kernel's body, and each must end up inside the kernel:
only there do its per-thread arrays stay in registers. Numba offers two ways to get there:

    inline=True        Numba copies the function's IR into every call site and types each
                       copy again, so compile time grows with the number of calls;
    forceinline=True   Numba compiles the function once for its argument types and marks it
                       alwaysinline; LLVM then inlines it into each caller.

Both give the same PTX, instruction for instruction (the kernels of every chapter's
``ptx_targets()`` compared; where they differ, LLVM dropped a comparison it had already
made, or used fewer local-memory slots), and the second compiles the course's kernels in
about 35% less time (a chapter's first call on a GPU, and the PTX check in CI). A function
compiled on its own keeps its own fast-math flags, not the kernel's: the building blocks
take the kernels' ``FASTMATH``. The simulator runs device functions as Python and takes
neither option.
"""

from __future__ import annotations

from numba import cuda

from kernels.base.runtime import on_simulator

__all__ = ["inlined", "FASTMATH"]

# Fast math without the two flags that assume finite values: exp2 and log stay the fast
# hardware instructions (afn), products and sums may fuse and reorder (contract, reassoc),
# but the compiler may not assume that no input is NaN or Inf. With nnan/ninf it may drop
# a NaN from a max or a comparison, and a NaN query row would come out finite.
FASTMATH = frozenset({"nsz", "arcp", "contract", "afn", "reassoc"})


def inlined(fn=None, *, fastmath=FASTMATH):
    """``@inlined`` or ``@inlined(fastmath=...)`` over a device function: a building block
    LLVM inlines into each kernel (``forceinline``), compiled with ``fastmath``."""
    def wrap(f):
        if on_simulator():
            return cuda.jit(device=True)(f)
        return cuda.jit(device=True, forceinline=True, fastmath=fastmath)(f)

    return wrap if fn is None else wrap(fn)
