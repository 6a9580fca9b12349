"""The figures of slides/02_tiled_matmul.md: rung 3's thread -> register micro-tile map.

    python slides/img/make_02_figures.py      # writes slides/img/02_*.png

No GPU needed. Which thread owns which entry of the BM x BN tile of C is computed by the
index arithmetic of ``kernels.tiled_matmul.make_register_tiles`` (see ``owners``), for the
production tiling (``RUNG3_CONFIGS[RUNG3_DEFAULT]``) and a small one of the same shape.
"""

from __future__ import annotations

from figures import plt, save  # noqa: E402  (first: the repository on the path, kernels, matplotlib without a display)
import matplotlib  # noqa: E402

import numpy as np  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from kernels.tiled_matmul import RUNG3_CONFIGS, RUNG3_DEFAULT, make_register_tiles  # noqa: E402

SHADES = (0.0, 0.3, 0.5, 0.68)                    # ty % 4 -> how much white is mixed in

plt.rcParams.update({"font.size": 13, "axes.titlesize": 15})



def owners(BM, BN, BK, TM, TN):
    """The thread that owns each entry of the BM x BN tile of C, by make_register_tiles'
    index arithmetic (its epilogue's store of acc[i, j]):

        tx = tid % (BN / TN),  ty = tid // (BN / TN),  VM = min(4, TM),  VN = min(4, TN)
        row = (i // VM) * STEP_M + ty * VM + i % VM        STEP_M = (BM / TM) * VM,  i < TM
        col = (j // VN) * STEP_N + tx * VN + j % VN        STEP_N = (BN / TN) * VN,  j < TN

    Checks that every entry has exactly one owner (and that the factory accepts the tiling)."""
    make_register_tiles(BM, BN, BK, TM, TN)      # raises on a tiling the kernel refuses
    THREADS_N, THREADS_M = BN // TN, BM // TM
    VM, VN = min(4, TM), min(4, TN)
    STEP_M, STEP_N = THREADS_M * VM, THREADS_N * VN
    own = np.full((BM, BN), -1)
    for tid in range(THREADS_M * THREADS_N):
        tx, ty = tid % THREADS_N, tid // THREADS_N
        for i in range(TM):
            for j in range(TN):
                r = (i // VM) * STEP_M + ty * VM + i % VM
                c = (j // VN) * STEP_N + tx * VN + j % VN
                assert own[r, c] == -1, f"entry ({r}, {c}) owned twice"
                own[r, c] = tid
    assert (own >= 0).all(), "an entry of C without an owner"
    return own, THREADS_M, THREADS_N


def runs(own):
    """The rectangles of equal owner (r0, c0, h, w, tid), each a whole piece of a micro-tile."""
    R, C = own.shape
    seen = np.zeros_like(own, bool)
    out = []
    for r in range(R):
        for c in range(C):
            if seen[r, c]:
                continue
            tid = own[r, c]
            w = 1
            while c + w < C and own[r, c + w] == tid:
                w += 1
            h = 1
            while r + h < R and (own[r + h, c:c + w] == tid).all():
                h += 1
            seen[r:r + h, c:c + w] = True
            out.append((r, c, h, w, tid))
    return out


def thread_color(TX):
    """A thread's colour: its hue from tx (same hue: same columns), lighter with ty % 4."""
    def color(tid):
        tx, ty = tid % TX, tid // TX
        palette = plt.cm.tab10.colors + plt.cm.Dark2.colors
        base = np.array(matplotlib.colors.to_rgb(palette[tx % len(palette)]))
        f = SHADES[ty % 4]
        return tuple(base * (1 - f) + f)

    def text(tid):
        return "white" if SHADES[(tid // TX) % 4] < 0.4 else "black"
    return color, text


def draw_owned(ax, own, title, colors, text_color=None, labels=True, ticks=4, highlight=None, fs=10, row0=0):
    """A tile (or rows ``row0`` onwards of one), each entry coloured by its owner, each piece
    outlined (and named t<tid> where ``labels``)."""
    R, C = own.shape
    img = np.array([[colors(tid) for tid in row] for row in own])
    ax.imshow(img, interpolation="nearest", extent=(0, C, row0 + R, row0), aspect="equal")
    for r0, c0, h, w, tid in runs(own):
        strong = highlight is None or tid in highlight
        ax.add_patch(Rectangle((c0, row0 + r0), w, h, fill=False, ec="0.15" if strong else "0.75",
                               lw=1.0 if strong else 0.4))
        if labels and strong:
            ax.text(c0 + w / 2, row0 + r0 + h / 2, f"t{tid}", ha="center", va="center", fontsize=fs,
                    color=text_color(tid) if text_color else "white", fontweight="bold")
    ax.set_xticks(range(0, C + 1, ticks))
    ax.set_yticks(range(row0, row0 + R + 1, ticks))
    ax.tick_params(labelsize=9.5, length=2, top=True, labeltop=True, bottom=False, labelbottom=False)
    if title:
        ax.set_title(title, fontsize=12.5, pad=8)


def figure_small(BM=32, BN=32, BK=8, TM=8, TN=8, who=5, k=2):
    """A small rung-3 block of the production's shape (8 x 8 a thread, runs of 4): every
    thread's piece of C, and, for one thread, the A rows and B columns it reads a k-step."""
    own, THREADS_M, THREADS_N = owners(BM, BN, BK, TM, TN)
    color, text = thread_color(THREADS_N)
    tx, ty = who % THREADS_N, who // THREADS_N
    rows = sorted({r for r in range(BM) if (own[r] == who).any()})
    cols = sorted({c for c in range(BN) if (own[:, c] == who).any()})

    fig = plt.figure(figsize=(12.8, 7.0))
    grid = fig.add_gridspec(2, 3, width_ratios=[BK, BN, 34], height_ratios=[BK, BM], wspace=0.08, hspace=0.06)
    # B tile (BK x BN): the TN columns this thread reads at every k-step
    ax = fig.add_subplot(grid[0, 1])
    light, dark = matplotlib.colors.to_rgb("#f6b26b"), matplotlib.colors.to_rgb("#b45f06")
    b = np.full((BK, BN, 3), 0.95)
    b[:, cols] = light
    b[k, cols] = dark
    ax.imshow(b, interpolation="nearest", extent=(0, BN, BK, 0), aspect="equal")
    ax.set_xticks(range(0, BN + 1, 4))
    ax.set_yticks([0, BK])
    ax.tick_params(labelsize=9.5, length=2, top=True, labeltop=True, bottom=False, labelbottom=False)
    ax.set_title(f"B tile: BK × BN = {BK} × {BN}", fontsize=12.5, pad=6)
    # A tile (BM x BK): the TM rows this thread reads at every k-step (As holds it transposed)
    ax = fig.add_subplot(grid[1, 0])
    a = np.full((BM, BK, 3), 0.95)
    a[rows] = light
    a[rows, k] = dark
    ax.imshow(a, interpolation="nearest", extent=(0, BK, BM, 0), aspect="equal")
    ax.set_xticks([0, BK])
    ax.set_yticks(range(0, BM + 1, 4))
    ax.tick_params(labelsize=9.5, length=2)
    ax.set_ylabel(f"A tile: BM × BK = {BM} × {BK}", fontsize=12.5)
    # C tile: every thread's micro-tile
    ax = fig.add_subplot(grid[1, 1])
    draw_owned(ax, own, None, color, text, fs=10.5)
    ax.tick_params(labeltop=False)
    for r0, c0, h, w, tid in runs(own):
        if tid == who:
            ax.add_patch(Rectangle((c0, r0), w, h, fill=False, ec="black", lw=3.2))
    ax.text(BN / 2, BM + 1.2, f"C tile: BM × BN = {BM} × {BN}, {THREADS_M * THREADS_N} threads, "
            f"{TM} × {TN} a thread", ha="center", va="top", fontsize=12.5)
    ax = fig.add_subplot(grid[:, 2])
    ax.axis("off")
    ax.text(0.02, 0.98,
            f"make_register_tiles({BM}, {BN}, {BK}, {TM}, {TN})\n"
            f"threads: {THREADS_M} down × {THREADS_N} across,\n"
            f"tx = t % {THREADS_N}, ty = t // {THREADS_N}\n\n"
            f"thread (ty, tx) owns\n"
            f"  rows 4ty … 4ty+3, then {THREADS_M * 4} further\n"
            f"  cols 4tx … 4tx+3, then {THREADS_N * 4} further\n\n"
            f"t{who} = (ty {ty}, tx {tx}), outlined:\n"
            f"  rows {', '.join(str(r) for r in rows[:1])}–{rows[3]}, {rows[4]}–{rows[-1]}\n"
            f"  cols {cols[0]}–{cols[3]}, {cols[4]}–{cols[-1]}\n\n"
            f"k-step k = {k} (dark): it reads A[its rows, k]\n"
            f"and B[k, its cols], {TM} + {TN} floats in runs\n"
            f"of 4 (one 16-byte load each), and does\n"
            f"{TM} × {TN} = {TM * TN} FMAs into registers:\n"
            f"an outer product; BK = {BK} of them a tile",
            va="top", ha="left", fontsize=12, transform=ax.transAxes, linespacing=1.3)
    fig.suptitle(f"Chapter 2, rung 3: each thread keeps a TM × TN = {TM} × {TN} micro-tile of C in registers:\n"
                 f"{TM} + {TN} shared loads feed {TM * TN} FMAs a k-step (small block, production shape)",
                 fontsize=14)
    fig.subplots_adjust(left=0.05, right=0.995, bottom=0.06, top=0.83)
    save(fig, "02_register_tiles_small.png")


def figure_production():
    """The production tiling: the whole 128 x 128 tile with warp 0 coloured, and warp 0's rows."""
    BM, BN, BK, TM, TN = RUNG3_CONFIGS[RUNG3_DEFAULT]
    own, THREADS_M, THREADS_N = owners(BM, BN, BK, TM, TN)
    color, text = thread_color(THREADS_N)
    whole = lambda tid: color(tid) if tid < 32 else (0.96, 0.96, 0.96)  # noqa: E731
    step = 4 * THREADS_M                           # rows between a thread's two row runs
    fig = plt.figure(figsize=(12.8, 5.3))
    grid = fig.add_gridspec(3, 2, width_ratios=[1, 3.1], height_ratios=[1, 1, 1.25], wspace=0.08, hspace=0.45)
    ax = fig.add_subplot(grid[:, 0])
    draw_owned(ax, own, f"the whole tile: {BM} × {BN}\n{THREADS_M * THREADS_N} threads, warp 0 coloured", whole,
               labels=False, ticks=32, highlight=set(range(32)))
    ax.set_ylabel("row of the C tile")
    for k, r0 in enumerate((0, step)):             # warp 0 = ty 0, 1: rows 0..7 and step..step+7
        ax = fig.add_subplot(grid[k, 1])
        draw_owned(ax, own[r0:r0 + 8], None, color, text, ticks=16, fs=8.5, row0=r0)
        ax.set_yticks([r0, r0 + 4, r0 + 8])
        if k == 1:
            ax.text(BN / 2, r0 - 7.5, "⋮  rows 8 … 63: warps 1 … 7, the same pattern 8 rows down each  ⋮",
                    ha="center", va="center", fontsize=12, color="0.3")
        if k == 0:
            ax.set_title(f"warp 0 (t0 … t31 = ty 0, 1): rows 0–7 and {step}–{step + 7}", fontsize=12.5, pad=8)
    ax = fig.add_subplot(grid[2, 1])
    ax.axis("off")
    ax.text(0.0, 0.95,
            f"RUNG3_DEFAULT = \"{RUNG3_DEFAULT}\": BM = {BM}, BN = {BN}, BK = {BK}, TM = {TM}, TN = {TN};\n"
            f"{THREADS_M} × {THREADS_N} threads, t = {THREADS_N}·ty + tx. Thread (ty, tx): rows 4ty … 4ty+3 "
            f"and {step}+4ty …,\ncols 4tx … 4tx+3 and {4 * THREADS_N}+4tx … . A half-warp (16 threads, one ty) "
            f"reads 16 consecutive\nfloat4s of a B row: no bank conflicts. Hue = tx, lighter = ty.",
            va="top", ha="left", fontsize=12, transform=ax.transAxes, linespacing=1.35)
    fig.suptitle(f"Chapter 2, rung 3 as run on the H100: {TM} × {TN} a thread as 2 × 2 pieces of 4 × 4,\n"
                 f"{step} rows and {4 * THREADS_N} columns apart", fontsize=14)
    fig.subplots_adjust(left=0.06, right=0.985, bottom=0.0, top=0.83)
    save(fig, "02_register_tiles_production.png")


def main():
    figure_small()
    figure_production()


if __name__ == "__main__":
    main()
