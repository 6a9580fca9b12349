"""Chapter 0: the GPU and the simulator.

Three small kernels that show the machine the rest of the course programs:

``copy``
    A grid-stride copy of a float32 vector. Each thread starts at its global index
    ``i = blockIdx.x * blockDim.x + threadIdx.x`` and steps by the number of threads in
    the whole grid, so any grid size covers any N. Neighbouring threads touch neighbouring
    addresses (coalesced: a warp of 32 threads reads 128 contiguous bytes at once), which
    is what lets a copy reach the HBM bandwidth. ``ITEMS`` > 1 gives each thread several
    elements a block-width apart, so more loads are in flight before the first store.

``block_sums``
    A block reduction: each block loads ``THREADS`` elements into shared memory and halves
    the active threads each step (a tree), with a barrier (``cuda.syncthreads()``) between
    steps so that no thread reads a partial sum before it is written. Threads, blocks,
    barriers and shared memory in twenty lines.

``empty``
    A kernel that does nothing: launching it measures Numba's launch overhead.

Launchers validate their input and give back the kind of array they were given (NumPy in,
NumPy out; device array in, device array out).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int32

from kernels.base.runtime import (ArrayKind, cdiv, check_array, check_int, check_out, device_empty,
                                  on_simulator, to_device)

# Production launch shapes on a GPU; small ones in the simulator (each simulated thread is
# a Python thread).
COPY_THREADS = 64 if on_simulator() else 256
COPY_BLOCKS_PER_SM = 8          # enough resident warps to keep many loads in flight
SUM_THREADS = 64 if on_simulator() else 256


# The kernels a learner may write in place of these (``kernels.base.learner``): each
# factory's name, and the tests that grade it (a ``pytest -k`` expression).
# The notebook asks for the two the chapter does not print (a scaled sum and a block max);
# the copy and the block sum it prints can be rewritten too.
EXERCISES = {"make_scale_add": "scale_add", "make_block_max": "block_maxes",
             "make_copy": "copy", "make_block_sum": "block_sums"}


# --------------------------------------------------------------------------- copy

@functools.lru_cache(maxsize=None)
def make_copy(items: int = 1):
    """A grid-stride float32 copy kernel; each thread moves ``items`` elements a step."""
    ITEMS = items

    @cuda.jit
    def copy_kernel(src, dst):
        n = src.shape[0]
        # Global index of this thread's first element, and the step: every thread of the grid.
        start = cuda.blockIdx.x * cuda.blockDim.x * ITEMS + cuda.threadIdx.x
        step = cuda.gridDim.x * cuda.blockDim.x * ITEMS
        for base in range(start, n, step):
            # ITEMS elements a block-width apart: a warp's 32 threads still read 32
            # consecutive floats at each of them (coalesced). All ITEMS loads are issued
            # before any store: a store in between could alias src, so the compiler would
            # make every load wait for the previous store, one load in flight per thread.
            vals = cuda.local.array(ITEMS, float32)
            for j in range(ITEMS):
                i = base + j * cuda.blockDim.x
                if i < n:
                    vals[j] = src[i]
            for j in range(ITEMS):
                i = base + j * cuda.blockDim.x
                if i < n:
                    dst[i] = vals[j]

    return copy_kernel


def copy_grid(n: int, threads: int, items: int, blocks: int | None = None) -> int:
    """Blocks to launch for a grid-stride copy of ``n`` elements."""
    needed = max(1, cdiv(n, threads * items))
    if blocks is not None:
        return blocks
    if on_simulator():
        return min(needed, 4)
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    return min(needed, sms * COPY_BLOCKS_PER_SM)


def copy(x, *, out=None, items: int = 1, threads: int | None = None, blocks: int | None = None):
    """``out[:] = x`` for a 1-D float32 array, by the grid-stride copy kernel.

    ``out`` (optional) must be a float32 array of the same length, on the device when ``x``
    is; with ``out`` given nothing is allocated (what the bench times).
    """
    shape, _ = check_array(x, "x", ndim=1)
    items = check_int(items, "items", 1, 16)
    threads = _check_threads(COPY_THREADS if threads is None else threads, "threads")
    if blocks is not None:
        blocks = check_int(blocks, "blocks", 1, 2**31 - 1)
    kind = ArrayKind(x)
    if out is not None:
        out_shape, _ = check_array(out, "out", ndim=1)
        if out_shape != shape:
            raise ValueError(f"out: expected shape {shape} like x, got {out_shape}")
        if kind.on_device != ArrayKind(out).on_device:
            raise TypeError("out: expected the same kind of array as x (both NumPy or both on the device)")
    n = shape[0]
    src = to_device(x, "x")
    dst = to_device(out, "out") if (out is not None and kind.on_device) else device_empty((n,), np.float32)
    if n > 0:
        make_copy(items)[copy_grid(n, threads, items, blocks), threads](src, dst)
    if out is not None and not kind.on_device:
        dst.copy_to_host(out)
        return out
    return out if out is not None else kind.give_back(dst)


# --------------------------------------------------------------------------- block reduction

@functools.lru_cache(maxsize=None)
def make_block_sum(threads: int):
    """A kernel where block b writes sum(x[b*threads : (b+1)*threads]) to ``sums[b]``."""
    THREADS = threads  # a power of two: the tree halves it each step

    @cuda.jit
    def block_sum_kernel(x, sums):
        # Shared memory: one float per thread, visible to every thread of this block only.
        buf = cuda.shared.array(THREADS, float32)
        t = cuda.threadIdx.x
        i = cuda.blockIdx.x * THREADS + t
        # Each thread loads one element (0 past the end, so the tree needs no bounds checks).
        buf[t] = x[i] if i < x.shape[0] else float32(0.0)
        cuda.syncthreads()  # every load is in shared memory before anyone reads a neighbour's
        half = int32(THREADS // 2)
        while half > 0:
            if t < half:
                buf[t] += buf[t + half]
            # Every thread of the block reaches this barrier, in every step (a barrier
            # inside ``if t < half`` would hang or be undefined on a GPU).
            cuda.syncthreads()
            half //= int32(2)
        if t == 0:
            sums[cuda.blockIdx.x] = buf[0]

    return block_sum_kernel


def block_sums(x, *, threads: int | None = None):
    """Per-block sums of a 1-D float32 array: element b is ``x[b*threads:(b+1)*threads].sum()``.

    ``threads`` (a power of two, 1..1024) is both the block size and the segment length.
    Returns ``cdiv(len(x), threads)`` float32 sums, as the kind of array ``x`` is.
    """
    shape, _ = check_array(x, "x", ndim=1)
    threads = SUM_THREADS if threads is None else threads
    threads = _check_threads(threads, "threads")
    if threads & (threads - 1):
        raise ValueError(f"threads: expected a power of two, got {threads}")
    kind = ArrayKind(x)
    n = shape[0]
    blocks = cdiv(n, threads)
    sums = device_empty((blocks,), np.float32)
    if blocks > 0:
        make_block_sum(threads)[blocks, threads](to_device(x, "x"), sums)
    return kind.give_back(sums)


# --------------------------------------------------------------------------- the exercises' kernels
# Solutions of the notebook's kernel exercises (not printed there): a learner's factory of
# the same name replaces them (``kernels.base.learner``) and the same tests grade it.

@functools.lru_cache(maxsize=None)
def make_scale_add(threads: int):
    """out[i] = a * x[i] + y[i] for every i: a grid-stride loop (any grid covers any n)."""

    @cuda.jit
    def scale_add_kernel(a, x, y, out):
        i = cuda.grid(1)
        while i < x.shape[0]:
            out[i] = a * x[i] + y[i]
            i += cuda.gridsize(1)

    return scale_add_kernel


def scale_add(a, x, y, *, out=None, threads: int | None = None, blocks: int | None = None):
    """a * x + y for a float32 scalar ``a`` and 1-D float32 arrays ``x``, ``y`` of one length,
    by ``make_scale_add``'s kernel on a grid of ``blocks`` blocks (default: enough for one
    element a thread, at most 4 in the simulator) of ``threads`` threads. ``out``: a device
    array of x's shape to write into (returned as given)."""
    if isinstance(a, bool) or not isinstance(a, (int, float, np.floating, np.integer)):
        raise TypeError(f"a: expected a number, got {type(a).__name__}")
    shape, _ = check_array(x, "x", ndim=1)
    y_shape, _ = check_array(y, "y", ndim=1)
    if y_shape != shape:
        raise ValueError(f"y: expected shape {shape} like x, got {y_shape}")
    threads = _check_threads(COPY_THREADS if threads is None else threads, "threads")
    n = shape[0]
    blocks = copy_grid(n, threads, 1, None if blocks is None else check_int(blocks, "blocks", 1, 2**31 - 1))
    kind = ArrayKind(x)
    dst = check_out(out, "out", (n,))
    dst = device_empty((n,), np.float32) if dst is None else dst
    if n > 0:
        make_scale_add(threads)[blocks, threads](np.float32(a), to_device(x, "x"), to_device(y, "y"), dst)
    return out if out is not None else kind.give_back(dst)


@functools.lru_cache(maxsize=None)
def make_block_max(threads: int):
    """Block b writes max(x[b*threads : (b+1)*threads]) to ``maxes[b]``: the block sum's tree
    with max in place of +, -inf past the end, and NaN kept (``max`` of a NaN and a number
    is either, so the tree asks ``v != v``)."""
    THREADS = threads

    @cuda.jit
    def block_max_kernel(x, maxes):
        buf = cuda.shared.array(THREADS, float32)
        t = cuda.threadIdx.x
        i = cuda.blockIdx.x * THREADS + t
        buf[t] = x[i] if i < x.shape[0] else float32(-np.inf)
        cuda.syncthreads()
        half = int32(THREADS // 2)
        while half > 0:
            if t < half:
                a, b = buf[t], buf[t + half]
                buf[t] = a if (a != a or a >= b) else b
            cuda.syncthreads()
            half //= int32(2)
        if t == 0:
            maxes[cuda.blockIdx.x] = buf[0]

    return block_max_kernel


def block_maxes(x, *, out=None, threads: int | None = None):
    """Per-block maxima of a 1-D float32 array: element b is ``x[b*threads:(b+1)*threads].max()``
    (NaN if the segment holds one). ``threads``: a power of two, 1..1024. ``out``: a device
    array of the ``cdiv(len(x), threads)`` maxima to write into (returned as given)."""
    shape, _ = check_array(x, "x", ndim=1)
    threads = _check_threads(SUM_THREADS if threads is None else threads, "threads")
    if threads & (threads - 1):
        raise ValueError(f"threads: expected a power of two, got {threads}")
    kind = ArrayKind(x)
    blocks = cdiv(shape[0], threads)
    maxes = check_out(out, "out", (blocks,))
    maxes = device_empty((blocks,), np.float32) if maxes is None else maxes
    if blocks > 0:
        make_block_max(threads)[blocks, threads](to_device(x, "x"), maxes)
    return out if out is not None else kind.give_back(maxes)


# --------------------------------------------------------------------------- launch overhead

@cuda.jit
def empty():
    """Does nothing: a launch of it costs only the launch."""
    pass


def launch_empty(blocks: int = 1, threads: int = 1):
    """Launch the empty kernel (no synchronisation: the caller times it)."""
    empty[blocks, threads]()


# --------------------------------------------------------------------------- counting

def copy_owner(i: int, block_dim: int, grid_dim: int, items: int = 1) -> tuple[int, int]:
    """(block, thread) of the copy kernel that moves element ``i`` (``grid_stride_indices``
    inverted): where to look when element i comes out wrong."""
    r = i % (grid_dim * block_dim * items)
    return r // (block_dim * items), r % block_dim


def grid_stride_indices(block: int, thread: int, block_dim: int, grid_dim: int, n: int, items: int = 1):
    """The elements thread ``thread`` of block ``block`` copies, in order (the copy kernel's
    index arithmetic in plain Python)."""
    start = block * block_dim * items + thread
    step = grid_dim * block_dim * items
    return [base + j * block_dim for base in range(start, n, step) for j in range(items)
            if base + j * block_dim < n]


def attention_flops(b: int, h: int, nq: int, nk: int, d: int, *, causal: bool = False) -> float:
    """FLOPs of attention forward: 2*Nq*Nk*d for S = QK^T and as many for O = PV, a head
    (4BHN^2d when Nq = Nk), halved when causal. The softmax's O(N^2) work is not counted."""
    flops = 4.0 * b * h * nq * nk * d
    return flops / 2 if causal else flops


def standard_forward_bytes(b: int, h: int, n: int, d: int, bytes_per_element: int = 4) -> float:
    """HBM bytes of the standard forward (S and P written to and read from HBM): 4Nd + 4N^2
    elements a head (read Q, K, V, write O; write S, read S, write P, read P)."""
    return float(b * h * (4 * n * d + 4 * n * n) * bytes_per_element)


def fused_forward_compulsory_bytes(b: int, h: int, n: int, d: int, bytes_per_element: int = 4) -> float:
    """HBM bytes a fused forward cannot avoid: read Q, K, V, write O (4Nd) and L (N), a head."""
    return float(b * h * (4 * n * d + n) * bytes_per_element)


def arithmetic_intensity(flops: float, nbytes: float) -> float:
    """FLOPs per byte moved to or from HBM: above the ridge (peak FLOP/s / bandwidth) a kernel
    can be compute-bound, below it is bandwidth-bound."""
    return flops / nbytes


# --------------------------------------------------------------------------- helpers

def _check_threads(value, name):
    return check_int(value, name, 1, 1024)


def ptx_targets():
    """Every kernel of this chapter at its production launch shapes, for the PTX check."""
    vec = "float32[::1]"
    return [
        ("copy fp32 grid-stride, 1 element a step", make_copy(1), f"void({vec}, {vec})"),
        ("copy fp32 grid-stride, 4 elements a step", make_copy(4), f"void({vec}, {vec})"),
        ("block sum fp32 256 threads", make_block_sum(256), f"void({vec}, {vec})"),
        ("block max fp32 256 threads", make_block_max(256), f"void({vec}, {vec})"),
        ("scale-add fp32 grid-stride", make_scale_add(256), f"void(float32, {vec}, {vec}, {vec})"),
        ("empty kernel", empty, "void()"),
    ]
