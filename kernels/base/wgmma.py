"""Hopper's warpgroup tensor-core instruction from Numba: ``wgmma.mma_async`` (sm_90a), tf32.

``mma.sync`` (``kernels.base.mma``) is issued by one warp for a 16 x 8 tile, both operands in
its registers. On the H100, Hopper's own instruction is ``wgmma.mma_async``: the four warps of
a WARPGROUP (warps 4 w .. 4 w + 3, 128 threads) issue it together for a 64 x N tile, N up to
256, with B read by the tensor cores straight from shared memory, and it runs asynchronously:

    wgmma_fence()                         the registers it reads and writes are ready
    acc = wgmma(a, desc_b, acc, 1)        D = A B^T (+ D): a 64 x 8 A (tf32) times an N x 8 B
    ...                                   (more of them, chained on the same accumulators)
    wgmma_commit()                        close the group
    acc = wait(acc)                       wait for the group; the accumulators may be read

``desc_add(desc, nbytes)`` moves a descriptor along (a k-step of a K-major operand is 256 bytes
on); ``wgmma_wait_prior()`` waits for all groups but the last (the registers the earlier ones
read are free again).

A is in the warps' registers with ``mma.sync``'s m16n8k8 tf32 fragment layout, warp 4 w + i
holding rows 16 i .. 16 i + 15 of the 64 (``a_position_tf32``); D's accumulators too:
thread element 4 j + e is ``c_position(lane, e)`` of the 16 x 8 tile j (columns 8 j ..), so a
warp's D is exactly the N / 8 mma.sync accumulator tiles it would have. B is described, not
passed: a 64-bit descriptor (``wgmma_desc``) holds its shared address and the byte distances
between its 8 x 4 "core matrices" (8 rows of 16 bytes, stored as 128 contiguous bytes): LBO
between core matrices along k, SBO between core matrices along N (no swizzle). For tf32 B
must be K-major: each row's 8 k values in two core matrices. ``canonical_word`` is that layout
for a whole R x K operand, and ``canonical_strides(K)`` its (LBO, SBO) a k-step.

Where the shared memory that a wgmma reads was written by ordinary stores, each writing thread
must ``async_fence()`` (fence.proxy.async) before the barrier that orders the writes: the
tensor cores read it through the asynchronous proxy.

The instructions need the sm_90a target, which numba-cuda takes on a Hopper GPU. In the
simulator the same calls run as Python: every thread of the block posts its A fragment, the
block meets at a barrier, the first thread of each warpgroup computes the product from the
posted fragments and the shared memory the descriptor names (in float64, tf32 operands
truncated as the tensor core reads them), each thread adds its accumulators and rounds once.
"""

from __future__ import annotations

import functools
import threading

import numpy as np

from kernels.base.runtime import on_simulator

__all__ = ["has_wgmma", "canonical_word", "canonical_strides", "wgmma_desc", "make_wgmma_tf32", "make_wgmma_wait",
           "make_zeros", "desc_add", "wgmma_fence", "wgmma_commit", "wgmma_wait_prior", "async_fence", "WARPGROUP", "wgmma_shapes"]

WARPGROUP = 128                 # threads a warpgroup: four consecutive warps


@functools.lru_cache(maxsize=None)
def has_wgmma() -> bool:
    """Whether the current device runs wgmma: a GPU of compute capability 9.0 (Hopper), which
    numba-cuda compiles for as sm_90a. False in the simulator, whose kernels choose smaller tiles."""
    if on_simulator():
        return False
    from numba import cuda

    return tuple(cuda.get_current_device().compute_capability) == (9, 0)


def wgmma_shapes() -> tuple[int, ...]:
    """The N of m64nNk8 for tf32: multiples of 8 up to 256."""
    return tuple(range(8, 257, 8))


def canonical_word(row: int, k: int, K: int) -> int:
    """The word offset of element (row, k) of an R x K tf32 operand (K a multiple of 8) laid
    out K-major without swizzle: core matrix (row // 8, k // 4), each 8 rows x 4 words in 128
    contiguous bytes, at word 32 ((row // 8) K / 4 + k // 4)."""
    return 32 * ((row // 8) * (K // 4) + k // 4) + 4 * (row % 8) + k % 4


def canonical_strides(K: int) -> tuple[int, int]:
    """(LBO, SBO) in bytes of ``canonical_word``'s layout: core matrices 128 bytes apart along
    k, 32 K bytes apart along the rows. A k-step s (8 columns) starts 256 s bytes in."""
    return 128, 32 * K


# --------------------------------------------------------------------------- the simulator

class _SimDescriptor:
    """The simulator's descriptor: a shared address (``kernels.base.mma``'s) and the strides."""

    def __init__(self, addr, lbo, sbo):
        self.addr, self.lbo, self.sbo = addr, int(lbo), int(sbo)

    def matrix(self, rows: int) -> np.ndarray:
        """The rows x 8 B it describes, as the tensor core reads tf32 (low 13 bits dropped)."""
        from kernels.base.mma import TF32_MASK

        flat = self.addr.array.reshape(-1).view(np.uint32)
        out = np.zeros((rows, 8), np.float64)
        for r in range(rows):
            for k in range(8):
                byte = self.addr.offset + (r // 8) * self.sbo + (k // 4) * self.lbo + 16 * (r % 8) + 4 * (k % 4)
                out[r, k] = np.array(flat[byte // 4] & np.uint32(TF32_MASK), np.uint32).view(np.float32)
        return out


def _sim_desc(addr, lbo, sbo):
    return _SimDescriptor(addr, lbo, sbo)


def _sim_wgmma(n, a, desc, acc, accumulate):
    from kernels.base.mma import TF32_MASK, _sim_thread, a_position_tf32, c_position

    t = _sim_thread()
    group, member = t.thread_id // WARPGROUP, t.thread_id % WARPGROUP
    table = t._manager.__dict__.setdefault("_wgmma_table", {})
    entry = table.get(group)
    if entry is None:
        entry = table.setdefault(group, {"a": np.zeros((WARPGROUP, 4), np.uint32), "product": None,
                                         "lock": threading.Lock()})
    if member == 0:
        entry["product"] = None
    entry["a"][member] = [int(x) & 0xFFFFFFFF for x in a]
    t.syncthreads()                                  # every thread has posted
    with entry["lock"]:
        if entry["product"] is None:
            A = np.zeros((64, 8), np.float64)
            words = (entry["a"] & np.uint32(TF32_MASK)).view(np.float32).astype(np.float64)
            for th in range(WARPGROUP):
                for i in range(4):
                    r, k = a_position_tf32(th % 32, i)
                    A[16 * (th // 32) + r, k] = words[th, i]
            entry["product"] = A @ desc.matrix(n).T
    product = entry["product"]
    w, lane = member // 32, member % 32
    out = []
    for i in range(n // 2):
        r, c = c_position(lane, i % 4)
        x = product[16 * w + r, 8 * (i // 4) + c]
        out.append(np.float32(x + (float(acc[i]) if accumulate else 0.0)))
    t.syncthreads()                                  # every thread has read: the table may be reused
    return tuple(out)


def _sim_nothing():
    return None


# --------------------------------------------------------------------------- the GPU

def _asm(builder, out_types, text, constraints, args, side_effect=True):
    from llvmlite import ir

    if not out_types:
        ret = ir.VoidType()
    elif len(out_types) == 1:
        ret = out_types[0]
    else:
        ret = ir.LiteralStructType(out_types)
    value = builder.call(ir.InlineAsm(ir.FunctionType(ret, [x.type for x in args]), text, constraints,
                                      side_effect=side_effect), args)
    if not out_types:
        return []
    if len(out_types) == 1:
        return [value]
    return [builder.extract_value(value, k) for k in range(len(out_types))]


def _elements(context, builder, ty, value, target):
    return [context.cast(builder, builder.extract_value(value, k), ty.types[k], target) for k in range(len(ty))]


@functools.lru_cache(maxsize=None)
def _gpu_fence(text):
    from numba.core import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def fence(typingctx):
        def codegen(context, builder, sig, args):
            _asm(builder, [], text, "~{memory}", [])
            return context.get_dummy_value()

        return types.void(), codegen

    return fence


@functools.lru_cache(maxsize=None)
def _gpu_desc():
    from llvmlite import ir
    from numba.core import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def wgmma_desc(typingctx, addr, lbo, sbo):
        """bits 0-13: the address / 16 (18 bits of shared address), 16-29: LBO / 16, 32-45: SBO / 16."""
        def codegen(context, builder, sig, args):
            i64 = ir.IntType(64)
            a = builder.zext(context.cast(builder, args[0], sig.args[0], types.uint32), i64)
            lb = context.cast(builder, args[1], sig.args[1], types.uint64)
            sb = context.cast(builder, args[2], sig.args[2], types.uint64)
            start = builder.lshr(builder.and_(a, ir.Constant(i64, 0x3FFFF)), ir.Constant(i64, 4))
            lead = builder.shl(builder.and_(builder.lshr(lb, ir.Constant(i64, 4)), ir.Constant(i64, 0x3FFF)),
                               ir.Constant(i64, 16))
            stride = builder.shl(builder.and_(builder.lshr(sb, ir.Constant(i64, 4)), ir.Constant(i64, 0x3FFF)),
                                 ir.Constant(i64, 32))
            return builder.or_(builder.or_(start, lead), stride)

        return types.uint64(addr, lbo, sbo), codegen

    return wgmma_desc


@functools.lru_cache(maxsize=None)
def _gpu_wgmma(n_cols):
    from llvmlite import ir
    from numba.core import types
    from numba.cuda.extending import intrinsic

    n = n_cols // 2
    regs = ",".join(f"${i}" for i in range(n))
    text = (f"{{ .reg .pred p; setp.ne.b32 p, ${n + 5}, 0; "
            f"wgmma.mma_async.sync.aligned.m64n{n_cols}k8.f32.tf32.tf32 {{{regs}}}, "
            f"{{${n},${n + 1},${n + 2},${n + 3}}}, ${n + 4}, p, 1, 1; }}")
    constraints = ",".join(["=f"] * n + ["r"] * 4 + ["l", "r"] + [str(i) for i in range(n)])
    result = types.UniTuple(types.float32, n)

    @intrinsic
    def wgmma(typingctx, a, desc, acc, accumulate):
        if not (isinstance(a, types.BaseTuple) and len(a) == 4 and isinstance(acc, types.BaseTuple)
                and len(acc) == n):
            raise TypeError(f"wgmma m64n{n_cols}k8: expected a = 4 uint32 registers, acc = {n} float32; "
                            f"got {a}, {acc}")

        def codegen(context, builder, sig, args):
            f32 = ir.FloatType()
            ops = (_elements(context, builder, sig.args[0], args[0], types.uint32)
                   + [context.cast(builder, args[1], sig.args[1], types.uint64),
                      context.cast(builder, args[3], sig.args[3], types.int32)]
                   + _elements(context, builder, sig.args[2], args[2], types.float32))
            outs = _asm(builder, [f32] * n, text, constraints, ops)
            return context.make_tuple(builder, result, outs)

        return result(a, desc, acc, accumulate), codegen

    return wgmma


@functools.lru_cache(maxsize=None)
def _gpu_wait(n, pending):
    from llvmlite import ir
    from numba.core import types
    from numba.cuda.extending import intrinsic

    constraints = ",".join(["=f"] * n + [str(i) for i in range(n)]) + ",~{memory}"
    result = types.UniTuple(types.float32, n)

    @intrinsic
    def wait(typingctx, acc):
        def codegen(context, builder, sig, args):
            ops = _elements(context, builder, sig.args[0], args[0], types.float32)
            outs = _asm(builder, [ir.FloatType()] * n, f"wgmma.wait_group.sync.aligned {pending};", constraints, ops)
            return context.make_tuple(builder, result, outs)

        return result(acc), codegen

    return wait


@functools.lru_cache(maxsize=None)
def _gpu_zeros(n):
    from llvmlite import ir
    from numba.core import types
    from numba.cuda.extending import intrinsic

    result = types.UniTuple(types.float32, n)

    @intrinsic
    def zeros(typingctx):
        def codegen(context, builder, sig, args):
            return context.make_tuple(builder, result, [ir.Constant(ir.FloatType(), 0.0)] * n)

        return result(), codegen

    return zeros


# --------------------------------------------------------------------------- the functions

def make_wgmma_tf32(n_cols: int):
    """``wgmma(a, desc_b, acc, accumulate) -> acc``: m64n{n_cols}k8, tf32 in, fp32 accumulate;
    a: this thread's 4 A registers (tf32 bit patterns, uint32), desc_b: ``wgmma_desc`` of the
    n_cols x 8 B, acc: n_cols / 2 float32 (``accumulate`` 0: D = A B^T, 1: D = A B^T + acc).
    The result is not ready until ``make_wgmma_wait(n_cols / 2)`` returns it."""
    if n_cols not in wgmma_shapes():
        raise ValueError(f"n_cols: expected a multiple of 8 up to 256, got {n_cols}")
    if on_simulator():
        return lambda a, desc, acc, accumulate: _sim_wgmma(n_cols, a, desc, acc, accumulate)
    return _gpu_wgmma(n_cols)


def make_zeros(n: int):
    """``zeros() -> acc``: n float32 zeros as one tuple (a fresh accumulator)."""
    if on_simulator():
        return lambda: (np.float32(0.0),) * int(n)
    return _gpu_zeros(int(n))


def make_wgmma_wait(n: int, pending: int = 0):
    """``wait(acc) -> acc``: wait until at most ``pending`` committed groups are in flight (0:
    every one done); returns the n accumulators of a group that is done, which the compiler
    may then read (they come out of the wait, so no read of them moves above it)."""
    if on_simulator():
        return lambda acc: tuple(acc)
    return _gpu_wait(int(n), int(pending))


def _sim_desc_add(desc, nbytes):
    return _SimDescriptor(desc.addr + nbytes, desc.lbo, desc.sbo)


@functools.lru_cache(maxsize=None)
def _gpu_desc_add():
    from numba.core import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def desc_add(typingctx, desc, nbytes):
        """The descriptor of the matrix nbytes further on: nbytes / 16 added to its address field
        (one 64-bit add; the caller keeps the address within the field)."""
        def codegen(context, builder, sig, args):
            from llvmlite import ir
            d = context.cast(builder, args[0], sig.args[0], types.uint64)
            n = context.cast(builder, args[1], sig.args[1], types.uint64)
            return builder.add(d, builder.lshr(n, ir.Constant(ir.IntType(64), 4)))

        return types.uint64(desc, nbytes), codegen

    return desc_add


if on_simulator():
    wgmma_desc, desc_add = _sim_desc, _sim_desc_add
    wgmma_fence = wgmma_commit = wgmma_wait_prior = async_fence = _sim_nothing
else:
    wgmma_desc, desc_add = _gpu_desc(), _gpu_desc_add()
    wgmma_fence = _gpu_fence("wgmma.fence.sync.aligned;")
    wgmma_commit = _gpu_fence("wgmma.commit_group.sync.aligned;")
    wgmma_wait_prior = _gpu_fence("wgmma.wait_group.sync.aligned 1;")     # all but the last group done
    async_fence = _gpu_fence("fence.proxy.async.shared::cta;")
