"""The figures of chapter 10's theory slides, drawn from kernels.io_theory's own functions.

    python slides/img/make_10_theory_figures.py      # writes slides/img/10_theory_*.png

No GPU needed: the orders are formulas, the measured bytes are read from the committed
workbook/results/flash_forward_dram.csv (Nsight Compute on the H100).
"""

from __future__ import annotations

from figures import plt, save  # noqa: E402  (first: the repository on the path, kernels, matplotlib without a display)

import numpy as np  # noqa: E402

from kernels import io_theory as th  # noqa: E402

plt.rcParams.update({"font.size": 13, "axes.titlesize": 14})



def regimes_axes(ax, n=4096, d=256):
    """[5]'s two regimes against M for one head: N^2 d^2 / M, N^2 d / sqrt(M), the optimum,
    standard attention, the exact counts of FA-1 and FA-2 with tiles from M, the H100's M."""
    Ms = np.unique(np.geomspace(4 * d, n * d, 160).astype(int))
    ax.loglog(Ms, [th.theorem2_order(n, d, M) for M in Ms], "-", color="C0", label=r"$N^2d^2/M$ ([1] Thm 2)")
    ax.loglog(Ms, [th.small_cache_order(n, d, M) for M in Ms], "-", color="C1", label=r"$N^2d/\sqrt{M}$ ([5], $M<d^2$)")
    ax.loglog(Ms, [th.optimal_order(n, d, M) for M in Ms], "k", lw=4, alpha=0.25, label="optimal ([5])")
    ax.loglog(Ms, [th.fa1_forward_accesses(n, d, **dict(zip(("Br", "Bc"), th.tiles_from_m(d, M))))["total"]
                   for M in Ms], "--", color="C0", lw=1.2, label="FA-1 Alg. 1, exact")
    ax.loglog(Ms, [th.small_cache_accesses(n, d, M)["total"] for M in Ms], "--", color="C1", lw=1.2,
              label="small-cache alg., exact")
    ax.axhline(th.standard_order(n, d), color="C3", ls=":", label=r"standard $Nd+N^2$")
    ax.axvline(th.crossover_m(d), color="gray", ls="-.")
    ax.text(th.crossover_m(d) * 1.1, th.standard_order(n, d) * 40, r"$M=d^2$", color="gray")
    for itemsize, label in ((4, "fp32"), (2, "fp16")):
        M = th.h100_regime(d, itemsize)["M"]
        ax.plot([M], [th.optimal_order(n, d, M)], "v", ms=11, color="C2" if itemsize == 4 else "C4")
        ax.annotate(f"H100 {label}", (M, th.optimal_order(n, d, M)), textcoords="offset points",
                    xytext=(-20, -24), fontsize=10)
    ax.set_xlabel("M, on-chip memory (elements)")
    ax.set_ylabel("HBM accesses, one head")
    ax.set_title(f"N = {n}, d = {d}")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=9, loc="upper right")


def m_sweep_axes(ax, rows):
    """The Br sweep of chapter 4 against M = the tiles' shared memory: measured L2 -> SM and
    DRAM bytes, the IO model at those tiles, 4 N^2 d^2 / M, the compulsory bytes."""
    Ms = np.array([r["M"] for r in rows], float)
    grid = np.geomspace(Ms.min() / 1.3, Ms.max() * 1.3, 50)
    per = rows[-1]["theorem2"] * rows[-1]["M"]                          # N^2 d^2 B H 4 bytes
    ax.loglog(Ms, [r["l2_read"] / 1e9 for r in rows], "s-", color="C0", label="measured: SMs read from L2")
    ax.loglog(Ms, [r["kv_stream"] / 1e9 for r in rows], "o--", color="gray", label=r"K/V stream $2N^2d/B_r$")
    ax.loglog(grid, 4 * per / grid / 1e9, "-", color="C1", label=r"$4\,N^2d^2/M$")
    ax.loglog(Ms, [r["dram"] / 1e9 for r in rows], "^-", color="C3", label="measured: DRAM (HBM)")
    ax.axhline(rows[0]["compulsory"] / 1e9, color="k", ls=":", label="compulsory")
    for r in rows:
        ax.annotate(f"Br={r['Br']}", (r["M"], r["l2_read"] / 1e9), textcoords="offset points", xytext=(4, 6),
                    fontsize=9)
    ax.set_xlabel("M = shared memory of the tiles (fp32 elements)")
    ax.set_ylabel("GB per call (B=4, H=16)")
    ax.set_title("chapter 4's Br sweep as an M sweep (H100)")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=9, loc="lower left", bbox_to_anchor=(0.0, 0.1))


def main():
    fig, ax = plt.subplots(figsize=(8, 5.2))
    regimes_axes(ax)
    fig.tight_layout()
    save(fig, "10_theory_regimes.png")
    try:
        rows = th.m_sweep()
    except FileNotFoundError as e:
        print(f"skipped 10_theory_m_sweep.png: {e}")
        return
    fig, ax = plt.subplots(figsize=(8, 5.2))
    m_sweep_axes(ax, rows)
    fig.tight_layout()
    save(fig, "10_theory_m_sweep.png")


if __name__ == "__main__":
    main()
