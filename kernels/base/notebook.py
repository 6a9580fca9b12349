"""What the notebooks share: printing a part of a kernel's source, a ladder's timings, an
A/B's rows, and the picture of mma.sync's fragments.

A chapter shows its kernel a piece at a time, next to the text that explains that piece:
``show_source(make_stream_k, "for g in range(", "`last` is rewritten")`` prints the lines
of the function's source from the first line containing the one marker to the first line
after it containing the other (and ``more`` lines beyond).
"""

from __future__ import annotations

import inspect

__all__ = ["show_source", "show_ladder", "show_ab", "draw_fragments"]


def show_source(fn, first: str, last: str, more: int = 0) -> None:
    """Print ``fn``'s source from the line containing ``first`` to the next line containing
    ``last`` (and ``more`` lines after it). ValueError if a marker is not found."""
    lines = inspect.getsource(fn).splitlines()
    i = next((n for n, line in enumerate(lines) if first in line), None)
    if i is None:
        raise ValueError(f"first: {first!r} is not in the source of {fn.__name__}")
    j = next((n for n, line in enumerate(lines[i:], i) if last in line), None)
    if j is None:
        raise ValueError(f"last: {last!r} does not follow {first!r} in the source of {fn.__name__}")
    print("\n".join(lines[i:j + 1 + more]))


def show_ladder(path) -> None:
    """Print the rows of a committed ladder results file (``python -m kernels.bench.<chapter>
    --ladder``): each rung's time, TFLOP/s and time over the last rung's, causal and not."""
    from pathlib import Path

    from kernels.bench.harness import read_csv

    path = Path(path)
    if not path.exists():
        print(f"(no {path} yet: run the chapter's bench with --ladder on a GPU)")
        return
    env, rows = read_csv(path)
    print(env.get("device", "?"))
    for causal in ("False", "True"):
        these = [r for r in rows if r["config"].endswith(f"causal={causal}")]
        for r in these:
            print(f"  {r['kernel']:<38} {r['config']:<40} {r['median_ms']:9.2f} ms  "
                  f"{r['tflops']:6.2f} TFLOP/s  {r['median_ms'] / these[-1]['median_ms']:6.1f}x the last")


def show_ab(path, over: str, over_name: str) -> None:
    """Print the rows of a committed A/B of kernel variants (bare launches taking turns, the
    peer SDPA memory-efficient in the same rounds): config, variant, median time, its speedup
    in column ``over`` (over the variant named ``over_name``), over SDPA, and its error over
    float32 NumPy's."""
    import csv
    from pathlib import Path

    path = Path(path)
    if not path.exists():
        print(f"(no {path} yet: it is written by an A/B run on a GPU)")
        return
    with open(path) as fh:
        rows = list(csv.DictReader(line for line in fh if not line.startswith("#")))
    width = min(58, max(len(r["variant"]) for r in rows))
    for r in rows:
        error = float(r["error_vs_float32"] or "nan")
        error = f"error {error:.2f}x float32's" if error == error else "(error not measured)"
        print(f"{r['config']:36s} {r['variant'][:width]:{width}s} {float(r['median_ms']):7.3f} ms  "
              f"{float(r[over]):.2f}x {over_name}  {float(r['vs_sdpa_mem_eff']):.2f}x SDPA m-e  {error}")


def draw_fragments():
    """The figure of which lane holds which element of mma.sync m16n8k16's A, B and C/D,
    drawn from ``kernels.base.mma``'s position table (the one its emulation and tests use)."""
    import matplotlib.pyplot as plt
    import numpy as np

    from kernels.base import mma as tc

    fig, axes = plt.subplots(1, 3, figsize=(12, 4.2), gridspec_kw={"width_ratios": [16, 8, 8]})
    for ax, (name, position, count, shape) in zip(axes, (("A (16 x 16): a[0..7]", tc.a_position, 8, (16, 16)),
                                                        ("B (16 x 8): b[0..3]", tc.b_position, 4, (16, 8)),
                                                        ("C, D (16 x 8, fp32): c[0..3]", tc.c_position, 4, (16, 8)))):
        owner = np.zeros(shape, int)
        for lane in range(32):
            for i in range(count):
                owner[position(lane, i)] = lane
        ax.imshow(owner % 4, cmap="Pastel1", vmin=0, vmax=8)
        for (r, c), lane in np.ndenumerate(owner):
            ax.text(c, r, str(lane), ha="center", va="center", fontsize=6)
        ax.set_title(name, fontsize=9)
        ax.set_xticks([]), ax.set_yticks([])
    fig.suptitle("which lane holds which element (colour: lane % 4, the lane's place in its quad)", fontsize=9)
    fig.tight_layout()
    return fig
