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
tiling of ``MMA_CONFIGS``) and 8192^3, against cuBLAS fp16 (CuPy, torch.matmul; fp16 out);
and bf16 A and B (the default tiling) against cuBLAS bf16 (torch.matmul; bf16 out).
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
    launch_mma_tiles,
    make_shared_tiles,
    matmul,
    matmul_tensor_cores,
    MMA_TILES_GPU,
    MMA_TILES_SIM,
)
from kernels.base.mma import bf16_bits  # noqa: E402

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


# Rung 4's candidate tilings (BM, BN, BK, WM, WN, STAGES) at the reference size.
MMA_CONFIGS = {"128x128x64 w64x32 s3": MMA_TILES_GPU, "128x128x32 w64x32 s2": (128, 128, 32, 64, 32, 2),
               "128x128x32 w64x32 s4": (128, 128, 32, 64, 32, 4), "64x128x64 w32x64 s3": (64, 128, 64, 32, 64, 3)}


def _tensor_core_rung(ctx, cp, torch):
    """Rung 4: fp16 (then bf16) A and B, fp32 C, on tensor cores; peers cuBLAS fp16 (CuPy,
    torch) and bf16 (torch)."""
    results = []
    sizes = [(32, 32, 16)] if ctx.simulator else ([(4096, 4096, 4096)] if ctx.quick
                                                  else [(4096, 4096, 4096), (8192, 8192, 8192)])
    for bf16 in (False, True):
        dt = "bf16" if bf16 else "fp16"
        for index, (m, n, k) in enumerate(sizes):
            config = f"M={m} N={n} K={k} {dt}"
            flops = 2.0 * m * n * k
            rng = np.random.default_rng(400)
            x, y = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
            if bf16:
                a_host, b_host = bf16_bits(x).astype(np.uint16), bf16_bits(y).astype(np.uint16)
                a_val, b_val = ((h.astype(np.uint32) << 16).view(np.float32) for h in (a_host, b_host))
            else:
                a_host, b_host = x.astype(np.float16).view(np.uint16), y.astype(np.float16).view(np.uint16)
                a_val, b_val = (h.view(np.float16).astype(np.float32) for h in (a_host, b_host))
            a, b = cuda.to_device(a_host), cuda.to_device(b_host)       # the 16-bit patterns
            c = cuda.device_array((m, n), np.float32)
            sets = [(a, b, c)]
            base = dict(N=m) if m == n == k else {}
            rows = []
            cublas_ms = None
            if cp is not None and not bf16:
                ca, cb = cp.asarray(a).view(cp.float16), cp.asarray(b).view(cp.float16)
                cc = cp.empty((m, n), cp.float16)
                r = ctx.measure(CHAPTER, "peer: cuBLAS (CuPy) fp16", config, lambda a, b, c: cp.matmul(a, b, out=c),
                                [(ca, cb, cc)], flops=flops, model_bytes=2.0 * (m * k + k * n + m * n), is_peer=True,
                                peak_memory=False, note="cupy.matmul of fp16 (tensor cores; fp16 out)",
                                extra=dict(base))
                cublas_ms = r.median_ms
                rows.append(r)
            if torch is not None:
                tdt = torch.bfloat16 if bf16 else torch.float16
                ta = torch.as_tensor(a, device="cuda").view(tdt)
                tb = torch.as_tensor(b, device="cuda").view(tdt)
                tc = torch.empty((m, n), device="cuda", dtype=tdt)
                r = ctx.measure(CHAPTER, f"peer: torch.matmul {dt}", config,
                                lambda a, b, c: torch.matmul(a, b, out=c), [(ta, tb, tc)], flops=flops,
                                model_bytes=2.0 * (m * k + k * n + m * n), is_peer=True, peak_memory=False,
                                note=f"{dt} in and out (cuBLAS, tensor cores)", extra=dict(base))
                if bf16:
                    cublas_ms = r.median_ms
                rows.append(r)
            default = MMA_TILES_SIM if ctx.simulator else MMA_TILES_GPU
            configs = {"sim": default} if ctx.simulator or bf16 or index else MMA_CONFIGS
            for name, tiles in configs.items():
                def rung4(a, b, c, tiles=tiles):
                    launch_mma_tiles(a, b, c, tiles, bf16=bf16, aligned=True)

                rung4(*sets[0])
                _check(c, a_val, b_val, f"rung 4 {dt} {name}")
                is_default = tiles == default
                label = "rung 4 (tensor cores)" if is_default else f"rung 4 (tensor cores) {name}"
                bm, bn, bk, wm, wn, stages = tiles
                rows.append(ctx.measure(CHAPTER, label, config, rung4, sets, flops=flops,
                                        model_bytes=2.0 * (m * k * cdiv(n, bn) + k * n * cdiv(m, bm)) + 4.0 * m * n,
                                        peak_memory=False,
                                        note=f"mma.sync m16n8k16 {dt}: BM={bm} BN={bn} BK={bk}, warp tile {wm}x{wn}, "
                                             f"{stages} stages, {32 * (bm // wm) * (bn // wn)} threads",
                                        extra=dict(base) if is_default else {}))
            if index == 0:
                user = (lambda a, b, c: matmul_tensor_cores(a, b, bf16=True)) if bf16 else (
                    lambda a, b, c: matmul_tensor_cores(a.view(np.float16), b.view(np.float16)))
                rows.append(ctx.measure(CHAPTER, "matmul_tensor_cores() launcher (rung 4)", config, user, sets,
                                        flops=flops, model_bytes=2.0 * (m * k + k * n) + 4.0 * m * n,
                                        peak_memory=False, note="argument checks and the output allocation included"))
            for r in rows:
                if cublas_ms:
                    r.note += f"; {cublas_ms / r.median_ms:.3f}x cuBLAS {dt}'s speed"
            results.extend(rows)
            del sets, a, b, c
            if cp is not None:
                cp.get_default_memory_pool().free_all_blocks()
    return results


# --------------------------------------------------------------------------- plot

_LADDER = (("rung 1 (global)", "rung 1: global", "#c6dbef", None),
           ("rung 2 (shared tiles)", "rung 2: shared", "#6baed6", None),
           ("rung 3 (registers)", "rung 3: registers", "#08519c", None),
           ("peer: cuBLAS (CuPy) fp32", "cuBLAS fp32", "0.35", "//"))


def plot(results, path, *, title, simulator, ceiling=float("nan"), judged_by=None):
    """Three questions, one a panel: how far each rung of the fp32 ladder climbs toward
    cuBLAS at every size; what the tilings the bench sweeps give at 4096^3; where the fp16
    tensor-core rung stands against cuBLAS's. In the simulator, the tour's generic plot."""
    from kernels.bench.tour import plot_results

    sizes = []
    for r in results:
        if r.kernel == "rung 3 (registers)" and r.config.endswith("fp32") and r.config not in sizes:
            sizes.append(r.config)
    if simulator or len(sizes) < 2:
        return plot_results(results, path, title=title, simulator=simulator, ceiling=ceiling, judged_by=judged_by)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tf = {(r.kernel, r.config): r.tflops for r in results}
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 5.8), gridspec_kw={"width_ratios": [1.5, 1.2, 0.75]})

    # (a) the fp32 ladder at every size
    width = 0.8 / len(_LADDER)
    for k, (kernel, label, color, hatch) in enumerate(_LADDER):
        pts = [(g + (k - (len(_LADDER) - 1) / 2) * width, tf[(kernel, s)]) for g, s in enumerate(sizes)
               if (kernel, s) in tf]
        if pts:
            xs, ys = zip(*pts)
            a.bar(xs, ys, width, color=color, hatch=hatch, edgecolor="white" if hatch else "black", lw=0.5, label=label)
            for x, y in pts:
                a.text(x, y + 0.6, f"{y:.3g}", ha="center", va="bottom", fontsize=9)
    if ceiling == ceiling:
        a.axhline(ceiling, color="red", linestyle=":", lw=1.2, label=f"FMA ceiling {ceiling:.1f}")

    def short(config):
        m, n, k = (int(item.split("=")[1]) for item in config.split()[:3])
        return f"{m}³" if m == n == k else f"{m} × {n}\n× {k}"
    a.set_xticks(range(len(sizes)), [short(s) for s in sizes], fontsize=10.5)
    a.set_ylabel("TFLOP/s (higher is better)")
    a.set_ylim(0, max(ceiling if ceiling == ceiling else 0, max(tf.get((k, s), 0) for k, *_ in _LADDER
                                                                for s in sizes)) * 1.5)
    a.grid(True, axis="y", alpha=0.3)
    a.legend(fontsize=9.5, loc="upper left", ncol=2, columnspacing=0.8, handlelength=1.5)
    share = [tf[("rung 3 (registers)", s)] / tf[("peer: cuBLAS (CuPy) fp32", s)] for s in sizes
             if ("rung 3 (registers)", s) in tf and ("peer: cuBLAS (CuPy) fp32", s) in tf]
    a.set_title(f"fp32: each rung multiplies the rate; rung 3 reaches\n{min(share):.0%}–{max(share):.0%} of "
                "cuBLAS at every size, ragged included", fontsize=12)

    # (b) the tilings swept at 4096^3 (rung 3 fp32, rung 4 fp16) and the launchers
    ref32 = next((s for s in sizes if s.startswith("M=4096 N=4096")), sizes[0])
    ref16 = ref32.replace("fp32", "fp16")
    rows = [r for r in results if r.config in (ref32, ref16) and not r.is_peer
            and (r.kernel.startswith("rung 3") or r.kernel.startswith("rung 4") or "launcher" in r.kernel)]
    rows.sort(key=lambda r: (r.config.endswith("fp16"), "launcher" in r.kernel, -r.tflops))
    ys = range(len(rows))
    b.barh(list(ys), [r.tflops for r in rows], color=["#08519c" if r.config == ref32 else "#e6550d" for r in rows],
           edgecolor="black", lw=0.5)
    for y, r in zip(ys, rows):
        b.text(r.tflops, y, f" {r.tflops:.3g}", va="center", fontsize=9.5)
    b.set_yticks(list(ys), [r.kernel.replace(" (registers)", "").replace(" (tensor cores)", " (TC)")
                            .replace(" launcher (rung 3)", "").replace(" launcher (rung 4)", "")
                            + ("" if r.kernel[-1] in "0123456789" or "launcher" in r.kernel else " default")
                            + (" launcher" if "launcher" in r.kernel else "")
                            for r in rows], fontsize=10)
    b.invert_yaxis()
    b.set_xlabel("TFLOP/s at 4096³ (blue: fp32, orange: fp16 in, fp32 sums)")
    b.set_xlim(0, max(r.tflops for r in rows) * 1.2)
    b.grid(True, axis="x", alpha=0.3)
    fastest = all(tf.get((default, cfg), 0) >= max(r.tflops for r in rows if r.kernel.startswith(default)
                                                   and r.config == cfg)
                  for default, cfg in (("rung 3 (registers)", ref32), ("rung 4 (tensor cores)", ref16)))
    b.set_title(("Tilings at 4096³: the defaults are the fastest;" if fastest else "Tilings at 4096³ (the sweep);")
                + "\nthe launchers add checks and allocation", fontsize=12)

    # (c) fp16 on tensor cores against cuBLAS fp16
    fp16 = [s for s in dict.fromkeys(r.config for r in results if r.config.endswith("fp16"))
            if ("rung 4 (tensor cores)", s) in tf]
    labels = [s.split(" N=")[0].replace("M=", "") + "³" for s in fp16]
    for k, (kernel, label, color, hatch) in enumerate((("rung 4 (tensor cores)", "rung 4 (tensor cores)", "#e6550d", None),
                                                       ("peer: cuBLAS (CuPy) fp16", "cuBLAS fp16", "0.35", "//"))):
        pts = [(g + (k - 0.5) * 0.38, tf[(kernel, s)]) for g, s in enumerate(fp16) if (kernel, s) in tf]
        if pts:
            xs, ys_ = zip(*pts)
            c.bar(xs, ys_, 0.38, color=color, hatch=hatch, edgecolor="white" if hatch else "black", lw=0.5, label=label)
            for x, y in pts:
                c.text(x, y + 5, f"{y:.3g}", ha="center", va="bottom", fontsize=9.5)
    c.set_xticks(range(len(fp16)), labels, fontsize=10.5)
    c.set_ylabel("TFLOP/s")
    c.set_ylim(0, max(tf.get(("peer: cuBLAS (CuPy) fp16", s), 0) for s in fp16) * 1.2 if fp16 else 1)
    c.grid(True, axis="y", alpha=0.3)
    c.legend(fontsize=9.5, loc="upper left")
    share16 = [tf[("rung 4 (tensor cores)", s)] / tf[("peer: cuBLAS (CuPy) fp16", s)] for s in fp16
               if ("peer: cuBLAS (CuPy) fp16", s) in tf]
    if share16:
        c.set_title(f"fp16 on tensor cores: rung 4 reaches\n{min(share16):.0%}–{max(share16):.0%} of cuBLAS fp16",
                    fontsize=12)
    fig.suptitle(title, fontsize=12.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
