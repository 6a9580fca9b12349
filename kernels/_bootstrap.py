"""First use of ``python -m kernels`` (the tour) or ``python -m kernels test`` (the tests) on
a machine without the course's packages: create ``.venv`` beside the repository, install
``requirements.txt`` into it, and run the same command again from there. Later runs from
any Python go straight to ``.venv``. Standard library only: this runs before anything the
course imports (``kernels/__init__.py`` calls ``ensure`` when run with ``python -m``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv"
# What the tour and the tests import (a few of requirements.txt's packages stand for all).
# Top-level names only: finding a submodule imports its parent, and Numba must not be
# imported before ``kernels.base.runtime`` has chosen the GPU or the simulator.
NEEDED = ("numpy", "numba", "numba_cuda", "matplotlib", "pytest", "hypothesis", "xdist", "nbmake", "jupytext")
AGAIN = "WORKBOOK_BOOTSTRAPPED"          # set for the second run: never loop


def missing() -> list[str]:
    return [name for name in NEEDED if importlib.util.find_spec(name) is None]


def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def ensure() -> None:
    """Return if everything is importable; otherwise set it up and re-run this command."""
    gone = missing()
    if not gone:
        return
    if os.environ.get(AGAIN):
        raise SystemExit(f"kernels: still missing after installing requirements.txt: {', '.join(gone)} "
                         f"(Python {sys.version.split()[0]} at {sys.executable}); install them by hand")
    in_venv = sys.prefix != sys.base_prefix
    python = venv_python()
    if not in_venv and python.exists():        # the course's .venv exists: run from there
        _again(python)
    if not in_venv:
        print(f"kernels: first use: creating a virtual environment in {VENV}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    else:
        python = Path(sys.executable)
    print(f"kernels: installing requirements.txt into {python.parent.parent} (missing here: {', '.join(gone)}); "
          "this takes a few minutes once", flush=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(ROOT / "requirements.txt")],
                   check=True, cwd=ROOT)
    _again(python)


def _again(python: Path) -> None:
    print(f"kernels: running with {python}", flush=True)
    os.environ[AGAIN] = "1"
    os.execv(str(python), [str(python), "-m", "kernels", *sys.argv[1:]])
