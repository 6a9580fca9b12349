"""Chapter 0's bench: the ceilings every later chapter is measured against.

* device copy bandwidth (bytes read + written): our grid-stride copy kernel (1 and 4
  elements a step) against the driver's device-to-device memcpy and CuPy's copy kernel,
  over N, so the plot shows where launch overhead stops mattering;
* the fp32 FMA ceiling: cuBLAS sgemm 8192^3 with TF32 off (``ctx.fp32_ceiling_tflops()``,
  the figure every chapter's "% FMA" column divides by);
* Numba's launch overhead: an empty kernel, and a kernel with two array arguments given
  as Numba device arrays or as CuPy arrays (converted at every launch).

All in one run, on one device. In the simulator the sizes are tiny and the timings are
Python's, not a GPU's.
"""

from __future__ import annotations

import math

import numpy as np

from kernels import gpu_basics
from kernels.bench.harness import Result, cupy_or_none
from numba import cuda

CHAPTER = 0
TITLE = "the GPU and the simulator"


def _random_device_vector(n, seed, cp):
    """A float32 Numba device array of standard normals (generated on the device when CuPy is here)."""
    if cp is not None:
        cp.random.seed(seed)
        return cuda.as_cuda_array(cp.random.standard_normal(n, dtype=cp.float32))
    return cuda.to_device(np.random.default_rng(seed).standard_normal(n).astype(np.float32))


def _size(nbytes):
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:g} KiB"


def run(ctx) -> list[Result]:
    cp = cupy_or_none()
    results = []
    if ctx.simulator:
        sizes = [2**10] if ctx.quick else [2**10, 2**12]
    else:
        sizes = [2**22, 2**26, 2**28] if ctx.quick else [2**20, 2**22, 2**24, 2**26, 2**28]
    threads = gpu_basics.COPY_THREADS

    # ---- copy bandwidth over N
    for n in sizes:
        config = f"N={n} fp32"
        moved = 2 * 4 * n  # every element read once and written once
        sets = []
        for s in range(2):  # two rotating (src, dst) pairs, random data
            src = _random_device_vector(n, 2 * s + 1, cp)
            dst = _random_device_vector(n, 2 * s + 2, cp)
            sets.append((src, dst))
        for items in (1, 4):
            kern = gpu_basics.make_copy(items)
            blocks = gpu_basics.copy_grid(n, threads, items)
            r = ctx.measure(CHAPTER, f"copy kernel, {items} a step", config,
                            lambda src, dst, k=kern, g=blocks: k[g, threads](src, dst), sets,
                            flops=0, model_bytes=moved, peak_memory=False,
                            extra={"N": n, "buffer": _size(4 * n), "blocks": blocks, "threads": threads})
            results.append(r)
            src, dst = sets[0]
            assert np.array_equal(src[-4096:].copy_to_host(), dst[-4096:].copy_to_host()), "copy kernel is wrong"
        if cp is not None:
            cp_sets = [(cp.asarray(a), cp.asarray(b)) for a, b in sets]
            results.append(ctx.measure(
                CHAPTER, "peer: cudaMemcpy D2D (CuPy)", config,
                lambda src, dst: dst.data.copy_from_device(src.data, src.nbytes), cp_sets,
                flops=0, model_bytes=moved, is_peer=True, peak_memory=False, extra={"N": n}))
            results.append(ctx.measure(
                CHAPTER, "peer: cupy.copyto kernel", config,
                lambda src, dst: cp.copyto(dst, src), cp_sets,
                flops=0, model_bytes=moved, is_peer=True, peak_memory=False, extra={"N": n}))
            del cp_sets
        del sets

    # ---- the fp32 FMA ceiling (cuBLAS, TF32 off), measured once for the whole run
    if ctx.simulator:
        ctx.progress("  ch0 cuBLAS fp32 ceiling: not measured in the simulator")
    else:
        ctx.progress("  ch0 peer: cuBLAS sgemm fp32 (TF32 off)    M=N=K=8192")
        tflops = ctx.fp32_ceiling_tflops()
        flops = 2.0 * 8192**3
        ms = flops / (tflops * 1e12) * 1e3
        results.append(Result(CHAPTER, "peer: cuBLAS sgemm fp32 (TF32 off)", "M=N=K=8192 fp32", ms,
                              math.nan, math.nan, flops, 3 * 4 * 8192**2, tflops,
                              3 * 4 * 8192**2 / (ms / 1e3) / 1e9, 100.0, math.nan, True,
                              "the fp32 FMA ceiling every chapter's %FMA uses"))

    # ---- launch overhead: events bracket the host's launch of a kernel that does nothing
    note = "launch overhead: CUDA events around a launch of a kernel that does no work"
    results.append(ctx.measure(CHAPTER, "launch: empty kernel, no arguments", "1 block x 1 thread",
                               lambda: gpu_basics.empty[1, 1](), [()], flops=0, model_bytes=0,
                               peak_memory=False, note=note))
    copy1 = gpu_basics.make_copy(1)
    a, b = cuda.to_device(np.ones(32, np.float32)), cuda.device_array(32, np.float32)
    results.append(ctx.measure(CHAPTER, "launch: 2 Numba device arrays", "copy kernel, N=32",
                               lambda x, y: copy1[1, 32](x, y), [(a, b)], flops=0, model_bytes=0,
                               peak_memory=False, note=note))
    if cp is not None:
        ca, cb = cp.ones(32, cp.float32), cp.empty(32, cp.float32)
        results.append(ctx.measure(CHAPTER, "launch: 2 CuPy arrays (converted)", "copy kernel, N=32",
                                   lambda x, y: copy1[1, 32](x, y), [(ca, cb)], flops=0, model_bytes=0,
                                   peak_memory=False, note=note))
    return results
