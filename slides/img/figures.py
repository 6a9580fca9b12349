"""What the slides' figure scripts (``make_*.py`` beside this file) share: the repository on
``sys.path``, the course's ``kernels`` imported first (it picks the GPU or the simulator
before Numba loads), matplotlib without a display, and one way to save a figure.

    from figures import HERE, plt, save      # first, in each make_*.py
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402,F401  (first: picks the GPU or the simulator)
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DPI = 100


def save(fig, name, **options):
    """``fig`` to ``HERE / name`` at DPI (``options`` go to ``savefig``), closed, and said."""
    path = HERE / name
    fig.savefig(path, dpi=DPI, **options)
    plt.close(fig)
    print(f"wrote {path.relative_to(ROOT)}")
