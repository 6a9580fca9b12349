"""``python -m kernels``: the tour of every chapter's bench (see ``kernels.bench.tour``), or
the tests.

    python -m kernels                  # every chapter found in kernels/bench/
    python -m kernels --chapters 0,4   # some chapters
    python -m kernels --benches tf32_backward   # some bench modules (one of a chapter's two)
    python -m kernels --quick          # fewer sizes and repeats
    python -m kernels --list           # what would run
    python -m kernels test             # the tests: python -m pytest -n <workers> --dist worksteal --nbmake tests workbook
    python -m kernels test -k rung     # (anything after "test" goes to pytest)

On first use either installs requirements.txt into .venv (``kernels/_bootstrap.py``).

The tests' workers: in the simulator one more than the cores, at most 8 (a simulated
kernel's threads wait at each barrier for Python to switch to the next one, and a core left
idle there takes another worker's test: 15% faster on 2 cores); on a GPU 2 (each worker
compiles the kernels and holds its own CUDA context).
"""

import subprocess
import sys
from pathlib import Path

import kernels  # noqa: F401  (GPU or simulator, before Numba)

if sys.argv[1:2] == ["test"]:
    import os

    root = Path(__file__).resolve().parents[1]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = min(cores + 1, 8) if kernels.DEVICE == "sim" else 2
    command = [sys.executable, "-m", "pytest", "-n", str(workers), "--dist", "worksteal", "--nbmake", "tests",
               "workbook", *sys.argv[2:]]
    env = cache = None
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        # The run starts a hundred Python processes (the workers, the notebooks' kernels, the
        # PTX checks, the learner's and the tour's tests ...), each importing NumPy, Numba,
        # Hypothesis, pytest and the course (PyTorch, Jupyter for some). With no bytecode
        # written, each compiled all that source again: 1.5-2 s a process. They share one
        # bytecode cache instead, for this run only, in a folder of its own removed at the
        # end (nothing is written beside the sources, as PYTHONDONTWRITEBYTECODE asks).
        import shutil
        import tempfile

        cache = tempfile.mkdtemp(prefix="workbook-test-pycache-")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = cache
    try:
        status = subprocess.call(command, cwd=root, env=env)
    finally:
        if cache:
            shutil.rmtree(cache, ignore_errors=True)
    sys.exit(status)

from kernels.bench.tour import main  # noqa: E402

sys.exit(main())
