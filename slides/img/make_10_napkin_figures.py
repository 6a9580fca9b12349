"""The napkin figures of chapter 10, drawn by kernels.napkin_model's own functions.

    python slides/img/make_10_napkin_figures.py      # writes slides/img/10_napkin_*.png

No GPU needed: the diagrams are shapes and byte counts; the prediction figure reads the
committed H100 results (workbook/results/*.csv).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kernels.napkin_model import draw_predictions, draw_standard, draw_streamed, prediction_table  # noqa: E402

DPI = 100


def save(fig, name):
    path = HERE / name
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path.relative_to(HERE.parents[1])}")


def main():
    fig, ax = plt.subplots(figsize=(12, 3.9))
    draw_standard(ax)
    save(fig, "10_napkin_standard.png")

    fig, ax = plt.subplots(figsize=(12, 4.8))
    draw_streamed(ax)
    save(fig, "10_napkin_streamed.png")

    fig, ax = plt.subplots(figsize=(11, 5.2))
    draw_predictions(ax, prediction_table())
    ax.set_title("Napkin (max over HBM, L2, shared memory, FLOP rate) against the H100", fontsize=11)
    save(fig, "10_napkin_predictions.png")


if __name__ == "__main__":
    main()
