"""First use of ``python -m kernels`` (the tour) or ``python -m kernels test`` (the tests) on
a machine without the course's packages: create ``.venv`` beside the repository, install
``requirements.txt`` into it, and run the same command again from there. Later runs from
any Python go straight to ``.venv``. Inside a virtual environment it installs there; with
``WORKBOOK_NO_INSTALL=1`` it only says what is missing. Standard library only: this runs before anything the
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
NEEDED = ("numpy", "numba", "numba_cuda", "matplotlib")                     # the tour, a chapter's bench
NEEDED_FOR_TESTS = NEEDED + ("pytest", "hypothesis", "xdist", "nbmake", "jupytext")
AGAIN = "WORKBOOK_BOOTSTRAPPED"          # set for the second run: never loop
NO_INSTALL = "WORKBOOK_NO_INSTALL"       # set: report what is missing, install nothing


def module() -> str:
    """The module ``python -m`` runs: ``kernels``, or one of its (``kernels.bench.decode``)."""
    argv = list(getattr(sys, "orig_argv", []))
    return argv[argv.index("-m") + 1] if "-m" in argv[:-1] else "kernels"


def missing() -> list[str]:
    needed = NEEDED_FOR_TESTS if module() == "kernels" and sys.argv[1:2] == ["test"] else NEEDED
    return [name for name in needed if importlib.util.find_spec(name) is None]


def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def ensure() -> None:
    """Return if everything is importable; otherwise set it up and re-run this command."""
    gone = missing()
    if not gone:
        return
    by_hand = f"{sys.executable} -m pip install -r {ROOT / 'requirements.txt'}"
    if os.environ.get(AGAIN):
        raise SystemExit(f"kernels: still missing after installing requirements.txt: {', '.join(gone)} "
                         f"(Python {sys.version.split()[0]} at {sys.executable}); install them by hand: {by_hand}")
    in_venv = sys.prefix != sys.base_prefix
    python = venv_python()
    if not in_venv and python.exists():        # the course's .venv exists: run from there
        _again(python)
    if os.environ.get(NO_INSTALL):
        raise SystemExit(f"kernels: missing {', '.join(gone)} ({NO_INSTALL} is set, so nothing is installed): {by_hand}")
    if not in_venv:
        print(f"kernels: first use: creating a virtual environment in {VENV}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    else:
        python = Path(sys.executable)
    print(f"kernels: installing requirements.txt into {python.parent.parent} (missing here: {', '.join(gone)}); "
          "this takes a few minutes once", flush=True)
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(ROOT / "requirements.txt")], cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"kernels: pip could not install requirements.txt into {python.parent.parent} (its "
                         f"messages are above: no network, or no wheel for this Python?); missing: {', '.join(gone)}")
    _again(python)


def _again(python: Path) -> None:
    print(f"kernels: running with {python}", flush=True)
    os.environ[AGAIN] = "1"
    os.execv(str(python), [str(python), "-m", module(), *sys.argv[1:]])
