"""``python -m kernels``: the tour of every chapter's bench (see ``kernels.bench.tour``).

    python -m kernels                  # every chapter found in kernels/bench/
    python -m kernels --chapters 0,4   # some chapters
    python -m kernels --quick          # fewer sizes and repeats
    python -m kernels --list           # what would run
"""

import sys

import kernels  # noqa: F401  (GPU or simulator, before Numba)
from kernels.bench.tour import main

sys.exit(main())
