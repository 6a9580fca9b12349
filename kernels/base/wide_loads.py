"""Wide loads: one instruction reads 16 bytes of a row (4 float32 or 8 float16).

A load of one float32 moves 4 bytes, of one float16 2 bytes. A kernel that streams a
KV cache at the HBM limit (chapter 7) needs about 1.5 T float16 elements a second on
an H100; one load instruction an element, plus its address arithmetic and its bounds
check, and the kernel is bound by instruction issue before it is bound by memory. A
16-byte load (PTX ``ld.global.v4.b32``) moves 8 float16 or 4 float32 in one instruction, with
one address and one bounds check for all of them.

``make_load(n)(a, row, col)``: a[row, col], a[row, col + 1], ... a[row, col + n - 1] as a
tuple of n float32 values (a float16 row widens to float32 on the way), for a 2-D
C-contiguous float32 or float16 array, in one load of n * itemsize bytes (4, 8 or 16).
The address of a[row, col] must be a multiple of that: the caller checks that the
array's base and its row length (d * itemsize) are multiples of 16 bytes, and takes col
a multiple of n. Numba has no vector loads, so on the GPU this is a small ``@intrinsic``
that emits LLVM IR: an aligned load of a vector of 32-bit words, bitcast to n elements
and widened. In the simulator it is the same n values read one at a time. n = 1 is a
plain load of one element.
"""

from __future__ import annotations

import functools

from numba import cuda, float32

from kernels.base.inlined import inlined
from kernels.base.runtime import on_simulator

__all__ = ["make_load", "WIDE_BYTES", "is_aligned"]

WIDE_BYTES = 16


def is_aligned(array, row_elements: int, itemsize: int) -> bool:
    """Whether every row of a device ``array`` with rows of ``row_elements`` elements starts
    on a 16-byte boundary (its base address and its row length both multiples of 16)."""
    if (row_elements * itemsize) % WIDE_BYTES:
        return False
    if on_simulator():
        return True
    return array.__cuda_array_interface__["data"][0] % WIDE_BYTES == 0


@inlined
def _load1(a, row, col):
    return (float32(a[row, col]),)


@functools.lru_cache(maxsize=None)
def make_load(n: int):
    """The device function that loads n consecutive elements of a row (see the module)."""
    if on_simulator():
        # a plain Python function: the simulator runs kernels as Python, and a call of a
        # simulated device function costs far more than the few loads it does
        def load_n(a, row, col):
            return tuple(float32(a[row, col + e]) for e in range(n))
        return load_n
    if n == 1:
        return _load1
    return _wide_intrinsic(n)


def _wide_intrinsic(n: int):
    from llvmlite import ir
    from numba.core import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    @intrinsic
    def load_n(typingctx, array, row, col):
        if not (isinstance(array, types.Array) and array.ndim == 2 and array.dtype in (types.float32, types.float16)):
            return None
        nbytes = n * (array.dtype.bitwidth // 8)
        if nbytes not in (4, 8, 16):
            return None
        result = types.UniTuple(types.float32, n)

        def codegen(context, builder, sig, args):
            aryty, rowty, colty = sig.args
            ary = context.make_array(aryty)(context, builder, value=args[0])
            inds = [context.cast(builder, args[1], rowty, types.intp),
                    context.cast(builder, args[2], colty, types.intp)]
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, inds)
            words = ir.VectorType(ir.IntType(32), nbytes // 4)
            loaded = builder.load(builder.bitcast(ptr, words.as_pointer()), align=nbytes)
            if aryty.dtype == types.float16:      # (Numba keeps a float16 as i16: widen each)
                vec = builder.bitcast(loaded, ir.VectorType(ir.IntType(16), n))
                vals = [builder.fpext(builder.bitcast(builder.extract_element(vec, ir.Constant(ir.IntType(32), e)),
                                                      ir.HalfType()), ir.FloatType()) for e in range(n)]
            else:
                vec = builder.bitcast(loaded, ir.VectorType(ir.FloatType(), n))
                vals = [builder.extract_element(vec, ir.Constant(ir.IntType(32), e)) for e in range(n)]
            return context.make_tuple(builder, result, vals)

        return result(array, row, col), codegen

    return load_n
