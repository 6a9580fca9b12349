"""The figure of slides/06_block_sparse.md, drawn from kernels.sparsity_patterns itself.

    python slides/img/make_06_figures.py      # writes slides/img/06_patterns.png

Each panel is the block mask a pattern function returns for 16 x 16 tiles (N = 2048,
blocks of 128), and rho is its kept fraction: the same masks the notebook and the bench use.
"""

from __future__ import annotations

from figures import plt, save  # noqa: E402  (first: the repository on the path, kernels, matplotlib without a display)


from kernels.sparsity_patterns import PATTERNS  # noqa: E402

N, BLOCK = 2048, 128
plt.rcParams.update({"font.size": 13, "axes.titlesize": 14})


def main():
    fig, axes = plt.subplots(1, len(PATTERNS), figsize=(15, 3.9), dpi=100)
    for ax, (name, make) in zip(axes, PATTERNS.items()):
        mask = make(N, N, BLOCK)
        flags = mask.flags if mask.flags.ndim == 2 else mask.flags[0]
        ax.imshow(flags, cmap="Blues", vmin=-0.1, vmax=1.2, interpolation="nearest")
        ax.set_title(f"{name}\nrho = {flags.mean():.2f}")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_xlabel("key tile c")
    axes[0].set_ylabel("query tile r")
    fig.suptitle(f"Block masks of kernels/sparsity_patterns.py (N = {N}, blocks of {BLOCK}): "
                 "a dark tile is computed, a light one skipped", y=0.99)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    save(fig, "06_patterns.png")


if __name__ == "__main__":
    main()
