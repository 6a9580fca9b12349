"""Chapter 2's bench: the rungs of the tiled matmul against cuBLAS, in one run.

C = A @ B, float32, row-major. Sizes (M, N, K): 4096^3 always; without ``--quick`` also
2048^3, 8192^3 and a ragged (4000, 3999, 4001), where no tile divides anything. Every size
measures, in the same run:

* ``rung 1 (global)``          one thread an output, operands from global memory
* ``rung 2 (shared tiles)``    T x T tiles of A and B staged in shared memory
* ``rung 3 (registers) ...``   BM x BN block tiles, TM x TN register micro-tiles a thread;
  at 4096^3 every candidate tiling of ``RUNG3_CONFIGS`` (the sweep that picks the
  default), at the other sizes the default tiling only
* ``matmul() launcher``        rung 3 as a user calls it (argument checks, output allocated)
* peers: cuBLAS through CuPy (``cupy.matmul``) and ``torch.matmul``, both with TF32 off
  (``CUPY_TF32`` unset; ``torch.backends.cuda.matmul.allow_tf32 = False``): plain fp32
  FMAs, like ours.

TFLOP/s count 2 M N K FLOPs; ``pct_fma_ceiling`` is against the fp32 ceiling measured in
the same run (cuBLAS 8192^3). Each row's note ends with its speed over cuBLAS's at the same
size. The default rung-3 tiling is labelled ``rung 3 (registers)``; the other candidates of
the sweep carry their tiling in the label. ``model_bytes`` is what the kernel's tiling requests from global memory
(``kernels.tiled_matmul.global_bytes``: rung 1 2 M N K + M N floats, rung 2 and 3 each
input re-read once per tile across); for the peers the compulsory M K + K N + M N floats.
Our kernels are timed as bare launches on preallocated device arrays; each result is
checked against the float64 oracle on a few rows and columns before it is timed.

Rung 4 (tensor cores, ``matmul_tensor_cores``): fp16 A and B, fp32 C, at 4096^3 (every
tiling of ``MMA_CONFIGS``) and 8192^3, against cuBLAS fp16 (CuPy, torch.matmul; fp16 out).
"""

from __future__ import annotations

import os

import numpy as np
from numba import cuda

os.environ.pop("CUPY_TF32", None)  # before CuPy is imported anywhere: TF32 off, plain fp32

from kernels.bench.harness import Result, cupy_or_none, torch_or_none  # noqa: E402
from kernels.base.runtime import cdiv  # noqa: E402
from kernels.tiled_matmul import (  # noqa: E402
    RUNG3_CONFIGS,
    RUNG3_DEFAULT,
    default_tiles,
    global_bytes,
    make_naive,
    make_register_tiles,
    make_mma_tiles,
    make_shared_tiles,
    matmul,
    matmul_tensor_cores,
    MMA_TILES_GPU,
)

CHAPTER = 2
TITLE = "tiled matmul"


def _sizes(ctx):
    """(M, N, K) to measure; the first is the reference size where the rung-3 sweep runs."""
    if ctx.simulator:
        return [(16, 16, 16)] if ctx.quick else [(16, 16, 16), (13, 17, 9)]
    if ctx.quick:
        return [(4096, 4096, 4096)]
    return [(4096, 4096, 4096), (2048, 2048, 2048), (8192, 8192, 8192), (4000, 3999, 4001)]


def _rung3_configs(ctx, first):
    if ctx.simulator:
        return {"sim 16x16x4 4x4": default_tiles(3)["register_tiles"]}
    if first:
        return dict(RUNG3_CONFIGS)
    return {RUNG3_DEFAULT: RUNG3_CONFIGS[RUNG3_DEFAULT]}


def _input_sets(m, n, k, count, cp):
    """``count`` (a, b, c) sets of device arrays: a, b N(0, 1) float32 (never zeros), c output."""
    sets = []
    for i in range(count):
        if cp is not None:
            cp.random.seed(300 + i)
            a = cp.random.standard_normal((m, k), dtype=cp.float32)
            b = cp.random.standard_normal((k, n), dtype=cp.float32)
            c = cp.empty((m, n), dtype=cp.float32)
            sets.append((a, b, c))
        else:
            rng = np.random.default_rng(300 + i)
            a = cuda.to_device(rng.standard_normal((m, k)).astype(np.float32))
            b = cuda.to_device(rng.standard_normal((k, n)).astype(np.float32))
            sets.append((a, b, cuda.device_array((m, n), np.float32)))
    return sets


def _host(x):
    return x.get() if hasattr(x, "get") else x.copy_to_host()


def _check(c, a_host, b_host, label):
    """A few rows and columns of C (first, last: the ragged edges) against float64."""
    m, n = c.shape
    rows = sorted({0, 1, m // 2, m - 1} & set(range(m)))
    cols = sorted({0, 1, n // 2, n - 1} & set(range(n)))
    got = _host(c)
    exact = a_host[rows].astype(np.float64) @ b_host.astype(np.float64)
    approx = a_host[rows] @ b_host                       # float32 NumPy: the yardstick
    err = np.max(np.abs(got[rows] - exact))
    err32 = np.max(np.abs(approx - exact))
    exact_c = a_host.astype(np.float64) @ b_host[:, cols].astype(np.float64)
    err_c = np.max(np.abs(got[:, cols] - exact_c))
    bound = 4 * max(err32, 1e-6 * np.max(np.abs(exact)))
    assert err <= bound and err_c <= 4 * bound, (
        f"{label}: differs from the float64 oracle by {max(err, err_c):.3g} (float32 NumPy: {err32:.3g})")


def run(ctx) -> list[Result]:
    cp = cupy_or_none()
    torch = torch_or_none()
    results = []
    for index, (m, n, k) in enumerate(_sizes(ctx)):
        config = f"M={m} N={n} K={k} fp32"
        flops = 2.0 * m * n * k
        sets = _input_sets(m, n, k, 2, cp)
        a_host, b_host = _host(sets[0][0]), _host(sets[0][1])
        # Numba views, flat views for rung 3 (its kernel takes flat arrays and the sizes).
        views = [tuple(cuda.as_cuda_array(x) if cp is not None else x for x in s) for s in sets]
        flat = [(a.reshape(m * k), b.reshape(k * n), c.reshape(m * n)) for a, b, c in views]
        # Cubes carry N (the tour draws them as lines over N); the ragged size is a bar.
        base = dict(N=m) if m == n == k else {}
        rows = []

        # Peers first: every rung's row carries its ratio to cuBLAS at this size.
        cublas_ms = None
        if cp is not None:
            def cublas(a, b, c):
                cp.matmul(a, b, out=c)

            r = ctx.measure(CHAPTER, "peer: cuBLAS (CuPy) fp32", config, cublas, sets, flops=flops,
                            model_bytes=global_bytes(m, n, k, rung=0), is_peer=True, peak_memory=False,
                            note="cupy.matmul, TF32 off (CUPY_TF32 unset); compulsory bytes",
                            extra=dict(base))
            cublas_ms = r.median_ms
            rows.append(r)
        if torch is not None:
            tf32 = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = False
            try:
                tsets = [tuple(torch.as_tensor(x, device="cuda") for x in s) for s in views]
                rows.append(ctx.measure(CHAPTER, "peer: torch.matmul fp32", config,
                                        lambda a, b, c: torch.matmul(a, b, out=c), tsets, flops=flops,
                                        model_bytes=global_bytes(m, n, k, rung=0), is_peer=True,
                                        peak_memory=False, note="TF32 off; compulsory bytes", extra=dict(base)))
                del tsets
            finally:
                torch.backends.cuda.matmul.allow_tf32 = tf32

        # Rung 1: one thread an output.
        bx, by = default_tiles(1)["block"]
        k1 = make_naive(bx, by)
        g1 = (cdiv(n, bx), cdiv(m, by))

        def rung1(a, b, c):
            k1[g1, (bx, by)](a, b, c)

        rung1(*views[0])
        _check(views[0][2], a_host, b_host, "rung 1")
        rows.append(ctx.measure(CHAPTER, "rung 1 (global)", config, rung1, views, flops=flops,
                                model_bytes=global_bytes(m, n, k, rung=1), peak_memory=False,
                                note=f"{bx}x{by} threads a block, one output a thread",
                                extra=dict(base)))

        # Rung 2: shared-memory tiles.
        t = default_tiles(2)["tile"]
        k2 = make_shared_tiles(t)
        g2 = (cdiv(n, t), cdiv(m, t))

        def rung2(a, b, c):
            k2[g2, (t, t)](a, b, c)

        rung2(*views[0])
        _check(views[0][2], a_host, b_host, "rung 2")
        rows.append(ctx.measure(CHAPTER, "rung 2 (shared tiles)", config, rung2, views, flops=flops,
                                model_bytes=global_bytes(m, n, k, rung=2, tile=t), peak_memory=False,
                                note=f"T={t}: {t}x{t} tiles of A and B in shared memory",
                                extra=dict(base)))

        # Rung 3: register micro-tiles, every candidate tiling at the reference size.
        for name, (bm, bn, bk, tm, tn) in _rung3_configs(ctx, index == 0).items():
            k3 = make_register_tiles(bm, bn, bk, tm, tn)
            g3, threads = (cdiv(n, bn), cdiv(m, bm)), k3.threads

            def rung3(a, b, c, k3=k3, g3=g3, threads=threads):
                k3[g3, threads](a, b, c, m, n, k)

            rung3(*flat[0])
            _check(views[0][2], a_host, b_host, f"rung 3 {name}")
            is_default = ctx.simulator or name == RUNG3_DEFAULT
            label = "rung 3 (registers)" if is_default else f"rung 3 (registers) {name}"
            rows.append(ctx.measure(CHAPTER, label, config, rung3, flat,
                                    flops=flops, model_bytes=global_bytes(m, n, k, rung=3, bm=bm, bn=bn),
                                    peak_memory=False,
                                    note=f"BM={bm} BN={bn} BK={bk}, {tm}x{tn} a thread, {threads} threads",
                                    extra=dict(base) if is_default else {}))

        # The launcher as a user calls it: checks its arguments, allocates C.
        if index == 0:
            rows.append(ctx.measure(CHAPTER, "matmul() launcher (rung 3)", config,
                                    lambda a, b, c: matmul(a, b), sets, flops=flops,
                                    model_bytes=global_bytes(m, n, k, rung=3), peak_memory=False,
                                    note="argument checks and the output allocation included"))

        for r in rows:
            if cublas_ms:
                r.note += f"; {cublas_ms / r.median_ms:.3f}x cuBLAS's speed"
        results.extend(rows)
        del sets, views, flat
        if cp is not None:
            cp.get_default_memory_pool().free_all_blocks()
    results.extend(_tensor_core_rung(ctx, cp, torch))
    return results


# Rung 4's candidate tilings (BM, BN, BK, WM, WN) at the reference size.
MMA_CONFIGS = {"128x128x32 w64x32": MMA_TILES_GPU, "64x64x32 w32x32": (64, 64, 32, 32, 32),
               "128x64x32 w64x32": (128, 64, 32, 64, 32)}


def _tensor_core_rung(ctx, cp, torch):
    """Rung 4: fp16 A and B, fp32 C, on tensor cores; peers cuBLAS fp16 (CuPy, torch)."""
    results = []
    sizes = [(32, 32, 16)] if ctx.simulator else ([(4096, 4096, 4096)] if ctx.quick
                                                  else [(4096, 4096, 4096), (8192, 8192, 8192)])
    for index, (m, n, k) in enumerate(sizes):
        config = f"M={m} N={n} K={k} fp16"
        flops = 2.0 * m * n * k
        rng = np.random.default_rng(400)
        a_host = rng.standard_normal((m, k)).astype(np.float16)
        b_host = rng.standard_normal((k, n)).astype(np.float16)
        a, b = cuda.to_device(a_host), cuda.to_device(b_host)
        c = cuda.device_array((m, n), np.float32)
        sets = [(a, b, c)]
        base = dict(N=m) if m == n == k else {}
        rows = []
        cublas_ms = None
        if cp is not None:
            ca, cb = cp.asarray(a), cp.asarray(b)
            cc = cp.empty((m, n), cp.float16)
            r = ctx.measure(CHAPTER, "peer: cuBLAS (CuPy) fp16", config, lambda a, b, c: cp.matmul(a, b, out=c),
                            [(ca, cb, cc)], flops=flops, model_bytes=2.0 * (m * k + k * n + m * n), is_peer=True,
                            peak_memory=False, note="cupy.matmul of fp16 (tensor cores; fp16 out)", extra=dict(base))
            cublas_ms = r.median_ms
            rows.append(r)
        if torch is not None:
            ta, tb = torch.as_tensor(a, device="cuda"), torch.as_tensor(b, device="cuda")
            tc = torch.empty((m, n), device="cuda", dtype=torch.float16)
            rows.append(ctx.measure(CHAPTER, "peer: torch.matmul fp16", config,
                                    lambda a, b, c: torch.matmul(a, b, out=c), [(ta, tb, tc)], flops=flops,
                                    model_bytes=2.0 * (m * k + k * n + m * n), is_peer=True, peak_memory=False,
                                    note="fp16 in and out (tensor cores)", extra=dict(base)))
        configs = {"sim 32x32x16 w16x16": None} if ctx.simulator else (
            MMA_CONFIGS if index == 0 else {"128x128x32 w64x32": MMA_TILES_GPU})
        for name, tiles in configs.items():
            tiles = tiles or (32, 32, 16, 16, 16)
            kern = make_mma_tiles(*tiles)
            grid = (cdiv(n, tiles[1]), cdiv(m, tiles[0]))

            def rung4(a, b, c, kern=kern, grid=grid):
                kern[grid, kern.threads](a, b, c, np.int32(1))

            rung4(*sets[0])
            _check(c, a_host.astype(np.float32), b_host.astype(np.float32), f"rung 4 {name}")
            is_default = ctx.simulator or tiles == MMA_TILES_GPU
            label = "rung 4 (tensor cores)" if is_default else f"rung 4 (tensor cores) {name}"
            rows.append(ctx.measure(CHAPTER, label, config, rung4, sets, flops=flops,
                                    model_bytes=2.0 * (m * k * cdiv(n, tiles[1]) + k * n * cdiv(m, tiles[0]))
                                    + 4.0 * m * n, peak_memory=False,
                                    note=f"mma.sync m16n8k16: BM={tiles[0]} BN={tiles[1]} BK={tiles[2]}, "
                                         f"warp tile {tiles[3]}x{tiles[4]}, {kern.threads} threads",
                                    extra=dict(base) if is_default else {}))
        if index == 0:
            rows.append(ctx.measure(CHAPTER, "matmul_tensor_cores() launcher (rung 4)", config,
                                    lambda a, b, c: matmul_tensor_cores(a, b), sets, flops=flops,
                                    model_bytes=2.0 * (m * k + k * n) + 4.0 * m * n, peak_memory=False,
                                    note="argument checks and the output allocation included"))
        for r in rows:
            if cublas_ms:
                r.note += f"; {cublas_ms / r.median_ms:.3f}x cuBLAS fp16's speed"
        results.extend(rows)
        del sets, a, b, c
        if cp is not None:
            cp.get_default_memory_pool().free_all_blocks()
    return results
