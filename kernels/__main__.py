"""``python -m kernels``: the tour of every chapter's bench (see ``kernels.bench.tour``), or
the tests.

    python -m kernels                  # every chapter found in kernels/bench/
    python -m kernels --chapters 0,4   # some chapters
    python -m kernels --quick          # fewer sizes and repeats
    python -m kernels --list           # what would run
    python -m kernels test             # the tests: python -m pytest -n 2 --dist worksteal --nbmake tests workbook
    python -m kernels test -k rung     # (anything after "test" goes to pytest)

On first use either installs requirements.txt into .venv (``kernels/_bootstrap.py``).
"""

import subprocess
import sys
from pathlib import Path

import kernels  # noqa: F401  (GPU or simulator, before Numba)

if sys.argv[1:2] == ["test"]:
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "worksteal", "--nbmake", "tests", "workbook",
               *sys.argv[2:]]
    sys.exit(subprocess.call(command, cwd=root))

from kernels.bench.tour import main  # noqa: E402

sys.exit(main())
