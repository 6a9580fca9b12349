"""The figures of slides/07_decode.md, drawn from kernels.decode's own functions.

    python slides/img/make_07_figures.py      # writes slides/img/07_*.png

No GPU needed: importing ``kernels`` selects the simulator where there is none, and every
number drawn here comes from the host-side functions (wave_efficiency, split_count,
split_ranges, stream_k_schedule, check_schedule), not from a measurement.
"""

from __future__ import annotations

from figures import plt, save  # noqa: E402  (first: the repository on the path, kernels, matplotlib without a display)

from matplotlib.patches import Rectangle  # noqa: E402

from kernels.decode import check_schedule, split_count, split_ranges, stream_k_schedule, wave_efficiency  # noqa: E402

SIZE = (10, 4.5)                  # inches at DPI: 1000 x 450 pixels
DPI = 100
SMS, PER_SM = 132, 4              # H100 SXM: 132 SMs; 4 decode blocks an SM
SLOTS = SMS * PER_SM
HEADS = 32                        # B = 1, H = 32, Nq = 1: 32 (head, row tile) items
N_KEYS = 131072
HEAD_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
IDLE = "#e6e6e6"

plt.rcParams.update({"font.size": 13, "axes.titlesize": 14})



def sm_grid(ax, busy_slots, per_sm, title):
    """132 SMs in 12 columns x 11 rows, each as per_sm slots; busy_slots[sm] slots filled."""
    cols = 12
    sub = 2 if per_sm == 4 else 1
    for sm in range(SMS):
        x0, y0 = (sm % cols) * 1.15, -(sm // cols) * 1.15
        ax.add_patch(Rectangle((x0 - 0.04, y0 - 0.04), 1.08, 1.08, fill=False, lw=0.8, ec="0.4"))
        for s in range(per_sm):
            w = 1.0 / sub
            x, y = x0 + (s % sub) * w, y0 + (s // sub) * w
            ax.add_patch(Rectangle((x + 0.04, y + 0.04), w - 0.08, w - 0.08,
                                   fc=HEAD_COLORS[0] if s < busy_slots[sm] else IDLE, ec="none"))
    ax.set_xlim(-0.2, cols * 1.15)
    ax.set_ylim(-10 * 1.15 - 0.2, 1.2)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title, fontsize=13)


def figure_grid():
    """Chapter 4's grid at Nq = 1 (one block a head) against split-K's."""
    splits = split_count(HEADS, N_KEYS, SLOTS)
    chunk = split_ranges(N_KEYS, splits)[0][1]
    fig, (a, b) = plt.subplots(1, 2, figsize=SIZE)
    # chapter 4: 32 blocks, one a head; the block scheduler puts one on each of 32 SMs
    sm_grid(a, [1 if sm < HEADS else 0 for sm in range(SMS)], 1,
            f"chapter 4 at Nq = 1: {HEADS} blocks on {SMS} SMs\n"
            f"{HEADS / SMS:.0%} of the SMs busy, each block {N_KEYS} keys")
    # split-K: heads x splits blocks, dealt round-robin over the SMs, up to PER_SM each
    blocks = HEADS * splits
    busy = [min(PER_SM, blocks // SMS + (1 if sm < blocks % SMS else 0)) for sm in range(SMS)]
    sm_grid(b, busy, PER_SM,
            f"split-K, {splits} splits: {blocks} blocks on {SMS} x {PER_SM} slots\n"
            f"{wave_efficiency(blocks, SLOTS):.0%} of the slots busy, each block {chunk} keys")
    fig.suptitle(f"B = 1, H = {HEADS}, one new query, {N_KEYS} cached keys", fontsize=14)
    fig.tight_layout()
    save(fig, "07_grid.png")


def figure_splits():
    """split_count's rule: wave efficiency of HEADS x s blocks on SLOTS slots."""
    chosen = split_count(HEADS, N_KEYS, SLOTS)
    s_max = 70
    s = list(range(1, s_max + 1))
    eff = [wave_efficiency(HEADS * k, SLOTS) for k in s]
    best = max(wave_efficiency(HEADS * k, SLOTS) for k in range(1, 129))
    fig, ax = plt.subplots(figsize=SIZE)
    ax.bar(s, eff, color=[HEAD_COLORS[1] if k == chosen else HEAD_COLORS[0] for k in s], width=0.8)
    ax.axhline(0.85 * best, color="0.3", ls="--", lw=1)
    ax.text(0.8, 0.85 * best - 0.015, f"85% of the best\n(best: {best:.2f})", va="top", ha="left", fontsize=11)
    ax.annotate(f"split_count: s = {chosen}\n({HEADS * chosen} blocks, {wave_efficiency(HEADS * chosen, SLOTS):.0%})",
                xy=(chosen, wave_efficiency(HEADS * chosen, SLOTS)), xytext=(chosen + 6, 1.08),
                arrowprops=dict(arrowstyle="->", color="0.2"), fontsize=12)
    for k in (16, 33):
        e = wave_efficiency(HEADS * k, SLOTS)
        ax.text(k, e + 0.02, f"{e:.2f}", ha="center", fontsize=10)
    ax.set_xlim(0, s_max + 1)
    ax.set_ylim(0, 1.25)
    ax.set_xlabel("splits s (slices of each head's keys)")
    ax.set_ylabel("wave efficiency")
    ax.set_title(f"{HEADS} heads x s splits on {SMS} SMs x {PER_SM} blocks = {SLOTS} slots: "
                 f"blocks / (waves x slots)")
    fig.tight_layout()
    save(fig, "07_splits.png")


def figure_schedule(tiles, blocks, name, title):
    """Stream-K: the work laid end to end (top), and each block's segments below it."""
    sched = stream_k_schedule(tiles, blocks)
    check_schedule(sched, tiles, blocks)
    total = sum(tiles)
    starts = [sum(tiles[:i]) for i in range(len(tiles))]
    fig, ax = plt.subplots(figsize=SIZE)
    # the work laid end to end, one cell a key tile, coloured by head
    for h, n in enumerate(tiles):
        for t in range(n):
            ax.add_patch(Rectangle((starts[h] + t, 0), 1, 0.8, fc=HEAD_COLORS[h % len(HEAD_COLORS)],
                                   ec="white", lw=0.8))
        ax.text(starts[h] + n / 2, 0.4, f"head {h}" if n >= 6 else f"h{h}", ha="center", va="center",
                color="white", fontsize=12, fontweight="bold")
    # each block's row: its segments, solid when the segment is the whole head (written
    # straight to O, L), hatched when it is a partial (merged by the head's last block)
    for c in range(blocks):
        y = -1.2 * (c + 1)
        work = 0
        for g in range(sched.cta_first[c], sched.cta_first[c + 1]):
            h = int(sched.seg_item[g])
            a, b = int(sched.seg_tile_start[g]), int(sched.seg_tile_end[g])
            whole = sched.item_count[h] == 1
            ax.add_patch(Rectangle((starts[h] + a, y), b - a, 0.8, fc=HEAD_COLORS[h % len(HEAD_COLORS)],
                                   ec="black", lw=0.8, hatch=None if whole else "//", alpha=1.0 if whole else 0.75))
            if b - a >= 2:
                ax.text(starts[h] + (a + b) / 2, y + 0.4, f"[{a}, {b})", ha="center", va="center", fontsize=10,
                        color="white", fontweight="bold")
            work += b - a
        ax.text(-0.5, y + 0.4, f"block {c}", ha="right", va="center", fontsize=12)
        ax.text(total + 0.5, y + 0.4, f"{work} tiles", ha="left", va="center", fontsize=11, color="0.3")
    # the block boundaries c W / blocks
    for c in range(blocks + 1):
        x = c * total // blocks
        ax.plot([x, x], [-1.2 * blocks - 0.1, 1.0], color="black", lw=1.2 if c in (0, blocks) else 1.0,
                ls="-" if c in (0, blocks) else "--")
    ax.text(-0.5, 0.4, "work", ha="right", va="center", fontsize=12, fontweight="bold")
    ax.set_xlim(-4.5, total + 5)
    ax.set_ylim(-1.2 * blocks - 0.3, 1.1)
    ax.axis("off")
    ax.set_title(title, fontsize=14)
    fig.tight_layout()
    save(fig, name)


def main():
    figure_grid()
    figure_splits()
    figure_schedule([10, 10, 10, 10], 6, "07_stream_k_uniform.png",
                    "stream-K: 4 heads x 10 key tiles on 6 blocks (hatched: a partial, merged later)")
    figure_schedule([40, 3, 3, 3], 6, "07_stream_k_ragged.png",
                    "stream-K, ragged caches: tiles [40, 3, 3, 3] on 6 blocks (solid: a whole head)")


if __name__ == "__main__":
    main()
