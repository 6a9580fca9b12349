"""More than 48 KB of shared memory for one block: dynamic shared memory, limit raised.

A kernel may declare at most 48 KB of *static* shared memory (``cuda.shared.array`` with a
constant shape). Larger tiles (up to 227 KB a block on an H100) need *dynamic* shared
memory: the kernel declares ``cuda.shared.array(0, float32)`` and the size in bytes is the
fourth launch argument, ``kernel[grid, block, stream, nbytes](...)``. Above 48 KB the
driver also wants the kernel's own limit raised first, or the launch fails with
CUDA_ERROR_INVALID_VALUE. numba-cuda has no public call for that (numba-cuda issue 94);
its driver layer does it:

    compiled = dispatcher.compile(argument types)          # the kernel for these arguments
    cufunc = compiled._codelibrary.get_cufunc()            # its CUDA function
    driver.cuKernelSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes, cufunc.handle, device)

This module wraps that private path in one function. In the simulator there is no limit
(and no driver), so the function does nothing there.
"""

from __future__ import annotations

from numba import cuda

from kernels.base.runtime import launch_stream, on_simulator

STATIC_LIMIT_BYTES = 48 * 1024

_raised: dict = {}   # (dispatcher id, argument types, device id) -> bytes already allowed


def max_dynamic_shared_bytes() -> int:
    """The most shared memory one block may opt in to on the current device (227 KB on an H100)."""
    if on_simulator():
        return 227 * 1024
    device = cuda.get_current_device()
    return int(device.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)


def allow_dynamic_shared_memory(dispatcher, args, nbytes: int) -> None:
    """Let ``dispatcher``, compiled for ``args``, launch with ``nbytes`` of dynamic shared memory.

    Call it before the launch with the very arguments of the launch (their types pick the
    compiled kernel). Does nothing at or below 48 KB and in the simulator. Raises
    ValueError if the device cannot give that much.
    """
    nbytes = int(nbytes)
    if nbytes <= STATIC_LIMIT_BYTES or on_simulator():
        return
    limit = max_dynamic_shared_bytes()
    if nbytes > limit:
        raise ValueError(f"shared memory: {nbytes} bytes a block asked, the device allows {limit}")
    argtypes = tuple(dispatcher.typeof_pyval(a) for a in args)
    device_id = cuda.get_current_device().id
    key = (id(dispatcher), argtypes, device_id)
    if _raised.get(key, 0) >= nbytes:
        return
    from numba.cuda.cudadrv.driver import binding, driver

    compiled = dispatcher.compile(argtypes)
    cufunc = compiled._codelibrary.get_cufunc()
    attribute = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attribute, nbytes, cufunc.handle, device_id)
    _raised[key] = nbytes


def launch_with_shared(make, nbytes, grid, threads, args):
    """``make(dynamic)``, launched with ``nbytes`` of shared memory: static up to 48 KB,
    dynamic (the kernel's limit raised) above."""
    dynamic = nbytes > STATIC_LIMIT_BYTES and not on_simulator()
    kernel = make(dynamic)
    allow_dynamic_shared_memory(kernel, args, nbytes)
    kernel[grid, threads, launch_stream(), nbytes if dynamic else 0](*args)


def _sim_shared_view(base, offset, shape):
    size = 1
    for s in shape:
        size *= int(s)
    return base[int(offset):int(offset) + size].reshape(tuple(int(s) for s in shape))


def _gpu_shared_view():
    from numba.core import cgutils, types
    from numba.cuda.extending import intrinsic
    from numba.np.arrayobj import make_array, populate_array

    @intrinsic
    def shared_view(typingctx, base, offset, shape):
        if not (isinstance(base, types.Array) and base.ndim == 1 and isinstance(offset, types.Integer)
                and isinstance(shape, types.BaseTuple) and all(isinstance(s, types.Integer) for s in shape)):
            raise TypeError(f"shared_view(base, offset, shape): expected a 1-D array, an int and a tuple of ints; "
                            f"got {base}, {offset}, {shape}")
        result = types.Array(base.dtype, len(shape), "C")

        def codegen(context, builder, sig, args):
            intp = context.get_value_type(types.intp)
            ary = make_array(sig.args[0])(context, builder, args[0])
            first = context.cast(builder, args[1], sig.args[1], types.intp)
            dims = [context.cast(builder, builder.extract_value(args[2], k), sig.args[2][k], types.intp)
                    for k in range(len(shape))]
            strides, step = [], ary.itemsize
            for d in reversed(dims):                      # C order: the last index is contiguous
                strides.insert(0, step)
                step = builder.mul(step, d)
            out = make_array(sig.return_type)(context, builder)
            populate_array(out, data=builder.gep(ary.data, [first]), shape=cgutils.pack_array(builder, dims, intp),
                           strides=cgutils.pack_array(builder, strides, intp), itemsize=ary.itemsize, meminfo=None)
            return out._getvalue()

        return result(base, offset, shape), codegen

    return shared_view


# shared_view(base, offset, shape): the C-contiguous array of ``shape`` that starts at element
# ``offset`` of the 1-D (dynamic) shared array ``base``, for carving one dynamic allocation
# into several multi-dimensional tiles. (Numba's ``reshape`` calls a helper that the CUDA
# target does not have.) Nothing is checked: the caller keeps it inside ``base``.
shared_view = _sim_shared_view if on_simulator() else _gpu_shared_view()
