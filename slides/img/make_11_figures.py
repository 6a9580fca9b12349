"""The figures of slides/11_tensor_cores_fp32.md, drawn from kernels.tf32_error's own functions.

    python slides/img/make_11_figures.py      # writes slides/img/11_*.png

No GPU needed: the tensor core's arithmetic is modelled in NumPy (float64 for exact products).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

import kernels  # noqa: E402,F401  (first: picks the GPU or the simulator)
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kernels.tf32_error import draw_dot_errors, draw_error_terms  # noqa: E402

DPI = 100
plt.rcParams.update({"font.size": 13, "axes.titlesize": 14})


def save(fig, name):
    path = HERE / name
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    print(f"wrote {path.relative_to(HERE.parents[1])}")


def main():
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    draw_error_terms(axes[0])
    draw_dot_errors(axes[1], d=64)
    fig.tight_layout()
    save(fig, "11_tf32_errors.png")


if __name__ == "__main__":
    main()
