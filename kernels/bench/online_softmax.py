"""Chapter 3's bench: the row-softmax kernel against the copy bandwidth and its peers.

Softmax does a handful of operations an element: it is bound by memory, so the figure that
counts is GB/s against the COMPULSORY bytes, 8 an element (x read once, p written once),
plus the 4 bytes a row of L = logsumexp the kernel also writes. Every shape is measured
next to, in the same run:

* a device-to-device copy of the same bytes (cudaMemcpy through CuPy): the ceiling; each
  result's ``pct_of_copy`` is its time against the copy's;
* ``torch.softmax(x, dim=-1)`` in fp32;
* a CuPy softmax expression, exp(x - max) / sum (several passes, with temporaries).

Rows that fit on chip (n <= TPR * K) are read once; longer rows are read twice (the second
read mostly from L2), which the ``passes`` entry says. The kernel is timed as a launch on
preallocated device arrays; ``softmax()`` (which also allocates its outputs) once as well.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from kernels import reference as ref
from kernels.bench.harness import Result, cupy_or_none, torch_or_none
from kernels.online_softmax import default_tiles, make_row_softmax, softmax
from kernels.base.runtime import cdiv

CHAPTER = 3
TITLE = "online softmax"


def _shapes(ctx):
    if ctx.simulator:
        return [(4, 64)] if ctx.quick else [(4, 64), (2, 100)]
    if ctx.quick:
        return [(65536, 4096), (16384, 16384)]
    return [(65536, 1024), (16384, 4096), (65536, 4096), (16384, 16384), (32768, 16384), (4096, 65536)]


def _alt_tiles(n, ctx):
    """A couple of other tilings for the same n (full GPU runs only), to see the trade-off
    between threads a row and floats a thread."""
    if ctx.simulator or ctx.quick:
        return []
    return {1024: [(128, 1, 8)], 4096: [(512, 1, 8), (128, 1, 32)], 16384: [(1024, 1, 16)]}.get(n, [])


def _random_sets(rows, n, count, cp):
    """``count`` float32 (rows, n) device arrays of N(0, 4^2) values (never zeros)."""
    sets = []
    for s in range(count):
        if cp is not None:
            cp.random.seed(100 + s)
            sets.append(cuda.as_cuda_array(cp.random.standard_normal((rows, n), dtype=cp.float32) * 4))
        else:
            x = np.random.default_rng(100 + s).standard_normal((rows, n)).astype(np.float32) * 4
            sets.append(cuda.to_device(x))
    return sets


def _check(p, x, rows_to_check=4):
    """A few rows of the output against the float64 oracle (the tests check it properly)."""
    got = p[:rows_to_check].copy_to_host()
    exact = ref.softmax(x[:rows_to_check].copy_to_host())
    err = float(np.max(np.abs(got - exact)))
    assert err < 1e-5, f"row softmax differs from the oracle by {err:.3g}"


def run(ctx) -> list[Result]:
    cp = cupy_or_none()
    torch = torch_or_none()
    results = []
    for rows, n in _shapes(ctx):
        config = f"rows={rows} n={n} fp32"
        elems = rows * n
        compulsory = 8 * elems                                    # read x once, write p once
        xs = _random_sets(rows, n, 2, cp)
        p = cuda.device_array((rows, n), np.float32)
        lse = cuda.device_array((rows,), np.float32)
        shape_results = []

        # ---- the copy of the same bytes: the ceiling this shape is held against
        copy_ms = float("nan")
        if cp is not None:
            cxs = [cp.asarray(x) for x in xs]
            dst = cp.empty((rows, n), cp.float32)
            r = ctx.measure(CHAPTER, "peer: D2D copy (cudaMemcpy)", config,
                            lambda src: dst.data.copy_from_device(src.data, src.nbytes), [(c,) for c in cxs],
                            flops=0, model_bytes=compulsory, is_peer=True, peak_memory=False,
                            note="the same bytes read and written: the ceiling",
                            extra={"rows": rows, "n": n})
            copy_ms = r.median_ms
            shape_results.append(r)
            del dst

        # ---- the kernel, default tiles and a few others
        for tiles in [default_tiles(n)] + _alt_tiles(n, ctx):
            tpr, rpb, k = tiles
            kern = make_row_softmax(tpr, rpb, k)
            grid, block = cdiv(rows, rpb), tpr * rpb
            passes = "read once (row in registers)" if n <= tpr * k else "read twice (second read mostly L2)"
            label = "row softmax kernel" + ("" if tiles == default_tiles(n) else " (other tiles)")
            r = ctx.measure(CHAPTER, label, config,
                            lambda x, kern=kern, grid=grid, block=block: kern[grid, block](x, p, lse),
                            [(x,) for x in xs], flops=0, model_bytes=compulsory + 4 * rows,
                            note=f"TPR={tpr} RPB={rpb} K={k}: {passes}", peak_memory=False,
                            extra={"rows": rows, "n": n, "tiles": f"TPR={tpr} RPB={rpb} K={k}"})
            kern[grid, block](xs[-1], p, lse)
            _check(p, xs[-1])
            shape_results.append(r)

        # ---- the launcher as a user calls it (allocates p and L each call)
        r = ctx.measure(CHAPTER, "softmax() launcher", config, lambda x: softmax(x, return_lse=True),
                        [(x,) for x in xs], flops=0, model_bytes=compulsory + 4 * rows,
                        note="kernel + output allocation + argument checks",
                        extra={"rows": rows, "n": n})
        shape_results.append(r)

        # ---- peers
        if torch is not None:
            txs = [torch.as_tensor(x, device="cuda") for x in xs]
            shape_results.append(ctx.measure(
                CHAPTER, "peer: torch.softmax fp32", config, lambda t: torch.softmax(t, dim=-1),
                [(t,) for t in txs], flops=0, model_bytes=compulsory, is_peer=True,
                extra={"rows": rows, "n": n}))
            del txs
            torch.cuda.empty_cache()
        if cp is not None:
            def cupy_softmax(c):
                e = cp.exp(c - c.max(axis=-1, keepdims=True))
                return e / e.sum(axis=-1, keepdims=True)

            shape_results.append(ctx.measure(
                CHAPTER, "peer: CuPy softmax expression", config, cupy_softmax,
                [(c,) for c in cxs], flops=0, model_bytes=compulsory, is_peer=True,
                note="max, exp(x - max), sum, divide: several passes and temporaries",
                extra={"rows": rows, "n": n}))
            del cxs
            cp.get_default_memory_pool().free_all_blocks()

        for r in shape_results:
            r.extra["pct_of_copy"] = round(100.0 * copy_ms / r.median_ms, 1) if copy_ms == copy_ms else "n/a"
        results.extend(shape_results)
        del xs, p, lse
    return results


# --------------------------------------------------------------------------- plot

_BARS = (("row softmax kernel", "row softmax kernel", "#1f77b4", None),
         ("softmax() launcher", "softmax() launcher", "#9ecae1", None),
         ("peer: torch.softmax fp32", "torch.softmax", "0.35", "//"),
         ("peer: CuPy softmax expression", "CuPy expression", "0.7", "//"))


def plot(results, path, *, title, simulator, ceiling=float("nan"), judged_by=None):
    """One question: what fraction of a same-size device copy's bandwidth each softmax
    reaches, shape by shape (the copy reads and writes the same bytes: the ceiling). In the
    simulator, the tour's generic plot."""
    from kernels.bench.tour import plot_results

    shapes = []
    for r in results:
        if r.config not in shapes and "pct_of_copy" in r.extra:
            shapes.append(r.config)
    if simulator or len(shapes) < 2:
        return plot_results(results, path, title=title, simulator=simulator, ceiling=ceiling, judged_by=judged_by)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pct = {(r.kernel, r.config): float(r.extra["pct_of_copy"]) for r in results if "pct_of_copy" in r.extra}
    fig, ax = plt.subplots(figsize=(13, 5.6))
    width = 0.8 / len(_BARS)
    for k, (kernel, label, color, hatch) in enumerate(_BARS):
        xs = [g + (k - (len(_BARS) - 1) / 2) * width for g, c in enumerate(shapes) if (kernel, c) in pct]
        ys = [pct[(kernel, c)] for c in shapes if (kernel, c) in pct]
        ax.bar(xs, ys, width, color=color, hatch=hatch, edgecolor="white" if hatch else "black", lw=0.5, label=label)
        for x, y in zip(xs, ys):
            ax.text(x, y + 1, f"{y:.0f}", ha="center", va="bottom", fontsize=9)
    ax.axhline(100, color="0.3", linestyle=":", lw=1.5)
    ax.text(len(shapes) - 0.5, 101, "device copy of the same bytes = 100%", ha="right", va="bottom", fontsize=10,
            color="0.3")
    labels = []
    for c in shapes:
        twice = any(r.config == c and r.kernel == "row softmax kernel" and "read twice" in r.note for r in results)
        labels.append(c.replace(" fp32", "").replace(" n=", "\nn = ").replace("rows=", "rows = ")
                      + ("\n(read twice)" if twice else ""))
    ax.set_xticks(range(len(shapes)), labels, fontsize=10.5)
    ax.set_ylim(0, 118)
    ax.set_ylabel("% of a device copy's bandwidth (higher is better)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=10.5, loc="upper left", ncol=4)
    ours = [pct[("row softmax kernel", c)] for c in shapes if ("row softmax kernel", c) in pct]
    torch_ = [pct[("peer: torch.softmax fp32", c)] for c in shapes if ("peer: torch.softmax fp32", c) in pct]
    ax.set_title(f"The row softmax kernel reads and writes at {min(ours):.0f}–{max(ours):.0f}% of a device copy's rate "
                 f"(torch.softmax: {min(torch_):.0f}–{max(torch_):.0f}%);\nthe launcher pays for allocating its "
                 "outputs; CuPy's expression makes several passes", fontsize=12)
    fig.suptitle(f"{title}; fp32, bytes counted: x read once, P and L written once", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
