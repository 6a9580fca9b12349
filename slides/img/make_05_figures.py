"""The figures of slides/05_flash_backward.md, drawn from kernels.flash_backward's own tiles.

    python slides/img/make_05_figures.py      # writes slides/img/05_*.png

No GPU needed. The tile shapes are the production tiles (``GPU_TILES``) and the loops are
those of ``make_dkdv_body`` and ``make_dq_body`` as ``launch`` runs them: the D pre-pass,
then the dK/dV kernel (with atomic dQ by default), then, with ``dq_mode="separate"``, the
dQ kernel.
"""

from __future__ import annotations

from figures import plt, save  # noqa: E402  (first: the repository on the path, kernels, matplotlib without a display)

from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

from kernels.base.backward_tiles import GPU_TILES  # noqa: E402
from kernels.flash_backward import DQ_MODES  # noqa: E402

HBM = "#f4cccc"          # the colours of slides/img/00_memory_hierarchy.png and 04_dataflow.png
HBM_EDGE = "#cc4125"
Q_COLOR = "#e69138"      # the query side: Q_i, dO_i, L_i, D_i, dQ_i
KV_COLOR = "#3d85c6"     # the key side: K_j, V_j, dK_j, dV_j
SP_COLOR = "#8e7cc3"     # S, P, dP, dS: never in HBM
DONE, TODO = "#b4a7d6", "white"

plt.rcParams.update({"font.size": 13, "axes.titlesize": 15})
assert set(DQ_MODES) == {"atomic", "separate"}, "the figure draws these two dQ modes"



def arrow(ax, start, end, color="0.15", lw=2.2, rad=0.0, ms=20):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=ms, color=color, lw=lw,
                                 connectionstyle=f"arc3,rad={rad}", shrinkA=1, shrinkB=1))


# --------------------------------------------------------------------------- 1. the two loop orders

def tile_grid(ax, x0, y0, size, rows, cols, cur, walk, done):
    """The Tr x Tc grid of (query tile i, key tile j) pairs, drawn size x size; ``walk``
    "down" (a block owns column cur[1]) or "across" (a block owns row cur[0]); ``done``:
    how many steps of the walk are behind the current one."""
    h, w = size / rows, size / cols
    ci, cj = cur
    for i in range(rows):
        for j in range(cols):
            mine = (j == cj) if walk == "down" else (i == ci)
            step = i if walk == "down" else j
            fc = TODO
            if mine:
                fc = SP_COLOR if (i, j) == cur else (DONE if step < done else "#ece8f6")
            ax.add_patch(Rectangle((x0 + j * w, y0 + size - (i + 1) * h), w, h, fc=fc, ec="0.55", lw=0.5))
    ax.add_patch(Rectangle((x0, y0), size, size, fill=False, ec="0.2", lw=1.2))
    return h, w


def figure_loops(d=64, n=1024):
    """Which loop each kernel runs and where each gradient is summed: the dK/dV kernel (K/V
    tiles outer, query tiles inner; dQ by atomics: the default) and the dQ kernel of
    dq_mode="separate" (query tiles outer, key tiles inner)."""
    t = GPU_TILES[d]
    Tr, Tc = n // t.Br, n // t.Bc                 # the dK/dV kernel's tiles
    Tr2, Tc2 = n // t.dq_Br, n // t.dq_Bc         # the dQ kernel's
    fig, ax = plt.subplots(figsize=(12.8, 7.2))
    ax.set_xlim(0, 16)
    ax.set_ylim(0, 9)
    ax.axis("off")

    # ---- the launches, in order
    ax.text(8, 8.55, "launch order:   ① D = rowsum(dO ∘ O)  (and dQ = 0 when atomic)   →   ② dK/dV kernel   →   "
            "③ dQ kernel (separate only)", ha="center", va="center", fontsize=12.5,
            bbox=dict(fc="#f3f3f3", ec="0.6", boxstyle="round,pad=0.35"))

    size = 4.6
    # ---- ② the dK/dV kernel: one block a key tile j, walking down the query tiles
    x0, y0 = 0.75, 1.85
    cur = (5, 2)
    h, w = tile_grid(ax, x0, y0, size, Tr, Tc, cur, "down", cur[0])
    ax.text(4.1, 7.65, f"② dK/dV kernel: grid (Tc, B·H), one block a key tile j\n"
            f"default dq_mode=\"atomic\"  (Br = {t.Br}, Bc = {t.Bc}, {t.threads} threads)", ha="center",
            va="center", fontsize=13, fontweight="bold")
    ax.text(x0 + size / 2, y0 + size + 0.1, f"key tiles j  ({Tc} × Bc = {t.Bc} keys)", ha="center",
            va="bottom", fontsize=11.5, color=KV_COLOR)
    ax.text(x0 - 0.1, y0 + size / 2, f"query tiles i  ({Tr} × Br = {t.Br} rows)", rotation=90, ha="right",
            va="center", fontsize=11.5, color=Q_COLOR)
    cx = x0 + (cur[1] + 0.5) * w
    arrow(ax, (cx, y0 + size - 0.05), (cx, y0 + 0.05), color="0.15", lw=2.2)
    ax.text(cx + w / 2 + 0.08, y0 + size - 0.08, "K$_j$, V$_j$ kept in\nshared memory;\nper step i:\n"
            "  dV$_j$ += P$^T$dO$_i$\n  dK$_j$ += τ dS$^T$Q$_i$", ha="left", va="top", fontsize=10.5,
            color=KV_COLOR, fontweight="bold", bbox=dict(fc="white", ec="none", alpha=0.9, pad=1.5))
    # dK_j, dV_j under the column: summed on chip, written once
    ax.add_patch(Rectangle((cx - 0.75, y0 - 0.9), 1.5, 0.55, fc=KV_COLOR, ec="0.2"))
    ax.text(cx, y0 - 0.62, "dK$_j$, dV$_j$", ha="center", va="center", color="white", fontsize=12.5,
            fontweight="bold")
    arrow(ax, (cx, y0), (cx, y0 - 0.35), color="0.15", lw=2.2, ms=14)
    ax.text(cx + 0.85, y0 - 0.62, "summed down the column on chip,\nwritten to HBM once", ha="left",
            va="center", fontsize=11, color=KV_COLOR)
    ax.text(x0, y0 - 1.15, "Q$_i$, dO$_i$, L$_i$, D$_i$ come from HBM at every step: each block reads all of them",
            ha="left", va="center", fontsize=11, color=Q_COLOR)
    # dQ in HBM, to the right: every block adds its piece of every dQ_i
    qx = x0 + size + 0.3
    for i in range(Tr):
        ax.add_patch(Rectangle((qx, y0 + size - (i + 1) * h), 0.38, h, fc=HBM if i != cur[0] else Q_COLOR,
                               ec=HBM_EDGE, lw=0.6))
    ax.text(qx + 0.19, y0 + size + 0.1, "dQ", ha="center", va="bottom", fontsize=12, fontweight="bold")
    ax.text(qx + 0.19, y0 - 0.1, "HBM", ha="center", va="top", fontsize=10.5, color=HBM_EDGE)
    cy = y0 + size - (cur[0] + 0.5) * h
    arrow(ax, (x0 + (cur[1] + 1) * w, cy), (qx, cy), color=Q_COLOR, lw=2.6)
    ax.text(qx + 0.48, cy, "dQ$_i$ += τ dS K$_j$:\nfloat32 atomic\nadds from every\nblock j; their order\n"
            "varies, so dQ's\nlast bits do", ha="left", va="center", fontsize=11, color="#b45f06")

    # ---- ③ the dQ kernel: one block a query tile i, walking across the key tiles
    x1 = 9.0
    cur2 = (3, 9)
    h2, w2 = tile_grid(ax, x1, y0, size, Tr2, Tc2, cur2, "across", cur2[1])
    ax.text(x1 + size / 2 + 0.4, 7.65, f"③ dQ kernel (dq_mode=\"separate\"): grid (Tr, B·H),\n"
            f"one block a query tile i  (Br = {t.dq_Br}, Bc = {t.dq_Bc}, {t.dq_threads} thr.)",
            ha="center", va="center", fontsize=13, fontweight="bold")
    ax.text(x1 + size / 2, y0 + size + 0.1, f"key tiles j  ({Tc2} × Bc = {t.dq_Bc} keys)", ha="center",
            va="bottom", fontsize=11.5, color=KV_COLOR)
    ax.text(x1 - 0.1, y0 + size / 2, f"query tiles i  ({Tr2} × Br = {t.dq_Br} rows)", rotation=90, ha="right",
            va="center", fontsize=11.5, color=Q_COLOR)
    ry = y0 + size - (cur2[0] + 0.5) * h2
    arrow(ax, (x1 + 0.05, ry), (x1 + size - 0.05, ry), color="0.15", lw=2.2)
    ax.text(x1 + 0.1, ry + h2 / 2 + 0.05, "Q$_i$, dO$_i$, L$_i$, D$_i$ kept in shared memory;\n"
            "per step j: dQ$_i$ += τ dS K$_j$", ha="left", va="bottom", fontsize=10.5, color=Q_COLOR,
            fontweight="bold", bbox=dict(fc="white", ec="none", alpha=0.9, pad=1.5))
    ax.add_patch(Rectangle((x1 + size + 0.35, ry - 0.3), 0.9, 0.6, fc=Q_COLOR, ec="0.2"))
    ax.text(x1 + size + 0.8, ry, "dQ$_i$", ha="center", va="center", color="white", fontsize=12.5,
            fontweight="bold")
    arrow(ax, (x1 + size, ry), (x1 + size + 0.35, ry), color="0.15", lw=2.2, ms=14)
    ax.text(x1 + size + 0.8, ry - 0.4, "summed along\nthe row on chip,\nwritten once:\nthe same bits\n"
            "every run", ha="center", va="top", fontsize=10.5, color="#b45f06")
    ax.text(x1 + size / 2, y0 - 0.3, "K$_j$, V$_j$ come from HBM at every step; S, P, dP, dS are\n"
            "recomputed a second time (14 N²d FLOPs a head, not 10);\n② then runs without atomics",
            ha="center", va="top", fontsize=11)

    # ---- legend and cost
    ax.add_patch(Rectangle((0.3, 0.08), 0.35, 0.25, fc=SP_COLOR, ec="0.4"))
    ax.text(0.75, 0.2, "the (i, j) tile the block works on now: S, P, dP, dS on chip, never in HBM", ha="left",
            va="center", fontsize=11)
    ax.add_patch(Rectangle((9.8, 0.08), 0.35, 0.25, fc=DONE, ec="0.4"))
    ax.text(10.25, 0.2, f"tiles done (drawn at N = {n}, d = {d})", ha="left", va="center", fontsize=11)

    fig.suptitle("Chapter 5's backward: dK, dV sum over query tiles, dQ over key tiles; one loop order\n"
                 "keeps one side on chip, so dQ comes by atomic adds (default) or from a second kernel",
                 fontsize=15)
    fig.subplots_adjust(left=0.0, right=1.0, bottom=0.0, top=0.89)
    save(fig, "05_loops.png")


def main():
    figure_loops()


if __name__ == "__main__":
    main()
