"""The napkin figures of chapter 10, drawn by kernels.napkin_model's own functions.

    python slides/img/make_10_napkin_figures.py      # writes slides/img/10_napkin_*.png

No GPU needed: the diagrams are shapes and byte counts; the prediction figure reads the
committed H100 results (workbook/results/*.csv).
"""

from __future__ import annotations

from figures import plt, save  # noqa: E402  (first: the repository on the path, kernels, matplotlib without a display)


from kernels.napkin_model import draw_predictions, draw_standard, draw_streamed, prediction_table  # noqa: E402




def main():
    fig, ax = plt.subplots(figsize=(12, 3.9))
    draw_standard(ax)
    save(fig, "10_napkin_standard.png", bbox_inches="tight")

    fig, ax = plt.subplots(figsize=(12, 4.8))
    draw_streamed(ax)
    save(fig, "10_napkin_streamed.png", bbox_inches="tight")

    fig, ax = plt.subplots(figsize=(11, 5.2))
    draw_predictions(ax, prediction_table())
    ax.set_title("Napkin (max over HBM, L2, shared memory, FLOP rate) against the H100", fontsize=11)
    save(fig, "10_napkin_predictions.png", bbox_inches="tight")


if __name__ == "__main__":
    main()
