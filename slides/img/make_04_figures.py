"""The figures of slides/04_flash_forward.md, drawn from kernels.flash_forward's own numbers.

    python slides/img/make_04_figures.py      # writes slides/img/04_*.png

No GPU needed: importing ``kernels`` selects the simulator where there is none. The tile
shapes are the kernel's production tiles (``gpu_tiles``), the shared-memory sizes come from
its layout (``_layout``, ``shared_bytes``), and the thread -> micro-tile maps apply the index
arithmetic of ``make_attend_query_tile`` (see ``s_owner`` and ``o_owner`` below).
"""

from __future__ import annotations

from figures import plt, save  # noqa: E402  (first: the repository on the path, kernels, matplotlib without a display)
import matplotlib  # noqa: E402

import numpy as np  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

from kernels.base.fused import Tiles, run_length  # noqa: E402
from kernels.flash_forward import _layout, gpu_tiles, shared_bytes  # noqa: E402

HBM = "#f4cccc"          # the colours of slides/img/00_memory_hierarchy.png
HBM_EDGE = "#cc4125"
SHARED = "#cfe2f3"
SHARED_EDGE = "#3d85c6"
REGS = "#d9ead3"
REGS_EDGE = "#38761d"
Q_COLOR = "#e69138"      # the query side (Q_i, O_i, L_i)
KV_COLOR = "#3d85c6"     # the key side (K_j, V_j)
SP_COLOR = "#8e7cc3"     # S and P: never in HBM

plt.rcParams.update({"font.size": 13, "axes.titlesize": 15})



def arrow(ax, start, end, color="0.15", lw=2.2, style="-|>", rad=0.0, ls="-"):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=20, color=color, lw=lw,
                                 connectionstyle=f"arc3,rad={rad}", linestyle=ls, shrinkA=2, shrinkB=2))


def kb(floats):
    return f"{4 * floats / 1024:.1f} KB"


# --------------------------------------------------------------------------- 1. the dataflow

def strip(ax, x, y, w, h, tiles, cur, color, label=None, fs=13):
    """A matrix drawn with its rows along x, cut into ``tiles`` tiles; tile ``cur`` coloured."""
    tw = w / tiles
    for k in range(tiles):
        ax.add_patch(Rectangle((x + k * tw, y), tw, h, fc=color if k == cur else "white", ec="0.35", lw=0.6))
    if label:
        ax.text(x + (cur + 0.5) * tw, y + h / 2, label, ha="center", va="center", color="white",
                fontsize=fs, fontweight="bold")
    return x + cur * tw, tw


def tile(ax, x, y, w, h, color, label, note=None, fs=14):
    ax.add_patch(Rectangle((x, y), w, h, fc=color, ec="0.2", lw=0.8))
    ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", color="white", fontsize=fs, fontweight="bold")
    if note:
        ax.text(x + w / 2, y - 0.08, note, ha="center", va="top", fontsize=10.5, color="0.1", linespacing=1.15)


def band(ax, y, h, fc, ec, title):
    ax.add_patch(Rectangle((0.1, y), 15.3, h, fc=fc, ec=ec, lw=1.5))
    ax.text(0.25, y + h - 0.15, title, ha="left", va="top", fontsize=13.5, fontweight="bold", color=ec)


def figure_dataflow(d=64, n=1024):
    """FlashAttention's Fig. 1 (left), for chapter 4's loop order: one block, one query tile i,
    every tile drawn with its rows along x, on chip to scale."""
    t = gpu_tiles(d)
    Br, Bc, TM, TX = t.Br, t.Bc, t.TM, t.TX
    Tr, Tc = n // Br, n // Bc
    i, j = 1, 5                                   # the tiles drawn as current
    _, _, _, _, q_st, k_st, v_st, p_st, total = _layout(Br, Bc, d)
    assert 4 * total == shared_bytes(t, d)
    RN, RD = Bc // TX, d // TX

    fig, ax = plt.subplots(figsize=(12.8, 7.2))
    ax.set_xlim(0, 15.5)
    ax.set_ylim(0, 8.7)
    ax.axis("off")
    s = 0.0105                                    # units a float, on chip
    BR, D, BC = Br * s, d * s, Bc * s

    # ---- HBM: Q, K, V, O (N x d) and L (N), cut into the kernel's tiles
    band(ax, 6.0, 2.6, HBM, HBM_EDGE, "HBM")
    hy, hh, hw, x0, gap = 6.75, 0.6, 3.0, 1.65, 0.45
    qx, qw = strip(ax, x0, hy, hw, hh, Tr, i, Q_COLOR, "Q$_i$")
    kx, kw = strip(ax, x0 + (hw + gap), hy, hw, hh, Tc, j, KV_COLOR)
    vx, vw = strip(ax, x0 + 2 * (hw + gap), hy, hw, hh, Tc, j, KV_COLOR)
    ox, ow = strip(ax, x0 + 3 * (hw + gap), hy + 0.2, hw, hh - 0.2, Tr, i, Q_COLOR, "O$_i$", fs=12)
    lx, lw_ = strip(ax, x0 + 3 * (hw + gap), hy, hw, 0.14, Tr, i, Q_COLOR)
    for k, name in enumerate(("Q  (N × d)", "K  (N × d)", "V  (N × d)", "O  (N × d),  L  (N)")):
        ax.text(x0 + k * (hw + gap) + hw / 2, hy + hh + 0.1, name, ha="center", va="bottom", fontsize=13,
                fontweight="bold")
    ax.text(kx + kw / 2, hy - 0.06, "K$_j$", ha="center", va="top", fontsize=12, color=KV_COLOR, fontweight="bold")
    ax.text(vx + vw / 2, hy - 0.06, "V$_j$", ha="center", va="top", fontsize=12, color=KV_COLOR, fontweight="bold")
    ax.text(lx + lw_ / 2, hy - 0.06, "L$_i$", ha="center", va="top", fontsize=12, color=Q_COLOR,
            fontweight="bold")
    arrow(ax, (kx - 0.2, 8.15), (vx + vw + 0.2, 8.15), color=KV_COLOR, lw=1.8)
    ax.text((kx + vx + vw) / 2, 8.25, "inner loop j = 0 … Tc−1: K$_j$, V$_j$ stream past Q$_i$", ha="center",
            va="bottom", fontsize=12, color=KV_COLOR)

    # ---- shared memory: Q_i, K_j, V_j, P (stored transposed where a thread reads runs of rows)
    band(ax, 3.25, 2.5, SHARED, SHARED_EDGE, f"shared\nmemory\n{4 * total / 1024:.0f} KB")
    sy = 4.55
    sq_x = qx + qw / 2 - BR / 2
    tile(ax, sq_x, sy, BR, D, Q_COLOR, "Q$_i$", f"Br × d, stored\nd × (Br+4): {kb(d * q_st)}")
    sk_x = kx + kw / 2 - BC / 2
    tile(ax, sk_x, sy, BC, D, KV_COLOR, "K$_j$", f"Bc × d\n{kb(d * k_st)}")
    sv_x = vx + vw / 2 - BC / 2
    tile(ax, sv_x, sy, BC, D, KV_COLOR, "V$_j$", f"Bc × d\n{kb(Bc * v_st)}")
    sp_x = sv_x + BC + 0.45
    tile(ax, sp_x, sy, BR, BC, SP_COLOR, "P", f"Br × Bc, stored\nBc × (Br+4): {kb(Bc * p_st)}")

    # ---- registers: S, m, l, O of the block's threads
    band(ax, 0.75, 2.25, REGS, REGS_EDGE, f"registers\n{t.threads}\nthreads")
    ry = 1.75
    rs_x = (sq_x + BR + sk_x) / 2 - BR / 2 + 0.3
    tile(ax, rs_x, ry, BR, BC, SP_COLOR, "S$_{ij}$", f"Br × Bc: {TM} × {RN} a thread")
    rm_x = rs_x + BR + 0.55
    ax.add_patch(Rectangle((rm_x, ry + 0.42), BR, 0.16, fc=Q_COLOR, ec="0.2", lw=0.8))
    ax.add_patch(Rectangle((rm_x, ry + 0.12), BR, 0.16, fc=Q_COLOR, ec="0.2", lw=0.8))
    ax.text(rm_x - 0.08, ry + 0.5, "m", ha="right", va="center", fontsize=13, fontweight="bold")
    ax.text(rm_x - 0.08, ry + 0.2, "ℓ", ha="right", va="center", fontsize=13, fontweight="bold")
    ax.text(rm_x + BR / 2, ry - 0.08, f"Br each: {TM} + {TM} a thread", ha="center", va="top", fontsize=10.5)
    ro_x = rm_x + BR + 0.5
    tile(ax, ro_x, ry, BR, D, Q_COLOR, "O$_i$", f"Br × d: {TM} × {RD} a thread")

    # ---- HBM <-> chip
    arrow(ax, (qx + qw / 2, hy - 0.05), (qx + qw / 2, sy + D + 0.05), color=Q_COLOR, lw=3)
    ax.text(qx + qw / 2 + 0.12, 5.45, "once", ha="left", va="center", fontsize=13, color=Q_COLOR,
            fontweight="bold")
    for x, w in ((kx, kw), (vx, vw)):
        arrow(ax, (x + w / 2, hy - 0.36), (x + w / 2, sy + D + 0.05), color=KV_COLOR, lw=3)
        ax.text(x + w / 2 + 0.12, 5.45, f"every j ({Tc}×)", ha="left", va="center", fontsize=12,
                color=KV_COLOR, fontweight="bold")
    up_x = ro_x + BR + 0.2
    arrow(ax, (ro_x + BR, ry + D / 2), (ox + ow / 2 + 0.1, hy - 0.03), color=Q_COLOR, lw=3, rad=0.25)
    ax.text(up_x + 0.2, 2.4, "once, at the end:\nO$_i$ / ℓ\nL$_i$ = m + log ℓ", ha="left",
            va="center", fontsize=11.5, color=Q_COLOR, fontweight="bold")

    # ---- on chip: the three steps of one K/V tile
    arrow(ax, (sq_x + BR * 0.8, sy - 0.5), (rs_x + BR * 0.25, ry + BC + 0.05), color="0.2")
    arrow(ax, (sk_x + BC / 2, sy - 0.5), (rs_x + BR * 0.75, ry + BC + 0.05), color="0.2")
    ax.text(rs_x + BR * 0.5, 2.8, "①", ha="center", va="center", fontsize=17)
    arrow(ax, (rs_x + BR + 0.05, ry + BC - 0.05), (sp_x + 0.15, sy - 0.5), color=SP_COLOR, lw=2.6)
    ax.text((rs_x + BR + sp_x) / 2 - 0.25, 3.45, "②", ha="center", va="center", fontsize=17, color=SP_COLOR)
    arrow(ax, (sp_x + BR * 0.45, sy - 0.5), (ro_x + BR * 0.35, ry + D + 0.05), color="0.2")
    arrow(ax, (sv_x + BC / 2, sy - 0.5), (ro_x + BR * 0.1, ry + D + 0.05), color="0.2")
    ax.text(ro_x - 0.1, 2.8, "③", ha="center", va="center", fontsize=17)
    ax.text(0.15, 0.45, "① S = Q$_i$K$_j^T$      ② m' = max(m, rowmax S),  P = exp(S − m')      "
            "③ ℓ ← e$^{m-m'}$ℓ + rowsum P,  O ← e$^{m-m'}$O + P V$_j$", ha="left", va="center", fontsize=12.5)
    ax.text(0.15, 0.08, f"HBM drawn at N = {n}: Tr = {Tr} query tiles of Br = {Br} rows, Tc = {Tc} key tiles of "
            f"Bc = {Bc} rows; on chip to scale (rows along x). Grid: (Tr, B·H) blocks.", ha="left", va="center",
            fontsize=10.5, color="0.3")

    fig.suptitle(f"Chapter 4's forward at d = {d} ({t}): one block a query tile;\n"
                 f"S and P never leave the chip, only Q, K, V, O, L touch HBM", fontsize=15)
    fig.subplots_adjust(left=0.005, right=0.995, bottom=0.005, top=0.9)
    save(fig, "04_dataflow.png")


# --------------------------------------------------------------------------- 2. threads -> micro-tiles

def owners(t: Tiles, D: int):
    """(S owner, O owner): the thread of the block that owns each entry of the Br x Bc tile S
    and of the Br x D tile O, by the index arithmetic of ``make_attend_query_tile``:

        tx = tid % TX,  ty = tid // TX
        row = ty * VM + (i // VM) * TY * VM + i % VM                     i < TM
        col = tx * VN + (jj // VN) * TX * VN + jj % VN                   jj < RN  (S)
        col = tx * VD + (c // VD) * TX * VD + c % VD                     c < RD   (O)

    Checks that every entry has exactly one owner."""
    Br, Bc, TM, TX = t.Br, t.Bc, t.TM, t.TX
    TY, RN, RD = Br // TM, Bc // TX, D // TX
    VM, VN, VD = run_length(TM), run_length(RN), run_length(RD)
    s_own = np.full((Br, Bc), -1)
    o_own = np.full((Br, D), -1)
    for tid in range(t.threads):
        tx, ty = tid % TX, tid // TX
        rows = [ty * VM + (i // VM) * TY * VM + i % VM for i in range(TM)]
        s_cols = [tx * VN + (jj // VN) * TX * VN + jj % VN for jj in range(RN)]
        o_cols = [tx * VD + (c // VD) * TX * VD + c % VD for c in range(RD)]
        for own, cols in ((s_own, s_cols), (o_own, o_cols)):
            for r in rows:
                for c in cols:
                    assert own[r, c] == -1, f"{t}: entry ({r}, {c}) owned twice"
                    own[r, c] = tid
    assert (s_own >= 0).all() and (o_own >= 0).all(), f"{t}: an entry without an owner"
    return s_own, o_own


THREAD_COLORS = plt.cm.tab10.colors + ("#17becf", "#bcbd22", "#7f7f7f", "#aec7e8", "#ffbb78", "#98df8a")


def runs(own):
    """The rectangles of equal owner that are runs of whole micro-tile pieces: (r0, c0, h, w, tid)."""
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


def draw_owned(ax, own, title, colors, labels=True, ticks=4, highlight=None, fs=10, row0=0, text_color=None):
    """One tile (or ``row0`` onwards of one), each entry coloured by its owner thread
    (``colors(tid)``), the pieces a thread owns outlined; ``labels``: each piece named t<tid>."""
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


SHADES = (0.0, 0.3, 0.5, 0.68)                    # ty % 4 -> how much white is mixed in


def warp_color(TX):
    """A thread's colour: its hue from tx (same hue: same columns), lighter with ty % 4."""
    def color(tid):
        tx, ty = tid % TX, tid // TX
        base = np.array(matplotlib.colors.to_rgb(plt.cm.tab10.colors[tx % 10]))
        f = SHADES[ty % 4]
        return tuple(base * (1 - f) + f)

    def text(tid):
        return "white" if SHADES[(tid // TX) % 4] < 0.4 else "black"
    return color, text


def figure_thread_map_small(t=Tiles(Br=32, Bc=16, TM=8, TX=2), d=32):
    """Every thread of a small block with the production's structure (TM = 8, runs of 4)."""
    s_own, o_own = owners(t, d)
    TY, RN, RD = t.Br // t.TM, t.Bc // t.TX, d // t.TX
    color = lambda tid: matplotlib.colors.to_rgb(THREAD_COLORS[tid % len(THREAD_COLORS)])  # noqa: E731
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(12.8, 6.6), gridspec_kw={"width_ratios": [1.05, 2, 1.35]})
    draw_owned(a, s_own, f"S tile: Br × Bc = {t.Br} × {t.Bc} (keys)\n{t.TM} × RN = {t.TM} × {RN} a thread", color)
    a.set_ylabel("query row of the tile")
    draw_owned(b, o_own, f"O tile: Br × d = {t.Br} × {d} (head dim)\n{t.TM} × RD = {t.TM} × {RD} a thread", color)
    c.axis("off")
    VM, VN = run_length(t.TM), run_length(RN)
    c.text(0.0, 1.0, f"{t}, d = {d}\n{t.threads} threads: TY = Br/TM = {TY},\nTX = {t.TX};"
           f" t = TX·ty + tx\n\n"
           f"thread (ty, tx) owns the rows\n   {VM}·ty + {VM}·TY·a + i\n   = {VM}ty … {VM}ty+{VM - 1},"
           f" then {VM * TY} further\n\n"
           f"and the S columns\n   {VN}·tx + {VN}·TX·b + j\n   = {VN}tx … {VN}tx+{VN - 1}, "
           f"then {VN * t.TX} further\n\n"
           f"O columns: the same rule\nwith RD = d/TX = {RD}\n\n"
           f"runs of 4 floats: one\n16-byte shared load each", va="top", ha="left", fontsize=12,
           transform=c.transAxes, linespacing=1.3)
    fig.suptitle("Chapter 4's thread → micro-tile map, small: each thread owns TM rows × Bc/TX "
                 "columns of S\n(and the same rows × d/TX columns of O), in runs of 4 spread over the tile",
                 fontsize=14)
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.03, top=0.8, wspace=0.15)
    save(fig, "04_thread_map_small.png")


def figure_thread_map_d64():
    """The production tile at d = 64: the whole 256 x 64 tile with warp 0 coloured, and warp
    0's rows, every thread named."""
    t = gpu_tiles(64)
    s_own, o_own = owners(t, 64)
    assert (s_own == o_own).all()                 # Bc = d = 64: S and O split alike
    TY = t.Br // t.TM
    color, text = warp_color(t.TX)
    whole = lambda tid: color(tid) if tid < 32 else (0.96, 0.96, 0.96)  # noqa: E731
    fig = plt.figure(figsize=(12.8, 7.0))
    grid = fig.add_gridspec(2, 3, width_ratios=[1.1, 6.2, 2.9], height_ratios=[1, 1], wspace=0.18, hspace=0.12)
    ax = fig.add_subplot(grid[:, 0])
    draw_owned(ax, s_own, f"the whole tile\n{t.Br} × 64", whole, labels=False, ticks=32, highlight=set(range(32)))
    ax.set_ylabel("query row of the tile")
    for k, r0 in enumerate((0, 4 * TY)):          # warp 0 = ty 0..3: rows 0..15 and 128..143
        ax = fig.add_subplot(grid[k, 1])
        draw_owned(ax, s_own[r0:r0 + 16], None, color, ticks=4, fs=9, row0=r0, text_color=text)
        if k == 1:
            ax.text(32, r0 - 9, "⋮  rows 16 … 127: warps 1 … 7, the same pattern 16 rows down each  ⋮",
                    ha="center", va="center", fontsize=12, color="0.3")
        if k == 0:
            ax.set_title("warp 0 (t0 … t31): its rows 0–15 and 128–143, all 64 columns", fontsize=12.5, pad=8)
    ax = fig.add_subplot(grid[:, 2])
    ax.axis("off")
    ax.text(0.0, 1.0, f"{t}, d = 64\n{t.threads} threads, t = TX·ty + tx\n"
            f"TY = Br/TM = {TY}, TX = {t.TX}\n\n"
            f"thread (ty, tx):\n"
            f"  rows 4ty … 4ty+3\n  and 4ty+128 … 4ty+131\n"
            f"  cols 4tx … 4tx+3\n  and 4tx+32 … 4tx+35\n"
            f"  = 8 × 8 entries of S\n  and the same of O\n\n"
            f"colour: hue = tx (columns),\nlighter = ty (rows)\n\n"
            f"a 4-float run: one\n16-byte shared load;\n8 threads along a row read\n"
            f"128 consecutive bytes", va="top", ha="left", fontsize=11.5, transform=ax.transAxes, linespacing=1.25)
    fig.suptitle(f"Chapter 4's tile at d = 64: each of the {t.threads} threads owns 8 × 8 entries of S (and of O)\n"
                 "as 2 × 2 pieces of 4 × 4, 128 rows and 32 columns apart", fontsize=14)
    fig.subplots_adjust(left=0.05, right=0.995, bottom=0.02, top=0.83)
    save(fig, "04_thread_map_d64.png")


def figure_thread_map_d128():
    """The production tile at d = 128: warp 0's rows of S (Br x Bc) and of O (Br x d)."""
    t = gpu_tiles(128)
    s_own, o_own = owners(t, 128)
    TY = t.Br // t.TM
    color, text = warp_color(t.TX)
    fig = plt.figure(figsize=(12.8, 4.4))
    grid = fig.add_gridspec(2, 2, width_ratios=[t.Bc, 128], height_ratios=[1, 0.5], wspace=0.06, hspace=0.15)
    ax = fig.add_subplot(grid[0, 0])
    draw_owned(ax, s_own[:16], f"S: rows 0–15 of {t.Br} × {t.Bc}", color, ticks=8, fs=9, text_color=text)
    ax.set_ylabel("query row")
    ax = fig.add_subplot(grid[0, 1])
    draw_owned(ax, o_own[:16], f"O: rows 0–15 of {t.Br} × 128", color, ticks=16, fs=8, text_color=text)
    ax = fig.add_subplot(grid[1, :])
    ax.axis("off")
    ax.text(0.0, 0.95, f"{t}, d = 128: {t.threads} threads, t = TX·ty + tx, TY = {TY}, TX = {t.TX}.   "
            f"Warp w: rows 16w … 16w+15.\n"
            f"Thread (ty, tx): rows 4ty … 4ty+3 (TM = 4: one run);  S columns 4tx … 4tx+3 (Bc/TX = 4: one run);\n"
            f"O columns 4tx + 32b … 4tx + 32b + 3 for b < 4 (d/TX = 16: four runs).   "
            f"Hue = tx, lighter = ty.", va="top", ha="left", fontsize=12, transform=ax.transAxes, linespacing=1.4)
    fig.suptitle("Chapter 4's tile at d = 128: each thread owns a 4 × 4 piece of S and 4 × 16 of O,\n"
                 "its O columns in four runs of 4, 32 apart (warp 0 shown)", fontsize=14)
    fig.subplots_adjust(left=0.05, right=0.985, bottom=0.0, top=0.78)
    save(fig, "04_thread_map_d128.png")


def main():
    figure_dataflow()
    figure_thread_map_small()
    figure_thread_map_d64()
    figure_thread_map_d128()


if __name__ == "__main__":
    main()
