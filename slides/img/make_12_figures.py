"""The figures of slides/12_tensor_core_backward.md (and notebook 12), drawn from the
fragment layout in kernels.base.mma and the tiles of kernels.tensor_core_backward.

    python slides/img/make_12_figures.py      # writes slides/img/12_*.png

No GPU needed:

* 12_operands.png: the five products of one warp and one chunk of 16 queries, and where
  each operand comes from (registers, shared memory by ldmatrix or ldmatrix.trans).
* 12_fragments.png: one lane's elements of S^T = K_w Q_c^T (this chapter) and of
  S = Q_c K_w^T (chapter 8's orientation) against the A fragment that dV += P^T dO_c needs:
  the first is in place, element by element; the second is not.
"""

from __future__ import annotations

from figures import plt, save  # noqa: E402  (first: the repository on the path, kernels, matplotlib without a display)

from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

from kernels.base.mma import a_position, c_position  # noqa: E402

plt.rcParams.update({"font.size": 13, "axes.titlesize": 15})

# Where an operand comes from: (colour, legend)
KEPT = ("#b6d7a8", "registers, loaded once a block (ldmatrix; from shared memory each chunk at d = 128)")
ACC_AS_A = ("#6aa84f", "registers: an accumulator of this chunk, packed to fp16 / bf16 as the A operand")
LDM = ("#9fc5e8", "shared memory, ldmatrix")
LDM_T = ("#8e7cc3", "shared memory, ldmatrix.trans")
ACC = ("#fce5cd", "accumulator in registers (this chunk)")
ACC_KEPT = ("#f6b26b", "accumulator in registers over every query tile; written once")
ATOMIC = ("#e06666", "accumulator in registers, then added to dQ in HBM (float32 atomic adds)")

PRODUCTS = [   # product, (A, source), (B, source), (accumulator, source)
    ("S^T = K_w Q_c^T", ("K_w", KEPT), ("Q_c^T (Q_i)", LDM), ("S^T: 16 keys x 16 queries", ACC)),
    ("dP^T = V_w dO_c^T", ("V_w", KEPT), ("dO_c^T (dO_i)", LDM), ("dP^T", ACC)),
    ("dV_w += P^T dO_c", ("P^T = exp2(S^T - L)", ACC_AS_A), ("dO_c (dO_i)", LDM_T), ("dV_w", ACC_KEPT)),
    ("dK_w += dS^T Q_c", ("dS^T = P^T o (dP^T - D)", ACC_AS_A), ("Q_c (Q_i)", LDM_T), ("dK_w", ACC_KEPT)),
    ("dQ_i += dS K_j", ("dS (stored as dS^T)", LDM_T), ("K_j", LDM_T), ("dQ_i: a warp's 16-row pieces", ATOMIC)),
]


def arrow(ax, start, end, color="0.15", lw=2.0, rad=0.0, ms=18):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=ms, color=color, lw=lw,
                                 connectionstyle=f"arc3,rad={rad}", shrinkA=2, shrinkB=2))


def figure_operands():
    """The five products as a table: a row a product, a cell an operand, coloured by where
    the operand comes from; arrows where an accumulator becomes a later product's A."""
    fig, ax = plt.subplots(figsize=(15, 8.4))
    ax.set_xlim(0, 15)
    ax.set_ylim(-0.6, 7.7)
    ax.axis("off")
    xs = (0.1, 3.45, 8.1, 11.65)                    # the columns: product, accumulator, A, B
    widths = (3.2, 3.4, 3.4, 3.3)
    top, h = 7.0, 0.9
    for x, w, head in zip(xs, widths, ("a warp, a chunk c of 16 queries", "C, D (fp32)", "A (16 x 16)",
                                       "B (16 x 8 a tile)")):
        ax.text(x + w / 2, top + 0.2, head, ha="center", va="bottom", fontsize=13, weight="bold")
    cells = {}
    for r, (name, a, b, acc) in enumerate(PRODUCTS):
        y = top - (r + 1) * (h + 0.25)
        ax.add_patch(Rectangle((xs[0], y), widths[0], h, fc="#f3f3f3", ec="0.4"))
        ax.text(xs[0] + widths[0] / 2, y + h / 2, name, ha="center", va="center", fontsize=13.5, family="monospace")
        for c, (label, (colour, _)) in zip((1, 2, 3), (acc, a, b)):
            ax.add_patch(Rectangle((xs[c], y), widths[c], h, fc=colour, ec="0.4"))
            ax.text(xs[c] + widths[c] / 2, y + h / 2, label, ha="center", va="center", fontsize=12.5)
            cells[(r, c)] = (xs[c], y, widths[c], h)
    # the accumulators of S^T and dP^T are the A operands of dV and dK: the same registers
    for src, dst in (((0, 1), (2, 2)), ((1, 1), (3, 2))):
        x, y, w, hh = cells[src]
        x2, y2, w2, h2 = cells[dst]
        arrow(ax, (x + w, y + hh / 2), (x2, y2 + h2 / 2), color="#38761d", rad=-0.2)
    ax.text((xs[1] + widths[1] + xs[2]) / 2, cells[(4, 1)][1] + cells[(4, 1)][3] / 2,
            "the same\nregisters:\nno shuffle,\nno shared\nmemory", ha="center", va="center", fontsize=11,
            color="#38761d")
    x, y, w, hh = cells[(3, 2)]
    x2, y2, w2, h2 = cells[(4, 2)]
    arrow(ax, (x + w / 2, y), (x2 + w2 / 2, y2 + h2), color="#674ea7")
    ax.text(x + w / 2 + 0.15, (y + y2 + h2) / 2, "dS^T stored to shared memory", fontsize=11, color="#674ea7",
            va="center")
    legend = (KEPT, ACC_AS_A, LDM, LDM_T, ACC, ACC_KEPT, ATOMIC)
    handles = [Rectangle((0, 0), 1, 1, fc=c, ec="0.4") for c, _ in legend]
    ax.legend(handles, [t for _, t in legend], loc="lower center", bbox_to_anchor=(0.5, -0.01), ncol=2,
              fontsize=11, frameon=False)
    ax.set_title("The five products of the backward: where each operand comes from", pad=2)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- 2. the fragments

def lane_cells(lane, transposed):
    """{(key, query): label} of the 16 x 16 tile P^T (keys x queries) that ``lane`` holds in
    its two accumulator tiles n = 0, 1: of S^T = K_w Q_c^T (``transposed``: this chapter,
    tile n = queries 8n..8n+7), or of S = Q_c K_w^T (chapter 8: rows are queries, tile n =
    keys 8n..8n+7)."""
    out = {}
    for n in range(2):
        for e in range(4):
            r, c = c_position(lane, e)
            key, query = (r, c + 8 * n) if transposed else (c + 8 * n, r)
            out[(key, query)] = f"c{n}[{e}]"
    return out


def fragment_panel(ax, lane, transposed):
    held = lane_cells(lane, transposed)
    wanted = {a_position(lane, i): f"a[{i}]" for i in range(8)}
    for key in range(16):
        for query in range(16):
            second = query >= 8 if transposed else key >= 8          # accumulator tile n = 1
            fc = "#6aa84f" if (key, query) in held else ("#e6e6e6" if second else "#f6f6f6")
            ax.add_patch(Rectangle((query, 15 - key), 1, 1, fc=fc, ec="0.75", lw=0.5))
    for (key, query), label in wanted.items():
        ax.add_patch(Rectangle((query, 15 - key), 1, 1, fill=False, ec="#cc0000", lw=2.6))
        text = label + ("\n" + held[(key, query)] if (key, query) in held else "")
        ax.text(query + 0.5, 15 - key + 0.5, text, ha="center", va="center", fontsize=8.5, linespacing=0.9)
    for (key, query), label in held.items():
        if (key, query) not in wanted:
            ax.text(query + 0.5, 15 - key + 0.5, label, ha="center", va="center", fontsize=8.5, color="white")
    if transposed:                                    # the two accumulator tiles: queries 0-7 | 8-15
        ax.axvline(8, color="0.3", lw=1.5)
    else:                                             # keys 0-7 | 8-15
        ax.axhline(8, color="0.3", lw=1.5)
    ax.set_xlim(0, 16)
    ax.set_ylim(0, 16)
    ax.set_aspect("equal")
    ax.set_xticks([0.5, 7.5, 8.5, 15.5], ["0", "7", "8", "15"])
    ax.set_yticks([15.5, 8.5, 7.5, 0.5], ["0", "7", "8", "15"])
    ax.set_xlabel("query of the chunk (P^T's column: the k of dV += P^T dO_c)")
    ax.set_ylabel("key of the warp (P^T's row)")
    in_place = sum(1 for cell in wanted if cell in held)
    g, t = lane // 4, lane % 4
    if transposed:
        title = f"this chapter: S^T = K_w Q_c^T, lane {lane} (g={g}, t={t})\n{in_place} of 8 in place"
    else:
        title = f"chapter 8's S = Q_c K_w^T, read as P^T, lane {lane}\n{in_place} of 8 in place"
    ax.set_title(title, fontsize=13.5)
    return in_place


def figure_fragments(lane=5):
    fig, axes = plt.subplots(1, 2, figsize=(15, 8.2))
    good = fragment_panel(axes[0], lane, transposed=True)
    bad = fragment_panel(axes[1], lane, transposed=False)
    assert good == 8 and bad < 8, (good, bad)
    fig.suptitle("green: what the lane holds in its accumulator tiles c0, c1 (c_position); "
                 "red boxes: the A fragment of P^T it needs (a_position)", fontsize=13)
    fig.tight_layout(rect=(0, 0.01, 1, 0.95))
    return fig


def main():
    save(figure_operands(), "12_operands.png")
    save(figure_fragments(), "12_fragments.png", bbox_inches="tight", pad_inches=0.15)


if __name__ == "__main__":
    main()
